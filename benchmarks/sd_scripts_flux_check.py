"""sd-scripts' side of benchmarks/gpu.py's FLUX.1 rows, checked on the CPU: no GPU, no 34 GB files.

    python benchmarks/sd_scripts_flux_check.py --sd-scripts PATH [--sd-scripts-python PYTHON] [--work DIR]

Each check runs in sd-scripts' own environment (a subprocess of ``--sd-scripts-python``, cwd its
checkout, its ``library`` package; benchmarks/sd_scripts_launch.py's torchvision workaround first);
nothing of sd-scripts is imported here. Our side writes the inputs with gpu.py's own code:
benchmarks/flux_weights.py's headers and files, sd_scripts_launch's tokenizer and hub caches,
gpu.py's sd_scripts_args command lines.

1. headers: sd-scripts' FLUX.1 models built as its loaders build them (flux_models.Flux with dev's
   params and flux_models.AutoEncoder on the meta device; flux_utils.load_clip_l / load_t5xxl
   given the header's tensors as meta tensors) against the full-size files' headers as
   flux_weights.file_states computes them: every tensor a file holds is one of the model's, with
   its shape (its loaders load with strict=False: an unknown name would be dropped silently);
   every tensor of the model is in the file (tied names count once: T5's token embedding).
2. load: real files through sd-scripts' loaders: the transformer at full width with 1 double and 1
   single block (load_flow_model takes the block counts from the keys), CLIP-L and the
   autoencoder at full size; every tensor loaded (none left on the meta device) and equal to the
   file's; then one forward of each in sd-scripts' code (FLUX.1 on a 32x32 latent and 8 text
   tokens, CLIP-L on a tokenized caption, the autoencoder on a 64 px image): finite, of the
   expected shapes. T5-XXL's 9.5 GB is not written: its check is 1 and 4.
3. options: gpu.py's exact command line for each case with an sd-scripts row (FLUX.1 and SD),
   parsed by the entry script's own setup_parser (with its verify_command_line_training_args);
   the entry then runs as ``__main__`` up to its first model load, which is stopped: sd-scripts'
   own checks on the way pass (verify_training_args, prepare_dataset_args, the dataset from
   gpu.py's images, the tokenizers from gpu.py's tokenizer cache, assert_extra_args, the
   accelerator); train_util.get_optimizer then builds the case's optimizer on one parameter
   (fused_backward_pass's Adafactor check). The parsed values gpu.py's rows depend on are
   compared with ours.
4. tokenizers: FLUX.1's tokenize strategy built as flux_train.py builds it (no
   --tokenizer_cache_dir: the hub cache gpu.py sets as HF_HUB_CACHE) and as
   flux_train_network.py does (gpu.py's tokenizer cache); both give our tiny T5 tokenizer's ids
   (all below T5-XXL's 32128) and the shipped CLIP tokenizer's.

Prints one line per check (``ok`` or what failed) and exits 1 if any failed. About 2 minutes and
3 GB of memory (the reduced transformer file is 1.1 GB).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

from transformers import CLIPTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import flux_weights, gpu, sd_scripts_launch  # noqa: E402
from library.models import t5  # noqa: E402
from library.models.families.flux import flux  # noqa: E402
from library.models.loading import SHIPPED_TOKENIZER  # noqa: E402
from tools.make_sample_dataset import make_sample_dataset  # noqa: E402

CAPTION = "a photo of sks dog"
STEPS = 16  # the command lines' --max_train_steps (not run: only parsed and checked)

# Runs in sd-scripts' process: argv = launcher path, mode, mode's arguments. Prints "RESULT <json>".
SD_SIDE = r'''
import importlib.util, json, os, runpy, sys
sys.path.insert(0, os.getcwd())  # sd-scripts' checkout: its library package
spec = importlib.util.spec_from_file_location("sdtk_launch", sys.argv[1])
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)
launch._declare_missing_torchvision_ops()
import torch
mode, rest = sys.argv[2], sys.argv[3:]


def result(obj):
    print("RESULT " + json.dumps(obj), flush=True)


def compare(model, header):
    """unexpected / shape / missing names of a header against a model's state dict."""
    sd = model.state_dict(keep_vars=True)
    unexpected = sorted(k for k in header if k not in sd)
    shape = sorted(f"{k}: file {header[k][0]} model {list(sd[k].shape)}" for k in header
                   if k in sd and list(sd[k].shape) != header[k][0])
    groups = {}
    for k, v in sd.items():
        groups.setdefault(id(v), []).append(k)
    missing = sorted(names[0] for names in groups.values() if not any(n in header for n in names))
    return {"tensors": len(header), "unexpected": unexpected[:5], "n_unexpected": len(unexpected),
            "shape": shape[:5], "n_shape": len(shape), "missing": missing[:5], "n_missing": len(missing)}


def meta_state(header):
    dt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64}
    return {k: torch.empty(s, dtype=dt[d], device="meta") for k, (s, d) in header.items()}


def on_meta(model):
    return [k for k, v in list(model.named_parameters()) + list(model.named_buffers()) if v.device.type == "meta"]


if mode == "headers":
    from library import flux_models, flux_utils
    headers = json.load(open(rest[0]))
    out = {}
    for name, header in headers.items():
        try:
            if name == "model":
                with torch.device("meta"):
                    model = flux_models.Flux(flux_models.configs[flux_utils.MODEL_NAME_DEV].params)
                model.load_state_dict(meta_state(header), strict=False, assign=True)
            elif name == "ae":
                with torch.device("meta"):
                    model = flux_models.AutoEncoder(flux_models.configs[flux_utils.MODEL_NAME_DEV].ae_params)
                model.load_state_dict(meta_state(header), strict=False, assign=True)
            elif name == "clip_l":
                model = flux_utils.load_clip_l(None, torch.bfloat16, "cpu", state_dict=meta_state(header))
            else:
                model = flux_utils.load_t5xxl(None, None, "cpu", state_dict=meta_state(header))
            out[name] = compare(model, header)
        except Exception as e:
            out[name] = {"error": type(e).__name__ + ": " + " ".join(str(e).split())[:300]}
    result(out)

elif mode == "load":
    from safetensors.torch import load_file
    from library import flux_utils
    files, tok_cache = json.loads(rest[0]), rest[1]
    out = {}
    torch.manual_seed(0)
    for name, path in files.items():
        try:
            if name == "model":
                _, model = flux_utils.load_flow_model(path, None, "cpu")
            elif name == "clip_l":
                model = flux_utils.load_clip_l(path, torch.bfloat16, "cpu")
            else:
                model = flux_utils.load_ae(path, torch.bfloat16, "cpu")
            stored = load_file(path)
            sd = model.state_dict()
            unequal = [k for k, v in stored.items() if k in sd and not torch.equal(sd[k], v)]
            row = {"tensors": len(stored), "on_meta": on_meta(model)[:5], "unequal": unequal[:5],
                   "params": sum(p.numel() for p in model.parameters())}
            with torch.no_grad():
                if name == "model":
                    row["blocks"] = [len(model.double_blocks), len(model.single_blocks)]
                    img = torch.randn(1, 16 * 16, 64, dtype=torch.bfloat16)  # a 32x32 latent, packed 2x2
                    img_ids = flux_utils.prepare_img_ids(1, 16, 16)
                    txt = torch.randn(1, 8, 4096, dtype=torch.bfloat16)
                    y = torch.randn(1, 768, dtype=torch.bfloat16)
                    with torch.autocast("cpu", dtype=torch.bfloat16):  # as its training step (accelerator.autocast)
                        pred = model(img=img, img_ids=img_ids, txt=txt, txt_ids=torch.zeros(1, 8, 3), y=y,
                                     timesteps=torch.tensor([0.5]), guidance=torch.tensor([3.5]))
                    row["out"] = [list(pred.shape), bool(torch.isfinite(pred).all())]
                elif name == "clip_l":
                    from transformers import CLIPTokenizer
                    tok = CLIPTokenizer.from_pretrained(os.path.join(tok_cache, "openai_clip-vit-large-patch14"))
                    ids = tok(["a photo of sks dog"], max_length=77, padding="max_length", truncation=True,
                              return_tensors="pt")["input_ids"]
                    pooled = model(ids)["pooler_output"]
                    row["out"] = [list(pooled.shape), bool(torch.isfinite(pooled).all())]
                else:
                    z = model.encode(torch.rand(1, 3, 64, 64, dtype=torch.bfloat16) * 2 - 1)
                    row["out"] = [list(z.shape), bool(torch.isfinite(z).all())]
            out[name] = row
            del model, stored, sd
        except Exception as e:
            out[name] = {"error": type(e).__name__ + ": " + " ".join(str(e).split())[:300]}
    result(out)

elif mode == "options":
    entry, argv = rest[0], rest[1:]

    class Stop(Exception):
        pass

    from library import flux_utils, sdxl_train_util, train_util
    reached = []

    def stopper(name):
        def stop(*args, **kwargs):
            reached.append(name)
            raise Stop(name)
        return stop

    for mod, names in ((flux_utils, ("load_flow_model", "load_ae", "load_clip_l", "load_t5xxl")),
                       (train_util, ("load_target_model",)), (sdxl_train_util, ("load_target_model",))):
        for n in names:
            setattr(mod, n, stopper(mod.__name__.split(".")[-1] + "." + n))
    script = os.path.join(os.getcwd(), entry)
    g = runpy.run_path(script, run_name="sdtk_check")  # its setup_parser, without running it
    parser = g["setup_parser"]()
    args = parser.parse_args(argv)
    train_util.verify_command_line_training_args(args)
    args = train_util.read_config_from_file(args, parser)
    out = {"parsed": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}}
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
        out["run"] = "returned before loading a model"
    except Stop:
        out["run"] = "stopped at " + reached[0]
    except BaseException as e:
        out["run"] = "failed: " + type(e).__name__ + ": " + " ".join(str(e).split())[:300] if str(e) else type(e).__name__
    try:
        opt_name, _, opt = train_util.get_optimizer(args, [{"params": [torch.nn.Parameter(torch.zeros(4))], "lr": args.learning_rate}])
        out["optimizer"] = [opt_name, type(opt).__name__]
    except BaseException as e:
        out["optimizer"] = "failed: " + type(e).__name__ + ": " + " ".join(str(e).split())[:300]
    result(out)

elif mode == "tokenizers":
    from library import strategy_flux
    tok_cache = rest[0]
    out = {}
    for how, cache in (("hub cache (flux_train.py)", None), ("tokenizer cache (flux_train_network.py)", tok_cache)):
        try:
            s = strategy_flux.FluxTokenizeStrategy(512, cache)
            l_tokens, t5_tokens, mask = s.tokenize("a photo of sks dog")
            out[how] = {"clip": l_tokens[0, :8].tolist(), "t5": t5_tokens[0, :8].tolist(), "t5_len": t5_tokens.shape[1],
                        "t5_max_id": int(t5_tokens.max()), "t5_class": type(s.t5xxl).__name__, "mask": int(mask.sum())}
        except Exception as e:
            out[how] = {"error": type(e).__name__ + ": " + " ".join(str(e).split())[:300]}
    result(out)
'''


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sd-scripts", required=True, metavar="PATH", help="a kohya-ss/sd-scripts checkout")
    p.add_argument("--sd-scripts-python", metavar="PYTHON",
                   help="the Python that runs sd-scripts (its own venv; default: this one)")
    p.add_argument("--work", metavar="DIR", help="working folder (default: a temporary one)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per sd-scripts subprocess")
    return p


def headers(states: dict) -> dict:
    """{file: {name: [shape, safetensors dtype]}} of flux_weights.file_states' meta tensors."""
    dtypes = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "int64": "I64"}
    return {name: {k: [list(v.shape), dtypes[str(v.dtype).removeprefix("torch.")]] for k, v in state.items()}
            for name, (state, _) in states.items()}


def sd_side(python: str, sd_scripts: str, script: str, args: list, env: dict, timeout: int) -> dict:
    """Run SD_SIDE in sd-scripts' process; its RESULT object, or {"error": its last error line}."""
    cmd = [python, script, os.path.join(ROOT, "benchmarks", "sd_scripts_launch.py"), *map(str, args)]
    p = subprocess.run(cmd, cwd=sd_scripts, env=sd_scripts_launch.clean_env(env), capture_output=True,
                       text=True, timeout=timeout)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    return {"error": (lines or ["no output"])[-1][:300]}


def header_problems(r: dict) -> str:
    if "error" in r:
        return r["error"]
    bad = [f"{r[f'n_{k}']} {k} (e.g. {r[k][0]})" for k in ("unexpected", "shape", "missing") if r[f"n_{k}"]]
    return "; ".join(bad)


def load_problems(name: str, r: dict, expect_out: list) -> str:
    if "error" in r:
        return r["error"]
    bad = []
    if r["on_meta"]:
        bad.append(f"not loaded: {r['on_meta']}")
    if r["unequal"]:
        bad.append(f"values differ: {r['unequal']}")
    if r["out"] != expect_out:
        bad.append(f"forward gave {r['out']}, expected {expect_out}")
    if name == "model" and r["blocks"] != [1, 1]:
        bad.append(f"blocks {r['blocks']}, expected [1, 1]")
    return "; ".join(bad)


def expected_values(name: str) -> dict:
    """The parsed values sd-scripts must hold for gpu.py's row ``name`` (from gpu.training_options)."""
    script, arch, size, batch = gpu.CASES[name]
    want = {"resolution": str(size), "train_batch_size": batch, "max_train_steps": STEPS, "mixed_precision": "bf16",
            "full_bf16": True, "cache_latents": True, "sdpa": True,
            # SD1's train_network.py has no such option (None: not in its parsed arguments)
            "cache_text_encoder_outputs": None if arch == "sd15" else True,
            "seed": 1, "gradient_checkpointing": False}
    if arch == "flux":
        want.update(timestep_sampling="sigma", model_prediction_type="sigma_scaled", guidance_scale=3.5,
                    discrete_flow_shift=3.0, weighting_scheme="uniform", t5xxl_max_token_length=512,
                    apply_t5_attn_mask=False, fp8_base=script == "train_lora")
    if script == "train_lora":
        want.update(network_module="networks.lora_flux" if arch == "flux" else "networks.lora", network_dim=16,
                    network_alpha=16.0, network_train_unet_only=True, optimizer_type="AdamW", learning_rate=1e-4)
    else:
        want.update(optimizer_type="Adafactor", learning_rate=1e-6, fused_backward_pass=True,
                    optimizer_args=["scale_parameter=False", "relative_step=False", "warmup_init=False"])
        if arch == "flux":
            want["blocks_to_swap"] = gpu.FLUX_BLOCKS_TO_SWAP
    return want


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sd_scripts_launch.check_paths(args.sd_scripts, args.sd_scripts_python, "flux_train_network.py")
    except sd_scripts_launch.SdScriptsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    python = args.sd_scripts_python or sys.executable
    sd = os.path.abspath(args.sd_scripts)
    work = os.path.abspath(args.work or tempfile.mkdtemp(prefix="sdtk-sd-flux-check-"))
    os.makedirs(work, exist_ok=True)
    script = os.path.join(work, "sd_side.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(SD_SIDE)
    lines, failed = [], False

    def report(what: str, problems: str) -> None:
        nonlocal failed
        failed |= bool(problems)
        lines.append(f"{what:<58} {'FAILED: ' + problems if problems else 'ok'}")
        print(lines[-1], flush=True)

    # 1. full-size headers
    path = os.path.join(work, "headers.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(headers(flux_weights.file_states()), f)
    r = sd_side(python, sd, script, ["headers", path], {}, args.timeout)
    for name in flux_weights.NAMES:
        rr = r.get(name, r)
        n = rr.get("tensors", "?")
        report(f"1 header {name} ({n} tensors) vs sd-scripts' model", header_problems(rr))

    # 2. real files through sd-scripts' loaders (the transformer with 1 + 1 blocks)
    files_dir = os.path.join(work, "files")
    reduced = dataclasses.replace(flux.FLUX_DEV, depth=1, depth_single_blocks=1)
    files = flux_weights.write_flux_files(files_dir, transformer=reduced, names=("model", "clip_l", "ae"))
    tokenizers, hub = sd_scripts_launch.tokenizer_cache(work), sd_scripts_launch.hub_cache(work)
    r = sd_side(python, sd, script, ["load", json.dumps({k: files[k] for k in ("model", "clip_l", "ae")}), tokenizers],
                {}, args.timeout)
    expect = {"model": [[1, 256, 64], True], "clip_l": [[1, 768], True], "ae": [[1, 16, 8, 8], True]}
    for name in ("model", "clip_l", "ae"):
        rr = r.get(name, r)
        what = f"2 load {name}" + (" (1 double + 1 single block)" if name == "model" else "")
        report(what + f" {rr.get('params', '?'):,} params" if isinstance(rr.get("params"), int) else what,
               load_problems(name, rr, expect[name]))

    # 3. gpu.py's command lines through sd-scripts' parsers and checks
    data = os.path.dirname(make_sample_dataset(os.path.join(work, "data1024"), n_images=4, size=1024, repeats=1))
    for name, (script_name, arch, size, batch) in gpu.CASES.items():
        if (script_name, arch) not in gpu.SD_SCRIPTS_ENTRY:
            continue
        case_files = files if arch == "flux" else {"model": os.path.join(work, f"{arch}-arch.safetensors")}
        entry, cmd = gpu.sd_scripts_args(name, case_files, tokenizers, data, os.path.join(work, f"sd-{name}"), STEPS)
        r = sd_side(python, sd, script, ["options", entry, *cmd], {"HF_HUB_CACHE": hub}, args.timeout)
        if "error" in r:
            report(f"3 options {name} ({entry})", r["error"])
            continue
        wrong = [f"{k}={r['parsed'].get(k)!r} (want {v!r})" for k, v in expected_values(name).items()
                 if r["parsed"].get(k) != v]
        first_load = r["run"].startswith("stopped at ")
        problems = "; ".join(([] if first_load else [r["run"]]) + wrong +
                             ([] if isinstance(r["optimizer"], list) else [r["optimizer"]]))
        detail = f"{r['run']}, optimizer {r['optimizer'][0] if isinstance(r['optimizer'], list) else '?'}"
        report(f"3 options {name} ({entry})", problems)
        lines.append(f"    {detail}")
        print(lines[-1], flush=True)

    # 4. the tokenizers both FLUX.1 scripts build
    r = sd_side(python, sd, script, ["tokenizers", tokenizers], {"HF_HUB_CACHE": hub}, args.timeout)
    tiny = t5.build_tiny_tokenizer()
    ours_t5 = t5.tokenize(tiny, [CAPTION], 512)[0][0, :8].tolist()
    clip = CLIPTokenizer.from_pretrained(SHIPPED_TOKENIZER)
    ours_clip = clip([CAPTION], max_length=77, padding="max_length", truncation=True)["input_ids"][0][:8]
    for how in ("hub cache (flux_train.py)", "tokenizer cache (flux_train_network.py)"):
        rr = r.get(how, r)
        if "error" in rr:
            report(f"4 tokenizers from the {how}", rr["error"])
            continue
        bad = []
        if rr["t5"] != ours_t5 or rr["clip"] != ours_clip:
            bad.append(f"ids {rr['t5']} / {rr['clip']}, ours {ours_t5} / {ours_clip}")
        if rr["t5_len"] != 512 or rr["t5_max_id"] >= 32128:
            bad.append(f"T5 length {rr['t5_len']}, max id {rr['t5_max_id']}")
        report(f"4 tokenizers from the {how}", "; ".join(bad))
    print(f"{'FAILED' if failed else 'all ok'} ({work})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
