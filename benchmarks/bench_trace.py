"""Time to trace a Llama-3-70B-shaped step on one CPU process, and the 80-layer model by reuse.

    python benchmarks/bench_trace.py                 # tp=8, seq 8192 (the preset's)
    python benchmarks/bench_trace.py --seq-len 4096 --layouts tp=8 tp=8,dp_shard=8 --full 8

For each layout it prints: the trace of a one-block model (embedding + 1 block + head,
forward + backward + AdamW step, records converted), the whole 80-layer model via reuse
(that trace, composed to 80 layers, summarized and every record of the step enumerated), the
ratio of the two, and, with ``--full N``, a full trace of N blocks for contrast. Peak RSS shows that no
parameter memory is allocated (one real 70B block in bf16 would be 1.7 GB).
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import time

from topomesh.models.parallelize import make_parallelize
from topomesh.models.presets import get_preset
from topomesh.trace.tracer import trace_step, transformer_spec


def _layout(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}


def _timed(fn, repeats: int) -> tuple[float, object]:  # noqa: ANN001
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _bench_layout(spec, par, layout: dict[str, int], text: str, args: argparse.Namespace) -> None:  # noqa: ANN001
    n = spec.n_layers
    one_s, one = _timed(lambda: trace_step(spec, par, layout, n_layers=1, batch_size=args.batch_size), args.repeats)

    def reuse():  # noqa: ANN202
        t = trace_step(spec, par, layout, n_layers=1, batch_size=args.batch_size).compose(n)
        return t, t.summary(), sum(1 for _ in t.events())

    whole_s, (_, summary, n_events) = _timed(reuse, args.repeats)
    one_events = sum(len(s.events) for s in one.segments)
    print(f"  {text:>18}: one block {one_s:6.2f} s ({one_events} records) | "
          f"{n} layers via reuse {whole_s:6.2f} s ({n_events} records) | ratio {whole_s / one_s:4.2f} | "
          f"{summary.flops / 1e15:.3f} PFLOP per rank per step")
    if args.full:
        full_s, _ = _timed(lambda: trace_step(spec, par, layout, n_layers=args.full,
                                              batch_size=args.batch_size, split_blocks=False), 1)
        print(f"  {'':>18}  full trace of {args.full} blocks {full_s:6.2f} s "
              f"({full_s / args.full:.2f} s per block; {n} blocks would take ~{full_s / args.full * n:.0f} s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-70b")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--layouts", nargs="+", default=["tp=8"])
    p.add_argument("--repeats", type=int, default=3)
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
    trace_step(spec, par, _layout(args.layouts[0]), n_layers=1, batch_size=args.batch_size)
    for text in args.layouts:
        _bench_layout(spec, par, _layout(text), text, args)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"  peak RSS {rss_mb:.0f} MB")


if __name__ == "__main__":
    main()
