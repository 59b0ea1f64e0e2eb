"""sd-scripts' FLUX.1 / SD3 options closed by the option audit (tests/config/test_sd_scripts_flow_options.py),
each against what sd-scripts' code computes, done by hand:

- FLUX.1 ``ip_noise_gamma`` (flux_train_utils.get_noisy_model_input_and_timesteps): the model's
  input is (1 - s) x0 + s (noise + gamma xi), the target noise - x0;
- SD3's autoencoder file as ``vae`` (sd3_train.py / sd3_train_network.py read args.vae);
- SD3 ``num_last_block_to_freeze`` (sd3_train.py): the last N parameter tensors whose name
  contains ``x_block`` are frozen;
- the SNR weightings, ``xformers`` and SD3's ``ip_noise_gamma``: "no effect", as sd-scripts'
  FLUX.1 / SD3 trainers ignore them."""
from __future__ import annotations

import logging
import math
import types

import pytest
import torch

from library.config.parse import parse_args
from library.training import flow_loss


def _opts(model, *argv, script="train_dreambooth"):
    return parse_args(script, ["--pretrained_model_name_or_path", model, "--train_data_dir", "unused",
                               "--resolution", "64", "--max_train_steps", "1", "--output_dir", "unused",
                               *[str(a) for a in argv]])


@pytest.mark.parametrize("random_strength", [False, True])
def test_flux_ip_noise_gamma_against_a_hand_computation(random_strength):
    gamma = 0.3
    extra = ["--ip_noise_gamma", gamma, "--timestep_sampling", "uniform", "--model_prediction_type", "raw"]
    opts = _opts("tiny-flux", *extra, *(["--ip_noise_gamma_random_strength"] if random_strength else []))
    assert flow_loss.check_options(opts, "dreambooth") == "flux"  # accepted, no longer refused
    losses = flow_loss.losses_for(opts, types.SimpleNamespace(family="flux"))
    torch.manual_seed(0)
    latents, pred = torch.randn(2, 16, 8, 8), torch.randn(2, 16, 8, 8)
    seeds = (11, 12)
    d = losses.draw(latents, [torch.Generator().manual_seed(s) for s in seeds])
    noisy = losses.noisy_latents(latents, d)
    loss = losses.per_sample_loss(pred, latents, d)
    for k, seed in enumerate(seeds):
        # the sample's generator, in the documented order: noise, sigma (uniform: u), the random
        # strength r, then xi
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn((16, 8, 8), generator=g).double()
        sigma = float(torch.rand(1, generator=g))
        r = float(torch.rand(1, generator=g)) if random_strength else 1.0
        xi = torch.randn((16, 8, 8), generator=g).double()
        x0 = latents[k].double()
        x_t = (1 - sigma) * x0 + sigma * (noise + gamma * r * xi)
        target = noise - x0  # the plain noise: the perturbation is in the input only
        assert torch.allclose(d.noise[k].double(), noise)
        assert abs(float(d.sigmas[k]) - sigma) < 1e-7
        assert torch.allclose(noisy[k].double(), x_t, atol=1e-6)
        ref = float(((pred[k].double() - target) ** 2).mean())
        assert abs(float(loss[k]) - ref) < 1e-6 * max(1.0, ref)
    assert not torch.equal(d.input_noise, d.noise)


def test_sd3_ip_noise_gamma_and_the_snr_weightings_have_no_effect(caplog):
    caplog.set_level(logging.WARNING)
    opts = _opts("tiny-sd3", "--ip_noise_gamma", "0.3", "--debiased_estimation_loss", "--v_pred_like_loss", "0.2",
                 "--scale_v_pred_loss_like_noise_pred", "--min_snr_gamma", "5")
    assert flow_loss.check_options(opts, "finetune") == "sd3"
    for name in ("ip_noise_gamma", "debiased_estimation_loss", "v_pred_like_loss",
                 "scale_v_pred_loss_like_noise_pred", "min_snr_gamma"):
        lines = [r.getMessage() for r in caplog.records if f"option {name} has no effect" in r.getMessage()]
        assert len(lines) == 1, name
    losses = flow_loss.losses_for(opts, types.SimpleNamespace(family="sd3"))
    d = losses.draw(torch.zeros(2, 16, 8, 8), [torch.Generator().manual_seed(s) for s in (1, 2)])
    assert torch.equal(d.input_noise, d.noise)


def test_xformers_and_sdpa_false_have_no_effect_on_flow_models(caplog, monkeypatch):
    caplog.set_level(logging.WARNING)
    # as parse leaves them when the xformers package is installed (xformers on, sdpa off)
    opts = _opts("tiny-flux").replace(xformers=True, sdpa=False)
    assert flow_loss.check_options(opts, "dreambooth") == "flux"
    assert "option xformers has no effect with the FLUX.1 model" in caplog.text
    caplog.clear()
    assert flow_loss.check_options(_opts("tiny-sd3", "--sdpa", "false"), "finetune") == "sd3"
    assert "option sdpa = false has no effect with the SD3 model" in caplog.text


def test_sd3_vae_option_is_the_autoencoder_file(tmp_path):
    """sd-scripts' SD3 scripts load the autoencoder from --vae: the bundle's VAE is that file's."""
    from safetensors.torch import save_file

    from library.models import flow_family
    from library.models.families.sd3 import sd3_checkpoint, sd3_vae

    vae = sd3_checkpoint.load_sd3("tiny-sd3").vae
    with torch.no_grad():
        for p in vae.parameters():
            p.mul_(0.5)
    path = str(tmp_path / "sd3_vae.safetensors")
    save_file(sd3_vae.to_original(vae, prefix=""), path)
    opts = _opts("tiny-sd3", "--vae", path, script="finetune")
    assert flow_loss.check_options(opts, "finetune") == "sd3"
    bundle = flow_family.load_from_options(opts)
    mine, theirs = bundle.vae.state_dict(), vae.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert bundle.vae_identity != "tiny-sd3:vae" and "builtin" not in bundle.vae_identity
    other = str(tmp_path / "ae.safetensors")
    save_file(sd3_vae.to_original(vae, prefix=""), other)
    with pytest.raises(flow_family.FlowFamilyError, match="both name SD3's autoencoder file; give one"):
        flow_loss.check_options(_opts("tiny-sd3", "--vae", path, "--ae", other), "finetune")


def test_num_last_block_to_freeze_freezes_the_last_x_block_tensors(dataset, tmp_path, train):
    """sd3_train.py's rule: of the parameters whose name contains x_block, in the model's order,
    the last N get no gradient. tiny-sd3 has two joint blocks; the last three such tensors of
    SAI's (and sd-scripts' SingleDiTBlock's) order attn, mlp, adaLN_modulation are written out
    here by hand."""
    from library.models.families.sd3 import sd3_builtins

    frozen = {"joint_blocks.1.x_block.adaLN_modulation.1.bias", "joint_blocks.1.x_block.adaLN_modulation.1.weight",
              "joint_blocks.1.x_block.mlp.fc2.bias"}
    rc, _, err, run = train("finetune", [
        "--pretrained_model_name_or_path", "tiny-sd3", "--train_data_dir", dataset, "--output_dir",
        str(tmp_path / "o"), "--resolution", "64", "--max_train_steps", "1", "--cache_latents",
        "--optimizer_type", "SGD", "--learning_rate", "0.5", "--num_last_block_to_freeze", "3"])
    assert rc == 0, err
    initial = sd3_builtins.build_builtin("tiny-sd3")["mmdit"].state_dict()
    trained = dict(run.parts.bundle.unet.named_parameters())
    same = {k for k, p in trained.items() if torch.equal(p.detach(), initial[k])}
    assert same == frozen
    assert all(not trained[k].requires_grad for k in frozen)


@pytest.mark.parametrize("model, loss_type, schedule", [
    ("tiny-flux", "huber", "constant"), ("tiny-flux", "smooth_l1", "exponential"),
    ("tiny-sd3", "huber", "exponential")])
def test_flow_huber_loss_against_a_hand_computation(model, loss_type, schedule):
    """sd-scripts' FLUX.1 / SD3 trainers take huber / smooth_l1 with the constant and exponential
    schedules at their timesteps t = 1000 sigma (get_huber_threshold_if_needed, conditional_loss):
    c = huber_c x huber_scale, or exp(ln(huber_c) t / 1000) x huber_scale; huber 2c(sqrt(d^2 +
    c^2) - c), smooth_l1 2(sqrt(d^2 + c^2) - c), averaged per sample."""
    huber_c, huber_scale = 0.2, 1.5
    fam = "flux" if model == "tiny-flux" else "sd3"
    extra = ["--model_prediction_type", "raw"] if fam == "flux" else []
    opts = _opts(model, "--loss_type", loss_type, "--huber_schedule", schedule, "--huber_c", huber_c,
                 "--huber_scale", huber_scale, "--weighting_scheme", "none", *extra,
                 script="train_dreambooth" if fam == "flux" else "finetune")
    assert flow_loss.check_options(opts, "dreambooth") == fam
    losses = flow_loss.losses_for(opts, types.SimpleNamespace(family=fam))
    torch.manual_seed(1)
    latents, pred = torch.randn(3, 16, 8, 8), torch.randn(3, 16, 8, 8)
    d = losses.draw(latents, [torch.Generator().manual_seed(s) for s in (5, 6, 7)])
    got = losses.per_sample_loss(pred, latents, d)
    noisy = losses.noisy_latents(latents, d).double()
    for k in range(3):
        s = float(d.sigmas[k])
        x0, n = latents[k].double(), d.noise[k].double()
        if fam == "flux":  # raw: the velocity against noise - x0
            p, t = pred[k].double(), n - x0
        else:  # SD3: the clean latent x_t - sigma * output against x0
            p, t = noisy[k] - s * pred[k].double(), x0
        c = huber_c * huber_scale if schedule == "constant" else \
            torch.exp(torch.tensor(math.log(huber_c) * 1000 * s / 1000, dtype=torch.float64)) * huber_scale
        root = torch.sqrt((p - t) ** 2 + c ** 2) - c
        ref = float((2 * c * root if loss_type == "huber" else 2 * root).mean())
        assert abs(float(got[k]) - ref) < 1e-5 * max(1.0, ref), (k, float(got[k]), ref)


def test_flow_huber_snr_schedule_is_refused_in_one_line():
    from library.models import flow_family

    with pytest.raises(flow_family.FlowFamilyError, match="huber_schedule snr: loss_type huber with the SD3 model"):
        flow_loss.check_options(_opts("tiny-sd3", "--loss_type", "huber", script="finetune"), "finetune")
