"""``topomesh plan``: search every layout of a model on a cluster and rank them.

Examples::

    topomesh plan --model llama3-8b --cluster dgx-h100 --gpus 64 --global-batch 256 --top 5
    topomesh plan --model llama3-70b --gpus 1024 --tp 8 --strategies tp,pp,dp_shard,dp_replicate \\
        --search micro-batch,recompute,schedule -o plan.json --html plan.html
    topomesh plan --model tiny-llama --topology world.json --device cpu -o plan.json
    topomesh launch --standalone --nproc-per-node 4 --plan plan.json train.py

The space is every assignment of degrees to ``--strategies`` and every order of the axes in
use (fixed degrees such as ``--tp 8`` are constraints), times the searched knobs; divisibility
and a memory lower bound prune it before tracing; each layout class is traced once (cached on
disk) and every layout is scored by the step simulator, orders with the same links sharing
one simulation (``--exhaustive`` simulates each one; the results are the same).
"""

from __future__ import annotations

import argparse
import json
import sys

HELP = "Search every layout of a model on a cluster; rank them; write the plan topomesh launch runs."

SEARCHABLE = ("micro-batch", "recompute", "schedule")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from topomesh.sim.inputs import add_step_arguments

    add_step_arguments(p)
    p.add_argument("--strategies", default=None, metavar="AXIS,...",
                   help="axes to search (default all: dp_replicate,dp_shard,cp,tp,pp,ep); fixed degrees "
                        "(--tp 8, --layout) are constraints")
    p.add_argument("--search", default="", metavar="KNOB,...",
                   help="knobs to search as well: micro-batch (1,2,4,8), recompute (none,selective,full), "
                        "schedule (1f1b, gpipe, interleaved-1f1b at --interleave or 2 and 4)")
    p.add_argument("--top", type=int, default=10, metavar="K", help="layouts to show and write (default 10)")
    p.add_argument("--exhaustive", action="store_true",
                   help="simulate every layout instead of sharing results between orders with the same links")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="local worker processes (default 1: this process)")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run tracing and scoring as Ray tasks (ADDRESS of an existing cluster, or a local Ray)")
    p.add_argument("--db", default=None, metavar="FILE", help="op-profile SQLite file (as simulate)")
    p.add_argument("--json", action="store_true", help="the plan as JSON on stdout")
    p.add_argument("-o", "--output", default=None, metavar="PLAN.json", help="write the plan file")
    p.add_argument("--csv", default=None, metavar="FILE", help="every scored layout as CSV")
    p.add_argument("--png", default=None, metavar="FILE", help="Pareto plot: step time against peak memory")
    p.add_argument("--html", default=None, metavar="FILE", help="one self-contained HTML report")
    p.add_argument("--export", default=None, choices=("torchtitan", "megatron"),
                   help="print the best layout as torchtitan TOML settings or Megatron-LM arguments")


def search_knobs(args: argparse.Namespace) -> object:
    """The knob table ``--search`` and the training flags describe."""
    from topomesh.errors import LayoutError
    from topomesh.search.space import KnobTable
    from topomesh.sim.schedules import Schedule

    wanted = [s.strip() for s in (args.search or "").split(",") if s.strip()]
    bad = [s for s in wanted if s not in SEARCHABLE]
    if bad:
        raise LayoutError(f"--search {args.search!r}: unknown knob(s) {', '.join(bad)}; known: {', '.join(SEARCHABLE)}.")
    mbs = (1, 2, 4, 8) if "micro-batch" in wanted else (args.micro_batch,)
    recs = ("none", "selective", "full") if "recompute" in wanted else (args.recompute,)
    if "schedule" in wanted:
        scheds = (Schedule.ONE_F_ONE_B, Schedule.GPIPE, Schedule.INTERLEAVED_1F1B)
        inter = (args.interleave,) if args.interleave > 1 else (2, 4)
    else:
        scheds, inter = (Schedule(args.schedule),), (args.interleave,)
    return KnobTable.product(micro_batch=mbs, recompute=recs, schedule=scheds, interleave=inter)


def fixed_degrees(args: argparse.Namespace) -> dict[str, int]:
    """Degrees given with ``--tp 8`` or ``--layout``: constraints of the search."""
    from topomesh.errors import LayoutError
    from topomesh.layout.dims import merge_degrees, parse_degrees
    from topomesh.sim.inputs import AXES

    if args.order:
        raise LayoutError("--order does not apply to plan: it searches every order of the axes in use.")
    flags = {a: getattr(args, a) for a in AXES if getattr(args, a) is not None}
    degrees = merge_degrees(flags, parse_degrees(args.layout), unset=0) if args.layout else flags
    bad = {a: d for a, d in degrees.items() if d is not None and d < 1 and d != 0}
    if bad:
        raise LayoutError(f"fixed degrees must be positive integers for plan, got {bad}.")
    return {a: d for a, d in degrees.items() if d}


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from topomesh.cli.argtypes import check_outputs
    from topomesh.errors import LayoutError
    from topomesh.search.evaluate import PlanInputs, build_cluster
    from topomesh.search.rank import csv_text, export_megatron, export_torchtitan, plan_dict
    from topomesh.search.run import search
    from topomesh.topology.api import write_atomic
    from topomesh.trace.cache import default_directory

    check_outputs(args, ("output", "csv", "png", "html"), plots=("png", "html"))
    if args.top < 1:
        raise LayoutError(f"--top must be a positive integer, got {args.top}.")
    strategies = [s for s in args.strategies.split(",") if s.strip()] if args.strategies else None
    base = PlanInputs(model=args.model, global_batch=1, seq_len=args.seq_len, cluster=args.cluster,
                      topology=args.topology, device=args.device, gpus=args.gpus)
    world = build_cluster(base).world_size if args.global_batch is None else None
    inputs = PlanInputs(model=args.model, global_batch=args.global_batch or world * args.micro_batch,
                        seq_len=args.seq_len, cluster=args.cluster, topology=args.topology, device=args.device,
                        gpus=args.gpus, dtype=args.dtype, sequence_parallel=args.sequence_parallel,
                        mixed_precision=args.mixed_precision, db=args.db, cache_dir=str(default_directory()))
    err = Console(stderr=True)
    with _progress(err) as tell:
        plan = search(inputs, strategies=strategies, fixed=fixed_degrees(args), knobs=search_knobs(args),
                      exhaustive=args.exhaustive, workers=args.workers, ray_address=args.ray, progress=tell)
    data = plan_dict(plan, top=args.top)
    text = json.dumps(data, indent=1)
    if args.output:
        write_atomic(args.output, text + "\n")
    if args.csv:
        write_atomic(args.csv, csv_text(plan))
    if args.png:
        from topomesh.report.plan import pareto_png

        write_atomic(args.png, pareto_png(plan))
    if args.html:
        from topomesh.report.plan import html_report

        write_atomic(args.html, html_report(plan, data, top=args.top))
    if args.export:
        if data["best"] is None:
            raise LayoutError("--export: the search found no feasible layout to export.")
        out = export_torchtitan(data["best"]) if args.export == "torchtitan" else export_megatron(
            data["best"], n_layers=plan.extra.get("n_layers"))
        sys.stdout.write(out)
        return 0
    if args.json:
        sys.stdout.write(text + "\n")
        return 0
    from topomesh.report.plan import print_plan

    print_plan(plan, data, top=args.top)
    for path, what in ((args.output, "plan"), (args.csv, "CSV"), (args.png, "Pareto plot"), (args.html, "report")):
        if path:
            err.print(f"{what} written to {path}", highlight=False)
    return 0


class _progress:
    """Rich progress bars with ETA for tracing and scoring, on stderr when it is a terminal."""

    def __init__(self, console: object) -> None:
        self.console = console
        self.bar = None
        self.tasks: dict[str, int] = {}

    def __enter__(self) -> object:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        if self.console.is_terminal:  # type: ignore[attr-defined]
            self.bar = Progress(TextColumn("{task.description:>8}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("ETA"), TimeRemainingColumn(), console=self.console, transient=True)
            self.bar.__enter__()
        return self.tell

    def tell(self, phase: str, done: int, total: int) -> None:
        if self.bar is None:
            return
        if phase not in self.tasks:
            self.tasks[phase] = self.bar.add_task(phase, total=total)
        self.bar.update(self.tasks[phase], completed=done, total=total)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
