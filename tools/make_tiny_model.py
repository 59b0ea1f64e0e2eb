"""Write a built-in tiny model as a diffusers folder and as a single file.

    python tools/make_tiny_model.py --arch sd15|sd2|sdxl|flux|flux-schnell [--inpaint] --out DIR

creates DIR/diffusers/ (model_index.json, unet, vae, text encoder(s), tokenizer(s), scheduler) and
DIR/<arch>.safetensors (original SD/SDXL key layout). The single file carries its architecture
configs and tokenizer in its metadata, so the loader rebuilds it without network access.
``--inpaint``: the inpainting model (a 9-channel U-Net input, built-in tiny-<arch>-inpaint).
FLUX.1 (tiny-flux, tiny-flux-schnell): DIR/diffusers/ (a diffusers FLUX folder) and sd-scripts'
separate files DIR/flux1.safetensors (BFL layout), DIR/clip_l.safetensors, DIR/t5xxl.safetensors,
DIR/ae.safetensors.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library.models import sd_checkpoint  # noqa: E402
from library.models.families.sd_common import tiny_models  # noqa: E402
from library.models.families.flux import flux_saving, tiny_flux  # noqa: E402


def make_tiny_model(arch: str, out: str, inpaint: bool = False) -> tuple[str, str]:
    """Write both forms; return (diffusers folder, single-file path)."""
    comps = tiny_models.build_tiny_components(arch, inpaint=inpaint)
    name = f"tiny-{arch}" + (tiny_models.INPAINT_SUFFIX if inpaint else "")
    family = tiny_models.FAMILY_OF_ARCH[arch]
    folder = os.path.join(out, "diffusers")
    single = os.path.join(out, f"{arch}.safetensors")
    sd_checkpoint.save_diffusers(comps, family, folder)
    sd_checkpoint.save_single_file(comps, family, single, metadata={"sdtk.builtin": name})
    return folder, single


def make_tiny_flux(variant: str, out: str) -> tuple[str, dict[str, str]]:
    """Write tiny-flux (dev) or tiny-flux-schnell; return (diffusers folder, {role: file path})."""
    parts = tiny_flux.build_tiny_flux(variant)
    folder = os.path.join(out, "diffusers")
    flux_saving.save_diffusers_folder(parts, variant, folder)
    return folder, flux_saving.save_single_files(parts, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write a built-in tiny model as a diffusers folder and a single file.")
    ap.add_argument("--arch", required=True, choices=["sd15", "sd2", "sdxl", "flux", "flux-schnell"])
    ap.add_argument("--inpaint", action="store_true", help="the inpainting model (9-channel U-Net input)")
    ap.add_argument("--out", required=True, help="output folder (created)")
    args = ap.parse_args(argv)
    if args.arch.startswith("flux"):
        if args.inpaint:
            ap.error("--inpaint: there is no FLUX inpainting model")
        folder, files = make_tiny_flux("schnell" if args.arch == "flux-schnell" else "dev", args.out)
        for path in (folder, *files.values()):
            print(f"wrote {path}")
        return 0
    folder, single = make_tiny_model(args.arch, args.out, args.inpaint)
    print(f"wrote {folder}")
    print(f"wrote {single}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
