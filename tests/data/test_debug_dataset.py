"""debug_dataset: a contact sheet of the first global batches, as they would train, and exit."""
import numpy as np
from PIL import Image


def test_debug_dataset_writes_a_contact_sheet_and_exits(tmp_path, dataset, run_script, monkeypatch):
    from library.config.parse import parse_args
    from library.data import debug_dataset
    from library.data.step_plan import epoch_batches
    from library.models import loading
    from library.training.plan import plan_run

    def no_weights(*a, **k):
        raise AssertionError("debug_dataset loaded a model")

    monkeypatch.setattr(loading, "load_model_bundle", no_weights)
    args = ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
            "--resolution", "64", "--output_dir", tmp_path / "out", "--max_train_steps", "3",
            "--train_batch_size", "2", "--flip_aug", "--shuffle_caption", "--seed", "2",
            "--caption_extension", ".caption"]
    rc, out, err = run_script("train_lora", [*args, "--debug_dataset"])
    assert rc == 0, err[-2000:]
    path = tmp_path / "out" / "last_debug_dataset.png"
    assert f"debug_dataset: wrote {path}" in out
    assert not (tmp_path / "out" / "last.safetensors").exists()

    # what the run would train: the epoch's global batches in order, each sample's caption
    # (at its step) and pixels (flip drawn per sample), from a plan made here
    opts, tset, plan = plan_run(parse_args("train_lora", [str(a) for a in args]), 1)
    batches = epoch_batches(tset.bucket_of, 2, 1, plan.global_batch)
    assert [len(gb.indices) for gb in batches] == [2, 2]  # 4 samples, global batch 2
    logged = [ln[ln.index("debug_dataset: step"):] for ln in (out + err).splitlines()
              if "debug_dataset: step" in ln]
    want = [(step, i) for step, gb in enumerate(batches) for i in gb.indices]
    assert len(logged) == len(want)
    for line, (step, i) in zip(logged, want):
        assert line.startswith(f"debug_dataset: step {step + 1}, sample {i}: {tset.samples[i].path}")
        assert line.endswith(f"caption {tset.caption(i, 1, step)!r}")
        assert f"flipped {tset.flip(i, 1)}" in line
    assert len({tset.flip(i, 1) for _, i in want}) == 2  # both flips occur: the cells show them

    sheet = np.asarray(Image.open(path).convert("RGB")).astype(int)
    cell, text_h = debug_dataset.CELL, debug_dataset.TEXT_LINES * debug_dataset.LINE_HEIGHT + 4
    assert sheet.shape == (2 * (cell + text_h + 8) + 8, 2 * (cell + 8) + 8, 3)
    for r, gb in enumerate(batches):
        for c, i in enumerate(gb.indices):
            px = tset.prepare(i, 1).pixels  # (3, 64, 64) in [-1, 1], flipped when drawn
            hand = ((px.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()
            hand = np.asarray(Image.fromarray(hand).resize((cell, cell))).astype(int)
            y, x = 8 + r * (cell + text_h + 8), 8 + c * (cell + 8)
            assert np.array_equal(sheet[y:y + cell, x:x + cell], hand)
            assert sheet[y + cell + 2:y + cell + text_h, x:x + cell].min() < 128  # a caption drawn
