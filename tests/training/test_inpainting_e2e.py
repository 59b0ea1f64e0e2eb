"""train_inpainting end to end on the tiny inpainting models (9-channel U-Net input).

- The U-Net input of a training step is, written out by hand from the image files: the noisy
  latents, the sample's mask taken at every 8th pixel (nearest-neighbour downsampling, as
  diffusers' inpainting pipelines and sd-scripts) and the VAE latents (posterior mean x scaling
  factor) of the image with the masked pixels set to 0 in [-1, 1].
- Two steps of each method: LoRA (above), DreamBooth on the SDXL inpainting model, fine-tune of a
  4-channel model, whose first convolution is widened to 9 channels (the new ones zero at the
  start) and saved as an inpainting checkpoint that diffusers recognises as one; textual
  inversion on an inpainting model.
- The combinations that cannot work stop with one line.
"""
from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image

from library.models import family


def base(model, data, out, *extra):
    return ["--pretrained_model_name_or_path", model, "--train_data_dir", data, "--output_dir", out,
            "--resolution", "64", "--max_train_steps", "2", "--learning_rate", "1e-3",
            "--train_inpainting", *extra]


def test_unet_input_is_latents_mask_and_masked_image_latents(dataset, tmp_path, train, monkeypatch):
    seen = []  # (x, timesteps) of each U-Net call
    real = family.SD1Model.unet_forward

    def spy(self, x, t, cond, size_cond=None, **kw):
        seen.append(x.detach().clone())
        return real(self, x, t, cond, size_cond, **kw)

    monkeypatch.setattr(family.SD1Model, "unet_forward", spy)
    from library.data.training_data import TrainingSet

    drawn = []  # (sample, epoch) of each mask, in batch order
    real_mask = TrainingSet.inpaint_mask

    def mask_spy(self, i, epoch, h, w):
        drawn.append((i, epoch, self.samples[i].path))
        return real_mask(self, i, epoch, h, w)

    monkeypatch.setattr(TrainingSet, "inpaint_mask", mask_spy)
    out = tmp_path / "out"
    rc, _, err, run = train("train_lora", base("tiny-sd15-inpaint", dataset, out,
                                               "--train_batch_size", "2", "--network_dim", "4"))
    assert rc == 0, err
    assert os.path.isfile(out / "last.safetensors")
    assert len(seen) == 2 and seen[0].shape == (2, 9, 8, 8)
    vae = run.parts.bundle.vae
    tset = run.tset
    for b, (i, epoch, path) in enumerate(drawn[:2]):  # the first step's batch
        pixels = np.asarray(Image.open(path).convert("RGB"), dtype=np.float64) / 127.5 - 1.0
        mask = real_mask(tset, i, epoch, 64, 64).numpy().astype(np.float64)
        assert set(np.unique(mask)) <= {0.0, 1.0} and 0 < mask.mean() < 1
        masked = torch.from_numpy((pixels * (1.0 - mask[..., None])).transpose(2, 0, 1)).float()
        with torch.no_grad():
            want_latents = vae.encode(masked[None]).latent_dist.mode()[0] * vae.config.scaling_factor
        want_mask = torch.from_numpy(mask[::8, ::8]).float()
        x = seen[0][b]
        torch.testing.assert_close(x[4], want_mask, rtol=0, atol=0)
        torch.testing.assert_close(x[5:], want_latents, rtol=1e-5, atol=1e-5)
    # channels 0-3: the noisy latents of the unmasked images (not the masked ones)
    assert not torch.allclose(seen[0][:, :4], seen[0][:, 5:], atol=1e-3)


def test_two_steps_dreambooth_and_widened_finetune(dataset, tmp_path, train):
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type
    from safetensors.torch import load_file

    from library.models import inpainting

    out = tmp_path / "db"
    rc, _, err, run = train("train_dreambooth", base("tiny-sdxl-inpaint", dataset, out))
    assert rc == 0, err
    sd = load_file(str(out / "last.safetensors"))
    # diffusers tells SDXL by a key of the 10th layer of OpenCLIP-G, which the 4-layer tiny text
    # encoder lacks: of its kinds it names the inpainting one
    assert infer_diffusers_model_type(sd) == "inpainting"
    assert sd[inpainting.CONV_IN_KEY].shape[1] == 9

    out = tmp_path / "ft"
    rc, _, err, run = train("finetune", base("tiny-sd15", dataset, out))
    assert rc == 0, err
    sd = load_file(str(out / "last.safetensors"))
    assert infer_diffusers_model_type(sd) == "inpainting"
    w = sd[inpainting.CONV_IN_KEY]
    assert w.shape[1] == 9
    # the widened channels trained away from zero; the model is saved whole and loads back
    assert float(w[:, 4:].abs().max()) > 0
    assert inpainting.is_inpainting(run.parts.bundle.unet)

    # textual inversion on an inpainting model (sd-scripts' train_textual_inversion.py has it too)
    out = tmp_path / "ti"
    rc, _, err, run = train("train_textual_inversion", base("tiny-sd15-inpaint", dataset, out,
                                                            "--token_string", "sks", "--init_word", "shape"))
    assert rc == 0, err
    assert os.path.isfile(out / "last.safetensors")


def test_combinations_that_cannot_work_stop_with_one_line(dataset, tmp_path, run_script):
    cases = [
        (["--pretrained_model_name_or_path", "tiny-sd15-inpaint"], "train_lora", False,
         "is an inpainting model (its U-Net takes 9 input channels"),
        (["--pretrained_model_name_or_path", "tiny-sd15", "--train_inpainting"], "train_lora", False,
         "is not an inpainting model"),
        (["--pretrained_model_name_or_path", "tiny-sd15-inpaint", "--train_inpainting",
          "--cache_latents"], "train_lora", False, "train_inpainting cannot be combined with cache_latents"),
    ]
    for args, script, _, msg in cases:
        rc, _, err = run_script(script, ["--train_data_dir", dataset, "--output_dir", tmp_path / "x",
                                         "--resolution", "64", "--max_train_steps", "1", *args])
        assert rc == 2, err
        lines = [ln for ln in err.strip().splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and msg in lines[0], err


def test_masks_follow_the_sample_not_the_batch_split(dataset, tmp_path, train, monkeypatch):
    """1 process x batch 2 and 1 x batch 1 x accumulation 2: each sample gets the same mask and
    masked-image latents (keyed by seed, epoch, sample), whatever batch it is in."""
    from library.data.training_data import TrainingSet

    rows = {}
    current = []
    real_mask = TrainingSet.inpaint_mask
    real_fwd = family.SD1Model.unet_forward

    def mask_spy(self, i, epoch, h, w):
        current.append((i, epoch))
        return real_mask(self, i, epoch, h, w)

    def fwd_spy(self, x, t, cond, size_cond=None, **kw):
        for key, row in zip(current, x.detach()):
            rows.setdefault(run_name[0], {})[key] = row[4:].clone()
        current.clear()
        return real_fwd(self, x, t, cond, size_cond, **kw)

    monkeypatch.setattr(TrainingSet, "inpaint_mask", mask_spy)
    monkeypatch.setattr(family.SD1Model, "unet_forward", fwd_spy)
    run_name = ["b2"]
    rc, _, err, _ = train("train_lora", base("tiny-sd15-inpaint", dataset, tmp_path / "a",
                                             "--train_batch_size", "2", "--max_train_steps", "1"))
    assert rc == 0, err
    run_name[0] = "acc2"
    rc, _, err, _ = train("train_lora", base("tiny-sd15-inpaint", dataset, tmp_path / "b",
                                             "--gradient_accumulation_steps", "2",
                                             "--max_train_steps", "1"))
    assert rc == 0, err
    assert set(rows["b2"]) == set(rows["acc2"]) and len(rows["b2"]) == 2
    for key, row in rows["b2"].items():
        other = rows["acc2"][key]
        assert torch.equal(row[0], other[0])  # the mask channel, exactly
        torch.testing.assert_close(row[1:], other[1:], rtol=1e-5, atol=1e-5)  # VAE batch 2 vs 1


def test_dry_run_estimates_an_inpainting_model(dataset, tmp_path, run_script):
    rc, out, err = run_script("train_lora", base("tiny-sd15-inpaint", dataset, tmp_path / "d", "--dry_run"))
    assert rc == 0, err
    assert "total peak of the training loop" in out + err and "not available" not in out + err


def test_validation_loss_gives_each_held_out_image_its_mask(dataset, tmp_path, train, monkeypatch):
    import random

    from library.data import held_out, inpaint_masks
    from library.data.step_plan import derive_seed
    from library.training import validation

    seen = []
    real = family.SD1Model.unet_forward

    def spy(self, x, t, cond, size_cond=None, **kw):
        seen.append(x.detach().clone())
        return real(self, x, t, cond, size_cond, **kw)

    monkeypatch.setattr(family.SD1Model, "unet_forward", spy)
    rc, out, err, run = train("train_lora", base("tiny-sd15-inpaint", dataset, tmp_path / "v",
                                                 "--validation_split", "0.5", "--max_train_steps", "1",
                                                 "--validate_every_n_steps", "1", "--seed", "5"))
    assert rc == 0, err
    assert "validation loss" in out and len(run.progress.val_log) == 1
    (item,) = run.tset.val_items
    val = [x for x in seen if x.shape[0] == validation.TIMESTEPS]  # one image, its 4 timesteps
    assert len(val) == 1
    x = val[0]
    assert x.shape[1] == 9 and all(torch.equal(x[0, 4:], x[k, 4:]) for k in range(1, x.shape[0]))
    rng = random.Random(derive_seed("val-inpaint", 5, held_out.place_in_dataset(item)))
    mask = inpaint_masks.random_mask(64, 64, rng)
    assert torch.equal(x[0, 4], mask[::8, ::8])


def test_sample_images_of_an_inpainting_model(dataset, tmp_path, train):
    """sample_prompts: a prompt's --i image with a mask drawn from its seed (diffusers' inpainting
    pipeline), and without --i the whole image generated; a missing --i file stops before loading."""
    folder = os.path.join(dataset, "2_sks shape")
    src = os.path.join(folder, sorted(f for f in os.listdir(folder) if f.endswith(".png"))[0])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"a photo --w 64 --h 64 --s 2 --d 7 --i {src}\na cat --w 64 --h 64 --s 2 --d 8\n")
    out = tmp_path / "s"
    rc, _, err, _ = train("train_lora", base("tiny-sd15-inpaint", dataset, out, "--max_train_steps", "1",
                                             "--sample_prompts", prompts, "--sample_at_first"))
    assert rc == 0, err
    files = sorted(os.listdir(out / "sample"))
    assert files == ["last_000000_00_7.png", "last_000000_01_8.png"]
    assert all(Image.open(out / "sample" / f).size == (64, 64) for f in files)
    prompts.write_text("a photo --w 64 --h 64 --i missing.png\n")
    rc, _, err, _ = train("train_lora", base("tiny-sd15-inpaint", dataset, out, "--max_train_steps", "1",
                                             "--sample_prompts", prompts, "--sample_at_first"))
    assert rc == 2 and "--i missing.png: no such file" in err, err
