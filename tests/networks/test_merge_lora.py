"""networks/merge_lora.py: a merged model computes what the model with the LoRA applied at run time
computes; the CLI writes single files and diffusers folders that load back."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from library.models.families.sd_common.tiny_models import build_tiny_components  # noqa: E402
from networks import lora  # noqa: E402
from networks.merge_lora import main, merge_lora_into  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tes(c):
    return [c["text_encoder"]] + ([c["text_encoder_2"]] if "text_encoder_2" in c else [])


def forward(c, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c["tokenizer"].vocab_size, (2, 77), generator=g)
    latents = torch.randn(2, 4, 8, 8, generator=g)
    with torch.no_grad():
        if "text_encoder_2" in c:
            h1 = c["text_encoder"](ids, output_hidden_states=True).hidden_states[-2]
            out2 = c["text_encoder_2"](ids, output_hidden_states=True)
            hidden = torch.cat([h1, out2.hidden_states[-2]], dim=-1)
            cond = {"text_embeds": out2.text_embeds,
                    "time_ids": torch.tensor([[64, 64, 0, 0, 64, 64]] * 2, dtype=torch.float32)}
            return c["unet"](latents, 500, encoder_hidden_states=hidden, added_cond_kwargs=cond).sample
        return c["unet"](latents, 500, encoder_hidden_states=c["text_encoder"](ids)[0]).sample


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def make_lora_file(arch, path, seed, dim=4, alpha=2.0, conv_dim="3", text_encoder=True):
    c = build_tiny_components(arch)
    torch.manual_seed(seed)  # lora_down's initialisation: the same file whatever ran before
    net = lora.create_network(1.0, dim, alpha, None, tes(c), c["unet"], conv_dim=conv_dim)
    net.apply_to(tes(c), c["unet"], apply_text_encoder=text_encoder)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.text_encoder_loras + net.unet_loras:
            m.lora_up.weight.copy_(torch.randn(m.lora_up.weight.shape, generator=g) * 0.2)
    net.save_weights(str(path), None, {})
    return str(path)


def runtime_output(arch, files_ratios):
    """The model with each LoRA hooked in at run time, multiplier = ratio."""
    c = build_tiny_components(arch)
    for path, ratio in files_ratios:
        net, sd = lora.create_network_from_weights(ratio, path, None, tes(c), c["unet"])
        net.load_state_dict(sd)
        net.apply_to(tes(c), c["unet"])
    return forward(c)


@pytest.mark.parametrize("arch", ["sd15", "sdxl"])
def test_merged_equals_runtime(arch, tmp_path):
    a = make_lora_file(arch, tmp_path / "a.safetensors", seed=1)
    b = make_lora_file(arch, tmp_path / "b.safetensors", seed=2, dim=2, alpha=1.0, conv_dim=None, text_encoder=False)
    files = [(a, 1.0), (b, -0.5)]
    expected = runtime_output(arch, files)

    c = build_tiny_components(arch)
    base = forward(c)
    for path, ratio in files:
        merge_lora_into(tes(c), c["unet"], lora.load_state_dict_file(path), ratio)
    merged = forward(c)
    assert rel(expected, base) > 1e-3  # the LoRAs really change the output
    assert rel(merged, expected) < 1e-4


def test_merge_rejects_a_file_for_another_model(tmp_path):
    f = make_lora_file("sdxl", tmp_path / "xl.safetensors", seed=1, conv_dim=None)
    c = build_tiny_components("sd15")
    with pytest.raises(lora.LoRAError, match="do not exist in this model"):
        merge_lora_into(tes(c), c["unet"], lora.load_state_dict_file(f), 1.0)


def test_cli_single_file_and_diffusers_folder(tmp_path):
    from library.models.loading import load_model_bundle

    a = make_lora_file("sd15", tmp_path / "a.safetensors", seed=3)
    expected = runtime_output("sd15", [(a, 0.8)])

    out_file = str(tmp_path / "merged.safetensors")
    assert main(["--sd_model", "tiny-sd15", "--models", a, "--ratios", "0.8", "--save_to", out_file]) == 0
    bundle = load_model_bundle(out_file)
    assert bundle.family == "sd1"
    assert rel(forward(bundle.components()), expected) < 1e-4

    out_dir = str(tmp_path / "merged_diffusers")
    assert main(["--sd_model", "tiny-sd15", "--models", a, "--ratios", "0.8", "--save_to", out_dir,
                 "--save_precision", "fp16"]) == 0
    from safetensors import safe_open
    with safe_open(os.path.join(out_dir, "unet", "diffusion_pytorch_model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}
    # fp16 storage: exactly the float32 merge (the single file above) rounded to fp16
    comps = load_model_bundle(out_dir).components()
    for key in ("unet", "text_encoder", "vae"):
        merged16, merged32 = comps[key].state_dict(), bundle.components()[key].state_dict()
        assert merged16.keys() == merged32.keys()
        for k, v in merged32.items():
            assert torch.equal(merged16[k], v.half() if v.is_floating_point() else v), (key, k)


def test_cli_errors_are_one_line(tmp_path, capsys):
    a = make_lora_file("sd15", tmp_path / "a.safetensors", seed=3, conv_dim=None)
    assert main(["--sd_model", "tiny-sdxl", "--models", a, "--save_to", str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and a in err and "\n" not in err
    assert main(["--sd_model", "tiny-sd15", "--models", str(tmp_path / "nope.safetensors"),
                 "--save_to", str(tmp_path / "o.safetensors")]) == 2
    assert "not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--sd_model", "tiny-sd15", "--models", a, "--ratios", "1", "2", "--save_to", "x.safetensors"])
    assert "--ratios" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o.safetensors")


def test_script_runs_from_a_plain_checkout():
    # `python networks/merge_lora.py --help` must work without installing the package.
    proc = subprocess.run([sys.executable, os.path.join(REPO, "networks", "merge_lora.py"), "--help"],
                          capture_output=True, text=True, cwd=str(REPO), timeout=60)
    assert proc.returncode == 0 and "--save_precision" in proc.stdout
