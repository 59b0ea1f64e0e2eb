"""Dtype placement: the dtype each part of a run's model is stored in, decided in one place.

The trainer (``Run.setup_method``) casts the real model with ``place``; the memory estimate
(``library/training/memory_estimate.py``) casts its fake model with the same ``tensor_dtypes`` targets,
so the two cannot disagree.

- trained parts (full fine-tune): ``trained_precision`` (float32, or full_bf16 / full_fp16);
- frozen parts (a network run's U-Net and text encoders): the mixed-precision dtype, or with
  ``fp8_base`` (U-Net and text encoders) / ``fp8_base_unet`` (U-Net only) float8_e4m3fn for the
  weights of their Linear/Conv2d modules and the mixed-precision dtype for the rest
  (library/models/fp8.py);
- the network: ``trained_precision``.

The VAE's dtype is ``latent_cache.vae_dtype`` (set at load, before latents are cached).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from library.config import method_kinds
from library.errors import UserError
from library.models import fp8

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options


class Fp8OptionError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class Placement:
    compute: torch.dtype                    # the mixed-precision dtype (float32 without it)
    unet: torch.dtype                       # fp8.FP8: Linear/Conv2d weights fp8, the rest compute
    text_encoders: tuple                    # one dtype per text encoder, same convention
    network: torch.dtype | None             # the trained network (None: no network)

    def input_dtype(self, storage: torch.dtype) -> torch.dtype:
        """The dtype a part stored as ``storage`` takes its inputs in."""
        return self.compute if storage == fp8.FP8 else storage


# the sd-scripts full-training scripts of a family that accept fp8_base and never read it
FULL_TRAINING_SCRIPTS = {None: "train_db, fine_tune and sdxl_train", "flux": "flux_train.py",
                         "sd3": "sd3_train.py"}


def check_options(opts: Options, family: str | None = None) -> None:
    """fp8_base / fp8_base_unet combinations, before any weight is loaded (sd-scripts' rule:
    fp8 needs a mixed-precision compute dtype); ``family``: "flux" / "sd3" for a FLUX.1 / SD3
    model, None for an SD one (the warning names that family's sd-scripts scripts)."""
    if not (opts.fp8_base or opts.fp8_base_unet):
        return
    name = "fp8_base_unet" if opts.fp8_base_unet and not opts.fp8_base else "fp8_base"
    if opts.script != "train_lora":
        # sd-scripts' train_db / fine_tune / sdxl_train (flux_train.py / sd3_train.py) define the
        # flag and never read it: the trained model is not stored in fp8 (dtype_placement ignores
        # it for full training)
        logging.getLogger("sdtk").warning(
            "option %s has no effect in %s (fp8 base weights are for network training; "
            "sd-scripts' %s ignore%s it too)", name, opts.script, FULL_TRAINING_SCRIPTS.get(family, FULL_TRAINING_SCRIPTS[None]),
            "" if family is None else "s")
        return
    if opts.mixed_precision not in ("bf16", "fp16"):
        raise Fp8OptionError(f"{name} needs mixed_precision bf16 or fp16 (the fp8 weights compute in "
                             f"it), not {opts.mixed_precision!r}")
    bypass = str((opts.network_args or {}).get("bypass_mode", "")).lower() in ("true", "1")
    if opts.network_module.split(".")[0] == "lycoris" and not bypass:
        # LyCORIS' default forward adds its delta to the base layer's weight and computes with
        # that (an fp8 weight: "mul_cpu_reduced_float not implemented"); its bypass mode calls
        # the layer's forward, which computes the fp8 weight in the compute dtype.
        raise Fp8OptionError(f"{name} with {opts.network_module} needs network_args bypass_mode=True "
                             "(its default forward computes with the fp8 base weight itself)")


def compute_dtype(mixed_precision: str):
    """The torch dtype of a mixed_precision setting ("no" -> float32)."""
    return {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[mixed_precision]


def trained_precision(opts: Options) -> str:
    """The dtype of the trained weights: "bfloat16" (full_bf16), "float16" (full_fp16) or
    "float32"."""
    if opts.full_bf16:
        return "bfloat16"
    if opts.full_fp16:
        return "float16"
    return "float32"


def dtype_placement(opts: Options, method_name: str, train_text_encoder: bool, n_text_encoders: int) -> Placement:
    """The dtypes of this run's U-Net, text encoders and network."""
    compute = compute_dtype(opts.mixed_precision)
    trained = getattr(torch, trained_precision(opts))
    kind = method_kinds.get(method_name)
    if kind.trains_embeddings:  # only the new rows train (their own tensor, `trained`)
        return Placement(compute, compute, (compute,) * n_text_encoders, trained)
    if not kind.trains_network:  # full training: fp8 is a train_lora option (config.py rejects it)
        return Placement(compute, trained, (trained if train_text_encoder else compute,) * n_text_encoders,
                         None)
    fp8_unet = bool(opts.fp8_base or opts.fp8_base_unet)
    fp8_te = bool(opts.fp8_base and not opts.fp8_base_unet)  # sd-scripts: fp8_base_unet wins
    return Placement(compute, fp8.FP8 if fp8_unet else compute,
                     (fp8.FP8 if fp8_te else compute,) * n_text_encoders, trained)


def tensor_dtypes(module: torch.nn.Module, storage: torch.dtype, compute: torch.dtype):
    """(owner module, "_parameters" or "_buffers", name, target dtype) for every floating tensor
    of ``module`` when it is stored as ``storage`` (fp8.FP8: eligible weights fp8, the rest
    ``compute``)."""
    for m in module.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(m, kind).items():
                if t is None or not t.is_floating_point():
                    continue
                if storage != fp8.FP8:
                    yield m, kind, name, storage
                elif kind == "_parameters" and name == "weight" and fp8.eligible(m):
                    yield m, kind, name, fp8.FP8
                else:
                    yield m, kind, name, compute


def place(module: torch.nn.Module, storage: torch.dtype, compute: torch.dtype, device) -> None:
    """Store ``module`` on ``device`` as ``storage``: each tensor cast straight from its loaded
    dtype (a float32 weight is rounded to fp8 once, not through bf16), one at a time, keeping
    the Parameter objects; fp8 modules get their up-casting forward (library/models/fp8.py)."""
    if storage != fp8.FP8:
        module.to(device, dtype=storage)
        return
    done = set()
    with torch.no_grad():
        for m, kind, name, dtype in list(tensor_dtypes(module, storage, compute)):
            t = getattr(m, kind)[name]
            if id(t) in done:  # tied
                continue
            done.add(id(t))
            if kind == "_parameters":
                t.data = t.data.to(device, dtype)
            else:
                m._buffers[name] = t.to(device, dtype)
    module.to(device)  # the integer buffers (position ids)
    fp8.install_forward(module, compute)


def parse_device(value: str | None, option: str = "--device") -> torch.device:
    """A tool's device flag (None or empty: the CPU); one line naming ``option`` for a name torch
    does not know or a device this machine lacks."""
    if not value:
        return torch.device("cpu")
    try:
        device = torch.device(value)
    except RuntimeError:
        raise UserError(f"{option} {value!r}: not a torch device (cpu, cuda, cuda:0, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{option} {value}: CUDA is not available on this machine")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"{option} {value}: MPS is not available on this machine")
    return device
