"""Time to trace a Llama-3-70B-shaped step on one CPU process, and the 80-layer model by reuse.

    python benchmarks/bench_trace.py                 # tp=8, seq 8192 (the preset's)
    python benchmarks/bench_trace.py --seq-len 4096 --layouts tp=8 tp=8,dp_shard=8 --full 4

For each layout it prints: the trace of a one-block model (embedding + 1 block + head,
forward + backward + AdamW step, records converted), the whole 80-layer model via reuse
(that trace, composed to 80 layers, summarized and every record of the step enumerated), the
ratio of the two, and, with ``--full N``, a full trace of N blocks for contrast. Peak RSS
shows that no parameter memory is allocated (one real 70B block in bf16 is 1.7 GB; the
embedding and head 4.2 GB).
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import time

from topomesh.layout.dims import parse_degrees
from topomesh.models.parallelize import make_parallelize
from topomesh.models.presets import get_preset
from topomesh.trace.tracer import trace_step, transformer_spec


def _bench_layout(spec, par, layout: dict[str, int], text: str, args: argparse.Namespace) -> None:  # noqa: ANN001
    n = spec.n_layers

    def one():  # noqa: ANN202
        return trace_step(spec, par, layout, n_layers=1, batch_size=args.batch_size)

    def reuse():  # noqa: ANN202
        t = trace_step(spec, par, layout, n_layers=1, batch_size=args.batch_size).compose(n)
        return t, t.summary(), sum(1 for _ in t.events())

    # Interleaved, so load from other jobs on the machine hits both alike; CPU time of this
    # process is reported next to wall time because it is the steadier of the two.
    walls: dict[str, list[float]] = {"one": [], "reuse": []}
    cpus: dict[str, list[float]] = {"one": [], "reuse": []}
    results: dict[str, object] = {}
    for _ in range(args.repeats):
        for name, fn in (("one", one), ("reuse", reuse)):
            w0, c0 = time.perf_counter(), time.process_time()
            results[name] = fn()
            walls[name].append(time.perf_counter() - w0)
            cpus[name].append(time.process_time() - c0)
    wall = {k: statistics.median(v) for k, v in walls.items()}
    cpu = {k: statistics.median(v) for k, v in cpus.items()}
    one_events = sum(len(s.events) for s in results["one"].segments)
    _, summary, n_events = results["reuse"]
    print(f"  {text:>16}: one block {wall['one']:5.2f} s wall / {cpu['one']:5.2f} s CPU ({one_events} records)"
          f" | {n} layers via reuse {wall['reuse']:5.2f} s wall / {cpu['reuse']:5.2f} s CPU ({n_events} records)"
          f" | ratio {wall['reuse'] / wall['one']:4.2f} wall, {cpu['reuse'] / cpu['one']:4.2f} CPU"
          f" | {summary.flops / 1e15:.3f} PFLOP per rank per step")
    if args.full:
        w0, c0 = time.perf_counter(), time.process_time()
        trace_step(spec, par, layout, n_layers=args.full, batch_size=args.batch_size, split_blocks=False)
        full_w, full_c = time.perf_counter() - w0, time.process_time() - c0
        print(f"  {'':>16}  full trace of {args.full} blocks {full_w:5.2f} s wall / {full_c:5.2f} s CPU"
              f" ({full_c / args.full:.2f} s CPU per block; {n} blocks ~{full_c / args.full * n:.0f} s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-70b")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--layouts", nargs="+", default=["tp=8"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--full", type=int, default=0, metavar="N", help="also trace N blocks in full")
    args = p.parse_args()
    cfg = get_preset(args.model)
    if args.seq_len:
        cfg = dataclasses.replace(cfg, seq_len=args.seq_len)
    spec = transformer_spec(cfg)
    par = make_parallelize()
    print(f"{cfg.name}: hidden {cfg.hidden}, {cfg.n_layers} layers, seq {cfg.seq_len}, "
          f"batch {args.batch_size}, bf16; median of {args.repeats}")
    # warm-up: the first trace in a process pays for imports and dispatch caches
    trace_step(spec, par, parse_degrees(args.layouts[0]), n_layers=1, batch_size=args.batch_size)
    for text in args.layouts:
        _bench_layout(spec, par, parse_degrees(text), text, args)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"  peak RSS {rss_mb:.0f} MB")


if __name__ == "__main__":
    main()
