"""LoRA for FLUX.1 in kohya's layout (the ``network_module`` of sd-scripts' ``networks/lora_flux.py``).

Names are ``lora_unet_`` + the BFL module path (library/models/families/flux/flux.py), dots as underscores, as
ComfyUI, Forge and diffusers' kohya converter read them; CLIP-L is ``lora_te1_text_model_...``,
T5-XXL (``train_t5xxl``) ``lora_te3_encoder_block_...``.

Targets, as sd-scripts: every Linear of the double blocks (``double_blocks_N_{img,txt}_attn_qkv``,
``_attn_proj``, ``_mlp_0``, ``_mlp_2``, ``_mod_lin``) and single blocks (``single_blocks_N_linear1``,
``_linear2``, ``_modulation_lin``); with ``in_dims`` also ``img_in``, ``time_in_{in,out}_layer``,
``vector_in_*``, ``guidance_in_*`` (dev), ``txt_in``; the final layer never. network_args:
``train_blocks`` (all / single / double), ``train_double_block_indices`` /
``train_single_block_indices`` ("0-3,7", "all", "none"), per-kind ranks ``img_attn_dim``,
``txt_attn_dim``, ``img_mlp_dim``, ``txt_mlp_dim``, ``img_mod_dim``, ``txt_mod_dim``,
``single_dim`` (linear1 and linear2), ``single_mod_dim`` (0 = none), ``in_dims`` (five ranks: img,
time, vector, guidance, txt), ``split_qkv`` (networks/lora_dit.py), ``train_t5xxl``, and LoRA's
``rank_dropout``, ``module_dropout``, ``loraplus_*``.
"""
from __future__ import annotations

from typing import Any, Optional

from library.models.families.flux import home
from networks import lora_dit
from networks.lora import TEXT_ENCODER_TARGET_MODULES, LoRAError, load_state_dict_file
from networks.lora_dit import Target

NETWORK_MODULE = "networks.lora_flux"
KIND = "LoRA"  # what library/training/network_options.py calls it in messages
PREFIX_CLIP_L, PREFIX_T5 = "lora_te1", "lora_te3"  # sd-scripts (lora_te3 for T5: ComfyUI maps it)
IN_LAYERS = ("img_in", "time_in", "vector_in", "guidance_in", "txt_in")  # in_dims order
TYPE_DIM_ARGS = ("img_attn_dim", "txt_attn_dim", "img_mlp_dim", "txt_mlp_dim", "img_mod_dim", "txt_mod_dim",
                 "single_dim", "single_mod_dim")
KNOWN_NETWORK_ARGS = ("train_blocks", "train_double_block_indices", "train_single_block_indices", *TYPE_DIM_ARGS,
                      "in_dims", "split_qkv", "train_t5xxl", "verbose", "rank_dropout", "module_dropout",
                      "loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio")
UNSUPPORTED = {"ggpo_beta": "sd-scripts' LoRA-GGPO", "ggpo_sigma": "sd-scripts' LoRA-GGPO",
               "network_reg_dims": "sd-scripts' ranks by regular expression",
               "network_reg_lrs": "sd-scripts' learning rates by regular expression"}
NO_EFFECT = ("conv_dim", "conv_alpha")


def parse_network_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """network_args of networks.lora_flux (strings as given, or values) -> checked values; one
    LoRAError line naming the arg for an unknown key or a bad value. Block indices are checked
    against the model when the network is built."""
    m = NETWORK_MODULE
    lora_dit.check_known(m, kwargs, KNOWN_NETWORK_ARGS, UNSUPPORTED, NO_EFFECT)
    out = lora_dit.common_args(m, kwargs)
    blocks = str(kwargs.get("train_blocks") or "all").strip()
    if blocks not in ("all", "single", "double"):
        raise LoRAError(f"network_args: train_blocks={kwargs['train_blocks']!r} for {m} must be all, single or double")
    out["train_blocks"] = blocks
    for key in ("train_double_block_indices", "train_single_block_indices"):
        if kwargs.get(key) is not None:
            out[key] = lora_dit.parse_block_selection(m, key, kwargs[key])
    for key in TYPE_DIM_ARGS:
        if kwargs.get(key) is not None:
            out[key] = lora_dit.parse_dim(m, key, kwargs[key])
    if kwargs.get("in_dims") is not None:
        out["in_dims"] = lora_dit.parse_dims(m, "in_dims", kwargs["in_dims"], IN_LAYERS)
    for key in ("split_qkv", "train_t5xxl", "verbose"):
        out[key] = lora_dit.parse_switch(m, key, kwargs[key]) if kwargs.get(key) is not None else False
    return out


def check_network_args(kwargs: dict[str, Any]) -> None:
    """Before any weight loads (the trainer calls it when network_module is networks.lora_flux)."""
    parse_network_args(dict(kwargs))


def _type_dim(args: dict[str, Any], path: str) -> Optional[int]:
    """The per-kind rank for a block layer (sd-scripts' order of identifiers), or None."""
    kinds = (("img_attn_dim", ".img_attn."), ("txt_attn_dim", ".txt_attn."), ("img_mlp_dim", ".img_mlp."),
             ("txt_mlp_dim", ".txt_mlp."), ("img_mod_dim", ".img_mod."), ("txt_mod_dim", ".txt_mod."))
    for key, part in kinds:
        if part in path and args.get(key) is not None:
            return args[key]
    if path.startswith("single_blocks."):
        key = "single_mod_dim" if ".modulation." in path else "single_dim"
        return args.get(key)
    return None


def transformer_targets(flux, args: dict[str, Any], dim: int, alpha: float) -> list[Target]:
    """Every Linear LoRA may go on in the Flux transformer, with the rank network_args give it
    (0: none). ``args`` from parse_network_args."""
    cfg = flux.config
    h = cfg.hidden_size
    double = lora_dit.selected_blocks(NETWORK_MODULE, "train_double_block_indices",
                                      args.get("train_double_block_indices", "all"), cfg.depth)
    single = lora_dit.selected_blocks(NETWORK_MODULE, "train_single_block_indices",
                                      args.get("train_single_block_indices", "all"), cfg.depth_single_blocks)
    blocks = args.get("train_blocks", "all")
    out = []
    for kind, flags in (("double_blocks", double), ("single_blocks", single)):
        if blocks not in ("all", kind.split("_")[0]):
            continue
        for i, block in enumerate(getattr(flux, kind)):
            for child, module in block.named_modules():
                if module.__class__.__name__ != "Linear":
                    continue
                path = f"{kind}.{i}.{child}"
                d = _type_dim(args, path)
                d = dim if d is None else d
                if not flags[i]:
                    d = 0
                split = None
                if args.get("split_qkv") and (path.endswith("_attn.qkv") or path.endswith(".linear1")):
                    split = (h, h, h) if path.endswith("qkv") else (h, h, h, cfg.mlp_hidden_dim)
                out.append(Target("lora_unet_" + path.replace(".", "_"), module, d, alpha, split))
    in_dims = args.get("in_dims") or [0] * len(IN_LAYERS)
    for layer, d in zip(IN_LAYERS, in_dims):
        root = getattr(flux, layer, None)  # schnell has no guidance_in
        if root is None:
            continue
        for child, module in root.named_modules():
            if module.__class__.__name__ == "Linear":
                path = layer + ("." + child if child else "")
                out.append(Target("lora_unet_" + path.replace(".", "_"), module, d, alpha))
    return out


def all_targets(text_encoders, flux, args: dict[str, Any], dim: int, alpha: float) -> tuple[list[Target], list[Target]]:
    """(text-encoder targets, transformer targets). text_encoders: [CLIP-L, T5-XXL] as sd-scripts
    passes them (either may be None); T5 only with train_t5xxl."""
    tes = list(text_encoders) if isinstance(text_encoders, (list, tuple)) else [text_encoders]
    te_targets: list[Target] = []
    if tes and tes[0] is not None:
        te_targets += lora_dit.text_encoder_targets(tes[0], PREFIX_CLIP_L, TEXT_ENCODER_TARGET_MODULES, dim, alpha)
    if args.get("train_t5xxl") and len(tes) > 1 and tes[1] is not None:
        te_targets += lora_dit.text_encoder_targets(tes[1], PREFIX_T5, lora_dit.T5_TARGET_MODULES, dim, alpha)
    return te_targets, transformer_targets(flux, args, dim, alpha)


def create_network(multiplier: float, network_dim: Optional[int], network_alpha: Optional[float], ae,
                   text_encoders, flux, neuron_dropout: Optional[float] = None, **kwargs) -> lora_dit.DiTLoRANetwork:
    """sd-scripts' create_network of networks.lora_flux: text_encoders [CLIP-L, T5-XXL], flux the
    BFL-layout transformer (library.models.families.flux.flux.Flux)."""
    return build_network(multiplier, network_dim, network_alpha, text_encoders, flux, neuron_dropout,
                         parse_network_args(kwargs))


def build_network(multiplier, network_dim, network_alpha, text_encoders, flux, neuron_dropout,
                  args: dict[str, Any]) -> lora_dit.DiTLoRANetwork:
    return lora_dit.build_network(all_targets, NETWORK_MODULE, multiplier, network_dim, network_alpha,
                                  text_encoders, flux, neuron_dropout, args)


def create_network_from_weights(multiplier: float, file: Optional[str], ae, text_encoders, flux, weights_sd=None,
                                for_inference: bool = False, **kwargs):
    """A network shaped like the file (rank and alpha per module; a split_qkv file is a plain LoRA
    of parts x rank, as sd-scripts reads it); weights are not loaded here."""
    if weights_sd is None:
        weights_sd = load_state_dict_file(file)
    args = parse_network_args(kwargs)
    args = {**args, "split_qkv": False, "train_t5xxl": any(k.startswith(PREFIX_T5 + "_") for k in weights_sd),
            "in_dims": [1] * len(IN_LAYERS), "train_blocks": "all", "train_double_block_indices": "all",
            "train_single_block_indices": "all"}
    network = lora_dit.network_from_weights(all_targets, text_encoders, flux, args, weights_sd, file, multiplier)
    return network, weights_sd


def file_metadata(variant: str) -> dict[str, str]:
    """The family's keys of a FLUX.1 LoRA file, as sd-scripts writes them (flux_train_network.py,
    library/sai_model_spec.py): variant "dev" or "schnell"."""
    return {"ss_network_module": NETWORK_MODULE, "ss_v2": "False", **home.metadata_fields(variant, "lora")}
