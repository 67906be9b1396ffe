"""Time enumerating and pruning the layout space of a model on a large world.

    python benchmarks/bench_space.py [--model llama3-70b] [--gpus 16384] [--repeats 5]

Six strategies by default (1,554,156 layouts on 16,384 GPUs). The device is the H100 SXM5
80 GB datasheet spec; the global batch defaults to 2,048 sequences of 8,192 tokens (16M
tokens, the final batch of Llama 3 405B pre-training, arXiv:2407.21783 §3.4.1). Prints median
wall times for the enumeration, the per-layout (row, permutation) index arrays and pruning,
first with the knobs fixed (micro-batch 1, no recompute, 1F1B), then with micro-batch,
recompute and schedule/interleave searched as well.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from topomesh.cost.devices import device_spec
from topomesh.models.presets import get_preset
from topomesh.search.prune import PruneSetup, prune
from topomesh.search.space import KnobTable, enumerate_space


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def run(world: int, setup: PruneSetup, knobs: KnobTable, repeats: int, label: str) -> None:
    t_enum, space = timed(lambda: enumerate_space(world, knobs=knobs), repeats)
    t_index, _ = timed(space.layout_index, repeats)
    t_prune, res = timed(lambda: prune(space, setup), repeats)
    print(f"{label}: {space.n_layouts:,} layouts x {len(knobs)} knob rows = {space.size:,}")
    print(f"  enumerate {t_enum * 1e3:.1f} ms ({len(space.degrees):,} degree rows), "
          f"index arrays {t_index * 1e3:.1f} ms, prune {t_prune * 1e3:.1f} ms")
    pruned = ", ".join(f"{r} {n:,}" for r, n in res.pruned.items() if n)
    print(f"  kept {res.kept:,}; pruned {res.n_pruned:,} ({pruned})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--gpus", type=int, default=16_384)
    ap.add_argument("--device", default="H100-SXM5-80GB")
    ap.add_argument("--global-batch", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cfg = get_preset(args.model)
    setup = PruneSetup(
        model=cfg, global_batch=args.global_batch, device_memory_bytes=device_spec(args.device).memory_bytes
    )
    print(f"{cfg.name} on {args.gpus:,} x {args.device}, global batch {args.global_batch}, "
          f"median of {args.repeats}")
    run(args.gpus, setup, KnobTable.product(), args.repeats, "fixed knobs")
    searched = KnobTable.product(
        micro_batch=divisors(args.global_batch),
        recompute=("none", "selective", "full"),
        schedule=("gpipe", "1f1b", "interleaved-1f1b"),
        interleave=divisors(cfg.n_layers),
    )
    run(args.gpus, setup, searched, args.repeats, "micro-batch, recompute, schedule searched")


if __name__ == "__main__":
    main()
