"""``python -m topomesh.launch ARGS`` is ``topomesh launch ARGS``."""

from __future__ import annotations

import sys

from topomesh.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["launch", *sys.argv[1:]]))
