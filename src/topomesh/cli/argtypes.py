"""Argument types shared by every command line: bounded whole numbers and finite seconds.

argparse's ``type=int`` reads ``+4``, ``4_0`` (as 40) and digits of other scripts, and
``type=float`` reads ``nan`` and ``inf`` — a timeout of ``nan`` never fires. These types
take plain ASCII decimal digits (:func:`topomesh.layout.dims.parse_decimal`) within named
limits, and finite positive seconds; anything else is argparse's one-line usage error
(exit 2) naming the flag, the value and the limit.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from topomesh.layout.dims import MAX_DEGREE, parse_decimal

MAX_RANKS = MAX_DEGREE
"""Ranks in one world (1,048,576: the compact file form's limit)."""
MAX_HOSTS = 65_536
"""Hosts in one world: 16 ranks each reach :data:`MAX_RANKS`."""
MAX_RANKS_PER_HOST = 1024
"""Ranks on one host (``discover --nproc``): more than the hardware threads of the largest
two-socket servers (2 × 192 cores × 2 threads = 768); `discover --nproc 1024 --json` takes
about 3 s here, 4,096 took minutes (the world is built pair by pair)."""
MAX_THREADS = 4096
"""CPU threads a command may ask torch for (``profile --threads``)."""
MAX_SEQ_LEN = 1 << 24
"""Tokens per sample (16,777,216; the longest published context windows are about 10 million)."""
MAX_BATCH = 1 << 20
"""Samples per micro-batch or batch."""
MAX_SECONDS = 7 * 24 * 3600.0
"""The longest time a flag may ask for (a week)."""


def bounded_int(lo: int, hi: int, *, rest: bool = False) -> Callable[[str], int]:
    """An argparse type: a whole number from ``lo`` to ``hi`` in plain ASCII digits; with
    ``rest``, also ``-1`` (the rest of the world, for degrees).

    >>> bounded_int(1, 8)("8"), bounded_int(1, 8, rest=True)("-1")
    (8, -1)
    """

    def parse(text: str) -> int:
        value = -1 if rest and text.strip() == "-1" else parse_decimal(text.strip())
        want = f"a whole number from {lo} to {hi}" + (" or -1 (the rest)" if rest else "")
        if value is None:
            raise argparse.ArgumentTypeError(
                f"expected {want} in plain ASCII digits (no sign, underscore or leading zero), got {text[:40]!r}")
        if value != -1 and not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected {want}, got {value}")
        return value

    parse.__name__ = "whole number"  # argparse names the type in "invalid <name> value" messages
    return parse


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0 and at most :data:`MAX_SECONDS`
    (``nan``, ``inf``, ``0`` and negatives refused).

    >>> positive_seconds("2.5"), positive_seconds("1e2")
    (2.5, 100.0)
    """
    try:
        if not text.isascii() or "_" in text or text != text.strip():
            raise ValueError(text)  # float() also reads "1_0", " 2 " and digits of other scripts
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text[:40]!r}") from None
    if not math.isfinite(value) or not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(
            f"expected a finite number of seconds above 0 and at most {MAX_SECONDS:g}, got {text[:40]!r}")
    return value


def check_outputs(args: argparse.Namespace, files: tuple[str, ...], plots: tuple[str, ...] = ()) -> None:
    """Before a command's long work: every output flag of ``files`` that is set must name a
    path :func:`~topomesh.topology.api.write_atomic` can write, and any set flag of ``plots``
    needs matplotlib. A typo or a missing extra then fails in a second, not after a search or a
    validation run of minutes whose results it would lose."""
    from topomesh.errors import OutputError
    from topomesh.report.plot import require_matplotlib
    from topomesh.topology.api import check_writable

    for name in files:
        path = getattr(args, name, None)
        if path:
            try:
                check_writable(path)
            except OutputError as e:
                raise OutputError(f"--{name}: {e}") from None
    wanted = [f"--{name}" for name in plots if getattr(args, name, None)]
    if wanted:
        require_matplotlib(" and ".join(wanted))
