"""``topomesh trace``: trace a built-in model's training step under a layout, on this CPU.

Example::

    topomesh trace llama3-70b --tp 8 --dp-shard 4 --seq-len 4096
    topomesh trace tiny-llama --tp 2 --dp-shard 2 --json

The model is traced with one block and composed to its full depth (``--full`` traces
every block instead). Prints ops by kind, FLOPs per phase, collectives by kind / mesh axis /
phase with bytes per step on one rank, and ops the cost model does not know. ``--gpu-kernels``
traces the step a GPU runs where a CPU build decomposes an op (:mod:`topomesh.trace.kernels`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from topomesh.cli.argtypes import MAX_BATCH, MAX_SEQ_LEN, bounded_int
from topomesh.errors import LayoutError
from topomesh.layout.dims import MAX_DEGREE, merge_degrees, parse_degrees

HELP = "Trace a model's training step under a layout (fake tensors, one CPU process): ops, FLOPs, collectives."

_AXES = ("dp_replicate", "dp_shard", "cp", "ep", "tp", "pp")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from topomesh.models.parallelize import Checkpointing
    from topomesh.models.presets import PRESETS

    p.add_argument("model", metavar="MODEL_PRESET", help=f"one of: {', '.join(PRESETS)}")
    for axis in _AXES:
        p.add_argument(f"--{axis.replace('_', '-')}", dest=axis, type=bounded_int(1, MAX_DEGREE), default=1, metavar="N",
                       help=f"degree of the {axis} mesh axis (default 1)")
    p.add_argument("--layout", default=None, metavar="AXIS=N,...",
                   help="the degrees as one spec, e.g. tp=8,dp_shard=8 (same as the flags)")
    p.add_argument("--batch-size", type=bounded_int(1, MAX_BATCH), default=1, help="micro-batch size per data-parallel rank")
    p.add_argument("--seq-len", type=bounded_int(1, MAX_SEQ_LEN), default=None,
                   help="sequence length (default: the preset's)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16",
                   help="compute dtype (and the parameters' dtype without --mixed-precision)")
    p.add_argument("--mixed-precision", action="store_true",
                   help="FSDP2 mixed precision: float32 master weights and optimizer, parameters "
                        "gathered in --dtype, gradients reduced in float32 (needs a dp/cp axis)")
    p.add_argument("--no-sp", action="store_true", help="tensor parallel without sequence parallel")
    p.add_argument("--checkpointing", choices=[c.value for c in Checkpointing], default="none")
    p.add_argument("--no-optimizer", action="store_true", help="trace forward and backward only")
    p.add_argument("--full", action="store_true", help="trace every block instead of composing from one")
    p.add_argument("--gpu-kernels", action="store_true",
                   help="trace the step as a GPU runs it (fused RMSNorm), as simulate and plan do for GPU clusters")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from topomesh.models.parallelize import Checkpointing, ParallelOptions, make_parallelize
    from topomesh.models.presets import get_preset
    from topomesh.trace.tracer import default_optimizer, trace_step, transformer_spec

    cfg = get_preset(args.model)
    if args.seq_len is not None:
        if args.seq_len <= 0:
            raise LayoutError(f"--seq-len must be positive, got {args.seq_len}.")
        cfg = dataclasses.replace(cfg, seq_len=args.seq_len)
    if args.batch_size <= 0:
        raise LayoutError(f"--batch-size must be positive, got {args.batch_size}.")
    layout = {a: getattr(args, a) for a in _AXES if getattr(args, a) != 1}
    if args.layout:
        layout = merge_degrees(layout, parse_degrees(args.layout))
    _check_model_layout(cfg, layout)  # degrees are >= 1: the flags' type and parse_degrees check that
    compute = _DTYPES[args.dtype]
    mixed = {"param_dtype": compute, "reduce_dtype": torch.float32} if args.mixed_precision else {}
    options = ParallelOptions(sequence_parallel=not args.no_sp, checkpointing=Checkpointing(args.checkpointing),
                              **mixed)
    spec = transformer_spec(cfg)
    traced = cfg.n_layers if args.full else 1
    err = Console(stderr=True)
    with err.status(f"tracing {cfg.name} ({traced} of {cfg.n_layers} blocks) under {layout or 'one rank'}"):
        trace = trace_step(
            spec, make_parallelize(options), layout, n_layers=traced, batch_size=args.batch_size,
            dtype=torch.float32 if args.mixed_precision else compute,
            optimizer=None if args.no_optimizer else default_optimizer,
            split_blocks=not args.full, gpu_kernels=args.gpu_kernels,
        )
    if not args.full and cfg.n_layers > traced:
        trace = trace.compose(cfg.n_layers)
    err.print(f"traced in {trace.trace_s:.2f} s", highlight=False)
    summary = trace.summary()
    doc = {
        "model": cfg.name,
        "layout": dict(trace.layout),
        "pp": args.pp,
        "world_size": trace.world_size * args.pp,
        "batch_size": args.batch_size,
        "seq_len": cfg.seq_len,
        "dtype": args.dtype,
        "mixed_precision": args.mixed_precision,
        "n_layers": trace.n_layers,
        "traced_layers": trace.traced_layers,
        "trace_s": round(trace.trace_s, 4),
        **summary.to_json(),
        "ops_by_kind": _by_kind(summary),
    }
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    _print(doc)
    return 0


def _check_model_layout(cfg: object, layout: dict[str, int]) -> None:
    """Degrees the model cannot take, refused before tracing: expert parallelism on a dense
    model (it would trace a plain replica and report ep groups that do nothing), and more
    pipeline stages than layers."""
    ep, pp = layout.get("ep", 1), layout.get("pp", 1)
    if ep > 1 and not cfg.n_experts:
        raise LayoutError(f"ep={ep} needs a mixture-of-experts model; {cfg.name} is dense.")
    if ep > 1 and cfg.n_experts % ep:
        raise LayoutError(f"ep={ep} does not divide the {cfg.n_experts} experts of {cfg.name}.")
    if pp > cfg.n_layers:
        raise LayoutError(f"pp={pp} pipeline stages need at least as many layers; {cfg.name} has {cfg.n_layers}.")


def _by_kind(summary: object) -> dict[str, dict[str, int]]:
    from topomesh.trace.convert import op_kind

    out: dict[str, dict[str, int]] = {}
    for op, n in summary.op_counts.items():
        k = out.setdefault(op_kind(op).value, {"count": 0, "flops": 0, "bytes": 0})
        k["count"] += n
        k["flops"] += summary.op_flops.get(op, 0)
        k["bytes"] += summary.op_bytes.get(op, 0)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["count"]))


def _print(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console()
    out.print(
        f"[bold]{doc['model']}[/] layout {doc['layout'] or '{}'} (pp {doc['pp']}, world {doc['world_size']}), "
        f"batch {doc['batch_size']} × seq {doc['seq_len']}, {doc['dtype']}"
        f"{' over float32 master weights' if doc['mixed_precision'] else ''}, "
        f"{doc['n_layers']} layers from {doc['traced_layers']} traced; one rank, one step"
    )
    t = Table(title="FLOPs (local shapes)")
    t.add_column("phase")
    t.add_column("TFLOP", justify="right")
    for phase, f in doc["flops_by_phase"].items():
        t.add_row(phase, f"{f / 1e12:.4g}")
    t.add_row("total", f"{doc['flops'] / 1e12:.4g}")
    out.print(t)
    t = Table(title="Collectives per step")
    for c in ("kind", "mesh axis", "phase", "count"):
        t.add_column(c)
    t.add_column("MiB", justify="right")
    for c in doc["collectives"]:
        t.add_row(c["kind"], c["mesh_axis"], c["phase"], str(c["count"]), f"{c['bytes'] / 2**20:.4g}")
    out.print(t)
    t = Table(title="Ops by kind")
    for c in ("kind", "count", "TFLOP", "GiB moved"):
        t.add_column(c, justify="left" if c == "kind" else "right")
    for kind, k in doc["ops_by_kind"].items():
        t.add_row(kind, str(k["count"]), f"{k['flops'] / 1e12:.4g}", f"{k['bytes'] / 2**30:.4g}")
    out.print(t)
    t = Table(title="Ops (top 15 by count)")
    t.add_column("op")
    t.add_column("count", justify="right")
    for op, n in sorted(doc["op_counts"].items(), key=lambda kv: -kv[1])[:15]:
        t.add_row(op, str(n))
    out.print(t)
    if doc["unknown_ops"]:
        out.print("[yellow]ops the cost model does not know:[/] " + ", ".join(f"{k} ×{v}" for k, v in doc["unknown_ops"].items()))
    else:
        out.print("no unknown ops")
