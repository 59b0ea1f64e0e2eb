"""train_dreambooth.py end to end on the built-in tiny models.

The minimal DreamBooth of the foundation issue: instance images, the full U-Net (optionally the text
encoders) trained with AdamW, saved as one file in the original SD/SDXL layout (or a diffusers
folder) that the model loader reads back. Each run is 2 steps at 64 px with cached latents.
"""
import os

import pytest
import torch
from tests.conftest import read

ARCH_NAME = {"sd15": "tiny-sd15", "sd2": "tiny-sd2", "sdxl": "tiny-sdxl"}
# Key prefixes of the original single-file layout, per component.
LAYOUT = {
    "sd15": {"unet": "model.diffusion_model.", "vae": "first_stage_model.",
             "text_encoder": "cond_stage_model.transformer."},
    "sd2": {"unet": "model.diffusion_model.", "vae": "first_stage_model.",
            "text_encoder": "cond_stage_model.model."},
    "sdxl": {"unet": "model.diffusion_model.", "vae": "first_stage_model.",
             "text_encoder": "conditioner.embedders.0.transformer.",
             "text_encoder_2": "conditioner.embedders.1.model."},
}
MODELSPEC_ARCH = {"sd15": "stable-diffusion-v1", "sd2": "stable-diffusion-v2-768-v",
                  "sdxl": "stable-diffusion-xl-v1-base"}


def base_args(model, data, out, *extra):
    return ["--pretrained_model_name_or_path", model, "--train_data_dir", data,
            "--output_dir", out, "--resolution", "64", "--max_train_steps", "2",
            "--learning_rate", "1e-3", "--cache_latents", *extra]



def rel(a, b):
    """||a-b|| / ||b|| (absolute for a zero b), in float32."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    nb = float(b.norm())
    return float((a - b).norm()) / (nb if nb > 0 else 1.0)


def state(module):
    return {k: v for k, v in module.state_dict().items() if v.is_floating_point()}


def changed(a: dict, b: dict, tol=1e-6) -> set:
    """Names whose tensors differ (relative difference above tol); the key sets must match."""
    assert a.keys() == b.keys()
    return {k for k in a if rel(a[k], b[k]) > tol}


def assert_equal_states(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].cpu(), b[k].cpu()), f"{what}: {k}"


def base_bundle(arch):
    from library.models.loading import load_model_bundle

    return load_model_bundle(ARCH_NAME[arch])


@pytest.mark.parametrize("arch", ["sd15", "sd2", "sdxl"])
def test_dreambooth_saves_a_single_file_that_loads_back(arch, dataset, tmp_path, train):
    from library.models.loading import load_model_bundle

    out = tmp_path / "out"
    rc, stdout, err, run = train("train_dreambooth", base_args(ARCH_NAME[arch], dataset, out))
    assert rc == 0, err
    assert "total_steps: 2" in stdout and "reg_images: 0" in stdout
    assert sorted(os.listdir(out)) == ["last.safetensors"]
    path = str(out / "last.safetensors")

    # One file in the original layout: every key belongs to one component's prefix, and each
    # component of the family is there.
    sd, md = read(path)
    prefixes = LAYOUT[arch]
    for key in sd:
        assert any(key.startswith(p) for p in prefixes.values()), key
    for comp, p in prefixes.items():
        assert any(k.startswith(p) for k in sd), comp
    assert "model.diffusion_model.input_blocks.0.0.weight" in sd
    assert "first_stage_model.encoder.conv_in.weight" in sd

    # It loads back, as the same family, with exactly the trained in-memory weights.
    loaded = load_model_bundle(path)
    assert loaded.family == run.parts.bundle.family == {"sd15": "sd1"}.get(arch, arch)
    assert loaded.v_parameterization == (arch == "sd2")
    assert_equal_states(state(loaded.unet), state(run.parts.bundle.unet), "unet")

    # Training changed every U-Net tensor; the VAE and (without --train_text_encoder) the text
    # encoders are exactly the base model's.
    base = base_bundle(arch)
    unet_before = state(base.unet)
    assert changed(state(loaded.unet), unet_before) == set(unet_before)
    assert_equal_states(state(loaded.vae), state(base.vae), "vae")
    assert len(loaded.text_encoders) == len(base.text_encoders) == (2 if arch == "sdxl" else 1)
    for i, (te, te0) in enumerate(zip(loaded.text_encoders, base.text_encoders)):
        assert_equal_states(state(te), state(te0), f"text encoder {i + 1}")

    # Metadata of a full model: modelspec without "/lora", no network keys.
    assert md["modelspec.architecture"] == MODELSPEC_ARCH[arch]
    assert md["modelspec.sai_model_spec"] == "1.0.0"
    assert md["modelspec.prediction_type"] == ("v" if arch == "sd2" else "epsilon")
    assert md["modelspec.title"] == "last" and md["modelspec.resolution"] == "64x64"
    assert md["modelspec.implementation"] == ("https://github.com/Stability-AI/generative-models"
                                              if arch == "sdxl" else "diffusers")
    assert not [k for k in md if k.startswith("ss_network")]
    assert md["ss_train_text_encoder"] == "False"
    assert md["ss_base_model_version"] == {"sd15": "sd_v1", "sd2": "sd_v2",
                                           "sdxl": "sdxl_base_v1-0"}[arch]
    assert md["ss_v2"] == str(arch == "sd2")
    assert md["ss_sd_model_name"] == ARCH_NAME[arch]
    assert md["ss_steps"] == "2" and md["ss_epoch"] == "1"
    assert md["ss_num_train_images"] == "4" and md["ss_num_reg_images"] == "0"
    assert float(md["ss_learning_rate"]) == 1e-3
    assert md["ss_mixed_precision"] == "no" and md["ss_seed"] == "42"
    assert md["ss_resolution"] == "(64, 64)" and md["ss_output_name"] == "last"
    assert float(md["ss_training_started_at"]) <= float(md["ss_training_finished_at"])


@pytest.mark.parametrize("arch", ["sd15", "sdxl"])
def test_train_text_encoder_trains_every_text_encoder(arch, dataset, tmp_path, train):
    from library.models.loading import load_model_bundle

    out = tmp_path / "out"
    rc, _, err, run = train("train_dreambooth", base_args(ARCH_NAME[arch], dataset, out, "--train_text_encoder"))
    assert rc == 0, err
    path = str(out / "last.safetensors")
    _, md = read(path)
    assert md["ss_train_text_encoder"] == "True"
    loaded, base = load_model_bundle(path), base_bundle(arch)
    assert_equal_states(state(loaded.unet), state(run.parts.bundle.unet), "unet")
    assert changed(state(loaded.unet), state(base.unet))
    for i, (te, te_run, te0) in enumerate(zip(loaded.text_encoders, run.parts.bundle.text_encoders,
                                              base.text_encoders)):
        assert_equal_states(state(te), state(te_run), f"text encoder {i + 1}")
        moved = changed(state(te), state(te0))
        # The token embedding and the first layer are on every gradient path (SDXL's first
        # encoder stops at its penultimate layer, so not every tensor changes).
        assert any(k.endswith("token_embedding.weight") for k in moved), (i, sorted(moved)[:5])
        assert any("layers.0.self_attn.q_proj.weight" in k for k in moved), (i, sorted(moved)[:5])
    assert_equal_states(state(loaded.vae), state(base.vae), "vae")


def test_text_encoder_learning_rates(dataset, tmp_path, train):
    """learning_rate_te (sd-scripts' name, an alias of text_encoder_lr) is honoured; a rate of 0
    freezes that part; SDXL takes one rate per text encoder."""
    # SD1: the text encoder at 0 stays the base one while the U-Net trains.
    base = base_bundle("sd15")
    rc, _, err, run = train("train_dreambooth", base_args("tiny-sd15", dataset, tmp_path / "a", "--train_text_encoder",
                                      "--learning_rate_te", "0"))
    assert rc == 0, err
    assert changed(state(run.parts.bundle.unet), state(base.unet))
    assert_equal_states(state(run.parts.bundle.text_encoders[0]), state(base.text_encoders[0]),
                        "text encoder")

    # A text-encoder rate without train_text_encoder (what the kohya_ss GUI writes): the SD1 text
    # encoder trains, as sd-scripts' train_db.py does, said in one line; an explicit
    # train_text_encoder = false keeps it frozen, with a warning.
    rc, _, err, run = train("train_dreambooth", base_args("tiny-sd15", dataset, tmp_path / "a2", "--text_encoder_lr",
                                      "1e-3"))
    assert rc == 0, err
    assert "the text encoder trains, as in sd-scripts' train_db.py" in err
    assert changed(state(run.parts.bundle.text_encoders[0]), state(base.text_encoders[0]))
    rc, _, err, run = train("train_dreambooth", base_args("tiny-sd15", dataset, tmp_path / "a3", "--text_encoder_lr",
                                      "1e-3", "--train_text_encoder=false"))
    assert rc == 0, err
    assert "WARNING: text_encoder_lr has no effect without train_text_encoder" in err
    assert_equal_states(state(run.parts.bundle.text_encoders[0]), state(base.text_encoders[0]),
                        "text encoder")

    # SD1: only the text encoder trains when learning_rate is 0 but text_encoder_lr is not.
    rc, _, err, run = train("train_dreambooth", base_args("tiny-sd15", dataset, tmp_path / "b", "--train_text_encoder",
                                      "--learning_rate", "0", "--text_encoder_lr", "1e-3"))
    assert rc == 0, err
    assert_equal_states(state(run.parts.bundle.unet), state(base.unet), "unet")
    assert changed(state(run.parts.bundle.text_encoders[0]), state(base.text_encoders[0]))

    # SDXL: [te1, te2] = [1e-3, 0] trains the first text encoder only.
    base = base_bundle("sdxl")
    rc, _, err, run = train("train_dreambooth", base_args("tiny-sdxl", dataset, tmp_path / "c", "--train_text_encoder",
                                      "--text_encoder_lr", "1e-3", "0"))
    assert rc == 0, err
    te1, te2 = run.parts.bundle.text_encoders
    assert changed(state(te1), state(base.text_encoders[0]))
    assert_equal_states(state(te2), state(base.text_encoders[1]), "text encoder 2")
    _, md = read(str(tmp_path / "c" / "last.safetensors"))
    assert md["ss_text_encoder_lr"] == str([1e-3, 0.0])

    # Two rates for a model with one text encoder: one line, no traceback.
    rc, _, err, _ = train("train_dreambooth", base_args("tiny-sd15", dataset, tmp_path / "d", "--train_text_encoder",
                                    "--text_encoder_lr", "1e-3", "1e-4"))
    assert rc == 2
    assert err.strip().splitlines()[-1] == ("error: text_encoder_lr: 2 values given but this sd1 "
                                            "model has 1 text encoder(s)")
    assert "Traceback" not in err


def test_zero_learning_rate_is_a_one_line_error(dataset, tmp_path, train):
    out = tmp_path / "out"
    rc, stdout, err, run = train("train_dreambooth", base_args("tiny-sd15", dataset, out, "--learning_rate", "0"))
    assert rc == 2 and run is None
    assert err.strip() == ("error: nothing to train: learning_rate is 0 and train_text_encoder is "
                           "off; set a learning_rate above 0")
    assert "step plan" not in stdout  # refused before any weight was loaded
    assert not out.exists()
    rc, _, err, _ = train("train_dreambooth", base_args("tiny-sd15", dataset, out, "--learning_rate", "0",
                                    "--train_text_encoder"))
    assert rc == 2
    assert err.strip() == ("error: nothing to train: learning_rate is 0 and text_encoder_lr is 0 "
                           "or unset; set a learning_rate above 0")


@pytest.mark.parametrize("fmt", ["diffusers", "ckpt"])
def test_save_model_as_other_formats_loads_back(fmt, dataset, tmp_path, train):
    from library.models.loading import load_model_bundle

    out = tmp_path / "out"
    # highvram: the VAE stays after caching, for the comparison with the in-memory model below
    rc, _, err, run = train("train_dreambooth", base_args("tiny-sdxl", dataset, out, "--save_model_as", fmt,
                                                          "--highvram"))
    assert rc == 0, err
    if fmt == "diffusers":
        path = out / "last"
        assert sorted(os.listdir(out)) == ["last"]
        assert {"model_index.json", "unet", "vae", "text_encoder", "text_encoder_2", "tokenizer",
                "tokenizer_2", "scheduler"} <= set(os.listdir(path))
        assert any(n.endswith(".safetensors") for n in os.listdir(path / "unet"))
    else:
        path = out / "last.ckpt"
        assert sorted(os.listdir(out)) == ["last.ckpt"]
    loaded = load_model_bundle(str(path))
    assert loaded.family == "sdxl"
    assert_equal_states(state(loaded.unet), state(run.parts.bundle.unet), "unet")
    for i, (te, te_run) in enumerate(zip(loaded.text_encoders, run.parts.bundle.text_encoders)):
        assert_equal_states(state(te), state(te_run), f"text encoder {i + 1}")
    assert_equal_states(state(loaded.vae), state(run.parts.bundle.vae), "vae")


def test_save_precision_fp16(dataset, tmp_path, train):
    out = tmp_path / "out"
    rc, _, err, run = train("train_dreambooth", base_args("tiny-sd15", dataset, out, "--save_precision", "fp16",
                                                          "--highvram"))  # the VAE stays, compared below
    assert rc == 0, err
    sd, _ = read(str(out / "last.safetensors"))
    floats = {k: v for k, v in sd.items() if v.is_floating_point()}
    assert floats and all(v.dtype == torch.float16 for v in floats.values())
    # The saved weights are the trained ones rounded to fp16; training went on in float32.
    assert next(run.parts.bundle.unet.parameters()).dtype == torch.float32
    from library.models.sd_checkpoint import original_state_dict

    trained = original_state_dict(run.parts.bundle.components(), "sd1")
    assert trained.keys() == sd.keys()
    for k, v in trained.items():
        if v.is_floating_point():
            assert torch.equal(sd[k], v.detach().to(torch.float16)), k


def test_reg_images_with_prior_loss_weight(dataset, tmp_path, train):
    from tools.make_sample_dataset import make_sample_dataset

    reg = tmp_path / "reg"
    make_sample_dataset(str(reg), n_images=2, size=64, repeats=1, concept="shape")
    trained = {}
    for w in ("1.0", "0.5"):
        out = tmp_path / f"out{w}"
        # batch 4 x 2 steps: the whole epoch (4 instance + 4 balanced reg samples) is seen.
        rc, stdout, err, run = train("train_dreambooth", base_args("tiny-sd15", dataset, out, "--reg_data_dir", reg,
                                               "--prior_loss_weight", w, "--train_batch_size", "4"))
        assert rc == 0, err
        assert "reg_images: 2" in stdout and "reg_samples: 4" in stdout
        assert "samples_per_epoch: 8" in stdout
        _, md = read(str(out / "last.safetensors"))
        assert md["ss_num_reg_images"] == "2" and md["ss_prior_loss_weight"] == w
        trained[w] = state(run.parts.bundle.unet)
    # The weight of the reg samples' loss reaches the update.
    assert changed(trained["0.5"], trained["1.0"], tol=1e-4)


def test_sdxl_learning_rate_te1_te2(dataset, tmp_path, train):
    """sd-scripts' learning_rate_te1 / learning_rate_te2: one rate per SDXL text encoder (0 freezes
    it), overriding text_encoder_lr for that encoder; SD1 rejects them with one line."""
    base = base_bundle("sdxl")
    rc, _, err, run = train("train_dreambooth", base_args(
        "tiny-sdxl", dataset, tmp_path / "a", "--train_text_encoder", "--text_encoder_lr", "1e-3",
        "--learning_rate_te2", "0"))
    assert rc == 0, err
    te1, te2 = run.parts.bundle.text_encoders
    assert changed(state(te1), state(base.text_encoders[0]))
    assert_equal_states(state(te2), state(base.text_encoders[1]), "text encoder 2")
    lrs = sorted(g["lr"] for g in run.parts.stepper.optimizer.param_groups)
    assert lrs == [1e-3, 1e-3]  # U-Net and text encoder 1; text encoder 2 is not in the optimizer
    _, md = read(str(tmp_path / "a" / "last.safetensors"))
    assert md["ss_text_encoder_lr"] == str([1e-3, 0.0])

    rc, _, err, run = train("train_dreambooth", base_args(
        "tiny-sdxl", dataset, tmp_path / "b", "--train_text_encoder", "--learning_rate_te1", "2e-4",
        "--learning_rate_te2", "3e-4"))
    assert rc == 0, err
    assert sorted(g["lr"] for g in run.parts.stepper.optimizer.param_groups) == [2e-4, 3e-4, 1e-3]

    rc, _, err, _ = train("train_dreambooth", base_args(
        "tiny-sd15", dataset, tmp_path / "c", "--train_text_encoder", "--learning_rate_te2", "1e-4"))
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("error: learning_rate_te2 is for SDXL's two text "
                                            "encoders; this sd1 model has one: use text_encoder_lr")


def test_stop_text_encoder_training(dataset, tmp_path, train):
    """The text encoder trains in the first N steps only: after 3 steps with N = 1 it equals the
    text encoder of a 1-step run, its optimizer state has 1 step, and the U-Net trained all 3; a
    resume from before and from after the stop gives the same weights bit for bit."""
    stop = ["--train_text_encoder", "--stop_text_encoder_training", "1", "--max_train_steps", "3"]
    base = base_bundle("sd15")
    rc, _, err, one = train("train_dreambooth", base_args(
        "tiny-sd15", dataset, tmp_path / "one", "--train_text_encoder", "--max_train_steps", "1"))
    assert rc == 0, err
    out = tmp_path / "full"
    rc, _, err, full = train("train_dreambooth", base_args(
        "tiny-sd15", dataset, out, *stop, "--save_every_n_steps", "1", "--save_state"))
    assert rc == 0, err
    assert "text encoder(s) frozen after step 1" in err
    te, te1, te0 = (state(r.text_encoders[0]) for r in (full.parts.bundle, one.parts.bundle, base))
    assert_equal_states(te, te1, "text encoder after the stop")
    assert changed(te, te0)
    assert changed(state(full.parts.bundle.unet), state(one.parts.bundle.unet))  # the U-Net went on training
    te_ids = {id(p) for p in full.parts.bundle.text_encoders[0].parameters()}
    opt_state = full.parts.stepper.optimizer.state
    te_steps = {int(opt_state[p]["step"]) for g in full.parts.stepper.optimizer.param_groups
                for p in g["params"] if id(p) in te_ids and p in opt_state}
    assert te_steps == {1}
    assert not any(p.requires_grad for p in full.parts.bundle.text_encoders[0].parameters())
    _, md = read(str(out / "last.safetensors"))
    assert md["ss_stop_text_encoder_training"] == "1"

    for k in (1, 2):  # resume at the stop (step 1) and after it (step 2)
        part = tmp_path / f"resume{k}"
        rc, _, err, r = train("train_dreambooth", base_args(
            "tiny-sd15", dataset, part, *stop, "--save_every_n_steps", "1", "--save_state",
            "--resume", out / f"last-step{k:08d}-state"))
        assert rc == 0, err
        assert_equal_states(state(r.parts.bundle.unet), state(full.parts.bundle.unet), f"unet, resume {k}")
        assert_equal_states(state(r.parts.bundle.text_encoders[0]), te, f"text encoder, resume {k}")

    # fused_backward_pass: the frozen text encoder's per-parameter optimizers are not stepped
    fused = ["--fused_backward_pass", "--max_grad_norm", "0"]
    rc, _, err, f1 = train("train_dreambooth", base_args(
        "tiny-sd15", dataset, tmp_path / "f1", "--train_text_encoder", "--max_train_steps", "1", *fused))
    assert rc == 0, err
    rc, _, err, f3 = train("train_dreambooth", base_args("tiny-sd15", dataset, tmp_path / "f3", *stop, *fused))
    assert rc == 0, err
    assert_equal_states(state(f3.parts.bundle.text_encoders[0]), state(f1.parts.bundle.text_encoders[0]),
                        "fused: text encoder after the stop")
    assert changed(state(f3.parts.bundle.unet), state(f1.parts.bundle.unet))

    rc, _, err, _ = train("train_dreambooth", base_args(
        "tiny-sd15", dataset, tmp_path / "bad", "--stop_text_encoder_training", "1",
        "--train_text_encoder=false"))
    assert rc == 2 and err.strip().splitlines()[-1] == (
        "error: stop_text_encoder_training needs train_text_encoder (the text encoders do not "
        "train without it)")


def test_reg_sample_loss_is_weighted_by_prior_loss_weight(dataset, tmp_path, train):
    """The per-sample loss of a reg sample is prior_loss_weight x its plain loss; an instance
    sample's is unweighted (checked on the trained Run, same noise and timestep draws)."""
    from tools.make_sample_dataset import make_sample_dataset

    reg = tmp_path / "reg"
    make_sample_dataset(str(reg), n_images=2, size=64, repeats=1, concept="shape")
    rc, _, err, run = train("train_dreambooth", base_args("tiny-sd15", dataset, tmp_path / "o",
                                                          "--reg_data_dir", reg,
                                                          "--prior_loss_weight", "0.25"))
    assert rc == 0, err
    from library.accelerator import make_accelerator
    from tests.conftest import reset_accelerate

    from library.training.batch_loss import BatchLoss

    c = run.parts
    acc = make_accelerator("no")  # run_script reset Accelerate's state after the run

    def batch_loss(opts):  # the run's, over the new Accelerator
        return BatchLoss(opts, run.tset, accelerator=acc, bundle=c.bundle,
                         family_model=c.family_model, losses=c.losses, placement=c.placement,
                         method=c.method, strategy=c.strategy, caches=c.caches)

    reg_i = next(i for i, s in enumerate(run.tset.samples) if s.is_reg)
    inst_i = next(i for i, s in enumerate(run.tset.samples) if not s.is_reg)
    with torch.no_grad():
        c.batch_loss = batch_loss(run.opts)
        weighted = [float(run.micro_step_loss(7, [i], None, 1)) for i in (reg_i, inst_i)]
        c.batch_loss = batch_loss(run.opts.replace(prior_loss_weight=1.0))
        plain = [float(run.micro_step_loss(7, [i], None, 1)) for i in (reg_i, inst_i)]
    reset_accelerate()
    assert weighted[0] == pytest.approx(0.25 * plain[0], rel=1e-6)
    assert weighted[1] == pytest.approx(plain[1], rel=1e-6)
