"""SD3 full fine-tuning with its text encoders (sd-scripts' sd3_train.py): train_text_encoder
trains CLIP-L and CLIP-G at learning_rate_te1 / learning_rate_te2, train_t5xxl T5-XXL at
learning_rate_te3 (each unset = learning_rate), on the built-in tiny-sd3 (64 px, SGD, no
clipping). Checked: the optimizer's groups and their rates, the first step's update of one weight
of each encoder == -lr x its gradient (taken from the first micro-step's loss by autograd, before
the trainer's backward), the saved single file holding the trained encoders, a 2 + 2 resume equal
to 4 steps bit for bit (one thread), and the refusals in one line."""
from __future__ import annotations

import pytest
import torch

from library.models.families import registry
from library.run.run_state import HOOKS

LRS = {"learning_rate": 1e-3, "clip_l": 0.5, "clip_g": 0.25, "t5xxl": 0.125}


def args(data, out, *extra, steps=1):
    return ["--pretrained_model_name_or_path", "tiny-sd3", "--train_data_dir", data, "--output_dir", out,
            "--resolution", "64", "--max_train_steps", str(steps), "--cache_latents", "--seed", "7",
            "--optimizer_type", "SGD", "--max_grad_norm", "0", "--learning_rate", str(LRS["learning_rate"]),
            "--train_text_encoder", "--train_t5xxl", "--learning_rate_te1", str(LRS["clip_l"]),
            "--learning_rate_te2", str(LRS["clip_g"]), "--learning_rate_te3", str(LRS["t5xxl"]), *extra]


# one weight per encoder that the loss reaches (CLIP: penultimate states and the pooled projection)
PROBES = {"clip_l": "text_model.encoder.layers.0.mlp.fc1.weight",
          "clip_g": "text_model.encoder.layers.0.self_attn.q_proj.weight",
          "t5xxl": "encoder.block.0.layer.0.SelfAttention.q.weight"}


def test_first_step_updates_each_encoder_at_its_rate_and_the_file_holds_them(dataset, tmp_path, train):
    from library.models.families.sd3 import sd3_builtins, sd3_checkpoint

    grads, before = {}, {}

    def record(view, epoch, idx, loss):
        if not grads:
            encs = dict(zip(("clip_l", "clip_g", "t5xxl"), view.parts.bundle.text_encoders))
            params = {n: dict(encs[n].named_parameters())[PROBES[n]] for n in PROBES}
            before.update({n: p.detach().clone() for n, p in params.items()})
            g = torch.autograd.grad(loss, list(params.values()), retain_graph=True)
            grads.update({n: v.detach().clone() for n, v in zip(params, g)})
        return loss

    out = tmp_path / "o"
    with HOOKS.add(after_micro_step=record):
        rc, _, err, run = train("finetune", args(dataset, str(out)))
    assert rc == 0, err
    b = run.parts.bundle
    initial = sd3_builtins.build_builtin("tiny-sd3")
    groups = run.parts.stepper.optimizer.param_groups
    assert [g["lr"] for g in groups] == [LRS["learning_rate"], LRS["clip_l"], LRS["clip_g"], LRS["t5xxl"]]
    for g, module in zip(groups, [b.unet, *b.text_encoders]):
        assert {id(p) for p in g["params"]} == {id(p) for p in module.parameters()}
    for i, name in enumerate(("clip_l", "clip_g", "t5xxl")):
        trained = dict(b.text_encoders[i].named_parameters())[PROBES[name]].detach()
        assert torch.equal(before[name], initial[name].state_dict()[PROBES[name]])
        g = grads[name]
        assert float(g.abs().max()) > 0, name  # the loss reaches the encoder
        expected = before[name] - LRS[name] * g
        scale = float((LRS[name] * g).abs().max())
        assert float((trained - expected).abs().max()) <= 1e-5 * scale + 1e-7, name

    m = sd3_checkpoint.load_sd3(str(out / "last.safetensors"), t5_loader=_t5_loader())
    for name, enc in (("clip_l", m.clip_l), ("clip_g", m.clip_g), ("t5xxl", m.t5xxl)):
        mine = dict(zip(("clip_l", "clip_g", "t5xxl"), b.text_encoders))[name].state_dict()
        saved = enc.state_dict()
        for k, v in mine.items():
            assert torch.equal(saved[k], v), (name, k)
        assert not torch.equal(saved[PROBES[name]], initial[name].state_dict()[PROBES[name]]), name


def _t5_loader():
    from library.models import t5

    return t5.model_from_state_dict


def test_without_train_t5xxl_t5_stays_frozen_in_eval_and_out_of_the_optimizer(dataset, tmp_path, train):
    """train_text_encoder alone: CLIP-L / CLIP-G train (unset rates = learning_rate), T5 is not in
    the optimizer, gets no gradient and stays in eval mode; the metadata lists the rates."""
    from safetensors import safe_open

    from library.models.families.sd3 import sd3_builtins

    out = tmp_path / "o"
    rc, _, err, run = train("finetune", ["--pretrained_model_name_or_path", "tiny-sd3", "--train_data_dir", dataset,
                                         "--output_dir", str(out), "--resolution", "64", "--max_train_steps", "1",
                                         "--cache_latents", "--learning_rate", "1e-3", "--train_text_encoder",
                                         "--learning_rate_te2", "0"])
    assert rc == 0, err
    clip_l, clip_g, t5_model = run.parts.bundle.text_encoders
    assert [g["lr"] for g in run.parts.stepper.optimizer.param_groups] == [1e-3, 1e-3]
    assert clip_l.training and not clip_g.training and not t5_model.training
    initial = sd3_builtins.build_builtin("tiny-sd3")
    for enc, name in ((clip_g, "clip_g"), (t5_model, "t5xxl")):
        assert all(torch.equal(v, initial[name].state_dict()[k]) for k, v in enc.state_dict().items()), name
    assert not torch.equal(clip_l.state_dict()[PROBES["clip_l"]], initial["clip_l"].state_dict()[PROBES["clip_l"]])
    with safe_open(str(out / "last.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_train_text_encoder"] == "True"


def test_resume_covers_the_text_encoders_bit_for_bit(dataset, tmp_path, train):
    """4 steps == 2 steps, a training state and 2 resumed, every tensor of the saved file
    (MMDiT, CLIP-L, CLIP-G, T5) equal (one thread: conftest's one_cpu_thread)."""
    from safetensors.torch import load_file

    def run(out, *extra):
        rc, _, err, _ = train("finetune", args(dataset, str(tmp_path / out), *extra, steps=4))
        assert rc == 0, err

    run("full", "--save_every_n_steps", "2", "--save_state")
    run("resumed", "--resume", str(tmp_path / "full" / "last-step00000002-state"))
    x = load_file(str(tmp_path / "full" / "last.safetensors"))
    y = load_file(str(tmp_path / "resumed" / "last.safetensors"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    mid = load_file(str(tmp_path / "full" / "last-step00000002.safetensors"))
    for prefix in ("text_encoders.clip_l.", "text_encoders.clip_g.", "text_encoders.t5xxl."):
        keys = [k for k in x if k.startswith(prefix)]
        assert keys and any(not torch.equal(mid[k], x[k]) for k in keys), prefix  # trained after the resume


@pytest.mark.parametrize("extra, message", [
    (["--train_t5xxl"], "train_t5xxl needs train_text_encoder"),
    # CLIP training with the cache caches T5 alone (tests/training/test_partial_text_cache.py)
    (["--train_text_encoder", "--train_t5xxl", "--cache_text_encoder_outputs"],
     "cache_text_encoder_outputs cannot be combined with train_t5xxl"),
])
def test_sd3_text_encoder_refusals_are_one_line(dataset, tmp_path, run_script, extra, message):
    rc, _, err = run_script("finetune", ["--pretrained_model_name_or_path", "tiny-sd3", "--train_data_dir", dataset,
                                         "--output_dir", str(tmp_path / "o"), "--resolution", "64", "--max_train_steps", "1",
                                         *extra])
    assert rc != 0 and message in err and "Traceback" not in err


@pytest.mark.parametrize("model, extra, message", [
    ("tiny-flux", ["--train_t5xxl"], "train_t5xxl: not with the FLUX.1 model tiny-flux"),
    ("tiny-flux", ["--learning_rate_te3", "1e-4"], "learning_rate_te3: not with the FLUX.1 model tiny-flux"),
    ("tiny-sdxl", ["--train_text_encoder", "--train_t5xxl"], "train_t5xxl: an option of SD3 models"),
    ("tiny-flux", ["--weighted_captions"], "weighted_captions: not with the FLUX.1 model tiny-flux: sd-scripts' "
                                            "FLUX.1 / SD3 text encodings have no prompt weighting"),
    ("tiny-sd3", ["--weighted_captions"], "weighted_captions: not with the SD3 model tiny-sd3: sd-scripts' "
                                           "FLUX.1 / SD3 text encodings have no prompt weighting"),
])
def test_options_other_families_refuse(dataset, tmp_path, run_script, model, extra, message):
    rc, _, err = run_script("finetune", ["--pretrained_model_name_or_path", model, "--train_data_dir", dataset,
                                         "--output_dir", str(tmp_path / "o"), "--resolution", "64", "--max_train_steps", "1",
                                         *extra])
    assert rc != 0 and message in err and "Traceback" not in err


def test_encoders_from_separate_files_are_written_into_the_saved_file(dataset, tmp_path, train):
    """A transformer-only SD3 file with sd-scripts' separate clip_l / clip_g / ae files (no T5):
    the trained CLIP-L and CLIP-G go into the saved single file (SAI's all-in-one names, as
    sd-scripts' save_sd3_model with the trained encoders), the VAE stays in its own file."""
    from safetensors.torch import save_file

    from library.models.families.sd3 import sd3, sd3_checkpoint, sd3_vae

    tiny = sd3_checkpoint.load_sd3("tiny-sd3")
    main = str(tmp_path / "mmdit.safetensors")
    only_mmdit = sd3_checkpoint.SD3Model(tiny.mmdit, tiny.clip_l, tiny.clip_g, tiny.vae, tiny.tokenizer_l,
                                         tiny.tokenizer_g, source="x", layout=sd3_checkpoint.LAYOUT_FILE,
                                         in_source=frozenset({"mmdit"}))
    sd3_checkpoint.save_sd3(only_mmdit, main)
    save_file({k: v for k, v in tiny.clip_l.state_dict().items() if "projection" not in k},
              str(tmp_path / "clip_l.safetensors"))
    save_file(tiny.clip_g.state_dict(), str(tmp_path / "clip_g.safetensors"))
    save_file(sd3_vae.to_original(tiny.vae, prefix=""), str(tmp_path / "ae.safetensors"))

    out = tmp_path / "o"
    rc, _, err, run = train("finetune", [
        "--pretrained_model_name_or_path", main, "--clip_l", str(tmp_path / "clip_l.safetensors"),
        "--clip_g", str(tmp_path / "clip_g.safetensors"), "--ae", str(tmp_path / "ae.safetensors"),
        "--train_data_dir", dataset, "--output_dir", str(out), "--resolution", "64", "--max_train_steps", "1",
        "--cache_latents", "--learning_rate", "1e-3", "--train_text_encoder"])
    assert rc == 0, err
    saved = sd3_checkpoint.load_sd3(str(out / "last.safetensors"), ae=str(tmp_path / "ae.safetensors"))
    assert saved.in_source == frozenset({"mmdit", "clip_l", "clip_g"})
    clip_l, clip_g = run.parts.bundle.text_encoders
    for mine, back in ((clip_l, saved.clip_l), (clip_g, saved.clip_g)):
        theirs = back.state_dict()
        assert all(torch.equal(theirs[k], v) for k, v in mine.state_dict().items())
    assert not torch.equal(clip_g.state_dict()[PROBES["clip_g"]], tiny.clip_g.state_dict()[PROBES["clip_g"]])
    assert not any(k.startswith("first_stage_model.") for k in _keys(str(out / "last.safetensors")))
    assert sd3.PREFIX + "x_embedder.proj.weight" in _keys(str(out / "last.safetensors"))


def _keys(path):
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return set(f.keys())


def test_a_diffusers_folder_is_saved_as_a_folder_with_the_trained_encoders(dataset, tmp_path, train):
    """An SD3 diffusers folder trains CLIP-L, CLIP-G and T5 and is saved as a folder: its
    text_encoder, text_encoder_2 and text_encoder_3 hold the trained weights. (The folder's
    tokenizers are read from tokenizer.json too: before, a folder written by transformers 5 got
    the released CLIP vocabulary, whose ids overflow a tiny model's embedding.)"""
    from library.models import t5
    from library.models.families.sd3 import sd3_checkpoint

    tiny = sd3_checkpoint.load_sd3("tiny-sd3", t5_loader=t5.model_from_state_dict)
    folder = str(tmp_path / "pipe")
    sd3_checkpoint.save_sd3(sd3_checkpoint.SD3Model(**{**tiny.__dict__, "layout": sd3_checkpoint.LAYOUT_DIFFUSERS}),
                            folder)
    out = tmp_path / "o"
    rc, _, err, run = train("finetune", ["--pretrained_model_name_or_path", folder, "--train_data_dir", dataset,
                                         "--output_dir", str(out), "--resolution", "64", "--max_train_steps", "1",
                                         "--cache_latents", "--learning_rate", "1e-3", "--train_text_encoder",
                                         "--train_t5xxl"])
    assert rc == 0, err
    back = sd3_checkpoint.load_sd3(str(out / "last"), t5_loader=t5.model_from_state_dict)
    assert back.layout == sd3_checkpoint.LAYOUT_DIFFUSERS
    # the folder's own tokenizers (transformers 5 writes tokenizer.json without vocab.json)
    assert back.tokenizer_l.get_vocab() == tiny.tokenizer_l.get_vocab()
    assert back.tokenizer_g.get_vocab() == tiny.tokenizer_g.get_vocab()
    for name, mine, theirs in zip(("clip_l", "clip_g", "t5xxl"), run.parts.bundle.text_encoders,
                                  (back.clip_l, back.clip_g, back.t5xxl)):
        saved = theirs.state_dict()
        assert all(torch.equal(saved[k], v) for k, v in mine.state_dict().items()), name
        assert not torch.equal(saved[PROBES[name]], getattr(tiny, name).state_dict()[PROBES[name]]), name


def test_learning_rate_te_is_not_read_as_in_sd3_train(dataset, tmp_path, train):
    """sd3_train.py never reads learning_rate_te (the GUI writes it): CLIP-L / CLIP-G train at
    learning_rate_te1 / te2, unset = learning_rate; here learning_rate_te 0 would have frozen them."""
    argv = ["--pretrained_model_name_or_path", "tiny-sd3", "--train_data_dir", dataset, "--output_dir",
            str(tmp_path / "o"), "--resolution", "64", "--max_train_steps", "1", "--cache_latents",
            "--optimizer_type", "SGD", "--learning_rate", "1e-3", "--train_text_encoder",
            "--learning_rate_te", "0", "--learning_rate_te2", "2e-3"]
    rc, _, err, run = train("finetune", argv)
    assert rc == 0, err
    assert "text_encoder_lr (learning_rate_te) has no effect with the sd3 model" in err
    assert [g["lr"] for g in run.parts.stepper.optimizer.param_groups] == [1e-3, 1e-3, 2e-3]
