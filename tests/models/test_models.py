"""Model loading: built-in names, diffusers folders and single files give the same model; source
resolution, detection, tokenizers, VAE override and one-line errors."""
import logging
import os
import shutil

import pytest
import torch

from library.models.loading import load_model_bundle, resolve_model_source
from library.errors import ModelError
from tools.make_tiny_model import main as make_tiny_main

ARCHS = {"sd15": "sd1", "sd2": "sd2", "sdxl": "sdxl"}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """make_tiny_model output per arch: {arch: (diffusers folder, single file)}."""
    out = {}
    for arch in ARCHS:
        d = tmp_path_factory.mktemp(arch)
        assert make_tiny_main(["--arch", arch, "--out", str(d)]) == 0
        out[arch] = (str(d / "diffusers"), str(d / f"{arch}.safetensors"))
    return out


def _modules(b):
    return {"unet": b.unet, "vae": b.vae, **{f"te{i}": te for i, te in enumerate(b.text_encoders)}}


def _assert_same_weights(a, b):
    ma, mb = _modules(a), _modules(b)
    assert ma.keys() == mb.keys()
    for name in ma:
        sa, sb = ma[name].state_dict(), mb[name].state_dict()
        assert sa.keys() == sb.keys(), name
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"{name}.{k}"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_three_sources_load_the_same_model(written, arch):
    folder, single = written[arch]
    bundles = [load_model_bundle(f"tiny-{arch}"), load_model_bundle(folder), load_model_bundle(single)]
    for b in bundles:
        assert b.family == ARCHS[arch]
        assert b.v_parameterization is (arch == "sd2")
        assert b.noise_scheduler.config.prediction_type == ("v_prediction" if arch == "sd2" else "epsilon")
        assert len(b.text_encoders) == len(b.tokenizers) == (2 if arch == "sdxl" else 1)
        assert set(b.components()) >= {"unet", "vae", "text_encoder", "tokenizer", "scheduler"}
    for b in bundles[1:]:
        _assert_same_weights(bundles[0], b)
        for ta, tb in zip(bundles[0].tokenizers, b.tokenizers):
            assert ta("a photo of a sks dog", padding="max_length", max_length=77).input_ids == \
                tb("a photo of a sks dog", padding="max_length", max_length=77).input_ids
    if arch == "sdxl":  # the second tokenizer's padding survives every form
        assert len({b.tokenizers[1].pad_token for b in bundles}) == 1
    ids = [b.identity for b in bundles]
    assert len(set(ids)) == 3 and ids[0] == f"builtin:tiny-{arch}:20240601"
    assert load_model_bundle(single).identity == bundles[2].identity  # stable across loads


def test_identity_changes_when_the_file_changes(written, tmp_path):
    src = written["sd15"][1]
    copy = str(tmp_path / "m.safetensors")
    shutil.copy(src, copy)
    a = load_model_bundle(copy)
    st = os.stat(copy)
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    b = load_model_bundle(copy)
    assert a.identity != b.identity and a.vae_identity != b.vae_identity


def test_resolution_rules(tmp_path, monkeypatch, caplog):
    assert resolve_model_source("tiny-sd15").kind == "builtin"
    assert resolve_model_source("tiny-sdxl").arch == "sdxl"
    assert resolve_model_source("sd15-arch").kind == "builtin"
    assert resolve_model_source("stabilityai/stable-diffusion-xl-base-1.0").kind == "hub"
    for missing in ["./nope", "/no/such/dir", "models/x.safetensors", "a/b/c", "x.ckpt"]:
        with pytest.raises(ModelError) as e:
            resolve_model_source(missing)
        assert str(e.value) == f"pretrained_model_name_or_path: no such file or directory: {missing}"
    with pytest.raises(ModelError, match="not a built-in model"):
        resolve_model_source("tiny-sd99")
    # An existing folder named like a built-in wins, with a warning.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-sd15").mkdir()
    with caplog.at_level(logging.WARNING, logger="sdtk"):
        src = resolve_model_source("tiny-sd15")
    assert src.kind == "diffusers" and src.location == str(tmp_path / "tiny-sd15")
    assert any("tiny-sd15" in r.getMessage() and "built-in" in r.getMessage() for r in caplog.records)


def test_existing_folder_named_like_builtin_is_loaded(written, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(written["sd2"][0], tmp_path / "tiny-sd15")
    b = load_model_bundle("tiny-sd15")
    assert b.family == "sd2" and b.identity.startswith("dir:")


def test_hub_id_offline_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError) as e:
        load_model_bundle("someorg/somemodel")
    assert "someorg/somemodel" in str(e.value) and "HF_HUB_OFFLINE" in str(e.value) and "\n" not in str(e.value)


def test_pickled_ckpt_needs_allow_pickle(written, tmp_path):
    from safetensors.torch import load_file

    sd = load_file(written["sd15"][1])
    path = str(tmp_path / "lightning.ckpt")
    torch.save({"state_dict": sd, "hparams": _Hparams()}, path)
    with pytest.raises(ModelError, match="allow_pickle"):
        load_model_bundle(path)
    # Without the metadata configs the tiny weights do not fit the real SD1.5 architecture:
    # a clear error instead of a crash (and allow_pickle did get past the pickle check).
    with pytest.raises(ModelError) as e:
        load_model_bundle(path, allow_pickle=True)
    assert path in str(e.value) and "\n" not in str(e.value)


class _Hparams:
    lr = 1e-4


def test_v_parameterization_flag_and_v2_check(caplog):
    b = load_model_bundle("tiny-sd15", v_parameterization=True)
    assert b.v_parameterization and b.noise_scheduler.config.prediction_type == "v_prediction"
    with caplog.at_level(logging.WARNING, logger="sdtk"):
        b = load_model_bundle("tiny-sd15", v2=True)
    assert b.family == "sd1" and any("v2" in r.getMessage() for r in caplog.records)


def test_missing_tokenizer_names_the_option(written, tmp_path):
    folder = tmp_path / "no_tok"
    shutil.copytree(written["sd15"][0], folder)
    shutil.rmtree(folder / "tokenizer")
    # The shipped CLIP vocabulary (49408) does not fit the tiny text encoder: say so, name the option.
    with pytest.raises(ModelError) as e:
        load_model_bundle(str(folder))
    assert "--tokenizer_path" in str(e.value) and "\n" not in str(e.value)
    b = load_model_bundle(str(folder), tokenizer_path=os.path.join(written["sd15"][0], "tokenizer"))
    assert b.tokenizers[0]("a cat").input_ids == load_model_bundle("tiny-sd15").tokenizers[0]("a cat").input_ids
    with pytest.raises(ModelError, match="tokenizer_path: no such file"):
        load_model_bundle(str(folder), tokenizer_path=str(tmp_path / "nothing"))


def test_vae_override(written, tmp_path):
    from library.models.families.sd_common.tiny_models import build_tiny_components

    vae = build_tiny_components("sd15")["vae"]
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.5)
    vae_dir = str(tmp_path / "myvae")
    vae.save_pretrained(vae_dir)
    base = load_model_bundle("tiny-sd15")
    b = load_model_bundle("tiny-sd15", vae=vae_dir)
    assert torch.equal(b.vae.decoder.conv_out.weight, vae.decoder.conv_out.weight)
    assert b.vae_identity != base.vae_identity and b.identity == base.identity
    # A VAE as a single file in the original layout (a full checkpoint's first_stage_model.*).
    b2 = load_model_bundle("tiny-sd15", vae=written["sd15"][1])
    _assert_same_weights(base, b2)
    with pytest.raises(ModelError, match="vae: no such file"):
        load_model_bundle("tiny-sd15", vae=str(tmp_path / "missing.safetensors"))


def test_models_module_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; import library.models.loading as m; m.resolve_model_source('tiny-sd15'); "
            "print('torch' in sys.modules, 'diffusers' in sys.modules)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.slow
def test_full_size_sd15_arch_round_trips_through_real_layout(tmp_path):
    from library.models.sd_checkpoint import save_single_file

    b = load_model_bundle("sd15-arch")
    assert sum(p.numel() for p in b.unet.parameters()) == 859520964
    assert b.tokenizers[0]("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    path = str(tmp_path / "sd15.safetensors")
    # Like a third-party file (no embedded configs: the shipped ones are used); fp16 halves the memory.
    save_single_file(b.components(), "sd1", path, dtype=torch.float16, embed_config=False)
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        assert "sdtk.diffusers_config" not in (f.metadata() or {})
    b2 = load_model_bundle(path)
    assert b2.family == "sd1" and not b2.v_parameterization
    ma, mb = _modules(b), _modules(b2)
    for name in ma:
        sb = mb[name].state_dict()
        for k, v in ma[name].state_dict().items():
            assert torch.equal(v.half().float(), sb[k].float()), f"{name}.{k}"


@pytest.mark.parametrize("name,family,v", [("sd2-arch", "sd2", True), ("sdxl-arch", "sdxl", False)])
def test_full_size_builtins_build_from_shipped_configs(name, family, v):
    """Built on the meta device (no memory): the real topology, shipped tokenizers, prediction type."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        b = load_model_bundle(name)
    assert b.family == family and b.v_parameterization is v
    assert b.unet.config.cross_attention_dim == sum(te.config.hidden_size for te in b.text_encoders)
    assert all(len(t) == 49408 for t in b.tokenizers)
    if family == "sdxl":
        assert b.tokenizers[1].pad_token == "!" and b.tokenizers[0].pad_token == "<|endoftext|>"
