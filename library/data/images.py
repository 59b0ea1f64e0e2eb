"""Image loading and the resize/crop/flip that turns an image into a bucket-sized tensor.

Resize as sd-scripts' ``trim_and_resize_if_required``: to ``resized_size`` first, then crop to
the bucket (center by default). sd-scripts downscales with OpenCV's INTER_AREA and upscales with
PIL's LANCZOS; we use PIL only: ``Image.Resampling.BOX`` for a downscale (an area average, as
INTER_AREA) and ``LANCZOS`` otherwise, so pixel values differ slightly from sd-scripts'.

SDXL size conditioning (all (h, w) / (top, left), as the U-Net's ``add_time_ids`` order):
- ``original_size``: the source image size before any resize (sd-scripts: the same).
- ``crop_top_left``: where the bucket-sized crop starts in the resized image, mirrored
  horizontally when flipped (left' = resized_w - left - bucket_w). This is SDXL's own definition
  (the crop offset). sd-scripts instead derives it from a letterbox fit of the original aspect
  into the bucket (``get_crop_ltrb``), which is 0 on the cropped axis and nonzero on the other,
  and ignores random crops; that is the known inaccuracy we do not reproduce.
- ``target_size``: the bucket.

Masked loss (``load_for_item``): the mask is an 8-bit image resized, cropped and flipped exactly
like the pixels (same resize rule, same crop offsets), then /255 -> [0, 1] at the bucket size:
- ``alpha_mask``: the image's alpha channel (1 where an image has none, as sd-scripts). The
  colour channels are then used as stored, not composited over white (sd-scripts reads the RGB
  of the RGBA image); without alpha_mask transparent images are composited as before.
- a mask image (``conditioning_data_dir``): its first (red) channel after PIL's RGB conversion
  (a greyscale mask: its grey value), as sd-scripts' ``apply_masked_loss`` reads the red channel
  of the conditioning image. A mask of another size (same aspect ratio) is resized to the
  image's resized size.
``latent_mask`` brings a mask to the latent size by area averaging (sd-scripts'
``interpolate(..., mode="area")``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps

from library.errors import DataError, first_line


@dataclass
class PreparedImage:
    pixels: torch.Tensor  # (3, H, W) float32 in [-1, 1]
    original_size: tuple[int, int]  # (h, w) of the source image (after EXIF orientation)
    crop_top_left: tuple[int, int]  # (top, left) in resized coordinates, after flip
    target_size: tuple[int, int]  # (h, w) = bucket
    mask: torch.Tensor | None = None  # (H, W) float32 in [0, 1] (masked loss), else None
    # (H, W) float32 in {0, 1}, 1 = regenerate: the sample's random mask (train_inpainting)
    inpaint_mask: torch.Tensor | None = None


def load_image(path: str) -> Image.Image:
    """Decode ``path`` to an RGB image, EXIF orientation applied.

    Alpha (RGBA, LA, P with transparency) is composited on white rather than dropped, so
    transparent areas do not turn into whatever colour the hidden pixels hold. CMYK, L, I;16 and
    palette images go through PIL's conversion. Decode errors -> DataError naming the file.
    """
    return _decode(path, _to_rgb)


def _decode(path: str, convert, what: str = "image"):
    """Open ``path``, apply EXIF orientation and ``convert``; decode errors -> DataError."""
    try:
        with Image.open(path) as img:
            img.load()
            return convert(ImageOps.exif_transpose(img))
    except DataError:
        raise
    except Exception as e:  # PIL raises many types for malformed files
        reason = first_line(e)
        raise DataError(f"cannot decode {what} {path}: {reason}") from None


_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


def _split_alpha(img: Image.Image) -> tuple[Image.Image, Image.Image | None]:
    """(RGB as stored, alpha channel "L") of an image with transparency; (RGB, None) otherwise."""
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in _ALPHA_MODES:
        rgba = img.convert("RGBA")
        return rgba.convert("RGB"), rgba.getchannel("A")
    return _to_rgb(img), None


def load_image_and_alpha(path: str) -> tuple[Image.Image, Image.Image | None]:
    """``alpha_mask``: the colour channels as stored and the alpha channel ("L"; None when the
    image has no transparency, i.e. a mask of ones)."""
    return _decode(path, _split_alpha)


def _mask_channel(img: Image.Image) -> Image.Image:
    if img.mode.startswith("I;16") or img.mode == "I":
        return _to_rgb(img).getchannel("R")  # 16-bit grey: scaled to 8 bit, not clipped
    return img.convert("RGB").getchannel("R")


def load_mask(path: str) -> Image.Image:
    """A mask image (conditioning_data_dir) -> its red channel as "L" (0 = ignored, 255 = full
    weight); PIL's RGB conversion first, as sd-scripts loads it (a grey image: the grey value)."""
    return _decode(path, _mask_channel, "mask image")


def load_for_item(item) -> tuple[Image.Image, Image.Image | None]:
    """(RGB image, mask "L" or None) of a dataset item: the alpha channel with ``alpha_mask``,
    the mask image with ``mask_path``, else no mask (the image composited as ``load_image``)."""
    if item.alpha_mask:
        rgb, alpha = load_image_and_alpha(item.path)
        return rgb, (alpha if alpha is not None else Image.new("L", rgb.size, 255))
    if item.mask_path:
        return load_image(item.path), load_mask(item.mask_path)
    return load_image(item.path), None


def latent_mask(mask: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
    """(H, W) or (B, H, W) mask -> the same at ``latent_hw`` by area averaging (sd-scripts'
    interpolate mode "area"; an exact 8x8 mean for a latent 8 times smaller)."""
    x = mask.float()
    squeeze = x.dim() == 2
    x = x[None, None] if squeeze else x[:, None]
    x = torch.nn.functional.interpolate(x, size=tuple(latent_hw), mode="area")
    return x[0, 0] if squeeze else x[:, 0]


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        return img
    if img.mode == "P":
        img = img.convert("RGBA") if "transparency" in img.info else img.convert("RGB")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if img.mode.startswith("I;16") or img.mode == "I":
        # 16-bit greyscale: PIL's convert("RGB") clips instead of scaling; scale to 8 bit first
        arr = np.asarray(img, dtype=np.float64)
        # I;16 is 16 bit by definition; a 32-bit "I" image (PNG 16-bit grey opens as "I") may
        # hold 8- or 16-bit data, so its range decides
        peak = 65535.0 if img.mode.startswith("I;16") or arr.max() > 255 else 255.0
        return Image.fromarray(np.clip(arr / peak * 255.0 + 0.5, 0, 255).astype(np.uint8), "L").convert("RGB")
    return img.convert("RGB")


def resize_image(img: Image.Image, size: tuple[int, int]) -> Image.Image:
    """Resize to (w, h): BOX (area) when shrinking both sides, LANCZOS otherwise (see module doc)."""
    if img.size == tuple(size):
        return img
    shrink = img.width > size[0] and img.height > size[1]
    return img.resize(tuple(size), Image.Resampling.BOX if shrink else Image.Resampling.LANCZOS)


def _offset(excess: int, random_crop: bool, generator: torch.Generator | None) -> int:
    if excess <= 0:
        return 0
    if not random_crop:
        return excess // 2
    return int(torch.randint(0, excess + 1, (1,), generator=generator).item())


def to_tensor(img: Image.Image) -> torch.Tensor:
    """RGB PIL image -> (3, H, W) float32 in [-1, 1] (ToTensor + Normalize(0.5, 0.5))."""
    arr = torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).float()
    return (arr / 255.0 - 0.5) / 0.5


def prepare_image(img: Image.Image, bucket_reso: tuple[int, int], resized_size: tuple[int, int],
                  flip: bool = False, random_crop: bool = False,
                  generator: torch.Generator | None = None,
                  mask: Image.Image | None = None, color=None) -> PreparedImage:
    """Resize ``img`` to ``resized_size`` (w, h), crop to ``bucket_reso`` (w, h), optionally flip.

    Center crop unless ``random_crop``; the random offsets are drawn from ``generator`` (left
    first, then top, as sd-scripts) so the crop is keyed to the sample, not to a global RNG.
    ``mask`` (an "L" image, see ``load_for_item``) gets the same resize, crop and flip.
    ``color``: a function (H, W, 3) uint8 -> uint8 (color_aug), applied to the bucket-sized crop
    before the flip, where sd-scripts applies it.
    """
    bw, bh = bucket_reso
    rw, rh = resized_size
    if rw < bw or rh < bh:
        raise ValueError(f"resized size {resized_size} is smaller than the bucket {bucket_reso}")
    if random_crop and generator is None:
        raise ValueError("random_crop needs a generator (randomness is keyed to the sample)")
    original_hw = (img.height, img.width)
    img = resize_image(_to_rgb(img), (rw, rh))
    left = _offset(rw - bw, random_crop, generator)
    top = _offset(rh - bh, random_crop, generator)
    img = img.crop((left, top, left + bw, top + bh))
    if color is not None:
        img = Image.fromarray(color(np.array(img, dtype=np.uint8)), "RGB")
    mask_t = None
    if mask is not None:
        m = resize_image(mask.convert("L"), (rw, rh)).crop((left, top, left + bw, top + bh))
        if flip:
            m = m.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        mask_t = torch.from_numpy(np.array(m, dtype=np.uint8)).float() / 255.0
    if flip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        left = rw - left - bw  # the crop's start in the mirrored resized image
    return PreparedImage(pixels=to_tensor(img), original_size=original_hw,
                         crop_top_left=(top, left), target_size=(bh, bw), mask=mask_t)
