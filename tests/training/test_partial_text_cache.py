"""Partial text-encoder caching for FLUX.1 and SD3 (sd-scripts' is_partial,
library/training/partial_text_cache.py): with cache_text_encoder_outputs while CLIP encoders
train and T5-XXL does not, the cache holds T5's part and the CLIP encoders run at every step.

Checked on the built-in tiny models (64 px, SGD, 2 steps, one thread): a partially cached run
trains the same weights as an uncached one (the cache's T5 states come from a batch-of-2 GEMM,
the step's from its own batch: last bits only, hence 1e-5 as the full cache's test), with the
options that act on the text (caption dropout for FLUX.1, SD3's per-encoder dropout); T5's
forward runs zero times per micro-step (once uncached) and the CLIP encoders once; the CLIP
encoders change; the disk entries hold T5's part alone and a second run loads them all, training
bit for bit the same weights; the key; and the refusals (T5 trained) in one line.
"""
from __future__ import annotations

import glob
import os

import pytest
import torch
from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

from library.run.run_state import HOOKS
from tests.conftest import read

COMMON = ["--resolution", "64", "--max_train_steps", "2", "--cache_latents", "--seed", "7",
          "--optimizer_type", "SGD", "--max_grad_norm", "0", "--train_batch_size", "2",
          "--t5xxl_max_token_length", "16", "--apply_t5_attn_mask"]
CASES = {
    # FLUX.1 LoRA on the transformer and CLIP-L, with caption dropout (the "" entry's T5 part)
    "flux-lora": ("train_lora", ["--pretrained_model_name_or_path", "tiny-flux", "--network_module",
                                 "networks.lora_flux", "--network_dim", "4", "--network_alpha", "4",
                                 "--learning_rate", "0.5", "--caption_dropout_rate", "0.8"]),
    # SD3 LoRA on the MMDiT, CLIP-L and CLIP-G, with SD3's per-encoder dropout
    "sd3-lora": ("train_lora", ["--pretrained_model_name_or_path", "tiny-sd3", "--network_module",
                                "networks.lora_sd3", "--network_dim", "4", "--network_alpha", "4",
                                "--learning_rate", "0.5", "--clip_l_dropout_rate", "0.5",
                                "--t5_dropout_rate", "0.5", "--apply_lg_attn_mask"]),
    # SD3 full fine-tune of the MMDiT, CLIP-L and CLIP-G (sd3_train.py's train_text_encoder)
    "sd3-finetune": ("finetune", ["--pretrained_model_name_or_path", "tiny-sd3", "--learning_rate", "1e-3",
                                  "--train_text_encoder", "--learning_rate_te1", "0.5",
                                  "--learning_rate_te2", "0.25"]),
}


def _weights(run, case):
    """What the run trains: the LoRA's tensors, or the MMDiT and both CLIP encoders."""
    if case.endswith("lora"):
        return {k: v.detach().clone() for k, v in run.parts.method.network.state_dict().items()}
    b = run.parts.bundle
    out = {}
    for name, module in (("mmdit", b.unet), ("clip_l", b.text_encoders[0]), ("clip_g", b.text_encoders[1])):
        out.update({f"{name}.{k}": v.detach().clone() for k, v in module.state_dict().items()})
    return out


class Calls:
    """Forward calls of T5 and of the CLIP encoders in each micro-step (class-level spies)."""

    def __init__(self, monkeypatch):
        self.now = {"t5": 0, "clip": 0}
        self.per_micro_step: list[dict] = []
        for cls, kind in ((T5EncoderModel, "t5"), (CLIPTextModel, "clip"), (CLIPTextModelWithProjection, "clip")):
            monkeypatch.setattr(cls, "forward", self._spy(cls.forward, kind))

    def _spy(self, real, kind):
        def forward(module, *args, **kwargs):
            self.now[kind] += 1
            return real(module, *args, **kwargs)
        return forward

    def hooks(self):
        def before(view, epoch, idx):
            self.now = {"t5": 0, "clip": 0}

        def after(view, epoch, idx, loss):
            self.per_micro_step.append(dict(self.now))
            return loss

        return HOOKS.add(before_micro_step=before, after_micro_step=after)


def _run(train, calls, case, data, out, *extra):
    script, args = CASES[case]
    calls.per_micro_step.clear()
    with calls.hooks():
        rc, stdout, err, run = train(script, [*args, "--train_data_dir", data, "--output_dir", out, *COMMON, *extra])
    assert rc == 0, err[-2000:]
    return run, stdout + err, list(calls.per_micro_step)


@pytest.mark.parametrize("case", list(CASES))
def test_partial_cache_trains_as_uncached_without_running_t5(case, dataset, tmp_path, train, monkeypatch):
    calls = Calls(monkeypatch)
    cache = str(tmp_path / "cache")
    disk = ["--cache_text_encoder_outputs_to_disk", "--cache_dir", cache]
    plain, _, plain_calls = _run(train, calls, case, dataset, str(tmp_path / "plain"))
    part, log, part_calls = _run(train, calls, case, dataset, str(tmp_path / "part"), *disk)

    assert plain.parts.caches.text is None
    assert part.parts.caches.text is not None and part.parts.caches.text_partial
    assert "the cache holds the frozen T5-XXL's outputs" in log
    # T5 left memory after caching (CPU: freed; nothing needs it later), as the dry run's
    # memory estimate says (the same rule: library/training/offload.py released_after_caching)
    assert next(part.parts.bundle.text_encoders[-1].parameters()).device.type == "meta"
    assert next(part.parts.bundle.text_encoders[0].parameters()).device.type == "cpu"
    t5_lines = _estimate_t5_lines(case, dataset, str(tmp_path / "dry"), *disk)
    assert t5_lines and all(not line.resident and "released" in line.note for line in t5_lines)
    clips = plain_calls[0]["clip"]  # CLIP-L; SD3: CLIP-L and CLIP-G (their inner modules counted too)
    assert clips > 0 and plain_calls == [{"t5": 1, "clip": clips}] * 2  # the spies see the uncached T5
    assert part_calls == [{"t5": 0, "clip": clips}] * 2  # T5 never runs; the CLIP encoders every step

    a, b = _weights(plain, case), _weights(part, case)
    assert a.keys() == b.keys()
    # measured 0 on this machine; other GEMM kernels may split a batch-of-2 (the cache's) and a
    # batch-of-1 row (the step's) differently: their last bits, as the full cache's test allows
    worst = max(float((a[k] - b[k]).norm()) / max(float(a[k].norm()), 1e-4) for k in a)
    assert worst <= 1e-5
    _dropout_acted(part, case)
    # the CLIP encoders trained: their LoRA up weights left zero, or their own weights changed
    if case.endswith("lora"):
        te = [k for k in b if k.startswith(("lora_te1_", "lora_te2_")) and k.endswith("lora_up.weight")]
        assert te and all(float(b[k].abs().max()) > 0 for k in te)
        assert not any(k.startswith("lora_te3_") for k in b)  # no T5 modules
    else:
        from library.models.families.sd3 import sd3_builtins

        initial = sd3_builtins.build_builtin("tiny-sd3")
        for name in ("clip_l", "clip_g"):
            start = initial[name].state_dict()
            assert sum(not torch.equal(b[f"{name}.{k}"], v) for k, v in start.items()) > len(start) // 2, name

    # the disk entries: T5's part alone (FLUX.1: 16 T5 states and the mask; SD3: the 16 T5 tokens
    # of the context, without CLIP's 77), for the two captions and the empty one
    files = sorted(glob.glob(os.path.join(cache, "te-*.safetensors")))
    assert len(files) == (3 if case == "flux-lora" else 2)
    for f in files:
        tensors, _ = read(f)
        if case.startswith("flux"):
            assert set(tensors) == {"hidden_states", "t5_attn_mask"} and tensors["hidden_states"].shape[0] == 16
        else:
            assert set(tensors) == {"hidden_states"} and tensors["hidden_states"].shape[0] == 16

    # a second run loads every entry and trains the same weights bit for bit
    again, log, again_calls = _run(train, calls, case, dataset, str(tmp_path / "again"), *disk)
    n = len(files)
    assert f"text-encoder cache (frozen encoders only): {n} caption(s), {n} loaded from disk, encoding 0" in log
    assert again_calls == part_calls
    c = _weights(again, case)
    assert all(torch.equal(b[k], c[k]) for k in b)


def _estimate_t5_lines(case, data, out, *extra):
    """The memory estimate's parameter lines of T5 for the case's options."""
    from library.config.options import METHOD_OF_SCRIPT
    from library.config.parse import parse_args
    from library.training import memory_estimate

    script, args = CASES[case]
    opts = parse_args(script, [*args, "--train_data_dir", data, "--output_dir", out, *COMMON, *extra, "--dry_run"])
    t5 = "text_encoder_2" if case.startswith("flux") else "text_encoder_3"
    return [line for line in memory_estimate.estimate(opts, METHOD_OF_SCRIPT[script]).params if line.component == t5]


def _dropout_acted(run, case):
    """The text dropout options of the case dropped some samples and kept others (epoch 0's
    draws, as library/data/training_data.py and SD3FamilyModel.drop_encoders make them)."""
    import random

    from library.data.step_plan import derive_seed

    n = len(run.tset.samples)
    if case == "flux-lora":
        dropped = [run.tset.cached_caption(i, 0) == "" for i in range(n)]
    elif case == "sd3-lora":  # CLIP-L's draw (rate 0.5); CLIP-G's rate is 0, T5's draw follows
        dropped = [random.Random(derive_seed("te-dropout", 7, 0, i)).random() < 0.5 for i in range(n)]
    else:
        return
    assert any(dropped) and not all(dropped)


def test_a_full_cache_is_not_a_partial_ones_entry(dataset, tmp_path, train, monkeypatch):
    """A full cache (network_train_unet_only: nothing trains) and a partial one over the same
    captions are different entries: neither run loads the other's."""
    calls = Calls(monkeypatch)
    disk = ["--cache_text_encoder_outputs_to_disk", "--cache_dir", str(tmp_path / "cache"),
            "--max_train_steps", "1"]
    _, log, full_calls = _run(train, calls, "flux-lora", dataset, str(tmp_path / "full"), *disk,
                              "--network_train_unet_only")
    assert "text-encoder cache: 3 caption(s), 0 loaded from disk, encoding 3" in log
    assert full_calls == [{"t5": 0, "clip": 0}]  # a full cache: no encoder runs in the step
    _, log, _ = _run(train, calls, "flux-lora", dataset, str(tmp_path / "part"), *disk)
    assert "text-encoder cache (frozen encoders only): 3 caption(s), 0 loaded from disk, encoding 3" in log


def test_the_partial_key_names_what_is_cached_and_not_the_trained_encoders(tmp_path):
    """A partial entry's key differs from a full one's; it changes with the t5xxl file, T5's
    dtype and the T5 options, and not with the trained encoders' files (clip_l, clip_g), their
    dtype or SD3's CLIP masks, which the full key follows; with a separate t5xxl file it does not
    follow the main model file either (T5 comes from that file alone)."""
    import time
    from types import SimpleNamespace

    from library.data import cache_stage
    from library.models.families.sd3.home import SD3FamilyModel

    files = {}
    for name in ("clip_l", "clip_g", "t5xxl"):
        files[name] = tmp_path / f"{name}.safetensors"
        files[name].write_bytes(b"one")

    def key(partial, lg_mask=False, t5_mask=False, t5_len=16, model="model", dtypes=("bf16", "bf16", "bf16"),
            t5xxl=True):
        fm = SD3FamilyModel.__new__(SD3FamilyModel)  # the family model's key parts, without weights
        fm.tokenizers, fm.t5_max_length = [None, None, None], t5_len
        fm.apply_lg_attn_mask, fm.apply_t5_attn_mask = lg_mask, t5_mask
        opts = SimpleNamespace(clip_l=str(files["clip_l"]), clip_g=str(files["clip_g"]),
                               t5xxl=str(files["t5xxl"]) if t5xxl else None, clip_skip=None,
                               max_token_length=None, weighted_captions=False)
        bundle = SimpleNamespace(identity=model, family="sd3", tokenizers=[])
        return cache_stage.text_identity(opts, bundle, fm, SimpleNamespace(text_encoders=dtypes), partial)

    full, part = key(False), key(True)
    assert part != full and key(True) == part
    assert key(True, lg_mask=True) == part and key(False, lg_mask=True) != full
    assert key(True, t5_mask=True) != part and key(True, t5_len=8) != part
    assert key(True, dtypes=("fp32", "fp32", "bf16")) == part and key(False, dtypes=("fp32", "fp32", "bf16")) != full
    assert key(True, dtypes=("bf16", "bf16", "fp8")) != part  # T5 in float8 (fp8_base)
    assert key(True, model="fine-tuned") == part and key(False, model="fine-tuned") != full
    assert key(True, t5xxl=False, model="fine-tuned") != key(True, t5xxl=False)  # T5 from the model file
    time.sleep(0.01)
    for name in ("clip_l", "clip_g"):  # a trained encoder's file rewritten
        files[name].write_bytes(b"other " + name.encode())
    assert key(True) == part and key(False) != full
    files["t5xxl"].write_bytes(b"another T5")
    assert key(True) != part


@pytest.mark.parametrize("script, extra, message", [
    ("train_lora", ["--pretrained_model_name_or_path", "tiny-flux", "--network_module", "networks.lora_flux",
                    "--network_args", "train_t5xxl=True"],
     "cache_text_encoder_outputs cannot be combined with network_args train_t5xxl: T5-XXL's outputs change"),
    ("train_lora", ["--pretrained_model_name_or_path", "tiny-sd3", "--network_module", "networks.lora_sd3",
                    "--network_args", "train_t5xxl=True"],
     "cache_text_encoder_outputs cannot be combined with network_args train_t5xxl: T5-XXL's outputs change"),
    ("finetune", ["--pretrained_model_name_or_path", "tiny-sd3", "--train_text_encoder", "--train_t5xxl"],
     "cache_text_encoder_outputs cannot be combined with train_t5xxl: T5-XXL's outputs change"),
    ("finetune", ["--pretrained_model_name_or_path", "tiny-sd3", "--train_text_encoder", "--train_t5xxl",
                  "--use_t5xxl_cache_only"],
     "use_t5xxl_cache_only cannot be combined with train_t5xxl: T5-XXL's outputs change"),
    ("finetune", ["--pretrained_model_name_or_path", "tiny-flux", "--use_t5xxl_cache_only"],
     "use_t5xxl_cache_only: not with the FLUX.1 model tiny-flux: SD3's sd3_train.py option"),
    ("train_lora", ["--pretrained_model_name_or_path", "tiny-sd15", "--network_module", "networks.lora"],
     "cache_text_encoder_outputs: the LoRA would train the text encoder too; add network_train_unet_only"),
])
def test_a_trained_t5_or_an_sd_text_encoder_refuses_the_cache_in_one_line(script, extra, message, dataset,
                                                                         tmp_path, run_script):
    rc, out, err = run_script(script, [*extra, "--train_data_dir", dataset, "--output_dir", str(tmp_path / "o"),
                                       "--resolution", "64", "--max_train_steps", "1",
                                       "--cache_text_encoder_outputs"])
    assert rc == 2
    lines = [line for line in (out + err).splitlines() if message.split(":")[0].split()[0] in line]
    assert len(lines) == 1 and message in lines[0], out + err
    assert "Traceback" not in out + err


def test_a_network_file_with_t5_modules_refuses_the_cache_at_set_up():
    """dim_from_weights reads the T5 modules from the file, known only once the network is
    built: the cache stage refuses a trained T5 then, in one line."""
    from types import SimpleNamespace

    from library.training import partial_text_cache

    clip, t5 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    net = SimpleNamespace(text_encoder_loras=[SimpleNamespace(org_module=clip), SimpleNamespace(org_module=t5)])
    method = SimpleNamespace(train_text_encoder=True, network=net)
    for m in (clip, t5):
        m.requires_grad_(False)
    fm = SimpleNamespace(family="flux", partial_cache_encoders=(1,))
    with pytest.raises(partial_text_cache.TextCacheError, match="^cache_text_encoder_outputs cannot be "
                                                              "combined with a trained T5-XXL"):
        partial_text_cache.is_partial(method, [clip, t5], fm)
    net.text_encoder_loras = net.text_encoder_loras[:1]  # CLIP-L's modules alone: partial
    assert partial_text_cache.is_partial(method, [clip, t5], fm)
    assert partial_text_cache.trained_text_encoders(method, [clip, t5]) == [True, False]
    method.train_text_encoder = False  # nothing trains: a full cache
    assert not partial_text_cache.is_partial(method, [clip, t5], fm)


def test_t5_leaves_memory_and_comes_back_for_samples_and_the_save(train, tmp_path):
    """After a partial cache T5 leaves memory (the CPU: freed, spilled for later uses; CUDA: to
    the CPU, as sd-scripts), and comes back for sample images and the full model's save: an SD3
    fine-tune with samples and validation writes the same file, samples and validation losses as
    with highvram (T5 kept), and the file holds T5 as built."""
    from library.models.families.sd3 import sd3_builtins, sd3_checkpoint
    from tools.make_sample_dataset import make_sample_dataset

    data = str(tmp_path / "data")
    make_sample_dataset(data, n_images=3, size=64, repeats=1)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square --d 5 --s 2 --w 64 --h 64\n")
    runs = {}
    for name, extra in (("released", []), ("kept", ["--highvram"])):
        script, args = CASES["sd3-finetune"]
        rc, out, err, run = train(script, [*args, "--train_data_dir", data, "--output_dir", str(tmp_path / name),
                                           *COMMON, "--train_batch_size", "1", "--cache_text_encoder_outputs",
                                           "--sample_prompts", str(prompts), "--sample_every_n_steps", "2",
                                           "--validation_split", "0.34", "--validate_every_n_steps", "2", *extra])
        assert rc == 0, err[-3000:]
        runs[name] = (out + err, run)
    log, r = runs["released"]
    assert r.parts.caches.text_partial
    assert "after caching: VAE (" in log and "T5-XXL (" in log and "freed (kept in a spill file" in log
    assert next(r.parts.bundle.text_encoders[2].parameters()).device.type == "meta"
    assert next(r.parts.bundle.text_encoders[0].parameters()).device.type == "cpu"  # CLIP-L trains
    klog, k = runs["kept"]
    assert "after caching" not in klog and next(k.parts.bundle.text_encoders[2].parameters()).device.type == "cpu"
    a, _ = read(str(tmp_path / "released" / "last.safetensors"))
    b, _ = read(str(tmp_path / "kept" / "last.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    built = sd3_builtins.build_builtin("tiny-sd3")["t5xxl"].state_dict()
    for key, v in built.items():
        assert torch.equal(a[sd3_checkpoint.TE_PREFIX["t5xxl"] + key], v), key
    samples = sorted(os.listdir(tmp_path / "released" / "sample"))
    assert samples and samples == sorted(os.listdir(tmp_path / "kept" / "sample"))
    for f in samples:
        assert (tmp_path / "released" / "sample" / f).read_bytes() == (tmp_path / "kept" / "sample" / f).read_bytes()
    assert r.progress.val_log and r.progress.val_log == k.progress.val_log


def test_use_t5xxl_cache_only_implies_a_partial_cache_even_with_frozen_clip(dataset, tmp_path, train, monkeypatch):
    """sd-scripts' sd3_train.py use_t5xxl_cache_only: it turns the cache on, and the cache holds
    T5's outputs alone, also when CLIP-L / CLIP-G are frozen (they then run every step without
    gradients): the MMDiT trains as with a full cache."""
    calls = Calls(monkeypatch)
    mmdit_only = ["--pretrained_model_name_or_path", "tiny-sd3", "--learning_rate", "1e-3"]
    monkeypatch.setitem(CASES, "sd3-mmdit", ("finetune", mmdit_only))
    full, _, full_calls = _run(train, calls, "sd3-mmdit", dataset, str(tmp_path / "full"),
                               "--cache_text_encoder_outputs")
    only, log, only_calls = _run(train, calls, "sd3-mmdit", dataset, str(tmp_path / "only"),
                                 "--use_t5xxl_cache_only")
    assert not full.parts.caches.text_partial and full_calls == [{"t5": 0, "clip": 0}] * 2
    assert "use_t5xxl_cache_only is enabled, so cache_text_encoder_outputs is also enabled" in log
    assert "use_t5xxl_cache_only: the cache holds the frozen T5-XXL's outputs" in log
    assert only.parts.caches.text_partial and only_calls[0]["clip"] > 0
    assert only_calls == [{"t5": 0, "clip": only_calls[0]["clip"]}] * 2
    a, b = full.parts.bundle.unet.state_dict(), only.parts.bundle.unet.state_dict()
    for k in a:
        assert float((a[k] - b[k]).norm()) / max(float(a[k].norm()), 1e-4) <= 1e-5, k
    assert any(not torch.equal(a[k], v) for k, v in _initial_mmdit().items())  # trained


def _initial_mmdit():
    from library.models.families.sd3 import sd3_builtins

    return sd3_builtins.build_builtin("tiny-sd3")["mmdit"].state_dict()


@pytest.mark.parametrize("family, with_t5", [("flux", True), ("sd3", True), ("sd3", False)])
def test_the_joined_conditioning_is_encode_s_bit_for_bit(family, with_t5):
    """encode_with_frozen_part(tokens, encode_frozen_part(tokens)) is encode(tokens): the same
    operations on the same inputs (an SD3 model without T5: the 77 zero tokens cached), and the
    frozen part is what the MMDiT / transformer reads of T5."""
    from library.models.families.flux import tiny_flux
    from library.models.families.sd3 import sd3_builtins
    from library.models.families.flux.home import FluxFamilyModel
    from library.models.families.sd3.home import SD3FamilyModel

    if family == "flux":
        p = tiny_flux.build_tiny_flux("dev")
        fm = FluxFamilyModel(p["transformer"], [p["clip_l"], p["t5"]], [p["clip_tokenizer"], p["t5_tokenizer"]],
                             t5_max_length=16, guidance_scale=3.5, apply_t5_attn_mask=True)
    else:
        p = sd3_builtins.build_builtin("tiny-sd3")
        encs, toks = [p["clip_l"], p["clip_g"]], [p["tokenizer_l"], p["tokenizer_g"]]
        if with_t5:
            encs, toks = encs + [p["t5xxl"]], toks + [p["tokenizer_t5"]]
        fm = SD3FamilyModel(p["mmdit"], encs, toks, apply_lg_attn_mask=True, apply_t5_attn_mask=True,
                            t5_max_length=16)
    tokens = fm.tokenize(["a red square", "sks shape, blue"])
    with torch.no_grad():
        full = fm.encode(tokens, None)
        part = fm.encode_frozen_part(tokens)
        joined = fm.encode_with_frozen_part(tokens, part)
    assert part.pooled is None
    assert torch.equal(joined.hidden_states, full.hidden_states) and torch.equal(joined.pooled, full.pooled)
    if family == "flux":
        assert torch.equal(part.hidden_states, full.hidden_states) and torch.equal(joined.t5_attn_mask, full.t5_attn_mask)
    else:  # the context's tokens after CLIP's 77
        assert torch.equal(part.hidden_states, full.hidden_states[:, 77:])
        assert part.hidden_states.shape[1] == (16 if with_t5 else 77)
        assert with_t5 or not part.hidden_states.any()
