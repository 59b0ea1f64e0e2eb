"""The Lumina Image 2.0 transformer (Next-DiT) in the original module layout.

Module names are those of Alpha-VLLM's Lumina-Image-2.0 and sd-scripts' ``lumina_models.NextDiT``
(``lumina-image-2.safetensors``, ComfyUI's ``lumina_2_model_bf16.safetensors`` with the
``model.diffusion_model.`` prefix): ``x_embedder``, ``t_embedder.mlp.{0,2}``, ``cap_embedder.{0,1}``,
``{context_refiner,noise_refiner,layers}.N.{attention.{qkv,out,q_norm,k_norm},feed_forward.{w1,w2,w3},
attention_norm{1,2},ffn_norm{1,2},adaLN_modulation.1}`` (no modulation in the context refiner),
``norm_final`` (unused, kept for the layout) and ``final_layer.{linear,adaLN_modulation.1}``.

Inputs as sd-scripts' ``NextDiT.forward``: latents (B, C, H, W), ``t`` (B,) in [0, 1] where 1 is the
clean image (Lumina's time runs opposite to sigma: t = 1 - sigma), the Gemma-2 states (B, L, D) and
their token mask (B, L). Output: the velocity d x / d t = x0 - noise, (B, C, H, W).

Each caption keeps only its masked-in tokens: the joint sequence of sample i is its own caption
tokens, then the image tokens, zero-padded to the batch's longest (as sd-scripts and diffusers).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from library.models import block_checkpoint

TIME_FREQ_DIM = 256  # the sinusoidal timestep embedding's width
ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class NextDiTConfig:
    """The transformer's shape (sd-scripts' LuminaParams, with the feed-forward width explicit)."""
    patch_size: int = 2
    in_channels: int = 16
    dim: int = 2304
    n_layers: int = 26
    n_refiner_layers: int = 2
    n_heads: int = 24
    n_kv_heads: int = 8
    ffn_hidden: int = 9216  # 256 * ceil(4 * dim / 256) (multiple_of 256, no ffn_dim_multiplier)
    norm_eps: float = 1e-5
    qk_norm: bool = True
    cap_feat_dim: int = 2304  # Gemma-2 2B's hidden width
    axes_dims: tuple[int, ...] = (32, 32, 32)
    axes_lens: tuple[int, ...] = (300, 512, 512)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def t_dim(self) -> int:
        return min(self.dim, 1024)

    def check(self) -> None:
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"Lumina config: dim {self.dim}, n_heads {self.n_heads} and n_kv_heads "
                             f"{self.n_kv_heads} must divide evenly")
        if sum(self.axes_dims) != self.head_dim or any(d % 2 for d in self.axes_dims):
            raise ValueError(f"Lumina config: axes_dims {list(self.axes_dims)} must be even and sum to the head "
                             f"dim {self.head_dim}")


LUMINA2_2B = NextDiTConfig()  # NextDiT_2B_GQA_patch2_Adaln_Refiner
# tiny-lumina: the real topology (refiners, GQA, qk norm, three RoPE axes) at small widths; the
# caption width is the tiny Gemma-2's
TINY = NextDiTConfig(dim=64, n_layers=2, n_refiner_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=256,
                     cap_feat_dim=32, axes_dims=(4, 6, 6), axes_lens=(300, 64, 64))


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 at least (sd-scripts' RMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(_at_least_float32(x.dtype))
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(xf.dtype)).to(x.dtype)


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def timestep_embedding(t: Tensor, dim: int = TIME_FREQ_DIM, max_period: float = 10_000.0) -> Tensor:
    """[cos(t f_k), sin(t f_k)], f_k = max_period^(-k / (dim/2)) (t unscaled, in [0, 1])."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope_tables(axes_dims, axes_lens, theta: float = ROPE_THETA) -> list[Tensor]:
    """Per axis, (len, dim/2) complex64 e^(i p theta^(-2k/dim)) for positions p < len (computed in
    float64)."""
    tables = []
    for d, n in zip(axes_dims, axes_lens):
        freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d)
        angles = torch.outer(torch.arange(n, dtype=torch.float64, device="cpu"), freqs)
        tables.append(torch.polar(torch.ones_like(angles), angles).to(torch.complex64))
    return tables


def apply_rope(x: Tensor, freqs: Tensor) -> Tensor:
    """x (B, L, H, D): consecutive feature pairs as complex numbers times freqs (B, L, D/2)."""
    xc = torch.view_as_complex(x.to(_at_least_float32(x.dtype)).reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs.unsqueeze(2)).flatten(3).to(x.dtype)


def modulate(x: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale.unsqueeze(1))


class Attention(nn.Module):
    """Grouped-query self-attention with a fused qkv projection, per-head RMS norms on q and k,
    RoPE, and a key mask. ``kernel``: library/models/families/lumina/attention.py's choice."""

    def __init__(self, c: NextDiTConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.qkv = nn.Linear(c.dim, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, bias=False)
        self.out = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        self.q_norm = RMSNorm(c.head_dim) if c.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(c.head_dim) if c.qk_norm else nn.Identity()
        self.kernel = None  # None: torch's scaled_dot_product_attention

    def forward(self, x: Tensor, mask: Tensor | None, freqs: Tensor) -> Tensor:
        b, n, _ = x.shape
        hd, kv = self.head_dim, self.n_kv_heads
        q, k, v = self.qkv(x).split([self.n_heads * hd, kv * hd, kv * hd], dim=-1)
        q = apply_rope(self.q_norm(q.view(b, n, self.n_heads, hd)), freqs)
        k = apply_rope(self.k_norm(k.view(b, n, kv, hd)), freqs)
        v = v.view(b, n, kv, hd)
        rep = self.n_heads // kv
        if rep > 1:  # key/value head j serves query heads j*rep .. j*rep + rep - 1
            k, v = (t.unsqueeze(3).expand(b, n, kv, rep, hd).reshape(b, n, self.n_heads, hd) for t in (k, v))
        scale = hd ** -0.5
        if self.kernel is not None:
            out = self.kernel(q, k, v, mask, scale)
        else:
            attn_mask = None if mask is None else mask.bool().view(b, 1, 1, n)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=attn_mask, scale=scale).transpose(1, 2)
        return self.out(out.reshape(b, n, self.n_heads * hd).to(x.dtype))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class JointTransformerBlock(nn.Module):
    """Pre- and post-normed attention and SwiGLU feed-forward; with ``modulation`` the timestep
    embedding scales the pre-norms and tanh-gates both residual branches."""

    def __init__(self, c: NextDiTConfig, modulation: bool):
        super().__init__()
        self.attention = Attention(c)
        self.feed_forward = FeedForward(c.dim, c.ffn_hidden)
        self.attention_norm1 = RMSNorm(c.dim, c.norm_eps)
        self.ffn_norm1 = RMSNorm(c.dim, c.norm_eps)
        self.attention_norm2 = RMSNorm(c.dim, c.norm_eps)
        self.ffn_norm2 = RMSNorm(c.dim, c.norm_eps)
        self.modulation = modulation
        if modulation:
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(c.t_dim, 4 * c.dim, bias=True))

    def forward(self, x: Tensor, mask: Tensor | None, freqs: Tensor, temb: Tensor | None = None) -> Tensor:
        if not self.modulation:
            x = x + self.attention_norm2(self.attention(self.attention_norm1(x), mask, freqs))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        scale_msa, gate_msa, scale_mlp, gate_mlp = self.adaLN_modulation(temb).chunk(4, dim=1)
        x = x + gate_msa.unsqueeze(1).tanh() * self.attention_norm2(
            self.attention(modulate(self.attention_norm1(x), scale_msa), mask, freqs))
        return x + gate_mlp.unsqueeze(1).tanh() * self.ffn_norm2(
            self.feed_forward(modulate(self.ffn_norm1(x), scale_mlp)))


class TimestepEmbedder(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(TIME_FREQ_DIM, dim, bias=True), nn.SiLU(), nn.Linear(dim, dim, bias=True))

    def forward(self, t: Tensor) -> Tensor:
        return self.mlp(timestep_embedding(t).to(self.mlp[0].weight.dtype))


class FinalLayer(nn.Module):
    def __init__(self, c: NextDiTConfig):
        super().__init__()
        self.norm_final = nn.LayerNorm(c.dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(c.dim, c.patch_size ** 2 * c.in_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(c.t_dim, c.dim, bias=True))

    def forward(self, x: Tensor, temb: Tensor) -> Tensor:
        return self.linear(modulate(self.norm_final(x), self.adaLN_modulation(temb)))


class NextDiT(block_checkpoint.CheckpointedBlocks, nn.Module):
    def __init__(self, config: NextDiTConfig):
        super().__init__()
        config.check()
        self.config = config
        c = config
        self.x_embedder = nn.Linear(c.patch_size ** 2 * c.in_channels, c.dim, bias=True)
        self.t_embedder = TimestepEmbedder(c.t_dim)
        self.cap_embedder = nn.Sequential(RMSNorm(c.cap_feat_dim, c.norm_eps), nn.Linear(c.cap_feat_dim, c.dim, bias=True))
        self.context_refiner = nn.ModuleList(JointTransformerBlock(c, False) for _ in range(c.n_refiner_layers))
        self.noise_refiner = nn.ModuleList(JointTransformerBlock(c, True) for _ in range(c.n_refiner_layers))
        self.layers = nn.ModuleList(JointTransformerBlock(c, True) for _ in range(c.n_layers))
        self.norm_final = RMSNorm(c.dim, c.norm_eps)  # in the released weights, never used
        self.final_layer = FinalLayer(c)
        self._rope = rope_tables(c.axes_dims, c.axes_lens)
        self.gradient_checkpointing = False
        self.cpu_offload_checkpointing = False
        self.block_swap = None  # library/training/block_swap.py's streamer, or None

    @property
    def dtype(self) -> torch.dtype:
        return self.x_embedder.weight.dtype

    def swap_block_lists(self) -> list:
        """What blocks_to_swap swaps (library/training/block_swap.py): the joint layers; the refiners
        stay on the device (sd-scripts' Lumina trainer has no block swap)."""
        return [self.layers]

    def _freqs(self, ids: Tensor) -> Tensor:
        """(B, L, 3) integer positions -> (B, L, head_dim/2) complex rotations."""
        parts = [table.to(ids.device)[ids[..., i].long()] for i, table in enumerate(self._rope)]
        return torch.cat(parts, dim=-1)

    def forward(self, x: Tensor, t: Tensor, cap_feats: Tensor, cap_mask: Tensor,
                cap_lens: list[int] | None = None) -> Tensor:
        """``cap_lens``: each caption's token count where the caller knows it without reading
        ``cap_mask`` (the memory estimate's fake tensors hold no values); None: from the mask."""
        b, ch, h, w = x.shape
        c, p = self.config, self.config.patch_size
        if h % p or w % p:
            raise ValueError(f"Lumina: latent size {h}x{w} is not a multiple of the patch size {p}")
        gh, gw = h // p, w // p
        n_img, n_cap, dev = gh * gw, cap_feats.shape[1], x.device
        temb = self.t_embedder(t)
        cap = self.cap_embedder(cap_feats)
        if cap_lens is None:
            cap_lens = [int(n) for n in cap_mask.sum(dim=1).tolist()]
        lengths = [n + n_img for n in cap_lens]
        longest = max(lengths)

        # positions: caption token k -> (k, 0, 0); image patch (r, q) -> (caption length, r, q)
        ids = torch.zeros(b, longest, 3, dtype=torch.long, device=dev)
        rows = torch.arange(gh, device=dev).repeat_interleave(gw)
        cols = torch.arange(gw, device=dev).repeat(gh)
        for i, n in enumerate(cap_lens):
            ids[i, :n, 0] = torch.arange(n, device=dev)
            ids[i, n:n + n_img, 0] = n
            ids[i, n:n + n_img, 1] = rows
            ids[i, n:n + n_img, 2] = cols
        freqs = self._freqs(ids)
        cap_freqs = torch.zeros(b, n_cap, freqs.shape[-1], dtype=freqs.dtype, device=dev)
        img_freqs = torch.zeros(b, n_img, freqs.shape[-1], dtype=freqs.dtype, device=dev)
        for i, n in enumerate(cap_lens):
            cap_freqs[i, :n] = freqs[i, :n]
            img_freqs[i] = freqs[i, n:n + n_img]

        # the refiners stay on the device under blocks_to_swap (it swaps the joint layers)
        for block in self.context_refiner:
            cap = self._call(block, cap, cap_mask, cap_freqs)
        img = x.view(b, ch, gh, p, gw, p).permute(0, 2, 4, 3, 5, 1).reshape(b, n_img, p * p * ch)
        img = self.x_embedder(img)
        for block in self.noise_refiner:
            img = self._call(block, img, None, img_freqs, temb)

        joint = img.new_zeros(b, longest, c.dim)
        mask = torch.zeros(b, longest, dtype=torch.bool, device=dev)
        for i, n in enumerate(cap_lens):
            mask[i, :n + n_img] = True
            joint[i, :n] = cap[i, :n].to(joint.dtype)
            joint[i, n:n + n_img] = img[i]
        joint_mask = None if len(set(lengths)) == 1 else mask
        for block in self.layers:
            joint = self._run(block, joint, joint_mask, freqs, temb)
        out = self.final_layer(joint, temb)
        img_out = torch.stack([out[i, n:n + n_img] for i, n in enumerate(cap_lens)])
        return img_out.view(b, gh, gw, p, p, ch).permute(0, 5, 1, 3, 2, 4).reshape(b, ch, h, w)
