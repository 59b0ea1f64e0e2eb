"""EMA of the trained weights (``ema_decay``): the saved ``<output_name>-ema`` files equal the decay
formula applied over the run (computed here from the weights recorded after every step), for the
full method and for LoRA; the EMA continues bit-identically across a resume."""
import os

import pytest
import torch
from tests.conftest import read

from library.training import ema as ema_mod


@pytest.fixture
def recorder(monkeypatch):
    """Records the initial weights and the weights after every optimizer step (float32 copies)."""
    rec = {"init": None, "steps": []}
    real_init, real_update = ema_mod.EMA.__init__, ema_mod.EMA.update

    def init(self, params, decay, device=None):
        real_init(self, params, decay, device)
        rec["init"] = [p.detach().float().clone() for p in self.params]
        rec["steps"].clear()

    def update(self):
        rec["steps"].append([p.detach().float().clone() for p in self.params])
        real_update(self)

    monkeypatch.setattr(ema_mod.EMA, "__init__", init)
    monkeypatch.setattr(ema_mod.EMA, "update", update)
    return rec


def expected_ema(rec, d):
    e = [t.clone() for t in rec["init"]]
    for ws in rec["steps"]:
        e = [d * a + (1 - d) * w for a, w in zip(e, ws)]
    return e


def close(a, b):
    return torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-7)


def args(model, data, out, *extra):
    return ["--pretrained_model_name_or_path", model, "--train_data_dir", data, "--output_dir", out,
            "--resolution", "64", "--max_train_steps", "3", "--cache_latents", *extra]


def test_lora_ema_file_is_the_decay_formula(dataset, tmp_path, train, recorder):
    from library.outputs.train_state import named_trainable

    out = tmp_path / "out"
    d = 0.6
    rc, _, err, run = train("train_lora", args("tiny-sd15", dataset, out, "--learning_rate", "1e-2",
                                               "--ema_decay", str(d), "--ema_device", "cpu"))
    assert rc == 0, err
    assert sorted(os.listdir(out)) == ["last-ema.safetensors", "last.safetensors"]
    assert len(recorder["steps"]) == 3
    exp = expected_ema(recorder, d)
    assert all(e.device.type == "cpu" for e in run.parts.ema.shadow)
    raw, _ = read(out / "last.safetensors")
    avg, md = read(out / "last-ema.safetensors")
    assert raw.keys() == avg.keys()
    assert md["sdtk.ema_decay"] == str(d)
    sd = run.parts.method.network.state_dict()
    name_of = {id(p): n for n, p in run.parts.method.network.named_parameters()}
    checked = 0
    for p, e, w_last in zip(run.parts.params, exp, recorder["steps"][-1]):
        key = name_of[id(p)]
        assert close(avg[key], e), key
        assert torch.equal(raw[key], w_last.to(raw[key].dtype)), key  # the raw file: the weights
        checked += 1
    assert checked == len(named_trainable(run.parts.method, run.parts.bundle)) > 0
    # EMA and raw weights differ (the average lags), and the in-memory model keeps the raw ones
    assert any(not torch.equal(avg[k], raw[k]) for k in raw)
    assert all(torch.equal(sd[k].cpu(), raw[k]) for k in raw)


def test_full_method_ema_single_file_and_diffusers(dataset, tmp_path, train, recorder):
    from library.models.loading import load_model_bundle

    d = 0.5
    for fmt in ("safetensors", "diffusers"):
        out = tmp_path / fmt
        rc, _, err, run = train("train_dreambooth", args(
            "tiny-sd15", dataset, out, "--learning_rate", "1e-3", "--ema_decay", str(d),
            "--save_model_as", fmt, "--max_train_steps", "2"))
        assert rc == 0, err
        name = "last-ema.safetensors" if fmt == "safetensors" else "last-ema"
        assert name in os.listdir(out)
        exp = expected_ema(recorder, d)
        loaded = load_model_bundle(str(out / name))
        ref = dict(loaded.unet.named_parameters())
        names = {id(p): n for n, p in run.parts.bundle.unet.named_parameters()}
        n = 0
        for p, e in zip(run.parts.params, exp):
            if id(p) in names:
                assert close(ref[names[id(p)]], e), names[id(p)]
                n += 1
        assert n == len(list(run.parts.bundle.unet.parameters()))
        # the EMA is not the trained model
        live = dict(run.parts.bundle.unet.named_parameters())
        assert any(not torch.equal(ref[k], live[k].detach()) for k in ref)


def test_ema_resume_is_bit_identical(dataset, tmp_path, train):
    common = ["--learning_rate", "1e-2", "--ema_decay", "0.7", "--network_dropout", "0.1"]
    rc, _, err, _ = train("train_lora", args("tiny-sd15", dataset, tmp_path / "full", *common))
    assert rc == 0, err
    part = tmp_path / "part"
    rc, _, err, _ = train("train_lora", args("tiny-sd15", dataset, part, *common,
                                             "--save_every_n_steps", "2", "--save_state"))
    assert rc == 0, err
    state = part / "last-step00000002-state"
    assert (state / "ema.safetensors").is_file()
    assert (part / "last-ema-step00000002.safetensors").is_file()  # periodic saves have one too
    rc, _, err, _ = train("train_lora", args("tiny-sd15", dataset, part, *common,
                                             "--resume", state))
    assert rc == 0, err
    for f in ("last.safetensors", "last-ema.safetensors"):
        a, _ = read(tmp_path / "full" / f)
        b, _ = read(part / f)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), f
    # a state without EMA cannot continue an EMA run (ema_decay must match)
    rc, _, err, _ = train("train_lora", args("tiny-sd15", dataset, part, "--learning_rate", "1e-2",
                                             "--network_dropout", "0.1", "--resume", state))
    assert rc == 2 and "ema_decay" in err


def test_finetune_ema_of_unet_and_text_encoder(dataset, tmp_path, train, recorder):
    """finetune.py with the text encoder trained for 1 of 3 steps: the EMA file holds the formula
    for the U-Net and the text encoder (whose average keeps moving towards its frozen weights)."""
    import json

    from library.models.loading import load_model_bundle

    folder = os.path.join(dataset, "2_sks shape")
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"shape_00": {"caption": "a circle"}, "shape_01": {"tags": "square"}}))
    d = 0.8
    out = tmp_path / "out"
    rc, _, err, run = train("finetune", [
        "--pretrained_model_name_or_path", "tiny-sd15", "--in_json", meta, "--train_data_dir", folder,
        "--output_dir", out, "--resolution", "64", "--max_train_steps", "3", "--cache_latents",
        "--learning_rate", "1e-3", "--train_text_encoder", "--stop_text_encoder_training", "1",
        "--ema_decay", str(d)])
    assert rc == 0, err
    assert len(recorder["steps"]) == 3
    exp = expected_ema(recorder, d)
    loaded = load_model_bundle(str(out / "last-ema.safetensors"))
    for name, live, saved in [("unet", run.parts.bundle.unet, loaded.unet),
                              ("te", run.parts.bundle.text_encoders[0], loaded.text_encoders[0])]:
        ref = dict(saved.named_parameters())
        names = {id(p): n for n, p in live.named_parameters()}
        hits = [(names[id(p)], e) for p, e in zip(run.parts.params, exp) if id(p) in names]
        assert len(hits) == len(ref), name
        for n, e in hits:
            assert close(ref[n], e), (name, n)
    # the text encoder did not change after step 1, its average did
    te_ids = {id(p) for p in run.parts.bundle.text_encoders[0].parameters()}
    k = next(i for i, p in enumerate(run.parts.params) if id(p) in te_ids
             and not torch.equal(recorder["steps"][0][i], recorder["init"][i]))
    assert torch.equal(recorder["steps"][0][k], recorder["steps"][2][k])
    assert not torch.equal(run.parts.ema.shadow[k], recorder["steps"][2][k])


def test_ema_files_follow_periodic_saves_and_rotation(dataset, tmp_path, train):
    out = tmp_path / "out"
    rc, _, err, _ = train("train_lora", args("tiny-sd15", dataset, out, "--learning_rate", "1e-2",
                                             "--ema_decay", "0.9", "--max_train_steps", "4",
                                             "--save_every_n_steps", "1", "--save_last_n_steps", "1"))
    assert rc == 0, err
    assert sorted(os.listdir(out)) == [
        "last-ema-step00000002.safetensors", "last-ema-step00000003.safetensors",
        "last-ema.safetensors", "last-step00000002.safetensors", "last-step00000003.safetensors",
        "last.safetensors"]
