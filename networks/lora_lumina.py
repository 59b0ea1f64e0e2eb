"""LoRA for Lumina Image 2.0 in kohya's layout (the ``network_module`` of sd-scripts'
``networks/lora_lumina.py``).

Names are ``lora_unet_`` + the original module path (library/models/families/lumina/nextdit.py),
dots as underscores: ``lora_unet_{layers,noise_refiner,context_refiner}_N_{attention_qkv,
attention_out,feed_forward_w1,feed_forward_w2,feed_forward_w3,adaLN_modulation_1}``,
``lora_unet_final_layer_{linear,adaLN_modulation_1}``, with ``embedder_dims`` also
``lora_unet_x_embedder``, ``lora_unet_t_embedder_mlp_{0,2}``, ``lora_unet_cap_embedder_1``; Gemma-2
``lora_te_layers_N_{self_attn_{q,k,v,o}_proj,mlp_{gate,up,down}_proj}``.

Targets, as sd-scripts: every Linear of every transformer block and the final layer (its
``JointTransformerBlock`` / ``FinalLayer``), and of Gemma-2's attention and MLP when the text
encoder trains. network_args: ``train_blocks`` (all, transformer: the names with ``layers_``,
refiners, noise_refiner, context_refiner), per-kind ranks ``attn_dim``, ``mlp_dim``, ``mod_dim``,
``refiner_dim`` (0 = none; the first given one whose kind the name has, in that order),
``embedder_dims`` (x, t, caption), ``split_qkv`` (networks/lora_dit.py), and LoRA's
``rank_dropout``, ``module_dropout``, ``loraplus_*``, ``verbose``.
Stronger than sd-scripts: its ``mlp_dim`` looks for "mlp" in the name, which no Lumina module has
(the feed-forward is ``feed_forward``), so it never applies there; here it sets the feed-forward
rank, as its documentation says.
"""
from __future__ import annotations

from typing import Any, Optional

from library.models.families.lumina import home
from networks import lora_dit
from networks.lora import LoRAError, load_state_dict_file
from networks.lora_dit import Target

NETWORK_MODULE = "networks.lora_lumina"
KIND = "LoRA"  # what library/training/network_options.py calls it in messages
UNET_PREFIX, TE_PREFIX = "lora_unet", "lora_te"
TE_TARGET_MODULES = ("Gemma2Attention", "Gemma2MLP")
EMBEDDERS = ("x_embedder", "t_embedder", "cap_embedder")  # embedder_dims order
# per-kind rank -> what its module names contain (sd-scripts' identifiers; mlp_dim: feed_forward)
TYPE_DIM_ARGS = {"attn_dim": "attention", "mlp_dim": "feed_forward", "mod_dim": "modulation",
                 "refiner_dim": "refiner"}
TRAIN_BLOCKS = {"all": None, "transformer": ("layers_",), "refiners": ("noise_refiner", "context_refiner"),
                "noise_refiner": ("noise_refiner",), "context_refiner": ("context_refiner",)}
KNOWN_NETWORK_ARGS = ("train_blocks", *TYPE_DIM_ARGS, "embedder_dims", "split_qkv", "verbose", "rank_dropout",
                      "module_dropout", "loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio")
NO_EFFECT = ("conv_dim", "conv_alpha")


def parse_network_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """network_args of networks.lora_lumina -> checked values; one LoRAError line naming the arg."""
    m = NETWORK_MODULE
    lora_dit.check_known(m, kwargs, KNOWN_NETWORK_ARGS, {}, NO_EFFECT)
    out = lora_dit.common_args(m, kwargs)
    blocks = str(kwargs.get("train_blocks") or "all").strip()
    if blocks not in TRAIN_BLOCKS:
        raise LoRAError(f"network_args: train_blocks={blocks!r} for {m}: one of {', '.join(TRAIN_BLOCKS)}")
    out["train_blocks"] = blocks
    for key in TYPE_DIM_ARGS:
        if kwargs.get(key) is not None:
            out[key] = lora_dit.parse_dim(m, key, kwargs[key])
    if kwargs.get("embedder_dims") is not None:
        out["embedder_dims"] = lora_dit.parse_dims(m, "embedder_dims", kwargs["embedder_dims"], EMBEDDERS)
    for key in ("split_qkv", "verbose"):
        out[key] = lora_dit.parse_switch(m, key, kwargs[key]) if kwargs.get(key) is not None else False
    return out


def check_network_args(kwargs: dict[str, Any]) -> None:
    """Before any weight loads (the trainer calls it when network_module is networks.lora_lumina)."""
    parse_network_args(dict(kwargs))


def _rank(name: str, args: dict[str, Any], dim: int) -> int:
    for key, kind in TYPE_DIM_ARGS.items():
        if args.get(key) is not None and kind in name:
            return args[key]
    return dim


def transformer_targets(model, args: dict[str, Any], dim: int, alpha: float) -> list[Target]:
    """Every Linear LoRA may go on in the Next-DiT, with the rank network_args give it (0: none)."""
    c = model.config
    qkv_widths = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim)
    keep = TRAIN_BLOCKS[args.get("train_blocks", "all")]
    out = []
    for path, module in model.named_modules():
        top = path.split(".")[0]
        if module.__class__.__name__ != "Linear" or top not in ("layers", "noise_refiner", "context_refiner",
                                                                "final_layer"):
            continue
        name = f"{UNET_PREFIX}_" + path.replace(".", "_")
        d = _rank(name, args, dim)
        if keep is not None and not any(k in name for k in keep):
            d = 0
        split = qkv_widths if args.get("split_qkv") and path.endswith("attention.qkv") else None
        out.append(Target(name, module, d, alpha, split))
    emb = args.get("embedder_dims") or [0] * len(EMBEDDERS)
    for root, d in zip(EMBEDDERS, emb):
        for child, module in model.get_submodule(root).named_modules():
            if module.__class__.__name__ == "Linear":
                path = root + ("." + child if child else "")
                out.append(Target(f"{UNET_PREFIX}_" + path.replace(".", "_"), module, d, alpha))
    return out


def all_targets(text_encoders, model, args: dict[str, Any], dim: int, alpha: float) -> tuple[list[Target], list[Target]]:
    """(Gemma-2 targets, transformer targets); text_encoders: [Gemma-2] as sd-scripts passes it."""
    tes = list(text_encoders) if isinstance(text_encoders, (list, tuple)) else [text_encoders]
    te_targets = []
    if tes and tes[0] is not None:
        te_targets = lora_dit.text_encoder_targets(tes[0], TE_PREFIX, TE_TARGET_MODULES, dim, alpha)
    return te_targets, transformer_targets(model, args, dim, alpha)


def create_network(multiplier: float, network_dim: Optional[int], network_alpha: Optional[float], ae,
                   text_encoders, lumina, neuron_dropout: Optional[float] = None, **kwargs) -> lora_dit.DiTLoRANetwork:
    """sd-scripts' create_network of networks.lora_lumina: text_encoders [Gemma-2], lumina the
    Next-DiT (library/models/families/lumina/nextdit.py)."""
    return lora_dit.build_network(all_targets, NETWORK_MODULE, multiplier, network_dim, network_alpha,
                                  text_encoders, lumina, neuron_dropout, parse_network_args(kwargs))


def create_network_from_weights(multiplier: float, file: Optional[str], ae, text_encoders, lumina, weights_sd=None,
                                for_inference: bool = False, **kwargs):
    """A network shaped like the file (rank and alpha per module); weights are not loaded here. A
    file of another family (FLUX.1's ``lora_unet_double_blocks_*``, SD's) names a module this model
    lacks: one line."""
    if weights_sd is None:
        weights_sd = load_state_dict_file(file)
    args = {**parse_network_args(kwargs), "split_qkv": False, "embedder_dims": [1] * len(EMBEDDERS),
            "train_blocks": "all"}
    args = {k: v for k, v in args.items() if k not in TYPE_DIM_ARGS}
    network = lora_dit.network_from_weights(all_targets, text_encoders, lumina, args, weights_sd, file, multiplier)
    return network, weights_sd


def file_metadata() -> dict[str, str]:
    """The family's keys of a Lumina 2 LoRA file, as sd-scripts writes them (lumina_train_network.py,
    library/sai_model_spec.py: architecture lumina-2, Alpha-VLLM's implementation)."""
    return {"ss_network_module": NETWORK_MODULE, "ss_v2": "False", **home.metadata_fields("lumina2", "lora")}
