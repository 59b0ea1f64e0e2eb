"""Anima's parts and family model (library/models/families/anima/parts.py, family_model.py): Qwen3
from a folder or one file, the Qwen-Image VAE from one file, the checks before loading, the text
conditioning (sd-scripts' AnimaTextEncodingStrategy) and the DiT call."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.models.families.anima import family_model, parts, tiny, weights
from library.models.families.anima.model import AnimaModelError


@pytest.fixture(scope="module")
def m():
    return tiny.build()


def _qwen3_folder(m, path):
    m["qwen3"].save_pretrained(path)
    m["qwen3_tokenizer"].save_pretrained(path)
    return str(path)


def test_qwen3_from_folder_and_single_file(m, tmp_path):
    torch.set_num_threads(1)
    folder = _qwen3_folder(m, tmp_path / "qwen3")
    ids = torch.tensor([[97, 32, 99, 256], [98, 256, 256, 256]])
    mask = (ids != 256).long()
    want = parts.encode_qwen3(m["qwen3"], ids, mask)
    model, tok = parts.load_qwen3(folder)
    assert torch.equal(parts.encode_qwen3(model, ids, mask), want)
    assert tok.pad_token == "<|endoftext|>"
    # one file with sd-scripts' causal-LM names (model.*, lm_head), the tokenizer files beside it
    single = tmp_path / "single"
    single.mkdir()
    m["qwen3_tokenizer"].save_pretrained(single)
    sd = {"model." + k: v for k, v in m["qwen3"].state_dict().items()}
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, str(single / "qwen3.safetensors"))
    model, _ = parts.load_qwen3(str(single / "qwen3.safetensors"), config=tiny.qwen3_config(len(tok)).to_dict())
    assert torch.equal(parts.encode_qwen3(model, ids, mask), want)
    # padding is zero (sd-scripts zeroes the states past the mask)
    assert (want[1, 1:] == 0).all() and (want[1, 0] != 0).any()


def test_qwen3_wrong_file_is_one_line(m, tmp_path):
    single = tmp_path / "q"
    single.mkdir()
    m["qwen3_tokenizer"].save_pretrained(single)
    sd = dict(m["qwen3"].state_dict())
    save_file(sd, str(single / "q.safetensors"))
    with pytest.raises(AnimaModelError, match=r"embed_tokens.weight has shape \[259, 32\], a Qwen3 text encoder "
                                              r"\(1024 wide, 28 layers\) has \[151936, 1024\]") as e:
        parts.load_qwen3(str(single / "q.safetensors"))  # Qwen3-0.6B's config: the tiny file does not fit
    assert "\n" not in str(e.value)
    with pytest.raises(AnimaModelError, match="no Qwen3 tokenizer"):
        save_file(sd, str(tmp_path / "alone.safetensors"))
        parts.load_qwen3(str(tmp_path / "alone.safetensors"))


def test_vae_single_file_and_wrong_vae(m, tmp_path):
    path = str(tmp_path / "vae.safetensors")
    save_file(m["vae"].state_dict(), path)
    vae = parts.load_vae(path, config=tiny.vae_config())
    img = torch.rand(1, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        a, b = parts.encode_images(m["vae"], img), parts.encode_images(vae, img)
    assert torch.equal(a, b) and a.shape == (1, 16, 2, 2)
    # the normalisation is (z - mean) / std with the config's per-channel statistics
    with torch.no_grad():
        z = m["vae"].encode(img.unsqueeze(2)).latent_dist.mode()[:, :, 0].double()
    mean = torch.tensor(m["vae"].config.latents_mean, dtype=torch.float64).view(1, -1, 1, 1)
    std = torch.tensor(m["vae"].config.latents_std, dtype=torch.float64).view(1, -1, 1, 1)
    assert torch.allclose(a.double(), (z - mean) / std, atol=1e-6)
    # an SD VAE (4 latent channels, 2-D convolutions) is refused before loading, in one line
    from diffusers import AutoencoderKL
    save_file(AutoencoderKL(block_out_channels=(8,), norm_num_groups=8).state_dict(), str(tmp_path / "sd.safetensors"))
    with pytest.raises(AnimaModelError, match=r"conv_in.weight has shape \[8, 3, 3, 3\], a Qwen-Image VAE") as e:
        parts.load_vae(str(tmp_path / "sd.safetensors"))
    assert "\n" not in str(e.value)


def test_family_model_conditioning_and_forward(m):
    torch.set_num_threads(1)
    fm = family_model.AnimaFamilyModel(m["dit"], [m["qwen3"]], [m["qwen3_tokenizer"], m["t5_tokenizer"]],
                                       qwen3_max_length=16, t5_max_length=12)
    ids = fm.tokenize(["a red cat", ""])
    assert [t.shape for t in ids] == [(2, 16), (2, 16), (2, 12), (2, 12)]
    assert ids[1][1].sum() == 0 and ids[3][1].sum() == 1  # empty caption: no Qwen3 token, T5's </s>
    with torch.no_grad():
        cond = fm.encode(ids, None)
        x, sigma = torch.randn(2, 16, 4, 6), torch.tensor([0.2, 0.7])
        pred = fm.unet_forward(x, sigma, cond)
        ctx = m["dit"].text_context(cond.hidden_states, ids[2], ids[3], ids[1])
        want = m["dit"](x, sigma, ctx)
    assert torch.equal(pred, want) and pred.isfinite().all()
    assert fm.cache_identity() == {"qwen3_max_length": 16, "t5_max_length": 12, "t5_vocab": len(m["t5_tokenizer"])}


def test_load_anima_from_files(m, tmp_path):
    dit_path = str(tmp_path / "anima.safetensors")
    weights.save_dit(m["dit"], dit_path)
    save_file(m["vae"].state_dict(), str(tmp_path / "vae.safetensors"))
    folder = _qwen3_folder(m, tmp_path / "qwen3")
    assert family_model.is_source(dit_path) and family_model.is_source("tiny-anima")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    assert not family_model.is_source(str(tmp_path / "other.safetensors"))
    with pytest.raises(AnimaModelError, match="vae: an Anima DiT file"):
        family_model.load_anima(dit_path, qwen3=folder, vae=None)
    # the tiny VAE's config is not the released one: its file is refused by shape, one line
    with pytest.raises(AnimaModelError, match="a Qwen-Image VAE"):
        family_model.load_anima(dit_path, qwen3=folder, vae=str(tmp_path / "vae.safetensors"))
    vae_dir = tmp_path / "vae_dir"
    m["vae"].save_pretrained(vae_dir)
    t5_dir = tmp_path / "t5"
    m["t5_tokenizer"].save_pretrained(t5_dir)
    got = family_model.load_anima(dit_path, qwen3=folder, vae=str(vae_dir), t5_tokenizer_path=str(t5_dir))
    for k, v in m["dit"].state_dict().items():
        assert torch.equal(got.dit.state_dict()[k], v), k
    assert got.t5_tokenizer("a cat")["input_ids"] == m["t5_tokenizer"]("a cat")["input_ids"]


def test_qwen3_of_another_width_is_refused(m, tmp_path):
    from transformers import Qwen3Model
    torch.manual_seed(0)
    cfg = tiny.qwen3_config(len(m["qwen3_tokenizer"]))
    cfg.hidden_size = 48
    wide = tmp_path / "wide"
    Qwen3Model(cfg).save_pretrained(wide)
    m["qwen3_tokenizer"].save_pretrained(wide)
    with pytest.raises(AnimaModelError, match="48 wide; the DiT's LLM adapter reads 32-wide"):
        family_model.load_anima("tiny-anima", qwen3=str(wide), vae=None)
