"""The ``topomesh`` command: one module per subcommand under ``topomesh.cli``.

Each subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. ``topomesh launch`` is the exception: it takes torchrun's own
arguments, so everything after ``launch`` goes to :mod:`topomesh.launch.cli` untouched.

Errors topomesh raises on purpose (:class:`~topomesh.errors.TopomeshError`) print as one
line on stderr with exit code 2; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

from topomesh.errors import TopomeshError

# Subcommands in the order `topomesh --help` lists them; modules that are not present
# (optional parts) are skipped.
COMMANDS = ("discover", "show", "launch", "layout", "trace", "profile", "calibrate", "simulate", "plan")


def _available() -> list[str]:
    return [c for c in COMMANDS if importlib.util.find_spec(f"topomesh.cli.{c}") is not None]


def build_parser() -> argparse.ArgumentParser:
    from topomesh import __version__

    parser = argparse.ArgumentParser(
        prog="topomesh",
        description="Topology-aware distributed PyTorch: discover, launch, lay out, plan.",
    )
    parser.add_argument("--version", action="version", version=f"topomesh {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _available():
        mod = importlib.import_module(f"topomesh.cli.{name}")
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "launch" and importlib.util.find_spec("topomesh.launch.cli"):
            from topomesh.launch.cli import main as launch_main

            return launch_main(argv[1:])
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "_run", None):
            parser.print_help()
            return 2
        return int(args._run(args) or 0)
    except TopomeshError as exc:
        print(f"topomesh: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("topomesh: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
