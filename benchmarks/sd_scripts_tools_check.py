"""Our LoRA tools side by side with sd-scripts' own (docs/LORA_TOOLS.md "Checked against sd-scripts' tools").

    python benchmarks/sd_scripts_tools_check.py --sd_scripts /path/to/sd-scripts [--work DIR] [--archs sd15 sdxl]

Inputs are made with our code: a LoCon (dim 4 / alpha 2, conv_dim 2 / alpha 1) and a LoRA (dim 4 /
alpha 4) trained 2 steps by our train_lora.py on each tiny model, and for extraction a tiny model
pair (original, tuned = original + random rank-2 deltas) written by library.models.sd_checkpoint. Each tool
then runs twice with the same flags: ours (networks/*.py, tools/show_metadata.py) and sd-scripts'
(as a subprocess, cwd and PYTHONPATH its checkout, so its own `library` package is used; nothing of
it is imported here). Per case the table gives the key sets, the per-module ranks, the per-module
deltas up @ down * alpha / rank (relative Frobenius difference: worst and mean over the common
modules), the metadata keys each writes, and whether each output loads in the other side's
create_network_from_weights.

sd-scripts is run with a small prelude (written to the work folder, our code): its library imports
torchvision for the data pipeline only, and PyPI's torchvision is a CUDA build that cannot load next
to a CPU torch, so a stand-in module that fails on use is put in sys.modules; and transformers 5
dropped the `CLIPFeatureExtractor` alias that its library imports, so the alias is restored.
sd-scripts also needs opencv-python-headless, imagesize and voluptuous (pip install them; they are
not dependencies of this project).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: make the repository root importable
    sys.path.insert(0, ROOT)

from library.models import sd_checkpoint  # noqa: E402
from library.models.families.sd_common.tiny_models import build_tiny_components  # noqa: E402
from networks import lora  # noqa: E402
from tools.make_sample_dataset import make_sample_dataset  # noqa: E402


# Run before an sd-scripts script; argv: the script, then its arguments.
PRELUDE = '''\
import os, runpy, sys, types
from transformers.utils import import_utils as _tiu
import diffusers.utils.import_utils  # noqa: F401  (records "no torchvision" before the stand-in exists)
assert not _tiu.is_torchvision_available()

class _Unusable:
    """torchvision stand-in: building transforms works (train_util does it at import), using them fails."""
    def __init__(self, *args, **kwargs):
        pass
    def __call__(self, *args, **kwargs):
        raise RuntimeError("torchvision is not available in this check")
    def __getattr__(self, name):
        return _Unusable

_tv = types.ModuleType("torchvision")
_tv.transforms = _Unusable()
sys.modules["torchvision"] = _tv
import transformers
sys.modules["transformers"].CLIPFeatureExtractor = transformers.CLIPImageProcessor

script = os.path.abspath(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
'''

# Run (through the prelude) inside sd-scripts: its networks/lora.py create_network_from_weights on
# each file, with the tiny model's text encoders (and, for SD1, U-Net) loaded from a diffusers folder.
# sd-scripts' SDXL U-Net is a fixed full-size class: it is built on the meta device, so for SDXL only
# the module names are checked (the tiny shapes cannot match it).
SD_SCRIPTS_LOADER = '''\
import json, sys, torch
from diffusers import UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTextModelWithProjection
from safetensors.torch import load_file
from networks import lora

arch, folder, files = sys.argv[1], sys.argv[2], sys.argv[3:]
if arch == "sdxl":
    from library.sdxl_original_unet import SdxlUNet2DConditionModel
    with torch.device("meta"):
        unet = SdxlUNet2DConditionModel()
    tes = [CLIPTextModel.from_pretrained(folder + "/text_encoder"),
           CLIPTextModelWithProjection.from_pretrained(folder + "/text_encoder_2")]
else:
    unet = UNet2DConditionModel.from_pretrained(folder + "/unet")
    tes = CLIPTextModel.from_pretrained(folder + "/text_encoder")
for f in files:
    try:
        sd = load_file(f)
        net, _ = lora.create_network_from_weights(1.0, f, None, tes, unet, weights_sd=sd)
        names = {m.lora_name for m in net.text_encoder_loras + net.unet_loras}
        wanted = {k.split(".")[0] for k in sd}
        missing = sorted(wanted - names)
        if missing:
            res = f"{len(missing)}/{len(wanted)} modules not created, e.g. {missing[0]}"
        elif arch == "sdxl":
            res = "names ok"
        else:
            info = net.load_state_dict(sd, strict=False)
            bad = list(info.missing_keys) + list(info.unexpected_keys)
            res = "ok" if not bad else f"{len(bad)} keys not loaded, e.g. {bad[0]}"
    except Exception as e:
        res = "FAIL " + type(e).__name__ + ": " + str(e).splitlines()[0][:100]
    print("RESULT " + json.dumps([f, res]))
'''

FAMILY = {"sd15": "sd1", "sdxl": "sdxl"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sd_scripts", required=True, help="path of a kohya-ss/sd-scripts checkout")
    p.add_argument("--work", default=None, help="folder for inputs and outputs (default: a temporary one)")
    p.add_argument("--archs", nargs="+", default=["sd15", "sdxl"], choices=sorted(FAMILY))
    p.add_argument("--steps", type=int, default=2, help="training steps of the input LoRAs (2-4)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per subprocess")
    return p


# --- running ---------------------------------------------------------------------------------------

def run(cmd, cwd, env_extra, timeout):
    env = dict(os.environ, HF_HUB_OFFLINE="1", **env_extra)
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def last_error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or ln.startswith("error:"):
            return ln[:160]
    return lines[-1][:160] if lines else "(no output)"


class Runner:
    def __init__(self, sd_scripts: str, work: str, timeout: int):
        self.sd = os.path.abspath(sd_scripts)
        self.work = work
        self.timeout = timeout
        self.prelude = os.path.join(work, "sd_scripts_prelude.py")
        with open(self.prelude, "w") as f:
            f.write(PRELUDE)
        self.loader = os.path.join(work, "sd_scripts_loader.py")
        with open(self.loader, "w") as f:
            f.write(SD_SCRIPTS_LOADER)

    def ours(self, script, args):
        return run([sys.executable, os.path.join(ROOT, script), *args], ROOT, {"PYTHONPATH": ROOT}, self.timeout)

    def theirs(self, script, args):
        return run([sys.executable, self.prelude, os.path.join(self.sd, script), *args], self.sd,
                   {"PYTHONPATH": self.sd}, self.timeout)


def file_tools_runner(argv, description: str, scripts: tuple[str, ...], prefix: str):
    """The file-tool checks' command line (--sd_scripts, --work, --timeout): (Runner, work folder),
    or None after one error line when --sd_scripts lacks one of ``scripts``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--sd_scripts", required=True, help="path of a kohya-ss/sd-scripts checkout")
    p.add_argument("--work", default=None, help="folder for inputs and outputs (default: a temporary one)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per subprocess")
    args = p.parse_args(argv)
    missing = [s for s in scripts if not os.path.isfile(os.path.join(args.sd_scripts, s))]
    if missing:
        print(f"error: --sd_scripts {args.sd_scripts}: not an sd-scripts checkout (no {missing[0]})", file=sys.stderr)
        return None
    work = args.work or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(work, exist_ok=True)
    return Runner(args.sd_scripts, work, args.timeout), work


def side_by_side(r: Runner, work: str, cases) -> list[str]:
    """Table rows: each case (title, script, args_of(output), stem, judge(ours, theirs) -> str) run
    by both sides; a failed side is its return code and last error line."""
    rows = ["| tool | result |", "|---|---|"]
    for title, script, args_of, stem, judge in cases:
        ours, theirs = os.path.join(work, f"{stem}.ours.safetensors"), os.path.join(work, f"{stem}.theirs.safetensors")
        rc_o, _, err_o = r.ours(script, args_of(ours))
        rc_t, _, err_t = r.theirs(script, args_of(theirs))
        if rc_o or rc_t or not os.path.isfile(theirs):
            res = f"ours rc {rc_o} {last_error_line(err_o) if rc_o else ''}; theirs rc {rc_t} " \
                  f"{last_error_line(err_t) if rc_t or not os.path.isfile(theirs) else ''}"
        else:
            res = judge(ours, theirs)
        rows.append(f"| {title} | {res} |")
    return rows


# --- inputs (our code) -----------------------------------------------------------------------------

def make_inputs(r: Runner, arch: str, steps: int) -> dict:
    d = os.path.join(r.work, arch)
    os.makedirs(d, exist_ok=True)
    data = os.path.join(d, "data")
    if not os.path.isdir(data):
        make_sample_dataset(data, n_images=2, size=64, repeats=2)
    files = {}
    for name, extra in (("locon", ["--network_dim", "4", "--network_alpha", "2", "--network_args", "conv_dim=2",
                                   "conv_alpha=1", "--seed", "1"]),
                        ("lora", ["--network_dim", "4", "--network_alpha", "4", "--seed", "2"])):
        out = os.path.join(d, "train_" + name)
        rc, _, err = r.ours("train_lora.py", [
            "--pretrained_model_name_or_path", f"tiny-{arch}", "--train_data_dir", data, "--output_dir", out,
            "--resolution", "64", "--max_train_steps", str(steps), "--learning_rate", "1e-2", "--cache_latents",
            *extra])
        if rc != 0:
            raise SystemExit(f"error: training the input {name} on tiny-{arch} failed: {last_error_line(err)}")
        files[name] = os.path.join(out, "last.safetensors")

    # model pair: tuned = original + a random rank-2 delta on every module LoRA/LoCon training targets
    c = build_tiny_components(arch)
    files["folder"] = os.path.join(d, "diffusers")
    if not os.path.isdir(files["folder"]):
        sd_checkpoint.save_diffusers(c, FAMILY[arch], files["folder"])
    files["org"] = os.path.join(d, "org.safetensors")
    sd_checkpoint.save_single_file(c, FAMILY[arch], files["org"])
    tes = [c["text_encoder"]] + ([c["text_encoder_2"]] if "text_encoder_2" in c else [])
    net = lora.LoRANetwork(tes, c["unet"], lora_dim=4, alpha=4, conv_lora_dim=2, conv_alpha=2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in net.text_encoder_loras + net.unet_loras:
            w = m.org_module.weight
            a = torch.randn(w.shape[0], 2, generator=g)
            b = torch.randn(2, w[0].numel(), generator=g)
            w.add_((a @ b).reshape(w.shape) * (0.05 * float(w.std()) / 2))
    files["tuned"] = os.path.join(d, "tuned.safetensors")
    sd_checkpoint.save_single_file(c, FAMILY[arch], files["tuned"])
    return files


# --- comparing -------------------------------------------------------------------------------------

def read(path):
    with safe_open(path, framework="pt") as f:
        md = f.metadata() or {}
    return load_file(path), md


def deltas(sd) -> dict:
    """Per module: rank and up @ down * alpha / rank in float64, flattened to (out, in * k * k)."""
    out = {}
    for key in sd:
        if not key.endswith(".lora_down.weight"):
            continue
        name = key.split(".")[0]
        down = sd[key].double()
        up = sd[name + ".lora_up.weight"].double()
        rank = down.shape[0]
        alpha = float(sd[name + ".alpha"]) if name + ".alpha" in sd else rank
        out[name] = (rank, up.reshape(up.shape[0], rank) @ down.reshape(rank, -1) * (alpha / rank))
    return out


def compare(ours_path, theirs_path) -> dict:
    o_sd, o_md = read(ours_path)
    t_sd, t_md = read(theirs_path)
    o, t = deltas(o_sd), deltas(t_sd)
    common = sorted(set(o) & set(t))
    rels, rank_diffs = [], []
    for name in common:
        ref = t[name][1]
        n = float(ref.norm())
        rels.append(float((o[name][1] - ref).norm()) / n if n > 0 else float(o[name][1].norm()))
        if o[name][0] != t[name][0]:
            rank_diffs.append(o[name][0] - t[name][0])
    return {
        "keys": "equal" if set(o_sd) == set(t_sd) else f"ours-only {len(set(o_sd) - set(t_sd))}, "
                                                        f"theirs-only {len(set(t_sd) - set(o_sd))}",
        "modules": len(common),
        "ranks": "equal" if not rank_diffs else
                 f"{len(rank_diffs)} differ (ours-theirs {min(rank_diffs):+d}..{max(rank_diffs):+d})",
        "worst": max(rels) if rels else float("nan"),
        "mean": sum(rels) / len(rels) if rels else float("nan"),
        "md_ours_only": sorted(set(o_md) - set(t_md)),
        "md_theirs_only": sorted(set(t_md) - set(o_md)),
    }


def our_loader(arch, path) -> str:
    c = build_tiny_components(arch)
    tes = [c["text_encoder"]] + ([c["text_encoder_2"]] if "text_encoder_2" in c else [])
    try:
        net, sd = lora.create_network_from_weights(1.0, path, None, tes, c["unet"])
        net.load_weights(path)
        n = len(net.text_encoder_loras) + len(net.unet_loras)
        wanted = len({k.split(".")[0] for k in sd})
        return "ok" if n == wanted else f"{wanted - n}/{wanted} modules not created"
    except Exception as e:  # reported, not raised: the table shows every failure
        return "FAIL " + type(e).__name__ + ": " + str(e).splitlines()[0][:100]


def their_loader(r: Runner, arch, folder, paths) -> dict:
    rc, out, err = r.theirs(r.loader, [arch, folder, *paths])
    got = dict(json.loads(ln[len("RESULT "):]) for ln in out.splitlines() if ln.startswith("RESULT "))
    return {p: got.get(p, f"FAIL (rc {rc}) {last_error_line(err)}") for p in paths}


def norm_md(md: dict) -> dict:
    out = {}
    for k, v in md.items():
        try:
            out[k] = json.loads(v) if isinstance(v, str) else v
        except ValueError:
            out[k] = v
    return out


def show_metadata_row(r: Runner, path) -> str:
    rc_o, out_o, err_o = r.ours("tools/show_metadata.py", ["--model", path, "--json"])
    rc_t, out_t, err_t = r.theirs("tools/show_metadata.py", ["--model", path])
    if rc_o or rc_t:
        return f"ours rc {rc_o} {last_error_line(err_o) if rc_o else ''} / theirs rc {rc_t} " \
               f"{last_error_line(err_t) if rc_t else ''}"
    o, t = norm_md(json.loads(out_o)), norm_md(json.loads(out_t[out_t.index("{"):]))
    if set(o) != set(t):
        return f"keys differ: ours-only {sorted(set(o) - set(t))}, theirs-only {sorted(set(t) - set(o))}"
    differ = sorted(k for k in o if o[k] != t[k])
    return f"{len(o)} keys, same; values differ: {differ}" if differ else f"{len(o)} keys and values, same"


# --- the cases -------------------------------------------------------------------------------------

def cases(arch, f, out):
    """(label, our script, their script, args with {out} for the output path)."""
    sdxl = ["--sdxl"] if arch == "sdxl" else []
    resize = [("resize --new_rank 2 --new_conv_rank 1", ["--model", f["locon"], "--new_rank", "2",
                                                        "--new_conv_rank", "1"])]
    for method, param in (("sv_ratio", "2"), ("sv_cumulative", "0.9"), ("sv_fro", "0.9")):
        resize.append((f"resize --dynamic_method {method} {param}",
                       ["--model", f["locon"], "--new_rank", "4", "--dynamic_method", method, "--dynamic_param", param]))
    rows = [(label, "networks/resize_lora.py", args) for label, args in resize]
    rows += [
        ("svd_merge 0.7/0.3 --new_rank 4 --new_conv_rank 2", "networks/svd_merge_lora.py",
         ["--models", f["locon"], f["lora"], "--ratios", "0.7", "0.3", "--new_rank", "4", "--new_conv_rank", "2"]),
        ("svd_merge 0.7/0.3 --new_rank 8 --new_conv_rank 2 (full rank)", "networks/svd_merge_lora.py",
         ["--models", f["locon"], f["lora"], "--ratios", "0.7", "0.3", "--new_rank", "8", "--new_conv_rank", "2"]),
        ("merge 0.7/0.3", "networks/merge_lora.py", ["--models", f["locon"], f["lora"], "--ratios", "0.7", "0.3"]),
        ("merge 0.7/0.3 --concat", "networks/merge_lora.py",
         ["--models", f["locon"], f["lora"], "--ratios", "0.7", "0.3", "--concat"]),
        ("extract --dim 4 --conv_dim 2", "networks/extract_lora_from_models.py",
         ["--model_org", f["org"], "--model_tuned", f["tuned"], "--dim", "4", "--conv_dim", "2", *sdxl]),
    ]
    return rows


def fmt(x):
    return "-" if x != x else f"{x:.1e}"


def check_arch(r: Runner, arch: str, steps: int) -> list[str]:
    f = make_inputs(r, arch, steps)
    lines = []
    outputs = []
    for i, (label, script, args) in enumerate(cases(arch, f, r.work)):
        o_path = os.path.join(r.work, arch, f"ours_{i}.safetensors")
        t_path = os.path.join(r.work, arch, f"theirs_{i}.safetensors")
        for p in (o_path, t_path):
            if os.path.exists(p):
                os.remove(p)
        rc_o, _, err_o = r.ours(script, [*args, "--save_to", o_path])
        rc_t, _, err_t = r.theirs(script, [*args, "--save_to", t_path])
        if rc_o or not os.path.exists(o_path) or rc_t or not os.path.exists(t_path):
            why = []
            if rc_o or not os.path.exists(o_path):
                why.append(f"ours failed (rc {rc_o}): {last_error_line(err_o)}")
            if rc_t or not os.path.exists(t_path):
                why.append(f"sd-scripts failed (rc {rc_t}): {last_error_line(err_t)}")
            lines.append(f"| {arch} | {label} | " + "; ".join(why).replace("|", "/") + " ||||||||")
            outputs += [p for p in (o_path, t_path) if os.path.exists(p)]
            continue
        c = compare(o_path, t_path)
        outputs += [o_path, t_path]
        lines.append(f"| {arch} | {label} | {c['keys']} | {c['modules']} | {c['ranks']} | {fmt(c['worst'])} | "
                     f"{fmt(c['mean'])} | {', '.join(c['md_ours_only']) or '-'} | "
                     f"{', '.join(c['md_theirs_only']) or '-'} | {{theirs:{t_path}}} | {{ours:{o_path}}} |")
    # loaders: each output in the other side's create_network_from_weights
    theirs_on_ours = their_loader(r, arch, f["folder"], [p for p in outputs if "/ours_" in p] + [f["locon"]])
    results = {p: our_loader(arch, p) for p in outputs if "/theirs_" in p}
    results.update(theirs_on_ours)
    lines = [ln.replace("{ours:", "").replace("{theirs:", "") for ln in lines]
    for p, res in results.items():
        for k, ln in enumerate(lines):
            lines[k] = ln.replace(p + "}", res.replace("|", "/"))
    lines.append(f"| {arch} | trained LoCon in sd-scripts' loader | {theirs_on_ours[f['locon']]} ||||||||")
    lines.append(f"| {arch} | show_metadata (trained LoCon; ours --json vs theirs) | "
                 f"{show_metadata_row(r, f['locon'])} ||||||||")
    return lines


HEADER = ("| model | case | keys | common modules | ranks | delta rel. diff worst | mean | metadata keys only ours "
          "| only theirs | our loader on theirs | sd-scripts' loader on ours |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not os.path.isfile(os.path.join(args.sd_scripts, "networks", "resize_lora.py")):
        print(f"error: --sd_scripts {args.sd_scripts}: no networks/resize_lora.py there, not an sd-scripts checkout",
              file=sys.stderr)
        return 2
    if not 1 <= args.steps <= 10:
        print(f"error: --steps {args.steps}: expected 1 to 10", file=sys.stderr)
        return 2
    sys.path.insert(0, ROOT)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = args.work or tempfile.mkdtemp(prefix="sd_scripts_check_")
    os.makedirs(work, exist_ok=True)
    r = Runner(args.sd_scripts, os.path.abspath(work), args.timeout)
    rows = []
    for arch in args.archs:
        rows += check_arch(r, arch, args.steps)
    print(HEADER)
    print("\n".join(rows))
    print(f"\n(inputs and outputs in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
