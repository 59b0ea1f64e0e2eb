"""The import of a kohya_ss GUI DreamBooth / fine-tune saved JSON (library/ui/gui_tabs.py through
library/ui/gui_import.py) writes the keys those tabs compute as the GUI writes them into its TOML.
The reference is the tests' own transcription of dreambooth_gui.py / finetune_gui.py
(tests/kohya_gui_configs.py ``gui_toml``); an imported config of each tab then trains two steps."""
from __future__ import annotations

import json
import os
import tomllib

import pytest

from tests import kohya_gui_configs as gui

from library.models.families import registry
from library.ui.gui_import import import_config

SCRIPT = {"dreambooth": "train_dreambooth", "finetune": "finetune"}
# the keys the tabs' own rules write (the reference's name -> ours)
TAB_KEYS = {"learning_rate_te": "text_encoder_lr", "learning_rate_te1": "learning_rate_te1",
            "learning_rate_te2": "learning_rate_te2", "train_text_encoder": "train_text_encoder",
            "stop_text_encoder_training": "stop_text_encoder_training", "in_json": "in_json",
            "dataset_repeats": "dataset_repeats", "train_data_dir": "train_data_dir",
            "enable_bucket": "enable_bucket", "vae": "vae", "max_train_steps": "max_train_steps",
            "cache_text_encoder_outputs": "cache_text_encoder_outputs", "no_half_vae": "no_half_vae",
            "cache_text_encoder_outputs_to_disk": "cache_text_encoder_outputs_to_disk",
            "fused_backward_pass": "fused_backward_pass",
            # keys one of the two tabs does not write (finetune_gui.py / dreambooth_gui.py)
            **{k: k for k in ("max_grad_norm", "lr_scheduler_num_cycles", "lr_scheduler_power", "prior_loss_weight",
                              "reg_data_dir", "no_token_padding", "block_lr")}}
PATHS = ("reg_data_dir", "logging_dir", "vae", "network_weights", "resume", "dataset_config",
         "log_tracker_config", "in_json", "wandb_api_key", *gui.FLOW_FILES, *gui.DIT_FILES)


def _saved(preset: dict, tab: str, data: str, out: str) -> dict:
    """The GUI's saved JSON for ``preset`` with the reference's test changes (paths, 2 steps)."""
    d = gui.normalize(preset, tab)
    d.update({k: "" for k in PATHS}, pretrained_model_name_or_path="tiny", output_dir=out,
             max_train_steps=2, max_train_epochs=0)
    if tab == "finetune":
        d.update(image_folder=data, train_dir=out)
        d.pop("train_data_dir", None)
    else:
        d["train_data_dir"] = data
    return d


def _compare(preset: dict, tab: str, tmp_path) -> list:
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir(exist_ok=True)
    ref = gui.gui_toml(preset, tab, model="tiny", data_dir=str(data), output_dir=str(out))
    text, notes = import_config(json.dumps(_saved(preset, tab, str(data), str(out))), SCRIPT[tab])
    cfg = tomllib.loads(text)
    want = {ours: ref.get(theirs) for theirs, ours in TAB_KEYS.items()}
    if gui.flow_family(preset):  # the GUI writes it, sd3_train.py / flux_train.py do not read it
        assert want["text_encoder_lr"] is not None
        want["text_encoder_lr"] = None
    if tab == "finetune" and not registry.get(gui.family_of(preset)).full_trains_text_encoders:
        want["train_text_encoder"] = None  # written by the GUI, not read by flux_train.py / lumina_train.py (a note)
    # (the tabs' filter drops every False; a false here is the option's default, unset)
    assert {ours: None if cfg.get(ours) is False else cfg.get(ours) for ours in TAB_KEYS.values()} == want, notes
    return notes


@pytest.mark.parametrize("tab", sorted(SCRIPT))
def test_every_shipped_preset_writes_the_tabs_keys_as_the_gui(tab, tmp_path):
    cases = [(n, p) for n, p in gui.presets(tab) if gui.family_of(p)]
    assert len(cases) >= 2
    for name, preset in cases:
        _compare(preset, tab, tmp_path)


# the tabs' rules, set off their defaults: (tab, fields)
RULES = {
    "sd1 rates": ("dreambooth", dict(learning_rate_te=3e-5, learning_rate_te1=1e-4, learning_rate_te2=2e-4)),
    "sd1 te rate 0": ("dreambooth", dict(learning_rate_te=0)),
    "sd1 stop te 20": ("dreambooth", dict(stop_text_encoder_training=20)),
    "sdxl te1 0": ("dreambooth", dict(sdxl=True, learning_rate_te1=0, learning_rate_te2=2e-5,
                                      train_text_encoder=False)),
    "sdxl rates 0": ("dreambooth", dict(sdxl=True, learning_rate_te1=0, learning_rate_te2=0, train_text_encoder=True)),
    "sdxl string rates": ("dreambooth", dict(sdxl=True, learning_rate_te1="1e-5", learning_rate_te2="")),
    "ft sd1": ("finetune", dict(learning_rate_te=2e-6, train_text_encoder=False, dataset_repeats="3",
                                max_grad_norm=0.5, lr_scheduler_num_cycles=3, prior_loss_weight=0.5,
                                no_token_padding=True)),
    "db off defaults": ("dreambooth", dict(max_grad_norm=0.5, lr_scheduler_num_cycles=3, prior_loss_weight=0.5,
                                           no_token_padding=True, dataset_repeats=5)),
    "ft sdxl caption json": ("finetune", dict(sdxl_checkbox=True, use_latent_files="No", learning_rate_te1=1e-6,
                                              caption_metadata_filename="caps.json", sdxl_no_half_vae=True)),
    "ft sd3": ("finetune", dict(sd3_checkbox=True, sd3_cache_text_encoder_outputs=True)),
    "ft anima": ("finetune", dict(anima_checkbox=True, anima_cache_text_encoder_outputs=True, vae="/sd/vae.safetensors")),
    "ft lumina": ("finetune", dict(lumina_checkbox=True, lumina_cache_text_encoder_outputs_to_disk=True,
                                   learning_rate_te=1e-5)),
    "ft defaults": ("finetune", {}),
}


@pytest.mark.parametrize("case", sorted(RULES))
def test_tab_rules_write_what_the_gui_writes(case, tmp_path):
    tab, fields = RULES[case]
    _compare(fields, tab, tmp_path)


def _import(fields: dict, script: str) -> tuple[dict, list]:
    text, notes = import_config(json.dumps(fields), script)
    return tomllib.loads(text), notes


def test_what_cannot_be_honoured_is_a_note():
    # -1: train_db.py leaves the text encoder untrained (the GUI writes -1, which our option refuses)
    cfg, notes = _import({"stop_text_encoder_training": -1, "learning_rate_te": 1e-5}, "train_dreambooth")
    assert cfg["train_text_encoder"] is False and "stop_text_encoder_training" not in cfg
    assert any(n.startswith("stop_text_encoder_training: -1") for n in notes), notes
    # the field reads "% of total steps" but the tab writes the number: a step count, noted
    cfg, notes = _import({"stop_text_encoder_training": 30}, "train_dreambooth")
    assert cfg["stop_text_encoder_training"] == 30 and any("% of total steps" in n for n in notes), notes
    # SDXL / SD3 / FLUX scripts do not read it; SD3 / FLUX do not read learning_rate_te
    for box, script in (("sdxl", "sdxl_train.py"), ("sd3_checkbox", "sd3_train.py"),
                        ("flux1_checkbox", "flux_train.py")):
        cfg, notes = _import({box: True, "stop_text_encoder_training": 10, "learning_rate_te": 1e-5},
                             "train_dreambooth")
        assert "stop_text_encoder_training" not in cfg and any(script in n for n in notes), (box, notes)
        assert "text_encoder_lr" not in cfg
        assert (box == "sdxl") or any(n.startswith("learning_rate_te: dropped") for n in notes), notes
    cfg, notes = _import({"stop_text_encoder_training": 10}, "finetune")
    assert "stop_text_encoder_training" not in cfg and any("fine-tune tab does not write" in n for n in notes)
    cfg, notes = _import({"flux1_checkbox": True, "train_text_encoder": True}, "finetune")
    assert "train_text_encoder" not in cfg and any("flux_train.py" in n for n in notes), notes


def test_finetune_metadata_and_epochs_are_noted():
    cfg, notes = _import({"train_dir": "/m", "image_folder": "/img", "max_train_steps": 0, "epoch": 3,
                          "flip_aug": True, "vae": "/v.safetensors", "create_caption": True,
                          "create_buckets": False}, "finetune")
    assert (cfg["in_json"], cfg["train_data_dir"], cfg["max_train_epochs"]) == ("/m/meta_lat.json", "/img", 3)
    assert "vae" not in cfg and cfg["enable_bucket"] is True
    for start in ("in_json: /m/meta_lat.json; the GUI writes the caption metadata", "flip_aug:", "vae: dropped",
                  "epoch: max_train_steps is 0"):
        assert any(n.startswith(start) for n in notes), (start, notes)
    assert not any("prepare_buckets_latents" in n for n in notes)
    assert not any(k in n for n in notes for k in ("use_latent_files", "create_caption", "train_dir:", "image_folder"))
    cfg, notes = _import({"image_folder": "/img"}, "finetune")  # no train_dir: the GUI's "/meta_lat.json"
    assert "in_json" not in cfg and any(n.startswith("train_dir: empty") for n in notes)
    # a preset without max_train_steps: the GUI's field keeps its 1600
    assert _import({"epoch": 2}, "finetune")[0]["max_train_steps"] == 1600


def _train(script: str, text: str, tmp_path, run_script) -> str:
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    rc, stdout, err = run_script(script, ["--config", str(path)])
    assert rc == 0, err[-2000:]
    assert "done: steps 2" in stdout + err
    assert any(f.endswith(".safetensors") for f in os.listdir(tmp_path / "out"))
    return stdout + err


BASE = dict(mixed_precision="no", xformers="none", max_resolution="64,64", max_train_steps=2, bucket_reso_steps=8,
            min_bucket_reso=64, max_bucket_reso=128, lr_warmup=0, save_every_n_epochs=0, learning_rate=1e-4,
            pretrained_model_name_or_path="tiny-sd15", cache_latents=False)


def test_imported_dreambooth_config_trains_two_steps(tmp_path, dataset, run_script):
    """SD1 with the text encoder rate and a stop step of 1: it trains, then stops after step 1."""
    saved = gui.normalize(dict(BASE, learning_rate_te=1e-4, stop_text_encoder_training=1, train_data_dir=dataset,
                               output_dir=str(tmp_path / "out")), "dreambooth")
    saved.update({k: "" for k in PATHS if k in saved})
    text, notes = import_config(json.dumps(saved), "train_dreambooth")
    assert tomllib.loads(text)["stop_text_encoder_training"] == 1, notes
    log = _train("train_dreambooth", text, tmp_path, run_script)
    assert "text encoder(s) frozen after step 1" in log


def test_imported_finetune_config_trains_two_steps(tmp_path, dataset, run_script):
    """The caption metadata in <train_dir>/meta_cap.json (as the GUI's preparation step writes it)."""
    concept = os.path.join(dataset, "2_sks shape")
    meta = {os.path.join(concept, f): {"caption": "sks shape"} for f in sorted(os.listdir(concept))
            if f.endswith(".png")}
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / "meta_cap.json").write_text(json.dumps(meta), encoding="utf-8")
    saved = gui.normalize(dict(BASE, image_folder=concept, train_dir=str(tmp_path / "meta"), use_latent_files="No",
                               output_dir=str(tmp_path / "out"), train_text_encoder=True, learning_rate_te=1e-5,
                               dataset_repeats=1),
                          "finetune")
    saved.update({k: "" for k in PATHS if k in saved})
    text, notes = import_config(json.dumps(saved), "finetune")
    cfg = tomllib.loads(text)
    assert (cfg["in_json"], cfg["dataset_repeats"], cfg["text_encoder_lr"]) == \
        (f"{tmp_path / 'meta'}/meta_cap.json", 1, 1e-5), notes
    _train("finetune", text, tmp_path, run_script)


def test_the_tab_runs_the_first_ticked_model_types_script():
    """finetune_gui.py train_model's order (kohya_ss v26): sdxl_train.py, sd3_train.py,
    flux_train.py, anima_train.py, lumina_train.py, else fine_tune.py; with two boxes ticked the
    earlier one's script runs."""
    order = [("sdxl_checkbox", "sdxl_train.py"), ("sd3_checkbox", "sd3_train.py"), ("flux1_checkbox", "flux_train.py"),
             ("anima_checkbox", "anima_train.py"), ("lumina_checkbox", "lumina_train.py")]
    for i, (box, script) in enumerate(order):
        assert registry.for_gui({box: True}).gui_script == script
        for later, _ in order[i + 1:]:
            assert registry.for_gui({box: True, later: True}).gui_script == script, (box, later)
    assert registry.for_gui({}) is None
