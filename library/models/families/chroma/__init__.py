"""Chroma (Chroma1-Base, Chroma1-HD): FLUX.1's transformer without CLIP-L and without the
guidance / vector inputs, its per-block modulations from the distilled-guidance approximator, over
FLUX.1's 16-channel autoencoder and T5-XXL with its attention mask; rectified flow with sd-scripts'
FLUX.1 rules (flux_train_network.py --model_type chroma), true CFG samples with a negative prompt.
Model code: model.py, checkpoint.py, sources.py, home.py (the hooks) in this folder, on
library/models/families/flux/flux.py's blocks; its network: networks/lora_flux.py (kohya's FLUX-style keys)."""
from __future__ import annotations

from library.models.families import flux
from library.models.families.base import SEQUENCE_SHIFT, TIMESTEP_SAMPLING, Family, FlowSpec

_NO_CLIP = "Chroma has no CLIP-L (sd-scripts' flux_train_network.py --model_type chroma does not load one)"

FLOW = FlowSpec(
    timestep_scale=1.0,  # the transformer takes sigma itself (x1000 inside its embeddings)
    training_draw=TIMESTEP_SAMPLING, input_perturbation=True,  # flux_train_network.py's FLUX.1 code path
    sample_schedule=SEQUENCE_SHIFT, sample_shift=None,  # flux_train_utils: get_schedule(shift=True) for Chroma too
    # sd-scripts' prompt defaults are FLUX.1's (scale 1.0: no CFG); its docs give Chroma a CFG
    # scale of about 4 with a negative prompt (train_network_advanced.md), and Chroma has no
    # distilled guidance input
    sample_steps=20, sample_scale=4.0, sample_guidance=None,
    size_multiple=16, packed_noise=True, t5_component="text_encoder",
    metadata_options=("apply_t5_attn_mask", "weighting_scheme", "logit_mean", "logit_std", "mode_scale",
                      "guidance_scale", "timestep_sampling", "sigmoid_scale", "model_prediction_type",
                      "discrete_flow_shift"),
    weights_raw_loss=False, option_defaults=(),
    sample_cfg_trunc_ratio=None, sample_renorm_cfg=None,  # plain CFG at every step
)

FAMILY = Family(
    name="chroma", title="Chroma", flow=FLOW,
    text_encoder_components=("text_encoder",), text_encoder_names=("T5-XXL",),  # diffusers' ChromaPipeline
    partial_cache=False, size_conditioning=False, pipelines=None,
    v2_metadata=False, block_lr=False, token_padding_option=False, rate_implies_text_encoder=False,
    full_trains_text_encoders=False, separate_t5_rate=False, saves_text_encoders=False,
    autoencoder_option="ae", single_file_parts=("t5xxl", "ae"), linear_projections=False,
    lora_module="networks.lora_flux", network_modules=("networks.lora_flux",),
    # the kohya_ss GUI: the flux1 box with its model_type "chroma" (LoRA only; its fine-tune tabs
    # run flux_train.py without model_type); ranked after FLUX.1, which the box means without it
    model_type="chroma", gui_boxes=("flux1_checkbox",), gui_rank=3, gui_script="flux_train.py", gui_te_rates=(),
    gui_db_text_encoder=False,
    unsupported={
        **{k: why for k, why in flux.FAMILY.unsupported.items() if k != "train_t5xxl"},
        "clip_l": _NO_CLIP,
        "train_t5xxl": "a LoRA on T5 (networks.lora_flux reads CLIP-L, then T5; Chroma has no CLIP-L)",
    },
    no_effect={
        **flux.FAMILY.no_effect,
        "guidance_scale": "Chroma's approximator takes guidance 0, as Chroma was trained and diffusers and ComfyUI "
                          "run it (sd-scripts requires guidance_scale = 0.0 for Chroma)",
    },
    native_size=1024, tiny_models=("tiny-chroma",), arch_models=(),
    home="library.models.families.chroma.home",
    sd_scripts=("flux_train_network.py",),
)
