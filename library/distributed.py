"""Process-group helpers: world size before torch is imported, and bucketed gradient sums."""
from __future__ import annotations

import os


def launched_world_size() -> int:
    """Number of processes the launcher started (accelerate launch / torchrun set WORLD_SIZE)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def make_accelerator(mixed_precision: str):
    """An Accelerator that joins CPU processes into one gloo job when CUDA is absent."""
    import torch
    from accelerate import Accelerator

    cpu = not torch.cuda.is_available()
    return Accelerator(cpu=cpu, mixed_precision=mixed_precision, gradient_accumulation_steps=1)


def sum_gradients(params, bucket_bytes: int = 25 * 1024 * 1024) -> None:
    """All-reduce (sum) the gradients of ``params`` across processes in flat buckets.

    One collective per ~25 MB bucket, as DDP does, instead of one per tensor. A parameter that
    received no gradient in this process (an empty share of the global batch) counts as zeros,
    so every process takes part in every collective.
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict = {}
    for p in params:
        by_dtype.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    for group in by_dtype.values():
        bucket, size = [], 0
        for p in group + [None]:
            if p is not None:
                bucket.append(p)
                size += p.grad.numel() * p.grad.element_size()
            if bucket and (p is None or size >= bucket_bytes):
                flat = torch.cat([q.grad.reshape(-1) for q in bucket])
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                offset = 0
                for q in bucket:
                    n = q.grad.numel()
                    q.grad.copy_(flat[offset:offset + n].view_as(q.grad))
                    offset += n
                bucket, size = [], 0


def all_reduce_sum(value: float, device) -> float:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item())
