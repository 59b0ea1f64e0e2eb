"""Interop: diffusers' kohya loader consumes every key of our LoRA files and, once fused, changes
exactly the weights the file names, by exactly W + up @ down * alpha / rank."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from library.models.families.sd_common.tiny_models import build_tiny_components  # noqa: E402
from networks import lora  # noqa: E402
from tests.conftest import diffusers_load_problems, diffusers_pipeline  # noqa: E402

pytest.importorskip("peft")  # diffusers' load_lora_weights needs it


def _text_encoders(c):
    return [c["text_encoder"]] + ([c["text_encoder_2"]] if "text_encoder_2" in c else [])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = (a.float() - b.float()).norm()
    ref = b.float().norm()
    return float(diff if ref == 0 else diff / ref)


def _inpaint_pipeline(arch, c):
    """diffusers' own inpainting pipeline over an inpainting model's components (its check:
    the U-Net takes latents + mask + masked-image latents channels)."""
    from diffusers import StableDiffusionInpaintPipeline, StableDiffusionXLInpaintPipeline

    if arch == "sdxl":
        return StableDiffusionXLInpaintPipeline(
            vae=c["vae"], text_encoder=c["text_encoder"], text_encoder_2=c["text_encoder_2"],
            tokenizer=c["tokenizer"], tokenizer_2=c["tokenizer_2"], unet=c["unet"],
            scheduler=c["scheduler"])
    return StableDiffusionInpaintPipeline(vae=c["vae"], text_encoder=c["text_encoder"],
                                          tokenizer=c["tokenizer"], unet=c["unet"],
                                          scheduler=c["scheduler"], safety_checker=None,
                                          feature_extractor=None, requires_safety_checker=False)


# inpaint: a LoRA of an inpainting model (9-channel U-Net input) is an ordinary LoRA file that
# diffusers' inpainting pipeline loads with every key consumed
@pytest.mark.parametrize("arch,conv,inpaint", [("sd15", False, False), ("sd15", True, False),
                                               ("sdxl", False, False), ("sdxl", True, False),
                                               ("sd15", True, True), ("sdxl", False, True)])
def test_diffusers_consumes_every_key_and_fuses_exactly(arch, conv, inpaint, tmp_path):
    c = build_tiny_components(arch, inpaint=inpaint)
    roots = {"unet": c["unet"], "text_encoder": c["text_encoder"]}
    if arch == "sdxl":
        roots["text_encoder_2"] = c["text_encoder_2"]
    base = {name: {k: v.clone() for k, v in root.state_dict().items()} for name, root in roots.items()}

    # Rank 4 / alpha 2 for Linear, rank 3 / alpha 1.5 for 3x3 convs: scale differs per module kind.
    kwargs = {"conv_dim": "3", "conv_alpha": "1.5"} if conv else {}
    net = lora.create_network(1.0, 4, 2.0, c["vae"], _text_encoders(c), c["unet"], **kwargs)
    net.apply_to(_text_encoders(c), c["unet"])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # up is zero at init: make the delta non-trivial
        for m in net.text_encoder_loras + net.unet_loras:
            m.lora_up.weight.copy_(torch.randn(m.lora_up.weight.shape, generator=gen))
    path = str(tmp_path / "lora.safetensors")
    net.save_weights(path, None, {"ss_network_dim": "4"})

    from safetensors.torch import load_file
    sd = load_file(path)
    names_in_file = {k.split(".")[0] for k in sd}
    # Which module each name in the file belongs to, by object identity in our own model.
    where = {}
    for root_name, root in roots.items():
        paths = {id(m): p for p, m in root.named_modules()}
        for m in net.text_encoder_loras + net.unet_loras:
            if id(m.org_module) in paths:
                where[m.lora_name] = (root_name, paths[id(m.org_module)] + ".weight")
    assert set(where) == names_in_file
    has_conv3x3 = any(sd[n + ".lora_down.weight"].dim() == 4 and sd[n + ".lora_down.weight"].shape[-1] == 3
                      for n in names_in_file)
    assert has_conv3x3 == conv

    # A fresh model with the same base weights goes through diffusers.
    fresh = build_tiny_components(arch, inpaint=inpaint)
    pipe = (_inpaint_pipeline if inpaint else diffusers_pipeline)(arch, fresh)
    problems = diffusers_load_problems(pipe, path)
    assert problems == [], problems

    pipe.fuse_lora(lora_scale=1.0)
    pipe.unload_lora_weights()  # fused weights stay, the peft wrappers go: original state-dict keys

    expected = {}
    for name, (root_name, key) in where.items():
        down, up = sd[name + ".lora_down.weight"], sd[name + ".lora_up.weight"]
        scale = float(sd[name + ".alpha"]) / down.shape[0]
        expected[(root_name, key)] = base[root_name][key].float() + lora.lora_delta(down, up, scale)

    checked = 0
    for root_name in roots:
        now = getattr(pipe, root_name).state_dict()
        assert set(now) == set(base[root_name])
        for key, value in now.items():
            if (root_name, key) in expected:
                err = _rel(value, expected[(root_name, key)])
                assert err <= 1e-5, f"{root_name}.{key}: rel err {err}"
                checked += 1
            else:
                assert torch.equal(value, base[root_name][key]), f"{root_name}.{key} changed without a LoRA"
    assert checked == len(names_in_file)


def test_lycoris_loha_creates_and_saves(tmp_path):
    # lycoris-lora 4.x's default preset targets both the TimestepEmbedding class and the
    # time_embedding.linear_* names, so on a diffusers U-Net it aborts with "duplicated lora name";
    # 3.4.x works. As sd-scripts does, SD1/2 pass the text encoder itself, SDXL a list of two.
    kohya = pytest.importorskip("lycoris.kohya")
    c = build_tiny_components("sd15")
    te, unet = c["text_encoder"], c["unet"]
    net = kohya.create_network(1.0, 4, 1.0, c["vae"], te, unet, algo="loha")
    net.apply_to(te, unet, True, True)
    groups, descriptions = net.prepare_optimizer_params(1e-4, 1e-4, 1e-4)
    assert len(groups) == len(descriptions) and sum(p.numel() for g in groups for p in g["params"]) > 0

    ids = torch.randint(0, c["tokenizer"].vocab_size, (1, 77))
    with torch.no_grad():
        hidden = te(ids)[0]
        out = unet(torch.randn(1, 4, 8, 8), 10, encoder_hidden_states=hidden).sample
    assert out.shape == (1, 4, 8, 8) and torch.isfinite(out).all()

    path = str(tmp_path / "loha.safetensors")
    net.save_weights(path, torch.float32, {"ss_network_module": "lycoris.kohya"})
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        keys = list(f.keys())
        assert f.metadata()["ss_network_module"] == "lycoris.kohya"
    assert any(k.startswith("lora_unet_") and k.endswith(".hada_w1_a") for k in keys)
    assert any(k.startswith("lora_te_") and k.endswith(".hada_w1_a") for k in keys)
