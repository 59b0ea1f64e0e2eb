"""The modules and network of sd-scripts' networks.oft_v2 and networks.boft (PEFT-form orthogonal
fine-tuning, sd-scripts PR #2357 / #2428): the layers they adapt, their tensors, dropout, merge.

Layers (as sd-scripts' modules, with networks.lora's kohya names: SD1/SD2 U-Net in diffusers
layout, SDXL in SAI layout, ``lora_te`` / ``lora_te1`` / ``lora_te2``): every Linear and 1x1 Conv2d
of the U-Net's Transformer2DModel blocks and of the text encoders' CLIP attention / MLP; with
``enable_conv`` also every layer of the ResNet blocks and resamplers (3x3 convs included). The
rotation acts on a layer's inputs (flattened kernels for a conv): its width must split into
blocks. The arithmetic is networks/orthogonal.py; run time and merge use the same functions
(merge in float64).
"""
from __future__ import annotations

import ast
import logging
import re

import torch

from networks import lora, lora_names, orthogonal
from networks.adapter_modules import HookedModule

logger = logging.getLogger("sdtk")

PARTS = ("oft_R.weight", "boft_R", "boft_s")


def in_features(module: torch.nn.Module) -> int:
    w = module.weight
    if isinstance(module, torch.nn.Conv2d) and (module.groups != 1 or max(module.dilation) > 1):
        raise lora.LoRAError(f"{type(module).__name__} with groups or dilation: orthogonal adapters need a plain conv")
    return w[0].numel()


class _OrthogonalModule(HookedModule):
    """Forward with the layer's weight replaced by ``weight_of(W)`` (its own bias kept); merge
    writes ``W + multiplier * (weight_of(W) - W)`` computed in float64."""

    def weight_of(self, weight: torch.Tensor, params: dict | None = None) -> torch.Tensor:
        raise NotImplementedError

    def interpolated(self, weight: torch.Tensor, params: dict | None = None) -> torch.Tensor:
        rotated = self.weight_of(weight, params)
        return rotated if self.multiplier == 1.0 else weight + self.multiplier * (rotated - weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.multiplier == 0.0:
            return self.org_forward(x)
        m = self.org_module
        w = self.interpolated(m.weight.float()).to(x.dtype)
        bias = None if m.bias is None else m.bias.to(x.dtype)
        if isinstance(m, torch.nn.Conv2d):
            return torch.nn.functional.conv2d(x, w, bias, m.stride, m.padding, m.dilation, m.groups)
        return torch.nn.functional.linear(x, w, bias)

    def merge_to(self, sd: dict, dtype=None, device=None) -> None:
        weight = self.org_module.weight
        device = device or weight.device
        params = {k: v.to(device, torch.float64) for k, v in (sd or {}).items()}
        with torch.no_grad():
            merged = self.interpolated(weight.detach().to(device, torch.float64), params)
            weight.data = merged.to(dtype or weight.dtype)


class _Vector(torch.nn.Module):
    """Holds ``oft_R.weight`` under the name sd-scripts' file has."""

    def __init__(self, rows: int, n: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(rows, n))


class OFTv2Module(_OrthogonalModule):
    """``oft_R.weight`` (blocks, b(b-1)/2), or (1, ...) with block_share; zero at the start (R = I).
    COFT (``coft``) projects the stored rows in place at each training forward, as sd-scripts;
    dropout replaces each block's rotation by I with probability p (torch's generator)."""

    def __init__(self, lora_name, org_module, multiplier=1.0, block_size=32, coft=False, coft_eps=6e-5,
                 block_share=False, dropout=0.0):
        super().__init__(lora_name, org_module, multiplier)
        n = in_features(org_module)
        if n % block_size:
            raise lora.LoRAError(f"{lora_name}: block size {block_size} does not divide its {n} inputs")
        self.block_size, self.n_blocks = int(block_size), n // int(block_size)
        self.is_conv = isinstance(org_module, torch.nn.Conv2d)
        self.coft, self.coft_eps, self.dropout = bool(coft), float(coft_eps), float(dropout or 0.0)
        self.oft_R = _Vector(1 if block_share else self.n_blocks, orthogonal.triu_size(self.block_size))

    def weight_of(self, weight, params=None):
        if params is None:
            vec = self.oft_R.weight
            if self.coft and self.training:
                with torch.no_grad():
                    vec.copy_(orthogonal.coft_project(vec, self.block_size, self.coft_eps))
        else:
            vec = params["oft_R.weight"]
        rot = orthogonal.neumann_cayley(orthogonal.skew(vec.to(weight.dtype), self.block_size))
        if params is None and self.training and self.dropout > 0 and rot.shape[0] > 1:
            keep = torch.empty(rot.shape[0], 1, 1, dtype=rot.dtype, device=rot.device).bernoulli_(1 - self.dropout)
            rot = keep * rot + (1 - keep) * torch.eye(self.block_size, dtype=rot.dtype, device=rot.device)
        rot = rot.repeat(self.n_blocks // rot.shape[0], 1, 1) if rot.shape[0] != self.n_blocks else rot
        return orthogonal.rotate_inputs(weight, rot, transpose=not self.is_conv)


class BOFTModule(_OrthogonalModule):
    """``boft_R`` (factors, blocks, b, b) zero at the start, ``boft_s`` (out, 1) one; dropout
    (PEFT's): in one random factor, int(p * blocks) random blocks become I."""

    def __init__(self, lora_name, org_module, multiplier=1.0, block_size=4, block_num=0, n_factors=1,
                 dropout=0.0, auto_adjust=True):
        super().__init__(lora_name, org_module, multiplier)
        n = in_features(org_module)
        try:
            b, nb = orthogonal.boft_shape(n, block_size, block_num, int(n_factors), auto_adjust)
        except ValueError as e:
            raise lora.LoRAError(f"{lora_name}: {e}") from None
        self.block_size, self.block_num, self.dropout = b, nb, float(dropout or 0.0)
        self.boft_R = torch.nn.Parameter(torch.zeros(int(n_factors), nb, b, b))
        self.boft_s = torch.nn.Parameter(torch.ones(org_module.weight.shape[0], 1))
        self.register_buffer("indices", orthogonal.butterfly_indices(n, nb, b, int(n_factors)), persistent=False)

    def _drop(self, blocks: torch.Tensor) -> torch.Tensor:
        """PEFT's multiplicative dropout on the blocks' skew parameters: a zero block is R = I."""
        m, nb = blocks.shape[:2]
        count = int(self.dropout * nb)
        if not (self.training and count > 0):
            return blocks
        factor = int(torch.randint(0, m, (1,)).item())
        mask = torch.zeros(m, nb, 1, 1, dtype=blocks.dtype, device=blocks.device)
        mask[factor, torch.randperm(nb)[:count].to(blocks.device)] = 1
        return blocks * (1 - mask)

    def weight_of(self, weight, params=None):
        if params is None:
            blocks, scale = self._drop(self.boft_R), self.boft_s
        else:
            blocks, scale = params["boft_R"], params.get("boft_s", self.boft_s.detach())
            scale = scale.reshape(-1, 1)  # a (1, out) file transposed, as sd-scripts accepts
        return orthogonal.boft_rotate(weight, blocks.to(weight.dtype), self.indices, scale.to(weight.dtype))


def parse_patterns(module: str, key: str, value) -> list[re.Pattern] | None:
    """``include_patterns`` / ``exclude_patterns``: a Python list of regular expressions (or one),
    as sd-scripts reads them."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (SyntaxError, ValueError):
            pass
    items = value if isinstance(value, (list, tuple)) else [value]
    try:
        return [re.compile(str(p)) for p in items]
    except re.error as e:
        raise lora.LoRAError(f"network_args: {key} of {module}: bad regular expression ({e})") from None


def pattern_filter(include, exclude):
    """sd-scripts' rule on a layer's dotted path (full matches): with include patterns only the
    layers they match; else all but those the exclude patterns match."""
    if include is None and exclude is None:
        return None

    def allowed(path: str) -> bool:
        if include is not None:
            return any(p.fullmatch(path) for p in include)
        return not any(p.fullmatch(path) for p in exclude)
    return allowed


def build(kind: str, text_encoder, unet, multiplier: float, factory, enable_conv: bool,
          modules: dict[str, object] | None = None, module_filter=None) -> lora.AdapterNetwork:
    """The network of ``factory(lora_name, org_module, setting)`` modules on sd-scripts' targets;
    ``modules``: name -> setting from a file (only those layers, 3x3 convs included);
    ``module_filter``: pattern_filter's."""
    def make(lora_name, org_module, mult, dim, alpha, *_):
        return factory(lora_name, org_module, alpha)

    if modules is not None:
        kwargs = dict(modules_dim={k: 1 for k in modules}, modules_alpha=modules)
    else:
        kwargs = dict(lora_dim=1, alpha=None, conv_lora_dim=1 if enable_conv else None, conv_alpha=None)
    try:
        network = OrthogonalNetwork(text_encoder, unet, multiplier=multiplier, is_sdxl=_is_sdxl(text_encoder, unet),
                                    module_factory=make, module_filter=module_filter, **kwargs)
    except lora.LoRAError as e:
        raise lora.LoRAError(f"{kind}: {e}") from None
    network.renamer = KeyRenamer(text_encoder, unet)
    return network


class OrthogonalNetwork(lora.AdapterNetwork):
    """AdapterNetwork reading the other key layouts sd-scripts' loader takes (KeyRenamer)."""

    renamer = None

    def file_keys(self, weights_sd):
        return weights_sd if self.renamer is None else self.renamer(weights_sd)


class KeyRenamer:
    """The key layouts sd-scripts' OFTv2 / BOFT loader reads besides kohya names, to kohya names:
    OMI's ``unet.`` / ``clip_l.`` / ``clip_g.`` + the layer's dotted path in sd-scripts' model (SDXL
    U-Net in SAI layout), and PEFT's ``base_model.model.`` + the diffusers path (an SDXL U-Net path
    is translated to SAI; a text-encoder path on SDXL names neither encoder: an error, where
    sd-scripts loads it into both)."""

    def __init__(self, text_encoder, unet):
        listed = text_encoder if isinstance(text_encoder, (list, tuple)) else [text_encoder]
        tes = [te for te in listed if te is not None]
        self.n_tes = len(tes)
        self.block_map = lora_names.sdxl_block_map(unet) if unet is not None and _is_sdxl(tes, unet) else None

    def _name(self, head: str, path: str, key: str) -> str:
        te1 = lora_names.PREFIX_TE if self.n_tes == 1 else lora_names.PREFIX_TE1
        if head == "unet":
            return lora_names.kohya_name(lora_names.PREFIX_UNET, path)
        if head in ("clip_l", "clip_g"):
            return lora_names.kohya_name(te1 if head == "clip_l" else lora_names.PREFIX_TE2, path)
        if path.startswith("text_model."):
            if self.n_tes != 1:
                raise lora.LoRAError(f"{key}: a PEFT text-encoder key on SDXL does not say which text encoder; "
                                     "rename it to clip_l. / clip_g.")
            return lora_names.kohya_name(te1, path)
        if self.block_map is not None and path.startswith(("down_blocks.", "mid_block.", "up_blocks.")):
            path = lora_names.sdxl_module_path(path, self.block_map)
        return lora_names.kohya_name(lora_names.PREFIX_UNET, path)

    def __call__(self, weights_sd: dict) -> dict:
        out = {}
        for key, value in weights_sd.items():
            part = next((p for p in PARTS if key.endswith("." + p)), None)
            name = key[:-len(part) - 1] if part else ""
            if part and "." in name:
                for head in ("unet", "clip_l", "clip_g", "base_model.model"):
                    if name.startswith(head + "."):
                        key = self._name(head, name[len(head) + 1:], key) + "." + part
                        break
            out[key] = value
        return out


def network_from_weights(kind: str, part: str, factory, multiplier: float, file, text_encoder, unet, weights_sd):
    """create_network_from_weights of a kind whose modules' ``part`` tensor names its layers (the
    file names them: pattern filters are not applied) -> (network, weights_sd under kohya keys)."""
    if weights_sd is None:
        weights_sd = lora.load_state_dict_file(file)
    weights_sd = KeyRenamer(text_encoder, unet)(weights_sd)
    modules = modules_of_file(weights_sd, part)
    if not modules:
        raise lora.LoRAError(f"weights {file or '(state dict)'}: no {part} keys, not a file of {kind}")
    return build(kind, text_encoder, unet, multiplier, factory, True, modules), weights_sd


def entry_points(kind: str, part: str, settings, module_factory, logged: tuple[str, ...]):
    """The kohya interface's create_network / create_network_from_weights (and our
    check_network_args, before any weight loads) of a kind:
    ``settings(network_dim, neuron_dropout, network_args)`` -> dict (with ``enable_conv`` and
    ``module_filter``), ``module_factory(settings, multiplier)`` -> build's factory; ``logged``: the
    settings the log line names."""
    def create_network(multiplier, network_dim, network_alpha, vae, text_encoder, unet, neuron_dropout=None,
                       **kwargs):
        s = settings(network_dim, neuron_dropout, kwargs)
        logger.info(f"{kind}: " + ", ".join(f"{k} {s[k]}" for k in logged))
        return build(kind, text_encoder, unet, multiplier, module_factory(s, multiplier), s["enable_conv"],
                     module_filter=s["module_filter"])

    def create_network_from_weights(multiplier, file, vae, text_encoder, unet, weights_sd=None,
                                    for_inference=False, **kwargs):
        s = settings(None, None, kwargs)
        return network_from_weights(kind, part, module_factory(s, multiplier), multiplier, file, text_encoder, unet,
                                    weights_sd)
    def check_network_args(kwargs: dict) -> None:
        settings(None, None, dict(kwargs))
    return create_network, create_network_from_weights, check_network_args


def _is_sdxl(text_encoder, unet) -> bool:
    return lora._is_sdxl(text_encoder, unet)


def modules_of_file(weights_sd: dict, part: str) -> dict[str, torch.Tensor]:
    """module name -> its ``part`` tensor in a file."""
    suffix = "." + part
    return {k[:-len(suffix)]: v for k, v in weights_sd.items() if k.endswith(suffix) and "." not in k[:-len(suffix)]}
