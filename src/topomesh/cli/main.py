"""The ``topomesh`` command: one module per subcommand under ``topomesh.cli``.

Each subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. ``topomesh launch`` is the exception: it takes torchrun's own
arguments, so everything after ``launch`` goes to :mod:`topomesh.launch.cli` untouched.

Errors topomesh raises on purpose (:class:`~topomesh.errors.TopomeshError`) print as one
line on stderr with exit code 2; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

from topomesh.errors import TopomeshError
from topomesh.report.text import printable

# Subcommands in the order `topomesh --help` lists them.
COMMANDS = ("discover", "show", "launch", "layout", "trace", "profile", "calibrate", "simulate", "validate", "plan")


# `launch` takes torchrun's own arguments and lives with the launcher.
_MODULES = {"launch": "topomesh.launch.cli"}


def _module(name: str) -> str:
    return _MODULES.get(name, f"topomesh.cli.{name}")


def _help_line(name: str) -> str:
    """A subcommand's ``HELP`` read from its source, so listing commands imports none of
    them (several import torch, seconds of start-up)."""
    spec = importlib.util.find_spec(_module(name))
    try:
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))  # type: ignore[union-attr, arg-type]
    except (OSError, SyntaxError, TypeError):
        return ""
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "HELP" for t in targets):
                try:
                    return str(ast.literal_eval(node.value))
                except ValueError:
                    return ""
    return ""


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The ``topomesh`` parser; only the ``selected`` subcommand's module is imported."""
    from topomesh import __version__

    parser = argparse.ArgumentParser(
        prog="topomesh",
        description="Topology-aware distributed PyTorch: discover, launch, lay out, trace, cost.",
    )
    parser.add_argument("--version", action="version", version=f"topomesh {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        help_line = _help_line(name)
        p = sub.add_parser(name, help=help_line, description=help_line)
        if name == selected and name not in _MODULES:
            mod = importlib.import_module(_module(name))
            if hasattr(mod, "add_arguments"):
                mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "launch":
            from topomesh.launch.cli import command as launch_command

            return launch_command(argv[1:])
        selected = next((a for a in argv if not a.startswith("-")), None)
        parser = build_parser(selected)
        args = parser.parse_args(argv)
        if not getattr(args, "_run", None):
            parser.print_help()
            return 2
        return int(args._run(args) or 0)
    except TopomeshError as exc:
        with contextlib.suppress(BrokenPipeError):  # stderr a closed pipe: the exit code still says it failed
            print(f"topomesh: error: {printable(exc)}", file=sys.stderr)  # names from files are not terminal codes
        return 2
    except KeyboardInterrupt:
        print("topomesh: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
