import io

import numpy as np
import pytest
import torch
from PIL import Image

from library.errors import DataError
from library.data.images import load_image, prepare_image, to_tensor


def _columns(w, h):
    """An RGB image whose red channel is the column index and green the row index."""
    arr = np.zeros((h, w, 3), dtype=np.uint8)
    arr[:, :, 0] = np.arange(w, dtype=np.uint8)[None, :]
    arr[:, :, 1] = np.arange(h, dtype=np.uint8)[:, None]
    return Image.fromarray(arr, "RGB")


def _value(v):
    return (v / 255.0 - 0.5) / 0.5


def test_center_crop_sizes_and_conditioning():
    img = _columns(129, 64)  # resized == source: no resampling, exact pixel check
    p = prepare_image(img, (64, 64), (129, 64))
    assert p.pixels.shape == (3, 64, 64) and p.pixels.dtype == torch.float32
    assert p.original_size == (64, 129) and p.target_size == (64, 64)
    assert p.crop_top_left == (0, 32)  # (129 - 64) // 2
    assert p.pixels[0, 0, 0].item() == pytest.approx(_value(32))
    assert p.pixels[0, 0, 63].item() == pytest.approx(_value(95))
    assert p.pixels.min() >= -1 and p.pixels.max() <= 1


def test_flip_mirrors_pixels_and_crop_left():
    img = _columns(129, 64)
    p = prepare_image(img, (64, 64), (129, 64), flip=True)
    # in the mirrored resized image, the crop starts at 129 - 32 - 64 = 33
    assert p.crop_top_left == (0, 33)
    mirrored = to_tensor(img.transpose(Image.Transpose.FLIP_LEFT_RIGHT))
    assert torch.equal(p.pixels, mirrored[:, 0:64, 33:97])
    assert p.pixels[0, 0, 0].item() == pytest.approx(_value(95))


def test_vertical_crop_top():
    p = prepare_image(_columns(64, 101), (64, 64), (64, 101))
    assert p.crop_top_left == (18, 0)
    assert p.pixels[1, 0, 0].item() == pytest.approx(_value(18))


def test_resize_then_crop_shapes():
    img = Image.new("RGB", (200, 100), (10, 200, 30))
    p = prepare_image(img, (64, 64), (128, 64))
    assert p.pixels.shape == (3, 64, 64) and p.original_size == (100, 200)
    assert p.crop_top_left == (0, 32)
    # a flat colour stays flat through the resample
    assert torch.allclose(p.pixels[1], torch.full((64, 64), _value(200)), atol=1e-6)
    up = prepare_image(Image.new("RGB", (20, 40), (0, 0, 0)), (64, 64), (64, 128))
    assert up.pixels.shape == (3, 64, 64) and up.crop_top_left == (32, 0)


def test_random_crop_is_keyed_to_the_generator():
    img = _columns(160, 80)
    full = to_tensor(img)

    def crop(seed, flip=False):
        return prepare_image(img, (64, 64), (160, 80), flip=flip, random_crop=True,
                             generator=torch.Generator().manual_seed(seed))

    a, b = crop(1), crop(1)
    assert a.crop_top_left == b.crop_top_left and torch.equal(a.pixels, b.pixels)
    offsets = {crop(s).crop_top_left for s in range(12)}
    assert len(offsets) > 1
    for s in range(12):
        p = crop(s)
        top, left = p.crop_top_left
        assert 0 <= top <= 16 and 0 <= left <= 96
        assert torch.equal(p.pixels, full[:, top:top + 64, left:left + 64])
        f = crop(s, flip=True)
        assert f.crop_top_left == (top, 160 - left - 64)
    with pytest.raises(ValueError):
        prepare_image(img, (64, 64), (160, 80), random_crop=True)


def _roundtrip(img, fmt, **kw):
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_load_image_modes(tmp_path):
    rgba = Image.new("RGBA", (8, 8), (255, 0, 0, 0))  # fully transparent red -> white
    (tmp_path / "a.png").write_bytes(_roundtrip(rgba, "PNG"))
    assert load_image(str(tmp_path / "a.png")).getpixel((0, 0)) == (255, 255, 255)

    pal = Image.new("P", (8, 8), 1)
    pal.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    (tmp_path / "p.png").write_bytes(_roundtrip(pal, "PNG"))
    assert load_image(str(tmp_path / "p.png")).getpixel((3, 3)) == (10, 20, 30)

    (tmp_path / "l.png").write_bytes(_roundtrip(Image.new("L", (8, 8), 77), "PNG"))
    assert load_image(str(tmp_path / "l.png")).getpixel((0, 0)) == (77, 77, 77)

    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # red in CMYK
    (tmp_path / "c.jpg").write_bytes(_roundtrip(cmyk, "JPEG", quality=100))
    r, g, b = load_image(str(tmp_path / "c.jpg")).getpixel((4, 4))
    assert r > 200 and g < 60 and b < 60

    grey16 = Image.fromarray(np.full((8, 8), 65535 // 2, dtype=np.uint16))  # mid grey, 16 bit
    (tmp_path / "g16.png").write_bytes(_roundtrip(grey16, "PNG"))
    v = load_image(str(tmp_path / "g16.png")).getpixel((0, 0))
    assert v[0] == v[1] == v[2] and abs(v[0] - 128) <= 1


def test_load_image_applies_exif_rotation(tmp_path):
    img = Image.new("RGB", (40, 16), (0, 0, 255))
    exif = Image.Exif()
    exif[0x0112] = 6
    img.save(tmp_path / "r.jpg", exif=exif)
    loaded = load_image(str(tmp_path / "r.jpg"))
    assert loaded.size == (16, 40) and loaded.mode == "RGB"


def test_load_image_decode_error_names_file(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(DataError) as e:
        load_image(str(tmp_path / "bad.png"))
    assert "bad.png" in str(e.value) and "\n" not in str(e.value)
