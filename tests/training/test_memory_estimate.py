"""The memory estimate (library/training/memory_estimate.py): its counted parts equal what a real run
holds, it loads no weights, and (slow) its total is within 15% of measured peaks."""
import contextlib
import dataclasses
import math
import os

import pytest
import torch

from library.training import memory_estimate as me
from tests.helpers import make_opts


@pytest.fixture(autouse=True, scope="module")
def _homes_imported():
    """The families' homes import their model code on first use (registry.home), and with it the
    names they bind from safetensors: import them before a test replaces safetensors' readers, so
    that no home keeps a refusing reader for the rest of the session."""
    from library.models.families import registry

    for name in registry.FLOW_FAMILIES:
        registry.home(name)


def refuse_tensor_reads(patch, family: str) -> None:
    """Any read of tensor data fails the test (the estimate reads headers and configs only);
    the family detection, which reads the keys, answers ``family``. ``patch``: a monkeypatch."""
    import safetensors
    import safetensors.torch

    def refuse(*a, **k):
        raise AssertionError("tensor data was read")

    for mod, name in ((safetensors, "safe_open"), (safetensors.torch, "load_file"), (safetensors.torch, "safe_open")):
        patch.setattr(mod, name, refuse)
    patch.setattr("library.models.flow_family.family_before_loading", lambda src: family)

# shapes that exercise every rule: vectors, a small matrix (< bitsandbytes' 4096-element 8-bit
# minimum), matrices and 3x3 / 1x1 conv kernels (Adafactor factors only the last two dims), and a
# zero-initialised matrix (a LoRA up weight: Prodigy keeps a 0-dim copy of it)
SHAPES = [(7,), (5000,), (40, 40), (128, 64), (64, 32, 3, 3), (96, 48, 1, 1), (300, 17)]
ZERO = 6  # index of the zero-initialised one


def _opts(optimizer_type, *args, **extra):
    return make_opts(optimizer_type=optimizer_type, optimizer_args=list(args), learning_rate=1e-3,
                     **extra)


def state_bytes(optimizers) -> int:
    """Bytes of the distinct tensors in the optimizers' state (shared maps counted once each)."""
    seen: set = set()
    return sum(me.tensor_bytes([o.state[p] for g in o.param_groups for p in g["params"]
                                if p in o.state], seen) for o in optimizers)


@pytest.mark.parametrize("optimizer_type,args", [
    ("AdamW", ()), ("AdamW", ("amsgrad=True",)), ("AdamW8bit", ()), ("PagedAdamW8bit", ()),
    ("AdamW8bit", ("min_8bit_size=100",)), ("Lion", ()), ("Lion8bit", ()), ("SGDNesterov", ()),
    ("SGDNesterov8bit", ()), ("Adafactor", ()), ("Adafactor", ("beta1=0.9",)),
    ("Adafactor", ("relative_step=False", "scale_parameter=False", "warmup_init=False")),
    ("Prodigy", ()),
    ("AdamWScheduleFree", ()), ("RAdamScheduleFree", ()), ("torch.optim.SGD", ()),
    ("torch.optim.RMSprop", ()), ("torch.optim.Adagrad", ()), ("PagedAdamW", ()),
    ("PagedAdamW32bit", ()), ("PagedLion8bit", ()), ("SGDScheduleFree", ()), ("DAdaptAdam", ()),
    ("DAdaptation", ()), ("DAdaptAdaGrad", ()), ("DAdaptAdan", ()), ("DAdaptAdanIP", ()),
    ("DAdaptLion", ()), ("DAdaptSGD", ()), ("RMSprop", ()),
])
def test_optimizer_state_rule_equals_the_real_state_after_one_step(optimizer_type, args):
    from library.training.optim import build_optimizer

    if optimizer_type.startswith("DAdapt"):
        pytest.importorskip("dadaptation")
    opts = _opts(optimizer_type, *args)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s) if i == ZERO else torch.randn(s))
              for i, s in enumerate(SHAPES)]
    opt = build_optimizer(optimizer_type, opts.optimizer_args, [{"params": params}], 1e-3)
    if hasattr(opt, "train"):
        opt.train()  # schedule-free: the training iterate, as the stepper does
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    rule = me.optimizer_rule(opts)
    expected = sum(rule.param_bytes(s, i == ZERO) for i, s in enumerate(SHAPES)) + \
        rule.per_optimizer_bytes(SHAPES)
    assert state_bytes([opt]) == expected, rule.describe()
    assert expected > 0 or optimizer_type == "torch.optim.SGD"  # SGD without momentum: none


def test_adafactor_factors_only_the_last_two_dimensions():
    rule = me.optimizer_rule(_opts("Adafactor"))
    # (out, in, 3, 3): rows out*in*3 + columns out*in*3, against out*in*9 unfactored
    assert rule.param_bytes((320, 320, 3, 3)) == 4 * (320 * 320 * 3 * 2) + 4
    assert rule.param_bytes((320,)) == 4 * 320 + 4


# -- through the trainer: the estimate of a run against the run itself ---------------------------

def _components_of(run):
    b = run.parts.bundle
    parts = {"unet": b.unet, "vae": b.vae, "text_encoder": b.text_encoders[0]}
    if len(b.text_encoders) > 1:
        parts["text_encoder_2"] = b.text_encoders[1]
    if len(b.text_encoders) > 2:  # SD3's T5-XXL
        parts["text_encoder_3"] = b.text_encoders[2]
    if run.parts.method.network is not None:
        parts["network"] = run.parts.method.network
    return parts


def _real_lines(run) -> dict:
    """(component, trained, dtype) -> parameter count, from the run's own modules."""
    trained = {id(p) for p in run.parts.params if p.requires_grad}
    out: dict = {}
    for name, module in _components_of(run).items():
        for p in module.parameters():
            k = (name, id(p) in trained, str(p.dtype).replace("torch.", ""))
            out[k] = out.get(k, 0) + p.numel()
    return out


def _optimizers(stepper):
    opts = getattr(stepper, "optimizers", None) or [stepper.optimizer]
    return [getattr(o, "optimizer", o) for o in opts]


def assert_estimate_counts_the_run(est, run, stepping: str = "plain") -> None:
    """The estimate's parameters (per component, trained or frozen, dtype), trained parameters,
    optimizer state and gradients against the run's own; ``stepping``: "plain" (all gradients at
    once), "fused" (the largest parameter's) or "groups" (the largest unit's)."""
    got = {(line.component, line.trained, line.dtype): line.numel for line in est.params}
    assert got == _real_lines(run)
    trained = [p for p in run.parts.params if p.requires_grad]
    assert est.trained_params == sum(p.numel() for p in trained) > 0
    assert est.optimizer == state_bytes(_optimizers(run.parts.stepper))
    nbytes = [p.numel() * p.element_size() for p in trained]
    if stepping == "fused":
        assert est.gradients == max(nbytes)
    elif stepping == "groups":
        assert est.gradients == max(sum(p.numel() * p.element_size() for p in u) for u in run.parts.stepper.units)
    else:
        assert est.gradients == sum(nbytes)


def _stepping(case: str) -> str:
    """The stepping a case's name says (the cases name "fused" and "groups")."""
    return "fused" if "fused" in case else "groups" if "groups" in case else "plain"


CASES = {
    "lora-conv-adamw8bit-fused": ("train_lora", "tiny-sd15", [
        "--network_dim", "4", "--network_args", "conv_dim=2", "--optimizer_type", "AdamW8bit",
        "--fused_backward_pass", "--cache_latents"]),
    "full-te-bf16-adafactor-groups": ("train_dreambooth", "tiny-sd15", [
        "--train_text_encoder", "--mixed_precision", "bf16", "--full_bf16",
        "--optimizer_type", "Adafactor", "--fused_optimizer_groups", "3"]),
    "sdxl-lora-unet-lion-cached": ("train_lora", "tiny-sdxl", [
        "--network_dim", "4", "--network_train_unet_only", "--optimizer_type", "Lion",
        "--cache_latents", "--cache_text_encoder_outputs"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_estimate_counts_what_the_run_holds(case, train, dataset, tmp_path, monkeypatch):
    from library.config.options import METHOD_OF_SCRIPT
    from library.config.parse import parse_args

    script, model, extra = CASES[case]
    argv = ["--pretrained_model_name_or_path", model, "--train_data_dir", dataset,
            "--output_dir", str(tmp_path / "o"), "--resolution", "64", "--max_train_steps", "1",
            "--learning_rate", "1e-3", "--max_grad_norm", "0", *extra]
    # the estimate --dry_run prints for these options, against the run itself
    est = me.estimate(parse_args(script, [*argv, "--dry_run"]), METHOD_OF_SCRIPT[script])
    rc, out, err, run = train(script, argv)
    assert rc == 0, err
    assert "memory estimate" not in out  # a real run does not spend the time (dry_run only)
    assert_estimate_counts_the_run(est, run, _stepping(case))
    if "groups" in case:
        assert len(run.parts.stepper.units) == 3
    # frozen parts that the run released after caching are not counted, the others are
    released = {"vae"} if "--cache_latents" in extra else set()
    if "--cache_text_encoder_outputs" in extra:
        released |= {"text_encoder", "text_encoder_2"}
    for line in est.params:
        assert line.resident == (line.trained or line.component not in released), line


# -- activations: the fake forward saves what the real forward saves -----------------------------

def _saved_bytes_real_and_fake(opts, method_name):
    from library.models import loading as models
    from library.training.methods import FullMethod, NetworkMethod

    real = models.load_model_bundle(opts.pretrained_model_name_or_path)
    comps = {"unet": real.unet, "vae": real.vae, "text_encoder": real.text_encoders[0]}
    method = NetworkMethod(opts, real) if method_name == "lora" else FullMethod(opts, real)
    method.setup()
    counted_real = me.count_activations(opts, real.family, comps, method, contextlib.nullcontext(),
                                        (64, 64), 2)
    est = me.estimate(opts, method_name)
    return counted_real, est


@pytest.mark.parametrize("gc", [False, True])
def test_fake_forward_saves_what_the_real_forward_saves(gc):
    from library.config.parse import parse_args

    opts = parse_args("train_lora", ["--pretrained_model_name_or_path", "tiny-sd15",
                                     "--train_data_dir", "unused", "--resolution", "64",
                                     "--train_batch_size", "2", "--max_train_steps", "1",
                                     "--dry_run", "--network_dim", "4"]
                      + (["--gradient_checkpointing"] if gc else []))
    real, est = _saved_bytes_real_and_fake(opts, "lora")
    assert real.saved > 0
    # the same saved tensors, up to a few scalar constants (measured: 0 to 24 bytes of 1.9 MB,
    # varying with what ran before in the process)
    assert est.activations == pytest.approx(
        int(me.ACTIVATION_FACTOR * (real.saved + real.recompute)) + real.weight_copies, abs=256)
    if gc:
        assert real.recompute > 0


def test_activations_grow_with_batch_and_resolution_and_shrink_with_checkpointing():
    from library.config.parse import parse_args

    def act(*extra):
        o = parse_args("train_dreambooth", ["--pretrained_model_name_or_path", "tiny-sd15",
                                            "--train_data_dir", "unused", "--max_train_steps", "1",
                                            "--dry_run", *extra])
        return me.estimate(o, "dreambooth").activations

    a1, a2 = act("--resolution", "64"), act("--resolution", "64", "--train_batch_size", "2")
    assert a2 == pytest.approx(2 * a1, rel=0.05)
    assert act("--resolution", "128") > 3 * a1
    assert act("--resolution", "64", "--gradient_checkpointing") < a1 / 2


# -- no weights: dry run, single files and folders -----------------------------------------------

def test_dry_run_prints_the_breakdown_without_loading_weights(run_script, dataset, no_weight_loading):
    rc, out, err = run_script("train_dreambooth", [
        "--pretrained_model_name_or_path", "sd15-arch", "--train_data_dir", dataset,
        "--resolution", "64", "--max_train_steps", "1", "--dry_run", "--fused_backward_pass",
        "--optimizer_type", "Adafactor", "--cache_latents"])
    assert rc == 0, err
    text = out[out.index("memory estimate"):]
    assert "parameters, trained: unet 859.5 M float32 3.202 GiB" in text
    assert "vae 83.7 M float32 (0.312 GiB not counted); released after its latents are cached" in text
    assert "parameters, frozen: text_encoder 123.1 M float32 0.458 GiB" in text
    for part in ("gradients:", "optimizer state:", "Adafactor", "activations:", "runtime overhead:",
                 "total peak of the training loop:"):
        assert part in text


def test_single_files_and_folders_are_estimated_from_their_configs(tmp_path, monkeypatch):
    from library.models import loading as models
    from library.models import sd_checkpoint

    bundle = models.load_model_bundle("tiny-sdxl")
    single = str(tmp_path / "m.safetensors")
    sd_checkpoint.save_single_file(bundle.components(), bundle.family, single)
    folder = str(tmp_path / "folder")
    sd_checkpoint.save_diffusers(bundle.components(), bundle.family, folder)

    def refuse(*a, **k):
        raise AssertionError("tensor data was read")

    import safetensors
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr(models, "load_model_bundle", refuse)

    def counts(model):
        o = make_opts(pretrained_model_name_or_path=model)
        with me._fake_mode():
            family, comps = me.fake_components(o)
        return family, {k: [(n, tuple(p.shape)) for n, p in m.named_parameters()]
                        for k, m in comps.items()}

    expected = counts("tiny-sdxl")
    assert expected[0] == "sdxl" and set(expected[1]) == {"unet", "vae", "text_encoder",
                                                          "text_encoder_2"}
    assert counts(single) == expected
    assert counts(folder) == expected
    shapes, meta = me.safetensors_header(single)
    unet = sum(math.prod(s) for k, s in shapes.items() if k.startswith("model.diffusion_model."))
    assert unet == sum(p.numel() for p in bundle.unet.parameters())


def test_broken_sd3_folder_config_is_one_line_naming_the_file(capsys, tmp_path):
    """An SD3 diffusers folder whose text_encoder/config.json is not JSON: the estimate says so in
    one line naming the file (the loader's ModelError), and the run goes on."""
    from library.config.parse import parse_args

    folder = _sd3_diffusers_folder(tmp_path)
    broken = os.path.join(folder, "text_encoder", "config.json")
    with open(broken, "w") as f:
        f.write("{oops")
    o = parse_args("train_lora", ["--pretrained_model_name_or_path", folder, "--train_data_dir", "unused",
                                  "--resolution", "64", "--max_train_steps", "1", "--dry_run"])
    assert me.report(o, "lora") is None
    said = [line for line in capsys.readouterr().out.splitlines() if "memory estimate" in line]
    assert len(said) == 1 and said[0].startswith(f"memory estimate: not available ({broken}: cannot read ("), said


def test_unavailable_estimate_is_one_line_and_not_fatal(capsys, tmp_path):
    from library.config.parse import parse_args

    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    o = parse_args("train_lora", ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir",
                                  "unused", "--resolution", "64", "--max_train_steps", "1", "--dry_run"])
    assert me.report(o.replace(pretrained_model_name_or_path=str(bad)), "lora") is None
    out = capsys.readouterr().out
    assert out.startswith("memory estimate: not available (") and out.count("\n") == 1


def test_anima_estimate_is_not_available_in_one_line(capsys):
    """Anima's home has no memory fakes: its hook says so in one line (no faked model, no
    traceback), and the run goes on."""
    from library.config.parse import parse_args

    o = parse_args("train_lora", ["--pretrained_model_name_or_path", "tiny-anima", "--train_data_dir",
                                  "unused", "--resolution", "64", "--max_train_steps", "1", "--dry_run"])
    assert me.report(o, "lora") is None
    out = capsys.readouterr().out
    assert out == "memory estimate: not available (tiny-anima: no memory estimate for Anima models yet)\n"


# -- measured (slow): the estimate against the benchmark's peak on a case it was not fitted on ---

@pytest.mark.slow
def test_estimate_is_within_15_percent_of_a_measured_peak(tmp_path):
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "bench"
    cmd = [sys.executable, "tools/memory_benchmark.py", "--model", "sd15-arch", "--method",
           "finetune", "--resolution", "320", "--batch_sizes", "1", "--variants", "adamw8bit",
           "--steps", "2", "--threads", "2", "--out", str(out)]
    p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout + p.stderr
    import csv

    with open(out / "results.csv") as f:
        row = next(csv.DictReader(f))
    measured = float(row["train_rss_gib"])
    from library.config.parse import parse_args

    o = parse_args("train_dreambooth", ["--pretrained_model_name_or_path", "sd15-arch",
                                        "--train_data_dir", "unused", "--resolution", "320",
                                        "--max_train_steps", "1", "--dry_run", "--cache_latents",
                                        "--cache_text_encoder_outputs", "--max_grad_norm", "0",
                                        "--optimizer_type", "AdamW8bit"])
    est = me.estimate(o, "dreambooth").total / me.GIB
    assert abs(est - measured) <= 0.15 * measured, json.dumps({"estimate": est, "measured": measured})


# -- one configuration pinned: a changed rule or constant fails ----------------------------------

def test_estimate_of_one_configuration_is_pinned():
    """tiny-sd15 LoRA dim 4 on the U-Net, AdamW, plain step, batch 1 at 64 px, latents and
    text-encoder outputs cached. The parameter, gradient and optimizer parts are derived here from
    the model's layers; the total (activations, runtime and the peak rule included) is pinned."""
    from library.config.parse import parse_args
    from library.models.families.sd_common.tiny_models import build_tiny_components

    opts = parse_args("train_lora", [
        "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", ".", "--resolution",
        "64", "--max_train_steps", "1", "--network_dim", "4", "--network_train_unet_only",
        "--optimizer_type", "AdamW", "--cache_latents", "--cache_text_encoder_outputs", "--dry_run"])
    est = me.estimate(opts, "lora")
    unet = build_tiny_components("sd15")["unet"]
    # sd-scripts' LoRA targets: every Linear and 1x1 Conv2d below a Transformer2DModel; a module
    # of dim 4 adds down (4 x in) and up (out x 4)
    shapes = []
    for block in unet.modules():
        if type(block).__name__ != "Transformer2DModel":
            continue
        for m in block.modules():
            if isinstance(m, torch.nn.Linear):
                shapes += [4 * m.in_features, m.out_features * 4]
            elif isinstance(m, torch.nn.Conv2d) and m.kernel_size == (1, 1):
                shapes += [4 * m.in_channels, m.out_channels * 4]
    n = sum(shapes)
    assert est.trained_params == n
    assert est.gradients == 4 * n  # float32, all at once (plain step)
    assert est.optimizer == 2 * 4 * n + 4 * len(shapes)  # AdamW: 2 moments + a float32 step each
    unet_bytes = 4 * sum(p.numel() for p in unet.parameters())
    assert est.resident_params == unet_bytes + 4 * n  # the VAE and text encoder are released
    assert est.step_temporaries == 2 * 4 * max(shapes)
    assert est.runtime == int(0.57 * 1024 ** 3)
    assert est.total == PINNED_TOTAL, est.total


# est.total of the configuration above (library/training/memory_estimate.py as of 2026-12-01): a change of
# ACTIVATION_FACTOR, GRADS_WITH_ACTIVATIONS, the activation count or the peak rule changes it
PINNED_TOTAL = 629_352_469


# -- FLUX.1 / SD3 (library/training/flow_memory.py) ----------------------------------------------

FLOW_CASES = {
    "flux-adamw-swap": ("train_dreambooth", "tiny-flux", ["--optimizer_type", "AdamW",
                                                         "--blocks_to_swap", "2"]),
    "flux-schnell-fused-adafactor-gc": ("finetune", "tiny-flux-schnell", [
        "--optimizer_type", "Adafactor", "--fused_backward_pass", "--gradient_checkpointing"]),
    "sd3-bf16-groups": ("train_dreambooth", "tiny-sd3.5-medium", [
        "--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "Adafactor",
        "--fused_optimizer_groups", "2"]),
    # LoRA (train_lora): the network's parameters, on the transformer and the CLIP encoders
    "flux-lora-te-adamw": ("train_lora", "tiny-flux", [
        "--network_module", "networks.lora_flux", "--network_dim", "4", "--optimizer_type", "AdamW"]),
    "sd3-lora-split-qkv-lion": ("train_lora", "tiny-sd3", [
        "--network_module", "networks.lora_sd3", "--network_dim", "4", "--network_args", "split_qkv=True",
        "--optimizer_type", "Lion"]),
    # train_t5xxl: the LoRA's T5 modules too (per-kind ranks: T5 takes network_dim)
    "flux-lora-t5-adamw": ("train_lora", "tiny-flux", [
        "--network_module", "networks.lora_flux", "--network_dim", "4", "--network_args", "train_t5xxl=True",
        "img_attn_dim=2", "--optimizer_type", "AdamW"]),
    "sd3-lora-t5-adamw": ("train_lora", "tiny-sd3", [
        "--network_module", "networks.lora_sd3", "--network_dim", "4", "--network_args", "train_t5xxl=True",
        "--optimizer_type", "AdamW"]),
}


@pytest.mark.parametrize("case", sorted(FLOW_CASES))
def test_flow_estimate_counts_what_the_run_holds(case, train, dataset, tmp_path):
    """The FLUX.1 / SD3 estimate's parameters (per component, trained or frozen, dtype),
    gradients and optimizer state against the run's own; the released autoencoder uncounted."""
    from library.config.options import METHOD_OF_SCRIPT
    from library.config.parse import parse_args

    script, model, extra = FLOW_CASES[case]
    argv = ["--pretrained_model_name_or_path", model, "--train_data_dir", dataset,
            "--output_dir", str(tmp_path / "o"), "--resolution", "64", "--max_train_steps", "1",
            "--learning_rate", "1e-3", "--max_grad_norm", "0", "--cache_latents", *extra]
    est = me.estimate(parse_args(script, [*argv, "--dry_run"]), METHOD_OF_SCRIPT[script])
    rc, out, err, run = train(script, argv)
    assert rc == 0, err
    assert_estimate_counts_the_run(est, run, _stepping(case))
    for line in est.params:
        assert line.resident == (line.component != "vae"), line
    if "swap" in case:  # the swapped blocks' bytes, from the run's own swap
        swap = run.parts.bundle.unet.block_swap
        assert f"{swap.swapped_bytes() / me.GIB:.3f} GiB of the transformer's weights in host" \
            in est.device_note


@pytest.mark.parametrize("model, gc", [("tiny-flux", False), ("tiny-flux", True),
                                       ("tiny-sd3", False), ("tiny-sd3", True)])
def test_flow_fake_forward_saves_what_the_real_forward_saves(model, gc):
    """The activations the estimate counts on fake tensors are those the real transformer saves
    for its backward (the same count on the loaded model), with and without checkpointing; its
    text tokens are the real encoding's (SD3 with the tiny T5: 77 + 256)."""
    from library.config.parse import parse_args
    from library.models import flow_family
    from library.training import flow_memory
    from library.training.methods import FullMethod

    opts = parse_args("train_dreambooth", ["--pretrained_model_name_or_path", model,
                                           "--train_data_dir", "unused", "--resolution", "64",
                                           "--train_batch_size", "2", "--max_train_steps", "1",
                                           "--dry_run"] + (["--gradient_checkpointing"] if gc else []))
    real = flow_family.load_from_options(opts)
    comps = {"unet": real.unet, "vae": real.vae, "text_encoder": real.text_encoders[0],
             "text_encoder_2": real.text_encoders[1]}
    if len(real.text_encoders) > 2:  # SD3's T5
        comps["text_encoder_3"] = real.text_encoders[2]
    # the text tokens the estimate feeds the transformer are those the run's encoding gives it
    fm = flow_family.family_model_for(real, opts)
    with torch.no_grad():
        cond = fm.encode(fm.tokenize(["a photo"]), None)
    assert flow_memory.text_tokens(opts, real.family, comps)[0] == cond.hidden_states.shape[1]
    method = FullMethod(opts, real)
    method.setup()
    counted = me.count_activations(opts, real.family, comps, method, contextlib.nullcontext(),
                                   (64, 64), 2)
    est = me.estimate(opts, "dreambooth")
    assert counted.saved > 0 and (counted.recompute > 0) == gc
    assert est.activations == pytest.approx(
        int(me.FLOW_ACTIVATION_FACTOR * (counted.saved + counted.recompute)) + counted.weight_copies,
        abs=256)


def _nbytes(value) -> int:
    """The bytes of a cache entry's tensors (a latent entry or a text conditioning's fields)."""
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if dataclasses.is_dataclass(value):
        return sum(_nbytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


# the partial cache (CLIP trained, T5 frozen: T5's part only), a full cache, bf16, the empty
# caption of caption dropout, and SD3's float32 T5 under bf16 autocast (train_text_encoder keeps it float32)
CACHE_CASES = {
    "flux-lora-partial": ("train_lora", "tiny-flux", True, [
        "--network_module", "networks.lora_flux", "--network_dim", "4", "--caption_dropout_rate", "0.5"]),
    "flux-lora-full-bf16": ("train_lora", "tiny-flux", False, [
        "--network_module", "networks.lora_flux", "--network_dim", "4", "--network_train_unet_only",
        "--mixed_precision", "bf16"]),
    "sd3-lora-partial-bf16": ("train_lora", "tiny-sd3", True, [
        "--network_module", "networks.lora_sd3", "--network_dim", "4", "--mixed_precision", "bf16"]),
    "sd3-te-partial-fp32-t5": ("train_dreambooth", "tiny-sd3", True, [
        "--train_text_encoder", "--mixed_precision", "bf16"]),
}


@pytest.mark.parametrize("case", sorted(CACHE_CASES))
def test_flow_cached_data_is_what_the_run_caches(case, train, dataset, tmp_path):
    """The estimate's cached data (latents and text-encoder outputs) equals the bytes of the
    entries a real 1-step run cached; with CLIP trained and T5 frozen that is T5's part alone."""
    from library.config.options import METHOD_OF_SCRIPT
    from library.config.parse import parse_args

    script, model, partial, extra = CACHE_CASES[case]
    argv = ["--pretrained_model_name_or_path", model, "--train_data_dir", dataset,
            "--output_dir", str(tmp_path / "o"), "--resolution", "64", "--max_train_steps", "1",
            "--learning_rate", "1e-3", "--max_grad_norm", "0", "--cache_latents",
            "--cache_text_encoder_outputs", *extra]
    rc, out, err, run = train(script, argv)
    assert rc == 0, err
    caches = run.parts.caches
    assert caches.text_partial == partial
    real = sum(_nbytes(e) for e in caches.latents.values()) + sum(_nbytes(e) for e in caches.text.values())
    est = me.estimate(parse_args(script, [*argv, "--dry_run"]), METHOD_OF_SCRIPT[script], run.tset)
    assert est.cached_data == real
    t5 = "text_encoder_2" if model == "tiny-flux" else "text_encoder_3"
    for line in est.params:  # a partial cache releases T5 alone; the CLIP encoders run each step
        if line.component.startswith("text_encoder"):
            kept = line.component != t5 if partial else False
            assert line.resident == (kept or line.trained), line


def test_flux_single_file_is_estimated_from_headers(tmp_path, monkeypatch):
    """A BFL transformer file with clip_l / t5xxl / ae files: the transformer built from the
    header's shapes, the other parts counted from their headers; no tensor data read."""
    from safetensors.torch import save_file

    from library.config.parse import parse_args
    from library.models import clip_l_file
    from library.models.families.flux import flux_checkpoint
    from library.models.families.flux.tiny_flux import build_tiny_flux

    parts = build_tiny_flux("dev")
    model = str(tmp_path / "m.safetensors")
    flux_checkpoint.save_flux_transformer(model, parts["transformer"].state_dict(), "bfl",
                                          parts["transformer"].config, metadata={})
    files, written = {}, {}
    for name, key in (("clip_l", "clip_l"), ("t5", "t5xxl"), ("ae", "ae")):
        files[key] = str(tmp_path / f"{key}.safetensors")
        sd, seen = {}, set()
        for k, v in parts[name].state_dict().items():  # tied tensors once, as a file holds them
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                sd[k] = v.contiguous()
        # the tiny CLIP-L with its config (clip_l_file's metadata, as the toolkit writes it)
        meta = clip_l_file.clip_l_file_metadata(parts["clip_l"], parts["clip_tokenizer"]) if key == "clip_l" else None
        save_file(sd, files[key], metadata=meta)
        written[key] = sum(v.numel() for v in sd.values())

    refuse_tensor_reads(monkeypatch, "flux")
    opts = parse_args("train_dreambooth", [
        "--pretrained_model_name_or_path", model, "--clip_l", files["clip_l"], "--t5xxl",
        files["t5xxl"], "--ae", files["ae"], "--train_data_dir", "unused", "--resolution", "64",
        "--max_train_steps", "1", "--dry_run"])
    est = me.estimate(opts, "dreambooth")
    got = {line.component: line.numel for line in est.params}
    assert got == {"unet": sum(p.numel() for p in parts["transformer"].parameters()),
                   "vae": written["ae"], "text_encoder": sum(p.numel() for p in parts["clip_l"].parameters()),
                   "text_encoder_2": written["t5xxl"]}


def _flux_diffusers_folder(tmp_path) -> str:
    from library.models.families.flux import flux_saving
    from library.models.families.flux.tiny_flux import build_tiny_flux

    folder = str(tmp_path / "flux-folder")
    flux_saving.save_diffusers_folder(build_tiny_flux("dev"), "dev", folder)
    return folder


def _sd3_single_file(tmp_path) -> str:
    """tiny-sd3 as one SAI-layout file (MMDiT, CLIP-L, CLIP-G, T5, VAE)."""
    from library.models.families.sd3 import sd3_checkpoint

    path = str(tmp_path / "sd3.safetensors")
    sd3_checkpoint.save_sd3(sd3_checkpoint.load_sd3("tiny-sd3"), path)
    return path


def _sd3_diffusers_folder(tmp_path) -> str:
    """tiny-sd3.5-medium (qk norm, attn2 layers) as a diffusers folder: transformer/, text_encoder/,
    text_encoder_2/, text_encoder_3/ (T5), vae/, written by the toolkit's own writer."""
    import dataclasses

    from library.models.families.sd3 import sd3_checkpoint

    folder = str(tmp_path / "sd3-folder")
    tiny = sd3_checkpoint.load_sd3("tiny-sd3.5-medium")
    sd3_checkpoint.save_sd3(dataclasses.replace(tiny, layout=sd3_checkpoint.LAYOUT_DIFFUSERS), folder)
    return folder


FLOW_SOURCES = {"flux-diffusers-folder": (_flux_diffusers_folder, "flux", "networks.lora_flux"),
                "sd3-single-file": (_sd3_single_file, "sd3", "networks.lora_sd3"),
                "sd3-diffusers-folder": (_sd3_diffusers_folder, "sd3", "networks.lora_sd3")}


def _t5_lora_params(t5_model, dim: int) -> int:
    """sd-scripts' T5 LoRA (train_t5xxl) counted by hand: every Linear inside a T5Attention or
    T5DenseGatedActDense gets a down (dim x in) and an up (out x dim)."""
    return sum(dim * (m.in_features + m.out_features)
               for block in t5_model.modules() if type(block).__name__ in ("T5Attention", "T5DenseGatedActDense")
               for m in block.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("source", sorted(FLOW_SOURCES))
def test_flow_files_and_folders_are_estimated_without_their_tensors(source, train, dataset, tmp_path, monkeypatch):
    """A FLUX.1 diffusers folder, an SD3 single file and an SD3 diffusers folder, estimated from
    safetensors headers and config files only (reading tensor data fails the test), for a LoRA run
    with T5 trained (train_t5xxl): every component's parameter count and the LoRA's trained
    parameters (T5's modules included) equal the real run's (which loads them)."""

    from library.config.parse import parse_args
    from library.models import flow_family

    make, family, module = FLOW_SOURCES[source]
    model = make(tmp_path)
    assert flow_family.family_before_loading(model) == family
    argv = ["--pretrained_model_name_or_path", model, "--train_data_dir", dataset,
            "--output_dir", str(tmp_path / "o"), "--resolution", "64", "--max_train_steps", "1",
            "--learning_rate", "1e-3", "--cache_latents", "--network_module", module, "--network_dim", "4"]
    t5_arg = ["--network_args", "train_t5xxl=True"]

    with monkeypatch.context() as m:
        refuse_tensor_reads(m, family)
        est = me.estimate(parse_args("train_lora", [*argv, *t5_arg, "--dry_run"]), "lora")
        without_t5 = me.estimate(parse_args("train_lora", [*argv, "--dry_run"]), "lora")
    rc, out, err, run = train("train_lora", [*argv, *t5_arg])
    assert rc == 0, err
    assert_estimate_counts_the_run(est, run)
    got = {(line.component, line.trained, line.dtype) for line in est.params}
    assert ("text_encoder", False, "float32") in got and ("network", True, "float32") in got
    assert (("text_encoder_3", False, "float32") in got) == (family == "sd3")  # SD3's T5 in the file
    # the T5 modules' share, against a hand count on the run's own T5
    t5_model = run.parts.bundle.text_encoders[-1]
    assert est.trained_params - without_t5.trained_params == _t5_lora_params(t5_model, 4) > 0


def test_sd3_folder_with_separate_files_is_estimated_as_the_loader_builds_it(tmp_path, monkeypatch):
    """An SD3 diffusers folder with ``clip_l`` and ``t5xxl`` files (a 3-layer T5, not the
    folder's 2): the files replace the folder's parts in the estimate as in the loader; every
    component's parameter count equals the loaded model's; no tensor data read."""
    from safetensors.torch import save_file
    from transformers import T5Config, T5EncoderModel

    from library.config.parse import parse_args
    from library.models import flow_family, t5
    from library.models.families.sd3 import sd3_checkpoint

    folder = _sd3_diffusers_folder(tmp_path)
    tiny = sd3_checkpoint.load_sd3("tiny-sd3.5-medium")
    clip_file, t5_file = str(tmp_path / "clip_l.safetensors"), str(tmp_path / "t5.safetensors")
    save_file({k: v.contiguous() for k, v in tiny.clip_l.state_dict().items()}, clip_file)
    cfg = dict(tiny.t5xxl.config.to_dict(), num_layers=3)
    t5_sd = T5EncoderModel(T5Config(**{k: cfg[k] for k in t5.T5XXL_CONFIG})).state_dict()
    t5_sd.pop("encoder.embed_tokens.weight")  # tied to shared.weight: stored once
    save_file({k: v.contiguous() for k, v in t5_sd.items()}, t5_file)
    argv = ["--pretrained_model_name_or_path", folder, "--clip_l", clip_file, "--t5xxl", t5_file,
            "--train_data_dir", "unused", "--resolution", "64", "--max_train_steps", "1", "--dry_run"]
    opts = parse_args("train_dreambooth", argv)

    with monkeypatch.context() as m:
        refuse_tensor_reads(m, "sd3")
        est = me.estimate(opts, "dreambooth")
    real = flow_family.load_from_options(opts)
    parts = {"unet": real.unet, "vae": real.vae, "text_encoder": real.text_encoders[0],
             "text_encoder_2": real.text_encoders[1], "text_encoder_3": real.text_encoders[2]}
    assert {line.component: line.numel for line in est.params} == {
        k: sum(p.numel() for p in v.parameters()) for k, v in parts.items()}
    assert real.text_encoders[2].config.num_layers == 3  # the file's T5, not the folder's


@pytest.mark.slow
def test_flux_estimate_against_a_measured_cpu_peak(tmp_path):
    """tiny-flux full fine-tune (AdamW, 64 px, 2 steps) in a fresh process: its training-loop
    peak resident set (tools/memory_benchmark.py's child) against the estimate. The tiny model's
    own parts are ~0.02 GiB: the estimate is its runtime constant (0.57 GiB, fitted on sd15-arch)
    plus those, and a tiny run's process holds less (measured 2026-12-03: 0.462 GiB against
    0.590 GiB). Tolerance: 0.15 GiB, that constant's excess on a tiny run plus a margin."""
    import json
    import subprocess
    import sys

    from library.config.parse import parse_args
    from tools.make_sample_dataset import make_sample_dataset
    from tools.memory_benchmark import CHILD

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    data = str(tmp_path / "data")
    make_sample_dataset(data, n_images=2, size=64, repeats=2)
    argv = ["--pretrained_model_name_or_path", "tiny-flux", "--train_data_dir", data,
            "--output_dir", str(tmp_path / "o"), "--resolution", "64", "--max_train_steps", "2",
            "--cache_latents", "--max_grad_norm", "0"]
    report = str(tmp_path / "report.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-c", CHILD, report, "train_dreambooth.py", *argv], cwd=root,
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    with open(report) as f:
        measured = json.load(f)["train"]["rss_bytes"] / me.GIB
    est = me.estimate(parse_args("train_dreambooth", [*argv, "--dry_run"]), "dreambooth").total / me.GIB
    assert abs(est - measured) <= 0.15, json.dumps({"estimate": est, "measured": measured})
