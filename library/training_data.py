"""The training set of a run: the epoch's global sample list and the loading of micro-batches.

Glue between the data modules (scan, buckets, images, latent cache) and the training loop.
Building the set reads image headers only, so the step plan is known before any weight loads.
"""
from __future__ import annotations

from dataclasses import dataclass

from library import buckets, data


@dataclass
class TrainingSet:
    train_items: list          # unique training images, bucket assigned
    reg_items: list            # unique regularisation images, bucket assigned
    samples: list              # the epoch's global list (repeats and reg balancing applied)

    @property
    def bucket_of(self) -> list:
        return [s.bucket for s in self.samples]

    def bucket_sizes(self) -> dict:
        sizes: dict = {}
        for s in self.samples:
            sizes[s.bucket] = sizes.get(s.bucket, 0) + 1
        return sizes

    @property
    def repeats_total(self) -> int:
        return sum(it.num_repeats for it in self.train_items)

    @property
    def reg_samples(self) -> int:
        return sum(1 for s in self.samples if s.is_reg)


def build_training_set(opts, log) -> TrainingSet:
    if getattr(opts, "dataset_config", None):
        where = getattr(opts, "dataset_config_path", None) or "the run config"
        raise data.DataError(f"{where}: the dataset config ([general] / [[datasets]]) is not "
                             "supported yet; use train_data_dir (and reg_data_dir) for now")
    train = data.scan_concept_dirs(opts.train_data_dir, opts.caption_extension, is_reg=False,
                                   log=log, option="train_data_dir")
    reg = []
    if getattr(opts, "reg_data_dir", None):
        reg = data.scan_concept_dirs(opts.reg_data_dir, opts.caption_extension, is_reg=True,
                                     log=log, option="reg_data_dir")
    bm = buckets.BucketManager(resolution=tuple(opts.resolution), enable_bucket=opts.enable_bucket,
                               min_size=opts.min_bucket_reso, max_size=opts.max_bucket_reso,
                               reso_steps=opts.bucket_reso_steps, no_upscale=opts.bucket_no_upscale)
    train = bm.assign(train, log)
    reg = bm.assign(reg, log)
    if not train:
        raise data.DataError(f"train_data_dir {opts.train_data_dir}: no image fits a bucket")
    reg_used = data.balance_regularization(train, reg)
    samples = data.expand_repeats(train) + data.expand_repeats(reg_used)
    return TrainingSet(train_items=train, reg_items=reg, samples=samples)


class MicroBatchImages:
    """Map-style dataset: element k is the prepared images of one micro-batch (for a DataLoader)."""

    def __init__(self, samples: list, batches: list):
        self.samples = samples
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, k):
        from library import images

        out = []
        for i in self.batches[k]:
            s = self.samples[i]
            img = images.load_image(s.path)
            out.append(images.prepare_image(img, s.bucket, s.resized_size))
        return out
