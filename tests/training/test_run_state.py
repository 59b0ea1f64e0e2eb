"""The declared run state (library/run/run_state.py) and the strategy chosen at set-up
(library/distributed/strategy.py).

- Components and Progress are slotted records: a module cannot add an attribute to them.
- The strategy follows the options and the process count; its share of validation images and
  sample prompts is item i on process i mod P, or (sharded) every item on every process with
  only its own kept.
- The loop's declared hooks see every micro-step and every step, with the step's loss and
  learning rate as the run records them, and a hook's loss is the one trained on.
- No module outside the trainer reads or writes run state by attribute name (getattr, setattr,
  hasattr, delattr, vars, __dict__): every part is declared, so it is read as ``obj.name``.
"""
from __future__ import annotations

import ast
import dataclasses
import math
import os
from types import SimpleNamespace

import pytest

from tests.helpers import make_opts
from tests.training.test_train_lora_e2e import base_args


def test_records_take_no_undeclared_attribute():
    from library.run.run_state import Caches, Components
    from library.training.progress import Progress

    parts = Components(**{f.name: None for f in dataclasses.fields(Components)})
    for record in (parts, Progress(), Caches()):
        with pytest.raises(AttributeError):
            record.undeclared = 1
    p = Progress()
    assert (p.global_step, p.position, p.loss_log) == (0, (1, 0), [])
    assert Progress().loss_log is not p.loss_log  # each run its own logs


# a value other than the default for every field of Progress, as a state holds it after training
_PROGRESS_VALUES = {
    "global_step": 7, "epochs_done": 2, "samples_seen": 14, "position": (3, 1),
    "loss_log": [0.25, 0.125], "lr_log": [1e-3, 5e-4], "val_log": [(3, 0.5), (6, 0.375)],
    "max_norm_stats": (2, 0.75, 1.5), "last_state": ("out/last-step00000006-state", 6),
}


def test_progress_saves_and_restores_every_field():
    """A state restores the whole record: every field survives state_dict -> JSON -> from_state
    (a field added to Progress without a value here fails, as one the state drops)."""
    import json

    from library.training.progress import Progress

    names = [f.name for f in dataclasses.fields(Progress)]
    assert sorted(names) == sorted(_PROGRESS_VALUES), "give every Progress field a test value"
    p = Progress(**_PROGRESS_VALUES)
    assert all(getattr(p, n) != getattr(Progress(), n) for n in names)
    back = Progress.from_state(json.loads(json.dumps(p.state_dict())))
    for n in names:
        assert getattr(back, n) == getattr(p, n), n
    # scale_weight_norms' device statistics are read to the host on the way
    from library.training.network_options import MaxNormStats
    import torch

    # rows: the norms after scaling, the scale factors (one module scaled)
    p.max_norm_stats = MaxNormStats(torch.tensor([[0.5, 1.0], [1.0, 0.5]]))
    assert Progress.from_state(json.loads(json.dumps(p.state_dict()))).max_norm_stats == (1, 0.75, 1.0)
    # a state written before val_log / max_norm_stats / last_state were saved
    old = {k: v for k, v in p.state_dict().items() if k not in ("val_log", "max_norm_stats", "last_state")}
    q = Progress.from_state(old)
    assert (q.val_log, q.max_norm_stats, q.last_state, q.global_step) == ([], None, None, 7)


def _acc(rank: int, processes: int):
    return SimpleNamespace(process_index=rank, num_processes=processes)


@pytest.mark.parametrize("deepspeed,fsdp,processes,kind", [
    (False, False, 1, "SingleProcess"), (False, False, 2, "DDP"), (False, True, 1, "FSDP"),
    (False, True, 3, "FSDP"), (True, False, 1, "DeepSpeed"), (True, False, 2, "DeepSpeed")])
def test_strategy_follows_the_options(deepspeed, fsdp, processes, kind, tmp_path):
    from library.distributed import strategy
    from library.config.parse import parse_args

    opts = parse_args("train_dreambooth", [
        "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", str(tmp_path),
        "--output_dir", str(tmp_path), "--resolution", "64", "--max_train_steps", "1",
        *(["--deepspeed"] if deepspeed else []), *(["--fsdp"] if fsdp else [])])
    s = strategy.for_run(opts, _acc(0, processes))
    assert type(s).__name__ == kind
    # every process runs every forward: FSDP across processes (all-gathers), DeepSpeed always
    assert s.forward_in_every_process == (kind == "DeepSpeed" or (kind == "FSDP" and processes > 1))
    assert s.state_flags() == {"sharded": kind == "FSDP", "deepspeed": kind == "DeepSpeed"}


def test_share_of_validation_images_and_prompts():
    from library.distributed import strategy

    # 7 items over 3 processes, process 1: items 1 and 4
    assert strategy.DDP(_acc(1, 3), make_opts()).share(7) == [(1, True), (4, True)]
    sharded = strategy.FSDP(_acc(1, 3))
    sharded.roots = [("unet", None)]  # sharded: every item runs everywhere, its own are kept
    assert sharded.share(7) == [(0, False), (1, True), (2, False), (3, False), (4, True),
                                (5, False), (6, False)]
    assert strategy.FSDP(_acc(1, 3)).share(7) == [(1, True), (4, True)]  # nothing sharded


def test_hooks_observe_and_feed_the_loop(dataset, tmp_path, train):
    """2 steps x 2 micro-steps (batch 1, accumulation 2): the micro-step hooks see 4 calls with
    one sample each, the step hook 2 calls whose (loss, lr) are the run's logs, and a loss the
    after-hook makes non-finite stops the run at that step."""
    from library.run.run_state import HOOKS

    micro, steps = [], []

    def before(run, epoch, idx):
        micro.append((run.progress.global_step, epoch, tuple(idx)))

    def after(run, epoch, idx, loss):
        return loss

    def step(run, loss, lr):
        steps.append((run.progress.global_step, loss, lr))

    args = base_args("tiny-sd15", dataset, str(tmp_path / "a"), "--gradient_accumulation_steps", "2",
                     "--lr_scheduler", "constant")
    with HOOKS.add(before_micro_step=before, after_micro_step=after, after_step=step):
        rc, _, err, run = train("train_lora", args)
    assert rc == 0, err
    assert [(s, len(i)) for s, _, i in micro] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert steps == [(1, run.progress.loss_log[0], 1e-3), (2, run.progress.loss_log[1], 1e-3)]
    assert run.progress.lr_log == [1e-3, 1e-3] and all(math.isfinite(x) for x in run.progress.loss_log)

    def poison(run, epoch, idx, loss):
        return loss * float("nan") if run.progress.global_step == 1 else loss

    with HOOKS.add(after_micro_step=poison):
        rc, _, err, _ = train("train_lora", base_args("tiny-sd15", dataset, str(tmp_path / "b")))
    assert rc != 0 and "non-finite loss NaN at step 2" in err


def _run_state_names() -> set[str]:
    """The names a run's state goes by: the Run and its records (and their usual short names),
    and each component, whose interface (method, strategy, stepper, ...) is declared. Not the
    accelerator: accelerate's object, whose optional parts (``scaler``) are its own API."""
    from library.run.run_state import Components

    parts = {f.name for f in dataclasses.fields(Components)} - {"accelerator"}
    return {"run", "r", "parts", "c", "progress", "caches", *parts}


def _by_name(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, code) of every attribute access by name on an object called one of ``names``
    (the last part of its dotted path: ``c.method``, ``self.run``): getattr / setattr / hasattr /
    delattr / vars(obj), obj.__dict__."""
    def last(node):
        if isinstance(node, ast.Attribute):
            return node.attr
        return node.id if isinstance(node, ast.Name) else None

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args and \
                node.func.id in ("getattr", "setattr", "hasattr", "delattr", "vars") and \
                last(node.args[0]) in names:
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Attribute) and node.attr == "__dict__" and last(node.value) in names:
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_scan_finds_access_by_name():
    names = _run_state_names()
    planted = ("net = getattr(c.method, 'network', None)\nsetattr(run, 'x', 1)\n"
               "run.parts.__dict__['k'] = 2\nif hasattr(self.stepper, 'steps_in_backward'): pass\n"
               "vars(progress)\n")
    assert [line for line, _ in _by_name(planted, names)] == [1, 2, 3, 4, 5]
    fine = ("getattr(opts, name)\ngetattr(self.optimizer, 'optimizer', None)\n"
            "getattr(acc, 'scaler', None)\nrun.parts.method.network\n")
    assert _by_name(fine, names) == []


def test_no_module_reads_or_writes_run_state_by_attribute_name():
    """Outside library/run/stages.py (which builds the parts), every module reads the run's
    declared parts as attributes: no probing with getattr/hasattr, no setattr, no __dict__."""
    from tests.helpers import ROOT, source_files

    names = _run_state_names()
    files = [p for p in source_files()
             if os.path.relpath(p, ROOT) != os.path.join("library", "run", "stages.py")]
    assert os.path.join(ROOT, "library", "run", "loop.py") in files  # sub-packages too
    found = [f"{os.path.relpath(path, ROOT)}:{line}: {code}" for path in files
             for line, code in _by_name(open(path, encoding="utf-8").read(), names)]
    assert not found, "\n".join(found)
