"""sd-scripts' family-specific entry scripts (sdxl_train_network.py, flux_train.py, train_db.py, ...,
the names the kohya_ss GUI runs): the model must be of a family whose ``sd_scripts`` name the
script, as sd-scripts' script can load no other; one line otherwise, before any weight loads.

    check(entry, source)    # entry: "sdxl_train_network.py"; source: pretrained_model_name_or_path

The family is read without loading weights: a flow family's name, keys or config
(flow_family.family_before_loading), a built-in model, a diffusers folder's configuration, an SD
single file's tensor names (a pickled .ckpt the loader reads with allow_pickle is not told before it
loads). A Hugging Face Hub id is known only once it downloads: not checked.
"""
from __future__ import annotations

from library import safetensors_file
from library.errors import ModelError, UserError
from library.models import flow_family, loading, sd_checkpoint
from library.models.families import registry


class ScriptFamilyError(UserError, ValueError):
    """A family-specific entry script given a model of another family."""


class _Shape:  # what sd_checkpoint.detect_family reads of a tensor
    def __init__(self, shape):
        self.shape = tuple(shape)


def _single_file_family(path: str) -> str | None:
    if path.endswith(".safetensors"):
        try:
            _, header = safetensors_file.read_header(path)
        except (OSError, ValueError) as e:
            raise ModelError(f"pretrained_model_name_or_path: {path}: not a readable safetensors file ({e})") from None
        shapes = {k: _Shape(v["shape"]) for k, v in header.items() if k != "__metadata__"}
        return sd_checkpoint.detect_family(shapes, path)
    import torch  # lazy: --help and the option errors must not import torch

    try:  # memory-mapped: the tensors are not read
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - not a plain tensor file: the loader says why when it reads it
        return None
    while isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    return sd_checkpoint.detect_family(sd, path) if isinstance(sd, dict) else None


def model_family(source: str) -> str | None:
    """The family of ``source`` without loading its weights; None for a Hub id."""
    fam = flow_family.family_before_loading(source)
    if fam is not None:
        return fam
    src = loading.resolve_model_source(source)
    if src.kind == "single_file":
        return _single_file_family(src.location)
    return loading.configured_family(source)


def families_of(entry: str) -> list[str]:
    """The families whose ``sd_scripts`` name ``entry``."""
    return [f.name for f in registry.FAMILIES.values() if entry in f.sd_scripts]


def check(entry: str, source: str | None) -> None:
    allowed = families_of(entry)
    assert allowed, f"{entry}: no family names it in sd_scripts"
    fam = model_family(source) if source else None
    if fam is None or fam in allowed:
        return
    titles = " / ".join(registry.get(f).title for f in allowed)
    raise ScriptFamilyError(f"{entry} trains {titles} models; the model {source} is of the {registry.get(fam).title} family "
                            f"(train it with {_scripts_for(fam, entry)})")


def _scripts_for(fam: str, entry: str) -> str:
    """The same kind of script for ``fam`` (a LoRA script for a LoRA script), else its scripts."""
    own = registry.get(fam).sd_scripts
    kind = [s for s in own if s.endswith("_network.py") == entry.endswith("_network.py")]
    return " or ".join(kind or own) or "train_lora.py"
