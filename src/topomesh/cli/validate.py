"""``topomesh validate``: run layouts for real on this machine and compare them with the
simulator's predictions on the ``local`` cluster.

Examples::

    topomesh validate --model benchmarks/validate_llama.json
    topomesh validate --model tiny-llama --seq-len 256 --layouts dp_shard=2 --layouts tp=2 --json
    topomesh validate --model benchmarks/validate_llama.json --png validate.png
    topomesh validate --device cuda --model benchmarks/validate_gpu_llama.json --layouts dp_shard=1 --micro-batch 2

Calibrates what it needs (the gloo collective profile with ``topomesh calibrate``: a sweep
before each pass, fitted with the newest saved ones, or once with ``--no-sweep-each-pass``;
the ops of the layouts' traces once with ``topomesh profile``'s
:func:`~topomesh.cost.ops.profile_ops`, at ``--threads`` threads), predicts each layout, runs it
(``topomesh launch --standalone``,
``--warmup`` steps discarded, the median of ``--steps`` timed steps — of every run's steps
with ``--repeats N``, the layouts run in turn N times — peak memory from the profiler's
allocation records) and prints predicted, measured and error per layout, the
mean and max absolute error and whether the predicted fastest is the measured fastest
(:mod:`topomesh.validate.run`).

``--device cuda`` validates one GPU: a one-rank layout run on it (NCCL, ``torch.cuda``'s
peak), its ops timed there with CUDA events into the op table, the prediction made on the
cluster preset of that GPU (``dgx-h100`` for an H100) with that table; no collective sweep
and no in-step replay (the events time each kernel itself).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

HELP = "Run layouts for real here (gloo on CPU, or one GPU) and compare step time and memory with the simulator's predictions."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from topomesh.sim.inputs import add_model_arguments, add_training_arguments
    from topomesh.validate.run import DEFAULT_LAYOUTS, POOL

    add_model_arguments(p)
    add_training_arguments(p, global_batch_default="2 × micro-batch × the least common multiple of the layouts' "
                                                   "data-parallel degrees, the same for every layout")
    p.add_argument("--layouts", action="append", default=None, metavar="AXIS=N,...",
                   help=f"a layout to run (repeatable; its world is the product of the degrees); "
                        f"default: {' | '.join(DEFAULT_LAYOUTS)}")
    p.add_argument("--steps", type=int, default=8, metavar="N", help="timed steps per layout, median taken (default 8)")
    p.add_argument("--repeats", type=int, default=3, metavar="N",
                   help="real runs per layout, the layouts taken in turn N times, each run after its own in-step "
                        "timing and prediction; all their steps pooled (default 3). Two processes on a small VM "
                        "move ±5-10 %% from one run to the next: this averages a slow spell out")
    p.add_argument("--warmup", type=int, default=2, metavar="N", help="steps discarded first (default 2, at least 2)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch threads per process, in the runs and in the op table (default 1)")
    p.add_argument("--in-step", action=argparse.BooleanOptionalAction, default=True,
                   help="price ops at their times inside the step (each layout's traced step replayed for real), "
                        "not only at their isolated op-table times (default on)")
    p.add_argument("--replays", type=int, default=2, metavar="N",
                   help="processes that replay each layout's step for its in-step op times, one after another, "
                        "their figures averaged (default 2): one replay's step moves by about 4 %% from one "
                        "process to the next")
    p.add_argument("--sweep-each-pass", action=argparse.BooleanOptionalAction, default=True,
                   help="before each pass over the layouts, one more collective sweep, the profile fitted over it "
                        f"and the newest saved ones ({POOL} in all; default on). Off: the saved profile is reused "
                        "(calibrated once when there is none)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the layouts run: cpu (gloo processes sharing this host's cores, predicted on the "
                        "local cluster; default) or cuda (one GPU, a one-rank layout, predicted on the cluster "
                        "preset of that GPU with its ops timed there)")
    p.add_argument("--db", default=None, metavar="FILE",
                   help="op-profile SQLite file the ops are timed into and priced from (default: the shared one)")
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.add_argument("--png", default=None, metavar="FILE", help="predicted against measured step time, one point per layout")


def _layouts(texts: list[str]) -> list[tuple[str, object]]:
    from topomesh.errors import LayoutError
    from topomesh.layout.dims import Axis, Layout, parse_degrees
    from topomesh.validate.worker import NO_CP

    out = []
    for text in texts:
        layout = Layout.from_degrees(parse_degrees(text))
        if layout.degree(Axis.CP) > 1:
            raise LayoutError(f"--layouts {text}: {NO_CP}")
        out.append((text, layout))
    return out


def _oversubscribed(layouts: list[tuple[str, object]], threads: int, cpus: int) -> list[str]:
    """The layouts whose ranks run more torch threads than this host has CPUs, where each has
    more than one: their ops then take turns on the cores, which an op table timed with
    ``threads`` threads on free cores does not describe (measured here, 2 CPUs, ``--threads 2``:
    ``dp_shard=2`` predicted 42 % over its run; one thread a rank on ``N`` ranks is what the
    calibration's compute stretch measures).

    >>> from topomesh.layout.dims import Layout
    >>> lays = [(t, Layout.from_degrees(d)) for t, d in (("dp_shard=1", {"dp_shard": 1}), ("tp=2", {"tp": 2}))]
    >>> _oversubscribed(lays, 2, 2), _oversubscribed(lays, 1, 2), _oversubscribed(lays, 2, 4)
    (['tp=2'], [], [])
    """
    return [text for text, lay in layouts if threads > 1 and lay.world_size * threads > cpus]


def _global_batch(args: argparse.Namespace, layouts: list[tuple[str, object]]) -> int:
    """The same global batch for every layout (so their step times compare): ``--global-batch``,
    else 2 × micro-batch × the least common multiple of the data-parallel degrees."""
    from topomesh.layout.dims import Axis

    if args.global_batch is not None:
        return args.global_batch
    dp = math.lcm(*(lay.degree(Axis.DP_REPLICATE) * lay.degree(Axis.DP_SHARD) for _, lay in layouts))
    return 2 * args.micro_batch * dp


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from topomesh.cli.argtypes import check_outputs
    from topomesh.cost.cluster import LOCAL, load_cluster, local_cluster, preset_for_device
    from topomesh.cost.devices import current_device_spec
    from topomesh.errors import CalibrationError, LayoutError
    from topomesh.sim.inputs import load_model
    from topomesh.sim.price import grad_probe_records, with_fb_host
    from topomesh.sim.schedules import Schedule
    from topomesh.sim.simulate import Simulator, Training, check_model_layout, micro_batches
    from topomesh.topology.discover import allowed_cpus
    from topomesh.trace.cache import TraceCache, default_directory
    from topomesh.trace.graph import OpRecord
    from topomesh.validate.run import (
        DEFAULT_LAYOUTS,
        compare,
        ensure_collectives,
        ensure_ops,
        in_step_tables,
        measure,
        pooled_collectives,
        pooled_result,
        profile_info,
    )

    check_outputs(args, ("png",), plots=("png",))
    for name in ("steps", "threads", "repeats", "replays"):
        if getattr(args, name) < 1:
            raise LayoutError(f"--{name} must be a positive integer, got {getattr(args, name)}.")
    if args.warmup < 2:
        raise LayoutError(f"--warmup must be at least 2 (the first step is not a steady one), got {args.warmup}.")
    torch.set_num_threads(args.threads)  # the op table and the CPU spec are keyed by it
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        raise CalibrationError("--device cuda: CUDA is not available on this machine")
    model = load_model(args.model, seq_len=args.seq_len)
    if model.config is None:
        raise LayoutError(f"--model {args.model}: validate runs built-in transformer configs (a preset or a .json).")
    layouts = _layouts(args.layouts or (["dp_shard=1"] if gpu else list(DEFAULT_LAYOUTS)))
    if gpu and any(lay.world_size != 1 for _, lay in layouts):
        raise LayoutError("--device cuda validates one GPU: give one-rank layouts (e.g. --layouts dp_shard=1); "
                          f"got {', '.join(text for text, lay in layouts if lay.world_size != 1)}")
    gb = _global_batch(args, layouts)
    training = Training(global_batch=gb, micro_batch=args.micro_batch, seq_len=args.seq_len or model.seq_len,
                        dtype=args.dtype, recompute=args.recompute, sequence_parallel=args.sequence_parallel,
                        schedule=Schedule(args.schedule), interleave=args.interleave,
                        mixed_precision=args.mixed_precision)
    for text, lay in layouts:  # before any sweep or run: a layout this model cannot take fails in seconds
        try:
            check_model_layout(model.config, lay, training)
            micro_batches(lay, training)
        except LayoutError as e:
            raise LayoutError(f"--layouts {text}: {e}") from None
    err = Console(stderr=True)
    cpus = len(allowed_cpus())
    over = [] if gpu else _oversubscribed(layouts, args.threads, cpus)
    if over:
        print(f"topomesh: {', '.join(over)}: {args.threads} threads a rank exceed this host's "
              f"{cpus} CPUs; the op table times ops on free cores, so these predictions "
              "run high (one thread a rank is what validate is calibrated for)", file=sys.stderr)
    cache = TraceCache(default_directory())
    worlds = sorted({lay.world_size for _, lay in layouts})
    cluster_name = preset_for_device(current_device_spec(args.device)) if gpu else LOCAL
    # a GPU's one rank has no collective to sweep, and its ops are timed as kernels: no replay
    sweep_each_pass, in_step_on = args.sweep_each_pass and not gpu, args.in_step and not gpu

    failed_sweeps: list[str] = []  # a pass's sweep that failed: the error (that pass priced with the saved profile)

    def collectives(tag: str) -> tuple[dict, dict]:
        """The collective profile (one more sweep pooled with the saved ones, or the saved one
        reused) and the local cluster of every world priced with it; on a GPU its preset's
        cluster of one rank, which has no collective to price."""
        if gpu:
            return {}, {1: load_cluster(cluster_name, gpus=1)}
        if sweep_each_pass:  # between the passes' runs
            try:
                with err.status(f"{tag}collective sweep ({max(worlds)} processes), pooled with the saved ones"):
                    path = pooled_collectives(max(worlds))
            except CalibrationError as e:  # the passes run so far are not lost to one failed sweep
                failed_sweeps.append(f"{tag}{e}")
                print(f"topomesh: {tag}the collective sweep failed ({e}); priced with the saved profile",
                      file=sys.stderr)
                with err.status("collective profile (the saved one, else calibrated once)"):
                    path = ensure_collectives(max(worlds))
        else:
            with err.status("collective profile (calibrated once, then reused)"):
                path = ensure_collectives(max(worlds))
        return profile_info(path), {w: local_cluster(gpus=w) for w in worlds}

    tag = f"run 1/{args.repeats}: " if args.repeats > 1 else ""
    profile, clusters = collectives(tag)
    records: list[OpRecord] = []
    traces = {}
    for text, lay in layouts:
        with err.status(f"tracing {model.spec.name} under {text}"):
            trace = Simulator(model=model, cluster=clusters[lay.world_size], cache=cache).trace(lay, training)
        full = traces[text] = trace.compose(model.spec.n_layers) if model.spec.n_layers > trace.traced_layers else trace
        records += [e for e in full.events() if isinstance(e, OpRecord)]
        records += grad_probe_records(trace)  # what its gradient adds and scaling are priced with
    with err.status("op table (ops not yet measured at this thread count)") as status:
        table = ensure_ops(records, progress=lambda d, n, op: status.update(f"profiling ops {d}/{n}: {op}"),
                           device=args.device, db=args.db)
    passes: dict[str, list] = {text: [] for text, _ in layouts}
    for n in range(args.repeats):  # the layouts in turn: a slow spell of the VM falls on all of them
        tag = f"run {n + 1}/{args.repeats}: " if args.repeats > 1 else ""
        if n and sweep_each_pass:
            profile, clusters = collectives(tag)
        for text, lay in layouts:
            step = None
            if in_step_on:  # just before the real run: this VM's speed drifts over minutes
                # ranks beyond the CPUs run their ops among each other's: as many replays at once
                copies = lay.world_size if lay.world_size * args.threads > cpus else 1
                with err.status(f"{tag}timing {text}'s ops inside its step (its traced step replayed"
                                f"{f', {copies} at once' if copies > 1 else ''})"):
                    step = in_step_tables(args.model, args.seq_len, [(text, lay)], training,
                                          threads=args.threads, copies=copies, replays=args.replays).get(text)
            cluster = clusters[lay.world_size]
            if step is not None and step.host_fb_s is not None:  # its eager step's host work beyond the replay
                cluster = with_fb_host(cluster, traces[text], step.host_fb_s)
            # one simulator per layout: op times are memoized per simulator, and each layout has its own
            sim = Simulator(model=model, cluster=cluster, cache=cache,
                            table={**table, **(step.table if step is not None else {})})
            predicted = sim.simulate(lay, training)
            with err.status(f"{tag}running {text} for real ({lay.world_size} processes, {args.steps} steps)"):
                record = measure(args.model, args.seq_len, lay, training, steps=args.steps, warmup=args.warmup,
                                 threads=args.threads, device=args.device)
            passes[text].append((predicted, record))
    results = [pooled_result(text, passes[text]) for text, _ in layouts]
    report = compare(results)
    ran_on = next(rec.get("device", args.device) for runs in passes.values() for _, rec in runs)
    report.update({"model": model.spec.name, "device": ran_on,
                   "cluster": cluster_name, "global_batch": gb, "threads": args.threads, "steps": args.steps,
                   "warmup": args.warmup, "repeats": args.repeats, "cpus": cpus,
                   "replays": args.replays if in_step_on else 0,
                   "collective_profile": profile, "failed_sweeps": failed_sweeps,
                   "loadavg_range": [min(x for r in results for x in r.loadavg or (0,)),
                                     max(x for r in results for x in r.loadavg or (0,))]})
    if args.json:  # the report before the picture: a picture that fails loses no measurement
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print(report)
    if args.png:
        from topomesh.validate.plot import save_validation_png

        save_validation_png(results, args.png)
    return 0


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report['model']}: predicted ({report.get('cluster', 'local')} cluster) vs measured "
                        f"on {report.get('device', 'cpu')}, global batch "
                        f"{report['global_batch']}, {report['threads']} thread(s) per process")
    runs = any(len(r.get("measured_runs_s") or ()) > 1 for r in report["layouts"])
    for col in ("layout", "ranks", "predicted ms", "measured ms", "error", *(("runs' medians ms",) if runs else ()),
                "step IQR", "CPU ms", "core wait ms", "pred. peak MB", "meas. peak MB", "mem error", "load"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for r in report["layouts"]:
        each = ("/".join(f"{x * 1e3:.0f}" for x in r.get("measured_runs_s") or ()),) if runs else ()
        table.add_row(r["layout"], str(r["world_size"]), f"{r['predicted_s'] * 1e3:.1f}", f"{r['measured_s'] * 1e3:.1f}",
                      f"{r['error'] * 100:+.1f}%", *each,
                      "-" if r.get("measured_spread") is None else f"{r['measured_spread'] * 100:.1f}%",
                      f"{r['measured_cpu_s'] * 1e3:.1f}", f"{r.get('core_wait_s', 0.0) * 1e3:.1f}",
                      f"{r['predicted_peak_bytes'] / 1e6:.1f}",
                      f"{r['measured_peak_bytes'] / 1e6:.1f}", f"{r['memory_error'] * 100:+.1f}%",
                      "/".join(f"{x:.1f}" for x in r["loadavg"]))
    console = Console()
    console.print(table)
    console.print(f"step time: mean |error| {report['mean_abs_error'] * 100:.1f}%, max {report['max_abs_error'] * 100:.1f}%; "
                  f"fastest predicted {report['fastest_predicted']}, measured {report['fastest_measured']} "
                  f"({'agree' if report['fastest_correct'] else 'DISAGREE'}); peak memory max |error| "
                  f"{report['max_abs_memory_error'] * 100:.1f}%", highlight=False)
    if report.get("mean_runs_spread") is not None:
        console.print(f"the real runs of a layout lay {report['mean_runs_spread'] * 100:.1f}% apart on average "
                      "(largest - smallest run's median step, over their median): an error below that is "
                      "no more than this host's own run-to-run noise", highlight=False)
    prof = report.get("collective_profile") or {}
    if prof:
        age = "" if prof.get("age_h") is None else f", {prof['age_h']:.1f} h before this run"
        sweeps = f", fitted over {prof['sweeps']} sweeps" if prof.get("sweeps", 1) > 1 else ""
        console.print(f"collectives priced from {prof['path']} (calibrated {prof.get('measured_at')}{age}{sweeps}); "
                      "ops timed in each layout's replayed step just before its run", highlight=False)
