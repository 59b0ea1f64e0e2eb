"""Byte identity of a refactor: the same fixed tiny runs give the same files before and after.

    python benchmarks/identity.py run --out /tmp/ident-before [--only lora ddp2]
    python benchmarks/identity.py compare /tmp/ident-before/manifest.json /tmp/ident-after/manifest.json

``run`` trains six fixed runs on ``tiny-sd15`` (64 px, generated images, one CPU thread per
process, 4 steps, a model and a training state saved at step 2 and at the end) and writes
``manifest.json``: for every file each run wrote, its content by kind:
  *.safetensors  every tensor's dtype, shape and SHA-256 of its bytes, and the metadata (the
                 three time stamps left out: ss_training_started_at / _finished_at,
                 modelspec.date; the embedded architecture record parsed)
  .metadata      FSDP's checkpoint index: its tensor layout (not its random save id and folder)
  *.json         the parsed document (state.json is compared key by key) without its time stamp
                 (saved_at); the ``--out`` folder (data and outputs) written as <ROOT>
  anything else  the SHA-256 of its bytes (optimizer states, FSDP shards, ...)
The runs: lora (train_lora), dreambooth_ema (train_dreambooth, text encoder, ema_decay),
finetune (finetune.py from a metadata file), ti (train_textual_inversion, 2 vectors), fsdp
(train_dreambooth --fsdp on 2 processes) and ddp2 (train_lora on 2 processes, global batch 2).
``compare`` prints every difference (run / file / key) and exits 1 if there is one.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library.accelerator import free_port  # noqa: E402
from library.config.options import OPTIONS_BY_NAME  # noqa: E402
from tools.make_sample_dataset import make_sample_dataset  # noqa: E402

TIME_KEYS = ("ss_training_started_at", "ss_training_finished_at", "modelspec.date", "saved_at")
COMMON = ["--pretrained_model_name_or_path", "tiny-sd15", "--resolution", "64",
          "--max_train_steps", "4", "--save_every_n_steps", "2", "--save_state", "--seed", "7"]


def runs(data: str, meta: str) -> dict[str, tuple[str, list[str], int]]:
    """name -> (entry script, its arguments without --output_dir, number of processes)."""
    folder = ["--train_data_dir", data, "--cache_latents"]
    return {
        "lora": ("train_lora.py", [*COMMON, *folder, "--network_dim", "4", "--learning_rate",
                                   "1e-2"], 1),
        "dreambooth_ema": ("train_dreambooth.py", [*COMMON, *folder, "--train_text_encoder",
                                                   "--learning_rate", "1e-3", "--ema_decay",
                                                   "0.7"], 1),
        "finetune": ("finetune.py", [*COMMON, "--train_data_dir", os.path.join(data, "2_sks shape"),
                                     "--in_json", meta, "--dataset_repeats", "2", "--cache_latents",
                                     "--learning_rate", "1e-3"], 1),
        "ti": ("train_textual_inversion.py", [*COMMON, *folder, "--token_string", "mytok",
                                              "--init_word", "shape", "--caption_prefix", "mytok",
                                              "--num_vectors_per_token", "2", "--learning_rate",
                                              "1e-2"], 1),
        "fsdp": ("train_dreambooth.py", [*COMMON, *folder, "--train_text_encoder",
                                         "--learning_rate", "1e-3", "--fsdp"], 2),
        "ddp2": ("train_lora.py", [*COMMON, *folder, "--network_dim", "4", "--learning_rate",
                                   "1e-2", "--train_batch_size", "1"], 2),
    }


def launch(script: str, args: list[str], procs: int, out: str) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT)
    for k in [k for k in env if k.startswith("ACCELERATE_")] + ["WORLD_SIZE", "RANK", "LOCAL_RANK"]:
        env.pop(k, None)
    target = [os.path.join(ROOT, script), *args, "--output_dir", out]
    if procs == 1:
        cmd = [sys.executable, *target]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
               str(procs), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend",
               "no", "--main_process_port", str(free_port()), *target]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{script} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")


def normal_config(text: str):
    """The embedded architecture record, its defaulted-key lists sorted (files written before
    sd_checkpoint sorted them list those keys in the process's string-hash order)."""
    rec = json.loads(text)
    for cfg in rec.values():
        if isinstance(cfg, dict) and "_use_default_values" in cfg:
            cfg["_use_default_values"] = sorted(cfg["_use_default_values"])
    return rec


def describe(path: str, root: str):
    """The comparable content of one output file (see the module docstring)."""
    if path.endswith(".safetensors"):
        # lazy: --help loads this module before torch; torch and safetensors are imported when
        # describe() runs
        import torch
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            md = {k: normal_config(v) if k == "sdtk.diffusers_config" else v
                  for k, v in (f.metadata() or {}).items() if k not in TIME_KEYS}
            tensors = {}
            for k in f.keys():
                t = f.get_tensor(k).contiguous()
                raw = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
                tensors[k] = [str(t.dtype), list(t.shape), hashlib.sha256(raw).hexdigest()]
        return {"metadata": md, "tensors": tensors}
    if os.path.basename(path) == ".metadata":
        # torch.distributed.checkpoint's index: a pickle with a random save id and the
        # temporary folder it was written in; the tensors' layout is what must match
        with open(path, "rb") as f:
            m = pickle.load(f)
        return hashlib.sha256(repr((m.state_dict_metadata, m.storage_data)).encode()).hexdigest()
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".json"):
        doc = json.loads(raw.decode("utf-8").replace(root, "<ROOT>"))
        return {k: v for k, v in doc.items() if k not in TIME_KEYS} if isinstance(doc, dict) else doc
    return hashlib.sha256(raw).hexdigest()


def manifest_of(out: str, root: str) -> dict:
    files = {}
    for dirpath, _, names in os.walk(out):
        for n in sorted(names):
            p = os.path.join(dirpath, n)
            files[os.path.relpath(p, out)] = describe(p, root)
    return files


def cmd_run(a) -> None:
    os.makedirs(a.out, exist_ok=True)
    data = os.path.join(a.out, "data")
    make_sample_dataset(data, n_images=2, size=64, repeats=2)
    concept = os.path.join(data, "2_sks shape")
    meta = {}
    for n in sorted(os.listdir(concept)):
        stem, ext = os.path.splitext(n)
        if ext == ".caption":
            with open(os.path.join(concept, n), encoding="utf-8") as f:
                meta[stem] = {"caption": f.read().strip()}
    meta_path = os.path.join(a.out, "meta.json")
    with open(meta_path, "w", encoding="utf-8") as f:
        json.dump(meta, f)
    manifest = {}
    for name, (script, args, procs) in runs(data, meta_path).items():
        if a.only and name not in a.only:
            continue
        out = os.path.join(a.out, name)
        t0 = time.perf_counter()
        launch(script, args, procs, out)
        manifest[name] = manifest_of(out, a.out)
        print(f"{name}: {len(manifest[name])} files, {time.perf_counter() - t0:.0f} s", flush=True)
    with open(os.path.join(a.out, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)


def differences(a, b, where: str):
    """Every (place, before, after) where two manifests differ, key by key."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                yield f"{where}/{k}", a.get(k, "<missing>"), b.get(k, "<missing>")
            else:
                yield from differences(a[k], b[k], f"{where}/{k}")
    elif a != b:
        yield where, a, b


def new_option_at_default(where: str, before, after) -> bool:
    """A training state's record of an option added since the before run, at its default: the
    same run (the rule of train_state.check_resumable, which resumes such a state)."""
    head, _, name = where.rpartition("/")
    option = OPTIONS_BY_NAME.get(name)
    return (head.endswith("/state.json/config") and before == "<missing>" and option is not None
            and after == json.loads(json.dumps(option.default)))


def cmd_compare(a) -> int:
    with open(a.before, encoding="utf-8") as f:
        before = json.load(f)
    with open(a.after, encoding="utf-8") as f:
        after = json.load(f)
    diffs = [d for d in differences(before, after, "") if not new_option_at_default(*d)]
    for where, x, y in diffs:
        print(f"{where}: {str(x)[:120]} -> {str(y)[:120]}")
    n_files = sum(len(v) for v in before.values())
    print(f"{len(before)} runs, {n_files} files: "
          + ("identical" if not diffs else f"{len(diffs)} differences"))
    return 1 if diffs else 0


def main(argv=None, run=None, doc: str = __doc__) -> int:
    """``run`` / ``compare`` with ``run`` (default: this module's runs) writing the manifest."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--only", nargs="*", default=None)
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    a = p.parse_args(argv)
    if a.cmd == "run":
        (run or cmd_run)(a)
        return 0
    return cmd_compare(a)


if __name__ == "__main__":
    sys.exit(main())
