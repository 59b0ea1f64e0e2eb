"""Dataset-config keys that act on the network, against hand computations:

- custom_attributes = {diff_output_preservation = true} (DOP, sd-scripts' train_network.py): the
  target of such a subset's samples is the U-Net's prediction with the network removed, on the
  same noisy latents, timesteps and caption;
- a dataset's network_multiplier: its samples train with the network at that multiplier, never
  in a batch with another multiplier's samples.
"""
import math

import pytest
import torch

from tests.conftest import reset_accelerate
from tools.make_sample_dataset import make_sample_dataset


def _dataset_toml(tmp_path, subsets, datasets_extra=("", )):
    """A run TOML whose dataset config has one [[datasets]] per ``datasets_extra`` entry, each with
    the given subsets (lists of extra subset lines)."""
    folder = make_sample_dataset(str(tmp_path / "data"), n_images=2, size=64, repeats=1)
    text = "[general]\nresolution = 64\ncaption_extension = \".caption\"\n"
    for extra, subs in zip(datasets_extra, subsets):
        text += f"[[datasets]]\n{extra}\n"
        for lines in subs:
            text += f"[[datasets.subsets]]\nimage_dir = \"{folder}\"\n{lines}\n"
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def _args(tmp_path, config, *extra):
    return ["--config", config, "--pretrained_model_name_or_path", "tiny-sd15",
            "--output_dir", tmp_path / "out", "--network_dim", "4", "--learning_rate", "1e-2",
            "--optimizer_args", "weight_decay=0", "--seed", "5", *extra]


def _lora_state(run):
    return {k: v.detach().clone() for k, v in run.parts.method.network.state_dict().items()}


def _initial_lora(seed):
    """The network as the run creates it: seeded by the run's seed right before it is built."""
    from library.models.loading import load_model_bundle
    from networks.lora import create_network

    b = load_model_bundle("tiny-sd15")
    torch.manual_seed(seed)
    net = create_network(1.0, 4, 1.0, b.vae, b.text_encoders[0], b.unet, neuron_dropout=None)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


DOP = "custom_attributes = {diff_output_preservation = true}"


def test_dop_only_run_leaves_the_lora_at_its_initial_weights(tmp_path, train):
    """With lora_up = 0 the network adds exactly nothing, so the prediction equals the prior
    (network at multiplier 0) bit for bit: zero loss, zero gradient, no update (AdamW without
    weight decay). The same run without DOP moves the weights (so this can fail)."""
    init = _initial_lora(5)
    assert all(not v.any() for k, v in init.items() if "lora_up" in k)
    for dop, moved in ((DOP, False), ("", True)):
        out = tmp_path / ("dop" if dop else "plain")
        rc, o, err, run = train("train_lora", _args(out, _dataset_toml(out, [[dop]]),
                                                    "--max_train_steps", "2"))
        assert rc == 0, err[-2000:]
        got = _lora_state(run)
        assert got.keys() == init.keys()
        same = all(torch.equal(got[k].float(), init[k].float()) for k in init)
        assert same is (not moved)
        if not moved:
            assert run.progress.loss_log == [0.0, 0.0]


def _hand_loss(run, i, epoch, captured, scale_up):
    """Sample ``i``'s loss computed here: its noisy latents from the captured draw (the DDPM
    formula in float64), its caption encoded, the U-Net with the LoRA's up weights times
    ``scale_up`` (0: the network removed, DOP's prior) for the prior/target, and with them times
    the sample's multiplier for the prediction."""
    c = run.parts
    k = captured["idx"].index(i)
    latents, d = captured["latents"][k:k + 1], captured["draw"]
    t = d.timesteps[k:k + 1]
    ac = c.losses.scheduler.alphas_cumprod.to(torch.float64)[t].view(-1, 1, 1, 1)
    noisy = (ac.sqrt() * latents.double() + (1 - ac).sqrt() * d.input_noise[k:k + 1].double()).float()
    tokens = c.family_model.tokenize([run.tset.caption(i, epoch)], pad=True)
    net = c.method.network
    ups = {n: p for n, p in net.named_parameters() if "lora_up" in n}
    saved = {n: p.detach().clone() for n, p in ups.items()}

    def unet(up_factor):
        with torch.no_grad():
            for n, p in ups.items():
                p.copy_(saved[n] * up_factor)
            net.set_multiplier(1.0)
            try:
                cond = c.family_model.encode(tokens, None)
                return c.family_model.unet_forward(noisy, t, cond).double()
            finally:
                for n, p in ups.items():
                    p.copy_(saved[n])

    m = run.tset.samples[i].network_multiplier
    pred = unet(1.0 if m is None else m)
    target = unet(0.0) if scale_up == 0 else d.noise[k:k + 1].double()
    return float(((pred - target) ** 2).mean())


def _close(got, want, delta=1e-5):
    """A mean squared error from float32 U-Net outputs (values ~1, run at another batch size
    than the reference: elementwise rounding differences rms <= delta) against its float64 hand
    value: |mse(a + e) - mse(a)| <= 2 rms(a) delta + delta^2, rms(a) = sqrt(mse). A DOP loss is
    small (prediction and prior nearly equal), so a relative bound would not do."""
    return abs(got - want) <= 2 * math.sqrt(want) * delta + delta**2


@pytest.fixture
def capture(monkeypatch):
    """The last per-sample loss call's latents, draw and losses; ``reaccelerate(run)`` gives a
    finished run an Accelerator again (run_script resets Accelerate's state after a run)."""
    from library.training import losses

    captured = {}
    real = losses.Losses.per_sample_loss

    def spy(self, pred, latents, d, mask=None, target=None):
        out = real(self, pred, latents, d, mask, target)
        captured.update(latents=latents.detach(), draw=d, loss=out.detach().double())
        return out

    monkeypatch.setattr(losses.Losses, "per_sample_loss", spy)
    yield captured
    reset_accelerate()


def _reaccelerate(run):
    from library.accelerator import make_accelerator
    from tests.helpers import reaccelerate

    reaccelerate(run, make_accelerator("no"))


def test_mixed_subsets_equal_a_hand_computation_of_both_targets(tmp_path, train, capture):
    """One batch with a DOP sample and a plain one: the DOP sample's loss is against the U-Net
    without the network, the plain one's against the noise; the batch loss is their mean."""
    config = _dataset_toml(tmp_path, [["", DOP]])
    rc, o, err, run = train("train_lora", _args(tmp_path, config, "--max_train_steps", "2",
                                                "--network_train_unet_only", "--cache_latents"))
    assert rc == 0, err[-2000:]
    _reaccelerate(run)
    with torch.no_grad():  # a non-zero LoRA: two steps trained, plus a known offset
        for n, p in run.parts.method.network.named_parameters():
            if "lora_up" in n:
                p.add_(0.05 * torch.sign(torch.sin(torch.arange(p.numel(), dtype=torch.float32)))
                       .view_as(p))
    samples = run.tset.samples
    i_plain = next(i for i, s in enumerate(samples) if not s.dop)
    i_dop = next(i for i, s in enumerate(samples) if s.dop)
    capture["idx"] = [i_plain, i_dop]
    with torch.no_grad():
        total = float(run.micro_step_loss(9, [i_plain, i_dop], None, 2, 0))
    assert run.parts.method.network.multiplier == 1.0  # back at the batch's after the prior
    got = capture["loss"]
    want_plain = _hand_loss(run, i_plain, 9, capture, scale_up=1)
    want_dop = _hand_loss(run, i_dop, 9, capture, scale_up=0)
    noise_dop = _hand_loss(run, i_dop, 9, capture, scale_up=1)  # what DOP replaces
    assert _close(float(got[0]), want_plain) and _close(float(got[1]), want_dop)
    assert abs(want_dop - noise_dop) > 0.1 * noise_dop  # the two targets differ
    assert _close(total, (want_plain + want_dop) / 2)


def test_dataset_network_multiplier(tmp_path, train, capture):
    """Two datasets (multipliers 1 and -0.5) of the same bucket: every global batch holds one
    dataset's samples, each batch trains with the network at its dataset's multiplier (a hand
    computation with the up weights scaled), and the network is back at the run's after the step."""
    from library.data import step_plan

    config = _dataset_toml(tmp_path, [[""], [""]], ("network_multiplier = 1.0",
                                                     "network_multiplier = -0.5"))
    rc, o, err, run = train("train_lora", _args(tmp_path, config, "--max_train_steps", "2",
                                                "--train_batch_size", "2",
                                                "--network_train_unet_only", "--cache_latents"))
    assert rc == 0, err[-2000:]
    _reaccelerate(run)
    tset = run.tset
    mults = [s.network_multiplier for s in tset.samples]
    assert sorted(mults) == [-0.5, -0.5, 1.0, 1.0]
    for epoch in (1, 2, 3):  # 4 samples in one bucket: 2 batches of one multiplier each
        batches = step_plan.epoch_batches(tset.bucket_of, 5, epoch, 2)
        assert sorted(len({mults[i] for i in gb.indices}) for gb in batches) == [1, 1]
    assert run.plan.steps_per_epoch == 2
    with torch.no_grad():
        for n, p in run.parts.method.network.named_parameters():
            if "lora_up" in n:
                p.add_(0.05 * torch.sign(torch.cos(torch.arange(p.numel(), dtype=torch.float32)))
                       .view_as(p))
    i_neg = mults.index(-0.5)
    capture["idx"] = [i_neg]
    with torch.no_grad():
        run.micro_step_loss(9, [i_neg], None, 1, 0)
    net = run.parts.method.network
    assert net.multiplier == -0.5  # the dataset's, until the step's end
    run.parts.batch_loss.end_step()
    assert net.multiplier == 1.0  # the run's again
    got = float(capture["loss"][0])
    assert _close(got, _hand_loss(run, i_neg, 9, capture, 1))
    run.tset.samples[i_neg].network_multiplier = 1.0  # the same sample at 1 differs
    assert not math.isclose(_hand_loss(run, i_neg, 9, capture, 1), got, rel_tol=1e-3)


def test_network_keys_need_a_network_and_warmup_no_text_cache(tmp_path, run_script):
    for script, lines, extra, msg in (
            ("train_dreambooth", [DOP], [], "custom_attributes.diff_output_preservation (set for "),
            ("finetune", [""], [], "network_multiplier (set for "),
            ("train_lora", ["token_warmup_step = 4"], ["--cache_text_encoder_outputs",
                                                        "--network_train_unet_only"],
             "token_warmup_step (set for ")):
        out = tmp_path / script
        extra_ds = ("network_multiplier = 0.5",) if script == "finetune" else ("",)
        config = _dataset_toml(out, [lines], extra_ds)
        rc, o, err = run_script(script, ["--config", config, "--pretrained_model_name_or_path",
                                         "tiny-sd15", "--output_dir", out / "o",
                                         "--max_train_steps", "1", "--dry_run", *extra])
        line = err.strip().splitlines()[-1]
        assert rc == 2 and msg in line, err[-1500:]


def test_split_of_the_global_batch_does_not_change_the_data(tmp_path, train):
    """1 process x batch 2 and 1 x batch 1 x accumulation 2 (the same global batch) with a DOP
    subset, wildcards, shuffle, token warmup and two dataset multipliers: the same captions per
    sample and step, the same weights (SGD; the bound and the 128 px size are those of
    tests/training/test_equivalence.py, whose float32 noise floor is 1e-5)."""
    from tests.conftest import rel_diff
    from tools.make_sample_dataset import make_sample_dataset

    folder = make_sample_dataset(str(tmp_path / "data"), n_images=2, size=128, repeats=1)
    for name in ("shape_00", "shape_01"):
        with open(f"{folder}/{name}.caption", "w", encoding="utf-8") as f:
            f.write(f"{name}, {{red|green}}, x, y, z\n{name} {{up|down}}, w\n")
    caps = ("enable_wildcard = true\nshuffle_caption = true\nkeep_tokens = 1\n"
            "token_warmup_step = 2\n")
    config = tmp_path / "run.toml"
    config.write_text("[general]\nresolution = 128\ncaption_extension = \".caption\"\n"
                      f"[[datasets]]\nnetwork_multiplier = 1.0\n"
                      f"[[datasets.subsets]]\nimage_dir = \"{folder}\"\n{caps}"
                      f"[[datasets.subsets]]\nimage_dir = \"{folder}\"\n{DOP}\nclass_tokens = \"shape\"\n"
                      f"[[datasets]]\nnetwork_multiplier = -0.5\n"
                      f"[[datasets.subsets]]\nimage_dir = \"{folder}\"\n{caps}")
    seen = {}

    from library.data.training_data import TrainingSet
    real = TrainingSet.caption

    def spy(self, i, epoch, step=None):
        cap = real(self, i, epoch, step)
        if step is not None:
            seen.setdefault(key, []).append((epoch, step, i, cap))
        return cap

    states = {}
    for key, extra in (("1x2", ["--train_batch_size", "2"]),
                       ("1x1x2", ["--train_batch_size", "1", "--gradient_accumulation_steps", "2"])):
        TrainingSet.caption = spy
        try:
            rc, o, err, run = train("train_lora", [
                "--config", config, "--pretrained_model_name_or_path", "tiny-sd15",
                "--output_dir", tmp_path / key, "--network_dim", "4", "--learning_rate", "1e-2",
                "--optimizer_type", "SGDNesterov", "--optimizer_args", "momentum=0.9",
                "--max_train_steps", "4", "--seed", "3", "--cache_latents", *extra])
        finally:
            TrainingSet.caption = real
        assert rc == 0, err[-2000:]
        states[key] = _lora_state(run)
    assert sorted(seen["1x2"]) == sorted(seen["1x1x2"]) and len(seen["1x2"]) == 8
    assert len({c for *_, c in seen["1x2"]}) > 3
    worst = max(rel_diff(states["1x1x2"][k], states["1x2"][k]) for k in states["1x2"])
    init = _initial_lora(3)
    moved = max(rel_diff(states["1x2"][k], init[k]) for k in init)
    print(f"split: worst {worst:.2e}, moved {moved:.2e}")
    assert worst < 3e-5 and moved > 1e-4, (worst, moved)  # it trained, alike
