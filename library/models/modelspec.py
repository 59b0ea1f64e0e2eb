"""What SAI's ``modelspec.*`` and sd-scripts' ``ss_base_model_version`` metadata call each model
family (used by library/outputs/metadata.py for a run's files and by the LoRA tools)."""
from __future__ import annotations

ARCH = {"sd1": "stable-diffusion-v1", "sdxl": "stable-diffusion-xl-v1-base"}
BASE_MODEL_VERSION = {"sd1": "sd_v1", "sd2": "sd_v2", "sdxl": "sdxl_base_v1-0"}
IMPL_STABILITY_AI = "https://github.com/Stability-AI/generative-models"
IMPL_DIFFUSERS = "diffusers"


def modelspec_architecture(family: str, v_parameterization: bool, adapter: str | None) -> str:
    if family == "sd2":
        arch = "stable-diffusion-v2-768-v" if v_parameterization else "stable-diffusion-v2-512"
    else:
        arch = ARCH[family]
    return f"{arch}/{adapter}" if adapter else arch
