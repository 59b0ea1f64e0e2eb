"""``fsdp``: a full fine-tune sharded across 2 CPU processes (gloo) with FSDP2.

One ``accelerate launch --multi_gpu --num_processes 2`` of this file's worker runs
``train_dreambooth.py --fsdp`` twice in the same job: an uninterrupted 4-step run (U-Net and text
encoder trained, EMA, global-norm clipping engaged, a state written after step 2, sample images
at the first step, a validation loss every 2 steps, rank 1 with an empty share in some steps)
and a resume of that run from its step-2 state. Each rank reports what it held. The tests check:

- the job is one gloo job of world size 2 with distinct ranks;
- every trained parameter (U-Net and text encoder) is a DTensor sharded on dim 0 across the 2
  ranks, each rank holding about half of the elements, and so is the optimizer state;
- the per-step gradient norms (summed, not averaged, gradients), learning rates, losses,
  validation losses, sample images, weights and EMA equal a one-process unsharded run with the
  same global batch (SGD, 128 px images, as tests/training/test_equivalence.py explains);
- the saved model file loads with ``load_model_bundle`` and equals the in-memory (gathered)
  weights exactly; the sharded training state (one checkpoint file per rank) resumes to the
  uninterrupted run's weights within 1e-6 (bit-identical here), also with another file format
  and gradient checkpointing, and resumes on one process (resharded);
- on one process fsdp trains unsharded with the same state format (exact resume, also after
  ``stop_text_encoder_training`` froze the text encoder);
- the options and launch configs that cannot work with fsdp are rejected before any weight loads.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class GradNorms:
    """Records, while active, the global gradient norm of every optimizer step before clipping
    (sharded gradients: the norm over all shards, every rank joins). With clipping engaged on
    every step the weights would not show a gradient scaled by the process count (clipping
    normalises it); the norms do."""

    def __init__(self):
        self.norms: list[float] = []

    def __enter__(self):
        import torch

        from library.training import stepper

        self._stepper, self._step = stepper, stepper.PlainStepper.step
        real = self._step

        def step(stepper_self, read=None):
            grads = [p.grad for p in stepper_self.params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
            self.norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
            return real(stepper_self, read)

        stepper.PlainStepper.step = step
        return self

    def __exit__(self, *exc):
        self._stepper.PlainStepper.step = self._step


def _worker(report_dir: str, out_dir: str, argv: list[str]) -> int:
    """Runs train_dreambooth.py twice in this process (uninterrupted, then resumed from its
    step-2 state) and reports, per rank, what the first run held."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import runpy

    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    from tests.conftest import reset_accelerate
    from tests.training.test_equivalence import TrainingCapture

    def train(args):
        sys.argv = [os.path.join(ROOT, "train_dreambooth.py"), *args]
        with TrainingCapture() as cap, GradNorms() as norms:
            try:
                runpy.run_path(sys.argv[0], run_name="__main__")
                rc = 0
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
        return rc, cap.run, norms.norms

    rc, r, grad_norms = train([*argv, "--output_dir", os.path.join(out_dir, "full")])
    if rc != 0 or r is None:
        return rc or 1
    rank = dist.get_rank()
    params = {}
    full = {}
    for prefix, module in (("unet", r.parts.bundle.unet), ("text_encoder", r.parts.bundle.text_encoders[0])):
        for n, p in module.named_parameters():
            name = f"{prefix}.{n}"
            params[name] = {"dtensor": isinstance(p, DTensor),
                            "placements": [repr(x) for x in p.placements] if isinstance(p, DTensor) else None,
                            "local": p.to_local().numel() if isinstance(p, DTensor) else p.numel(),
                            "global": p.numel()}
            full[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().contiguous()
    report = {"pid": os.getpid(), "rank": rank, "world_size": dist.get_world_size(),
              "backend": dist.get_backend(), "num_processes": r.parts.accelerator.num_processes,
              "global_step": r.progress.global_step, "loss_log": r.progress.loss_log, "lr_log": r.progress.lr_log,
              "grad_norms": grad_norms,
              "val_log": r.progress.val_log, "params": params,
              "optimizer_state": sorted({type(v).__name__ for st in r.parts.stepper.optimizer.state.values()
                                         for v in st.values() if hasattr(v, "shape")}),
              "state_files": sorted(os.listdir(os.path.join(out_dir, "full",
                                                            "last-step00000002-state", "sharded")))}
    if rank == 0:
        save_file(full, os.path.join(report_dir, "memory.safetensors"))
    reset_accelerate()
    state = os.path.join(out_dir, "full", "last-step00000002-state")
    # The resume writes a diffusers folder (a file format may change on resume: the other save
    # path), recomputes activations (gradient_checkpointing: a memory option, also allowed) and,
    # to save time, writes no state and no samples (reporting and state saving may change too).
    argv = [a for a in argv if a not in ("--save_state", "--sample_at_first")]
    rc, r2, _ = train([*argv, "--output_dir", os.path.join(out_dir, "resumed"), "--resume", state,
                    "--save_model_as", "diffusers", "--gradient_checkpointing"])
    if rc != 0 or r2 is None:
        return rc or 1
    report["resumed_global_step"] = r2.progress.global_step
    report["resumed_checkpointing"] = bool(r2.parts.bundle.unet.is_gradient_checkpointing)
    report["resumed_loss_log"] = r2.progress.loss_log
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], sys.argv[2], sys.argv[3:]))


# -- the tests (imports below are for pytest only) -----------------------------------------------
import pytest  # noqa: E402
import torch  # noqa: E402

from tests.conftest import read, rel_diff, two_process_command  # noqa: E402
from tests.training.test_equivalence import BUCKET_ARGS, make_two_bucket_dataset  # noqa: E402

# Per-tensor ||a-b|| / ||b|| between 2 sharded processes x batch 1 and 1 process x batch 2: float32
# summation order only. Measured worst over the 3 possible held-out images: 6.8e-6, 9.2e-6 and
# 9.7e-6 (the tiny U-Net's middle-block biases, as in tests/training/test_equivalence.py, whose bound this
# is); an accounting error (an averaged instead of summed gradient) is caught by the gradient
# norms, which differ by the factor 2.
TOL = 3e-5
RESUME_TOL = 1e-6
CLIP = "0.5"  # engages on every step here (the global gradient norm is 2-3; asserted)


def max_rel_diff(a: dict, b: dict) -> tuple[float, str]:
    """Largest per-tensor ||a-b|| / ||b||, and its key. Absolute below ||b|| = 1e-8: CLIP's k_proj
    biases start at zero and get a zero gradient in exact arithmetic (softmax ignores a shift of
    all keys), so they hold float32 noise of norm ~1e-12 whose relative difference means nothing."""
    assert a.keys() == b.keys()
    return max((rel_diff(a[k].double(), b[k].double()), k) for k in b)


def fsdp_args(data: str, *extra) -> list[str]:
    """4 steps of 2 epochs; whichever image validation_split holds out, a bucket ends with a
    partial global batch, so rank 1 has an empty share (a zero-weight forward under fsdp)."""
    return ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", data,
            "--validation_split", "0.34", "--validate_every_n_steps", "2",
            "--sample_prompts", os.path.join(data, "prompts.txt"), "--sample_at_first",
            *BUCKET_ARGS, "--cache_latents", "--optimizer_type", "SGDNesterov",
            "--optimizer_args", "momentum=0.9", "--learning_rate", "0.05", "--lr_scheduler", "cosine",
            "--lr_warmup_steps", "1", "--seed", "7", "--max_train_steps", "4",
            "--max_grad_norm", CLIP, "--train_text_encoder", "--ema_decay", "0.5",
            "--save_every_n_steps", "2", "--save_state", "--fsdp", *extra]


def train_in_process(script: str, args: list[str], grad_norms: list | None = None):
    """(stdout, stderr, Run) of an in-process run that must succeed; each step's gradient norm
    into ``grad_norms``."""
    import contextlib
    import io

    from library.cli import main
    from tests.conftest import reset_accelerate
    from tests.training.test_equivalence import TrainingCapture

    out, err = io.StringIO(), io.StringIO()
    reset_accelerate()
    try:
        with TrainingCapture() as cap, GradNorms() as norms, contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            rc = main(script, [str(a) for a in args])
    finally:
        reset_accelerate()
    assert rc == 0, err.getvalue()[-3000:]
    if grad_norms is not None:
        grad_norms.extend(norms.norms)
    return out.getvalue(), err.getvalue(), cap.run


@pytest.fixture(scope="module")
def fsdp_job(tmp_path_factory):
    data = make_two_bucket_dataset(str(tmp_path_factory.mktemp("twobuckets")))
    with open(os.path.join(data, "prompts.txt"), "w") as f:  # 3 prompts: 2 for rank 0, 1 for rank 1
        f.write("".join(f"sks, a shape {i} --w 64 --h 64 --s 2 --d {i}\n" for i in range(3)))
    out = str(tmp_path_factory.mktemp("fsdp_out"))
    report = str(tmp_path_factory.mktemp("fsdp_report"))
    cmd, env = two_process_command(os.path.abspath(__file__),
                                   [report, out, *fsdp_args(data, "--train_batch_size", "1")])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = []
    for r in (0, 1):
        with open(os.path.join(report, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    ref_out = str(tmp_path_factory.mktemp("one_proc"))
    ref_norms: list = []
    ref_stdout, ref_stderr, ref_run = train_in_process(
        "train_dreambooth", [*fsdp_args(data, "--train_batch_size", "2"), "--output_dir", ref_out],
        ref_norms)
    return {"data": data, "out": out, "report": report, "ranks": ranks, "stdout": proc.stdout,
            "stderr": proc.stderr, "ref_out": ref_out, "ref_run": ref_run, "ref_stdout": ref_stdout, "ref_stderr": ref_stderr,
            "ref_grad_norms": ref_norms, "tmp": tmp_path_factory}


def test_two_processes_are_one_gloo_job(fsdp_job):
    ranks = fsdp_job["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["pid"] != ranks[1]["pid"]
    for r in ranks:
        assert r["world_size"] == 2 and r["num_processes"] == 2 and r["backend"] == "gloo"
    assert "fsdp: unet, text_encoder sharded across 2 processes" in fsdp_job["stderr"]


def test_parameters_are_sharded_across_the_ranks(fsdp_job):
    r0, r1 = (r["params"] for r in fsdp_job["ranks"])
    assert r0.keys() == r1.keys()
    assert any(k.startswith("unet.") for k in r0) and any(k.startswith("text_encoder.") for k in r0)
    local = [0, 0]
    total = 0
    for name, p0 in r0.items():
        p1 = r1[name]
        assert p0["dtensor"] and p1["dtensor"], name
        assert p0["placements"] == p1["placements"] == ["Shard(dim=0)"], name
        assert p0["global"] == p1["global"]
        assert p0["local"] + p1["local"] == p0["global"], name  # split, not replicated
        local[0] += p0["local"]
        local[1] += p1["local"]
        total += p0["global"]
    for n in local:
        assert 0.45 * total <= n <= 0.55 * total, (local, total)  # each rank about half
    # the optimizer's state (SGD momentum) is sharded too
    assert fsdp_job["ranks"][0]["optimizer_state"] == ["DTensor"]
    # the training state: one checkpoint file per rank plus the metadata
    assert fsdp_job["ranks"][0]["state_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_trains_as_one_unsharded_process(fsdp_job):
    ranks, ref = fsdp_job["ranks"], fsdp_job["ref_run"]
    assert "fsdp: one process, nothing to shard" in fsdp_job["ref_stderr"]
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == ref.progress.global_step == 4
    assert ranks[0]["lr_log"] == ranks[1]["lr_log"] == ref.progress.lr_log
    assert ranks[0]["loss_log"] == ranks[1]["loss_log"]
    assert ranks[0]["loss_log"] == pytest.approx(ref.progress.loss_log, rel=1e-5)
    # the gradient of each step is the sum over the ranks (an average would be half of it), and
    # global-norm clipping engaged on every step
    assert ranks[0]["grad_norms"] == ranks[1]["grad_norms"]
    ref_norms = fsdp_job["ref_grad_norms"]
    assert ranks[0]["grad_norms"] == pytest.approx(ref_norms, rel=1e-5)
    assert len(ref_norms) == 4 and min(ref_norms) > float(CLIP)
    # validation (every process evaluates every held-out image under fsdp) and samples
    assert [s for s, _ in ranks[0]["val_log"]] == [s for s, _ in ref.progress.val_log] == [2, 4]
    assert [v for _, v in ranks[0]["val_log"]] == pytest.approx([v for _, v in ref.progress.val_log], rel=1e-5)
    out, ref_out = fsdp_job["out"], fsdp_job["ref_out"]
    for name in ("last.safetensors", "last-ema.safetensors", "last-step00000002.safetensors"):
        got, _ = read(os.path.join(out, "full", name))
        want, _ = read(os.path.join(ref_out, name))
        worst, key = max_rel_diff(got, want)
        assert worst <= TOL, f"{name}: {key}: {worst:.2e}"
    # it trained: the weights moved from the initial ones, and the EMA differs from the weights
    start, _ = read(os.path.join(out, "full", "last-step00000002.safetensors"))
    end, _ = read(os.path.join(out, "full", "last.safetensors"))
    ema, _ = read(os.path.join(out, "full", "last-ema.safetensors"))
    unet_keys = [k for k in end if k.startswith("model.diffusion_model.")]
    te_keys = [k for k in end if k.startswith("cond_stage_model.")]
    assert max(float((end[k] - start[k]).norm()) for k in unet_keys) > 1e-3
    assert max(float((end[k] - start[k]).norm()) for k in te_keys) > 1e-4
    assert max(float((end[k] - ema[k]).norm()) for k in unet_keys) > 1e-4
    samples = sorted(os.listdir(os.path.join(out, "full", "sample")))
    assert samples == sorted(os.listdir(os.path.join(ref_out, "sample")))
    assert len(samples) == 3  # 3 prompts: rank 0 wrote 2, rank 1 one
    from PIL import Image
    import numpy as np

    for name in samples:  # the starting weights, gathered block by block: the same images
        with Image.open(os.path.join(out, "full", "sample", name)) as a, \
                Image.open(os.path.join(ref_out, "sample", name)) as b:
            diff = np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16))
            assert diff.max() <= 1, name


def test_saved_model_loads_and_equals_the_trained_weights(fsdp_job):
    memory, _ = read(os.path.join(fsdp_job["report"], "memory.safetensors"))
    loaded = _weights(os.path.join(fsdp_job["out"], "full", "last.safetensors"))
    assert set(memory) <= set(loaded)
    for k, v in memory.items():
        assert torch.equal(loaded[k], v), k


def _weights(path: str) -> dict:
    from library.models.loading import load_model_bundle

    b = load_model_bundle(path)
    out = {f"unet.{k}": v for k, v in b.unet.state_dict().items()}
    out.update({f"text_encoder.{k}": v for k, v in b.text_encoders[0].state_dict().items()})
    return out


def test_resumes_from_the_sharded_state(fsdp_job):
    """Resumed at step 2 of 4 (with gradient checkpointing, written as a diffusers folder this
    time): the uninterrupted run's weights and EMA."""
    ranks = fsdp_job["ranks"]
    assert ranks[0]["resumed_global_step"] == 4 and ranks[0]["resumed_checkpointing"]
    assert ranks[0]["resumed_loss_log"] == pytest.approx(ranks[0]["loss_log"], rel=1e-6)
    for name in ("last", "last-ema"):
        resumed = os.path.join(fsdp_job["out"], "resumed", name)
        assert os.path.isfile(os.path.join(resumed, "model_index.json"))
        a = _weights(resumed)
        b = _weights(os.path.join(fsdp_job["out"], "full", name + ".safetensors"))
        worst, key = max_rel_diff(a, b)
        assert worst <= RESUME_TOL, f"{name}: {key}: {worst:.2e}"


def test_sharded_state_resumes_on_one_process(fsdp_job):
    """The 2-process state, resharded onto 1 process x batch 2 (the same global batch)."""
    out = str(fsdp_job["tmp"].mktemp("resumed_one"))
    state = os.path.join(fsdp_job["out"], "full", "last-step00000002-state")
    _, _, r = train_in_process("train_dreambooth", [*fsdp_args(fsdp_job["data"], "--train_batch_size", "2"),
                                                 "--output_dir", out, "--resume", state])
    assert r.progress.global_step == 4
    a, _ = read(os.path.join(out, "last.safetensors"))
    b, _ = read(os.path.join(fsdp_job["out"], "full", "last.safetensors"))
    worst, key = max_rel_diff(a, b)
    assert worst <= TOL, f"{key}: {worst:.2e}"


# -- rejections, before any weight loads (in-process, no launch) ----------------------------------
def _db_args(dataset, tmp_path, *extra):
    return ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
            "--output_dir", str(tmp_path / "out"), "--resolution", "64", "--max_train_steps", "1",
            *extra]


@pytest.mark.parametrize("extra, message", [
    (["--fused_backward_pass"], "fsdp cannot be combined with fused_backward_pass"),
    (["--fused_optimizer_groups", "2"], "fsdp cannot be combined with fused_optimizer_groups"),
    (["--full_bf16", "--mixed_precision", "bf16"], "fsdp cannot be combined with full_bf16"),
    (["--ema_decay", "0.9", "--ema_device", "cpu"], "fsdp cannot be combined with ema_device cpu"),
], ids=["fused_backward_pass", "fused_optimizer_groups", "full_bf16", "ema_device_cpu"])
def test_combinations_that_cannot_work_are_rejected(run_script, dataset, tmp_path, no_weight_loading,
                                                     extra, message):
    rc, _, err = run_script("train_dreambooth", _db_args(dataset, tmp_path, "--fsdp", *extra))
    assert rc == 2 and message in err, err[-2000:]
    # the same options without fsdp pass the checks and train (here: weights would load)
    with pytest.raises(AssertionError, match="weights were loaded"):
        run_script("train_dreambooth", _db_args(dataset, tmp_path, *extra))


def test_fsdp_is_not_an_option_of_train_lora(run_script, dataset, tmp_path, no_weight_loading):
    rc, _, err = run_script("train_lora", _db_args(dataset, tmp_path, "--fsdp"))
    assert rc == 2 and "fsdp" in err and "train_dreambooth" in err, err[-2000:]


def test_accelerate_fsdp_config_is_rejected(run_script, dataset, tmp_path, no_weight_loading,
                                            monkeypatch):
    """``accelerate launch`` with an FSDP config sets this; the loop would ignore it. (A
    DeepSpeed config is used: tests/distributed/test_deepspeed.py.)"""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    rc, _, err = run_script("train_dreambooth", _db_args(dataset, tmp_path))
    assert rc == 2 and "Accelerate's FSDP config is not used by this toolkit" in err, err[-2000:]


def test_one_process_state_after_stop_text_encoder_training_resumes_exactly(dataset, tmp_path):
    """fsdp on one process (unsharded, the same state format): the text encoder stops training
    after step 1; the state of step 2 (its optimizer state still holds the encoder's) resumes
    to the uninterrupted run's weights, bit for bit."""
    args = ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
            "--resolution", "64", "--cache_latents", "--optimizer_type", "SGDNesterov",
            "--learning_rate", "0.05", "--max_train_steps", "3", "--train_text_encoder",
            "--stop_text_encoder_training", "1", "--save_every_n_steps", "2", "--save_state",
            "--fsdp"]
    _, err, r = train_in_process("train_dreambooth", [*args, "--output_dir", tmp_path / "full"])
    assert "fsdp: one process, nothing to shard" in err and r.progress.global_step == 3
    state = tmp_path / "full" / "last-step00000002-state"
    assert sorted(os.listdir(state / "sharded")) == [".metadata", "__0_0.distcp"]
    _, _, r2 = train_in_process("train_dreambooth", [*args, "--output_dir", tmp_path / "resumed",
                                                     "--resume", state])
    assert r2.progress.global_step == 3
    a, _ = read(tmp_path / "resumed" / "last.safetensors")
    b, _ = read(tmp_path / "full" / "last.safetensors")
    assert a.keys() == b.keys()
    for k in b:
        assert torch.equal(a[k], b[k]), k
