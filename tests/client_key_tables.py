"""Which module of a model the clients give an adapter file's module name, written out from their
loaders (our code, their rules), for the tiny models:

- A1111 (extensions-builtin/Lora/networks.py ``load_network``): the name goes through
  ``convert_diffusers_name_to_compvis`` (diffusers U-Net names and ``lora_te`` / ``lora_te2`` text
  encoder names to the compvis modules), then the fallbacks: ``[qkv]_proj`` -> the
  MultiheadAttention module, ``lora_unet`` -> ``diffusion_model`` (SAI names as they are),
  ``lora_te1_text_model`` -> ``0_transformer_text_model``, ``oft_unet`` -> ``diffusion_model``. The
  compvis module names are those of the original single-file layout (sd_model.model and the
  conditioner's / cond_stage_model's wrapped modules), dots as underscores. Its module types accept
  a module whose tensors include ``lora_up.weight`` + ``lora_down.weight`` (network_lora), the four
  ``hada_w*`` (network_hada), ``lokr_w1`` (or its a/b) + ``lokr_w2`` (or its a/b) (network_lokr),
  ``oft_blocks`` or ``oft_diag`` (network_oft).
- ComfyUI (comfy/lora.py ``model_lora_keys_unet`` / ``model_lora_keys_clip``): ``lora_unet_`` +
  the SAI weight path or the diffusers weight path, ``lora_te_`` (SD1/SD2), ``lora_te1_`` /
  ``lora_te2_`` (SDXL) + ``text_model_encoder_layers_{i}_{self_attn_[qkvo..]_proj, mlp_fc1,
  mlp_fc2}``; no ``oft_unet_`` mapping. Its weight adapters (comfy/weight_adapter) accept the same
  tensor sets as A1111's for LoRA, LoHa, LoKr.

LyCORIS' DoRA and full modules:
- A1111 (extensions-builtin/Lora/network.py ``NetworkModule``): any module's ``dora_scale`` is read
  and applied in ``finalize_updown`` (``apply_weight_decompose``), always over the input axis (the
  norm of each input column of W + updown, updown before the alpha / rank scale, which then scales
  the result's difference from W with the multiplier); network_full.py takes a module with ``diff``
  (``diff_b`` added to the bias), ``W + m * diff``.
- ComfyUI (comfy/lora.py ``load_lora``): ``<name>.dora_scale`` is handed to the LoRA / LoHa / LoKr
  adapter, whose ``weight_decompose`` (comfy/weight_adapter/base.py) takes the output axis when
  dora_scale's first dimension is the weight's and then divides by the norm of the base W's rows
  (not of W + delta), else the input columns of W + delta; ``W + strength * (W' - W)``. ``diff``
  patches the weight and ``diff_b`` the layer's ``.bias`` (``W + strength * diff``). A key no adapter
  reads is logged as "lora key not loaded".
"""
from __future__ import annotations

import math
import re

import torch

from library.models import sd_checkpoint

A1111_TYPES = {
    "LoRA": lambda p: {"lora_up.weight", "lora_down.weight"} <= p,
    "LoHa": lambda p: {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"} <= p,
    "LoKr": lambda p: ("lokr_w1" in p or {"lokr_w1_a", "lokr_w1_b"} <= p)
    and ("lokr_w2" in p or {"lokr_w2_a", "lokr_w2_b"} <= p),
    "OFT": lambda p: "oft_blocks" in p or "oft_diag" in p,
}
A1111_TYPES["Full"] = lambda p: "diff" in p
COMFY_TYPES = {k: A1111_TYPES[k] for k in ("LoRA", "LoHa", "LoKr", "Full")}
# the tensors of a module each client reads (ComfyUI warns about any other): LoRA's, LoHa's, LoKr's
# own, the scalars, DoRA's dora_scale, full's diff / diff_b
A1111_READS = {"lora_up.weight", "lora_down.weight", "lora_mid.weight", "alpha", "scale", "bias", "dora_scale",
               "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2", "lokr_w1", "lokr_w1_a",
               "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2", "diff", "diff_b"}
COMFY_READS = (A1111_READS - {"scale", "bias"}) | {"reshape_weight"}


def a1111_dora(weight, updown, dora_scale, scale: float, multiplier: float):
    """A1111's weight of a DoRA module (network.py finalize_updown / apply_weight_decompose):
    ``updown`` the module's product before the alpha / rank ``scale``; the norm over the input axis."""
    merged = updown + weight
    norm = merged.transpose(0, 1).reshape(merged.shape[1], -1).norm(dim=1, keepdim=True)
    norm = norm.reshape(merged.shape[1], *[1] * (merged.dim() - 1)).transpose(0, 1)
    return weight + (merged * (dora_scale / norm) - weight) * scale * multiplier


def comfy_dora(weight, lora_diff, dora_scale, alpha: float, strength: float):
    """ComfyUI's weight of a DoRA module (comfy/weight_adapter/base.py weight_decompose): ``alpha``
    is alpha / rank; on the output axis the norm is the base weight's."""
    calc = weight + lora_diff * alpha
    if dora_scale.shape[0] == calc.shape[0]:
        norm = weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True)
        norm = norm.reshape(weight.shape[0], *[1] * (weight.dim() - 1))
    else:
        norm = calc.transpose(0, 1).reshape(calc.shape[1], -1).norm(dim=1, keepdim=True)
        norm = norm.reshape(calc.shape[1], *[1] * (calc.dim() - 1)).transpose(0, 1)
    norm = norm + torch.finfo(weight.dtype).eps
    return weight + strength * (calc * (dora_scale / norm) - weight)

_RESNET = {"conv1": "in_layers_2", "conv2": "out_layers_3", "norm1": "in_layers_0", "norm2": "out_layers_0",
           "time_emb_proj": "emb_layers_1", "conv_shortcut": "skip_connection"}


def a1111_weight_keys(state_dict: dict) -> dict[str, str]:
    """A1111's network_layer_mapping keys for a model in the original single-file layout (modules
    with weights) -> the weight's key (a MultiheadAttention module: its in_proj_weight)."""
    out = {}
    for key in state_dict:
        for suffix in (".weight", ".in_proj_weight"):
            if key.endswith(suffix):
                path = key[:-len(suffix)]
                break
        else:
            continue
        for prefix, cut in (("model.diffusion_model.", len("model.")), ("cond_stage_model.", len("cond_stage_model.")),
                            ("conditioner.embedders.", len("conditioner.embedders."))):
            if path.startswith(prefix):
                out[path[cut:].replace(".", "_")] = key
    return out


def a1111_module_shapes(components: dict, family: str) -> dict[str, tuple]:
    """A1111's network_layer_mapping keys for the model -> weight shape (a MultiheadAttention
    module: its in_proj_weight, q/k/v stacked)."""
    sd = sd_checkpoint.original_state_dict(components, family)
    return {name: tuple(sd[key].shape) for name, key in a1111_weight_keys(sd).items()}


def client_delta(parts: dict) -> tuple[int, int]:
    """(output rows, elements) of the weight a module's tensors make under the clients' formulas:
    LoRA up @ down, LoHa (w1a @ w1b) * (w2a @ w2b) or Tucker einsum, LoKr kron(w1, w2), OFT blocks."""
    if "diff" in parts:
        return parts["diff"].shape[0], parts["diff"].numel()
    if "lora_up.weight" in parts:
        up, down = parts["lora_up.weight"], parts["lora_down.weight"]
        return up.shape[0], up.shape[0] * math.prod(down.shape[1:])
    if "hada_w1_a" in parts:
        if "hada_t1" in parts:  # einsum("i j k l, j r, i p -> p r k l", t1, w1b, w1a)
            t, a, b = parts["hada_t1"], parts["hada_w1_a"], parts["hada_w1_b"]
            return a.shape[1], a.shape[1] * b.shape[1] * math.prod(t.shape[2:])
        return parts["hada_w1_a"].shape[0], parts["hada_w1_a"].shape[0] * parts["hada_w1_b"].shape[1]
    if "lokr_w1" in parts:
        w1 = parts["lokr_w1"]
        if "lokr_w2" in parts:
            w2 = parts["lokr_w2"].shape
        elif "lokr_t2" in parts:
            t, a, b = parts["lokr_t2"], parts["lokr_w2_a"], parts["lokr_w2_b"]
            w2 = (a.shape[1], b.shape[1], *t.shape[2:])
        else:
            w2 = (parts["lokr_w2_a"].shape[0], parts["lokr_w2_b"].shape[1])
        return w1.shape[0] * w2[0], w1.numel() * math.prod(w2)
    blocks = parts["oft_blocks"]
    return blocks.shape[0] * blocks.shape[1], None


def _compvis(key: str, is_sd2: bool) -> str:
    def m(regex):
        r = re.match(regex, key)
        return [int(x) if x.isdigit() else x for x in r.groups()] if r else None

    if g := m(r"lora_unet_conv_in(.*)"):
        return f"diffusion_model_input_blocks_0_0{g[0]}"
    if g := m(r"lora_unet_conv_out(.*)"):
        return f"diffusion_model_out_2{g[0]}"
    if g := m(r"lora_unet_time_embedding_linear_(\d+)(.*)"):
        return f"diffusion_model_time_embed_{g[0] * 2 - 2}{g[1]}"
    if g := m(r"lora_unet_down_blocks_(\d+)_(attentions|resnets)_(\d+)_(.+)"):
        suffix = _RESNET.get(g[3], g[3]) if g[1] == "resnets" else g[3]
        return f"diffusion_model_input_blocks_{1 + g[0] * 3 + g[2]}_{1 if g[1] == 'attentions' else 0}_{suffix}"
    if g := m(r"lora_unet_mid_block_(attentions|resnets)_(\d+)_(.+)"):
        suffix = _RESNET.get(g[2], g[2]) if g[0] == "resnets" else g[2]
        return f"diffusion_model_middle_block_{1 if g[0] == 'attentions' else g[1] * 2}_{suffix}"
    if g := m(r"lora_unet_up_blocks_(\d+)_(attentions|resnets)_(\d+)_(.+)"):
        suffix = _RESNET.get(g[3], g[3]) if g[1] == "resnets" else g[3]
        return f"diffusion_model_output_blocks_{g[0] * 3 + g[2]}_{1 if g[1] == 'attentions' else 0}_{suffix}"
    if g := m(r"lora_unet_down_blocks_(\d+)_downsamplers_0_conv"):
        return f"diffusion_model_input_blocks_{3 + g[0] * 3}_0_op"
    if g := m(r"lora_unet_up_blocks_(\d+)_upsamplers_0_conv"):
        return f"diffusion_model_output_blocks_{2 + g[0] * 3}_{2 if g[0] > 0 else 1}_conv"
    if g := m(r"lora_te_text_model_encoder_layers_(\d+)_(.+)"):
        if is_sd2:
            rest = g[1].replace("mlp_fc1", "mlp_c_fc").replace("mlp_fc2", "mlp_c_proj").replace("self_attn", "attn")
            return f"model_transformer_resblocks_{g[0]}_{rest}"
        return f"transformer_text_model_encoder_layers_{g[0]}_{g[1]}"
    if g := m(r"lora_te2_text_model_encoder_layers_(\d+)_(.+)"):
        rest = g[1].replace("mlp_fc1", "mlp_c_fc").replace("mlp_fc2", "mlp_c_proj").replace("self_attn", "attn")
        return f"1_model_transformer_resblocks_{g[0]}_{rest}"
    return key


def a1111_target(name: str, mapping: set[str]) -> str | None:
    """The compvis module A1111 applies a file's module ``name`` to, or None (key not matched)."""
    is_sd2 = any(k.startswith("model_transformer_resblocks") for k in mapping)  # mapping: names or a dict
    key = _compvis(name, is_sd2)
    if key in mapping:
        return key
    x = re.match(r"(.*)_([qkv]_proj)$", key)
    if x and x.group(1) in mapping:
        return x.group(1)
    if "lora_unet" in name:
        key = name.replace("lora_unet", "diffusion_model")
    elif "lora_te1_text_model" in name:
        key = name.replace("lora_te1_text_model", "0_transformer_text_model")
        if key not in mapping:
            key = name.replace("lora_te1_text_model", "transformer_text_model")
    elif "oft_unet" in name:
        key = name.replace("oft_unet", "diffusion_model")
    return key if key in mapping else None


def comfy_names(components: dict, family: str) -> set[str]:
    """The module names ComfyUI's key map knows for the model."""
    out = set()
    for key in sd_checkpoint.original_state_dict(components, family):
        if key.startswith("model.diffusion_model.") and key.endswith(".weight"):
            out.add("lora_unet_" + key[len("model.diffusion_model."):-len(".weight")].replace(".", "_"))
    for key in components["unet"].state_dict():
        if key.endswith(".weight"):
            out.add("lora_unet_" + key[:-len(".weight")].replace(".", "_"))
    tes = [components["text_encoder"]] + ([components["text_encoder_2"]] if "text_encoder_2" in components else [])
    parts = ("self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj", "self_attn_out_proj", "mlp_fc1", "mlp_fc2")
    for i, te in enumerate(tes):
        prefix = "lora_te" if len(tes) == 1 else f"lora_te{i + 1}"
        for b in range(te.config.num_hidden_layers):
            out |= {f"{prefix}_text_model_encoder_layers_{b}_{p}" for p in parts}
    return out


def modules_of_file(sd: dict) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for key in sd:
        name, _, part = key.partition(".")
        out.setdefault(name, set()).add(part)
    return out


COMFY_CLIP_MAP = {"mlp.fc1": "mlp_fc1", "mlp.fc2": "mlp_fc2", "self_attn.k_proj": "self_attn_k_proj",
                  "self_attn.q_proj": "self_attn_q_proj", "self_attn.v_proj": "self_attn_v_proj",
                  "self_attn.out_proj": "self_attn_out_proj"}


def comfy_dit_shapes(transformer, clip_l=None, clip_g=None, t5=None) -> dict[str, tuple]:
    """ComfyUI's key map (comfy/lora.py ``model_lora_keys_unet`` / ``model_lora_keys_clip``) for a
    FLUX.1 or SD3 model -> the shape of the weight each name patches. The transformer's keys in
    ComfyUI are ``diffusion_model.`` + BFL's (FLUX) or SAI's (SD3) layout, which our models keep,
    so ``lora_unet_`` + the path with dots as underscores; CLIP-L ``lora_te_`` / ``lora_te1_``,
    CLIP-G ``lora_te2_`` when CLIP-L is present, both ``text_model_encoder_layers_{i}_`` + the six
    attention / MLP layers; T5-XXL ``lora_te{n}_`` + its ``t5xxl.transformer.`` path, n = 1 + one
    per CLIP present, and with CLIP-L alone (FLUX) both 2 (OneTrainer) and 3."""
    out = {}
    for key, value in transformer.state_dict().items():
        if key.endswith(".weight"):
            out["lora_unet_" + key[:-len(".weight")].replace(".", "_")] = tuple(value.shape)
    g_prefixes = ("lora_te2",) if clip_l is not None else ("lora_te",)
    for te, prefixes in ((clip_l, ("lora_te", "lora_te1")), (clip_g, g_prefixes)):
        if te is None:
            continue
        sd = {k if k.startswith("text_model.") else "text_model." + k: v for k, v in te.state_dict().items()}
        for b in range(te.config.num_hidden_layers):
            for path, part in COMFY_CLIP_MAP.items():
                w = sd[f"text_model.encoder.layers.{b}.{path}.weight"]
                for p in prefixes:
                    out[f"{p}_text_model_encoder_layers_{b}_{part}"] = tuple(w.shape)
    if t5 is not None:
        index = 1 + (clip_g is not None) + (clip_l is not None)
        indices = (2, 3) if index == 2 else (index,)
        for key, value in t5.state_dict().items():
            if key.endswith(".weight"):
                for i in indices:
                    out[f"lora_te{i}_" + key[:-len(".weight")].replace(".", "_")] = tuple(value.shape)
    return out
