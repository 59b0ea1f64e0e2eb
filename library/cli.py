"""Entry-point glue: parse options, run, and turn user errors into one line without traceback."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from library.accelerator import is_main_process, leave_process_group_at_exit, peer_failure
from library.config.options import METHOD_OF_SCRIPT
from library.config.parse import fine_tuning_data, parse_args
from library.errors import NonFiniteStop, TrainingInterrupted, UserError
from library.models import script_family
from library.outputs import progress_stream

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

PROMPT_ONLY_SCRIPTS = ("train_leco",)  # no dataset: library/run/leco.py runs them


def main(script: str, argv: list[str] | None = None, entry: str | None = None) -> int:
    """Run ``script`` (a name of library/config/options.py SCRIPTS). ``entry``: the sd-scripts
    family-specific script it runs as (sdxl_train_network.py, ...), whose model must be of a family
    naming it (library/models/script_family.py)."""
    opts = None
    status, code, message, state = "done", 0, "", None
    try:
        opts = parse_args(script, sys.argv[1:] if argv is None else argv, entry)
        if entry is not None:
            script_family.check(entry, opts.pretrained_model_name_or_path)
        if script in PROMPT_ONLY_SCRIPTS:
            from library.run import leco  # lazy: --help and option errors must not import torch

            leco.run(opts)
        else:
            from library.run import trainer  # lazy: --help and option errors must not import torch

            trainer.run(opts, METHOD_OF_SCRIPT[script])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        status, code, message = "failed", 2, str(e)
    except NonFiniteStop as e:  # a non-finite loss / gradient / weight: exit code 3
        print(f"error: {e}", file=sys.stderr)
        status, code, message = "failed", e.exit_code, str(e)
    except TrainingInterrupted as e:  # SIGINT/SIGTERM: a state was written; 130 / 143
        print(f"interrupted by {e}", file=sys.stderr)
        status, code, message, state = "stopped", e.exit_code, f"interrupted by {e}", e.state_dir
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        status, code, message = "interrupted", 130, "interrupted"
    except RuntimeError as e:  # several processes: another one ended (its own line says why)
        line = peer_failure(e)
        if line is None:
            _end(opts, "failed", 1, f"{type(e).__name__}: {e}", None)
            leave_process_group_at_exit(finished=False)
            raise
        print(f"error: {line}", file=sys.stderr)
        status, code, message = "failed", 2, line
    _end(opts, status, code, message, state)
    leave_process_group_at_exit(finished=code == 0)
    return code


def full_training_script(argv: list[str] | None = None) -> str:
    """The script a full-training entry that takes both kinds of dataset runs (sd-scripts'
    sdxl_train.py, sd3_train.py, flux_train.py, lumina_train.py): finetune with a metadata file
    (in_json, or a subset's metadata_file), else train_dreambooth (image folders)."""
    return "finetune" if fine_tuning_data(sys.argv[1:] if argv is None else argv) else "train_dreambooth"


def _end(opts: Options | None, status: str, code: int, message: str, state: str | None) -> None:
    """The progress stream's last line (progress_file, main process; not for a dry run)."""
    if opts is None or not opts.progress_file or opts.dry_run or not is_main_process():
        return
    progress_stream.write_end(opts.progress_file, status, code, message, state)
