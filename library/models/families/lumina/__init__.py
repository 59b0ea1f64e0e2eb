"""Lumina Image 2.0: the Next-DiT transformer over the latents of FLUX.1's 16-channel autoencoder,
Gemma-2 2B's penultimate states behind sd-scripts' system prompt, rectified flow with Lumina's time
running opposite to sigma; lumina_train.py / lumina_train_network.py.
Model code: this folder (nextdit.py the transformer, layout.py its file layouts, text.py Gemma-2 and
the system prompt, loading.py the sources and checks, tiny.py tiny-lumina, attention.py the kernels,
home.py the hooks: detection, checks, bundle, family model, save); its network:
networks/lora_lumina.py."""
from __future__ import annotations

from library.models.families import anima
from library.models.families.base import FIXED_SHIFT, TIMESTEP_SAMPLING, Family, FlowSpec

_POS_EMB = "SD3's position-embedding table; Lumina 2 has rotary positions"
_TE_DROPOUT = "SD3's text-encoder dropout (sd-scripts has none for Lumina 2)"
_NOT_T5 = "Lumina 2's only text encoder is Gemma-2 (the gemma2 option); it has no {}"
# the options only Lumina 2 reads (library/config/options.py); FLUX.1 (so Chroma) and SD3 refuse
# them with this reason (their ``unsupported`` tables spread REFUSED_ELSEWHERE)
OWN_OPTIONS = ("gemma2", "gemma2_max_token_length", "system_prompt", "use_flash_attn", "use_sage_attn",
               "sample_batch_size")
REFUSED_ELSEWHERE = {name: "a Lumina 2 option (sd-scripts' lumina scripts)" for name in OWN_OPTIONS}

FLOW = FlowSpec(
    # the family model hands the transformer 1 - sigma (Lumina's t) and negates its velocity, so the
    # shared losses and sampler see FLUX's convention (timestep sigma, velocity noise - x0)
    timestep_scale=1.0,
    training_draw=TIMESTEP_SAMPLING, input_perturbation=True,  # lumina_train_util reads ip_noise_gamma
    sample_schedule=FIXED_SHIFT, sample_shift=6.0,  # its samples: FlowMatchEulerDiscreteScheduler(shift=6.0)
    sample_steps=36, sample_scale=3.5, sample_guidance=None,  # lumina_train_util's prompt defaults
    size_multiple=16, packed_noise=False, t5_component="text_encoder",
    metadata_options=("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "guidance_scale",
                      "timestep_sampling", "sigmoid_scale", "model_prediction_type", "discrete_flow_shift"),
    # lumina_train_util's defaults where they differ from FLUX.1's
    weights_raw_loss=False,  # lumina_train_util weights the prediction as FLUX.1's
    option_defaults=(("timestep_sampling", "shift"), ("discrete_flow_shift", 6.0),
                     ("model_prediction_type", "raw")),
    sample_cfg_trunc_ratio=0.25, sample_renorm_cfg=1.0,  # lumina_train_util's prompt defaults (ctr, rcfg)
)

FAMILY = Family(
    name="lumina", title="Lumina 2", flow=FLOW,
    text_encoder_components=("text_encoder",), text_encoder_names=("Gemma-2",),
    partial_cache=False, size_conditioning=False, pipelines=None,
    v2_metadata=False, block_lr=False, token_padding_option=False, rate_implies_text_encoder=False,
    # sd-scripts' lumina_train.py trains the transformer alone
    full_trains_text_encoders=False, separate_t5_rate=False, saves_text_encoders=False,
    autoencoder_option="ae", single_file_parts=("gemma2", "ae"), linear_projections=False,
    lora_module="networks.lora_lumina", network_modules=("networks.lora_lumina",),
    # the kohya_ss GUI's Lumina box (its LoRA and fine-tune tabs; train_model picks its script last,
    # after Anima's)
    model_type=None, gui_boxes=("lumina_checkbox",), gui_rank=5, gui_script="lumina_train.py", gui_te_rates=(),
    gui_db_text_encoder=False,
    unsupported={
        "vae": "Lumina 2's autoencoder (FLUX.1's) is the ae option (sd-scripts' lumina scripts read ae)",
        "clip_l": _NOT_T5.format("CLIP-L"), "clip_g": _NOT_T5.format("CLIP-G"),
        "t5xxl": _NOT_T5.format("T5-XXL"), "t5xxl_max_token_length": _NOT_T5.format("T5-XXL"),
        "apply_t5_attn_mask": _NOT_T5.format("T5-XXL (its Gemma-2 mask always applies)"),
        "apply_lg_attn_mask": _NOT_T5.format("CLIP masks"),
        "guidance_scale": "FLUX.1 dev's guidance input; Lumina 2 has none (samples use CFG)",
        "training_shift": "SD3's shift; Lumina 2 shifts with discrete_flow_shift",
        "num_last_block_to_freeze": "sd-scripts' sd3_train.py option",
        **{name: _TE_DROPOUT for name in ("clip_l_dropout_rate", "clip_g_dropout_rate", "t5_dropout_rate")},
        "train_t5xxl": _NOT_T5.format("T5-XXL"), "learning_rate_te3": _NOT_T5.format("third text encoder"),
        "use_t5xxl_cache_only": _NOT_T5.format("T5-XXL"),
        **{name: _POS_EMB for name in ("pos_emb_random_crop_rate", "enable_scaled_pos_embed")},
        **{name: "FLUX.1's block-swap split; Lumina 2 has one stack of blocks"
           for name in ("split_mode", "double_blocks_to_swap", "single_blocks_to_swap")},
        **anima.REFUSED_ELSEWHERE,
    },
    no_effect={
        "train_text_encoder": "sd-scripts' lumina_train.py trains the transformer alone (Gemma-2 stays frozen)",
        "min_timestep": "Lumina 2 draws its noise level by timestep_sampling (sd-scripts ignores the bounds)",
        "max_timestep": "Lumina 2 draws its noise level by timestep_sampling (sd-scripts ignores the bounds)",
    },
    native_size=1024, tiny_models=("tiny-lumina",), arch_models=(),
    home="library.models.families.lumina.home",
    sd_scripts=("lumina_train_network.py", "lumina_train.py"),
)
