"""The weight arithmetic of sd-scripts' own adapter kinds, on plain tensors.

One place for what a file's tensors mean, used by the training modules
(networks/adapter_modules.py), the merge tool and the file checks of the LoRA tools:

- LoRA / LoCon / DyLoRA / LoRA-FA (``lora_down``, ``lora_up``): ``up @ down * alpha / rank``.
- LoHa (``hada_w1_a``, ``hada_w1_b``, ``hada_w2_a``, ``hada_w2_b``, Tucker 3x3 convs also
  ``hada_t1``, ``hada_t2``): ``(w1a @ w1b) * (w2a @ w2b) * alpha / rank``.
- LoKr (``lokr_w1``; ``lokr_w2`` full, or ``lokr_w2_a @ lokr_w2_b``, Tucker ``lokr_t2``):
  ``kron(w1, w2) * alpha / rank``, scale 1 when ``w2`` is a full matrix.
- OFT (``oft_blocks``, prefix ``oft_unet``): a block-diagonal Cayley rotation of the output rows,
  ``W' = R^T W`` per block, with the skew matrix's norm clamped to ``alpha * out_dim``.
- DoRA (LyCORIS ``dora_wd``: a LoRA / LoHa / LoKr module with ``dora_scale``): the weight
  decomposed, ``W' = m * (W + delta) / ||W + delta||``, m = ``dora_scale``, the norm taken over
  every axis but the one dora_scale runs along: the output rows (shape (out, 1, ...), LyCORIS'
  default ``wd_on_output``) or the input columns ((1, in, 1, ...), ``wd_on_output=False``).
- LyCORIS full (``diff``, ``diff_b``): ``W' = W + diff``, ``b' = b + diff_b``.

Tucker layouts follow LyCORIS (sd-scripts keeps them): ``w_a`` is (rank, out), ``w_b`` (rank, in),
``t`` (rank, rank, k, k), rebuilt as ``einsum("i j ..., i p, j r -> p r ...", t, w_a, w_b)``.
"""
from __future__ import annotations

import torch

# the tensor names that identify a module's kind in a file (first match wins)
KIND_KEYS = (("LoHa", "hada_w1_a"), ("LoKr", "lokr_w1"), ("OFT", "oft_blocks"), ("LoRA", "lora_down.weight"),
             ("LyCORIS iA3", "on_input"), ("LyCORIS GLoRA", "a1.weight"), ("LyCORIS Diag-OFT", "oft_diag"),
             ("LyCORIS full", "diff"))
NETWORK_MODULE_OF_KIND = {"LoRA": "networks.lora", "LoHa": "networks.loha", "LoKr": "networks.lokr",
                          "OFT": "networks.oft"}


def file_kinds(state_dict: dict) -> list[str]:
    """The adapter kinds a file's modules have (sorted, usually one)."""
    parts: dict[str, set] = {}
    for key in state_dict:
        name, _, part = key.partition(".")
        parts.setdefault(name, set()).add(part)
    kinds = set()
    for name, p in parts.items():
        if "dora_scale" in p:
            kinds.add("DoRA")
            continue
        for kind, part in KIND_KEYS:
            if part in p:
                kinds.add(kind)
                break
    return sorted(kinds)


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """(m, n), m <= n, m * n == dimension: as balanced as allowed by ``factor`` (LyCORIS / sd-scripts:
    ``factor > 0`` that divides the dimension fixes m; else m grows while m + n shrinks and m <= factor)."""
    if factor > 0 and dimension % factor == 0:
        m, n = factor, dimension // factor
        return (n, m) if m > n else (m, n)
    limit = dimension if factor < 0 else factor
    m, n = 1, dimension
    while m < n:
        new_m = m + 1
        while dimension % new_m:
            new_m += 1
        new_n = dimension // new_m
        if new_m + new_n > m + n or new_m > limit:
            break
        m, n = new_m, new_n
    return (n, m) if m > n else (m, n)


def tucker(t: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    """(out, in, k, k) from a Tucker core t (rank, rank, k, k), wa (rank, out), wb (rank, in)."""
    return torch.einsum("i j ..., i p, j r -> p r ...", t, wa, wb)


def loha_delta(p: dict, scale: float, shape) -> torch.Tensor:
    """LoHa delta in the original weight's shape (p: the module's tensors by name, float32)."""
    if "hada_t1" in p:
        d = tucker(p["hada_t1"], p["hada_w1_a"], p["hada_w1_b"]) * tucker(p["hada_t2"], p["hada_w2_a"], p["hada_w2_b"])
    else:
        d = (p["hada_w1_a"] @ p["hada_w1_b"]) * (p["hada_w2_a"] @ p["hada_w2_b"])
    return (d * scale).reshape(shape)


def lokr_w2(p: dict) -> torch.Tensor:
    if "lokr_w2" in p:
        return p["lokr_w2"]
    if "lokr_t2" in p:
        return tucker(p["lokr_t2"], p["lokr_w2_a"], p["lokr_w2_b"])
    return p["lokr_w2_a"] @ p["lokr_w2_b"]


def lokr_delta(p: dict, scale: float, shape) -> torch.Tensor:
    w1, w2 = p["lokr_w1"], lokr_w2(p)
    while w1.dim() < w2.dim():
        w1 = w1.unsqueeze(-1)
    return (torch.kron(w1, w2.contiguous()) * scale).reshape(shape)


def lokr_rank(p: dict) -> int | None:
    """The rank that divides alpha (None: w2 is a full matrix, scale 1)."""
    if "lokr_w2_a" not in p:
        return None
    return p["lokr_w2_a"].shape[0] if "lokr_t2" in p else p["lokr_w2_a"].shape[1]


def oft_rotation(blocks: torch.Tensor, constraint: float, multiplier: float = 1.0) -> torch.Tensor:
    """sd-scripts' OFT: R = (I + Q)(I - Q)^-1 per block, Q = the skew part of ``blocks`` with its
    norm clamped to ``constraint``; returns multiplier * (R - I) + I (num_blocks, b, b)."""
    q = blocks - blocks.transpose(1, 2)
    norm = torch.norm(q.flatten())
    q = q * ((torch.clamp(norm, max=constraint) + 1e-8) / (norm + 1e-8))
    eye = torch.eye(blocks.shape[1], device=blocks.device, dtype=q.dtype).unsqueeze(0)
    r = torch.matmul(eye + q, torch.linalg.inv((eye - q).float()).to(q.dtype))
    return multiplier * (r - eye) + eye


def oft_apply(weight: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """W' with each block of output rows rotated: W'_k = R_k^T W_k."""
    k, b = r.shape[0], r.shape[1]
    w = weight.reshape(k, b, -1)
    return torch.einsum("k n m, k n p -> k m p", r, w).reshape(weight.shape)


def dora_axis(dora_scale: torch.Tensor, weight_shape: tuple) -> int:
    """The weight axis dora_scale gives one magnitude per slice of: 0 (output rows, shape
    (out, 1, ...)) or 1 (input columns, (1, in, 1, ...)); ValueError for any other shape."""
    ones = (1,) * (len(weight_shape) - 1)
    shape = tuple(dora_scale.shape)
    if shape == (weight_shape[0], *ones):
        return 0
    if len(weight_shape) > 1 and shape == (1, weight_shape[1], *ones[1:]):
        return 1
    raise ValueError(f"dora_scale {shape} fits neither the output rows {(weight_shape[0], *ones)} nor the "
                     f"input columns of a weight {tuple(weight_shape)}")


def dora_weight(weight: torch.Tensor, delta: torch.Tensor, dora_scale: torch.Tensor) -> torch.Tensor:
    """DoRA's weight ``m * (W + delta) / ||W + delta||``, the norm over every axis but dora_axis's
    (LyCORIS' apply_weight_decompose at multiplier 1, without its float eps)."""
    merged = weight + delta
    axis = dora_axis(dora_scale, tuple(weight.shape))
    norm = torch.linalg.vector_norm(merged, dim=[d for d in range(merged.dim()) if d != axis], keepdim=True)
    return dora_scale.to(merged.dtype) * merged / norm


def module_delta(p: dict[str, torch.Tensor], weight: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The additive delta of one module of a file (LoRA, LoHa or LoKr; tensors by part name),
    alpha included, in the weight's shape and ``dtype``. OFT is not additive: see oft_apply."""
    p = {k: v.to(dtype) for k, v in p.items()}
    alpha = float(p["alpha"]) if "alpha" in p else None
    if "hada_w1_a" in p:
        rank = p["hada_w1_b"].shape[0]
        return loha_delta(p, (alpha if alpha else rank) / rank, weight.shape)
    if "lokr_w1" in p:
        rank = lokr_rank(p)
        return lokr_delta(p, 1.0 if rank is None else (alpha if alpha else rank) / rank, weight.shape)
    down, up = p["lora_down.weight"], p["lora_up.weight"]
    rank = down.shape[0]
    scale = (alpha if alpha else rank) / rank
    if down.dim() == 2:
        return (up @ down * scale).reshape(weight.shape)
    if down.shape[2:] == (1, 1):
        return (up.flatten(1) @ down.flatten(1) * scale).reshape(weight.shape)
    return torch.nn.functional.conv2d(down.permute(1, 0, 2, 3), up).permute(1, 0, 2, 3) * scale
