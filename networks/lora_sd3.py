"""LoRA for SD3 / SD3.5 in kohya's layout (the ``network_module`` of sd-scripts' ``networks/lora_sd3.py``).

Names are ``lora_unet_`` + the SAI module path (library/models/families/sd3/sd3.py), dots as underscores, as
ComfyUI and Forge read them: ``lora_unet_joint_blocks_N_{context_block,x_block}_{attn_qkv,
attn_proj, mlp_fc1, mlp_fc2, adaLN_modulation_1}`` (SD3.5 medium also ``x_block_attn2_*``);
CLIP-L ``lora_te1_``, CLIP-G ``lora_te2_``, T5-XXL (``train_t5xxl``) ``lora_te3_``.

Targets, as sd-scripts: every Linear of both streams of every joint block; with ``emb_dims``
(six ranks: context_embedder, t_embedder, x_embedder, y_embedder, final_layer adaLN_modulation,
final_layer linear) also those layers (x_embedder is the 2x2 patch convolution: a conv LoRA).
network_args: ``train_block_indices``, per-kind ranks ``context_attn_dim``, ``context_mlp_dim``,
``context_mod_dim``, ``x_attn_dim``, ``x_mlp_dim``, ``x_mod_dim`` (0 = none), ``emb_dims``,
``split_qkv`` (networks/lora_dit.py), ``train_t5xxl``, and LoRA's ``rank_dropout``,
``module_dropout``, ``loraplus_*``.
"""
from __future__ import annotations

from typing import Any, Optional

from library.models.families.sd3 import home
from networks import lora_dit
from networks.lora import TEXT_ENCODER_TARGET_MODULES, LoRAError, load_state_dict_file
from networks.lora_dit import Target

NETWORK_MODULE = "networks.lora_sd3"
KIND = "LoRA"  # what library/training/network_options.py calls it in messages
PREFIXES = ("lora_te1", "lora_te2", "lora_te3")  # CLIP-L, CLIP-G, T5-XXL
EMB_LAYERS = ("context_embedder", "t_embedder", "x_embedder", "y_embedder", "final_layer.adaLN_modulation",
              "final_layer.linear")  # emb_dims order
TYPE_DIM_ARGS = ("context_attn_dim", "context_mlp_dim", "context_mod_dim", "x_attn_dim", "x_mlp_dim", "x_mod_dim")
KNOWN_NETWORK_ARGS = ("train_block_indices", *TYPE_DIM_ARGS, "emb_dims", "split_qkv", "train_t5xxl", "verbose",
                      "rank_dropout", "module_dropout", "loraplus_lr_ratio", "loraplus_unet_lr_ratio",
                      "loraplus_text_encoder_lr_ratio")
NO_EFFECT = ("conv_dim", "conv_alpha")


def parse_network_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """network_args of networks.lora_sd3 -> checked values; one LoRAError line naming the arg for
    an unknown key or a bad value (block indices are checked against the model when built)."""
    m = NETWORK_MODULE
    lora_dit.check_known(m, kwargs, KNOWN_NETWORK_ARGS, {}, NO_EFFECT)
    out = lora_dit.common_args(m, kwargs)
    if kwargs.get("train_block_indices") is not None:
        out["train_block_indices"] = lora_dit.parse_block_selection(m, "train_block_indices",
                                                                    kwargs["train_block_indices"])
    for key in TYPE_DIM_ARGS:
        if kwargs.get(key) is not None:
            out[key] = lora_dit.parse_dim(m, key, kwargs[key])
    if kwargs.get("emb_dims") is not None:
        out["emb_dims"] = lora_dit.parse_dims(m, "emb_dims", kwargs["emb_dims"], EMB_LAYERS)
    for key in ("split_qkv", "train_t5xxl", "verbose"):
        out[key] = lora_dit.parse_switch(m, key, kwargs[key]) if kwargs.get(key) is not None else False
    return out


def check_network_args(kwargs: dict[str, Any]) -> None:
    """Before any weight loads (the trainer calls it when network_module is networks.lora_sd3)."""
    parse_network_args(dict(kwargs))


def _type_dim(args: dict[str, Any], stream: str, layer: str) -> Optional[int]:
    kind = "attn" if layer.startswith("attn") else "mlp" if layer.startswith("mlp") else \
        "mod" if layer.startswith("adaLN_modulation") else None
    key = f"{'context' if stream == 'context_block' else 'x'}_{kind}_dim"
    return args.get(key) if kind else None


def transformer_targets(mmdit, args: dict[str, Any], dim: int, alpha: float) -> list[Target]:
    """Every Linear (and the patch conv) LoRA may go on in the MMDiT, with the rank network_args
    give it (0: none). ``args`` from parse_network_args."""
    flags = lora_dit.selected_blocks(NETWORK_MODULE, "train_block_indices", args.get("train_block_indices", "all"),
                                     mmdit.config.depth)
    h = mmdit.config.hidden_size
    out = []
    for i, block in enumerate(mmdit.joint_blocks):
        for stream in ("context_block", "x_block"):
            for layer, module in getattr(block, stream).named_modules():
                if module.__class__.__name__ != "Linear":
                    continue
                d = _type_dim(args, stream, layer)
                d = (dim if d is None else d) if flags[i] else 0
                path = f"joint_blocks.{i}.{stream}.{layer}"
                split = (h, h, h) if args.get("split_qkv") and layer.endswith(".qkv") else None
                out.append(Target("lora_unet_" + path.replace(".", "_"), module, d, alpha, split))
    emb = args.get("emb_dims") or [0] * len(EMB_LAYERS)
    for layer, d in zip(EMB_LAYERS, emb):
        root = mmdit.get_submodule(layer)
        for child, module in root.named_modules():
            if module.__class__.__name__ in ("Linear", "Conv2d"):
                path = layer + ("." + child if child else "")
                out.append(Target("lora_unet_" + path.replace(".", "_"), module, d, alpha))
    return out


def all_targets(text_encoders, mmdit, args: dict[str, Any], dim: int,
                alpha: float) -> tuple[list[Target], list[Target]]:
    """(text-encoder targets, transformer targets). text_encoders: [CLIP-L, CLIP-G, T5-XXL] as
    sd-scripts passes them (any may be None); T5 only with train_t5xxl."""
    tes = list(text_encoders) if isinstance(text_encoders, (list, tuple)) else [text_encoders]
    if args.get("train_t5xxl") and (len(tes) < 3 or tes[2] is None):
        raise LoRAError(f"network_args: train_t5xxl for {NETWORK_MODULE}: this SD3 model has no T5-XXL "
                        "(give the t5xxl file)")
    te_targets: list[Target] = []
    for i, te in enumerate(tes[:3]):
        if te is None or (i == 2 and not args.get("train_t5xxl")):
            continue
        classes = lora_dit.T5_TARGET_MODULES if i == 2 else TEXT_ENCODER_TARGET_MODULES
        te_targets += lora_dit.text_encoder_targets(te, PREFIXES[i], classes, dim, alpha)
    return te_targets, transformer_targets(mmdit, args, dim, alpha)


class SD3LoRANetwork(lora_dit.DiTLoRANetwork):
    """The SD3 network: text_encoder_lr as sd-scripts' lora_sd3 reads it, one rate for all three
    encoders or [CLIP-L, CLIP-G] (T5-XXL at CLIP-G's) or [CLIP-L, CLIP-G, T5-XXL]."""

    def prepare_optimizer_params(self, text_encoder_lr, unet_lr, default_lr):
        if isinstance(text_encoder_lr, (list, tuple)) and len(text_encoder_lr) == 2:
            text_encoder_lr = [*text_encoder_lr, text_encoder_lr[1]]
        return super().prepare_optimizer_params(text_encoder_lr, unet_lr, default_lr)

    prepare_optimizer_params_with_multiple_te_lrs = prepare_optimizer_params


def create_network(multiplier: float, network_dim: Optional[int], network_alpha: Optional[float], vae,
                   text_encoders, mmdit, neuron_dropout: Optional[float] = None, **kwargs) -> lora_dit.DiTLoRANetwork:
    """sd-scripts' create_network of networks.lora_sd3: text_encoders [CLIP-L, CLIP-G, T5-XXL],
    mmdit the SAI-layout transformer (library.models.families.sd3.sd3.MMDiT)."""
    return build_network(multiplier, network_dim, network_alpha, text_encoders, mmdit, neuron_dropout,
                         parse_network_args(kwargs))


def build_network(multiplier, network_dim, network_alpha, text_encoders, mmdit, neuron_dropout,
                  args: dict[str, Any]) -> lora_dit.DiTLoRANetwork:
    return lora_dit.build_network(all_targets, NETWORK_MODULE, multiplier, network_dim, network_alpha,
                                  text_encoders, mmdit, neuron_dropout, args, SD3LoRANetwork)


def create_network_from_weights(multiplier: float, file: Optional[str], vae, text_encoders, mmdit, weights_sd=None,
                                for_inference: bool = False, **kwargs):
    """A network shaped like the file (rank and alpha per module); weights are not loaded here."""
    if weights_sd is None:
        weights_sd = load_state_dict_file(file)
    args = {**parse_network_args(kwargs), "split_qkv": False, "emb_dims": [1] * len(EMB_LAYERS),
            "train_t5xxl": any(k.startswith(PREFIXES[2] + "_") for k in weights_sd), "train_block_indices": "all"}
    network = lora_dit.network_from_weights(all_targets, text_encoders, mmdit, args, weights_sd, file, multiplier,
                                            SD3LoRANetwork)
    return network, weights_sd


def file_metadata(variant: str) -> dict[str, str]:
    """The family's keys of an SD3 LoRA file, as sd-scripts writes them (sd3_train_network.py,
    library/sai_model_spec.py): variant "sd3", "sd3.5-medium" or "sd3.5-large" (MMDiTConfig.variant).
    sd-scripts' modelspec for an SD3 LoRA says implementation "diffusers" and prediction type
    "epsilon" (its SD1 defaults); written the same so that tools reading them agree."""
    return {"ss_network_module": NETWORK_MODULE, "ss_v2": "False", **home.metadata_fields(variant, "lora")}
