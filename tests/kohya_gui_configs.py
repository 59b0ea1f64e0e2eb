"""The run TOML the kohya_ss GUI (bmaltais/kohya_ss) writes for one of its presets, pointed at
test paths and a tiny built-in model.

Our own code following the GUI's mapping (kohya_gui/{lora,dreambooth,finetune,textual_inversion}_gui.py
`train_model`: the `config_toml_data` dict and its filter, common_gui.update_my_data for old
preset fields), for the SD1/SD2/SDXL, FLUX.1, SD3, Anima and Lumina model types (the GUI's
other families' presets are skipped by the caller). Test-only changes, on top of what the GUI writes: the paths,
the model, 64 px, two steps.
"""
from __future__ import annotations

import json
import os

# The GUI's presets, as tools/update_gui_presets.py stored them from a kohya_ss checkout (with its
# commit): data the tests own, so the preset cases run on any clone.
PRESETS_FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config",
                               "kohya_gui_presets.json")
TABS = ("lora", "dreambooth", "finetune", "textual_inversion")

# The GUI's field defaults (kohya_gui/class_*.py `config.get(..., default)`, lora_gui.py widgets,
# BasicTraining(learning_rate_value=..., lr_scheduler_value=..., lr_warmup_value=...)).
COMMON_DEFAULTS = dict(
    adaptive_noise_scale=0, bucket_no_upscale=True, bucket_reso_steps=64, cache_latents=True,
    cache_latents_to_disk=False, caption_dropout_every_n_epochs=0, caption_dropout_rate=0,
    caption_extension=".txt", clip_skip=1, color_aug=False, debiased_estimation_loss=False,
    dynamo_backend="no", enable_bucket=True, epoch=1, flip_aug=False, fp8_base=False,
    full_bf16=False, full_fp16=False, gradient_accumulation_steps=1, gradient_checkpointing=False,
    huber_c=0.1, huber_scale=1.0, huber_schedule="snr", ip_noise_gamma=0,
    ip_noise_gamma_random_strength=False, keep_tokens=0, log_config=False, log_tracker_name="",
    log_with="", loss_type="l2", lr_scheduler_args="", lr_scheduler_num_cycles=1,
    lr_scheduler_power=1.0, lr_scheduler_type="", lr_warmup_steps=0, masked_loss=False,
    max_bucket_reso=2048, max_data_loader_n_workers=0, max_grad_norm=1.0,
    max_resolution="512,512", max_timestep=1000, max_token_length=75, max_train_epochs=0,
    max_train_steps=1600, mem_eff_attn=False, min_bucket_reso=256, min_snr_gamma=0,
    min_timestep=0, mixed_precision="fp16", multires_noise_discount=0.3,
    multires_noise_iterations=0, no_token_padding=False, noise_offset=0,
    noise_offset_random_strength=False, noise_offset_type="Original", optimizer="AdamW8bit",
    optimizer_args="", output_name="last", persistent_data_loader_workers=False,
    prior_loss_weight=1.0, random_crop=False, sample_every_n_epochs=0, sample_every_n_steps=0,
    sample_prompts="", sample_sampler="euler_a", save_every_n_epochs=1, save_every_n_steps=0,
    save_last_n_epochs=0, save_last_n_epochs_state=0, save_last_n_steps=0,
    save_last_n_steps_state=0, save_model_as="safetensors", save_precision="fp16",
    save_state=False, save_state_on_train_end=False, scale_v_pred_loss_like_noise_pred=False,
    sdxl=False, sdxl_cache_text_encoder_outputs=False, sdxl_no_half_vae=False, seed=0,
    shuffle_caption=False, skip_cache_check=False, stop_text_encoder_training=0,
    train_batch_size=1, v2=False, v_parameterization=False, v_pred_like_loss=0, vae_batch_size=0,
    wandb_run_name="", weighted_captions=False, xformers="xformers", highvram=False,
    fused_backward_pass=False, fused_optimizer_groups=0, cache_text_encoder_outputs=False,
    cache_text_encoder_outputs_to_disk=False, no_half_vae=False, train_text_encoder=False,
    dataset_repeats=1, vae_chunk_size=0,
)
TAB_DEFAULTS = {
    "lora": dict(learning_rate=0.0001, lr_scheduler="cosine", lr_warmup=10, LoRA_type="Standard",
                 LyCORIS_preset="full", text_encoder_lr=0.0001, unet_lr=0.0001, network_dim=8,
                 network_alpha=1, conv_dim=1, conv_alpha=1, scale_weight_norms=0,
                 network_dropout=0, rank_dropout=0, module_dropout=0.0, unit=1, factor=-1,
                 bypass_mode=False, dora_wd=False, use_cp=False, use_tucker=False,
                 use_scalar=False, rank_dropout_scale=False, constrain=0.0, rescaled=False,
                 train_norm=False, decompose_both=False, train_on_input=True,
                 loraplus_lr_ratio=0, loraplus_unet_lr_ratio=0, loraplus_text_encoder_lr_ratio=0,
                 dim_from_weights=False, fp8_base_unet=False, train_lora_ggpo=False,
                 ggpo_sigma=0.03, ggpo_beta=0.01),
    "dreambooth": dict(learning_rate=1e-5, lr_scheduler="cosine", lr_warmup=10,
                       learning_rate_te=1e-5, learning_rate_te1=1e-5, learning_rate_te2=1e-5),
    # finetune_gui.py: its "Dataset repeats" (40) and "Train text encoder" (on) widgets
    "finetune": dict(learning_rate=1e-5, lr_scheduler="constant", lr_warmup=0,
                     learning_rate_te=1e-5, learning_rate_te1=1e-5, learning_rate_te2=1e-5,
                     block_lr="", dataset_repeats=40, train_text_encoder=True),
    # textual_inversion_gui.py: BasicTraining(learning_rate_value=1e-5, lr_scheduler_value="cosine",
    # lr_warmup_value=10) and its own fields (token_string has no default: the GUI requires one)
    "textual_inversion": dict(learning_rate=1e-5, lr_scheduler="cosine", lr_warmup=10,
                              token_string="", init_word="*", num_vectors_per_token=1,
                              template="caption", weights=""),
}
BLOCK_FIELDS = ("down_lr_weight", "mid_lr_weight", "up_lr_weight", "block_lr_zero_threshold",
                "block_dims", "block_alphas", "conv_block_dims", "conv_block_alphas")

_INT_FIELDS = ("clip_skip", "epoch", "gradient_accumulation_steps", "keep_tokens", "lr_warmup",
               "max_data_loader_n_workers", "max_train_epochs", "save_every_n_epochs", "seed",
               "max_train_steps", "caption_dropout_every_n_epochs")
_FLOAT_FIELDS = ("adaptive_noise_scale", "noise_offset", "learning_rate", "text_encoder_lr",
                 "unet_lr")
# fields the GUI shows as numbers (gradio returns numbers for them)
_NUMBER_FIELDS = ("min_bucket_reso", "max_bucket_reso", "bucket_reso_steps", "train_batch_size",
                  "network_dim", "network_alpha", "conv_dim", "conv_alpha", "vae_batch_size",
                  "learning_rate_te", "learning_rate_te1", "learning_rate_te2", "min_snr_gamma",
                  "prior_loss_weight", "max_grad_norm", "caption_dropout_rate", "noise_offset",
                  "stop_text_encoder_training", "multires_noise_iterations",
                  "multires_noise_discount", "scale_weight_norms", "network_dropout",
                  "rank_dropout", "module_dropout", "max_token_length", "dataset_repeats")


OTHER_FAMILIES = {"hunyuan_image_checkbox": "HunyuanImage-2.1"}
FLOW_FAMILIES = {"flux1_checkbox": "flux", "sd3_checkbox": "sd3", "anima_checkbox": "anima",
                 "lumina_checkbox": "lumina"}

# The GUI's FLUX.1 / SD3 field defaults (kohya_gui/class_flux1.py, class_sd3.py `config.get`)
FLOW_DEFAULTS = dict(
    ae="", clip_l="", t5xxl="", discrete_flow_shift=3.0, model_prediction_type="sigma_scaled",
    timestep_sampling="sigma", apply_t5_attn_mask=False, split_mode=False, train_blocks="all",
    split_qkv=False, train_t5xxl=False, cpu_offload_checkpointing=False, guidance_scale=3.5,
    t5xxl_max_token_length=512, mem_eff_save=False, single_blocks_to_swap=0,
    double_blocks_to_swap=0, blocks_to_swap=0, blockwise_fused_optimizers=False,
    flux_fused_backward_pass=False, flux1_cache_text_encoder_outputs=False,
    flux1_cache_text_encoder_outputs_to_disk=False, img_attn_dim="", img_mlp_dim="",
    img_mod_dim="", single_dim="", txt_attn_dim="", txt_mlp_dim="", txt_mod_dim="",
    single_mod_dim="", in_dims="", train_double_block_indices="all", train_single_block_indices="all",
    weighting_scheme="logit_normal", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, clip_g="",
    save_clip=False, save_t5xxl=False, t5xxl_device="", t5xxl_dtype="bf16",
    sd3_text_encoder_batch_size=1, sd3_cache_text_encoder_outputs=False,
    sd3_cache_text_encoder_outputs_to_disk=False, sd3_fused_backward_pass=False,
    clip_l_dropout_rate=0.0, clip_g_dropout_rate=0.0, t5_dropout_rate=0.0,
    enable_scaled_pos_embed=False, pos_emb_random_crop_rate=0.0, enable_all_linear=False,
)
FLOW_FILES = ("ae", "clip_l", "clip_g", "t5xxl")  # the preset's own model files
# The GUI's Anima / Lumina fields, as its saved JSON names them, with their defaults
# (kohya_gui/class_anima.py, class_lumina.py `config.get("anima.<name>", default)`)
DIT_DEFAULTS = dict(
    anima_checkbox=False, anima_qwen3="", anima_vae="", anima_llm_adapter_path="", anima_t5_tokenizer_path="",
    anima_discrete_flow_shift=1.0, anima_timestep_sampling="sigmoid", anima_sigmoid_scale=1.0,
    anima_qwen3_max_token_length=512, anima_t5_max_token_length=512, anima_attn_mode="torch",
    anima_split_attn=False, anima_vae_chunk_size=0, anima_vae_disable_cache=False, anima_qwen_image_vae_2d=False,
    anima_cache_text_encoder_outputs=False, anima_cache_text_encoder_outputs_to_disk=False,
    anima_unsloth_offload_checkpointing=False, anima_compile=False, anima_torch_compile=False,
    anima_compile_backend="inductor", anima_compile_mode="default", anima_compile_dynamic="auto",
    anima_compile_fullgraph=False, anima_compile_cache_size_limit=0,
    lumina_checkbox=False, lumina_gemma2="", lumina_ae="", lumina_discrete_flow_shift=6.0,
    lumina_model_prediction_type="raw", lumina_timestep_sampling="shift", lumina_sigmoid_scale=1.0,
    lumina_gemma2_max_token_length=256, lumina_system_prompt="", lumina_use_flash_attn=False,
    lumina_use_sage_attn=False, lumina_cache_text_encoder_outputs=False,
    lumina_cache_text_encoder_outputs_to_disk=False,
)
DIT_FILES = ("anima_qwen3", "anima_vae", "anima_llm_adapter_path", "anima_t5_tokenizer_path", "lumina_gemma2",
             "lumina_ae")


def other_family(preset: dict) -> str | None:
    """The GUI model type of a preset this toolkit does not train (HunyuanImage, ...), or None."""
    return next((name for box, name in OTHER_FAMILIES.items() if preset.get(box)), None)


def flow_family(preset: dict) -> str | None:
    """'flux' / 'sd3' / 'anima' / 'lumina' for a preset of that model type, else None."""
    return next((name for box, name in FLOW_FAMILIES.items() if preset.get(box)), None)


def family_of(preset: dict) -> str | None:
    """'sd1' / 'sd2' / 'sdxl' / 'flux' / 'sd3' / 'anima' / 'lumina', or None for a model type this
    toolkit does not train."""
    if other_family(preset):
        return None
    if flow_family(preset):
        return flow_family(preset)
    if preset.get("sdxl") or preset.get("sdxl_checkbox"):
        return "sdxl"
    return "sd2" if preset.get("v2") else "sd1"


def _number(v):
    if isinstance(v, str):
        try:
            f = float(v)
        except ValueError:
            return v
        return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f
    return v


def normalize(preset: dict, tab: str) -> dict:
    """The GUI's field values once it has loaded the preset (update_my_data) over its defaults."""
    d = {**COMMON_DEFAULTS, **TAB_DEFAULTS[tab], **FLOW_DEFAULTS, **DIT_DEFAULTS}
    if tab == "finetune":
        d["sdxl"] = False
    p = dict(preset)
    p.setdefault("optimizer", "AdamW8bit" if p.get("use_8bit_adam") else d["optimizer"])
    for k in _INT_FIELDS:
        if k in p:
            try:
                p[k] = int(p[k])
            except (TypeError, ValueError):
                p[k] = 0
    if "lr_scheduler_num_cycles" in p:
        try:
            p["lr_scheduler_num_cycles"] = int(p["lr_scheduler_num_cycles"])
        except (TypeError, ValueError):
            p["lr_scheduler_num_cycles"] = 1
    for k in _FLOAT_FIELDS:
        if k in p:
            try:
                p[k] = float(p[k])
            except (TypeError, ValueError):
                p[k] = 0.0
    if "lr_scheduler_power" in p:
        try:
            p["lr_scheduler_power"] = float(p["lr_scheduler_power"])
        except (TypeError, ValueError):
            p["lr_scheduler_power"] = 1.0
    for k in _NUMBER_FIELDS:
        if k in p:
            p[k] = _number(p[k])
    if p.get("LoRA_type") == "LoCon":
        p["LoRA_type"] = "LyCORIS/LoCon"
    if isinstance(p.get("xformers"), bool):
        p["xformers"] = "xformers" if p["xformers"] else "none"
    if "lora_network_weights" in p:
        p["network_weights"] = p.pop("lora_network_weights")
    if "sdxl_checkbox" in p:
        p["sdxl"] = p.pop("sdxl_checkbox")
    d.update(p)
    return d


# The LoRA_type dropdown of lora_gui.py (v26), and the types for other model families
LORA_TYPES = ("Anima", "Flux1", "Flux1 OFT", "HunyuanImage-2.1", "Kohya DyLoRA", "Kohya LoCon", "Kohya LoHa",
              "Kohya LoKr", "LoRA-FA", "Lumina", "LyCORIS/iA3", "LyCORIS/BOFT", "LyCORIS/Diag-OFT",
              "LyCORIS/DyLoRA", "LyCORIS/GLoRA", "LyCORIS/LoCon", "LyCORIS/LoHa", "LyCORIS/LoKr",
              "LyCORIS/Native Fine-Tuning", "Standard")
OTHER_FAMILY_TYPES = {"HunyuanImage-2.1": "HunyuanImage-2.1"}
# the types the GUI allows with its Flux1 checkbox besides the LyCORIS ones (lora_gui.py: "LoRA type
# must be set to 'Flux1', 'Flux1 OFT' or 'LyCORIS' if Flux1 checkbox is checked")
FLUX_TYPES = ("Flux1", "Flux1 OFT")


def _lora_network(d: dict) -> tuple[str, str]:
    """(network_module, network_args string) as lora_gui.py builds them from LoRA_type
    (append_loraplus_network_args comes last for every type)."""
    module, args = _lora_network_by_type(d)
    for k in ("loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio"):
        if d.get(k):
            args += f" {k}={d[k]}"
    return module, args


def _lora_network_by_type(d: dict) -> tuple[str, str]:
    t, args = d["LoRA_type"], ""
    common = (f" preset={d['LyCORIS_preset']} conv_dim={d['conv_dim']} conv_alpha={d['conv_alpha']}")
    if t in ("LoCon", "LyCORIS/LoCon", "LyCORIS/LoHa"):
        algo = "locon" if "LoCon" in t else "loha"
        return "lycoris.kohya", (
            f"{common} use_tucker={d['use_tucker']} rank_dropout={d['rank_dropout']} "
            f"bypass_mode={d['bypass_mode']} dora_wd={d['dora_wd']} module_dropout={d['module_dropout']} "
            f"use_tucker={d['use_tucker']} use_scalar={d['use_scalar']} "
            f"rank_dropout_scale={d['rank_dropout_scale']} algo={algo} train_norm={d['train_norm']}")
    if t == "LyCORIS/LoKr":
        return "lycoris.kohya", (
            f"{common} use_tucker={d['use_tucker']} rank_dropout={d['rank_dropout']} "
            f"bypass_mode={d['bypass_mode']} dora_wd={d['dora_wd']} module_dropout={d['module_dropout']} "
            f"factor={d['factor']} use_cp={d['use_cp']} use_scalar={d['use_scalar']} "
            f"decompose_both={d['decompose_both']} rank_dropout_scale={d['rank_dropout_scale']} "
            f"algo=lokr train_norm={d['train_norm']}")
    if t == "LyCORIS/iA3":
        return "lycoris.kohya", f"{common} train_on_input={d['train_on_input']} algo=ia3"
    if t == "LyCORIS/GLoRA":
        return "lycoris.kohya", (
            f"{common} use_tucker={d['use_tucker']} rank_dropout={d['rank_dropout']} "
            f"module_dropout={d['module_dropout']} rank_dropout_scale={d['rank_dropout_scale']} "
            f'algo="glora" train_norm={d["train_norm"]}')
    if t == "LyCORIS/BOFT":
        return "lycoris.kohya", (
            f"{common} module_dropout={d['module_dropout']} use_tucker={d['use_tucker']} "
            f"rank_dropout={d['rank_dropout']} rank_dropout_scale={d['rank_dropout_scale']} algo=boft "
            f"train_norm={d['train_norm']}")
    if t == "LyCORIS/Diag-OFT":
        return "lycoris.kohya", (
            f"{common} module_dropout={d['module_dropout']} use_tucker={d['use_tucker']} "
            f"rank_dropout={d['rank_dropout']} rank_dropout_scale={d['rank_dropout_scale']} "
            f"constraint={d['constrain']} rescaled={d['rescaled']} algo=diag-oft train_norm={d['train_norm']}")
    if t == "LyCORIS/DyLoRA":
        return "lycoris.kohya", (
            f"{common} use_tucker={d['use_tucker']} block_size={d['unit']} rank_dropout={d['rank_dropout']} "
            f'module_dropout={d["module_dropout"]} algo="dylora" train_norm={d["train_norm"]}')
    if t == "LyCORIS/Native Fine-Tuning":
        return "lycoris.kohya", (
            f" preset={d['LyCORIS_preset']} rank_dropout={d['rank_dropout']} module_dropout={d['module_dropout']} "
            f"rank_dropout_scale={d['rank_dropout_scale']} algo=full train_norm={d['train_norm']}")
    if t in ("Kohya LoHa", "Kohya LoKr"):
        # lora_gui.py build_native_loha_lokr_network_args: only non-default values
        parts = []
        if d["conv_dim"] is not None and float(d["conv_dim"]) > 0:
            parts.append(f"conv_dim={int(d['conv_dim'])}")
            if d["conv_alpha"] is not None:
                a = d["conv_alpha"]
                parts.append(f"conv_alpha={int(a) if float(a) == int(a) else a}")
        if d["use_tucker"]:
            parts.append("use_tucker=True")
        if t == "Kohya LoKr" and d["factor"] is not None and int(d["factor"]) != -1:
            parts.append(f"factor={int(d['factor'])}")
        for k in ("rank_dropout", "module_dropout"):
            if d[k] is not None and float(d[k]) > 0:
                parts.append(f"{k}={d[k]}")
        return ("networks.loha" if t == "Kohya LoHa" else "networks.lokr"), (" " + " ".join(parts)) if parts else ""
    if t == "LoRA-FA":
        for k in (*BLOCK_FIELDS, "rank_dropout", "module_dropout"):
            if d.get(k):
                args += f" {k}={d[k]}"
        return "networks.lora_fa", args
    if t == "Kohya DyLoRA":
        for k in ("conv_dim", "conv_alpha", *BLOCK_FIELDS, "rank_dropout", "module_dropout", "unit"):
            if d.get(k):
                args += f" {k}={d[k]}"
        return "networks.dylora", args
    if t == "Flux1":
        # lora_gui.py: the per-kind dims and block indices set in the GUI, split_mode forcing
        # train_blocks = single, split_qkv and train_t5xxl, then rank/module dropout
        if d["train_lora_ggpo"]:  # LoRA-GGPO: its two values join the list
            for k in ("ggpo_sigma", "ggpo_beta"):
                if d[k]:
                    args += f" {k}={d[k]}"
        names = ("img_attn_dim", "img_mlp_dim", "img_mod_dim", "single_dim", "txt_attn_dim",
                 "txt_mlp_dim", "txt_mod_dim", "single_mod_dim", "in_dims",
                 "train_double_block_indices", "train_single_block_indices")
        for k in names:
            if d.get(k):
                args += f" {k}={d[k]}"
        if d["split_mode"]:
            args += " train_blocks=single"
        if d["split_qkv"]:
            args += " split_qkv=True"
        if d["train_t5xxl"] and d.get("flux1_checkbox"):
            args += " train_t5xxl=True"
        for k in ("rank_dropout", "module_dropout"):
            if d[k] is not None and float(d[k]) > 0:
                args += f" {k}={d[k]}"
        return "networks.lora_flux", args
    if t in ("Anima", "Lumina"):
        # lora_gui.py: networks.lora_anima / networks.lora_lumina with the rank / module dropouts
        for k in ("rank_dropout", "module_dropout"):
            if d[k] is not None and float(d[k]) > 0:
                args += f" {k}={d[k]}"
        return f"networks.lora_{t.lower()}", args
    if t == "Flux1 OFT":
        # lora_gui.py: network_args are the set values of its list, which holds enable_all_linear only
        return "networks.oft_flux", " enable_all_linear=True" if d.get("enable_all_linear") else ""
    if t in ("Standard", "Kohya LoCon"):
        if t == "Kohya LoCon":
            args += f' conv_dim="{d["conv_dim"]}" conv_alpha="{d["conv_alpha"]}"'
        for k in (*BLOCK_FIELDS, "rank_dropout", "module_dropout"):
            if d.get(k):
                args += f" {k}={d[k]}"
        module = "networks.lora"
    else:
        raise NotImplementedError(f"LoRA_type {t!r} is not covered by this converter")
    return module, args


def _warmup(d: dict):
    warm = float(d.get("lr_warmup") or 0)
    steps = float(d.get("lr_warmup_steps") or 0)
    if steps > 0:
        return int(steps)
    return warm / 100 if warm else 0


def gui_toml(preset: dict, tab: str, *, model: str, data_dir: str, output_dir: str,
             pixels: int = 64, steps: int = 2, network_weights: str = "") -> dict:
    """The TOML dict the GUI writes for `preset` on `tab` (test paths, `model`, `pixels`, `steps`;
    `network_weights` replaces the preset's own network weights file where it names one)."""
    d = normalize(preset, tab)
    sdxl = bool(d["sdxl"])
    preset_weights = bool(d.get("network_weights"))
    d.update(train_data_dir=data_dir, output_dir=output_dir, pretrained_model_name_or_path=model)
    for k in ("reg_data_dir", "logging_dir", "vae", "network_weights", "resume", "dataset_config",
              "log_tracker_config", "in_json", "wandb_api_key", *FLOW_FILES, *DIT_FILES):
        d[k] = ""  # the preset's own paths do not exist here (the tiny models hold their encoders)
    if preset_weights:
        d["network_weights"] = network_weights
    # test size: the preset's resolution scaled to `pixels` on the short side (keeping a
    # non-multiple-of-8 side as such), bucket limits around it, and `steps` steps
    w, h = (int(x) for x in (str(d["max_resolution"]).split(",") * 2)[:2])
    scale = pixels / min(w, h)
    d["max_resolution"] = f"{round(w * scale)},{round(h * scale)}"
    if int(d["bucket_reso_steps"]) % 8 == 0:
        d["bucket_reso_steps"] = 8
    # (a step that is not a multiple of 8, e.g. the LyCORIS presets' 1, is kept: it is rounded up)
    d["min_bucket_reso"] = min(int(d["min_bucket_reso"]), pixels)
    d["max_bucket_reso"] = max(int(d["max_bucket_reso"]) * scale, 2 * pixels)
    d["max_bucket_reso"] = int(d["max_bucket_reso"]) - int(d["max_bucket_reso"]) % 8
    d["max_train_steps"], d["max_train_epochs"] = steps, 0
    d["train_batch_size"], d["gradient_accumulation_steps"] = 1, 1
    for k in ("save_every_n_epochs", "save_every_n_steps", "sample_every_n_epochs",
              "sample_every_n_steps"):
        d[k] = 0
    os.makedirs(os.path.join(output_dir, "sample"), exist_ok=True)
    prompt_file = os.path.join(output_dir, "sample", "prompt.txt")  # create_prompt_file
    with open(prompt_file, "w", encoding="utf-8") as f:
        f.write(d.get("sample_prompts") or "")

    max_train_steps = d["max_train_steps"]
    stop_te = d["stop_text_encoder_training"]
    if tab == "lora":
        stop_te = 0  # lora_gui: "not yet supported. Ignoring"
    # (dreambooth_gui.py writes its "% of total steps" field's value unchanged)
    warmup = _warmup(d)
    xf = d["xformers"]
    out = {
        "adaptive_noise_scale": d["adaptive_noise_scale"] or None,
        "bucket_no_upscale": d["bucket_no_upscale"], "bucket_reso_steps": d["bucket_reso_steps"],
        "cache_latents": d["cache_latents"], "cache_latents_to_disk": d["cache_latents_to_disk"],
        "caption_dropout_every_n_epochs": int(d["caption_dropout_every_n_epochs"]),
        "caption_dropout_rate": d["caption_dropout_rate"], "caption_extension": d["caption_extension"],
        "clip_skip": d["clip_skip"] or None, "color_aug": d["color_aug"],
        "dataset_config": d["dataset_config"], "debiased_estimation_loss": d["debiased_estimation_loss"],
        "dynamo_backend": d["dynamo_backend"], "enable_bucket": d["enable_bucket"],
        "flip_aug": d["flip_aug"], "fp8_base": d["fp8_base"], "full_bf16": d["full_bf16"],
        "full_fp16": d["full_fp16"], "gradient_accumulation_steps": int(d["gradient_accumulation_steps"]),
        "gradient_checkpointing": d["gradient_checkpointing"], "huber_c": d["huber_c"],
        "huber_scale": d["huber_scale"], "huber_schedule": d["huber_schedule"],
        "ip_noise_gamma": d["ip_noise_gamma"] or None,
        "ip_noise_gamma_random_strength": d["ip_noise_gamma_random_strength"],
        "keep_tokens": int(d["keep_tokens"]), "logging_dir": d["logging_dir"],
        "log_config": d["log_config"], "log_tracker_name": d["log_tracker_name"],
        "log_tracker_config": d["log_tracker_config"], "log_with": d["log_with"],
        "loss_type": d["loss_type"], "lr_scheduler": d["lr_scheduler"],
        "lr_scheduler_args": str(d["lr_scheduler_args"]).replace('"', "").split(),
        "lr_scheduler_type": d["lr_scheduler_type"] or None, "lr_warmup_steps": warmup,
        "masked_loss": d["masked_loss"], "max_bucket_reso": d["max_bucket_reso"],
        "max_timestep": d["max_timestep"] or None, "max_token_length": int(d["max_token_length"]),
        "max_train_epochs": int(d["max_train_epochs"]) or None,
        "max_train_steps": int(max_train_steps) or None, "mem_eff_attn": d["mem_eff_attn"],
        "min_bucket_reso": int(d["min_bucket_reso"]), "min_snr_gamma": d["min_snr_gamma"] or None,
        "min_timestep": d["min_timestep"] or None, "mixed_precision": d["mixed_precision"],
        "noise_offset_type": d["noise_offset_type"], "optimizer_type": d["optimizer"],
        "output_dir": d["output_dir"], "output_name": d["output_name"],
        "persistent_data_loader_workers": int(d["persistent_data_loader_workers"]),
        "pretrained_model_name_or_path": d["pretrained_model_name_or_path"],
        "random_crop": d["random_crop"], "resolution": d["max_resolution"], "resume": d["resume"],
        "sample_prompts": prompt_file, "sample_sampler": d["sample_sampler"],
        "save_every_n_epochs": d["save_every_n_epochs"] or None,
        "save_every_n_steps": d["save_every_n_steps"] or None,
        "save_last_n_steps": d["save_last_n_steps"] or None,
        "save_last_n_steps_state": d["save_last_n_steps_state"] or None,
        "save_last_n_epochs": d["save_last_n_epochs"] or None,
        "save_last_n_epochs_state": d["save_last_n_epochs_state"] or None,
        "save_model_as": d["save_model_as"], "save_precision": d["save_precision"],
        "save_state": d["save_state"], "save_state_on_train_end": d["save_state_on_train_end"],
        "scale_v_pred_loss_like_noise_pred": d["scale_v_pred_loss_like_noise_pred"],
        "sdpa": True if xf == "sdpa" else None, "seed": int(d["seed"]) or None,
        "shuffle_caption": d["shuffle_caption"], "skip_cache_check": d["skip_cache_check"],
        "train_batch_size": d["train_batch_size"], "train_data_dir": d["train_data_dir"],
        "v2": d["v2"], "v_parameterization": d["v_parameterization"],
        "v_pred_like_loss": d["v_pred_like_loss"] or None, "vae": d["vae"],
        "vae_batch_size": d["vae_batch_size"] or None, "wandb_api_key": d["wandb_api_key"],
        "wandb_run_name": d["wandb_run_name"] or d["output_name"],
        "weighted_captions": d["weighted_captions"], "xformers": True if xf == "xformers" else None,
        "max_data_loader_n_workers": int(d["max_data_loader_n_workers"]),
    }
    original = d["noise_offset_type"] == "Original"
    multires = d["noise_offset_type"] == "Multires"
    cycles = int(d["lr_scheduler_num_cycles"]) if d["lr_scheduler_num_cycles"] != "" else int(d["epoch"])
    opt_args = _split(d["optimizer_args"])
    if tab == "lora":
        module, args = _lora_network(d)
        te, unet = float(d["text_encoder_lr"] or 0), float(d["unet_lr"] or 0)
        out.update({
            "adaptive_noise_scale": d["adaptive_noise_scale"] if original else None,
            "noise_offset": d["noise_offset"] if original else None,
            "noise_offset_random_strength": d["noise_offset_random_strength"] if original else None,
            "multires_noise_discount": d["multires_noise_discount"] if multires else None,
            "multires_noise_iterations": d["multires_noise_iterations"] if multires else None,
            "cache_text_encoder_outputs": True if sdxl and d["sdxl_cache_text_encoder_outputs"] else None,
            "dim_from_weights": d["dim_from_weights"], "epoch": int(d["epoch"]),
            "highvram": d["highvram"], "learning_rate": float(d["learning_rate"] or 0),
            "lr_scheduler_num_cycles": cycles,
            "lr_scheduler_power": d["lr_scheduler_power"], "max_grad_norm": d["max_grad_norm"],
            "network_alpha": d["network_alpha"], "network_args": args.replace('"', "").split(),
            "network_dim": d["network_dim"], "network_dropout": d["network_dropout"],
            "network_module": module,
            "network_train_unet_only": te == 0 and unet != 0,
            "network_train_text_encoder_only": te != 0 and unet == 0,
            "network_weights": d["network_weights"],
            "no_half_vae": True if sdxl and d["sdxl_no_half_vae"] else None,
            "optimizer_args": opt_args,  # the GUI's `if optimizer_args != []` is always true
            "prior_loss_weight": d["prior_loss_weight"], "reg_data_dir": d["reg_data_dir"],
            "scale_weight_norms": d["scale_weight_norms"],
            "stop_text_encoder_training": stop_te or None,
            "text_encoder_lr": [te, te] if te > 0 else None,
            "training_comment": d.get("training_comment", ""),
            "unet_lr": unet if unet != 0.0 else None,
        })
        keep = _lora_keeps
    elif tab == "textual_inversion":
        for k in ("caption_dropout_rate", "debiased_estimation_loss", "fp8_base", "full_bf16",
                  "masked_loss", "weighted_captions"):
            del out[k]  # not in textual_inversion_gui.py's config_toml_data
        out.update({
            "epoch": int(d["epoch"]), "init_word": d["init_word"],
            "learning_rate": d["learning_rate"], "lr_scheduler_num_cycles": cycles,
            "lr_scheduler_power": d["lr_scheduler_power"],
            "multires_noise_discount": d["multires_noise_discount"],
            "multires_noise_iterations": d["multires_noise_iterations"] or None,
            "no_half_vae": d["sdxl_no_half_vae"], "no_token_padding": d["no_token_padding"],
            "noise_offset": d["noise_offset"] or None,
            "noise_offset_random_strength": d["noise_offset_random_strength"],
            "num_vectors_per_token": int(d["num_vectors_per_token"]), "optimizer_args": opt_args,
            "prior_loss_weight": d["prior_loss_weight"], "reg_data_dir": d["reg_data_dir"],
            "token_string": d["token_string"], "weights": d["weights"],
            "use_object_template": True if d["template"] == "object template" else None,
            "use_style_template": True if d["template"] == "style template" else None,
        })
        keep = _lora_keeps  # the same `value not in ["", False, None]` filter
    else:
        out.update({
            "noise_offset": d["noise_offset"] or None,
            "noise_offset_random_strength": d["noise_offset_random_strength"],
            "multires_noise_discount": d["multires_noise_discount"],
            "multires_noise_iterations": d["multires_noise_iterations"] or None,
            # dreambooth_gui.py / finetune_gui.py: from the model types' own boxes (FLUX.1 / SD3
            # in _flow_keys)
            "cache_text_encoder_outputs": sdxl and d["sdxl_cache_text_encoder_outputs"],
            "cache_text_encoder_outputs_to_disk": None,
            "fused_backward_pass": d["fused_backward_pass"],
            "fused_optimizer_groups": int(d["fused_optimizer_groups"]) or None,
            "learning_rate": d["learning_rate"],
            "learning_rate_te": d["learning_rate_te"] if not sdxl else None,
            "learning_rate_te1": d["learning_rate_te1"] if sdxl else None,
            "learning_rate_te2": d["learning_rate_te2"] if sdxl else None,
            "no_half_vae": sdxl and d["sdxl_no_half_vae"],
        })
        if tab == "dreambooth":
            out.update({
                "epoch": int(d["epoch"]), "no_token_padding": d["no_token_padding"],
                "lr_scheduler_num_cycles": cycles,
                "lr_scheduler_power": d["lr_scheduler_power"], "max_grad_norm": d["max_grad_norm"],
                "optimizer_args": opt_args if d["optimizer_args"] != "" else None,
                "prior_loss_weight": d["prior_loss_weight"], "reg_data_dir": d["reg_data_dir"],
                "stop_text_encoder_training": stop_te or None,
                # dreambooth_gui.py: with SDXL the text encoder rates decide
                "train_text_encoder": (_gui_float(d["learning_rate_te1"]) > 0
                                       or _gui_float(d["learning_rate_te2"]) > 0) if sdxl else None,
            })
        else:
            out.update({
                "block_lr": d["block_lr"], "dataset_repeats": int(d["dataset_repeats"]),
                "enable_bucket": True, "in_json": _finetune_metadata(d),
                "cache_text_encoder_outputs": sdxl and d["sdxl_cache_text_encoder_outputs"],
                "cache_text_encoder_outputs_to_disk": None,
                "max_bucket_reso": int(d["max_bucket_reso"]),
                "optimizer_args": opt_args,
                # (finetune_gui.py writes vae and vae_chunk_size only with its Anima box: _dit_keys)
                "train_text_encoder": d["train_text_encoder"], "vae": None,
            })
        keep = _db_ft_keeps
    out.update(_flow_keys(d, tab, sdxl))
    out.update(_dit_keys(d, tab, out))
    return dict(sorted((k, v) for k, v in out.items() if keep(v)))


def _dit_keys(d: dict, tab: str, out: dict) -> dict:
    """The Anima / Lumina keys the LoRA and fine-tune tabs write (lora_gui.py, finetune_gui.py
    config_toml_data: each None unless its model type is checked; where FLUX.1 writes the same key,
    `lumina_x if lumina_checkbox else anima_x if anima_checkbox else x if flux1_checkbox`)."""
    anima, lumina = bool(d.get("anima_checkbox")), bool(d.get("lumina_checkbox"))
    if not (anima or lumina) or tab not in ("lora", "finetune"):
        return {}
    compile_on = anima and d["anima_compile"]
    new = {
        "clip_skip": None, "max_token_length": None,
        "cache_text_encoder_outputs": bool(out.get("cache_text_encoder_outputs")) or
        (anima and d["anima_cache_text_encoder_outputs"]) or (lumina and d["lumina_cache_text_encoder_outputs"]),
        "cache_text_encoder_outputs_to_disk": bool(out.get("cache_text_encoder_outputs_to_disk")) or
        (anima and d["anima_cache_text_encoder_outputs_to_disk"]) or
        (lumina and d["lumina_cache_text_encoder_outputs_to_disk"]),
        "blocks_to_swap": d["blocks_to_swap"],
        "discrete_flow_shift": float(d["lumina_discrete_flow_shift"] if lumina else d["anima_discrete_flow_shift"]),
        "timestep_sampling": d["lumina_timestep_sampling"] if lumina else d["anima_timestep_sampling"],
        "sigmoid_scale": float(d["lumina_sigmoid_scale"] if lumina else d["anima_sigmoid_scale"]),
        "attn_mode": d["anima_attn_mode"] if anima and d["anima_attn_mode"] != "torch" else None,
        "vae_chunk_size": int(d["anima_vae_chunk_size"]) if anima and d["anima_vae_chunk_size"] else None,
        "llm_adapter_path": d["anima_llm_adapter_path"] if anima and d["anima_llm_adapter_path"] else None,
        "t5_tokenizer_path": d["anima_t5_tokenizer_path"] if anima and d["anima_t5_tokenizer_path"] else None,
        "qwen3_max_token_length": int(d["anima_qwen3_max_token_length"]) if anima else None,
        "t5_max_token_length": int(d["anima_t5_max_token_length"]) if anima else None,
        # `anima_<key> if anima_checkbox`, the compile settings `if anima_checkbox and anima_compile`
        **{k: d[f"anima_{k}"] if anima else None for k in (
            "qwen3", "split_attn", "vae_disable_cache", "unsloth_offload_checkpointing", "qwen_image_vae_2d",
            "compile", "torch_compile")},
        **{k: d[f"anima_{k}"] if compile_on else None for k in ("compile_backend", "compile_mode", "compile_fullgraph")},
        "compile_dynamic": d["anima_compile_dynamic"] if compile_on and d["anima_compile_dynamic"] != "auto" else None,
        "compile_cache_size_limit": (int(d["anima_compile_cache_size_limit"])
                                     if compile_on and d["anima_compile_cache_size_limit"] else None),
        **{k: d[f"lumina_{k}"] if lumina else None for k in ("gemma2", "use_flash_attn", "use_sage_attn")},
        "gemma2_max_token_length": (int(d["lumina_gemma2_max_token_length"])
                                    if lumina and d["lumina_gemma2_max_token_length"] else None),
        "system_prompt": d["lumina_system_prompt"] if lumina and d["lumina_system_prompt"] else None,
    }
    if lumina:
        new.update(ae=d["lumina_ae"], model_prediction_type=d["lumina_model_prediction_type"])
    if anima:
        new["vae"] = d["anima_vae"]  # lora_gui.py: `anima_vae if anima_checkbox else ... vae`
    if tab == "lora":  # the LoRA tab's filter: `value not in ["", False, None]`
        for k in ("cache_text_encoder_outputs", "cache_text_encoder_outputs_to_disk"):
            new[k] = True if new[k] else None
    return new


def _flow_keys(d: dict, tab: str, sdxl: bool) -> dict:
    """The FLUX.1 / SD3 keys the tab writes (lora_gui.py, dreambooth_gui.py and finetune_gui.py
    config_toml_data: each None unless its model type is checked)."""
    flux, sd3 = bool(d.get("flux1_checkbox")), bool(d.get("sd3_checkbox"))
    cache = ((flux and d["flux1_cache_text_encoder_outputs"])
             or (sd3 and d["sd3_cache_text_encoder_outputs"]))
    cache_disk = ((flux and d["flux1_cache_text_encoder_outputs_to_disk"])
                  or (sd3 and d["sd3_cache_text_encoder_outputs_to_disk"]))
    out = {
        "clip_l": d["clip_l"] if flux or sd3 else None, "t5xxl": d["t5xxl"] if flux or sd3 else None,
        "clip_g": d["clip_g"] if sd3 else None, "logit_mean": d["logit_mean"] if sd3 else None,
        "logit_std": d["logit_std"] if sd3 else None, "mode_scale": d["mode_scale"] if sd3 else None,
        "save_clip": d["save_clip"] if sd3 else None, "save_t5xxl": d["save_t5xxl"] if sd3 else None,
        "t5xxl_device": d["t5xxl_device"] if sd3 else None,
        "t5xxl_dtype": d["t5xxl_dtype"] if sd3 else None,
        "text_encoder_batch_size": d["sd3_text_encoder_batch_size"] if sd3 else None,
        "weighting_scheme": d["weighting_scheme"] if sd3 else None,
        "ae": d["ae"] if flux else None,
        "discrete_flow_shift": float(d["discrete_flow_shift"]) if flux else None,
        "model_prediction_type": d["model_prediction_type"] if flux else None,
        "timestep_sampling": d["timestep_sampling"] if flux else None,
        "t5xxl_max_token_length": int(d["t5xxl_max_token_length"]) if flux else None,
        "guidance_scale": float(d["guidance_scale"]) if flux else None,
        "mem_eff_save": d["mem_eff_save"] if flux else None,
        "apply_t5_attn_mask": d["apply_t5_attn_mask"] if flux else None,
        "cpu_offload_checkpointing": d["cpu_offload_checkpointing"] if flux else None,
        "blocks_to_swap": d["blocks_to_swap"] if flux or sd3 else None,
        "single_blocks_to_swap": d["single_blocks_to_swap"] if flux else None,
        "double_blocks_to_swap": d["double_blocks_to_swap"] if flux else None,
    }
    if tab == "lora":
        out.update({
            "cache_text_encoder_outputs": True if (sdxl and d["sdxl_cache_text_encoder_outputs"]) or cache else None,
            "cache_text_encoder_outputs_to_disk": True if cache_disk else None,
            "fp8_base_unet": d["fp8_base_unet"] if flux else None,
            "fused_backward_pass": d["sd3_fused_backward_pass"] if sd3 else None,
            "split_mode": d["split_mode"] if flux else None,
            "clip_g_dropout_rate": d["clip_g_dropout_rate"] if sd3 else None,
            "clip_l_dropout_rate": d["clip_l_dropout_rate"] if sd3 else None,
            "t5_dropout_rate": d["t5_dropout_rate"] if sd3 else None,
            "enable_scaled_pos_embed": d["enable_scaled_pos_embed"] if sd3 else None,
            "pos_emb_random_crop_rate": d["pos_emb_random_crop_rate"] if sd3 else None,
        })
        if sd3 and d["LoRA_type"] in ("Standard", "Kohya LoCon"):
            out["network_module"] = "networks.lora_sd3"
    else:  # dreambooth_gui.py (finetune_gui.py writes the same model keys)
        out.update({
            "blockwise_fused_optimizers": d["blockwise_fused_optimizers"] if flux else None,
            "fused_backward_pass": (d["sd3_fused_backward_pass"] if sd3 else
                                    d["flux_fused_backward_pass"] if flux else d["fused_backward_pass"]),
        })
        if flux or sd3:
            out["cache_text_encoder_outputs"] = cache
            out["cache_text_encoder_outputs_to_disk"] = cache_disk
    return out


def _gui_float(v) -> float:
    return float(v) if v not in (None, "") else 0.0


def _split(v) -> list:
    return str(v).replace('"', "").split()


def _lora_keeps(v) -> bool:
    """lora_gui.py's filter `value not in ["", False, None]`: drops 0 and 0.0 too (0 == False)."""
    return v not in ["", False, None]


def _db_ft_keeps(v) -> bool:
    """dreambooth_gui.py / finetune_gui.py's filters: identity tests against False, so 0 is kept."""
    return not (isinstance(v, str) and v == "") and v is not None and v is not False


def _finetune_metadata(d: dict) -> str:
    """The finetune tab's in_json: <train_dir>/meta_lat.json or meta_cap.json (use_latent_files),
    which its caption-metadata step (sd-scripts' merge_captions_to_metadata.py, full paths)
    writes from the image folder's caption files; here train_dir is the output folder."""
    if d.get("use_latent_files", "Yes") == "Yes":
        name = d.get("latent_metadata_filename") or "meta_lat.json"
    else:
        name = d.get("caption_metadata_filename") or "meta_cap.json"
    meta = {}
    folder = d["train_data_dir"]
    for f in sorted(os.listdir(folder)):
        stem, ext = os.path.splitext(f)
        if ext.lower() not in (".png", ".jpg", ".jpeg", ".webp"):
            continue
        cap = os.path.join(folder, stem + d["caption_extension"])
        entry = {}
        if os.path.exists(cap):
            with open(cap, encoding="utf-8") as fh:
                entry["caption"] = fh.read().strip()
        meta[os.path.abspath(os.path.join(folder, f))] = entry
    path = os.path.join(d["output_dir"], name)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(meta, fh)
    return path


def _fixture() -> dict:
    with open(PRESETS_FIXTURE, encoding="utf-8") as f:
        return json.load(f)


def presets_commit() -> str:
    """The bmaltais/kohya_ss commit the stored presets come from."""
    return _fixture()["commit"]


def presets(tab: str) -> list[tuple[str, dict]]:
    """(name, preset) for each preset the GUI ships for `tab`, sorted by name (none for
    textual inversion: the GUI ships no presets for it)."""
    return sorted(_fixture()["presets"].get(tab, {}).items())


def tiny_model(family: str) -> str:
    return {"sd1": "tiny-sd15", "sd2": "tiny-sd2", "sdxl": "tiny-sdxl", "flux": "tiny-flux",
            "sd3": "tiny-sd3", "anima": "tiny-anima", "lumina": "tiny-lumina"}[family]


def write_toml(path: str, data: dict) -> str:
    import toml

    with open(path, "w", encoding="utf-8") as f:
        toml.dump(data, f)
    return path
