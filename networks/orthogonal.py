"""The rotation arithmetic of sd-scripts' PEFT-form orthogonal adapters (networks.oft_v2 and
networks.boft, sd-scripts PR #2357 / #2428), on plain tensors, in any float dtype (float64 merges).

OFTv2 (a file's ``oft_R.weight``, shape (r, b(b-1)/2)): each row is the strict upper triangle of a
b x b matrix M, row-major (``torch.triu_indices(b, b, 1)``); Q = M - M^T is skew-symmetric, and the
block's rotation is PEFT's truncated Neumann series of the Cayley transform (I + Q)(I - Q)^-1 with
5 terms: ``R = I + 2Q + 2Q^2 + 2Q^3 + Q^4``. The layer's flattened weight W (out, in[*kh*kw])
splits its inputs into r blocks of b: a Linear computes with ``W @ blockdiag(R)^T`` (sd-scripts
rotates the input rows x -> x R), a Conv2d with ``W @ blockdiag(R)`` (sd-scripts rotates the
flattened kernel, the other side). With ``block_share`` the file has one row used for every block.
COFT projects each block's Q to Frobenius norm <= eps / sqrt(number of rows).

BOFT (``boft_R`` (m, N, b, b), ``boft_s`` (out, 1)): each b x b block A gives the exact Cayley
rotation of S = (A - A^T) / 2, ``(I - S)(I + S)^-1``; factor i is ``P_i blockdiag(R_i) P_i^T`` with
P_i the butterfly permutation below (P_0 = I), the rotation ``R = M_{m-1} ... M_1 M_0``, and the
weight ``diag(s) @ W @ R^T`` (Linear and Conv2d alike).

A multiplier m interpolates: ``W + m (W' - W)``.
"""
from __future__ import annotations

import math

import torch

NEUMANN_TERMS = 5  # PEFT's / sd-scripts' num_cayley_neumann_terms (not an option of the network)


def triu_size(block_size: int) -> int:
    return block_size * (block_size - 1) // 2


def block_size_of_triu(n_elements: int) -> int | None:
    """b with b(b-1)/2 == n_elements, or None."""
    b = int((1 + math.isqrt(1 + 8 * n_elements)) // 2)
    return b if triu_size(b) == n_elements else None


def skew(vec: torch.Tensor, block_size: int) -> torch.Tensor:
    """(r, b(b-1)/2) upper-triangle rows -> (r, b, b) skew-symmetric M - M^T."""
    rows, cols = torch.triu_indices(block_size, block_size, 1, device=vec.device)
    m = vec.new_zeros(vec.shape[0], block_size, block_size)
    m[:, rows, cols] = vec
    return m - m.transpose(1, 2)


def neumann_cayley(q: torch.Tensor, terms: int = NEUMANN_TERMS) -> torch.Tensor:
    """PEFT's truncated series for (I + Q)(I - Q)^-1: I + 2Q + ... + 2Q^(terms-2) + Q^(terms-1)."""
    eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device).expand_as(q)
    out, power = eye.clone(), eye
    for k in range(1, terms):
        power = power @ q
        out = out + (power if k == terms - 1 and terms > 2 else 2 * power)
    return out


def coft_project(vec: torch.Tensor, block_size: int, eps: float) -> torch.Tensor:
    """COFT: each row's skew matrix scaled down to Frobenius norm eps / sqrt(rows) when above it."""
    bound = eps / math.sqrt(vec.shape[0])
    norm = skew(vec, block_size).flatten(1).norm(dim=1, keepdim=True)
    return torch.where(norm <= bound, vec, vec * (bound / norm))


def oft_blocks_rotation(vec: torch.Tensor, block_size: int, n_blocks: int) -> torch.Tensor:
    """(n_blocks, b, b) rotations of an ``oft_R.weight`` (one shared row repeated)."""
    r = neumann_cayley(skew(vec, block_size))
    return r.repeat(n_blocks // r.shape[0], 1, 1) if r.shape[0] != n_blocks else r


def rotate_inputs(weight: torch.Tensor, blocks: torch.Tensor, transpose: bool) -> torch.Tensor:
    """W_flat @ blockdiag(blocks)^T (transpose) or W_flat @ blockdiag(blocks), in W's shape."""
    n, b = blocks.shape[0], blocks.shape[-1]
    w = weight.reshape(weight.shape[0], n, b)
    out = torch.einsum("ork,rck->orc" if transpose else "ork,rkc->orc", w, blocks)
    return out.reshape(weight.shape)


def cayley(blocks: torch.Tensor) -> torch.Tensor:
    """BOFT's exact Cayley rotation of each (.., b, b) block: (I - S)(I + S)^-1, S = (A - A^T) / 2."""
    s = 0.5 * (blocks - blocks.transpose(-1, -2))
    eye = torch.eye(blocks.shape[-1], dtype=blocks.dtype, device=blocks.device).expand_as(s)
    return torch.linalg.solve(eye + s, eye - s, left=False)


def butterfly_indices(n: int, block_num: int, block_size: int, n_factors: int) -> torch.Tensor:
    """(m, n) index rows of the butterfly permutations (PEFT's block_butterfly_perm): row i[j] is
    the input P_i takes output j from. Factor i splits n into groups of b * 2^i and puts each
    group's half-blocks (b/2 wide) in even-then-odd order; factor 0 (and every factor of a
    one-factor BOFT) is the identity."""
    out = torch.arange(n).repeat(n_factors, 1)
    if n_factors == 1:
        return out
    half = block_size // 2
    for i in range(1, n_factors):
        group = n // (block_num // 2 ** i)
        chunks = group // half
        order = [*range(0, chunks, 2), *range(1, chunks, 2)]
        within = torch.cat([torch.arange(c * half, (c + 1) * half) for c in order])
        out[i] = torch.cat([start + within for start in range(0, n, group)])
    return out


def boft_rotate(weight: torch.Tensor, blocks: torch.Tensor, indices: torch.Tensor,
                scale: torch.Tensor) -> torch.Tensor:
    """diag(scale) @ W_flat @ R^T for R = prod_i P_i blockdiag(cayley(blocks[i])) P_i^T, without
    forming R: each factor acts on the columns of W^T (the flattened inputs)."""
    m, n_blocks, b, _ = blocks.shape
    rot = cayley(blocks)
    x = weight.reshape(weight.shape[0], -1).transpose(0, 1)  # (n, out)
    for i in range(m):
        idx = indices[i].to(x.device)
        inv = torch.empty_like(idx)
        inv[idx] = torch.arange(idx.numel(), device=idx.device)
        y = x[inv].reshape(n_blocks, b, -1)  # P_i^T x
        y = torch.bmm(rot[i], y).reshape(x.shape)
        x = y[idx]  # P_i y
    return (x.transpose(0, 1) * scale.reshape(-1, 1)).reshape(weight.shape)


def nearest_divisor(n: int, want: int) -> int:
    """sd-scripts' adjust_block_size: ``want`` if it divides n, else the nearer divisor below or
    above (the lower one on a tie), n when want >= n."""
    if want >= n:
        return n
    if n % want == 0:
        return want
    lower = next(d for d in range(want, 0, -1) if n % d == 0)
    higher = next((d for d in range(want, n + 1) if n % d == 0), None)
    if higher is None or want - lower <= higher - want:
        return lower
    return higher


def boft_shape_valid(n: int, block_size: int, block_num: int, n_factors: int) -> bool:
    if block_size <= 0 or block_num <= 0 or block_size * block_num != n:
        return False
    k = n_factors - 1
    return k <= 0 or (block_num % 2 ** k == 0 and block_size % 2 == 0 and n % (block_size * 2 ** k) == 0)


def boft_shape(n: int, block_size: int | None, block_num: int | None, n_factors: int,
               auto_adjust: bool) -> tuple[int, int]:
    """(block_size, block_num) for n inputs, as sd-scripts chooses; ValueError names the problem."""
    what = f"in_features={n}, boft_n_butterfly_factor={n_factors}"
    if block_num:
        if n % block_num or not boft_shape_valid(n, n // block_num, block_num, n_factors):
            raise ValueError(f"boft_block_num={block_num} gives no valid BOFT shape for {what}")
        return n // block_num, block_num
    want = block_size or 4
    if n % want and not auto_adjust:
        raise ValueError(f"boft_block_size={want} does not divide {n} inputs (auto_adjust=false)")
    size = want if n % want == 0 else nearest_divisor(n, want)
    if boft_shape_valid(n, size, n // size, n_factors):
        return size, n // size
    if not auto_adjust:
        raise ValueError(f"boft_block_size={size} gives no valid BOFT shape for {what} (auto_adjust=false)")
    for d in sorted((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - want), d)):
        if boft_shape_valid(n, d, n // d, n_factors):
            return d, n // d
    raise ValueError(f"no valid BOFT block shape for {what}, boft_block_size={want}")
