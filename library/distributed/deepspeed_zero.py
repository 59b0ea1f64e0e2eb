"""``deepspeed``: DeepSpeed ZeRO stages 0-2 (optimizer state, then gradients, partitioned across
the processes), driven by the toolkit's own loop.

Turned on by the ``deepspeed`` option (with sd-scripts' ``zero_stage`` and
``offload_optimizer_device``) or by launching with an Accelerate DeepSpeed config
(``accelerate launch --config_file ds.yaml``: ``distributed_type: DEEPSPEED`` and its
``deepspeed_config`` fields, or a ``deepspeed_config_file`` JSON). Both end in the same options
(``resolve_options``), so the printed config, the metadata and the resume check see them.

Accelerate's own DeepSpeed path is not used: it needs a CUDA device (on a CPU machine it builds
a plain process group), and it would step the optimizer inside ``accelerator.backward``. Here the
toolkit calls ``deepspeed.initialize`` itself over the run's process group (gloo on CPU, NCCL on
CUDA; one process gets a one-process group), with the trained modules (the LoRA network, or the
U-Net and trained text encoders) and the optimizer built from ``optimizer_type``:

- Each process's loss is weighted by its share of the global batch, and the toolkit's contract is
  that gradients are summed (library/accelerator.py); DeepSpeed averages over the processes, so
  the loss handed to ``engine.backward`` is multiplied by the process count, with
  ``scale_wrt_gas=False`` (the loss is already divided by the whole global batch). The
  accumulation boundary is the loop's last micro-step, set explicitly.
- Stage 2 reduces gradients during every micro-step's backward, and ZeRO builds its partitioned
  gradient in the backward of the boundary: every process runs every micro-step (a zero-weight
  forward for an empty share, ``forward_in_every_process``), even a single one.
- ``max_grad_norm`` is DeepSpeed's ``gradient_clipping`` (the same global-norm rule). The
  learning-rate scheduler is the toolkit's, stepped once per optimizer step.
- ``mixed_precision`` bf16 / fp16 become DeepSpeed's bf16 / fp16 modes: the trained modules are
  bf16 / fp16 with float32 master copies inside ZeRO (fp16 with DeepSpeed's loss scaling).
- The training state keeps DeepSpeed's own partitioned checkpoint (``deepspeed/``, one optimizer
  file per process) beside the toolkit's files; a resume needs the same process count.

Not supported, each rejected with its reason before any weight loads: ``zero_stage`` 3 (sharded
weights: use ``fsdp``), NVMe offload, parameter offload, ``fused_backward_pass`` /
``fused_optimizer_groups`` (ZeRO owns the gradients: they are reduced and partitioned in its own
buckets, not stepped in per-parameter hooks), ``full_bf16`` / ``full_fp16`` (DeepSpeed's bf16 /
fp16 modes are the equivalent), ``fsdp``, ``stop_text_encoder_training`` (ZeRO steps every
partition every step, a frozen encoder would still decay), and optimizers that need each
parameter's shape or a global state (Adafactor, Prodigy, D-Adaptation, schedule-free): ZeRO
hands the optimizer flat slices of the parameters.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import warnings
from typing import TYPE_CHECKING

from library.config.options import OPTIONS_BY_NAME
from library.distributed.fsdp import trained_roots
from library.errors import UserError
from library.training.optim import build_optimizer, resolve_optimizer_class

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")

STATE_DIR = "deepspeed"   # inside a training state folder
_TAG = "zero"             # DeepSpeed's checkpoint tag (a subfolder)
SUPPORTED_STAGES = (0, 1, 2)


class DeepSpeedError(UserError, ValueError):
    pass


def enabled(opts: Options) -> bool:
    return opts.deepspeed


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def launched_with_deepspeed() -> bool:
    """``accelerate launch`` with a DeepSpeed config (it sets ACCELERATE_USE_DEEPSPEED)."""
    return _env_flag("ACCELERATE_USE_DEEPSPEED")


def _read_config_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise DeepSpeedError(f"deepspeed_config_file {path}: no such file (from the Accelerate "
                             "config)") from None
    except (OSError, ValueError) as e:
        raise DeepSpeedError(f"deepspeed_config_file {path}: cannot be read as JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise DeepSpeedError(f"deepspeed_config_file {path}: expected a JSON object")
    for key in ("optimizer", "scheduler"):
        if key in cfg:
            raise DeepSpeedError(f"deepspeed_config_file {path}: remove \"{key}\": the {key} comes "
                                 f"from the run's {'optimizer_type' if key == 'optimizer' else 'lr_scheduler'}")
    return cfg


def resolve_options(opts: Options):
    """Fold an Accelerate DeepSpeed launch (its environment) and a DeepSpeed JSON
    (``deepspeed_config_file``, from the options or the launch) into the run's options: returns
    them with those values (the options are frozen; the run holds the returned copy). A value
    set differently in two places is an error naming both."""
    changes: dict[str, object] = {}
    launch = launched_with_deepspeed()
    env_path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "") if launch else ""
    path = opts.deepspeed_config_file
    if env_path and env_path.lower() != "none":
        if path and os.path.abspath(path) != os.path.abspath(env_path):
            raise DeepSpeedError(f"deepspeed_config_file: the run's options say {path}, the "
                                 f"Accelerate config says {env_path}; set it in one place")
        path = changes["deepspeed_config_file"] = env_path
    given = {}
    if path:
        zo = _read_config_file(path).get("zero_optimization", {}) or {}
        if "stage" in zo and zo["stage"] != "auto":
            given["zero_stage"] = (zo["stage"], f"{path}: zero_optimization.stage")
        for kind in ("optimizer", "param"):
            dev = (zo.get(f"offload_{kind}") or {}).get("device")
            if dev not in (None, "auto"):
                given[f"offload_{kind}_device"] = (dev, f"{path}: zero_optimization.offload_{kind}.device")
    if launch:
        for key, env in (("zero_stage", "ACCELERATE_DEEPSPEED_ZERO_STAGE"),
                         ("offload_optimizer_device", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
                         ("offload_param_device", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE")):
            if os.environ.get(env) not in (None, ""):
                value = (os.environ[env], f"the Accelerate config ({env})")
                if key in given and _norm(key, given[key][0], given[key][1]) != _norm(key, *value):
                    raise DeepSpeedError(f"{key}: {given[key][1]} says {given[key][0]!r}, "
                                         f"{value[1]} says {value[0]!r}; set it in one place")
                given.setdefault(key, value)
        changes["deepspeed"] = True
    for key, (value, where) in given.items():
        value = _norm(key, value, where)
        mine, default = getattr(opts, key), OPTIONS_BY_NAME[key].default
        if mine != default and mine != value:
            raise DeepSpeedError(f"{key}: the run's options say {mine!r}, {where} says {value!r}; "
                                 "set it in one place")
        changes[key] = value
    if not changes:
        return opts
    opts = opts.replace(**changes)
    if launch:
        logger.info(f"deepspeed: from the Accelerate launch config (zero_stage {opts.zero_stage})")
    return opts


def _norm(key: str, value, where: str):
    if key != "zero_stage":
        return str(value).lower()
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DeepSpeedError(f"{where}: zero stage {value!r} is not a number") from None


# -- checks before loading ------------------------------------------------------------------------
_ELEMENTWISE_TORCH = {"SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam"}
_ELEMENTWISE_BNB = ("Adam", "AdamW", "Lion", "SGD", "RMSprop", "Adagrad", "PagedAdam",
                    "PagedAdamW", "PagedLion")


def elementwise_reason(cls) -> str | None:
    """Why optimizer class ``cls`` cannot step ZeRO's flat slices of the parameters, or None.
    Only optimizers whose update of each element depends on that element alone qualify."""
    module = (getattr(cls, "__module__", "") or "").split(".")[0]
    name = cls.__name__
    if module == "torch" and name in _ELEMENTWISE_TORCH:
        return None
    if module == "bitsandbytes" and name.startswith(_ELEMENTWISE_BNB) and "LAMB" not in name \
            and "LARS" not in name:
        return None
    if module == "lion_pytorch" and name == "Lion":
        return None
    if name == "Adafactor":
        return "Adafactor factors its second moment over each parameter's rows and columns " \
               "and scales updates by each parameter's RMS"
    return f"{module}.{name} is not known to update each element independently of the " \
           "parameter's shape and of the other parameters"


def check_options(opts: Options) -> None:
    """Combinations that cannot work with deepspeed (and its options without it), before any
    weight is loaded."""
    if not enabled(opts):
        for key in ("offload_optimizer_device", "offload_param_device", "deepspeed_config_file"):
            if getattr(opts, key) != OPTIONS_BY_NAME[key].default:
                raise DeepSpeedError(f"{key} is only used with deepspeed: add deepspeed = true or "
                                     "remove it")
        if opts.zero_stage not in (None, 2):  # 2: sd-scripts' default, in many saved configs
            raise DeepSpeedError("zero_stage is only used with deepspeed: add deepspeed = true or "
                                 "remove it")
        return
    stage = opts.zero_stage if opts.zero_stage is not None else 2
    if stage == 3:
        raise DeepSpeedError("zero_stage 3 (sharded weights) is not supported; for a full fine-tune "
                             "with sharded weights use the fsdp option, or ZeRO stage 2 (sharded "
                             "gradients and optimizer state)")
    if stage not in SUPPORTED_STAGES:
        raise DeepSpeedError(f"zero_stage must be 0, 1 or 2, got {stage}")
    off = (opts.offload_optimizer_device or "none").lower()
    if off not in ("none", "cpu"):
        raise DeepSpeedError(f"offload_optimizer_device {off!r} is not supported: use cpu or none "
                             "(NVMe offload is not supported)")
    if off == "cpu" and stage == 0:
        raise DeepSpeedError("offload_optimizer_device cpu needs zero_stage 1 or 2")
    if (opts.offload_param_device or "none").lower() != "none":
        raise DeepSpeedError("offload_param_device is for ZeRO stage 3, which is not supported")
    if opts.fsdp:
        raise DeepSpeedError("deepspeed and fsdp cannot be combined: choose one way to shard")
    for name in ("fused_backward_pass", "fused_optimizer_groups"):
        if getattr(opts, name):
            raise DeepSpeedError(f"deepspeed cannot be combined with {name}: ZeRO owns the "
                                 "gradients (it reduces and partitions them in its own buckets), so "
                                 "they cannot be stepped inside per-parameter backward hooks; drop one")
    for name in ("full_bf16", "full_fp16"):
        if getattr(opts, name):
            raise DeepSpeedError(f"deepspeed cannot be combined with {name}: with deepspeed, "
                                 f"mixed_precision {name[5:]} already trains {name[5:]} weights with "
                                 "float32 master copies inside ZeRO; drop it")
    if opts.stop_text_encoder_training:
        raise DeepSpeedError("deepspeed cannot be combined with stop_text_encoder_training: ZeRO "
                             "steps every partition every step, so frozen text encoders would "
                             "still change (weight decay, momentum)")
    if importlib.util.find_spec("deepspeed") is None:  # (importing it takes seconds)
        raise DeepSpeedError("deepspeed is not installed: pip install deepspeed (or the "
                             "deepspeed extra)")

    cls, _ = resolve_optimizer_class(opts.optimizer_type)
    reason = elementwise_reason(cls)
    if reason:
        raise DeepSpeedError(f"optimizer_type {opts.optimizer_type} cannot be used with deepspeed: "
                             f"ZeRO hands the optimizer flat slices of the parameters, and {reason}; "
                             "use AdamW, AdamW8bit, Lion or SGDNesterov")


# -- the engine -----------------------------------------------------------------------------------
def _import_deepspeed():
    """Import deepspeed quietly: its accelerator notice on CPU machines, and its shared-memory
    all-reduce op, which only serves inference and would be compiled (~35 s) on first use."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when
    # _import_deepspeed() runs
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # lazy: optional dependency (deepspeed: pip install -e ".[deepspeed]"), imported when used
    import deepspeed
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False
    for name in ("DeepSpeed", "deepspeed"):
        log = logging.getLogger(name)
        log.setLevel(logging.WARNING)
        if not any(getattr(f, "_sdtk", False) for f in log.filters):
            # the optimizer was checked here (elementwise_reason): not "untested"
            f = logging.Filter()
            f.filter = lambda r: "untested optimizer" not in r.getMessage()
            f._sdtk = True
            log.addFilter(f)
    # DeepSpeed's ZeRO all-gather uses a torch function deprecated in favour of another name
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor. is deprecated")
    return deepspeed


def ds_config(opts: Options, processes: int) -> dict:
    """DeepSpeed's config for this run (``deepspeed_config_file``'s other ZeRO settings kept)."""
    stage = opts.zero_stage if opts.zero_stage is not None else 2
    zero = {}
    path = opts.deepspeed_config_file
    user = _read_config_file(path) if path else {}
    bs, A = opts.train_batch_size, opts.gradient_accumulation_steps
    clip = float(opts.max_grad_norm or 0.0)
    if path:
        # what the run's options decide: the file may say "auto" or the same value
        for key, theirs, mine, option in (
                ("train_micro_batch_size_per_gpu", user.get("train_micro_batch_size_per_gpu"), bs,
                 "train_batch_size"),
                ("gradient_accumulation_steps", user.get("gradient_accumulation_steps"), A,
                 "gradient_accumulation_steps"),
                ("train_batch_size", user.get("train_batch_size"), bs * A * processes,
                 "train_batch_size x processes x gradient_accumulation_steps"),
                ("gradient_clipping", user.get("gradient_clipping"), clip, "max_grad_norm"),
                ("bf16.enabled", (user.get("bf16") or {}).get("enabled"),
                 opts.mixed_precision == "bf16", "mixed_precision"),
                ("fp16.enabled", (user.get("fp16") or {}).get("enabled"),
                 opts.mixed_precision == "fp16", "mixed_precision")):
            if theirs not in (None, "auto") and theirs != mine:
                raise DeepSpeedError(f"deepspeed_config_file {path}: {key} is {theirs!r}, the run's "
                                     f"{option} says {mine!r}; set it to \"auto\"")
        zero.update({k: v for k, v in (user.get("zero_optimization") or {}).items()
                     if v != "auto" and k not in ("stage", "offload_optimizer", "offload_param")})
    zero["stage"] = stage
    off = (opts.offload_optimizer_device or "none").lower()
    if off != "none":
        zero["offload_optimizer"] = {"device": off, "pin_memory": False}
    cfg = {
        "train_micro_batch_size_per_gpu": bs,
        "gradient_accumulation_steps": A,
        "train_batch_size": bs * A * processes,
        "gradient_clipping": clip,
        "zero_optimization": zero,
        "bf16": {"enabled": opts.mixed_precision == "bf16"},
        "fp16": {"enabled": opts.mixed_precision == "fp16"},
        "zero_allow_untested_optimizer": True,   # the optimizer is checked here (check_options)
        "zero_force_ds_cpu_optimizer": False,    # offload with the run's optimizer
        "steps_per_print": 2 ** 62,
        "wall_clock_breakdown": False,
    }
    return cfg


def _process_group(acc) -> bool:
    """DeepSpeed needs a process group; one process gets a one-process group (returns True when
    this made it)."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when
    # _process_group() runs
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return False
    backend = "nccl" if acc.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed asserts a launcher set it
    return True


def trained_modules(b, method) -> list[tuple[str, object]]:
    """(name, module) the engine wraps: the LoRA network, or the U-Net / trained text encoders."""
    if method.network is not None:  # a method with a network module (LoRA)
        return [("network", method.network)]

    return trained_roots(b, method)


def make_stepper(opts: Options, acc, plan, modules: list[tuple[str, object]], groups: list[dict]):
    """The DeepSpeed engine over the trained ``modules`` and the run's optimizer, as a stepper."""
    # lazy: its options are resolved before the plan, without torch
    import torch

    from library.training.stepper import build_run_scheduler

    deepspeed = _import_deepspeed()
    wrapper = torch.nn.ModuleDict(dict(modules))
    # copies of the groups: ZeRO replaces each optimizer group's parameters with its flat
    # partition, and the method's groups must keep naming the model's parameters
    optimizer = build_optimizer(opts.optimizer_type, opts.optimizer_args,
                                [{**g, "params": list(g["params"])} for g in groups],
                                opts.learning_rate)
    scheduler = build_run_scheduler(opts, optimizer, warmup_steps=plan.warmup_steps,
                                    total_steps=plan.total_steps)
    config = ds_config(opts, acc.num_processes)
    n = sum(p.numel() for p in {id(p): p for g in groups for p in g["params"]
                                if p.requires_grad}.values())
    owns_group = _process_group(acc)
    try:
        # deepspeed.initialize prints its config and a few notices to stdout on every rank
        with contextlib.redirect_stdout(io.StringIO()):
            engine, ds_optimizer, _, _ = deepspeed.initialize(
                model=wrapper, optimizer=optimizer, config=config, dist_init_required=False)
    except BaseException:
        if owns_group:
            # lazy: the dry run's plan loads this module before torch; torch is imported when
            # make_stepper() runs
            import torch.distributed as dist

            dist.destroy_process_group()
        raise
    stage = config["zero_optimization"]["stage"]
    off = config["zero_optimization"].get("offload_optimizer", {}).get("device")
    logger.info(f"deepspeed: ZeRO stage {stage} over {acc.num_processes} process(es), "
                f"{n} trained weights ({', '.join(k for k in wrapper)}); "
                + {0: "nothing partitioned", 1: "optimizer state partitioned",
                   2: "optimizer state and gradients partitioned"}[stage]
                + (f", optimizer offloaded to {off}" if off else ""))
    return DeepSpeedStepper(engine, ds_optimizer, optimizer, scheduler, acc.num_processes, stage,
                            owns_process_group=owns_group)


class DeepSpeedStepper:
    """The DeepSpeed engine as a stepper (library/training/stepper.py's ``Stepper``). Every process runs
    every micro-step (the DeepSpeed strategy's ``forward_in_every_process``)."""

    steps_in_backward = False
    nonfinite = None        # DeepSpeed's own overflow handling (fp16) skips such steps itself
    partial_update = False

    def __init__(self, engine, ds_optimizer, optimizer, scheduler, processes: int, stage: int,
                 owns_process_group: bool = False):
        self.engine = engine
        self.owns_process_group = owns_process_group  # the one-process group made for it
        self.ds_optimizer = ds_optimizer
        self.optimizer = optimizer          # the run's optimizer (ZeRO steps its flat slices)
        self.scheduler = scheduler
        self.processes = processes
        self.stage = stage

    def current_lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def backward(self, loss, last_micro_step: bool = True, loss_finite=None) -> None:
        # loss_finite: unused (step() reads the loss before the engine steps)
        self.engine.set_gradient_accumulation_boundary(bool(last_micro_step))
        # DeepSpeed averages over the processes; the toolkit's losses are meant to be summed
        self.engine.backward(loss * self.processes, scale_wrt_gas=False)

    def step(self, read=None):
        """``read``: the step's one host read (library/training/stepper.py; no norm here)."""
        got = None if read is None else read(None)
        if got is not None and not got.finite:
            return got  # the loop's guard (a non-finite loss): no engine step
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        self.scheduler.step()  # once per optimizer step
        return got

    @contextlib.contextmanager
    def eval_mode(self):
        yield  # schedule-free optimizers are rejected with deepspeed

    @property
    def schedulers(self) -> list:
        return [self.scheduler]

    def skip(self) -> None:
        """Not reached: DeepSpeed reports no non-finite step to the loop (``nonfinite`` None)."""
        raise RuntimeError("deepspeed: no step to skip")

    def state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])

    # the partitioned optimizer state: every process writes / reads its own part
    def save_partitions(self, folder: str) -> None:
        self.engine.save_checkpoint(folder, tag=_TAG, client_state={}, save_latest=False,
                                    exclude_frozen_parameters=True)

    def load_partitions(self, folder: str) -> None:
        path, _ = self.engine.load_checkpoint(folder, tag=_TAG, load_module_strict=False,
                                              load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if path is None:
            raise ValueError(f"no DeepSpeed checkpoint in {folder}")

    def close(self) -> None:
        """The engine, and the one-process group made for it (end of the run)."""
        destroy = getattr(self.engine, "destroy", None)
        if callable(destroy):
            destroy()
        if self.owns_process_group:
            # lazy: the dry run's plan loads this module before torch; torch is imported when
            # close() runs
            import torch.distributed as dist

            dist.destroy_process_group()
            self.owns_process_group = False


@contextlib.contextmanager
def master_weights(params):
    """Inside: with deepspeed in bf16 / fp16, the trained parameters hold ZeRO's float32 master
    weights (for a model save), their own half-precision values again after. Every process must
    enter it (gathering a master weight is a collective). A no-op in float32."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when
    # master_weights() runs
    import torch

    params = list(params)
    if all(p.dtype == torch.float32 for p in params):
        yield
        return
    # lazy: optional dependency (deepspeed: pip install -e ".[deepspeed]"), imported when used
    from deepspeed.utils import safe_get_full_fp32_param

    saved = []
    with torch.no_grad():
        for p in params:
            full = safe_get_full_fp32_param(p)
            saved.append((p, p.data))
            if full is not None:
                p.data = full.to(p.device)
    try:
        yield
    finally:
        for p, data in saved:
            p.data = data
