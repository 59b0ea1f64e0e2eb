"""What SAI's ``modelspec.*`` and sd-scripts' ``ss_base_model_version`` metadata call each model
family (used by library/outputs/metadata.py for a run's files and by the LoRA tools)."""
from __future__ import annotations

ARCH = {"sd1": "stable-diffusion-v1", "sdxl": "stable-diffusion-xl-v1-base", "flux": "flux-1-dev",
        "sd3": "stable-diffusion-3-medium", "lumina": "lumina-2"}
BASE_MODEL_VERSION = {"sd1": "sd_v1", "sd2": "sd_v2", "sdxl": "sdxl_base_v1-0", "flux": "flux1",
                      "sd3": "sd3", "lumina": "lumina2"}
IMPL_STABILITY_AI = "https://github.com/Stability-AI/generative-models"
IMPL_DIFFUSERS = "diffusers"
IMPL_FLUX = "https://github.com/black-forest-labs/flux"
IMPL_LUMINA = "https://github.com/Alpha-VLLM/Lumina-Image-2.0"
IMPL = {"sdxl": IMPL_STABILITY_AI, "sd3": IMPL_STABILITY_AI, "flux": IMPL_FLUX, "lumina": IMPL_LUMINA}  # sd-scripts; others: IMPL_DIFFUSERS
FLUX_ARCH = {"dev": "flux-1-dev", "schnell": "flux-1-schnell"}
# sd-scripts' SD3 model_type (sd3_utils.analyze_state_dict_state) per MMDiTConfig.variant: its
# ss_base_model_version and the suffix of modelspec.architecture "stable-diffusion-3-<type>"
SD3_MODEL_TYPE = {"sd3": "medium", "sd3.5-medium": "5-medium", "sd3.5-large": "5-large"}


def modelspec_architecture(family: str, v_parameterization: bool, adapter: str | None) -> str:
    if family == "sd2":
        arch = "stable-diffusion-v2-768-v" if v_parameterization else "stable-diffusion-v2-512"
    else:
        arch = ARCH[family]
    return f"{arch}/{adapter}" if adapter else arch


def flow_fields(family: str, variant: str, adapter: str | None) -> dict[str, str]:
    """ss_base_model_version and modelspec architecture / implementation / prediction_type of a
    FLUX.1 ("dev" / "schnell") or SD3 (MMDiTConfig.variant) file, as sd-scripts writes them
    (library/sai_model_spec.py): FLUX.1 has no prediction_type; an SD3 LoRA says "diffusers" and
    "epsilon" (its SD1 defaults), an SD3 checkpoint Stability AI's implementation."""
    if family == "lumina":  # one variant (sd-scripts' MODEL_VERSION_LUMINA_V2), no prediction_type
        return {"ss_base_model_version": "lumina2", "modelspec.implementation": IMPL_LUMINA,
                "modelspec.architecture": f"lumina-2/{adapter}" if adapter else "lumina-2"}
    table = FLUX_ARCH if family == "flux" else SD3_MODEL_TYPE
    if variant not in table:
        raise ValueError(f"{family} variant {variant!r}; expected {', '.join(table)}")
    if family == "flux":
        arch, out = FLUX_ARCH[variant], {"ss_base_model_version": "flux1", "modelspec.implementation": IMPL_FLUX}
    else:
        t = SD3_MODEL_TYPE[variant]
        arch = f"stable-diffusion-3-{t}"
        out = {"ss_base_model_version": t, "modelspec.prediction_type": "epsilon",
               "modelspec.implementation": IMPL_DIFFUSERS if adapter else IMPL_STABILITY_AI}
    out["modelspec.architecture"] = f"{arch}/{adapter}" if adapter else arch
    return out
