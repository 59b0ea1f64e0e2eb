"""Chroma through the trainer on the built-in tiny-chroma (64 px, one thread):

- full fine-tuning (beyond sd-scripts, whose flux_train.py is FLUX.1-only): the first micro-step's
  loss equals an independent float64 recomputation (the image encoded by a fresh tiny
  autoencoder, the sample's generator drawing its noise and then its sigma from sd-scripts' table
  with shift 3, x_t = (1 - sigma) x0 + sigma noise, T5 with its attention mask, the initial
  transformer in float64 with the first padding token attended, target noise - x0); the saved
  transformer is one original-layout file that reloads equal to the trained weights;
- one Euler step of the sampler with true CFG (the negative prompt) in float64 against
  x + (sigma_next - sigma) (v_neg + scale (v_pos - v_neg)), the transformer called directly;
- detection before loading: Chroma files and diffusers folders are Chroma's, a FLUX.1 file is
  not, ``model_type = "chroma"`` with a FLUX.1 model stops in one line before any weight loads;
  the kohya_ss GUI's flux1 box with its model_type "chroma" selects Chroma.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from library.models import flow_family, t5
from library.models.families.flux import flux, flux_ae
from library.models.families import registry
from library.models.families.chroma import checkpoint, sources
from library.run.run_state import HOOKS
from library.training import flow_sampling, sampling


def chroma_args(data, out, *extra):
    return ["--pretrained_model_name_or_path", "tiny-chroma", "--train_data_dir", data,
            "--output_dir", out, "--resolution", "64", "--max_train_steps", "2",
            "--learning_rate", "1e-3", "--cache_latents", "--seed", "7", *extra]


def _velocity(model, x, sigma, states, mask):
    """The transformer called directly, as the sampler and the trainer call it."""
    b, _, h, w = x.shape
    dt = x.dtype
    out = model(flux.pack_latents(x), flux.image_ids(h // 2, w // 2, b).to(dt), states.to(dt),
                torch.zeros(b, states.shape[1], 3, dtype=dt), torch.full((b,), sigma, dtype=dt), mask)
    return flux.unpack_latents(out, h // 2, w // 2)


def _reference_loss(run, epoch, i):
    from library.data import step_plan

    parts = sources.build_tiny()  # the initial weights (fixed seed), a fresh copy
    model, ae, t5_model = parts["transformer"].double(), parts["ae"].double(), parts["t5"].double()
    item = run.tset.samples[i]
    assert not run.tset.flip(i, epoch)
    rgb = np.asarray(Image.open(item.path).convert("RGB"), dtype=np.float64)
    pixels = torch.from_numpy(rgb / 127.5 - 1.0).permute(2, 0, 1)[None]
    with torch.no_grad():
        x0 = flux_ae.encode_latents(ae, pixels)
        g = torch.Generator().manual_seed(step_plan.derive_seed("sample", 7, epoch, i))
        noise = torch.randn(tuple(x0.shape[1:]), generator=g)[None].double()
        u = float(torch.rand(1, generator=g))  # sd-scripts' default sigma sampling: the table index
        index = min(int(u * 1000), 999)
        t, s = (1000 - index) / 1000, 3.0  # discrete_flow_shift 3.0
        sigma = s * t / (1 + (s - 1) * t)
        x_t = (1 - sigma) * x0 + sigma * noise
        ids, mask = t5.tokenize(parts["t5_tokenizer"], [run.tset.caption(i, epoch)], 512)
        states = t5_model(ids, attention_mask=mask).last_hidden_state
        v = _velocity(model, x_t, sigma, states, mask)
    return float(((v - (noise - x0)) ** 2).mean())


def test_chroma_full_finetune_loss_and_saved_transformer(dataset, tmp_path, train):
    losses = []

    def first_loss(run, epoch, idx, loss):
        losses.append((epoch, list(idx), float(loss.detach())))
        return loss

    out = tmp_path / "out"
    with HOOKS.add(after_micro_step=first_loss):
        rc, _, err, run = train("finetune", chroma_args(dataset, str(out), "--model_prediction_type", "raw",
                                                        "--model_type", "chroma"))
    assert rc == 0, err
    assert sorted(os.listdir(out)) == ["last.safetensors"]
    epoch, idx, loss = losses[0]
    assert loss == pytest.approx(_reference_loss(run, epoch, idx[0]), rel=1e-4, abs=1e-7)
    w = checkpoint.read_transformer(str(out / "last.safetensors"))
    assert w.layout == "original" and "distilled_guidance_layer.in_proj.weight" in w.state_dict
    trained = run.parts.bundle.unet.state_dict()
    assert w.state_dict.keys() == trained.keys()
    assert all(torch.equal(w.state_dict[k], trained[k].float()) for k in trained)
    initial = sources.build_tiny()["transformer"].state_dict()
    assert not torch.equal(initial["img_in.weight"], trained["img_in.weight"])


def test_one_euler_step_with_true_cfg_in_float64():
    from library.config import parse

    o = parse.options_from_values("train_dreambooth", {"pretrained_model_name_or_path": "tiny-chroma"})
    b = flow_family.load_from_options(o)
    fm = flow_family.family_model_for(b, o)
    with torch.no_grad():
        pos, neg = (fm.encode(fm.tokenize([text]), None) for text in ("red", "blue, dark"))
    x = flow_sampling.initial_noise("chroma", 64, 64, 6).double()
    model = b.unet.double()
    try:
        with torch.no_grad():
            out = flow_sampling.sample(fm, pos, neg, x, [0.9, 0.5], scale=4.0, guidance=None, dtype=torch.float64)
            vp, vn = (_velocity(model, x, 0.9, c.hidden_states.double(), c.t5_attn_mask) for c in (pos, neg))
            torch.testing.assert_close(out.double(), (x + (0.5 - 0.9) * (vn + 4.0 * (vp - vn))).float().double(),
                                       rtol=0, atol=1e-6)
            assert float((vp - vn).abs().max()) > 1e-3  # the negative prompt matters
    finally:
        b.unet.float()
    # a prompt line's defaults: 20 steps, CFG 4 (Chroma has no distilled guidance input)
    assert flow_sampling.settings(sampling.parse_line("red", "t"), "chroma") == (20, 4.0, None)


def test_detection_before_loading_and_model_type(tmp_path):
    from library.models.families.chroma.model import TINY_CHROMA
    from library.models.families.flux import tiny_flux
    from library.models.families.flux.flux_checkpoint import save_flux_transformer
    from library.training import flow_loss
    from tests.helpers import make_opts

    sd = sources.build_tiny()["transformer"].state_dict()
    original, folder = str(tmp_path / "chroma.safetensors"), str(tmp_path / "pipe" / "transformer")
    checkpoint.save_transformer(original, sd, "original", TINY_CHROMA)
    checkpoint.save_transformer(folder, sd, "diffusers", TINY_CHROMA)
    flux_file = str(tmp_path / "flux.safetensors")
    fl = tiny_flux.build_tiny_flux("dev")["transformer"]
    save_flux_transformer(flux_file, fl.state_dict(), "bfl", fl.config)
    assert flow_family.family_before_loading(original) == "chroma"
    assert flow_family.family_before_loading(str(tmp_path / "pipe")) == "chroma"
    assert flow_family.family_before_loading(flux_file) == "flux"
    assert flow_family.family_before_loading("tiny-chroma") == "chroma"
    opts = make_opts(pretrained_model_name_or_path=flux_file, model_type="chroma")
    with pytest.raises(flow_family.FlowFamilyError) as e:
        flow_loss.check_options(opts, "dreambooth")
    assert str(e.value) == f"model_type chroma: {flux_file} is a FLUX.1 model, not Chroma (the family comes from the weights)"
    # the kohya_ss GUI: its flux1 box means FLUX.1, with model_type "chroma" Chroma
    assert registry.for_gui({"flux1_checkbox": True}).name == "flux"
    assert registry.for_gui({"flux1_checkbox": True, "model_type": "chroma"}).name == "chroma"
