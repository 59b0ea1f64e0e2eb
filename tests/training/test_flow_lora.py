"""train_lora on FLUX.1 and SD3 (sd-scripts' flux_train_network.py / sd3_train_network.py) through
the entry script, on the built-in tiny models (64 px, 2 steps):

- a FLUX.1 LoRA (transformer and CLIP-L): the file holds the trained network in kohya's FLUX
  layout with sd-scripts' metadata, and loads in diffusers' FluxPipeline with every key consumed
  and the fused weights W + up @ down * alpha / rank (float64, from the file);
- an SD3 LoRA (split_qkv): every name is in ComfyUI's key map, and the MMDiT patched the way the
  clients patch it (float64, from the file) computes what the trained run's network computes;
- exact resume of a FLUX.1 and of an SD3 LoRA (stopped mid-epoch at step 2, resumed, bit-identical file);
- the network modules and network_args that do not apply fail before any weight loads.
diffusers 0.42 has no kohya SD3 converter (tests/networks/test_lora_sd3.py pins it): ComfyUI's
key map stands in for the SD3 client.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.models.families.flux import flux_checkpoint, flux_saving, tiny_flux
from library.models.families.sd3 import sd3_builtins
from tests.client_key_tables import comfy_dit_shapes
from tests.conftest import read
from tests.helpers import load_lora_logged
from tests.networks.test_lora_flux import _expected

FLUX_IMPL = "https://github.com/black-forest-labs/flux"  # sd-scripts' IMPL_FLUX


def lora_args(model, module, data, out, *extra):
    return ["--pretrained_model_name_or_path", model, "--train_data_dir", data, "--output_dir", out,
            "--resolution", "64", "--max_train_steps", "2", "--cache_latents", "--seed", "7",
            "--network_module", module, "--network_dim", "4", "--network_alpha", "4",
            "--learning_rate", "1e-2", *extra]


def _block_and_clip_names(flux, clip_l) -> set[str]:
    """Independent of the network's walk: every 2-D weight of the double / single blocks, and
    CLIP-L's attention and MLP projections (sd-scripts' targets), as kohya names."""
    names = {"lora_unet_" + k[:-len(".weight")].replace(".", "_") for k, v in flux.state_dict().items()
             if k.endswith(".weight") and v.dim() == 2 and k.startswith(("double_blocks.", "single_blocks."))}
    for k in clip_l.state_dict():
        if ".layers." in k and k.endswith(("_proj.weight", "fc1.weight", "fc2.weight")):
            path = k if k.startswith("text_model.") else "text_model." + k
            names.add("lora_te1_" + path[:-len(".weight")].replace(".", "_"))
    return names


def _assert_saved_is_trained(path, network):
    """The file holds the network's tensors as trained (float32, save_precision unset)."""
    saved, trained = load_file(path), network.state_dict()
    assert saved.keys() == trained.keys()
    for k, v in trained.items():
        assert torch.equal(saved[k], v.detach().float()), k
    ups = [k for k in saved if k.endswith("lora_up.weight")]
    assert all(float(saved[k].abs().max()) > 0 for k in ups)  # every module trained (ups start at 0)


def test_flux_lora_trains_and_loads_in_diffusers(dataset, tmp_path, train):
    from diffusers import FluxPipeline

    out = tmp_path / "out"
    rc, _, err, run = train("train_lora", lora_args("tiny-flux", "networks.lora_flux", dataset, str(out)))
    assert rc == 0, err
    path = str(out / "last.safetensors")
    parts = tiny_flux.build_tiny_flux("dev")  # the initial weights (fixed seed), a fresh copy
    sd, meta = read(path)
    assert {k.split(".")[0] for k in sd} == _block_and_clip_names(parts["transformer"], parts["clip_l"])
    _assert_saved_is_trained(path, run.parts.method.network)
    clip_l, t5 = run.parts.bundle.text_encoders
    assert clip_l.training and not t5.training  # T5 has no LoRA: frozen, no dropout (a diffusers T5 has 0.1)
    assert (meta["ss_network_module"], meta["ss_base_model_version"], meta["modelspec.architecture"],
            meta["modelspec.implementation"]) == ("networks.lora_flux", "flux1", "flux-1-dev/lora", FLUX_IMPL)
    assert "modelspec.prediction_type" not in meta  # sd-scripts writes none for FLUX.1
    assert (meta["ss_network_dim"], meta["ss_network_alpha"], meta["ss_guidance_scale"],
            meta["ss_timestep_sampling"], meta["ss_model_prediction_type"]) == \
        ("4", "4.0", "3.5", "sigma", "sigma_scaled")

    # diffusers' converter hard-codes FLUX.1's widths for single_blocks linear1 (3072 x 3 + 12288):
    # the tiny model's linear1 stays out of the file diffusers reads (ComfyUI's map below has all)
    loaded = {k: v for k, v in sd.items() if "_linear1." not in k}
    assert len(loaded) == len(sd) - 3 * len(parts["transformer"].single_blocks)
    dpath = str(tmp_path / "for_diffusers.safetensors")
    save_file(loaded, dpath)
    folder = str(tmp_path / "tiny-flux")
    flux_saving.save_diffusers_folder(parts, "dev", folder)
    pipe = FluxPipeline.from_pretrained(folder, torch_dtype=torch.float64)
    log = load_lora_logged(pipe, dpath)
    assert "unsupported keys" not in log and "unexpected" not in log and "incompatible" not in log, log
    n_modules = sum(1 for k in loaded if k.endswith(".alpha"))
    n_qkv = sum(1 for k in loaded if k.endswith("_qkv.alpha"))  # diffusers: to_q, to_k, to_v each
    layers = [m for _, m in list(pipe.transformer.named_modules()) + list(pipe.text_encoder.named_modules())
              if hasattr(m, "lora_A") and len(m.lora_A)]
    assert len(layers) == n_modules + 2 * n_qkv  # every module of the file became a PEFT layer
    pipe.fuse_lora(components=["transformer", "text_encoder"])
    pipe.unload_lora_weights()
    fused = flux_checkpoint.diffusers_to_bfl(pipe.transformer.state_dict(), parts["transformer"].config)
    expected = _expected(parts["transformer"].state_dict(), loaded, "lora_unet_", lambda p: p)
    assert fused.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(fused[k], expected[k], rtol=0, atol=1e-12, msg=k)
    te_expected = _expected(parts["clip_l"].state_dict(), loaded, "lora_te1_",
                            lambda p: p if p.startswith("text_model.") else "text_model." + p)
    te_fused = pipe.text_encoder.state_dict()
    moved = 0
    for k in te_expected:
        torch.testing.assert_close(te_fused[k].double(), te_expected[k], rtol=0, atol=1e-12, msg=k)
        moved += not torch.equal(te_expected[k], parts["clip_l"].state_dict()[k].double())
    assert moved == 6 * parts["clip_l"].config.num_hidden_layers  # q, k, v, out, fc1, fc2 per layer

    table = comfy_dit_shapes(parts["transformer"], clip_l=parts["clip_l"])
    for name in {k.split(".")[0] for k in sd}:
        d, u = sd[name + ".lora_down.weight"], sd[name + ".lora_up.weight"]
        assert table[name] == (u.shape[0], d.shape[1]), name


def test_flux_lora_network_args_and_t5_through_the_entry_script(dataset, tmp_path, train):
    """sd-scripts' lora_flux network_args as a run gives them: train_blocks, block indices, per-kind
    and in_dims ranks, and train_t5xxl (a T5 LoRA, lora_te3_, at text_encoder_lr's second rate)."""
    out = tmp_path / "out"
    rc, _, err, run = train("train_lora", lora_args(
        "tiny-flux", "networks.lora_flux", dataset, str(out), "--text_encoder_lr", "1e-2", "5e-3",
        "--network_args", "train_blocks=double", "train_double_block_indices=1", "img_attn_dim=2",
        "txt_mlp_dim=0", "in_dims=[0,0,0,0,3]", "train_t5xxl=True"))
    assert rc == 0, err
    path = str(out / "last.safetensors")
    _assert_saved_is_trained(path, run.parts.method.network)
    sd, meta = read(path)
    unet = {k.split(".")[0]: v.shape[0] for k, v in sd.items()
            if k.startswith("lora_unet_") and k.endswith("lora_down.weight")}
    parts = tiny_flux.build_tiny_flux("dev")
    flux, t5 = parts["transformer"], parts["t5"]
    expected = {"lora_unet_" + k[:-len(".weight")].replace(".", "_") for k, v in flux.state_dict().items()
                if k.startswith("double_blocks.1.") and k.endswith(".weight") and v.dim() == 2
                and ".txt_mlp." not in k}
    assert set(unet) == expected | {"lora_unet_txt_in"}
    assert {n: r for n, r in unet.items() if r != 4} == {
        "lora_unet_double_blocks_1_img_attn_qkv": 2, "lora_unet_double_blocks_1_img_attn_proj": 2,
        "lora_unet_txt_in": 3}
    table = comfy_dit_shapes(flux, clip_l=parts["clip_l"], t5=t5)
    te3 = {k.split(".")[0] for k in sd if k.startswith("lora_te3_")}
    # sd-scripts' T5 targets: every Linear of T5's attention and gated MLP
    assert te3 == {"lora_te3_" + k[:-len(".weight")].replace(".", "_") for k in t5.state_dict()
                   if ".layer." in k and k.endswith(("q.weight", "k.weight", "v.weight", "o.weight", "wi_0.weight",
                                                     "wi_1.weight", "wo.weight"))}
    assert all(n in table for n in te3)
    groups = dict(zip(run.parts.method.group_names, (g["lr"] for g in run.parts.method.param_groups)))
    assert groups == {"textencoder 1": 1e-2, "textencoder 3": 5e-3, "unet": 1e-2}
    assert json.loads(meta["ss_network_args"])["train_t5xxl"] == "True"
    assert all(te.training for te in run.parts.bundle.text_encoders)


def _patched_mmdit(sd: dict):
    """A fresh tiny SD3 MMDiT in float64, each weight the file names patched as the clients do:
    W + up @ down * alpha / rank."""
    mmdit = sd3_builtins.build_builtin("tiny-sd3")["mmdit"].double()
    modules = {"lora_unet_" + n.replace(".", "_"): m for n, m in mmdit.named_modules() if n}
    names = {k.split(".")[0] for k in sd if k.startswith("lora_unet_")}
    with torch.no_grad():
        for name in names:
            d, u, a = (sd[f"{name}.{p}"].double() for p in ("lora_down.weight", "lora_up.weight", "alpha"))
            w = modules[name].weight
            w += (u.flatten(1) @ d.flatten(1)).reshape(w.shape) * (float(a) / d.shape[0])
    return mmdit, len(names)


def test_sd3_lora_trains_and_the_clients_patch_is_the_trained_model(dataset, tmp_path, train):
    out = tmp_path / "out"
    rc, _, err, run = train("train_lora", lora_args("tiny-sd3", "networks.lora_sd3", dataset, str(out),
                                                    "--network_args", "split_qkv=True"))
    assert rc == 0, err
    path = str(out / "last.safetensors")
    _assert_saved_is_trained(path, run.parts.method.network)
    sd, meta = read(path)
    assert (meta["ss_network_module"], meta["ss_base_model_version"], meta["modelspec.architecture"],
            meta["modelspec.implementation"], meta["modelspec.prediction_type"]) == \
        ("networks.lora_sd3", "medium", "stable-diffusion-3-medium/lora", "diffusers", "epsilon")
    assert json.loads(meta["ss_network_args"]) == {"split_qkv": "True"}
    assert meta["ss_weighting_scheme"] == "uniform" and meta["ss_apply_lg_attn_mask"] == "False"
    base = sd3_builtins.build_builtin("tiny-sd3")
    table = comfy_dit_shapes(base["mmdit"], clip_l=base["clip_l"], clip_g=base["clip_g"])
    names = {k.split(".")[0] for k in sd}
    assert {n.split("_")[1] for n in names} == {"unet", "te1", "te2"}
    for name in names:
        d, u = sd[name + ".lora_down.weight"], sd[name + ".lora_up.weight"]
        assert table[name] == (u.shape[0], d.shape[1]), name
    assert float(sd["lora_unet_joint_blocks_0_x_block_attn_qkv.alpha"]) == 12.0  # 3 parts x alpha 4

    patched, n = _patched_mmdit(sd)
    # every 2-D weight of the joint blocks (the last context block has only qkv and adaLN)
    assert n == sum(1 for k, v in patched.state_dict().items() if k.startswith("joint_blocks.") and v.dim() == 2)
    cfg = patched.config
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 8, 8, generator=g, dtype=torch.float64)
    t = torch.tensor([250.0, 800.0], dtype=torch.float64)
    y = torch.randn(2, cfg.adm_in_channels, generator=g, dtype=torch.float64)
    ctx = torch.randn(2, 154, cfg.context_dim, generator=g, dtype=torch.float64)
    trained = run.parts.bundle.unet.eval()
    with torch.no_grad():
        got = trained(x.float(), t.float(), y.float(), ctx.float()).double()
        want = patched(x, t, y, ctx)
        before = sd3_builtins.build_builtin("tiny-sd3")["mmdit"].double()(x, t, y, ctx)
    change = float((want - before).norm())
    assert change > 1e-3 * float(want.norm())  # the LoRA changed the output
    assert float((got - want).norm()) < 1e-3 * change  # float32 against float64: the same model


@pytest.mark.parametrize("model, module, probe, extra", [
    ("tiny-flux", "networks.lora_flux", "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight", []),
    ("tiny-sd3", "networks.lora_sd3", "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_up.weight", []),
    ("tiny-flux", "lycoris.kohya", "lora_unet_double_blocks_0_img_attn_qkv.lokr_w1",
     ["--network_args", "algo=lokr", "factor=4"]),
    ("tiny-sd3", "lycoris.kohya", "lora_unet_joint_blocks_0_x_block_attn_qkv.hada_w1_a", ["--network_args", "algo=loha"]),
], ids=["flux", "sd3", "flux-lycoris-lokr", "sd3-lycoris-loha"])
def test_flow_lora_resume_is_bit_identical(dataset, tmp_path, train, model, module, probe, extra):
    """Stopped at step 2 of 4 (mid-epoch: 4 samples, batch 1) with its state, resumed in another
    folder: the final file (CLIP-L (and SD3's CLIP-G) and transformer LoRA, AdamW state) equals
    the uninterrupted run's, one thread (conftest). LyCORIS' file has the names LyCORIS makes on
    sd-scripts' FLUX.1 / SD3 (tests/networks/test_lycoris_dit.py): the blocks' Linear layers and
    CLIP-L's (and CLIP-G's)."""
    args = ["--max_train_steps", "4", "--save_every_n_steps", "2", "--save_state", *extra]
    whole = str(tmp_path / "whole")
    rc, _, err, u = train("train_lora", lora_args(model, module, dataset, whole, *args))
    assert rc == 0, err
    state = os.path.join(whole, "last-step00000002-state")
    assert os.path.isdir(state)
    resumed = str(tmp_path / "resumed")
    rc, _, err, r = train("train_lora", lora_args(model, module, dataset, resumed, *args, "--resume", state))
    assert rc == 0, err
    assert r.progress.global_step == 4 and r.progress.loss_log == u.progress.loss_log
    a, b = load_file(os.path.join(whole, "last.safetensors")), load_file(os.path.join(resumed, "last.safetensors"))
    assert a.keys() == b.keys() and any(k.startswith("lora_te1_") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    mid = load_file(os.path.join(whole, "last-step00000002.safetensors"))
    assert not torch.equal(mid[probe], a[probe])
    if module == "lycoris.kohya":  # LyCORIS puts no module on T5: it alone runs in eval mode
        tes = u.parts.bundle.text_encoders
        assert [id(t) for t in u.parts.method._untouched_text_encoders()] == [id(tes[-1])]
        assert type(tes[-1]).__name__ == "T5EncoderModel"
    if module == "lycoris.kohya" and model == "tiny-flux":
        parts = tiny_flux.build_tiny_flux("dev")
        assert {k.split(".")[0] for k in a} == _block_and_clip_names(parts["transformer"], parts["clip_l"])
    elif module == "lycoris.kohya":
        parts = sd3_builtins.build_builtin("tiny-sd3")
        table = comfy_dit_shapes(parts["mmdit"], clip_l=parts["clip_l"], clip_g=parts["clip_g"])
        expected = {n for n in table if n.startswith(("lora_unet_joint_blocks_", "lora_te1_", "lora_te2_"))
                    and not n.endswith("_ln_q") and not n.endswith("_ln_k")}
        assert {k.split(".")[0] for k in a} == expected


@pytest.mark.parametrize("model, extra, message", [
    ("tiny-flux", ["--network_module", "networks.lora_sd3"],
     'network_module networks.lora_sd3: not for the FLUX.1 model tiny-flux: it is the LoRA of SD3 models, whose '
     'layer names it targets; FLUX.1 trains with network_module = "networks.lora_flux" or "networks.oft_flux" or '
     '"lycoris.kohya"'),
    ("tiny-flux", ["--network_module", "networks.lora"],
     "network_module networks.lora: not for the FLUX.1 model tiny-flux: it puts its modules in the SD U-Net's "
     "block classes (Transformer2DModel, ResnetBlock2D, ...), which the FLUX.1 transformer does not have "
     "(sd-scripts would train none of the transformer's layers with it)"),
    ("tiny-sd3", ["--network_module", "networks.oft_flux"],
     'network_module networks.oft_flux: not for the SD3 model tiny-sd3: it is the OFT of FLUX.1 models, whose '
     'layer names it targets; SD3 trains with network_module = "networks.lora_sd3" or "lycoris.kohya"'),
    ("tiny-sd3", ["--network_module", "my_networks.custom"],
     "this toolkit runs only sd-scripts' and LyCORIS' network modules of these transformers"),
    ("tiny-sd3", ["--network_module", "networks.lora_flux"], "it is the LoRA of Chroma / FLUX.1 models"),
    ("tiny-sd15", ["--network_module", "networks.lora_flux"],
     "network_module networks.lora_flux: the LoRA of Chroma / FLUX.1 models; tiny-sd15 is not one"),
    ("tiny-sd15", ["--network_module", "networks.oft_flux"],
     "network_module networks.oft_flux: the OFT of FLUX.1 models; tiny-sd15 is not one"),
    ("tiny-flux", ["--network_module", "lycoris.kohya", "--network_args", "algo=lokr", "train_t5xxl=True"],
     "network_args: train_t5xxl with lycoris.kohya: LyCORIS puts no module on T5"),
    ("tiny-flux", ["--network_module", "networks.oft_flux", "--network_args", "enable_all_linear=maybe"],
     "enable_all_linear='maybe' for networks.oft_flux is not true or false"),
    ("tiny-flux", ["--network_module", "networks.oft_flux", "--network_args", "train_blocks=single"],
     "unknown key 'train_blocks' for networks.oft_flux"),
    ("tiny-flux", ["--network_module", "networks.lora_flux", "--network_args", "train_t5xxl=True",
                   "--cache_text_encoder_outputs"],
     "cache_text_encoder_outputs cannot be combined with network_args train_t5xxl: T5-XXL's outputs change"),
    ("tiny-flux", ["--network_module", "networks.lora_flux", "--network_train_unet_only", "--network_args",
                   "train_t5xxl=True"], "train_t5xxl trains a LoRA on T5, a text encoder; network_train_unet_only"),
    ("tiny-sd3", ["--network_module", "networks.lora_sd3", "--network_train_unet_only", "--network_args",
                  "train_t5xxl=True"], "train_t5xxl trains a LoRA on T5, a text encoder; network_train_unet_only"),
    ("tiny-sd3", ["--network_module", "networks.lora_sd3", "--pivotal_tokens", "sksx", "--pivotal_init_words", "dog"],
     "pivotal_tokens: pivotal tuning trains SD / SDXL embeddings; not with the SD3 model tiny-sd3"),
    ("tiny-flux", ["--network_module", "networks.lora_flux", "--network_args", "train_blocks=some"],
     "train_blocks='some' for networks.lora_flux must be all, single or double"),
])
def test_lora_network_modules_and_args_that_do_not_apply_fail_before_loading(
        dataset, tmp_path, run_script, no_weight_loading, monkeypatch, model, extra, message):
    from library.models import flow_family
    from library.models.families.flux import flux_loading
    from library.models.families.sd3 import sd3_checkpoint

    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the options were checked")

    for mod, name in ((flux_loading, "load_flux"), (sd3_checkpoint, "load_sd3"), (flow_family, "load_from_options")):
        monkeypatch.setattr(mod, name, refuse)
    rc, _, err = run_script("train_lora", ["--pretrained_model_name_or_path", model, "--train_data_dir", dataset,
                                           "--output_dir", str(tmp_path / "o"), "--resolution", "64",
                                           "--max_train_steps", "2", *extra])
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_family_fields_are_sd_scripts_strings():
    """library/sai_model_spec.py's architecture / implementation and sd3_utils' model_type."""
    from library.models.families.flux import home as flux_home
    from library.models.families.sd3 import home as sd3_home

    assert flux_home.metadata_fields("schnell", "lora") == {
        "ss_base_model_version": "flux1", "modelspec.implementation": FLUX_IMPL,
        "modelspec.architecture": "flux-1-schnell/lora"}
    assert flux_home.metadata_fields("dev", None)["modelspec.architecture"] == "flux-1-dev"
    assert sd3_home.metadata_fields("sd3.5-large", "lora") == {
        "ss_base_model_version": "5-large", "modelspec.implementation": "diffusers",
        "modelspec.prediction_type": "epsilon", "modelspec.architecture": "stable-diffusion-3-5-large/lora"}
    assert sd3_home.metadata_fields("sd3.5-medium", None) == {
        "ss_base_model_version": "5-medium", "modelspec.prediction_type": "epsilon",
        "modelspec.implementation": "https://github.com/Stability-AI/generative-models",
        "modelspec.architecture": "stable-diffusion-3-5-medium"}


def test_lora_may_be_saved_as_ckpt_the_full_model_may_not(dataset):
    """A LoRA file is the network's (any of save_model_as' formats, as for SD); a full FLUX.1 model
    is saved in the layout it was loaded from."""
    from library.config.parse import parse_args
    from library.models.flow_family import FlowFamilyError
    from library.training import flow_loss

    def opts(script):
        return parse_args(script, ["--pretrained_model_name_or_path", "tiny-flux", "--train_data_dir", dataset,
                                   "--output_dir", "unused", "--resolution", "64", "--max_train_steps", "2",
                                   "--save_model_as", "ckpt",
                                   *(["--network_module", "networks.lora_flux"] if script == "train_lora" else [])])

    assert flow_loss.check_options(opts("train_lora"), "lora") == "flux"
    with pytest.raises(FlowFamilyError, match="save_model_as ckpt: a FLUX.1 model is saved in the layout"):
        flow_loss.check_options(opts("train_dreambooth"), "dreambooth")


@pytest.mark.parametrize("model, module, version, arch", [
    ("tiny-flux-schnell", "networks.lora_flux", "flux1", "flux-1-schnell/lora"),
    ("tiny-sd3.5-large", "networks.lora_sd3", "5-large", "stable-diffusion-3-5-large/lora"),
])
def test_the_files_metadata_names_the_variant_trained(dataset, tmp_path, train, model, module, version, arch):
    rc, _, err, _ = train("train_lora", lora_args(model, module, dataset, str(tmp_path), "--max_train_steps", "1",
                                                  "--network_train_unet_only"))
    assert rc == 0, err
    sd, meta = read(str(tmp_path / "last.safetensors"))
    assert (meta["ss_base_model_version"], meta["modelspec.architecture"]) == (version, arch)
    assert not any(k.startswith("lora_te") for k in sd)  # network_train_unet_only


def test_flux_base_weights_are_merged_as_the_clients_patch(dataset, tmp_path, train):
    """base_weights with a FLUX.1 LoRA file (split_qkv, CLIP-L too): merged into the loaded model
    before training (sd-scripts merges through the network module's create_network_from_weights);
    the model's weights are W + multiplier x up @ down x alpha / rank of the file."""
    from networks import lora_flux

    parts = tiny_flux.build_tiny_flux("dev")
    net = lora_flux.create_network(1.0, 4, 2, None, [parts["clip_l"], parts["t5"]], parts["transformer"],
                                   split_qkv="True")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    base = str(tmp_path / "base.safetensors")
    net.save_weights(base, None, lora_flux.file_metadata("dev"))
    net.remove_from()
    rc, _, err, run = train("train_lora", lora_args(
        "tiny-flux", "networks.lora_flux", dataset, str(tmp_path / "out"), "--max_train_steps", "1",
        "--base_weights", base, "--base_weights_multiplier", "0.5", "--network_train_unet_only"))
    assert rc == 0, err
    sd = load_file(base)
    sd = {k: v * 0.5 if k.endswith("lora_up.weight") else v for k, v in sd.items()}  # the multiplier
    expected = _expected(parts["transformer"].state_dict(), sd, "lora_unet_", lambda p: p)
    merged = run.parts.bundle.unet.state_dict()
    changed = 0
    for k, v in expected.items():
        torch.testing.assert_close(merged[k].double(), v, rtol=1e-6, atol=1e-6, msg=k)
        changed += not torch.equal(v, parts["transformer"].state_dict()[k].double())
    assert changed == sum(1 for k in sd if k.startswith("lora_unet_") and k.endswith(".alpha"))
    te = run.parts.bundle.text_encoders[0].state_dict()
    te_expected = _expected(parts["clip_l"].state_dict(), sd, "lora_te1_",
                            lambda p: p if p.startswith("text_model.") else "text_model." + p)
    for k, v in te_expected.items():
        torch.testing.assert_close(te[k].double(), v, rtol=1e-6, atol=1e-6, msg=k)


def _lycoris_file(parts: dict, tes_names: tuple[str, ...], model_name: str, algo: str, path: str) -> dict:
    """A lycoris.kohya file of the tiny model (random values), with the kohya names the trainer
    writes (networks/lora_names.py); returns its tensors."""
    lycoris_kohya = pytest.importorskip("lycoris.kohya")
    from networks import lora_names

    tes, model = [parts[n] for n in tes_names], parts[model_name]
    net = lycoris_kohya.create_network(1.0, 4, 2, None, tes, model, algo=algo, factor=4)
    net.apply_to(tes, model, True, True)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    sd = {k: v.detach().contiguous() for k, v in
          lora_names.rename_keys(net.state_dict(), lora_names.plain_to_kohya_names(tes, model)).items()}
    net.restore()  # the tiny parts are built anew for the reference below
    save_file(sd, path)
    return sd


def _lycoris_delta(sd: dict, name: str, shape) -> torch.Tensor:
    """Independent of LyCORIS' code: a module's delta from the file in float64, as the clients
    compute it. LoKr: kron(w1, w2) x alpha / rank, each factor whole or a @ b (rank: the inner
    size of a factorised one; a file without one scales by 1); LoHa: (w1a @ w1b) * (w2a @ w2b) x
    alpha / rank."""
    t = {k[len(name) + 1:]: v.double() for k, v in sd.items() if k.startswith(name + ".")}
    if "hada_w1_a" in t:
        rank = t["hada_w1_b"].shape[0]
        d = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"]) * (float(t["alpha"]) / rank)
        return d.reshape(shape)
    w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
    w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
    rank = t["lokr_w2_b"].shape[0] if "lokr_w2_b" in t else t["lokr_w1_b"].shape[0] if "lokr_w1_b" in t else None
    scale = float(t["alpha"]) / rank if rank else 1.0
    return (torch.kron(w1, w2) * scale).reshape(shape)


def _weight_paths(model, prefix: str, text_model: bool = False) -> dict:
    """kohya module name -> the model's weight key, from the checkpoint keys (CLIP's under text_model.)."""
    out = {}
    for k in model.state_dict():
        if k.endswith(".weight"):
            path = "text_model." + k if text_model and not k.startswith("text_model.") else k
            out[f"{prefix}_" + path[:-len(".weight")].replace(".", "_")] = k
    return out


@pytest.mark.parametrize("family, algo, module, multiplier", [
    ("flux", "lokr", "networks.lora_flux", 0.5), ("sd3", "loha", "networks.lora_sd3", 1.0)])
def test_lycoris_base_weights_are_merged_as_the_deltas(family, algo, module, multiplier, dataset, tmp_path, train):
    """base_weights with a lycoris.kohya file (LoKr on FLUX.1 with CLIP-L, LoHa on SD3 with CLIP-L /
    CLIP-G) while training the family's LoRA: every layer the file names is W + multiplier x the
    file's delta (float64 from the file), every other weight unchanged."""
    if family == "flux":
        parts, model, tes, te_names = tiny_flux.build_tiny_flux("dev"), "transformer", ("clip_l", "t5"), ("clip_l",)
        name = "tiny-flux"
    else:
        parts, model, tes, te_names = sd3_builtins.build_builtin("tiny-sd3"), "mmdit", ("clip_l", "clip_g", "t5xxl"), \
            ("clip_l", "clip_g")
        name = "tiny-sd3"
    base = str(tmp_path / "lyco.safetensors")
    sd = _lycoris_file(parts, tes, model, algo, base)
    fresh = tiny_flux.build_tiny_flux("dev") if family == "flux" else sd3_builtins.build_builtin("tiny-sd3")
    rc, out, err, run = train("train_lora", lora_args(
        name, module, dataset, str(tmp_path / "out"), "--max_train_steps", "1", "--base_weights", base,
        "--base_weights_multiplier", str(multiplier), "--network_train_unet_only"))
    assert rc == 0, err
    b = run.parts.bundle
    merged_parts = [(b.unet, fresh[model], _weight_paths(fresh[model], "lora_unet"))] + [
        (b.text_encoders[i], fresh[n], _weight_paths(fresh[n], f"lora_te{i + 1}", text_model=True))
        for i, n in enumerate(te_names)]
    names = {k.split(".")[0] for k in sd}
    assert any(n.startswith("lora_te2_" if family == "sd3" else "lora_te1_") for n in names)
    seen = set()
    for merged_model, before_model, paths in merged_parts:
        merged, before = merged_model.state_dict(), before_model.state_dict()
        for kohya, key in paths.items():
            w = before[key].double()
            want = w + multiplier * _lycoris_delta(sd, kohya, w.shape) if kohya in names else w
            torch.testing.assert_close(merged[key].double(), want, rtol=1e-5, atol=1e-6, msg=key)
            seen.add(kohya)
    assert names <= seen  # every module of the file is a layer checked above
    assert f"base_weights: merged {base} (multiplier {multiplier}): {len(names)} modules" in out + err


def test_lycoris_base_weights_refusals_are_one_line(tmp_path, monkeypatch):
    """A LyCORIS file of another model: one line naming a module that is no layer of this one
    (SD3's CLIP-G modules, lora_te2_, are T5's place in FLUX.1's list, where LyCORIS puts none);
    a kind not merged here (GLoRA): one line naming it; without lycoris-lora installed: one line
    naming the package."""
    import sys

    from library.training import network_options
    from networks import lora

    sd3 = sd3_builtins.build_builtin("tiny-sd3")
    sd = _lycoris_file(sd3, ("clip_l", "clip_g", "t5xxl"), "mmdit", "lokr", str(tmp_path / "sd3.safetensors"))
    fx = tiny_flux.build_tiny_flux("dev")

    class Bundle:
        family, unet, text_encoders = "flux", fx["transformer"], [fx["clip_l"], fx["t5"]]

    with pytest.raises(lora.LoRAError, match=r"^a LyCORIS LoKr file: \d+ module\(s\) name no layer of this FLUX.1 "
                                             r"model that LyCORIS can merge \(wrong base model\?\), e.g. lora_te2_text_model_"):
        network_options._merge(Bundle, sd, 1.0, "networks.lora_flux")
    glora = {"lora_unet_double_blocks_0_img_attn_qkv.a1.weight": torch.zeros(4, 32),
             "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(4.0)}
    with pytest.raises(lora.LoRAError, match=r"^a LyCORIS GLoRA file: base_weights merges LyCORIS LoHa and LoKr "
                                             r"files \(and LoRA / LoCon ones\) into FLUX.1 models, not GLoRA$"):
        network_options._merge(Bundle, glora, 1.0, "lycoris.kohya")
    monkeypatch.setitem(sys.modules, "lycoris.kohya", None)  # import lycoris.kohya -> ImportError
    with pytest.raises(lora.LoRAError, match=r"^a LyCORIS LoKr file: merging it needs lycoris-lora"):
        network_options._merge(Bundle, sd, 1.0, "networks.lora_flux")


def test_flux_oft_base_weights_are_merged_as_the_rotation(dataset, tmp_path, train):
    """base_weights with a networks.oft_flux file while training networks.oft_flux (sd-scripts
    merges through the run's network module): each layer's weight is the file's rotation (per
    part, multiplier 0.5: R = 0.5 (R - I) + I), against the float64 computation. The OFT network
    puts no module on a text encoder, so without network_train_unet_only they stay frozen and
    their outputs may be cached."""
    from tests.networks import test_oft_flux

    flux = tiny_flux.build_tiny_flux("dev")["transformer"]
    base = str(tmp_path / "oft_base.safetensors")
    sd, layers = test_oft_flux.write_sd_scripts_oft_file(flux, base, 0.05, seed=0), test_oft_flux._expected(flux, True)
    rc, _, err, run = train("train_lora", lora_args(
        "tiny-flux", "networks.oft_flux", dataset, str(tmp_path / "out"), "--max_train_steps", "1",
        "--base_weights", base, "--base_weights_multiplier", "0.5", "--cache_text_encoder_outputs"))
    assert rc == 0, err
    assert run.parts.method.train_text_encoder is False
    assert not any(p.requires_grad for te in run.parts.bundle.text_encoders for p in te.parameters())
    merged, before = run.parts.bundle.unet.state_dict(), flux.state_dict()
    for name, split in layers.items():
        key = name[len("oft_unet_"):]
        path = next(k for k in before if k.replace(".", "_") == key + "_weight")
        w, b = before[path], before[path[:-len("weight")] + "bias"]
        _, want = test_oft_flux._reference(w, b, [sd[f"{name}.oft_blocks.{i}"] for i in range(len(split))], 0.5, 0.5, split,
                             torch.zeros(1, w.shape[1]))
        torch.testing.assert_close(merged[path].double(), want, rtol=1e-5, atol=1e-6, msg=path)
        assert not torch.allclose(want, w.double(), atol=1e-4)
