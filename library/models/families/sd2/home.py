"""SD2's hooks (base.HOOKS): the SD families' shared ones (library/models/families/sd_common/hooks.py,
where their contract differs from the flow homes') and SD2's metadata strings and built-in names."""
from __future__ import annotations

from library.models.families.sd_common import hooks
from library.models.families.sd_common.hooks import (claims, family_model, load, memory_conditioning,  # noqa: F401
                                                     memory_family_model, memory_parts, memory_text_entry_bytes,
                                                     memory_text_tokens, save_full)
from library.models.modelspec import IMPL_DIFFUSERS

BUILTIN_NAMES = hooks.builtin_names("sd2")

# SAI modelspec architecture per prediction type (sd-scripts: 768-v for v_parameterization)
SD2_ARCH = {"epsilon": "stable-diffusion-v2-512", "v": "stable-diffusion-v2-768-v"}


def metadata_fields(variant: str, adapter: str | None) -> dict[str, str]:
    """sd-scripts' values; ``variant``: the prediction type ("epsilon" / "v")."""
    return hooks.fields("sd_v2", SD2_ARCH[variant], IMPL_DIFFUSERS, variant, adapter)
