"""Optimizers and learning-rate schedulers, by sd-scripts' names."""
from __future__ import annotations

import ast
import importlib
import inspect
import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from library.config.options import LR_SCHEDULERS
from library.errors import UserError, first_line

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")


class OptimizerError(UserError, ValueError):
    """A bad optimizer_type / optimizer_args / lr_scheduler, with a one-line message."""


# name (lower case, matched case-insensitively as sd-scripts does) ->
# (module, attribute, pip package that provides it, fixed kwargs)
_OPTIMIZERS = {
    "adamw": ("torch.optim", "AdamW", "torch", {}),
    "adamw8bit": ("bitsandbytes.optim", "AdamW8bit", "bitsandbytes", {}),
    "pagedadamw": ("bitsandbytes.optim", "PagedAdamW", "bitsandbytes", {}),
    "pagedadamw8bit": ("bitsandbytes.optim", "PagedAdamW8bit", "bitsandbytes", {}),
    "pagedadamw32bit": ("bitsandbytes.optim", "PagedAdamW32bit", "bitsandbytes", {}),
    "lion8bit": ("bitsandbytes.optim", "Lion8bit", "bitsandbytes", {}),
    "pagedlion8bit": ("bitsandbytes.optim", "PagedLion8bit", "bitsandbytes", {}),
    "lion": ("lion_pytorch", "Lion", "lion-pytorch", {}),
    # momentum 0.9 unless optimizer_args set it (sd-scripts' default; Nesterov needs momentum > 0)
    "sgdnesterov": ("torch.optim", "SGD", "torch", {"nesterov": True, "momentum": 0.9}),
    "sgdnesterov8bit": ("bitsandbytes.optim", "SGD8bit", "bitsandbytes",
                        {"nesterov": True, "momentum": 0.9}),
    "adafactor": ("transformers.optimization", "Adafactor", "transformers", {}),
    "prodigy": ("prodigyopt", "Prodigy", "prodigyopt", {}),
    # sd-scripts' get_optimizer maps the bare name DAdaptation to the experimental AdamPreprint
    # (its help text says so too), not to DAdaptAdam
    "dadaptation": ("dadaptation.experimental", "DAdaptAdamPreprint", "dadaptation", {}),
    "dadaptadampreprint": ("dadaptation.experimental", "DAdaptAdamPreprint", "dadaptation", {}),
    "dadaptadam": ("dadaptation", "DAdaptAdam", "dadaptation", {}),
    "dadaptadagrad": ("dadaptation", "DAdaptAdaGrad", "dadaptation", {}),
    "dadaptadan": ("dadaptation", "DAdaptAdan", "dadaptation", {}),
    "dadaptadanip": ("dadaptation.experimental", "DAdaptAdanIP", "dadaptation", {}),
    "dadaptlion": ("dadaptation", "DAdaptLion", "dadaptation", {}),
    "dadaptsgd": ("dadaptation", "DAdaptSGD", "dadaptation", {}),
    "adamwschedulefree": ("schedulefree", "AdamWScheduleFree", "schedulefree", {}),
    "radamschedulefree": ("schedulefree", "RAdamScheduleFree", "schedulefree", {}),
    "sgdschedulefree": ("schedulefree", "SGDScheduleFree", "schedulefree", {}),
}

# sd-scripts' spelling of each name, for messages
NAMES = ("AdamW", "AdamW8bit", "PagedAdamW", "PagedAdamW8bit", "PagedAdamW32bit", "Lion8bit",
         "PagedLion8bit", "Lion", "SGDNesterov", "SGDNesterov8bit", "AdaFactor", "Prodigy",
         "DAdaptation", "DAdaptAdamPreprint", "DAdaptAdam", "DAdaptAdaGrad", "DAdaptAdan",
         "DAdaptAdanIP", "DAdaptLion", "DAdaptSGD", "AdamWScheduleFree", "RAdamScheduleFree",
         "SGDScheduleFree")

# optional packages of the `optimizers` extra in pyproject.toml
_EXTRA_PACKAGES = {"lion-pytorch", "prodigyopt", "schedulefree", "dadaptation"}

# torch.optim classes that the steppers cannot drive (they call step() without a closure, on
# dense gradients)
_TORCH_UNSUPPORTED = {"LBFGS": "it needs a closure that re-evaluates the loss in every step",
                      "SparseAdam": "it needs sparse gradients"}

# Their step() raises when parameter groups have different nonzero learning rates (they compute
# one step size from the first group's lr); dadaptation's AdaGrad, Adan and AdanIP scale each
# group by its own lr.
_ONE_LR = {"DAdaptAdam", "DAdaptAdamPreprint", "DAdaptLion", "DAdaptSGD", "Prodigy"}

SCHEDULERS = LR_SCHEDULERS  # the lr_scheduler names (options.py holds the one list)

def parse_literal(value):
    """`optimizer_args` values arrive as strings from the CLI: read them as Python literals."""
    if not isinstance(value, str):
        return value
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        low = value.lower()
        if low in ("true", "false"):
            return low == "true"
        return value


def resolve_optimizer_class(optimizer_type: str):
    """Return (class, fixed kwargs) for an sd-scripts optimizer name or a dotted path."""
    key = optimizer_type.lower()
    if key in _OPTIMIZERS:
        module, attr, package, fixed = _OPTIMIZERS[key]
    elif "." in optimizer_type:
        module, attr = optimizer_type.rsplit(".", 1)
        package, fixed = module.split(".")[0], {}
    else:
        # sd-scripts takes any other bare name from torch.optim (there case-sensitively)
        torch_name = _torch_optim_name(optimizer_type)
        if torch_name is None:
            raise OptimizerError(f"optimizer_type: unknown optimizer {optimizer_type!r}; known: "
                                 f"{', '.join(NAMES)}, a torch.optim class (SGD, RMSprop, ...), "
                                 "or a dotted path such as torch.optim.AdamW")
        module, attr, package, fixed = "torch.optim", torch_name, "torch", {}
    if module == "torch.optim" and attr in _TORCH_UNSUPPORTED:
        raise OptimizerError(f"optimizer_type {optimizer_type}: torch.optim.{attr} cannot be used: "
                             f"{_TORCH_UNSUPPORTED[attr]}")
    try:
        mod = importlib.import_module(module)
    except ImportError:
        extra = " or the optimizers extra: pip install 'sdtk[optimizers]'" \
            if package in _EXTRA_PACKAGES else ""
        raise OptimizerError(f"optimizer_type {optimizer_type}: module {module} is not installed "
                             f"(pip install {package}{extra})") from None
    cls = getattr(mod, attr, None)
    if cls is None:
        raise OptimizerError(f"optimizer_type {optimizer_type}: {module} has no {attr}")
    return cls, dict(fixed)


def _torch_optim_name(name: str) -> str | None:
    """The torch.optim optimizer class called ``name`` (exact spelling first, then any case)."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when
    # _torch_optim_name() runs
    import torch

    def is_optimizer(attr):
        obj = getattr(torch.optim, attr, None)
        return isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) \
            and obj is not torch.optim.Optimizer
    if is_optimizer(name):
        return name
    matches = [a for a in dir(torch.optim) if a.lower() == name.lower() and is_optimizer(a)]
    return matches[0] if matches else None


def check_optimizer(optimizer_type: str, optimizer_args: dict, probe: bool = False,
                    learning_rate: float = 1e-4):
    """Resolve the class and check the arguments against its signature; no parameters needed,
    so this runs before any weight is loaded. Returns (class, fixed kwargs, parsed args).
    With ``probe`` and some ``optimizer_args`` the optimizer is also built over one dummy
    parameter, so that bad values (``betas=oops``, ``lr=-1``) fail here too, before the weights
    load."""
    cls, kwargs = resolve_optimizer_class(optimizer_type)
    args = {k: parse_literal(v) for k, v in (optimizer_args or {}).items()}
    params = inspect.signature(cls.__init__).parameters
    accepts_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    for k in args:
        if k not in params and not accepts_any:
            valid = sorted(p for p in params if p not in ("self", "params"))
            raise OptimizerError(f"optimizer_args: {cls.__name__} has no argument {k!r}; "
                                 f"valid: {', '.join(valid)}")
    if probe and args:  # only values the user gave can be wrong here
        # lazy: the dry run's plan loads this module before torch; torch is imported when
        # check_optimizer() runs
        import torch

        _construct(cls, dict(kwargs), args, [torch.nn.Parameter(torch.zeros(4))], learning_rate,
                   warn=False)
    return cls, kwargs, args


def build_optimizer(optimizer_type: str, optimizer_args: dict, param_groups, learning_rate: float,
                    warn: bool = True):
    """The optimizer over ``param_groups``; ``warn=False`` for the 2nd..Nth fused optimizer."""
    cls, kwargs, args = check_optimizer(optimizer_type, optimizer_args)
    return _construct(cls, kwargs, args, param_groups, learning_rate, warn=warn)


def is_adafactor(cls) -> bool:
    return cls.__name__ == "Adafactor" and (cls.__module__ or "").startswith("transformers")


def adafactor_relative_step(args: dict) -> bool:
    """Whether Adafactor computes its own step size (relative_step=True), from the parsed
    optimizer_args, as sd-scripts decides it: as given, True by default (transformers' and
    sd-scripts' default), and True with warmup_init=True (sd-scripts' correction: transformers
    refuses warmup_init without it)."""
    if args.get("warmup_init", False):
        return True
    return bool(args.get("relative_step", True))


def _adafactor_kwargs(kwargs, args, param_groups, learning_rate, warn):
    """sd-scripts' Adafactor set-up: relative_step=True unless optimizer_args say otherwise (then
    lr is None and the groups' lrs are dropped); every other argument as given, else
    transformers' default (scale_parameter=True, warmup_init=False)."""
    rel = adafactor_relative_step(args)
    if warn and args.get("warmup_init", False) and args.get("relative_step", True) is False:
        logger.info("Adafactor: warmup_init=True needs relative_step=True: using it (as sd-scripts)")
    kwargs["relative_step"] = rel
    if not rel:
        return param_groups
    kwargs["lr"] = None
    if warn:
        given = f"learning_rate {learning_rate:g}" if learning_rate else "learning_rate"
        logger.warning(f"Adafactor with relative_step=True (sd-scripts' default): {given} is used "
                       "only as the initial lr reported before the first step; it, unet_lr and "
                       "text_encoder_lr set no step size (Adafactor computes its own; optimizer_args "
                       "relative_step=False scale_parameter=False warmup_init=False step by "
                       "learning_rate)")
    if isinstance(param_groups, list) and param_groups and isinstance(param_groups[0], dict):
        # a group's lr would override lr=None; sd-scripts drops them likewise
        param_groups = [{k: v for k, v in g.items() if k != "lr"} for g in param_groups]
    return param_groups


def _group_lrs(param_groups, learning_rate) -> list:
    if isinstance(param_groups, list) and param_groups and isinstance(param_groups[0], dict):
        return [g.get("lr", learning_rate) for g in param_groups]
    return [learning_rate]


def _check_step_size_free(cls, param_groups, learning_rate, warn):
    """D-Adaptation and Prodigy estimate the step size: lr is a multiplier of it (about 1.0)."""
    lrs = _group_lrs(param_groups, learning_rate)
    distinct = sorted({float(x) for x in lrs if x})
    if cls.__name__ in _ONE_LR and len(distinct) > 1:
        raise OptimizerError(f"optimizer_type {cls.__name__}: the parameter groups have learning "
                             f"rates {', '.join(f'{x:g}' for x in distinct)}, and {cls.__name__} "
                             "estimates one step size for all of them: give unet_lr and "
                             "text_encoder_lr one value (or 0 to leave a part untrained)")
    if warn and lrs[0] is not None and lrs[0] <= 0.1:
        logger.warning(f"{cls.__name__}: learning rate {lrs[0]:g} is low: D-Adaptation and "
                       "Prodigy take it as a multiplier of their estimated step size; about 1.0 "
                       "is usual (as sd-scripts warns)")


def _construct(cls, kwargs, args, param_groups, learning_rate, warn=True):
    params = inspect.signature(cls.__init__).parameters
    accepts_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    kwargs.update(args)
    if "lr" in params or accepts_any:
        kwargs.setdefault("lr", learning_rate)
    if not isinstance(param_groups, list):
        param_groups = list(param_groups)  # read below, then handed to the class
    if is_adafactor(cls):
        param_groups = _adafactor_kwargs(kwargs, args, param_groups, learning_rate, warn)
    module = (cls.__module__ or "").split(".")[0]
    if module in ("dadaptation", "prodigyopt"):
        _check_step_size_free(cls, param_groups, kwargs.get("lr", learning_rate), warn)
    if module == "bitsandbytes" and cls.__name__.startswith("Paged"):
        _paged_on_cpu(cls, param_groups, warn)
    try:
        return cls(param_groups, **kwargs)
    except Exception as e:  # noqa: BLE001 - constructors fail on bad values in many ways
        given = ", ".join(f"{k}={v!r}" for k, v in args.items()) or "none"
        raise OptimizerError(f"optimizer_args for {cls.__name__} (given: {given}): "
                             f"{type(e).__name__}: {e}") from None


def _paged_on_cpu(cls, param_groups, warn):
    """bitsandbytes pages optimizer state between GPU and CPU memory (CUDA unified memory); for
    CPU parameters it allocates ordinary tensors (its own warning at the first step says so):
    said here once, in our words."""

    # lazy: the dry run's plan loads this module before torch; torch is imported when
    # _paged_on_cpu() runs
    import torch

    groups = param_groups if isinstance(param_groups, list) else list(param_groups)
    tensors = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    if tensors and all(isinstance(p, torch.Tensor) and p.device.type == "cpu" for p in tensors):
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        if warn:
            logger.info(f"{cls.__name__} on the CPU: nothing to page, bitsandbytes keeps the "
                        "state in ordinary CPU memory (same updates as without paging)")


def steps_of(value, total_steps: int) -> int:
    """lr_warmup_steps / lr_decay_steps: a number of steps, or a fraction (below 1) of all steps,
    rounded as library/data/step_plan.py rounds the warmup."""
    if isinstance(value, float) and 0 < value < 1:
        return int(round(value * total_steps))
    return int(value or 0)


@dataclass(frozen=True)
class ScheduleSpec:
    """What a learning-rate schedule depends on, all counts in optimizer steps."""
    name: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1
    num_cycles: int = 1
    power: float = 1.0
    decay_steps: int = 0
    min_lr_ratio: float | None = None
    timescale: int | None = None
    scheduler_type: str | None = None   # lr_scheduler_type: a class instead of ``name``
    scheduler_args: dict = field(default_factory=dict)   # lr_scheduler_args, parsed
    initial_lr: float = 0.0  # adafactor: the lr reported before the first step (learning_rate)


def schedule_spec(opts: Options, *, warmup_steps: int, total_steps: int) -> ScheduleSpec:
    """The run's schedule from its options (lr_scheduler and the lr_* options)."""
    return ScheduleSpec(
        name=opts.lr_scheduler, warmup_steps=warmup_steps, total_steps=total_steps,
        num_cycles=opts.lr_scheduler_num_cycles, power=opts.lr_scheduler_power,
        decay_steps=steps_of(opts.lr_decay_steps, total_steps),
        min_lr_ratio=opts.lr_scheduler_min_lr_ratio, timescale=opts.lr_scheduler_timescale,
        scheduler_type=opts.lr_scheduler_type or None,  # "" (sd-scripts' default) = unset
        scheduler_args={k: parse_literal(v) for k, v in (opts.lr_scheduler_args or {}).items()},
        initial_lr=opts.learning_rate or 0.0)


def check_scheduler(opts: Options, *, warmup_steps: int, total_steps: int) -> ScheduleSpec:
    """Everything about the schedule that can be wrong, before any weight loads: the spec is
    built over the run's optimizer class on one dummy parameter (so the same code as the run
    raises); options that have no effect with this schedule are announced."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when
    # check_scheduler() runs
    import torch

    spec = schedule_spec(opts, warmup_steps=warmup_steps, total_steps=total_steps)
    cls, _, args = check_optimizer(opts.optimizer_type, opts.optimizer_args)
    sf = is_schedule_free_class(cls)
    if sf and (spec.scheduler_type or spec.name != "constant" or spec.warmup_steps):
        logger.warning(f"{cls.__name__} is schedule-free: lr_scheduler {spec.name}"
                       f"{', lr_scheduler_type' if spec.scheduler_type else ''}"
                       f"{', lr_warmup_steps' if spec.warmup_steps else ''} have no effect, the "
                       "learning rate stays constant (as sd-scripts; the optimizer's own "
                       "warmup_steps argument warms up)")
    elif is_adafactor(cls) and adafactor_relative_step(args) and \
            spec.name != "adafactor" and not spec.scheduler_type:
        logger.info(f"Adafactor with relative_step=True: lr_scheduler {spec.name} has no effect, "
                    "using the adafactor scheduler (as sd-scripts)")
    unused = [(opts.lr_decay_steps, "lr_decay_steps", ("warmup_stable_decay",)),
              (spec.min_lr_ratio, "lr_scheduler_min_lr_ratio",
               ("cosine_with_min_lr", "warmup_stable_decay")),
              (spec.timescale, "lr_scheduler_timescale", ("inverse_sqrt",))]
    for value, key, users in unused:
        if value and (spec.scheduler_type or spec.name not in users) and not sf:
            logger.warning(f"{key} has no effect with lr_scheduler "
                           f"{spec.scheduler_type or spec.name} (only with {', '.join(users)})")
    p = torch.nn.Parameter(torch.zeros(4))
    opt = build_optimizer(opts.optimizer_type, opts.optimizer_args, [{"params": [p]}],
                          opts.learning_rate or 1e-4, warn=False)
    build_scheduler(spec, opt)
    return spec


def is_schedule_free_class(cls) -> bool:
    """Schedule-free optimizers (train/eval iterates); sd-scripts keeps their lr constant."""
    return "schedulefree" in cls.__name__.lower()


def _scheduler_class(path: str):
    """lr_scheduler_type: a torch.optim.lr_scheduler name or a dotted class path."""
    module, attr = path.rsplit(".", 1) if "." in path else ("torch.optim.lr_scheduler", path)
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ImportError:
        raise OptimizerError(f"lr_scheduler_type {path}: module {module} is not installed") from None
    except AttributeError:
        raise OptimizerError(f"lr_scheduler_type {path}: {module} has no {attr}") from None
    if not isinstance(cls, type):
        raise OptimizerError(f"lr_scheduler_type {path}: not a class")
    return cls


def _custom_scheduler(spec: ScheduleSpec, path: str, optimizer):
    """lr_scheduler_type ``path`` (spec.scheduler_type) over ``optimizer``."""
    cls = _scheduler_class(path)
    if spec.warmup_steps:
        raise OptimizerError(f"lr_scheduler_type {spec.scheduler_type}: lr_warmup_steps cannot be "
                             "used with a scheduler class (sd-scripts refuses it too): set it to 0")
    step = getattr(cls, "step", None)
    if step is not None:
        req = [n for n, p in list(inspect.signature(step).parameters.items())[1:]
               if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if req:
            raise OptimizerError(f"lr_scheduler_type {spec.scheduler_type}: its step() needs "
                                 f"{', '.join(req)} (a metric); the trainer steps the scheduler "
                                 "once per optimizer step without one")
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        for k in spec.scheduler_args:
            if k not in params or k in ("self", "optimizer"):
                valid = sorted(n for n in params if n not in ("self", "optimizer"))
                raise OptimizerError(f"lr_scheduler_args: {cls.__name__} has no argument {k!r}; "
                                     f"valid: {', '.join(valid)}")
    try:
        return cls(optimizer, **spec.scheduler_args)
    except Exception as e:  # noqa: BLE001 - constructors fail on bad values in many ways
        given = ", ".join(f"{k}={v!r}" for k, v in spec.scheduler_args.items()) or "none"
        raise OptimizerError(f"lr_scheduler_args for {cls.__name__} (given: {given}): "
                             f"{first_line(e, typed=True)}") from None


def parse_step_rules(rules) -> tuple[list[tuple[int, float]], float]:
    """piecewise_constant's step_rules "m1:s1,m2:s2,...,m_last" (diffusers' format): factor m1
    while step < s1, then m2 while step < s2, ..., then m_last."""
    if not isinstance(rules, str) or not rules.strip():
        raise OptimizerError("lr_scheduler piecewise_constant needs lr_scheduler_args "
                             "step_rules='1:100,0.1:200,0.01' (factor:until_step, ..., last factor)")
    parts = [r.strip() for r in rules.split(",")]
    try:
        pairs = []
        for r in parts[:-1]:
            value, step = r.split(":")
            pairs.append((int(step), float(value)))
        last = float(parts[-1])
    except ValueError:
        raise OptimizerError(f"lr_scheduler_args step_rules {rules!r}: expected "
                             "'factor:step,factor:step,...,factor', e.g. '1:100,0.1:200,0.01'") from None
    return sorted(pairs), last


def build_scheduler(spec: ScheduleSpec, optimizer):
    """The scheduler of ``spec`` over ``optimizer``: one scheduler step per optimizer step, all
    counts in optimizer steps."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when
    # build_scheduler() runs
    from torch.optim.lr_scheduler import LambdaLR

    if spec.scheduler_type:
        if _is_relative_step_adafactor(optimizer):
            raise OptimizerError(f"lr_scheduler_type {spec.scheduler_type} cannot schedule Adafactor "
                                 "with relative_step=True (it has no learning rate to scale): drop "
                                 "lr_scheduler_type or set optimizer_args relative_step=False")
        return _custom_scheduler(spec, spec.scheduler_type, optimizer)
    name, w, n = spec.name, spec.warmup_steps, max(spec.total_steps, 1)
    if name not in SCHEDULERS:
        raise OptimizerError(f"lr_scheduler: unknown scheduler {name!r}; known: {', '.join(SCHEDULERS)}")
    if is_schedule_free_class(type(optimizer)):
        return LambdaLR(optimizer, lambda step: 1.0)  # sd-scripts: constant (check_scheduler says so)
    relative = _is_relative_step_adafactor(optimizer)
    if name == "adafactor" or relative:
        return _adafactor_scheduler(spec, optimizer, relative)
    if spec.scheduler_args and name != "piecewise_constant":
        raise OptimizerError(f"lr_scheduler_args {', '.join(spec.scheduler_args)}: lr_scheduler "
                             f"{name} takes none (they are for lr_scheduler_type, or "
                             "piecewise_constant's step_rules)")
    if w and name in ("constant", "piecewise_constant"):
        raise OptimizerError(f"lr_scheduler {name} has no warmup (sd-scripts refuses lr_warmup_steps "
                             "with constant too): use constant_with_warmup, or lr_warmup_steps 0")
    ratio = spec.min_lr_ratio
    if name == "cosine_with_min_lr" and ratio is None:
        raise OptimizerError("lr_scheduler cosine_with_min_lr needs lr_scheduler_min_lr_ratio (the "
                             "lowest learning rate as a fraction of the initial one)")
    ratio = ratio or 0.0
    d = spec.decay_steps
    stable = n - w - d  # warmup_stable_decay
    if name == "warmup_stable_decay" and stable < 0:
        raise OptimizerError(f"lr_warmup_steps ({w}) + lr_decay_steps ({d}) exceed the run's {n} "
                             "steps: shorten them")
    timescale = spec.timescale or w or 10_000  # transformers' default (inverse_sqrt)
    if name == "piecewise_constant":
        rules, last = parse_step_rules(spec.scheduler_args.get("step_rules"))
        unknown = set(spec.scheduler_args) - {"step_rules"}
        if unknown:
            raise OptimizerError(f"lr_scheduler_args {', '.join(sorted(unknown))}: "
                                 "piecewise_constant takes only step_rules")

    def half_cosine(progress):  # num_cycles half waves, as sd-scripts passes num_cycles / 2
        return 0.5 * (1.0 + math.cos(math.pi * spec.num_cycles * progress))

    # Written here (not diffusers' get_scheduler) so the curves are ours to test and document:
    # lambda(step) is the factor applied during optimizer step `step` (0-based). Warmup, for
    # every schedule that has one, rises linearly from 1/(w+1) (diffusers and transformers start
    # at 0, which wastes the first step) to 1 at step w.
    def factor(step):
        if name == "constant":
            return 1.0
        if name == "piecewise_constant":
            return next((m for until, m in rules if step < until), last)
        if step < w:
            return (step + 1) / (w + 1)
        if name == "constant_with_warmup":
            return 1.0
        if name == "inverse_sqrt":
            return 1.0 / math.sqrt((step - w + timescale) / timescale)
        if name == "warmup_stable_decay":
            if step < w + stable:
                return 1.0
            if step >= n:
                return ratio
            progress = (step - w - stable) / max(1, d)
            return max(0.0, half_cosine(progress) * (1.0 - ratio) + ratio)
        progress = min(1.0, (step - w) / max(1, n - w))
        if name == "linear":
            return max(0.0, 1.0 - progress)
        if name == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if name == "cosine_with_restarts":
            if progress >= 1.0:
                return 0.0
            return 0.5 * (1.0 + math.cos(math.pi * ((spec.num_cycles * progress) % 1.0)))
        if name == "polynomial":
            return max(0.0, (1.0 - progress)) ** spec.power
        if name == "cosine_with_min_lr":
            return max(0.0, half_cosine(progress) * (1.0 - ratio) + ratio)
        raise AssertionError(name)

    return LambdaLR(optimizer, factor)


def _is_relative_step_adafactor(optimizer) -> bool:
    return is_adafactor(type(optimizer)) and bool(optimizer.param_groups[0].get("relative_step"))


def _adafactor_scheduler(spec: ScheduleSpec, optimizer, relative: bool):
    """transformers' AdafactorSchedule: reports the step size Adafactor computes itself
    (relative_step=True); the update does not read it. sd-scripts builds it with
    initial_lr=learning_rate, the value reported before the first step."""
    # lazy: the dry run's plan loads this module before torch; transformers is imported when
    # _adafactor_scheduler() runs
    from transformers.optimization import AdafactorSchedule

    if not is_adafactor(type(optimizer)):
        raise OptimizerError(f"lr_scheduler adafactor needs optimizer_type Adafactor, not "
                             f"{type(optimizer).__name__}")
    if not relative:
        raise OptimizerError("lr_scheduler adafactor needs Adafactor with relative_step=True "
                             "(optimizer_args relative_step=False given): use another "
                             "lr_scheduler, or drop relative_step=False")
    if spec.warmup_steps:
        raise OptimizerError("Adafactor with relative_step=True (the adafactor scheduler) has no "
                             "lr_warmup_steps (sd-scripts refuses them too): use optimizer_args "
                             "warmup_init=True, or lr_warmup_steps 0, or optimizer_args "
                             "relative_step=False scale_parameter=False warmup_init=False for a "
                             "learning_rate step")

    class FloatAdafactorSchedule(AdafactorSchedule):
        """Reports, per group, the step size Adafactor used in its last step on the group's first
        parameter, as a float (transformers returns a 0-dim tensor when scale_parameter
        multiplies by the weights' RMS, and skips groups whose gradients are already freed, as
        the fused steppers free them); initial_lr before the first step."""

        def get_lr(self):
            opt, out = self.optimizer, []
            for group, base in zip(opt.param_groups, self.base_lrs):
                state = opt.state.get(group["params"][0], {})
                out.append(float(opt._get_lr(group, state)) if "step" in state else base)
            return out

    return FloatAdafactorSchedule(optimizer, initial_lr=spec.initial_lr)
