"""SD3 / SD3.5 (medium, large): the MMDiT over 16-channel latents, CLIP-L and CLIP-G (pooled and
penultimate states) and an optional T5-XXL, rectified flow with training_shift and the timestep
bounds, CFG samples with shift 3; sd3_train.py / sd3_train_network.py.
Model code: this folder (sd3*.py; home.py holds SD3FamilyModel), library/models/flow_family.py, t5.py; its network:
networks/lora_sd3.py."""
from __future__ import annotations

from library.models.families import anima, lumina
from library.models.families.base import FIXED_SHIFT, SHIFTED_BOUNDED, Family, FlowSpec

_OLD_SWAP = "sd-scripts' deprecated FLUX.1 block-swap name; give blocks_to_swap"
_NO_PERTURBATION = ("sd-scripts' SD3 trainers add no input perturbation (sd3_train_utils draws the noisy input "
                    "from the plain noise)")

FLOW = FlowSpec(
    timestep_scale=1000.0,  # the MMDiT takes 1000 sigma
    training_draw=SHIFTED_BOUNDED, input_perturbation=False,
    sample_schedule=FIXED_SHIFT, sample_shift=3.0,  # sd-scripts' samples: ModelSamplingDiscreteFlow(shift=3.0)
    sample_steps=30, sample_scale=7.5, sample_guidance=None,  # sd3_train_utils' prompt defaults
    size_multiple=8, packed_noise=False, t5_component="text_encoder_3",
    metadata_options=("apply_lg_attn_mask", "apply_t5_attn_mask", "weighting_scheme", "logit_mean",
                      "logit_std", "mode_scale"),
    weights_raw_loss=False, option_defaults=(),
    sample_cfg_trunc_ratio=None, sample_renorm_cfg=None,  # plain CFG at every step
)

FAMILY = Family(
    name="sd3", title="SD3", flow=FLOW,
    text_encoder_components=("text_encoder", "text_encoder_2", "text_encoder_3"),
    text_encoder_names=("CLIP-L", "CLIP-G", "T5-XXL"),
    partial_cache=True, size_conditioning=False, pipelines=None,
    v2_metadata=False, block_lr=False, token_padding_option=False, rate_implies_text_encoder=False,
    full_trains_text_encoders=True, separate_t5_rate=True, saves_text_encoders=True,
    autoencoder_option="vae", single_file_parts=(), linear_projections=False,
    lora_module="networks.lora_sd3", network_modules=("networks.lora_sd3",),
    model_type=None, gui_boxes=("sd3_checkbox",), gui_rank=1, gui_script="sd3_train.py", gui_te_rates=(), gui_db_text_encoder=False,
    unsupported={"guidance_scale": "FLUX.1 dev's guidance input; SD3 has none",
                 **{name: _OLD_SWAP for name in ("split_mode", "double_blocks_to_swap", "single_blocks_to_swap")},
                 **anima.REFUSED_ELSEWHERE, **lumina.REFUSED_ELSEWHERE},
    no_effect={name: _NO_PERTURBATION for name in ("ip_noise_gamma", "ip_noise_gamma_random_strength")},
    native_size=1024, tiny_models=("tiny-sd3", "tiny-sd3.5-medium", "tiny-sd3.5-large"), arch_models=("sd3-arch", "sd3.5-medium-arch", "sd3.5-large-arch"),
    home="library.models.families.sd3.home",
    sd_scripts=("sd3_train_network.py", "sd3_train.py"),
)
