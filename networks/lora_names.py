"""Kohya LoRA module names.

A kohya name is ``<prefix>_<module path with "." replaced by "_">``. The paths that the
ecosystem (A1111, Forge, ComfyUI, diffusers' kohya loader) expects are:

- SD1/SD2 U-Net: the diffusers layout (``down_blocks.0.attentions.0...``), because sd-scripts trains
  SD1/2 on a diffusers-shaped U-Net;
- SDXL U-Net: the SAI/original layout (``input_blocks.4.1...``), because sd-scripts trains SDXL on
  its own SAI-shaped U-Net; our models are diffusers models, so their paths are translated
  by ``library.models.unet_layout``;
- text encoders: the transformers layout under ``text_model.`` (transformers 5 dropped the
  ``text_model`` wrapper from ``CLIPTextModel`` but not from ``CLIPTextModelWithProjection``;
  the names in the file must not depend on that).
"""
from __future__ import annotations

from library.models import unet_layout

PREFIX_UNET = "lora_unet"
PREFIX_TE = "lora_te"
PREFIX_TE1 = "lora_te1"
PREFIX_TE2 = "lora_te2"


def kohya_name(prefix: str, module_path: str) -> str:
    return (prefix + "." + module_path).replace(".", "_")


def text_encoder_path(path: str) -> str:
    """The module path as the text encoder had it inside ``text_model`` (see module docstring)."""
    return path if path.startswith("text_model.") else "text_model." + path


def text_encoder_prefix(index: int, count: int) -> str:
    if count == 1:
        return PREFIX_TE
    return PREFIX_TE1 if index == 0 else PREFIX_TE2


def text_encoder_prefix_of(lora_name: str) -> str:
    """``lora_te``, ``lora_te1``, ``lora_te2`` or ``lora_te3`` (FLUX / SD3 T5) of a text encoder module name."""
    head = lora_name.split("_", 2)
    return "_".join(head[:2])


def is_sdxl_unet(unet) -> bool:
    config = getattr(unet, "config", None)
    return getattr(config, "addition_embed_type", None) == "text_time"


def sdxl_block_map(unet) -> dict[str, str]:
    """Map each diffusers block path of an SDXL-shaped U-Net to its SAI path."""
    return unet_layout.block_map(unet.config)


def sdxl_module_path(path: str, block_map: dict[str, str]) -> str:
    """Translate a diffusers module path inside an SDXL U-Net to the SAI path."""
    return unet_layout.original_path(path, block_map)


def plain_to_kohya_names(text_encoders, unet) -> dict[str, str]:
    """{name a plain walk gives: the kohya name} for every module of the model whose two names
    differ. A plain walk (``<prefix>_<module path>``, as LyCORIS' lycoris.kohya names modules on
    the model it is given) names our diffusers SDXL U-Net in diffusers layout
    (``lora_unet_down_blocks_...``, which A1111 would map with SD1 numbering) and transformers 5's
    CLIPTextModel without ``text_model``; the kohya names are those of networks.lora. The text
    encoders' prefixes are LyCORIS': ``lora_te`` for one, ``lora_te1``, ``lora_te2``, ``lora_te3``
    by position in a list (FLUX.1's [CLIP-L, T5], SD3's [CLIP-L, CLIP-G, T5], as sd-scripts' trainers
    pass them)."""
    out: dict[str, str] = {}
    tes = [te for te in text_encoders if te is not None]
    for i, te in enumerate(tes):
        if not is_clip(te):
            continue  # T5 (FLUX.1, SD3): its paths are its names
        prefix = PREFIX_TE if len(tes) == 1 else f"{PREFIX_TE}{i + 1}"  # LyCORIS: te1, te2, te3 of a list
        for path, _ in te.named_modules():
            if path:
                plain, ours = kohya_name(prefix, path), kohya_name(prefix, text_encoder_path(path))
                if plain != ours:
                    out[plain] = ours
    if unet is not None and is_sdxl_unet(unet):
        blocks = sdxl_block_map(unet)
        for path, _ in unet.named_modules():
            try:
                ours = kohya_name(PREFIX_UNET, sdxl_module_path(path, blocks))
            except KeyError:
                continue  # no original-layout place (e.g. time_proj, which has no weights)
            out[kohya_name(PREFIX_UNET, path)] = ours
    return out


def kohya_layers(text_encoders, unet) -> dict:
    """{kohya name: module} for every module of the text encoders and the U-Net, under the names
    networks.lora gives and lycoris.kohya's files get (plain_to_kohya_names; text encoder prefixes
    as there)."""
    tes = [te for te in text_encoders if te is not None]
    roots = [(PREFIX_TE if len(tes) == 1 else f"{PREFIX_TE}{i + 1}", te) for i, te in enumerate(tes)]
    renames = plain_to_kohya_names(tes, unet)
    out = {}
    for prefix, root in roots + ([(PREFIX_UNET, unet)] if unet is not None else []):
        for path, module in root.named_modules():
            if path:
                plain = kohya_name(prefix, path)
                out[renames.get(plain, plain)] = module
    return out


def is_clip(text_encoder) -> bool:
    """A transformers CLIP text model (its kohya names are under ``text_model.``)."""
    return str(getattr(getattr(text_encoder, "config", None), "model_type", "")).startswith("clip")


def rename_keys(state_dict: dict, names: dict[str, str]) -> dict:
    """Rename ``<module name>.<tensor>`` keys by module name (names not in the table stay)."""
    out = {}
    for key, value in state_dict.items():
        module, dot, rest = key.partition(".")
        out[names.get(module, module) + dot + rest] = value
    return out
