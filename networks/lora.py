"""Kohya-format LoRA network (the ``network_module`` interface of kohya-ss/sd-scripts).

A trainer imports a network module and calls ``create_network(...)`` or
``create_network_from_weights(...)``; the returned network hooks the forward of the model's own
Linear / Conv2d modules (their weights stay where they are) and adds ``up(down(x)) * scale *
multiplier``. Module selection, naming, initialisation, dropout and the file format are those of
sd-scripts' ``networks/lora.py`` so that files load in A1111, Forge, ComfyUI and diffusers.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
from io import BytesIO
from typing import IO
from typing import Any, Optional

import torch
from safetensors.torch import save

from library import safetensors_file
from library.errors import UserError, first_line
from library.files import atomic_path
from networks import lora_blocks, lora_names
from networks.adapter_modules import HookedModule
from networks.adapter_weights import file_kinds

UNET_TARGET_MODULES = ("Transformer2DModel",)  # LoRA-LierLa
UNET_TARGET_MODULES_CONV3X3 = ("ResnetBlock2D", "Downsample2D", "Upsample2D")  # + LoRA-C3Lier
# transformers 5 has only CLIPAttention; older versions had CLIPSdpaAttention / CLIPFlashAttention2.
TEXT_ENCODER_TARGET_MODULES = ("CLIPAttention", "CLIPSdpaAttention", "CLIPFlashAttention2", "CLIPMLP")

# network_args keys this module understands (values arrive as strings).
KNOWN_NETWORK_ARGS = ("conv_dim", "conv_alpha", "rank_dropout", "module_dropout",
                      "loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio",
                      *lora_blocks.BLOCK_LIST_ARGS, *lora_blocks.LR_WEIGHT_ARGS, "block_lr_zero_threshold")


logger = logging.getLogger("sdtk")


class LoRAError(UserError, ValueError):
    """Bad LoRA input (option, file or model); the message is one line naming the culprit."""


# --- helpers ----------------------------------------------------------------------------------

def parse_number(key: str, value: Any, kind: type, low: float, high: float | None = None,
                  low_inclusive: bool = True) -> Any:
    """Parse a network option (strings from network_args, or numbers) and check its range."""
    try:
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            number = int(value.strip()) if isinstance(value, str) else int(value)
        else:
            number = float(value)
    except (TypeError, ValueError):
        raise LoRAError(f"{key}={value!r} is not a{'n integer' if kind is int else ' number'}") from None
    too_low = number < low if low_inclusive else number <= low
    if too_low or (high is not None and number >= high):
        bound = f"{'>=' if low_inclusive else '>'} {low}" + (f" and < {high}" if high is not None else "")
        raise LoRAError(f"{key}={value!r} must be {bound}")
    return number


def parse_bool(module: str, key: str, value: Any) -> bool:
    """A switch of network_args as written (a string from the command line or TOML, or a bool):
    "False" is false (sd-scripts' ``bool("False")`` is true)."""
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", "none", ""):
        return False
    raise LoRAError(f"network_args: {key}={value!r} for {module} is not true or false")


def parse_network_args(kwargs: dict[str, Any], module: str = "networks.lora",
                        known: tuple[str, ...] = KNOWN_NETWORK_ARGS) -> dict[str, Any]:
    unknown = sorted(k for k in kwargs if k not in known)
    if unknown:
        raise LoRAError(f"network_args: unknown key {unknown[0]!r} for {module}; "
                        f"known keys: {', '.join(known)}")
    out: dict[str, Any] = {}
    if kwargs.get("conv_dim") is not None:
        out["conv_dim"] = parse_number("network_args: conv_dim", kwargs["conv_dim"], int, 1)
        # sd-scripts: conv_alpha defaults to 1.0 when conv_dim is given
        out["conv_alpha"] = (parse_number("network_args: conv_alpha", kwargs["conv_alpha"], float, 0)
                             if kwargs.get("conv_alpha") is not None else 1.0)
    elif kwargs.get("conv_alpha") is not None:
        raise LoRAError("network_args: conv_alpha is given without conv_dim")
    for key in ("rank_dropout", "module_dropout"):
        if kwargs.get(key) is not None:
            out[key] = parse_number("network_args: " + key, kwargs[key], float, 0.0, 1.0)
    for key in ("loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio"):
        if kwargs.get(key) is not None:
            out[key] = parse_number("network_args: " + key, kwargs[key], float, 0.0, low_inclusive=False)
    try:
        lora_blocks.check_syntax(kwargs)  # the counts need the model family: checked in create_network
    except lora_blocks.BlockArgError as e:
        raise LoRAError(str(e)) from None
    for key in lora_blocks.BLOCK_LIST_ARGS + lora_blocks.LR_WEIGHT_ARGS + ("block_lr_zero_threshold",):
        if kwargs.get(key) is not None:
            out[key] = kwargs[key]
    return out


def check_network_args(kwargs: dict[str, Any]) -> None:
    """Validate network_args before any weight is loaded (called by the trainer when present)."""
    parse_network_args(dict(kwargs))


def lora_delta(down: torch.Tensor, up: torch.Tensor, scale: float) -> torch.Tensor:
    """The weight delta ``up @ down * scale`` in the original weight's shape (float32)."""
    down, up = down.float(), up.float()
    if down.dim() == 2:
        delta = up @ down
    elif down.shape[2:] == (1, 1):
        delta = (up.flatten(1) @ down.flatten(1)).unsqueeze(2).unsqueeze(3)
    else:
        # 3x3 down followed by 1x1 up == a 3x3 conv whose kernel is up composed with down
        delta = torch.nn.functional.conv2d(down.permute(1, 0, 2, 3), up).permute(1, 0, 2, 3)
    return delta * scale


def load_state_dict_file(file: str) -> dict[str, torch.Tensor]:
    if os.path.isdir(file):
        raise LoRAError(f"LoRA weights file {file} is a folder, not a file")
    if not os.path.isfile(file):
        raise LoRAError(f"LoRA weights file not found: {file}")
    try:
        if os.path.splitext(file)[1].lower() == ".safetensors":
            # lazy: imported in a try: load_state_dict_file() answers its absence or failure
            from safetensors.torch import load_file
            return load_file(file)
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt or foreign file
        raise LoRAError(f"cannot read LoRA weights file {file}: {first_line(e, typed=True)}") from e


# --- hashes exactly as sd-scripts' train_util (sd-webui-additional-networks' model hashes) ------

def addnet_hash_safetensors(b: IO[bytes]) -> str:
    """SHA-256 of everything after the safetensors header."""
    h = hashlib.sha256()
    b.seek(0)
    n = int.from_bytes(b.read(8), "little")
    b.seek(n + 8)
    for chunk in iter(lambda: b.read(1024 * 1024), b""):
        h.update(chunk)
    return h.hexdigest()


def addnet_hash_legacy(b: IO[bytes]) -> str:
    """First 8 hex digits of the SHA-256 of the 64 KiB at offset 1 MiB."""
    h = hashlib.sha256()
    b.seek(0x100000)
    h.update(b.read(0x10000))
    return h.hexdigest()[0:8]


def precalculate_safetensors_hashes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[str, str]:
    # Only the immutable training metadata (ss_*) enters the hash, as in sd-scripts.
    b = BytesIO(save(tensors, {k: v for k, v in metadata.items() if k.startswith("ss_")}))
    return addnet_hash_safetensors(b), addnet_hash_legacy(b)


def _atomic_save(file: str, write) -> None:
    with atomic_path(file) as tmp:
        write(tmp)


# --- modules ----------------------------------------------------------------------------------

class LoRAModule(HookedModule):
    """LoRA for one Linear or Conv2d: hooks the original module's forward (no weight copied)."""

    PLUS_PARAMS = ("lora_up",)

    def __init__(self, lora_name: str, org_module: torch.nn.Module, multiplier: float = 1.0,
                 lora_dim: int = 4, alpha: float | torch.Tensor | None = 1.0, dropout: float | None = None,
                 rank_dropout: float | None = None, module_dropout: float | None = None):
        super().__init__(lora_name, org_module, multiplier)
        self.lora_dim = int(lora_dim)
        if isinstance(org_module, torch.nn.Conv2d):
            in_dim, out_dim = org_module.in_channels, org_module.out_channels
            self.lora_down = torch.nn.Conv2d(in_dim, self.lora_dim, org_module.kernel_size, org_module.stride,
                                             org_module.padding, bias=False)
            self.lora_up = torch.nn.Conv2d(self.lora_dim, out_dim, (1, 1), (1, 1), bias=False)
        else:
            self.lora_down = torch.nn.Linear(org_module.in_features, self.lora_dim, bias=False)
            self.lora_up = torch.nn.Linear(self.lora_dim, org_module.out_features, bias=False)

        if isinstance(alpha, torch.Tensor):
            alpha = float(alpha.detach().float())
        alpha = float(self.lora_dim if alpha is None or alpha == 0 else alpha)  # 0/None: no scaling
        self.scale = alpha / self.lora_dim
        self.register_buffer("alpha", torch.tensor(alpha, dtype=torch.float32))  # saved as 0-dim .alpha

        # same as Microsoft's LoRA and sd-scripts: the network starts as an exact no-op
        torch.nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))
        torch.nn.init.zeros_(self.lora_up.weight)

        self.dropout = dropout
        self.rank_dropout = rank_dropout
        self.module_dropout = module_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        org_forwarded = self.org_forward(x)
        if self.module_dropout is not None and self.training and torch.rand(1) < self.module_dropout:
            return org_forwarded

        lx = self.lora_down(x.to(self.lora_down.weight.dtype))
        if self.dropout is not None and self.training:
            lx = torch.nn.functional.dropout(lx, p=self.dropout)

        scale = self.scale
        if self.rank_dropout is not None and self.training:
            mask = torch.rand((lx.size(0), self.lora_dim), device=lx.device) > self.rank_dropout
            if lx.dim() == 3:
                mask = mask.unsqueeze(1)  # text encoder: (batch, tokens, rank)
            elif lx.dim() == 4:
                mask = mask.unsqueeze(-1).unsqueeze(-1)  # conv: (batch, rank, h, w)
            lx = lx * mask
            scale = self.scale / (1.0 - self.rank_dropout)  # as if the rank were reduced

        lx = self.lora_up(lx)
        return org_forwarded + (lx * (self.multiplier * scale)).to(org_forwarded.dtype)

    def merge_to(self, sd: dict[str, torch.Tensor], dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> None:
        """Add ``multiplier * up @ down * scale`` (from sd, or our own weights) to the original weight."""
        down = sd.get("lora_down.weight", self.lora_down.weight)
        up = sd.get("lora_up.weight", self.lora_up.weight)
        weight = self.org_module.weight
        device = device or weight.device
        delta = lora_delta(down.to(device), up.to(device), self.scale) * self.multiplier
        merged = weight.detach().to(device, torch.float32) + delta
        with torch.no_grad():
            weight.data = merged.to(dtype or weight.dtype)


class AdapterNetwork(torch.nn.Module):
    """The kohya network of hooked modules: selection, names, apply/merge/save and the optimizer
    groups of sd-scripts' networks/lora.py, for any module kind (``module_factory``); LoRA adds
    max-norm regularisation (LoRANetwork)."""

    UNET_TARGET_REPLACE_MODULE = list(UNET_TARGET_MODULES)
    UNET_TARGET_REPLACE_MODULE_CONV2D_3X3 = list(UNET_TARGET_MODULES_CONV3X3)
    TEXT_ENCODER_TARGET_REPLACE_MODULE = list(TEXT_ENCODER_TARGET_MODULES)
    LORA_PREFIX_UNET = lora_names.PREFIX_UNET
    LORA_PREFIX_TEXT_ENCODER = lora_names.PREFIX_TE
    LORA_PREFIX_TEXT_ENCODER1 = lora_names.PREFIX_TE1
    LORA_PREFIX_TEXT_ENCODER2 = lora_names.PREFIX_TE2

    def __init__(self, text_encoder, unet, multiplier: float = 1.0, lora_dim: int = 4, alpha: float = 1.0,
                 dropout: float | None = None, rank_dropout: float | None = None,
                 module_dropout: float | None = None, conv_lora_dim: int | None = None,
                 conv_alpha: float | None = None, modules_dim: dict[str, int] | None = None,
                 modules_alpha: dict[str, Any] | None = None, is_sdxl: bool | None = None,
                 block_dims: list[int] | None = None, block_alphas: list[float] | None = None,
                 conv_block_dims: list[int] | None = None, conv_block_alphas: list[float | None] | None = None,
                 module_factory=None, unet_targets: tuple[str, ...] | None = None,
                 text_encoder_targets: tuple[str, ...] | None = None, unet_prefix: str = lora_names.PREFIX_UNET,
                 module_filter=None):
        """Either lora_dim/alpha (+ conv_lora_dim/conv_alpha) for every target, or modules_dim /
        modules_alpha per kohya name (from a file; then 3x3 convs are included when named), or
        per U-Net block (networks/lora_blocks.py) block_dims/block_alphas (+ conv_block_dims /
        conv_block_alphas for the 3x3 convs); a dim of 0 creates no module. module_factory(lora_name,
        org_module, multiplier, dim, alpha, dropout, rank_dropout, module_dropout) makes each
        module (default: LoRAModule). unet_targets / text_encoder_targets / unet_prefix: the module
        classes searched and the U-Net name prefix, when not LoRA's (OFT). module_filter(path): whether
        the layer at the dotted path sd-scripts' model has (SDXL U-Net in SAI layout, text encoders
        under ``text_model``) gets a module (default: all)."""
        super().__init__()
        factory = module_factory or LoRAModule
        self.multiplier = multiplier
        self.lora_dim, self.alpha = lora_dim, alpha
        self.conv_lora_dim, self.conv_alpha = conv_lora_dim, conv_alpha
        self.dropout, self.rank_dropout, self.module_dropout = dropout, rank_dropout, module_dropout
        self.loraplus_lr_ratio = self.loraplus_unet_lr_ratio = self.loraplus_text_encoder_lr_ratio = None
        self.block_lr_weight: list[float] | None = None

        text_encoders = [te for te in (text_encoder if isinstance(text_encoder, (list, tuple)) else [text_encoder])
                         if te is not None]
        self.is_sdxl = bool(is_sdxl) if is_sdxl is not None else (
            len(text_encoders) == 2 or (unet is not None and lora_names.is_sdxl_unet(unet)))

        def dims_for(lora_name: str, is_small: bool, is_unet: bool):
            if modules_dim is not None:
                if lora_name in modules_dim:
                    return modules_dim[lora_name], modules_alpha[lora_name]
                return None, None
            if is_unet and block_dims is not None:
                i = lora_blocks.block_index(lora_name, self.is_sdxl)
                if i < 0:
                    raise LoRAError(f"block_dims: U-Net module {lora_name} is in no block")
                if is_small:
                    return block_dims[i], block_alphas[i]
                if conv_block_dims is not None:
                    return conv_block_dims[i], conv_block_alphas[i]
                return None, None
            if is_small:
                return self.lora_dim, self.alpha
            if self.conv_lora_dim is not None:
                return self.conv_lora_dim, self.conv_alpha
            return None, None

        def create_modules(prefix: str, root: torch.nn.Module, targets, name_of) -> list[LoRAModule]:
            loras = []
            for name, module in root.named_modules():
                if module.__class__.__name__ not in targets:
                    continue
                for child_name, child in module.named_modules():
                    is_linear = child.__class__.__name__ == "Linear"
                    is_conv2d = child.__class__.__name__ == "Conv2d"
                    if not (is_linear or is_conv2d):
                        continue
                    path = name_of(name + "." + child_name)
                    if module_filter is not None and not module_filter(path):
                        continue
                    lora_name = lora_names.kohya_name(prefix, path)
                    dim, alpha = dims_for(lora_name, is_linear or child.kernel_size == (1, 1),
                                          prefix == unet_prefix)
                    if not dim:
                        continue
                    loras.append(factory(lora_name, child, self.multiplier, dim, alpha, dropout,
                                         rank_dropout, module_dropout))
            return loras

        self.text_encoder_loras: list[LoRAModule] = []
        for i, te in enumerate(text_encoders):
            prefix = lora_names.text_encoder_prefix(i, len(text_encoders))
            self.text_encoder_loras += create_modules(
                prefix, te, TEXT_ENCODER_TARGET_MODULES if text_encoder_targets is None else text_encoder_targets,
                lora_names.text_encoder_path)

        self.unet_loras: list[LoRAModule] = []
        if unet is not None:
            targets = UNET_TARGET_MODULES if unet_targets is None else unet_targets
            if modules_dim is not None or self.conv_lora_dim is not None or conv_block_dims is not None:
                targets = targets + UNET_TARGET_MODULES_CONV3X3
            if self.is_sdxl:
                block_map = lora_names.sdxl_block_map(unet)
                name_of = lambda path: lora_names.sdxl_module_path(path, block_map)  # noqa: E731
            else:
                name_of = lambda path: path  # noqa: E731
            self.unet_loras = create_modules(unet_prefix, unet, targets, name_of)

        if modules_dim is not None:
            found = {lora.lora_name for lora in self.text_encoder_loras + self.unet_loras}
            missing = sorted(set(modules_dim) - found)
            if missing:
                raise LoRAError(f"LoRA weights: {len(missing)} module(s) do not exist in this model "
                                f"(wrong base model?), e.g. {missing[0]}")

        seen: set[str] = set()
        for lora in self.text_encoder_loras + self.unet_loras:
            if lora.lora_name in seen:  # two paths mapping to one name would corrupt the file
                raise LoRAError(f"duplicated LoRA name {lora.lora_name}")
            seen.add(lora.lora_name)
            self.add_module(lora.lora_name, lora)

    # --- kohya network interface ---------------------------------------------------------------

    def set_multiplier(self, multiplier: float) -> None:
        self.multiplier = multiplier
        for lora in self.text_encoder_loras + self.unet_loras:
            lora.multiplier = multiplier

    def set_enabled(self, is_enabled: bool) -> None:
        for lora in self.text_encoder_loras + self.unet_loras:
            lora.multiplier = self.multiplier if is_enabled else 0.0

    def file_keys(self, weights_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A file's tensors under this network's kohya keys (a kind that reads other key layouts
        renames them here)."""
        return weights_sd

    def load_weights(self, file: str):
        weights_sd = self.file_keys(load_state_dict_file(file))
        try:
            info = self.load_state_dict(weights_sd, strict=False)
        except RuntimeError as e:  # shape mismatch: another dim or another base model
            raise LoRAError(f"LoRA weights {file} do not fit this network: {str(e).splitlines()[-1].strip()}") from e
        if info.unexpected_keys:
            raise LoRAError(f"LoRA weights {file}: {len(info.unexpected_keys)} key(s) match no module of this "
                            f"network (other base model or module set?), e.g. {info.unexpected_keys[0]}")
        return info

    def apply_to(self, text_encoder=None, unet=None, apply_text_encoder: bool = True, apply_unet: bool = True) -> None:
        # Modules not applied are dropped, so they are neither trained nor saved (sd-scripts).
        if not apply_text_encoder:
            self._drop(self.text_encoder_loras)
            self.text_encoder_loras = []
        if not apply_unet:
            self._drop(self.unet_loras)
            self.unet_loras = []
        for lora in self.text_encoder_loras + self.unet_loras:
            lora.apply_to()

    def _drop(self, loras: list[LoRAModule]) -> None:
        for lora in loras:
            lora.restore()
            del self._modules[lora.lora_name]

    def remove_from(self) -> None:
        """Restore every hooked module's own forward (the network can be applied again)."""
        for lora in self.text_encoder_loras + self.unet_loras:
            lora.restore()

    def is_mergeable(self) -> bool:
        return True

    def merge_to(self, text_encoder, unet, weights_sd: dict[str, torch.Tensor], dtype=None, device=None) -> None:
        """Merge the weights of weights_sd (kohya keys) times the multiplier into the original modules."""
        weights_sd = self.file_keys(weights_sd)
        prefixes = {k.split(".", 1)[0] for k in weights_sd}
        for lora in self.text_encoder_loras + self.unet_loras:
            if lora.lora_name not in prefixes:
                continue
            sd = {k[len(lora.lora_name) + 1:]: v for k, v in weights_sd.items()
                  if k.startswith(lora.lora_name + ".")}
            lora.merge_to(sd, dtype, device)

    def set_loraplus_lr_ratio(self, loraplus_lr_ratio, loraplus_unet_lr_ratio, loraplus_text_encoder_lr_ratio):
        self.loraplus_lr_ratio = loraplus_lr_ratio
        self.loraplus_unet_lr_ratio = loraplus_unet_lr_ratio
        self.loraplus_text_encoder_lr_ratio = loraplus_text_encoder_lr_ratio

    def prepare_optimizer_params(self, text_encoder_lr, unet_lr, default_lr):
        """-> (param_groups, descriptions), as sd-scripts.

        text_encoder_lr: float, None (-> default_lr) or a list (one per text encoder; a shorter
        list repeats its first value). A group whose lr ends up 0 or None is left out (frozen).
        LoRA+ puts lora_up weights in a separate "plus" group with lr * ratio.
        """
        self.requires_grad_(True)
        all_params, descriptions = [], []

        def assemble(loras, lr, ratio, label):
            groups: dict[str, list] = {"lora": [], "plus": []}
            for lora in loras:
                for pname, param in lora.named_parameters():
                    plus = ratio is not None and any(p in pname for p in lora.PLUS_PARAMS)
                    groups["plus" if plus else "lora"].append(param)
            for key, params in groups.items():
                if not params:
                    continue
                group_lr = None if lr is None else (lr * ratio if key == "plus" else lr)
                if not group_lr:
                    for p in params:  # frozen: no gradient (trainable_parameters agrees)
                        p.requires_grad_(False)
                    continue
                all_params.append({"params": params, "lr": group_lr})
                descriptions.append(label + (" plus" if key == "plus" else ""))

        if self.text_encoder_loras:
            te_ratio = self.loraplus_text_encoder_lr_ratio or self.loraplus_lr_ratio
            if isinstance(text_encoder_lr, (list, tuple)):
                lrs = list(text_encoder_lr) or [default_lr]
            else:
                lrs = [text_encoder_lr if text_encoder_lr is not None else default_lr]
            by_te: dict[str, list[LoRAModule]] = {}
            for lora in self.text_encoder_loras:
                by_te.setdefault(lora_names.text_encoder_prefix_of(lora.lora_name), []).append(lora)
            for i, (prefix, loras) in enumerate(by_te.items()):
                lr = lrs[i] if i < len(lrs) else lrs[0]
                if lr is None:
                    lr = default_lr
                label = "textencoder" if len(by_te) == 1 else f"textencoder {prefix[len(lora_names.PREFIX_TE):]}"
                assemble(loras, lr, te_ratio, label)

        if self.unet_loras:
            lr = unet_lr if unet_lr is not None else default_lr
            ratio = self.loraplus_unet_lr_ratio or self.loraplus_lr_ratio
            if self.block_lr_weight is None:
                assemble(self.unet_loras, lr, ratio, "unet")
            else:
                # sd-scripts: one group (pair with LoRA+) per block, in order of first appearance,
                # at lr * the block's weight; weight 0 leaves the block's modules out (frozen)
                by_block: dict[int, list[LoRAModule]] = {}
                for lora in self.unet_loras:
                    by_block.setdefault(lora_blocks.block_index(lora.lora_name, self.is_sdxl), []).append(lora)
                for i, loras in by_block.items():
                    assemble(loras, None if lr is None else lr * self.block_lr_weight[i], ratio,
                             f"unet_block{i}")
        return all_params, descriptions

    def set_block_lr_weight(self, block_lr_weight: list[float] | None) -> None:
        """One learning-rate factor per U-Net block (networks/lora_blocks.py), or None."""
        self.block_lr_weight = block_lr_weight

    # sd-scripts' name for a network whose prepare_optimizer_params takes one rate per text
    # encoder (train_network.py then passes text_encoder_lr as the list it was given)
    prepare_optimizer_params_with_multiple_te_lrs = prepare_optimizer_params

    def enable_gradient_checkpointing(self) -> None:
        pass  # nothing to checkpoint inside a LoRA module (sd-scripts does the same)

    def prepare_grad_etc(self, text_encoder, unet) -> None:
        self.requires_grad_(True)

    def on_epoch_start(self, text_encoder, unet) -> None:
        self.train()

    def get_trainable_params(self):
        return self.parameters()

    def save_weights(self, file: str, dtype: Optional[torch.dtype], metadata: Optional[dict[str, str]]) -> None:
        write_weights(file, self.state_dict(), dtype, metadata)


class LoRANetwork(AdapterNetwork):
    """sd-scripts' LoRA network: LoRAModule (or a subclass) with max-norm regularisation."""

    @torch.no_grad()
    def apply_max_norm_regularization(self, max_norm_value: float, device) -> tuple[int, float, float]:
        """sd-scripts' max-norm regularisation, after an optimizer step: each module whose
        ||up @ down * alpha / rank|| exceeds max_norm_value has up and down scaled by
        sqrt(max_norm / norm) (so the product's norm becomes max_norm).
        Returns (modules scaled, mean and max of the norms after scaling)."""
        return max_norm_summary(self.scale_max_norms(max_norm_value, device))

    @torch.no_grad()
    def scale_max_norms(self, max_norm_value: float, device):
        """``apply_max_norm_regularization`` with its statistics left on the device (no host
        read): a (2, modules) tensor of the norms after scaling and the ratios applied, for
        ``max_norm_summary`` when they are shown or logged; None without modules."""
        loras = self.text_encoder_loras + self.unet_loras
        if not loras:
            return None
        norms, ratios = [], []
        for lora in loras:
            down, up = lora.lora_down.weight, lora.lora_up.weight
            norm = torch.linalg.vector_norm(lora_delta(down.to(device), up.to(device), lora.scale))
            # as sd-scripts: the clamp below keeps a ~0 norm from dividing (its ratio is exactly 1)
            clamped = norm.clamp(min=max_norm_value / 2)
            ratio = clamped.clamp(max=max_norm_value) / clamped
            # multiplying by sqrt(1) = 1 is exact: the modules within the bound stay bit-identical
            sqrt_ratio = ratio.sqrt()
            down.mul_(sqrt_ratio.to(down.device, down.dtype))
            for p in lora.lora_up.parameters():  # the up weight, or split_qkv's blocks of it
                p.mul_(sqrt_ratio.to(p.device, p.dtype))
            norms.append(norm * ratio)
            ratios.append(ratio)
        return torch.stack([torch.stack(norms), torch.stack(ratios)])


def write_weights(file: str, state_dict: dict[str, torch.Tensor], dtype: Optional[torch.dtype],
                  metadata: Optional[dict[str, str]]) -> None:
    """The one writer of LoRA-family and embedding files, for training and every tool.

    Atomic (the previous file stays on any failure); floating tensors (alpha included, as
    sd-scripts) in ``dtype``; a tensor with non-finite values is refused by name.
    .safetensors: the metadata as strings, with the sshs_* hashes computed over what is written
    (any given ones dropped); other suffixes: torch.save, without metadata."""
    sd = {}
    for k, v in state_dict.items():
        v = v.detach().to("cpu", copy=True)
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        if v.is_floating_point() and not torch.isfinite(v.float()).all():
            raise LoRAError(f"{file}: not written, {k} has non-finite values")
        sd[k] = v.contiguous()
    if os.path.splitext(file)[1].lower() == ".safetensors":
        meta = {k: str(v) for k, v in (metadata or {}).items() if not k.startswith("sshs_")}
        meta["sshs_model_hash"], meta["sshs_legacy_hash"] = precalculate_safetensors_hashes(sd, meta)
        _atomic_save(file, lambda tmp: safetensors_file.save(sd, tmp, meta))
    else:
        _atomic_save(file, lambda tmp: torch.save(sd, tmp))


# --- module-level entry points (the network_module interface) ----------------------------------

def create_network(multiplier: float, network_dim: Optional[int], network_alpha: Optional[float], vae,
                   text_encoder, unet, neuron_dropout: Optional[float] = None, **kwargs) -> LoRANetwork:
    return build_network(multiplier, network_dim, network_alpha, text_encoder, unet, neuron_dropout,
                         parse_network_args(kwargs))


def build_network(multiplier, network_dim, network_alpha, text_encoder, unet, neuron_dropout,
                  args: dict[str, Any], module_factory=None, network_class=None) -> AdapterNetwork:
    """The network of parsed network_args (LoRA's, or a kind's that shares them), with
    module_factory's modules in network_class (default: LoRA in LoRANetwork)."""
    network_dim = 4 if network_dim is None else parse_number("network_dim", network_dim, int, 1)
    network_alpha = 1.0 if network_alpha is None else parse_number("network_alpha", network_alpha, float, 0)
    if neuron_dropout is not None:
        neuron_dropout = parse_number("network_dropout", neuron_dropout, float, 0.0, 1.0)
    is_sdxl = _is_sdxl(text_encoder, unet)
    block_lr_weight = _lr_weights(args, is_sdxl)
    per_block = {}
    if args.get("block_dims") is not None or block_lr_weight is not None:
        # sd-scripts: block_dims or an lr weight switches on per-block ranks
        try:
            dims, alphas, conv_dims, conv_alphas = lora_blocks.block_dims_and_alphas(
                args, is_sdxl, network_dim, network_alpha, args.get("conv_dim"), args.get("conv_alpha"),
                block_lr_weight)
        except lora_blocks.BlockArgError as e:
            raise LoRAError(str(e)) from None
        per_block = dict(block_dims=dims, block_alphas=alphas, conv_block_dims=conv_dims,
                         conv_block_alphas=conv_alphas)
    network = (network_class or LoRANetwork)(
        text_encoder, unet, multiplier=multiplier, lora_dim=network_dim, alpha=network_alpha,
        dropout=neuron_dropout, rank_dropout=args.get("rank_dropout"), module_dropout=args.get("module_dropout"),
        conv_lora_dim=args.get("conv_dim"), conv_alpha=args.get("conv_alpha"), is_sdxl=is_sdxl,
        module_factory=module_factory, **per_block)
    _set_lr_options(network, args, block_lr_weight)
    return network


def _is_sdxl(text_encoder, unet) -> bool:
    tes = [te for te in (text_encoder if isinstance(text_encoder, (list, tuple)) else [text_encoder]) if te is not None]
    return len(tes) == 2 or (unet is not None and lora_names.is_sdxl_unet(unet))


def _lr_weights(args: dict[str, Any], is_sdxl: bool) -> list[float] | None:
    try:
        return lora_blocks.lr_weights(args, is_sdxl, log=logger.warning)
    except lora_blocks.BlockArgError as e:
        raise LoRAError(str(e)) from None


def _set_lr_options(network: LoRANetwork, args: dict[str, Any], block_lr_weight) -> None:
    if any(k.startswith("loraplus") for k in args):
        network.set_loraplus_lr_ratio(args.get("loraplus_lr_ratio"), args.get("loraplus_unet_lr_ratio"),
                                      args.get("loraplus_text_encoder_lr_ratio"))
    if block_lr_weight is not None:
        network.set_block_lr_weight(block_lr_weight)


def dims_from_weights(weights_sd: dict[str, torch.Tensor]) -> tuple[dict[str, int], dict[str, Any]]:
    """Per kohya name: rank (rows of lora_down) and alpha (rank when the file has none)."""
    modules_dim: dict[str, int] = {}
    modules_alpha: dict[str, Any] = {}
    for key, value in weights_sd.items():
        if "." not in key:
            continue
        lora_name = key.split(".")[0]
        if key.endswith(".alpha"):
            modules_alpha[lora_name] = value
        elif "lora_down" in key:
            modules_dim[lora_name] = value.size()[0]
    for lora_name, dim in modules_dim.items():
        modules_alpha.setdefault(lora_name, dim)  # old files without alpha: no scaling
    return modules_dim, modules_alpha


def create_network_from_weights(multiplier: float, file: Optional[str], vae, text_encoder, unet,
                                weights_sd: Optional[dict[str, torch.Tensor]] = None, for_inference: bool = False,
                                **kwargs) -> tuple[LoRANetwork, dict[str, torch.Tensor]]:
    """Network shaped like the file (dims and alphas per module, 3x3 convs included); weights are
    not loaded here (call load_weights / load_state_dict, or merge_to)."""
    if weights_sd is None:
        weights_sd = load_state_dict_file(file)
    return build_network_from_weights(multiplier, file, text_encoder, unet, weights_sd, parse_network_args(kwargs))


def build_network_from_weights(multiplier, file, text_encoder, unet, weights_sd, args: dict[str, Any],
                               module_factory=None, network_class=None, kind: str = "LoRA",
                               dims_reader=None) -> tuple[AdapterNetwork, dict[str, torch.Tensor]]:
    """create_network_from_weights for any kind: dims_reader(weights_sd) -> (dims, alphas) per
    module name (default: LoRA's ``lora_down`` rows)."""
    modules_dim, modules_alpha = (dims_reader or dims_from_weights)(weights_sd)
    if not modules_dim:
        found = file_kinds(weights_sd)
        what = f"a {'/'.join(found)} file" if found else "no adapter module keys"
        raise LoRAError(f"weights {file or '(state dict)'}: {what}, not a {kind} file of this network_module")
    unused = sorted(k for k in ("conv_dim", "conv_alpha", *lora_blocks.BLOCK_LIST_ARGS) if k in args)
    if unused:  # the file fixes every module's rank and alpha
        raise LoRAError(f"network_args: {unused[0]} has no effect on a network shaped by a weights file "
                        "(dim_from_weights: the ranks and alphas come from network_weights); remove it")
    is_sdxl = _is_sdxl(text_encoder, unet)
    network = (network_class or LoRANetwork)(text_encoder, unet, multiplier=multiplier, modules_dim=modules_dim,
                                             modules_alpha=modules_alpha, is_sdxl=is_sdxl,
                                             module_factory=module_factory)
    _set_lr_options(network, args, _lr_weights(args, is_sdxl))  # sd-scripts: lr weights apply here too
    return network, weights_sd


def max_norm_summary(stacked) -> tuple[int, float, float]:
    """(modules scaled, mean and max of the norms after scaling) of ``scale_max_norms``'s
    tensor, in one host transfer for all modules."""
    if stacked is None:
        return 0, 0.0, 0.0
    stats = stacked.float().cpu()
    scaled_norms = stats[0]
    keys_scaled = int((stats[1] != 1).sum())
    return keys_scaled, float(scaled_norms.mean()), float(scaled_norms.max())
