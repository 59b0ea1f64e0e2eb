"""sd-scripts' training entry scripts by their names (the kohya_ss GUI runs `accelerate launch
<script> --config_file <toml>`): each one's --help runs, each trains one step on its family's tiny
model from the TOML the GUI writes (tests/kohya_gui_configs.py), the full scripts that take both
kinds of dataset pick DreamBooth or fine-tuning as sd-scripts does, and a model of another family
is refused in one line naming the script and the family."""
from __future__ import annotations

import os
import runpy
import subprocess
import sys

import pytest

from library.config.parse import fine_tuning_data
from library.models.families import registry
from tests import kohya_gui_configs as gui
from tests.conftest import reset_accelerate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# script -> (GUI tab, GUI fields that select the family, the tiny model)
CASES = {
    "train_network.py": ("lora", {}, "tiny-sd15"),
    "sdxl_train_network.py": ("lora", {"sdxl": True}, "tiny-sdxl"),
    "flux_train_network.py": ("lora", {"flux1_checkbox": True, "LoRA_type": "Flux1"}, "tiny-flux"),
    "sd3_train_network.py": ("lora", {"sd3_checkbox": True}, "tiny-sd3"),
    "lumina_train_network.py": ("lora", {"lumina_checkbox": True, "LoRA_type": "Lumina"}, "tiny-lumina"),
    "lumina_train.py": ("finetune", {"lumina_checkbox": True}, "tiny-lumina"),  # in_json: fine-tuning
    "anima_train_network.py": ("lora", {"anima_checkbox": True, "LoRA_type": "Anima"}, "tiny-anima"),
    "anima_train.py": ("dreambooth", {"anima_checkbox": True}, "tiny-anima"),
    "train_db.py": ("dreambooth", {}, "tiny-sd15"),
    "sdxl_train.py": ("dreambooth", {"sdxl": True}, "tiny-sdxl"),
    "flux_train.py": ("dreambooth", {"flux1_checkbox": True}, "tiny-flux"),
    "sd3_train.py": ("finetune", {"sd3_checkbox": True}, "tiny-sd3"),  # in_json: fine-tuning
    "fine_tune.py": ("finetune", {}, "tiny-sd15"),
    "train_textual_inversion.py": ("textual_inversion", {"token_string": "sks"}, "tiny-sd15"),
    "sdxl_train_textual_inversion.py": ("textual_inversion", {"sdxl": True, "token_string": "sks"}, "tiny-sdxl"),
}
# the scripts whose family is fixed, with a model of another family
MISMATCH = {"train_network.py": "tiny-sdxl", "sdxl_train_network.py": "tiny-sd15", "flux_train.py": "tiny-chroma",
            "sd3_train_network.py": "tiny-flux", "lumina_train_network.py": "tiny-sd3", "train_db.py": "tiny-lumina",
            "sdxl_train.py": "tiny-sd2", "fine_tune.py": "tiny-sdxl", "sdxl_train_textual_inversion.py": "tiny-sd15",
            "anima_train.py": "tiny-lumina"}


def _run_entry(script: str, argv: list[str], monkeypatch) -> int:
    reset_accelerate()
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    reset_accelerate()
    return e.value.code


def test_every_family_script_is_at_the_root():
    """Each script a family names (its ``sd_scripts``) is an entry at the repository root."""
    named = {s for f in registry.FAMILIES.values() for s in f.sd_scripts}
    assert set(CASES) - {"train_textual_inversion.py"} <= named
    for script in named:
        assert os.path.isfile(os.path.join(ROOT, script)), script


def test_help_of_every_script():
    for script in sorted(CASES):
        r = subprocess.run([sys.executable, os.path.join(ROOT, script), "--help"], capture_output=True,
                           text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
        assert r.returncode == 0 and "--pretrained_model_name_or_path" in r.stdout, (script, r.stderr[-500:])
        assert r.stdout.startswith(f"usage: {script} "), r.stdout[:200]


@pytest.mark.parametrize("script", sorted(CASES))
def test_one_step_from_the_gui_toml(script, tmp_path, dataset, monkeypatch):
    from tests.config.test_kohya_gui import _config

    tab, fields, model = CASES[script]
    path, cfg = _config(tab, fields, tmp_path, dataset)
    assert cfg["pretrained_model_name_or_path"] == gui.tiny_model(gui.family_of(fields)) == model
    cfg["max_train_steps"] = 1
    gui.write_toml(path, cfg)
    assert fine_tuning_data(["--config_file", path]) == (tab == "finetune")
    assert _run_entry(script, ["--config_file", path], monkeypatch) == 0
    saved = [f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors")]
    assert saved, os.listdir(tmp_path / "out")


@pytest.mark.parametrize("script", sorted(MISMATCH))
def test_a_model_of_another_family_is_refused(script, tmp_path, dataset, monkeypatch, capsys):
    model = MISMATCH[script]
    rc = _run_entry(script, ["--pretrained_model_name_or_path", model, "--train_data_dir", dataset,
                             "--output_dir", str(tmp_path / "o"), "--resolution", "64", "--max_train_steps", "1",
                             "--token_string", "sks"] if "inversion" in script else
                    ["--pretrained_model_name_or_path", model, "--train_data_dir", dataset,
                     "--output_dir", str(tmp_path / "o"), "--resolution", "64", "--max_train_steps", "1",
                     *(["--in_json", str(tmp_path / "meta.json")] if script == "fine_tune.py" else [])],
                    monkeypatch)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    fam = registry.get(MISMATCH_FAMILY[model]).title
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"error: {script} trains "), err
    assert f"is of the {fam} family" in lines[0] and not os.path.exists(tmp_path / "o"), err


MISMATCH_FAMILY = {"tiny-sdxl": "sdxl", "tiny-sd15": "sd1", "tiny-chroma": "chroma", "tiny-flux": "flux",
                   "tiny-sd3": "sd3", "tiny-lumina": "lumina", "tiny-sd2": "sd2"}


def test_full_scripts_pick_the_method_as_sd_scripts(tmp_path):
    """sdxl_train.py & co.: fine-tuning with in_json (flag or run file, also in a grouping table) or
    a dataset subset with metadata_file (inline or in dataset_config), else DreamBooth."""
    run = tmp_path / "run.toml"
    assert not fine_tuning_data([]) and fine_tuning_data(["--in_json=m.json"])
    run.write_text('[model]\nin_json = "m.json"\n')
    assert fine_tuning_data(["--config", str(tmp_path / "run")])  # .toml appended, as sd-scripts
    run.write_text('train_data_dir = "x"\n')
    assert not fine_tuning_data(["--config_file", str(run)])
    ds = tmp_path / "ds.toml"
    ds.write_text('[[datasets]]\n[[datasets.subsets]]\nimage_dir = "x"\nmetadata_file = "m.json"\n')
    assert fine_tuning_data(["--config_file", str(run), "--dataset_config", str(ds)])
    run.write_text(f'dataset_config = "{ds}"\n')
    assert fine_tuning_data(["--config_file", str(run)])
    ds.write_text('[[datasets]]\n[[datasets.subsets]]\nimage_dir = "x"\n')
    assert not fine_tuning_data(["--config_file", str(run)])
    assert not fine_tuning_data(["--config_file", str(tmp_path / "missing.toml")])


def test_a_single_file_family_is_read_from_its_tensor_names(tmp_path, dataset, monkeypatch, capsys):
    """An SD single file: the family from its tensor names alone (a file with the names and no real
    weights is refused as SDXL's, which only a check before loading can do), also as a .ckpt."""
    import torch
    from safetensors.torch import save_file

    from library.models import script_family

    names = {"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(1),
             "conditioner.embedders.1.model.ln_final.weight": torch.zeros(1)}
    sft, ckpt = str(tmp_path / "xl.safetensors"), str(tmp_path / "xl.ckpt")
    save_file(names, sft)
    torch.save({"state_dict": names}, ckpt)
    assert script_family.model_family(sft) == script_family.model_family(ckpt) == "sdxl"
    for path in (sft, ckpt):
        rc = _run_entry("train_network.py", ["--pretrained_model_name_or_path", path, "--train_data_dir", dataset,
                                             "--output_dir", str(tmp_path / "o"), "--resolution", "64",
                                             "--max_train_steps", "1"], monkeypatch)
        err = capsys.readouterr().err
        assert rc == 2 and f"the model {path} is of the SDXL family (train it with sdxl_train_network.py)" in err, err
