"""The training set of a run: the epoch's global sample list and the loading of micro-batches.

Glue between the data modules (scan, dataset config, buckets, images, latent cache) and the
training loop. Building the set reads image headers (and decodes each image once to skip broken
files), so the step plan is known before any weight loads.

Augmentation is keyed to the sample, not to the process (DESIGN.md "Randomness is keyed to the
sample"): sample ``i`` of epoch ``e`` draws its caption processing, flip and random crop from
generators seeded by ``derive_seed(kind, seed, e, i)`` (color_aug too), so 1 process x batch 2 and 2 processes x
batch 1 see the same captions and pixels.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any
import dataclasses
import os
import random
import re
from dataclasses import dataclass, field

from library.config.dataset_config import resolve_dataset_config, run_caption_options
from library.config.parse import required
from library.data import buckets, class_images, color_aug, folders, inpaint_masks
from library.data.held_out import split_items
from library.data.step_plan import EpochSamples, derive_seed
from library.errors import DataError

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options


@dataclass
class TrainingSet:
    train_items: list          # unique training images, bucket assigned
    reg_items: list            # unique regularisation images, bucket assigned
    samples: list              # the epoch's global list (repeats and reg balancing applied)
    seed: int = 0
    batch_size: int | None = None  # set when the dataset config fixes the per-process batch size
    resolution: tuple | None = None  # the (first) dataset's resolution, for the metadata
    resolutions: tuple = ()  # every dataset's resolution (W, H) (SD3's enable_scaled_pos_embed)
    text_variants: int = 4  # text_encoder_cache_variants
    stats: folders.ScanStats = field(default_factory=folders.ScanStats)
    val_items: list = field(default_factory=list)  # held out by validation_split (validation.py)
    masked: bool = False  # masked loss: some image has a mask (alpha_mask or conditioning_data_dir)
    # textual inversion's use_object_template / use_style_template: every caption is one of these
    # (each with the token string in it), drawn per sample and epoch, as sd-scripts replaces them
    caption_templates: tuple | None = None
    total_steps: int | None = None  # the run's steps (plan): token_warmup_step below 1 is a fraction
    inpainting: bool = False  # train_inpainting: prepare() draws each sample's random mask
    # num_class_images: every planned class image of the reg folders (library/data/class_images.py);
    # library/outputs/class_images.py makes the missing ones before the model loads
    class_images: list = field(default_factory=list)
    # cached_caption's memo: each (path, caption options, caption)'s variants, computed once
    _variants: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def per_dataset_multiplier(self) -> bool:
        """Whether datasets differ in network_multiplier: a batch then holds one multiplier's
        samples (the network runs at one multiplier per forward)."""
        return len({s.network_multiplier for s in self.samples}) > 1

    @property
    def bucket_of(self) -> list:
        """Each sample's batch key: its bucket, and its network multiplier where datasets set
        their own (so one global batch trains at one multiplier, whatever the process count)."""
        if self.per_dataset_multiplier:
            return [(*s.bucket, s.network_multiplier) for s in self.samples]
        return [s.bucket for s in self.samples]

    def bucket_sizes(self) -> dict:
        """Samples per epoch of each batch key (bucket_of)."""
        sizes: dict = {}
        for key in self.bucket_of:
            key = tuple(key)
            sizes[key] = sizes.get(key, 0) + 1
        return sizes

    def epoch_samples(self) -> EpochSamples:
        """What one epoch holds, for the step plan (class images still to make: checked now)."""
        return EpochSamples(self.bucket_sizes(), len(self.train_items), self.repeats_total,
                            len(self.reg_items), self.reg_samples, len(self.class_images),
                            len(class_images.to_make(self.class_images)))

    def multiplier(self, idx) -> float | None:
        """The network multiplier of a batch's samples (one per batch by bucket_of): their
        dataset's network_multiplier (dataset config), or None (folders: the run's)."""
        return self.samples[idx[0]].network_multiplier if idx else None

    @property
    def repeats_total(self) -> int:
        return sum(it.num_repeats for it in self.train_items)

    @property
    def reg_samples(self) -> int:
        return sum(1 for s in self.samples if s.is_reg)

    # -- per-sample augmentation (keyed by seed, epoch, sample index) ---------------------------
    def caption(self, i: int, epoch: int, step: int | None = None) -> str:
        """Sample ``i``'s caption in ``epoch``, trained in optimizer step ``step`` (the steps done
        before it: token warmup; None: after the warmup)."""
        if self.caption_templates:
            rng = random.Random(derive_seed("template", self.seed, epoch, i))
            return rng.choice(self.caption_templates)
        s = self.samples[i]
        if s.captions is None:
            return s.caption
        rng = random.Random(derive_seed("caption", self.seed, epoch, i))
        return folders.process_caption(s.caption, s.captions, epoch, rng, step, self.total_steps)

    def caption_variants(self, item) -> list[str]:
        """The processed captions the text-encoder cache holds for ``item`` (dropout aside): one
        when nothing random applies, else ``text_variants`` distinct draws of the shuffle / tag
        dropout (fewer if the caption has fewer), each from a generator keyed by (seed, image
        path, draw)."""
        o = item.captions
        if o is None:
            return [item.caption]
        nodrop = dataclasses.replace(o, caption_dropout_rate=0.0, caption_dropout_every_n_epochs=0)
        n = self.text_variants if o.draws else 1
        # Distinct variants (a repeated draw would waste a cache slot), as long as the caption has
        # that many; a bounded number of draws keeps it deterministic and finite.
        out: list[str] = []
        for v in range(8 * n):
            c = folders.process_caption(item.caption, nodrop, 0,
                                     random.Random(derive_seed("te-variant", self.seed, item.path, v)))
            if c not in out:
                out.append(c)
                if len(out) == n:
                    break
        return out

    @staticmethod
    def uses_empty_caption(item) -> bool:
        o = item.captions
        return o is not None and (o.caption_dropout_rate > 0 or o.caption_dropout_every_n_epochs > 0)

    def cached_caption(self, i: int, epoch: int) -> str:
        """Sample ``i``'s caption for ``epoch`` among the cached ones: the empty caption when
        caption dropout draws it (the same draw as ``caption``), else one variant picked by a
        generator keyed by (seed, epoch, sample)."""
        s = self.samples[i]
        o = s.captions
        if o is not None:
            rng = random.Random(derive_seed("caption", self.seed, epoch, i))
            drop = o.caption_dropout_rate > 0 and rng.random() < o.caption_dropout_rate
            if drop or (o.caption_dropout_every_n_epochs > 0 and epoch % o.caption_dropout_every_n_epochs == 0):
                return ""
        memo = self._variants
        key = (s.path, s.captions, s.caption)
        if key not in memo:
            memo[key] = self.caption_variants(s)
        variants = memo[key]
        if len(variants) == 1:
            return variants[0]
        return variants[random.Random(derive_seed("te-pick", self.seed, epoch, i)).randrange(len(variants))]

    def flip(self, i: int, epoch: int) -> bool:
        if not self.samples[i].flip_aug:
            return False
        return random.Random(derive_seed("flip", self.seed, epoch, i)).random() < 0.5

    def color(self, i: int, epoch: int):
        """Sample ``i``'s color_aug decision for ``epoch`` (None: unchanged)."""
        if not self.samples[i].color_aug:
            return None

        return color_aug.draw(random.Random(derive_seed("color", self.seed, epoch, i)))

    def inpaint_mask(self, i: int, epoch: int, height: int, width: int):
        """Sample ``i``'s random inpainting mask for ``epoch`` (train_inpainting), (height, width)
        at the prepared image's size, 1 = regenerate (library/data/inpaint_masks.py)."""
        rng = random.Random(derive_seed("inpaint-mask", self.seed, epoch, i))
        return inpaint_masks.random_mask(width, height, rng)

    def prepare(self, i: int, epoch: int):
        """Sample ``i``'s pixels for ``epoch``: resize, crop (random when the subset says so),
        color_aug (when it draws a change), flip (when flip_aug draws it); its mask (masked loss)
        gets the same geometry."""
        # lazy: the training set (the plan) is built without torch
        import functools

        import torch

        from library.data import images

        s = self.samples[i]
        g = None
        if s.random_crop:
            g = torch.Generator().manual_seed(derive_seed("crop", self.seed, epoch, i))
        aug = self.color(i, epoch)
        color = None if aug is None else functools.partial(color_aug.apply, aug=aug)
        img, mask = images.load_for_item(s)
        p = images.prepare_image(img, s.bucket, s.resized_size, flip=self.flip(i, epoch),
                                 random_crop=s.random_crop, generator=g, mask=mask, color=color)
        if self.inpainting:  # drawn here, in the DataLoader worker, on the prepared pixels' size
            p.inpaint_mask = self.inpaint_mask(i, epoch, *p.pixels.shape[1:])
        return p


def _bucket_manager(resolution, enable_bucket, min_reso, max_reso, steps, no_upscale, where=None):
    try:
        return buckets.BucketManager(resolution=tuple(resolution), enable_bucket=enable_bucket,
                                     min_size=min_reso, max_size=max_reso, reso_steps=steps,
                                     no_upscale=no_upscale)
    except DataError as e:
        if where is None:
            raise
        raise DataError(f"{where}: {e}") from None


def build_training_set(opts: Options, log) -> TrainingSet:
    """Scan the images (dataset config or train_data_dir/reg_data_dir), assign buckets, balance
    the reg images per dataset (sd-scripts' rule) and expand repeats into the epoch's list."""
    stats = folders.ScanStats()
    batch_size = None
    held_out: list = []  # validation_split: training images held out (each dataset's own share)
    planned: list = []  # num_class_images: the class images of the reg folders
    resolution = opts.resolution
    resolutions = () if resolution is None else (tuple(resolution),)
    if opts.dataset_config:
        train, reg, samples, batch_size, resolutions = _from_dataset_config(opts, log, stats, held_out,
                                                                            planned)
        resolution = resolutions[0]
    else:
        train, reg, samples = _from_folders(opts, log, stats, held_out, planned)
    cache = opts.cache_latents or opts.cache_latents_to_disk
    if cache:
        for key, why in (("random_crop", "a random crop"), ("color_aug", "a color augmentation")):
            item = next((it for it in train + reg if getattr(it, key)), None)
            if item is not None:  # sd-scripts asserts the same (is_latent_cacheable)
                raise DataError(f"{key} cannot be combined with cache_latents (set for "
                                     f"{item.image_dir}): {why} differs per sample and epoch, "
                                     "so its latents cannot be cached; turn one of them off")
    masked = _check_masks(opts, train + reg + held_out)
    _check_network_keys(opts, train + reg)
    summary = stats.summary()
    if summary:
        log.warning(summary)
    tset = TrainingSet(train_items=train, reg_items=reg, samples=samples,
                       seed=opts.seed, batch_size=batch_size,
                       resolution=resolution, resolutions=resolutions,
                       text_variants=opts.text_encoder_cache_variants, stats=stats,
                       val_items=held_out, masked=masked, caption_templates=_templates(opts),
                       inpainting=opts.train_inpainting, class_images=planned)
    if opts.script == "train_textual_inversion" and not tset.caption_templates:
        _check_token_in_captions(tset, opts.token_string)
    return tset


def _check_network_keys(opts: Options, items: list) -> None:
    """Dataset keys that act on the network (network_multiplier, diff_output_preservation) need
    a network to act on; token warmup changes a caption every step, which a text-encoder cache
    cannot hold (sd-scripts refuses both too)."""
    where = opts.dataset_config_path or "the run config"
    if opts.script != "train_lora":
        run = opts.network_multiplier
        for key, used in (("network_multiplier",
                           lambda it: it.network_multiplier not in (None, run)),
                          ("custom_attributes.diff_output_preservation", lambda it: it.dop)):
            item = next((it for it in items if used(it)), None)
            if item is not None:
                raise DataError(f"{where}: {key} (set for {item.image_dir}) acts on the "
                                     f"network of train_lora; {opts.script} trains no network")
    if opts.cache_text_encoder_outputs or opts.cache_text_encoder_outputs_to_disk:
        item = next((it for it in items if it.captions is not None
                     and it.captions.token_warmup_step > 0), None)
        if item is not None:
            raise DataError(f"token_warmup_step (set for {item.image_dir}) cannot be combined "
                                 "with cache_text_encoder_outputs: the caption changes every step "
                                 "of the warmup")


def _check_token_in_captions(tset: TrainingSet, token: str | None) -> None:
    """Textual inversion learns from the captions that contain the token: with none, nothing
    would train (a zero gradient every step)."""
    if not token:
        return  # the method says token_string is required
    word = re.compile(rf"(?<![\w]){re.escape(token)}(?![\w])")
    if not any(word.search(tset.caption(i, 1)) for i in range(len(tset.samples))):
        raise DataError(f"token_string {token!r} is in no training caption, so nothing would "
                             "train: put it in the captions (or caption_prefix), or use "
                             "use_object_template / use_style_template")


def _templates(opts: Options) -> tuple | None:
    """sd-scripts' template captions of textual inversion, with the token string filled in."""
    if opts.script != "train_textual_inversion":
        return None
    # lazy: the training set (the plan) is built without torch
    from library.models.families.sd_common import embeddings  # torch: only for a textual-inversion run
    if opts.use_object_template and opts.use_style_template:
        raise DataError("use_object_template and use_style_template exclude each other")
    if not (opts.use_object_template or opts.use_style_template):
        return None
    chosen = embeddings.OBJECT_TEMPLATES if opts.use_object_template else embeddings.STYLE_TEMPLATES
    return tuple(t.format(opts.token_string) for t in chosen)


def _check_masks(opts: Options, items: list) -> bool:
    """Masked loss: whether some image has a mask; ``masked_loss`` with no mask source is an
    error (it would change nothing). ``alpha_mask`` implies the masked loss, as in sd-scripts."""
    masked = any(it.alpha_mask or it.mask_path for it in items)
    if opts.masked_loss and not masked:
        raise DataError("masked_loss: no image has a mask; set alpha_mask (the images' alpha "
                             "channel) or conditioning_data_dir (a folder of mask images named "
                             "like the images), as a run option or per subset")
    return masked


def _item_fields(opts: Options) -> dict:
    captions = run_caption_options(opts)
    return dict(captions=None if captions.is_identity else captions,
                flip_aug=opts.flip_aug,
                random_crop=opts.random_crop,
                color_aug=opts.color_aug,
                cache_dir=opts.cache_dir,
                alpha_mask=opts.alpha_mask)


def _mask_folder(opts: Options, alpha_mask: bool, folder: str | None, where: str) -> str | None:
    """conditioning_data_dir of a set of images, checked: it needs masked_loss (as sd-scripts,
    where the key otherwise means ControlNet conditioning images) and excludes alpha_mask."""
    if not folder:
        return None
    if not opts.masked_loss:
        raise DataError(f"{where}: conditioning_data_dir (mask images) needs masked_loss = true")
    if alpha_mask:
        raise DataError(f"{where}: alpha_mask and conditioning_data_dir are both set: the mask "
                             "comes from one of them; unset the other")
    return folder


def _from_folders(opts: Options, log, stats, held_out, planned):
    fields = _item_fields(opts)
    if opts.in_json:  # fine-tuning metadata; train_data_dir is the image folder
        train = folders.scan_metadata(opts.in_json, opts.train_data_dir, num_repeats=opts.dataset_repeats,
                                   option="in_json", log=log, stats=stats, **fields)
    else:
        if opts.dataset_repeats != 1:
            raise DataError("dataset_repeats applies to in_json metadata only; N_concept "
                                 "folders give their repeats in the folder name")
        train = folders.scan_concept_dirs(required(opts.train_data_dir, "train_data_dir"), opts.caption_extension, is_reg=False,
                                       log=log, option="train_data_dir", stats=stats, **fields)
    # conditioning_data_dir (a run option): masks of the training images, looked up by stem;
    # regularisation images are trained unmasked
    folder = _mask_folder(opts, fields["alpha_mask"], opts.conditioning_data_dir,
                          "conditioning_data_dir")
    if folder:
        folders.attach_masks(train, folder, "conditioning_data_dir")
    reg = []
    if opts.reg_data_dir and opts.num_class_images:
        reg = _reg_with_class_images(opts, log, stats, fields, planned)
    elif opts.reg_data_dir:
        reg = folders.scan_concept_dirs(opts.reg_data_dir, opts.caption_extension, is_reg=True,
                                     log=log, option="reg_data_dir", stats=stats, **fields)
    bm = _bucket_manager(opts.resolution, opts.enable_bucket, opts.min_bucket_reso,
                         opts.max_bucket_reso, opts.bucket_reso_steps, opts.bucket_no_upscale)
    train = bm.assign(train, log, stats)
    reg = bm.assign(reg, log, stats)
    if not train:
        raise DataError(f"train_data_dir {opts.train_data_dir}: no image fits a bucket")
    train = _hold_out(train, opts, held_out, "train_data_dir")
    reg_used = folders.balance_regularization(train, reg)
    samples = folders.expand_repeats(train) + folders.expand_repeats(reg_used)
    return train, reg, samples


def _reg_with_class_images(opts: Options, log, stats, fields, planned) -> list:
    """reg_data_dir's images with each N_class folder filled up to num_class_images (an empty
    folder too) by planned class images, after the folder's own images."""
    root = required(opts.reg_data_dir, "reg_data_dir")
    if not os.path.isdir(root):
        raise DataError(f"reg_data_dir {root!r} does not exist or is not a directory")
    found = class_images.concept_folders(root)
    if not found:
        raise DataError(f"reg_data_dir {root} has no N_concept folders (e.g. 1_dog)")
    reg = []
    for folder, repeats, tokens in found:
        own = folders.scan_image_folder(folder, num_repeats=repeats, class_tokens=tokens,
                                        caption_extension=opts.caption_extension, is_reg=True,
                                        log=log, stats=stats, **fields)
        made, plan = class_images.plan_folder(opts, folder, tokens, len(own), repeats,
                                              opts.resolution, f"reg_data_dir folder {folder}", fields)
        reg += own + made
        planned += plan
    return reg


def _from_dataset_config(opts: Options, log, stats, held_out, planned):
    path = opts.dataset_config_path or "the run config"
    datasets = resolve_dataset_config(required(opts.dataset_config, "dataset_config"), path, opts)
    for name in ("train_data_dir", "reg_data_dir"):
        if getattr(opts, name):
            log.warning(f"{name} is ignored: the dataset config in {path} lists the images")
    sizes = {ds.batch_size for ds in datasets}
    if len(sizes) > 1:
        detail = ", ".join(f"{ds.where}: {ds.batch_size}" for ds in datasets)
        raise DataError(
            f"{path}: datasets have different batch_size ({detail}); a step is one global batch "
            "from one bucket (train_batch_size x processes x accumulation), so per-dataset batch "
            "sizes cannot be honoured exactly: give every dataset the same batch_size")
    train, reg, samples = [], [], []
    for ds in datasets:
        bm = _bucket_manager(ds.resolution, ds.enable_bucket, ds.min_bucket_reso, ds.max_bucket_reso,
                             ds.bucket_reso_steps, ds.bucket_no_upscale, where=f"{path}: {ds.where}")
        ds_train: list[folders.ImageItem] = []
        ds_reg: list[folders.ImageItem] = []
        for sub in ds.subsets:
            caps = sub.captions
            sub_fields: dict[str, Any] = dict(captions=None if caps.is_identity else caps, flip_aug=sub.flip_aug,
                              random_crop=sub.random_crop, color_aug=sub.color_aug,
                              cache_dir=opts.cache_dir,
                              alpha_mask=sub.alpha_mask,
                              network_multiplier=float(ds.network_multiplier),
                              dop=bool(sub.custom_attributes.get("diff_output_preservation")))
            where = f"{path}: {sub.where}.conditioning_data_dir"
            folder = _mask_folder(opts, sub.alpha_mask, sub.conditioning_data_dir, where)
            if getattr(sub, "metadata_file", None):  # a fine-tuning subset
                items = folders.scan_metadata(str(sub.metadata_file), sub.image_dir,
                                           num_repeats=sub.num_repeats, is_reg=sub.is_reg,
                                           option=f"{path}: {sub.where}.metadata_file", log=log,
                                           stats=stats, **sub_fields)
            else:
                items = folders.scan_image_folder(
                    sub.image_dir, num_repeats=sub.num_repeats, class_tokens=sub.class_tokens,
                    caption_extension=sub.caption_extension, is_reg=sub.is_reg, log=log,
                    stats=stats, **sub_fields)
            if not items:
                concept = [n for n in sorted(os.listdir(sub.image_dir))
                           if folders.parse_concept_dir_name(n) and os.path.isdir(os.path.join(sub.image_dir, n))]
                if concept:
                    raise DataError(
                        f"{path}: {sub.where}.image_dir: {sub.image_dir} holds N_concept folders "
                        f"({concept[0]}, ...) but no images: a subset's image_dir is the folder of "
                        "the images themselves (one subset per folder, with num_repeats and "
                        "class_tokens), or use train_data_dir")
                if not (sub.is_reg and opts.num_class_images):  # else filled with class images
                    log.warning(f"{path}: {sub.where}: no usable images in {sub.image_dir}")
            if folder:
                folders.attach_masks(items, folder, where)
            if sub.is_reg and opts.num_class_images and not getattr(sub, "metadata_file", None):
                made, plan = class_images.plan_folder(
                    opts, sub.image_dir, sub.class_tokens, len(items), sub.num_repeats, ds.resolution,
                    f"{path}: {sub.where}", sub_fields)
                items += made
                planned += plan
            (ds_reg if sub.is_reg else ds_train).extend(items)
        ds_train = bm.assign(ds_train, log, stats)
        ds_reg = bm.assign(ds_reg, log, stats)
        if not ds_train:
            raise DataError(f"{path}: {ds.where}: no usable training image (subsets with "
                                 "is_reg = false)")
        ds_train = _hold_out(ds_train, opts, held_out, f"{path}: {ds.where}")
        reg_used = folders.balance_regularization(ds_train, ds_reg)
        train += ds_train
        reg += ds_reg
        samples += folders.expand_repeats(ds_train) + folders.expand_repeats(reg_used)
    return train, reg, samples, sizes.pop(), tuple(tuple(ds.resolution) for ds in datasets)


def _hold_out(items: list, opts: Options, held_out: list, where: str) -> list:
    """validation_split: move this dataset's held-out images to ``held_out``; returns the rest."""
    if not opts.validation_split:
        return items

    train, val = split_items(items, opts.validation_split, _validation_seed(opts), where)
    held_out.extend(val)
    return train


def _validation_seed(opts: Options) -> int:
    v = opts.validation_seed
    return opts.seed if v is None else v


class ImageBatch(list):
    """The prepared images of one micro-batch (``PreparedImage`` each, in the batch's order) and
    their pixels stacked once, where they were prepared (a DataLoader worker): one tensor to pin
    and to copy to the device."""

    def __init__(self, images: list):
        super().__init__(images)
        # lazy: the dry run's plan loads this module before torch; torch is imported when __init__()
        # runs
        import torch

        self.pixels = torch.stack([p.pixels for p in images]) if images else None
        # train_inpainting: the samples' random masks (B, H, W), stacked with the pixels
        self.inpaint_masks = (torch.stack([p.inpaint_mask for p in images])
                              if images and images[0].inpaint_mask is not None else None)

    def pin_memory(self):
        """Called by the DataLoader's pinning thread (pin_memory=True): page-locked pixels, so
        the copy to the GPU can run while the host prepares the next step."""
        if self.pixels is not None:
            self.pixels = self.pixels.pin_memory()
        if self.inpaint_masks is not None:
            self.inpaint_masks = self.inpaint_masks.pin_memory()
        return self

    def pixels_on(self, device, dtype):
        """The stacked pixels on ``device`` in ``dtype``: copied without waiting when pinned
        (the kernels that read them are queued after the copy on the same stream)."""
        pix = self.pixels.to(device, non_blocking=self.pixels.is_pinned())
        return pix.to(dtype)


class _SampleImages:
    """Map-style dataset keyed by ``(epoch, sample indices)``: the key carries the epoch, so
    persistent workers (which keep the copy of the dataset they started with) prepare any
    epoch's batch, with the sample-keyed flip, crop and color_aug of that epoch."""

    def __init__(self, tset: TrainingSet):
        self.tset = tset

    def __getitem__(self, key):
        epoch, idx = key
        return ImageBatch([self.tset.prepare(i, epoch) for i in idx])


class _EpochKeys:
    """The DataLoader's sampler: the keys of the current epoch, read when an epoch's iteration
    starts (in the training process)."""

    def __init__(self):
        self.keys: list = []

    def __iter__(self):
        return iter(list(self.keys))

    def __len__(self):
        return len(self.keys)


def _as_is(batch):
    return batch


def loader_workers(requested: int | None, device_type: str, processes: int) -> int:
    """DataLoader workers of a run without cached latents: ``max_data_loader_n_workers`` when
    set; unset, on CUDA min(8, the CPU cores of this process's share), else 0 (on a CPU-only
    machine the workers would take cores from the training's own kernels)."""
    if requested is not None:
        return requested
    if device_type != "cuda":
        return 0
    return max(1, min(8, (os.cpu_count() or 1) // max(1, processes)))


class ImageLoader:
    """Decodes and augments the images of the micro-batches a process trains (runs without
    cached latents): in ``workers`` DataLoader worker processes (0: in this process), pinned
    when the run computes on CUDA, one DataLoader for the whole run so that
    ``persistent`` workers survive from one epoch to the next."""

    def __init__(self, tset: TrainingSet, workers: int, persistent: bool, pin: bool):
        # lazy: the dry run's plan loads this module before torch; torch is imported when __init__()
        # runs
        import torch
        from torch.utils.data import DataLoader

        self.dataset = _SampleImages(tset)
        self._keys = _EpochKeys()
        self.workers = workers
        # every iter() of a DataLoader draws its workers' base seed from its generator; with none,
        # from torch's global one, which network dropout draws from and a resume restores: a
        # resumed run starts its epoch's iterator at another point of the stream and its dropout
        # masks would differ. The augmentation is keyed per sample, so the workers' seeds need
        # no other source.
        self.loader = DataLoader(self.dataset, sampler=self._keys, batch_size=None,
                                 collate_fn=_as_is, num_workers=workers, pin_memory=pin,
                                 persistent_workers=persistent and workers > 0,
                                 generator=torch.Generator().manual_seed(0))

    def epoch(self, epoch: int, batches: list):
        """An iterator over the ``ImageBatch`` of each of ``batches`` (lists of sample indices)."""
        self._keys.keys = [(epoch, tuple(b)) for b in batches]
        return iter(self.loader)

    def load(self, epoch: int, idx: list) -> ImageBatch:
        """One batch prepared here and now (e.g. the zero-weight sample of an empty share)."""
        return self.dataset[(epoch, tuple(idx))]
