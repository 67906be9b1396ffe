"""``topomesh calibrate``: measure collectives on this cluster, fit, save a profile.

Three ways to run it:

* ``topomesh calibrate --local N`` spawns N gloo (or NCCL) processes on this host;
* under a launcher (``torchrun ... -m topomesh.cost.calibrate`` or
  ``topomesh launch ... -m topomesh.cost.calibrate``), every rank runs the sweep;
* ``topomesh calibrate --show NAME|FILE`` prints a saved or built-in profile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from topomesh.cli.argtypes import MAX_RANKS_PER_HOST, bounded_int, positive_seconds
from topomesh.cost.calibrate import (
    add_sweep_arguments,
    config_from_args,
    profile_directory,
    spawn_local,
    worker,
)
from topomesh.cost.collectives import builtin_profile, builtin_profile_names, load_profile
from topomesh.errors import CalibrationError

HELP = "Measure this cluster's collectives over message and group sizes, fit cost models, save a profile."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--local", type=bounded_int(1, MAX_RANKS_PER_HOST), metavar="N", default=None,
                   help="spawn N local worker processes (one node, loopback) instead of running under a launcher")
    p.add_argument("--show", metavar="PROFILE", default=None,
                   help=f"print a profile: a JSON file or a built-in name ({', '.join(builtin_profile_names())})")
    p.add_argument("--timeout", type=positive_seconds, default=600.0, help="seconds before --local workers are stopped")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_sweep_arguments(p)


def _worker_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes), "--factor", str(args.factor),
            "--collectives", args.collectives, "--max-repeats", str(args.max_repeats), "--backend", args.backend,
            "--pool", str(args.pool)]
    if args.max_group:
        argv += ["--max-group", str(args.max_group)]
    if args.output:
        argv += ["--output", str(Path(args.output).resolve())]
    if args.no_progress or args.json:
        argv.append("--no-progress")
    return argv


def _model_rows(models: list[dict[str, Any]]) -> list[list[str]]:
    """One row per model, then one per group size fitted alone (``by_group``), named ``n=N``."""
    rows = []
    for m in models:
        rows.append(_model_row(m, ""))
        rows += [_model_row(g, f" n={g['group_size']}") for g in m.get("by_group") or ()]
    return rows


def _model_row(m: dict[str, Any], suffix: str) -> list[str]:
    fe = m.get("fit_error") or {}
    terms = m["terms"]
    alpha = " / ".join(f"{t['alpha_us']:.1f}" for t in terms)
    bw = " / ".join("link" if t["busbw_GBps"] is None else f"{t['busbw_GBps'] * t['bw_scale']:.3g}" for t in terms)
    err = f"{fe['mean_rel'] * 100:.1f}% / {fe['max_rel'] * 100:.1f}%" if fe else "-"
    pts = f"{fe['train_points']}+{fe['heldout_points']}" if fe else "-"
    return [m["collective"], m["link"], m["model"] + suffix, alpha, bw, err, pts]


def _print_table(title: str, models: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("collective", "link", "model", "alpha us", "busbw GB/s", "held-out err mean/max", "fit+held"):
        table.add_column(col)
    for row in _model_rows(models):
        table.add_row(*row)
    Console().print(table)


def run(args: argparse.Namespace) -> int:
    if args.show:
        if args.show in builtin_profile_names():
            prof = builtin_profile(args.show)
        elif Path(args.show).is_file():
            prof = load_profile(args.show)
        else:
            raise CalibrationError(
                f"--show {args.show!r} is neither a file nor a built-in profile ({', '.join(builtin_profile_names())})"
            )
        data = prof.to_dict()
        if args.json:
            print(json.dumps(data, indent=2))
        else:
            _print_table(f"{prof.name} ({prof.backend}): {prof.source}", data["models"])
        return 0
    config_from_args(args)  # bad sweep options fail here, before any process starts
    if args.output is None:
        profile_directory()  # and a cache directory we may not use
    if args.local is not None:
        result = spawn_local(args.local, _worker_argv(args), timeout_s=args.timeout)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        result = worker(args)
        if result is None:  # not rank 0
            return 0
    else:
        raise CalibrationError(
            "not started by a launcher (RANK/WORLD_SIZE unset): use `topomesh calibrate --local N` for one "
            "node, or `torchrun ... -m topomesh.cost.calibrate` / `topomesh launch ... -m topomesh.cost.calibrate`"
        )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(f"calibrated profile {result['cluster_fingerprint']}", result["models"])
        pooled = f", fitted over {result['sweeps']} sweeps" if result.get("sweeps", 1) > 1 else ""
        print(f"profile: {result['profile']}  (sweep {result['sweep_seconds']:.1f} s{pooled})", file=sys.stderr)
        if result.get("not_pooled"):
            print(f"not pooled with the saved profile: {result['not_pooled']}", file=sys.stderr)
        for key, why in result.get("skipped", {}).items():
            print(f"not fitted: {key}: {why}", file=sys.stderr)
    return 0
