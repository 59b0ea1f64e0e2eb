"""SD3 sources and layouts (library/models/families/sd3/sd3_checkpoint.py): the built-in tiny models, SAI single
files (all-in-one or with separate component files), diffusers folders; each saved back in its
layout; the diffusers -> SAI key mapping against diffusers' own SAI -> diffusers conversion."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from library.models import t5
from library.models.families.sd3 import sd3, sd3_checkpoint, sd3_text, sd3_vae

COMPONENTS = ("mmdit", "clip_l", "clip_g", "vae")


def _assert_same(a, b, components=COMPONENTS):
    for name in components:
        sa, sb = getattr(a, name).state_dict(), getattr(b, name).state_dict()
        assert sa.keys() == sb.keys(), name
        bad = [k for k in sa if not torch.equal(sa[k], sb[k])]
        assert not bad, (name, bad[:3])


@pytest.fixture(scope="module")
def tiny():
    return sd3_checkpoint.load_sd3("tiny-sd3.5-medium")


def _keys(path):
    with safe_open(path, "pt") as f:
        return set(f.keys()), f.metadata()


@pytest.mark.parametrize("variant", ("sd3", "sd3.5-medium", "sd3.5-large"))
def test_diffusers_to_sai_inverts_diffusers_conversion(variant):
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    torch.manual_seed(0)
    sai = sd3.build_mmdit(sd3.tiny_config(variant)).state_dict()
    theirs = convert_sd3_transformer_checkpoint_to_diffusers({sd3.PREFIX + k: v for k, v in sai.items()})
    back = sd3_checkpoint.mmdit_from_diffusers(theirs)
    assert back.keys() == sai.keys()
    assert all(torch.equal(back[k], sai[k]) for k in sai)
    assert sd3_checkpoint.detect_variant(back) == variant
    assert sd3_checkpoint.detect_variant({sd3.PREFIX + k: v for k, v in back.items()}) == variant


def test_detect_variant_is_none_for_other_families():
    assert sd3_checkpoint.detect_variant({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(1)}) is None
    assert sd3_checkpoint.detect_variant({"double_blocks.0.img_attn.qkv.weight": torch.zeros(1)}) is None


def test_builtin_builds_are_bit_identical(tiny):
    again = sd3_checkpoint.load_sd3("tiny-sd3.5-medium")
    _assert_same(tiny, again)
    assert tiny.variant == "sd3.5-medium" and sd3_checkpoint.load_sd3("tiny-sd3").variant == "sd3"
    assert tiny.tokenizer_g.pad_token_id == 0  # CLIP-G pads with "!" (id 0), as sd-scripts
    # SAI's CLIP-L has no projection: the pooled vector is the unprojected one
    assert torch.equal(tiny.clip_l.text_projection.weight, torch.eye(32))


def check_diffusers_reads_all_in_one(path: str, tiny, cfg_dir) -> None:
    """diffusers' own single-file loaders (transformer, VAE, both CLIPs, T5) read the all-in-one
    file to the tiny model's weights, bit for bit (configs written into ``cfg_dir``)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel

    for sub, cfg in (("transformer", sd3_checkpoint.diffusers_config(tiny.mmdit.config)),
                     ("vae", dict(tiny.vae.config))):
        os.makedirs(cfg_dir / sub)
        (cfg_dir / sub / "config.json").write_text(json.dumps(cfg))
    ref = SD3Transformer2DModel.from_single_file(path, config=str(cfg_dir), subfolder="transformer",
                                                 local_files_only=True)
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in sd3_checkpoint.mmdit_to_diffusers(
        tiny.mmdit).state_dict().items())
    vae = AutoencoderKL.from_single_file(path, config=str(cfg_dir), subfolder="vae", local_files_only=True)
    assert all(torch.equal(v, vae.state_dict()[k]) for k, v in tiny.vae.state_dict().items())
    from diffusers.loaders.single_file_utils import create_diffusers_clip_model_from_ldm
    from transformers import CLIPTextModelWithProjection

    state = load_file(path)
    for which, sub in (("clip_l", "text_encoder"), ("clip_g", "text_encoder_2")):
        os.makedirs(cfg_dir / sub)
        (cfg_dir / sub / "config.json").write_text(json.dumps(getattr(tiny, which).config.to_dict()))
        clip = create_diffusers_clip_model_from_ldm(CLIPTextModelWithProjection, state, subfolder=sub,
                                                    config=str(cfg_dir), local_files_only=True)
        ours = getattr(tiny, which).state_dict()
        assert all(torch.equal(v, ours[k]) for k, v in clip.state_dict().items() if not k.endswith("position_ids"))
    from diffusers.loaders.single_file_utils import create_diffusers_t5_model_from_checkpoint
    from transformers import T5EncoderModel

    os.makedirs(cfg_dir / "text_encoder_3")
    (cfg_dir / "text_encoder_3" / "config.json").write_text(json.dumps(tiny.t5xxl.config.to_dict()))
    theirs = create_diffusers_t5_model_from_checkpoint(T5EncoderModel, state, subfolder="text_encoder_3",
                                                       config=str(cfg_dir), local_files_only=True)
    ours = tiny.t5xxl.state_dict()
    assert theirs.state_dict().keys() == ours.keys()
    assert all(torch.equal(v, ours[k]) for k, v in theirs.state_dict().items())


def test_all_in_one_file_round_trip_and_diffusers_reads_it(tiny, tmp_path):
    path = str(tmp_path / "sd3.safetensors")
    sd3_checkpoint.save_sd3(tiny, path)
    keys, meta = _keys(path)
    assert {k.split(".transformer.")[0] for k in keys if k.startswith("text_encoders.")} == {
        "text_encoders.clip_l", "text_encoders.clip_g", "text_encoders.t5xxl"}  # the tiny T5 too
    assert "text_encoders.clip_l.transformer.text_model.embeddings.position_embedding.weight" in keys
    assert "text_encoders.clip_l.transformer.text_projection.weight" not in keys  # as in SAI's files
    assert "text_encoders.clip_g.transformer.text_projection.weight" in keys
    assert "model.diffusion_model.joint_blocks.0.x_block.attn2.qkv.weight" in keys
    assert "first_stage_model.encoder.down.0.block.0.conv1.weight" in keys
    assert not any("quant_conv" in k for k in keys)  # SD3's VAE has none
    back = sd3_checkpoint.load_sd3(path, t5_loader=t5.model_from_state_dict)
    _assert_same(tiny, back, COMPONENTS + ("t5xxl",))
    assert back.layout == sd3_checkpoint.LAYOUT_FILE and back.in_source == frozenset(COMPONENTS + ("t5xxl",))
    assert back.tokenizer_t5.get_vocab() == tiny.tokenizer_t5.get_vocab()  # from the file's record

    check_diffusers_reads_all_in_one(path, tiny, tmp_path / "cfg")


def test_transformer_file_with_separate_component_files(tiny, tmp_path):
    main = str(tmp_path / "mmdit.safetensors")
    only_mmdit = sd3_checkpoint.SD3Model(tiny.mmdit, tiny.clip_l, tiny.clip_g, tiny.vae, tiny.tokenizer_l,
                                         tiny.tokenizer_g, source="x", layout=sd3_checkpoint.LAYOUT_FILE,
                                         in_source=frozenset({"mmdit"}))
    sd3_checkpoint.save_sd3(only_mmdit, main)
    # sd-scripts' separate files: CLIP in transformers' layout (CLIP-L without projection), the VAE
    # in the LDM layout without a prefix
    clip_l = {k: v for k, v in tiny.clip_l.state_dict().items() if "projection" not in k}
    save_file(clip_l, str(tmp_path / "clip_l.safetensors"))
    save_file(tiny.clip_g.state_dict(), str(tmp_path / "clip_g.safetensors"))
    save_file(sd3_vae.to_original(tiny.vae, prefix=""), str(tmp_path / "ae.safetensors"))

    with pytest.raises(sd3.SD3ModelError, match="holds no clip_l weights; give the clip_l file"):
        sd3_checkpoint.load_sd3(main)
    back = sd3_checkpoint.load_sd3(main, clip_l=str(tmp_path / "clip_l.safetensors"),
                                   clip_g=str(tmp_path / "clip_g.safetensors"), ae=str(tmp_path / "ae.safetensors"))
    _assert_same(tiny, back)
    # saved in the layout it came from: the transformer file alone, the separate files untouched
    out = str(tmp_path / "saved.safetensors")
    sd3_checkpoint.save_sd3(back, out)
    keys, _ = _keys(out)
    assert keys and all(k.startswith(sd3.PREFIX) for k in keys)
    assert keys == {sd3.PREFIX + k for k in tiny.mmdit.state_dict()}
    # asked for (trained text encoders): the CLIPs go into the file too, in the all-in-one layout
    sd3_checkpoint.save_sd3(back, out, components={"mmdit", "clip_l", "clip_g"})
    with_clips = sd3_checkpoint.load_sd3(out, ae=str(tmp_path / "ae.safetensors"))
    assert with_clips.in_source == frozenset({"mmdit", "clip_l", "clip_g"})
    _assert_same(tiny, with_clips)


def test_diffusers_folder_round_trip(tiny, tmp_path):
    from diffusers import SD3Transformer2DModel

    folder = str(tmp_path / "pipe")
    as_folder = sd3_checkpoint.SD3Model(**{**tiny.__dict__, "layout": sd3_checkpoint.LAYOUT_DIFFUSERS})
    sd3_checkpoint.save_sd3(as_folder, folder)
    index = json.loads(open(os.path.join(folder, "model_index.json")).read())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["text_encoder_3"] == ["transformers", "T5EncoderModel"]
    back = sd3_checkpoint.load_sd3(folder, t5_loader=t5.model_from_state_dict)
    _assert_same(tiny, back, COMPONENTS + ("t5xxl",))
    assert back.tokenizer_t5.get_vocab() == tiny.tokenizer_t5.get_vocab()  # tokenizer_3
    assert back.layout == sd3_checkpoint.LAYOUT_DIFFUSERS
    # diffusers' model from the saved folder computes what ours does
    ref = SD3Transformer2DModel.from_pretrained(folder, subfolder="transformer", local_files_only=True).eval()
    g = torch.Generator().manual_seed(0)
    x, y, ctx = torch.randn(1, 16, 4, 4, generator=g), torch.randn(1, 96, generator=g), torch.randn(1, 5, 128, generator=g)
    t = torch.tensor([500.0])
    with torch.no_grad():
        ours = tiny.mmdit(x, t, y, ctx)
        theirs = ref(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=y, timestep=t).sample
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5


def test_t5_weights_are_carried_or_given_to_the_loader(tiny, tmp_path):
    t5 = {"shared.weight": torch.randn(10, 8), "encoder.block.0.layer.0.SelfAttention.k.weight": torch.randn(8, 8)}
    path = str(tmp_path / "with_t5.safetensors")
    sd = sd3_checkpoint.single_file_state_dict(tiny, COMPONENTS)
    sd.update({sd3_checkpoint.TE_PREFIX["t5xxl"] + k: v for k, v in t5.items()})
    save_file({k: v.contiguous() for k, v in sd.items()}, path,
              metadata={sd3_checkpoint.META_KEY: json.dumps(sd3_checkpoint.config_record(tiny))})
    kept = sd3_checkpoint.load_sd3(path)
    assert kept.t5xxl is None and "t5xxl" in kept.in_source
    out = str(tmp_path / "out.safetensors")
    sd3_checkpoint.save_sd3(kept, out)
    saved = load_file(out)
    for k, v in t5.items():
        assert torch.equal(saved[sd3_checkpoint.TE_PREFIX["t5xxl"] + k], v)

    seen = {}

    def loader(state_dict, source):
        seen.update(state_dict)
        module = torch.nn.Module()
        module.shared = torch.nn.Embedding(10, 8)
        return module

    built = sd3_checkpoint.load_sd3(path, t5_loader=loader)
    assert set(seen) == set(t5) and built.t5xxl is not None


def test_bad_sources_are_one_line_errors(tiny, tmp_path):
    with pytest.raises(sd3.SD3ModelError, match="no such file"):
        sd3_checkpoint.load_sd3(str(tmp_path / "missing.safetensors"))
    with pytest.raises(sd3.SD3ModelError, match="^clip_g: no such file: .*nope.safetensors$"):
        sd3_checkpoint.load_sd3("tiny-sd3", clip_g=str(tmp_path / "nope.safetensors"))
    other = str(tmp_path / "sdxl.safetensors")
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(4, 4)}, other)
    with pytest.raises(sd3.SD3ModelError, match="no SD3 transformer weights"):
        sd3_checkpoint.load_sd3(other)
    # a tiny CLIP without the toolkit's metadata cannot be sized: say so instead of a shape dump
    no_meta = str(tmp_path / "nometa.safetensors")
    sd3_checkpoint.save_sd3(tiny, no_meta, embed_config=False)
    with pytest.raises(sd3.SD3ModelError, match="clip_l is 32 wide, not 768"):
        sd3_checkpoint.load_sd3(no_meta)


def test_detect_source_without_loading(tiny, tmp_path):
    path = str(tmp_path / "m.safetensors")
    sd3_checkpoint.save_sd3(tiny, path)
    assert sd3_checkpoint.detect_source(path) == "sd3.5-medium"
    assert sd3_checkpoint.detect_source("tiny-sd3.5-large") == "sd3.5-large"
    assert sd3_checkpoint.detect_source("tiny-sdxl") is None
    other = str(tmp_path / "sdxl.safetensors")
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(1)}, other)
    assert sd3_checkpoint.detect_source(other) is None
    folder = tmp_path / "pipe" / "transformer"
    os.makedirs(folder)
    (folder / "config.json").write_text(json.dumps(sd3_checkpoint.diffusers_config(sd3.tiny_config("sd3.5-large"))))
    assert sd3_checkpoint.detect_source(str(tmp_path / "pipe")) == "sd3.5-large"


def test_fp8_stored_weights_load_upcast(tiny, tmp_path):
    # fp8-stored transformer files (as shared for SD3.5): each tensor is upcast into the float32 model
    path = str(tmp_path / "fp8.safetensors")
    sd = {k: (v.to(torch.float8_e4m3fn) if k.startswith(sd3.PREFIX) and not k.endswith("pos_embed") else v)
          for k, v in sd3_checkpoint.single_file_state_dict(tiny).items()}
    save_file(sd, path, metadata={sd3_checkpoint.META_KEY: json.dumps(sd3_checkpoint.config_record(tiny))})
    back = sd3_checkpoint.load_sd3(path)
    w = back.mmdit.joint_blocks[0].x_block.attn.qkv.weight
    assert w.dtype == torch.float32
    assert torch.equal(w, tiny.mmdit.joint_blocks[0].x_block.attn.qkv.weight.to(torch.float8_e4m3fn).float())


def test_diffusers_folder_t5_given_to_the_loader_or_copied(tiny, tmp_path):
    src = str(tmp_path / "src")
    sd3_checkpoint.save_sd3(sd3_checkpoint.SD3Model(**{**tiny.__dict__, "layout": sd3_checkpoint.LAYOUT_DIFFUSERS,
                                                       "t5xxl": None, "tokenizer_t5": None}), src)
    t5 = {"shared.weight": torch.randn(10, 8)}
    os.makedirs(os.path.join(src, "text_encoder_3"))
    save_file(t5, os.path.join(src, "text_encoder_3", "model.safetensors"))
    seen = {}
    sd3_checkpoint.load_sd3(src, t5_loader=lambda sd, where: seen.update(sd) or torch.nn.Linear(1, 1))
    assert set(seen) == set(t5) and torch.equal(seen["shared.weight"], t5["shared.weight"])
    # without a T5 module the save keeps the source folder's T5 as it was
    plain = sd3_checkpoint.load_sd3(src)
    out = str(tmp_path / "out")
    sd3_checkpoint.save_sd3(plain, out)
    assert torch.equal(load_file(os.path.join(out, "text_encoder_3", "model.safetensors"))["shared.weight"],
                       t5["shared.weight"])
    assert json.loads(open(os.path.join(out, "model_index.json")).read())["text_encoder_3"][0] == "transformers"


def test_real_files_use_clips_shipped_tokenizer():
    tok_l, tok_g = sd3_text.shipped_tokenizers()
    assert len(tok_l) == 49408 and tok_l.pad_token_id == 49407  # CLIP-L pads with its end token
    assert tok_g.pad_token_id == 0  # CLIP-G with "!" (sd-scripts: pad_token_id = 0)


@pytest.mark.parametrize("name, billions, tol", [("sd3-arch", 2.0, 0.1), ("sd3.5-medium-arch", 2.5, 0.05),
                                                 ("sd3.5-large-arch", 8.1, 0.05)])
def test_full_size_builtins_have_the_published_sizes(name, billions, tol):
    # Stability AI's announced sizes (SD3 Medium 2B, SD3.5 Medium 2.5B, SD3.5 Large 8.1B) count
    # the transformer checkpoint's tensors, the saved position table included; shapes only (meta)
    from library.models.families.sd3 import sd3_builtins

    comps = sd3_builtins.build_builtin(name, device="meta")
    n = sum(v.numel() for v in comps["mmdit"].state_dict().values())
    assert abs(n / 1e9 - billions) < tol, n
    assert comps["vae"].config.latent_channels == 16 and comps["clip_g"].config.hidden_size == 1280
    assert sd3_checkpoint.detect_source(name) == comps["mmdit"].config.variant
