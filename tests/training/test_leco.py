"""train_leco.py: LECO (concept erasing and sliders from prompts only, sd-scripts' train_leco.py).

- The prompt file as sd-scripts reads it: its own test cases (the original LECO's YAML list; a
  slider target expanded into 4 settings), TOML [[prompts]] with top-level defaults.
- The LECO target against a hand computation in float64 on a separately built copy of the tiny
  model: the text encoder's and the U-Net's outputs with no network, on the step's denoised
  latents, combined as neutral -/+ guidance_scale * (positive - unconditional); the step's loss is
  the mean squared error of the network-on prediction (zero LoRA at step 1: the base model's).
- The result is an ordinary LoRA file (U-Net keys only) that diffusers' kohya loader consumes.
- Options that make no sense for LECO are refused by name; several processes are refused.
- The common stepper's non-finite guard: a step whose loss is NaN updates nothing (the weights
  stay those of the step before, bit for bit), the run stops with exit code 3 and the file saved
  before it is kept.
"""
from __future__ import annotations

import os

import pytest
import torch

from library.config import leco_prompts
from library.run import leco

PROMPTS = """
[[prompts]]
target = "van gogh"
guidance_scale = 1.5
resolution = 64
batch_size = 2

[[prompts]]
target = "red"
neutral = "a photo"
action = "enhance"
guidance_scale = 2.0
resolution = [64, 72]
multiplier = 0.5
weight = 0.5
"""


def test_prompt_files_read_as_sd_scripts(tmp_path):
    # sd-scripts' tests/library/test_leco_train_util.py, both cases
    p = tmp_path / "prompts.yaml"
    p.write_text('- target: "van gogh"\n  guidance_scale: 1.5\n  resolution: 512\n')
    (s,) = leco_prompts.read_prompt_file(str(p))
    assert (s.target, s.positive, s.unconditional, s.neutral, s.action, s.guidance_scale) == \
        ("van gogh", "van gogh", "", "", "erase", 1.5)
    p = tmp_path / "slider.yaml"
    p.write_text('targets:\n  - target_class: ""\n    positive: "high detail"\n    negative: "low detail"\n'
                 '    multiplier: 1.25\n    weight: 0.5\nguidance_scale: 2.0\nresolution: 768\nneutral: ""\n')
    first, second, third, fourth = leco_prompts.read_prompt_file(str(p))
    assert (first.target, first.positive, first.unconditional, first.action, first.multiplier,
            first.weight, first.resolution) == ("", "low detail", "high detail", "erase", 1.25, 0.5, (768, 768))
    assert (second.positive, second.unconditional, second.action, second.multiplier) == \
        ("high detail", "low detail", "enhance", 1.25)
    assert (third.action, third.multiplier, fourth.action, fourth.multiplier) == \
        ("erase", -1.25, "enhance", -1.25)
    assert first.guidance_scale == 2.0
    # TOML, top-level defaults, [h, w]
    p = tmp_path / "p.toml"
    p.write_text("guidance_scale = 3.0\n" + PROMPTS)
    a, b = leco_prompts.read_prompt_file(str(p))
    assert (a.guidance_scale, a.batch_size, a.resolution, b.guidance_scale, b.resolution,
            b.neutral, b.unconditional) == (1.5, 2, (64, 64), 2.0, (64, 72), "a photo", "")
    # the shipped example: one erase entry and one slider (4 settings)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    shipped = leco_prompts.read_prompt_file(os.path.join(root, "configs", "leco", "prompts.toml"))
    assert [(s.action, s.multiplier) for s in shipped] == [
        ("erase", 1.0), ("erase", 1.0), ("enhance", 1.0), ("erase", -1.0), ("enhance", -1.0)]
    assert {s.resolution for s in shipped} == {(64, 64)}
    p.write_text('[[prompts]]\ntarget = "x"\nguidance_scael = 2\n')
    with pytest.raises(leco_prompts.PromptFileError, match="prompts\\[0\\]: unknown key 'guidance_scael'"):
        leco_prompts.read_prompt_file(str(p))


def _args(tmp_path, model="tiny-sd15", *extra):
    pf = tmp_path / "prompts.toml"
    pf.write_text(PROMPTS)
    return ["--pretrained_model_name_or_path", model, "--prompts_file", pf, "--output_dir",
            tmp_path / "out", "--max_train_steps", "2", "--max_denoising_steps", "4",
            "--learning_rate", "1e-3", "--network_dim", "4", "--network_alpha", "2", *extra]


def _hand_reference(c, prompts, x, t):
    """The tiny SD1.5 model ``c`` built again, in float64, with no network: each prompt's U-Net
    output on latents ``x`` at timestep ``t``."""
    te, unet, tok = c["text_encoder"].double(), c["unet"].double(), c["tokenizer"]
    out = {}
    with torch.no_grad():
        for p in prompts:
            ids = tok([p], padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
            h = te(ids).last_hidden_state.expand(x.shape[0], -1, -1)
            out[p] = unet(x.double(), torch.full((x.shape[0],), t), h).sample
    return out


def test_leco_target_and_loss_match_a_hand_computation(tmp_path, run_script, monkeypatch):
    seen = []
    real = leco.leco_loss

    def spy(bundle, family_model, network, sampler, prompts, d, opts):
        loss, parts = real(bundle, family_model, network, sampler, prompts, d, opts)
        seen.append((d, {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in parts.items()},
                     float(loss.detach())))
        return loss, parts

    monkeypatch.setattr(leco, "leco_loss", spy)
    rc, out, err = run_script("train_leco", _args(tmp_path, "tiny-sd15", "--seed", "3"))
    assert rc == 0, err
    assert os.path.isfile(tmp_path / "out" / "last.safetensors")
    assert len(seen) == 2
    from library.models.families.sd_common.tiny_models import build_tiny_components

    c = build_tiny_components("sd15")
    actions = set()
    for n, (d, parts, loss) in enumerate(seen):
        s = d.setting
        x, t = parts["latents"], parts["timestep"]
        assert x.shape == (s.batch_size, 4, s.resolution[0] // 8, s.resolution[1] // 8)
        ref = _hand_reference(c, {s.positive, s.neutral, s.unconditional, s.target}, x, t)
        sign = -1.0 if s.action == "erase" else 1.0
        want = ref[s.neutral] + sign * s.guidance_scale * (ref[s.positive] - ref[s.unconditional])
        torch.testing.assert_close(parts["target"].double(), want, rtol=1e-5, atol=1e-5)
        actions.add(s.action)
        if n == 0:  # the LoRA's up projections are still zero: the prediction is the base model's
            want_loss = ((ref[s.target] - want) ** 2).mean(dim=(1, 2, 3)).mean() * s.weight
            assert abs(loss - float(want_loss)) <= 1e-4 * float(want_loss) + 1e-9
    # 0 < t < 1000 from the 1000-step schedule at k of 4 sampler steps
    assert all(0 <= p["timestep"] < 1000 for _, p, _ in seen)


def test_leco_sdxl_writes_a_lora_diffusers_loads(tmp_path, run_script):
    from safetensors.torch import load_file

    from library.models.families.sd_common.tiny_models import build_tiny_components
    from tests.conftest import diffusers_load_problems, diffusers_pipeline

    pytest.importorskip("peft")
    rc, out, err = run_script("train_leco", _args(tmp_path, "tiny-sdxl", "--save_every_n_steps", "1"))
    assert rc == 0, err
    assert sorted(os.listdir(tmp_path / "out")) == ["last-step00000001.safetensors", "last.safetensors"]
    path = str(tmp_path / "out" / "last.safetensors")
    sd = load_file(path)
    assert sd and all(k.startswith("lora_unet_") for k in sd)
    assert any(float(v.abs().max()) > 0 for k, v in sd.items() if k.endswith("lora_up.weight"))
    pipe = diffusers_pipeline("sdxl", build_tiny_components("sdxl"))
    problems = diffusers_load_problems(pipe, path)
    # a U-Net-only LoRA: diffusers says so for each text encoder, and nothing else
    assert all("No LoRA keys associated to CLIPTextModel" in p for p in problems), problems


def test_options_that_make_no_sense_are_refused_by_name(tmp_path, run_script, monkeypatch):
    cases = [(["--train_data_dir", tmp_path], "option train_data_dir is not accepted by train_leco"),
             (["--cache_latents"], "option cache_latents is not accepted by train_leco"),
             (["--network_train_text_encoder_only"], "option network_train_text_encoder_only is not accepted"),
             (["--mixed_precision", "fp16"], "mixed_precision fp16 needs loss scaling")]
    for extra, msg in cases:
        rc, _, err = run_script("train_leco", _args(tmp_path, "tiny-sd15", *extra))
        assert rc == 2 and msg in err, err
        assert len([ln for ln in err.splitlines() if ln.startswith("error:")]) == 1
    run_toml = tmp_path / "run.toml"
    run_toml.write_text('[[datasets]]\n[[datasets.subsets]]\nimage_dir = "x"\n')
    rc, _, err = run_script("train_leco", _args(tmp_path, "tiny-sd15", "--config", run_toml))
    assert rc == 2 and "train_leco trains from prompts only: a dataset config" in err, err
    rc, _, err = run_script("train_leco", _args(tmp_path, "tiny-sd15-inpaint"))
    assert rc == 2 and "is an inpainting model: LECO" in err, err
    monkeypatch.setenv("WORLD_SIZE", "2")
    rc, _, err = run_script("train_leco", _args(tmp_path, "tiny-sd15"))
    assert rc == 2 and "train_leco runs as one process" in err, err


def test_partial_denoising_follows_the_guidance_and_the_step_count():
    """leco_denoise_guidance_scale and max_denoising_steps: classifier-free guidance mixes the
    unconditional and the text predictions (scale 0: the unconditional one alone, scale 1: the
    text one alone, whatever the other), and ``stop`` of ``steps`` sampler steps run at the first
    ``stop`` timesteps of a ``steps``-step schedule."""
    from types import SimpleNamespace

    from diffusers import DDPMScheduler

    from library.models.family import TextConditioning

    calls = []

    def unet_forward(x, ts, ctx, sc):  # a prediction that depends on the input and the text
        calls.append(int(ts[0]))
        return 0.1 * x + ctx.hidden_states.mean(dim=(1, 2)).view(-1, 1, 1, 1)

    model = leco.Denoiser(SimpleNamespace(unet_forward=unet_forward), size_conditioning=False)
    text, empty = (TextConditioning(torch.full((1, 3, 8), v), None) for v in (1.0, -2.0))
    x0 = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))

    def run(cond, uncond, guidance, steps=6, stop=3):  # DDPM's added noise: keyed, the same each run
        return leco.denoise_partway(model, DDPMScheduler(), x0, leco.Guidance(cond, uncond, guidance),
                                    steps, stop, None, torch.Generator().manual_seed(1))

    torch.testing.assert_close(run(text, empty, 0.0), run(empty, empty, 5.0), rtol=0, atol=1e-6)
    torch.testing.assert_close(run(text, empty, 1.0), run(text, text, 5.0), rtol=0, atol=1e-6)
    assert not torch.allclose(run(text, empty, 3.0), run(text, empty, 1.0))
    calls.clear()
    run(text, empty, 3.0, steps=6, stop=4)
    s = DDPMScheduler()
    s.set_timesteps(6)
    assert calls == [int(t) for t in s.timesteps[:4]] and len(set(calls)) == 4


def test_a_nonfinite_step_updates_nothing_and_stops(tmp_path, run_script, monkeypatch):
    real = leco.leco_loss
    before = {}

    def poisoned(bundle, family_model, network, sampler, prompts, d, opts):
        loss, parts = real(bundle, family_model, network, sampler, prompts, d, opts)
        calls.append(network)
        if len(calls) == 2:  # step 2: the weights as step 1 left them, then a NaN loss
            before.update({k: v.detach().clone() for k, v in network.state_dict().items()})
            loss = loss * float("nan")
        return loss, parts

    calls = []
    monkeypatch.setattr(leco, "leco_loss", poisoned)
    rc, out, err = run_script("train_leco", _args(tmp_path, "tiny-sd15", "--save_every_n_steps", "1",
                                                  "--max_grad_norm", "0"))
    assert rc == 3, err
    assert "non-finite loss NaN at step 2: training stopped before its update" in err, err
    after = calls[-1].state_dict()
    assert before and after.keys() == before.keys()
    for k, v in before.items():  # not one element moved (the old loop stepped, then checked)
        assert torch.equal(after[k], v), k
    # step 1 had changed the weights: the guard, not a frozen network, kept them
    assert any(float(v.abs().max()) > 0 for k, v in before.items() if "lora_up" in k)
    assert sorted(os.listdir(tmp_path / "out")) == ["last-step00000001.safetensors"]
