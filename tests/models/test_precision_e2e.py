"""Precision and memory options end to end on tiny-sd15 / tiny-sdxl: bf16 autocast (CPU), fp16
(refused on CPU), --no_half_vae, --gradient_checkpointing (same math) and --clip_skip."""
import pytest
import torch
from tests.conftest import read


def lora_args(model, data, out, *extra):
    return ["--pretrained_model_name_or_path", model, "--train_data_dir", data,
            "--output_dir", out, "--resolution", "64", "--max_train_steps", "2",
            "--learning_rate", "1e-3", "--network_dim", "4", "--network_alpha", "2",
            "--cache_latents", *extra]


def db_args(model, data, out, *extra):
    return ["--pretrained_model_name_or_path", model, "--train_data_dir", data,
            "--output_dir", out, "--resolution", "64", "--max_train_steps", "2",
            "--learning_rate", "1e-3", "--cache_latents", *extra]


ARGS = {"train_lora": lora_args, "train_dreambooth": db_args}



def rel(a, b):
    """||a-b|| / ||b|| (absolute for a zero b), in float32."""
    a, b = a.float(), b.float()
    nb = float(b.norm())
    return float((a - b).norm()) / (nb if nb > 0 else 1.0)


def max_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(rel(a[k], b[k]) for k in a)


def trained_lora_changed(sd: dict) -> bool:
    # lora_up starts at zero: any non-zero up weight means the network trained.
    return any(float(v.abs().max()) > 0 for k, v in sd.items() if k.endswith("lora_up.weight"))


def counting_checkpoint(monkeypatch):
    """Count calls of torch's activation checkpointing (as diffusers and transformers call it)."""
    import torch.utils.checkpoint as tuc
    import transformers.modeling_utils as tmu

    calls = []
    real = tuc.checkpoint

    def checkpoint(fn, *args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(tuc, "checkpoint", checkpoint)
    monkeypatch.setattr(tmu, "checkpoint", checkpoint)
    return calls


@pytest.mark.parametrize("script,model,extra", [
    ("train_lora", "tiny-sd15", []),
    ("train_lora", "tiny-sdxl", []),
    ("train_dreambooth", "tiny-sd15", ["--train_text_encoder"]),
], ids=["lora-sd15", "lora-sdxl", "dreambooth-te-sd15"])
def test_gradient_checkpointing_does_not_change_the_math(script, model, extra, dataset, tmp_path,
                                                         train, monkeypatch, recwarn):
    args = ARGS[script]
    rc, _, err, _ = train(script, args(model, dataset, tmp_path / "plain", *extra))
    assert rc == 0, err
    calls = counting_checkpoint(monkeypatch)
    rc, _, err, run = train(script, args(model, dataset, tmp_path / "gc", *extra,
                                         "--gradient_checkpointing"))
    assert rc == 0, err
    # Checkpointing really ran (U-Net blocks, and the text encoder layers that train), with
    # non-reentrant checkpoints, which pass gradients to parameters inside frozen models.
    assert calls and set(calls) == {False}
    def checkpointed(model):
        return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())

    assert checkpointed(run.parts.bundle.unet)
    assert all(checkpointed(te) for te in run.parts.bundle.text_encoders)
    # transformers 5's activation_checkpointing_enable, not its deprecated old name
    assert not [w for w in recwarn if "gradient_checkpointing_enable" in str(w.message)]
    plain, _ = read(str(tmp_path / "plain" / "last.safetensors"))
    gc, md = read(str(tmp_path / "gc" / "last.safetensors"))
    assert md["ss_gradient_checkpointing"] == "True"
    if script == "train_lora":
        assert trained_lora_changed(gc)
    assert max_rel(gc, plain) < 1e-5


def test_bf16_mixed_precision_trains_and_saves_a_lora(dataset, tmp_path, train):
    rc, _, err, fp32 = train("train_lora", lora_args("tiny-sd15", dataset, tmp_path / "fp32"))
    assert rc == 0, err
    rc, _, err, bf16 = train("train_lora", lora_args("tiny-sd15", dataset, tmp_path / "bf16",
                                                     "--mixed_precision", "bf16"))
    assert rc == 0, err
    # Frozen weights in bf16, the trained network in float32, the VAE in bf16.
    assert next(bf16.parts.bundle.unet.parameters()).dtype == torch.bfloat16
    assert bf16.parts.bundle.text_encoders[0].dtype == torch.bfloat16
    assert bf16.parts.bundle.vae.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in bf16.parts.method.network.parameters())
    sd, md = read(str(tmp_path / "bf16" / "last.safetensors"))
    assert md["ss_mixed_precision"] == "bf16"
    assert all(v.dtype == torch.float32 for k, v in sd.items() if k.endswith(".weight"))
    assert all(bool(torch.isfinite(v).all()) for v in sd.values())
    assert trained_lora_changed(sd)
    # Autocast was on (the loss is not bit-equal to float32's) and it is the same loss (first
    # step: same weights, same noise and timestep).
    a, b = bf16.progress.loss_log[0], fp32.progress.loss_log[0]
    assert a != b and abs(a - b) < 0.05 * b, (a, b)


def test_bf16_dreambooth_trains_the_unet_in_float32(dataset, tmp_path, train):
    rc, _, err, run = train("train_dreambooth", db_args("tiny-sd15", dataset, tmp_path / "out",
                                                        "--mixed_precision", "bf16"))
    assert rc == 0, err
    assert next(run.parts.bundle.unet.parameters()).dtype == torch.float32  # trained: float32 master
    assert run.parts.bundle.text_encoders[0].dtype == torch.bfloat16  # frozen
    sd, md = read(str(tmp_path / "out" / "last.safetensors"))
    assert md["ss_mixed_precision"] == "bf16"
    unet = {k: v for k, v in sd.items() if k.startswith("model.diffusion_model.")}
    assert unet and all(v.dtype == torch.float32 for v in unet.values())
    assert all(bool(torch.isfinite(v).all()) for v in unet.values())


def test_no_half_vae_keeps_the_vae_and_its_latents_in_float32(dataset, tmp_path, train):
    rc, _, err, fp32 = train("train_lora", lora_args("tiny-sd15", dataset, tmp_path / "fp32"))
    assert rc == 0, err
    rc, _, err, half = train("train_lora", lora_args("tiny-sd15", dataset, tmp_path / "half",
                                                     "--mixed_precision", "bf16"))
    assert rc == 0, err
    rc, _, err, full = train("train_lora", lora_args("tiny-sd15", dataset, tmp_path / "full",
                                                     "--mixed_precision", "bf16", "--no_half_vae"))
    assert rc == 0, err
    assert full.parts.bundle.vae.dtype == torch.float32 and half.parts.bundle.vae.dtype == torch.bfloat16
    assert next(full.parts.bundle.unet.parameters()).dtype == torch.bfloat16

    def latents(run):
        return {p: run.parts.caches.latents[k].latents for p, k in run.parts.caches.latent_key.items()}

    exact, rounded, got = latents(fp32), latents(half), latents(full)
    assert exact.keys() == got.keys() == rounded.keys()
    for p in exact:  # the float32 VAE's latents, not the bf16 VAE's
        assert torch.equal(got[p].float(), exact[p].float()), p
        assert not torch.equal(rounded[p].float(), exact[p].float()), p
    sd, _ = read(str(tmp_path / "full" / "last.safetensors"))
    assert trained_lora_changed(sd)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 mixed precision works on CUDA")
@pytest.mark.parametrize("script", ["train_lora", "train_dreambooth"])
def test_fp16_on_cpu_is_a_one_line_error(script, dataset, tmp_path, train):
    out = tmp_path / "out"
    rc, stdout, err, run = train(script, ARGS[script]("tiny-sd15", dataset, out,
                                                      "--mixed_precision", "fp16"))
    assert rc == 2 and run is None
    assert err.strip() == ("error: mixed_precision: fp16 needs a CUDA GPU (on CPU Accelerate "
                           "applies neither fp16 autocast nor loss scaling); use bf16 (CPU "
                           "autocast) or no")
    assert "step plan" not in stdout and not out.exists()  # before any weight was loaded


def test_clip_skip(dataset, tmp_path, train):
    rc, _, err, _ = train("train_lora", lora_args("tiny-sd15", dataset, tmp_path / "default"))
    assert rc == 0, err
    rc, _, err, _ = train("train_lora", lora_args("tiny-sd15", dataset, tmp_path / "one",
                                                  "--clip_skip", "1"))
    assert rc == 0, err
    rc, _, err, run = train("train_lora", lora_args("tiny-sd15", dataset, tmp_path / "two",
                                                    "--clip_skip", "2"))
    assert rc == 0, err
    last_layer = run.parts.bundle.text_encoders[0].config.num_hidden_layers - 1
    default, _ = read(str(tmp_path / "default" / "last.safetensors"))
    one, md1 = read(str(tmp_path / "one" / "last.safetensors"))
    two, md2 = read(str(tmp_path / "two" / "last.safetensors"))
    assert md1["ss_clip_skip"] == "1" and md2["ss_clip_skip"] == "2"
    # clip_skip 1 is the last layer, as unset; 2 conditions the U-Net on the penultimate layer.
    assert max_rel(one, default) == 0.0
    cross = [k for k in two if "attn2_to_k.lora_up" in k]
    assert cross and all(rel(two[k], default[k]) > 1e-3 for k in cross)
    # The last text-encoder layer is skipped: its LoRA gets no gradient and stays at zero.
    last = [k for k in two if k.startswith(f"lora_te_text_model_encoder_layers_{last_layer}_")
            and k.endswith("lora_up.weight")]
    assert last and all(float(two[k].abs().max()) == 0 for k in last)
    assert all(float(default[k].abs().max()) > 0 for k in last)
