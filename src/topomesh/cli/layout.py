"""``topomesh layout SOURCE --tp 8 --pp 2 ...``: place a layout on a topology and show it.

SOURCE is any topology file ``topomesh show`` reads (v0.1 JSON, compact, NCCL XML,
``nvidia-smi topo -m``). A host-level file describes one host; ``--hosts N`` makes a
world of N such hosts, numbered host after host (``--rank-order contiguous``, torchrun's
default) or round-robin over hosts (``round-robin``), to see what placement fixes.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from topomesh.cli.argtypes import MAX_HOSTS, MAX_RANKS, bounded_int
from topomesh.errors import LayoutError
from topomesh.layout.api import resolve_layout
from topomesh.layout.dims import MAX_DEGREE, Axis, merge_degrees, parse_degrees
from topomesh.layout.place import Strategy
from topomesh.report.layout import layout_to_dict, render_layout
from topomesh.topology.api import read_source
from topomesh.topology.build import build_topology
from topomesh.topology.model import RankInfo, Topology

HELP = "Place a parallel layout (tp, pp, dp, ...) on a topology: ranks, groups and the links each axis crosses."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SOURCE", help="topology file (v0.1/compact JSON, NCCL XML, nvidia-smi topo -m)")
    for axis in Axis:
        flag = "--" + axis.value.replace("_", "-")
        parser.add_argument(flag, dest=axis.value, type=bounded_int(1, MAX_DEGREE, rest=True), default=1, metavar="N",
                            help=f"{axis.value} degree (default 1; -1 = the rest of the world)")
    parser.add_argument("--dp", dest="dp_alias", type=bounded_int(1, MAX_DEGREE, rest=True), default=None, metavar="N",
                        help="alias of --dp-replicate")
    parser.add_argument("--layout", default=None, metavar="AXIS=N,...",
                        help="the degrees as one spec, e.g. tp=8,pp=2,dp_shard=-1 (same as the flags)")
    parser.add_argument("--order", default=None, help="axes fastest first, e.g. tp-cp-ep-dp_shard-dp_replicate-pp (the default)")
    parser.add_argument("--strategy", choices=[s.value for s in Strategy], default=Strategy.TOPOLOGY.value,
                        help="topology: locality-aware placement (default); rank-order: logical rank i on rank i")
    parser.add_argument("--hosts", type=bounded_int(1, MAX_HOSTS), default=None, metavar="N",
                        help=f"repeat a one-host SOURCE into N hosts (at most {MAX_HOSTS})")
    parser.add_argument("--rank-order", choices=["contiguous", "round-robin"], default="contiguous",
                        help="with --hosts: how ranks are numbered over the hosts")
    parser.add_argument("--json", action="store_true", help="machine-readable output (stable keys)")


def _replicate(topo: Topology, n: int, round_robin: bool) -> Topology:
    if len(topo.hosts) != 1:
        raise LayoutError(f"--hosts needs a one-host SOURCE, this one has {len(topo.hosts)} hosts")
    if n < 1:
        raise LayoutError(f"--hosts must be at least 1, got {n}")
    if n * topo.world_size > MAX_RANKS:
        raise LayoutError(f"--hosts {n} of {topo.world_size} ranks each make {n * topo.world_size} ranks, more than "
                          f"the {MAX_RANKS} topomesh handles")
    base = topo.hosts[0]
    hosts = [base.renamed(f"{base.hostname}-{i}") for i in range(n)]
    per = topo.world_size
    ranks = []
    for r in range(n * per):
        h, local = (r % n, r // n) if round_robin else (r // per, r % per)
        ranks.append(RankInfo(rank=r, host=h, local_rank=local, device=topo.ranks[local].device))
    return build_topology(hosts, ranks, source=topo.source)


def run(args: argparse.Namespace) -> int:
    topo = read_source(args.source)
    if args.hosts is not None:
        topo = _replicate(topo, args.hosts, args.rank_order == "round-robin")
    elif args.rank_order != "contiguous":
        raise LayoutError("--rank-order needs --hosts")
    degrees = {a.value: getattr(args, a.value) for a in Axis}
    if args.dp_alias is not None:
        if degrees["dp_replicate"] != 1:
            raise LayoutError("give --dp or --dp-replicate, not both")
        degrees["dp_replicate"] = args.dp_alias
    if args.layout:
        degrees = merge_degrees(degrees, parse_degrees(args.layout, allow_rest=True))
    layout = resolve_layout(degrees, topo.world_size, order=args.order)
    if args.json:
        json.dump(layout_to_dict(topo, layout, args.strategy), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        Console().print(render_layout(topo, layout, args.strategy))
    return 0
