import copy
import shutil

import pytest
import torch
from PIL import Image

from library.data.buckets import BucketManager
from library.data.folders import ImageItem, scan_concept_dirs
from library.data.images import load_image, prepare_image
from library.data.latent_cache import (cache_key, encode_latents, encode_pixels, item_cache_key,
                                  vae_fingerprint)
from library.models.families.sd_common.tiny_models import build_tiny_components
from tools.make_sample_dataset import make_sample_dataset


@pytest.fixture(scope="module")
def vae():
    return build_tiny_components("sd15")["vae"].eval()


def _item(path, size=(64, 64)):
    return ImageItem(path=str(path), caption="", num_repeats=1, is_reg=False,
                     class_tokens=None, size=size)


def test_cache_key_is_content_addressed(tmp_path):
    Image.new("RGB", (64, 64), (1, 2, 3)).save(tmp_path / "a.png")
    shutil.copy(tmp_path / "a.png", tmp_path / "copy.png")
    base = dict(bucket=(64, 64), resized_size=(64, 64), flip=False, vae_identity="vae1",
                dtype=torch.float32)
    k = cache_key(_item(tmp_path / "a.png"), **base)
    assert k == cache_key(str(tmp_path / "a.png"), **base)
    assert k == cache_key(_item(tmp_path / "copy.png"), **base)  # same bytes, same key
    assert len(k) == 64 and all(c in "0123456789abcdef" for c in k)
    changed = [
        dict(base, bucket=(64, 32)),
        dict(base, resized_size=(128, 64)),
        dict(base, flip=True),
        dict(base, vae_identity="vae2"),
        dict(base, dtype=torch.float16),
    ]
    keys = {cache_key(_item(tmp_path / "a.png"), **c) for c in changed}
    assert k not in keys and len(keys) == len(changed)
    # editing the image's bytes changes the key
    Image.new("RGB", (64, 64), (1, 2, 4)).save(tmp_path / "a.png")
    assert cache_key(_item(tmp_path / "a.png"), **base) != k


def test_vae_fingerprint(vae):
    same = copy.deepcopy(vae)
    assert vae_fingerprint(same) == vae_fingerprint(vae)
    with torch.no_grad():
        next(same.parameters()).view(-1)[0] += 1e-3
    assert vae_fingerprint(same) != vae_fingerprint(vae)


def test_encode_latents_shapes_batching_and_flip(tmp_path, vae):
    make_sample_dataset(str(tmp_path / "d"), n_images=3, size=64, repeats=2)
    wide_img = Image.new("RGB", (150, 64), (200, 30, 30))
    wide_img.paste((20, 20, 220), (0, 0, 40, 64))  # asymmetric, so its flip differs
    wide_img.save(tmp_path / "d" / "2_sks shape" / "wide.png")
    items = BucketManager((64, 64), True, 32, 128, 32, False).assign(scan_concept_dirs(str(tmp_path / "d")))
    buckets = {it.bucket for it in items}
    assert len(buckets) == 2  # the wide image lands in another bucket

    calls = []
    original = vae.encode

    def counting(x, *a, **k):
        calls.append(tuple(x.shape))
        return original(x, *a, **k)

    vae.encode = counting
    try:
        # repeats in the list must not re-encode: each distinct image once
        cache = encode_latents(vae, items + items, batch_size=2, dtype=torch.float32, device="cpu",
                               flip=True, vae_identity="tiny")
    finally:
        del vae.encode
    # bucket (64, 64): 3 images -> batches of 2 and 1; wide bucket: 1; each twice with flip
    # (the wide image's bucket is (96, 32): pixels (1, 3, 32, 96))
    assert sorted(calls) == sorted([(2, 3, 64, 64), (1, 3, 64, 64), (1, 3, 32, 96)] * 2)
    assert len(cache) == 2 * len(items)

    for it in items:
        e = cache[item_cache_key(it, False, "tiny", torch.float32)]
        w, h = it.bucket
        assert e.latents.shape == (4, h // 8, w // 8) and e.latents.device.type == "cpu"
        assert e.target_size == (h, w) and e.original_size == (it.size[1], it.size[0])
        prep = prepare_image(load_image(it.path), it.bucket, it.resized_size)
        expected = encode_pixels(vae, prep.pixels[None])[0]
        assert torch.allclose(e.latents, expected, atol=1e-5)
        assert e.crop_top_left == prep.crop_top_left
        f = cache[item_cache_key(it, True, "tiny", torch.float32)]
        prep_f = prepare_image(load_image(it.path), it.bucket, it.resized_size, flip=True)
        assert f.crop_top_left == prep_f.crop_top_left
        assert torch.allclose(f.latents, encode_pixels(vae, prep_f.pixels[None])[0], atol=1e-5)

    wide = next(it for it in items if it.path.endswith("wide.png"))
    e = cache[item_cache_key(wide, False, "tiny", torch.float32)]
    f = cache[item_cache_key(wide, True, "tiny", torch.float32)]
    assert not torch.allclose(e.latents, f.latents)
    # 150x64 -> bucket (96, 32), resized (96, 41): 9 rows cropped, top offset 4, kept by the flip
    assert (wide.bucket, wide.resized_size) == ((96, 32), (96, 41))
    assert e.crop_top_left == f.crop_top_left == (4, 0)


def test_encode_latents_is_deterministic_and_scaled(tmp_path, vae):
    folder = make_sample_dataset(str(tmp_path / "d"), n_images=2, size=64, repeats=1)
    items = BucketManager((64, 64), False).assign(scan_concept_dirs(str(tmp_path / "d")))
    a = encode_latents(vae, items, batch_size=1, dtype=torch.float32, device="cpu")
    b = encode_latents(vae, items, batch_size=2, dtype=torch.float32, device="cpu")
    assert a.keys() == b.keys() and len(a) == 2
    for k in a:
        assert torch.allclose(a[k].latents, b[k].latents, atol=1e-5)
    # the stored latents are the posterior mean times the scaling factor
    it = items[0]
    pixels = prepare_image(load_image(it.path), it.bucket, it.resized_size).pixels[None]
    with torch.no_grad():
        mean = vae.encode(pixels).latent_dist.mean[0]
    key = item_cache_key(it, False, vae_fingerprint(vae), torch.float32)
    assert torch.allclose(a[key].latents, mean * vae.config.scaling_factor, atol=1e-6)
    assert folder
