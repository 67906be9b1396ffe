"""``topomesh discover``: describe this machine (or a sysfs tree) as a topology.

One rank per GPU (or per NUMA node on a CPU-only host) unless ``--nproc`` says otherwise,
placed as torchrun would (:func:`topomesh.topology.build.single_host_topology`).
"""

from __future__ import annotations

import argparse
import sys

from topomesh.cli.argtypes import MAX_RANKS_PER_HOST, bounded_int
from topomesh.cli.show import add_output_arguments, emit
from topomesh.topology import api
from topomesh.topology.build import single_host_topology
from topomesh.topology.discover import ENV_SYSFS_ROOT, discover_host

HELP = "Discover this machine's GPUs, NICs and links; print them or write a v0.1 topology file."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", metavar="FILE", help="write the topology file to FILE (atomically)")
    parser.add_argument(
        "--sysfs-root",
        metavar="DIR",
        help=f"read sysfs from DIR instead of / (default: ${ENV_SYSFS_ROOT}, else /)",
    )
    parser.add_argument(
        "--nproc", type=bounded_int(1, MAX_RANKS_PER_HOST), metavar="N",
        help=f"ranks on this host, at most {MAX_RANKS_PER_HOST} (default: one per GPU, else per NUMA node)",
    )
    parser.add_argument(
        "--form",
        choices=[f.value for f in api.FileForm],
        default=api.FileForm.AUTO.value,
        help="file form for -o and --json: dense v0.1, compact, or auto by world size (default)",
    )
    add_output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    host = discover_host(args.sysfs_root)
    topo = single_host_topology(host, args.nproc, source="discover")
    if args.output:
        api.save_topology(topo, args.output, args.form)  # a bad path raises TopologyError
    emit(topo, args, args.form)
    if args.output and not args.json:
        print(f"wrote {args.output}", file=sys.stderr)
    return 0
