"""Every config the kohya_ss GUI writes for SD1/SD2/SDXL, FLUX.1, SD3, Anima and Lumina loads and
trains.

tests/kohya_gui_configs.py turns each GUI preset (bmaltais/kohya_ss presets/{lora,dreambooth,
finetune}/*.json, stored in tests/config/kohya_gui_presets.json by tools/update_gui_presets.py)
and the GUI's own defaults into the run TOML the GUI would write; here each one
runs with --dry_run and trains two steps on the tiny model of its family (the textual-inversion
tab has no presets: its defaults, for SD1 and SDXL; the GUI ships no Anima or Lumina preset: the
defaults of its LoRA and fine-tune tabs with that model type, the only tabs that offer them).
"""
import os

import pytest
import torch

from library.config.options import GUI_KEYS_BY_NAME
from tests import kohya_gui_configs as gui

SCRIPT = {"lora": "train_lora", "dreambooth": "train_dreambooth", "finetune": "finetune",
          "textual_inversion": "train_textual_inversion"}

# Presets rejected before any weight loads with one line naming the key (sd-scripts stops on the
# LyCORIS presets' bucket_reso_steps = 1, which we round up to 8): LyCORIS 3.x's kohya wrapper has
# no "ia3" algorithm (library/training/network_options.py LYCORIS_UNSUPPORTED).
REJECTED = {
    "lora/iA3-Prodigy-sd15": "algo=ia3",
    "lora/ia3-sd15": "algo=ia3",
}
# Presets that load but cannot train here: the run stops with one line (none today).
TRAIN_REJECTED: dict[str, str] = {}


def _cases():
    out = []
    for tab in gui.TABS:
        for name, preset in gui.presets(tab):
            pid = f"{tab}/{name}"
            fam = gui.family_of(preset)
            if fam is None:
                why = f"a {gui.other_family(preset)} preset: not an SD1/SD2/SDXL model"
                out.append(pytest.param(tab, preset, pid, id=f"{pid} [skipped: {why}]",
                                        marks=pytest.mark.skip(reason=why)))
                continue
            out.append(pytest.param(tab, preset, pid, id=pid))
        # (the LoRA tab trains FLUX.1 with its Flux1 type: its default type writes networks.lora)
        flux = {"flux1_checkbox": True, **({"LoRA_type": "Flux1"} if tab == "lora" else {})}
        flow = (("flux", flux), ("sd3", {"sd3_checkbox": True}))
        if tab in ("lora", "finetune"):  # the tabs with the Anima and Lumina model types
            flow += tuple((fam, {f"{fam}_checkbox": True, **({"LoRA_type": fam.title()} if tab == "lora" else {})})
                          for fam in ("anima", "lumina"))
        for fam, flags in (("sd1", {}), ("sdxl", {"sdxl": True}),
                           *(flow if tab != "textual_inversion" else ())):
            if tab == "finetune" and fam == "sdxl":
                flags = {"sdxl_checkbox": True}
            # (finetune + flux: the tab's "Train text encoder" is on by default; flux_train.py has no
            # such option and ignores the key: a warning here, checked in test_gui_config_trains_two_steps)
            pid = f"{tab}/GUI defaults {fam}"
            if tab == "textual_inversion":
                flags = {**flags, "token_string": "sks"}  # the GUI requires one (no default)
            out.append(pytest.param(tab, flags, pid, id=pid))
    return out


CASES = _cases()


def test_every_stored_sd_preset_is_a_dry_run_case():
    """The fixture holds the GUI's presets for its LoRA, DreamBooth and fine-tune tabs with the
    kohya_ss commit they come from, and each SD1/SD2/SDXL one is a dry-run case of the default
    suite (not skipped): a lost or emptied fixture fails here instead of shrinking the cases."""
    commit = gui.presets_commit()
    assert len(commit) == 40 and int(commit, 16) >= 0
    stored = {f"{tab}/{name}": preset for tab in gui.TABS for name, preset in gui.presets(tab)}
    assert {p.split("/")[0] for p in stored} == {"lora", "dreambooth", "finetune"}
    sd = {pid for pid, preset in stored.items() if gui.family_of(preset) is not None}
    run = {c.values[2] for c in CASES if not c.marks}
    assert sd and sd <= run
    # the kinds of preset the GUI ships for these families, each present
    fams = {gui.family_of(stored[pid]) for pid in sd}
    types = {gui.normalize(stored[pid], "lora")["LoRA_type"] for pid in sd if pid.startswith("lora/")}
    assert fams >= {"sd1", "sdxl"} and {"Standard", "LyCORIS/LoHa", "LyCORIS/LoKr"} <= types


def _earlier_lora(fam, d, path):
    """A LoRA file of the preset's shape (rank, alpha, conv) on the tiny model, as an earlier run
    would have written it (non-zero up weights)."""
    from library.models.loading import load_model_bundle
    from networks.lora import create_network

    b = load_model_bundle(gui.tiny_model(fam))
    conv = {"conv_dim": d["conv_dim"], "conv_alpha": d["conv_alpha"]} if d.get("conv_dim") else {}
    tes = b.text_encoders if len(b.text_encoders) > 1 else b.text_encoders[0]
    torch.manual_seed(0)
    net = create_network(1.0, int(d["network_dim"]), float(d["network_alpha"]), None, tes, b.unet, **conv)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_up" in name:
                p.normal_(0, 1e-3)
    net.save_weights(path, None, {})
    return path


def _config(tab, preset, tmp_path, dataset):
    fam = gui.family_of(preset)
    out = str(tmp_path / "out")
    concept = os.path.join(dataset, "2_sks shape")
    for f in os.listdir(concept):  # GUI users caption in .txt files (the GUI's default extension)
        if f.endswith(".caption"):
            with open(os.path.join(concept, f)) as src, \
                    open(os.path.join(concept, f[:-len(".caption")] + ".txt"), "w") as dst:
                dst.write(src.read())
    # the finetune tab's image folder holds the images themselves (captions via in_json)
    data = concept if tab == "finetune" else dataset
    weights = ""
    if gui.normalize(preset, tab).get("network_weights"):
        # e.g. "finetuning phase 2": the preset names the LoRA of an earlier run to continue from
        weights = _earlier_lora(fam, gui.normalize(preset, tab), str(tmp_path / "phase1.safetensors"))
    cfg = gui.gui_toml(preset, tab, model=gui.tiny_model(fam), data_dir=data, output_dir=out,
                       network_weights=weights)
    if cfg.get("mixed_precision") == "fp16" and not torch.cuda.is_available():
        # the GUI's default; fp16 loss scaling needs CUDA: bf16 autocast is the CPU's half precision
        cfg["mixed_precision"] = "bf16"
        cfg.pop("full_fp16", None)
    return gui.write_toml(str(tmp_path / "config.toml"), cfg), cfg


@pytest.mark.parametrize("tab, preset, pid", CASES)
def test_gui_config_dry_run(tab, preset, pid, tmp_path, dataset, run_script, monkeypatch):
    from library.training import memory_estimate

    # the memory estimate (a fake-tensor model build, seconds each) is advice, tested elsewhere;
    # what matters here is that every check a real run makes before loading weights passes
    estimated = []
    monkeypatch.setattr(memory_estimate, "report", lambda *a, **k: estimated.append(a))
    path, cfg = _config(tab, preset, tmp_path, dataset)
    rc, out, err = run_script(SCRIPT[tab], ["--config", path, "--dry_run"])
    if pid in REJECTED:
        line = err.strip().splitlines()[-1]
        assert rc == 2 and line.startswith("error: ") and REJECTED[pid] in line, err
        return
    assert rc == 0, err[-2000:]
    assert "step plan:" in out and len(estimated) == 1


# What decides which code a preset's training reaches: the tab, the family and these GUI keys.
# The optimizer is not among them: tests/training/test_optimizers.py steps every optimizer name,
# and each preset's optimizer and optimizer_args are parsed and checked by its dry run above; its
# two training steps with them run under ``pytest -m slow`` (kept out of the default suite for
# CI time, 93 s of it).
_TRAINING_CLASS = ("LoRA_type", "v2", "v_parameterization", "mixed_precision")
_TRAINING_FLAGS = ("network_weights", "fp8_base", "fused_backward_pass", "full_bf16", "full_fp16",
                   "cache_text_encoder_outputs")


def _train_cases():
    """Every preset that loads also trains (two steps at 64 px take 1-25 s on the tiny models).
    The default suite trains the first preset of each training class (tab, family, LoRA type,
    precision, the flags above): 20 of the 42 that train; the others, which differ from it only in
    the optimizer or in values such as ranks and rates (their dry runs above check those), train under
    ``pytest -m slow``."""
    seen, out = set(), []
    for c in CASES:
        tab, preset, pid = c.values
        if pid in REJECTED:
            continue
        if c.marks:
            out.append(c)
            continue
        d = gui.normalize(preset, tab)
        cls = (tab, gui.family_of(preset), *(d.get(k) for k in _TRAINING_CLASS),
               *(bool(d.get(k)) for k in _TRAINING_FLAGS))
        out.append(c if cls not in seen else pytest.param(*c.values, id=c.id, marks=pytest.mark.slow))
        seen.add(cls)
    return out


@pytest.mark.parametrize("tab, preset, pid", _train_cases())
def test_gui_config_trains_two_steps(tab, preset, pid, tmp_path, dataset, run_script, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # presets with log_with = "wandb": no network
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    path, cfg = _config(tab, preset, tmp_path, dataset)
    rc, out, err = run_script(SCRIPT[tab], ["--config", path])
    if pid in TRAIN_REJECTED:
        line = err.strip().splitlines()[-1]
        assert rc == 2 and line.startswith("error: ") and TRAIN_REJECTED[pid] in line, err[-2000:]
        return
    assert rc == 0, err[-2000:]
    assert "done: steps 2" in out + err
    if tab == "dreambooth" and gui.family_of(preset) in ("sd1", "sd2") and cfg.get("learning_rate_te"):
        # the GUI writes learning_rate_te and no train_text_encoder: trained, as train_db.py
        assert "the text encoder trains, as in sd-scripts' train_db.py" in err
    if gui.family_of(preset) in ("flux", "sd3") and cfg.get("learning_rate_te"):
        # flux_train.py / sd3_train.py never read learning_rate_te (sd3_train.py: learning_rate_te1/2/3)
        assert "text_encoder_lr (learning_rate_te) has no effect with the" in err
    if gui.family_of(preset) == "flux" and cfg.get("train_text_encoder"):
        # flux_train.py has no train_text_encoder: the GUI's key is ignored there, warned here
        assert "option train_text_encoder has no effect with the FLUX.1 model" in err
    name = cfg.get("output_name", "last")
    saved = [f for f in os.listdir(tmp_path / "out") if f.startswith(name)]
    assert saved, os.listdir(tmp_path / "out")


def test_gui_keys_cover_every_key_the_converter_writes(tmp_path):
    """Each key of every preset's and default's GUI TOML (FLUX.1 / SD3 included) is in
    library.config.options GUI_KEYS, for the tab that wrote it."""
    letter = {"lora": "l", "dreambooth": "d", "finetune": "f", "textual_inversion": "t"}
    seen = set()
    for c in CASES:
        tab, preset, pid = c.values
        if gui.family_of(preset) is None:
            continue
        cfg = gui.gui_toml(preset, tab, model="tiny-sd15", data_dir=str(tmp_path),
                           output_dir=str(tmp_path / "o"))
        for key in cfg:
            assert key in GUI_KEYS_BY_NAME, f"{pid}: {key} is not in GUI_KEYS"
            assert letter[tab] in GUI_KEYS_BY_NAME[key].tabs, f"{pid}: {key} not listed for {tab}"
            seen.add(key)
    assert {"epoch", "noise_offset_type", "network_args", "learning_rate_te", "xformers",
            "token_string", "init_word"} <= seen
    # the FLUX.1 and SD3 presets' own keys (their model file paths are emptied here)
    assert {"discrete_flow_shift", "model_prediction_type", "timestep_sampling", "guidance_scale",
            "apply_t5_attn_mask", "t5xxl_max_token_length", "weighting_scheme", "logit_mean",
            "logit_std", "mode_scale", "t5xxl_dtype", "text_encoder_batch_size"} <= seen


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-sd3"])
# --- the rules behind it, one by one --------------------------------------------------------

def _parse(tmp_path, text, *argv, script="train_lora"):
    from library.config.parse import parse_args

    p = tmp_path / "run.toml"
    p.write_text('pretrained_model_name_or_path = "tiny-sd15"\ntrain_data_dir = "data"\n'
                 'resolution = 64\noutput_dir = "out"\nmax_train_steps = 2\n' + text)
    return parse_args(script, ["--config", str(p), *argv])


def test_gui_only_keys_warn_or_reject(tmp_path, caplog):
    from library.config.parse import ConfigError

    opts = _parse(tmp_path, 'epoch = 10\nnoise_offset_type = "Original"\nvae_chunk_size = 0\n')
    assert opts.ignored == {"epoch": 10, "noise_offset_type": "Original"}
    assert "option epoch has no effect" in caplog.text
    assert "vae_chunk_size" not in caplog.text  # the GUI's unset value: silent
    assert _parse(tmp_path, "train_inpainting = true\n").train_inpainting  # an option now
    assert _parse(tmp_path, 'model_type = "flux"\n').model_type == "flux"  # an option (flow_loss checks it)
    with pytest.raises(ConfigError, match="unknown option 'epochs'"):  # a typo is still an error
        _parse(tmp_path, "epochs = 10\n")
    with pytest.raises(ConfigError, match="unknown option 'epoch'"):  # GUI keys are file keys only
        _parse(tmp_path, "", "--epoch", "3")


@pytest.mark.parametrize("script, text, blocks, line", [
    # sd-scripts' flux_train_network.py: split_mode sets blocks_to_swap 18 unless it is given
    ("train_lora", "split_mode = true\n", 18, "split_mode is deprecated (sd-scripts): use blocks_to_swap; "
     "blocks_to_swap = 18 is set"),
    ("train_lora", "split_mode = true\nblocks_to_swap = 4\n", 4, "blocks_to_swap is given, so split_mode "
     "is ignored"),
    ("finetune", "split_mode = true\n", None, "option split_mode has no effect in finetune"),
    # sd-scripts' flux_train.py: blocks_to_swap = double + single // 2 when blocks_to_swap is unset
    ("finetune", "double_blocks_to_swap = 6\nsingle_blocks_to_swap = 9\n", 10,
     "double_blocks_to_swap = 6 and single_blocks_to_swap = 9 give blocks_to_swap = 10"),
    ("train_dreambooth", "single_blocks_to_swap = 5\n", 2, "give blocks_to_swap = 2"),
    ("train_dreambooth", "single_blocks_to_swap = 1\n", None, None),  # 1 // 2 = 0: nothing to map
    ("finetune", "double_blocks_to_swap = 6\nblocks_to_swap = 3\n", 3, "blocks_to_swap is given, so "
     "they are ignored"),
    ("train_lora", "double_blocks_to_swap = 6\n", None, "have no effect in train_lora"),
    # what the GUI writes when they are off: nothing happens, nothing is said
    ("train_lora", "split_mode = false\nsingle_blocks_to_swap = 0\ndouble_blocks_to_swap = 0\n", None, None),
])
def test_flux_deprecated_block_swap_keys(tmp_path, caplog, script, text, blocks, line):
    """The kohya_ss GUI's FLUX.1 split_mode / double_blocks_to_swap / single_blocks_to_swap (sd-scripts'
    deprecated names) map to blocks_to_swap as sd-scripts' scripts do, with one warning line."""
    caplog.set_level("WARNING", logger="sdtk")
    opts = _parse(tmp_path, text, script=script)
    assert opts.blocks_to_swap == blocks
    said = [r.getMessage() for r in caplog.records if "blocks_to_swap" in r.getMessage()
            or "split_mode" in r.getMessage()]
    if line is None:
        assert said == []
    else:
        assert len(said) == 1 and line in said[0], said


def test_sd3_position_keys_are_options(tmp_path):
    opts = _parse(tmp_path, "enable_scaled_pos_embed = true\npos_emb_random_crop_rate = 0.25\n")
    assert (opts.enable_scaled_pos_embed, opts.pos_emb_random_crop_rate) == (True, 0.25)


def test_xformers_without_the_package_falls_back_to_sdpa(tmp_path, caplog):
    from importlib.util import find_spec

    if find_spec("xformers") is not None:
        pytest.skip("xformers is installed here")
    opts = _parse(tmp_path, "xformers = true\n")
    assert (opts.xformers, opts.sdpa) == (False, True)
    assert "xformers package is not installed; using SDPA" in caplog.text


def test_config_values_are_checked_even_when_the_command_line_overrides_them(tmp_path):
    from library.config.parse import ConfigError

    with pytest.raises(ConfigError, match=r"run.toml:6: train_batch_size: expected an integer"):
        _parse(tmp_path, 'train_batch_size = "two"\n', "--train_batch_size", "2")
    assert _parse(tmp_path, "train_batch_size = 3\n", "--train_batch_size", "2").train_batch_size == 2


@pytest.mark.parametrize("extra, message", [
    (["--optimizer_type", "NoSuchOptimizer"], "optimizer_type: unknown optimizer 'NoSuchOptimizer'"),
    (["--network_args", "no_such_key=1"], "network_args: unknown key 'no_such_key'"),
    (["--network_module", "no_such.module"], "network_module: cannot import 'no_such.module'"),
])
def test_dry_run_stops_on_what_a_real_run_stops_on(extra, message, dataset, run_script):
    rc, out, err = run_script("train_lora", [
        "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
        "--resolution", "64", "--max_train_steps", "2", "--dry_run", *extra])
    assert rc == 2 and err.strip().splitlines()[-1].startswith(f"error: {message}"), err




@pytest.mark.parametrize("model, extra, trains", [
    ("tiny-sd15", ["--learning_rate_te", "1e-3"], True),           # train_db.py: trains the TE
    ("tiny-sd15", ["--learning_rate_te", "1e-3", "--train_text_encoder=false"], False),
    ("tiny-sdxl", ["--learning_rate_te1", "1e-3"], False),        # sdxl_train.py needs the switch
])
def test_dreambooth_text_encoder_rate_trains_it_as_sd_scripts(model, extra, trains, dataset,
                                                               tmp_path, train):
    from library.models.loading import resolve_model_source  # noqa: F401 - the built-in name resolves

    rc, out, err, run = train("train_dreambooth", [
        "--pretrained_model_name_or_path", model, "--train_data_dir", dataset,
        "--output_dir", tmp_path / "o", "--resolution", "64", "--max_train_steps", "2",
        "--learning_rate", "1e-3", "--cache_latents", *extra])
    assert rc == 0, err[-2000:]
    assert run.parts.method.train_text_encoder is trains
    te = run.parts.bundle.text_encoders[0]
    assert all(p.requires_grad is trains for p in te.parameters())
    assert ("the text encoder trains, as in sd-scripts' train_db.py" in err) is trains


def test_gui_option_keys_are_accepted_by_the_tab_scripts():
    """A GUI key documented as "honoured as option X" is an option of the entry script of every
    tab that writes it (else the GUI's file would be refused with "not accepted by")."""
    from library.config.options import ALIASES, GUI_KEYS, OPTIONS_BY_NAME

    script = {"l": "train_lora", "d": "train_dreambooth", "f": "finetune", "t": "train_textual_inversion"}
    for k in GUI_KEYS:
        target = ALIASES.get(k.target or k.name, k.target or k.name)
        if k.action != "option":
            continue
        for t in k.tabs:
            assert script[t] in OPTIONS_BY_NAME[target].scripts, f"{k.name} ({t})"


def test_sd3_gui_keys_without_effect_warn(tmp_path, caplog):
    """The SD3 tab's T5 and unified-checkpoint keys (sd-scripts ignores save_clip / save_t5xxl;
    T5's dtype and device follow the other encoders here): one "no effect" warning each, not an
    error."""
    keys = {"t5xxl_dtype": '"bf16"', "t5xxl_device": '"cpu"', "save_clip": "true", "save_t5xxl": "true"}
    opts = _parse(tmp_path, "".join(f"{k} = {v}\n" for k, v in keys.items()), script="train_dreambooth")
    assert set(opts.ignored) == set(keys)
    for k in keys:
        assert f"option {k} has no effect in this toolkit (marked [DOES NOT WORK] in sd-scripts" in caplog.text, k
