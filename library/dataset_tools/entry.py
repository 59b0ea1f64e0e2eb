"""What every dataset tool's main does around its work: the ``sdtk`` log on stderr, and a user
error (a missing folder, a file that is not UTF-8, a read-only folder) printed as one line with
exit status 2 instead of a traceback."""
from __future__ import annotations

import sys

from library.errors import UserError
from library.log import setup_logging


def run_tool(work, *args, **kwargs) -> int:
    """``work(*args, **kwargs)``; 0 when it returns (or its int result), 2 on a UserError."""
    setup_logging(True)
    try:
        result = work(*args, **kwargs)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) and not isinstance(result, bool) else 0
