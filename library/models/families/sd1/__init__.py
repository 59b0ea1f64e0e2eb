"""SD1.x (Stable Diffusion 1.4 / 1.5 and their fine-tunes): one CLIP text encoder, the DDPM
schedule with epsilon prediction, diffusers' StableDiffusionPipeline for samples.
Hooks: home.py over library/models/families/sd_common/hooks.py; model code: library/models/family.py
(SD1Model), loading.py, sd_checkpoint.py, families/sd_common/tiny_models.py."""
from __future__ import annotations

from library.models.families.base import Family

SD_NETWORK_MODULES = ("networks.lora", "networks.loha", "networks.lokr", "networks.dylora", "networks.lora_fa",
                      "networks.oft", "networks.oft_v2", "networks.boft")  # sd-scripts' network modules of the SD U-Nets' block classes

FAMILY = Family(
    name="sd1", title="SD1", flow=None,
    text_encoder_components=("text_encoder",), text_encoder_names=("CLIP-L",), partial_cache=False,
    size_conditioning=False,
    pipelines=("StableDiffusionPipeline", "StableDiffusionInpaintPipeline", "StableDiffusionImg2ImgPipeline"),
    v2_metadata=False, block_lr=False, token_padding_option=True, rate_implies_text_encoder=True,
    full_trains_text_encoders=True, separate_t5_rate=False, saves_text_encoders=True,
    autoencoder_option="vae", single_file_parts=(), linear_projections=False,
    lora_module="networks.lora", network_modules=SD_NETWORK_MODULES,
    model_type=None, gui_boxes=(), gui_rank=9, gui_script="train_db.py", gui_te_rates=("learning_rate_te",), gui_db_text_encoder=False,
    unsupported={}, no_effect={}, native_size=512, tiny_models=("tiny-sd15", "tiny-sd15-inpaint"), arch_models=("sd15-arch",),
    home="library.models.families.sd1.home",
    sd_scripts=("train_network.py", "train_db.py", "fine_tune.py"),
)
