"""Our SD model tools and LoRA block weights side by side with sd-scripts' own (docs/MODELS.md,
docs/LORA_TOOLS.md).

    python benchmarks/sd_scripts_model_tools_check.py --sd_scripts /path/to/sd-scripts [--work DIR]

Each tool runs twice on the same inputs, ours and sd-scripts' (a subprocess in its checkout through
benchmarks/sd_scripts_tools_check.py's prelude; nothing of it is imported here):
- tools/merge_models.py on three tiny SD1 checkpoints (plain, --unet_only, fp16): tensor by tensor;
- tools/convert_diffusers20_original_sd.py, diffusers folder -> single file (sd-scripts' other
  direction builds the full-size architecture, which a tiny file cannot fill): tensor by tensor,
  with sd-scripts' text-encoder key prefix read as the standard one (checkpoint_merge.canonical_key);
- networks/svd_merge_lora.py --lbws on two tiny SD1 LoRAs, and networks/sdxl_merge_lora.py --concat
  --lbws on two tiny SDXL LoRAs: each output's deltas against the float64 block-weighted sum;
- the LoRA Block Weight block of every module of those files: ours (networks/lora_blocks.py
  lbw_index) and sd-scripts' get_lbw_block_index, run in its checkout.
sd-scripts' library needs opencv-python-headless, imagesize and voluptuous (not dependencies of this
project).
"""
from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: make the repository root importable
    sys.path.insert(0, ROOT)

from benchmarks.sd_scripts_flux_tools_check import compare  # noqa: E402
from benchmarks.sd_scripts_tools_check import Runner, file_tools_runner, last_error_line, side_by_side  # noqa: E402
from library.models import checkpoint_merge, sd_checkpoint  # noqa: E402
from library.models.families.sd_common.tiny_models import build_tiny_components  # noqa: E402
from networks import lora, lora_blocks  # noqa: E402

SCRIPTS = ("tools/merge_models.py", "tools/convert_diffusers20_original_sd.py", "networks/svd_merge_lora.py",
           "networks/sdxl_merge_lora.py")

# Run in sd-scripts' checkout (through the prelude): its block index of each key, as SD1 and as SDXL.
LBW_INDEX = '''\
import json, os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "networks"))
from svd_merge_lora import get_lbw_block_index
with open(sys.argv[1]) as f:
    keys = json.load(f)
with open(sys.argv[2], "w") as f:
    json.dump({k: [get_lbw_block_index(k, False), get_lbw_block_index(k, True)] for k in keys}, f)
'''


def checkpoints(work: str) -> list[str]:
    """Three tiny SD1 checkpoints: the tiny model plus seeded noise, more each time."""
    comps = build_tiny_components("sd15")
    paths = []
    for i in range(3):
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for p in (p for name in ("unet", "vae", "text_encoder") for p in comps[name].parameters()):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        paths.append(os.path.join(work, f"m{i}.safetensors"))
        sd_checkpoint.save_single_file(comps, "sd1", paths[-1])
    sd_checkpoint.save_diffusers(comps, "sd1", os.path.join(work, "folder"))
    return paths


def lora_file(arch: str, path: str, seed: int, dim: int, alpha: float, text_encoder: bool) -> str:
    """A tiny LoRA with random ups (a fresh network's are zero)."""
    c = build_tiny_components(arch)
    tes = [c["text_encoder"]] + ([c["text_encoder_2"]] if "text_encoder_2" in c else [])
    torch.manual_seed(seed)
    net = lora.create_network(1.0, dim, alpha, None, tes, c["unet"])
    net.apply_to(tes, c["unet"], apply_text_encoder=text_encoder)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.text_encoder_loras + net.unet_loras:
            m.lora_up.weight.copy_(torch.randn(m.lora_up.weight.shape, generator=g) * 0.2)
    net.save_weights(path, None, {})
    return path


def _delta(sd: dict, name: str) -> torch.Tensor:
    down, up = sd[name + ".lora_down.weight"].double(), sd[name + ".lora_up.weight"].double()
    rank = down.shape[0]
    alpha = float(sd[name + ".alpha"]) if name + ".alpha" in sd else rank
    return up.reshape(up.shape[0], rank) @ down.reshape(rank, -1) * (alpha / rank)


def block_weighted_error(out: str, inputs: list[tuple[str, float, list[float]]], is_sdxl: bool) -> str:
    """Worst and mean relative Frobenius error of the output's deltas against the float64
    sum_i ratio_i * w_i(block) * delta_i (blocks: LBW_NAMES order, 26 values per input)."""
    want: dict[str, torch.Tensor] = {}
    for path, ratio, weights in inputs:
        sd = load_file(path)
        for name in {k.split(".")[0] for k in sd}:
            w = lora_blocks.lbw_factor(weights, name, is_sdxl)
            want[name] = want.get(name, 0) + ratio * w * _delta(sd, name)
    got = load_file(out)
    errs = [float((_delta(got, n) - v).norm() / v.norm()) for n, v in want.items() if v.norm() > 0]
    return f"relative error of the deltas: worst {max(errs):.3g}, mean {sum(errs) / len(errs):.3g}"


def block_index_agreement(r: Runner, files: list[str], work: str) -> str:
    keys = sorted({k for f in files for k in load_file(f) if k.endswith("lora_down.weight")})
    with open(os.path.join(work, "keys.json"), "w") as f:
        json.dump(keys, f)
    helper = os.path.join(work, "lbw_index.py")
    with open(helper, "w") as f:
        f.write(LBW_INDEX)
    out = os.path.join(work, "theirs_index.json")
    rc, _, err = r.theirs(helper, [os.path.join(work, "keys.json"), out])
    if rc:
        return f"sd-scripts' helper failed: {last_error_line(err)}"
    with open(out) as f:
        theirs = json.load(f)
    differ = [k for k in keys if theirs[k][int(lora_blocks.is_sdxl_names([k.split(".")[0]]))]
              != lora_blocks.lbw_index(k.split(".")[0], lora_blocks.is_sdxl_names([k.split(".")[0]]))]
    return f"{len(keys)} modules, {len(differ)} in another block" + (f" (e.g. {differ[0]})" if differ else "")


def both_block_weighted(inputs, is_sdxl: bool):
    """A judge: each side's block_weighted_error."""
    return lambda ours, theirs: (f"ours: {block_weighted_error(ours, inputs, is_sdxl)}; "
                                 f"theirs: {block_weighted_error(theirs, inputs, is_sdxl)}")


def canonical_compare(ours: str, theirs: str) -> str:
    a = {checkpoint_merge.canonical_key(k): v for k, v in load_file(ours).items()}
    b = {checkpoint_merge.canonical_key(k): v for k, v in load_file(theirs).items()}
    differ = [k for k in a.keys() & b.keys() if not torch.equal(a[k], b[k])]
    return (f"{len(a)} / {len(b)} tensors, {len(a.keys() ^ b.keys())} keys on one side only, "
            f"{len(differ)} of the common ones differ")


def main(argv=None) -> int:
    setup = file_tools_runner(argv, __doc__.split("\n\n")[0], SCRIPTS, "sdtk-model-tools-")
    if setup is None:
        return 2
    r, work = setup
    w = lambda *parts: os.path.join(work, *parts)  # noqa: E731
    models = checkpoints(work)
    sd1 = [lora_file("sd15", w("a.safetensors"), 1, 4, 2.0, True), lora_file("sd15", w("b.safetensors"), 2, 2, 1.0, False)]
    xl = [lora_file("sdxl", w("xa.safetensors"), 3, 4, 2.0, True), lora_file("sdxl", w("xb.safetensors"), 4, 2, 1.0, False)]
    wa, wb = [0.1 * k - 0.7 for k in range(26)], [1.5 - 0.05 * k for k in range(26)]
    half = [0.5] * 12
    full_half = lora_blocks.parse_lbws([json.dumps(half)] * 2, 2)[0]
    sd1_in, xl_in = [(sd1[0], 0.8, wa), (sd1[1], -0.5, wb)], [(xl[0], 1.0, full_half[0]), (xl[1], 1.0, full_half[1])]
    merge = ["--models", *models, "--ratios", "0.5", "0.3", "0.2"]
    cases = [
        ("merge_models", "tools/merge_models.py", lambda out: [*merge, "--output", out], "merge", compare),
        ("merge_models --unet_only", "tools/merge_models.py", lambda out: [*merge, "--unet_only", "--output", out],
         "unet", compare),
        ("merge_models fp16", "tools/merge_models.py",
         lambda out: [*merge, "--precision", "fp16", "--saving_precision", "fp16", "--output", out], "fp16", compare),
        ("convert_diffusers20_original_sd diffusers -> .safetensors", "tools/convert_diffusers20_original_sd.py",
         lambda out: ["--v1", w("folder"), out], "conv", canonical_compare),
        ("svd_merge_lora --lbws (26 values, rank 6)", "networks/svd_merge_lora.py",
         lambda out: ["--models", *sd1, "--ratios", "0.8", "-0.5", "--lbws", json.dumps(wa), json.dumps(wb),
                      "--new_rank", "6", "--save_to", out], "svd", both_block_weighted(sd1_in, False)),
        ("sdxl_merge_lora --concat --lbws (12 values, all 0.5)", "networks/sdxl_merge_lora.py",
         lambda out: ["--models", *xl, "--ratios", "1", "1", "--lbws", json.dumps(half), json.dumps(half),
                      "--concat", "--save_to", out], "xl", both_block_weighted(xl_in, True)),
    ]
    rows = side_by_side(r, work, cases)
    rows.append(f"| LoRA Block Weight block of each module | {block_index_agreement(r, sd1 + xl, work)} |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
