"""The `topomesh` entry point: every command is listed, and listing them imports no torch."""

from __future__ import annotations

import subprocess
import sys

from topomesh.cli.main import COMMANDS

_PROBE = """
import contextlib, io, sys
from topomesh.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    main(["--help"])
print("TORCH" if "torch" in sys.modules else "NO-TORCH")
print(out.getvalue())
"""


def test_help_lists_every_command_without_importing_torch():
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True)
    first, _, listing = proc.stdout.partition("\n")
    assert first == "NO-TORCH", "listing commands must not import torch (seconds of start-up)"
    for name in COMMANDS:
        assert f"    {name}" in listing, f"{name} missing from topomesh --help"
    assert "torchrun with a topology" in listing  # launch's help line, read from its module


def test_unknown_command_is_exit_2(capsys):
    from topomesh.cli.main import main

    try:
        rc = main(["warp-drive"])
    except SystemExit as exc:  # argparse exits 2 on an invalid choice
        rc = exc.code
    assert rc == 2 and "invalid choice: 'warp-drive'" in capsys.readouterr().err
