"""Step time of the fused steppers on 2 gloo processes: synchronous sums against overlapped ones.

    python benchmarks/fused_overlap.py [--steps 4] [--warmup 1] [--bounds 0 1 2 4] [--groups 4]
                                       [--channels 1280] [--threads 1]

The trained module is SD1.5's real-width U-Net mid block (diffusers ``UNetMidBlock2DCrossAttn``:
two ResNet blocks and a transformer at 1280 channels, cross-attention over 77 x 768 text states,
about 97 M parameters, as in ``sd15-arch``), fully fine-tuned with plain SGD at the latent size
of a 64 px image (8 x 8), batch 1 per process. Two processes with ``--threads`` intra-op threads
each, one gloo job, are started once and time every configuration in turn, each from the same
initial weights and data, interleaved step by step (each configuration keeps its own copy of
the block: about 1 GiB per configuration and process):
  plain          the plain stepper: backward, then the bucketed sum of all gradients, one step
  fused k        fused_backward_pass (one unit per parameter) with fused_reductions_in_flight k
                 (0: each parameter's sum inside its hook, synchronously; k >= 1: overlapped)
  groups N k     fused_optimizer_groups N likewise
Time per step = the median over ``--steps`` steps after ``--warmup`` (backward and update; the
forward is the same in every configuration and is not timed). Each fused k >= 1 run's weights
are compared bit for bit with its k = 0 run. Run it on an idle machine: the two processes share
the cores with whatever else runs.
"""
from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from diffusers.models.unets.unet_2d_blocks import UNetMidBlock2DCrossAttn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library.config.parse import options_from_values  # noqa: E402
from library.training.stepper import make_stepper  # noqa: E402


class _Accelerator:
    """The one Accelerator call a stepper makes for a plain module."""

    def backward(self, loss):
        loss.backward()

    def prepare(self, optimizer):
        return optimizer


def _block(channels: int):
    torch.manual_seed(0)
    return UNetMidBlock2DCrossAttn(in_channels=channels, temb_channels=channels,
                                   cross_attention_dim=768, num_attention_heads=8,
                                   resnet_groups=32, resnet_eps=1e-5, resnet_act_fn="silu",
                                   output_scale_factor=1, use_linear_projection=False)


def _configs(bounds, groups, plain=True):
    out = [("plain", {})] if plain else []
    out += [(f"fused k={k}", {"fused_backward_pass": True, "fused_reductions_in_flight": k})
            for k in bounds]
    if groups:
        out += [(f"groups {groups} k={k}", {"fused_optimizer_groups": groups,
                                            "fused_reductions_in_flight": k}) for k in bounds]
    return out


class _Run:
    """One configuration: its own copy of the block (same initial weights), stepper and data."""

    def __init__(self, rank, extra, args):
        self.args, self.block = args, _block(args.channels)
        self.params = list(self.block.parameters())
        opts = options_from_values("train_dreambooth", {
            "optimizer_type": "torch.optim.SGD", "optimizer_args": {}, "learning_rate": 1e-4,
            "lr_scheduler": "constant", "max_grad_norm": 0.0, **extra})
        self.stepper = make_stepper(_Accelerator(), opts, [{"params": self.params}], self.params,
                                    warmup_steps=0, total_steps=args.warmup + args.steps)
        self.gen = torch.Generator().manual_seed(100 + rank)  # each process its own share
        self.times = []

    def step(self):
        c = self.args.channels
        x = torch.randn(1, c, 8, 8, generator=self.gen)
        temb = torch.randn(1, c, generator=self.gen)
        text = torch.randn(1, 77, 768, generator=self.gen)
        loss = self.block(x, temb, encoder_hidden_states=text).float().pow(2).mean() / 2
        t = time.perf_counter()
        self.stepper.backward(loss)
        self.stepper.step()
        self.times.append(time.perf_counter() - t)

    def result(self):
        digest = hashlib.sha256()
        for p in self.params:
            digest.update(p.detach().numpy().tobytes())
        return statistics.median(self.times[self.args.warmup:]), digest.hexdigest(), \
            sum(p.numel() for p in self.params)


def _worker(rank, port, args, queue):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=1800))
    configs = _configs(args.bounds, args.groups, not args.no_plain)
    runs = [_Run(rank, extra, args) for _, extra in configs]
    # interleaved: step s of every configuration, then step s + 1, so that a change of the
    # machine's load falls on all of them alike
    for s in range(args.warmup + args.steps):
        for (name, _), run in zip(configs, runs):
            dist.barrier()
            run.step()
            if rank == 0:
                print(f"step {s} {name}: {run.times[-1]:.3f} s", flush=True)
    queue.put((rank, [(name, *run.result()) for (name, _), run in zip(configs, runs)]))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bounds", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--groups", type=int, default=4, help="0: no fused_optimizer_groups runs")
    ap.add_argument("--channels", type=int, default=1280)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-plain", action="store_true", help="without the plain stepper's run")
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    rows, sync = results[0], {}
    print(f"\nSD1.5 mid block ({rows[0][3] / 1e6:.1f} M parameters, full fine-tune, SGD), "
          f"2 gloo processes x {args.threads} thread(s), 8 x 8 latents, batch 1 per process; "
          f"median of {args.steps} steps after {args.warmup}:")
    print("| configuration | s/step (backward + update) | vs k=0 | weights vs k=0 |")
    print("|---|---|---|---|")
    for (name, seconds, digest, _), (_, _, digest1, _) in zip(rows, results[1]):
        assert digest == digest1, f"{name}: the processes ended with different weights"
        base = name.rsplit(" k=", 1)[0]
        if name.endswith(" k=0"):
            sync[base] = (seconds, digest)
        ref = sync.get(base)
        vs = f"{seconds / ref[0]:.2f}" if ref and " k=" in name else ""
        same = ("identical" if digest == ref[1] else "DIFFERENT") if ref and " k=" in name \
            and not name.endswith(" k=0") else ""
        print(f"| {name} | {seconds:.3f} | {vs} | {same} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
