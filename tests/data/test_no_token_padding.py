"""no_token_padding (train_dreambooth, SD1/SD2): unpadded training captions against the text
encoder run by hand, a 2-step run whose U-Net sees the short context, and the rejections."""
import pytest
import torch

from library.models import family


@pytest.fixture(scope="module")
def sd15():
    from library.models.loading import load_model_bundle

    return load_model_bundle("tiny-sd15")


def test_unpadded_conditioning_is_the_text_encoder_on_the_real_tokens(sd15):
    family_model = family.family_model_for(sd15)
    tok, te = sd15.tokenizers[0], sd15.text_encoders[0]
    caption = "a photo of sks shape"
    words = tok(caption, add_special_tokens=False).input_ids
    hand = torch.tensor([[tok.bos_token_id, *words, tok.eos_token_id]])
    ids = family_model.tokenize([caption], pad=False)
    assert torch.equal(ids[0], hand)  # BOS, the caption's tokens, EOS: no padding
    with torch.no_grad():
        cond = family_model.encode(ids, None).hidden_states
        assert cond.shape[:2] == (1, len(words) + 2)
        torch.testing.assert_close(cond, te(hand).last_hidden_state, rtol=0, atol=0)
        # clip_skip applies as usual: the 2nd last layer through the final layer norm
        out = te(hand, output_hidden_states=True)
        norm = getattr(te, "text_model", te).final_layer_norm
        torch.testing.assert_close(family_model.encode(ids, 2).hidden_states, norm(out.hidden_states[-2]))
        # CLIP's causal mask: the real tokens' states are those of the padded sequence; what
        # changes is that the U-Net no longer attends to the padding states
        padded = family_model.encode(family_model.tokenize([caption]), None).hidden_states
    assert padded.shape[1] == 77
    torch.testing.assert_close(padded[:, :len(words) + 2], cond, rtol=1e-5, atol=1e-5)
    with pytest.raises(family.FamilyError):
        family_model.tokenize([caption, "two captions"], pad=False)


def _args(dataset, tmp_path, *extra):
    return ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
            "--output_dir", tmp_path / "out", "--resolution", "64", "--max_train_steps", "2",
            "--learning_rate", "1e-3", "--cache_latents", *extra]


def test_train_dreambooth_two_steps_unet_sees_the_unpadded_context(train, dataset, tmp_path, monkeypatch):
    lengths = []
    real = family.SD1Model.unet_forward

    def spy(self, noisy, t, cond, size_cond=None, **kw):
        lengths.append(tuple(cond.hidden_states.shape[:2]))
        return real(self, noisy, t, cond, size_cond, **kw)

    monkeypatch.setattr(family.SD1Model, "unet_forward", spy)
    rc, _, err, run = train("train_dreambooth", _args(dataset, tmp_path, "--no_token_padding"))
    assert rc == 0, err[-3000:]
    assert run.progress.global_step == 2 and (tmp_path / "out" / "last.safetensors").is_file()
    tok = run.parts.bundle.tokenizers[0]
    captions = {run.tset.caption(i, 0) for i in range(len(run.tset.samples))}
    want = {len(tok(c).input_ids) for c in captions}
    assert lengths and all(b == 1 and n < 77 for b, n in lengths)
    assert {n for _, n in lengths} <= want


@pytest.mark.parametrize("extra, message", [
    (["--train_batch_size", "2"], "no_token_padding needs train_batch_size = 1"),
    (["--cache_text_encoder_outputs"], "no_token_padding cannot be combined with cache_text_encoder_outputs"),
    (["--max_token_length", "150"], "no_token_padding cannot be combined with max_token_length"),
    (["--weighted_captions"], "no_token_padding cannot be combined with weighted_captions"),
    (["--pretrained_model_name_or_path", "tiny-sdxl"], "no_token_padding is for SD1/SD2"),
])
def test_rejections_before_loading(run_script, dataset, tmp_path, no_weight_loading, extra, message):
    rc, _, err = run_script("train_dreambooth", _args(dataset, tmp_path, "--no_token_padding", *extra))
    assert rc == 2 and message in err, err[-2000:]
    assert len([ln for ln in err.splitlines() if ln.lower().startswith("error")]) == 1


def test_not_an_option_of_train_lora(run_script, dataset, tmp_path, no_weight_loading):
    rc, _, err = run_script("train_lora", _args(dataset, tmp_path, "--no_token_padding"))
    assert rc == 2 and "no_token_padding" in err, err[-2000:]
