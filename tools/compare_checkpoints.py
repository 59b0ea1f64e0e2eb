#!/usr/bin/env python
"""Compare a run's saved LoRA files: a labelled grid of files x multipliers x prompts at fixed
seeds, each cell also its own PNG with A1111's text, and grid.json (docs/GENERATION.md).

    python tools/compare_checkpoints.py --ckpt MODEL --lora_dir OUTPUT_DIR --outdir GRID \
        --from_file prompts.txt --multipliers 0.5 1.0 --W 512 --H 512 --steps 20 --seed 1
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library.log import setup_logging  # noqa: E402

setup_logging(True)  # before diffusers loads bitsandbytes, whose optional-kernel notice it silences

from library.outputs import checkpoint_grid, gen_options  # noqa: E402


def run(argv: list[str]) -> None:
    layout = checkpoint_grid.compare(checkpoint_grid.parse_args(argv))
    print(f"{len(layout['rows'])} x {len(layout['columns'])} cells: "
          f"{os.path.join(layout['outdir'], checkpoint_grid.GRID_PNG)}")


def main(argv=None) -> int:
    return gen_options.run_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
