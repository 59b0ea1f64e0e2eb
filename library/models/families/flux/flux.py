"""The FLUX.1 transformer (dev and schnell) in Black Forest Labs' module layout.

Module names are BFL's (and sd-scripts' ``library/flux_models.py``), so ``state_dict()`` keys are
those of the released ``flux1-dev.safetensors`` / ``flux1-schnell.safetensors``: ``img_in``,
``time_in.{in_layer,out_layer}``, ``vector_in``, ``guidance_in`` (dev only), ``txt_in``,
``double_blocks.N.{img,txt}_{mod.lin,attn.qkv,attn.norm.{query,key}_norm.scale,attn.proj,mlp.0,mlp.2}``,
``single_blocks.N.{linear1,linear2,norm.{query,key}_norm.scale,modulation.lin}``,
``final_layer.{adaLN_modulation.1,linear}``.

Inputs are those of BFL's / sd-scripts' ``Flux.forward``: the packed latents (``pack_latents``:
2x2 patches of the 16-channel latents, 64 features per token), their position ids
(``image_ids``: (0, row, column) per patch), the T5 hidden states with all-zero ids
(``text_ids``), the timesteps in [0, 1] (scaled by 1000 inside the sinusoidal embedding), the
pooled CLIP-L output, and for dev the distilled guidance scale. ``txt_attention_mask`` (the T5
tokenizer's mask, used with ``apply_t5_attn_mask``) keeps padded T5 tokens out of every
attention as keys, as sd-scripts does; they still attend as queries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from library.models import block_checkpoint

# The sinusoidal timestep / guidance embedding width (BFL's MLPEmbedder input).
TIME_EMBED_DIM = 256


@dataclass(frozen=True)
class FluxConfig:
    """The transformer's shape (BFL's FluxParams)."""
    in_channels: int = 64  # 16 latent channels x a 2x2 patch
    vec_in_dim: int = 768  # CLIP-L pooled output width
    context_in_dim: int = 4096  # T5-XXL hidden width
    hidden_size: int = 3072
    mlp_ratio: float = 4.0
    num_heads: int = 24
    depth: int = 19  # double-stream blocks
    depth_single_blocks: int = 38
    axes_dim: tuple[int, ...] = (16, 56, 56)  # RoPE dims per id axis; sums to the head dim
    theta: int = 10_000
    qkv_bias: bool = True
    guidance_embed: bool = True  # dev: True, schnell: False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    def check(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"FLUX config: hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if sum(self.axes_dim) != self.head_dim or any(d % 2 for d in self.axes_dim):
            raise ValueError(f"FLUX config: axes_dim {list(self.axes_dim)} must be even and sum to the head dim "
                             f"{self.head_dim}")


FLUX_DEV = FluxConfig()
FLUX_SCHNELL = FluxConfig(guidance_embed=False)
# The built-in tiny-flux: the real topology (double and single blocks, RoPE over three axes,
# guidance input) at small widths; text widths are those of the tiny CLIP-L and tiny T5.
TINY_FLUX_DEV = FluxConfig(vec_in_dim=32, context_in_dim=32, hidden_size=64, num_heads=2, depth=2,
                           depth_single_blocks=2, axes_dim=(8, 12, 12))
TINY_FLUX_SCHNELL = FluxConfig(vec_in_dim=32, context_in_dim=32, hidden_size=64, num_heads=2, depth=2,
                               depth_single_blocks=2, axes_dim=(8, 12, 12), guidance_embed=False)


# --- latents, ids, masks ---------------------------------------------------------------------

def pack_latents(latents: Tensor) -> Tensor:
    """(B, C, 2h, 2w) latents -> (B, h*w, C*4) tokens: each 2x2 patch is one token, its features
    ordered (channel, patch row, patch column); tokens row-major over the patch grid."""
    b, c, hh, ww = latents.shape
    if hh % 2 or ww % 2:
        raise ValueError(f"FLUX latents must have even height and width (2x2 patches), got {hh}x{ww}")
    x = latents.reshape(b, c, hh // 2, 2, ww // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (hh // 2) * (ww // 2), c * 4)


def unpack_latents(tokens: Tensor, height: int, width: int) -> Tensor:
    """The inverse of pack_latents: (B, h*w, C*4) -> (B, C, 2h, 2w) for a patch grid h x w."""
    b, n, f = tokens.shape
    if n != height * width or f % 4:
        raise ValueError(f"FLUX tokens of shape {tuple(tokens.shape)} do not fit a {height}x{width} patch grid")
    x = tokens.reshape(b, height, width, f // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, f // 4, height * 2, width * 2)


def image_ids(height: int, width: int, batch_size: int = 1, device=None) -> Tensor:
    """Position ids of a height x width patch grid: (B, h*w, 3), each (0, row, column)."""
    ids = torch.zeros(height, width, 3, device=device)
    ids[..., 1] = torch.arange(height, device=device)[:, None]
    ids[..., 2] = torch.arange(width, device=device)[None, :]
    return ids.reshape(1, height * width, 3).expand(batch_size, -1, -1).contiguous()


def text_ids(length: int, batch_size: int = 1, device=None) -> Tensor:
    """Position ids of the T5 tokens: all zero (BFL gives text no position; RoPE is then the identity)."""
    return torch.zeros(batch_size, length, 3, device=device)


def joint_attention_mask(txt_attention_mask: Tensor | None, n_img: int) -> Tensor | None:
    """The boolean key mask of the joint [text, image] sequence, (B, 1, 1, L): padded T5 tokens
    (mask 0) are never attended to; image tokens always are."""
    if txt_attention_mask is None:
        return None
    m = txt_attention_mask.to(torch.bool)
    m = torch.cat([m, torch.ones(m.shape[0], n_img, dtype=torch.bool, device=m.device)], dim=1)
    return m[:, None, None, :]


# --- math ------------------------------------------------------------------------------------

def rope(pos: Tensor, dim: int, theta: int) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles pos * theta^(-2i/dim), i < dim/2, computed in float64
    (as BFL) and returned in float32: each (..., L, dim/2)."""
    scale = torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim
    omega = 1.0 / (theta ** scale)
    angles = pos.to(torch.float64)[..., None] * omega
    return torch.cos(angles).float(), torch.sin(angles).float()


class EmbedND(nn.Module):
    """RoPE over several id axes: the head dim is split into ``axes_dim`` parts, part i rotated by
    id axis i."""

    def __init__(self, dim: int, theta: int, axes_dim: tuple[int, ...]):
        super().__init__()
        self.dim = dim
        self.theta = theta
        self.axes_dim = tuple(axes_dim)

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        parts = [rope(ids[..., i], d, self.theta) for i, d in enumerate(self.axes_dim)]
        cos = torch.cat([c for c, _ in parts], dim=-1)
        sin = torch.cat([s for _, s in parts], dim=-1)
        return cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, L, head_dim/2): broadcast over heads


def apply_rope(x: Tensor, pe: tuple[Tensor, Tensor]) -> Tensor:
    """Rotate the (even, odd) element pairs of the last dim of x (B, H, L, D) by the angles of pe."""
    cos, sin = pe
    xf = x.float().reshape(*x.shape[:-1], -1, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack([cos * x0 - sin * x1, sin * x0 + cos * x1], dim=-1)
    return out.reshape(x.shape).type_as(x)


def attention(q: Tensor, k: Tensor, v: Tensor, pe: tuple[Tensor, Tensor], attn_mask: Tensor | None = None) -> Tensor:
    q, k = apply_rope(q, pe), apply_rope(k, pe)
    x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


def timestep_embedding(t: Tensor, dim: int, max_period: int = 10000, time_factor: float = 1000.0) -> Tensor:
    """Sinusoidal embedding [cos, sin] of time_factor * t (t in [0, 1], or the guidance scale)."""
    t = time_factor * t
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb.to(t) if torch.is_floating_point(t) else emb


def _split_heads(qkv: Tensor, num_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    # (B, L, 3*H*D) -> three (B, H, L, D), the fused projection's order being (q, k, v) x heads x dim
    b, n, _ = qkv.shape
    x = qkv.reshape(b, n, 3, num_heads, -1).permute(2, 0, 3, 1, 4)
    return x[0], x[1], x[2]


# --- layers ----------------------------------------------------------------------------------

class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, hidden_dim: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden_dim, bias=True)
        self.silu = nn.SiLU()
        self.out_layer = nn.Linear(hidden_dim, hidden_dim, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_layer(self.silu(self.in_layer(x)))


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        rrms = torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + 1e-6)
        return (xf * rrms * self.scale.float()).to(x.dtype)


class QKNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.query_norm = RMSNorm(dim)
        self.key_norm = RMSNorm(dim)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.query_norm(q).to(v), self.key_norm(k).to(v)


class SelfAttention(nn.Module):
    """The parameters of one stream's attention (qkv, q/k RMS norms, output projection); the
    double block runs the joint attention itself."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.norm = QKNorm(dim // num_heads)
        self.proj = nn.Linear(dim, dim)


class Modulation(nn.Module):
    """adaLN modulation from the conditioning vector: (shift, scale, gate) once, or twice for a
    double block (attention, then MLP)."""

    def __init__(self, dim: int, double: bool):
        super().__init__()
        self.multiplier = 6 if double else 3
        self.lin = nn.Linear(dim, self.multiplier * dim, bias=True)

    def forward(self, vec: Tensor) -> list[Tensor]:
        return list(self.lin(F.silu(vec))[:, None, :].chunk(self.multiplier, dim=-1))


def _mlp(hidden: int, mlp_hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(hidden, mlp_hidden, bias=True), nn.GELU(approximate="tanh"),
                         nn.Linear(mlp_hidden, hidden, bias=True))


class DoubleStreamBlock(nn.Module):
    """Image and text streams with their own weights, one joint attention over [text, image]."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, qkv_bias: bool):
        super().__init__()
        mlp_hidden = int(hidden_size * mlp_ratio)
        self.num_heads = num_heads
        self.img_mod = Modulation(hidden_size, double=True)
        self.img_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_attn = SelfAttention(hidden_size, num_heads, qkv_bias)
        self.img_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_mlp = _mlp(hidden_size, mlp_hidden)
        self.txt_mod = Modulation(hidden_size, double=True)
        self.txt_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_attn = SelfAttention(hidden_size, num_heads, qkv_bias)
        self.txt_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_mlp = _mlp(hidden_size, mlp_hidden)

    def _qkv(self, x: Tensor, norm: nn.LayerNorm, shift: Tensor, scale: Tensor, attn: SelfAttention):
        q, k, v = _split_heads(attn.qkv((1 + scale) * norm(x) + shift), self.num_heads)
        q, k = attn.norm(q, k, v)
        return q, k, v

    def forward(self, img: Tensor, txt: Tensor, vec: Tensor, pe: tuple[Tensor, Tensor],
                attn_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return self.modulated(img, txt, self.img_mod(vec), self.txt_mod(vec), pe, attn_mask)

    def modulated(self, img: Tensor, txt: Tensor, img_mod: list[Tensor], txt_mod: list[Tensor],
                  pe: tuple[Tensor, Tensor], attn_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The block given its modulations (shift, scale, gate of the attention, then of the MLP,
        each (B, 1, hidden), per stream): FLUX.1's from ``img_mod`` / ``txt_mod``, Chroma's from
        its approximator."""
        i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = img_mod
        t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = txt_mod
        img_q, img_k, img_v = self._qkv(img, self.img_norm1, i_shift1, i_scale1, self.img_attn)
        txt_q, txt_k, txt_v = self._qkv(txt, self.txt_norm1, t_shift1, t_scale1, self.txt_attn)
        attn = attention(torch.cat((txt_q, img_q), dim=2), torch.cat((txt_k, img_k), dim=2),
                         torch.cat((txt_v, img_v), dim=2), pe, attn_mask)
        n_txt = txt.shape[1]
        txt_attn, img_attn = attn[:, :n_txt], attn[:, n_txt:]
        img = img + i_gate1 * self.img_attn.proj(img_attn)
        img = img + i_gate2 * self.img_mlp((1 + i_scale2) * self.img_norm2(img) + i_shift2)
        txt = txt + t_gate1 * self.txt_attn.proj(txt_attn)
        txt = txt + t_gate2 * self.txt_mlp((1 + t_scale2) * self.txt_norm2(txt) + t_shift2)
        return img, txt


class SingleStreamBlock(nn.Module):
    """One stream over [text, image]: attention and MLP in parallel from one fused input
    projection (linear1 = q, k, v, MLP in), one fused output projection (linear2)."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.linear1 = nn.Linear(hidden_size, hidden_size * 3 + self.mlp_hidden_dim)
        self.linear2 = nn.Linear(hidden_size + self.mlp_hidden_dim, hidden_size)
        self.norm = QKNorm(hidden_size // num_heads)
        self.pre_norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp_act = nn.GELU(approximate="tanh")
        self.modulation = Modulation(hidden_size, double=False)

    def forward(self, x: Tensor, vec: Tensor, pe: tuple[Tensor, Tensor], attn_mask: Tensor | None = None) -> Tensor:
        return self.modulated(x, self.modulation(vec), pe, attn_mask)

    def modulated(self, x: Tensor, mod: list[Tensor], pe: tuple[Tensor, Tensor],
                  attn_mask: Tensor | None = None) -> Tensor:
        """The block given its modulation (shift, scale, gate, each (B, 1, hidden))."""
        shift, scale, gate = mod
        qkv, mlp = torch.split(self.linear1((1 + scale) * self.pre_norm(x) + shift),
                               [3 * self.hidden_size, self.mlp_hidden_dim], dim=-1)
        q, k, v = _split_heads(qkv, self.num_heads)
        q, k = self.norm(q, k, v)
        attn = attention(q, k, v, pe, attn_mask)
        return x + gate * self.linear2(torch.cat((attn, self.mlp_act(mlp)), dim=2))


class LastLayer(nn.Module):
    def __init__(self, hidden_size: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x: Tensor, vec: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=1)  # BFL order: shift first
        return self.modulated(x, shift[:, None, :], scale[:, None, :])

    def modulated(self, x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        """The output projection given its modulation (shift, scale, each (B, 1, hidden))."""
        return self.linear((1 + scale) * self.norm_final(x) + shift)


class Flux(block_checkpoint.CheckpointedBlocks, nn.Module):
    """The FLUX.1 flow-matching transformer; forward returns the velocity prediction per packed
    image token."""

    def __init__(self, config: FluxConfig):
        super().__init__()
        config.check()
        self.config = config
        h = config.hidden_size
        self.pe_embedder = EmbedND(config.head_dim, config.theta, config.axes_dim)
        self.img_in = nn.Linear(config.in_channels, h, bias=True)
        self.time_in = MLPEmbedder(TIME_EMBED_DIM, h)
        self.vector_in = MLPEmbedder(config.vec_in_dim, h)
        if config.guidance_embed:
            self.guidance_in = MLPEmbedder(TIME_EMBED_DIM, h)
        self.txt_in = nn.Linear(config.context_in_dim, h)
        self.double_blocks = nn.ModuleList(
            [DoubleStreamBlock(h, config.num_heads, config.mlp_ratio, config.qkv_bias) for _ in range(config.depth)])
        self.single_blocks = nn.ModuleList(
            [SingleStreamBlock(h, config.num_heads, config.mlp_ratio) for _ in range(config.depth_single_blocks)])
        self.final_layer = LastLayer(h, config.in_channels)
        self.gradient_checkpointing = False
        # blocks_to_swap: streams host-kept blocks to the device around their use (None: off;
        # library/training/block_swap.py sets it)
        self.block_swap = None
        # cpu_offload_checkpointing: with gradient checkpointing, what each checkpoint keeps
        # (the block's inputs) is held in host memory until the backward (sd-scripts' option)
        self.cpu_offload_checkpointing = False

    def forward(self, img: Tensor, img_ids: Tensor, txt: Tensor, txt_ids: Tensor, timesteps: Tensor, y: Tensor,
                guidance: Tensor | None = None, txt_attention_mask: Tensor | None = None) -> Tensor:
        """img (B, N, in_channels) packed latents; img_ids (B, N, 3); txt (B, L, context_in_dim);
        txt_ids (B, L, 3); timesteps (B,) in [0, 1]; y (B, vec_in_dim) pooled CLIP-L; guidance (B,)
        the guidance scale (dev only); txt_attention_mask (B, L) 1 = real token, or None."""
        if img.ndim != 3 or txt.ndim != 3:
            raise ValueError("FLUX: img and txt must be (batch, tokens, features)")
        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(timesteps, TIME_EMBED_DIM))
        if self.config.guidance_embed:
            if guidance is None:
                raise ValueError("FLUX dev (guidance-distilled) needs a guidance value")
            vec = vec + self.guidance_in(timestep_embedding(guidance, TIME_EMBED_DIM))
        vec = vec + self.vector_in(y)
        txt = self.txt_in(txt)
        pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))
        mask = joint_attention_mask(txt_attention_mask, img.shape[1])
        for block in self.double_blocks:
            img, txt = self._run(block, img, txt, vec, pe, mask)
        n_txt = txt.shape[1]
        x = torch.cat((txt, img), dim=1)
        for block in self.single_blocks:
            x = self._run(block, x, vec, pe, mask)
        return self.final_layer(x[:, n_txt:], vec)
