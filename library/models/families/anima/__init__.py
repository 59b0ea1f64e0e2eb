"""Anima: NVIDIA Cosmos-Predict2's MiniTrainDiT over the Qwen-Image VAE's 16-channel latents,
conditioned by Qwen3-0.6B's states mapped through the 6-layer LLM adapter into the T5-compatible
cross-attention space (T5's tokenizer feeds the adapter; no T5 model runs); rectified flow with
sd-scripts' timestep_sampling rule (the DiT takes sigma), CFG samples on a shifted linear schedule;
anima_train.py / anima_train_network.py.
Model code: this folder (model.py, weights.py, parts.py, family_model.py, tiny.py; home.py the hooks); its network:
networks/lora_anima.py (ComfyUI's layout: networks/convert_anima_lora_to_comfy.py)."""
from __future__ import annotations

from library.models.families.base import LINEAR_SHIFT, TIMESTEP_SAMPLING, Family, FlowSpec

_T5 = "FLUX.1 / SD3's T5-XXL; Anima runs no T5 (its LLM adapter reads T5 token ids: t5_tokenizer_path, " \
      "t5_max_token_length)"
_CLIP = "FLUX.1 / SD3's CLIP; Anima's text encoder is Qwen3 (the qwen3 option)"
_SD3 = "an SD3 option (sd-scripts' anima scripts do not define it)"
_SWAP = "block swapping is not built for Anima's DiT here (sd-scripts' blocks_to_swap)"
# the options only Anima reads (library/config/options.py); the other flow families refuse them
# with this reason (their ``unsupported`` tables spread REFUSED_ELSEWHERE)
PART_RATES = ("llm_adapter_lr", "self_attn_lr", "cross_attn_lr", "mlp_lr", "mod_lr")  # anima_train.py's
OWN_OPTIONS = ("qwen3", "llm_adapter_path", "t5_tokenizer_path", "qwen3_max_token_length", "t5_max_token_length",
               "attn_mode", "split_attn", "vae_chunk_size", "vae_disable_cache", *PART_RATES)
REFUSED_ELSEWHERE = {name: "an Anima option (sd-scripts' anima scripts)" for name in OWN_OPTIONS}
_BOUNDS = "Anima draws its noise level by timestep_sampling (sd-scripts' Anima trainer ignores the timestep bounds)"

FLOW = FlowSpec(
    timestep_scale=1.0,  # the DiT takes sigma (sd-scripts: timesteps / 1000)
    training_draw=TIMESTEP_SAMPLING,  # flux_train_utils.get_noisy_model_input_and_timesteps
    input_perturbation=True,          # the same function adds ip_noise_gamma
    sample_schedule=LINEAR_SHIFT, sample_shift=3.0,  # anima_train_utils.do_sample: flow_shift 3
    sample_steps=30, sample_scale=7.5, sample_guidance=None,  # _sample_image_inference's defaults
    size_multiple=16, packed_noise=False, t5_component="text_encoder",
    metadata_options=("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "timestep_sampling",
                      "sigmoid_scale", "discrete_flow_shift"),
    weights_raw_loss=True,  # compute_loss_weighting_for_anima weights the raw loss (sigma_sqrt, cosmap)
    # anima_train_utils' own defaults (FLUX.1's are sigma and 3); the prediction is the raw
    # velocity (sd-scripts' Anima trainer has no model_prediction_type)
    option_defaults=(("timestep_sampling", "sigmoid"), ("discrete_flow_shift", 1.0),
                     ("model_prediction_type", "raw")),
    sample_cfg_trunc_ratio=None, sample_renorm_cfg=None,  # plain CFG at every step
)

FAMILY = Family(
    name="anima", title="Anima", flow=FLOW,
    text_encoder_components=("text_encoder",), text_encoder_names=("Qwen3",),
    partial_cache=False, size_conditioning=False, pipelines=None,
    v2_metadata=False, block_lr=False, token_padding_option=False, rate_implies_text_encoder=False,
    # sd-scripts keeps Qwen3 frozen in both Anima scripts
    full_trains_text_encoders=False, separate_t5_rate=False, saves_text_encoders=False,
    autoencoder_option="vae", single_file_parts=("qwen3", "vae"), linear_projections=False,
    lora_module="networks.lora_anima", network_modules=("networks.lora_anima",),
    # the kohya_ss GUI's Anima box (its LoRA and fine-tune tabs; train_model picks its script after
    # SDXL's, FLUX.1's and SD3's, before Lumina's)
    model_type=None, gui_boxes=("anima_checkbox",), gui_rank=4, gui_script="anima_train.py", gui_te_rates=(),
    gui_db_text_encoder=False,
    unsupported={
        "apply_t5_attn_mask": _T5, "t5xxl": _T5, "t5xxl_max_token_length": _T5, "train_t5xxl": _T5,
        "learning_rate_te3": _T5, "use_t5xxl_cache_only": _T5, "t5_dropout_rate": _T5,
        "clip_l": _CLIP, "clip_g": _CLIP, "apply_lg_attn_mask": _CLIP,
        "clip_l_dropout_rate": _CLIP, "clip_g_dropout_rate": _CLIP,
        "ae": "Anima's autoencoder is the vae option (sd-scripts' anima scripts read vae)",
        "fp8_base": "sd-scripts' Anima trainer does not support an fp8 base (it turns fp8_base off)",
        "fp8_base_unet": "sd-scripts' Anima trainer does not support an fp8 base (it turns fp8_base off)",
        "guidance_scale": "FLUX.1 dev's guidance input; Anima has none (its samples use CFG: scale)",
        "model_prediction_type": "FLUX.1's option; sd-scripts' Anima trainer compares the raw velocity",
        "training_shift": _SD3, "pos_emb_random_crop_rate": _SD3, "enable_scaled_pos_embed": _SD3,
        "num_last_block_to_freeze": _SD3,
        "blocks_to_swap": _SWAP, "split_mode": _SWAP, "double_blocks_to_swap": _SWAP,
        "single_blocks_to_swap": _SWAP,
        "blockwise_fused_optimizers": "FLUX.1 / SD3's per-block optimizers (sd-scripts' anima_train.py has none)",
        "weighted_captions": "weights CLIP token states; Anima's Qwen3 prompts are not weighted (sd-scripts has "
                             "no weighted captions for Anima)",
    },
    no_effect={"min_timestep": _BOUNDS, "max_timestep": _BOUNDS,
               "train_text_encoder": "sd-scripts' Anima scripts keep Qwen3 frozen"},
    native_size=1024, tiny_models=("tiny-anima",), arch_models=(),
    home="library.models.families.anima.home",
    sd_scripts=("anima_train_network.py", "anima_train.py"),
)
