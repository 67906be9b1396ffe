"""Time a one-node collective calibration (default sweep: 6 collectives, 1 KiB .. 64 MiB) and
print the held-out fit error of every fitted model.

    python benchmarks/bench_calibrate.py [--nproc 2] [--runs 1]

Wall time includes starting the worker processes (importing torch), which on a loaded
2-core machine is several seconds of the total.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from topomesh.cost.calibrate import spawn_local


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--runs", type=int, default=1)
    args = p.parse_args()
    walls, sweeps = [], []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            result = spawn_local(args.nproc, ["--output", str(Path(tmp) / "p.json"), "--no-progress"])
            walls.append(time.perf_counter() - t0)
            sweeps.append(result["sweep_seconds"])
        print(f"run {run}: wall {walls[-1]:.1f} s, sweep (init + measure + fit) {sweeps[-1]:.1f} s")
        for m in result["models"]:
            fe = m["fit_error"]
            alts = ", ".join(f"{k} {v * 100:.1f}%" for k, v in fe["alternatives"].items())
            terms = "; ".join(f"alpha {t['alpha_us']:.0f} us, busbw {t['busbw_GBps']:.2f} GB/s"
                              + (f" up to {t['upto_bytes']} B" if t["upto_bytes"] else "") for t in m["terms"])
            print(f"  {m['collective']:>14} {m['link']:<4} {m['model']:<10} held-out err mean "
                  f"{fe['mean_rel'] * 100:5.1f}% max {fe['max_rel'] * 100:5.1f}% ({alts}) | {terms}")
    print(f"median wall {statistics.median(walls):.1f} s, median sweep {statistics.median(sweeps):.1f} s "
          f"over {args.runs} run(s), {args.nproc} processes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
