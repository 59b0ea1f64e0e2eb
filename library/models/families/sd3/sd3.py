"""The SD3 / SD3.5 MMDiT in Stability AI's layout.

Module names follow SAI's released checkpoints (and sd-scripts' `library/sd3_models.py`), so that
`state_dict()` keys are those of the files people share, under `model.diffusion_model.` in an
all-in-one file: `x_embedder.proj`, `pos_embed` (a fixed 2-D sin-cos table saved in the file and
cropped to the latent size), `t_embedder.mlp.{0,2}`, `y_embedder.mlp.{0,2}`, `context_embedder`,
`joint_blocks.N.{context_block,x_block}.{adaLN_modulation.1, attn.qkv, attn.proj, attn.ln_q,
attn.ln_k, mlp.fc1, mlp.fc2}`, SD3.5 medium's `x_block.attn2.*` in its first blocks, and
`final_layer.{adaLN_modulation.1, linear}`. The last joint block's context block is "pre only":
its output is unused, so it has no `attn.proj` and no `mlp`.

SAI's rule fixes the widths: hidden size = 64 x depth, one 64-wide head per block of depth.

forward(x, t, y, context): x the latents (B, 16, H, W), t the timesteps (B,) = sigma x 1000,
y the pooled text vector (B, adm_in_channels), context the token states (B, L, context_dim).
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from library.errors import ModelError, first_line
from library.models import block_checkpoint
from library.models.families.sd3 import sd3_positions

HEAD_DIM = 64  # SAI: hidden = 64 * depth, heads = depth
PREFIX = "model.diffusion_model."  # the transformer's keys in an all-in-one file


class SD3ModelError(ModelError):
    """SD3 weights or sources that do not form a model; one line naming the file, key or option."""


@dataclass(frozen=True)
class MMDiTConfig:
    depth: int
    patch_size: int = 2
    in_channels: int = 16
    adm_in_channels: int = 2048  # pooled CLIP-L (768) + CLIP-G (1280)
    context_dim: int = 4096  # the context embedder's input: T5-XXL's width
    qk_norm: str | None = None  # None (SD3) or "rms" (SD3.5)
    x_block_self_attn_layers: tuple[int, ...] = ()  # SD3.5 medium: 0..12
    pos_embed_max_size: int = 192  # the saved table is max x max patches
    # Only for a freshly built table: the latent size the table's positions are laid out for
    # (diffusers' `sample_size`; a loaded file brings its own table).
    sample_size: int = 128
    mlp_ratio: float = 4.0

    @property
    def hidden_size(self) -> int:
        return HEAD_DIM * self.depth

    @property
    def num_heads(self) -> int:
        return self.depth

    @property
    def variant(self) -> str:
        """sd3 (SD3 medium), sd3.5-medium or sd3.5-large, as sd-scripts tells them apart."""
        if self.qk_norm is None:
            return "sd3"
        return "sd3.5-medium" if self.x_block_self_attn_layers else "sd3.5-large"


# Configurations of the released models (what config_from_state_dict reads from their weights).
SD3_MEDIUM = MMDiTConfig(depth=24, pos_embed_max_size=192)
SD35_MEDIUM = MMDiTConfig(depth=24, qk_norm="rms", x_block_self_attn_layers=tuple(range(13)),
                          pos_embed_max_size=384)
SD35_LARGE = MMDiTConfig(depth=38, qk_norm="rms", pos_embed_max_size=192)
# Tiny: two blocks (the last one pre-only), pooled = tiny CLIP-L 32 + CLIP-G 64, a 128-wide context.
TINY = MMDiTConfig(depth=2, adm_in_channels=96, context_dim=128, pos_embed_max_size=16, sample_size=8)


def tiny_config(variant: str = "sd3") -> MMDiTConfig:
    """The tiny config of a variant: sd3, sd3.5-medium (qk norm + attn2 in block 0), sd3.5-large."""
    if variant == "sd3":
        return TINY
    if variant == "sd3.5-medium":
        return replace(TINY, qk_norm="rms", x_block_self_attn_layers=(0,))
    if variant == "sd3.5-large":
        return replace(TINY, qk_norm="rms")
    raise ValueError(f"unknown SD3 variant {variant!r}; expected sd3, sd3.5-medium or sd3.5-large")


# --- reading the configuration from the weights ----------------------------------------------

_BLOCK = re.compile(r"^joint_blocks\.(\d+)\.")
_ATTN2 = re.compile(r"^joint_blocks\.(\d+)\.x_block\.attn2\.qkv\.weight$")


def strip_prefix(state_dict: dict) -> dict:
    """The transformer's keys without `model.diffusion_model.` (other components dropped when the
    prefix is present)."""
    if any(k.startswith(PREFIX) for k in state_dict):
        return {k[len(PREFIX):]: v for k, v in state_dict.items() if k.startswith(PREFIX)}
    return dict(state_dict)


def is_mmdit_state_dict(state_dict: dict) -> bool:
    return "joint_blocks.0.x_block.attn.qkv.weight" in state_dict or \
        PREFIX + "joint_blocks.0.x_block.attn.qkv.weight" in state_dict


def config_from_state_dict(state_dict: dict, source: str = "checkpoint") -> MMDiTConfig:
    """The configuration of SAI-layout transformer weights (with or without the prefix), from
    their shapes: depth from the number of joint blocks, patch size and width from
    x_embedder.proj, the pos_embed table's size, qk norm from ln_q, attn2 layers."""
    sd = strip_prefix(state_dict)
    need = ("x_embedder.proj.weight", "pos_embed", "y_embedder.mlp.0.weight", "context_embedder.weight")
    for key in need:
        if key not in sd:
            raise SD3ModelError(f"{source}: not an SD3 transformer (no {key})")
    depth = 1 + max((int(m.group(1)) for k in sd if (m := _BLOCK.match(k))), default=-1)
    if depth == 0:
        raise SD3ModelError(f"{source}: not an SD3 transformer (no joint_blocks)")
    proj = sd["x_embedder.proj.weight"]
    if proj.shape[0] != HEAD_DIM * depth:
        raise SD3ModelError(f"{source}: x_embedder.proj.weight is {proj.shape[0]} wide but {depth} joint "
                            f"blocks need {HEAD_DIM * depth} (hidden = 64 x depth)")
    n_patches = sd["pos_embed"].shape[1]
    max_size = round(math.sqrt(n_patches))
    if max_size * max_size != n_patches:
        raise SD3ModelError(f"{source}: pos_embed holds {n_patches} positions, not a square table")
    ctx = sd["context_embedder.weight"]
    return MMDiTConfig(
        depth=depth, patch_size=proj.shape[2], in_channels=proj.shape[1],
        adm_in_channels=sd["y_embedder.mlp.0.weight"].shape[1], context_dim=ctx.shape[1],
        qk_norm="rms" if "joint_blocks.0.x_block.attn.ln_q.weight" in sd else None,
        x_block_self_attn_layers=tuple(sorted(int(m.group(1)) for k in sd if (m := _ATTN2.match(k)))),
        pos_embed_max_size=max_size)


# --- the fixed position table ------------------------------------------------------------------

def sincos_pos_embed(dim: int, grid_size: int, base_size: int) -> torch.Tensor:
    """(grid_size^2, dim): per patch (row h, column w) sin-cos features of w in the first half and
    of h in the second, positions scaled by base_size / grid_size (SAI's and diffusers' table)."""
    pos = torch.arange(grid_size, dtype=torch.float64) * (base_size / grid_size)
    return sd3_positions.sincos_table(dim, pos)


# --- modules (names as SAI's) ----------------------------------------------------------------

def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class RMSNorm(nn.Module):
    """SAI's qk norm: x / rms(x) * weight over the head dimension, eps 1e-6 (computed in float32)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.to(x.dtype) * self.weight.to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, in_channels: int, hidden: int):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_channels, hidden, patch_size, patch_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class MLPEmbedder(nn.Module):
    """t_embedder / y_embedder: mlp = Linear, SiLU, Linear."""

    def __init__(self, in_dim: int, hidden: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def timestep_embedding(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """[cos, sin] of t times frequencies exp(-ln(max_period) i / (dim/2)), in float32."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class AttentionLinears(nn.Module):
    """SAI's AttentionLinears: qkv (fused), optional ln_q/ln_k per head, proj (absent if pre-only).

    The block classes have sd-scripts' names (library/sd3_models.py: AttentionLinears, MLP,
    SingleDiTBlock, MMDiTBlock, UnPatch): LyCORIS picks the layers it trains by class name
    (SingleDiTBlock is one of its targets, its lumina "FinalLayer" and "SelfAttention" must not
    match), so its modules here are the ones it makes on sd-scripts' SD3."""

    def __init__(self, dim: int, num_heads: int, qk_norm: str | None, pre_only: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        if not pre_only:
            self.proj = nn.Linear(dim, dim)
        if qk_norm == "rms":
            self.ln_q = RMSNorm(self.head_dim)
            self.ln_k = RMSNorm(self.head_dim)
        elif qk_norm is None:
            self.ln_q = nn.Identity()
            self.ln_k = nn.Identity()
        else:
            raise ValueError(f"qk_norm: {qk_norm!r}; expected None or 'rms'")

    def pre_attention(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as (B, heads, L, head_dim), q and k normalised."""
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, self.head_dim).unbind(2)
        return self.ln_q(q).transpose(1, 2), self.ln_k(k).transpose(1, 2), v.transpose(1, 2)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).flatten(2)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SingleDiTBlock(nn.Module):
    """One stream of a joint block (SAI's DismantledBlock, sd-scripts' SingleDiTBlock): adaLN-modulated
    attention and MLP.

    adaLN_modulation yields (shift, scale, gate) for attention and MLP (6 x hidden); 9 with the
    extra self-attention attn2 (its shift, scale, gate last); 2 (shift, scale) when pre-only."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, qk_norm: str | None,
                 pre_only: bool = False, self_attn: bool = False):
        super().__init__()
        self.pre_only = pre_only
        self.self_attn = self_attn
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = AttentionLinears(dim, num_heads, qk_norm, pre_only=pre_only)
        if self_attn:
            self.attn2 = AttentionLinears(dim, num_heads, qk_norm)
        if not pre_only:
            self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
            self.mlp = MLP(dim, int(dim * mlp_ratio))
        n_mods = 9 if self_attn else (2 if pre_only else 6)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, n_mods * dim))

    def pre_attention(self, x: torch.Tensor, c: torch.Tensor):
        mods = self.adaLN_modulation(c).chunk(9 if self.self_attn else (2 if self.pre_only else 6), dim=-1)
        x_norm = self.norm1(x)
        qkv = self.attn.pre_attention(_modulate(x_norm, mods[0], mods[1]))
        qkv2 = self.attn2.pre_attention(_modulate(x_norm, mods[6], mods[7])) if self.self_attn else None
        return qkv, qkv2, mods

    def post_attention(self, x: torch.Tensor, attn: torch.Tensor, attn2: torch.Tensor | None, mods) -> torch.Tensor:
        _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods[:6]
        x = x + gate_msa.unsqueeze(1) * self.attn.proj(attn)
        if attn2 is not None:
            x = x + mods[8].unsqueeze(1) * self.attn2.proj(attn2)
        return x + gate_mlp.unsqueeze(1) * self.mlp(_modulate(self.norm2(x), shift_mlp, scale_mlp))


class MMDiTBlock(nn.Module):
    """Joint attention over [context tokens, image tokens]; each stream has its own weights."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, qk_norm: str | None,
                 pre_only: bool, self_attn: bool):
        super().__init__()
        self.context_block = SingleDiTBlock(dim, num_heads, mlp_ratio, qk_norm, pre_only=pre_only)
        self.x_block = SingleDiTBlock(dim, num_heads, mlp_ratio, qk_norm, self_attn=self_attn)

    def forward(self, context: torch.Tensor, x: torch.Tensor, c: torch.Tensor):
        c_qkv, _, c_mods = self.context_block.pre_attention(context, c)
        x_qkv, x_qkv2, x_mods = self.x_block.pre_attention(x, c)
        n_ctx = context.shape[1]
        q, k, v = (torch.cat([a, b], dim=2) for a, b in zip(c_qkv, x_qkv))
        attn = _attention(q, k, v)
        attn2 = _attention(*x_qkv2) if x_qkv2 is not None else None
        x = self.x_block.post_attention(x, attn[:, n_ctx:], attn2, x_mods)
        if self.context_block.pre_only:
            return None, x
        return self.context_block.post_attention(context, attn[:, :n_ctx], None, c_mods), x


class UnPatch(nn.Module):
    def __init__(self, dim: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(_modulate(self.norm_final(x), shift, scale))


class MMDiT(nn.Module):
    def __init__(self, config: MMDiTConfig):
        super().__init__()
        self.config = config
        hidden, p = config.hidden_size, config.patch_size
        self.x_embedder = PatchEmbed(p, config.in_channels, hidden)
        self.t_embedder = MLPEmbedder(256, hidden)
        self.y_embedder = MLPEmbedder(config.adm_in_channels, hidden)
        self.context_embedder = nn.Linear(config.context_dim, hidden)
        table = sincos_pos_embed(hidden, config.pos_embed_max_size, config.sample_size // p)
        self.register_buffer("pos_embed", table.unsqueeze(0))
        self.joint_blocks = nn.ModuleList(
            MMDiTBlock(hidden, config.num_heads, config.mlp_ratio, config.qk_norm,
                       pre_only=i == config.depth - 1, self_attn=i in config.x_block_self_attn_layers)
            for i in range(config.depth))
        self.final_layer = UnPatch(hidden, p, config.in_channels)
        self.gradient_checkpointing = False
        # blocks_to_swap: streams host-kept blocks to the device around their use (None: off;
        # library/training/block_swap.py sets it)
        self.block_swap = None
        # cpu_offload_checkpointing: with gradient checkpointing, what each checkpoint keeps
        # (the block's inputs) is held in host memory until the backward (sd-scripts' option)
        self.cpu_offload_checkpointing = False
        # enable_scaled_pos_embed: the tables per resolution (sd3_positions.ScaledPosEmbed), used
        # instead of pos_embed by every forward; None: the saved table
        self.scaled_pos_embed: sd3_positions.ScaledPosEmbed | None = None

    def enable_scaled_pos_embed(self, latent_sizes) -> None:
        """sd-scripts' enable_scaled_pos_embed(True, latent_sizes): a scaled table per latent size
        (in latent pixels); the saved pos_embed is kept (and saved) unchanged."""
        p = self.config.patch_size
        self.scaled_pos_embed = sd3_positions.ScaledPosEmbed(self.config.hidden_size,
                                                             [s // p for s in latent_sizes])

    def enable_gradient_checkpointing(self, enabled: bool = True) -> None:
        self.gradient_checkpointing = enabled

    def _call(self, block: nn.Module, *args):
        return block_checkpoint.call(block, args, checkpointing=self.gradient_checkpointing and self.training,
                                     offload=self.cpu_offload_checkpointing)

    def cropped_pos_embed(self, h: int, w: int, crop_rate: float = 0.0, crop_seeds=None,
                          device=None, dtype=None) -> torch.Tensor:
        """The position embedding of latents of h x w patches: (1, h*w, hidden), the centre of the
        table (SAI's cropped_pos_embed; with enable_scaled_pos_embed the scaled table of the
        latent's size), or with ``crop_seeds`` (one per sample) (B, h*w, hidden), each sample's
        window drawn with ``crop_rate`` (sd3_positions.crop_offset: pos_emb_random_crop_rate)."""
        if self.scaled_pos_embed is not None:
            size = self.scaled_pos_embed.size_for(h, w)
            m = self.scaled_pos_embed.grid(size)
            table = self.scaled_pos_embed.table(size, device or self.pos_embed.device,
                                                dtype or torch.float32)
        else:
            m = self.config.pos_embed_max_size
            if h > m or w > m:
                raise SD3ModelError(f"latents of {h} x {w} patches exceed the model's position table "
                                    f"({m} x {m} patches, {m * self.config.patch_size * 8} px)")
            table = self.pos_embed[0]
        seeds = [None] if crop_seeds is None else list(crop_seeds)
        windows = [sd3_positions.window(table, m, *sd3_positions.crop_offset(seed, crop_rate, m, h, w), h, w)
                   for seed in seeds]
        return torch.stack(windows)

    def patches(self, x: torch.Tensor) -> tuple[int, int]:
        """(h, w): the patch grid of latents x (B, C, H, W)."""
        H, W = x.shape[-2:]
        p = self.config.patch_size
        if H % p or W % p:
            raise SD3ModelError(f"latent size {H} x {W} is not a multiple of the patch size {p}")
        return H // p, W // p

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, context: torch.Tensor,
                pos_embed: torch.Tensor | None = None) -> torch.Tensor:
        """``pos_embed``: the position embedding (1 or B, h*w, hidden) from cropped_pos_embed,
        computed by the caller (outside a compiled forward: a random crop's draws and the scaled
        tables are Python); None: the table's centre."""
        b, _, H, W = x.shape
        p = self.config.patch_size
        h, w = self.patches(x)
        if pos_embed is None:
            pos_embed = self.cropped_pos_embed(h, w, device=x.device, dtype=x.dtype)
        x = self.x_embedder(x) + pos_embed.to(x.dtype)
        c = self.t_embedder(timestep_embedding(t).to(x.dtype)) + self.y_embedder(y)
        context = self.context_embedder(context)
        for block in self.joint_blocks:
            if self.block_swap is not None:
                context, x = self.block_swap.run(block, functools.partial(self._call, block), context, x, c)
            else:
                context, x = self._call(block, context, x, c)
        x = self.final_layer(x, c)  # (B, h*w, p*p*C)
        x = x.view(b, h, w, p, p, -1).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(b, -1, H, W)


def build_mmdit(config: MMDiTConfig, state_dict: dict | None = None, source: str = "checkpoint",
                dtype: torch.dtype = torch.float32) -> MMDiT:
    """An MMDiT of ``config``: random weights, or with ``state_dict`` (SAI layout, prefix
    optional) its weights cast to ``dtype`` (fp8-stored files are upcast), every key required and
    none left over (one line naming the first mismatch). A loaded model is built on the meta
    device and takes the file's tensors: no time spent on random weights it would overwrite."""
    if state_dict is None:
        return MMDiT(config)
    with torch.device("meta"):
        model = MMDiT(config)
    sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in strip_prefix(state_dict).items()}
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    except RuntimeError as e:  # a shape mismatch: torch lists every one over many lines
        msg = first_line(e)
        m = re.search(r"size mismatch for ([^:]+): copying a param with shape (torch\.Size\(\[[^\]]*\]\))"
                      r".*current model is (torch\.Size\(\[[^\]]*\]\))", str(e))
        if m:
            msg = f"{m.group(1)} has shape {m.group(2)[11:-1]}, the model needs {m.group(3)[11:-1]}"
        raise SD3ModelError(f"{source}: the SD3 transformer weights do not fit: {msg}") from None
    if missing:
        raise SD3ModelError(f"{source}: SD3 transformer weights missing (e.g. {missing[0]}; {len(missing)} tensors)")
    if unexpected:
        raise SD3ModelError(f"{source}: unexpected SD3 transformer weights (e.g. {unexpected[0]}; "
                            f"{len(unexpected)} tensors)")
    return model


def last_x_block_parameters(mmdit: nn.Module, n: int) -> list[str]:
    """num_last_block_to_freeze (sd-scripts' sd3_train.py): the names of the last ``n`` parameter
    tensors (not blocks) whose name contains ``x_block`` (the joint blocks' image stream), in the
    module's order, which follows SAI's (and sd-scripts' SingleDiTBlock's): attn, attn2, mlp,
    adaLN_modulation."""
    names = [name for name, _ in mmdit.named_parameters() if "x_block" in name]
    return names[max(0, len(names) - n):] if n > 0 else []
