"""SDXL: two CLIP text encoders (CLIP-L, OpenCLIP-bigG: its pooled output), the U-Net's size
conditioning, sdxl_train.py's block_lr, diffusers' StableDiffusionXLPipeline for samples.
Hooks: home.py over library/models/families/sd_common/hooks.py; model code: library/models/family.py
(SDXLModel), loading.py, sd_checkpoint.py (SAI layout), unet_layout.py, families/sd_common/tiny_models.py."""
from __future__ import annotations

from library.models.families import sd1
from library.models.families.base import Family

FAMILY = Family(
    name="sdxl", title="SDXL", flow=None,
    text_encoder_components=("text_encoder", "text_encoder_2"), text_encoder_names=("CLIP-L", "CLIP-G"),
    partial_cache=False, size_conditioning=True,
    pipelines=("StableDiffusionXLPipeline", "StableDiffusionXLInpaintPipeline",
               "StableDiffusionXLImg2ImgPipeline"),
    v2_metadata=False, block_lr=True, token_padding_option=False, rate_implies_text_encoder=False,
    full_trains_text_encoders=True,
    separate_t5_rate=False, saves_text_encoders=True,
    autoencoder_option="vae", single_file_parts=(), linear_projections=True,
    lora_module="networks.lora", network_modules=sd1.SD_NETWORK_MODULES,
    model_type=None, gui_boxes=("sdxl", "sdxl_checkbox"), gui_rank=0, gui_script="sdxl_train.py",
    gui_te_rates=("learning_rate_te1", "learning_rate_te2"), gui_db_text_encoder=True,
    unsupported={}, no_effect={}, native_size=1024, tiny_models=("tiny-sdxl", "tiny-sdxl-inpaint"), arch_models=("sdxl-arch",),
    home="library.models.families.sdxl.home",
    sd_scripts=("sdxl_train_network.py", "sdxl_train.py", "sdxl_train_textual_inversion.py"),
)
