"""The hooks (base.HOOKS) the SD families share; each family's home (sd1/home.py, sd2/home.py,
sdxl/home.py) takes these and adds its metadata strings and built-in names.

Where the contract differs from the flow homes' (docs/FAMILIES.md "The hooks a home provides"):

- ``claims(path)`` is False for every path. Detection before loading asks the flow homes; a source
  none of them claims is an SD model, and the SD loader (library/models/loading.py) tells SD1,
  SD2 and SDXL apart while it loads (from the keys of a single file, the configs of a diffusers
  folder). ``load`` of any SD home loads any of the three.
- The memory hooks raise ``fake_parts.Unavailable``: the DDPM families' estimate is
  library/training/memory_estimate.py's U-Net path (the components from the source's diffusers
  configs or the shipped ones, the family read from them), not the flow homes' transformer inputs.
- ``metadata_fields(variant, adapter)``: a DDPM model has no variant of its own; ``variant`` is the
  run's prediction type, "epsilon" or "v" (v_parameterization).

tests/models/test_families.py checks every hook of every home, and these three differences.
"""
from __future__ import annotations

from library.models import family, fake_parts, loading, modelspec, sd_checkpoint

__all__ = ["claims", "load", "family_model", "save_full", "memory_parts", "memory_family_model",
           "memory_conditioning", "memory_text_tokens", "memory_text_entry_bytes"]  # what every SD home takes

PREDICTIONS = ("epsilon", "v")
# the file suffixes a full save's path carries for a single file (save_model_as safetensors /
# ckpt); without one (diffusers, diffusers_safetensors) the save is a diffusers folder
SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt")
_NO_ESTIMATE = ("the SD families' memory estimate is library/training/memory_estimate.py's U-Net "
                "path, not the flow families' hooks")


def builtin_names(family_name: str) -> tuple[str, ...]:
    """The built-in names of one SD family, from the SD loader's tables."""
    return tuple(n for table in (loading.TINY_BUILTINS, loading.ARCH_BUILTINS) for n, arch in table.items()
                 if loading.FAMILY_OF_ARCH[arch] == family_name)


def claims(path: str) -> bool:
    """Never: what no flow home claims loads through the SD loader (see above)."""
    return False


def load(opts) -> loading.ModelBundle:
    return loading.load_from_options(opts)


def family_model(bundle, opts, rewrite=None) -> family.FamilyModel:
    return family.family_model_for(bundle, max_token_length=opts.max_token_length,
                                   weighted=opts.weighted_captions, rewrite=rewrite)


def save_full(bundle, path: str, dtype, metadata: dict, trained_encoders: tuple[str, ...] = ()) -> None:
    """The whole model: one file in the original layout with ``metadata`` (a path ending in
    SINGLE_FILE_SUFFIXES), else a diffusers folder; every text encoder is saved, trained or not."""
    comps = bundle.components()
    if path.endswith(SINGLE_FILE_SUFFIXES):
        sd_checkpoint.save_single_file(comps, bundle.family, path, dtype=dtype, metadata=metadata)
    else:
        sd_checkpoint.save_diffusers(comps, bundle.family, path, dtype=dtype)


def metadata_hook(base_model_version: str, architectures: dict[str, str], implementation: str):
    """An SD family's ``metadata_fields(variant, adapter)`` hook from its strings (sd-scripts'
    sai_model_spec): ss_base_model_version and modelspec architecture (``architectures``: by
    prediction type) / implementation / prediction_type; ``variant`` is the prediction type."""
    def metadata_fields(variant: str, adapter: str | None) -> dict[str, str]:
        if variant not in PREDICTIONS:
            raise ValueError(f"prediction type {variant!r}; expected {' or '.join(PREDICTIONS)}")
        return {"ss_base_model_version": base_model_version,
                "modelspec.architecture": modelspec.with_adapter(architectures[variant], adapter),
                "modelspec.implementation": implementation, "modelspec.prediction_type": variant}
    return metadata_fields


def memory_parts(opts, header) -> dict:
    raise fake_parts.Unavailable(_NO_ESTIMATE)


def memory_family_model(opts, comps: dict, text_encoders: list):
    raise fake_parts.Unavailable(_NO_ESTIMATE)


def memory_conditioning(opts, comps: dict, batch: int, dtype):
    raise fake_parts.Unavailable(_NO_ESTIMATE)


def memory_text_tokens(opts, comps: dict) -> tuple[int, int, int]:
    raise fake_parts.Unavailable(_NO_ESTIMATE)


def memory_text_entry_bytes(opts, comps: dict, text_dtype_bytes: int, partial: bool) -> int:
    raise fake_parts.Unavailable(_NO_ESTIMATE)
