"""train_lora.py end to end on the built-in tiny models: files, kohya keys, module counts, metadata.

Each model is trained from its built-in name, from the diffusers folder and from the single file
that tools/make_tiny_model.py wrote.
"""
import json
import os

import pytest
import torch

from tests.conftest import count_sd_scripts_modules, read, rel_diff

ARCH_NAME = {"sd15": "tiny-sd15", "sd2": "tiny-sd2", "sdxl": "tiny-sdxl"}


@pytest.fixture(scope="module")
def written_models(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    out = {}
    for arch in ARCH_NAME:
        folder, single = make_tiny_model(arch, str(tmp_path_factory.mktemp(arch)))
        out[arch] = {"diffusers": folder, "single_file": single}
    return out


def base_args(model, data, out, *extra):
    return ["--pretrained_model_name_or_path", model, "--train_data_dir", data,
            "--output_dir", out, "--resolution", "64", "--max_train_steps", "2",
            "--learning_rate", "1e-3", "--network_dim", "4", "--network_alpha", "2",
            "--cache_latents", *extra]



def prefix_counts(keys):
    counts = {}
    for k in keys:
        if k.endswith(".lora_down.weight"):
            p = k.split("_")[1]
            counts[p] = counts.get(p, 0) + 1
    return counts


EXPECTED_KEYS = {
    "sd15": ["lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight",
             "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight",
             "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight"],
    "sd2": ["lora_unet_up_blocks_1_attentions_2_transformer_blocks_0_ff_net_2.lora_up.weight",
            "lora_te_text_model_encoder_layers_3_mlp_fc2.lora_down.weight"],
    "sdxl": ["lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_k.lora_down.weight",
             "lora_unet_middle_block_1_transformer_blocks_9_ff_net_0_proj.lora_up.weight",
             "lora_unet_output_blocks_0_1_transformer_blocks_9_attn1_to_out_0.lora_down.weight",
             "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight",
             "lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_up.weight"],
}


@pytest.mark.parametrize("arch", ["sd15", "sd2", "sdxl"])
@pytest.mark.parametrize("source", ["builtin", "diffusers", "single_file"])
def test_train_lora_writes_a_kohya_file(arch, source, written_models, dataset, tmp_path, run_script):
    from library.models.families.sd_common.tiny_models import build_tiny_components

    model = ARCH_NAME[arch] if source == "builtin" else written_models[arch][source]
    out = tmp_path / "out"
    rc, stdout, err = run_script("train_lora", base_args(model, dataset, out))
    assert rc == 0, err
    assert "total_steps: 2" in stdout
    sd, md = read(str(out / "last.safetensors"))
    for key in EXPECTED_KEYS[arch]:
        assert key in sd, key
    for key, t in sd.items():
        if key.endswith(".alpha"):
            assert t.dim() == 0 and float(t) == 2.0
    comps = build_tiny_components(arch)
    assert prefix_counts(sd) == count_sd_scripts_modules(comps, conv=False)
    version = {"sd15": "sd_v1", "sd2": "sd_v2", "sdxl": "sdxl_base_v1-0"}[arch]
    spec = {"sd15": "stable-diffusion-v1/lora", "sd2": "stable-diffusion-v2-768-v/lora",
            "sdxl": "stable-diffusion-xl-v1-base/lora"}[arch]
    assert md["ss_network_module"] == "networks.lora"
    assert md["ss_network_dim"] == "4" and float(md["ss_network_alpha"]) == 2.0
    assert json.loads(md["ss_network_args"]) == {}
    assert md["ss_base_model_version"] == version
    assert md["ss_v2"] == str(arch == "sd2")
    assert md["ss_resolution"] == "(64, 64)"
    assert md["ss_num_train_images"] == "4"  # 2 images x 2 repeats
    assert md["ss_steps"] == "2" and md["ss_epoch"] == "1"
    assert float(md["ss_learning_rate"]) == 1e-3
    assert md["ss_seed"] == "42" and md["ss_output_name"] == "last"
    assert float(md["ss_training_started_at"]) <= float(md["ss_training_finished_at"])
    assert json.loads(md["ss_tag_frequency"])["2_sks shape"]["sks shape"] == 2
    assert len(md["sshs_model_hash"]) == 64 and len(md["sshs_legacy_hash"]) == 8
    assert md["modelspec.sai_model_spec"] == "1.0.0"
    assert md["modelspec.architecture"] == spec
    assert md["modelspec.implementation"] == ("https://github.com/Stability-AI/generative-models"
                                              if arch == "sdxl" else "diffusers")
    assert md["modelspec.title"] == "last" and md["modelspec.resolution"] == "64x64"
    assert md["modelspec.prediction_type"] == ("v" if arch == "sd2" else "epsilon")
    assert md["modelspec.date"].startswith("20")


def test_conv_dim_adds_c3lier_modules(dataset, tmp_path, run_script):
    from library.models.families.sd_common.tiny_models import build_tiny_components

    out = tmp_path / "out"
    rc, _, err = run_script("train_lora", base_args("tiny-sdxl", dataset, out, "--network_args",
                                                    "conv_dim=2", "conv_alpha=1"))
    assert rc == 0, err
    sd, md = read(str(out / "last.safetensors"))
    assert prefix_counts(sd) == count_sd_scripts_modules(build_tiny_components("sdxl"), conv=True)
    assert "lora_unet_input_blocks_1_0_in_layers_2.lora_down.weight" in sd
    assert sd["lora_unet_input_blocks_1_0_in_layers_2.lora_down.weight"].shape[-2:] == (3, 3)
    assert json.loads(md["ss_network_args"]) == {"conv_dim": "2", "conv_alpha": "1"}


def test_epoch_and_step_saves_use_sd_scripts_names(dataset, tmp_path, run_script):
    out = tmp_path / "out"
    args = base_args("tiny-sd15", dataset, out, "--max_train_epochs", "2", "--save_every_n_epochs",
                     "1", "--save_every_n_steps", "3", "--train_batch_size", "2",
                     "--save_precision", "fp16", "--output_name", "mylora")
    rc, stdout, err = run_script("train_lora", args)
    assert rc == 0, err
    assert "max_train_epochs wins" in err
    names = sorted(os.listdir(out))
    assert names == ["mylora-000001.safetensors", "mylora-step00000003.safetensors",
                     "mylora.safetensors"]
    sd, md = read(str(out / "mylora-000001.safetensors"))
    assert md["ss_epoch"] == "1" and md["ss_steps"] == "2"
    assert all(t.dtype == torch.float16 for k, t in sd.items() if k.endswith("weight"))


def test_unet_only_and_text_encoder_only(dataset, tmp_path, run_script):
    rc, _, err = run_script("train_lora", base_args("tiny-sd15", dataset, tmp_path / "u",
                                                    "--network_train_unet_only"))
    assert rc == 0, err
    sd, _ = read(str(tmp_path / "u" / "last.safetensors"))
    assert set(prefix_counts(sd)) == {"unet"}
    rc, _, err = run_script("train_lora", base_args("tiny-sd15", dataset, tmp_path / "t",
                                                    "--network_train_text_encoder_only"))
    assert rc == 0, err
    sd, _ = read(str(tmp_path / "t" / "last.safetensors"))
    assert set(prefix_counts(sd)) == {"te"}


def test_network_weights_continue_from_a_file(dataset, tmp_path, run_script):
    rc, _, err = run_script("train_lora", base_args("tiny-sd15", dataset, tmp_path / "a"))
    assert rc == 0, err
    first, _ = read(str(tmp_path / "a" / "last.safetensors"))
    rc, _, err = run_script("train_lora", base_args("tiny-sd15", dataset, tmp_path / "b",
                                                    "--network_weights",
                                                    tmp_path / "a" / "last.safetensors",
                                                    "--learning_rate", "1e-12"))
    assert rc == 0, err
    again, _ = read(str(tmp_path / "b" / "last.safetensors"))
    assert first.keys() == again.keys()
    for k in first:  # a negligible learning rate: the loaded weights are kept
        assert torch.allclose(first[k], again[k], rtol=0, atol=1e-9), k


def test_lycoris_loha_trains_and_saves(dataset, tmp_path, run_script):
    pytest.importorskip("lycoris")
    out = tmp_path / "out"
    rc, _, err = run_script("train_lora", base_args("tiny-sd15", dataset, out, "--network_module",
                                                    "lycoris.kohya", "--network_args", "algo=loha"))
    assert rc == 0, err
    sd, md = read(str(out / "last.safetensors"))
    assert any(k.endswith("hada_w1_a") for k in sd)
    assert md["ss_network_module"] == "lycoris.kohya"


def test_tiny_overfit_lowers_the_loss(tmp_path):
    """One image, 30 steps: the loss on a fixed set of (noise, timestep) draws goes down."""
    from library.run import trainer
    from library.config.parse import parse_args
    from tests.conftest import reset_accelerate
    from tools.make_sample_dataset import make_sample_dataset

    make_sample_dataset(str(tmp_path / "data"), n_images=1, size=64, repeats=1)
    opts = parse_args("train_lora", base_args("tiny-sd15", str(tmp_path / "data"),
                                              str(tmp_path / "out"), "--max_train_steps", "30",
                                              "--learning_rate", "3e-3", "--network_dim", "8",
                                              "--network_alpha", "8"))
    reset_accelerate()
    r = trainer.run(opts, "lora")

    def fixed_loss():
        with torch.no_grad():
            return sum(float(r.micro_step_loss(epoch, [0], None, 1)) for epoch in range(100, 116))

    r.parts.method.network.set_multiplier(0.0)
    before = fixed_loss()
    r.parts.method.network.set_multiplier(1.0)
    after = fixed_loss()
    reset_accelerate()
    assert after < before * 0.9, (before, after)


def test_plain_attention_matches_sdpa(dataset, tmp_path, run_script):
    """--sdpa=false switches the U-Net and text encoder to math attention: same result, within
    float tolerance (and the flag really changes the attention path)."""
    # SGD keeps the update linear in the gradient (Adam's first steps amplify float noise).
    sgd = ["--optimizer_type", "torch.optim.SGD", "--learning_rate", "0.1"]
    rc, _, err = run_script("train_lora", base_args("tiny-sd15", dataset, tmp_path / "a", *sgd))
    assert rc == 0, err
    rc, _, err = run_script("train_lora", base_args("tiny-sd15", dataset, tmp_path / "b", *sgd,
                                                    "--sdpa=false"))
    assert rc == 0, err
    a, _ = read(str(tmp_path / "a" / "last.safetensors"))
    b, _ = read(str(tmp_path / "b" / "last.safetensors"))
    keys = sorted(a)
    flat_a = torch.cat([a[k].flatten() for k in keys])
    flat_b = torch.cat([b[k].flatten() for k in keys])
    assert rel_diff(flat_b, flat_a) < 1e-4  # the kernels differ only in summation order
    assert not torch.equal(flat_a, flat_b)  # ... but they do differ: the flag took effect


def test_uncached_loading_with_workers_matches_cached(dataset, tmp_path, run_script):
    """Without --cache_latents images are decoded per step (here in a DataLoader worker) and
    encoded with the VAE's posterior mean, so the result equals the cached run's."""
    sgd = ["--optimizer_type", "torch.optim.SGD", "--learning_rate", "0.1"]
    rc, _, err = run_script("train_lora", base_args("tiny-sd15", dataset, tmp_path / "a", *sgd))
    assert rc == 0, err
    args = [a for a in base_args("tiny-sd15", dataset, tmp_path / "b", *sgd) if a != "--cache_latents"]
    rc, _, err = run_script("train_lora", args + ["--max_data_loader_n_workers", "1"])
    assert rc == 0, err
    a, _ = read(str(tmp_path / "a" / "last.safetensors"))
    b, _ = read(str(tmp_path / "b" / "last.safetensors"))
    for k in a:
        assert rel_diff(b[k], a[k]) < 1e-5, k


def test_network_multiplier_scales_the_trained_network(dataset, tmp_path, run_script):
    """network_multiplier scales the LoRA's output during training: at 0 the network gets no
    gradient (up weights stay at their zero init), at 1 it trains."""
    sgd = ["--optimizer_type", "torch.optim.SGD", "--learning_rate", "0.1"]
    for m in ("0", "1"):
        rc, _, err = run_script("train_lora", base_args("tiny-sd15", dataset, tmp_path / m, *sgd,
                                                        "--network_multiplier", m))
        assert rc == 0, err
    off, _ = read(str(tmp_path / "0" / "last.safetensors"))
    on, _ = read(str(tmp_path / "1" / "last.safetensors"))
    ups = [k for k in off if k.endswith("lora_up.weight")]
    assert all(float(off[k].abs().max()) == 0.0 for k in ups)
    assert any(float(on[k].abs().max()) > 0.0 for k in ups)


def test_model_spec_metadata_options_are_written(dataset, tmp_path, run_script):
    """sd-scripts' metadata_* options (the kohya_ss GUI writes title, author, description,
    license, tags) land in the file as modelspec.<field>; the thumbnail as a data: URL of the
    file's bytes; training_comment as ss_training_comment. A missing thumbnail is one line."""
    import base64

    from safetensors import safe_open

    thumb = tmp_path / "thumb.png"
    thumb.write_bytes(b"\x89PNG\r\n\x1a\nnot really an image")
    out = str(tmp_path / "out")
    meta_args = ["--metadata_title", "My LoRA", "--metadata_author", "me", "--metadata_license",
                 "CC0", "--metadata_tags", "a,b", "--metadata_trigger_phrase", "sks shape",
                 "--metadata_thumbnail", str(thumb), "--training_comment", "hello"]
    rc, _, err = run_script("train_lora", base_args("tiny-sd15", dataset, out, *meta_args))
    assert rc == 0, err[-2000:]
    with safe_open(os.path.join(out, "last.safetensors"), "pt") as f:
        md = f.metadata()
    assert md["modelspec.title"] == "My LoRA" and md["modelspec.author"] == "me"
    assert md["modelspec.license"] == "CC0" and md["modelspec.tags"] == "a,b"
    assert md["modelspec.trigger_phrase"] == "sks shape" and md["ss_training_comment"] == "hello"
    assert "modelspec.description" not in md  # unset: not written
    head, data = md["modelspec.thumbnail"].split(",", 1)
    assert head == "data:image/png;base64" and base64.b64decode(data) == thumb.read_bytes()
    rc, _, err = run_script("train_lora", base_args("tiny-sd15", dataset, str(tmp_path / "o2"),
                                                    "--metadata_thumbnail", str(tmp_path / "nope.png")))
    assert rc == 2 and err.strip().splitlines()[-1] == f"error: metadata_thumbnail: no such file: {tmp_path / 'nope.png'}"
    assert "Traceback" not in err
