"""The step-accounting contract on one process: a global batch split differently trains alike.

1 process x ``train_batch_size 2`` and 1 process x ``train_batch_size 1`` x
``gradient_accumulation_steps 2`` are the same global batch (DESIGN.md, "Step accounting"): the
same plan, the same samples in every step, the same noise and timesteps per sample, the same
learning rate per step and the same LoRA weights, with global-norm clipping off and engaged
(clipping acts on the accumulated gradient). Runs are deterministic per seed.

The dataset has two aspect-ratio buckets with an odd sample count in each, so every bucket ends
with a partial global batch (an empty micro-step under accumulation). Images are at least 128 px
on the short side: at 64 px the tiny U-Net's middle block sees a 1x1 feature map, where GroupNorm
over 2 values and softmax over 1 token make float32 gradients noise-dominated (~5% apart between
any two summation orders, where float64 agrees to 1e-10), which would make no test meaningful.

The optimizer is SGD with Nesterov momentum: its update is linear in the gradient, so weight
differences measure gradient differences. With AdamW the per-element normalisation turns float32
summation-order noise in near-zero gradient elements into differences of up to ~7e-4 relative
after 3 steps (measured), so a tight bound on AdamW weights would test Adam's conditioning, not
the step accounting. Network dropout is off: it draws from the global RNG, not per sample.
"""
from __future__ import annotations

import contextlib
import io
import os
import re

import pytest
import torch
from safetensors import safe_open

# Per-tensor ||a-b|| / ||b|| bound for two runs whose global batch is split differently. The float32
# noise floor measured on this model and data (8 seeds, SGD) is 3e-6 .. 1e-5 for the worst of
# the 648 tensors (5e-6 / 6e-6 at seed 7, 9e-6 for 2 processes); accounting errors measured with
# the same runs: a per-micro-batch mean loss 0.49, clipping per micro-step 0.35.
TOL = 3e-5
# A max_grad_norm that engages on every step here (the global gradient norm is ~0.06).
CLIP = "0.02"
TIME_KEYS = {"ss_training_started_at", "ss_training_finished_at", "modelspec.date"}
PLAN_KEYS = ("samples_per_epoch", "global_batch", "steps_per_epoch", "epochs", "total_steps",
             "warmup_steps")


def make_two_bucket_dataset(root: str) -> str:
    """Two buckets at ``BUCKET_ARGS``: 128x128 (3 samples: one image x2 repeats, one x1) and
    192x64 (1 sample); with a global batch of 2 each bucket ends with a partial batch."""
    from PIL import Image, ImageDraw

    specs = [("2_sks shape", "square_a", (128, 128), (210, 40, 40), "a red circle"),
             ("1_sks thing", "square_b", (128, 128), (40, 160, 60), "a green square"),
             ("1_sks thing", "wide_c", (192, 64), (40, 60, 210), "a blue band")]
    for folder, stem, (w, h), colour, caption in specs:
        d = os.path.join(root, folder)
        os.makedirs(d, exist_ok=True)
        img = Image.new("RGB", (w, h), (235, 230, 220))
        draw = ImageDraw.Draw(img)
        draw.ellipse((w // 5, h // 6, 4 * w // 5, 5 * h // 6), fill=colour)
        draw.rectangle((0, 0, w // 6, h // 3), fill=(20, 20, 30))
        img.save(os.path.join(d, stem + ".png"))
        with open(os.path.join(d, stem + ".caption"), "w", encoding="utf-8") as f:
            f.write(f"sks, {caption}\n")
    return root


def make_reg_images(root: str) -> str:
    """One 192x64 regularisation image in ``1_thing``: sd-scripts' balancing raises its repeats to
    the 4 training samples, so the wide bucket holds 5 samples (1 train + 4 reg) and the epoch 8,
    in 5 global batches of 2 (both buckets end with a partial batch)."""
    from PIL import Image, ImageDraw

    d = os.path.join(root, "1_thing")
    os.makedirs(d, exist_ok=True)
    img = Image.new("RGB", (192, 64), (120, 130, 150))
    ImageDraw.Draw(img).rectangle((60, 10, 150, 50), fill=(200, 180, 40))
    img.save(os.path.join(d, "reg_d.png"))
    with open(os.path.join(d, "reg_d.caption"), "w", encoding="utf-8") as f:
        f.write("a thing, yellow\n")
    return root


BUCKET_ARGS = ["--resolution", "128", "--enable_bucket", "--min_bucket_reso", "64",
               "--max_bucket_reso", "192", "--bucket_reso_steps", "64"]


def train_args(data: str, out: str, *extra) -> list[str]:
    return ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", data,
            "--output_dir", out, *BUCKET_ARGS, "--network_dim", "4", "--network_alpha", "2",
            "--cache_latents", "--optimizer_type", "SGDNesterov", "--optimizer_args",
            "momentum=0.9", "--learning_rate", "1.0", "--lr_scheduler", "cosine",
            "--lr_warmup_steps", "1", "--seed", "7", *extra]


def dreambooth_args(data: str, reg: str, out: str, *extra) -> list[str]:
    """Full fine-tune of the U-Net and the text encoder on the two-bucket data with reg images,
    SGD (see the module docstring), sample-keyed flip and caption shuffle, images loaded per step.
    Learning rate 0.1: most tensors move by 1e-4 .. 0.4 of their norm in a few steps."""
    return ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", data,
            "--reg_data_dir", reg, "--prior_loss_weight", "0.5", "--output_dir", out,
            *BUCKET_ARGS, "--train_text_encoder", "--flip_aug", "--shuffle_caption",
            "--optimizer_type", "SGDNesterov", "--optimizer_args", "momentum=0.9",
            "--learning_rate", "0.1", "--lr_scheduler", "cosine", "--lr_warmup_steps", "1",
            "--seed", "7", *extra]


class TrainingCapture:
    """Records, while active, the Run that ``library.run.trainer.run`` returns and every micro-step's
    samples as (completed steps, epoch, sample indices). Used in-process and in the workers of
    tests/distributed/test_multiprocess.py."""

    def __init__(self):
        self.micro_steps: list[tuple[int, int, tuple[int, ...]]] = []
        self._stack = contextlib.ExitStack()
        self._runs: list = []

    @property
    def run(self):
        """The last Run the trainer returned (None before one)."""
        return self._runs[-1] if self._runs else None

    def __enter__(self):
        from library.run.run_state import HOOKS
        from tests.conftest import runs_kept

        def before_micro_step(run_self, epoch, idx):
            self.micro_steps.append((run_self.progress.global_step, epoch, tuple(idx)))

        self._runs = self._stack.enter_context(runs_kept())
        self._stack.enter_context(HOOKS.add(before_micro_step=before_micro_step))
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def samples_per_step(self) -> list[tuple[int, tuple[int, ...]]]:
        """(epoch, sorted sample indices) of each step, all micro-steps together."""
        steps: dict = {}
        for step, epoch, idx in self.micro_steps:
            steps.setdefault(step, [epoch, []])[1].extend(idx)
        return [(e, tuple(sorted(i))) for _, (e, i) in sorted(steps.items())]


def train_in_process(args: list[str], script: str = "train_lora") -> dict:
    """Run an entry script in this process; returns stdout, the Run, the capture and the saved
    weights."""
    from library.cli import main
    from tests.conftest import reset_accelerate

    out, err = io.StringIO(), io.StringIO()
    reset_accelerate()
    # one thread, as conftest's autouse fixture, which module-scoped fixtures run before: the
    # CPU backward is then bit-reproducible (and equals the 2-process workers' OMP_NUM_THREADS=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with TrainingCapture() as cap, contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            rc = main(script, [str(a) for a in args])
    finally:
        torch.set_num_threads(threads)
        reset_accelerate()
    assert rc == 0, err.getvalue()[-3000:]
    outdir = args[args.index("--output_dir") + 1]
    tensors, meta = read_file(os.path.join(outdir, "last.safetensors"))
    return {"stdout": out.getvalue(), "run": cap.run, "capture": cap, "tensors": tensors,
            "metadata": meta}


def read_file(path):
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def plan_values(stdout: str) -> dict:
    """The ``key: value`` lines of the printed step plan."""
    block = stdout.split("step plan:", 1)[1]
    return dict(re.findall(r"^  (\w+): (\S+)$", block, flags=re.M))


def max_rel_diff(a: dict, b: dict, zero: float = 0.0, floor: float = 0.0) -> tuple[float, str]:
    """Largest per-tensor ||a-b|| / max(||b||, floor) (absolute where ||b|| <= zero), and its key.

    ``floor``: a tensor whose norm is below it is compared relative to the floor. A bias that
    starts at zero and gets a gradient that nearly cancels (a sum over many positions) ends with
    a norm of ~1e-5 made of float32 cancellation: its relative difference measures that noise,
    not the training."""
    assert a.keys() == b.keys()
    worst = (0.0, "")
    for k in b:
        x, y = a[k].detach().double(), b[k].detach().double()
        d, n = float((x - y).norm()), float(y.norm())
        worst = max(worst, (d / max(n, floor) if n > zero else d, k))
    return worst


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Trains each named variant once for the whole module (in-process, ~1-3 s each)."""
    data = make_two_bucket_dataset(str(tmp_path_factory.mktemp("twobuckets")))
    variants = {
        "bs2": ["--train_batch_size", "2", "--max_grad_norm", "0"],
        "acc2": ["--train_batch_size", "1", "--gradient_accumulation_steps", "2",
                 "--max_grad_norm", "0"],
        "bs2_clip": ["--train_batch_size", "2", "--max_grad_norm", CLIP],
        "acc2_clip": ["--train_batch_size", "1", "--gradient_accumulation_steps", "2",
                      "--max_grad_norm", CLIP],
        "bs2_again": ["--train_batch_size", "2", "--max_grad_norm", "0"],
        "bs2_seed8": ["--train_batch_size", "2", "--max_grad_norm", "0", "--seed", "8"],
    }
    done: dict = {}

    def get(name):
        if name not in done:
            out = str(tmp_path_factory.mktemp(name))
            done[name] = train_in_process(train_args(data, out, "--max_train_epochs", "1",
                                                     *variants[name]))
        return done[name]

    return get


def test_plan_two_buckets_partial_batches_same_for_both_splits(trained):
    a, b = plan_values(trained("bs2")["stdout"]), plan_values(trained("acc2")["stdout"])
    # 3 samples in the square bucket -> 2 global batches (2 + 1); 1 in the wide one -> 1.
    assert a["samples_per_epoch"] == "4"
    assert a["global_batch"] == "2" and a["steps_per_epoch"] == "3" and a["total_steps"] == "3"
    assert {k: a[k] for k in PLAN_KEYS} == {k: b[k] for k in PLAN_KEYS}
    assert (a["train_batch_size"], a["gradient_accumulation_steps"]) == ("2", "1")
    assert (b["train_batch_size"], b["gradient_accumulation_steps"]) == ("1", "2")
    # the plan is what happened
    for name in ("bs2", "acc2"):
        r = trained(name)["run"]
        assert r.progress.global_step == 3 and r.progress.epochs_done == 1 and r.parts.stepper.scheduler.last_epoch == 3
        seen = sorted(i for _, idx in trained(name)["capture"].samples_per_step() for i in idx)
        assert seen == [0, 1, 2, 3]  # every sample of the epoch exactly once
    buckets = {r_.bucket for r_ in trained("bs2")["run"].tset.samples}
    assert buckets == {(128, 128), (192, 64)}


@pytest.mark.parametrize("clip", ["", "_clip"], ids=["no_clipping", "clipping"])
def test_batch_2_equals_batch_1_with_accumulation_2(trained, clip):
    a, b = trained("acc2" + clip), trained("bs2" + clip)
    # the same samples in the same steps, and partial batches happened (an empty micro-step)
    assert a["capture"].samples_per_step() == b["capture"].samples_per_step()
    assert [len(i) for _, i in b["capture"].samples_per_step()].count(1) == 2
    assert len(a["capture"].micro_steps) == 4  # 3 steps x 2 micro-steps, 2 of them empty
    # the learning rate of every step (cosine with 1 warmup step), and the logged global loss
    assert a["run"].progress.lr_log == b["run"].progress.lr_log == pytest.approx([0.5, 1.0, 0.5])
    assert a["run"].progress.loss_log == pytest.approx(b["run"].progress.loss_log, rel=1e-5)
    worst, key = max_rel_diff(a["tensors"], b["tensors"])
    assert worst <= TOL, f"{key}: {worst:.2e}"
    # the up weights start at zero: they moved, so equality above is not trivial
    ups = [t for k, t in b["tensors"].items() if k.endswith("lora_up.weight")]
    assert ups and all(t.abs().max() > 0 for t in ups)


def test_clipping_engaged(trained):
    """Guard for the test above: max_grad_norm CLIP really changes the result."""
    worst, _ = max_rel_diff(trained("bs2_clip")["tensors"], trained("bs2")["tensors"])
    assert worst > 0.1


def test_same_seed_is_bit_identical(trained):
    a, b = trained("bs2"), trained("bs2_again")
    assert a["tensors"].keys() == b["tensors"].keys()
    for k in a["tensors"]:
        assert a["tensors"][k].dtype == b["tensors"][k].dtype
        assert torch.equal(a["tensors"][k], b["tensors"][k]), k
    assert a["run"].progress.loss_log == b["run"].progress.loss_log
    # the metadata differs only in the times of the runs
    strip = lambda md: {k: v for k, v in md.items() if k not in TIME_KEYS}  # noqa: E731
    assert strip(a["metadata"]) == strip(b["metadata"])


def test_other_seed_differs(trained):
    a, b = trained("bs2_seed8"), trained("bs2")
    worst, _ = max_rel_diff(a["tensors"], b["tensors"])
    assert worst > 0.1
    assert a["run"].progress.loss_log != b["run"].progress.loss_log
