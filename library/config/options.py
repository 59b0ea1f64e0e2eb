"""The option schema: the single source of truth for every option of every entry script.

Each `Option` carries its type, default, help text, the entry scripts that accept it and its
allowed values. `library.config.parse` generates the argparse parser, `--help`, the TOML loading and
validation from it; `docs/OPTIONS.md` is generated from it (`python -m library.config.options`).

`SD_SCRIPTS_NAMES` lists every other option name of kohya-ss/sd-scripts' `train_network.py`,
`sdxl_train_network.py`, `train_db.py`, `fine_tune.py` and `sdxl_train.py`, so that their configs
load: a name whose absence cannot change the trained weights or the data is accepted with a
one-line warning ("ignore"); a name that would change the training math, the data, what is
trained or which files appear is rejected with a "not supported yet" error ("reject"), unless
it is set to its sd-scripts default (off), which is accepted silently.

This module imports nothing heavy: `--help` must print in well under a second.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any

# the scripts that train from images; train_leco trains from prompts only (LECO_OPTIONS below)
IMAGE_SCRIPTS = ("train_lora", "train_dreambooth", "finetune", "train_textual_inversion")
SCRIPTS = IMAGE_SCRIPTS + ("train_leco",)
METHOD_OF_SCRIPT = {"train_lora": "lora", "train_dreambooth": "dreambooth", "finetune": "finetune",
                    "train_textual_inversion": "textual_inversion"}
ALL = IMAGE_SCRIPTS
LECO = ("train_leco",)
LORA = ("train_lora",)
DB_LORA = ("train_lora", "train_dreambooth")
FULL = ("train_dreambooth", "finetune")
TI = ("train_textual_inversion",)
# options that do not apply to textual inversion (its text encoder runs every step, nothing but
# the new embedding rows trains): train_textual_inversion rejects them by name
NOT_TI = ("train_lora", "train_dreambooth", "finetune")

# Sections group options in --help and in docs/OPTIONS.md, in this order.
SECTIONS = {
    "config": "Configuration files and run control",
    "model": "Model",
    "dataset": "Dataset",
    "network": "Network (LoRA)",
    "embedding": "Textual inversion and pivotal tuning (new tokens)",
    "optimizer": "Optimizer and learning rate",
    "training": "Training",
    "loss": "Noise, timesteps and loss",
    "saving": "Saving",
    "logging": "Logging, validation and sample images",
    "leco": "LECO: concept erasing and sliders from prompts (train_leco.py)",
}

# torch.compile backends for dynamo_backend (sd-scripts' choices that torch still has, and the GUI's "no")
DYNAMO_BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs", "no")
# sd-scripts' sampler names (library/training/sampling.py maps them to diffusers' schedulers)
SD_SAMPLERS = ("ddim", "pndm", "lms", "euler", "euler_a", "heun", "dpm_2", "dpm_2_a", "dpmsolver",
               "dpmsolver++", "dpmsingle", "k_lms", "k_euler", "k_euler_a", "k_dpm_2", "k_dpm_2_a")
LOSS_TYPES = ("l2", "l1", "huber", "smooth_l1")
# library/training/optim.py build_scheduler draws each of these curves (docs/OPTIMIZERS.md)
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts",
                 "polynomial", "cosine_with_min_lr", "warmup_stable_decay", "inverse_sqrt",
                 "piecewise_constant", "adafactor")


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
    path_list            paths: a TOML list of strings or one string; on the command line several values
    float_list           numbers: a TOML list, or a comma-separated string ("1e-6,2e-6", as sd-scripts'
                         block_lr); on the command line several values, each possibly comma-separated
    str_list             words: a TOML list of strings or one string; on the command line several values
    int_list             integers: a TOML list or one integer; on the command line several values
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
    O("dry_run", "bool", False, "Print the step plan and the memory estimate and exit without "
      "loading any weights (the estimate builds the model from its configuration on fake tensors).",
      "config"),
    O("debug_dataset", "bool", False, "Write <output_dir>/<output_name>_debug_dataset.png, a "
      "contact sheet of the first global batches of epoch 1 as they would train (flip, crop, "
      "color_aug, captions as augmented), log each sample, and exit without loading any weights "
      "(sd-scripts opens a window instead).", "config"),
    # --- model ---
    O("pretrained_model_name_or_path", "str", None, "Base model: a diffusers folder, a single-file "
      ".safetensors/.ckpt checkpoint, a hub id (online only) or a built-in model (each family's tiny "
      "models, e.g. tiny-sd15, tiny-sdxl, tiny-flux; docs/MODELS.md lists them). The family comes "
      "from the weights (a transformer file or diffusers folder is told from its keys). Required.", "model"),
    O("v2", "bool", False, "The base model is Stable Diffusion 2.x (normally detected from the weights).",
      "model"),
    O("v_parameterization", "bool", False, "Train with the v-prediction target (SD 2.x 768-v models; "
      "normally detected from the scheduler config).", "model"),
    O("vae", "path", None, "Replace the model's VAE with this file or diffusers folder.", "model"),
    O("no_half_vae", "bool", False, "Keep the VAE in float32 under mixed precision.", "model"),
    O("clip_skip", "int", None, "Use the output of the n-th last text encoder layer (2 = penultimate); "
      "unset = the last layer.", "model", min=1),
    O("max_token_length", "int", None, "Longest caption in tokens: 75 (unset), 150 or 225. As sd-scripts: "
      "a longer caption is split into windows of 75 tokens, each encoded as BOS ... EOS, and the "
      "states concatenated (152 / 227 instead of 77); for training captions, the text-encoder cache, "
      "validation and sample prompts.", "model", choices=(75, 150, 225)),
    O("no_token_padding", "bool", False, "Tokenize training captions without padding to 77 tokens, so "
      "the U-Net attends only to the caption's own tokens (sd-scripts' train_db.py). SD1/SD2 only; "
      "needs train_batch_size = 1 and excludes cache_text_encoder_outputs and max_token_length. "
      "Validation and sample prompts are padded as usual (as sd-scripts' sampling).", "model",
      scripts=("train_dreambooth",)),
    O("weighted_captions", "bool", False, "Read A1111-style prompt weights in captions, as sd-scripts: "
      "(word:1.2), (word) = x1.1, [word] = /1.1, \\( for a literal bracket; each token's text-encoder "
      "hidden states are multiplied by its weight (no mean renormalisation, SDXL's pooled output "
      "unweighted). Also applies to validation and sample prompts. docs/WEIGHTED_CAPTIONS.md.", "model"),
    O("tokenizer_path", "path", None, "Folder with the CLIP tokenizer files (for single-file checkpoints "
      "whose tokenizer is not next to them; the project ships CLIP's).", "model"),
    O("allow_pickle", "bool", False, "Allow loading a .ckpt that needs full pickle unpickling (can run "
      "arbitrary code). Without it .ckpt files load with torch.load(weights_only=True).", "model"),
    # FLUX.1 / SD3 sources and text options (sd-scripts' names; library/models/flow_family.py)
    O("clip_l", "path", None, "FLUX.1 / SD3: the CLIP-L text encoder file beside a single-file "
      "transformer (sd-scripts' --clip_l); a diffusers folder's own is replaced by it.", "model",
      scripts=NOT_TI),
    O("clip_g", "path", None, "SD3: the CLIP-G text encoder file (sd-scripts' --clip_g); replaces "
      "the main file's own.", "model", scripts=NOT_TI),
    O("t5xxl", "path", None, "FLUX.1 / SD3: the T5-XXL text encoder file beside a single-file "
      "transformer (sd-scripts' --t5xxl); SD3 without one (and with none in its file) trains with "
      "77 zero tokens in T5's place, as sd-scripts.", "model", scripts=NOT_TI),
    O("ae", "path", None, "FLUX.1 / SD3: the 16-channel autoencoder file beside a single-file "
      "transformer (sd-scripts' --ae).", "model", scripts=NOT_TI),
    O("t5xxl_max_token_length", "int", None, "FLUX.1 / SD3: T5 prompt length in tokens; unset = "
      "sd-scripts' default (FLUX.1 dev 512, schnell 256; SD3 256).", "model", scripts=NOT_TI, min=1),
    # Anima's sources and text options (sd-scripts' anima_train_utils; library/models/families/anima/)
    O("qwen3", "path", None, "Anima: the Qwen3-0.6B text encoder, a Hugging Face folder or one "
      ".safetensors file with its tokenizer files beside it (sd-scripts' --qwen3).", "model",
      scripts=NOT_TI),
    O("llm_adapter_path", "path", None, "Anima: the LLM adapter's weights in their own file; unset = "
      "the adapter inside the DiT file (sd-scripts' --llm_adapter_path).", "model", scripts=NOT_TI),
    O("t5_tokenizer_path", "path", None, "Anima: folder of the T5 tokenizer whose ids the LLM adapter "
      "embeds; unset = T5 v1.1's from the local Hugging Face cache (sd-scripts' bundled t5_old).",
      "model", scripts=NOT_TI),
    O("qwen3_max_token_length", "int", None, "Anima: Qwen3 prompt length in tokens; unset = 512 "
      "(sd-scripts' default).", "model", scripts=NOT_TI, min=1),
    O("t5_max_token_length", "int", None, "Anima: T5 token ids the LLM adapter reads; unset = 512 "
      "(sd-scripts' default).", "model", scripts=NOT_TI, min=1),
    O("attn_mode", "str", None, "Anima: the DiT's attention kernel (sd-scripts' --attn_mode): torch or "
      "sdpa = PyTorch's SDPA (the default); flash = flash_attn's kernel, xformers = xformers' "
      "memory-efficient attention (each on CUDA with its package installed, refused in one line "
      "otherwise); sageattn is refused (no backward pass: sd-scripts' inference-only kernel).", "model",
      scripts=NOT_TI, choices=("torch", "sdpa", "flash", "xformers", "sageattn")),
    O("split_attn", "bool", False, "Anima: the DiT's attention one sample at a time instead of over the "
      "whole batch (sd-scripts' --split_attn): less peak memory, the same result.", "model", scripts=NOT_TI),
    O("vae_chunk_size", "int", None, "Anima: the Qwen-Image VAE's convolutions in row chunks of this many "
      "output rows (sd-scripts' --vae_chunk_size), for encoding (latent caching) and decoding (samples): "
      "less peak memory, the same latents; unset or 0 = whole images.", "model", scripts=NOT_TI, min=0),
    O("vae_disable_cache", "bool", False, "Anima: run the Qwen-Image VAE without its causal feature cache "
      "(sd-scripts' --vae_disable_cache); for single images the latents are the same.", "model",
      scripts=NOT_TI),
    O("apply_lg_attn_mask", "bool", False, "SD3: pass the CLIP-L / CLIP-G padding masks to the "
      "encoders (sd-scripts' --apply_lg_attn_mask).", "model", scripts=NOT_TI),
    O("apply_t5_attn_mask", "bool", False, "FLUX.1 / SD3: pass the T5 padding mask to T5 (FLUX.1: "
      "also to the transformer's attention; sd-scripts' --apply_t5_attn_mask).", "model", scripts=NOT_TI),
    # SD3's text-encoder dropout (sd-scripts' sd3_train_utils; library/models/flow_family.py)
    O("clip_l_dropout_rate", "float", 0.0, "SD3: probability that a training sample's CLIP-L output "
      "(its states and pooled part) is zeros, drawn per sample and epoch (sd-scripts' "
      "--clip_l_dropout_rate); also with cache_text_encoder_outputs.", "model", scripts=NOT_TI,
      min=0, max=1),
    O("clip_g_dropout_rate", "float", 0.0, "SD3: likewise for CLIP-G's output (sd-scripts' "
      "--clip_g_dropout_rate).", "model", scripts=NOT_TI, min=0, max=1),
    O("t5_dropout_rate", "float", 0.0, "SD3: likewise for T5's states (sd-scripts' --t5_dropout_rate); "
      "without T5 they are zeros anyway.", "model", scripts=NOT_TI, min=0, max=1),
    # SD3.5's position-embedding options (sd-scripts' sd3_train_utils; library/models/families/sd3/sd3.py)
    O("pos_emb_random_crop_rate", "float", 0.0, "SD3: probability that a training sample's "
      "position embedding is a random crop of the table (every offset alike) instead of its "
      "centre, drawn per sample and epoch (sd-scripts' --pos_emb_random_crop_rate, meant for "
      "SD3.5 medium); samples and validation use the centre.", "model", scripts=NOT_TI, min=0,
      max=1),
    O("enable_scaled_pos_embed", "bool", False, "SD3: position embeddings scaled per dataset "
      "resolution for multi-resolution training (sd-scripts' --enable_scaled_pos_embed, meant for "
      "SD3.5 medium): each dataset resolution's latent size s gets a sin-cos table of 1.5 s / 2 "
      "patches whose centre s / 2 patches span the positions of 16 patches; a latent takes the "
      "table of its area (the midpoints between the sizes' areas divide them), also in samples "
      "and validation.", "model", scripts=NOT_TI),
    O("model_type", "str", None, "sd-scripts' flux_train_network.py --model_type (\"flux\", "
      "\"chroma\"; the kohya_ss GUI's FLUX.1 model type): the family the weights must be. The family "
      "comes from the weights; a given model_type that differs stops before any weight loads. Unset: "
      "any family (each family's model_type: docs/MODELS.md).", "model", scripts=NOT_TI),
    # Lumina 2 (sd-scripts' lumina_train_util; library/models/families/lumina/)
    O("gemma2", "path", None, "Lumina 2: the Gemma-2 2B text encoder (a .safetensors file or a transformers "
      "folder) beside a single-file transformer (sd-scripts' --gemma2); replaces a diffusers folder's own.",
      "model", scripts=NOT_TI),
    O("gemma2_max_token_length", "int", None, "Lumina 2: Gemma-2 prompt length in tokens, rounded up to a "
      "multiple of 8; unset = sd-scripts' 256.", "model", scripts=NOT_TI, min=1),
    O("system_prompt", "str", "", "Lumina 2: text put before every caption and sample prompt as "
      "\"<system_prompt> <Prompt Start> <caption>\" (sd-scripts' --system_prompt; empty: none).", "model",
      scripts=NOT_TI),
    O("use_flash_attn", "bool", False, "Lumina 2: the transformer attends with flash_attn's kernels "
      "(CUDA, the flash-attn package).", "model", scripts=NOT_TI),
    O("use_sage_attn", "bool", False, "Lumina 2: sageattention's kernel in no-grad forwards (samples, "
      "validation; it has no backward pass, so training forwards use SDPA).", "model", scripts=NOT_TI),
    O("sample_batch_size", "int", None, "Lumina 2: sample prompts rendered together, up to this many "
      "consecutive ones with the same size, steps, scale and CFG shaping, each image from its own seed's "
      "noise (sd-scripts' lumina --sample_batch_size); unset = train_batch_size.", "logging", scripts=NOT_TI,
      min=1),
    O("guidance_scale", "float", 3.5, "FLUX.1 dev: the distilled guidance input given to the "
      "transformer in training (sd-scripts' default 3.5); schnell has no guidance input.", "model",
      scripts=NOT_TI),
    O("sdpa", "bool", True, "Use PyTorch scaled-dot-product attention (default).", "model"),
    O("xformers", "bool", False, "Use xformers memory-efficient attention (needs the xformers extra); "
      "takes precedence over sdpa.", "model"),
    O("torch_compile", "bool", False, "Compile the U-Net's training forward with torch.compile "
      "(after the network hooks and gradient checkpointing; a U-Net that cannot be one graph is "
      "compiled block by block, with a warning, and so is every U-Net with fused_backward_pass "
      "or fused_optimizer_groups). Works under DDP (the graph is cut at DDP's buckets). The first "
      "step pays the compile time (logged); see docs/PERFORMANCE.md.", "model"),
    O("dynamo_backend", "str", "inductor", "torch.compile backend of torch_compile (sd-scripts' "
      "default inductor; aot_eager traces without generating code; \"no\" is the kohya_ss GUI's "
      "off, only valid without torch_compile).", "model", choices=DYNAMO_BACKENDS),
    # --- dataset ---
    O("train_data_dir", "path", None, "Folder of N_concept subfolders (N = repeats, concept = class "
      "tokens). Required unless a dataset config is given.", "dataset"),
    O("reg_data_dir", "path", None, "Folder of N_concept subfolders of regularisation images (prior "
      "preservation).", "dataset", scripts=DB_LORA + TI),
    O("num_class_images", "int", 0, "Prior preservation (diffusers' DreamBooth name): every reg folder "
      "(reg_data_dir's N_class folders, a dataset's is_reg subsets) that holds fewer images gets the "
      "missing ones generated with the base model before training, from its class tokens, image i "
      "with seed + i; kept in <reg folder>/.sdcache/class_images (or cache_dir/class_images) under a "
      "key of the model, prompt, seed, size, sampler, steps and scale, so a later run reuses them; "
      "never written over the user's images. 0 = off. docs/FINETUNING.md.", "dataset",
      scripts=DB_LORA + TI, min=0),
    O("class_image_steps", "int", None, "Sampling steps of the class images (num_class_images); unset = "
      "gen_img's default for the family (SD 50, FLUX.1 20, SD3 30).", "dataset", scripts=DB_LORA + TI,
      min=1),
    O("class_image_scale", "float", None, "CFG scale of the class images (num_class_images); unset = "
      "gen_img's default for the family (7.5; FLUX.1 1.0).", "dataset", scripts=DB_LORA + TI),
    O("class_image_sampler", "str", "ddim", "Sampler of the class images (num_class_images; SD; FLUX.1 / "
      "SD3 use their Euler sampler): the names of sample_sampler.", "dataset", scripts=DB_LORA + TI,
      choices=SD_SAMPLERS),
    O("in_json", "path", None, "Fine-tuning metadata instead of N_concept folders (sd-scripts' "
      "fine_tune.py): a JSON file {image: {\"caption\": ..., \"tags\": ...}} or a .jsonl file with "
      "one {\"image_path\", \"caption\", \"tags\"} per line; images are looked up in train_data_dir "
      "(by path, or by stem). The caption is caption + ', ' + tags.", "dataset"),
    O("dataset_repeats", "int", 1, "Repeats of every image listed by in_json.", "dataset", min=1),
    O("caption_extension", "str", ".caption", "Extension of caption files next to the images.",
      "dataset", aliases=("caption_extention",)),
    O("resolution", "resolution", None, "Training resolution: 'size' or 'width,height' (TOML: also an "
      "int or [w, h]); multiples of 8. Required unless the dataset config sets it.", "dataset"),
    O("cache_latents", "bool", False, "Encode every image with the VAE once, before training, and keep "
      "the latents in memory.", "dataset"),
    O("cache_latents_to_disk", "bool", False, "Also keep the cached latents on disk (safetensors files "
      "named by a hash of the image bytes, bucket, resize, flip, VAE and dtype), so later runs load "
      "them instead of running the VAE; implies cache_latents.", "dataset"),
    O("cache_dir", "path", None, "Folder for the disk caches; unset = <image folder>/.sdcache.",
      "dataset"),
    O("cache_text_encoder_outputs", "bool", False, "Encode every caption (and its augmented variants) "
      "with the text encoder(s) once, before training; SD/SDXL: the text encoders are then not trained "
      "(LoRA: needs network_train_unet_only, except with OFT, which puts no module on them). FLUX.1 / SD3 with trained CLIP encoders: only the "
      "frozen T5's outputs are cached and CLIP runs every step (sd-scripts' partial cache; not with "
      "train_t5xxl).", "dataset", scripts=NOT_TI),
    O("cache_text_encoder_outputs_to_disk", "bool", False, "Also keep the text-encoder outputs on disk "
      "(<image folder>/.sdcache or cache_dir, keyed by the processed caption, tokenizer, encoder, "
      "dtype and clip_skip); implies cache_text_encoder_outputs.", "dataset", scripts=NOT_TI),
    O("text_encoder_batch_size", "int", None, "Captions per text-encoder batch when caching their "
      "outputs (sd-scripts' FLUX.1 / SD3 option); unset = vae_batch_size (sd-scripts: the dataset's "
      "batch size). Speed and memory only.", "dataset", min=1, scripts=NOT_TI),
    O("text_encoder_cache_variants", "int", 4, "With cached text-encoder outputs and shuffle_caption or "
      "caption_tag_dropout_rate: augmented variants cached per caption, one picked per sample and "
      "epoch (caption dropout uses one cached empty caption).", "dataset", min=1, scripts=NOT_TI),
    O("flip_aug", "bool", False, "Mirror each sample horizontally with probability 1/2 (drawn per "
      "sample and epoch). With cached latents both variants are cached.", "dataset"),
    O("random_crop", "bool", False, "Crop at a random offset (per sample and epoch) instead of the "
      "center; cannot be combined with cache_latents.", "dataset"),
    O("color_aug", "bool", False, "sd-scripts' weak colour augmentation: with probability 0.33 per "
      "sample and epoch, half of the time a hue shift uniform in [-8, 8] on OpenCV's 0-180 scale "
      "(+-16 degrees), else pixel ** gamma with gamma uniform in [0.95, 1.05] on the 0-255 values "
      "(a brightness change, as sd-scripts), applied after the resize and crop. Also a subset key. "
      "Cannot be combined with cache_latents (docs/DATA_AUGMENTATION.md).", "dataset"),
    O("alpha_mask", "bool", False, "Masked loss from each image's alpha channel (transparent = not "
      "trained; an image without alpha: all ones); implies masked_loss. The colour channels are then "
      "used as stored, not composited over white.", "dataset"),
    O("conditioning_data_dir", "path", None, "Folder of mask images for masked_loss, one per "
      "training image with the same file stem (its red channel, 0-255 -> 0-1, scaled to the image); "
      "a missing mask is an error. Applies to train_data_dir images (dataset config: to subsets "
      "without is_reg and their own conditioning_data_dir). Needs masked_loss.", "dataset"),
    O("shuffle_caption", "bool", False, "Shuffle the caption's comma-separated tags each epoch "
      "(after the first keep_tokens).", "dataset"),
    O("caption_separator", "str", ",", "Separator of caption tags for shuffling and tag dropout.",
      "dataset"),
    O("keep_tokens", "int", 0, "Tags at the start of the caption kept in place by shuffle_caption "
      "and caption_tag_dropout_rate.", "dataset", min=0),
    O("keep_tokens_separator", "str", "", "Tags before this separator (and after a second one) are "
      "kept in place; overrides keep_tokens when the caption contains it.", "dataset"),
    O("secondary_separator", "str", None, "Separator that joins tags into one for shuffle_caption "
      "and caption_tag_dropout_rate (they split at caption_separator only); replaced by "
      "caption_separator afterwards.", "dataset"),
    O("enable_wildcard", "bool", False, "Wildcards in captions: each {...} group of alternatives "
      "separated by vertical bars becomes one of them, and a caption file's lines are alternative "
      "captions, drawn per sample and epoch ({{ and }} are literal braces).", "dataset"),
    O("token_warmup_min", "int", 1, "Token warmup: the flexible (not kept) tags used at the first "
      "step.", "dataset", min=0),
    O("token_warmup_step", "float", 0.0, "Token warmup: the step by which all tags are used, "
      "growing linearly from token_warmup_min (the first ones in the caption's order); below 1 a "
      "fraction of the run's steps; 0 = off. Not with cache_text_encoder_outputs.", "dataset",
      min=0),
    O("caption_prefix", "str", None, "Text put before every caption (joined with a space).", "dataset"),
    O("caption_suffix", "str", None, "Text put after every caption (joined with a space).", "dataset"),
    O("caption_dropout_rate", "float", 0.0, "Probability that a sample's caption is replaced by the "
      "empty caption.", "dataset", min=0, max=1),
    O("caption_dropout_every_n_epochs", "int", 0, "Use empty captions for every sample in every N-th "
      "epoch; 0 = never.", "dataset", min=0),
    O("caption_tag_dropout_rate", "float", 0.0, "Probability that each (not kept) caption tag is "
      "dropped.", "dataset", min=0, max=1),
    O("enable_bucket", "bool", False, "Aspect-ratio buckets: batch images of similar aspect ratio at "
      "their own resolution instead of center-cropping to a square.", "dataset"),
    O("min_bucket_reso", "int", 256, "Smallest bucket side; a multiple of bucket_reso_steps.", "dataset",
      min=8),
    O("max_bucket_reso", "int", 1024, "Largest bucket side; a multiple of bucket_reso_steps.", "dataset",
      min=8),
    O("bucket_reso_steps", "int", 64, "Bucket side step in pixels; one that is not a multiple of 8 "
      "(the latent grid) is rounded up to one, with a warning (sd-scripts stops on it; the kohya_ss "
      "GUI's LyCORIS presets write 1).", "dataset", min=1),
    O("bucket_no_upscale", "bool", False, "Never upscale an image to fit a bucket.", "dataset"),
    O("vae_batch_size", "int", 1, "Images per VAE batch when caching latents.", "dataset", min=1),
    O("max_data_loader_n_workers", "int", None, "DataLoader worker processes that decode and "
      "augment the images of a run without cached latents. Unset: on CUDA min(8, CPU cores per "
      "process) (sd-scripts' default is 8), on a CPU-only machine 0 (the training computes on the "
      "same cores); with cached latents there is nothing to load. 0 loads in the training process.",
      "dataset", min=0),
    O("persistent_data_loader_workers", "bool", False, "Keep the DataLoader workers between epochs "
      "(no start-up pause per epoch, their memory stays in use).", "dataset"),
    # --- network ---
    O("network_module", "str", "networks.lora", "Python module with the kohya network interface "
      "(create_network, create_network_from_weights): networks.lora, sd-scripts' networks.loha, "
      "networks.lokr, networks.dylora, networks.lora_fa, networks.oft, networks.oft_v2, networks.boft, or "
      "lycoris.kohya; a transformer family's own modules (FLUX.1: networks.lora_flux, networks.oft_flux; "
      "SD3: networks.lora_sd3; docs/MODELS.md names each family's) or lycoris.kohya. "
      "Unset: the model family's LoRA (networks.lora for SD; each family's own).", "network",
      scripts=LORA),
    O("network_dim", "int", 4, "LoRA rank. Unset: the network module's default (networks.lora 4; "
      "networks.oft_v2 block size 32).", "network", scripts=LORA, min=1),
    O("network_alpha", "float", 1.0, "LoRA alpha; the update is scaled by alpha / rank.", "network",
      scripts=LORA, min=0),
    O("network_dropout", "float", None, "Dropout on the LoRA down-projection output (neurons) each "
      "step; unset = none.", "network", scripts=LORA, min=0, max=1, max_exclusive=True),
    O("network_args", "kv_str", None, "Extra key=value arguments for the network module, e.g. "
      "conv_dim=4 conv_alpha=1 rank_dropout=0.1 module_dropout=0.1, or LyCORIS' algo=loha. "
      "TOML: a list of 'key=value' strings or a table.", "network", scripts=LORA),
    O("network_weights", "path", None, "Start from the weights in this LoRA file.", "network",
      scripts=LORA),
    O("network_multiplier", "float", 1.0, "Multiplier of the LoRA output during training; a "
      "dataset's network_multiplier (dataset config) overrides it for its samples, which then "
      "never share a batch with another multiplier's.", "network", scripts=LORA),
    O("network_train_unet_only", "bool", False, "Train only the U-Net part of the network.", "network",
      scripts=LORA),
    O("network_train_text_encoder_only", "bool", False, "Train only the text encoder part of the "
      "network.", "network", scripts=LORA),
    O("dim_from_weights", "bool", False, "Create the network with the ranks and alphas of "
      "network_weights (per module, 3x3 convs included), so network_dim, network_alpha and conv_dim "
      "are not needed. Needs network_weights.", "network", scripts=LORA),
    O("scale_weight_norms", "float", None, "Max-norm regularisation (sd-scripts): after every "
      "optimizer step, each module whose ||up @ down * alpha / rank|| exceeds this value is scaled "
      "down to it; the number of scaled modules and the mean / max norm are logged "
      "(max_norm/keys_scaled, norm/avg_key_norm, max_norm/max_key_norm). 1 is a usual start; "
      "0 or unset = off (as sd-scripts).", "network", scripts=LORA, min=0),
    O("base_weights", "path_list", None, "LoRA files merged into the base model (U-Net and text "
      "encoders, in float32) before training, in order; the trained network is on top of them.",
      "network", scripts=LORA),
    O("base_weights_multiplier", "float_list", None, "One multiplier per base_weights file; unset = "
      "1.0 for each.", "network", scripts=LORA),
    # --- textual inversion (train_textual_inversion) and pivotal tuning (train_lora) ---
    O("token_string", "str", None, "Textual inversion: the new token the embedding is learned for "
      "(e.g. sks_toy); it must not be a word the tokenizer already has as one token. With "
      "num_vectors_per_token N the tokens token_string, token_string1 ... token_string<N-1> are "
      "added and every occurrence of token_string in a caption or sample prompt stands for all of "
      "them. Required.", "embedding", scripts=TI),
    O("init_word", "str", None, "Textual inversion: the new vectors start as the embeddings of this "
      "word's tokens (cycled, or cut, to num_vectors_per_token, as sd-scripts); unset = drawn from a "
      "normal distribution with the mean and std of the existing rows (seeded).", "embedding",
      scripts=TI),
    O("num_vectors_per_token", "int", 1, "Textual inversion: vectors the token stands for.",
      "embedding", scripts=TI, min=1, max=75),
    O("weights", "path", None, "Textual inversion: start from this embedding file (emb_params, "
      "clip_l/clip_g, or an A1111 .pt with string_to_param); its vector count must equal "
      "num_vectors_per_token.", "embedding", scripts=TI),
    O("use_object_template", "bool", False, "Textual inversion: ignore the captions and train with "
      "sd-scripts' object templates (\"a photo of a {}\", ...), the template drawn per sample and "
      "epoch.", "embedding", scripts=TI),
    O("use_style_template", "bool", False, "Textual inversion: ignore the captions and train with "
      "sd-scripts' style templates (\"a painting in the style of {}\", ...), drawn per sample and "
      "epoch.", "embedding", scripts=TI),
    O("pivotal_tokens", "str_list", None, "Pivotal tuning: new tokens whose embeddings train together "
      "with the LoRA (each as token_string of train_textual_inversion). The LoRA file holds them as "
      "A1111 bundled embeddings (bundle_emb.<token>.*), and each is also written as its own "
      "embedding file <LoRA file name>_<token>.safetensors. docs/TEXTUAL_INVERSION.md.",
      "embedding", scripts=LORA),
    O("pivotal_init_words", "str_list", None, "Pivotal tuning: one initial word per pivotal token "
      "(as init_word), or one for all; unset = random rows as for init_word.", "embedding",
      scripts=LORA),
    O("pivotal_num_vectors", "int_list", None, "Pivotal tuning: vectors per pivotal token, one value "
      "per token or one for all; unset = 1.", "embedding", scripts=LORA, min=1, max=75),
    O("pivotal_learning_rate", "float", None, "Pivotal tuning: learning rate of the new embedding "
      "rows; unset = learning_rate.", "embedding", scripts=LORA, min=0),
    O("stop_pivotal_training", "int", None, "Pivotal tuning: the embeddings train in the first N "
      "optimizer steps only, then freeze (no gradient, no update; the LoRA goes on). Unset = the "
      "whole run.", "embedding", scripts=LORA, min=1),
    # --- optimizer ---
    O("optimizer_type", "str", "AdamW", "Optimizer, by sd-scripts' name (any case): AdamW (default), "
      "AdamW8bit, PagedAdamW, PagedAdamW8bit, PagedAdamW32bit, Lion, Lion8bit, PagedLion8bit, "
      "SGDNesterov, SGDNesterov8bit, AdaFactor, Prodigy, DAdaptation (= DAdaptAdamPreprint), "
      "DAdaptAdam, DAdaptAdaGrad, DAdaptAdan, DAdaptAdanIP, DAdaptLion, DAdaptSGD, "
      "DAdaptAdamPreprint, AdamWScheduleFree, RAdamScheduleFree, SGDScheduleFree; a torch.optim "
      "class name (SGD, RMSprop, ...), or a dotted class path. See docs/OPTIMIZERS.md.",
      "optimizer"),
    O("optimizer_args", "kv_literal", None, "Extra key=value optimizer arguments, values read as "
      "Python literals, e.g. weight_decay=0.01 betas=0.9,0.999. TOML: a list of 'key=value' strings "
      "or a table.", "optimizer"),
    O("learning_rate", "float", 2e-6, "Learning rate (sd-scripts' default 2e-6; LoRA usually wants "
      "about 1e-4).", "optimizer", min=0),
    O("unet_lr", "float", None, "Learning rate of the U-Net part of the network; unset = "
      "learning_rate.", "optimizer", scripts=LORA, min=0),
    O("text_encoder_lr", "float_or_list", None, "Learning rate of the text encoder(s); one value, or "
      "one per text encoder (SDXL: two). Unset = learning_rate. FLUX.1 / SD3 full fine-tunes do not read "
      "it (sd-scripts' flux_train.py / sd3_train.py: learning_rate_te1/2/3); their LoRAs do.", "optimizer", min=0,
      aliases=("learning_rate_te",), scripts=NOT_TI),
    O("learning_rate_te1", "float", None, "SDXL / SD3: learning rate of text encoder 1 (SD3: CLIP-L; "
      "sd-scripts' name); overrides text_encoder_lr for that encoder.", "optimizer", scripts=FULL, min=0),
    O("learning_rate_te2", "float", None, "SDXL / SD3: learning rate of text encoder 2 (SD3: CLIP-G; "
      "sd-scripts' name); overrides text_encoder_lr for that encoder.", "optimizer", scripts=FULL, min=0),
    O("learning_rate_te3", "float", None, "SD3 with train_t5xxl: learning rate of T5-XXL (sd-scripts' "
      "sd3_train.py name); unset = learning_rate.", "optimizer", scripts=FULL, min=0),
    O("block_lr", "float_list", None, "SDXL full fine-tuning: 23 learning rates, one per U-Net block "
      "as sd-scripts' sdxl_train.py (0: time/label embedding, 1-9: input blocks 0-8 (conv_in is "
      "input block 0), 10-12: middle block, 13-21: output blocks 0-8, 22: the output layers); a "
      "block at 0 is not trained. Replaces learning_rate for the U-Net.", "optimizer", scripts=FULL,
      min=0),
    *(O(k, "float", None, f"Anima full fine-tuning (anima_train.py): learning rate of {what} "
        "(sd-scripts' --" + k + "); unset = learning_rate, 0 = frozen (no gradient, not in the "
        "optimizer). A LoRA does not read it (sd-scripts' anima_train_network.py neither).", "optimizer",
        scripts=NOT_TI, min=0)
      for k, what in (("llm_adapter_lr", "the LLM adapter (every llm_adapter.* tensor)"),
                      ("self_attn_lr", "the blocks' self-attention (blocks.N.self_attn.*)"),
                      ("cross_attn_lr", "the blocks' cross-attention (blocks.N.cross_attn.*)"),
                      ("mlp_lr", "the blocks' MLPs (blocks.N.mlp.*)"),
                      ("mod_lr", "the AdaLN modulation (every *.adaln_modulation* tensor, the final "
                                 "layer's too)"))),
    O("lr_scheduler", "str", "constant", "Learning-rate schedule (curves in docs/OPTIMIZERS.md). "
      "adafactor needs optimizer_type Adafactor with relative_step=True (its default), which "
      "uses it whatever lr_scheduler says; ignored when "
      "lr_scheduler_type is set; schedule-free optimizers keep a constant learning rate.",
      "optimizer", choices=LR_SCHEDULERS),
    O("lr_warmup_steps", "steps_or_fraction", 0, "Warmup length: a number of optimizer steps, or a "
      "float below 1 (or 'N%') for that fraction of all steps.", "optimizer", min=0),
    O("lr_decay_steps", "steps_or_fraction", 0, "warmup_stable_decay: length of the final decay, a "
      "number of optimizer steps or a float below 1 (or 'N%') for that fraction of all steps; the "
      "steps between warmup and decay keep the full learning rate.", "optimizer", min=0),
    O("lr_scheduler_num_cycles", "int", 1, "Number of restarts of cosine_with_restarts; "
      "cosine_with_min_lr and warmup_stable_decay: number of half cosine waves (1 = down once).",
      "optimizer", min=1),
    O("lr_scheduler_power", "float", 1.0, "Power of the polynomial schedule.", "optimizer", min=0),
    O("lr_scheduler_min_lr_ratio", "float", None, "Lowest learning rate as a fraction of the "
      "initial one: required by cosine_with_min_lr, optional for warmup_stable_decay (unset = 0).",
      "optimizer", min=0, max=1),
    O("lr_scheduler_timescale", "int", None, "inverse_sqrt: the learning rate after warmup is "
      "lr x sqrt(timescale / (step - warmup + timescale)); unset = the warmup steps (10000 "
      "without warmup).", "optimizer", min=1),
    O("lr_scheduler_type", "str", None, "A scheduler class instead of lr_scheduler: a name in "
      "torch.optim.lr_scheduler (e.g. StepLR) or a dotted class path, built as cls(optimizer, "
      "**lr_scheduler_args) and stepped once per optimizer step; no lr_warmup_steps.", "optimizer"),
    O("lr_scheduler_args", "kv_literal", None, "Extra key=value arguments of the scheduler, values "
      "read as Python literals (as optimizer_args): of lr_scheduler_type, or piecewise_constant's "
      "step_rules (e.g. step_rules='1:100,0.1:200,0.01').", "optimizer"),
    O("max_grad_norm", "float", 1.0, "Clip the global gradient norm to this; 0 = no clipping.",
      "optimizer", min=0),
    O("fused_backward_pass", "bool", False, "Step each parameter inside the backward pass as soon as "
      "its gradient is complete, then free that gradient (saves the memory of all gradients; with "
      "gradient_accumulation_steps > 1 only in the last micro-step). Any optimizer without global "
      "state; max_grad_norm then clips each parameter's gradient separately. Not with fp16.",
      "optimizer"),
    O("fused_optimizer_groups", "int", None, "Split the trainable parameters into N contiguous groups "
      "(in backward order), each with its own optimizer stepped as soon as the group's gradients are "
      "complete; unset or 0 = off. max_grad_norm then clips each group separately. Not with fp16 "
      "or fused_backward_pass.", "optimizer", min=0),
    O("fused_reductions_in_flight", "int", 2, "Several processes with fused_backward_pass or "
      "fused_optimizer_groups: how many parameters' (groups') gradient sums may be in flight "
      "while the backward pass goes on; each is stepped when its sum completes, oldest first. "
      "At most this many + 1 parameters' (groups') gradients are alive at once. 0 = sum each one "
      "synchronously inside its hook. The same weights bit for bit whatever the value; no "
      "effect on one process (not an sd-scripts option).", "optimizer", min=0),
    # --- training ---
    O("train_batch_size", "int", 1, "Batch size per process.", "training", min=1),
    O("max_train_steps", "int", None, "Training length in optimizer steps. Give this or "
      "max_train_epochs (epochs win if both are given).", "training", min=1),
    O("max_train_epochs", "int", None, "Training length in epochs (takes precedence over "
      "max_train_steps).", "training", min=1),
    O("gradient_accumulation_steps", "int", 1, "Micro-batches per optimizer step.", "training", min=1),
    O("gradient_checkpointing", "bool", False, "Recompute activations in the backward pass to save "
      "memory.", "training"),
    O("highvram", "bool", False, "Keep the VAE and text encoders on the device after caching. By "
      "default, once latents (text-encoder outputs) are cached the VAE (text encoders) move to the "
      "CPU, or on a CPU-only machine are freed and read back from a spill file when samples or a "
      "full model's save need them.", "training"),
    O("mixed_precision", "str", "no", "Autocast precision; fp16 (with loss scaling) needs a CUDA GPU, "
      "bf16 also runs on the CPU.", "training", choices=("no", "fp16", "bf16")),
    O("full_bf16", "bool", False, "Train the weights themselves in bf16 (U-Net/text encoders, or the "
      "network): bf16 weights and gradients, float32 optimizer state, each update computed in "
      "float32 and written back with stochastic rounding (unbiased). Needs mixed_precision bf16; "
      "not with Prodigy, D-Adaptation or schedule-free optimizers.", "training"),
    O("full_fp16", "bool", False, "Train the weights themselves in fp16: fp16 weights and gradients, "
      "float32 optimizer state, dynamic loss scaling (a step whose gradients overflow is skipped "
      "and the scale halved). Needs mixed_precision fp16 (on a CPU: fp16 computation without "
      "autocast); not with fused_backward_pass or fused_optimizer_groups.", "training"),
    O("fp8_base", "bool", False, "Store the frozen U-Net and text encoders in float8 (e4m3fn): the "
      "weights of their Linear/Conv2d layers (norms, embeddings and biases stay in the "
      "mixed-precision dtype), computed in the mixed-precision dtype, one layer's weight up-cast "
      "at a time (docs/FP8.md). About half the frozen weights' bytes of a bf16 base. Needs "
      "mixed_precision bf16 or fp16. Network training only: train_dreambooth and finetune accept it "
      "with a no-effect warning, as sd-scripts' train_db, fine_tune and sdxl_train (FLUX.1 / SD3: "
      "flux_train.py / sd3_train.py) ignore it.",
      "training", scripts=NOT_TI),
    O("fp8_base_unet", "bool", False, "As fp8_base, for the U-Net only: the text encoders stay in the "
      "mixed-precision dtype (with fp8_base too, as in sd-scripts).", "training", scripts=NOT_TI),
    # --- FLUX.1 / SD3 transformer memory (library/training/block_swap.py) ---
    O("blocks_to_swap", "int", None, "FLUX.1 / SD3: keep this many transformer blocks in host "
      "memory and copy each to the device just ahead of its use (a side stream overlapped with "
      "compute on CUDA), and home again after it, in the forward and the backward pass. FLUX.1 "
      "counts in double blocks as sd-scripts: n // 2 double and (n - n // 2) x 2 single blocks; "
      "SD3: n joint blocks; the last ones of each list. The same weights as without it; a plain "
      "optimizer steps the swapped blocks on the host, fused_backward_pass on the device. One "
      "process; not with fused_optimizer_groups, cpu_offload_checkpointing, ema_decay or "
      "torch_compile. 0 / unset = off.", "training", scripts=NOT_TI, min=0),
    # sd-scripts' deprecated FLUX.1 block-swap names (mapped in library/config/parse.py)
    O("split_mode", "bool", False, "[Deprecated] FLUX.1 train_lora: use blocks_to_swap. As "
      "sd-scripts' flux_train_network.py: sets blocks_to_swap = 18, or is ignored when "
      "blocks_to_swap is given (a warning either way); no effect in train_dreambooth / finetune "
      "(sd-scripts' flux_train.py has no such option).", "training", scripts=NOT_TI),
    O("double_blocks_to_swap", "int", None, "[Deprecated] FLUX.1 train_dreambooth / finetune: "
      "use blocks_to_swap. As sd-scripts' flux_train.py: without blocks_to_swap, blocks_to_swap = "
      "double_blocks_to_swap + single_blocks_to_swap // 2 (a warning); no effect in train_lora "
      "(sd-scripts' flux_train_network.py has no such option).", "training", scripts=NOT_TI, min=0),
    O("single_blocks_to_swap", "int", None, "[Deprecated] FLUX.1 train_dreambooth / finetune: "
      "use blocks_to_swap; see double_blocks_to_swap.", "training", scripts=NOT_TI, min=0),
    O("cpu_offload_checkpointing", "bool", False, "FLUX.1 / SD3: with gradient checkpointing, the "
      "activations kept at each transformer block's input wait in host memory until the "
      "backward (sd-scripts' option; turns gradient_checkpointing on, as sd-scripts). Not with "
      "blocks_to_swap.", "training", scripts=NOT_TI),
    O("blockwise_fused_optimizers", "bool", False, "FLUX.1 / SD3 full fine-tune: one optimizer per "
      "transformer block (and one for the other parameters, one per trained text encoder), each "
      "stepped inside the backward pass as soon as its block's gradients are complete, then its "
      "gradients freed (sd-scripts' flux_train.py option). The same update as one optimizer for "
      "optimizers without global state; max_grad_norm then clips each block separately. Not with "
      "fused_backward_pass, fused_optimizer_groups or fp16.", "optimizer", scripts=FULL),
    O("ddp_timeout", "int", None, "Minutes a process waits for the others in a collective before the "
      "job fails (multi-process runs); unset = 30.", "training", min=1),
    O("ddp_gradient_as_bucket_view", "bool", False, "Several processes (DDP): the gradients are "
      "views into DDP's all-reduce buckets instead of separate tensors (saves one copy of the "
      "gradients' memory and a copy per step). No effect on one process, with fsdp, deepspeed or "
      "the fused steps (no DDP there).", "training"),
    O("ddp_static_graph", "bool", False, "Several processes (DDP): the same parameters get "
      "gradients in every step, so DDP records which in the first step instead of searching the "
      "autograd graph after every forward. No effect on one process, with fsdp, deepspeed or the "
      "fused steps.", "training"),
    O("ddp_bucket_cap_mb", "int", 25, "Several processes (DDP): the size in MB of the gradient "
      "buckets DDP all-reduces while the backward pass runs (Accelerate's and PyTorch's "
      "bucket_cap_mb). No effect on one process, with fsdp, deepspeed or the fused steps.",
      "training", min=1),
    O("ddp_comm_hook", "str", "no", "Several processes (DDP): all-reduce the gradients in bf16 or "
      "fp16 (PyTorch's compression hooks, still the sum over the processes): half the traffic, "
      "for PCIe or network links. Lossy: each process's gradient is rounded to bf16/fp16 before "
      "the sum (docs/DISTRIBUTED.md). On one process nothing is all-reduced and it has no "
      "effect. Not with fsdp, deepspeed or the fused steps.", "training",
      choices=("no", "bf16", "fp16")),
    O("fsdp", "bool", False, "Full fine-tune sharded across the processes (PyTorch FSDP2, applied by "
      "the toolkit): each process holds about 1/N of the weights, gradients and optimizer state of "
      "the U-Net and trained text encoders; the model file is gathered, the training state stays "
      "sharded. On one process it trains unsharded. Not with fused_backward_pass, "
      "fused_optimizer_groups, full_bf16, full_fp16 or ema_device cpu.", "training", scripts=FULL),
    O("deepspeed", "bool", False, "Train through DeepSpeed ZeRO (stages 0-2; library/distributed/deepspeed_zero.py), "
      "applied by the toolkit on CPU/gloo and CUDA. Also turned on by launching with an Accelerate "
      "DeepSpeed config. Gradients summed as without it; not with fsdp, fused_backward_pass, "
      "fused_optimizer_groups, full_bf16/full_fp16, stop_text_encoder_training, or optimizers that "
      "need whole parameters (Adafactor, Prodigy, D-Adaptation, schedule-free).", "training", scripts=NOT_TI),
    O("zero_stage", "int", 2, "With deepspeed: 0 (plain data parallel), 1 (optimizer state "
      "partitioned), 2 (also gradients). Stage 3 is not supported: use fsdp.", "training",
      min=0, max=3, scripts=NOT_TI),
    O("offload_optimizer_device", "str", None, "With deepspeed (stage 1 or 2): 'cpu' keeps the "
      "optimizer state and step on the CPU (ZeRO-Offload); unset or 'none' = on the device.",
      "training", scripts=NOT_TI),
    O("offload_param_device", "str", None, "ZeRO stage 3 parameter offload: not supported (only "
      "unset or 'none').", "training", scripts=NOT_TI),
    O("deepspeed_config_file", "path", None, "With deepspeed: a DeepSpeed JSON whose "
      "zero_optimization settings (bucket sizes, overlap_comm, ...) are used; batch sizes, "
      "accumulation, gradient_clipping and bf16/fp16 must be \"auto\" or equal the run's options; "
      "no optimizer or scheduler section. Set "
      "from an Accelerate config's deepspeed_config_file.", "training", scripts=NOT_TI),
    O("seed", "int", 42, "Random seed. Unlike sd-scripts (random when unset) the default is fixed, so "
      "that two runs of the same config give the same weights.", "training", min=0,
      max=2**32 - 1),  # NumPy's seed range (accelerate's set_seed seeds NumPy too)
    O("train_text_encoder", "bool", False, "Also train the text encoder(s) (SD3: CLIP-L and CLIP-G; "
      "T5-XXL with train_t5xxl).", "training", scripts=FULL),
    O("train_t5xxl", "bool", False, "SD3 with train_text_encoder: also train T5-XXL, at "
      "learning_rate_te3 (sd-scripts' sd3_train.py). A FLUX.1 / SD3 LoRA takes it in network_args.",
      "training", scripts=FULL),
    O("use_t5xxl_cache_only", "bool", False, "SD3 (sd-scripts' sd3_train.py): cache only T5-XXL's "
      "outputs; CLIP-L and CLIP-G run every step (with gradients under train_text_encoder). Implies "
      "cache_text_encoder_outputs; not with train_t5xxl. train_text_encoder with "
      "cache_text_encoder_outputs caches T5's outputs alone without it.", "training", scripts=FULL),
    O("num_last_block_to_freeze", "int", None, "SD3 full fine-tune: freeze the last N parameter "
      "tensors of the joint blocks' image stream (the names containing x_block, in the model's "
      "order: the last block's adaLN_modulation.1 bias and weight, mlp.fc2 bias, ...), as "
      "sd-scripts' sd3_train.py counts them (tensors, not blocks); they get no gradient and no "
      "update. Unset or 0 = off.", "training", scripts=FULL, min=0),
    O("stop_text_encoder_training", "int", None, "With train_text_encoder: train the text encoder(s) "
      "for the first N optimizer steps only; after that they are frozen (no gradient, no update). "
      "Unset = for the whole run.", "training", scripts=FULL, min=1),
    O("ema_decay", "float", None, "Keep an exponential moving average of the trained weights: after "
      "each optimizer step ema = d x ema + (1 - d) x weights, starting from the initial weights; saved "
      "beside every model as <name>-ema (and in the training state). Unset = off.", "training",
      min=0, max=1, max_exclusive=True),
    O("ema_device", "str", "same", "Where the EMA weights live: 'same' (the trained weights' device) "
      "or 'cpu' (off the accelerator).", "training", choices=("same", "cpu")),
    O("prior_loss_weight", "float", 1.0, "Loss weight of regularisation images.", "training",
      scripts=DB_LORA + TI, min=0),
    O("on_nonfinite", "str", "stop", "What a non-finite (NaN/inf) loss or gradient norm does: "
      "'stop' (exit code 3, the state from before the bad update written as "
      "<output_name>-step<N>-state) or 'skip' (no update for that step, the scheduler still "
      "steps; a warning). Not in sd-scripts; see docs/RELIABILITY.md.", "training",
      choices=("stop", "skip")),
    # --- noise, timesteps and loss (sd-scripts' names and formulas; library/training/losses.py) ---
    O("noise_offset", "float", None, "Add noise_offset x N(0,1) per image and channel to the noise "
      "(brighter darks and darker brights; 0.1 is usual); unset or 0 = off.", "loss", min=0),
    O("noise_offset_random_strength", "bool", False, "Scale noise_offset by a uniform random factor "
      "in [0, 1), drawn per sample.", "loss"),
    O("adaptive_noise_scale", "float", None, "Add adaptive_noise_scale x |mean of the latent channel| "
      "to noise_offset (the sum clamped at 0). Needs noise_offset.", "loss"),
    O("multires_noise_iterations", "int", None, "Multi-resolution (pyramid) noise: add noise at this "
      "many ever coarser scales (6-10 is usual); unset or 0 = off.", "loss", min=0),
    O("multires_noise_discount", "float", 0.3, "Weight decay per scale of the multi-resolution noise "
      "(level i is weighted discount^i).", "loss", min=0),
    O("ip_noise_gamma", "float", None, "Input perturbation: add ip_noise_gamma x N(0,1) to the noise "
      "put into the latents, not to the target (0.1 is usual); unset or 0 = off.", "loss", min=0),
    O("ip_noise_gamma_random_strength", "bool", False, "Scale ip_noise_gamma by a uniform random factor "
      "in [0, 1), drawn per sample.", "loss"),
    O("zero_terminal_snr", "bool", False, "Rescale the noise schedule so the last timestep has zero "
      "SNR (Lin et al. 2023); meant for v-prediction models.", "loss"),
    O("min_timestep", "int", None, "Smallest training timestep (inclusive); unset = 0.", "loss", min=0),
    O("max_timestep", "int", None, "Largest training timestep (exclusive); unset = the model's "
      "training timesteps (1000). Equal to min_timestep: train at that one timestep.", "loss", min=1),
    O("loss_type", "str", "l2", "Loss between prediction and target: l2 (MSE), l1, huber (pseudo-Huber, "
      "2c(sqrt(d^2+c^2)-c)) or smooth_l1 (2(sqrt(d^2+c^2)-c)).", "loss", choices=LOSS_TYPES),
    O("huber_schedule", "str", "snr", "Threshold c of the huber/smooth_l1 loss per timestep t: constant "
      "(huber_c x huber_scale), exponential (huber_c^(t/T) x huber_scale) or snr ((1-huber_c)/"
      "(1+sigma_t)^2 + huber_c, sigma_t = sqrt((1-alphabar_t)/alphabar_t); huber_scale unused).",
      "loss", choices=("constant", "exponential", "snr")),
    O("huber_c", "float", 0.1, "Huber threshold parameter of loss_type huber/smooth_l1.", "loss", min=0,
      min_exclusive=True),
    O("huber_scale", "float", 1.0, "Scale of the huber threshold (constant and exponential "
      "schedules).", "loss", min=0, min_exclusive=True),
    # flow matching (FLUX.1): library/training/flow_matching.py, docs/FLOW_MATCHING.md
    O("timestep_sampling", "str", "sigma", "FLUX.1: how a sample's noise level sigma is drawn "
      "(sd-scripts' names and default; its docs recommend shift or flux_shift).", "loss",
      scripts=NOT_TI, choices=("sigma", "uniform", "sigmoid", "shift", "flux_shift", "nextdit_shift")),
    O("sigmoid_scale", "float", 1.0, "FLUX.1: scale of the normal draw inside the sigmoid of "
      "timestep_sampling sigmoid, shift and flux_shift.", "loss", scripts=NOT_TI),
    O("discrete_flow_shift", "float", 3.0, "FLUX.1: the shift s of timestep_sampling shift and of "
      "the sigma table (sigma' = s sigma / (1 + (s - 1) sigma)).", "loss", scripts=NOT_TI, min=0,
      min_exclusive=True),
    O("model_prediction_type", "str", "sigma_scaled", "FLUX.1: what the loss compares: raw (the "
      "velocity against noise - latents), additive, sigma_scaled (sd-scripts' default; the clean "
      "latent it implies against the latents, docs/FLOW_MATCHING.md).", "loss", scripts=NOT_TI,
      choices=("raw", "additive", "sigma_scaled")),
    O("weighting_scheme", "str", "uniform", "FLUX.1 / SD3: the density of the noise level (SD3; "
      "FLUX.1 with timestep_sampling sigma) and the loss weight of the sigma-scaled prediction "
      "(sd-scripts' names).", "loss", scripts=NOT_TI,
      choices=("sigma_sqrt", "logit_normal", "mode", "cosmap", "none", "uniform")),
    O("logit_mean", "float", 0.0, "Mean of weighting_scheme logit_normal.", "loss", scripts=NOT_TI),
    O("logit_std", "float", 1.0, "Standard deviation of weighting_scheme logit_normal.", "loss",
      scripts=NOT_TI, min=0),
    O("mode_scale", "float", 1.29, "Scale of weighting_scheme mode.", "loss", scripts=NOT_TI),
    O("training_shift", "float", 1.0, "SD3: the shift s of the drawn noise level before it becomes "
      "the integer timestep (sd-scripts' --training_shift; 1 = none).", "loss", scripts=NOT_TI, min=0,
      min_exclusive=True),
    O("min_snr_gamma", "float", None, "Min-SNR weighting (Hang et al. 2023): weight each sample by "
      "min(SNR, gamma)/SNR (v-prediction: /(SNR+1)); 5 is the paper's value; unset or 0 = off.", "loss",
      min=0),
    O("scale_v_pred_loss_like_noise_pred", "bool", False, "Weight a v-prediction loss by SNR/(SNR+1) "
      "so it scales like a noise-prediction loss. v-prediction models only.", "loss"),
    O("v_pred_like_loss", "float", None, "Add this multiple of a v-prediction-like loss, "
      "loss x (SNR+1)/SNR. Epsilon-prediction models only; unset or 0 = off.", "loss", min=0),
    O("debiased_estimation_loss", "bool", False, "Debiased estimation (Yu et al. 2024): weight by "
      "1/sqrt(SNR) (v-prediction: 1/(SNR+1)), SNR capped at 1000.", "loss"),
    O("masked_loss", "bool", False, "Multiply the per-pixel loss by the image's mask (from "
      "conditioning_data_dir or alpha_mask, area-averaged to the latent size) before the mean, as "
      "sd-scripts (no renormalisation); the validation loss too.", "loss"),
    O("train_inpainting", "bool", False, "Train an inpainting model (sd-scripts' --train_inpainting): "
      "the U-Net takes 9 channels, the noisy latents, a random mask per sample and epoch "
      "(cloud, polygon or shape, at the latent size) and the latents of the image with the masked "
      "region blanked. Needed for an inpainting model (9-channel U-Net, recognised from the "
      "weights); on a 4-channel model DreamBooth and fine-tune widen its first convolution. Not "
      "with cache_latents (docs/MODELS.md, Inpainting models).", "model"),
    # --- saving ---
    O("output_dir", "path", None, "Folder for the trained files. Required (except with --dry_run).",
      "saving"),
    O("output_name", "str", "last", "Base name of the trained files: <output_name>.safetensors, "
      "<output_name>-000001.safetensors per epoch, <output_name>-step00000100.safetensors per step.",
      "saving"),
    O("metadata_title", "str", None, "modelspec.title of the saved files; unset = output_name.",
      "saving"),
    *(O(f"metadata_{k}", "str", None, f"modelspec.{k} of the saved files (sd-scripts' model-spec "
        f"metadata){extra}; unset = not written.", "saving")
      for k, extra in (("author", ""), ("description", ""), ("license", ""),
                       ("tags", ", comma-separated"), ("usage_hint", ""),
                       ("thumbnail", ": an image file, embedded as a data: URL (or a data: URL as is)"),
                       ("merged_from", ""), ("trigger_phrase", ""), ("preprocessor", ""),
                       ("is_negative_embedding", ""))),
    O("training_comment", "str", None, "Free text written to the saved files' ss_training_comment.",
      "saving"),
    O("save_model_as", "str", "safetensors", "File format of saved models.", "saving",
      choices_by_script={
          "train_lora": ("safetensors", "ckpt", "pt"),
          "train_dreambooth": ("safetensors", "ckpt", "diffusers", "diffusers_safetensors"),
          "finetune": ("safetensors", "ckpt", "diffusers", "diffusers_safetensors"),
          "train_textual_inversion": ("safetensors", "pt", "ckpt"),
      }),
    O("save_precision", "str", None, "Cast saved weights to this precision; unset = as trained.",
      "saving", choices=("float", "fp16", "bf16")),
    O("save_every_n_epochs", "int", None, "Also save every N epochs.", "saving", min=1),
    O("save_every_n_steps", "int", None, "Also save every N steps.", "saving", min=1),
    O("save_last_n_epochs", "int", None, "Keep only the last N epoch saves (sd-scripts: the save "
      "of epoch E removes that of epoch E - N x save_every_n_epochs).", "saving", min=1),
    O("save_last_n_steps", "int", None, "Keep only the step saves of the last N steps (sd-scripts: "
      "a number of steps, not of files).", "saving", min=1),
    O("save_state", "bool", False, "Write a training state folder next to each model save: "
      "<output_name>-000001-state, <output_name>-step00000100-state, <output_name>-state at the "
      "end (weights, optimizer, scheduler, data position, generators, counters, config); resume "
      "continues from it exactly.", "saving"),
    O("save_state_on_train_end", "bool", False, "Write only the final training state "
      "(<output_name>-state).", "saving"),
    O("save_last_n_epochs_state", "int", None, "Keep only the last N epoch states; unset = "
      "save_last_n_epochs.", "saving", min=1),
    O("save_last_n_steps_state", "int", None, "Keep only the step states of the last N steps; unset "
      "= save_last_n_steps.", "saving", min=1),
    # the Hugging Face Hub (library/outputs/hub.py; sd-scripts' library/huggingface_util.py)
    O("huggingface_repo_id", "str", None, "Upload each saved model file (and, with "
      "save_state_to_huggingface, each training state) to this Hugging Face Hub repository "
      "(owner/name), created when it does not exist; a failed upload is a warning and the local "
      "file stays.", "saving"),
    O("huggingface_repo_type", "str", None, "The repository's type; unset = model.", "saving",
      choices=("model", "dataset", "space")),
    O("huggingface_path_in_repo", "str", None, "Folder in the repository the uploads go to "
      "(<folder>/<file name>); unset = the repository's root.", "saving"),
    O("huggingface_token", "str", None, "Hub token with write access, for this process only (not "
      "written to disk: not in the saved config, state or metadata); unset = huggingface_hub's own "
      "login (HF_TOKEN, hf auth login).", "saving"),
    O("huggingface_repo_visibility", "str", None, "Visibility of a repository the run creates; "
      "unset = private (sd-scripts: anything but public is private).", "saving",
      choices=("public", "private")),
    O("save_state_to_huggingface", "bool", False, "Also upload each training state folder that "
      "save_state / save_state_on_train_end write.", "saving"),
    O("resume_from_huggingface", "bool", False, "resume names a state on the Hub, as sd-scripts "
      "reads it: <owner>/<repo>/<path in repo>[:<revision>[:<repo type>]]; its files are "
      "downloaded into huggingface_hub's cache and resumed as a local state.", "saving"),
    O("async_upload", "bool", False, "Upload in a background thread (one upload at a time, in save "
      "order) while training goes on; the run waits for every upload before it ends.", "saving"),
    O("resume", "str", None, "Continue from a training state folder, or 'latest' (the state with "
      "the highest step in output_dir). The run may be made longer, and the process count changed "
      "if the global batch stays the same; any other change is an error naming it. SIGINT/SIGTERM "
      "write <output_name>-step<N>-state after the current step and exit with 130/143.", "config"),
    # --- logging and validation (library/outputs/tracking.py, library/training/validation.py) ---
    O("logging_dir", "path", None, "Write TensorBoard logs to <logging_dir>/<log_prefix><timestamp>/: "
      "loss/current, loss/average (mean of the last steps-per-epoch steps), loss/epoch, "
      "loss/validation and lr/<group>; losses are global-batch means over all processes. Needs the "
      "tensorboard extra.", "logging"),
    O("log_with", "str", None, "Tracker: tensorboard (the default when logging_dir is set; needs "
      "logging_dir), wandb (Weights & Biases, the wandb extra; its files go under the run folder "
      "when logging_dir is set) or all (both); the same tags in each; main process only.", "logging",
      choices=("tensorboard", "wandb", "all")),
    O("log_tracker_name", "str", None, "wandb project name; unset = sd-scripts' network_train "
      "(train_lora), dreambooth (train_dreambooth), finetuning (finetune).", "logging"),
    O("log_tracker_config", "path", None, "TOML file whose [wandb] table is passed to wandb.init "
      "as keyword arguments (sd-scripts' init_kwargs, e.g. entity, tags, notes).", "logging"),
    O("wandb_run_name", "str", None, "wandb run name; unset = wandb's generated name.", "logging"),
    O("wandb_api_key", "str", None, "wandb API key, set for this process only (not written to disk, "
      "not part of the saved config); unset = wandb's own login.", "logging"),
    O("log_prefix", "str", None, "Prefix of the run folder name under logging_dir.", "logging"),
    O("validation_split", "float", 0.0, "Fraction of the training images held out for the "
      "validation loss (chosen from validation_seed, per dataset; at least one image each way); "
      "0 = no validation.", "logging", min=0, max=1, max_exclusive=True),
    O("validation_seed", "int", None, "Seed of the validation split and of the validation noise; "
      "unset = seed.", "logging", min=0),
    O("validate_every_n_steps", "int", None, "Also compute the validation loss every N steps.",
      "logging", min=1),
    O("validate_every_n_epochs", "int", None, "Compute the validation loss every N epochs; unset = "
      "every epoch (when validation_split is set).", "logging", min=1),
    O("sample_prompts", "path", None, "Prompt file for sample images: .txt, one prompt per line with "
      "optional --n negative prompt, --w width, --h height, --d seed, --s steps, --l CFG scale, "
      "--g FLUX.1 dev's guidance input, --ss sampler (defaults 512, 512, seed + prompt index, "
      "30, 7.5, -, sample_sampler; FLUX.1: 20 steps, CFG 1, --g 3.5; SD3: 30, 7.5; both with "
      "their flow-matching Euler sampler); or .toml "
      "([prompt] defaults + [[prompt.subset]]) / .json (a list) with the keys prompt, "
      "negative_prompt, width, height, seed, sample_steps, scale, guidance_scale, sample_sampler. Images: "
      "<output_dir>/sample/<output_name>_<step:06d>_<prompt index:02d>_<seed>.png.", "logging"),
    O("sample_every_n_steps", "int", None, "Generate the sample images every N steps.", "logging",
      min=1),
    O("sample_every_n_epochs", "int", None, "Generate the sample images every N epochs.", "logging",
      min=1),
    O("sample_at_first", "bool", False, "Also generate the sample images before training.",
      "logging"),
    O("sample_sampler", "str", "ddim", "Sampler of the sample images (a prompt's --ss overrides it): "
      "ddim, pndm, lms, euler, euler_a, heun, dpm_2, dpm_2_a, dpmsolver, dpmsolver++, dpmsingle "
      "(k_ names accepted).", "logging",
      choices=SD_SAMPLERS),
    # --- LECO (train_leco.py, sd-scripts' train_leco.py / sdxl_train_leco.py) ---
    O("prompts_file", "path", None, "LECO prompt file (TOML as sd-scripts' train_leco.py, or the "
      "original LECO's YAML): [[prompts]] with target, positive, unconditional, neutral, action "
      "(erase / enhance), guidance_scale, resolution, dynamic_resolution, batch_size, "
      "dynamic_crops, multiplier, weight; or slider targets (target_class, positive, negative). "
      "Required.", "leco", scripts=LECO),
    O("max_denoising_steps", "int", 40, "Each step denoises fresh noise part of the way with the "
      "network on, for a random 1..N-1 of N sampler steps, then trains at the timestep reached "
      "(sd-scripts' default 40).", "leco", scripts=LECO, min=2),
    O("leco_denoise_guidance_scale", "float", 3.0, "Classifier-free guidance of that partial "
      "denoising (target prompt against unconditional).", "leco", scripts=LECO, min=0),
    # --- progress stream and control channel (library/outputs/progress_stream.py, docs/UI.md) ---
    O("progress_file", "path", None, "Append the run's progress to this file as JSON lines (main "
      "process): the plan, each step's loss, learning rate and gradient norm, saves, samples, "
      "validation losses, non-finite events and the end with its exit code; a shell can follow it "
      "with tail -f. The values are those the step already reads: no extra device read.", "logging"),
    O("control_file", "path", None, "Read commands from this file at each step boundary: JSON "
      "lines {\"command\": \"save_now\" | \"sample_now\" | \"stop\"} (or the bare word per line), "
      "appended by the UI or a script; read from its start, so remove it before a new run. With "
      "several processes the main process reads it and every process takes the command after "
      "the same step (agreed in the step's one small all-reduce).",
      "logging"),
)

# Run options that train_leco honours (library/run/leco.py); every other option of the image
# scripts (datasets, captions, caches, text-encoder training, ...) is refused there by name.
LECO_OPTIONS = frozenset("""
    config pretrained_model_name_or_path v2 v_parameterization tokenizer_path allow_pickle
    clip_skip max_token_length sdpa xformers seed mixed_precision gradient_checkpointing
    max_train_steps max_grad_norm learning_rate unet_lr optimizer_type optimizer_args
    lr_scheduler lr_warmup_steps lr_scheduler_num_cycles lr_scheduler_power lr_scheduler_args
    lr_scheduler_type lr_decay_steps lr_scheduler_min_lr_ratio lr_scheduler_timescale
    network_module network_dim network_alpha network_dropout network_args network_weights
    dim_from_weights network_train_unet_only output_dir output_name save_model_as save_precision
    save_every_n_steps training_comment noise_offset min_snr_gamma metadata_title
    metadata_author metadata_description metadata_license metadata_tags metadata_usage_hint
    metadata_thumbnail metadata_trigger_phrase""".split())
OPTIONS = tuple(replace(o, scripts=o.scripts + LECO) if o.name in LECO_OPTIONS else o
                for o in OPTIONS)

OPTIONS_BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}
# The run options gen_img.py takes under the same names: the model's separate parts, its text
# settings and prediction type. A run's images (the UI's Compare panel, class images) pass the run's
# own (``gen_img_flags``); the Generate page's "model parts" are the path-typed ones.
GEN_IMG_RUN_OPTIONS = ("vae", "clip_l", "clip_g", "t5xxl", "ae", "tokenizer_path", "qwen3", "llm_adapter_path",
                       "t5_tokenizer_path", "gemma2", "apply_t5_attn_mask", "t5xxl_max_token_length",
                       "qwen3_max_token_length", "t5_max_token_length", "gemma2_max_token_length", "system_prompt",
                       "v2", "v_parameterization")
GEN_IMG_PARTS = tuple(n for n in GEN_IMG_RUN_OPTIONS if OPTIONS_BY_NAME[n].type == "path")


def gen_img_flags(opts, path=lambda p: p) -> list[str]:
    """gen_img.py's flags for the run options ``GEN_IMG_RUN_OPTIONS`` that ``opts`` sets: a switch
    as ``--name``, a value as one ``--name=value`` argument (a text starting with '-' stays a value),
    a path through ``path``."""
    out = []
    for name in GEN_IMG_RUN_OPTIONS:
        value = getattr(opts, name)
        if value is True:
            out.append(f"--{name}")
        elif value not in (None, False, ""):
            out.append(f"--{name}={path(value) if OPTIONS_BY_NAME[name].type == 'path' else value}")
    return out


# Secrets: set for this process only, never written (saved config, state, metadata) nor shown
SECRET_OPTIONS = ("wandb_api_key", "huggingface_token")
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
    _n("log_config", "flag", _IGN, "the options are not written to the TensorBoard or wandb log"),
    # model
    _n("tokenizer_cache_dir", "value", _IGN, "tokenizers are shipped; see tokenizer_path"),
    _n("disable_mmap_load_safetensors", "flag", _IGN, "loading speed only"),
    _n("mem_eff_attn", "flag", _IGN, "SDPA attention is used, which is memory-efficient"),
    _n("diffusers_xformers", "flag", _IGN, "use xformers"),
    _n("lowram", "flag", _REJ, "loading models straight to the GPU is a memory feature not implemented yet"),
    # model-spec / metadata (library/sai_model_spec.py)
    _n("no_metadata", "flag", _REJ, "metadata is always written; not writing it is not implemented yet"),
    # dataset (train_util.add_dataset_arguments)
    _n("cache_info", "flag", _IGN, "speeds up dataset scanning only"),
    _n("skip_cache_check", "flag", _IGN, "cache speed only"),
    _n("face_crop_aug_range", "value", _REJ, "augmentation changes the images"),
    _n("resize_interpolation", "value", _REJ, "changes the images"),
    _n("dataset_class", "value", _REJ, "custom dataset classes are not supported"),
    # validation (train_network.py)
    _n("max_validation_steps", "value", _IGN, "every held-out image is evaluated at fixed timesteps"),
    # saving and resuming
    _n("save_n_epoch_ratio", "value", _REJ, "the files it asks for would not be written; use save_every_n_epochs"),
    _n("use_safetensors", "flag", _IGN, "safetensors is already the default of save_model_as"),
    _n("mem_eff_save", "flag", _IGN, "a FLUX.1 transformer file is always written one tensor at a time"),
    _n("output_config", "flag", _REJ, "writing the arguments to a config and exiting is not implemented"),
    _n("skip_until_initial_step", "flag", _REJ, "changes which steps are trained"),
    _n("initial_epoch", "value", _REJ, "changes which steps are trained"),
    _n("initial_step", "value", _REJ, "changes which steps are trained"),
    # optimizer and schedule
    _n("use_8bit_adam", "flag", _REJ, "use optimizer_type = \"AdamW8bit\""),
    _n("use_lion_optimizer", "flag", _REJ, "use optimizer_type = \"Lion\""),
    # distributed (the ddp_*, fsdp and deepspeed options are in the table)
    _n("offload_optimizer_nvme_path", "value", _IGN, "NVMe offload is not supported (offload_optimizer_device)"),
    _n("offload_param_nvme_path", "value", _IGN, "NVMe offload is not supported (offload_param_device)"),
    _n("zero3_init_flag", "flag", _IGN, "only used with ZeRO stage 3, which is not supported"),
    _n("zero3_save_16bit_model", "flag", _IGN, "only used with ZeRO stage 3, which is not supported"),
    _n("fp16_master_weights_and_gradients", "flag", _REJ, "changes the computation"),
    # sd-scripts' FLUX.1 / SD3 scripts (flux_train_network.py, flux_train.py, sd3_train_network.py,
    # sd3_train.py; the audit: tests/config/sd_scripts_flow_options.json)
    _n("controlnet_model_name_or_path", "value", _IGN, "read only by sd-scripts' separate "
       "flux_train_control_net.py; flux_train.py and flux_train_network.py ignore it too"),
    _n("skip_latents_validity_check", "flag", _IGN, "sd-scripts' deprecated name of skip_cache_check: "
       "cache speed only"),
    *(_n(k, "flag", _IGN, "marked [DOES NOT WORK] in sd-scripts, which ignores it (no unified "
         "checkpoint); an SD3 model is saved here in the layout it was loaded from")
      for k in ("save_clip", "save_t5xxl")),
    _n("t5xxl_dtype", "value", _IGN, "marked [DOES NOT WORK] in sd-scripts, which ignores it; T5-XXL "
       "is loaded and run as the other text encoders are"),
    _n("t5xxl_device", "value", _IGN, "marked [DOES NOT WORK] in sd-scripts, which ignores it; T5-XXL "
       "is placed as the other text encoders are"),
)

SD_SCRIPTS_BY_NAME: dict[str, SdScriptsName] = {n.name: n for n in SD_SCRIPTS_NAMES}


# ----------------------------------------------------------------------------------------------
# Keys the kohya_ss GUI writes into its run TOML (bmaltais/kohya_ss kohya_gui/lora_gui.py,
# dreambooth_gui.py, finetune_gui.py: `config_toml_data`), for the LoRA (l), DreamBooth (d) and
# fine-tune (f) tabs. sd-scripts reads that TOML into an argparse Namespace, so a key no parser
# defines is silently ignored there; here each key is one of:
#   "option"  honoured: an option of the schema above (`target`, default the key itself);
#   "sd"      an sd-scripts name of SD_SCRIPTS_NAMES (accepted with no effect, or rejected, there);
#   "ignore"  a GUI-only key that has no effect, also in sd-scripts (warned when set; `why`);
#   "reject"  a GUI-only key whose setting cannot be honoured (an error when set; `why`).
# The GUI-only entries are the parsing rule of those keys (library/config/parse.py); the "option" and
# "sd" entries only document (their behaviour lives in the tables above; a test checks they
# agree).


@dataclass(frozen=True)
class GuiKey:
    name: str
    tabs: str            # letters of the tabs that write it: l, d, f, t (textual inversion)
    action: str          # "option", "sd", "ignore" or "reject"
    why: str = ""
    target: str = ""     # "option": the option it sets, when not the key itself


_OTHER_FAMILY = ("an option of the GUI's {} training, a model family this toolkit does not train "
                 "(the GUI writes it only with that model type checked)")


# a key of the GUI's FLUX.1 / SD3 / Anima training that has no counterpart here yet
_FLOW_NOT_YET = ("an option of the GUI's {} training that this toolkit does not support yet "
                 "(the GUI writes it only with that model type checked)")


def _gui_family(names: str, tabs: str, family: str, trained: bool = False) -> list:
    """GUI keys of one model type's training that are refused here: ``trained``, a family this
    toolkit trains (library/models/families/) without that option yet, else one it does not train."""
    why = (_FLOW_NOT_YET if trained else _OTHER_FAMILY).format(family)
    return [GuiKey(n, tabs, "reject", why) for n in names.split()]


GUI_OPTION_KEYS = """
async_upload:ldf huggingface_path_in_repo:ldf huggingface_repo_id:ldf huggingface_repo_type:ldf
huggingface_repo_visibility:ldf huggingface_token:ldf resume_from_huggingface:ldf
save_state_to_huggingface:ldf
adaptive_noise_scale:ldf bucket_no_upscale:ldf bucket_reso_steps:ldf cache_latents:ldf
cache_latents_to_disk:ldf cache_text_encoder_outputs:ldf cache_text_encoder_outputs_to_disk:ldf
caption_dropout_every_n_epochs:ldf caption_dropout_rate:ldf caption_extension:ldf clip_skip:ldf
dataset_config:ldf dataset_repeats:f debiased_estimation_loss:ldf enable_bucket:ldf flip_aug:ldf
full_bf16:ldf full_fp16:ldf fused_backward_pass:ldf fused_optimizer_groups:df
gradient_accumulation_steps:ldf gradient_checkpointing:ldf highvram:l huber_c:ldf huber_scale:ldf
huber_schedule:ldf in_json:f ip_noise_gamma:ldf ip_noise_gamma_random_strength:ldf keep_tokens:ldf
learning_rate:ldf learning_rate_te:df learning_rate_te1:df learning_rate_te2:df log_tracker_config:ldf
log_tracker_name:ldf log_with:ldf logging_dir:ldf loss_type:ldf lr_scheduler:ldf
lr_scheduler_num_cycles:ld lr_scheduler_power:ld lr_warmup_steps:ldf masked_loss:ldf
max_bucket_reso:ldf max_data_loader_n_workers:ldf max_grad_norm:ld max_timestep:ldf
max_token_length:ldf max_train_epochs:ldf max_train_steps:ldf min_bucket_reso:ldf min_snr_gamma:ldf
min_timestep:ldf mixed_precision:ldf multires_noise_discount:ldf multires_noise_iterations:ldf
network_alpha:l network_args:l network_dim:l network_dropout:l network_module:l
network_train_text_encoder_only:l network_train_unet_only:l network_weights:l no_half_vae:ldf
noise_offset:ldf noise_offset_random_strength:ldf optimizer_args:ldf optimizer_type:ldf
output_dir:ldf output_name:ldf pretrained_model_name_or_path:ldf prior_loss_weight:ld random_crop:ldf
reg_data_dir:ld resolution:ldf resume:ldf sample_every_n_epochs:ldf sample_every_n_steps:ldf
sample_prompts:ldf sample_sampler:ldf save_every_n_epochs:ldf save_every_n_steps:ldf
save_last_n_epochs:ldf save_last_n_epochs_state:ldf save_last_n_steps:ldf save_last_n_steps_state:ldf
save_model_as:ldf save_precision:ldf save_state:ldf save_state_on_train_end:ldf
scale_v_pred_loss_like_noise_pred:ldf sdpa:ldf seed:ldf shuffle_caption:ldf
stop_text_encoder_training:d text_encoder_lr:l train_batch_size:ldf train_data_dir:ldf
train_text_encoder:df unet_lr:l v2:ldf v_parameterization:ldf v_pred_like_loss:ldf vae:ldf
vae_batch_size:ldf wandb_api_key:ldf wandb_run_name:ldf weighted_captions:ldf xformers:ldf
scale_weight_norms:l dim_from_weights:l block_lr:f fp8_base:ldf fp8_base_unet:l
lr_scheduler_type:ldf lr_scheduler_args:ldf color_aug:ldf no_token_padding:d
metadata_author:ldf metadata_description:ldf metadata_license:ldf metadata_tags:ldf
metadata_title:ldf training_comment:l
dynamo_backend:ldf persistent_data_loader_workers:ldf torch_compile:lf
blocks_to_swap:ldf cpu_offload_checkpointing:ldf blockwise_fused_optimizers:df
"""

GUI_SD_KEYS = """
mem_eff_save:ldf disable_mmap_load_safetensors:ldf log_config:ldf mem_eff_attn:ldf
skip_cache_check:ldf
"""


GUI_NOTES = {
    "dynamo_backend": "the GUI's Accelerate launch setting (default \"no\"); compiles only with "
                      "torch_compile, as in sd-scripts",
    "persistent_data_loader_workers": "the GUI writes it as 0 / 1",
    "xformers": "the GUI's default attention; without the xformers package SDPA is used (the "
                "same computation), with a warning",
    "resolution": "the GUI writes \"W,H\"; with enable_bucket it is the bucket area, as sd-scripts",
    "network_args": "built by the GUI from LoRA_type and the LyCORIS fields; a key given twice "
                    "(use_tucker) takes its last value, as sd-scripts",
    "learning_rate_te": "alias of text_encoder_lr; in train_dreambooth (SD1/SD2) it also trains the "
                        "text encoder unless train_text_encoder = false, as sd-scripts' train_db.py",
    "stop_text_encoder_training": "a step count: the DreamBooth tab writes its \"% of total steps\" "
                                  "field's value unchanged; the LoRA tab never writes it (it resets "
                                  "its field to 0)",
    "lr_warmup_steps": "the GUI writes a step count or a fraction of all steps (its percentage / 100)",
    "sample_prompts": "the GUI always writes <output_dir>/sample/prompt.txt",
}


def _gui_table(text: str, action: str) -> list:
    out = []
    for item in text.split():
        name, _, tabs = item.partition(":")
        out.append(GuiKey(name, tabs, action, GUI_NOTES.get(name, "")))
    return out


GUI_KEYS: tuple[GuiKey, ...] = (
    *_gui_table(GUI_OPTION_KEYS, "option"),
    *_gui_table(GUI_SD_KEYS, "sd"),
    GuiKey("epoch", "ld", "ignore", "the GUI's epoch count, which the GUI itself folds into "
           "max_train_steps (computed from the images, repeats and batch) and "
           "lr_scheduler_num_cycles; sd-scripts defines no such option"),
    GuiKey("noise_offset_type", "ldf", "ignore", "chooses which noise keys the GUI writes "
           "(noise_offset / adaptive_noise_scale for Original, multires_noise_* for Multires), and "
           "those keys are honoured; sd-scripts defines no such option"),
    GuiKey("vae_chunk_size", "lf", "option"),  # Anima's (the GUI writes it with its Anima box)
    GuiKey("show_timesteps", "ldf", "ignore", "displays the FLUX/SD3 timestep distribution; "
           "sd-scripts' SD scripts do not define it"),
    GuiKey("show_timesteps_resolution", "ldf", "ignore", "see show_timesteps"),
    *(GuiKey(n, "ldf", "option") for n in (  # FLUX.1 / SD3: library/models/flow_family.py
        "ae apply_t5_attn_mask clip_l t5xxl t5xxl_max_token_length guidance_scale "
        "discrete_flow_shift model_prediction_type timestep_sampling clip_g logit_mean logit_std "
        "mode_scale weighting_scheme").split()),
    *(GuiKey(n, "ldf", "option") for n in "split_mode single_blocks_to_swap double_blocks_to_swap".split()),
    GuiKey("model_type", "ldf", "option"),  # written for Chroma only (library/ui/gui_import.py)
    *(GuiKey(n, "ldf", "sd") for n in "save_clip save_t5xxl t5xxl_dtype t5xxl_device".split()),
    *_gui_family("train_blocks", "df", "FLUX.1", trained=True),
    GuiKey("text_encoder_batch_size", "ldf", "option"),
    *(GuiKey(n, "l", "option") for n in "clip_g_dropout_rate clip_l_dropout_rate t5_dropout_rate".split()),
    *(GuiKey(n, "l", "option") for n in "enable_scaled_pos_embed pos_emb_random_crop_rate".split()),
    *_gui_family("byt5 text_encoder fp8_scaled fp8_vl text_encoder_cpu", "l", "HunyuanImage-2.1"),
    GuiKey("sigmoid_scale", "lf", "option"),  # written with the Anima and Lumina boxes
    *(GuiKey(n, "lf", "option") for n in  # Anima: library/models/families/anima/
      "qwen3 qwen3_max_token_length llm_adapter_path t5_tokenizer_path t5_max_token_length".split()),
    *(GuiKey(n, "lf", "option") for n in "attn_mode split_attn vae_disable_cache".split()),  # Anima
    *_gui_family("unsloth_offload_checkpointing qwen_image_vae_2d compile compile_backend "
                 "compile_mode compile_dynamic compile_fullgraph compile_cache_size_limit",
                 "lf", "Anima", trained=True),
    *(GuiKey(n, "lf", "option") for n in  # Lumina 2: library/models/families/lumina/
      "gemma2 gemma2_max_token_length system_prompt use_flash_attn use_sage_attn".split()),
)

# Keys the textual-inversion tab (t) writes (kohya_gui/textual_inversion_gui.py config_toml_data);
# its no_token_padding (written only when set) is not here: train_textual_inversion rejects it, as
# an option of train_dreambooth.
GUI_TI_KEYS = """
adaptive_noise_scale async_upload bucket_no_upscale bucket_reso_steps cache_latents
cache_latents_to_disk caption_dropout_every_n_epochs caption_extension clip_skip color_aug
dataset_config disable_mmap_load_safetensors dynamo_backend enable_bucket epoch flip_aug full_fp16
gradient_accumulation_steps gradient_checkpointing huber_c huber_scale huber_schedule
huggingface_repo_id huggingface_token huggingface_repo_type huggingface_repo_visibility
huggingface_path_in_repo init_word ip_noise_gamma ip_noise_gamma_random_strength keep_tokens
learning_rate logging_dir log_config log_tracker_name log_tracker_config loss_type lr_scheduler
lr_scheduler_args lr_scheduler_num_cycles lr_scheduler_power lr_scheduler_type lr_warmup_steps
max_bucket_reso max_timestep max_token_length max_train_epochs max_train_steps mem_eff_attn
metadata_author metadata_description metadata_license metadata_tags metadata_title
min_bucket_reso min_snr_gamma min_timestep mixed_precision multires_noise_discount
multires_noise_iterations no_half_vae noise_offset noise_offset_random_strength noise_offset_type
num_vectors_per_token optimizer_type optimizer_args output_dir output_name
persistent_data_loader_workers pretrained_model_name_or_path prior_loss_weight random_crop
reg_data_dir resolution resume resume_from_huggingface sample_every_n_epochs sample_every_n_steps
sample_prompts sample_sampler save_every_n_epochs save_every_n_steps save_last_n_steps
save_last_n_steps_state save_last_n_epochs save_last_n_epochs_state save_model_as save_precision
save_state save_state_on_train_end save_state_to_huggingface scale_v_pred_loss_like_noise_pred
sdpa seed shuffle_caption skip_cache_check token_string train_batch_size train_data_dir log_with
v2 v_parameterization v_pred_like_loss vae vae_batch_size wandb_api_key wandb_run_name weights
use_object_template use_style_template xformers max_data_loader_n_workers
""".split()


def _with_ti_tab(keys: tuple) -> tuple:
    by_name = {k.name: k for k in keys}
    out = [dataclasses.replace(k, tabs=k.tabs + "t") if k.name in GUI_TI_KEYS else k for k in keys]
    out += [GuiKey(n, "t", "option") for n in GUI_TI_KEYS if n not in by_name]  # the tab's own
    return tuple(out)


GUI_KEYS = _with_ti_tab(GUI_KEYS)

GUI_KEYS_BY_NAME: dict[str, GuiKey] = {k.name: k for k in GUI_KEYS}
# GUI-only keys: parsed from this table (library/config/parse.py)
GUI_ONLY: dict[str, GuiKey] = {k.name: k for k in GUI_KEYS if k.action in ("ignore", "reject")}


def options_for(script: str) -> list[Option]:
    return [o for o in OPTIONS if script in o.scripts]


def _check_schema() -> None:
    """Catch mistakes in the tables above at import (cheap)."""
    names = [o.name for o in OPTIONS] + list(ALIASES) + [n.name for n in SD_SCRIPTS_NAMES]
    dup = {n for n in names if names.count(n) > 1}
    assert not dup, f"option names defined twice: {sorted(dup)}"
    for o in OPTIONS:
        assert o.section in SECTIONS and set(o.scripts) <= set(SCRIPTS), o.name
    assert LECO_OPTIONS <= set(OPTIONS_BY_NAME), sorted(LECO_OPTIONS - set(OPTIONS_BY_NAME))
    for n in SD_SCRIPTS_NAMES:
        assert n.kind in ("flag", "value", "list") and n.action in (_IGN, _REJ), n.name
    gui = [k.name for k in GUI_KEYS]
    assert len(gui) == len(set(gui)), "GUI keys listed twice"
    for k in GUI_KEYS:
        assert set(k.tabs) <= set("ldft") and k.tabs, k.name
        if k.action == "option":
            target = k.target or k.name
            assert target in OPTIONS_BY_NAME or target in ALIASES, f"GUI key {k.name}: no option {target}"
        elif k.action == "sd":
            assert k.name in SD_SCRIPTS_BY_NAME, f"GUI key {k.name}: not an sd-scripts name"
        else:
            assert k.action in ("ignore", "reject") and k.why, k.name
            assert k.name not in names, f"GUI-only key {k.name} is also an option name"


_check_schema()


def render_markdown() -> str:
    """docs/OPTIONS.md, generated from the tables above (a test keeps the file in sync)."""
    out = ["# Options", "",
           "Generated from `library/config/options.py` by `python -m library.config.options > docs/OPTIONS.md`; "
           "do not edit by hand.", "",
           "Every option can be given on the command line (`--name value`) or in a run TOML "
           "(`name = value`, in any table except `[general]`/`[[datasets]]`, which hold the dataset "
           "config). The command line overrides the file. Boolean flags: `--flag` sets true; "
           "`--flag=false` / `--flag false` (also `true/1/0/yes/no/on/off`) sets a value, which is how "
           "a default-true option such as `--sdpa` is turned off. Relative paths, in a file or on the "
           "command line, are relative to the current directory (as in sd-scripts).", "",
           "Scripts: `lora` = train_lora.py, `db` = train_dreambooth.py, `ft` = finetune.py, "
           "`ti` = train_textual_inversion.py, `leco` = train_leco.py.", ""]
    short = {"train_lora": "lora", "train_dreambooth": "db", "finetune": "ft",
             "train_textual_inversion": "ti", "train_leco": "leco"}
    for sec, title in SECTIONS.items():
        out += [f"## {title}", "", "| option | type | default | scripts | allowed | description |",
                "|---|---|---|---|---|---|"]
        for o in OPTIONS:
            if o.section != sec:
                continue
            if o.choices_by_script:
                allowed = "; ".join(f"{short[s]}: {', '.join(c)}" for s, c in o.choices_by_script.items())
            elif o.choices:
                allowed = ", ".join(map(str, o.choices))
            else:
                allowed = o.range_text()
            name = f"`{o.name}`" + "".join(f" (alias `{a}`)" for a in o.aliases)
            scripts = ("all" if o.scripts == ALL else "all, leco" if o.scripts == ALL + LECO
                       else ", ".join(short[s] for s in o.scripts))
            out.append(f"| {name} | {o.type} | {_md_default(o.default)} | {scripts} | {allowed} | "
                       f"{o.help}{' Command line only.' if o.cli_only else ''} |")
        out.append("")
    out += ["## Rules between options", "",
            "- `max_train_steps` or `max_train_epochs` is required; with both, epochs win (with a warning).",
            "- `network_train_unet_only` and `network_train_text_encoder_only` exclude each other.",
            "- `pretrained_model_name_or_path` is required; `train_data_dir` is required unless a "
            "dataset config is given; `resolution` is required unless a dataset config is given; "
            "`output_dir` is required unless `dry_run`.",
            "- `min_bucket_reso <= max_bucket_reso`; with buckets, a `bucket_reso_steps` that is not a multiple of 8 is rounded up to one (with a warning).",
            "- `xformers` takes precedence over `sdpa`; without the xformers package the run uses "
            "SDPA (the same computation), with a warning.",
            "- `min_bucket_reso` / `max_bucket_reso` that are not multiples of `bucket_reso_steps` are "
            "rounded down / up to one, with a warning (sd-scripts' rule). With `enable_bucket` the "
            "resolution only sets the bucket area (`\"512,650\"` is an area of 512 x 650); without it, "
            "a resolution that is not a multiple of 8 is the crop size, as in sd-scripts (a warning).",
            "- `train_dreambooth` (SD1/SD2): a config that sets `text_encoder_lr` (`learning_rate_te`) "
            "or `stop_text_encoder_training` and not `train_text_encoder` trains the text encoder, as "
            "sd-scripts' train_db.py does (one log line says so); `train_text_encoder = false` keeps "
            "it frozen. SDXL trains its text encoders only with `train_text_encoder` (sdxl_train.py).",
            "- `network_args` / `optimizer_args` as a list with a key given twice: the last value wins "
            "(as sd-scripts), with a warning.",
            "- A value in a config file is checked (type, range) even when the command line overrides it.",
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
    out += _render_gui_keys()
    return "\n".join(out)


def gui_key_effect(k: GuiKey) -> str:
    """What a kohya_ss GUI key does here, in words (docs/OPTIONS.md, docs/KOHYA_GUI.md)."""
    if k.action == "option":
        target = ALIASES.get(k.target or k.name, k.target or k.name)
        return f"honoured as option `{target}`" + (f"; {k.why}" if k.why else "")
    if k.action == "sd":
        n = SD_SCRIPTS_BY_NAME[k.name]
        if n.action == _IGN:
            return f"no effect, with a warning: {n.why}"
        return f"rejected unless off ({_md_off(n)}): {n.why}"
    if k.action == "ignore":
        return f"no effect, with a warning when set: {k.why}"
    return f"rejected when set: {k.why}"


def _render_gui_keys() -> list:
    tab = {"l": "LoRA", "d": "DreamBooth", "f": "fine-tune", "t": "textual inversion"}
    out = ["## Keys the kohya_ss GUI writes", "",
           "Every key of the run TOML the kohya_ss GUI (bmaltais/kohya_ss) writes from its LoRA, "
           "DreamBooth, fine-tune and textual-inversion tabs (`config_toml_data`), and what it does here. A key is "
           "\"set\" unless it has the GUI's unset value (the GUI leaves out empty, false and "
           "unset values itself). See docs/KOHYA_GUI.md for bringing a GUI config over.", "",
           "| key | tabs | here |", "|---|---|---|"]
    for k in sorted(GUI_KEYS, key=lambda k: k.name):
        tabs = ", ".join(tab[c] for c in k.tabs)
        out.append(f"| `{k.name}` | {tabs} | {gui_key_effect(k)} |")
    out.append("")
    return out


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
