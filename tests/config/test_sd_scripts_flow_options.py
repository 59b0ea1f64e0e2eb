"""Every option sd-scripts' FLUX.1 and SD3 trainers accept (flux_train_network.py, flux_train.py,
sd3_train_network.py, sd3_train.py at the commit named in sd_scripts_flow_options.json, read from
their argparse parsers) is known to the entry script that takes its place here (train_lora for
the *_train_network.py scripts, train_dreambooth and finetune for flux_train.py / sd3_train.py):
an option of the schema, or an sd-scripts name accepted with a "no effect" warning or refused by
name (library/config/options.py SD_SCRIPTS_NAMES), each in one line. A new sd-scripts option in
that file that is neither fails here, so a gap shows; likewise the network_args sd-scripts'
networks/lora_flux.py and networks/lora_sd3.py read. Parsing only: no model is built."""
from __future__ import annotations

import json
import logging
import os

import pytest

from library.config.options import ALIASES, OPTIONS_BY_NAME, SD_SCRIPTS_BY_NAME
from library.config.parse import ConfigError, parse_args
from library.models import flow_family
from library.models.families import registry
from library.training import flow_loss

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = json.load(open(os.path.join(HERE, "sd_scripts_flow_options.json")))
ROOT = os.path.dirname(os.path.dirname(HERE))
BASE = ["--pretrained_model_name_or_path", "tiny-flux", "--train_data_dir", "unused", "--resolution",
        "64", "--max_train_steps", "1", "--dry_run"]


def _pairs():
    for sd_script, names in DATA["scripts"].items():
        for entry in DATA["entry_scripts"][sd_script]:
            for name in names:
                yield sd_script, entry, name


PAIRS = sorted(set(_pairs()))


def verdict(entry: str, name: str) -> str:
    """What ``entry`` makes of sd-scripts' option ``name``: "option" (in the schema for this
    script), "other script" (a schema option of another entry script: refused by name),
    "ignore" / "reject" (SD_SCRIPTS_NAMES), or "unknown" (the gap this test exists for)."""
    canonical = ALIASES.get(name, name)
    if canonical in OPTIONS_BY_NAME:
        return "option" if entry in OPTIONS_BY_NAME[canonical].scripts else "other script"
    if name in SD_SCRIPTS_BY_NAME:
        return SD_SCRIPTS_BY_NAME[name].action
    return "unknown"


def test_the_data_file_names_its_source():
    assert DATA["source"] == "kohya-ss/sd-scripts" and len(DATA["commit"]) == 40
    assert set(DATA["scripts"]) == set(DATA["entry_scripts"]) == {
        "flux_train_network.py", "flux_train.py", "sd3_train_network.py", "sd3_train.py"}
    # sd-scripts' parsers define these; a truncated file would pass the test below vacuously
    for names in DATA["scripts"].values():
        assert {"pretrained_model_name_or_path", "t5xxl", "blocks_to_swap", "weighting_scheme"} <= set(names)
        assert len(names) > 180


def test_every_sd_scripts_flow_option_is_known():
    unknown = [f"{sd}: {name} ({entry})" for sd, entry, name in PAIRS if verdict(entry, name) == "unknown"]
    assert not unknown, "sd-scripts options sdtk neither takes nor names: " + ", ".join(unknown)


# sd-scripts options that are a schema option of another entry script here: refused by name.
# flux_train.py / sd3_train.py take reg_data_dir (DreamBooth); finetune is fine_tune.py's job.
OTHER_SCRIPT = {("finetune", "reg_data_dir")}


def test_options_of_another_entry_script_are_the_listed_ones():
    got = {(entry, name) for _, entry, name in PAIRS if verdict(entry, name) == "other script"}
    assert got == OTHER_SCRIPT


def _value(name: str) -> list:
    """A command-line setting that is not sd-scripts' default (off)."""
    entry = SD_SCRIPTS_BY_NAME.get(name)
    if entry is not None and entry.kind == "flag":
        return [f"--{name}"]
    return [f"--{name}", "1"]


@pytest.mark.parametrize("entry, name", sorted({(e, n) for _, e, n in PAIRS
                                                if verdict(e, n) in ("ignore", "reject", "other script")}))
def test_names_sdtk_does_not_take_are_one_line_on_the_command_line(entry, name, caplog):
    assert_one_line(entry, name, BASE, caplog)


def assert_one_line(entry: str, name: str, base: list, caplog) -> None:
    """A no-effect name parses with one warning naming it; a refused one stops with one line
    naming it (never argparse's usage dump or a traceback)."""
    caplog.set_level(logging.WARNING)
    argv = base + _value(name)
    if verdict(entry, name) == "ignore":
        opts = parse_args(entry, argv)
        assert name in opts.ignored
        lines = [r.getMessage() for r in caplog.records if name in r.getMessage()]
        assert len(lines) == 1 and "no effect" in lines[0], lines
        return
    with pytest.raises(ConfigError) as e:
        parse_args(entry, argv)
    assert name in str(e.value) and "\n" not in str(e.value)


def test_model_type_names_the_family_the_weights_must_be():
    """sd-scripts' model_type is an option; before loading, a value no family has, or one that is
    not the weights' family, stops with one line (library/training/flow_loss.py)."""
    from library.training import flow_loss

    opts = parse_args("train_lora", BASE + ["--model_type", "flux"])
    assert opts.model_type == "flux" and opts.ignored == {}
    assert flow_loss.check_options(opts.replace(pretrained_model_name_or_path="tiny-flux"), "dreambooth") == "flux"
    with pytest.raises(flow_loss.flow_family.FlowFamilyError, match=r"^model_type flux: tiny-sd3 is a SD3 model, not FLUX.1"):
        flow_loss.check_options(opts.replace(pretrained_model_name_or_path="tiny-sd3"), "dreambooth")
    with pytest.raises(flow_loss.flow_family.FlowFamilyError, match=r"^model_type flux: tiny-sd15 is not a FLUX.1 model$"):
        flow_loss.check_options(opts.replace(pretrained_model_name_or_path="tiny-sd15"), "dreambooth")
    with pytest.raises(flow_loss.flow_family.FlowFamilyError, match=r"^model_type dev: not a model type"):
        flow_loss.check_options(opts.replace(model_type="dev", pretrained_model_name_or_path="tiny-flux"), "dreambooth")


def test_flow_refusal_and_no_effect_tables_name_options():
    """The FLUX.1 / SD3 run-time tables (refused with the family, or warned "no effect") name
    options of the schema, and none is both refused and warned for one family."""
    for fam in registry.FLOW_FAMILIES:
        refused = {**flow_family.UNSUPPORTED, **registry.get(fam).unsupported}
        warned = {**flow_loss.NO_EFFECT, **registry.get(fam).no_effect}
        assert set(refused) <= set(OPTIONS_BY_NAME) and set(warned) <= set(OPTIONS_BY_NAME)
        assert not set(refused) & set(warned), fam


def test_docs_table_lists_every_refused_and_no_effect_flow_option():
    """docs/MODELS.md's table of sd-scripts' FLUX.1 / SD3 options that do not simply work here
    names every entry of the run-time tables and every sd-scripts-only name of the four scripts."""
    text = open(os.path.join(ROOT, "docs", "MODELS.md"), encoding="utf-8").read()
    start = text.index("### FLUX.1 and SD3 options refused or without effect")
    end = text.find("\n## ", start)
    table = text[start:end if end >= 0 else len(text)]
    names = set(flow_family.UNSUPPORTED) | set(flow_loss.NO_EFFECT)
    for fam in registry.FLOW_FAMILIES:
        names |= set(registry.get(fam).unsupported) | set(registry.get(fam).no_effect)
    names |= {n for _, e, n in PAIRS if verdict(e, n) in ("ignore", "reject", "other script")}
    missing = sorted(n for n in names if f"`{n}`" not in table)
    assert not missing, f"docs/MODELS.md's FLUX.1 / SD3 option table lacks {missing}"


@pytest.mark.parametrize("module", sorted(DATA["network_args"]))
def test_every_sd_scripts_flow_network_arg_is_known(module):
    """The network_args sd-scripts' FLUX.1 / SD3 LoRA modules read: taken, refused by name or
    "no effect" by the module of the same name here (networks/lora_flux.py, networks/lora_sd3.py)."""
    import importlib

    m = importlib.import_module(module)
    named = set(m.KNOWN_NETWORK_ARGS) | set(getattr(m, "UNSUPPORTED", {})) | set(m.NO_EFFECT)
    missing = sorted(set(DATA["network_args"][module]) - named)
    assert not missing, f"{module}: sd-scripts' network_args not named here: {missing}"
