"""What SAI's ``modelspec.*`` and sd-scripts' ``ss_base_model_version`` metadata call each model
family (used by library/outputs/metadata.py for a run's files and by the LoRA tools)."""
from __future__ import annotations

ARCH = {"sd1": "stable-diffusion-v1", "sdxl": "stable-diffusion-xl-v1-base", "flux": "flux-1-dev",
        "sd3": "stable-diffusion-3-medium"}
BASE_MODEL_VERSION = {"sd1": "sd_v1", "sd2": "sd_v2", "sdxl": "sdxl_base_v1-0", "flux": "flux1",
                      "sd3": "sd3"}
IMPL_STABILITY_AI = "https://github.com/Stability-AI/generative-models"
IMPL_DIFFUSERS = "diffusers"
IMPL = {"sdxl": IMPL_STABILITY_AI, "sd3": IMPL_STABILITY_AI,
        "flux": "https://github.com/black-forest-labs/flux"}  # sd-scripts; others: IMPL_DIFFUSERS


def modelspec_architecture(family: str, v_parameterization: bool, adapter: str | None) -> str:
    if family == "sd2":
        arch = "stable-diffusion-v2-768-v" if v_parameterization else "stable-diffusion-v2-512"
    else:
        arch = ARCH[family]
    return f"{arch}/{adapter}" if adapter else arch
