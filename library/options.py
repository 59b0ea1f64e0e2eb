"""The option schema: the single source of truth for every option of every entry script.

Each `Option` carries its type, default, help text, the entry scripts that accept it and its
allowed values. `library.config` generates the argparse parser, `--help`, the TOML loading and
validation from it; `docs/OPTIONS.md` is generated from it (`python -m library.options`).

`SD_SCRIPTS_NAMES` lists every other option name of kohya-ss/sd-scripts' `train_network.py`,
`sdxl_train_network.py`, `train_db.py`, `fine_tune.py` and `sdxl_train.py`, so that their configs
load: a name whose absence cannot change the trained weights or the data is accepted with a
one-line warning ("ignore"); a name that would change the training math, the data, what is
trained or which files appear is rejected with a "not supported yet" error ("reject"), unless
it is set to its sd-scripts default (off), which is accepted silently.

This module imports nothing heavy: `--help` must print in well under a second.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCRIPTS = ("train_lora", "train_dreambooth", "finetune")
ALL = SCRIPTS
LORA = ("train_lora",)
DB_LORA = ("train_lora", "train_dreambooth")
FULL = ("train_dreambooth", "finetune")

# Sections group options in --help and in docs/OPTIONS.md, in this order.
SECTIONS = {
    "config": "Configuration files and run control",
    "model": "Model",
    "dataset": "Dataset",
    "network": "Network (LoRA)",
    "optimizer": "Optimizer and learning rate",
    "training": "Training",
    "saving": "Saving",
}

LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts",
                 "polynomial")


@dataclass(frozen=True)
class Option:
    """One option. `type` is one of:

    str, path            a string (paths are kept as given; relative ones are relative to the CWD)
    int, float, bool     numbers and switches (TOML: a real number / bool)
    resolution           "512", "512,768", 512 or [512, 768] -> (width, height)
    kv_literal           optimizer_args: ["k=v", ...] or a table -> dict of str -> Python literal
    kv_str               network_args: the same shapes -> dict of str -> str (as sd-scripts passes them)
    float_or_list        a float, or a list of floats (text_encoder_lr: one per text encoder)
    steps_or_fraction    an int number of steps, or a float in [0, 1) (or "10%") = a fraction of all steps
    """

    name: str
    type: str
    default: Any
    help: str
    section: str
    scripts: tuple = ALL
    choices: tuple | None = None
    choices_by_script: dict | None = None
    min: float | None = None
    max: float | None = None
    min_exclusive: bool = False
    max_exclusive: bool = False
    aliases: tuple = ()
    cli_only: bool = False

    def choices_for(self, script: str):
        if self.choices_by_script is not None:
            return self.choices_by_script.get(script)
        return self.choices

    def range_text(self) -> str:
        """A readable form of the allowed range, e.g. ">= 1" or "in [0, 1)"."""
        lo, hi = self.min, self.max
        if lo is not None and hi is not None:
            return f"in {'(' if self.min_exclusive else '['}{_num(lo)}, {_num(hi)}{')' if self.max_exclusive else ']'}"
        if lo is not None:
            return f"{'>' if self.min_exclusive else '>='} {_num(lo)}"
        if hi is not None:
            return f"{'<' if self.max_exclusive else '<='} {_num(hi)}"
        return ""


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


O = Option  # short alias for the table below

OPTIONS: tuple[Option, ...] = (
    # --- configuration files and run control ---
    O("config", "path", None, "Run configuration TOML. Its tables are free-form grouping (as sd-scripts' "
      "[model_arguments]); [general] and [[datasets]] are the dataset config. Flags on the command "
      "line override the file.", "config", aliases=("config_file",), cli_only=True),
    O("dataset_config", "path", None, "Dataset configuration TOML ([general], [[datasets]], "
      "[[datasets.subsets]]), as sd-scripts' --dataset_config. Alternatively put those tables in the "
      "run configuration.", "config"),
    O("dry_run", "bool", False, "Print the step plan and exit without loading any weights (no model "
      "code is imported).", "config"),
    # --- model ---
    O("pretrained_model_name_or_path", "str", None, "Base model: a diffusers folder, a single-file "
      ".safetensors/.ckpt checkpoint, a hub id (online only) or a built-in model: tiny-sd15, tiny-sd2, "
      "tiny-sdxl, sd15-arch, sdxl-arch. Required.", "model"),
    O("v2", "bool", False, "The base model is Stable Diffusion 2.x (normally detected from the weights).",
      "model"),
    O("v_parameterization", "bool", False, "Train with the v-prediction target (SD 2.x 768-v models; "
      "normally detected from the scheduler config).", "model"),
    O("vae", "path", None, "Replace the model's VAE with this file or diffusers folder.", "model"),
    O("no_half_vae", "bool", False, "Keep the VAE in float32 under mixed precision.", "model"),
    O("clip_skip", "int", None, "Use the output of the n-th last text encoder layer (2 = penultimate); "
      "unset = the last layer.", "model", min=1),
    O("tokenizer_path", "path", None, "Folder with the CLIP tokenizer files (for single-file checkpoints "
      "whose tokenizer is not next to them; the project ships CLIP's).", "model"),
    O("allow_pickle", "bool", False, "Allow loading a .ckpt that needs full pickle unpickling (can run "
      "arbitrary code). Without it .ckpt files load with torch.load(weights_only=True).", "model"),
    O("sdpa", "bool", True, "Use PyTorch scaled-dot-product attention (default).", "model"),
    O("xformers", "bool", False, "Use xformers memory-efficient attention (needs the xformers extra); "
      "takes precedence over sdpa.", "model"),
    # --- dataset ---
    O("train_data_dir", "path", None, "Folder of N_concept subfolders (N = repeats, concept = class "
      "tokens). Required unless a dataset config is given.", "dataset"),
    O("reg_data_dir", "path", None, "Folder of N_concept subfolders of regularisation images (prior "
      "preservation).", "dataset", scripts=DB_LORA),
    O("caption_extension", "str", ".caption", "Extension of caption files next to the images.",
      "dataset", aliases=("caption_extention",)),
    O("resolution", "resolution", None, "Training resolution: 'size' or 'width,height' (TOML: also an "
      "int or [w, h]); multiples of 8. Required unless the dataset config sets it.", "dataset"),
    O("cache_latents", "bool", False, "Encode every image with the VAE once, before training, and keep "
      "the latents in memory.", "dataset"),
    O("enable_bucket", "bool", False, "Aspect-ratio buckets: batch images of similar aspect ratio at "
      "their own resolution instead of center-cropping to a square.", "dataset"),
    O("min_bucket_reso", "int", 256, "Smallest bucket side; a multiple of bucket_reso_steps.", "dataset",
      min=8),
    O("max_bucket_reso", "int", 1024, "Largest bucket side; a multiple of bucket_reso_steps.", "dataset",
      min=8),
    O("bucket_reso_steps", "int", 64, "Bucket side step in pixels; a multiple of 8.", "dataset", min=8),
    O("bucket_no_upscale", "bool", False, "Never upscale an image to fit a bucket.", "dataset"),
    O("vae_batch_size", "int", 1, "Images per VAE batch when caching latents.", "dataset", min=1),
    O("max_data_loader_n_workers", "int", 0, "DataLoader worker processes. Default 0 (load in the "
      "training process): with cached latents or small datasets workers only add start-up time "
      "(each re-imports torch) and memory; sd-scripts' default is 8.", "dataset", min=0),
    # --- network ---
    O("network_module", "str", "networks.lora", "Python module with the kohya network interface "
      "(create_network, create_network_from_weights), e.g. networks.lora or lycoris.kohya.", "network",
      scripts=LORA),
    O("network_dim", "int", 4, "LoRA rank.", "network", scripts=LORA, min=1),
    O("network_alpha", "float", 1.0, "LoRA alpha; the update is scaled by alpha / rank.", "network",
      scripts=LORA, min=0),
    O("network_dropout", "float", None, "Dropout on the LoRA down-projection output (neurons) each "
      "step; unset = none.", "network", scripts=LORA, min=0, max=1, max_exclusive=True),
    O("network_args", "kv_str", None, "Extra key=value arguments for the network module, e.g. "
      "conv_dim=4 conv_alpha=1 rank_dropout=0.1 module_dropout=0.1, or LyCORIS' algo=loha. "
      "TOML: a list of 'key=value' strings or a table.", "network", scripts=LORA),
    O("network_weights", "path", None, "Start from the weights in this LoRA file.", "network",
      scripts=LORA),
    O("network_multiplier", "float", 1.0, "Multiplier of the LoRA output during training.", "network",
      scripts=LORA),
    O("network_train_unet_only", "bool", False, "Train only the U-Net part of the network.", "network",
      scripts=LORA),
    O("network_train_text_encoder_only", "bool", False, "Train only the text encoder part of the "
      "network.", "network", scripts=LORA),
    # --- optimizer ---
    O("optimizer_type", "str", "AdamW", "Optimizer: AdamW (default), AdamW8bit, PagedAdamW8bit, "
      "Lion8bit, Lion, SGDNesterov, SGDNesterov8bit, AdaFactor, Prodigy, AdamWScheduleFree, "
      "RAdamScheduleFree, or a dotted class path. Checked when the optimizer is built.", "optimizer"),
    O("optimizer_args", "kv_literal", None, "Extra key=value optimizer arguments, values read as "
      "Python literals, e.g. weight_decay=0.01 betas=0.9,0.999. TOML: a list of 'key=value' strings "
      "or a table.", "optimizer"),
    O("learning_rate", "float", 2e-6, "Learning rate (sd-scripts' default 2e-6; LoRA usually wants "
      "about 1e-4).", "optimizer", min=0),
    O("unet_lr", "float", None, "Learning rate of the U-Net part of the network; unset = "
      "learning_rate.", "optimizer", scripts=LORA, min=0),
    O("text_encoder_lr", "float_or_list", None, "Learning rate of the text encoder(s); one value, or "
      "one per text encoder (SDXL: two). Unset = learning_rate.", "optimizer", min=0,
      aliases=("learning_rate_te",)),
    O("lr_scheduler", "str", "constant", "Learning-rate schedule.", "optimizer", choices=LR_SCHEDULERS),
    O("lr_warmup_steps", "steps_or_fraction", 0, "Warmup length: a number of optimizer steps, or a "
      "float below 1 (or 'N%') for that fraction of all steps.", "optimizer", min=0),
    O("lr_scheduler_num_cycles", "int", 1, "Number of restarts of cosine_with_restarts.", "optimizer",
      min=1),
    O("lr_scheduler_power", "float", 1.0, "Power of the polynomial schedule.", "optimizer", min=0),
    O("max_grad_norm", "float", 1.0, "Clip the global gradient norm to this; 0 = no clipping.",
      "optimizer", min=0),
    # --- training ---
    O("train_batch_size", "int", 1, "Batch size per process.", "training", min=1),
    O("max_train_steps", "int", None, "Training length in optimizer steps. Give this or "
      "max_train_epochs (epochs win if both are given).", "training", min=1),
    O("max_train_epochs", "int", None, "Training length in epochs (takes precedence over "
      "max_train_steps).", "training", min=1),
    O("gradient_accumulation_steps", "int", 1, "Micro-batches per optimizer step.", "training", min=1),
    O("gradient_checkpointing", "bool", False, "Recompute activations in the backward pass to save "
      "memory.", "training"),
    O("mixed_precision", "str", "no", "Autocast precision; fp16 (with loss scaling) needs a CUDA GPU, "
      "bf16 also runs on the CPU.", "training", choices=("no", "fp16", "bf16")),
    O("ddp_timeout", "int", None, "Minutes a process waits for the others in a collective before the "
      "job fails (multi-process runs); unset = 30.", "training", min=1),
    O("seed", "int", 42, "Random seed. Unlike sd-scripts (random when unset) the default is fixed, so "
      "that two runs of the same config give the same weights.", "training", min=0),
    O("train_text_encoder", "bool", False, "Also train the text encoder(s).", "training", scripts=FULL),
    O("prior_loss_weight", "float", 1.0, "Loss weight of regularisation images.", "training",
      scripts=DB_LORA, min=0),
    # --- saving ---
    O("output_dir", "path", None, "Folder for the trained files. Required (except with --dry_run).",
      "saving"),
    O("output_name", "str", "last", "Base name of the trained files: <output_name>.safetensors, "
      "<output_name>-000001.safetensors per epoch, <output_name>-step00000100.safetensors per step.",
      "saving"),
    O("save_model_as", "str", "safetensors", "File format of saved models.", "saving",
      choices_by_script={
          "train_lora": ("safetensors", "ckpt", "pt"),
          "train_dreambooth": ("safetensors", "ckpt", "diffusers", "diffusers_safetensors"),
          "finetune": ("safetensors", "ckpt", "diffusers", "diffusers_safetensors"),
      }),
    O("save_precision", "str", None, "Cast saved weights to this precision; unset = as trained.",
      "saving", choices=("float", "fp16", "bf16")),
    O("save_every_n_epochs", "int", None, "Also save every N epochs.", "saving", min=1),
    O("save_every_n_steps", "int", None, "Also save every N steps.", "saving", min=1),
)

OPTIONS_BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}
ALIASES: dict[str, str] = {a: o.name for o in OPTIONS for a in o.aliases}


@dataclass(frozen=True)
class SdScriptsName:
    """An sd-scripts option name this toolkit does not implement.

    kind: "flag" (store_true), "value" (one value) or "list" (nargs="*") on the command line.
    off: the values meaning "not used" (sd-scripts' default); such a setting is accepted silently.
    action: "ignore" (warn that it has no effect) or "reject" (error: not supported yet).
    """

    name: str
    kind: str
    action: str
    why: str
    off: tuple = field(default=(None, False))


def _n(name, kind, action, why, off=None):
    if off is None:
        off = {"flag": (None, False), "value": (None, ""), "list": (None, ())}[kind]
    return SdScriptsName(name, kind, action, why, tuple(off))


_IGN, _REJ = "ignore", "reject"

SD_SCRIPTS_NAMES: tuple[SdScriptsName, ...] = (
    # logging (library/utils.py add_logging_arguments) and trackers
    _n("console_log_level", "value", _IGN, "console logging is not configurable here"),
    _n("console_log_file", "value", _IGN, "console logging is not configurable here"),
    _n("console_log_simple", "flag", _IGN, "console logging is not configurable here"),
    _n("log_with", "value", _IGN, "trackers are not supported yet"),
    _n("logging_dir", "value", _IGN, "TensorBoard logging is not implemented yet"),
    _n("log_prefix", "value", _IGN, "log folder naming"),
    _n("log_tracker_name", "value", _IGN, "trackers are not supported"),
    _n("log_tracker_config", "value", _IGN, "trackers are not supported"),
    _n("wandb_run_name", "value", _IGN, "wandb is not supported"),
    _n("wandb_api_key", "value", _IGN, "wandb is not supported"),
    _n("log_config", "flag", _IGN, "trackers are not supported"),
    # model
    _n("tokenizer_cache_dir", "value", _IGN, "tokenizers are shipped; see tokenizer_path"),
    _n("disable_mmap_load_safetensors", "flag", _IGN, "loading speed only"),
    _n("mem_eff_attn", "flag", _IGN, "SDPA attention is used, which is memory-efficient"),
    _n("diffusers_xformers", "flag", _IGN, "use xformers"),
    _n("torch_compile", "flag", _IGN, "speed only"),
    _n("dynamo_backend", "value", _IGN, "speed only", off=(None, "inductor")),
    _n("highvram", "flag", _IGN, "memory housekeeping only"),
    _n("lowram", "flag", _REJ, "loading models straight to the GPU is a memory feature not implemented yet"),
    _n("fp8_base", "flag", _REJ, "fp8 base weights change the computation"),
    _n("fp8_base_unet", "flag", _REJ, "fp8 base weights change the computation"),
    _n("full_fp16", "flag", _REJ, "fp16 weights and gradients change the computation"),
    _n("full_bf16", "flag", _REJ, "bf16 weights and gradients change the computation"),
    _n("max_token_length", "value", _REJ, "long prompts (150/225 tokens) change the text conditioning",
       off=(None, 75)),
    _n("no_token_padding", "flag", _REJ, "changes the text conditioning"),
    _n("weighted_captions", "flag", _REJ, "changes the text conditioning"),
    # model-spec / metadata (library/sai_model_spec.py)
    *(_n(f"metadata_{k}", "value", _IGN, "extra model-spec metadata is not written")
      for k in ("title", "author", "description", "license", "tags", "usage_hint", "thumbnail",
                "merged_from", "trigger_phrase", "preprocessor", "is_negative_embedding")),
    _n("training_comment", "value", _IGN, "not written to the metadata"),
    _n("no_metadata", "flag", _REJ, "metadata is always written; not writing it is not implemented yet"),
    # dataset (train_util.add_dataset_arguments)
    _n("cache_info", "flag", _IGN, "speeds up dataset scanning only"),
    _n("skip_cache_check", "flag", _IGN, "cache speed only"),
    _n("caption_separator", "value", _IGN, "only used by caption shuffling and dropout", off=(None, ",")),
    _n("shuffle_caption", "flag", _REJ, "caption shuffling changes the captions"),
    _n("keep_tokens", "value", _REJ, "caption shuffling changes the captions", off=(None, 0)),
    _n("keep_tokens_separator", "value", _REJ, "changes the captions", off=(None, "")),
    _n("secondary_separator", "value", _REJ, "changes the captions", off=(None, "")),
    _n("enable_wildcard", "flag", _REJ, "changes the captions"),
    _n("caption_prefix", "value", _REJ, "changes the captions", off=(None, "")),
    _n("caption_suffix", "value", _REJ, "changes the captions", off=(None, "")),
    _n("caption_dropout_rate", "value", _REJ, "caption dropout changes the captions", off=(None, 0)),
    _n("caption_dropout_every_n_epochs", "value", _REJ, "caption dropout changes the captions", off=(None, 0)),
    _n("caption_tag_dropout_rate", "value", _REJ, "caption dropout changes the captions", off=(None, 0)),
    _n("token_warmup_min", "value", _REJ, "token warmup changes the captions", off=(None, 1)),
    _n("token_warmup_step", "value", _REJ, "token warmup changes the captions", off=(None, 0)),
    _n("color_aug", "flag", _REJ, "augmentation changes the images"),
    _n("flip_aug", "flag", _REJ, "augmentation changes the images"),
    _n("face_crop_aug_range", "value", _REJ, "augmentation changes the images"),
    _n("random_crop", "flag", _REJ, "augmentation changes the images"),
    _n("resize_interpolation", "value", _REJ, "changes the images"),
    _n("alpha_mask", "flag", _REJ, "masked loss changes the loss"),
    _n("masked_loss", "flag", _REJ, "masked loss changes the loss"),
    _n("conditioning_data_dir", "value", _REJ, "masked loss changes the loss"),
    _n("cache_latents_to_disk", "flag", _REJ, "the disk latent cache comes with the data pipeline; use cache_latents"),
    _n("cache_text_encoder_outputs", "flag", _REJ, "text encoder output caching is not implemented yet"),
    _n("cache_text_encoder_outputs_to_disk", "flag", _REJ, "text encoder output caching is not implemented yet"),
    _n("debug_dataset", "flag", _REJ, "dataset preview instead of training is not implemented"),
    _n("dataset_class", "value", _REJ, "custom dataset classes are not supported"),
    _n("in_json", "value", _REJ, "fine-tuning metadata JSON is not implemented yet"),
    _n("dataset_repeats", "value", _REJ, "fine-tuning metadata JSON is not implemented yet", off=(None, 1)),
    _n("persistent_data_loader_workers", "flag", _IGN, "speed only"),
    # validation (train_network.py)
    _n("validation_split", "value", _REJ, "a validation split removes images from training", off=(None, 0)),
    _n("validation_seed", "value", _IGN, "validation is not implemented yet"),
    _n("validate_every_n_steps", "value", _IGN, "validation is not implemented yet"),
    _n("validate_every_n_epochs", "value", _IGN, "validation is not implemented yet"),
    _n("max_validation_steps", "value", _IGN, "validation is not implemented yet"),
    # hub
    *(_n(k, "value", _IGN, "hub upload is not supported")
      for k in ("huggingface_repo_id", "huggingface_repo_type", "huggingface_path_in_repo",
                "huggingface_token", "huggingface_repo_visibility")),
    _n("save_state_to_huggingface", "flag", _IGN, "hub upload is not supported"),
    _n("resume_from_huggingface", "flag", _IGN, "hub upload is not supported"),
    _n("async_upload", "flag", _IGN, "hub upload is not supported"),
    # saving and resuming
    _n("save_state", "flag", _REJ, "training state saving is not implemented yet"),
    _n("save_state_on_train_end", "flag", _REJ, "training state saving is not implemented yet"),
    _n("resume", "value", _REJ, "resuming is not implemented yet"),
    _n("save_n_epoch_ratio", "value", _REJ, "the files it asks for would not be written; use save_every_n_epochs"),
    _n("save_last_n_epochs", "value", _IGN, "older checkpoints are kept"),
    _n("save_last_n_epochs_state", "value", _IGN, "older checkpoints are kept"),
    _n("save_last_n_steps", "value", _IGN, "older checkpoints are kept"),
    _n("save_last_n_steps_state", "value", _IGN, "older checkpoints are kept"),
    _n("use_safetensors", "flag", _IGN, "safetensors is already the default of save_model_as"),
    _n("output_config", "flag", _REJ, "writing the arguments to a config and exiting is not implemented"),
    _n("skip_until_initial_step", "flag", _REJ, "changes which steps are trained"),
    _n("initial_epoch", "value", _REJ, "changes which steps are trained"),
    _n("initial_step", "value", _REJ, "changes which steps are trained"),
    # sampling
    *(_n(k, "value", _IGN, "sample images are not generated yet")
      for k in ("sample_every_n_steps", "sample_every_n_epochs", "sample_prompts")),
    _n("sample_sampler", "value", _IGN, "sample images are not generated yet", off=(None, "ddim")),
    _n("sample_at_first", "flag", _IGN, "sample images are not generated yet"),
    # noise, timesteps and loss (train_util + custom_train_functions)
    _n("noise_offset", "value", _REJ, "changes the noise", off=(None, 0)),
    _n("noise_offset_random_strength", "flag", _REJ, "changes the noise"),
    _n("adaptive_noise_scale", "value", _REJ, "changes the noise", off=(None, 0)),
    _n("multires_noise_iterations", "value", _REJ, "changes the noise", off=(None, 0)),
    _n("multires_noise_discount", "value", _IGN, "only used with multires_noise_iterations", off=(None, 0.3)),
    _n("ip_noise_gamma", "value", _REJ, "changes the noise", off=(None, 0)),
    _n("ip_noise_gamma_random_strength", "flag", _REJ, "changes the noise"),
    _n("zero_terminal_snr", "flag", _REJ, "changes the noise schedule"),
    _n("min_timestep", "value", _REJ, "changes the timestep range", off=(None, 0)),
    _n("max_timestep", "value", _REJ, "changes the timestep range", off=(None, 1000)),
    _n("loss_type", "value", _REJ, "only the l2 (MSE) loss is implemented", off=(None, "l2")),
    _n("huber_schedule", "value", _IGN, "only used with loss_type huber/smooth_l1", off=(None, "snr")),
    _n("huber_c", "value", _IGN, "only used with loss_type huber/smooth_l1", off=(None, 0.1)),
    _n("huber_scale", "value", _IGN, "only used with loss_type huber/smooth_l1", off=(None, 1.0)),
    _n("min_snr_gamma", "value", _REJ, "changes the loss weighting", off=(None, 0)),
    _n("scale_v_pred_loss_like_noise_pred", "flag", _REJ, "changes the loss weighting"),
    _n("v_pred_like_loss", "value", _REJ, "changes the loss", off=(None, 0)),
    _n("debiased_estimation_loss", "flag", _REJ, "changes the loss weighting"),
    # optimizer and schedule
    _n("use_8bit_adam", "flag", _REJ, "use optimizer_type = \"AdamW8bit\""),
    _n("use_lion_optimizer", "flag", _REJ, "use optimizer_type = \"Lion\""),
    _n("lr_scheduler_type", "value", _REJ, "custom scheduler classes are not supported", off=(None, "")),
    _n("lr_scheduler_args", "list", _REJ, "custom scheduler arguments are not supported", off=(None, ())),
    _n("lr_decay_steps", "value", _REJ, "changes the schedule", off=(None, 0)),
    _n("lr_scheduler_timescale", "value", _REJ, "changes the schedule"),
    _n("lr_scheduler_min_lr_ratio", "value", _REJ, "changes the schedule"),
    _n("learning_rate_te1", "value", _REJ, "use text_encoder_lr = [te1, te2]"),
    _n("learning_rate_te2", "value", _REJ, "use text_encoder_lr = [te1, te2]"),
    _n("block_lr", "value", _REJ, "per-block learning rates are not implemented"),
    _n("stop_text_encoder_training", "value", _REJ, "changes what is trained"),
    _n("fused_backward_pass", "flag", _REJ, "not implemented yet (a memory feature a run may depend on)"),
    _n("fused_optimizer_groups", "value", _REJ, "not implemented yet (a memory feature a run may depend on)", off=(None, 0)),
    _n("cpu_offload_checkpointing", "flag", _REJ, "not implemented yet (a memory feature a run may depend on)"),
    _n("blocks_to_swap", "value", _REJ, "not implemented yet (a memory feature a run may depend on)", off=(None, 0)),
    # network (train_network.py)
    _n("dim_from_weights", "flag", _REJ, "set network_dim to the rank of network_weights"),
    _n("scale_weight_norms", "value", _REJ, "changes the trained weights"),
    _n("base_weights", "list", _REJ, "merging networks before training is not implemented", off=(None, ())),
    _n("base_weights_multiplier", "list", _REJ, "merging networks before training is not implemented", off=(None, ())),
    # distributed (accelerate does DDP; deepspeed is not supported)
    _n("ddp_gradient_as_bucket_view", "flag", _IGN, "DDP performance setting"),
    _n("ddp_static_graph", "flag", _IGN, "DDP performance setting"),
    _n("deepspeed", "flag", _REJ, "DeepSpeed is not supported"),
    _n("zero_stage", "value", _IGN, "only used with deepspeed", off=(None, 2)),
    _n("offload_optimizer_device", "value", _IGN, "only used with deepspeed"),
    _n("offload_optimizer_nvme_path", "value", _IGN, "only used with deepspeed"),
    _n("offload_param_device", "value", _IGN, "only used with deepspeed"),
    _n("offload_param_nvme_path", "value", _IGN, "only used with deepspeed"),
    _n("zero3_init_flag", "flag", _IGN, "only used with deepspeed"),
    _n("zero3_save_16bit_model", "flag", _IGN, "only used with deepspeed"),
    _n("fp16_master_weights_and_gradients", "flag", _REJ, "changes the computation"),
)

SD_SCRIPTS_BY_NAME: dict[str, SdScriptsName] = {n.name: n for n in SD_SCRIPTS_NAMES}


def options_for(script: str) -> list[Option]:
    return [o for o in OPTIONS if script in o.scripts]


def _check_schema() -> None:
    """Catch mistakes in the tables above at import (cheap)."""
    names = [o.name for o in OPTIONS] + list(ALIASES) + [n.name for n in SD_SCRIPTS_NAMES]
    dup = {n for n in names if names.count(n) > 1}
    assert not dup, f"option names defined twice: {sorted(dup)}"
    for o in OPTIONS:
        assert o.section in SECTIONS and set(o.scripts) <= set(SCRIPTS), o.name
    for n in SD_SCRIPTS_NAMES:
        assert n.kind in ("flag", "value", "list") and n.action in (_IGN, _REJ), n.name


_check_schema()


def render_markdown() -> str:
    """docs/OPTIONS.md, generated from the tables above (a test keeps the file in sync)."""
    out = ["# Options", "",
           "Generated from `library/options.py` by `python -m library.options > docs/OPTIONS.md`; "
           "do not edit by hand.", "",
           "Every option can be given on the command line (`--name value`) or in a run TOML "
           "(`name = value`, in any table except `[general]`/`[[datasets]]`, which hold the dataset "
           "config). The command line overrides the file. Boolean flags: `--flag` sets true; "
           "`--flag=false` / `--flag false` (also `true/1/0/yes/no/on/off`) sets a value, which is how "
           "a default-true option such as `--sdpa` is turned off. Relative paths, in a file or on the "
           "command line, are relative to the current directory (as in sd-scripts).", "",
           "Scripts: `lora` = train_lora.py, `db` = train_dreambooth.py, `ft` = finetune.py.", ""]
    short = {"train_lora": "lora", "train_dreambooth": "db", "finetune": "ft"}
    for sec, title in SECTIONS.items():
        out += [f"## {title}", "", "| option | type | default | scripts | allowed | description |",
                "|---|---|---|---|---|---|"]
        for o in OPTIONS:
            if o.section != sec:
                continue
            if o.choices_by_script:
                allowed = "; ".join(f"{short[s]}: {', '.join(c)}" for s, c in o.choices_by_script.items())
            elif o.choices:
                allowed = ", ".join(o.choices)
            else:
                allowed = o.range_text()
            name = f"`{o.name}`" + "".join(f" (alias `{a}`)" for a in o.aliases)
            scripts = "all" if o.scripts == ALL else ", ".join(short[s] for s in o.scripts)
            out.append(f"| {name} | {o.type} | {_md_default(o.default)} | {scripts} | {allowed} | "
                       f"{o.help}{' Command line only.' if o.cli_only else ''} |")
        out.append("")
    out += ["## Rules between options", "",
            "- `max_train_steps` or `max_train_epochs` is required; with both, epochs win (with a warning).",
            "- `network_train_unet_only` and `network_train_text_encoder_only` exclude each other.",
            "- `pretrained_model_name_or_path` is required; `train_data_dir` is required unless a "
            "dataset config is given; `resolution` is required unless a dataset config is given; "
            "`output_dir` is required unless `dry_run`.",
            "- `min_bucket_reso <= max_bucket_reso`, both multiples of `bucket_reso_steps`, itself a multiple of 8.",
            "- `xformers` takes precedence over `sdpa` and needs the xformers package.",
            "- The same option given twice in one file (e.g. in two tables, or by its alias) is an error.",
            "",
            "## Config files", "",
            "- A run TOML (`--config run.toml`, alias `--config_file`; `.toml` is appended if missing, as "
            "in sd-scripts) may put options at the top level or in any tables; table names are free-form "
            "(`[model_arguments]`, `[training_arguments]`, ...). `[general]` and `[[datasets]]` are the "
            "dataset config, kept for the data pipeline; a separate `dataset_config` file may hold them "
            "instead (not both).",
            "- Values must have the option's TOML type (a string is not a number); integers are accepted "
            "for floats, and whole floats for integers. An empty string for an unset path (as sd-scripts "
            "GUIs write) means unset.",
            "- `optimizer_args` / `network_args`: a list of `\"key=value\"` strings, one string of "
            "space-separated pairs, or a table. `optimizer_args` values are read as Python literals "
            "(`betas=0.9,0.999` -> `(0.9, 0.999)`; a TOML list becomes a tuple), `network_args` values are "
            "passed to the network module as strings, as sd-scripts does.",
            "- Unknown names are errors with the closest valid name; every error is one line naming the "
            "option, and for files the file and line.",
            ""]
    ign = [n for n in SD_SCRIPTS_NAMES if n.action == _IGN]
    rej = [n for n in SD_SCRIPTS_NAMES if n.action == _REJ]
    out += ["## sd-scripts options accepted with no effect", "",
            "These kohya-ss/sd-scripts options cannot change the trained weights or the data, so a config "
            "that sets them still loads; each one that is set (to anything but its sd-scripts default) "
            "prints one warning `option NAME has no effect in this toolkit`.", "",
            "| option | why it has no effect |", "|---|---|"]
    out += [f"| `{n.name}` | {n.why} |" for n in ign]
    out += ["", "## sd-scripts options rejected (not supported yet)", "",
            "Ignoring these would silently change the training math, the data, what is trained or "
            "which files appear, so a config that sets them is an error, unless it sets them to their "
            "sd-scripts default (shown), which is accepted silently.", "",
            "| option | off value accepted | why |", "|---|---|---|"]
    out += [f"| `{n.name}` | {_md_off(n)} | {n.why} |" for n in rej]
    out.append("")
    return "\n".join(out)


def _md_default(v) -> str:
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "true" if v else "false"
    return f"`{v}`"


def _md_off(n: SdScriptsName) -> str:
    vals = [v for v in n.off if v is not None and v != ()]
    if n.kind == "flag":
        return "false"
    return ", ".join(f"`{v!r}`" if isinstance(v, str) else f"`{v}`" for v in vals) or "unset"


if __name__ == "__main__":
    print(render_markdown(), end="")
