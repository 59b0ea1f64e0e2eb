"""Masked loss (sd-scripts' masked_loss / alpha_mask / conditioning_data_dir).

- The formula against an independent computation: the mask, block-averaged to the latent size
  (8x8 means), multiplies the elementwise loss before the per-sample mean, with no
  renormalisation; a mask of ones gives exactly the unmasked loss.
- End to end: the mask that reaches the loss is the image's alpha channel (or mask image) with
  the image's own crop and flip, on a non-square bucket with flip_aug, cached and uncached.
- The latent cache holds the mask: editing a mask file re-encodes exactly that entry.
- Errors before any weight loads: a missing mask file, masked_loss without a mask source,
  conditioning_data_dir without masked_loss.
"""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
from PIL import Image

from library.training import losses
from library.config.parse import parse_args
from library.errors import DataError
from library.data.training_data import build_training_set
from tests.training.test_losses import make_losses

LOG = logging.getLogger("test_masked_loss")

# images: 96x72 (w x h) -> bucket 96x64 (non-square), no resize, center crop of rows 4..67
W, H, TOP = 96, 72, 4
BUCKET_ARGS = ["--resolution", "96,64", "--enable_bucket", "--min_bucket_reso", "32",
               "--max_bucket_reso", "128", "--bucket_reso_steps", "32"]


def ref_latent_mask(full: np.ndarray, flipped: bool) -> torch.Tensor:
    """(H, W) uint8 mask of the source image -> the (8, 12) latent mask: center crop to the
    bucket, mirror when flipped, /255, then the mean of each 8x8 block (float64)."""
    m = full[TOP:TOP + 64].astype(np.float64) / 255.0
    if flipped:
        m = m[:, ::-1]
    return torch.from_numpy(m.reshape(8, 8, 12, 8).mean(axis=(1, 3)).copy())


def ref_masked_loss(pred, target, mask_full):
    """Per-sample masked MSE written out: elementwise (pred - target)^2, times the mask averaged
    over each 8x8 pixel block under the latent element, mean over C, h, w."""
    b, c, h, w = pred.shape
    blocks = mask_full.double().reshape(b, h, 8, w, 8).mean(dim=(2, 4))
    return (((pred.double() - target.double()) ** 2) * blocks[:, None]).mean(dim=(1, 2, 3))


# -- the formula ------------------------------------------------------------------------------

def test_masked_loss_matches_a_reference_computation():
    L = make_losses()
    g = torch.Generator().manual_seed(0)
    x = torch.randn((3, 4, 6, 5), generator=g)
    pred = torch.randn(x.shape, generator=g)
    d = L.draw(x, [torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    mask_full = torch.rand((3, 48, 40), generator=g)
    mask_full[1] = 0.0  # a fully masked sample has loss 0
    got = L.per_sample_loss(pred, x, d, mask_full)
    want = ref_masked_loss(pred, d.noise, mask_full)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    assert float(got[1]) == 0.0
    # at the latent size (as the trainer passes it) the same numbers
    from library.data.images import latent_mask

    got_latent = L.per_sample_loss(pred, x, d, latent_mask(mask_full, (6, 5)).unsqueeze(1))
    torch.testing.assert_close(got_latent, got, rtol=1e-6, atol=0)


@pytest.mark.parametrize("loss_type", ["l2", "huber"])
def test_mask_of_ones_is_exactly_the_unmasked_loss(loss_type):
    L = make_losses("--loss_type", loss_type, "--min_snr_gamma", "5")
    g = torch.Generator().manual_seed(7)
    x = torch.randn((2, 4, 6, 5), generator=g)
    pred = torch.randn(x.shape, generator=g)
    d = L.draw(x, [torch.Generator().manual_seed(s) for s in (4, 5)])
    plain = L.per_sample_loss(pred, x, d)
    assert torch.equal(L.per_sample_loss(pred, x, d, torch.ones((2, 1, 6, 5))), plain)
    assert torch.equal(L.per_sample_loss(pred, x, d, torch.ones((2, 48, 40))), plain)
    # and the mask is applied before the SNR weight, per element (sd-scripts' order)
    half = torch.ones((2, 1, 6, 5))
    half[:, :, :3] = 0.0
    elem = losses.elementwise_loss(pred.float(), d.noise.float(), loss_type, L.huber_threshold(d.timesteps))
    want = L.weight((elem * half).mean(dim=(1, 2, 3)), d.timesteps)
    torch.testing.assert_close(L.per_sample_loss(pred, x, d, half), want, rtol=0, atol=0)


# -- data -------------------------------------------------------------------------------------

def _alpha(k: int) -> np.ndarray:
    """An asymmetric alpha pattern per image (k = 2: fully transparent)."""
    if k == 2:
        return np.zeros((H, W), np.uint8)
    yy, xx = np.mgrid[0:H, 0:W]
    a = np.clip(xx * (255 // W) * (k + 1) + yy, 0, 255).astype(np.uint8)
    a[: H // 3, : W // 4] = 0  # a transparent corner on the left
    return a


def _rgb(k: int) -> np.ndarray:
    yy, xx = np.mgrid[0:H, 0:W]
    return np.stack([xx * 2 + k * 5, yy * 3, np.full_like(xx, 90 + 40 * k)], axis=-1).astype(np.uint8)


def make_rgba_dataset(root: str, n: int = 3) -> str:
    folder = os.path.join(root, "2_sks shape")
    os.makedirs(folder, exist_ok=True)
    for k in range(n):
        rgba = np.dstack([_rgb(k), _alpha(k)])
        Image.fromarray(rgba, "RGBA").save(os.path.join(folder, f"img_{k}.png"))
        with open(os.path.join(folder, f"img_{k}.caption"), "w") as f:
            f.write(f"a shape {k}")
    return root


def make_mask_dataset(root: str, n: int = 3) -> tuple[str, str]:
    """RGB images and a conditioning_data_dir of masks (k = 0: an RGB mask whose red channel
    differs from green and blue; the others greyscale)."""
    folder = os.path.join(root, "data", "2_sks shape")
    masks = os.path.join(root, "masks")
    os.makedirs(folder, exist_ok=True)
    os.makedirs(masks, exist_ok=True)
    for k in range(n):
        Image.fromarray(_rgb(k), "RGB").save(os.path.join(folder, f"img_{k}.png"))
        with open(os.path.join(folder, f"img_{k}.caption"), "w") as f:
            f.write(f"a shape {k}")
        m = _alpha(k)
        if k == 0:
            Image.fromarray(np.dstack([m, 255 - m, np.full_like(m, 7)]), "RGB").save(os.path.join(masks, "img_0.png"))
        else:
            Image.fromarray(m, "L").save(os.path.join(masks, f"img_{k}.png"))
    return os.path.join(root, "data"), masks


def opts_for(data, out, *extra, script="train_lora"):
    return parse_args(script, ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", data,
                               "--output_dir", out, "--max_train_epochs", "2", *BUCKET_ARGS,
                               *[str(e) for e in extra]])


def test_items_get_their_mask_and_the_bucket_is_non_square(tmp_path):
    data, masks = make_mask_dataset(str(tmp_path))
    ts = build_training_set(opts_for(data, "o", "--masked_loss", "--conditioning_data_dir", masks), LOG)
    assert ts.masked and {it.bucket for it in ts.train_items} == {(96, 64)}
    assert {os.path.basename(it.mask_path) for it in ts.train_items} == {"img_0.png", "img_1.png", "img_2.png"}
    assert all(it.resized_size == (W, H) for it in ts.train_items)
    # the prepared mask is the mask image's red channel, cropped like the pixels
    i = next(i for i, s in enumerate(ts.samples) if s.path.endswith("img_0.png"))
    p = ts.prepare(i, 1)
    assert p.crop_top_left[0] == TOP and tuple(p.mask.shape) == (64, 96)
    m = _alpha(0)[TOP:TOP + 64] / 255.0
    flipped = ts.flip(i, 1)
    torch.testing.assert_close(p.mask.double(), torch.from_numpy(m[:, ::-1].copy() if flipped else m))


def test_alpha_mask_reads_the_colour_channels_uncomposited(tmp_path):
    data = make_rgba_dataset(str(tmp_path))
    ts = build_training_set(opts_for(data, "o", "--alpha_mask"), LOG)
    assert ts.masked  # alpha_mask implies the masked loss (as sd-scripts)
    i = next(i for i, s in enumerate(ts.samples) if s.path.endswith("img_1.png"))
    p = ts.prepare(i, 1)
    rgb = torch.from_numpy(_rgb(1)[TOP:TOP + 64].astype(np.float32)).permute(2, 0, 1) / 127.5 - 1
    torch.testing.assert_close(p.pixels, rgb)  # transparent pixels keep their colour
    # without alpha_mask: composited over white, no mask (the bad-input behaviour)
    ts = build_training_set(opts_for(data, "o"), LOG)
    p = ts.prepare(i, 1)
    assert not ts.masked and p.mask is None
    assert torch.equal(p.pixels[:, 0, 0], torch.ones(3))  # the transparent corner is white


# -- end to end -------------------------------------------------------------------------------

seen_validation: dict = {}  # id(seen) -> the masks the validation loss was computed with


def record_masks(monkeypatch):
    """Spy on the trainer: per (epoch, sample index) the mask passed to the loss, the per-sample
    loss, and the flip (from the loaded pixels when uncached)."""
    from library.training.batch_loss import BatchLoss

    seen, current, validation = {}, {}, []
    seen_validation[id(seen)] = validation
    real_step, real_psl = BatchLoss.training, losses.Losses.per_sample_loss

    def training(self, epoch, idx, images, n_global, step=None):
        current["keys"] = [(epoch, i) for i in idx]
        current["images"] = images
        current["tset"] = self.tset
        try:
            return real_step(self, epoch, idx, images, n_global, step)
        finally:
            current["keys"] = []  # validation calls the loss too: not a training sample

    def per_sample_loss(self, pred, latents, d, mask=None, target=None):
        out = real_psl(self, pred, latents, d, mask, target)
        if not current.get("keys"):
            validation.append(None if mask is None else mask.detach().double().cpu())
        for k, key in enumerate(current.get("keys", [])):
            seen[key] = {"mask": None if mask is None else mask[k, 0].detach().double().cpu(),
                         "loss": float(out[k]), "path": current["tset"].samples[key[1]].path,
                         "flip": current["tset"].flip(key[1], key[0]),
                         "pixels": None if current["images"] is None else current["images"][k].pixels}
        return out

    monkeypatch.setattr(BatchLoss, "training", training)
    monkeypatch.setattr(losses.Losses, "per_sample_loss", per_sample_loss)
    return seen


def train_args(data, out, *extra):
    return ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", data,
            "--output_dir", out, "--max_train_epochs", "2", "--train_batch_size", "2",
            "--learning_rate", "1e-3", "--network_dim", "4", "--flip_aug", "--seed", "3",
            *BUCKET_ARGS, *extra]


def check_masks(seen, source_mask):
    """Every sample's mask is its image's mask with the sample's crop and flip; the fully
    masked image contributes loss 0; both flips occurred."""
    flips = set()
    for key, s in seen.items():
        k = int(os.path.basename(s["path"])[4])
        flipped = s["flip"]
        if s["pixels"] is not None:  # the pixels say whether it was mirrored: red grows with x
            red = s["pixels"][0, 10]
            assert (red[0] > red[-1]) == flipped
        flips.add(flipped)
        torch.testing.assert_close(s["mask"], ref_latent_mask(source_mask(k), flipped), rtol=0, atol=1e-6)
        if k == 2:
            assert s["loss"] == 0.0
        else:
            assert s["loss"] > 0.0
    assert flips == {True, False}


def test_alpha_mask_reaches_the_loss_cached_and_uncached(train, tmp_path, monkeypatch):
    data = make_rgba_dataset(str(tmp_path / "d"))
    seen = record_masks(monkeypatch)
    rc, out, err, run = train("train_lora", train_args(data, str(tmp_path / "o1"), "--alpha_mask"))
    assert rc == 0, err
    assert os.path.isfile(tmp_path / "o1" / "last.safetensors") and len(seen) == 12
    check_masks(seen, _alpha)
    uncached = dict(seen)
    seen.clear()
    rc, out, err, run = train("train_lora", train_args(data, str(tmp_path / "o2"), "--alpha_mask",
                                                        "--cache_latents"))
    assert rc == 0, err
    check_masks(seen, _alpha)
    for key, s in seen.items():  # the cached mask is the uncached one
        assert torch.equal(s["mask"], uncached[key]["mask"])
        assert s["loss"] == pytest.approx(uncached[key]["loss"], rel=1e-4, abs=1e-7)


def test_conditioning_data_dir_masks_reach_the_loss(train, tmp_path, monkeypatch):
    data, masks = make_mask_dataset(str(tmp_path))
    seen = record_masks(monkeypatch)
    rc, out, err, run = train("train_lora", train_args(data, str(tmp_path / "o"), "--masked_loss",
                                                        "--conditioning_data_dir", masks,
                                                        "--validation_split", "0.34"))
    assert rc == 0, err
    assert run.tset.masked and len(run.tset.val_items) == 1
    check_masks(seen, _alpha)  # the masks hold the same patterns (image 0: its red channel)
    # the validation loss: the held-out image's mask (center crop, no flip), at each timestep
    val = seen_validation[id(seen)]
    assert "validation loss" in out + err and val
    k = int(os.path.basename(run.tset.val_items[0].path)[4])
    for m in val:
        assert m.shape[1] == 1
        for t in range(m.shape[0]):
            torch.testing.assert_close(m[t, 0], ref_latent_mask(_alpha(k), False), rtol=0, atol=1e-6)


# -- the cache ----------------------------------------------------------------------------------

def test_cache_holds_the_mask_and_an_edited_mask_recomputes_its_entries(tmp_path):
    from library.data import latent_cache
    from library.models.families.sd_common.tiny_models import build_tiny_components

    vae = build_tiny_components("sd15")["vae"].eval()
    calls = []
    real = vae.encode
    vae.encode = lambda x, *a, **k: (calls.append(x.shape[0]), real(x, *a, **k))[1]
    data, masks = make_mask_dataset(str(tmp_path))

    def encode():
        ts = build_training_set(opts_for(data, "o", "--masked_loss", "--conditioning_data_dir", masks,
                                         "--cache_latents_to_disk"), LOG)
        calls.clear()
        out = latent_cache.encode_latents(vae, ts.train_items, batch_size=4, dtype=torch.float32,
                                          device="cpu", vae_identity="v", log=LOG, to_disk=True)
        return ts, out

    ts, first = encode()
    assert sum(calls) == 3 and len(first) == 3
    for it in ts.train_items:
        e = first[latent_cache.item_cache_key(it, False, "v", torch.float32)]
        k = int(os.path.basename(it.path)[4])
        torch.testing.assert_close(e.mask.double(), ref_latent_mask(_alpha(k), False), rtol=0, atol=1e-6)
    ts, second = encode()
    assert calls == [] and second.keys() == first.keys()  # unchanged: loaded with the masks
    for k in first:
        assert torch.equal(second[k].mask, first[k].mask)

    Image.fromarray(np.full((H, W), 128, np.uint8), "L").save(os.path.join(masks, "img_1.png"))
    ts, third = encode()
    assert sum(calls) == 1  # exactly the edited mask's entry
    assert len(set(third) - set(first)) == 1 and len(set(third) & set(first)) == 2
    (new,) = set(third) - set(first)
    torch.testing.assert_close(third[new].mask, torch.full((8, 12), 128 / 255.0))

    # the unmasked key of the same image is another entry (and unchanged from before masks)
    it = ts.train_items[0]
    plain = latent_cache.cache_key(it, it.bucket, it.resized_size, False, "v", torch.float32)
    assert plain not in third and plain == latent_cache.cache_key(
        it.path, it.bucket, it.resized_size, False, "v", torch.float32)
    it.mask_path, it.alpha_mask = None, True
    assert latent_cache.item_cache_key(it, False, "v", torch.float32) not in (set(third) | {plain})


# -- errors -----------------------------------------------------------------------------------

def test_mask_errors_are_one_line_before_loading(tmp_path, run_script):
    data, masks = make_mask_dataset(str(tmp_path))
    os.remove(os.path.join(masks, "img_2.png"))
    with pytest.raises(DataError) as e:
        build_training_set(opts_for(data, "o", "--masked_loss", "--conditioning_data_dir", masks), LOG)
    msg = str(e.value)
    assert "img_2.png" in msg and masks in msg and "\n" not in msg

    base = train_args(data, str(tmp_path / "out"))
    rc, out, err = run_script("train_lora", [*base, "--masked_loss", "--conditioning_data_dir", masks])
    assert rc == 2 and "no mask image for" in err and "img_2.png" in err
    rc, out, err = run_script("train_lora", [*base, "--masked_loss"])
    assert rc == 2 and "masked_loss: no image has a mask" in err
    rc, out, err = run_script("train_lora", [*base, "--conditioning_data_dir", masks])
    assert rc == 2 and "needs masked_loss" in err
    rc, out, err = run_script("train_lora", [*base, "--masked_loss", "--alpha_mask",
                                             "--conditioning_data_dir", masks])
    assert rc == 2 and "alpha_mask and conditioning_data_dir are both set" in err
    assert not (tmp_path / "out").exists()


def test_dataset_config_keys(tmp_path):
    """alpha_mask and conditioning_data_dir per subset; conditioning_data_dir is a subset-only
    key, and the run option applies to the subsets without is_reg."""
    data, masks = make_mask_dataset(str(tmp_path))
    folder = os.path.join(data, "2_sks shape")
    cfg = tmp_path / "ds.toml"

    def build(text, *extra):
        cfg.write_text(text)
        return build_training_set(parse_args("train_lora", [
            "--pretrained_model_name_or_path", "tiny-sd15", "--output_dir", "o", "--max_train_steps",
            "1", "--dataset_config", str(cfg), "--masked_loss", *extra]), LOG)

    sub = f'[[datasets.subsets]]\nimage_dir = "{folder}"\n'
    ts = build(f'[general]\nresolution = [96, 64]\n[[datasets]]\n{sub}conditioning_data_dir = "{masks}"\n'
               f'{sub}alpha_mask = true\n{sub}')
    assert [bool(it.mask_path) for it in ts.train_items] == [True] * 3 + [False] * 6
    assert [it.alpha_mask for it in ts.train_items] == [False] * 3 + [True] * 3 + [False] * 3
    ts = build(f'[general]\nresolution = [96, 64]\n[[datasets]]\n{sub}{sub}is_reg = true\n',
               "--conditioning_data_dir", masks)
    assert all(it.mask_path for it in ts.train_items) and ts.reg_items
    assert all(it.mask_path is None for it in ts.reg_items)  # reg images train unmasked
    with pytest.raises(DataError, match="general.conditioning_data_dir: is a subset key"):
        build(f'[general]\nconditioning_data_dir = "{masks}"\n[[datasets]]\nresolution = 64\n{sub}')


def test_resume_sees_a_changed_mask_source(tmp_path):
    """The training state's data fingerprint covers the mask: another mask file (size), or alpha
    masks switched on, is a change of the training data."""
    from types import SimpleNamespace

    from library.outputs.train_state import data_fingerprint

    img, mask = tmp_path / "a.png", tmp_path / "a_mask.png"
    img.write_bytes(b"x" * 10)
    mask.write_bytes(b"m" * 5)

    def tset(alpha_mask=False, mask_path=None):
        item = SimpleNamespace(path=str(img), caption="c", num_repeats=1, bucket=(64, 64),
                               is_reg=False, alpha_mask=alpha_mask, mask_path=mask_path)
        return SimpleNamespace(train_items=[item], reg_items=[])

    plain = data_fingerprint(tset())
    alpha = data_fingerprint(tset(alpha_mask=True, mask_path=None))
    with_mask = data_fingerprint(tset(alpha_mask=False, mask_path=str(mask)))
    assert len({str(plain), str(alpha), str(with_mask)}) == 3
    mask.write_bytes(b"m" * 6)
    assert data_fingerprint(tset(alpha_mask=False, mask_path=str(mask))) != with_mask
