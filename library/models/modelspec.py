"""What SAI's ``modelspec.*`` metadata shares across the families (used by the families' homes,
whose ``metadata_fields`` hold each family's own ``ss_base_model_version`` and architecture
strings, and by the LoRA tools): sd-scripts' implementation URLs and the adapter suffix."""
from __future__ import annotations

IMPL_STABILITY_AI = "https://github.com/Stability-AI/generative-models"
IMPL_DIFFUSERS = "diffusers"


def with_adapter(architecture: str, adapter: str | None) -> str:
    """modelspec.architecture of an adapter's file: the base architecture "/<adapter>" (sd-scripts)."""
    return f"{architecture}/{adapter}" if adapter else architecture
