"""Our FLUX.1 / SD3 file tools side by side with sd-scripts' own (docs/LORA_TOOLS.md, docs/MODELS.md).

    python benchmarks/sd_scripts_flux_tools_check.py --sd_scripts /path/to/sd-scripts [--work DIR]

Each tool runs twice on the same inputs, ours and sd-scripts' (a subprocess in its checkout through
benchmarks/sd_scripts_tools_check.py's prelude; nothing of it is imported here), and the outputs are
compared tensor by tensor:
- networks/convert_flux_lora.py, both directions, on a kohya FLUX.1 LoRA at FLUX.1's real widths
  (sd-scripts' converter writes them in): plain and block-diagonal (split_qkv) fused qkv and linear1,
  scales 1/4, 1/2, 1/8, 1 and 4;
- tools/convert_diffusers_to_flux.py on tiny-flux's transformer in diffusers' layout, in the three
  shards sd-scripts' tool expects (``-0000N-of-00003``);
- tools/merge_sd3_safetensors.py on tiny SD3.5 medium split into separate component files.
sd-scripts' library needs opencv-python-headless and einops (not dependencies of this project).
"""
from __future__ import annotations

import json
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: make the repository root importable
    sys.path.insert(0, ROOT)

from benchmarks.sd_scripts_tools_check import file_tools_runner, side_by_side  # noqa: E402
from library.models.families.flux import flux_checkpoint, tiny_flux  # noqa: E402
from library.models.families.sd3 import sd3_checkpoint, sd3_vae  # noqa: E402


SCRIPTS = ("networks/convert_flux_lora.py", "tools/convert_diffusers_to_flux.py", "tools/merge_sd3_safetensors.py")


def flux_lora(path: str) -> None:
    """A kohya FLUX.1 LoRA at the real widths (3072; linear1 3 x 3072 + 12288)."""
    g = torch.Generator().manual_seed(0)
    h, r = 3072, 4

    def module(name, out, inp, rank, alpha, split=None):
        down = torch.randn(rank, inp, generator=g)
        up = (torch.block_diag(*[torch.randn(w, rank // len(split), generator=g) for w in split]) if split
              else torch.randn(out, rank, generator=g))
        return {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up, f"{name}.alpha": torch.tensor(float(alpha))}

    sd = {}
    sd.update(module("lora_unet_double_blocks_0_img_attn_qkv", 3 * h, h, r, 1))
    sd.update(module("lora_unet_double_blocks_0_txt_attn_qkv", 3 * h, h, 3 * r, 3 * r, split=(h, h, h)))
    sd.update(module("lora_unet_single_blocks_0_linear1", 7 * h, h, r, 2))
    sd.update(module("lora_unet_single_blocks_1_linear1", 7 * h, h, 4 * r, 2, split=(h, h, h, 4 * h)))
    sd.update(module("lora_unet_single_blocks_0_linear2", h, 5 * h, r, 0.5))
    sd.update(module("lora_unet_double_blocks_3_img_mod_lin", 6 * h, h, r, 16))
    save_file(sd, path, metadata={"ss_network_module": "networks.lora_flux"})


def flux_diffusers_shards(folder: str):
    """tiny-flux's transformer in diffusers' layout, in exactly 3 shards with an index."""
    tiny = tiny_flux.build_tiny_flux("dev")["transformer"]
    sd = flux_checkpoint.bfl_to_diffusers(tiny.state_dict(), tiny.config)
    out = os.path.join(folder, "transformer")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(flux_checkpoint.diffusers_config(tiny.config), f)
    keys = sorted(sd)
    weight_map = {}
    for i in range(3):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-00003.safetensors"
        part = {k: sd[k].contiguous() for k in keys[i::3]}
        save_file(part, os.path.join(out, name))
        weight_map.update(dict.fromkeys(part, name))
    with open(os.path.join(out, flux_checkpoint.DIFFUSERS_INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def sd3_parts(folder: str) -> dict:
    tiny = sd3_checkpoint.load_sd3("tiny-sd3.5-medium")
    files = {w: os.path.join(folder, f"{w}.safetensors") for w in ("dit", "clip_l", "clip_g", "t5xxl", "vae")}
    sd3_checkpoint.save_sd3(tiny, files["dit"], components={"mmdit"})
    save_file({k: v for k, v in tiny.clip_l.state_dict().items() if "projection" not in k}, files["clip_l"])
    save_file(tiny.clip_g.state_dict(), files["clip_g"])
    t5_sd = sd3_checkpoint.single_file_state_dict(tiny, {"t5xxl"})
    save_file({k[len(sd3_checkpoint.TE_PREFIX["t5xxl"]):]: v for k, v in t5_sd.items()}, files["t5xxl"])
    save_file(sd3_vae.to_original(tiny.vae, prefix=""), files["vae"])
    return files


def compare(ours: str, theirs: str) -> str:
    a, b = load_file(ours), load_file(theirs)
    if a.keys() != b.keys():
        return f"keys differ: {len(a.keys() - b.keys())} only ours, {len(b.keys() - a.keys())} only theirs"
    differ = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    with safe_open(ours, "pt") as f:
        ma = f.metadata() or {}
    with safe_open(theirs, "pt") as f:
        mb = f.metadata() or {}
    meta = sorted(set(ma) ^ set(mb))
    result = f"{len(a)} tensors, {'all bit-identical' if not differ else f'{len(differ)} differ, e.g. {differ[0]}'}"
    return result + (f"; metadata keys only on one side: {', '.join(meta)}" if meta else "; same metadata keys")


def main(argv=None) -> int:
    setup = file_tools_runner(argv, __doc__.split("\n\n")[0], SCRIPTS, "sdtk-flux-tools-")
    if setup is None:
        return 2
    r, work = setup
    w = lambda *parts: os.path.join(work, *parts)  # noqa: E731
    flux_lora(w("kohya.safetensors"))
    os.makedirs(w("flux-diffusers"), exist_ok=True)
    flux_diffusers_shards(w("flux-diffusers"))
    os.makedirs(w("sd3-parts"), exist_ok=True)
    parts = sd3_parts(w("sd3-parts"))
    sd3_args = [a for which, path in parts.items() for a in (f"--{which}", path)]
    cases = [
        ("convert_flux_lora sd-scripts -> ai-toolkit", "networks/convert_flux_lora.py",
         lambda out: ["--src", "sd-scripts", "--dst", "ai-toolkit", "--src_path", w("kohya.safetensors"),
                      "--dst_path", out], "ait", compare),
        ("convert_flux_lora ai-toolkit -> sd-scripts (their ai-toolkit file)", "networks/convert_flux_lora.py",
         lambda out: ["--src", "ai-toolkit", "--dst", "sd-scripts", "--src_path", w("ait.theirs.safetensors"),
                      "--dst_path", out], "back", compare),
        ("convert_diffusers_to_flux", "tools/convert_diffusers_to_flux.py",
         lambda out: ["--diffusers_path", w("flux-diffusers"), "--save_to", out], "bfl", compare),
        ("merge_sd3_safetensors", "tools/merge_sd3_safetensors.py", lambda out: [*sd3_args, "--output", out], "sd3",
         compare),
    ]
    print("\n".join(side_by_side(r, work, cases)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
