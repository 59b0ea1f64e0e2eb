"""Entry-point glue: parse options, run, and turn user errors into one line without traceback."""
from __future__ import annotations

import sys

from library.errors import UserError
from library.training.nonfinite import NonFiniteStop
from library.outputs.train_state import TrainingInterrupted

METHOD_OF_SCRIPT = {"train_lora": "lora", "train_dreambooth": "dreambooth", "finetune": "finetune",
                    "train_textual_inversion": "textual_inversion"}
PROMPT_ONLY_SCRIPTS = ("train_leco",)  # no dataset: library/training/leco.py runs them


def main(script: str, argv: list[str] | None = None) -> int:
    from library.config.parse import parse_args

    try:
        opts = parse_args(script, sys.argv[1:] if argv is None else argv)
        if script in PROMPT_ONLY_SCRIPTS:
            from library.training import leco

            leco.run(opts)
        else:
            from library.training import trainer

            trainer.run(opts, METHOD_OF_SCRIPT[script])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteStop as e:  # a non-finite loss / gradient / weight: exit code 3
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except TrainingInterrupted as e:  # SIGINT/SIGTERM: a state was written; 130 / 143
        print(f"interrupted by {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:  # several processes: another one ended (its own line says why)
        from library.distributed.accelerator import peer_failure

        line = peer_failure(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2
    return 0
