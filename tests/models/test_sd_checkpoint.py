"""Single-file (original layout) and diffusers saving: round trips through diffusers' own
single-file loading, real key names, atomic writes, pickle safety."""
import os
import tempfile

import pytest
import torch

from library.models import loading
from library.models import sd_checkpoint as sdc
from library.errors import ModelError
from library.models.families.sd_common.tiny_models import FAMILY_OF_ARCH, build_tiny_components

ARCHS = ["sd15", "sd2", "sdxl"]

REAL_KEYS = {
    "sd15": ["model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight",
             "model.diffusion_model.input_blocks.3.0.op.weight",
             "model.diffusion_model.middle_block.1.proj_in.weight",
             "model.diffusion_model.output_blocks.2.1.conv.weight",
             "model.diffusion_model.output_blocks.5.2.conv.weight",
             "model.diffusion_model.output_blocks.11.1.transformer_blocks.0.ff.net.0.proj.weight",
             "model.diffusion_model.time_embed.0.weight", "model.diffusion_model.out.2.weight",
             "first_stage_model.encoder.down.0.block.0.conv1.weight",
             "first_stage_model.encoder.mid.attn_1.q.weight", "first_stage_model.decoder.up.3.upsample.conv.weight",
             "first_stage_model.quant_conv.weight",
             "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight",
             "cond_stage_model.transformer.text_model.final_layer_norm.weight"],
    "sd2": ["model.diffusion_model.input_blocks.1.1.proj_in.weight",
            "cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight",
            "cond_stage_model.model.transformer.resblocks.0.mlp.c_fc.weight",
            "cond_stage_model.model.positional_embedding", "cond_stage_model.model.token_embedding.weight",
            "cond_stage_model.model.ln_final.weight"],
    "sdxl": ["model.diffusion_model.input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight",
             "model.diffusion_model.input_blocks.8.1.transformer_blocks.9.attn1.to_q.weight",
             "model.diffusion_model.label_emb.0.0.weight", "model.diffusion_model.output_blocks.2.2.conv.weight",
             "conditioner.embedders.0.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight",
             "conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight",
             "conditioner.embedders.1.model.text_projection"],
}


@pytest.fixture(scope="module")
def tiny():
    return {arch: build_tiny_components(arch) for arch in ARCHS}


def _load_back(path):
    """Load a saved file the way models.py does: diffusers' single-file conversion + the file's configs."""
    state_dict, meta = sdc.read_state_dict(path)
    family = sdc.detect_family(state_dict, path)
    record = __import__("json").loads(meta[sdc.META_CONFIG_KEY])
    with tempfile.TemporaryDirectory() as tmp:
        sdc.write_config_dir(record, tmp)
        return sdc.load_unet_vae_te(state_dict, family, tmp, path), family, state_dict


@pytest.mark.parametrize("arch", ARCHS)
def test_single_file_round_trip_is_exact(tiny, tmp_path, arch):
    comps, family = tiny[arch], FAMILY_OF_ARCH[arch]
    path = str(tmp_path / f"{arch}.safetensors")
    sdc.save_single_file(comps, family, path, metadata={"ss_note": "x"})
    loaded, detected, state_dict = _load_back(path)
    assert detected == family
    for key in REAL_KEYS[arch]:
        assert key in state_dict, key
    names = ["unet", "vae", "text_encoder"] + (["text_encoder_2"] if arch == "sdxl" else [])
    n_tensors = 0
    for name in names:
        want, got = comps[name].state_dict(), loaded[name].state_dict()
        assert set(want) == set(got), name
        for k, v in want.items():
            assert torch.equal(v, got[k]), f"{name}.{k}"
            n_tensors += 1
    # Every tensor in the file is used (plus SD2/SDXL OpenCLIP extras the models do not hold).
    extras = {k for k in state_dict if k.endswith(("logit_scale",)) or (arch == "sd2" and k.endswith("text_projection"))}
    fused = sum(1 for k in state_dict if ".in_proj_" in k)
    assert len(state_dict) - len(extras) == n_tensors - 2 * fused


def test_mid_attention_is_conv_shaped_and_dtype_applies(tiny, tmp_path):
    path = str(tmp_path / "half.safetensors")
    sdc.save_single_file(tiny["sd15"], "sd1", path, dtype=torch.float16)
    sd, meta = sdc.read_state_dict(path)
    assert sd["first_stage_model.encoder.mid.attn_1.q.weight"].ndim == 4
    assert all(v.dtype == torch.float16 for v in sd.values() if v.is_floating_point())
    assert sdc.META_CONFIG_KEY in meta


def test_ckpt_round_trip_and_pickle_refused(tiny, tmp_path):
    path = str(tmp_path / "m.ckpt")
    sdc.save_single_file(tiny["sd15"], "sd1", path)
    sd, meta = sdc.read_state_dict(path)  # plain tensors and strings: weights_only loading works
    assert "model.diffusion_model.out.2.weight" in sd and sdc.META_CONFIG_KEY in meta
    b = loading.load_single_file(path)  # the tiny architecture comes back from the .ckpt's own record
    assert torch.equal(b.unet.conv_in.weight, tiny["sd15"]["unet"].conv_in.weight)

    bad = str(tmp_path / "bad.ckpt")
    torch.save({"state_dict": sd, "callbacks": _Opaque()}, bad)
    with pytest.raises(ModelError) as e:
        sdc.read_state_dict(bad)
    msg = str(e.value)
    assert "allow_pickle" in msg and bad in msg and "\n" not in msg
    sd2, _ = sdc.read_state_dict(bad, allow_pickle=True)
    assert set(sd2) == set(sd)


class _Opaque:
    """A non-tensor object, as Lightning checkpoints carry (refused by weights_only loading)."""


def test_single_file_save_is_atomic(tiny, tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"previous good model")

    def crash(sd, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", crash)
    from library.files import SaveError

    with pytest.raises(SaveError, match=r"^cannot save .*model.safetensors: disk full; the previous file"):
        sdc.save_single_file(tiny["sd15"], "sd1", str(path))
    assert path.read_bytes() == b"previous good model"
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_diffusers_save_is_atomic_and_loads(tiny, tmp_path, monkeypatch):
    out = tmp_path / "model"
    out.mkdir()
    (out / "marker").write_text("old")
    real = sdc._write_diffusers

    def crash(components, family, tmp, dtype):
        real(components, family, tmp, dtype)
        raise OSError("disk full")

    monkeypatch.setattr(sdc, "_write_diffusers", crash)
    from library.files import SaveError

    with pytest.raises(SaveError, match=r"^cannot save .*model: disk full; the previous folder"):
        sdc.save_diffusers(tiny["sd2"], "sd2", str(out))
    assert os.listdir(out) == ["marker"] and os.listdir(tmp_path) == ["model"]
    monkeypatch.setattr(sdc, "_write_diffusers", real)

    sdc.save_diffusers(tiny["sd2"], "sd2", str(out), dtype=torch.float16)
    assert os.listdir(tmp_path) == ["model"] and not (out / "marker").exists()
    from diffusers import UNet2DConditionModel
    unet = UNet2DConditionModel.from_pretrained(str(out), subfolder="unet", torch_dtype=torch.float16)
    from safetensors.torch import load_file
    assert load_file(str(out / "unet" / "diffusion_pytorch_model.safetensors"))["conv_in.weight"].dtype == torch.float16
    assert torch.equal(unet.conv_in.weight, tiny["sd2"]["unet"].conv_in.weight.half())
    assert tiny["sd2"]["unet"].dtype == torch.float32  # the caller's model is not cast


def test_detect_family_rejects_non_sd_files():
    with pytest.raises(ModelError, match="not a Stable Diffusion checkpoint"):
        sdc.detect_family({"foo.weight": torch.zeros(1)}, "x.safetensors")


@pytest.mark.parametrize("arch,model_type", [("sd15", "v1"), ("sd2", "v2"), ("sdxl", "xl_base")])
def test_real_architecture_keys_match_diffusers_detection(arch, model_type):
    """Full-size shipped configs (meta tensors, no memory): the original-layout keys we write are
    the ones diffusers recognises as that real model type, and the parameter counts are the real ones."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    base = os.path.join(sdc.SHIPPED_CONFIGS, arch)
    with init_empty_weights():
        comps = {"unet": UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(base, subfolder="unet")),
                 "vae": AutoencoderKL.from_config(AutoencoderKL.load_config(base, subfolder="vae")),
                 "text_encoder": CLIPTextModel(CLIPTextConfig.from_json_file(f"{base}/text_encoder/config.json"))}
        if arch == "sdxl":
            comps["text_encoder_2"] = CLIPTextModelWithProjection(
                CLIPTextConfig.from_json_file(f"{base}/text_encoder_2/config.json"))
    n = {k: sum(p.numel() for p in m.parameters()) for k, m in comps.items()}
    real = {"sd15": (859520964, 123060480), "sd2": (865910724, 340387840), "sdxl": (2567463684, 123060480)}[arch]
    assert (n["unet"], n["text_encoder"], n["vae"]) == (*real, 83653863)
    if arch == "sdxl":
        assert n["text_encoder_2"] == 694659840
    sd = sdc.original_state_dict(comps, FAMILY_OF_ARCH[arch])
    assert infer_diffusers_model_type(sd) == model_type
    assert sdc.detect_family(sd) == FAMILY_OF_ARCH[arch]
    if arch == "sd15":  # real v1-5 file: 686 U-Net + 248 VAE + 196 text-encoder tensors (+ position_ids)
        assert len(sd) == 686 + 248 + 196
    if arch == "sd2":  # OpenCLIP's 24th block is written (as a copy), as A1111/sd-scripts expect
        assert "cond_stage_model.model.transformer.resblocks.23.attn.in_proj_weight" in sd
        assert sd["cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight"].shape == (3072, 1024)


def test_the_same_model_writes_the_same_bytes_under_any_string_hash_seed(tmp_path):
    """The embedded architecture record lists diffusers' defaulted config keys; diffusers keeps
    them in set order, which follows the process's string-hash seed. Two processes with different
    PYTHONHASHSEED write byte-identical files (the order was seed-dependent before)."""
    import subprocess
    import sys

    script = ("import sys; from library.models import sd_checkpoint as s; "
              "from library.models.families.sd_common.tiny_models import build_tiny_components as b; "
              "s.save_single_file(b('sd15'), 'sd1', sys.argv[1])")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files = []
    for seed in ("1", "2"):
        path = tmp_path / f"seed{seed}.safetensors"
        env = dict(os.environ, PYTHONHASHSEED=seed, OMP_NUM_THREADS="1", PYTHONPATH=root)
        subprocess.run([sys.executable, "-c", script, str(path)], env=env, cwd=root, check=True)
        files.append(path.read_bytes())
    assert files[0] == files[1]


def _with_projections(unet, linear: bool):
    """The same U-Net with 1x1-conv (``linear`` False) or Linear proj_in / proj_out (diffusers'
    two forms; sd-scripts writes SD2 folders with convs)."""
    from diffusers import UNet2DConditionModel

    out = UNet2DConditionModel.from_config(dict(unet.config) | {"use_linear_projection": linear})
    shape = (lambda v: v.flatten(1)) if linear else (lambda v: v[:, :, None, None])
    out.load_state_dict({k: shape(v) if k.endswith(("proj_in.weight", "proj_out.weight")) and v.ndim != (2 if linear else 4)
                         else v for k, v in unet.state_dict().items()})
    return out.eval()


@pytest.mark.parametrize("arch", ["sd2", "sd15"])
def test_a_training_save_writes_the_familys_projections(arch, tmp_path):
    """A full-model training save (single file) of a diffusers folder whose projections have the
    other form: SD2 files hold 2-D Linear proj_in / proj_out (A1111, sd-scripts), SD1 files 4-D 1x1
    convs; the file loads back to the same function. Reference: the folder's own U-Net forward
    (the same products, another kernel: float32 rounding only)."""
    from safetensors.torch import load_file

    from library.config.parse import options_from_values
    from library.training.methods import FullMethod
    from tests.helpers import assert_same_unet_function

    comps = build_tiny_components(arch)
    linear = arch == "sd2"  # the family's form; the folder holds the other
    other = _with_projections(comps["unet"], not linear)
    folder = tmp_path / "folder"
    sdc.save_diffusers(comps | {"unet": other}, FAMILY_OF_ARCH[arch], str(folder))
    bundle = loading.load_model_bundle(str(folder))
    assert bundle.unet.config.use_linear_projection is (not linear)
    opts = options_from_values("train_dreambooth", {"pretrained_model_name_or_path": str(folder),
                                                    "output_dir": str(tmp_path)})
    FullMethod(opts, bundle).save(str(tmp_path / "out.safetensors"), None, {})
    sd = load_file(str(tmp_path / "out.safetensors"))
    proj = [k for k in sd if k.startswith("model.diffusion_model.") and k.endswith(("proj_in.weight", "proj_out.weight"))]
    assert proj and {sd[k].ndim for k in proj} == {2 if linear else 4}
    assert sd["first_stage_model.decoder.mid.attn_1.proj_out.weight"].ndim == 4  # the VAE's stay convs
    back = loading.load_model_bundle(str(tmp_path / "out.safetensors")).unet.eval()
    assert back.config.use_linear_projection is linear
    assert_same_unet_function(other, back)
