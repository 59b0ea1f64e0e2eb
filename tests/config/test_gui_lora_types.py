"""Every LoRA_type of the kohya_ss GUI's dropdown (lora_gui.py) for SD1/SD2/SDXL and FLUX.1 (Anima's
and Lumina's: tests/config/test_kohya_gui.py),
converted with the GUI's own mapping (tests/kohya_gui_configs.py), trains two steps on the tiny
model or stops with one line that says why; the file it writes has the kind's keys (docs/KOHYA_GUI.md, table
"LoRA types")."""
import os

import pytest
from safetensors import safe_open

from tests import kohya_gui_configs as gui

# type -> (tiny model, extra GUI fields, expected: a key part in the saved file, or the error line)
SD_TYPES = {
    "Standard": ("sd1", {}, ".lora_down.weight"),
    "Kohya LoCon": ("sd1", {}, ".lora_down.weight"),
    "Kohya LoHa": ("sdxl", {}, ".hada_w1_a"),
    "Kohya LoKr": ("sd1", {"factor": 4, "conv_dim": 4, "use_tucker": True}, ".lokr_w1"),
    "LoRA-FA": ("sd1", {}, ".lora_down.weight"),
    # the GUI's defaults (network_dim 8, conv_dim 1) stop sd-scripts' DyLoRA too
    "Kohya DyLoRA": ("sd1", {}, "error: network_args: conv_dim=1 for networks.dylora must equal network_dim=8"),
    "Kohya DyLoRA, conv_dim = network_dim": ("sd1", {"conv_dim": 8, "conv_alpha": 2, "unit": 2},
                                             ".lora_down.weight"),
    "LyCORIS/LoCon": ("sd1", {}, ".lora_down.weight"),
    "LyCORIS/LoHa": ("sd1", {}, ".hada_w1_a"),
    "LyCORIS/LoKr": ("sd1", {}, ".lokr_w1"),
    "LyCORIS/GLoRA": ("sd1", {}, ".a1.weight"),
    # the GUI's default conv_dim 1 stops LyCORIS' BOFT ("impossible to decompose ... with factor 1")
    "LyCORIS/BOFT": ("sd1", {"conv_dim": 4}, ".oft_blocks"),
    "LyCORIS/Diag-OFT": ("sd1", {}, ".oft_blocks"),
    "LyCORIS/DyLoRA": ("sd1", {}, ".lora_down.weight"),
    "LyCORIS/Native Fine-Tuning": ("sd1", {}, ".diff"),
    "LyCORIS/iA3": ("sd1", {}, "error: network_args algo=ia3 (kohya_ss GUI LoRA type LyCORIS/iA3)"),
}


# the types the GUI allows with its Flux1 checkbox (gui.FLUX_TYPES and the LyCORIS ones), on tiny-flux
FLUX_CASES = {
    "Flux1": ({}, ".lora_down.weight"),
    "Flux1 OFT": ({"network_dim": 4, "network_alpha": 1e-3}, ".oft_blocks.0"),
    "Flux1 OFT, enable_all_linear": ({"network_dim": 4, "network_alpha": 1e-3, "enable_all_linear": True},
                                     "single_blocks_1_linear1.oft_blocks.3"),
    "LyCORIS/LoKr": ({"factor": 4}, "double_blocks_0_img_attn_qkv.lokr_w1"),
}


# the Anima and Lumina types train in tests/config/test_kohya_gui.py (the LoRA tab's defaults with
# that model type: lora/GUI defaults anima, lora/GUI defaults lumina)
DIT_TYPES = {"Anima": "anima", "Lumina": "lumina"}


def test_every_dropdown_type_is_covered():
    from tests.config.test_kohya_gui import CASES

    assert {c.split(",")[0] for c in SD_TYPES} | set(gui.OTHER_FAMILY_TYPES) | set(gui.FLUX_TYPES) | \
        set(DIT_TYPES) == set(gui.LORA_TYPES)
    ids = {c.values[2]: c.values[1] for c in CASES}
    for t, fam in DIT_TYPES.items():
        assert ids[f"lora/GUI defaults {fam}"]["LoRA_type"] == t
    assert set(gui.FLUX_TYPES) <= {c.split(",")[0] for c in FLUX_CASES}
    assert "Kohya DyLoRA" in SD_TYPES and len(gui.LORA_TYPES) == 20


def _run(lora_type, fam, extra, tmp_path, dataset, run_script):
    preset = {"LoRA_type": lora_type, "sdxl": fam == "sdxl", "flux1_checkbox": fam == "flux", "mixed_precision": "no",
              "network_dim": 8, "network_alpha": 4, **extra}
    cfg = gui.gui_toml(preset, "lora", model=gui.tiny_model(fam), data_dir=dataset,
                       output_dir=str(tmp_path / "out"))
    cfg["xformers"] = False
    path = gui.write_toml(str(tmp_path / "config.toml"), cfg)
    return cfg, run_script("train_lora", ["--config", path])


@pytest.mark.parametrize("case", sorted(SD_TYPES))
def test_gui_lora_type_trains_two_steps_or_stops_with_one_line(case, tmp_path, dataset, run_script):
    fam, extra, expected = SD_TYPES[case]
    cfg, (rc, out, err) = _run(case.split(",")[0], fam, extra, tmp_path, dataset, run_script)
    if not expected.startswith("."):
        last = err.strip().splitlines()[-1]
        assert rc == 2 and last.startswith("error: ") and expected in last, err[-2000:]
        return
    assert rc == 0, err[-2000:]
    assert "done: steps 2" in out + err
    files = [f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors")]
    assert files
    with safe_open(str(tmp_path / "out" / files[0]), "pt") as f:
        keys = list(f.keys())
        meta = f.metadata()
    assert any(k.endswith(expected) for k in keys), sorted(keys)[:5]
    assert meta["ss_network_module"] == cfg["network_module"]


@pytest.mark.parametrize("case", sorted(FLUX_CASES))
def test_gui_flux_lora_type_trains_two_steps(case, tmp_path, dataset, run_script):
    """With the Flux1 checkbox: Flux1 (networks.lora_flux), Flux1 OFT (networks.oft_flux, sd-scripts'
    keys oft_unet_*.oft_blocks.<part>) and a LyCORIS type train two steps on tiny-flux."""
    extra, expected = FLUX_CASES[case]
    cfg, (rc, out, err) = _run(case.split(",")[0], "flux", extra, tmp_path, dataset, run_script)
    assert rc == 0, err[-2000:]
    assert "done: steps 2" in out + err
    files = [f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors")]
    with safe_open(str(tmp_path / "out" / files[0]), "pt") as f:
        keys = list(f.keys())
        meta = f.metadata()
    assert any(k.endswith(expected) for k in keys), sorted(keys)[:5]
    assert meta["ss_network_module"] == cfg["network_module"] and meta["ss_base_model_version"] == "flux1"
