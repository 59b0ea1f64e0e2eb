"""Aspect-ratio buckets with sd-scripts' semantics (train_util.BucketManager,
model_util.make_bucket_resolutions).

All sizes are (w, h). ``select_bucket`` returns the bucket, the size the image is resized to
before the crop, and the aspect-ratio error, exactly as sd-scripts computes them. Without
bucketing there is one bucket, ``resolution``: the image is scaled so that it covers it (the
short side relative to the bucket fits) and is then center-cropped, as sd-scripts' fixed path.
"""
from __future__ import annotations

import logging
import math

from library.data.folders import ImageItem
from library.errors import DataError

logger = logging.getLogger(__name__)


def make_bucket_resolutions(max_reso: tuple[int, int], min_size: int = 256, max_size: int = 1024,
                            divisible: int = 64) -> list[tuple[int, int]]:
    """sd-scripts' bucket list: the square of the same area, then for each width from
    ``min_size`` to ``max_size`` in ``divisible`` steps the largest height (a multiple of
    ``divisible``, at most ``max_size``) within the area, and its transpose. Sorted."""
    max_area = max_reso[0] * max_reso[1]
    resos = set()
    side = int(math.sqrt(max_area) // divisible) * divisible
    resos.add((side, side))
    width = min_size
    while width <= max_size:
        height = min(max_size, int((max_area // width) // divisible) * divisible)
        if height >= min_size:
            resos.add((width, height))
            resos.add((height, width))
        width += divisible
    return sorted(resos)


def _check_multiple_of_8(option: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0 or value % 8:
        raise DataError(f"--{option} must be a positive multiple of 8 (the VAE downsamples by 8), got {value!r}")


class BucketManager:
    def __init__(self, resolution: tuple[int, int], enable_bucket: bool, min_size: int = 256,
                 max_size: int = 1024, reso_steps: int = 64, no_upscale: bool = False,
                 log: logging.Logger = logger):
        if len(resolution) != 2 or any(not isinstance(v, int) or v <= 0 for v in resolution):
            raise DataError(f"--resolution must be W or W,H (positive), got {resolution!r}")
        self.resolution = (int(resolution[0]), int(resolution[1]))
        if not enable_bucket and (self.resolution[0] % 8 or self.resolution[1] % 8):
            # sd-scripts: images are cropped to exactly this size; the VAE then encodes it to
            # ceil-ish latent sizes that do not cover whole 8 px blocks. Same here, said once.
            log.warning(f"resolution {self.resolution[0]}x{self.resolution[1]} is not a multiple "
                        "of 8: images are cropped to it and the VAE's latents cover it only "
                        "approximately (as sd-scripts); a multiple of 8 is usual")
        self.enable_bucket = enable_bucket
        self.no_upscale = bool(no_upscale) and enable_bucket
        self.max_area = self.resolution[0] * self.resolution[1]

        if not enable_bucket:
            self.reso_steps = 0  # no buckets: one resolution, nothing rounded to steps
            self.resos = [self.resolution]
        else:
            if reso_steps % 8:
                # Bucket sides must be whole latent pixels. sd-scripts stops here (it needs 64 /
                # 32); the GUI's LyCORIS presets write 1, meaning "as fine as possible": 8.
                adjusted = reso_steps + 8 - reso_steps % 8
                log.warning(f"bucket_reso_steps {reso_steps} is not a multiple of 8 (the latent grid): "
                            f"using {adjusted}")
                reso_steps = adjusted
            if reso_steps % 64:
                log.warning(f"--bucket_reso_steps {reso_steps} is not a multiple of 64: some models "
                            "may produce artifacts at such bucket sizes")
            self.reso_steps = reso_steps
            if self.no_upscale:
                # sd-scripts: buckets then come from each image's size, min/max are not used
                log.warning("--min_bucket_reso and --max_bucket_reso are ignored with --bucket_no_upscale")
                self.resos = []
            else:
                # sd-scripts (adjust_min_max_bucket_reso_by_steps): min rounded down, max up to
                # a multiple of the step; with buckets the resolution only gives the area
                if min_size % reso_steps:
                    adjusted = min_size - min_size % reso_steps
                    log.warning(f"min_bucket_reso {min_size} is not a multiple of bucket_reso_steps "
                                f"({reso_steps}): using {adjusted}, as sd-scripts")
                    min_size = adjusted
                if max_size % reso_steps:
                    adjusted = max_size + reso_steps - max_size % reso_steps
                    log.warning(f"max_bucket_reso {max_size} is not a multiple of bucket_reso_steps "
                                f"({reso_steps}): using {adjusted}, as sd-scripts")
                    max_size = adjusted
                _check_multiple_of_8("min_bucket_reso", min_size)
                _check_multiple_of_8("max_bucket_reso", max_size)
                if min_size > max_size:
                    raise DataError(f"--min_bucket_reso ({min_size}) must not exceed --max_bucket_reso ({max_size})")
                if min(self.resolution) < min_size:
                    raise DataError(f"--min_bucket_reso ({min_size}) must not exceed the resolution's "
                                    f"short side ({min(self.resolution)})")
                if max(self.resolution) > max_size:
                    raise DataError(f"--max_bucket_reso ({max_size}) must be at least the resolution's "
                                    f"long side ({max(self.resolution)})")
                self.resos = make_bucket_resolutions(self.resolution, min_size, max_size, reso_steps)
        self._reso_set = set(self.resos)
        self._aspects = [w / h for w, h in self.resos]

    def _round_to_steps(self, x: float) -> int:
        x = int(x + 0.5)
        return x - x % self.reso_steps

    def select_bucket(self, image_width: int, image_height: int
                      ) -> tuple[tuple[int, int], tuple[int, int], float]:
        """(bucket, resized_size, ar_error) for an image of this size, as sd-scripts."""
        aspect = image_width / image_height
        if not self.no_upscale:
            reso = (image_width, image_height)
            if reso not in self._reso_set:
                # closest aspect ratio; ties go to the first (smallest) bucket, as np.argmin
                best = min(range(len(self.resos)), key=lambda i: abs(self._aspects[i] - aspect))
                reso = self.resos[best]
            # scale so the image covers the bucket: match the side that is relatively shorter
            if aspect > reso[0] / reso[1]:
                scale = reso[1] / image_height
            else:
                scale = reso[0] / image_width
            resized = (int(image_width * scale + 0.5), int(image_height * scale + 0.5))
        else:
            if image_width * image_height > self.max_area:
                # shrink to the max area keeping the aspect; round the side whose rounding
                # keeps the aspect closer (sd-scripts' logic)
                rw = math.sqrt(self.max_area * aspect)
                rh = self.max_area / rw
                bw = self._round_to_steps(rw)
                bh_in_w = self._round_to_steps(bw / aspect)
                bh = self._round_to_steps(rh)
                bw_in_h = self._round_to_steps(bh * aspect)
                ar_w = bw / bh_in_w if bh_in_w else math.inf
                ar_h = bw_in_h / bh if bh else math.inf
                if abs(ar_w - aspect) < abs(ar_h - aspect):
                    resized = (bw, int(bw / aspect + 0.5))
                else:
                    resized = (int(bh * aspect + 0.5), bh)
            else:
                resized = (image_width, image_height)
            # bucket = resized size rounded down to steps: crop, never pad
            reso = (resized[0] - resized[0] % self.reso_steps, resized[1] - resized[1] % self.reso_steps)
            if reso[0] < 8 or reso[1] < 8:
                raise DataError(f"image of {image_width}x{image_height} is smaller than one bucket step "
                                f"({self.reso_steps}) with --bucket_no_upscale")
        ar_error = reso[0] / reso[1] - aspect
        return reso, resized, ar_error

    def assign(self, items: list[ImageItem], log: logging.Logger = logger,
               stats=None) -> list[ImageItem]:
        """Set ``bucket`` and ``resized_size`` on each item; items that fit no bucket are
        skipped with one warning line naming the file (and counted in ``stats``, a
        ``data.ScanStats``). Images smaller than their bucket on both sides are upscaled, as
        sd-scripts does, announced in one line with the count. Returns the kept items."""
        kept, upscaled = [], []
        for it in items:
            try:
                it.bucket, it.resized_size, _ = self.select_bucket(*it.size)
            except DataError as e:
                log.warning(f"skipping image {it.path}: {e}")
                if stats is not None:
                    stats.too_small.append(it.path)
                continue
            if it.size[0] < it.bucket[0] and it.size[1] < it.bucket[1]:
                upscaled.append(it)
            kept.append(it)
        if upscaled:
            smallest = min(upscaled, key=lambda it: it.size[0] * it.size[1])
            log.warning(f"{len(upscaled)} image(s) are smaller than their bucket and are upscaled "
                        f"(smallest: {smallest.path}, {smallest.size[0]}x{smallest.size[1]}); "
                        "bucket_no_upscale keeps them at their size instead")
        return kept
