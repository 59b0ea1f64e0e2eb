"""FLUX.1 (dev, schnell): the BFL transformer over 2x2-packed latents of the 16-channel
autoencoder, CLIP-L's pooled output and T5-XXL's states, rectified flow with sd-scripts'
timestep_sampling, dev's distilled guidance input, flux_train.py / flux_train_network.py.
Model code: this folder (flux.py, flux_*.py, tiny_flux.py), library/models/flow_family.py, t5.py, clip_l_file.py;
its networks: networks/lora_flux.py, networks/oft_flux.py."""
from __future__ import annotations

from library.models.families import anima, lumina
from library.models.families.base import SEQUENCE_SHIFT, TIMESTEP_SAMPLING, Family, FlowSpec

_TE_DROPOUT = "SD3's text-encoder dropout (sd-scripts has none for FLUX.1)"
_POS_EMB = "SD3's position-embedding table; FLUX.1 has rotary positions"
_BOUNDS = "FLUX.1 draws its noise level by timestep_sampling (sd-scripts' FLUX.1 trainers ignore the timestep bounds)"

FLOW = FlowSpec(
    timestep_scale=1.0,  # the transformer takes sigma itself (sd-scripts: (1000 sigma) / 1000)
    training_draw=TIMESTEP_SAMPLING, input_perturbation=True,
    sample_schedule=SEQUENCE_SHIFT, sample_shift=None,
    sample_steps=20, sample_scale=1.0, sample_guidance=3.5,  # flux_train_utils' prompt defaults
    size_multiple=16, packed_noise=True, t5_component="text_encoder_2",
    metadata_options=("apply_t5_attn_mask", "weighting_scheme", "logit_mean", "logit_std", "mode_scale",
                      "guidance_scale", "timestep_sampling", "sigmoid_scale", "model_prediction_type",
                      "discrete_flow_shift"),
    weights_raw_loss=False, option_defaults=(),
    sample_cfg_trunc_ratio=None, sample_renorm_cfg=None,  # plain CFG at every step
)

FAMILY = Family(
    name="flux", title="FLUX.1", flow=FLOW,
    text_encoder_components=("text_encoder", "text_encoder_2"), text_encoder_names=("CLIP-L", "T5-XXL"),
    partial_cache=True, size_conditioning=False, pipelines=None,
    v2_metadata=False, block_lr=False, token_padding_option=False, rate_implies_text_encoder=False,
    # sd-scripts' flux_train.py has no train_text_encoder (a config's key is ignored there; the
    # GUI's fine-tune tab writes it true): FLUX.1's encoders stay frozen (no_effect below)
    full_trains_text_encoders=False, separate_t5_rate=False, saves_text_encoders=False,
    autoencoder_option="ae", single_file_parts=("clip_l", "t5xxl", "ae"), linear_projections=False,
    lora_module="networks.lora_flux", network_modules=("networks.lora_flux", "networks.oft_flux"),
    model_type="flux", gui_boxes=("flux1_checkbox",), gui_rank=2, gui_script="flux_train.py", gui_te_rates=(), gui_db_text_encoder=False,
    # what only SD3 honours (SD3's sampling is weighting_scheme with training_shift and the timestep
    # bounds; FLUX.1 has none)
    unsupported={
        "vae": "FLUX.1's 16-channel autoencoder is the ae option (sd-scripts' flux_train reads ae; SD3's "
               "scripts read vae)",
        "num_last_block_to_freeze": "sd-scripts' sd3_train.py option (SD3's joint blocks)",
        "apply_lg_attn_mask": "SD3's CLIP masks; FLUX.1 has apply_t5_attn_mask",
        "training_shift": "SD3's shift; FLUX.1 shifts with discrete_flow_shift",
        **{name: _TE_DROPOUT for name in ("clip_l_dropout_rate", "clip_g_dropout_rate", "t5_dropout_rate")},
        "train_t5xxl": "SD3's sd3_train.py option; a FLUX.1 LoRA takes train_t5xxl in network_args",
        "learning_rate_te3": "SD3's T5-XXL learning rate (sd-scripts' flux_train.py trains the transformer alone)",
        "use_t5xxl_cache_only": "SD3's sd3_train.py option (flux_train.py trains the transformer alone; a "
                                "FLUX.1 LoRA training CLIP-L caches T5's outputs alone)",
        **{name: _POS_EMB for name in ("pos_emb_random_crop_rate", "enable_scaled_pos_embed")},
        **anima.REFUSED_ELSEWHERE, **lumina.REFUSED_ELSEWHERE,
    },
    # the GUI writes max_timestep = 1000 for FLUX.1 too; sd-scripts' FLUX.1 trainers ignore the bounds
    no_effect={
        "train_text_encoder": "sd-scripts' flux_train.py trains the transformer alone (CLIP-L and T5 stay "
                              "frozen) and has no such option: a config's key is ignored there, and the "
                              "kohya_ss GUI's fine-tune tab writes it true",
        "min_timestep": _BOUNDS, "max_timestep": _BOUNDS,
    },
    native_size=1024, tiny_models=("tiny-flux", "tiny-flux-schnell"), arch_models=(),
    home="library.models.families.flux.home",
    sd_scripts=("flux_train_network.py", "flux_train.py"),
)
