"""Exponential moving average of the trained weights (``ema_decay``, ``ema_device``).

After each optimizer step: ``ema = d * ema + (1 - d) * w`` for every trainable parameter, the
average starting from the initial weights (before the first step). It is saved beside every
model save as ``<output_name>-ema`` (same format and naming as the raw weights: the method's own
save, with the averaged values swapped into the parameters for the duration of the save, by
library/outputs/checkpoints.py through the strategy's ``ema_weights``) and is
part of the training state (``ema.safetensors``), so a resume continues it exactly.

Every process keeps the same average (the weights are identical in every process after a step);
only the main process writes files. With ``fsdp`` the average is sharded like the weights (its
tensors are DTensors of the same layout): each process averages its shard, the save gathers.
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from library.errors import ResumeError

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")

STATE_FILE = "ema.safetensors"


class EMA:
    def __init__(self, params, decay: float, device=None):
        # lazy: the dry run's plan loads this module before torch; torch is imported when __init__()
        # runs
        import torch

        self.decay = float(decay)
        self.params = list(params)
        with torch.no_grad():
            self.shadow = [p.detach().to(device or p.device, dtype=torch.float32, copy=True)
                           for p in self.params]

    def update(self) -> None:
        """ema = d * ema + (1 - d) * w (in float32)."""
        # lazy: the dry run's plan loads this module before torch; torch is imported when update()
        # runs
        import torch

        d = self.decay
        with torch.no_grad():
            for e, p in zip(self.shadow, self.params):
                w = p.detach().to(e.device, dtype=torch.float32)
                e.mul_(d).add_(w, alpha=1.0 - d)

    @contextlib.contextmanager
    def swapped(self):
        """The parameters hold the EMA values inside the block, their own values again after."""
        # lazy: the dry run's plan loads this module before torch; torch is imported when swapped()
        # runs
        import torch

        with torch.no_grad():
            backup = [p.detach().clone() for p in self.params]
            try:
                for p, e in zip(self.params, self.shadow):
                    p.copy_(e.to(p.device, p.dtype))
                yield
            finally:
                for p, b in zip(self.params, backup):
                    p.copy_(b)

    # -- training state -------------------------------------------------------------------------
    def state_tensors(self, names: list[str]) -> dict:
        return {n: e.detach().to("cpu", copy=True).contiguous() for n, e in zip(names, self.shadow)}

    def load_tensors(self, tensors: dict, names: list[str], where: str) -> None:
        # lazy: the dry run's plan loads this module before torch; torch is imported when
        # load_tensors() runs
        import torch

        missing = [n for n in names if n not in tensors]
        if missing or len(tensors) != len(names):
            raise ResumeError(f"resume: {where}: the EMA weights do not match this run's trainable "
                              f"parameters (e.g. {(missing or sorted(tensors))[0]})")
        with torch.no_grad():
            for n, e in zip(names, self.shadow):
                e.copy_(tensors[n].to(e.device, e.dtype))


def for_params(opts: Options, params):
    """The run's EMA (``ema_decay`` set) over the trainable ``params``, or None."""
    decay = opts.ema_decay
    if decay is None:
        return None
    device = "cpu" if opts.ema_device == "cpu" else None
    ema = EMA(params, decay, device)
    n = sum(e.numel() for e in ema.shadow)
    where = ema.shadow[0].device if ema.shadow else "cpu"
    logger.info(f"EMA of {n} trained weights, decay {decay}, on {where}")
    return ema
