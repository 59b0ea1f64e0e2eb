"""Validation loss: training images held out by ``validation_split``, evaluated at fixed
timesteps with fixed noise.

    library/data/held_out.py                    the held-out images (building the training set)
    check_options(opts)                          before any weight is loaded
    due(opts, tset, epoch=None, step=None)       whether this step / epoch end validates
    Validation(opts, tset).loss(components)      the global mean (every process calls it)

The number is comparable across runs, batch sizes and process counts:

- The split is keyed by (validation_seed, the image's place in its dataset: its folder's name and
  its path inside that folder): each dataset's images are ordered by a hash of that key and the
  first ``round(n x fraction)`` are held out (at least one, and at least one left to train), so it
  depends neither on the scan order nor the process count, nor on where the dataset lies: a
  dataset moved or copied elsewhere keeps its split.
- Each held-out image is evaluated once per validation: center crop, no flip, its caption without
  random processing (no shuffle, no dropout), at ``TIMESTEPS`` timesteps spread evenly over
  [min_timestep, max_timestep) (the midpoints of K equal slices), the k-th with plain Gaussian
  noise from a generator seeded by (validation_seed, "val", image index, k). The K evaluations of
  one image are one batch, whatever the process count, and the loss is the run's loss function
  (loss_type and SNR weighting, the image's mask with masked loss, without the training noise
  variants). FLUX.1 and SD3 take their flow loss at K fixed noise levels instead
  (flow_loss.FlowLosses.fixed_draw: FLUX sigma = (k + 1/2) / K; SD3 the midpoint timesteps of
  [min_timestep, max_timestep), sigma = t / 1000), the same noise. An inpainting model (train_inpainting) gets each held-out image's random mask drawn
  once from (validation_seed, the image's place in its dataset), and its masked-image latents.
- Image i is evaluated by process i mod P; each process writes its images' losses into a vector
  of zeros and the vectors are summed across processes (adding zeros is exact), then every process
  averages the same vector in the same order: 1 and 2 processes give bit-identical numbers.
- Validation runs in eval mode (network dropout off), without gradients, under the optimizer's
  eval weights (schedule-free), and inside ``torch.random.fork_rng``: it changes neither the
  weights nor any random draw of the training.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from library.accelerator import is_main_process
from library.data import images, inpaint_masks, latent_cache
from library.data.held_out import ValidationError, caption, place_in_dataset
from library.data.step_plan import derive_seed
from library.data.text_cache import batch as cached_batch
from library.models import inpainting
from library.training.flow_loss import FlowLosses
from library.training.losses import Draw

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options
    from accelerate import Accelerator

    from library.models.family import FamilyModel
    from library.models.loading import ModelBundle
    from library.training.methods import Method
    from library.training.stepper import Stepper

logger = logging.getLogger("sdtk")

TIMESTEPS = 4  # evaluations per image, at fixed timesteps spread over the training range


def check_options(opts: Options) -> None:
    if (opts.validate_every_n_steps or opts.validate_every_n_epochs) and not opts.validation_split:
        name = "validate_every_n_steps" if opts.validate_every_n_steps else "validate_every_n_epochs"
        raise ValidationError(f"{name} needs validation_split (the fraction of the training images "
                              "held out for the validation loss)")


def due(opts: Options, tset, *, epoch: int | None = None, step: int | None = None) -> bool:
    """After a step (``step``) or at the end of an epoch (``epoch``)."""
    if not tset.val_items:
        return False
    if step is not None:
        n = opts.validate_every_n_steps
        return n is not None and n > 0 and step % n == 0
    if epoch is None:
        raise ValueError("validation.due: an epoch or a step")
    return epoch % (opts.validate_every_n_epochs or 1) == 0


def fixed_draw(losses, noise):
    """The draw of one held-out image's K = len(noise) evaluations: ``noise`` (K, C, h, w) at
    SD's fixed ``timesteps``, or at the flow losses' own K fixed noise levels (FLUX.1, SD3:
    flow_loss.FlowLosses.fixed_draw)."""
    if isinstance(losses, FlowLosses):
        return losses.fixed_draw(noise, len(noise))
    t = torch.tensor(timesteps(losses), dtype=torch.long, device=noise.device)
    return Draw(noise=noise, input_noise=noise, timesteps=t)


def timesteps(losses) -> list[int]:
    """SD's TIMESTEPS fixed timesteps: the midpoints of equal slices of [min, max)."""
    lo, hi = losses.min_timestep, losses.max_timestep
    if hi <= lo:
        return [hi] * TIMESTEPS
    return [min(hi - 1, lo + int((k + 0.5) * (hi - lo) / TIMESTEPS)) for k in range(TIMESTEPS)]


def _seed(opts: Options) -> int:
    return opts.seed if opts.validation_seed is None else opts.validation_seed


def _key(item) -> tuple:
    return (item.path, tuple(item.bucket), tuple(item.resized_size))  # one image, two datasets


class Shares(Protocol):
    """What evaluation asks of the run's strategy (library/distributed/strategy.py)."""

    def share(self, n: int) -> list[tuple[int, bool]]: ...


@dataclass(frozen=True, slots=True)
class Evaluated:
    """The model under training as validation and the samples evaluate it: the ``bundle`` with
    the ``method``'s trained parts, its ``family_model`` (tokenize, encode, forward), on the
    ``accelerator``'s device and processes, in the ``stepper``'s eval mode (schedule-free
    optimizers' averaged weights), each process doing the ``strategy``'s share."""

    accelerator: Accelerator
    bundle: ModelBundle
    method: Method
    family_model: FamilyModel
    stepper: Stepper
    strategy: Shares

    def modules(self) -> list:
        """The modules that run in eval mode while validating or sampling: the model's and the
        method's network."""
        mods = [self.bundle.unet, *self.bundle.text_encoders]
        if self.method.network is not None:  # a method with a network module (LoRA)
            mods.append(self.method.network)
        return mods


class Validation:
    """The held-out images of a run and their latents (encoded once, in the cache stage)."""

    def __init__(self, opts: Options, tset):
        self.opts, self.tset = opts, tset
        self.items = tset.val_items
        self._latents: dict = {}  # key -> (latent (C,h,w) float32, size conditioning (6,))
        self._masks: dict = {}    # key -> (h, w) at the latent size, or None
        self._inpaint: dict = {}  # key -> (5, h, w) inpainting conditioning (train_inpainting)

    def latents(self, vae, device, item):
        """(latent (C,h,w) float32, size conditioning (6,)) of a held-out image, encoded once."""
        key = _key(item)
        if key not in self._latents:
            img, mask = images.load_for_item(item)  # masked loss: the alpha channel or mask image
            p = images.prepare_image(img, item.bucket, item.resized_size, mask=mask)
            pix = p.pixels.unsqueeze(0).to(device, dtype=vae.dtype)
            with torch.no_grad():
                lat = latent_cache.encode_pixels(vae, pix).to(torch.float32)[0].cpu()
            self._masks[key] = None if p.mask is None else images.latent_mask(p.mask, tuple(lat.shape[1:]))
            if self.opts.train_inpainting:
                self._inpaint[key] = self._inpaint_conditioning(vae, pix, item)
            self._latents[key] = (lat, torch.tensor([*p.original_size, *p.crop_top_left, *p.target_size],
                                                    dtype=torch.float32))
        return self._latents[key]

    def _inpaint_conditioning(self, vae, pix, item):
        """(5, h, w): the held-out image's mask, keyed by (validation_seed, its place in its
        dataset) as the split is, and the latents of the image masked by it."""
        h, w = pix.shape[2:]
        rng = random.Random(_derive("val-inpaint", _seed(self.opts), place_in_dataset(item)))
        mask = inpaint_masks.random_mask(w, h, rng)[None, None].to(pix.device)
        with torch.no_grad():
            masked = latent_cache.encode_pixels(vae, inpainting.masked_pixels(pix, mask))
        return inpainting.conditioning(mask, masked.to(torch.float32))[0].cpu()

    def encode_held_out(self, vae, device, strategy) -> None:
        """Encode the held-out images this process evaluates now (the cache stage), so that
        validation never needs the VAE once it has left the device (library/training/offload.py)."""
        for i, _ in strategy.share(len(self.items)):  # fsdp: every process evaluates every image
            self.latents(vae, device, self.items[i])

    def _mask(self, item, latent_hw, n: int, device):
        """Masked loss (as in training, and as sd-scripts validates): the held-out image's mask
        (ones for an image without one) repeated for its ``n`` timesteps, (n,1,h,w); None when no
        image of the run has a mask."""
        if not self.tset.masked:
            return None
        m = self._masks.get(_key(item))
        if m is None:
            m = torch.ones(tuple(latent_hw))
        return m.expand(n, *m.shape).unsqueeze(1).to(device)

    def loss(self, model: Evaluated, *, losses, batch_loss, text_cache,
             text_partial: bool = False) -> float:
        """The mean validation loss of ``model`` over every held-out image and timestep (all
        processes): the batch loss of training (library/training/batch_loss.py) at fixed
        timesteps of ``losses``; captions from ``text_cache`` (None: encoded with the model's
        family model; ``text_partial``: its frozen encoders' part, the trained encoders run now)."""
        acc, opts, items = model.accelerator, self.opts, self.items
        bundle, family_model, stepper, strategy = model.bundle, model.family_model, model.stepper, model.strategy
        n = TIMESTEPS
        mine = torch.zeros(len(items), dtype=torch.float64)
        mods = model.modules()
        modes = {m: m.training for root in mods for m in root.modules()}
        devices = [acc.device] if acc.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad(), stepper.eval_mode():
                for root in mods:
                    root.eval()
                for i, kept in strategy.share(len(items)):  # fsdp: all images, own slots kept
                    lat, size = self.latents(bundle.vae, acc.device, items[i])
                    x0 = lat.unsqueeze(0).expand(n, *lat.shape).to(acc.device)
                    noise = torch.stack([torch.randn(lat.shape, generator=torch.Generator().manual_seed(
                        _derive("val", _seed(opts), i, k))) for k in range(n)]).to(acc.device)
                    d = fixed_draw(losses, noise)
                    text = caption(items[i])

                    def conditioning(text=text):
                        if text_cache is not None:  # encoded in the cache stage (partial: joined)
                            return cached_batch(text_cache, [text] * n, acc.device, family_model, text_partial)
                        tokens = [tk.to(acc.device) for tk in family_model.tokenize([text] * n)]
                        return family_model.encode(tokens, opts.clip_skip)

                    sc = size.unsqueeze(0).expand(n, 6).to(acc.device)
                    mask = self._mask(items[i], lat.shape[1:], n, acc.device)
                    inpaint = self._inpaint.get(_key(items[i]))
                    if inpaint is not None:
                        inpaint = inpaint.unsqueeze(0).expand(n, *inpaint.shape).to(acc.device)
                    per_sample = batch_loss.per_sample(x0, d, conditioning, sc, mask,
                                                       inpaint=inpaint)
                    if kept:
                        mine[i] = float(per_sample.double().mean())
        finally:
            for m, training in modes.items():
                m.training = training
        if acc.num_processes > 1:  # each slot is non-zero in one process only: the sum is exact
            buf = mine.to(acc.device)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            mine = buf.cpu()
        return float(mine.mean())


def _derive(*key) -> int:
    return derive_seed(*key)


def run_validation(validation: Validation, progress, label: str, model: Evaluated, *, losses,
                   batch_loss, text_cache, text_partial: bool = False) -> float:
    """Compute (``validation.loss`` of ``model``), print (main process) and record
    (``progress.val_log``) the validation loss."""
    value = validation.loss(model, losses=losses, batch_loss=batch_loss, text_cache=text_cache,
                            text_partial=text_partial)
    progress.val_log.append((progress.global_step, value))
    if is_main_process():
        tqdm.write(f"validation loss {value:.6f} at step {progress.global_step}{label} "
                   f"({len(validation.items)} image(s) x {TIMESTEPS} timesteps)")
    return value
