"""Textual inversion (train_textual_inversion.py) and pivotal tuning (train_lora.py pivotal_tokens)
end to end on the tiny models.

References, all independent of the trainer: diffusers' ``load_textual_inversion`` (the file's
vectors become the token's rows of a pipeline built from the base model) and ``load_lora_weights``;
the base model built again (every frozen weight and embedding row bit-identical); the init word's
rows read from the base matrix by its token ids; A1111's bundle_emb key rule (written out below
from extensions-builtin/Lora/networks.py).
"""
import os
import shutil

import pytest
import torch

from tests.conftest import diffusers_load_problems, diffusers_pipeline, read

ARCH_NAME = {"sd15": "tiny-sd15", "sd2": "tiny-sd2", "sdxl": "tiny-sdxl"}


def ti_args(model, data, out, *extra):
    # caption_prefix puts the token into every caption ("mytok sks shape")
    return ["--pretrained_model_name_or_path", model, "--train_data_dir", data, "--output_dir", out,
            "--resolution", "64", "--cache_latents", "--token_string", "mytok", "--init_word", "shape",
            "--learning_rate", "1e-2", "--caption_prefix", "mytok", *extra]


def _encoders(pipe):
    pairs = [(pipe.tokenizer, pipe.text_encoder)]
    if getattr(pipe, "text_encoder_2", None) is not None:
        pairs.append((pipe.tokenizer_2, pipe.text_encoder_2))
    return pairs


def _load_in_diffusers(arch, path, token):
    """A pipeline of the base model with the embedding file loaded by diffusers; returns it and
    the (n, width) rows its text encoder(s) now hold for the token (diffusers' multi-vector names
    token, token_1, ...)."""
    from library.models.families.sd_common.tiny_models import build_tiny_components

    pipe = diffusers_pipeline(arch, build_tiny_components(arch))
    sd, _ = read(path)
    if arch == "sdxl":  # diffusers loads an SDXL embedding per encoder (its documented way)
        pipe.load_textual_inversion(sd["clip_l"], token=token, text_encoder=pipe.text_encoder,
                                    tokenizer=pipe.tokenizer)
        pipe.load_textual_inversion(sd["clip_g"], token=token, text_encoder=pipe.text_encoder_2,
                                    tokenizer=pipe.tokenizer_2)
    else:
        pipe.load_textual_inversion(path, token=token)
    rows = []
    for tok, te in _encoders(pipe):
        n = next(len(v) for v in sd.values())
        names = [token] + [f"{token}_{i}" for i in range(1, n)]
        ids = tok.convert_tokens_to_ids(names)
        rows.append(te.get_input_embeddings().weight.detach()[ids])
    return pipe, rows


def _same_module(a, b, skip=()):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) - set(skip) == set(sb), set(sa) ^ set(sb)
    for k, v in sb.items():
        assert sa[k].equal(v), k


def _check_frozen(run, arch):
    """Everything but the new rows is bit-identical to a fresh build of the base model."""
    from library.models.families.sd_common.tiny_models import build_tiny_components

    base = build_tiny_components(arch)
    b = run.parts.bundle
    _same_module(b.unet, base["unet"])
    if not next(b.vae.parameters()).is_meta:  # freed after caching on a CPU-only machine
        _same_module(b.vae, base["vae"])
    names = ["text_encoder"] + (["text_encoder_2"] if arch == "sdxl" else [])
    for te, name in zip(b.text_encoders, names):
        new = [k for k in te.state_dict() if k.endswith("token_embedding.new")]
        assert len(new) == 1
        _same_module(te, base[name], skip=new)
    return base


def test_sd15_embedding_loads_in_diffusers_frozen_parts_identical_loss_falls_resume_exact(
        dataset, tmp_path, train):
    from library.models.families.sd_common.tiny_models import build_tiny_components

    out = tmp_path / "out"
    rc, stdout, err, run = train("train_textual_inversion", ti_args(
        "tiny-sd15", dataset, out, "--max_train_steps", "4", "--num_vectors_per_token", "2",
        "--save_every_n_steps", "2", "--save_state"))
    assert rc == 0, err
    path = str(out / "last.safetensors")
    sd, md = read(path)
    assert set(sd) == {"emb_params"} and tuple(sd["emb_params"].shape) == (2, 32)
    assert md["modelspec.architecture"] == "stable-diffusion-v1/textual-inversion"
    assert md["ss_token_string"] == "mytok"
    assert os.path.isfile(out / "last-step00000002.safetensors")  # step names as for LoRA
    spec = run.parts.method.spec
    trained = run.parts.method.tokens.rows(0, spec).detach().clone()
    assert sd["emb_params"].equal(trained)
    # diffusers: the loaded pipeline's text encoder gives the trained rows exactly, and keeps
    # the base rows
    pipe, rows = _load_in_diffusers("sd15", path, "mytok")
    assert rows[0].equal(trained)
    base = _check_frozen(run, "sd15")
    base_w = base["text_encoder"].get_input_embeddings().weight
    assert pipe.text_encoder.get_input_embeddings().weight[:base_w.shape[0]].equal(base_w)
    # the init word's first two tokens (cut to num_vectors_per_token, as sd-scripts)
    init_ids = base["tokenizer"]("shape", add_special_tokens=False).input_ids[:2]
    init = base_w.detach()[init_ids]
    assert not trained.equal(init)
    # the loss falls on the tiny overfit: the training samples' draws (noise, timestep) scored
    # with the initial and the trained rows (the U-Net is nearly blind to the text on the tiny
    # model, so the per-step log is noise; these draws are the same for both)
    emb = run.parts.method.tokens.modules[0]

    def training_loss(rows):
        with torch.no_grad():
            emb.new.copy_(rows)
            return sum(float(run.micro_step_loss(epoch, [i], None, 1))
                       for epoch in (1,) for i in range(4))

    from library import accelerator as distributed
    from tests.conftest import reset_accelerate
    from tests.helpers import reaccelerate

    reaccelerate(run, distributed.accelerator_for(run.opts))  # the test runner reset the last one
    try:
        with_init, with_trained = training_loss(init), training_loss(trained)
    finally:
        reset_accelerate()
    emb.new.data.copy_(trained)
    assert with_trained < with_init * (1 - 1e-4), (with_init, with_trained)
    # resume from the step-2 state: the same final embedding, bit for bit
    first = read(path)[0]
    rc, _, err, _ = train("train_textual_inversion", ti_args(
        "tiny-sd15", dataset, out, "--max_train_steps", "4", "--num_vectors_per_token", "2",
        "--save_every_n_steps", "2", "--save_state", "--resume",
        str(out / "last-step00000002-state")))
    assert rc == 0, err
    assert read(path)[0]["emb_params"].equal(first["emb_params"])


@pytest.mark.parametrize("arch", ["sd2", "sdxl"])
def test_embedding_file_of_sd2_and_sdxl_loads_in_diffusers_with_its_ema(arch, dataset, tmp_path, train):
    out = tmp_path / "out"
    rc, _, err, run = train("train_textual_inversion", ti_args(
        ARCH_NAME[arch], dataset, out, "--max_train_steps", "2", "--save_every_n_steps", "1",
        "--ema_decay", "0.5"))
    assert rc == 0, err
    path = str(out / "last.safetensors")
    sd, _ = read(path)
    widths = {"sd2": {"emb_params": 64}, "sdxl": {"clip_l": 32, "clip_g": 64}}[arch]
    assert {k: tuple(v.shape) for k, v in sd.items()} == {k: (1, w) for k, w in widths.items()}
    _, rows = _load_in_diffusers(arch, path, "mytok")
    for k, got in enumerate(rows):
        assert got.equal(run.parts.method.tokens.rows(k, run.parts.method.spec).detach())
    base = _check_frozen(run, arch)
    # the EMA file: 0.5 x (0.5 x initial + 0.5 x step 1) + 0.5 x step 2, the initial rows being
    # the init word's first token in each encoder's base matrix
    step1, _ = read(str(out / "last-step00000001.safetensors"))
    ema, _ = read(str(out / "last-ema.safetensors"))
    names = ["text_encoder"] + (["text_encoder_2"] if arch == "sdxl" else [])
    toks = ["tokenizer"] + (["tokenizer_2"] if arch == "sdxl" else [])
    for key, te, tok in zip(widths, names, toks):
        first = base[tok]("shape", add_special_tokens=False).input_ids[0]
        init = base[te].get_input_embeddings().weight.detach()[first:first + 1]
        expected = 0.5 * (0.5 * init + 0.5 * step1[key]) + 0.5 * sd[key]
        assert torch.allclose(ema[key], expected, rtol=0, atol=1e-6), key
        assert not ema[key].equal(sd[key])


def _a1111_bundled(sd):
    """A1111's reading of bundled embeddings (extensions-builtin/Lora/networks.py load_network):
    ``bundle_emb.<name>.<vec>``, where a ``string_to_param.<k>`` vec nests under string_to_param."""
    out = {}
    for key, w in sd.items():
        head, _, rest = key.partition(".")
        if head != "bundle_emb":
            continue
        name, vec = rest.split(".", 1)
        d = out.setdefault(name, {})
        if vec.split(".")[0] == "string_to_param":
            d["string_to_param"] = {vec.split(".", 1)[1]: w}
        else:
            d[vec] = w
    return out


def test_pivotal_tuning_bundles_embeddings_a1111_layout_and_loads_in_diffusers(dataset, tmp_path, train):
    from library.models.families.sd_common.tiny_models import build_tiny_components

    out = tmp_path / "out"
    rc, _, err, run = train("train_lora", [
        "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
        "--output_dir", out, "--resolution", "64", "--cache_latents", "--max_train_steps", "2",
        "--learning_rate", "1e-3", "--network_dim", "4", "--caption_prefix", "toka tokb",
        "--pivotal_tokens", "toka", "tokb", "--pivotal_init_words", "shape", "sks",
        "--pivotal_num_vectors", "2", "1", "--pivotal_learning_rate", "1e-2",
        "--stop_pivotal_training", "1", "--save_every_n_steps", "1"])
    assert rc == 0, err
    sd, md = read(str(out / "last.safetensors"))
    bundled = _a1111_bundled(sd)
    assert set(bundled) == {"toka", "tokb"}
    assert {k for k in sd if k.startswith("bundle_emb.")} == {
        "bundle_emb.toka.string_to_param.*", "bundle_emb.tokb.string_to_param.*"}
    for token, n in (("toka", 2), ("tokb", 1)):
        sep, _ = read(str(out / f"last_{token}.safetensors"))
        vec = bundled[token]["string_to_param"]["*"]
        assert tuple(vec.shape) == (n, 32)
        assert vec.equal(sep["emb_params"])  # the separate file holds the same vectors
        # frozen after step 1: the step-1 files hold the final vectors already
        step1, _ = read(str(out / f"last-step00000001_{token}.safetensors"))
        assert step1["emb_params"].equal(vec)
        _, rows = _load_in_diffusers("sd15", str(out / f"last_{token}.safetensors"), token)
        assert rows[0].equal(vec)
    # the network kept training after the embeddings froze
    lora1, _ = read(str(out / "last-step00000001.safetensors"))
    ups = [k for k in sd if k.endswith("lora_up.weight")]
    assert any(not sd[k].equal(lora1[k]) for k in ups)
    assert '"toka"' in md["ss_pivotal_tokens"]
    # diffusers loads the LoRA part with every key consumed
    lora_part = {k: v for k, v in sd.items() if not k.startswith("bundle_emb.")}
    pipe = diffusers_pipeline("sd15", build_tiny_components("sd15"))
    assert diffusers_load_problems(pipe, lora_part) == []


# -- options: before any weight loads ------------------------------------------------------------
def test_options_that_do_not_apply_are_rejected_by_name(tmp_path):
    from library.config.parse import ConfigError, parse_args
    from library.config.options import OPTIONS

    base = ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", str(tmp_path),
            "--resolution", "64", "--max_train_steps", "1", "--token_string", "mytok"]
    rejected = [o for o in OPTIONS if "train_textual_inversion" not in o.scripts]
    for name in ("network_dim", "cache_text_encoder_outputs", "text_encoder_lr", "train_text_encoder",
                 "fp8_base", "deepspeed", "pivotal_tokens", "unet_lr", "fsdp", "no_token_padding"):
        assert name in [o.name for o in rejected], name
    for o in rejected:
        toml = tmp_path / "run.toml"
        toml.write_text(f"{o.name} = {'true' if o.type == 'bool' else '1'}\n")
        with pytest.raises(ConfigError, match=rf"option {o.name} is not accepted by train_textual_inversion"):
            parse_args("train_textual_inversion", [*base, "--config", str(toml)])


@pytest.mark.parametrize("script,extra,message", [
    ("train_textual_inversion", [], "token_string is required"),
    ("train_textual_inversion", ["--token_string", "zzq"], "token_string 'zzq' is in no training caption"),
    ("train_textual_inversion", ["--token_string", "sks", "--use_object_template",
                                 "--use_style_template"], "exclude each other"),
    ("train_textual_inversion", ["--token_string", "a.b", "--use_object_template"], "letters, digits"),
    ("train_lora", ["--pivotal_init_words", "shape"], "pivotal_init_words needs pivotal_tokens"),
    ("train_lora", ["--pivotal_tokens", "toka", "tokb", "--pivotal_num_vectors", "1", "2", "3"],
     "pivotal_num_vectors: 3 values for 2 pivotal_tokens"),
    ("train_lora", ["--pivotal_tokens", "toka", "--cache_text_encoder_outputs",
                    "--network_train_unet_only"], "cache_text_encoder_outputs cannot be combined with pivotal_tokens"),
    ("train_lora", ["--pivotal_tokens", "toka", "--deepspeed"], "deepspeed cannot be combined with pivotal_tokens"),
])
def test_bad_settings_are_one_line_errors_before_loading(script, extra, message, dataset, run_script,
                                                         no_weight_loading):
    rc, _, err = run_script(script, ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir",
                                     dataset, "--resolution", "64", "--max_train_steps", "1",
                                     "--dry_run", *extra])
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and message in lines[0], err


def test_multi_vector_token_is_one_tag_for_shuffling():
    """The N-vector expansion happens at tokenization, after caption shuffling and tag dropout:
    a whole word only (mytok1 and xmytok stay), each occurrence."""
    from library.models.families.sd_common.embeddings import TokenSpec, prompt_rewriter

    rw = prompt_rewriter([TokenSpec("mytok", None, 3)])
    assert rw("a mytok, mytok1 xmytok (mytok:1.2)") == \
        "a mytok mytok1 mytok2, mytok1 xmytok (mytok mytok1 mytok2:1.2)"
    assert prompt_rewriter([TokenSpec("mytok", None, 1)]) is None


def test_weights_file_starts_the_rows_and_templates_replace_the_captions(dataset, tmp_path, train):
    """`weights`: the token's rows start from the file (learning rate 1e-30: AdamW's update and
    decay are below float32's resolution of the rows, so the saved rows are the file's); `use_object_template` / `use_style_template`:
    every caption is one of sd-scripts' templates (a few written out here) with the token."""
    from safetensors.torch import save_file

    from library.config.parse import parse_args
    from library.training.plan import plan_run

    start = torch.randn(2, 32, generator=torch.Generator().manual_seed(7))
    src = tmp_path / "start.safetensors"
    save_file({"emb_params": start}, str(src))
    out = tmp_path / "out"
    args = ti_args("tiny-sd15", dataset, out, "--max_train_steps", "1",
                   "--num_vectors_per_token", "2", "--weights", src)
    args[args.index("--learning_rate") + 1] = "1e-30"
    rc, _, err, _ = train("train_textual_inversion", args)
    assert rc == 0, err
    assert read(str(out / "last.safetensors"))[0]["emb_params"].equal(start)

    base = ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
            "--resolution", "64", "--token_string", "mytok", "--init_word", "shape", "--dry_run",
            "--max_train_steps", "4"]
    some = {"--use_object_template": {"a photo of a mytok", "a rendering of a mytok",
                                      "a photo of the weird mytok"},
            "--use_style_template": {"a painting in the style of mytok",
                                     "a picture in the style of mytok"}}
    for flag, known in some.items():
        _, tset, _ = plan_run(parse_args("train_textual_inversion", base + [flag]), 1)
        seen = {tset.caption(i, e) for e in range(1, 40) for i in range(len(tset.train_items))}
        assert all("mytok" in c and "sks" not in c for c in seen), seen
        assert known & seen and len(seen) > 3, seen


def test_pivotal_tuning_on_sdxl_resumes_bit_identically(dataset, tmp_path, train):
    """Pivotal tuning on SDXL: the bundle holds the token's clip_l / clip_g vectors (A1111's
    layout), the LoRA part loads in diffusers' SDXL pipeline, and a resume from the step-2 state
    (the embeddings still training then: stop_pivotal_training 3) ends in the uninterrupted run's file, bit for
    bit: LoRA and embedding rows."""
    from library.models.families.sd_common.tiny_models import build_tiny_components

    def args(out, *extra):
        return ["--pretrained_model_name_or_path", "tiny-sdxl", "--train_data_dir", dataset,
                "--output_dir", out, "--resolution", "64", "--cache_latents",
                "--max_train_steps", "4", "--learning_rate", "1e-3", "--network_dim", "4",
                "--caption_prefix", "toka", "--pivotal_tokens", "toka", "--pivotal_init_words",
                "shape", "--pivotal_num_vectors", "2", "--pivotal_learning_rate", "1e-2",
                "--stop_pivotal_training", "3", "--save_every_n_steps", "2", "--save_state", *extra]

    whole, part = tmp_path / "whole", tmp_path / "part"
    rc, _, err, _ = train("train_lora", args(whole))
    assert rc == 0, err
    sd, _ = read(str(whole / "last.safetensors"))
    assert {k for k in sd if k.startswith("bundle_emb.")} == {"bundle_emb.toka.clip_l",
                                                               "bundle_emb.toka.clip_g"}
    assert tuple(sd["bundle_emb.toka.clip_l"].shape)[0] == 2
    start, _ = read(str(whole / "last-step00000002.safetensors"))
    assert not start["bundle_emb.toka.clip_g"].equal(sd["bundle_emb.toka.clip_g"])  # step 3 trained it
    shutil.copytree(whole / "last-step00000002-state", part / "last-step00000002-state")
    rc, _, err, _ = train("train_lora", args(part, "--resume", part / "last-step00000002-state"))
    assert rc == 0, err
    resumed, _ = read(str(part / "last.safetensors"))
    assert set(resumed) == set(sd)
    assert all(resumed[k].equal(sd[k]) for k in sd)
    lora_part = {k: v for k, v in sd.items() if not k.startswith("bundle_emb.")}
    pipe = diffusers_pipeline("sdxl", build_tiny_components("sdxl"))
    assert diffusers_load_problems(pipe, lora_part) == []
