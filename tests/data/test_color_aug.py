"""color_aug: the transform against hand computations and Python's colorsys, the decision
frequencies, sample-keyed determinism, a train_lora run, and the cache_latents rejection."""
import colorsys
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from library.data import color_aug
from library.data.training_data import TrainingSet


def px(*rgb):
    return np.array([[rgb]], dtype=np.uint8)


def test_hue_shift_of_pure_colours_by_hand():
    # red: H 0 on OpenCV's 0-180 scale; +8 -> 16 degrees: G = 255 * 16/60 = 68, B = 0
    assert color_aug.hue_shift(px(255, 0, 0), 8.0).tolist() == [[[255, 68, 0]]]
    # -8 -> 172 (344 degrees): B = 255 * (360 - 344)/60 = 68
    assert color_aug.hue_shift(px(255, 0, 0), -8.0).tolist() == [[[255, 0, 68]]]
    # the shifted hue is truncated (sd-scripts writes the float into a uint8 array): 4.7 -> 4
    # (8 degrees): G = 255 * 8/60 = 34
    assert color_aug.hue_shift(px(255, 0, 0), 4.7).tolist() == [[[255, 34, 0]]]
    # green: H 60 -> 68 (136 degrees, towards cyan): B = 255 * 16/60 = 68
    assert color_aug.hue_shift(px(0, 255, 0), 8.0).tolist() == [[[0, 255, 68]]]
    # grey has no hue: unchanged
    assert color_aug.hue_shift(px(90, 90, 90), 8.0).tolist() == [[[90, 90, 90]]]


def _colorsys_reference(img, shift):
    """OpenCV's 8-bit round trip written with colorsys (float64): H rounded to 2-degree steps,
    S rounded to /255, the shift truncated, back to RGB rounded. Also the pixels whose hue falls
    on a rounding tie (x.5 on the 0-180 scale), where float error picks the side."""
    out = np.empty_like(img)
    tie = np.zeros(img.shape[:2], bool)
    s_ = 180 + shift if shift < 0 else shift
    for y in range(img.shape[0]):
        for x in range(img.shape[1]):
            r, g, b = (img[y, x] / 255.0).tolist()
            h, s, v = colorsys.rgb_to_hsv(r, g, b)
            tie[y, x] = abs((h * 180) % 1 - 0.5) < 1e-6
            h8 = np.floor(h * 180 + 0.5) % 180
            s8 = np.floor(s * 255 + 0.5)
            h8 = np.floor((h8 + s_) % 180)
            rgb = colorsys.hsv_to_rgb(h8 / 180.0, s8 / 255.0, v)
            out[y, x] = np.rint(np.array(rgb) * 255)
    return out, tie


@pytest.mark.parametrize("shift", [-7.3, 2.5, 8.0])
def test_hue_shift_matches_colorsys(shift):
    img = np.random.default_rng(1).integers(0, 256, (12, 12, 3)).astype(np.uint8)
    got = color_aug.hue_shift(img, shift).astype(int)
    ref, tie = _colorsys_reference(img, shift)
    diff = np.abs(got - ref.astype(int)).max(axis=-1)
    assert diff[~tie].max() <= 1 and (diff[~tie] > 0).mean() < 0.02  # float rounding ties only
    assert tie.mean() < 0.05


def test_gamma_is_the_float64_formula_on_0_255_values():
    img = np.random.default_rng(2).integers(0, 256, (8, 8, 3)).astype(np.uint8)
    for g in (0.95, 1.0, 1.03):
        ref = np.floor(np.clip(img.astype(np.float64) ** g, 0, 255))
        assert np.array_equal(color_aug.gamma(img, g), ref.astype(np.uint8))
    # by hand: 255 ** 0.95 = 193.3 (darker), 100 ** 1.05 = 125.9 (brighter), 255 ** 1.05 clips
    assert color_aug.gamma(px(255, 100, 0), 0.95).tolist() == [[[193, 79, 0]]]
    assert color_aug.gamma(px(255, 100, 0), 1.05).tolist() == [[[255, 125, 0]]]


def test_decision_frequencies_over_sample_keys():
    n = 12000
    tset = TrainingSet(train_items=[], reg_items=[], samples=[SimpleNamespace(color_aug=True)] * n, seed=7)
    draws = [tset.color(i, 3) for i in range(n)]
    hue = [d.value for d in draws if d is not None and d.kind == "hue"]
    gam = [d.value for d in draws if d is not None and d.kind == "gamma"]
    assert 0.145 < len(hue) / n < 0.185 and 0.145 < len(gam) / n < 0.185
    assert 0.63 < draws.count(None) / n < 0.71
    assert min(hue) >= -8 and max(hue) <= 8 and abs(np.mean(hue)) < 0.5
    assert min(gam) >= 0.95 and max(gam) <= 1.05 and abs(np.mean(gam) - 1) < 0.005
    # keyed to (seed, epoch, sample): another epoch draws differently, off draws nothing
    assert [tset.color(i, 4) for i in range(50)] != draws[:50]
    off = TrainingSet(train_items=[], reg_items=[], samples=[SimpleNamespace(color_aug=False)], seed=7)
    assert off.color(0, 3) is None


def _tset(dataset, *extra):
    import logging

    from library.config.parse import parse_args
    from library.data.training_data import build_training_set

    opts = parse_args("train_lora", ["--pretrained_model_name_or_path", "tiny-sd15",
                                     "--train_data_dir", dataset, "--resolution", "64",
                                     "--output_dir", "/tmp/unused", "--max_train_steps", "1",
                                     *extra])
    return build_training_set(opts, logging.getLogger("test"))


def test_same_sample_key_same_image_and_applied_after_the_crop(dataset):
    aug, plain = _tset(dataset, "--color_aug"), _tset(dataset)
    keys = [(i, e) for e in range(12) for i in range(len(aug.samples))]
    changed = [(i, e) for i, e in keys if aug.color(i, e) is not None]
    assert changed and len(changed) < len(keys)
    for i, e in changed[:3] + [k for k in keys if k not in changed][:1]:
        a, b = aug.prepare(i, e).pixels, aug.prepare(i, e).pixels
        assert torch.equal(a, b)  # the same key gives the same image
        base = plain.prepare(i, e).pixels
        u8 = np.rint((base.permute(1, 2, 0).numpy() * 0.5 + 0.5) * 255).astype(np.uint8)
        want = color_aug.apply(u8, aug.color(i, e))
        got = np.rint((a.permute(1, 2, 0).numpy() * 0.5 + 0.5) * 255).astype(np.uint8)
        assert np.array_equal(got, want)


@pytest.mark.parametrize("cache", ["--cache_latents", "--cache_latents_to_disk"])
def test_rejected_with_cached_latents_before_loading(run_script, dataset, tmp_path, no_weight_loading, cache):
    rc, _, err = run_script("train_lora", ["--pretrained_model_name_or_path", "tiny-sd15",
                                           "--train_data_dir", dataset, "--resolution", "64",
                                           "--output_dir", tmp_path / "out", "--max_train_steps", "1",
                                           "--color_aug", cache])
    assert rc == 2 and "color_aug cannot be combined with cache_latents" in err, err[-2000:]
    assert len([ln for ln in err.splitlines() if ln.lower().startswith("error")]) == 1


def test_train_lora_two_steps_with_color_aug(train, dataset, tmp_path, monkeypatch):
    calls = []
    real = TrainingSet.color

    def spy(self, i, epoch):
        d = real(self, i, epoch)
        calls.append(d)
        return d

    monkeypatch.setattr(TrainingSet, "color", spy)
    out = tmp_path / "out"
    rc, _, err, run = train("train_lora", [
        "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
        "--output_dir", out, "--resolution", "64", "--max_train_steps", "2", "--network_dim", "4",
        "--color_aug", "--seed", "3"])
    assert rc == 0, err[-3000:]
    assert os.path.isfile(out / "last.safetensors") and run.progress.global_step == 2
    assert len(calls) >= 2  # every trained sample drew its decision


def test_subset_key_is_honoured_and_rejected_with_cached_latents(dataset, tmp_path):
    import logging

    from library.config.parse import parse_args
    from library.errors import DataError
    from library.data.training_data import build_training_set

    image_dir = os.path.join(dataset, sorted(os.listdir(dataset))[0])

    def opts(extra):
        cfg = tmp_path / "run.toml"
        cfg.write_text("pretrained_model_name_or_path = \"tiny-sd15\"\nmax_train_steps = 1\n"
                       f"output_dir = \"{tmp_path / 'out'}\"\n{extra}"
                       f"[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = \"{image_dir}\"\n"
                       "caption_extension = \".caption\"\ncolor_aug = true\n")
        return parse_args("train_lora", ["--config", str(cfg)])

    tset = build_training_set(opts(""), logging.getLogger("test"))
    assert tset.samples and all(s.color_aug for s in tset.samples)
    with pytest.raises(DataError, match="color_aug cannot be combined with cache_latents"):
        build_training_set(opts("cache_latents = true\n"), logging.getLogger("test"))
