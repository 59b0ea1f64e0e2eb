"""The option schema and config loading: library/config/options.py, library/config/parse.py, configs/*.toml."""
import glob
import json
import logging
import os
import subprocess
import sys
import time

import pytest
import toml

from library.config import options as schema
from library.config.parse import ConfigError, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", "data",
        "--resolution", "64", "--output_dir", "out"]
STEPS = ["--max_train_steps", "3"]


@pytest.fixture
def write(tmp_path):
    def _write(text, name="run.toml"):
        p = tmp_path / name
        p.write_text(text)
        return str(p)
    return _write


def base_without(name):
    i = BASE.index(f"--{name}")
    return BASE[:i] + BASE[i + 2:]


def parse(*argv, script="train_lora"):
    return parse_args(script, list(argv))


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "sdtk" and r.levelno == logging.WARNING]


# --- unknown names, types, ranges ------------------------------------------------------------

def test_unknown_toml_key_names_file_line_and_suggestion(write):
    path = write('[additional_network_arguments]\nnetwork_alpha = 1\nnetwork_dimm = 8\n')
    with pytest.raises(ConfigError) as e:
        parse(*BASE, *STEPS, "--config", path)
    assert str(e.value) == f"{path}:3: network_dimm: unknown option 'network_dimm'; did you mean network_dim?"


def test_unknown_cli_flag_suggests():
    with pytest.raises(ConfigError, match=r"--lerning_rate: unknown option 'lerning_rate'; did you mean learning_rate\?"):
        parse(*BASE, *STEPS, "--lerning_rate", "1e-4")


def test_wrong_type_names_key_file_and_line(write):
    path = write('pretrained_model_name_or_path = "tiny-sd15"\n[training_arguments]\n\ntrain_batch_size = "2"\n')
    with pytest.raises(ConfigError) as e:
        parse(*BASE, *STEPS, "--config", path)
    assert str(e.value).startswith(f"{path}:4: train_batch_size: expected an integer")


@pytest.mark.parametrize("line, expect", [
    ("train_batch_size = 0", "train_batch_size: 0 is out of range: must be >= 1"),
    ("max_grad_norm = -1.0", "max_grad_norm: -1.0 is out of range: must be >= 0"),
    ("network_dropout = 1.0", "network_dropout: 1.0 is out of range: must be in [0, 1)"),
    ('mixed_precision = "fp8"', "mixed_precision: 'fp8' is not one of: no, fp16, bf16"),
    ('lr_scheduler = "cosine_restart"', "did you mean cosine_with_restarts?"),
    ('save_model_as = "diffusers"', "'diffusers' is not one of: safetensors, ckpt, pt"),
    ("resolution = 0", "0x0: width and height must be positive"),
    ("cache_latents = 1", "cache_latents: expected a boolean (true/false), got an integer (1)"),
    ("lr_warmup_steps = 2.5", "lr_warmup_steps: 2.5: a fraction must be below 1"),
])
def test_bad_values_are_one_line_errors_naming_the_key(write, line, expect):
    path = write(f"[t]\n{line}\n")
    name = line.split(" =")[0]
    with pytest.raises(ConfigError) as e:
        parse(*(base_without(name) if f"--{name}" in BASE else BASE), *STEPS, "--config", path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}:2: ") and expect in msg


def test_option_of_another_script_is_a_clear_error(write):
    with pytest.raises(ConfigError, match="option train_text_encoder is not accepted by train_lora"):
        parse(*BASE, *STEPS, "--train_text_encoder")
    path = write("[n]\nnetwork_dim = 4\n")
    with pytest.raises(ConfigError, match=r":2: network_dim: option network_dim is not accepted by train_dreambooth"):
        parse(*BASE, *STEPS, "--config", path, script="train_dreambooth")


def test_same_key_in_two_tables_or_by_alias_is_an_error(write):
    path = write("[a]\nseed = 1\n[b]\nseed = 2\n")
    with pytest.raises(ConfigError, match=r":4: seed: given twice \(also at line 2 in \[a\]\)"):
        parse(*BASE, *STEPS, "--config", path)
    path = write('caption_extension = ".txt"\n[b]\ncaption_extention = ".txt"\n', "alias.toml")
    with pytest.raises(ConfigError, match="given twice .*as caption_extension"):
        parse(*BASE, *STEPS, "--config", path)


def test_config_option_only_on_command_line(write):
    path = write('config_file = "other.toml"\n')
    with pytest.raises(ConfigError, match="config_file can only be given on the command line"):
        parse(*BASE, *STEPS, "--config", path)


def test_invalid_toml_and_missing_file(write, tmp_path):
    path = write("[a\nseed = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        parse(*BASE, *STEPS, "--config", path)
    with pytest.raises(ConfigError, match="config: no such file"):
        parse(*BASE, *STEPS, "--config", str(tmp_path / "missing.toml"))


# --- precedence and normalisation --------------------------------------------------------------

def test_cli_beats_toml_and_given_records_both(write):
    path = write("[additional_network_arguments]\nnetwork_dim = 8\nnetwork_alpha = 2\n"
                 "[training_arguments]\nmax_train_epochs = 5\n")
    opts = parse(*BASE, "--config", path, "--network_dim", "32", "--max_train_epochs", "1")
    assert (opts.network_dim, opts.network_alpha, opts.max_train_epochs) == (32, 2.0, 1)
    assert {"network_dim", "network_alpha", "max_train_epochs", "config", "resolution"} <= opts.given
    assert "seed" not in opts.given and opts.seed == 42


def test_config_file_alias_and_toml_suffix(write):
    path = write("[x]\nnetwork_dim = 12\n")
    assert parse(*BASE, *STEPS, "--config_file", path[:-len(".toml")]).network_dim == 12


def test_boolean_flags(write):
    opts = parse(*BASE, *STEPS)
    assert opts.sdpa is True and opts.cache_latents is False
    opts = parse(*BASE, *STEPS, "--cache_latents", "--sdpa=false", "--v2", "yes")
    assert (opts.cache_latents, opts.sdpa, opts.v2) == (True, False, True)
    with pytest.raises(ConfigError, match="--v2: expected true or false, got 'maybe'"):
        parse(*BASE, *STEPS, "--v2", "maybe")


def test_resolution_shapes():
    base = base_without("resolution")
    for value, expect in [("512", (512, 512)), ("512,768", (512, 768)), (" 640 , 384 ", (640, 384))]:
        assert parse(*base, *STEPS, "--resolution", value).resolution == expect


def test_resolution_toml_shapes(write):
    for i, (value, expect) in enumerate([("512", (512, 512)), ('"512,768"', (512, 768)), ("[768, 512]", (768, 512))]):
        path = write(f"resolution = {value}\n", f"r{i}.toml")
        args = base_without("resolution")
        assert parse(*args, *STEPS, "--config", path).resolution == expect


def test_optimizer_args_list_table_and_cli_give_the_same_dict(write):
    as_list = write('optimizer_args = ["weight_decay=0.01", "betas=0.9,0.999", "foreach=False", "name=x"]\n', "l.toml")
    as_table = write('[optimizer_args]\nweight_decay = 0.01\nbetas = [0.9, 0.999]\nforeach = false\nname = "x"\n', "t.toml")
    as_string = write('optimizer_args = "weight_decay=0.01 betas=0.9,0.999 foreach=False name=x"\n', "s.toml")
    expect = {"weight_decay": 0.01, "betas": (0.9, 0.999), "foreach": False, "name": "x"}
    for path in (as_list, as_table, as_string):
        assert parse(*BASE, *STEPS, "--config", path).optimizer_args == expect
    cli = parse(*BASE, *STEPS, "--optimizer_args", "weight_decay=0.01", "betas=0.9,0.999", "foreach=False", "name=x")
    assert cli.optimizer_args == expect
    assert parse(*BASE, *STEPS).optimizer_args == {}


def test_network_args_are_strings_in_every_shape(write):
    as_list = write('[net]\nnetwork_args = ["conv_dim=4", "algo=loha", "rank_dropout=0.1"]\n', "l.toml")
    as_table = write('[network_args]\nconv_dim = 4\nalgo = "loha"\nrank_dropout = 0.1\n', "t.toml")
    expect = {"conv_dim": "4", "algo": "loha", "rank_dropout": "0.1"}
    for path in (as_list, as_table):
        assert parse(*BASE, *STEPS, "--config", path).network_args == expect
    # a key given twice: the last value wins, as sd-scripts (the kohya_ss GUI writes use_tucker
    # twice for LyCORIS LoCon/LoHa)
    assert parse(*BASE, *STEPS, "--network_args", "conv_dim=4", "algo=loha", "conv_dim=8"
                 ).network_args == {"conv_dim": "8", "algo": "loha"}
    twice = write('network_args = ["use_tucker=False", "algo=locon", "use_tucker=True"]\n', "r.toml")
    assert parse(*BASE, *STEPS, "--config", twice).network_args == {"use_tucker": "True", "algo": "locon"}


def test_lr_warmup_forms():
    assert parse(*BASE, *STEPS, "--lr_warmup_steps", "10").lr_warmup_steps == 10
    assert parse(*BASE, *STEPS, "--lr_warmup_steps", "0.1").lr_warmup_steps == 0.1
    assert parse(*BASE, *STEPS, "--lr_warmup_steps", "5%").lr_warmup_steps == pytest.approx(0.05)


def test_text_encoder_lr_one_or_per_encoder_and_alias(write):
    assert parse(*BASE, *STEPS, "--text_encoder_lr", "1e-5").text_encoder_lr == 1e-5
    assert parse(*BASE, *STEPS, "--text_encoder_lr", "1e-5", "2e-5").text_encoder_lr == [1e-5, 2e-5]
    path = write("learning_rate_te = 3e-6\n")
    assert parse(*BASE, *STEPS, "--config", path, script="train_dreambooth").text_encoder_lr == 3e-6


def test_empty_path_and_optimizer_type_mean_unset(write):
    path = write('vae = ""\nnetwork_weights = ""\noptimizer_type = ""\n')
    opts = parse(*BASE, *STEPS, "--config", path)
    assert (opts.vae, opts.network_weights, opts.optimizer_type) == (None, None, "AdamW")


# --- rules between options ---------------------------------------------------------------------

def test_neither_steps_nor_epochs_names_both():
    with pytest.raises(ConfigError) as e:
        parse(*BASE)
    assert "max_train_steps" in str(e.value) and "max_train_epochs" in str(e.value)


def test_both_steps_and_epochs_epochs_win_with_warning(caplog):
    opts = parse(*BASE, "--max_train_steps", "100", "--max_train_epochs", "2")
    assert (opts.max_train_epochs, opts.max_train_steps) == (2, None)
    assert any("max_train_epochs wins" in m for m in warnings_of(caplog))


def test_unet_only_and_text_encoder_only_exclude_each_other():
    with pytest.raises(ConfigError, match="exclude each other"):
        parse(*BASE, *STEPS, "--network_train_unet_only", "--network_train_text_encoder_only")


@pytest.mark.parametrize("drop, expect", [
    ("--pretrained_model_name_or_path", "pretrained_model_name_or_path is required"),
    ("--train_data_dir", "train_data_dir is required"),
    ("--resolution", "resolution is required"),
    ("--output_dir", "output_dir is required"),
])
def test_required_options(drop, expect):
    with pytest.raises(ConfigError, match=expect):
        parse(*base_without(drop[2:]), *STEPS)


def test_dry_run_needs_no_output_dir():
    assert parse(*base_without("output_dir"), *STEPS, "--dry_run").output_dir is None


def test_bucket_rules():
    with pytest.raises(ConfigError, match="min_bucket_reso .* is larger than max_bucket_reso"):
        parse(*BASE, *STEPS, "--min_bucket_reso", "512", "--max_bucket_reso", "256")
    # not a multiple of 8: accepted here, rounded up by the buckets (tests/data/test_buckets.py)
    assert parse(*BASE, *STEPS, "--bucket_reso_steps", "1").bucket_reso_steps == 1
    # not a multiple of the step: accepted here, rounded by the buckets (tests/data/test_buckets.py)
    assert parse(*BASE, *STEPS, "--max_bucket_reso", "1000").max_bucket_reso == 1000


# --- sd-scripts compatibility ------------------------------------------------------------------

SDSCRIPTS_CONFIG = """\
[model_arguments]
pretrained_model_name_or_path = "tiny-sd15"
v2 = false
v_parameterization = false

[additional_network_arguments]
network_module = "networks.lora"
network_dim = 16
network_alpha = 8
network_args = ["conv_dim=4", "conv_alpha=2"]
network_train_unet_only = true
unet_lr = 1e-4
no_metadata = false

[optimizer_arguments]
optimizer_type = "AdamW8bit"
learning_rate = 1e-4
optimizer_args = ["weight_decay=0.1"]
lr_scheduler = "cosine"
lr_warmup_steps = 50

[dataset_arguments]
train_data_dir = "train"
reg_data_dir = ""
resolution = "512,512"
caption_extension = ".txt"
enable_bucket = true
cache_latents = true
shuffle_caption = false
flip_aug = false
keep_tokens = 0

[training_arguments]
output_dir = "output"
output_name = "my_lora"
save_precision = "fp16"
save_every_n_epochs = 1
train_batch_size = 4
max_train_steps = 1600
max_train_epochs = 10
seed = 1
mixed_precision = "bf16"
gradient_checkpointing = true
xformers = false
sdpa = true
noise_offset = 0.0
min_snr_gamma = 0
full_bf16 = false
skip_cache_check = true
log_with = "tensorboard"

[saving_arguments]
save_model_as = "safetensors"
"""


def test_sd_scripts_shaped_config_loads(write, caplog):
    opts = parse_args("train_lora", ["--config", write(SDSCRIPTS_CONFIG)])
    assert (opts.network_dim, opts.network_alpha, opts.resolution, opts.train_batch_size) == (16, 8.0, (512, 512), 4)
    assert opts.network_args == {"conv_dim": "4", "conv_alpha": "2"}
    assert (opts.optimizer_type, opts.lr_scheduler, opts.lr_warmup_steps, opts.reg_data_dir) == ("AdamW8bit", "cosine", 50, None)
    assert (opts.max_train_epochs, opts.max_train_steps, opts.mixed_precision) == (10, None, "bf16")
    assert opts.ignored == {"skip_cache_check": True}
    assert opts.log_with == "tensorboard"
    warned = warnings_of(caplog)
    assert "option skip_cache_check has no effect in this toolkit (cache speed only)" in warned
    assert not any("full_bf16" in m or "noise_offset" in m for m in warned)  # off values: silent


def test_no_effect_name_warns_once(write, caplog):
    path = write("[t]\nskip_cache_check = true\nmax_validation_steps = 1\n")
    parse(*BASE, *STEPS, "--config", path, "--skip_cache_check", "--mem_eff_attn")
    warned = warnings_of(caplog)
    for name in ("skip_cache_check", "max_validation_steps", "mem_eff_attn"):
        assert sum(m.startswith(f"option {name} has no effect in this toolkit") for m in warned) == 1


@pytest.mark.parametrize("line", ["initial_step = 3", "face_crop_aug_range = \"0.2,0.5\"",
                                  "lowram = true"])
def test_dangerous_not_yet_options_are_rejected(write, line):
    name = line.split(" =")[0]
    path = write(f"[training_arguments]\n{line}\n")
    with pytest.raises(ConfigError) as e:
        parse(*BASE, *STEPS, "--config", path)
    assert str(e.value).startswith(f"{path}:2: {name}: option {name} is not supported yet (")


def test_every_sd_scripts_name_off_is_silent_on_is_warned_or_rejected(caplog):
    for n in schema.SD_SCRIPTS_NAMES:
        off = [v for v in n.off if v is not None]
        off_argv = {"flag": [f"--{n.name}=false"], "list": [f"--{n.name}"],
                    "value": [f"--{n.name}", str(off[0])] if off else []}[n.kind]
        if off_argv:
            caplog.clear()
            parse(*BASE, *STEPS, *off_argv)
            assert not any(n.name in m for m in warnings_of(caplog)), n.name
        on_argv = {"flag": [f"--{n.name}"], "value": [f"--{n.name}", "7"], "list": [f"--{n.name}", "a"]}[n.kind]
        caplog.clear()
        if n.action == "reject":
            with pytest.raises(ConfigError, match=f"option {n.name} is not supported yet"):
                parse(*BASE, *STEPS, *on_argv)
        else:
            parse(*BASE, *STEPS, *on_argv)
            assert [m for m in warnings_of(caplog) if n.name in m] == \
                [f"option {n.name} has no effect in this toolkit ({n.why})"]


# The option names of sd-scripts' train_network.py (setup_parser and the library functions it
# calls), transcribed from kohya-ss/sd-scripts: each must be known here.
TRAIN_NETWORK_NAMES = """
console_log_level console_log_file console_log_simple v2 v_parameterization pretrained_model_name_or_path
tokenizer_cache_dir metadata_title metadata_author metadata_description metadata_license metadata_tags
metadata_usage_hint metadata_thumbnail metadata_merged_from metadata_trigger_phrase metadata_preprocessor
metadata_is_negative_embedding train_data_dir cache_info shuffle_caption caption_separator caption_extension
caption_extention keep_tokens keep_tokens_separator secondary_separator enable_wildcard caption_prefix
caption_suffix color_aug flip_aug face_crop_aug_range random_crop debug_dataset resolution cache_latents
vae_batch_size cache_latents_to_disk skip_cache_check enable_bucket min_bucket_reso max_bucket_reso
bucket_reso_steps bucket_no_upscale resize_interpolation token_warmup_min token_warmup_step alpha_mask
dataset_class caption_dropout_rate caption_dropout_every_n_epochs caption_tag_dropout_rate reg_data_dir
in_json dataset_repeats output_dir output_name huggingface_repo_id huggingface_repo_type
huggingface_path_in_repo huggingface_token huggingface_repo_visibility save_state_to_huggingface
resume_from_huggingface async_upload save_precision save_every_n_epochs save_every_n_steps
save_n_epoch_ratio save_last_n_epochs save_last_n_epochs_state save_last_n_steps save_last_n_steps_state
save_state save_state_on_train_end resume train_batch_size max_token_length mem_eff_attn torch_compile
dynamo_backend xformers sdpa vae max_train_steps max_train_epochs max_data_loader_n_workers
persistent_data_loader_workers seed gradient_checkpointing gradient_accumulation_steps mixed_precision
full_fp16 full_bf16 fp8_base ddp_timeout ddp_gradient_as_bucket_view ddp_static_graph clip_skip logging_dir
log_with log_prefix log_tracker_name wandb_run_name log_tracker_config wandb_api_key log_config noise_offset
noise_offset_random_strength multires_noise_iterations ip_noise_gamma ip_noise_gamma_random_strength
multires_noise_discount adaptive_noise_scale zero_terminal_snr min_timestep max_timestep loss_type
huber_schedule huber_c huber_scale lowram highvram sample_every_n_steps sample_at_first sample_every_n_epochs
sample_prompts sample_sampler config_file output_config prior_loss_weight conditioning_data_dir masked_loss
deepspeed zero_stage offload_optimizer_device offload_optimizer_nvme_path offload_param_device
offload_param_nvme_path zero3_init_flag zero3_save_16bit_model fp16_master_weights_and_gradients
optimizer_type use_8bit_adam use_lion_optimizer learning_rate max_grad_norm optimizer_args lr_scheduler_type
lr_scheduler_args lr_scheduler lr_warmup_steps lr_decay_steps lr_scheduler_num_cycles lr_scheduler_power
fused_backward_pass lr_scheduler_timescale lr_scheduler_min_lr_ratio dataset_config min_snr_gamma
scale_v_pred_loss_like_noise_pred v_pred_like_loss debiased_estimation_loss weighted_captions
cpu_offload_checkpointing no_metadata save_model_as unet_lr text_encoder_lr fp8_base_unet network_weights
network_module network_dim network_alpha network_dropout network_args network_train_unet_only
network_train_text_encoder_only training_comment dim_from_weights scale_weight_norms base_weights
base_weights_multiplier no_half_vae skip_until_initial_step initial_epoch initial_step validation_seed
validation_split validate_every_n_steps validate_every_n_epochs max_validation_steps
cache_text_encoder_outputs cache_text_encoder_outputs_to_disk disable_mmap_load_safetensors
""".split()


def test_every_train_network_name_is_known():
    known = set(schema.OPTIONS_BY_NAME) | set(schema.ALIASES) | set(schema.SD_SCRIPTS_BY_NAME)
    assert [n for n in TRAIN_NETWORK_NAMES if n not in known] == []


# --- dataset config ----------------------------------------------------------------------------

DATASET_TABLES = '[general]\nenable_bucket = true\n\n[[datasets]]\nresolution = 64\n\n[[datasets.subsets]]\nimage_dir = "img"\nnum_repeats = 3\n'


def test_inline_dataset_config_is_kept_raw(write):
    path = write('pretrained_model_name_or_path = "tiny-sd15"\noutput_dir = "o"\nmax_train_steps = 1\n' + DATASET_TABLES)
    opts = parse_args("train_lora", ["--config", path])
    assert opts.dataset_config == {"general": {"enable_bucket": True},
                                   "datasets": [{"resolution": 64, "subsets": [{"image_dir": "img", "num_repeats": 3}]}]}
    assert opts.dataset_config_path == path and opts.train_data_dir is None and opts.resolution is None


def test_separate_dataset_config_file_and_not_both(write):
    ds = write(DATASET_TABLES, "ds.toml")
    opts = parse_args("train_lora", ["--pretrained_model_name_or_path", "tiny-sd15", "--output_dir", "o",
                                     "--max_train_epochs", "1", "--dataset_config", ds])
    assert opts.dataset_config["datasets"][0]["subsets"][0]["num_repeats"] == 3 and opts.dataset_config_path == ds
    run = write('[x]\ndataset_config = "' + ds + '"\n' + DATASET_TABLES)
    with pytest.raises(ConfigError, match="the dataset config is given twice"):
        parse(*BASE, *STEPS, "--config", run)
    bad = write("[general]\nx = 1\n[training]\nseed = 1\n", "bad_ds.toml")
    with pytest.raises(ConfigError, match="unexpected key 'training' in a dataset config"):
        parse(*BASE, *STEPS, "--dataset_config", bad)


# --- the Options object ------------------------------------------------------------------------

def test_to_dict_round_trips_through_toml(write):
    path = write(SDSCRIPTS_CONFIG.replace('train_data_dir = "train"\n', "") + DATASET_TABLES)
    opts = parse_args("train_lora", ["--config", path, "--text_encoder_lr", "1e-5", "2e-5",
                                     "--optimizer_args", "betas=0.9,0.99", "eps=1e-8"])
    again = parse_args("train_lora", ["--config", write(toml.dumps(opts.to_dict()), "resolved.toml")])
    assert again.to_dict() == opts.to_dict()
    assert again.optimizer_args == {"betas": (0.9, 0.99), "eps": 1e-8}
    json.dumps(opts.to_dict())  # plain types only


def test_every_option_is_an_attribute_and_typos_are_explained():
    opts = parse(*BASE, *STEPS, script="finetune")
    assert opts.script == "finetune" and opts.network_dim == 4 and opts.prior_loss_weight == 1.0
    assert "network_dim" not in opts.to_dict()
    with pytest.raises(AttributeError, match="did you mean network_alpha"):
        opts.network_alpah


# --- shipped configs, docs and --help ----------------------------------------------------------

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.toml")))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_shipped_config_loads(path):
    first = open(path).readline()
    assert first.startswith("# script: "), f"{path} must start with '# script: <entry script>'"
    opts = parse_args(first.split(":", 1)[1].strip(), ["--config", path])
    assert opts.pretrained_model_name_or_path


def test_shipped_configs_exist():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"quickstart_lora.toml", "sdscripts_style_lora.toml", "dreambooth_tiny.toml"} <= names


def test_options_doc_is_generated_from_the_schema():
    with open(os.path.join(ROOT, "docs", "OPTIONS.md")) as f:
        assert f.read() == schema.render_markdown(), "regenerate: python -m library.config.options > docs/OPTIONS.md"


def test_help_is_fast_and_imports_no_torch():
    code = ("import sys, time, io, contextlib\n"
            "t = time.perf_counter()\n"
            "from library.config.parse import parse_args\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            "    try:\n        parse_args('train_lora', ['--help'])\n"
            "    except SystemExit as e:\n        code = e.code\n"
            "print(code, 'torch' in sys.modules, time.perf_counter() - t)\n"
            "print(out.getvalue())\n")
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    wall = time.perf_counter() - start
    assert res.returncode == 0, res.stderr
    head, _, help_text = res.stdout.partition("\n")
    exit_code, torch_imported, _ = head.split()
    assert exit_code in ("0", "None") and torch_imported == "False"
    assert wall < 1.0, f"--help took {wall:.2f} s"
    assert "--network_dim" in help_text and "Network (LoRA):" in help_text and "--config_file" in help_text
    assert "--lowram" not in help_text  # sd-scripts-only names are hidden from --help
