"""The SD trainer's features on the flow-matching families (FLUX.1 and SD3 full fine-tuning on
tiny-flux / tiny-sd3, 64 px, one thread; EMA and resume also on tiny-chroma):

- masked loss: an image's alpha channel (or its conditioning_data_dir mask), averaged over each
  8x8 pixel block under a latent element, multiplies the elementwise loss of the unpacked
  prediction (FLUX.1 packs 2x2 latent patches into tokens; the velocity is unpacked before the
  loss, so the mask is not packed): the first micro-step's loss equals a float64 recomputation
  with the mask; a mask on the wrong pixels (transposed) would not;
- the options sd-scripts' FLUX.1 / SD3 trainers ignore warn and change nothing; a text-encoder
  rate alone leaves the encoders frozen (flux_train / sd3_train);
- torch_compile (aot_eager) against eager: SD3 as one graph, FLUX.1 block by block with the
  fused backward pass (FLUX.1 as one graph: slow);
- EMA: ``<name>-ema`` is saved in the family's layout and equals the decay formula over the
  weights after every step;
- SIGINT: a Ctrl-C after step 2 saves a state (exit 130, no model file), the resumed run ends
  bit-identical to the uninterrupted one: model and EMA files, and the final training state
  (weights, EMA, optimizer and scheduler state);
- the non-finite guard: a NaN loss at step 2 stops the run (exit 3, one line), nothing
  non-finite is written, and the state kept holds the weights after step 1.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from library.run.run_state import HOOKS
from tests.distributed.test_multiprocess import _same_stepper_state
from tests.outputs.test_resume import train as train_until
from tests.training.test_ema import close, expected_ema, recorder  # noqa: F401 - recorder: a fixture
from tests.training.test_faults_nonfinite import assert_all_finite, assert_one_error_line, inject
from tests.training import test_flux_train, test_sd3_train

MODELS = {"flux": "tiny-flux", "sd3": "tiny-sd3", "chroma": "tiny-chroma"}
# what the references of test_flux_train / test_sd3_train compute
LOSS_ARGS = {"flux": ["--model_prediction_type", "raw"], "sd3": []}
REFERENCE = {"flux": test_flux_train._reference_loss, "sd3": test_sd3_train._reference_loss}


def flow_args(family, data, out, *extra):
    return ["--pretrained_model_name_or_path", MODELS[family], "--train_data_dir", data,
            "--output_dir", str(out), "--resolution", "64", "--max_train_steps", "2",
            "--learning_rate", "1e-3", "--cache_latents", "--seed", "7", *extra]


def _alpha(k: int) -> np.ndarray:
    """A fixed, asymmetric random alpha channel (64 x 64) per image, with a transparent corner."""
    a = np.random.default_rng(100 + k).integers(0, 256, (64, 64)).astype(np.uint8)
    a[:20, :40] = 0
    return a


def make_masked_dataset(root: str, masks: str | None = None) -> str:
    """Two 64 px images with their masks: the alpha channel, or (``masks``) greyscale mask images
    of the same names in that folder (conditioning_data_dir) beside RGB images."""
    folder = os.path.join(root, "2_sks shape")
    os.makedirs(folder)
    if masks:
        os.makedirs(masks)
    for k in range(2):
        yy, xx = np.mgrid[0:64, 0:64]
        rgb = np.stack([xx * 3 + 20 * k, yy * 2, np.full_like(xx, 80 + 50 * k)], -1).astype(np.uint8)
        if masks:
            Image.fromarray(rgb, "RGB").save(os.path.join(folder, f"img_{k}.png"))
            Image.fromarray(_alpha(k), "L").save(os.path.join(masks, f"img_{k}.png"))
        else:
            Image.fromarray(np.dstack([rgb, _alpha(k)]), "RGBA").save(os.path.join(folder, f"img_{k}.png"))
        with open(os.path.join(folder, f"img_{k}.caption"), "w") as f:
            f.write(f"a shape {k}")
    return root


def latent_mask(k: int) -> torch.Tensor:
    """Image k's mask / 255, mean of each 8x8 block (float64, (8, 8))."""
    a = _alpha(k).astype(np.float64) / 255.0
    return torch.from_numpy(a.reshape(8, 8, 8, 8).mean(axis=(1, 3)).copy())


@pytest.mark.parametrize("family, source", [("flux", "alpha"), ("sd3", "alpha"), ("flux", "conditioning")])
def test_masked_loss_is_the_mask_weighted_loss(family, source, tmp_path, train):
    masks = str(tmp_path / "masks") if source == "conditioning" else None
    data = make_masked_dataset(str(tmp_path / "data"), masks)
    how = ["--conditioning_data_dir", masks] if masks else ["--alpha_mask"]
    losses = []

    def first(run, epoch, idx, loss):
        losses.append((epoch, list(idx), float(loss.detach())))
        return loss

    with HOOKS.add(after_micro_step=first):
        rc, _, err, run = train("finetune", flow_args(family, data, tmp_path / "out", "--masked_loss",
                                                      *how, *LOSS_ARGS[family]))
    assert rc == 0, err
    epoch, idx, loss = losses[0]
    mask = latent_mask(int(os.path.basename(run.tset.samples[idx[0]].path)[4]))
    assert loss == pytest.approx(REFERENCE[family](run, epoch, idx[0], mask=mask), rel=1e-4, abs=1e-7)
    # the pattern matters: the same loss with the mask transposed, or without a mask, differs
    for other in (mask.T, None):
        assert loss != pytest.approx(REFERENCE[family](run, epoch, idx[0], mask=other), rel=1e-3)


def _sd3_mmdit(path):
    from library.models.families.sd3 import sd3_checkpoint

    return sd3_checkpoint.load_sd3(path).mmdit.state_dict()


def _transformer(family, path):
    """The saved transformer's weights under the training module's parameter names."""
    if family in ("flux", "chroma"):  # their original layouts are the modules' own names
        return load_file(path)
    return _sd3_mmdit(path)


@pytest.mark.parametrize("family", ["flux", "sd3", "chroma"])
def test_ema_and_sigint_resume(family, dataset, tmp_path, recorder):
    rec = recorder
    base = flow_args(family, dataset, tmp_path / "whole", "--max_train_steps", "4", "--ema_decay", "0.5",
                     "--save_state_on_train_end")
    rc, err, whole = train_until("finetune", base)
    assert rc == 0, err[-2000:]
    names = {id(p): n for n, p in whole.parts.bundle.unet.named_parameters()}
    ema = _transformer(family, str(tmp_path / "whole" / "last-ema.safetensors"))
    live = dict(whole.parts.bundle.unet.named_parameters())
    n = 0
    for p, e in zip(whole.parts.params, expected_ema(rec, 0.5)):
        assert close(ema[names[id(p)]], e), names[id(p)]
        n += 1
    assert n == len(live) and len(rec["steps"]) == 4
    assert any(not torch.equal(ema[k], live[k].detach()) for k in live)  # not the trained weights

    parts = str(tmp_path / "parts")
    args = [*base[:base.index("--output_dir")], "--output_dir", parts,
            *base[base.index("--output_dir") + 2:]]
    rc, err, _ = train_until("finetune", args, stop_at={2})
    assert rc == 130 and "interrupted by SIGINT: stopped after step 2" in err, err[-2000:]
    assert sorted(os.listdir(parts)) == ["last-step00000002-state"]
    rc, err, resumed = train_until("finetune", [*args, "--resume", "latest"])
    assert rc == 0, err[-2000:]
    assert resumed.progress.loss_log == whole.progress.loss_log
    for name in ("last.safetensors", "last-ema.safetensors"):
        a, b = load_file(os.path.join(parts, name)), load_file(str(tmp_path / "whole" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    # the final training states too: weights, EMA, optimizer and scheduler state, bit for bit
    states = [os.path.join(d, "last-state") for d in (parts, str(tmp_path / "whole"))]
    files = [sorted(f for f in os.listdir(d) if f.endswith((".safetensors", ".pt"))) for d in states]
    assert files[0] == files[1] and "stepper.pt" in files[0]
    for f in files[0]:
        if f.endswith(".safetensors"):
            a, b = (load_file(os.path.join(d, f)) for d in states)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f
        elif f == "stepper.pt":
            _same_stepper_state(*(torch.load(os.path.join(d, f), weights_only=True) for d in states))


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_nan_loss_stops_with_the_state_of_the_last_good_step(family, dataset, tmp_path, train):
    from library.outputs.train_state import named_trainable

    rc, _, err, ref = train("finetune", flow_args(family, dataset, tmp_path / "ref", "--max_train_steps", "1"))
    assert rc == 0, err
    good = {n: p.detach().clone() for n, p in named_trainable(ref.parts.method, ref.parts.bundle)}
    out = str(tmp_path / "out")
    with inject(2, "nan"):
        rc, _, err, _ = train("finetune", flow_args(family, dataset, out, "--max_train_steps", "3",
                                                    "--save_every_n_steps", "1"))
    state = os.path.join(out, "last-step00000001-state")
    assert rc == 3, err[-3000:]
    assert_one_error_line(err, f"non-finite loss NaN at step 2: training stopped before its update; "
                               f"the state after step 1 is in {state}")
    assert not os.path.exists(os.path.join(out, "last.safetensors"))
    assert_all_finite(out)
    kept = load_file(os.path.join(state, "trainable.safetensors"))
    assert kept.keys() == good.keys() and kept
    assert all(torch.equal(kept[k], good[k]) for k in kept)


def _compiled_against_eager(family, dataset, tmp_path, train, *extra):
    from tests.conftest import rel_diff

    def weights(out, *more):
        rc, _, err, run = train("finetune", flow_args(family, dataset, tmp_path / out, "--optimizer_type",
                                                      "SGD", "--learning_rate", "0.5", *extra, *more))
        assert rc == 0, err
        return {n: p.detach().clone() for n, p in run.parts.bundle.unet.named_parameters()}, err

    eager, _ = weights("eager")
    compiled, err = weights("compiled", "--torch_compile", "--dynamo_backend", "aot_eager")
    start = MODEL_INITIAL[family]()
    assert sum(not torch.equal(start[k], v) for k, v in eager.items()) > len(eager) // 2
    assert compiled.keys() == eager.keys()
    worst = max(rel_diff(compiled[k], b) for k, b in eager.items())
    assert worst < 1e-5, worst
    print(f"compiled against eager: {worst:.2e}")
    return err


def test_compiled_sd3_matches_eager(dataset, tmp_path, train):
    """torch_compile (aot_eager: dynamo's graph and AOT autograd's joint forward/backward) trains
    the SD3 transformer as one graph to the eager weights within 1e-5 per tensor (SGD, 2 steps)."""
    err = _compiled_against_eager("sd3", dataset, tmp_path, train)
    assert "torch_compile: transformer traced and compiled" in err and "one by one" not in err


def test_compiled_fused_flux_block_by_block_matches_eager(dataset, tmp_path, train):
    """With fused_backward_pass each double- and single-stream block of FLUX.1 is its own graph,
    stepped in its gradients' hooks, to the eager fused run's weights within 1e-5."""
    err = _compiled_against_eager("flux", dataset, tmp_path, train, "--fused_backward_pass")
    for name in ("double_blocks.0", "double_blocks.1", "single_blocks.0"):
        assert f"transformer {name} traced and compiled" in err, name


@pytest.mark.slow
def test_compiled_flux_matches_eager(dataset, tmp_path, train):
    """Slow (~30 s: dynamo traces the whole FLUX.1 transformer, its blocks unrolled): FLUX.1
    compiled as one graph, against eager, within 1e-5."""
    err = _compiled_against_eager("flux", dataset, tmp_path, train)
    assert "torch_compile: transformer traced and compiled" in err and "one by one" not in err


def _initial_sd3():
    from library.models.families.sd3 import sd3_builtins

    return sd3_builtins.build_builtin("tiny-sd3")["mmdit"].state_dict()


MODEL_INITIAL = {"flux": test_flux_train.build_initial, "sd3": _initial_sd3}


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_options_sd_scripts_ignores_warn_and_leave_the_loss_unchanged(family, dataset, tmp_path, train):
    """clip_skip, max_token_length, min_snr_gamma, the noise-offset options and FLUX.1's timestep
    bounds (the kohya_ss GUI writes them for every model type; sd-scripts' FLUX.1 / SD3 trainers
    ignore them): one "no effect" line each, and the same losses and weights as without them."""
    def run(out, *extra):
        rc, _, err, r = train("finetune", flow_args(family, dataset, tmp_path / out, *extra))
        assert rc == 0, err
        return r, err

    plain, _ = run("plain")
    extra = ["--clip_skip", "2", "--max_token_length", "225", "--min_snr_gamma", "5",
             "--noise_offset", "0.1", "--adaptive_noise_scale", "0.01"]
    names = ["clip_skip", "max_token_length", "min_snr_gamma", "noise_offset", "adaptive_noise_scale"]
    if family == "flux":  # (SD3 honours its timestep bounds)
        extra += ["--min_timestep", "100", "--max_timestep", "900"]
        names += ["min_timestep", "max_timestep"]
    ignored, err = run("ignored", *extra)
    for name in names:
        assert f"option {name} has no effect with the" in err, name
        assert err.count(f"option {name} has no effect") == 1, (name, err)  # one line each
    assert ignored.progress.loss_log == plain.progress.loss_log
    a, b = (dict(r.parts.bundle.unet.named_parameters()) for r in (plain, ignored))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_text_encoder_rate_alone_keeps_the_encoders_frozen(family, dataset, tmp_path, train):
    """learning_rate_te without train_text_encoder (the GUI's DreamBooth tab writes it for every
    model type): sd-scripts' flux_train.py / sd3_train.py train only the transformer then, as
    sdxl_train.py; train_db.py's implied text-encoder training is SD1/SD2's."""
    rc, _, err, run = train("train_dreambooth", flow_args(family, dataset, tmp_path / "o",
                                                          "--learning_rate_te", "1e-3"))
    assert rc == 0, err
    assert not run.parts.method.train_text_encoder
    # (sd3_train.py / flux_train.py never read learning_rate_te: learning_rate_te1/2/3)
    assert f"text_encoder_lr (learning_rate_te) has no effect with the {family} model" in err
    assert not any(p.requires_grad for te in run.parts.bundle.text_encoders for p in te.parameters())
