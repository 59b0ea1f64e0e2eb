"""LoRA for Anima in kohya's layout (the ``network_module`` of sd-scripts' ``networks/lora_anima.py``).

Names are ``lora_unet_`` + the DiT's module path (library/models/families/anima/model.py, the
released file's names without ``net.``), dots as underscores, as ComfyUI reads them:
``lora_unet_blocks_N_{self_attn,cross_attn}_{q,k,v,output}_proj``, ``lora_unet_blocks_N_mlp_layer{1,2}``,
and with ``train_llm_adapter`` ``lora_unet_llm_adapter_blocks_N_{self_attn,cross_attn}_{q,k,v,o}_proj``
and ``..._mlp_{0,2}``.

Targets, as sd-scripts: every Linear inside the modules of class Block, PatchEmbed,
TimestepEmbedding and FinalLayer (and LLMAdapterTransformerBlock with ``train_llm_adapter``), less
the paths its default exclude pattern ``.*(_modulation|_norm|_embedder|final_layer).*`` matches
(fully) and the user's ``exclude_patterns``, unless an ``include_patterns`` entry matches. Qwen3
is never trained (sd-scripts' Anima trainer keeps it frozen), so a file holds no ``lora_te_`` key.
network_args: ``train_llm_adapter``, ``exclude_patterns``, ``include_patterns`` (Python list
literals of regular expressions, or one string), ``network_reg_dims`` ("regex=rank, ..."), and
LoRA's ``rank_dropout``, ``module_dropout``, ``loraplus_*``, ``verbose``.
"""
from __future__ import annotations

import ast
import os
import re
from typing import Any, Optional

import torch
from transformers import Qwen3Config, Qwen3Model

from library import safetensors_file
from library.models.families.anima import model
from networks import lora_dit
from networks.lora import LoRAError, load_state_dict_file
from networks.lora_dit import Target

NETWORK_MODULE = "networks.lora_anima"
KIND = "LoRA"  # what library/training/network_options.py calls it in messages
TRAINS_TEXT_ENCODERS = False  # Qwen3 stays frozen (sd-scripts' AnimaNetworkTrainer.is_train_text_encoder)
PREFIX = "lora_unet"
TARGET_CLASSES = ("Block", "PatchEmbed", "TimestepEmbedding", "FinalLayer")
ADAPTER_CLASSES = ("LLMAdapterTransformerBlock",)
DEFAULT_EXCLUDE = r".*(_modulation|_norm|_embedder|final_layer).*"
KNOWN_NETWORK_ARGS = ("train_llm_adapter", "exclude_patterns", "include_patterns", "network_reg_dims", "verbose",
                      "rank_dropout", "module_dropout", "loraplus_lr_ratio", "loraplus_unet_lr_ratio",
                      "loraplus_text_encoder_lr_ratio")
UNSUPPORTED = {"network_reg_lrs": "per-module learning rates by regular expression"}
NO_EFFECT = ("conv_dim", "conv_alpha")


def _patterns(key: str, value: Any) -> list[re.Pattern]:
    """A list literal of regular expressions (sd-scripts' ast.literal_eval), or one pattern."""
    items = value
    if isinstance(value, str):
        text = value.strip()
        try:
            items = ast.literal_eval(text) if text.startswith("[") else text
        except (ValueError, SyntaxError):
            raise LoRAError(f"network_args: {key} for {NETWORK_MODULE} is not a list of patterns: {value!r}") from None
    items = [items] if isinstance(items, str) else list(items)
    out = []
    for p in items:
        try:
            out.append(re.compile(str(p)))
        except re.error as e:
            raise LoRAError(f"network_args: {key} for {NETWORK_MODULE}: bad regular expression {p!r} ({e})") from None
    return out


def _reg_dims(value: Any) -> list[tuple[re.Pattern, int]]:
    """sd-scripts' "regex=rank, regex=rank" (first match wins)."""
    out = []
    for pair in str(value).split(","):
        pair = pair.strip()
        if not pair:
            continue
        if "=" not in pair:
            raise LoRAError(f"network_args: network_reg_dims for {NETWORK_MODULE}: {pair!r} is not regex=rank")
        pattern, rank = (s.strip() for s in pair.split("=", 1))
        out.append((_patterns("network_reg_dims", [pattern])[0], lora_dit.parse_dim(NETWORK_MODULE, "network_reg_dims",
                                                                                   rank)))
    return out


def parse_network_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """network_args of networks.lora_anima -> checked values; one LoRAError line naming the arg."""
    m = NETWORK_MODULE
    lora_dit.check_known(m, kwargs, KNOWN_NETWORK_ARGS, UNSUPPORTED, NO_EFFECT)
    out = lora_dit.common_args(m, kwargs)
    for key in ("train_llm_adapter", "verbose"):
        out[key] = lora_dit.parse_switch(m, key, kwargs[key]) if kwargs.get(key) is not None else False
    out["exclude_patterns"] = _patterns("exclude_patterns", kwargs.get("exclude_patterns") or [])
    out["include_patterns"] = _patterns("include_patterns", kwargs.get("include_patterns") or [])
    out["network_reg_dims"] = _reg_dims(kwargs["network_reg_dims"]) if kwargs.get("network_reg_dims") else []
    return out


def check_network_args(kwargs: dict[str, Any]) -> None:
    """Before any weight loads (the trainer calls it when network_module is networks.lora_anima)."""
    parse_network_args(dict(kwargs))


def transformer_targets(dit, args: dict[str, Any], dim: int, alpha: float) -> list[Target]:
    """Every Linear LoRA may go on in the DiT, with its rank (0: excluded)."""
    classes = TARGET_CLASSES + (ADAPTER_CLASSES if args.get("train_llm_adapter") else ())
    exclude = [re.compile(DEFAULT_EXCLUDE), *args.get("exclude_patterns", [])]
    include = args.get("include_patterns", [])
    out, seen = [], set()
    for name, module in dit.named_modules():
        if module.__class__.__name__ not in classes:
            continue
        for child_name, child in module.named_modules():
            if child.__class__.__name__ != "Linear":
                continue
            path = f"{name}.{child_name}" if name else child_name
            if path in seen:
                continue
            seen.add(path)
            excluded = any(p.fullmatch(path) for p in exclude) and not any(p.fullmatch(path) for p in include)
            d = 0 if excluded else next((r for p, r in args.get("network_reg_dims", []) if p.fullmatch(path)), dim)
            out.append(Target(f"{PREFIX}_{path.replace('.', '_')}", child, d, alpha))
    return out


def all_targets(text_encoders, dit, args: dict[str, Any], dim: int, alpha: float) -> tuple[list[Target], list[Target]]:
    """(text-encoder targets: none, Qwen3 stays frozen; the DiT's targets)."""
    return [], transformer_targets(dit, args, dim, alpha)


def create_network(multiplier: float, network_dim: Optional[int], network_alpha: Optional[float], vae,
                   text_encoders, dit, neuron_dropout: Optional[float] = None, **kwargs) -> lora_dit.DiTLoRANetwork:
    """sd-scripts' create_network of networks.lora_anima (dit: library.models.families.anima.model.Anima)."""
    return lora_dit.build_network(all_targets, NETWORK_MODULE, multiplier, network_dim, network_alpha,
                                  text_encoders, dit, neuron_dropout, parse_network_args(kwargs))


def create_network_from_weights(multiplier: float, file: Optional[str], vae, text_encoders, dit, weights_sd=None,
                                for_inference: bool = False, **kwargs):
    """A network shaped like the file (rank and alpha per module, the adapter when the file has it);
    weights are not loaded here. A file of another family names a module this DiT lacks: one line."""
    if weights_sd is None:
        weights_sd = load_state_dict_file(file)
    te = sorted(k for k in weights_sd if k.startswith("lora_te"))
    if te:
        raise LoRAError(f"LoRA weights {file or '(state dict)'}: {te[0].split('.')[0]} is a text-encoder module; "
                        "an Anima LoRA trains the DiT alone (wrong base model?)")
    args = {**parse_network_args(kwargs), "train_llm_adapter": True,
            "exclude_patterns": [], "include_patterns": [re.compile(".*")], "network_reg_dims": []}
    _, targets = all_targets(text_encoders, dit, args, 1, 1.0)
    chosen = lora_dit.from_weights(targets, weights_sd, file)
    network = lora_dit.DiTLoRANetwork([], chosen, multiplier, 4, 1.0)
    lora_dit.set_loraplus(network, args)
    return network, weights_sd


def module_paths() -> dict[str, dict[str, str]]:
    """{underscored: dotted} of the Linear layers of a DiT block, an adapter block, the DiT outside
    its blocks, and a Qwen3 layer, from the models' module names (meta tensors: no weights)."""
    def linears(module, skip=()) -> dict[str, str]:
        return {n.replace(".", "_"): n for n, m in module.named_modules()
                if isinstance(m, torch.nn.Linear) and not n.startswith(skip)}

    with torch.device("meta"):
        dit = model.Anima(model.TINY)
        qwen = Qwen3Model(Qwen3Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                      num_attention_heads=1, num_key_value_heads=1, head_dim=8))
    return {"blocks": linears(dit.blocks[0]), "llm_adapter.blocks": linears(dit.llm_adapter.blocks[0]),
            "": linears(dit, skip=("blocks.", "llm_adapter.blocks.")), "layers": linears(qwen.layers[0])}


def dotted(name: str, text_encoder: bool, tables: dict) -> str | None:
    """``blocks_3_self_attn_q_proj`` -> ``blocks.3.self_attn.q_proj`` (None: not a module of Anima's
    DiT, or with ``text_encoder`` of its Qwen3)."""
    stacks = ("layers",) if text_encoder else ("llm_adapter.blocks", "blocks")
    for stack in stacks:
        m = re.fullmatch(re.escape(stack.replace(".", "_")) + r"_(\d+)_(.+)", name)
        if m and m.group(2) in tables[stack]:
            return f"{stack}.{m.group(1)}.{tables[stack][m.group(2)]}"
    return None if text_encoder else tables[""].get(name)


def check_network_weights(path: str) -> None:
    """Before any weight loads (the trainer calls it for network_weights): every module a
    safetensors file names, read from its header, is one an Anima LoRA can have; a LoRA of another
    family is one line naming its first foreign module."""
    if not path.lower().endswith(".safetensors") or not os.path.isfile(path):
        return  # read (and refused if foreign) when the network is built
    _, header = safetensors_file.read_header(path)
    tables = module_paths()
    for name in sorted({k.split(".")[0] for k in header if k != "__metadata__"}):
        if not name.startswith(PREFIX + "_") or dotted(name[len(PREFIX) + 1:], False, tables) is None:
            raise LoRAError(f"network_weights {path}: {name} is no module of an Anima LoRA (a LoRA of another "
                            "family?); it was not loaded")


def file_metadata() -> dict[str, str]:
    """The family's keys of an Anima LoRA file (sd-scripts' NetworkTrainer writes ss_network_module)."""
    return {"ss_network_module": NETWORK_MODULE, "ss_v2": "False"}
