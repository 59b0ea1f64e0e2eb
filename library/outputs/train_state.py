"""Training states: what ``save_state`` writes and ``resume`` reads, so that a run continues exactly.

A state is a folder next to the model files (sd-scripts' names): ``<output_name>-000001-state``
per epoch save, ``<output_name>-step00000100-state`` per step save (and on SIGINT/SIGTERM),
``<output_name>-state`` at the end. It holds

- ``state.json``: format version, counters (global step, epochs done, samples seen), the data
  position (epoch and index of the next global batch in that epoch's global order), the step plan
  it was made under (global batch, steps per epoch), the resolved config (``opts.to_dict()``), a
  fingerprint of the data (one entry per image), the content hashes of the model files, images
  and masks (``content``, library/outputs/content_hash.py) and the per-step loss and learning-rate logs;
- ``trainable.safetensors``: every trainable parameter, by name;
- ``stepper.pt``: the stepper's ``state_dict()`` (optimizer(s) and scheduler(s));
- ``ema.safetensors`` (with ``ema_decay``): the moving average of every trainable parameter,
  by the same names (``library/training/ema.py``);
- with ``fsdp`` instead of ``trainable.safetensors`` / ``ema.safetensors`` and the optimizer part
  of ``stepper.pt``: ``sharded/``, a ``torch.distributed.checkpoint`` folder (one file per process
  and ``.metadata``) of the weights, the optimizer state and the EMA, each process writing its
  shards into the same temporary folder (``library/distributed/fsdp.py``); loading reshards to the resuming
  run's process count;
- with ``deepspeed``, besides the files above: ``deepspeed/``, DeepSpeed's own checkpoint (the
  partitioned optimizer state, one file per process, written by every process into the same
  temporary folder; ``library/distributed/deepspeed_zero.py``); it resumes on the same process count only;
- ``rng.pt``: the global generators of every process (torch CPU and CUDA, Python, NumPy). The
  noise, timesteps, order and augmentation are keyed by (seed, epoch, sample) and need none;
  network dropout (neuron, rank, module) draws from torch's global generator, which is why it
  is kept.

The folder is written under a temporary name and renamed into place (``files.atomic_dir``): a
save that fails leaves the previous state of that name intact.

A resume may lengthen the run (``max_train_steps`` / ``max_train_epochs``; a schedule that depends
on the total length then continues with the new length's curve from the resume point), change the
learning rates (e.g. lower after a non-finite stop: the curve continues at the new base rates),
``on_nonfinite``, the saving options, speed and memory options, and the process count or the
split of the global batch (``train_batch_size`` x processes x ``gradient_accumulation_steps``)
as long as the global batch stays the same. Anything else that differs from the state is an error naming it.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import time
import zipfile
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.optim.lr_scheduler import LambdaLR

from library import safetensors_file
from library.accelerator import _is_multi_process, is_main_process
from library.config.options import METHOD_OF_SCRIPT, OPTIONS_BY_NAME
from library.config.parse import Options
from library.config.parse import required
from library.data.step_plan import StepPlan
from library.data.training_data import TrainingSet
from library.distributed.strategy import DEEPSPEED_DIR, SHARDED_DIR
from library.errors import ResumeError, first_line
from library.files import SaveError, atomic_dir, output_file, save_elsewhere
from library.outputs import content_hash
from library.training import flow_loss, nonfinite
from library.training.ema import STATE_FILE
from library.training.nonfinite import first_nonfinite
from library.training.progress import Progress

STATE_VERSION = 1
INFO_FILE = "state.json"
WEIGHTS_FILE = "trainable.safetensors"
STEPPER_FILE = "stepper.pt"
RNG_FILE = "rng.pt"

# Options a resume may change, and why that cannot change what the continued run computes
# (beyond float rounding for the speed/memory ones). Everything else must match the state.
RESUMABLE_CHANGES = {
    "max_train_steps": "the run may be lengthened",
    "max_train_epochs": "the run may be lengthened",
    "resume": "the state to resume from",
    "dry_run": "run control",
    "config": "where the options come from",
    "dataset_config": "where the dataset options come from (the data itself is compared)",
    "output_dir": "where files are written",
    "output_name": "how files are named",
    "save_model_as": "file format", "save_precision": "file precision",
    "training_comment": "metadata only",
    **{f"metadata_{k}": "metadata only" for k in (
        "title", "author", "description", "license", "tags", "usage_hint", "thumbnail",
        "merged_from", "trigger_phrase", "preprocessor", "is_negative_embedding")},
    "save_every_n_epochs": "save interval", "save_every_n_steps": "save interval",
    "save_state": "state saving", "save_state_on_train_end": "state saving",
    "save_last_n_epochs": "rotation", "save_last_n_steps": "rotation",
    "save_last_n_epochs_state": "rotation", "save_last_n_steps_state": "rotation",
    "train_batch_size": "split of the global batch (checked: the global batch must stay the same)",
    "gradient_accumulation_steps": "split of the global batch (checked likewise)",
    "max_data_loader_n_workers": "speed", "persistent_data_loader_workers": "speed",
    "torch_compile": "speed", "dynamo_backend": "speed", "ddp_timeout": "failure detection",
    "ddp_gradient_as_bucket_view": "speed", "ddp_static_graph": "speed",
    "fused_reductions_in_flight": "speed and memory (the same weights bit for bit)",
    "ddp_bucket_cap_mb": "speed",
    "gradient_checkpointing": "memory", "highvram": "memory", "sdpa": "speed", "xformers": "speed",
    "vae_batch_size": "speed", "text_encoder_batch_size": "speed", "cache_latents": "speed", "cache_latents_to_disk": "speed",
    "cache_dir": "speed", "ema_device": "where the EMA lives (its values are in the state)",
    "cache_text_encoder_outputs": "speed (frozen text encoders only; FLUX.1 / SD3: T5 beside trained CLIP)",
    "cache_text_encoder_outputs_to_disk": "speed (frozen text encoders only; FLUX.1 / SD3: T5 beside trained CLIP)",
    "use_t5xxl_cache_only": "speed (SD3: T5's outputs cached, the same training)",
    "learning_rate": "lower after a non-finite stop (the schedule continues at the new rate)",
    "unet_lr": "likewise", "text_encoder_lr": "likewise",
    "on_nonfinite": "failure handling (e.g. skip the batch that went non-finite)",
    "logging_dir": "reporting", "log_with": "reporting", "log_prefix": "reporting",
    "log_tracker_name": "reporting", "log_tracker_config": "reporting",
    "wandb_run_name": "reporting", "wandb_api_key": "reporting",
    "validate_every_n_steps": "reporting", "validate_every_n_epochs": "reporting",
    "sample_prompts": "reporting", "sample_every_n_steps": "reporting",
    "sample_every_n_epochs": "reporting", "sample_at_first": "reporting", "sample_sampler": "reporting",
    "progress_file": "reporting", "control_file": "run control",
    **{k: "where saves are uploaded" for k in (
        "huggingface_repo_id", "huggingface_repo_type", "huggingface_path_in_repo",
        "huggingface_token", "huggingface_repo_visibility", "save_state_to_huggingface",
        "async_upload")},
    "resume_from_huggingface": "where the state to resume from is",
}

_STATE_NAME = re.compile(r"^(?P<name>.+?)(?:-(?P<epoch>\d{6})|-step(?P<step>\d{8}))?-state$")


# -- names, discovery, rotation -------------------------------------------------------------------
def state_dir(output_dir: str, output_name: str, *, epoch: int | None = None,
              step: int | None = None) -> str:
    """sd-scripts' state folder names, next to the model files of the same save: the model's
    name with ``-state`` for its extension."""
    return output_file(output_dir, output_name, "-state", epoch=epoch, step=step)


def read_info(path: str) -> dict:
    f = os.path.join(path, INFO_FILE)
    if not os.path.lexists(path):
        raise ResumeError(f"resume: no such training state folder: {path}")
    if not os.path.isdir(path):
        raise ResumeError(f"resume: {path} is not a folder (give a training state folder such as "
                          "<output_name>-state, or latest)")
    try:
        with open(f, encoding="utf-8") as fh:
            info = json.load(fh)
    except FileNotFoundError:
        raise ResumeError(f"resume: {path} has no {INFO_FILE}; it is not a training state") from None
    except (OSError, ValueError) as e:
        raise ResumeError(f"resume: {path} is damaged: {INFO_FILE} cannot be read "
                          f"({first_line(e)})") from None
    if info.get("version") != STATE_VERSION:
        raise ResumeError(f"resume: {f}: state format {info.get('version')!r} is not "
                          f"{STATE_VERSION} (written by another version of this toolkit)")
    # fsdp: the weights (and optimizer state, EMA) are torch.distributed.checkpoint shards
    weights = os.path.join(SHARDED_DIR, ".metadata") if info.get("sharded") else WEIGHTS_FILE
    if info.get("deepspeed"):
        weights = os.path.join(DEEPSPEED_DIR, "zero")  # and trainable.safetensors, checked below
        if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
            raise ResumeError(f"resume: {path} is incomplete: {WEIGHTS_FILE} is missing")
    for name in (weights, STEPPER_FILE, RNG_FILE):
        if not os.path.exists(os.path.join(path, name)):
            raise ResumeError(f"resume: {path} is damaged: {name} is missing")
    checks = [(STEPPER_FILE, _torch_file_problem), (RNG_FILE, _torch_file_problem)]
    if not info.get("sharded"):
        checks.append((WEIGHTS_FILE, _safetensors_problem))
    for name, check in checks:
        problem = check(os.path.join(path, name))
        if problem:
            raise ResumeError(f"resume: {path} is damaged: {name} {problem}")
    return info


def _safetensors_problem(path: str) -> str | None:
    """Why a safetensors file is unusable (truncated, bad header), from its header and size."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                return "is truncated (incomplete header)"
            header = json.loads(f.read(n))
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    except ValueError:
        return "has a corrupt header"
    end = max((v["data_offsets"][1] for k, v in header.items()
               if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v), default=0)
    if 8 + n + end > size:
        return f"is truncated ({size} bytes, its header describes {8 + n + end})"
    return None


def _torch_file_problem(path: str) -> str | None:
    """Why a torch.save file (a zip archive) is unusable: the central directory sits at its end,
    so a truncated file has none, or entries that reach past the end (nothing is decompressed)."""
    try:
        size = os.path.getsize(path)
        with zipfile.ZipFile(path) as z:
            for e in z.infolist():
                if e.header_offset + e.compress_size > size:
                    return f"is truncated ({size} bytes)"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    except zipfile.BadZipFile:
        return f"is truncated or not a torch save file ({size} bytes)"
    return None


def list_states(output_dir: str, damaged: list | None = None) -> list[tuple[int, float, str]]:
    """(global step, mtime, path) of every complete state folder in ``output_dir``; the others
    as (mtime, path, ResumeError) into ``damaged``."""
    out: list[tuple[int, float, str]] = []
    if not os.path.isdir(output_dir):
        return out
    for entry in os.listdir(output_dir):
        path = os.path.join(output_dir, entry)
        if entry.startswith(".") or not _STATE_NAME.match(entry) or not os.path.isdir(path):
            continue
        try:
            info = read_info(path)
        except ResumeError as e:
            if damaged is not None:
                damaged.append((os.path.getmtime(path), path, e))
            continue
        out.append((int(info["global_step"]), os.path.getmtime(os.path.join(path, INFO_FILE)), path))
    return out


def resolve(resume: str, output_dir: str | None, log=None) -> str:
    """The state folder ``resume`` names: a path, or ``latest`` = the highest step in output_dir
    (a damaged state, e.g. truncated when the disk filled, is passed over with a warning)."""
    if resume == "latest":
        damaged: list = []
        states = list_states(output_dir or ".", damaged)
        if not states:
            why = f"; {damaged[0][2]}" if damaged else ""
            raise ResumeError(f"resume latest: no training state in output_dir {output_dir} "
                              f"(states are written with save_state or on SIGINT/SIGTERM){why}")
        chosen = max(states)  # highest step; among equal steps the newest
        for mtime, path, err in sorted(damaged):
            if log is not None and mtime >= chosen[1]:
                log.warning(f"{err}; resume latest uses the previous state {chosen[2]}")
        return chosen[2]
    return resume


def remove_state(path: str, log) -> None:
    if os.path.isdir(path) and _STATE_NAME.match(os.path.basename(path)):
        shutil.rmtree(path)
        log.info(f"removed old state {path}")


# -- what must match ------------------------------------------------------------------------------
def data_fingerprint(tset) -> list[list]:
    """One entry per image of the run: path, size in bytes, caption, repeats, bucket, reg flag;
    with masked loss also the mask's source (alpha, or the mask file and its size)."""
    out = []
    for it in list(tset.train_items) + list(tset.reg_items):
        try:
            size = os.path.getsize(it.path)
        except OSError:
            size = -1
        entry = [str(it.path), size, it.caption, int(it.num_repeats),
                 list(it.bucket) if it.bucket else None, bool(it.is_reg)]
        mask = it.mask_path
        if mask or it.alpha_mask:  # masked loss: its mask source too
            try:
                msize = os.path.getsize(mask) if mask else -1
            except OSError:
                msize = -1
            entry.append(["alpha"] if not mask else [str(mask), msize])
        out.append(entry)
    return out


def _json(v):
    return json.loads(json.dumps(v))


def check_resumable(info: dict, path: str, opts: Options, plan, tset) -> None:
    """Raise ResumeError naming the first thing that differs between the state and this run."""
    saved, now = info["config"], _json(opts.to_dict())
    for key in sorted(set(saved) | set(now)):
        if key in RESUMABLE_CHANGES:
            continue
        if key not in saved and key in OPTIONS_BY_NAME and \
                now.get(key) == _json(OPTIONS_BY_NAME[key].default):
            continue  # an option newer than the state, at its default: the run it saved
        if saved.get(key) != now.get(key):
            raise ResumeError(
                f"resume: {key} changed since the state in {path} was saved (was "
                f"{_show(saved.get(key))}, now {_show(now.get(key))}); a resume continues the same "
                "run: use the saved value or start a new run")
    if plan.global_batch != info["global_batch"]:
        raise ResumeError(
            f"resume: the global batch changed since the state in {path} was saved (was "
            f"{info['global_batch']} = train_batch_size {info['train_batch_size']} x "
            f"{info['processes']} process(es) x gradient_accumulation_steps "
            f"{info['gradient_accumulation_steps']}, now {plan.global_batch} = "
            f"{plan.train_batch_size} x {plan.processes} x {plan.gradient_accumulation_steps}); "
            "set train_batch_size so that the global batch stays the same")
    if info.get("deepspeed") and opts.zero_stage and plan.processes != info["processes"]:
        raise ResumeError(
            f"resume: the state in {path} holds DeepSpeed ZeRO stage {opts.zero_stage} optimizer "
            f"state partitioned over {info['processes']} process(es); resume it on "
            f"{info['processes']} (this run has {plan.processes})")
    fp_saved, fp_now = info["data"], _json(data_fingerprint(tset))
    if fp_saved != fp_now:
        raise ResumeError(f"resume: the training data changed since the state in {path} was saved "
                          f"({_data_diff(fp_saved, fp_now)})")
    if plan.steps_per_epoch != info["steps_per_epoch"]:  # same data and batch: cannot happen
        raise ResumeError(f"resume: steps per epoch changed ({info['steps_per_epoch']} -> "
                          f"{plan.steps_per_epoch}) since the state in {path} was saved")
    if plan.total_steps <= info["global_step"]:
        length = "max_train_epochs" if opts.max_train_epochs else "max_train_steps"
        raise ResumeError(
            f"resume: the state in {path} is at step {info['global_step']} but this run has "
            f"{plan.total_steps} steps; raise {length} to train further")


def check_resume(opts: Options, method_name: str, plan, tset, log) -> tuple[str, dict]:
    """The state ``opts.resume`` names, found and checked against this run (its script, options,
    plan, data and content) before weights load; -> (path, info). ``log`` None: checked again
    quietly (after the load, when the joined job's plan may differ from the launcher's)."""
    path = resolve(required(opts.resume, "resume"), opts.output_dir, log)
    info = read_info(path)
    saved_method = info.get("method")
    if saved_method and saved_method != method_name:  # before the option diff, which would
        # name some option the two scripts set differently
        script = {m: s for s, m in METHOD_OF_SCRIPT.items()}
        raise ResumeError(
            f"resume: the state in {path} was written by {script.get(saved_method, saved_method)}"
            f".py ({saved_method}), this is {script.get(method_name, method_name)}.py; resume it "
            "with the script that wrote it")
    # the options as the run resolves them (an unset network_module is the family's LoRA, as saved)
    check_resumable(info, path, flow_loss.with_family_network(opts, method_name), plan, tset)

    # the content of the model files and images (after the data check has named any new path)
    content_hash.check(info.get("content"), opts, tset, path, log)
    if log is not None and is_main_process():
        print(f"resume: {path}: step {info['global_step']} of {plan.total_steps}, epoch "
              f"{info['epoch']} from its global batch {info['batch'] + 1} of {plan.steps_per_epoch}",
              flush=True)
    return path, info


def _show(v) -> str:
    return "unset" if v is None else repr(v)


def _data_diff(a: list, b: list) -> str:
    fields = ("path", "file size", "caption", "repeats", "bucket", "regularisation flag")
    if len(a) != len(b):
        return f"{len(a)} images then, {len(b)} now"
    for x, y in zip(a, b):
        if x != y:
            what = next(f for f, u, v in zip(fields, x, y) if u != v)
            return f"{what} of {y[0]}: was {_show(x[fields.index(what)])}, now " \
                   f"{_show(y[fields.index(what)])}"
    return "unknown difference"


# -- trainable parameters by name -----------------------------------------------------------------
def named_trainable(method, b) -> list[tuple[str, object]]:
    """(name, parameter) for every trainable parameter of the ``method`` over the model ``b``
    (its bundle), in ``trainable_parameters()`` order."""
    roots = []
    if method.network is not None:
        roots.append(("network", method.network))
    roots.append(("unet", b.unet))
    for i, te in enumerate(b.text_encoders):
        roots.append(("text_encoder" if i == 0 else f"text_encoder_{i + 1}", te))
    names: dict[int, str] = {}
    for prefix, module in roots:
        for n, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), f"{prefix}.{n}")
    out = []
    for i, p in enumerate(method.trainable_parameters()):
        out.append((names.get(id(p), f"param.{i}"), p))
    return out


def saved_tensors(named: list, ema) -> list:
    """(name, tensor) of what a save writes that training changes: the trainable parameters
    (``named``) and the EMA (frozen weights come from the loaded model and stay as loaded)."""
    if ema is None:
        return named
    return named + [("ema." + n, e) for (n, _), e in zip(named, ema.shadow)]


# -- RNG ------------------------------------------------------------------------------------------
def rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": _plain_tuple(random.getstate())}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    st["numpy"] = {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "gauss": float(gauss)}
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(_tuple(st["python"]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
    n = st["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["gauss"]))


def _plain_tuple(v):
    return [_plain_tuple(x) for x in v] if isinstance(v, (tuple, list)) else v


def _tuple(v):
    return tuple(_tuple(x) for x in v) if isinstance(v, list) else v


# -- write and load -------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunRecord:
    """What a state records of its run besides the progress: the options, the step plan, the
    training set (its fingerprint and content hashes) and the method's name."""

    opts: Options
    plan: StepPlan
    tset: TrainingSet
    method_name: str


def write_state(path: str, log, *, record: RunRecord, progress, named: list, ema, stepper,
                strategy, accelerator) -> None:
    """Write a training state to ``path``: the run's ``record`` and ``progress`` (after its last
    completed step), the trainable parameters (``named``) and ``ema``, the ``stepper``'s state
    and the generators. Every process calls this; the main process writes the folder,
    atomically; the ``strategy``'s part (fsdp shards, DeepSpeed's partitions) is written by
    every process into the same temporary folder."""
    acc = accelerator
    stepper_state = stepper.state_dict()  # every process (a sharded stepper may gather)
    # nothing non-finite is written, and no good state replaced by it (every process checks)
    nonfinite.check_before_save(saved_tensors(named, ema) + _named_tensors("optimizer", stepper_state),
                                path, acc)
    rngs = _gather_objects(rng_state()) if _is_multi_process() else [rng_state()]

    def write_files(tmp):
        _write_files(tmp, record, progress, strategy, named, ema, stepper_state, rngs)

    if strategy.state_dir is not None:  # the strategy's own part, written by every process
        with _shared_atomic_dir(path, acc) as tmp:
            strategy.save_process_state(tmp, named, ema)
            if is_main_process():
                write_files(tmp)
    elif is_main_process():
        _write_single(path, write_files)
    if is_main_process():
        log.info(f"saved training state {path} (step {progress.global_step}"
                 f"{strategy.state_note()})")
    acc.wait_for_everyone()


def _write_single(path: str, write_files) -> None:
    """A state only the main process writes; when it cannot be written (disk full, read-only),
    a rescue copy in the system temp dir and one line saying where, as for the model file."""
    def write(p):
        with atomic_dir(p) as tmp:
            write_files(tmp)

    try:
        write(path)
    except SaveError as e:
        raise save_elsewhere(e, write, "the training state was",
                             " (continue with --resume {rescue})") from None


@contextlib.contextmanager
def _shared_atomic_dir(path: str, acc):
    """``atomic_dir`` that every process writes into: the main process makes the temporary
    folder and tells the others its name; it is renamed into place after all have written."""
    multi = _is_multi_process()
    if is_main_process():
        with atomic_dir(path) as tmp:
            if multi:
                _broadcast_object(tmp)
            yield tmp
            acc.wait_for_everyone()  # every process's shards are written
    else:
        tmp = _broadcast_object(None)
        yield tmp
        acc.wait_for_everyone()


def _broadcast_object(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _write_files(tmp: str, record: RunRecord, progress, strategy, named: list, ema,
                 stepper_state: dict, rngs: list) -> None:
    """The main process's files of a state (into the temporary folder ``tmp``)."""
    plan, opts = record.plan, record.opts
    flags = strategy.state_flags()  # its layout: {"sharded": ..., "deepspeed": ...}
    info = {
        "version": STATE_VERSION,
        **progress.state_dict(),  # epoch, batch: the next global batch to train
        "global_batch": plan.global_batch, "steps_per_epoch": plan.steps_per_epoch,
        "processes": plan.processes, "train_batch_size": plan.train_batch_size,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "total_steps": plan.total_steps,
        "method": record.method_name,
        "saved_at": time.time(),
        "config": _json(opts.to_dict()),
        "data": _json(data_fingerprint(record.tset)),
        "content": content_hash.fingerprint(opts, record.tset),  # checked by content_hash.check
        **flags,
    }
    if not strategy.weights_sharded:  # (sharded: in its state_dir, written by every process)
        weights = {n: p.detach().to("cpu", copy=True).contiguous() for n, p in named}
        safetensors_file.save(weights, os.path.join(tmp, WEIGHTS_FILE))
        if ema is not None:
            safetensors_file.save(ema.state_tensors([n for n, _ in named]), os.path.join(tmp, STATE_FILE))
    torch.save(_to_cpu(stepper_state), os.path.join(tmp, STEPPER_FILE))
    torch.save({"processes": len(rngs), "ranks": rngs}, os.path.join(tmp, RNG_FILE))
    with open(os.path.join(tmp, INFO_FILE), "w", encoding="utf-8") as f:
        json.dump(info, f)


def load_state(path: str, info: dict, log, *, accelerator, named: list, ema, stepper, strategy,
               network_dropout: float | None):
    """Put the state's weights (into ``named``'s parameters and the ``ema``), optimizer /
    scheduler (the ``stepper``'s, the ``strategy``'s part) and generators into this run; returns
    the saved Progress (library/training/progress.py). ``network_dropout``: the run's (a
    warning when its draws cannot continue exactly)."""
    acc = accelerator
    strategy.check_state(path, info)  # a layout this strategy cannot read: one line
    if info.get("sharded"):
        # the weights, optimizer state and EMA from the shards (resharded to this run)
        strategy.load_sharded_state(path, named, ema)
    else:
        _load_weights(ema, path, named)
    try:
        # Under MULTI_CPU the device is cpu:<rank>, a location torch.load cannot restore to
        device = "cpu" if acc.device.type == "cpu" else acc.device
        st = torch.load(os.path.join(path, STEPPER_FILE), map_location=device, weights_only=True)
        rng = torch.load(os.path.join(path, RNG_FILE), weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises several kinds for a bad file
        # torch's weights_only refusal spans many lines: its first says what failed
        raise ResumeError(f"resume: {path} is damaged: cannot read the optimizer state "
                          f"({first_line(e)})") from None
    fresh = [list(sc.base_lrs) for sc in stepper.schedulers]  # this run's learning rates
    try:
        stepper.load_state_dict(st)
        strategy.load_process_state(path, named, ema)  # e.g. DeepSpeed's partitioned optimizer state
    except (KeyError, ValueError, RuntimeError, AssertionError) as e:
        raise ResumeError(f"resume: {path}: the optimizer state does not fit this run's optimizer "
                          f"({first_line(e)})") from None
    _keep_learning_rates(stepper, fresh, path, log)
    return _load_rest(acc, stepper, network_dropout, info, rng, log)


def _keep_learning_rates(stepper, fresh: list, path: str, log) -> None:
    """A resume may change the learning rates (e.g. lower after a non-finite stop): the loaded
    scheduler state carries the saved run's base rates, replaced here by this run's, so that
    the schedule's curve continues from the resume point at the new rates (``resync_lr``).
    Only for the toolkit's own curves: other schedulers keep their rate in their state."""
    changed = False
    for sc, base in zip(_schedulers(stepper), fresh):
        if list(sc.base_lrs) == base:
            continue
        if type(sc) is not LambdaLR:
            raise ResumeError(f"resume: {path}: the learning rate changed, which a resume can "
                              f"only follow with lr_scheduler's curves (not {type(sc).__name__}); "
                              "use the saved learning rates")
        if not changed:
            log.info(f"resume: this run's learning rates {base} replace the saved {sc.base_lrs}")
        changed = True
        sc.base_lrs = list(base)
        for g, lr in zip(sc.optimizer.param_groups, base):
            g["initial_lr"] = lr


def _load_weights(ema, path: str, named: list) -> None:
    weights = load_file(os.path.join(path, WEIGHTS_FILE))

    bad = first_nonfinite(weights.items())
    if bad is not None:
        raise ResumeError(f"resume: {os.path.join(path, WEIGHTS_FILE)}: tensor {bad} holds NaN or "
                          "inf values; resume from another state")
    missing = [n for n, _ in named if n not in weights]
    extra = sorted(set(weights) - {n for n, _ in named})
    if missing or extra:
        raise ResumeError(f"resume: {path}: the trainable parameters differ from this run's "
                          f"(e.g. {(missing or extra)[0]}); the state belongs to another model")
    with torch.no_grad():
        for n, p in named:
            w = weights[n]
            if w.shape != p.shape:
                raise ResumeError(f"resume: {path}: {n} has shape {tuple(w.shape)} in the state, "
                                  f"{tuple(p.shape)} in this run")
            p.copy_(w.to(p.device, p.dtype))
    if ema is not None:
        f = os.path.join(path, STATE_FILE)
        if not os.path.isfile(f):
            raise ResumeError(f"resume: {path} has no {STATE_FILE} (saved without ema_decay)")
        ema.load_tensors(load_file(f), [n for n, _ in named], path)


def _load_rest(acc, stepper, network_dropout, info: dict, rng: dict, log):
    resync_lr(stepper)
    ranks = rng["ranks"]
    rank = acc.process_index
    set_rng_state(ranks[rank] if len(ranks) == acc.num_processes else ranks[0])
    if len(ranks) != acc.num_processes and network_dropout:
        log.warning("resume: the state was saved by %d process(es), this run has %d: network "
                    "dropout draws from each process's generator and does not continue exactly",
                    len(ranks), acc.num_processes)
    return Progress.from_state(info)


def resync_lr(stepper) -> None:
    """Recompute the learning rates of the next step from each scheduler's own curve.
    A resumed LambdaLR keeps the learning rate the saving run computed for its next step; when
    the resume lengthened the run, the curve (cosine, linear, polynomial) is the new one's. Same
    length: the same values, bit for bit (LambdaLR computes base_lr * lambda(last_epoch))."""
    for s in _schedulers(stepper):
        # only the toolkit's own curves (library/training/optim.py build_scheduler, plain LambdaLR):
        # AdafactorSchedule (a LambdaLR subclass) reports Adafactor's own step size, and a class
        # from lr_scheduler_type keeps its state in its state_dict
        if type(s) is not LambdaLR:
            continue
        lrs = [base * fn(s.last_epoch) for base, fn in zip(s.base_lrs, s.lr_lambdas)]
        for g, lr in zip(s.optimizer.param_groups, lrs):
            g["lr"] = lr
        s._last_lr = lrs


def _schedulers(stepper) -> list:
    """Every scheduler of a stepper (one, or one per fused unit), each once."""
    return list(stepper.schedulers)


def _named_tensors(prefix: str, v) -> list:
    """(dotted path, tensor) of every tensor in a nested state dict."""
    if isinstance(v, torch.Tensor):
        return [(prefix, v)]
    if isinstance(v, dict):
        return [x for k, y in v.items() for x in _named_tensors(f"{prefix}.{k}", y)]
    if isinstance(v, (list, tuple)):
        return [x for i, y in enumerate(v) for x in _named_tensors(f"{prefix}.{i}", y)]
    return []


def _to_cpu(v):
    if isinstance(v, torch.Tensor):
        return v.detach().cpu()
    if isinstance(v, dict):
        return {k: _to_cpu(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_to_cpu(x) for x in v)
    return v


def _gather_objects(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
