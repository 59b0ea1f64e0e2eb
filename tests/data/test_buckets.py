import logging

import pytest

from library.data.buckets import BucketManager, make_bucket_resolutions
from library.data.folders import ImageItem
from library.errors import DataError

# Worked out by hand from sd-scripts' make_bucket_resolutions((512, 512), 256, 1024, 64):
# the 512 square, then for widths 256..1024 step 64 the height (262144 // w) // 64 * 64 capped
# at 1024, and the transposes.
EXPECTED_512 = [(256, 832), (256, 896), (256, 960), (256, 1024), (320, 704), (320, 768),
                (384, 640), (448, 576), (512, 512), (576, 448), (640, 384), (704, 320),
                (768, 320), (832, 256), (896, 256), (960, 256), (1024, 256)]


def test_bucket_resolutions_match_sd_scripts():
    assert make_bucket_resolutions((512, 512), 256, 1024, 64) == EXPECTED_512
    bm = BucketManager((512, 512), True, 256, 1024, 64, False)
    assert bm.resos == EXPECTED_512


@pytest.mark.parametrize("size, bucket, resized", [
    ((1000, 600), (640, 384), (640, 384)),   # exact 5:3 bucket, downscale
    ((300, 500), (384, 640), (384, 640)),    # exact 3:5 bucket, upscale
    ((1024, 1024), (512, 512), (512, 512)),
    ((800, 400), (704, 320), (704, 352)),    # 2.2 is closest to 2.0; cover -> crop 32 rows
    ((512, 512), (512, 512), (512, 512)),    # an image already of a bucket size is kept
])
def test_select_bucket_known_sizes(size, bucket, resized):
    bm = BucketManager((512, 512), True, 256, 1024, 64, False)
    reso, rs, err = bm.select_bucket(*size)
    assert reso == bucket and rs == resized
    assert err == pytest.approx(bucket[0] / bucket[1] - size[0] / size[1])
    assert rs[0] >= reso[0] and rs[1] >= reso[1]  # resized always covers the bucket


def test_no_upscale_buckets():
    bm = BucketManager((512, 512), True, 256, 1024, 64, True)
    # small image: kept at its size, bucket rounded down to the step
    assert bm.select_bucket(300, 200)[:2] == ((256, 192), (300, 200))
    # large 2:1 image: shrunk to the max area; rounding the height keeps 2:1 exactly
    assert bm.select_bucket(2000, 1000)[:2] == ((640, 320), (640, 320))


def test_fixed_resolution_covers_then_center_crops():
    bm = BucketManager((64, 64), False)
    assert bm.resos == [(64, 64)]
    assert bm.select_bucket(100, 50)[:2] == ((64, 64), (128, 64))
    assert bm.select_bucket(50, 100)[:2] == ((64, 64), (64, 128))
    assert bm.select_bucket(64, 64)[:2] == ((64, 64), (64, 64))
    assert bm.select_bucket(32, 32)[:2] == ((64, 64), (64, 64))  # upscaled
    bm = BucketManager((96, 64), False)
    assert bm.select_bucket(300, 100)[:2] == ((96, 64), (192, 64))


@pytest.mark.parametrize("kwargs, option", [
    (dict(resolution=(0, 512), enable_bucket=False), "--resolution"),
    (dict(resolution=(512, 512), enable_bucket=True, min_size=512, max_size=256), "--min_bucket_reso"),
    (dict(resolution=(512, 512), enable_bucket=True, min_size=8), "--min_bucket_reso"),
    (dict(resolution=(512, 512), enable_bucket=True, min_size=640), "--min_bucket_reso"),
    (dict(resolution=(512, 1024), enable_bucket=True, max_size=768), "--max_bucket_reso"),
])
def test_invalid_bucket_options_name_the_option(kwargs, option):
    with pytest.raises(DataError) as e:
        BucketManager(**kwargs)
    assert option in str(e.value) and "\n" not in str(e.value)


def test_reso_steps_not_multiple_of_64_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="library.data.buckets"):
        bm = BucketManager((512, 512), True, 256, 1024, 32)
    assert any("bucket_reso_steps" in r.getMessage() for r in caplog.records)
    assert all(w % 32 == 0 and h % 32 == 0 for w, h in bm.resos)


def test_assign_sets_buckets_and_skips_too_small(caplog):
    items = [ImageItem(path=p, caption="", num_repeats=1, is_reg=False, class_tokens=None, size=s)
             for p, s in (("big.png", (800, 400)), ("tiny.png", (40, 40)))]
    bm = BucketManager((512, 512), True, 256, 1024, 64, True)
    with caplog.at_level(logging.WARNING, logger="library.data.buckets"):
        kept = bm.assign(items)
    assert [i.path for i in kept] == ["big.png"]
    assert kept[0].bucket == (640, 320) and kept[0].resized_size == (640, 320)  # area 320000 > 512*512
    assert sum("tiny.png" in r.getMessage() for r in caplog.records) == 1


def test_gui_resolution_rules_as_sd_scripts(caplog):
    """sd-scripts: with buckets, "512,650" is only the bucket area; min/max_bucket_reso that are
    not multiples of the step are rounded (min down, max up), with a warning; without buckets a
    resolution that is not a multiple of 8 is the crop size (a warning)."""
    bm = BucketManager((512, 650), enable_bucket=True, min_size=250, max_size=1000, reso_steps=64)
    assert (576, 576) in bm.resos       # the square: int(sqrt(512 * 650) / 64) * 64
    assert (512, 640) in bm.resos       # width 512: (332800 // 512) // 64 * 64 = 640
    assert (192, 1024) in bm.resos      # min 250 -> 192, max 1000 -> 1024
    assert min(w for w, _ in bm.resos) == 192 and max(w for w, _ in bm.resos) == 1024
    assert "min_bucket_reso 250 is not a multiple of bucket_reso_steps (64): using 192" in caplog.text
    assert "max_bucket_reso 1000 is not a multiple of bucket_reso_steps (64): using 1024" in caplog.text
    fixed = BucketManager((512, 650), enable_bucket=False)
    assert fixed.resos == [(512, 650)]
    assert fixed.select_bucket(1024, 1024)[:2] == ((512, 650), (650, 650))
    assert "resolution 512x650 is not a multiple of 8" in caplog.text


def test_bucket_steps_below_the_latent_grid_round_up(caplog):
    """The kohya_ss GUI's LyCORIS presets write bucket_reso_steps = 1 (sd-scripts stops on it):
    the finest step bucket sides can take is 8, so 1..7 -> 8 and 36 -> 40, with a warning."""
    for given, used, reso, lo, hi in ((1, 8, 64, 32, 128), (36, 40, 80, 40, 160)):
        bm = BucketManager((reso, reso), enable_bucket=True, min_size=lo, max_size=hi, reso_steps=given)
        assert bm.reso_steps == used
        assert all(w % used == 0 and h % used == 0 for w, h in bm.resos)
        assert f"bucket_reso_steps {given} is not a multiple of 8 (the latent grid): using {used}" in caplog.text
    # step 8, area 64 x 64: width 72 -> height (4096 // 72) // 8 * 8 = 56
    bm = BucketManager((64, 64), enable_bucket=True, min_size=32, max_size=128, reso_steps=1)
    assert (72, 56) in bm.resos and (56, 72) in bm.resos
