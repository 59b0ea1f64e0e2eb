"""The import of a kohya_ss GUI saved JSON (library/ui/gui_import.py, library/ui/gui_network.py) sets
network_module and network_args as the GUI writes them into its TOML for every LoRA type of its
dropdown and every LoRA preset it ships. The reference is the TOML the GUI would write, built by
the tests' own transcription of lora_gui.py (tests/kohya_gui_configs.py ``gui_toml``); an imported
config per model family then trains two steps."""
from __future__ import annotations

import json
import os
import tomllib

import pytest
from safetensors import safe_open

from tests import kohya_gui_configs as gui

from library.config.options import GUI_ONLY, OPTIONS_BY_NAME
from library.config.parse import parse_args
from library.errors import UserError
from library.ui.gui_import import MODEL_TYPE_FIELDS, import_config

# every network field of the LoRA tab set off its default (a second case per type)
NON_DEFAULT = dict(
    LyCORIS_preset="attn-mlp", conv_dim=4, conv_alpha=2, factor=4, bypass_mode=True, dora_wd=True,
    use_cp=True, use_tucker=True, use_scalar=True, rank_dropout_scale=True, constrain=0.5, rescaled=True,
    train_norm=True, decompose_both=True, train_on_input=False, unit=2, rank_dropout=0.1,
    module_dropout=0.2, down_lr_weight="0,1,1,1,1,1,1,1,1,1,1,1", mid_lr_weight="0.5",
    up_lr_weight="1,1,1,1,1,1,1,1,1,1,1,0", block_lr_zero_threshold="0.1",
    block_dims="2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2",
    block_alphas="1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1", conv_block_dims="2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2",
    conv_block_alphas="1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1", loraplus_lr_ratio=4,
    loraplus_unet_lr_ratio=8, loraplus_text_encoder_lr_ratio=2, split_mode=True, train_blocks="double",
    split_qkv=True, train_t5xxl=True, enable_all_linear=True, img_attn_dim="4", txt_mlp_dim="2",
    single_dim="3", in_dims="[4,0,0,0,0]", train_double_block_indices="0-3",
    train_single_block_indices="none", train_lora_ggpo=True, ggpo_sigma=0.05, ggpo_beta=0.02,
)
RATE_KEYS = ("text_encoder_lr", "unet_lr", "network_train_unet_only", "network_train_text_encoder_only")
TYPES = [t for t in gui.LORA_TYPES if t not in gui.OTHER_FAMILY_TYPES]


def _gui_writes(preset: dict, tmp_path) -> dict:
    """The TOML the GUI writes for ``preset`` (the reference)."""
    return gui.gui_toml(preset, "lora", model="tiny-sd15", data_dir=str(tmp_path), output_dir=str(tmp_path / "o"))


def _reference(preset: dict, tmp_path) -> tuple[str, set]:
    """network_module and network_args of the TOML the GUI writes for ``preset``."""
    cfg = _gui_writes(preset, tmp_path)
    return cfg["network_module"], set(cfg.get("network_args", []))


def _imported(fields: dict) -> tuple[dict, list]:
    text, notes = import_config(json.dumps(fields), "train_lora")
    return tomllib.loads(text), notes


def _case(t: str, extra: dict) -> dict:
    return {"LoRA_type": t, "flux1_checkbox": t in gui.FLUX_TYPES, "anima_checkbox": t == "Anima",
            "lumina_checkbox": t == "Lumina", **extra}


@pytest.mark.parametrize("extra", [{}, NON_DEFAULT], ids=["defaults", "every-field-set"])
@pytest.mark.parametrize("lora_type", TYPES)
def test_saved_json_network_is_what_the_gui_writes(lora_type, extra, tmp_path):
    """The GUI's saved JSON holds every field (gui.normalize: the preset over the GUI's defaults)."""
    preset = _case(lora_type, extra)
    saved = gui.normalize(preset, "lora")
    cfg, notes = _imported(saved)
    module, args = _reference(preset, tmp_path)
    assert cfg["network_module"] == module
    assert set(cfg.get("network_args", [])) == args, notes
    for k in ("LoRA_type", "conv_dim", "LyCORIS_preset", "factor", "use_tucker", "img_attn_dim", "loraplus_lr_ratio"):
        assert k not in cfg and not any(n.startswith(f"{k}:") for n in notes), (k, notes)
    if lora_type == "LyCORIS/iA3":
        assert any("a run stops on it here" in n for n in notes), notes
    elif lora_type == "Flux1" and extra:
        assert any(n.startswith("train_lora_ggpo:") for n in notes), notes
    else:
        assert not any(n.startswith("LoRA_type") for n in notes), notes


def test_a_partial_json_reads_the_gui_defaults_and_sd3_standard_is_lora_sd3(tmp_path):
    """A field missing from the file keeps the GUI's default (a preset holds a few fields);
    Standard with the SD3 checkbox writes networks.lora_sd3; an old 'LoCon' is LyCORIS/LoCon."""
    for preset in ({"LoRA_type": "Flux1", "flux1_checkbox": True}, {"LoRA_type": "LyCORIS/LoKr"},
                   {"LoRA_type": "Standard", "sd3_checkbox": True}, {"LoRA_type": "LoCon", "conv_dim": 8},
                   {"LoRA_type": "Kohya LoKr", "factor": 8, "conv_dim": 0}):
        cfg, _ = _imported(preset)
        module, args = _reference(preset, tmp_path)
        assert (cfg["network_module"], set(cfg.get("network_args", []))) == (module, args), preset
    assert _imported({"LoRA_type": "Standard", "sd3_checkbox": True})[0]["network_module"] == "networks.lora_sd3"


def test_every_shipped_lora_preset_imports_its_network(tmp_path):
    cases = gui.presets("lora")
    assert len(cases) >= 30
    for name, preset in cases:
        cfg, notes = _imported(preset)
        ref = _gui_writes(preset, tmp_path)
        assert cfg["network_module"] == ref["network_module"], name
        assert set(cfg.get("network_args", [])) == set(ref.get("network_args", [])), (name, notes)
        assert {k: cfg.get(k) for k in RATE_KEYS} == {k: ref.get(k) for k in RATE_KEYS}, name


@pytest.mark.parametrize("lora_type", sorted(gui.OTHER_FAMILY_TYPES))
def test_other_family_types_are_a_note(lora_type):
    box = {"Anima": "anima_checkbox", "Lumina": "lumina_checkbox", "HunyuanImage-2.1": "hunyuan_image_checkbox"}
    cfg, notes = _imported({"LoRA_type": lora_type, box[lora_type]: True, "network_dim": 4})
    assert "network_module" not in cfg and "network_args" not in cfg and cfg["network_dim"] == 4
    assert any(n.startswith(f"LoRA_type {lora_type!r}: network_module not set") and
               gui.OTHER_FAMILY_TYPES[lora_type] in n for n in notes), notes
    assert any(n.startswith(f"{box[lora_type]}: dropped") for n in notes), notes


def test_combinations_the_gui_refuses_are_noted():
    _, notes = _imported({"LoRA_type": "Standard", "flux1_checkbox": True})
    assert any("the GUI requires LoRA type Flux1, Flux1 OFT or a LyCORIS type" in n for n in notes), notes
    _, notes = _imported({"LoRA_type": "Kohya LoHa", "sd3_checkbox": True})
    assert any("SDXL or Anima only" in n for n in notes), notes


# one imported saved JSON per model family: (family, LoRA_type, extra GUI fields, a key part of the saved file)
TRAIN_CASES = {
    "sd1 LyCORIS/LoHa": ("sd1", "LyCORIS/LoHa", {"conv_dim": 4, "use_tucker": True}, ".hada_w1_a"),
    "sdxl Kohya LoKr": ("sdxl", "Kohya LoKr", {"factor": 4, "conv_dim": 4}, ".lokr_w1"),
    "flux Flux1": ("flux", "Flux1", {"split_qkv": True, "img_attn_dim": "2", "train_double_block_indices": "0",
                                     "train_single_block_indices": "none"}, "double_blocks_0_img_attn_qkv.lora_down.weight"),
    # the Anima / Lumina fields of the saved JSON reach the run (a shift the run logs, the system prompt)
    "anima Anima": ("anima", "Anima", {"anima_timestep_sampling": "shift", "anima_discrete_flow_shift": 2.5,
                                       "anima_qwen3_max_token_length": 64, "rank_dropout": 0.1},
                    "lora_unet_blocks_0_self_attn_q_proj.lora_down.weight"),
    "lumina Lumina": ("lumina", "Lumina", {"lumina_system_prompt": "You are a painter.", "lumina_timestep_sampling": "sigmoid",
                                           "lumina_sigmoid_scale": 1.5, "lumina_cache_text_encoder_outputs": True,
                                           "text_encoder_lr": 0},  # cached Gemma-2: the GUI's rate 0 (unet only)
                      "lora_unet_layers_0_attention_qkv.lora_down.weight"),
}
# what of those fields the saved LoRA records (sd-scripts' ss_* keys of the family's flow options)
TRAIN_METADATA = {"anima Anima": {"ss_timestep_sampling": "shift", "ss_discrete_flow_shift": "2.5"},
                  "lumina Lumina": {"ss_timestep_sampling": "sigmoid", "ss_sigmoid_scale": "1.5"}}
# and the keys the import writes for them
TRAIN_KEYS = {"anima Anima": {"qwen3_max_token_length": 64, "network_args": ["rank_dropout=0.1"]},
              "lumina Lumina": {"system_prompt": "You are a painter.", "cache_text_encoder_outputs": True,
                                "network_train_unet_only": True}}


@pytest.mark.parametrize("case", sorted(TRAIN_CASES))
def test_imported_config_trains_two_steps(case, tmp_path, dataset, run_script):
    fam, lora_type, extra, key = TRAIN_CASES[case]
    saved = gui.normalize({"LoRA_type": lora_type, "sdxl": fam == "sdxl", "flux1_checkbox": fam == "flux",
                           "anima_checkbox": fam == "anima", "lumina_checkbox": fam == "lumina",
                           "network_dim": 4, "network_alpha": 2, "mixed_precision": "no", "xformers": "none",
                           "max_resolution": "64,64", "max_train_steps": 2, "bucket_reso_steps": 8,
                           "min_bucket_reso": 64, "max_bucket_reso": 128, "lr_warmup": 0, **extra}, "lora")
    text, notes = import_config(json.dumps(saved), "train_lora")
    out = tmp_path / "out"
    text += (f'pretrained_model_name_or_path = "{gui.tiny_model(fam)}"\ntrain_data_dir = "{dataset}"\n'
             f'output_dir = "{out}"\n')
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    rc, stdout, err = run_script("train_lora", ["--config", str(path)])
    assert rc == 0, (notes, err[-2000:])
    assert "done: steps 2" in stdout + err
    files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    with safe_open(str(out / files[0]), "pt") as f:
        keys = list(f.keys())
        meta = f.metadata()
    assert any(k.endswith(key) for k in keys), sorted(keys)[:5]
    assert meta["ss_network_module"] == tomllib.loads(text)["network_module"]
    assert {k: meta.get(k) for k in TRAIN_METADATA.get(case, {})} == TRAIN_METADATA.get(case, {})
    assert {k: tomllib.loads(text).get(k) for k in TRAIN_KEYS.get(case, {})} == TRAIN_KEYS.get(case, {})


# the Anima / Lumina fields set off the GUI's defaults (the compile settings with anima_compile)
DIT_FIELDS = dict(anima_timestep_sampling="shift", anima_discrete_flow_shift=2.0, anima_sigmoid_scale=0.5,
                  anima_qwen3_max_token_length=128, anima_t5_max_token_length=64, anima_attn_mode="sdpa",
                  anima_split_attn=True, anima_vae_chunk_size=16, anima_vae_disable_cache=True,
                  anima_cache_text_encoder_outputs_to_disk=True, anima_compile=True, anima_compile_dynamic="true",
                  anima_compile_cache_size_limit=8, lumina_timestep_sampling="nextdit_shift",
                  lumina_discrete_flow_shift=3.0, lumina_model_prediction_type="sigma_scaled",
                  lumina_sigmoid_scale=2.0, lumina_gemma2_max_token_length=128, lumina_system_prompt="Draw.",
                  lumina_use_sage_attn=True, lumina_cache_text_encoder_outputs=True)
BOX_TYPES = {"flux1_checkbox": "Flux1", "anima_checkbox": "Anima", "lumina_checkbox": "Lumina"}


@pytest.mark.parametrize("box", ["sdxl", "flux1_checkbox", "sd3_checkbox", "anima_checkbox", "lumina_checkbox", None])
def test_model_type_fields_are_written_only_with_their_type(box, tmp_path):
    """A saved JSON holds the FLUX.1 / SD3 / SDXL / Anima / Lumina fields of every model type; the
    GUI writes each (under its TOML key) only with its type checked, as the reference does."""

    lora_type = BOX_TYPES.get(box, "Standard")
    preset = {"LoRA_type": lora_type, "sdxl_cache_text_encoder_outputs": True, "sdxl_no_half_vae": True,
              "flux1_cache_text_encoder_outputs": True, "sd3_cache_text_encoder_outputs": True,
              "sd3_cache_text_encoder_outputs_to_disk": True, "apply_t5_attn_mask": True, "blocks_to_swap": 4,
              "weighting_scheme": "mode", "clip_l_dropout_rate": 0.1, "clip_skip": 2, "max_token_length": 150,
              **DIT_FIELDS, **({box: True} if box else {})}
    saved = gui.normalize(preset, "lora")
    saved["sd3_clip_l_dropout_rate"] = saved.pop("clip_l_dropout_rate")  # the GUI's field name
    cfg, notes = _imported(saved)
    ref = _gui_writes(preset, tmp_path)
    # the options of train_lora among them (the others are dropped with a note); not the model
    # files, which the reference blanks
    keys = {key for _, _, key in MODEL_TYPE_FIELDS if key in OPTIONS_BY_NAME and
            "train_lora" in OPTIONS_BY_NAME[key].scripts} - {"ae", "clip_l", "t5xxl", "clip_g", "vae", "qwen3", "gemma2"}
    assert len(keys) > 30
    assert {k: cfg.get(k) for k in keys | {"clip_skip", "max_token_length"}} == \
        {k: ref.get(k) for k in keys | {"clip_skip", "max_token_length"}}
    # the GUI-only keys (Anima's attention, VAE and compile settings: refused here, as a run
    # refuses them by name) are dropped with a note exactly where the GUI writes them
    gui_only = {key for _, _, key in MODEL_TYPE_FIELDS if key in GUI_ONLY}
    assert len(gui_only) >= 10
    assert {k for k in gui_only if any(n.startswith(f"{k}: dropped") for n in notes)} == \
        {k for k in gui_only if ref.get(k) not in (None, False, 0)}
    assert ("weighting_scheme" in cfg) == (box == "sd3_checkbox") and ("guidance_scale" in cfg) == (box == "flux1_checkbox")


@pytest.mark.parametrize("te, unet", [(0.0001, 0.0001), (0, 0.0002), (0.0003, 0)])
def test_lora_rates_choose_the_trained_parts_as_the_gui(te, unet, tmp_path):
    """A text encoder rate of 0 trains the U-Net alone (and the other way round), and the text
    encoder rate is written once per encoder, as the GUI writes its TOML."""
    preset = {"LoRA_type": "Standard", "text_encoder_lr": te, "unet_lr": unet, "learning_rate": 0.001}
    cfg, _ = _imported(gui.normalize(preset, "lora"))
    ref = _gui_writes(preset, tmp_path)
    assert {k: cfg.get(k) for k in RATE_KEYS} == {k: ref.get(k) for k in RATE_KEYS}
    assert (cfg.get("network_train_unet_only"), cfg.get("network_train_text_encoder_only")) == \
        ((True, None) if te == 0 else (None, True) if unet == 0 else (None, None))


def test_every_shipped_preset_imports_a_config_the_parser_accepts(tmp_path):
    """Every GUI preset of a family trained here (LoRA, DreamBooth, fine-tune), its paths pointed
    at the test's folder and a tiny model, imports into a config that parses: numbers the preset
    holds as strings are numbers, 0 fields are unset, max_train_steps 0 is the GUI's epochs."""
    (tmp_path / "data").mkdir()
    paths = ("reg_data_dir", "logging_dir", "vae", "network_weights", "resume", "dataset_config",
             "log_tracker_config", "in_json", "ae", "clip_l", "clip_g", "t5xxl", "sd3_clip_l", "sd3_t5xxl")
    n = 0
    for tab, script in (("lora", "train_lora"), ("dreambooth", "train_dreambooth"), ("finetune", "finetune")):
        for name, preset in gui.presets(tab):
            fam = gui.family_of(preset)
            if fam is None:
                continue
            preset = dict(preset, pretrained_model_name_or_path=gui.tiny_model(fam), train_data_dir=str(tmp_path / "data"),
                          output_dir=str(tmp_path / "out"), **{k: "" for k in paths if k in preset})
            text, _ = import_config(json.dumps(preset), script)
            path = tmp_path / "config.toml"
            path.write_text(text, encoding="utf-8")
            try:
                parse_args(script, ["--config", str(path)])
            except UserError as e:
                pytest.fail(f"{tab}/{name}: {e}")
            n += 1
    assert n >= 30


def test_network_fields_held_as_strings_are_numbers_and_a_bad_one_is_one_line(tmp_path):
    preset = {"LoRA_type": "Kohya LoKr", "conv_dim": "4", "conv_alpha": "2.5", "factor": "8", "rank_dropout": ""}
    cfg, _ = _imported(preset)
    assert set(cfg["network_args"]) == {"conv_dim=4", "conv_alpha=2.5", "factor=8"}
    with pytest.raises(UserError, match=r"^conv_dim: expected a number .* got 'x'$"):
        _imported({"LoRA_type": "LyCORIS/LoKr", "conv_dim": "x"})


def test_anima_and_lumina_defaults_write_only_what_the_gui_writes():
    """At class_anima.py's defaults the GUI writes no attn_mode ("torch") and no compile setting
    (anima_compile off), and neither model type writes clip_skip / max_token_length: no note for
    them, and the model fields under their keys."""
    cfg, notes = _imported(gui.normalize({"LoRA_type": "Anima", "anima_checkbox": True, "clip_skip": 2}, "lora"))
    assert not [n for n in notes if n.split(":")[0] in ("attn_mode", "compile_mode", "compile_backend",
                                                         "compile_dynamic", "clip_skip", "max_token_length")], notes
    assert (cfg["qwen3_max_token_length"], cfg["timestep_sampling"], cfg["network_module"]) == \
        (512, "sigmoid", "networks.lora_anima") and "clip_skip" not in cfg and "max_token_length" not in cfg
    cfg, notes = _imported(gui.normalize({"LoRA_type": "Lumina", "lumina_checkbox": True, "ae": "/flux/ae.sft",
                                          "lumina_ae": "/lumina/ae.sft", "discrete_flow_shift": 3.1}, "lora"))
    assert (cfg["ae"], cfg["discrete_flow_shift"], cfg["model_prediction_type"]) == ("/lumina/ae.sft", 6.0, "raw")
