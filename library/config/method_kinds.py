"""The training methods, each declared once with what it trains (issue 38 item 2): shared code
asks these capabilities (``method_kinds.get(method_name).trains_network``, ...), never compares a
method's name. The method objects that train are library/training/methods.py's (``METHODS``) and
LECO's run (library/run/leco.py); the scripts that select them are options.py's
``METHOD_OF_SCRIPT`` and ``train_leco``. No torch import (the option checks read it).

train_inpainting is not a method of its own: it is an option of these methods (an inpainting
base for the adapters, a widened U-Net for the full ones; library/models/inpainting.py).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MethodKind:
    name: str                 # the method's name (METHOD_OF_SCRIPT's values, "leco")
    title: str                # how messages name it
    trains_network: bool      # a network module's adapter (network_module, network_args); a LoRA save
    trains_model: bool        # the model's own weights (a full-model save)
    trains_embeddings: bool   # new token embeddings alone (textual inversion)
    flow_families: bool       # trains the rectified-flow families (FLUX.1, SD3)
    memory_estimate: str | None  # why the memory estimate does not model it (None: it does)


# Textual inversion trains a few embedding rows but keeps every frozen activation of the text
# encoders for their backward: a profile the estimate's fitted constants were not measured on.
_TI_NOT_MODELED = "textual inversion is not modeled (the text encoders' activations are kept for its backward)"

KINDS: dict[str, MethodKind] = {k.name: k for k in (
    MethodKind("lora", "LoRA", trains_network=True, trains_model=False, trains_embeddings=False,
               flow_families=True, memory_estimate=None),
    MethodKind("dreambooth", "DreamBooth", trains_network=False, trains_model=True, trains_embeddings=False,
               flow_families=True, memory_estimate=None),
    MethodKind("finetune", "fine-tune", trains_network=False, trains_model=True, trains_embeddings=False,
               flow_families=True, memory_estimate=None),
    MethodKind("textual_inversion", "textual inversion", trains_network=False, trains_model=False,
               trains_embeddings=True, flow_families=False, memory_estimate=_TI_NOT_MODELED),
    MethodKind("leco", "LECO", trains_network=True, trains_model=False, trains_embeddings=False,
               flow_families=False, memory_estimate="LECO's prompt-driven steps are not modeled"),
)}


def get(name: str) -> MethodKind:
    if name not in KINDS:
        raise ValueError(f"unknown training method {name!r}; registered: {', '.join(KINDS)}")
    return KINDS[name]

