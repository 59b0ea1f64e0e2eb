#!/usr/bin/env python
"""Compare a run's saved LoRA files: a labelled grid of files x multipliers x prompts at fixed
seeds, each cell also its own PNG with A1111's text, and grid.json (docs/GENERATION.md).

    python tools/compare_checkpoints.py --ckpt MODEL --lora_dir OUTPUT_DIR --outdir GRID \
        --from_file prompts.txt --multipliers 0.5 1.0 --W 512 --H 512 --steps 20 --seed 1
"""
import logging
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library.log import setup_logging  # noqa: E402

setup_logging(True)  # before diffusers loads bitsandbytes, whose optional-kernel notice it silences

from library.errors import UserError  # noqa: E402
from library.outputs import checkpoint_grid  # noqa: E402


def main(argv=None) -> int:
    try:
        layout = checkpoint_grid.compare(checkpoint_grid.parse_args(sys.argv[1:] if argv is None else argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(f"{len(layout['rows'])} x {len(layout['columns'])} cells: "
          f"{os.path.join(layout['outdir'], checkpoint_grid.GRID_PNG)}")
    logging.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
