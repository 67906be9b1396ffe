"""``topomesh profile``: time every distinct op of a traced step on this device.

Ops come from a trace of a model under a layout (``--model tiny-llama --layout
tp=2,dp_shard=2``; a preset, a JSON config or ``path.py:fn`` as ``simulate`` takes them:
:func:`topomesh.trace.tracer.trace_step` on two blocks, composed to the model's depth; with
``--device cuda`` traced as a GPU runs it, :mod:`topomesh.trace.kernels`) or from a JSON file of op records (``--records``, the
format :func:`topomesh.cost.ops.records_to_json` writes: a list of objects with ``op``,
``inputs``/``outputs`` as ``{"shape", "dtype", "stride"}``, ``flops``, ``bytes_moved``,
``phase`` and ``args``). Each distinct signature not yet in the shared op-profile table
is run for real and its median stored; the summary splits the step's op time into
measured and roofline parts and lists the ops with no measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from topomesh.cli.argtypes import MAX_BATCH, MAX_SEQ_LEN, MAX_THREADS, bounded_int, positive_seconds
from topomesh.cost.devices import current_device_spec, device_fingerprint, device_spec
from topomesh.cost.opdb import OpProfileDB, default_db_path
from topomesh.cost.ops import CostSummary, ProfileRun, cost_summary, profile_ops, records_from_json
from topomesh.errors import CalibrationError, TraceError
from topomesh.layout.dims import parse_degrees
from topomesh.topology.api import read_json
from topomesh.trace.graph import OpRecord

HELP = "Profile each distinct op of a traced step on this device into the shared op-profile table."


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="PRESET|FILE.json|PATH.py:FN",
                     help="model to trace, as simulate takes it: a preset (tiny-llama, llama3-8b), a JSON file of "
                          "TransformerConfig fields, or path.py:function")
    src.add_argument("--records", type=Path, metavar="FILE",
                     help="JSON list of op records (see docs/cost.md for the format)")
    p.add_argument("--layout", default="dp_shard=1", metavar="AXIS=N,...",
                   help="mesh axes and degrees for --model, e.g. tp=2,dp_shard=2 (pp is left out of a trace)")
    p.add_argument("--seq-len", type=bounded_int(1, MAX_SEQ_LEN), default=None, help="override the preset's sequence length")
    p.add_argument("--batch-size", type=bounded_int(1, MAX_BATCH), default=1, help="micro-batch size per rank (default 1)")
    p.add_argument("--dtype", default="bfloat16", help="training dtype for --model (default bfloat16)")
    p.add_argument("--device", default="cpu", help="torch device to profile on: cpu or cuda[:i] (default cpu)")
    p.add_argument("--db", type=Path, default=None, help=f"op-profile SQLite file (default {default_db_path()})")
    p.add_argument("--threads", type=bounded_int(1, MAX_THREADS), default=None,
                   help="torch CPU threads while profiling (part of the key)")
    p.add_argument("--spec", default=None, help="device spec for the roofline of unprofiled ops "
                   "(default: this device; e.g. H100-SXM5-80GB)")
    p.add_argument("--no-profile", action="store_true", help="only price the records with what the table has")
    p.add_argument("--max-seconds", type=positive_seconds, default=None,
                   help="stop starting new ops after this many seconds (the rest: roofline, profiled next run)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _load(path: Path) -> list[Any]:
    return records_from_json(read_json(path, what="op-records file", error=TraceError), source=str(path))


def _trace_records(args: argparse.Namespace) -> list[OpRecord]:
    import torch

    from topomesh.sim.inputs import load_model
    from topomesh.sim.simulate import Training
    from topomesh.trace.tracer import trace_step

    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise TraceError(f"--dtype {args.dtype!r} is not a torch dtype")
    model = load_model(args.model, seq_len=args.seq_len)
    spec = model.spec
    # the built-in parallelize's defaults (sequence parallel, no recomputation), no mixed precision
    parallelize = model.parallelize(Training(global_batch=args.batch_size, micro_batch=args.batch_size,
                                             seq_len=model.seq_len), False)
    traced = min(2, spec.n_layers)
    trace = trace_step(spec, parallelize, parse_degrees(args.layout), n_layers=traced,
                       batch_size=args.batch_size, dtype=dtype, gpu_kernels=args.device.startswith("cuda"))
    if spec.n_layers > traced:
        trace = trace.compose(spec.n_layers)
    from topomesh.sim.price import grad_probe_records

    # and the probes its gradient adds and a pipeline's gradient scaling are priced with
    # (sim.price.grad_add_s_per_byte, grad_scale_s_per_byte)
    return [e for e in trace.events() if isinstance(e, OpRecord)] + grad_probe_records(trace)


def _profile(records: list[Any], db: OpProfileDB, device: str, fp: str, show: bool,
             max_seconds: float | None) -> ProfileRun:
    if not show:
        return profile_ops(records, db, device=device, fingerprint=fp, max_seconds=max_seconds)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("profile"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), TextColumn("{task.description}"), console=Console(stderr=True)) as bar:
        task = bar.add_task("", total=None)

        def progress(done: int, total: int, op: str) -> None:
            bar.update(task, completed=done, total=total, description=op)

        return profile_ops(records, db, device=device, fingerprint=fp, progress=progress, max_seconds=max_seconds)


def summary_json(run: ProfileRun | None, summary: CostSummary, *, fp: str, db: Path, spec: str) -> dict[str, Any]:
    return {
        "device_fingerprint": fp,
        "db": str(db),
        "roofline_spec": spec,
        "profiled_now": run.profiled if run else 0,
        "left_for_later": run.left if run else 0,
        "cached": run.cached if run else None,
        "distinct": run.distinct if run else None,
        "failed": dict(run.failed) if run else {},
        "ops": summary.ops,
        "measured_s": summary.measured_s,
        "roofline_s": summary.roofline_s,
        "total_s": summary.total_s,
        "unknown": [{"op": u.op, "count": u.count, "roofline_s": u.roofline_s, "reason": u.reason}
                    for u in summary.unknown],
    }


def run(args: argparse.Namespace) -> int:
    import torch

    if args.threads is not None:
        if args.threads < 1:
            raise CalibrationError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CalibrationError(f"--device {args.device}: CUDA is not available on this machine")
    records = _load(args.records) if args.records else _trace_records(args)
    fp = device_fingerprint(args.device)
    if not args.spec and not args.device.startswith("cuda") and not args.json:
        print("pricing unprofiled ops needs this CPU's spec (measured on first use, a few seconds)",
              file=sys.stderr)
    spec = device_spec(args.spec) if args.spec else current_device_spec(args.device)
    with OpProfileDB(args.db) as db:
        run_ = None if args.no_profile else _profile(records, db, args.device, fp, show=not args.json,
                                                     max_seconds=args.max_seconds)
        summary = cost_summary(records, spec, db.table(fp), db.failures(fp))
        data = summary_json(run_, summary, fp=fp, db=db.path, spec=spec.name)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from topomesh.report.text import printable

    console = Console()
    if run_ is not None:
        console.print(f"{fp}: {run_.distinct} distinct ops, {run_.cached} already in {db.path}, "
                      f"{run_.profiled} profiled now in {run_.seconds:.1f} s"
                      + (f", {run_.left} left for a later run (--max-seconds)" if run_.left else ""))
    console.print(f"{summary.ops} ops: measured {summary.measured_s * 1e3:.3f} ms + roofline "
                  f"{summary.roofline_s * 1e3:.3f} ms ({spec.name}) = {summary.total_s * 1e3:.3f} ms")
    if summary.unknown:
        table = Table(title="ops without a measurement (priced by the roofline)")
        for col in ("op", "count", "roofline ms", "reason"):
            table.add_column(col)
        for u in summary.unknown:
            table.add_row(*(Text(printable(c)) for c in (u.op, str(u.count), f"{u.roofline_s * 1e3:.4f}", u.reason)))
        console.print(table)
    for op, why in (run_.failed if run_ else {}).items():
        print(f"could not profile {printable(op)}: {printable(why)}", file=sys.stderr)
    return 0
