"""SD2.x (Stable Diffusion 2.0 / 2.1, 512 epsilon and 768 v-prediction): SD1's shape with the
OpenCLIP-H text encoder; ``v_parameterization`` comes from the model or the options.
Hooks: home.py over library/models/families/sd_common/hooks.py; model code: library/models/family.py
(SD1Model), loading.py, sd_checkpoint.py, families/sd_common/tiny_models.py."""
from __future__ import annotations

import dataclasses

from library.models.families import sd1

FAMILY = dataclasses.replace(
    sd1.FAMILY, name="sd2", title="SD2", text_encoder_names=("OpenCLIP-H",), v2_metadata=True, linear_projections=True,
    tiny_models=("tiny-sd2", "tiny-sd2-inpaint"), arch_models=("sd2-arch",),
    home="library.models.families.sd2.home",
)
