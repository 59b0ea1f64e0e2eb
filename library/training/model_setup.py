"""The set-up stage's model part, one path for the trainer and the memory estimate.

    set_up_method(opts, method_name, method, bundle, placer) -> MethodSetUp

The trainer (library/run/stages.py ``Run.setup_method``) runs it on the loaded model, the memory
estimate (library/training/memory_estimate.py) on the same model built on fake tensors: the
dtype of every part (``placement.dtype_placement``), the model's parts stored in them before the
method picks its parameters (so that a network hooks the fp8 forward), the method's set-up (its
parameter groups), then the network stored in its dtype. What differs is only how a module is
stored (``Placer``): the trainer's ``placement.place`` on the device (or, with
``blocks_to_swap``, the swapped blocks kept on the host), the estimate's new fake parameters in
the same dtypes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from library.models import placement

if TYPE_CHECKING:  # annotations only
    import torch

    from library.config.parse import Options
    from library.models.placement import Placement
    from library.training.methods import Method


class ModelParts(Protocol):
    """What the set-up stores of a model (a loaded ModelBundle, or the estimate's fake one)."""

    @property
    def unet(self) -> torch.nn.Module: ...

    @property
    def text_encoders(self) -> list: ...


class Placer(Protocol):
    """How a module is stored in a dtype (``compute``: the dtype fp8 parts compute in); returns
    {id(old parameter): new parameter} for parameters it replaced (the trainer's keep theirs)."""

    def unet(self, module: torch.nn.Module, storage: torch.dtype,
             compute: torch.dtype) -> dict[int, torch.nn.Parameter]: ...

    def module(self, module: torch.nn.Module, storage: torch.dtype,
               compute: torch.dtype) -> dict[int, torch.nn.Parameter]: ...


@dataclass(frozen=True, slots=True)
class MethodSetUp:
    """What the model part of the set-up makes: the dtypes of the parts and the method's
    parameter groups (over the parameters as placed)."""

    placement: Placement
    groups: list[dict]


def set_up_method(opts: Options, method_name: str, method: Method, bundle: ModelParts,
                  placer: Placer) -> MethodSetUp:
    """Store the U-Net (or transformer) and text encoders of ``bundle`` in the run's dtypes, set
    ``method`` up over them, then store its network (if any) in its dtype."""
    # The dtypes of every part (library/models/placement.py): the trained weights float32, or
    # with full_bf16 / full_fp16 bf16 / fp16 (the stepper updates them in float32 and rounds
    # back); the frozen parts the mixed-precision dtype, or with fp8_base / fp8_base_unet float8.
    # Placed before the network hooks the modules, so its hooks call the fp8 forward; after the
    # load (and any merge of base weights into it).
    pl = placement.dtype_placement(opts, method_name, method.train_text_encoder,
                                   len(bundle.text_encoders))
    placer.unet(bundle.unet, pl.unet, pl.compute)
    for te, te_dtype in zip(bundle.text_encoders, pl.text_encoders):
        placer.module(te, te_dtype, pl.compute)
    groups = method.setup()
    if method.network is not None and pl.network is not None:
        new = placer.module(method.network, pl.network, pl.network)
        if new:  # parameters replaced (fake tensors): the groups point at the new ones
            groups = [{**g, "params": [new.get(id(p), p) for p in g["params"]]} for g in groups]
    return MethodSetUp(placement=pl, groups=groups)
