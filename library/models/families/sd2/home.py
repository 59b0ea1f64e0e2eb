"""SD2's hooks (base.HOOKS): the SD families' shared ones (library/models/families/sd_common/hooks.py,
where their contract differs from the flow homes'), its metadata strings and built-in names."""
from __future__ import annotations

from library.models.families.sd_common import hooks
from library.models.families.sd_common.hooks import *  # noqa: F403 - the hooks every SD home shares
from library.models.modelspec import IMPL_DIFFUSERS

BUILTIN_NAMES = hooks.builtin_names("sd2")
metadata_fields = hooks.metadata_hook(
    "sd_v2", {"epsilon": "stable-diffusion-v2-512", "v": "stable-diffusion-v2-768-v"}, IMPL_DIFFUSERS)
