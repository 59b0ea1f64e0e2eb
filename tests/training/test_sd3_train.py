"""SD3 full fine-tuning through the entry scripts on the built-in tiny-sd3 (64 px, 2 steps): the
first micro-step's loss against an independent float64 recomputation (a fresh copy of the
initial weights; the sample's generator draws its noise and then u; weighting_scheme uniform,
training_shift 1: timestep floor(1000 u), sigma = t / 1000; the MMDiT given 1000 sigma and the
context CLIP-L | CLIP-G penultimate states zero-padded to the context width, then the tiny T5's
last states of the caption padded to 256 tokens, unmasked; prediction x_t - sigma * output against
x0), and the saved single file reloading with the trained MMDiT, the untouched VAE and T5."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from library.run.run_state import HOOKS


def sd3_args(data, out, *extra):
    return ["--pretrained_model_name_or_path", "tiny-sd3", "--train_data_dir", data,
            "--output_dir", out, "--resolution", "64", "--max_train_steps", "2",
            "--learning_rate", "1e-3", "--cache_latents", "--seed", "7", *extra]


def _reference_loss(run, epoch, i, text_dropped=False, mask=None, pos=None):
    """``text_dropped``: every encoder dropped (clip_l / clip_g / t5_dropout_rate 1): the context
    and the pooled vector all zeros. ``mask``: the loss mask (masked loss). ``pos(mmdit)``: the
    position embedding (1, h*w, hidden) the MMDiT adds instead of its table's centre."""
    from library.data import step_plan
    from library.models.families.sd3 import sd3_builtins, sd3_text

    c = sd3_builtins.build_builtin("tiny-sd3")  # the initial weights (fixed seed), a fresh copy
    mmdit, vae = c["mmdit"].double().eval(), c["vae"].double()
    clip_l, clip_g, t5_model = c["clip_l"].double(), c["clip_g"].double(), c["t5xxl"].double()
    item = run.tset.samples[i]
    assert not run.tset.flip(i, epoch)
    rgb = np.asarray(Image.open(item.path).convert("RGB"), dtype=np.float64)
    pixels = torch.from_numpy(rgb / 127.5 - 1.0).permute(2, 0, 1)[None]
    with torch.no_grad():
        x0 = (vae.encode(pixels).latent_dist.mean - 0.0609) * 1.5305
        g = torch.Generator().manual_seed(step_plan.derive_seed("sample", 7, epoch, i))
        noise = torch.randn(tuple(x0.shape[1:]), generator=g)[None].double()
        u = float(torch.rand(1, generator=g))
        t = min(int(u * 1000), 999)
        sigma = t / 1000
        x_t = (1 - sigma) * x0 + sigma * noise
        toks = sd3_text.tokenize([run.tset.caption(i, epoch)], c["tokenizer_l"], c["tokenizer_g"])
        l_states = clip_l(toks.l_ids, output_hidden_states=True)
        g_states = clip_g(toks.g_ids, output_hidden_states=True)
        lg = torch.cat([l_states.hidden_states[-2], g_states.hidden_states[-2]], dim=-1)
        pooled = torch.cat([l_states.text_embeds, g_states.text_embeds], dim=-1)
        width = mmdit.config.context_dim
        t5_ids = c["tokenizer_t5"]([run.tset.caption(i, epoch)], max_length=256, padding="max_length",
                                   truncation=True, return_tensors="pt")["input_ids"]
        t5_states = t5_model(input_ids=t5_ids).last_hidden_state
        assert t5_states.shape == (1, 256, width)
        context = torch.cat([torch.nn.functional.pad(lg, (0, width - lg.shape[-1])), t5_states], dim=1)
        if text_dropped:
            context, pooled = torch.zeros_like(context), torch.zeros_like(pooled)
        if pos is not None:
            table = pos(mmdit)
            mmdit.cropped_pos_embed = lambda *a, **k: table
        out = mmdit(x_t, torch.tensor([float(t)], dtype=torch.float64), pooled, context)
    err = (x_t - sigma * out - x0) ** 2
    return float((err if mask is None else err * mask).mean())


def test_sd3_full_finetune_loss_and_saved_file(dataset, tmp_path, train):
    from library.models.families.sd3 import sd3_checkpoint

    losses = []

    def record(run, epoch, idx, loss):
        losses.append((epoch, list(idx), float(loss.detach())))
        return loss

    out = tmp_path / "out"
    with HOOKS.add(after_micro_step=record):
        rc, _, err, run = train("finetune", sd3_args(dataset, str(out)))
    assert rc == 0, err
    epoch, idx, loss = losses[0]
    assert loss == pytest.approx(_reference_loss(run, epoch, idx[0]), rel=1e-4, abs=1e-7)

    m = sd3_checkpoint.load_sd3(str(out / "last.safetensors"))
    trained = run.parts.bundle.unet.state_dict()
    for k, v in m.mmdit.state_dict().items():
        assert torch.equal(v, trained[k]), k
    from library.models.families.sd3 import sd3_builtins

    initial = sd3_builtins.build_builtin("tiny-sd3")
    for k, v in m.vae.state_dict().items():
        assert torch.equal(v, initial["vae"].state_dict()[k]), k
    assert "t5xxl" in m.in_source and m.t5xxl is None  # carried through: no T5 loader given here
    for k, v in initial["t5xxl"].state_dict().items():
        if k != "encoder.embed_tokens.weight":  # tied to shared.weight
            assert torch.equal(m.t5xxl_state_dict[k], v), k
    assert not torch.equal(initial["mmdit"].state_dict()["x_embedder.proj.weight"],
                           trained["x_embedder.proj.weight"])


@pytest.mark.parametrize("extra, message", [
    (["--t5xxl", "t5.safetensors"], "t5xxl: no such file"),
    (["--guidance_scale", "2.0"], "guidance_scale: not with the SD3 model"),
    (["--zero_terminal_snr"], "zero_terminal_snr: not with the SD3 model"),
    (["--vae", "vae.safetensors"], "vae: no such file: vae.safetensors (SD3's autoencoder file)"),
    (["--double_blocks_to_swap", "4"], "double_blocks_to_swap: not with the SD3 model tiny-sd3: sd-scripts' "
                                       "deprecated FLUX.1 block-swap name; give blocks_to_swap"),
])
def test_sd3_unsupported_options_fail_before_loading(dataset, tmp_path, run_script, extra, message):
    rc, _, err = run_script("finetune", sd3_args(dataset, str(tmp_path / "o"), *extra))
    assert rc != 0 and message in err and "Traceback" not in err


def test_sd3_batch_2_equals_batch_1_with_accumulation_2_and_resume_is_exact(dataset, tmp_path, train):
    """Batch 2 == batch 1 with gradient accumulation 2 (SGD); 4 steps in one run == 2 steps, a
    training state and a resumed run of the other 2, bit for bit (one thread)."""
    from safetensors.torch import load_file

    from library.models.families.sd3 import sd3_builtins

    def final(out, *extra):
        rc, _, err, run = train("finetune", sd3_args(dataset, str(tmp_path / out), "--optimizer_type",
                                                     "SGD", "--learning_rate", "0.5", *extra))
        assert rc == 0, err
        return {k: v.detach().clone() for k, v in run.parts.bundle.unet.state_dict().items()}

    a, b = final("bs2", "--train_batch_size", "2"), final("ga2", "--gradient_accumulation_steps", "2")
    initial = sd3_builtins.build_builtin("tiny-sd3")["mmdit"].state_dict()
    moved = 0
    for k in a:
        scale = float((a[k] - initial[k]).abs().max())
        moved += scale > 0
        assert float((a[k] - b[k]).abs().max()) <= 1e-5 * max(scale, 1e-3), k
    assert moved > len(a) // 2

    four = ["--max_train_steps", "4"]
    final("full", *four, "--save_every_n_steps", "2", "--save_state")
    final("resumed", *four, "--resume", str(tmp_path / "full" / "last-step00000002-state"))
    x = load_file(str(tmp_path / "full" / "last.safetensors"))
    y = load_file(str(tmp_path / "resumed" / "last.safetensors"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    mid = load_file(str(tmp_path / "full" / "last-step00000002.safetensors"))
    key = "model.diffusion_model.x_embedder.proj.weight"
    assert not torch.equal(mid[key], x[key])  # the resumed steps trained


def _hand_crop(epoch, i):
    """pos_emb_random_crop_rate 1: the window of tiny-sd3's 16 x 16 table (4 x 4 patches of the
    64 px latents) at the offset random.Random(derive_seed("pos-crop", seed, epoch, i)) draws
    after its rate draw: top, then left, each uniform in [0, 12]."""
    import random

    from library.data import step_plan

    def pos(mmdit):
        r = random.Random(step_plan.derive_seed("pos-crop", 7, epoch, i))
        assert r.random() < 1.0
        top, left = r.randrange(13), r.randrange(13)
        return mmdit.pos_embed[0].reshape(16, 16, -1)[top:top + 4, left:left + 4].reshape(1, 16, -1)
    return pos


def _hand_scaled(epoch, i):
    """enable_scaled_pos_embed at resolution 64: latent size 8, 4 patches, a table of int(1.5 x 4)
    = 6 patches at sd-scripts' positions i / 6 x scale - shift (scale 16 x 6 / 4, shift scale x
    (6 - 4) / 12): the centre 4 x 4 (rows and columns 1..4), sin | cos of the column's position
    then of the row's, frequencies 10000^(-k / 32) (width 128)."""
    def pos(mmdit):
        g, s, dim = 6, 4, mmdit.config.hidden_size
        scale = 16 * g / s
        p = torch.tensor([k / g * scale - scale * (g - s) / (2 * g) for k in range(g)], dtype=torch.float64)
        q = dim // 4
        omega = torch.tensor([10000.0 ** (-k / q) for k in range(q)], dtype=torch.float64)
        feats = torch.cat([torch.sin(p[:, None] * omega), torch.cos(p[:, None] * omega)], dim=1)  # (g, dim/2)
        table = torch.cat([feats[None, :, :].expand(g, g, -1), feats[:, None, :].expand(g, g, -1)], dim=-1)
        return table[1:5, 1:5].reshape(1, 16, dim)
    return pos


@pytest.mark.parametrize("extra, hand", [(["--pos_emb_random_crop_rate", "1"], _hand_crop),
                                         (["--enable_scaled_pos_embed"], _hand_scaled)])
def test_sd3_position_options_first_loss_against_hand_computation(dataset, tmp_path, train, extra, hand):
    """pos_emb_random_crop_rate / enable_scaled_pos_embed (sd-scripts' SD3.5 options): the first
    micro-step's loss is the float64 reference's with the hand-computed position embedding."""
    losses = []

    def record(run, epoch, idx, loss):
        losses.append((epoch, list(idx), float(loss.detach())))
        return loss

    with HOOKS.add(after_micro_step=record):
        rc, _, err, run = train("finetune", sd3_args(dataset, str(tmp_path / "o"), *extra,
                                                     "--max_train_steps", "1"))
    assert rc == 0, err
    epoch, idx, loss = losses[0]
    plain = _reference_loss(run, epoch, idx[0])
    want = _reference_loss(run, epoch, idx[0], pos=hand(epoch, idx[0]))
    assert abs(want - plain) > 1e-4 * plain  # the embedding changes the loss
    assert loss == pytest.approx(want, rel=1e-4, abs=1e-7)


def test_sd3_random_crop_resume_is_exact(dataset, tmp_path, train):
    """pos_emb_random_crop_rate 0.5: 4 steps in one run == 2 steps, a training state and a resumed
    run of the other 2, bit for bit (the crops are keyed to seed, epoch and sample)."""
    from safetensors.torch import load_file

    def final(out, *extra, rate="0.5"):
        rc, _, err, _ = train("finetune", sd3_args(dataset, str(tmp_path / out), "--optimizer_type", "SGD",
                                                   "--learning_rate", "0.5", "--max_train_steps", "4",
                                                   "--pos_emb_random_crop_rate", rate, *extra))
        assert rc == 0, err
        return load_file(str(tmp_path / out / "last.safetensors"))

    x = final("full", "--save_every_n_steps", "2", "--save_state")
    y = final("resumed", "--resume", str(tmp_path / "full" / "last-step00000002-state"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    z = final("centre", rate="0")
    assert not all(torch.equal(x[k], z[k]) for k in x)  # some sample took a random crop


def test_sd3_options_change_the_loss_or_the_encoding(dataset):
    """training_shift moves SD3's drawn timesteps (and the loss); apply_lg_attn_mask changes the
    CLIP states of a padded caption; neither is read by FLUX.1's loss."""
    from types import SimpleNamespace

    from library.config.parse import parse_args
    from library.models.flow_family import family_model_for, load_from_options
    from library.training.flow_loss import flow_options
    from library.training.flow_loss import FlowLosses

    def opts(*argv):
        return parse_args("finetune", sd3_args(dataset, "unused", *argv))

    def draw(o):
        losses = FlowLosses(o, flow_options(o, "sd3"))
        latents = torch.randn(4, 16, 8, 8, generator=torch.Generator().manual_seed(1))
        d = losses.draw(latents, [torch.Generator().manual_seed(10 + k) for k in range(4)])
        return d.timesteps

    t1, t3 = draw(opts()), draw(opts("--training_shift", "3.0"))
    assert bool((t3 >= t1).all()) and bool((t3 > t1).any())  # a shift above 1 moves toward noise
    bundle = load_from_options(SimpleNamespace(pretrained_model_name_or_path="tiny-sd3", clip_l=None,
                                               clip_g=None, t5xxl=None, ae=None, vae=None, allow_pickle=False))

    def states(o):
        fm = family_model_for(bundle, o)
        with torch.no_grad():
            return fm.encode(fm.tokenize(["a red square"]), None).hidden_states

    assert not torch.allclose(states(opts()), states(opts("--apply_lg_attn_mask")))


def _hand_conditioning(captions, length, lg_mask, t5_mask, drops=None):
    """SD3's (context, pooled) in float64 from the built-in components called directly: CLIP-L |
    CLIP-G penultimate states zero-padded to the context width, then T5's last states; pooled
    CLIP-L | CLIP-G. ``drops``: per caption (clip_l, clip_g, t5) booleans: that encoder's states
    and pooled part zeros."""
    from library.models.families.sd3 import sd3_builtins

    c = sd3_builtins.build_builtin("tiny-sd3")
    drops = drops or [(False, False, False)] * len(captions)

    def tok(tokenizer, n):
        return tokenizer(captions, max_length=n, padding="max_length", truncation=True, return_tensors="pt")

    def keep(x, which):  # zeros for the captions that drop encoder ``which``
        return torch.stack([torch.zeros_like(x[k]) if d[which] else x[k] for k, d in enumerate(drops)])

    with torch.no_grad():
        states, pooled = [], []
        for which, (enc, tk) in enumerate(((c["clip_l"], c["tokenizer_l"]), (c["clip_g"], c["tokenizer_g"]))):
            t = tok(tk, 77)
            out = enc.double()(input_ids=t["input_ids"], attention_mask=t["attention_mask"] if lg_mask else None,
                               output_hidden_states=True)
            states.append(keep(out.hidden_states[-2], which))
            pooled.append(keep(out.text_embeds, which))
        t = tok(c["tokenizer_t5"], length)
        t5_states = c["t5xxl"].double()(input_ids=t["input_ids"],
                                        attention_mask=t["attention_mask"] if t5_mask else None).last_hidden_state
    width = c["mmdit"].config.context_dim
    lg = torch.cat(states, dim=-1)
    context = torch.cat([torch.cat([lg, torch.zeros(len(captions), 77, width - lg.shape[-1], dtype=lg.dtype)],
                                   dim=-1), keep(t5_states, 2)], dim=1)
    return context, torch.cat(pooled, dim=-1)


@pytest.mark.parametrize("argv", [[], ["--apply_t5_attn_mask", "--t5xxl_max_token_length", "16"],
                                  ["--apply_lg_attn_mask"]])
def test_sd3_context_is_clip_padded_then_t5(dataset, argv):
    """The SD3 family model's conditioning against a hand computation from the built-in
    components in float64: context = [CLIP-L | CLIP-G penultimate states, zero-padded to the
    context width] then T5's last states (t5xxl_max_token_length tokens, default 256, as sd-scripts'
    SD3), the masks given to the encoders only with apply_lg_attn_mask / apply_t5_attn_mask;
    pooled = CLIP-L pooled | CLIP-G projected pooled."""
    from types import SimpleNamespace

    from library.config.parse import parse_args
    from library.models.flow_family import family_model_for, load_from_options

    opts = parse_args("finetune", sd3_args(dataset, "unused", *argv))
    bundle = load_from_options(SimpleNamespace(pretrained_model_name_or_path="tiny-sd3", clip_l=None,
                                               clip_g=None, t5xxl=None, ae=None, vae=None, allow_pickle=False))
    for enc in bundle.text_encoders:
        enc.double()
    fm = family_model_for(bundle, opts)
    captions = ["a red square", "a photo of sks dog in the style of blue painting"]
    with torch.no_grad():
        got = fm.encode(fm.tokenize(captions), None)

    length = 16 if "--t5xxl_max_token_length" in argv else 256
    want, want_pooled = _hand_conditioning(captions, length, "--apply_lg_attn_mask" in argv,
                                           "--apply_t5_attn_mask" in argv)
    width = bundle.unet.config.context_dim
    assert got.hidden_states.shape == (2, 77 + length, width)
    assert float((got.hidden_states - want).abs().max()) <= 1e-10
    assert float((got.pooled - want_pooled).abs().max()) <= 1e-10


def test_sd3_text_encoder_dropout_against_a_seeded_hand_computation(dataset):
    """clip_l / clip_g / t5_dropout_rate (sd-scripts' SD3 semantics): per sample, with
    random.Random(its seed), CLIP-L then CLIP-G then T5 is dropped when random() < its rate, a
    draw only for a rate above 0; a dropped encoder's states and pooled part are zeros. Checked
    against the float64 conditioning with those encoders zeroed by hand."""
    import random
    from types import SimpleNamespace

    from library.config.parse import parse_args
    from library.models.flow_family import family_model_for, load_from_options

    rates = (0.5, 0.0, 0.5)  # CLIP-G's 0: no draw, T5 takes the second one
    opts = parse_args("finetune", sd3_args(dataset, "unused", "--t5xxl_max_token_length", "8",
                                           "--clip_l_dropout_rate", "0.5", "--t5_dropout_rate", "0.5"))
    bundle = load_from_options(SimpleNamespace(pretrained_model_name_or_path="tiny-sd3", clip_l=None,
                                               clip_g=None, t5xxl=None, ae=None, vae=None, allow_pickle=False))
    for enc in bundle.text_encoders:
        enc.double()
    fm = family_model_for(bundle, opts)
    captions = ["a red square", "a blue circle", "sks dog", "a photo", "green", "the cat"]
    seeds = [1000 + k for k in range(len(captions))]
    with torch.no_grad():
        got = fm.drop_encoders(fm.encode(fm.tokenize(captions), None), seeds)
    drops = []
    for seed in seeds:
        r = random.Random(seed)
        dl = r.random() < rates[0]
        dt = r.random() < rates[2]
        drops.append((dl, False, dt))
    assert any(d[0] for d in drops) and any(d[2] for d in drops) and not all(d[0] and d[2] for d in drops)
    want, want_pooled = _hand_conditioning(captions, 8, False, False, drops)
    assert float((got.hidden_states - want).abs().max()) <= 1e-10
    assert float((got.pooled - want_pooled).abs().max()) <= 1e-10
    # the rate is a probability per sample: of 1000 samples about half drop CLIP-L, about half T5
    from library.models.family import TextConditioning

    ones = TextConditioning(torch.ones(1000, 77 + 8, 128), torch.ones(1000, 96))
    out = fm.drop_encoders(ones, list(range(1000)))
    l_dropped = (out.pooled[:, :32] == 0).all(dim=1)
    t5_dropped = (out.hidden_states[:, 77:] == 0).flatten(1).all(dim=1)
    assert 430 < int(l_dropped.sum()) < 570 and 430 < int(t5_dropped.sum()) < 570
    assert bool((out.pooled[:, 32:] == 1).all())  # CLIP-G's rate 0: never dropped
    assert bool(((out.hidden_states[:, :77, :32] == 0).flatten(1).all(dim=1) == l_dropped).all())


def test_sd3_every_encoder_dropped_trains_on_zero_text(dataset, tmp_path, train):
    """With all three dropout rates 1 the first micro-step's loss is the float64 reference's with
    a zero context and pooled vector; the dropout also applies to cached outputs."""
    losses = []

    def record(run, epoch, idx, loss):
        losses.append((epoch, list(idx), float(loss.detach())))
        return loss

    rates = ["--clip_l_dropout_rate", "1", "--clip_g_dropout_rate", "1", "--t5_dropout_rate", "1"]
    for extra in ([], ["--cache_text_encoder_outputs"]):
        losses.clear()
        with HOOKS.add(after_micro_step=record):
            rc, _, err, run = train("finetune", sd3_args(dataset, str(tmp_path / f"o{len(extra)}"), *rates,
                                                         *extra, "--max_train_steps", "1"))
        assert rc == 0, err
        epoch, idx, loss = losses[0]
        assert loss == pytest.approx(_reference_loss(run, epoch, idx[0], text_dropped=True), rel=1e-4, abs=1e-7)


def test_sd3_t5xxl_file_replaces_the_models_t5_and_a_wrong_width_is_one_line(tmp_path):
    """``t5xxl`` with an SD3 model: a T5 file (transformers layout, as sd-scripts' t5xxl files;
    this one carries its tiny tokenizer) replaces the model's own T5; a T5 whose width is not the
    MMDiT's context width is refused in one line naming the option."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from library.models import t5
    from library.models.flow_family import FlowFamilyError, load_from_options

    other, tok = t5.build_tiny_t5(128)
    with torch.no_grad():
        for p in other.parameters():  # not the built-in's T5 (the same seed): halved
            p.mul_(0.5)
    sd = {k: v.contiguous() for k, v in other.state_dict().items() if k != "encoder.embed_tokens.weight"}
    path = str(tmp_path / "t5xxl.safetensors")
    save_file(sd, path, metadata=t5.t5_file_metadata(other, tok))

    def load(p):
        return load_from_options(SimpleNamespace(pretrained_model_name_or_path="tiny-sd3", clip_l=None,
                                                 clip_g=None, t5xxl=p, ae=None, vae=None, allow_pickle=False))

    b = load(path)
    got = b.text_encoders[2].state_dict()
    assert all(torch.equal(got[k], v) for k, v in other.state_dict().items())
    assert b.tokenizers[2].get_vocab() == tok.get_vocab()

    narrow, tok32 = t5.build_tiny_t5(32)
    path32 = str(tmp_path / "t5_32.safetensors")
    save_file({k: v.contiguous() for k, v in narrow.state_dict().items() if k != "encoder.embed_tokens.weight"},
              path32, metadata=t5.t5_file_metadata(narrow, tok32))
    with pytest.raises(FlowFamilyError, match=r"^t5xxl: the T5 encoder is 32 wide; the SD3 model tiny-sd3 "
                                              r"reads 128-wide text tokens$"):
        load(path32)


@pytest.mark.parametrize("extra, message", [
    (["--t5_dropout_rate", "0.1"], "t5_dropout_rate: not with the FLUX.1 model tiny-flux: SD3's text-encoder dropout"),
    (["--train_text_encoder", "--train_t5xxl"], "train_t5xxl: not with the FLUX.1 model tiny-flux: SD3's "
                                                "sd3_train.py option"),
    (["--pos_emb_random_crop_rate", "0.5"], "pos_emb_random_crop_rate: not with the FLUX.1 model tiny-flux: "
                                            "SD3's position-embedding table"),
    (["--enable_scaled_pos_embed"], "enable_scaled_pos_embed: not with the FLUX.1 model tiny-flux"),
])
def test_sd3_text_options_refused_for_flux_in_one_line(dataset, tmp_path, run_script, extra, message):
    args = sd3_args(dataset, str(tmp_path / "o"), *extra)
    args[args.index("tiny-sd3")] = "tiny-flux"
    rc, _, err = run_script("finetune", args)
    assert rc != 0 and message in err and "Traceback" not in err
