"""Simulated steps of the presets at usual layouts, and what one simulation costs.

    python benchmarks/bench_simulate.py            # every case below
    python benchmarks/bench_simulate.py --quick    # the first two cases

For each case it prints the predicted step time, tokens/s, MFU, peak memory per GPU and the
largest parts of the breakdown, then the time one simulation takes: cold (an empty trace
cache: the layout class is traced on this CPU first) and warm (class traced, median of
repeats). These are predictions, not measurements of the runs; nothing here is compared
with, or fitted to, published training step times.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time

from topomesh.cost.cluster import load_cluster
from topomesh.layout.dims import Layout
from topomesh.models.presets import get_preset
from topomesh.sim.simulate import Simulator, Training, builtin_model
from topomesh.trace.cache import TraceCache

# (model, cluster, gpus, layout, training)
CASES = [
    ("llama3-8b", "dgx-h100", 8, Layout(dp_shard=8), Training(global_batch=32, micro_batch=1, recompute="selective")),
    ("gpt-22b", "dgx-a100-80gb", 64, Layout(tp=8, dp_shard=8), Training(global_batch=256, micro_batch=4)),
    ("llama3-70b", "dgx-h100", 256, Layout(tp=8, pp=4, dp_shard=8),
     Training(global_batch=256, micro_batch=1, schedule="interleaved-1f1b", interleave=2, recompute="selective")),
    ("gpt-175b", "dgx-a100-80gb", 1024, Layout(tp=8, pp=8, dp_shard=16),
     Training(global_batch=1536, micro_batch=1, schedule="interleaved-1f1b", interleave=2, recompute="selective")),
    ("mixtral-8x7b", "dgx-h100", 64, Layout(ep=8, dp_shard=8), Training(global_batch=256, micro_batch=1)),
    ("llama3-405b", "dgx-h100", 2048, Layout(tp=8, pp=16, dp_shard=16),
     Training(global_batch=2048, micro_batch=1, schedule="1f1b", recompute="full")),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="the first two cases only")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"{'model':14} {'cluster':14} {'gpus':>5} {'layout':28} {'step s':>8} {'tok/s':>11} {'MFU':>6} "
          f"{'peak GB':>8} {'cold s':>7} {'warm ms':>8}  largest parts")
    for name, cluster_name, gpus, layout, training in CASES[: 2 if args.quick else None]:
        with tempfile.TemporaryDirectory() as tmp:
            cluster = load_cluster(cluster_name, gpus=gpus)
            sim = Simulator(model=builtin_model(get_preset(name)), cluster=cluster, cache=TraceCache(tmp))
            t0 = time.perf_counter()
            r = sim.simulate(layout, training)
            cold = time.perf_counter() - t0
            warm = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                sim.simulate(layout, training)
                warm.append(time.perf_counter() - t0)
        b = r.breakdown
        parts = {"compute": b.compute_s, "bubble": b.bubble_s, "p2p": b.p2p_s, "optimizer": b.optimizer_s,
                 **{f"comm {k}": v for k, v in b.exposed_comm_s.items()}}
        top = ", ".join(f"{k} {v / r.step_time_s:.0%}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:3])
        sched = f" {training.schedule.value}" + (f"×{training.interleave}" if training.interleave > 1 else "") \
            if layout.pp > 1 else ""
        print(f"{name:14} {cluster_name:14} {gpus:>5} {layout.describe() + sched:28} {r.step_time_s:8.3f} "
              f"{r.tokens_per_s:11,.0f} {r.mfu:6.1%} {r.peak_memory_bytes / 1e9:8.1f} {cold:7.2f} "
              f"{statistics.median(warm) * 1e3:8.2f}  {top}{'' if r.feasible else '  INFEASIBLE: ' + r.reason}")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak_mb:.0f} MB")


if __name__ == "__main__":
    main()
