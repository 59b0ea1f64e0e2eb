#!/usr/bin/env python
"""The local web UI and JSON job API: python ui.py [--port 7860] [--listen] [--token T]
[--allowed_paths DIR ...] [--db FILE] [--gpus 0,1]. Needs the ui extra (pip install -e ".[ui]").
docs/UI.md describes the pages, the API and the safety rules.
"""
import sys

from library.ui.server import main

if __name__ == "__main__":
    sys.exit(main())
