"""The Chroma transformer (Chroma1-Base / Chroma1-HD) in its original module layout (lodestone's
``flow`` repository, as sd-scripts' chroma_models.py and ComfyUI read it).

FLUX.1's transformer (library/models/families/flux/flux.py: the double and single blocks, RoPE, the packed 2x2
latents) without CLIP-L's vector input, the timestep and guidance embedders and the per-block
modulation layers: every block's shift / scale / gate comes from the **distilled guidance
approximator** ``distilled_guidance_layer``, an MLP (``in_proj``, residual ``layers.N.{in_layer,
out_layer}`` with RMS ``norms.N.scale``, ``out_proj``) run on one input vector per modulation:
[the timestep's sinusoidal embedding (16), the guidance's (16, always 0 as Chroma was trained and
diffusers / ComfyUI run it), the modulation index's (32)]. The approximator's outputs, in order:
3 per single block (shift, scale, gate), 6 per double block's image stream, then 6 per double
block's text stream, then 2 for the final layer (shift, scale).

T5's padded tokens are masked as keys, except the first padding token, which Chroma attends to
(``chroma_mask``: sd-scripts' ``attn_padding = 1``, diffusers' ``mask_indices <= seq_len``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from library.models.families.flux import flux

GUIDANCE = 0.0  # the approximator's guidance input (Chroma was trained with 0; diffusers' ChromaPipeline)


@dataclass(frozen=True)
class ChromaConfig:
    """The transformer's shape (sd-scripts' ChromaParams)."""
    in_channels: int = 64
    context_in_dim: int = 4096
    hidden_size: int = 3072
    mlp_ratio: float = 4.0
    num_heads: int = 24
    depth: int = 19
    depth_single_blocks: int = 38
    axes_dim: tuple[int, ...] = (16, 56, 56)
    theta: int = 10_000
    qkv_bias: bool = True
    approximator_in_dim: int = 64
    approximator_depth: int = 5
    approximator_hidden_size: int = 5120

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def mod_count(self) -> int:
        """Modulation vectors: 3 per single block, 2 x 6 per double block, 2 for the final layer."""
        return 3 * self.depth_single_blocks + 12 * self.depth + 2

    def check(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"Chroma config: hidden_size {self.hidden_size} is not a multiple of num_heads "
                             f"{self.num_heads}")
        if sum(self.axes_dim) != self.head_dim or any(d % 2 for d in self.axes_dim):
            raise ValueError(f"Chroma config: axes_dim {list(self.axes_dim)} must be even and sum to the head dim "
                             f"{self.head_dim}")
        if self.approximator_in_dim % 4:
            raise ValueError(f"Chroma config: approximator_in_dim {self.approximator_in_dim} is not a multiple of 4")

    def record(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


CHROMA1 = ChromaConfig()  # Chroma1-Base / Chroma1-HD (8.9B)
# the built-in tiny-chroma: the real topology (double and single blocks, RoPE over three axes, the
# approximator) at small widths; the text width is the tiny T5's
TINY_CHROMA = ChromaConfig(context_in_dim=32, hidden_size=64, num_heads=2, depth=2, depth_single_blocks=2,
                           axes_dim=(8, 12, 12), approximator_depth=2, approximator_hidden_size=32)


class Approximator(nn.Module):
    """The distilled guidance layer: in_proj, n residual [RMSNorm -> MLPEmbedder] layers, out_proj."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int, n_layers: int):
        super().__init__()
        self.in_proj = nn.Linear(in_dim, hidden_dim, bias=True)
        self.layers = nn.ModuleList([flux.MLPEmbedder(hidden_dim, hidden_dim) for _ in range(n_layers)])
        self.norms = nn.ModuleList([flux.RMSNorm(hidden_dim) for _ in range(n_layers)])
        self.out_proj = nn.Linear(hidden_dim, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        x = self.in_proj(x)
        for layer, norm in zip(self.layers, self.norms):
            x = x + layer(norm(x))
        return self.out_proj(x)


class DoubleBlock(flux.DoubleStreamBlock):
    """FLUX.1's double block without its modulation layers (Chroma's come from the approximator)."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, qkv_bias: bool):
        super().__init__(hidden_size, num_heads, mlp_ratio, qkv_bias)
        del self.img_mod, self.txt_mod

    def forward(self, img, txt, img_mod, txt_mod, pe, attn_mask=None):
        return self.modulated(img, txt, img_mod, txt_mod, pe, attn_mask)


class SingleBlock(flux.SingleStreamBlock):
    """FLUX.1's single block without its modulation layer."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float):
        super().__init__(hidden_size, num_heads, mlp_ratio)
        del self.modulation

    def forward(self, x, mod, pe, attn_mask=None):
        return self.modulated(x, mod, pe, attn_mask)


class LastLayer(flux.LastLayer):
    """FLUX.1's final layer without its adaLN modulation."""

    def __init__(self, hidden_size: int, out_channels: int):
        super().__init__(hidden_size, out_channels)
        del self.adaLN_modulation

    def forward(self, x, shift, scale):
        return self.modulated(x, shift, scale)


def chroma_mask(t5_attn_mask: Tensor) -> Tensor:
    """T5's mask (1 = a real token) with the first padding token attended too (Chroma's rule)."""
    m = t5_attn_mask.to(torch.long)
    length = m.sum(dim=1, keepdim=True)
    return (torch.arange(m.shape[1], device=m.device)[None, :] <= length).to(torch.long)


class Chroma(flux.Flux):
    """The Chroma flow-matching transformer; forward returns the velocity per packed image token.
    A ``flux.Flux`` for the shared machinery (gradient checkpointing, blocks_to_swap over its
    double and single blocks), with its own modules and forward."""

    config: ChromaConfig  # type: ignore[assignment]  # its own shape record, not FluxConfig

    def __init__(self, config: ChromaConfig):
        nn.Module.__init__(self)
        config.check()
        self.config = config
        h = config.hidden_size
        self.pe_embedder = flux.EmbedND(config.head_dim, config.theta, config.axes_dim)
        self.img_in = nn.Linear(config.in_channels, h, bias=True)
        self.distilled_guidance_layer = Approximator(config.approximator_in_dim, h, config.approximator_hidden_size,
                                                     config.approximator_depth)
        self.txt_in = nn.Linear(config.context_in_dim, h)
        self.double_blocks = nn.ModuleList(
            [DoubleBlock(h, config.num_heads, config.mlp_ratio, config.qkv_bias) for _ in range(config.depth)])
        self.single_blocks = nn.ModuleList(
            [SingleBlock(h, config.num_heads, config.mlp_ratio) for _ in range(config.depth_single_blocks)])
        self.final_layer = LastLayer(h, config.in_channels)
        self.gradient_checkpointing = False
        self.block_swap = None
        self.cpu_offload_checkpointing = False

    def approximator_input(self, timesteps: Tensor) -> Tensor:
        """(B, mod_count, approximator_in_dim): per modulation, [timestep (in_dim/4), guidance 0
        (in_dim/4), modulation index (in_dim/2)] sinusoidal embeddings (x1000, cos first)."""
        cfg = self.config
        b = timesteps.shape[0]
        quarter = cfg.approximator_in_dim // 4
        t = flux.timestep_embedding(timesteps, quarter)
        g = flux.timestep_embedding(torch.full_like(timesteps, GUIDANCE), quarter)
        index = torch.arange(cfg.mod_count, device=timesteps.device, dtype=timesteps.dtype)
        mod = flux.timestep_embedding(index, 2 * quarter)
        tg = torch.cat([t, g], dim=1)[:, None, :].expand(b, cfg.mod_count, 2 * quarter)
        return torch.cat([tg, mod[None].expand(b, -1, -1)], dim=-1)

    def modulations(self, timesteps: Tensor) -> Tensor:
        """The approximator's (B, mod_count, hidden) modulation vectors at these timesteps."""
        x = self.approximator_input(timesteps)
        return self.distilled_guidance_layer(x.to(self.img_in.weight.dtype if x.is_floating_point() else x.dtype))

    def forward(self, img: Tensor, img_ids: Tensor, txt: Tensor, txt_ids: Tensor,  # type: ignore[override]
                timesteps: Tensor, txt_attention_mask: Tensor | None = None) -> Tensor:
        """No pooled vector or guidance input (FLUX.1's y, guidance). img (B, N, in_channels) packed latents; img_ids (B, N, 3); txt (B, L, context_in_dim) T5's
        states; txt_ids (B, L, 3); timesteps (B,) in [0, 1]; txt_attention_mask (B, L): T5's mask
        (1 = a real token; Chroma's rule adds the first padding token), or None: every token."""
        if img.ndim != 3 or txt.ndim != 3:
            raise ValueError("Chroma: img and txt must be (batch, tokens, features)")
        cfg = self.config
        img = self.img_in(img)
        mods = self.modulations(timesteps.to(img.dtype)).to(img.dtype)[:, :, None, :]  # (B, M, 1, hidden)
        txt = self.txt_in(txt)
        pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))
        mask = None if txt_attention_mask is None else flux.joint_attention_mask(chroma_mask(txt_attention_mask),
                                                                                 img.shape[1])
        n_single, n_double = cfg.depth_single_blocks, cfg.depth
        img_at, txt_at = 3 * n_single, 3 * n_single + 6 * n_double
        for i, block in enumerate(self.double_blocks):
            img_mod = list(mods[:, img_at + 6 * i: img_at + 6 * i + 6].unbind(1))
            txt_mod = list(mods[:, txt_at + 6 * i: txt_at + 6 * i + 6].unbind(1))
            img, txt = self._run(block, img, txt, img_mod, txt_mod, pe, mask)
        n_txt = txt.shape[1]
        x = torch.cat((txt, img), dim=1)
        for i, block in enumerate(self.single_blocks):
            x = self._run(block, x, list(mods[:, 3 * i: 3 * i + 3].unbind(1)), pe, mask)
        return self.final_layer(x[:, n_txt:], mods[:, -2], mods[:, -1])
