"""Anima's other parts, as sd-scripts' anima_utils reads them: the Qwen3-0.6B text encoder (a
Hugging Face folder, or one ``.safetensors`` file with the tokenizer files beside it), the T5
tokenizer of the LLM adapter (``t5_tokenizer_path``, default T5 v1.1's), and the Qwen-Image VAE
(a diffusers folder, or one ``.safetensors`` / ``.pth`` file in diffusers' layout or in the
original Wan / ComfyUI layout, renamed by diffusers' ``convert_wan_vae_to_diffusers``; the shapes
are checked after the renaming, so a file it does not map is refused in one line). Each file is checked against the part's shapes before a weight loads: one line naming
the file and the key.
"""
from __future__ import annotations

import os

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

from library.errors import first_line
from library.models import t5
from library.models.families.anima.model import LATENT_CHANNELS, AnimaModelError
from library.models.families.anima.weights import header_shapes

# Qwen3-0.6B (its config.json; sd-scripts ships it as its qwen3_06b config)
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, use_cache=False)
QWEN3_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _expected_shapes(module_factory) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in module_factory().state_dict().items()}


def check_against(expected: dict, shapes: dict, source: str, what: str, ignore=()) -> None:
    """``shapes`` (a file's) holds exactly ``expected``'s keys with their shapes."""
    for key, shape in expected.items():
        if key not in shapes:
            raise AnimaModelError(f"{source}: not {what} (no {key})")
        if tuple(shapes[key]) != shape:
            raise AnimaModelError(f"{source}: {key} has shape {list(shapes[key])}, {what} has {list(shape)}")
    extra = sorted(k for k in shapes if k not in expected and not k.startswith(ignore))
    if extra:
        raise AnimaModelError(f"{source}: {len(extra)} keys that are not {what}'s, first {extra[0]}")


# --- Qwen3 ----------------------------------------------------------------------------------

def _qwen3_keys(tensors: dict) -> dict:
    """sd-scripts strips ``model.``; a causal-LM file's ``lm_head`` (tied to the embedding) is dropped."""
    return {(k[len("model."):] if k.startswith("model.") else k): v for k, v in tensors.items()
            if not k.startswith("lm_head.")}


def load_qwen3(path: str, config: dict | None = None) -> tuple[Qwen3Model, object]:
    """(Qwen3Model, tokenizer) from a Hugging Face folder or one file (Qwen3-0.6B's config unless
    ``config`` is given); the tokenizer pads with ``<|endoftext|>`` (eos when it has no pad)."""
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise AnimaModelError(f"qwen3: {path} does not exist")
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - missing files and parse errors end the same way
        raise AnimaModelError(f"qwen3: no Qwen3 tokenizer in {folder} ({first_line(e)}); put Qwen3-0.6B's "
                              f"{' and '.join(QWEN3_TOKENIZER_FILES)} beside the weights or give its folder") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if os.path.isdir(path):
        try:
            cfg = Qwen3Config.from_pretrained(path, local_files_only=True)
        except Exception as e:  # noqa: BLE001
            raise AnimaModelError(f"qwen3: {path} has no Qwen3 config.json ({first_line(e)})") from None
        if cfg.model_type != "qwen3":
            raise AnimaModelError(f"qwen3: {path} is a {cfg.model_type} model, not Qwen3")
        files = [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
        if not files:
            raise AnimaModelError(f"qwen3: {path} holds no .safetensors weights")
    else:
        cfg, files = Qwen3Config(**(config or QWEN3_06B)), [path]
    cfg.use_cache = False
    shapes: dict = {}
    for f in files:
        shapes.update(_qwen3_keys(header_shapes(f)))
    check_against(_expected_shapes(lambda: Qwen3Model(cfg)), shapes, path, "a Qwen3 text encoder "
                  f"({cfg.hidden_size} wide, {cfg.num_hidden_layers} layers)")
    sd = {}
    for f in files:
        sd.update(load_file(f))
    sd = _qwen3_keys(sd)
    with torch.device("meta"):
        model = Qwen3Model(cfg)
    model.load_state_dict(sd, strict=True, assign=True)
    with torch.device("cpu"):  # its RoPE tables are non-persistent buffers: rebuilt, not loaded
        model.rotary_emb = type(model.rotary_emb)(config=model.config)
    left = [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise AnimaModelError(f"qwen3: {path}: buffers not rebuilt ({left[0]}); this transformers version's Qwen3 "
                              "has buffers this loader does not know")
    return model.eval().requires_grad_(False), tokenizer


def encode_qwen3(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The last hidden states, zero at the padding (sd-scripts' AnimaTextEncodingStrategy)."""
    dev = next(model.parameters()).device
    out = model(input_ids=input_ids.to(dev), attention_mask=attention_mask.to(dev)).last_hidden_state
    return out * attention_mask.to(dev, out.dtype).unsqueeze(-1)


# --- the T5 tokenizer ------------------------------------------------------------------------

def load_t5_tokenizer(path: str | None):
    """``t5_tokenizer_path``: a folder with T5's tokenizer files; None: T5 v1.1's (sd-scripts'
    bundled t5_old), from the local Hugging Face cache."""
    return t5.load_t5_tokenizer(os.path.expanduser(path) if path else None)


# --- the VAE --------------------------------------------------------------------------------

def _vae_class():
    from diffusers import AutoencoderKLQwenImage  # lazy: diffusers' model classes load slowly

    return AutoencoderKLQwenImage


def load_vae(path: str, config: dict | None = None):
    """The Qwen-Image VAE (``AutoencoderKLQwenImage``) from a diffusers folder or one file."""
    cls = _vae_class()
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise AnimaModelError(f"vae: {path} does not exist")
    if os.path.isdir(path):
        try:
            vae = cls.from_pretrained(path, local_files_only=True)
        except Exception as e:  # noqa: BLE001
            raise AnimaModelError(f"vae: {path} is not a diffusers AutoencoderKLQwenImage folder ({first_line(e)})") \
                from None
        _check_vae_channels(vae, path)
        return vae.eval().requires_grad_(False)
    if path.endswith(".safetensors"):
        shapes = header_shapes(path)
    else:
        sd = torch.load(path, map_location="cpu", weights_only=True)
        shapes = {k: tuple(v.shape) for k, v in sd.items()}
    wan = "encoder.conv1.weight" in shapes
    if wan:
        from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers  # lazy: as above

        shapes = {k: tuple(v.shape) for k, v in convert_wan_vae_to_diffusers(
            {k: torch.empty(s, device="meta") for k, s in shapes.items()}).items()}
    cfg = config or {}
    check_against(_expected_shapes(lambda: cls(**cfg)), shapes, path, "a Qwen-Image VAE (16 channels, 8x down)")
    if path.endswith(".safetensors"):
        sd = load_file(path)
    if wan:
        sd = convert_wan_vae_to_diffusers(sd)
    with torch.device("meta"):
        vae = cls(**cfg)
    vae.load_state_dict(sd, strict=True, assign=True)
    return vae.eval().requires_grad_(False)


def _check_vae_channels(vae, path: str) -> None:
    if getattr(vae.config, "z_dim", None) != LATENT_CHANNELS:
        raise AnimaModelError(f"vae: {path} has {vae.config.z_dim} latent channels; Anima's VAE has 16")


def latent_stats(vae) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (mean, std) of the VAE's latents (its config's latents_mean / latents_std):
    the DiT sees (z - mean) / std (sd-scripts' encode_pixels_to_latents, diffusers' pipeline)."""
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32)
    std = torch.tensor(vae.config.latents_std, dtype=torch.float32)
    return mean.view(1, -1, 1, 1), std.view(1, -1, 1, 1)


def encode_images(vae, images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> (B, 16, H/8, W/8) normalised latents (the posterior's mode:
    sd-scripts' Qwen-Image encoder returns the mean)."""
    p = next(vae.parameters())
    z = vae.encode(images.to(p.device, p.dtype).unsqueeze(2)).latent_dist.mode()[:, :, 0]
    mean, std = latent_stats(vae)
    return (z.float() - mean.to(z.device)) / std.to(z.device)


def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents (B, 16, h, w) -> images (B, 3, 8h, 8w) in [-1, 1] (unclamped)."""
    p = next(vae.parameters())
    mean, std = latent_stats(vae)
    z = latents.float() * std.to(latents.device) + mean.to(latents.device)
    return vae.decode(z.to(p.device, p.dtype).unsqueeze(2)).sample[:, :, 0]
