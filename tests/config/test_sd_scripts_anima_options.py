"""Every option sd-scripts' Anima trainers accept (anima_train_network.py, anima_train.py at the
commit named in sd_scripts_anima_options.json, read from their argparse parsers) is known to the
entry script that takes its place here (train_lora for anima_train_network.py, train_dreambooth and
finetune for anima_train.py): an option of the schema (honoured, or refused with the Anima model in
one line: the family's table), or an sd-scripts name accepted with a "no effect" warning or refused
by name (library/config/options.py SD_SCRIPTS_NAMES). A new sd-scripts option in that file that is
none of these fails here; likewise the network_args sd-scripts' networks/lora_anima.py reads.
Parsing only: no model is built."""
from __future__ import annotations

import json
import os

import pytest

from library.models.families import registry
from tests.config.test_sd_scripts_flow_options import assert_one_line, verdict

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = json.load(open(os.path.join(HERE, "sd_scripts_anima_options.json")))
FLOW = json.load(open(os.path.join(HERE, "sd_scripts_flow_options.json")))
BASE = ["--pretrained_model_name_or_path", "tiny-anima", "--train_data_dir", "unused", "--resolution",
        "64", "--max_train_steps", "1", "--dry_run"]
PAIRS = sorted({(sd, entry, name) for sd, names in DATA["scripts"].items()
                for entry in DATA["entry_scripts"][sd] for name in names})
# the options only sd-scripts' Anima scripts define (not its FLUX.1 / SD3 ones)
ANIMA_ONLY = sorted({n for names in DATA["scripts"].values() for n in names}
                    - {n for names in FLOW["scripts"].values() for n in names})


def test_the_data_file_names_its_source():
    assert DATA["source"] == "kohya-ss/sd-scripts" and len(DATA["commit"]) == 40
    assert set(DATA["scripts"]) == set(DATA["entry_scripts"]) == {"anima_train_network.py", "anima_train.py"}
    # sd-scripts' parsers define these; a truncated file would pass the tests below vacuously
    for names in DATA["scripts"].values():
        assert {"pretrained_model_name_or_path", "qwen3", "vae", "blocks_to_swap", "attn_mode", "mod_lr",
                "unsloth_offload_checkpointing", "xformers"} <= set(names)
        assert len(names) > 180 and "help" not in names


def test_every_sd_scripts_anima_option_is_known():
    unknown = [f"{sd}: {name} ({entry})" for sd, entry, name in PAIRS if verdict(entry, name) == "unknown"]
    assert not unknown, "sd-scripts Anima options sdtk neither takes nor names: " + ", ".join(unknown)


def test_options_of_another_entry_script_are_the_listed_ones():
    """anima_train.py takes reg_data_dir (DreamBooth folders); finetune is fine_tune.py's job."""
    got = {(entry, name) for _, entry, name in PAIRS if verdict(entry, name) == "other script"}
    assert got == {("finetune", "reg_data_dir")}


def test_anima_only_options_are_options_anima_does_not_refuse():
    """What only sd-scripts' Anima scripts define is an option of the entry scripts here, and the
    Anima family does not refuse or ignore it."""
    fam = registry.get("anima")
    assert ANIMA_ONLY and "qwen3" in ANIMA_ONLY
    for sd, entry, name in PAIRS:
        if name in ANIMA_ONLY:
            assert verdict(entry, name) == "option", (sd, entry, name)
            assert name not in fam.unsupported and name not in fam.no_effect, name


@pytest.mark.parametrize("entry, name", sorted({(e, n) for _, e, n in PAIRS
                                                if verdict(e, n) in ("ignore", "reject", "other script")}))
def test_names_sdtk_does_not_take_are_one_line_with_anima(entry, name, caplog):
    assert_one_line(entry, name, BASE, caplog)


def test_every_sd_scripts_anima_network_arg_is_known():
    """The network_args sd-scripts' networks/lora_anima.py reads: taken, refused by name or "no
    effect" by networks/lora_anima.py here."""
    from networks import lora_anima

    named = set(lora_anima.KNOWN_NETWORK_ARGS) | set(lora_anima.UNSUPPORTED) | set(lora_anima.NO_EFFECT)
    missing = sorted(set(DATA["network_args"]["networks.lora_anima"]) - named)
    assert not missing, f"networks.lora_anima: sd-scripts' network_args not named here: {missing}"
