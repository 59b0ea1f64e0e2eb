"""sd-scripts' caption options enable_wildcard, token_warmup_min / token_warmup_step and
secondary_separator (library/train_util.py BaseDataset.process_caption), against hand
computations of its draws and formulas, and keyed to (seed, epoch, sample)."""
import logging
import math
import random
import re

from library.data.folders import process_caption
from library.config.dataset_config import CaptionOptions
from library.data.step_plan import derive_seed

LOG = logging.getLogger("test")
o = CaptionOptions


def _hand_wildcards(caption, rng):
    """sd-scripts' draws, written out: one line of a multi-line caption, then each {..} group
    from left to right ({{ and }} are literal braces)."""
    if "\n" in caption:
        caption = rng.choice(caption.split("\n"))
    parts = re.split(r"(\{\{|\}\}|\{[^}]+\})", caption)
    out = []
    for p in parts:
        if p == "{{":
            out.append("{")
        elif p == "}}":
            out.append("}")
        elif p.startswith("{") and p.endswith("}") and len(p) > 2:
            out.append(rng.choice(p[1:-1].split("|")))
        else:
            out.append(p)
    return "".join(out)


def test_wildcards_draw_as_sd_scripts():
    caps = ["a {red|green|blue} ball on {grass|sand}", "{{literal}} {x|y}",
            "first {1|2}\nsecond {3|4|5}\nthird"]
    for cap in caps:
        seen = set()
        for seed in range(60):
            got = process_caption(cap, o(enable_wildcard=True), 1, random.Random(seed))
            assert got == _hand_wildcards(cap, random.Random(seed))
            seen.add(got)
        assert len(seen) >= 2 and not any("|" in s for s in seen)
    assert process_caption("{{literal}} {x|x}", o(enable_wildcard=True), 1, random.Random(0)) == "{literal} x"
    # off: the braces stay and only the first line is used (sd-scripts)
    assert process_caption("a {b|c}\nz", o(caption_prefix="p"), 1, random.Random(0)) == "p a {b|c}"
    # the draws come before the shuffle, from the same generator, in sd-scripts' order
    opt = o(enable_wildcard=True, shuffle_caption=True, keep_tokens=1)
    for seed in range(20):
        hand = random.Random(seed)
        tags = [t.strip() for t in _hand_wildcards("k, {a|b}, c, d", hand).split(",")]
        flex = tags[1:]
        hand.shuffle(flex)
        assert process_caption("k, {a|b}, c, d", opt, 1, random.Random(seed)) == ", ".join(tags[:1] + flex)


def test_token_warmup_formula():
    """floor(step * (n - min) / warmup) + min of the n flexible tags while step < warmup, in the
    caption's order (kept tags always there); a warmup below 1 is a fraction of the run's steps."""
    cap = "k, a, b, c, d, e"
    opt = o(keep_tokens=1, token_warmup_min=1, token_warmup_step=10)
    flex = ["a", "b", "c", "d", "e"]
    for step in range(0, 13):
        n = math.floor(step * (5 - 1) / 10) + 1 if step < 10 else 5
        assert process_caption(cap, opt, 1, random.Random(0), step) == ", ".join(["k"] + flex[:n])
    assert [process_caption(cap, opt, 1, random.Random(0), s).count(",") for s in (0, 3, 5, 9)] == [1, 2, 3, 4]
    frac = o(keep_tokens=1, token_warmup_min=2, token_warmup_step=0.25)  # of 40 steps: 10
    for step in (0, 4, 9, 10):
        n = math.floor(step * (5 - 2) / 10) + 2 if step < 10 else 5
        assert process_caption(cap, frac, 1, random.Random(0), step, 40) == ", ".join(["k"] + flex[:n])
    # no step (text-encoder cache variants, validation): the caption after the warmup
    assert process_caption(cap, opt, 1, random.Random(0)) == cap
    # with keep_tokens_separator only the middle warms up; shuffled after the cut
    sep = o(keep_tokens_separator="|||", token_warmup_step=4, token_warmup_min=1, shuffle_caption=True)
    for seed in range(10):
        got = process_caption("h ||| m1, m2, m3 ||| t", sep, 1, random.Random(seed), 2)
        assert got.split(", ")[0] == "h" and got.split(", ")[-1] == "t"
        assert sorted(got.split(", ")[1:-1]) == ["m1", "m2"]  # floor(2 * 2 / 4) + 1 = 2


def test_secondary_separator():
    """Tags joined by the secondary separator move together; it becomes caption_separator after
    the shuffle, and also without one (sd-scripts replaces it in every caption)."""
    opt = o(shuffle_caption=True, secondary_separator=";;;")
    for seed in range(20):
        got = process_caption("a;;;b, c, d", opt, 1, random.Random(seed))
        hand = random.Random(seed)
        flex = ["a;;;b", "c", "d"]
        hand.shuffle(flex)
        assert got == ", ".join(flex).replace(";;;", ",")
    assert process_caption("a;;;b, c", o(secondary_separator=";;;"), 1, random.Random(0)) == "a,b, c"
    assert process_caption("a;;;b| c", o(secondary_separator=";;;", caption_separator="|",
                                         shuffle_caption=True), 1, random.Random(0)) in ("a|b, c", "c, a|b")


def _tset(tmp_path, toml, *args):
    from library.config.parse import parse_args
    from library.training.plan import plan_run
    from tools.make_sample_dataset import make_sample_dataset

    folder = make_sample_dataset(str(tmp_path / "data"), n_images=2, size=64, repeats=1)
    for i, name in enumerate(("shape_00", "shape_01")):
        with open(f"{folder}/{name}.caption", "w", encoding="utf-8") as f:
            f.write(f"img{i} {{red|green|blue}}, x, y\n\nimg{i} {{up|down}}, x, y\n")
    cfg = tmp_path / "run.toml"
    cfg.write_text('pretrained_model_name_or_path = "tiny-sd15"\noutput_dir = "o"\n'
                   f"[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = \"{folder}\"\n"
                   f"num_repeats = 4\n{toml}")
    opts = parse_args("train_lora", ["--config", str(cfg), *args])
    return plan_run(opts, 1)


def test_wildcards_and_warmup_are_keyed_to_seed_epoch_and_sample(tmp_path):
    opts, ts, plan = _tset(tmp_path, "enable_wildcard = true\ntoken_warmup_step = 0.5\n",
                           "--max_train_steps", "8")
    assert ts.total_steps == 8  # the plan's, for the fraction: 4 warmup steps
    raw = ts.samples[0].caption
    assert raw == "img0 {red|green|blue}, x, y\nimg0 {up|down}, x, y"  # every non-empty line
    n = len(ts.samples)
    for epoch in (1, 2):
        for i in range(n):
            hand = random.Random(derive_seed("caption", opts.seed, epoch, i))
            tags = [t.strip() for t in _hand_wildcards(ts.samples[i].caption, hand).split(",")]
            for step in (0, 2, 4):
                want = tags[:math.floor(step * (3 - 1) / 4) + 1] if step < 4 else tags
                assert ts.caption(i, epoch, step) == ", ".join(want)
    e1 = [ts.caption(i, 1) for i in range(n)]
    assert len(set(e1[:4])) > 1  # the repeats of one image draw differently
    assert e1 != [ts.caption(i, 2) for i in range(n)]
    # the text-encoder cache holds several draws of a wildcard caption
    assert len(ts.caption_variants(ts.samples[0])) > 1


def test_training_passes_the_step_to_the_captions(tmp_path, run_script, monkeypatch):
    from library.data.training_data import TrainingSet

    steps = []
    real = TrainingSet.caption

    def spy(self, i, epoch, step=None):
        steps.append(step)
        return real(self, i, epoch, step)

    monkeypatch.setattr(TrainingSet, "caption", spy)
    opts, ts, plan = _tset(tmp_path, "token_warmup_step = 2\n", "--max_train_steps", "3")
    rc, out, err = run_script("train_lora", ["--config", str(tmp_path / "run.toml"),
                                             "--max_train_steps", "3", "--output_dir", tmp_path / "o"])
    assert rc == 0, err[-2000:]
    assert [s for s in steps if s is not None] == [0, 1, 2]


def test_fine_tuning_captions_with_wildcards():
    """sd-scripts' FineTuningDataset with enable_wildcard: the tags after each caption line."""
    from library.data.folders import metadata_caption

    entry = {"caption": "a {red|blue} dog\n\nthe dog", "tags": "grass,\nsun"}
    assert metadata_caption(entry, True) == "a {red|blue} dog, grass,, sun\nthe dog, grass,, sun"
    assert metadata_caption(entry) == "a {red|blue} dog\n\nthe dog, grass,\nsun"
    got = {process_caption(metadata_caption(entry, True), o(enable_wildcard=True), 1, random.Random(s))
           for s in range(30)}
    assert got == {"a red dog, grass,, sun", "a blue dog, grass,, sun", "the dog, grass,, sun"}
