"""The step plan: what one step, one epoch and the whole run mean, computed once.

Contract (DESIGN.md, "Step accounting"):
- ``train_batch_size`` is per process; global batch = batch x processes x accumulation.
- A step is one optimizer update over one global batch; a global batch comes from one bucket.
- An epoch is one pass over the global sample list (repeats and balanced reg images counted),
  sharded across processes, never repeated per process. A bucket's last partial global batch is kept.
- The order is one global permutation per epoch, identical in every process, then split.

No torch import: ``--dry_run`` prints the plan without loading model code.
"""
from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field


def derive_seed(*parts: object) -> int:
    """A 63-bit seed derived from the given parts; stable across processes and Python runs."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class StepPlan:
    images: int
    repeats_total: int          # samples per epoch coming from training images (repeats counted)
    reg_images: int
    reg_samples: int            # reg samples per epoch after balancing
    samples_per_epoch: int
    batches_per_epoch: int      # per-process micro-batches in one epoch (the busiest process)
    processes: int
    train_batch_size: int
    gradient_accumulation_steps: int
    global_batch: int
    steps_per_epoch: int
    epochs: int
    total_steps: int
    warmup_steps: int
    bucket_sizes: dict = field(default_factory=dict)
    class_images: int = 0       # num_class_images: of the reg images, those generated (planned)
    class_images_new: int = 0   # of them, the ones still to be made when the plan was made

    def lines(self) -> list[str]:
        return [
            f"images: {self.images}",
            f"repeats: {self.repeats_total}",
            f"reg_images: {self.reg_images}",
            f"reg_samples: {self.reg_samples}",
            f"samples_per_epoch: {self.samples_per_epoch}",
            f"batches_per_epoch: {self.batches_per_epoch}",
            f"processes: {self.processes}",
            f"train_batch_size: {self.train_batch_size}",
            f"gradient_accumulation_steps: {self.gradient_accumulation_steps}",
            f"global_batch: {self.global_batch}",
            f"steps_per_epoch: {self.steps_per_epoch}",
            f"epochs: {self.epochs}",
            f"total_steps: {self.total_steps}",
            f"warmup_steps: {self.warmup_steps}",
        ] + ([f"class_images: {self.class_images} of the reg images ({self.class_images_new} to "
              "generate before training)"] if self.class_images else [])


def steps_for_buckets(bucket_sizes: dict, global_batch: int) -> int:
    return sum(math.ceil(n / global_batch) for n in bucket_sizes.values() if n > 0)


@dataclass(frozen=True)
class EpochSamples:
    """What one epoch holds, counted from the training set (``TrainingSet.epoch_samples``)."""
    bucket_sizes: dict          # batch key -> samples of it per epoch
    images: int
    repeats_total: int          # samples from training images (repeats counted)
    reg_images: int
    reg_samples: int            # reg samples after balancing
    class_images: int = 0       # num_class_images: of the reg images, those generated (planned)
    class_images_new: int = 0   # of them, the ones still to be made


@dataclass(frozen=True)
class BatchShape:
    """How a global batch is made: ``train_batch_size`` per process, ``processes`` of them,
    ``gradient_accumulation_steps`` micro-steps."""
    processes: int
    train_batch_size: int
    gradient_accumulation_steps: int

    @property
    def global_batch(self) -> int:
        return self.train_batch_size * self.processes * self.gradient_accumulation_steps


@dataclass(frozen=True)
class RunLength:
    """The run's length and warmup as the options give them: ``max_train_epochs`` wins over
    ``max_train_steps``; ``lr_warmup_steps`` below 1 (a float) is a fraction of the steps."""
    max_train_epochs: int | None
    max_train_steps: int | None
    lr_warmup_steps: float | int | None


def make_plan(samples: EpochSamples, shape: BatchShape, length: RunLength) -> StepPlan:
    global_batch = shape.global_batch
    steps_per_epoch = steps_for_buckets(samples.bucket_sizes, global_batch)
    if steps_per_epoch == 0:
        raise ValueError("the dataset is empty: no samples per epoch")
    if length.max_train_epochs:
        epochs = int(length.max_train_epochs)
        total = epochs * steps_per_epoch
    elif length.max_train_steps:
        total = int(length.max_train_steps)
        epochs = math.ceil(total / steps_per_epoch)
    else:
        raise ValueError("max_train_epochs or max_train_steps must be set")
    warm = length.lr_warmup_steps or 0
    if isinstance(warm, float) and 0 < warm < 1:
        warmup = int(round(warm * total))
    else:
        warmup = int(warm)
    per_micro = shape.train_batch_size * shape.processes
    micro = sum(math.ceil(n / per_micro) for n in samples.bucket_sizes.values() if n > 0)
    return StepPlan(images=samples.images, repeats_total=samples.repeats_total,
                    reg_images=samples.reg_images, reg_samples=samples.reg_samples,
                    samples_per_epoch=sum(samples.bucket_sizes.values()), batches_per_epoch=micro,
                    processes=shape.processes, train_batch_size=shape.train_batch_size,
                    gradient_accumulation_steps=shape.gradient_accumulation_steps,
                    global_batch=global_batch, steps_per_epoch=steps_per_epoch, epochs=epochs,
                    total_steps=total, warmup_steps=min(warmup, total),
                    bucket_sizes=dict(samples.bucket_sizes), class_images=samples.class_images,
                    class_images_new=samples.class_images_new)


def what_if_lines(plan: StepPlan) -> list[str]:
    """What another process count would do with the same options (train_batch_size is per process)."""
    out = []
    for p in sorted({1, 2, 4, 8} - {plan.processes}):
        gb = plan.train_batch_size * p * plan.gradient_accumulation_steps
        spe = steps_for_buckets(plan.bucket_sizes, gb)
        out.append(f"with {p} process(es): global_batch {gb}, steps_per_epoch {spe}")
    if plan.processes > 1:
        same = plan.train_batch_size * plan.processes
        out.append(f"to keep global_batch {plan.global_batch} on 1 process use "
                   f"train_batch_size {same} (or gradient_accumulation_steps x{plan.processes})")
    return out


@dataclass(frozen=True)
class GlobalBatch:
    """One optimizer step's samples, as indices into the epoch's global sample list."""
    bucket: tuple
    indices: tuple[int, ...]

    def micro_batch(self, accum_index: int, process_index: int, train_batch_size: int,
                    processes: int) -> tuple[int, ...]:
        """This process's share of micro-step ``accum_index`` (possibly empty for a partial batch).

        Samples are laid out accumulation-major, then process, then within-batch; a partial last
        batch fills the earliest slots, so every split of the same global batch covers the same
        samples.
        """
        per_micro = train_batch_size * processes
        start = accum_index * per_micro + process_index * train_batch_size
        return self.indices[start:start + train_batch_size]


def epoch_batches(bucket_of: list, seed: int, epoch: int, global_batch: int) -> list[GlobalBatch]:
    """The epoch's global batches: shuffle within each bucket, chunk, shuffle the chunks.

    ``bucket_of[i]`` is the bucket of sample ``i`` of the epoch's global list. The same
    (seed, epoch) gives the same order in every process and for every process count.
    """
    rng = random.Random(derive_seed("order", seed, epoch))
    by_bucket: dict = {}
    for i, b in enumerate(bucket_of):
        by_bucket.setdefault(tuple(b), []).append(i)
    batches = []
    for b in sorted(by_bucket):
        idx = by_bucket[b]
        rng.shuffle(idx)
        for s in range(0, len(idx), global_batch):
            batches.append(GlobalBatch(b, tuple(idx[s:s + global_batch])))
    rng.shuffle(batches)
    return batches
