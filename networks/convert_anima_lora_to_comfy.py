"""Convert an Anima LoRA between sd-scripts' layout and ComfyUI's PEFT-style layout (sd-scripts'
networks/convert_anima_lora_to_comfy.py and its arguments).

    python networks/convert_anima_lora_to_comfy.py kohya_lora.safetensors comfy_lora.safetensors
    python networks/convert_anima_lora_to_comfy.py comfy_lora.safetensors kohya_lora.safetensors --reverse

sd-scripts: ``lora_unet_blocks_0_self_attn_q_proj.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``.
ComfyUI:    ``diffusion_model.blocks.0.self_attn.q_proj.lora_A.weight`` / ``.lora_B.weight`` / ``.alpha``
(Qwen3's ``lora_te_`` modules: ``text_encoder.qwen3.``). Tensors are unchanged.

The underscored name goes back to its dotted module path by the model's own module names (the
DiT's and the LLM adapter's, whatever the block index), not by sd-scripts' string replacements,
which leave an LLM-adapter module as ``llm.adapter...`` (no module of the model). A name that is
no Anima module is one error line. The metadata is kept, with fresh ``sshs_*`` hashes.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from networks import lora_svd  # noqa: E402
from networks.lora_anima import dotted, module_paths  # noqa: E402
from networks.lora import LoRAError, load_state_dict_file, write_weights  # noqa: E402

COMFY_DIT, COMFY_TE = "diffusion_model.", "text_encoder.qwen3."
KOHYA_DIT, KOHYA_TE = "lora_unet_", "lora_te_"
WEIGHTS = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight", "alpha": "alpha"}


def to_comfy(sd: dict, source: str) -> dict:
    tables = module_paths()
    out = {}
    for key, value in sd.items():
        module, _, weight = key.partition(".")
        if weight not in WEIGHTS:
            raise LoRAError(f"{source}: {key} is not a LoRA tensor (lora_down / lora_up / alpha)")
        for kohya, comfy in ((KOHYA_DIT, COMFY_DIT), (KOHYA_TE, COMFY_TE)):
            if module.startswith(kohya):
                path = dotted(module[len(kohya):], kohya == KOHYA_TE, tables)
                break
        else:
            raise LoRAError(f"{source}: {key} is not an sd-scripts Anima LoRA key (lora_unet_ / lora_te_)")
        if path is None:
            raise LoRAError(f"{source}: {module} is no module of Anima (another family's LoRA?)")
        out[f"{comfy}{path}.{WEIGHTS[weight]}"] = value
    return out


def from_comfy(sd: dict, source: str) -> dict:
    back = {v: k for k, v in WEIGHTS.items()}
    out = {}
    for key, value in sd.items():
        for comfy, kohya in ((COMFY_DIT, KOHYA_DIT), (COMFY_TE, KOHYA_TE)):
            if key.startswith(comfy):
                break
        else:
            raise LoRAError(f"{source}: {key} is not a ComfyUI Anima LoRA key (diffusion_model. / text_encoder.qwen3.)")
        rest = key[len(comfy):]
        weight = next((w for w in back if rest.endswith("." + w)), None)
        if weight is None:
            raise LoRAError(f"{source}: {key} is not a LoRA tensor (lora_A / lora_B / alpha)")
        out[f"{kohya}{rest[:-len(weight) - 1].replace('.', '_')}.{back[weight]}"] = value
    return out


def _parse_args(argv):
    p = argparse.ArgumentParser(description="Convert an Anima LoRA between sd-scripts' and ComfyUI's layouts.")
    p.add_argument("src_path", help="source: sd-scripts layout (ComfyUI's with --reverse)")
    p.add_argument("dst_path", help="destination: ComfyUI's layout (sd-scripts' with --reverse)")
    p.add_argument("--reverse", action="store_true", help="convert ComfyUI's layout to sd-scripts'")
    return p.parse_args(argv)


def run(args) -> None:
    for flag in ("src_path", "dst_path"):
        if not getattr(args, flag).lower().endswith(".safetensors"):
            raise LoRAError(f"{flag} {getattr(args, flag)}: must be a .safetensors file")
    if os.path.exists(args.dst_path) and os.path.exists(args.src_path) and os.path.samefile(args.src_path,
                                                                                             args.dst_path):
        raise LoRAError(f"dst_path {args.dst_path}: is src_path; write the conversion to another file")
    sd = load_state_dict_file(args.src_path)
    out = (from_comfy if args.reverse else to_comfy)(sd, args.src_path)
    write_weights(args.dst_path, out, None, lora_svd.read_metadata(args.src_path))
    print(f"converted {len(out)} keys ({'ComfyUI -> sd-scripts' if args.reverse else 'sd-scripts -> ComfyUI'}): "
          f"{args.dst_path}")


def main(argv=None) -> int:
    return lora_svd.tool_main(_parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
