"""Anima's transformer: the MiniTrainDiT of NVIDIA's Cosmos-Predict2 (sd-scripts: ``Anima`` in
its anima_models.py) with the LLM adapter that maps Qwen3-0.6B's states into the T5-compatible
cross-attention space.

Module names are those of the released single file (and sd-scripts' loader, after it strips
``net.``), so ``state_dict()`` keys are the file's: ``x_embedder.proj.1`` (the 2x2 patch Linear over
16 latent + 1 padding-mask channels), ``t_embedder.1.linear_{1,2}`` (AdaLN-LoRA: linear_2 gives the
3D-wide shared modulation), ``t_embedding_norm``, ``blocks.N.{self_attn,cross_attn}.{q,k,v,output}_proj``
with ``q_norm`` / ``k_norm`` (RMSNorm per head), ``blocks.N.mlp.layer{1,2}``,
``blocks.N.adaln_modulation_{self_attn,cross_attn,mlp}.{1,2}``, ``final_layer.{adaln_modulation.{1,2},
linear}``, ``pos_embedder.{seq,dim_spatial_range,dim_temporal_range}`` (RoPE tables, rebuilt from the
config) and ``llm_adapter.*``. The classes keep sd-scripts' names (``Block``, ``PatchEmbed``,
``TimestepEmbedding``, ``FinalLayer``, ``LLMAdapterTransformerBlock``): networks.lora_anima and
LyCORIS pick their layers by class name.

The forward takes images (B, 16, H, W) or (B, 16, 1, H, W), the noise level sigma (B,) itself
(sd-scripts passes sigma, not 1000 sigma), and either the adapter's output or Qwen3's states
with the T5 token ids (then the adapter runs inside the forward, as sd-scripts does for DDP).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from library.errors import ModelError
from library.models import block_checkpoint
from library.models.families.anima import attention

PREFIX = "net."  # the DiT's keys in the released file (ComfyUI's layout); sd-scripts strips it
LATENT_CHANNELS = 16
ROPE_BUFFERS = ("pos_embedder.seq", "pos_embedder.dim_spatial_range", "pos_embedder.dim_temporal_range")


class AnimaModelError(ModelError):
    """Anima weights that do not form a model; one line naming the file and key."""


@dataclass(frozen=True)
class AdapterConfig:
    """The LLM adapter: T5 token embeddings (vocab x target_dim) cross-attending to Qwen3's states."""
    source_dim: int = 1024    # Qwen3-0.6B's hidden size
    target_dim: int = 1024    # the T5-compatible width the DiT cross-attends to
    model_dim: int = 1024
    num_layers: int = 6
    num_heads: int = 16
    vocab_size: int = 32128   # T5's
    mlp_ratio: float = 4.0


@dataclass(frozen=True)
class AnimaConfig:
    model_channels: int = 2048
    num_blocks: int = 28
    num_heads: int = 16
    crossattn_dim: int = 1024
    adaln_lora_dim: int = 256
    mlp_hidden: int = 8192
    in_channels: int = LATENT_CHANNELS
    out_channels: int = LATENT_CHANNELS
    patch_spatial: int = 2
    # sd-scripts' fixed Anima values: max 512 x 512 latent positions, 128 frames, RoPE NTK
    # extrapolation 4 (h, w) and 1 (t), no fps modulation, the padding mask as an input channel
    max_img: int = 512
    max_frames: int = 128
    rope_ratios: tuple[float, float, float] = (1.0, 4.0, 4.0)  # t, h, w
    adapter: AdapterConfig | None = field(default_factory=AdapterConfig)

    @property
    def head_dim(self) -> int:
        return self.model_channels // self.num_heads


FULL = AnimaConfig()
# Tiny: the real topology at small widths (head 32 keeps RoPE's t/h/w split 12/10/10 non-degenerate).
TINY_ADAPTER = AdapterConfig(source_dim=32, target_dim=32, model_dim=32, num_layers=2, num_heads=2, vocab_size=64)
TINY = AnimaConfig(model_channels=64, num_blocks=2, num_heads=2, crossattn_dim=32, adaln_lora_dim=16,
                   mlp_hidden=256, adapter=TINY_ADAPTER)


# --- RoPE and norms --------------------------------------------------------------------------

def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistic in float32 (sd-scripts' DiT norm; eps 1e-6 where used).
    Not sd3.RMSNorm: that one multiplies in the input's dtype, sd-scripts' Anima norm by the weight
    as it is (a float32 weight keeps a bf16 input's product in float32)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class VideoRopePosition3DEmb(nn.Module):
    """3-D RoPE angles over (t, h, w): a head splits into t / h / w parts (h = w = head//6*2), each
    with NTK-scaled theta 10000 * ratio^(d/(d-2)); angles laid out [t, h, w] twice (rotate-half)."""

    def __init__(self, head_dim: int, len_h: int, len_w: int, len_t: int, ratios: tuple[float, float, float]):
        super().__init__()
        dim_h = head_dim // 6 * 2
        dim_t = head_dim - 2 * dim_h
        if dim_h <= 2 or dim_t <= 2:
            raise AnimaModelError(f"Anima's head width {head_dim} is too narrow for its 3-D RoPE")
        self.register_buffer("seq", torch.arange(max(len_h, len_w, len_t), dtype=torch.float))
        self.register_buffer("dim_spatial_range", torch.arange(0, dim_h, 2)[: dim_h // 2].float() / dim_h)
        self.register_buffer("dim_temporal_range", torch.arange(0, dim_t, 2)[: dim_t // 2].float() / dim_t)
        rt, rh, rw = ratios
        self.thetas = (10000.0 * rt ** (dim_t / (dim_t - 2)), 10000.0 * rh ** (dim_h / (dim_h - 2)),
                       10000.0 * rw ** (dim_h / (dim_h - 2)))

    def forward(self, t: int, h: int, w: int, device) -> torch.Tensor:
        """(t*h*w, head_dim) angles, float32."""
        seq = torch.arange(max(t, h, w), dtype=torch.float32, device=device)
        sp = self.dim_spatial_range.to(device, torch.float32)
        tf = 1.0 / (self.thetas[0] ** self.dim_temporal_range.to(device, torch.float32))
        hf, wf = 1.0 / (self.thetas[1] ** sp), 1.0 / (self.thetas[2] ** sp)
        et = torch.outer(seq[:t], tf)[:, None, None, :].expand(t, h, w, -1)
        eh = torch.outer(seq[:h], hf)[None, :, None, :].expand(t, h, w, -1)
        ew = torch.outer(seq[:w], wf)[None, None, :, :].expand(t, h, w, -1)
        return torch.cat([et, eh, ew] * 2, dim=-1).reshape(t * h * w, -1)


def rope_tables(cfg: "AnimaConfig") -> dict[str, torch.Tensor]:
    """The RoPE buffers as the model registers them (``pos_embedder.*``), on the CPU."""
    n = cfg.max_img // cfg.patch_spatial
    emb = VideoRopePosition3DEmb(cfg.head_dim, n, n, cfg.max_frames, cfg.rope_ratios)
    return {"pos_embedder." + k: v for k, v in emb.state_dict().items()}


def _attention(q, k, v, mask=None):
    """q, k, v (B, heads, L, D) -> (B, heads, Lq, D); a boolean key mask (B, 1, 1, Lk), True = attend;
    a query whose keys are all masked gets zeros (SDPA would return NaN)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    empty = ~mask.any(dim=-1, keepdim=True)  # (B, 1, 1, 1)
    return torch.where(empty, torch.zeros((), dtype=out.dtype, device=out.device), out)


# --- the DiT --------------------------------------------------------------------------------

def _projections(m: nn.Module, query_dim: int, context_dim: int, n_heads: int, head_dim: int, norm, out: str):
    """q / k / v projections without bias, per-head q / k norms, and the output projection named
    ``out`` (the DiT's ``output_proj``, the adapter's ``o_proj``)."""
    inner = n_heads * head_dim
    m.n_heads, m.head_dim = n_heads, head_dim
    m.q_proj = nn.Linear(query_dim, inner, bias=False)
    m.q_norm = norm(head_dim)
    m.k_proj = nn.Linear(context_dim, inner, bias=False)
    m.k_norm = norm(head_dim)
    m.v_proj = nn.Linear(context_dim, inner, bias=False)
    setattr(m, out, nn.Linear(inner, query_dim, bias=False))


class Attention(nn.Module):
    """Self- (context None, RoPE) or cross-attention with per-head RMS q/k norms, no biases."""

    def __init__(self, query_dim: int, context_dim: int | None, n_heads: int, head_dim: int):
        super().__init__()
        self.is_selfattn = context_dim is None
        self.kernel: str | None = None  # attn_mode's kernel, split_attn (attention.configure)
        self.split = False
        _projections(self, query_dim, query_dim if context_dim is None else context_dim, n_heads, head_dim,
                     RMSNorm, "output_proj")

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        ctx = x if context is None else context
        b = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(b, -1, self.n_heads, self.head_dim))
        k = self.k_norm(self.k_proj(ctx).view(b, -1, self.n_heads, self.head_dim))
        v = self.v_proj(ctx).view(b, -1, self.n_heads, self.head_dim)
        if self.is_selfattn and rope is not None:
            cos, sin = (r[None, :, None, :].to(q.dtype) for r in rope)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        out = attention.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.kernel, self.split)
        return self.output_proj(out.transpose(1, 2).reshape(b, -1, self.n_heads * self.head_dim))


class GPT2FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.layer1 = nn.Linear(dim, hidden, bias=False)
        self.activation = nn.GELU()
        self.layer2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.layer2(self.activation(self.layer1(x)))


def _modulation(dim: int, lora_dim: int, chunks: int) -> nn.Sequential:
    return nn.Sequential(nn.SiLU(), nn.Linear(dim, lora_dim, bias=False), nn.Linear(lora_dim, chunks * dim, bias=False))


class Block(nn.Module):
    """x += gate * sublayer(LN(x) * (1 + scale) + shift) for self-attention, cross-attention and
    the MLP; each (shift, scale, gate) = adaln_modulation(emb) + the shared AdaLN-LoRA term."""

    def __init__(self, cfg: AnimaConfig):
        super().__init__()
        d = cfg.model_channels
        self.layer_norm_self_attn = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.self_attn = Attention(d, None, cfg.num_heads, cfg.head_dim)
        self.layer_norm_cross_attn = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.cross_attn = Attention(d, cfg.crossattn_dim, cfg.num_heads, cfg.head_dim)
        self.layer_norm_mlp = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.mlp = GPT2FeedForward(d, cfg.mlp_hidden)
        self.adaln_modulation_self_attn = _modulation(d, cfg.adaln_lora_dim, 3)
        self.adaln_modulation_cross_attn = _modulation(d, cfg.adaln_lora_dim, 3)
        self.adaln_modulation_mlp = _modulation(d, cfg.adaln_lora_dim, 3)

    def forward(self, x, emb, adaln_lora, context, rope):
        for norm, mod, kind in ((self.layer_norm_self_attn, self.adaln_modulation_self_attn, "self"),
                                (self.layer_norm_cross_attn, self.adaln_modulation_cross_attn, "cross"),
                                (self.layer_norm_mlp, self.adaln_modulation_mlp, "mlp")):
            shift, scale, gate = (mod(emb) + adaln_lora).chunk(3, dim=-1)
            h = norm(x) * (1 + scale) + shift
            if kind == "self":
                h = self.self_attn(h, None, rope)
            elif kind == "cross":
                h = self.cross_attn(h, context)
            else:
                h = self.mlp(h)
            x = x + gate * h
        return x


class PatchEmbed(nn.Module):
    """(B, C, 1, H, W) -> (B, H/p * W/p, D): each p x p patch's (c, m, n) values, then ``proj.1``."""

    def __init__(self, patch: int, in_channels: int, dim: int):
        super().__init__()
        self.patch = patch
        self.proj = nn.Sequential(nn.Identity(), nn.Linear(in_channels * patch * patch, dim, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        p = self.patch
        x = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), c * p * p)
        return self.proj(x)


class Timesteps(nn.Module):
    """[cos, sin] of t * exp(-ln(10000) i / (D/2)), computed in float32 (float64 for a float64 t) and
    returned in t's dtype (sd-scripts' Timesteps returns its input's dtype)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.dim // 2
        dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=dtype, device=t.device) / half)
        args = t.to(dtype)[:, None] * freqs[None]
        out = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return out.to(t.dtype) if t.is_floating_point() else out


class TimestepEmbedding(nn.Module):
    """AdaLN-LoRA: returns (the sinusoidal features themselves, linear_2(silu(linear_1)) 3D wide)."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(dim, dim, bias=False)
        self.activation = nn.SiLU()
        self.linear_2 = nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, sample):
        return sample, self.linear_2(self.activation(self.linear_1(sample)))


class FinalLayer(nn.Module):
    def __init__(self, cfg: AnimaConfig):
        super().__init__()
        d = cfg.model_channels
        self.layer_norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(d, cfg.patch_spatial ** 2 * cfg.out_channels, bias=False)
        self.adaln_modulation = _modulation(d, cfg.adaln_lora_dim, 2)
        self.d = d

    def forward(self, x, emb, adaln_lora):
        shift, scale = (self.adaln_modulation(emb) + adaln_lora[..., : 2 * self.d]).chunk(2, dim=-1)
        return self.linear(self.layer_norm(x) * (1 + scale) + shift)


class Anima(block_checkpoint.CheckpointedBlocks, nn.Module):
    """The MiniTrainDiT (with its LLM adapter when the config has one). Its ``blocks`` run through
    ``_run``: gradient checkpointing and blocks_to_swap (library/training/block_swap.py, which asks
    ``swap_block_lists`` and ``swap_block_limit``)."""

    def __init__(self, cfg: AnimaConfig):
        super().__init__()
        self.config = cfg
        if cfg.model_channels % cfg.num_heads:
            raise AnimaModelError(f"Anima: width {cfg.model_channels} is not a multiple of {cfg.num_heads} heads")
        self.x_embedder = PatchEmbed(cfg.patch_spatial, cfg.in_channels + 1, cfg.model_channels)
        n = cfg.max_img // cfg.patch_spatial
        self.pos_embedder = VideoRopePosition3DEmb(cfg.head_dim, n, n, cfg.max_frames, cfg.rope_ratios)
        self.t_embedder = nn.Sequential(Timesteps(cfg.model_channels), TimestepEmbedding(cfg.model_channels))
        if cfg.adapter is not None:
            self.llm_adapter = LLMAdapter(cfg.adapter)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_blocks))
        self.final_layer = FinalLayer(cfg)
        self.t_embedding_norm = RMSNorm(cfg.model_channels)
        self.gradient_checkpointing = False
        self.cpu_offload_checkpointing = False
        self.block_swap = None  # library/training/block_swap.py's streamer, or None

    def swap_block_lists(self) -> list:
        """What blocks_to_swap swaps: the DiT's blocks (the LLM adapter stays on the device)."""
        return [self.blocks]

    def swap_block_limit(self) -> int:
        """sd-scripts' Anima.enable_block_swap: at most num_blocks - 2 blocks swapped."""
        return max(len(self.blocks) - 2, 0)

    def enable_gradient_checkpointing(self, cpu_offload: bool = False):
        self.gradient_checkpointing, self.cpu_offload_checkpointing = True, cpu_offload

    def disable_gradient_checkpointing(self):
        self.gradient_checkpointing = self.cpu_offload_checkpointing = self.unsloth_offload_checkpointing = False

    def text_context(self, qwen3_states, t5_input_ids, t5_attn_mask=None, qwen3_attn_mask=None):
        """The cross-attention context: the adapter's output, zero at T5's padding."""
        ctx = self.llm_adapter(qwen3_states, t5_input_ids, t5_attn_mask, qwen3_attn_mask)
        if t5_attn_mask is not None:
            ctx = ctx * t5_attn_mask.to(ctx.dtype).unsqueeze(-1)
        return ctx

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
                t5_input_ids: torch.Tensor | None = None, t5_attn_mask: torch.Tensor | None = None,
                source_attention_mask: torch.Tensor | None = None,
                padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, 16, H, W) or (B, 16, 1, H, W); timesteps sigma (B,); context the adapter's output
        (B, N, crossattn_dim), or Qwen3's states when t5_input_ids are given."""
        video = x.ndim == 5
        if video:
            if x.shape[2] != 1:
                raise AnimaModelError(f"Anima trains images: the latent has {x.shape[2]} frames")
            x = x[:, :, 0]
        if t5_input_ids is not None:
            context = self.text_context(context, t5_input_ids, t5_attn_mask, source_attention_mask)
        b, _, h, w = x.shape
        p = self.config.patch_spatial
        if padding_mask is None:
            padding_mask = torch.zeros(b, 1, h, w, dtype=x.dtype, device=x.device)
        hidden = self.x_embedder(torch.cat([x, padding_mask.to(x.dtype).expand(b, 1, h, w)], dim=1))
        angles = self.pos_embedder(1, h // p, w // p, x.device)
        rope = (torch.cos(angles), torch.sin(angles))
        emb, adaln_lora = self.t_embedder(timesteps.reshape(b))
        emb = self.t_embedding_norm(emb.to(hidden.dtype))
        emb, adaln_lora = emb[:, None, :], adaln_lora[:, None, :].to(hidden.dtype)
        for block in self.blocks:
            hidden = self._run(block, hidden, emb, adaln_lora, context, rope)
        out = self.final_layer(hidden, emb, adaln_lora)  # (B, L, p*p*C) as (p1 p2 C)
        c = self.config.out_channels
        out = out.reshape(b, h // p, w // p, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)
        return out[:, :, None] if video else out


# --- the LLM adapter ------------------------------------------------------------------------

class LLMAdapterRMSNorm(nn.Module):
    """T5's RMSNorm: statistic in float32, the result cast to a half weight's dtype, times weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + self.variance_epsilon)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


def _adapter_rope(head_dim: int, length: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float().to(device) / head_dim))
    freqs = torch.outer(torch.arange(length, device=device).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class LLMAdapterAttention(nn.Module):
    def __init__(self, query_dim: int, context_dim: int, n_heads: int, head_dim: int):
        super().__init__()
        _projections(self, query_dim, context_dim, n_heads, head_dim, LLMAdapterRMSNorm, "o_proj")

    def forward(self, x, mask, context, rope_q, rope_k):
        b = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(b, -1, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(context).view(b, -1, self.n_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(context).view(b, -1, self.n_heads, self.head_dim).transpose(1, 2)
        q = q * rope_q[0][None, None] + _rotate_half(q) * rope_q[1][None, None]
        k = k * rope_k[0][None, None] + _rotate_half(k) * rope_k[1][None, None]
        out = _attention(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, -1, self.n_heads * self.head_dim))


class LLMAdapterTransformerBlock(nn.Module):
    """x += self_attn(norm(x)) (T5 mask), x += cross_attn(norm(x), Qwen3 states) (Qwen3 mask),
    x += mlp(norm(x)); RMS norms, RoPE on queries and keys by their own positions."""

    def __init__(self, cfg: AdapterConfig):
        super().__init__()
        d, hd = cfg.model_dim, cfg.model_dim // cfg.num_heads
        hidden = int(d * cfg.mlp_ratio)
        self.norm_self_attn = LLMAdapterRMSNorm(d)
        self.self_attn = LLMAdapterAttention(d, d, cfg.num_heads, hd)
        self.norm_cross_attn = LLMAdapterRMSNorm(d)
        self.cross_attn = LLMAdapterAttention(d, cfg.source_dim, cfg.num_heads, hd)
        self.norm_mlp = LLMAdapterRMSNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))

    def forward(self, x, context, target_mask, source_mask, rope_x, rope_ctx):
        n = self.norm_self_attn(x)
        x = x + self.self_attn(n, target_mask, n, rope_x, rope_x)
        x = x + self.cross_attn(self.norm_cross_attn(x), source_mask, context, rope_x, rope_ctx)
        return x + self.mlp(self.norm_mlp(x))


class LLMAdapter(nn.Module):
    """T5 token ids -> embed (-> in_proj) -> blocks over Qwen3's states -> out_proj -> norm."""

    def __init__(self, cfg: AdapterConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.target_dim)
        self.in_proj = nn.Linear(cfg.target_dim, cfg.model_dim) if cfg.model_dim != cfg.target_dim else nn.Identity()
        self.blocks = nn.ModuleList(LLMAdapterTransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.out_proj = nn.Linear(cfg.model_dim, cfg.target_dim)
        self.norm = LLMAdapterRMSNorm(cfg.target_dim)

    def forward(self, source_hidden_states, target_input_ids, target_attention_mask=None,
                source_attention_mask=None):
        tmask = None if target_attention_mask is None else target_attention_mask.bool()[:, None, None, :]
        smask = None if source_attention_mask is None else source_attention_mask.bool()[:, None, None, :]
        x = self.in_proj(self.embed(target_input_ids))
        ctx = source_hidden_states.to(x.dtype)
        hd = self.config.model_dim // self.config.num_heads
        rope_x = _adapter_rope(hd, x.shape[1], x.device, x.dtype)
        rope_c = _adapter_rope(hd, ctx.shape[1], x.device, x.dtype)
        for block in self.blocks:
            x = block(x, ctx, tmask, smask, rope_x, rope_c)
        return self.norm(self.out_proj(x))
