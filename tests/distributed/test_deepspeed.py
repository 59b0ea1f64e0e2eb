"""``deepspeed`` (library/distributed/deepspeed_zero.py): what is checked before any weight loads, and how an Accelerate
DeepSpeed launch becomes the run's options. The training itself (ZeRO stages 0-2 on 1 and 2
gloo processes, resume, full fine-tune) is in tests/distributed/test_multiprocess.py."""
import json

import pytest

from library.distributed import deepspeed_zero as zero


def _args(dataset, tmp_path, *extra):
    return ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
            "--output_dir", str(tmp_path / "out"), "--resolution", "64", "--max_train_steps", "1",
            *extra]


@pytest.mark.parametrize("script, extra, message", [
    ("train_lora", ["--deepspeed", "--fused_backward_pass", "--optimizer_type", "AdamW"],
     "deepspeed cannot be combined with fused_backward_pass: ZeRO owns the gradients"),
    ("train_dreambooth", ["--deepspeed", "--fused_optimizer_groups", "2"],
     "deepspeed cannot be combined with fused_optimizer_groups"),
    ("train_lora", ["--deepspeed", "--zero_stage", "3"],
     "zero_stage 3 (sharded weights) is not supported; for a full fine-tune with sharded weights "
     "use the fsdp option"),
    ("train_lora", ["--deepspeed", "--optimizer_type", "Adafactor"],
     "optimizer_type Adafactor cannot be used with deepspeed: ZeRO hands the optimizer flat slices"),
    ("train_lora", ["--deepspeed", "--optimizer_type", "Adafactor", "--optimizer_args",
                    "relative_step=False", "scale_parameter=False", "warmup_init=False"],
     "optimizer_type Adafactor cannot be used with deepspeed: ZeRO hands the optimizer flat slices"),
    ("train_lora", ["--deepspeed", "--optimizer_type", "Prodigy"],
     "optimizer_type Prodigy cannot be used with deepspeed"),
    ("train_lora", ["--deepspeed", "--offload_optimizer_device", "nvme"],
     "offload_optimizer_device 'nvme' is not supported"),
    ("train_lora", ["--deepspeed", "--zero_stage", "0", "--offload_optimizer_device", "cpu"],
     "offload_optimizer_device cpu needs zero_stage 1 or 2"),
    ("train_lora", ["--deepspeed", "--offload_param_device", "cpu"],
     "offload_param_device is for ZeRO stage 3"),
    ("train_dreambooth", ["--deepspeed", "--fsdp"], "deepspeed and fsdp cannot be combined"),
    ("train_lora", ["--deepspeed", "--full_bf16", "--mixed_precision", "bf16"],
     "deepspeed cannot be combined with full_bf16"),
    ("train_dreambooth", ["--deepspeed", "--train_text_encoder", "--stop_text_encoder_training", "1"],
     "deepspeed cannot be combined with stop_text_encoder_training"),
    ("train_lora", ["--zero_stage", "1"], "zero_stage is only used with deepspeed"),
    ("train_lora", ["--offload_optimizer_device", "cpu"],
     "offload_optimizer_device is only used with deepspeed"),
])
def test_impossible_combinations_are_rejected_before_loading(run_script, dataset, tmp_path,
                                                             no_weight_loading, script, extra,
                                                             message):
    rc, _, err = run_script(script, _args(dataset, tmp_path, *extra))
    assert rc == 2 and message in err, err[-2000:]
    assert len([ln for ln in err.splitlines() if ln.lower().startswith("error")]) == 1


def test_accepted_options_reach_loading(run_script, dataset, tmp_path, no_weight_loading):
    """The supported settings pass every check (and would load weights)."""
    for extra in (["--deepspeed"], ["--deepspeed", "--zero_stage", "1", "--optimizer_type",
                                    "AdamW8bit", "--offload_optimizer_device", "cpu"],
                  ["--zero_stage", "2"]):  # sd-scripts' default in a saved config: not an error
        with pytest.raises(AssertionError, match="weights were loaded"):
            run_script("train_lora", _args(dataset, tmp_path, *extra))


def test_elementwise_optimizers():
    import torch
    from transformers.optimization import Adafactor

    from library.training.optim import resolve_optimizer_class

    for name in ("AdamW", "AdamW8bit", "PagedAdamW8bit", "Lion8bit", "Lion", "SGDNesterov",
                 "SGDNesterov8bit", "torch.optim.Adam"):
        assert zero.elementwise_reason(resolve_optimizer_class(name)[0]) is None, name
    for cls in (Adafactor, torch.optim.LBFGS):
        assert zero.elementwise_reason(cls)
    for name in ("Prodigy", "AdamWScheduleFree", "bitsandbytes.optim.LAMB"):
        assert zero.elementwise_reason(resolve_optimizer_class(name)[0]), name


def _opts(*extra):
    from library.config.parse import parse_args

    return parse_args("train_lora", ["--pretrained_model_name_or_path", "tiny-sd15",
                                     "--train_data_dir", "d", "--output_dir", "o",
                                     "--resolution", "64", "--max_train_steps", "1", *extra])


def test_accelerate_deepspeed_launch_becomes_the_options(monkeypatch, tmp_path):
    """``accelerate launch --use_deepspeed --zero_stage 1 --offload_optimizer_device cpu`` sets
    these variables; they turn deepspeed on with those values. The run's own value wins only
    where the launch says nothing; two different values are an error naming both."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "1")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    opts = zero.resolve_options(_opts())
    assert (opts.deepspeed, opts.zero_stage, opts.offload_optimizer_device) == (True, 1, "cpu")
    opts = _opts("--zero_stage", "0")
    with pytest.raises(zero.DeepSpeedError, match=r"zero_stage: the run's options say 0, the "
                                                  r"Accelerate config \(ACCELERATE_DEEPSPEED_ZERO_STAGE\) says 1"):
        zero.resolve_options(opts)


def test_deepspeed_config_file(monkeypatch, tmp_path):
    """An Accelerate config's deepspeed_config_file: its stage and offload are read, its other
    ZeRO settings kept in DeepSpeed's config, "auto" filled from the run; an optimizer section,
    or a batch size other than the run's, is an error naming the file."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 1000000, "overlap_comm": False,
                              "allgather_bucket_size": "auto"}}))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    opts = _opts("--train_batch_size", "3", "--gradient_accumulation_steps", "2",
                 "--max_grad_norm", "0.5", "--mixed_precision", "bf16")
    opts = zero.resolve_options(opts)
    assert (opts.deepspeed, opts.zero_stage, opts.deepspeed_config_file) == (True, 1, str(path))
    cfg = zero.ds_config(opts, processes=2)
    assert cfg["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000000,
                                        "overlap_comm": False}
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"],
            cfg["train_batch_size"], cfg["gradient_clipping"]) == (3, 2, 12, 0.5)
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}

    for content, message in (({"train_micro_batch_size_per_gpu": 4},
                              "train_micro_batch_size_per_gpu is 4, the run's train_batch_size says 3"),
                             ({"train_batch_size": 6}, "train_batch_size is 6, the run's "
                              "train_batch_size x processes x gradient_accumulation_steps says 12"),
                             ({"gradient_clipping": 1.0},
                              "gradient_clipping is 1.0, the run's max_grad_norm says 0.5"),
                             ({"fp16": {"enabled": True}},
                              "fp16.enabled is True, the run's mixed_precision says False")):
        path.write_text(json.dumps(content))
        with pytest.raises(zero.DeepSpeedError, match=f"deepspeed_config_file {path}: {message}"):
            zero.ds_config(opts, processes=2)
    path.write_text(json.dumps({"train_batch_size": 12, "gradient_clipping": 0.5,
                                "bf16": {"enabled": True}, "fp16": {"enabled": "auto"}}))
    assert zero.ds_config(opts, processes=2)["train_batch_size"] == 12  # the same values: fine
    path.write_text(json.dumps({"optimizer": {"type": "Adam"}}))
    with pytest.raises(zero.DeepSpeedError, match=f'{path}: remove "optimizer"'):
        zero.resolve_options(_opts())


def test_missing_deepspeed_is_named(run_script, dataset, tmp_path, no_weight_loading, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    rc, _, err = run_script("train_lora", _args(dataset, tmp_path, "--deepspeed"))
    assert rc == 2 and "deepspeed is not installed: pip install deepspeed" in err, err[-2000:]


def test_dry_run_says_the_memory_estimate_does_not_cover_deepspeed(run_script, dataset, tmp_path):
    rc, out, err = run_script("train_lora", _args(dataset, tmp_path, "--deepspeed", "--dry_run"))
    assert rc == 0, err[-2000:]
    assert "step plan:" in out
    assert "memory estimate: not available (deepspeed: ZeRO's flat parameter, gradient and " \
           "bucket buffers are not modeled)" in out


def test_config_file_from_the_options(tmp_path):
    """deepspeed_config_file set in the run's options (no Accelerate launch): its stage is read
    the same way, and a different stage in the options is an error naming both."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    opts = zero.resolve_options(_opts("--deepspeed", "--deepspeed_config_file", str(path)))
    assert opts.zero_stage == 1
    opts = _opts("--deepspeed", "--zero_stage", "0", "--deepspeed_config_file", str(path))
    with pytest.raises(zero.DeepSpeedError, match=f"zero_stage: the run's options say 0, {path}: "
                                                  "zero_optimization.stage says 1"):
        zero.resolve_options(opts)
