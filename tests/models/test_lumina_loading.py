"""Lumina 2 sources: the original single file (also with ComfyUI's prefix) with gemma2 and ae files,
a diffusers Lumina2 folder, the full save in the source's layout, and the one-line refusals read
from headers before any weight loads."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from library.errors import ModelError
from library.models.families.flux import flux_ae
from library.models.families.lumina import layout, loading, text, tiny


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lumina")
    parts = tiny.build_tiny_lumina()
    m = loading.LuminaModel("original", tiny.nextdit.TINY, parts["transformer"], parts["gemma2"], parts["tokenizer"],
                            parts["ae"], "x", "y")
    out = {"parts": parts, "dir": d}
    out["transformer"] = str(d / "lumina.safetensors")
    loading.save_transformer(out["transformer"], m, parts["transformer"].state_dict(), {"k": "v"})
    out["gemma2"] = str(d / "gemma2.safetensors")
    save_file({"model." + k: v.contiguous() for k, v in parts["gemma2"].state_dict().items()}, out["gemma2"],
              text.gemma2_file_metadata(parts["gemma2"], parts["tokenizer"]))
    out["ae"] = str(d / "ae.safetensors")
    save_file({k: v.contiguous() for k, v in flux_ae.ae_state_dict(parts["ae"]).items()}, out["ae"],
              flux_ae.ae_file_metadata(parts["ae"]))
    return out


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_single_file_with_gemma2_and_ae(files):
    assert loading.is_lumina_source(files["transformer"]) and loading.is_lumina_source("tiny-lumina")
    assert not loading.is_lumina_source(files["ae"]) and not loading.is_lumina_source(files["gemma2"])
    m = loading.load_lumina(files["transformer"], gemma2=files["gemma2"], ae=files["ae"])
    p = files["parts"]
    assert m.layout == "original" and m.config == tiny.nextdit.TINY
    assert _same(m.transformer, p["transformer"]) and _same(m.gemma2, p["gemma2"]) and _same(m.ae, p["ae"])
    assert m.tokenizer("a dog").input_ids == p["tokenizer"]("a dog").input_ids


def test_comfyui_prefix_and_diffusers_folder_round_trip(files, tmp_path):
    p = files["parts"]
    comfy = str(tmp_path / "comfy.safetensors")
    save_file({layout.COMFY_PREFIX + k: v.contiguous() for k, v in p["transformer"].state_dict().items()}
              | {"vae.decoder.conv_in.weight": torch.zeros(1)}, comfy,
              {loading.META_CONFIG_KEY: open_record(files["transformer"])})
    m = loading.load_lumina(comfy, gemma2=files["gemma2"], ae=files["ae"])
    assert _same(m.transformer, p["transformer"])
    # a diffusers folder: the transformer written by our saver in diffusers' layout, the rest by diffusers
    folder = tmp_path / "pipe"
    dm = loading.LuminaModel("diffusers", tiny.nextdit.TINY, p["transformer"], p["gemma2"], p["tokenizer"], p["ae"],
                             "x", "y")
    loading.save_transformer(str(folder / "transformer"), dm, p["transformer"].state_dict(), {})
    p["gemma2"].save_pretrained(str(folder / "text_encoder"))
    p["tokenizer"].save_pretrained(str(folder / "tokenizer"))
    p["ae"].save_pretrained(str(folder / "vae"))
    from diffusers import Lumina2Transformer2DModel
    ref = Lumina2Transformer2DModel.from_pretrained(str(folder / "transformer"))  # diffusers reads our folder
    assert ref.config.num_kv_heads == 2
    assert loading.is_lumina_source(str(folder))
    m = loading.load_lumina(str(folder))
    assert m.layout == "diffusers" and _same(m.transformer, p["transformer"]) and _same(m.gemma2, p["gemma2"])
    assert _same(m.ae, p["ae"])


def open_record(path):
    from library.safetensors_file import read_header
    return read_header(path)[1]["__metadata__"][loading.META_CONFIG_KEY]


def test_refusals_are_one_line_before_weights(files, tmp_path):
    def refused(match, *args, **kw):
        with pytest.raises(ModelError) as e:
            loading.check_sources(*args, **kw)
        assert match in str(e.value) and "\n" not in str(e.value), str(e.value)

    refused("gemma2: required with a single-file Lumina 2 transformer", files["transformer"], None, files["ae"])
    refused("ae: required", files["transformer"], files["gemma2"], None)
    # a T5 file as gemma2; a Gemma-2 of another size (no record: checked against 2B's shapes)
    t5 = str(tmp_path / "t5.safetensors")
    save_file({"shared.weight": torch.zeros(10, 4), "encoder.block.0.layer.0.SelfAttention.q.weight": torch.zeros(4, 4)},
              t5)
    refused("gemma2: " + t5 + " is not a Gemma-2 2B text encoder (no embed_tokens.weight", files["transformer"], t5,
            files["ae"])
    bare = str(tmp_path / "gemma_small.safetensors")
    save_file({k: v.contiguous() for k, v in files["parts"]["gemma2"].state_dict().items()}, bare)
    refused("is not a Gemma-2 2B text encoder: embed_tokens.weight is", files["transformer"], bare, files["ae"])
    # a Gemma-2 of the right layout but another width than the transformer reads
    wide, tok = text.build_tiny_gemma2(hidden_size=48)
    wide_file = str(tmp_path / "wide.safetensors")
    save_file({k: v.contiguous() for k, v in wide.state_dict().items()}, wide_file, text.gemma2_file_metadata(wide, tok))
    refused("is 48 wide; the Lumina 2 transformer reads 32-wide caption states", files["transformer"], wide_file,
            files["ae"])
    # SD's 4-channel VAE as ae
    sdvae = str(tmp_path / "sdvae.safetensors")
    save_file({"decoder.conv_in.weight": torch.zeros(64, 4, 3, 3), "quant_conv.weight": torch.zeros(8, 8, 1, 1)}, sdvae)
    refused("ae: " + sdvae + " is not FLUX.1's autoencoder: its latents have 4 channels", files["transformer"],
            files["gemma2"], sdvae)
    # not a Lumina file at all
    refused("not a Lumina 2 transformer", files["gemma2"], files["gemma2"], files["ae"])
    assert os.path.exists(files["transformer"])
