"""``topomesh simulate``: predict one layout's training step — time, breakdown, memory.

Examples::

    topomesh simulate --model llama3-8b --cluster dgx-h100 --gpus 64 --tp 8 --dp-shard -1
    topomesh simulate --model llama3-70b --cluster dgx-a100-80gb --gpus 512 \\
        --layout tp=8,pp=4,dp_shard=-1 --global-batch 512 --schedule interleaved-1f1b --interleave 2
    topomesh simulate --model my_model.py:build --topology cluster.json --device H100-SXM5-80GB --json

The layout's class is traced once on this CPU (fake tensors; cached on disk), priced on the
cluster (measured op table first, else the device's efficiency-aware roofline; collectives
on the link each axis crosses under the topology placement) and run through the event
simulation (:mod:`topomesh.sim`).
"""

from __future__ import annotations

import argparse
import json
import sys

HELP = "Predict a layout's training step on a cluster: step time, breakdown, MFU, memory per stage."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from topomesh.sim.inputs import add_step_arguments

    add_step_arguments(p)
    p.add_argument("--db", default=None, metavar="FILE",
                   help="op-profile SQLite file with measured op times (default: the shared one, when present)")
    p.add_argument("--json", action="store_true", help="the StepResult as JSON")
    p.add_argument("--timeline", default=None, metavar="FILE.json",
                   help="write the simulated step as a Chrome trace (Perfetto, chrome://tracing)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from topomesh.cli.argtypes import check_outputs
    from topomesh.cost.cluster import Cluster
    from topomesh.cost.opdb import device_table
    from topomesh.sim.inputs import (
        cluster_from_args,
        layout_from_args,
        load_model,
        training_from_args,
    )
    from topomesh.sim.simulate import Simulator
    from topomesh.trace.cache import TraceCache, default_directory

    check_outputs(args, ("timeline",))
    model = load_model(args.model, seq_len=args.seq_len)
    cluster: Cluster = cluster_from_args(args)
    layout = layout_from_args(args, cluster.world_size)
    training = training_from_args(args, layout, model)
    sim = Simulator(model=model, cluster=cluster, cache=TraceCache(default_directory()),
                    table=device_table(cluster.device, db=args.db, threads=cluster.threads_per_rank))
    err = Console(stderr=True)
    with err.status(f"tracing {model.spec.name} under {layout.describe()} (cached after the first time)"):
        sim.trace(layout, training)
    result = sim.simulate(layout, training, record=bool(args.timeline))
    if args.timeline:
        from topomesh.topology.api import write_atomic

        write_atomic(args.timeline, json.dumps(result.timeline))
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    from topomesh.report.simulate import print_result

    print_result(result, model=model.spec.name, cluster=cluster.name)
    if args.timeline:
        err.print(f"timeline written to {args.timeline} (open it in ui.perfetto.dev or chrome://tracing)",
                  highlight=False)
    return 0
