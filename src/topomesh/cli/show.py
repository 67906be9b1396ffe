"""``topomesh show SOURCE``: print a topology file as tables, a matrix, JSON or a picture.

SOURCE is a v0.1 file, a compact file, NCCL topology XML or ``nvidia-smi topo -m`` text,
detected by content (:func:`topomesh.topology.api.read_source`). With ``--layout
tp=8,pp=2,dp_shard=-1`` the layout view follows (hosts, ranks, each axis's groups and the
links they cross; ``--json`` then prints the layout document of ``topomesh layout``).
"""

from __future__ import annotations

import argparse
import sys

from topomesh.topology import api
from topomesh.topology.model import Topology

HELP = "Show a topology file (v0.1, compact, NCCL XML or nvidia-smi text) as tables, JSON or a PNG."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SOURCE", help="topology file: v0.1 / compact JSON, NCCL XML, nvidia-smi topo -m text")
    add_output_arguments(parser)
    parser.add_argument(
        "--layout",
        metavar="SPEC",
        help="also show a parallel layout placed on it, e.g. tp=8,pp=2,dp_shard=-1 (-1 = the rest)",
    )
    parser.add_argument("--order", default=None, help="with --layout: axes fastest first, e.g. tp-cp-ep-dp_shard-dp_replicate-pp")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared with ``topomesh discover``."""
    parser.add_argument("--json", action="store_true", help="print the v0.1 document (compact form for large worlds)")
    parser.add_argument("--png", metavar="FILE", help="also draw the graph to FILE (needs matplotlib: topomesh[plot])")
    parser.add_argument(
        "--matrix",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="print the rank-to-rank matrix (default: on)",
    )


def emit(topo: Topology, args: argparse.Namespace, form: str = "auto") -> None:
    """Write ``--png``, then print JSON (``--json``) or the tables to stdout."""
    if args.png:
        from topomesh.report.plot import save_png

        save_png(topo, args.png)
    if args.json:
        sys.stdout.write(api.dumps(topo, form))
        return
    from rich.console import Console

    from topomesh.report.text import printable
    from topomesh.report.topology import topology_report

    console = Console()
    console.print(topology_report(topo, matrix=args.matrix))
    if args.png:
        console.print(f"drawn to {printable(args.png)}", markup=False, highlight=False)


def run(args: argparse.Namespace) -> int:
    topo = api.read_source(args.source)
    if not args.layout:
        emit(topo, args)
        return 0
    import json

    from rich.console import Console

    from topomesh.layout.api import resolve_layout
    from topomesh.layout.dims import parse_degrees
    from topomesh.report.layout import layout_to_dict, render_layout

    layout = resolve_layout(parse_degrees(args.layout, allow_rest=True), topo.world_size, order=args.order)
    if args.json:
        json.dump(layout_to_dict(topo, layout), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    emit(topo, args)
    Console().print(render_layout(topo, layout))
    return 0
