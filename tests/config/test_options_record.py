"""The parsed options are a typed, frozen record generated from the schema (library/config/parse.py
Options), and unit tests build theirs with tests/helpers.make_opts."""
import dataclasses
import glob
import os
import pickle
import re
import types
import typing

import pytest

from library.config import options as schema
from library.config.parse import ConfigError, Options, parse_args
from tests.helpers import make_opts, source_files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", "data",
        "--resolution", "64", "--output_dir", "out", "--max_train_steps", "3"]

# What each schema value type (library/config/options.py Option docstring) holds once parsed, written
# out here from that docstring; "| None" where the option's default is unset.
VALUE_TYPES = {"str": str, "path": str, "int": int, "float": float, "bool": bool,
               "resolution": tuple[int, int], "kv_literal": dict[str, typing.Any],
               "kv_str": dict[str, str], "float_or_list": float | list[float],
               "steps_or_fraction": int | float, "path_list": list[str], "float_list": list[float],
               "str_list": list[str], "int_list": list[int]}


def expected_field(o):
    """(annotation, default) of option o's field, from the schema entry."""
    if o.name == "dataset_config":  # the loaded tables; the file's path is dataset_config_path
        return dict | None, None
    t = VALUE_TYPES[o.type]
    if o.type.startswith("kv"):  # a dict option is always a dict: unset is {}
        return t, {}
    return (t if o.default is not None else t | None), o.default


def conforms(value, t) -> bool:
    """isinstance for the annotations above (unions, list[X], dict[K, V], tuple[X, Y])."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (types.UnionType, typing.Union):
        return any(conforms(value, a) for a in args)
    if t is type(None):
        return value is None
    if t is typing.Any:
        return True
    if origin is list:
        return isinstance(value, list) and all(conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(conforms(k, args[0]) and conforms(v, args[1])
                                               for k, v in value.items())
    if origin is tuple:
        return isinstance(value, tuple) and len(value) == len(args) and \
            all(conforms(v, a) for v, a in zip(value, args))
    if t is float:
        return isinstance(value, float)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, t)


def test_every_option_is_a_field_with_the_schema_type_and_default():
    fields = {f.name: f for f in dataclasses.fields(Options)}
    assert set(fields) == {o.name for o in schema.OPTIONS} | {"script", "given",
                                                              "dataset_config_path", "ignored"}
    for o in schema.OPTIONS:
        f = fields[o.name]
        annotation, default = expected_field(o)
        assert f.type == annotation, o.name
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert value == default and type(value) is type(default), o.name
        assert conforms(value, annotation), o.name
    opts = parse_args("train_lora", BASE)  # what the parse leaves unset is the field's default
    for o in schema.OPTIONS:
        if o.name not in opts.given and o.name not in ("xformers", "sdpa"):  # (xformers -> sdpa)
            assert getattr(opts, o.name) == expected_field(o)[1], o.name


EVERY_TYPE = """
pretrained_model_name_or_path = "tiny-sd15"
train_data_dir = "data"
output_dir = "out"
resolution = [64, 96]
max_train_epochs = 2
network_dim = 8
network_alpha = 4
learning_rate = 1
unet_lr = 0.0001
text_encoder_lr = [1e-5, 2e-5]
lr_warmup_steps = "10%"
lr_decay_steps = 3
optimizer_args = { betas = [0.9, 0.99], weight_decay = 0.01 }
network_args = { conv_dim = 4, use_tucker = true }
lr_scheduler_args = ["timescale=3"]
base_weights = ["a.safetensors", "b.safetensors"]
base_weights_multiplier = "0.5,1"
noise_offset = 0
cache_latents = true
"""


@pytest.mark.parametrize("path", [None, *sorted(glob.glob(os.path.join(ROOT, "configs", "*.toml")))],
                         ids=lambda p: "every-type" if p is None else os.path.basename(p))
def test_parsed_values_have_their_field_types(path, tmp_path):
    if path is None:
        path = tmp_path / "run.toml"
        path.write_text(EVERY_TYPE)
        script = "train_lora"
    else:
        script = open(path).readline().split(":", 1)[1].strip()
    opts = parse_args(script, ["--config", str(path)])
    for f in dataclasses.fields(Options):
        if f.name in schema.OPTIONS_BY_NAME:
            assert conforms(getattr(opts, f.name), f.type), (f.name, getattr(opts, f.name))
    if path == tmp_path / "run.toml":
        assert opts.resolution == (64, 96) and opts.network_alpha == 4.0 and opts.learning_rate == 1.0
        assert opts.lr_warmup_steps == 0.1 and opts.network_args == {"conv_dim": "4", "use_tucker": "True"}


def test_options_refuse_writes_and_replace_makes_a_copy():
    opts = parse_args("train_lora", BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.seed = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.not_an_option = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        del opts.seed
    other = opts.replace(train_batch_size=3, resolution=(64, 128))
    assert (opts.train_batch_size, opts.resolution) == (1, (64, 64))  # unchanged
    assert (other.train_batch_size, other.resolution, other.given) == (3, (64, 128), opts.given)
    with pytest.raises(AttributeError, match="no option 'train_bach_size'; did you mean train_batch_size"):
        opts.replace(train_bach_size=3)
    with pytest.raises(AttributeError, match="did you mean network_alpha"):
        opts.network_alpah


def test_options_pickle_for_worker_processes():
    opts = parse_args("train_lora", BASE + ["--optimizer_args", "weight_decay=0.1"])
    again = pickle.loads(pickle.dumps(opts))
    assert again == opts and again is not opts and type(again) is Options
    assert again.to_dict() == opts.to_dict() and again.optimizer_args == {"weight_decay": 0.1}


def test_make_opts_equals_the_parse_of_the_same_values():
    parsed = parse_args("train_lora", BASE + ["--network_args", "conv_dim=4",
                                              "--text_encoder_lr", "1e-5", "2e-5"])
    built = make_opts(pretrained_model_name_or_path="tiny-sd15", train_data_dir="data",
                      resolution=64, output_dir="out", max_train_steps=3,
                      network_args={"conv_dim": 4}, text_encoder_lr=[1e-5, 2e-5])
    assert built == parsed
    assert make_opts().seed == 42 and make_opts().optimizer_args == {} and make_opts().given == frozenset()


def test_make_opts_checks_names_scripts_and_values():
    with pytest.raises(ConfigError, match="unknown option 'sed'; did you mean seed"):
        make_opts(sed=1)
    with pytest.raises(ConfigError, match="option network_dim is not accepted by finetune"):
        make_opts("finetune", network_dim=8)
    with pytest.raises(ConfigError, match="network_dim: 0 is out of range"):
        make_opts(network_dim=0)
    with pytest.raises(ConfigError, match="lr_scheduler: 'cosin' is not one of"):
        make_opts(lr_scheduler="cosin")
    assert make_opts(learning_rate=1).learning_rate == 1.0  # typed as a run file reads it


def test_no_module_reads_an_option_with_a_default_of_its_own():
    """Every option is a field with the schema's default: getattr(opts, "name", default) would
    repeat (and could contradict) the schema."""
    pattern = re.compile(r"getattr\((?:self\.|run\.|r\.)?opts, [^()]*,")
    found = []
    files = source_files()
    assert any(p.endswith(os.path.join("library", "run", "loop.py")) for p in files)  # sub-packages too
    for path in files:
        for i, line in enumerate(open(path, encoding="utf-8"), 1):
            if pattern.search(line):
                found.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_dataset_configs_batch_size_and_resolution_come_back_as_new_options(dataset, tmp_path):
    """plan_run resolves them before the run holds its options; the parsed ones stay as given."""
    from library.training.plan import plan_run

    cfg = tmp_path / "run.toml"
    cfg.write_text(f'pretrained_model_name_or_path = "tiny-sd15"\noutput_dir = "{tmp_path / "o"}"\n'
                   f'max_train_steps = 1\n[general]\nbatch_size = 2\n[[datasets]]\nresolution = 64\n'
                   f'[[datasets.subsets]]\nimage_dir = "{os.path.join(dataset, "2_sks shape")}"\n')
    parsed = parse_args("train_lora", ["--config", str(cfg)])
    opts, tset, plan = plan_run(parsed, processes=1)
    assert (parsed.train_batch_size, parsed.resolution) == (1, None)
    assert (opts.train_batch_size, opts.resolution, opts.given) == (2, (64, 64), parsed.given)
    assert plan.steps_per_epoch == 1 and len(tset.train_items) == 2  # 2 images, batch 2
