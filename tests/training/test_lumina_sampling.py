"""Lumina 2's samples as sd-scripts renders them (lumina_train_util.denoise): CFG only while Lumina's
time 1 - sigma is below ``cfg_trunc_ratio`` (a prompt's --ctr, default 0.25), the guided velocity's
norm capped at ``renorm_cfg`` x the conditional one's (--rcfg, default 1.0, 0 = no cap).

Reference: a float64 loop written from sd-scripts' formula in Lumina's own convention (the Next-DiT
called on t = 1 - sigma, its velocity x0 - noise guided, capped per sample, negated for the
scheduler's step), over diffusers' FlowMatchEulerDiscreteScheduler(shift=6.0) sigmas, on a float64
copy of the tiny transformer and the conditioning. Ours runs float32 through the shared sampler.
Tolerance: float32's relative rounding (6e-8) over the tiny transformer's few dozen layers and 6
Euler steps stays near 1e-6 of the latents' scale; 1e-4 leaves room, while plain CFG at every step
(no truncation, no cap) moves the latents by more than 1e-3 of their scale in every case (asserted),
and the reference's own decisions (steps guided, steps capped) are asserted to be mixed.
"""
from __future__ import annotations

import copy

import pytest
import torch

from library.config import parse
from library.models import flow_family
from library.training import flow_matching, flow_sampling, sampling


@pytest.fixture(scope="module")
def lumina():
    b = flow_family.load_from_options(parse.options_from_values(
        "train_lora", {"pretrained_model_name_or_path": "tiny-lumina", "system_prompt": "You are an assistant"}))
    opts = parse.options_from_values("train_lora", {"pretrained_model_name_or_path": "tiny-lumina",
                                                    "system_prompt": "You are an assistant"})
    return b, flow_family.family_model_for(b, opts)


def _reference(b, fm, prompt: str, negative: str, seed: int, steps: int, scale: float, ctr: float,
               rcfg: float, size: int = 64):
    """(final latents float64, guided steps, capped steps) as sd-scripts' denoise computes them."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=6.0)
    sched.set_timesteps(steps)
    sigmas = sched.sigmas.double()
    model = copy.deepcopy(b.unet).double()
    with torch.no_grad():
        cond = sampling.prompt_conditioning(fm, "cpu", None, [prompt])
        uncond = sampling.prompt_conditioning(fm.for_negative_prompts(), "cpu", None, [negative])
        g = torch.Generator("cpu").manual_seed(seed)
        x = torch.randn((1, 16, size // 8, size // 8), generator=g).double()
        guided = capped = 0
        for i in range(steps):
            s, s_next = sigmas[i], sigmas[i + 1]
            t = (1 - s).reshape(1)  # Lumina's time
            u = model(x, t, cond.hidden_states.double(), cond.mask)
            if t[0] < ctr:
                guided += 1
                uu = model(x, t, uncond.hidden_states.double(), uncond.mask)
                g_u = uu + scale * (u - uu)
                if rcfg > 0:
                    cap = u.flatten().norm() * rcfg
                    if g_u.flatten().norm() >= cap:
                        capped += 1
                        g_u = g_u * (cap / g_u.flatten().norm())
                u = g_u
            x = x + (s_next - s) * (-u)  # the scheduler's step on the negated (sigma-direction) velocity
    return x, guided, capped


@pytest.mark.parametrize("line, ctr, rcfg, expect", [
    ("a red dog --n blue --d 5 --w 64 --h 64 --s 6 --l 4 --ctr 0.9 --rcfg 0", 0.9, 0.0, "truncated"),
    ("a red dog --n blue --d 5 --w 64 --h 64 --s 6 --l 4 --ctr 2 --rcfg 1.2", 2.0, 1.2, "renormed"),
    ("a red dog --n blue --d 5 --w 64 --h 64 --s 6 --l 4", 0.25, 1.0, "defaults"),
])
def test_in_run_sample_equals_sd_scripts_formula_in_float64(lumina, line, ctr, rcfg, expect):
    b, fm = lumina
    p = sampling.parse_line(line, "test")
    assert flow_sampling.cfg_shaping(p, "lumina") == (ctr, rcfg)
    with torch.no_grad():
        ours = sampling.sample_latents(b, fm, p, 5, device=torch.device("cpu"))
    ref, guided, capped = _reference(b, fm, "a red dog", "blue", 5, 6, 4.0, ctr, rcfg)
    if expect == "truncated":  # some steps guided, the later ones not
        assert 0 < guided < 6 and capped == 0
    elif expect == "renormed":  # every step guided, some capped and some not
        assert guided == 6 and 0 < capped < 6
    else:  # sd-scripts' defaults: the first steps guided (sigma > 0.75 after shift 6), each capped
        assert 0 < guided < 6 and capped == guided
    err = (ours.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-4, err
    # the plain CFG at every step is another image: the shaping shows
    plain = sampling.sample_latents(b, fm, {**p, "cfg_trunc_ratio": 2.0, "renorm_cfg": 0.0}, 5,
                                    device=torch.device("cpu"))
    assert (plain.double() - ref).abs().max() / ref.abs().max() > 1e-3


def test_renorm_caps_each_sample_by_its_own_conditional_norm():
    """cfg_shaped against the float64 formula, per sample of a batch: one sample over the cap (scaled
    to it), one under (unchanged)."""
    g = torch.Generator().manual_seed(0)
    vc = torch.randn(2, 3, 4, 4, generator=g)
    vu = torch.randn(2, 3, 4, 4, generator=g)
    vu[1] = vc[1] * 0.9  # sample 1: guidance grows it a little, under a 1.5 cap
    out = flow_matching.cfg_shaped(vc, vu, 3.0, 1.5).double()
    for i in range(2):
        c, u = vc[i].double(), vu[i].double()
        want = u + 3.0 * (c - u)
        if want.norm() >= 1.5 * c.norm():
            want = want * (1.5 * c.norm() / want.norm())
        assert torch.allclose(out[i], want, rtol=1e-6, atol=1e-6)
    assert float(out[0].norm()) == pytest.approx(float(1.5 * vc[0].double().norm()), rel=1e-6)
    assert torch.allclose(out[1], (vu[1] + 3.0 * (vc[1] - vu[1])).double(), rtol=1e-6)


def test_sample_batch_size_groups_like_prompts_and_keeps_each_images_seed(lumina):
    """sample_batch_size (unset: train_batch_size) batches consecutive prompts of equal settings;
    a batched image equals the same prompt rendered alone up to float32 summation order (its noise is
    its own seed's; the Next-DiT attends each caption's own tokens), 1e-5 of the latents' scale."""
    from tests.helpers import options_from_values

    b, fm = lumina
    lines = ["a red dog --d 1 --w 64 --h 64 --s 3", "a cat --n blue --d 2 --w 64 --h 64 --s 3",
             "a dog --d 3 --w 64 --h 64 --s 3", "a dog --w 64 --h 80 --s 3", "a cat --w 64 --h 80 --s 3 --ctr 1"]
    prompts = [sampling.parse_line(x, "test") for x in lines]
    share = [(i, True) for i in range(5)]
    assert sampling.sample_groups(share, prompts, "lumina", 2) == [[(0, True), (1, True)], [(2, True)], [(3, True)],
                                                                  [(4, True)]]
    assert sampling.sample_groups(share, prompts, "lumina", 1) == [[x] for x in share]
    opts = options_from_values("train_lora", {"pretrained_model_name_or_path": "tiny-lumina", "train_batch_size": 3})
    assert sampling.sample_batch_size(opts, b) == 3
    assert sampling.sample_batch_size(opts.replace(sample_batch_size=2), b) == 2
    with torch.no_grad():
        both = sampling.flow_group_latents(b, fm, [(prompts[0], 1), (prompts[1], 2)], device=torch.device("cpu"))
        for k in range(2):
            alone = sampling.flow_group_latents(b, fm, [(prompts[k], k + 1)], device=torch.device("cpu"))
            assert ((both[k:k + 1] - alone).abs().max() / alone.abs().max()) < 1e-5
