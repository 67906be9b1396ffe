"""Benchmark ``topomesh plan``'s search: layouts per second cold (empty trace cache) and warm
(traces cached), wall time, traced classes, simulations, peak memory; and a small space run
both ways (fast path and ``--exhaustive``) to show the same best layout.

    python benchmarks/bench_plan.py                       # the issue's space: llama3-70b, dgx-h100, 16,384 GPUs
    python benchmarks/bench_plan.py --gpus 1024 --fixed tp=8 --workers 2
    python benchmarks/bench_plan.py --small-only

Layouts/s counts the whole space (pruned layouts included) over the wall time of the search.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time


def run(label: str, inputs, **kw) -> object:
    from topomesh.search.run import search

    t0 = time.perf_counter()
    plan = search(inputs, **kw)
    wall = time.perf_counter() - t0
    best = plan.best
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{label}: space {plan.space.size:,}, pruned {plan.pruning.n_pruned:,}, traced classes "
          f"{plan.traced_classes:,}, evaluated {plan.evaluated:,} ({plan.simulated:,} simulations), feasible "
          f"{plan.feasible:,}, failed {sum(plan.failed.values()):,} (classes that could not be traced "
          f"{plan.extra.get('trace_errors', 0)}, retried alone {plan.extra.get('trace_retried', 0)}); wall {wall:.1f} s = "
          f"{plan.space.size / wall:,.0f} layouts/s; peak RSS {rss:,.0f} MB; best "
          f"{best.layout.describe() + ' ' + best.layout.order_text() if best else None}"
          f" {best.result.step_time_s * 1e3 if best else float('nan'):.3f} ms", flush=True)
    for msg, n in sorted(plan.failed.items(), key=lambda kv: -kv[1])[:4]:
        print(f"    failed {n:,}: {msg[:200]}", flush=True)
    return plan


def main() -> int:
    from topomesh.search.evaluate import PlanInputs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-70b")
    p.add_argument("--cluster", default="dgx-h100")
    p.add_argument("--gpus", type=int, default=16384)
    p.add_argument("--global-batch", type=int, default=2048, help="Llama 3: 2,048 × 8,192 tokens (16M)")
    p.add_argument("--strategies", default="dp_replicate,dp_shard,cp,tp,pp,ep")
    p.add_argument("--fixed", default="", metavar="AXIS=N,...")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--small-only", action="store_true")
    p.add_argument("--cache", default=None, metavar="DIR", help="trace cache to use (default: a fresh temporary one)")
    args = p.parse_args()
    fixed = {k: int(v) for k, v in (kv.split("=") for kv in args.fixed.split(",") if kv)}
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache or os.path.join(tmp, "traces")
        os.makedirs(cache, mode=0o700, exist_ok=True)
        if not args.small_only:
            inputs = PlanInputs(model=args.model, cluster=args.cluster, gpus=args.gpus, global_batch=args.global_batch,
                                cache_dir=cache)
            kw = dict(strategies=args.strategies.split(","), fixed=fixed, workers=args.workers)
            run(f"cold  {args.model} {args.cluster} {args.gpus} GPUs", inputs, **kw)
            run(f"warm  {args.model} {args.cluster} {args.gpus} GPUs", inputs, **kw)
        small = PlanInputs(model="llama3-8b", cluster="dgx-h100", gpus=64, global_batch=256, cache_dir=cache)
        kw = dict(strategies=["tp", "pp", "dp_shard", "dp_replicate"], fixed={"tp": 8}, workers=1)
        fast = run("small fast        llama3-8b dgx-h100 64 GPUs", small, **kw)
        exh = run("small --exhaustive llama3-8b dgx-h100 64 GPUs", small, exhaustive=True, **kw)
        same = [(e.index, e.knob, e.result.to_dict()) for e in fast.entries] == [
            (e.index, e.knob, e.result.to_dict()) for e in exh.entries]
        print(f"small: every layout identical between fast and exhaustive: {same}")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
