"""FLUX.1 sources and files: the tiny built-ins, sd-scripts' separate files (BFL transformer, also
fp8-stored; clip_l, t5xxl, ae), diffusers folders written by diffusers itself, the BFL <->
diffusers mapping against diffusers' conversion, T5 tokenizer and files, the 16-channel AE."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.errors import ModelError
from library.models import t5
from library.models.families.flux import flux, flux_ae, flux_checkpoint, flux_loading, flux_saving, tiny_flux
from tests.models.test_flux import random_flux, reference_to_diffusers


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def tiny_dev():
    return tiny_flux.build_tiny_flux("dev")


@pytest.fixture(scope="module")
def single_files(tiny_dev, tmp_path_factory):
    return flux_saving.save_single_files(tiny_dev, str(tmp_path_factory.mktemp("flux-files")))


# --- the BFL <-> diffusers mapping -------------------------------------------------------------

@pytest.mark.parametrize("config", [flux.TINY_FLUX_DEV, flux.TINY_FLUX_SCHNELL])
def test_layout_mapping_matches_diffusers_conversion(config):
    sd = random_flux(config).state_dict()
    ref = reference_to_diffusers(sd, config.hidden_size)
    assert _same(flux_checkpoint.bfl_to_diffusers(sd, config), ref)
    # BFL -> diffusers (diffusers' conversion) -> BFL (ours): the same tensors
    assert _same(flux_checkpoint.diffusers_to_bfl(ref, config), sd)


def test_layout_and_variant_detection(tiny_dev):
    sd = tiny_dev["transformer"].state_dict()
    assert flux_checkpoint.layout_of(sd) == "bfl" and flux_checkpoint.variant_of(sd) == "dev"
    assert flux_checkpoint.layout_of({"model.diffusion_model." + k for k in sd}) == "bfl"
    ref = reference_to_diffusers(sd, 64)
    assert flux_checkpoint.layout_of(ref) == "diffusers" and flux_checkpoint.variant_of(ref) == "dev"
    schnell = tiny_flux.build_tiny_flux("schnell")["transformer"].state_dict()
    assert flux_checkpoint.variant_of(schnell) == "schnell"
    assert flux_checkpoint.layout_of(["model.diffusion_model.input_blocks.0.0.weight"]) is None


# --- tiny built-ins --------------------------------------------------------------------------

def test_tiny_builds_are_bit_identical(tiny_dev):
    again = tiny_flux.build_tiny_flux("dev")
    for name in ("transformer", "clip_l", "t5", "ae"):
        assert _same(again[name].state_dict(), tiny_dev[name].state_dict()), name
    m = flux_loading.load_flux("tiny-flux-schnell")
    assert (m.variant, m.layout, m.t5_max_length) == ("schnell", "bfl", 256)
    assert not m.config.guidance_embed


# --- sd-scripts' separate files --------------------------------------------------------------

def test_single_files_load_back(tiny_dev, single_files):
    m = flux_loading.load_flux(single_files["transformer"], clip_l=single_files["clip_l"],
                               t5xxl=single_files["t5xxl"], ae=single_files["ae"])
    assert (m.variant, m.layout, m.t5_max_length) == ("dev", "bfl", 512)
    assert m.config == flux.TINY_FLUX_DEV
    for ours, name in ((m.transformer, "transformer"), (m.clip_l, "clip_l"), (m.t5, "t5"), (m.ae, "ae")):
        assert _same(ours.state_dict(), tiny_dev[name].state_dict()), name
    assert m.t5_tokenizer("a photo of a dog").input_ids == tiny_dev["t5_tokenizer"]("a photo of a dog").input_ids
    assert m.clip_tokenizer("a dog").input_ids == tiny_dev["clip_tokenizer"]("a dog").input_ids
    # the files have the key names of the released files
    keys = set(load_file(single_files["transformer"]))
    assert "double_blocks.0.img_attn.qkv.weight" in keys and "guidance_in.in_layer.weight" in keys
    assert "text_model.encoder.layers.0.self_attn.q_proj.weight" in load_file(single_files["clip_l"])
    ae_keys = set(load_file(single_files["ae"]))
    assert {"encoder.down.0.block.0.norm1.weight", "encoder.mid.attn_1.q.weight", "decoder.up.0.block.0.conv1.weight",
            "decoder.conv_out.weight", "encoder.conv_out.weight"} <= ae_keys
    assert not any("quant_conv" in k or k.startswith("first_stage_model.") for k in ae_keys)


def test_sft_name(single_files, tmp_path):
    import shutil

    sft = str(tmp_path / "flux1-dev.sft")  # BFL's own file name
    shutil.copy(single_files["transformer"], sft)
    assert flux_loading.is_flux_source(sft)
    assert flux_checkpoint.read_transformer(sft).variant == "dev"


def test_single_file_needs_the_other_files(single_files):
    with pytest.raises(ModelError, match="^clip_l: required"):
        flux_loading.load_flux(single_files["transformer"], t5xxl=single_files["t5xxl"], ae=single_files["ae"])
    with pytest.raises(ModelError, match="^ae: no such file"):
        flux_loading.load_flux(single_files["transformer"], clip_l=single_files["clip_l"],
                               t5xxl=single_files["t5xxl"], ae="/nonexistent/ae.safetensors")
    with pytest.raises(ModelError, match="not a FLUX.1 transformer"):
        flux_checkpoint.read_transformer(single_files["clip_l"])


def test_fp8_stored_and_prefixed_transformer(tiny_dev, single_files, tmp_path):
    sd, meta = load_file(single_files["transformer"]), {}
    from safetensors import safe_open

    with safe_open(single_files["transformer"], framework="pt") as f:
        meta = f.metadata()
    fp8 = {"model.diffusion_model." + k: v.to(torch.float8_e4m3fn) for k, v in sd.items()}
    fp8["text_encoders.clip_l.whatever"] = torch.zeros(2)  # other parts of a full checkpoint are ignored
    path = str(tmp_path / "flux1-dev-fp8.safetensors")
    save_file(fp8, path, metadata=meta)
    model, w = flux_checkpoint.load_transformer(path, torch.bfloat16)
    assert w.layout == "bfl" and w.variant == "dev"
    loaded = model.state_dict()
    for k, v in sd.items():
        assert loaded[k].dtype == torch.bfloat16
        assert torch.equal(loaded[k], v.to(torch.float8_e4m3fn).to(torch.bfloat16)), k
    scaled = dict(fp8, **{"model.diffusion_model.img_in.scale_weight": torch.ones(1)})
    save_file(scaled, path, metadata=meta)
    with pytest.raises(ModelError, match="scaled-fp8"):
        flux_checkpoint.read_transformer(path)


def test_real_head_dim_without_metadata_uses_flux_axes(tmp_path):
    # A file without our metadata (as the released ones): head dim 128 -> RoPE axes (16, 56, 56).
    cfg = flux.FluxConfig(vec_in_dim=8, context_in_dim=8, hidden_size=256, num_heads=2, depth=1,
                          depth_single_blocks=1, mlp_ratio=0.25)
    sd = flux.Flux(cfg).state_dict()
    got = flux_checkpoint.config_from_bfl(sd, "x")
    assert got == cfg
    with pytest.raises(ModelError, match="RoPE axes are unknown"):
        flux_checkpoint.config_from_bfl(flux.Flux(flux.TINY_FLUX_DEV).state_dict(), "tiny.safetensors")


# --- diffusers folders -----------------------------------------------------------------------

def _diffusers_written_folder(parts, variant, out, shard=None):
    """A FLUX folder written by diffusers / transformers themselves; the transformer converted by
    diffusers' own single-file conversion."""
    from diffusers import FluxTransformer2DModel

    cfg = parts["transformer"].config
    kw = {k: v for k, v in flux_checkpoint.diffusers_config(cfg).items() if not k.startswith("_")}
    tr = FluxTransformer2DModel(**kw)
    tr.load_state_dict(reference_to_diffusers(parts["transformer"].state_dict(), cfg.hidden_size), strict=True)
    tr.save_pretrained(os.path.join(out, "transformer"), max_shard_size=shard or "10GB")
    parts["clip_l"].save_pretrained(os.path.join(out, "text_encoder"))
    parts["t5"].save_pretrained(os.path.join(out, "text_encoder_2"))
    parts["ae"].save_pretrained(os.path.join(out, "vae"))
    parts["clip_tokenizer"].save_pretrained(os.path.join(out, "tokenizer"))
    parts["t5_tokenizer"].save_pretrained(os.path.join(out, "tokenizer_2"))
    return out


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_diffusers_folder_converted_to_bfl(tiny_dev, tmp_path, shard):
    folder = _diffusers_written_folder(tiny_dev, "dev", str(tmp_path / "flux"), shard)
    if shard:
        assert os.path.isfile(os.path.join(folder, "transformer", flux_checkpoint.DIFFUSERS_INDEX))
    m = flux_loading.load_flux(folder)
    assert (m.variant, m.layout) == ("dev", "diffusers")
    for ours, name in ((m.transformer, "transformer"), (m.clip_l, "clip_l"), (m.t5, "t5"), (m.ae, "ae")):
        assert _same(ours.state_dict(), tiny_dev[name].state_dict()), name


def test_our_diffusers_folder_runs_in_flux_pipeline(tiny_dev, tmp_path):
    from diffusers import FluxPipeline, FluxTransformer2DModel

    folder = str(tmp_path / "ours")
    flux_saving.save_diffusers_folder(tiny_dev, "dev", folder)
    ref = reference_to_diffusers(tiny_dev["transformer"].state_dict(), 64)
    written = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer", local_files_only=True)
    assert _same(written.state_dict(), ref)
    pipe = FluxPipeline.from_pretrained(folder, local_files_only=True)
    images = pipe("a photo of a dog", height=32, width=32, num_inference_steps=1, guidance_scale=3.5,
                  max_sequence_length=16, output_type="pt").images
    assert images.shape == (1, 3, 32, 32) and torch.isfinite(images).all()


@pytest.mark.parametrize("layout", ["bfl", "diffusers"])
def test_save_flux_transformer_round_trip(tiny_dev, tmp_path, layout):
    tr = tiny_dev["transformer"]
    path = str(tmp_path / ("t.safetensors" if layout == "bfl" else "transformer"))
    flux_checkpoint.save_flux_transformer(path, tr.state_dict(), layout, tr.config, metadata={"ss_x": 1})
    w = flux_checkpoint.read_transformer(path)
    assert (w.layout, w.variant, w.config) == (layout, "dev", tr.config)
    assert _same(w.state_dict, tr.state_dict())
    # a second save replaces the first atomically: no temporaries left beside it
    flux_checkpoint.save_flux_transformer(path, tr.state_dict(), layout, tr.config)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]


# --- T5 --------------------------------------------------------------------------------------

def test_t5_tokenizer_conventions():
    tok = t5.build_tiny_tokenizer()
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "</s>", "<unk>"]
    assert tok.tokenize("a photo of sks") == ["▁a", "▁photo", "▁of", "▁sks"]
    ids, mask = t5.tokenize(tok, ["a photo of sks", "dog " * 600], t5.T5_MAX_LENGTH["dev"])
    assert ids.shape == mask.shape == (2, 512)
    n = len(tok.tokenize("a photo of sks"))
    assert ids[0, n] == 1 and not ids[0, n + 1:].any()  # </s>, then padding with 0
    assert mask[0].tolist() == [1] * (n + 1) + [0] * (511 - n)
    assert mask[1].all() and ids[1, -1] == 1  # truncated, </s> kept last
    ids, _ = t5.tokenize(tok, ["a"], t5.T5_MAX_LENGTH["schnell"])
    assert ids.shape == (1, 256)


def test_t5_encoder_mask():
    model, tok = t5.build_tiny_t5()
    ids, mask = t5.tokenize(tok, ["a photo of a dog"], 16)
    with torch.no_grad():
        masked = t5.encode(model, ids, mask, apply_t5_attn_mask=True)
        plain = t5.encode(model, ids, mask, apply_t5_attn_mask=False)
        ref = model(ids, attention_mask=mask).last_hidden_state
    assert masked.shape == (1, 16, 32)
    assert torch.equal(masked, ref) and not torch.allclose(masked, plain)


@pytest.mark.parametrize("embedding", ["both", "shared", "embed_tokens"])
def test_t5_file_embedding_names_and_inferred_config(tmp_path, embedding):
    model, _ = t5.build_tiny_t5()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if embedding == "shared":
        del sd["encoder.embed_tokens.weight"]
    elif embedding == "embed_tokens":
        del sd["shared.weight"]
    path = str(tmp_path / "t5xxl_fp16.safetensors")
    save_file({k: v.half() for k, v in sd.items()}, path)  # no metadata: config from the shapes
    loaded, tok = t5.load_t5(path)
    assert tok is None
    for key in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads", "feed_forward_proj",
                "relative_attention_num_buckets"):
        assert getattr(loaded.config, key) == getattr(model.config, key), key
    want = {k: v.half().float() for k, v in model.state_dict().items()}
    assert _same(loaded.state_dict(), want)
    assert loaded.shared.weight.data_ptr() == loaded.encoder.embed_tokens.weight.data_ptr()


# --- the autoencoder -------------------------------------------------------------------------

def test_ae_latents_scaling(tiny_dev):
    vae = tiny_dev["ae"]
    assert vae.config.latent_channels == 16 and vae.quant_conv is None
    torch.manual_seed(0)
    pixels = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        lat = flux_ae.encode_latents(vae, pixels)
        mean = vae.encode(pixels).latent_dist.mean
        assert torch.allclose(lat, (mean - 0.1159) * 0.3611, atol=1e-6, rtol=0)
        assert torch.allclose(flux_ae.decode_latents(vae, lat), vae.decode(mean).sample, atol=1e-5)
    assert lat.shape == (1, 16, 4, 4)


def test_ae_file_loads_in_diffusers_single_file(single_files, tiny_dev, tmp_path):
    """The ae file as diffusers' own from_single_file reads it (the FLUX VAE's config)."""
    from diffusers import AutoencoderKL

    cfg_dir = tmp_path / "cfg"
    os.makedirs(cfg_dir / "vae")
    cfg = {k: v for k, v in dict(tiny_dev["ae"].config).items() if not k.startswith("_")}
    (cfg_dir / "vae" / "config.json").write_text(json.dumps(dict(cfg, _class_name="AutoencoderKL")))
    vae = AutoencoderKL.from_single_file(single_files["ae"], config=str(cfg_dir), subfolder="vae",
                                         local_files_only=True)
    assert _same(vae.state_dict(), tiny_dev["ae"].state_dict())


def test_is_flux_source_and_dtype(single_files, tiny_dev, tmp_path):
    assert flux_loading.is_flux_source(single_files["transformer"])
    assert not flux_loading.is_flux_source(single_files["clip_l"])
    assert not flux_loading.is_flux_source(str(tmp_path))  # no transformer/config.json
    folder = str(tmp_path / "flux")
    flux_saving.save_diffusers_folder(tiny_dev, "dev", folder)
    assert flux_loading.is_flux_source(folder)
    m = flux_loading.load_flux(single_files["transformer"], clip_l=single_files["clip_l"],
                               t5xxl=single_files["t5xxl"], ae=single_files["ae"], dtype=torch.bfloat16)
    for part in (m.transformer, m.clip_l, m.t5, m.ae):
        assert {p.dtype for p in part.parameters()} == {torch.bfloat16}


def test_bad_files_are_one_line_errors(tmp_path, tiny_dev):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelError, match="not a readable safetensors file"):
        flux_checkpoint.read_transformer(str(junk))
    path = str(tmp_path / "bad-meta.safetensors")
    save_file(tiny_dev["transformer"].state_dict(), path, metadata={flux_checkpoint.META_CONFIG_KEY: "{"})
    with pytest.raises(ModelError, match="sdtk.flux_config is not a valid JSON object"):
        flux_checkpoint.read_transformer(path)
    save_file(tiny_dev["transformer"].state_dict(), path,
              metadata={flux_checkpoint.META_CONFIG_KEY: json.dumps({"axes_dim": [8, 8, 8], "theta": 10000})})
    with pytest.raises(ModelError, match="axes_dim"):
        flux_checkpoint.load_transformer(path)
    sd = dict(tiny_dev["transformer"].state_dict())
    del sd["single_blocks.1.linear2.bias"]
    with pytest.raises(ModelError, match="missing tensor single_blocks.1.linear2.bias"):
        flux_checkpoint.build_transformer(flux_checkpoint.TransformerWeights(sd, flux.TINY_FLUX_DEV, "bfl", "dev"))


def test_make_tiny_model_writes_flux(tmp_path, capsys):
    from tools.make_tiny_model import main

    assert main(["--arch", "flux-schnell", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("wrote ") == 5
    files = {r: str(tmp_path / n) for r, n in flux_saving.SINGLE_FILE_NAMES.items()}
    a = flux_loading.load_flux(files["transformer"], clip_l=files["clip_l"], t5xxl=files["t5xxl"], ae=files["ae"])
    b = flux_loading.load_flux(str(tmp_path / "diffusers"))
    assert (a.variant, a.layout, b.variant, b.layout) == ("schnell", "bfl", "schnell", "diffusers")
    want = tiny_flux.build_tiny_flux("schnell")["transformer"].state_dict()
    assert _same(a.transformer.state_dict(), want) and _same(b.transformer.state_dict(), want)


def test_prompt_conditioning_matches_flux_pipeline(tiny_dev):
    """Without apply_t5_attn_mask the conditioning is diffusers' FluxPipeline.encode_prompt's; with
    it, T5 skips the padding (a different, finite output)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    from library.models.families.flux import flux_text

    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=tiny_dev["ae"],
                        text_encoder=tiny_dev["clip_l"], tokenizer=tiny_dev["clip_tokenizer"],
                        text_encoder_2=tiny_dev["t5"], tokenizer_2=tiny_dev["t5_tokenizer"], transformer=None)
    prompts = ["a photo of a dog", "a red cat in the style of a painting"]
    tokens = flux_text.tokenize(tiny_dev["clip_tokenizer"], tiny_dev["t5_tokenizer"], prompts, 32)
    with torch.no_grad():
        ours = flux_text.encode(tiny_dev["clip_l"], tiny_dev["t5"], tokens, apply_t5_attn_mask=False)
        masked = flux_text.encode(tiny_dev["clip_l"], tiny_dev["t5"], tokens, apply_t5_attn_mask=True)
        embeds, pooled, ids = pipe.encode_prompt(prompts, prompts, max_sequence_length=32)
    assert torch.equal(ours.t5_out, embeds) and torch.equal(ours.l_pooled, pooled)
    assert ours.txt_ids.shape == (2, 32, 3) and torch.equal(ours.txt_ids[0], ids)
    assert ours.t5_attn_mask[0].sum() == len(tiny_dev["t5_tokenizer"](prompts[0]).input_ids)
    assert torch.isfinite(masked.t5_out).all() and not torch.allclose(masked.t5_out, ours.t5_out)


def test_full_size_t5xxl_config_from_shapes():
    """T5-XXL's config (sd-scripts' T5_CONFIG_JSON values) comes back from its tensors' shapes
    (meta device: no memory)."""
    from transformers import T5Config, T5EncoderModel

    with torch.device("meta"):
        sd = T5EncoderModel(T5Config(**t5.T5XXL_CONFIG)).state_dict()
    cfg = t5.config_from_state_dict(sd, "t5xxl_fp16.safetensors")
    assert {k: cfg[k] for k in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
                                "feed_forward_proj", "relative_attention_num_buckets")} == dict(
        vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=32)


def test_full_size_ae_layout_through_diffusers_conversion():
    """FLUX.1's autoencoder at full size (meta device): our ae.safetensors names, read back by
    diffusers' own LDM VAE conversion, give exactly the AutoencoderKL's tensors."""
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    with torch.device("meta"):
        vae = AutoencoderKL(**flux_ae.FLUX_AE_CONFIG)
    ours = flux_ae.ae_state_dict(vae)
    assert "encoder.conv_out.weight" in ours and ours["encoder.conv_out.weight"].shape[0] == 32  # 2 x 16 channels
    assert not any("quant_conv" in k for k in ours)
    back = convert_ldm_vae_checkpoint(ours, dict(vae.config))
    assert {k: v.shape for k, v in back.items()} == {k: v.shape for k, v in vae.state_dict().items()}


@pytest.mark.parametrize("prefixed", [True, False])
def test_clip_l_file_variants(single_files, tiny_dev, tmp_path, prefixed):
    """clip_l files as ComfyUI / sd-scripts hold them: text_model. names (or none), plus the full
    CLIP model's projection and logit scale and an old position-id buffer, which are not loaded."""
    from safetensors import safe_open

    from library.models import clip_l_file

    with safe_open(single_files["clip_l"], framework="pt") as f:
        meta = f.metadata()
    sd = load_file(single_files["clip_l"])
    if not prefixed:
        sd = {k.removeprefix("text_model."): v for k, v in sd.items()}
    sd["text_projection.weight"] = torch.zeros(32, 32)
    sd["logit_scale"] = torch.tensor(4.6)
    sd["text_model.embeddings.position_ids"] = torch.arange(77)[None]
    path = str(tmp_path / "clip_l.safetensors")
    save_file({k: v.to(torch.float8_e4m3fn) if v.is_floating_point() else v for k, v in sd.items()}, path,
              metadata=meta)
    model, _ = clip_l_file.load_clip_l(path)
    want = {k: v.to(torch.float8_e4m3fn).float() for k, v in tiny_dev["clip_l"].state_dict().items()}
    assert _same(model.state_dict(), want)
    ids = tiny_dev["clip_tokenizer"](["a dog"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).pooler_output).all()
