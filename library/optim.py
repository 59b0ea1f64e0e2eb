"""Optimizers and learning-rate schedulers, by sd-scripts' names."""
from __future__ import annotations

import ast
import importlib
import inspect
import logging
import math

from library.errors import UserError

logger = logging.getLogger("sdtk")


class OptimizerError(UserError, ValueError):
    """A bad optimizer_type / optimizer_args / lr_scheduler, with a one-line message."""


# name (lower case) -> (module, attribute, pip package that provides it, fixed kwargs)
_OPTIMIZERS = {
    "adamw": ("torch.optim", "AdamW", "torch", {}),
    "adamw8bit": ("bitsandbytes.optim", "AdamW8bit", "bitsandbytes", {}),
    "pagedadamw8bit": ("bitsandbytes.optim", "PagedAdamW8bit", "bitsandbytes", {}),
    "lion8bit": ("bitsandbytes.optim", "Lion8bit", "bitsandbytes", {}),
    "lion": ("lion_pytorch", "Lion", "lion-pytorch", {}),
    # momentum 0.9 unless optimizer_args set it (sd-scripts' default; Nesterov needs momentum > 0)
    "sgdnesterov": ("torch.optim", "SGD", "torch", {"nesterov": True, "momentum": 0.9}),
    "sgdnesterov8bit": ("bitsandbytes.optim", "SGD8bit", "bitsandbytes",
                        {"nesterov": True, "momentum": 0.9}),
    "adafactor": ("transformers.optimization", "Adafactor", "transformers", {}),
    "prodigy": ("prodigyopt", "Prodigy", "prodigyopt", {}),
    "adamwschedulefree": ("schedulefree", "AdamWScheduleFree", "schedulefree", {}),
    "radamschedulefree": ("schedulefree", "RAdamScheduleFree", "schedulefree", {}),
}

# optional packages of the `optimizers` extra in pyproject.toml
_EXTRA_PACKAGES = {"lion-pytorch", "prodigyopt", "schedulefree"}

SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts",
              "polynomial")


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
        names = ", ".join(v[1] if k not in ("sgdnesterov", "sgdnesterov8bit") else k
                          for k, v in _OPTIMIZERS.items())
        raise OptimizerError(f"optimizer_type: unknown optimizer {optimizer_type!r}; known: "
                             f"{names}, or a dotted path such as torch.optim.AdamW")
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
        import torch

        _construct(cls, dict(kwargs), args, [torch.nn.Parameter(torch.zeros(4))], learning_rate,
                   warn=False)
    return cls, kwargs, args


def build_optimizer(optimizer_type: str, optimizer_args: dict, param_groups, learning_rate: float,
                    warn: bool = True):
    """The optimizer over ``param_groups``; ``warn=False`` for the 2nd..Nth fused optimizer."""
    cls, kwargs, args = check_optimizer(optimizer_type, optimizer_args)
    return _construct(cls, kwargs, args, param_groups, learning_rate, warn=warn)


def _construct(cls, kwargs, args, param_groups, learning_rate, warn=True):
    params = inspect.signature(cls.__init__).parameters
    accepts_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    kwargs.update(args)
    if "lr" in params or accepts_any:
        kwargs.setdefault("lr", learning_rate)
    if cls.__name__ == "Adafactor" and kwargs.get("relative_step", True):
        # transformers' Adafactor defaults to relative_step=True, which ignores lr; sd-scripts
        # only allows that with lr=None. Say so rather than silently dropping the user's lr.
        if "relative_step" not in args:
            kwargs["relative_step"] = False
            kwargs.setdefault("scale_parameter", False)
            kwargs.setdefault("warmup_init", False)
        else:
            kwargs["lr"] = None
            if warn:
                logger.warning("Adafactor with relative_step=True: learning_rate is ignored")
    try:
        return cls(param_groups, **kwargs)
    except Exception as e:  # noqa: BLE001 - constructors fail on bad values in many ways
        given = ", ".join(f"{k}={v!r}" for k, v in args.items()) or "none"
        raise OptimizerError(f"optimizer_args for {cls.__name__} (given: {given}): "
                             f"{type(e).__name__}: {e}") from None


def build_scheduler(name: str, optimizer, *, warmup_steps: int, total_steps: int,
                    num_cycles: int = 1, power: float = 1.0):
    """One scheduler step per optimizer step; all counts in optimizer steps."""
    import torch
    from torch.optim.lr_scheduler import LambdaLR

    if "." in name:
        module, attr = name.rsplit(".", 1)
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            raise OptimizerError(f"lr_scheduler: cannot import {name}") from None
        return cls(optimizer)
    if name not in SCHEDULERS:
        raise OptimizerError(f"lr_scheduler: unknown scheduler {name!r}; known: {', '.join(SCHEDULERS)}")
    w, n = warmup_steps, max(total_steps, 1)

    def warm(step):
        return (step + 1) / (w + 1) if step < w else None

    # Written here (not diffusers' get_scheduler) so the curves are ours to test and document:
    # lambda(step) is the factor applied during optimizer step `step` (0-based).
    def factor(step):
        f = warm(step)
        if name == "constant":
            return 1.0
        if f is not None:
            return f
        if name == "constant_with_warmup":
            return 1.0
        progress = min(1.0, (step - w) / max(1, n - w))
        if name == "linear":
            return max(0.0, 1.0 - progress)
        if name == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if name == "cosine_with_restarts":
            if progress >= 1.0:
                return 0.0
            return 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0)))
        if name == "polynomial":
            return max(0.0, (1.0 - progress)) ** power
        raise AssertionError(name)

    del torch
    return LambdaLR(optimizer, factor)
