"""Launch overhead of `topomesh launch` against plain torchrun.

Each repeat starts two agents (two "nodes" on loopback, c10d rendezvous on a fresh port)
with two workers each running a trivial script, and measures the wall time until both
agents have exited. Plain ``torchrun`` and ``topomesh launch`` (``--topology auto``:
discovery, exchange through the rendezvous store, build, write) alternate, so load drifts
on a shared machine hit both alike. Reported: the median of each and the ratio of medians
(issue 3 target: <= 1.10).

Usage: ``python benchmarks/bench_launch_overhead.py [--repeats 10] [--sysfs DIR] [--json]``
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = "import os\nassert os.environ['WORLD_SIZE'] == '4'\n"
DEFAULT_SYSFS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "sysfs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_job(kind: str, tmp: Path, run: int, sysfs: list[str]) -> float:
    port = free_port()
    launcher = [sys.executable, "-m", "torch.distributed.run"] if kind == "torchrun" else [sys.executable, "-m", "topomesh.launch"]
    script = tmp / "trivial.py"
    procs = []
    t0 = time.perf_counter()
    for node in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp), TOPOMESH_SYSFS_ROOT=sysfs[node])
        cmd = [
            *launcher, "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={kind}-{run}",
            "--log-dir", str(tmp / f"logs-{kind}-{run}-{node}"), "--monitor-interval=0.1", str(script),
        ]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for p in procs:
        _, err = p.communicate(timeout=180)
        if p.returncode != 0:
            raise SystemExit(f"{kind} run {run} failed ({p.returncode}):\n{err.decode()[-2000:]}")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--sysfs", nargs=2, default=[str(DEFAULT_SYSFS / "dgx-h100-8gpu-8ib"), str(DEFAULT_SYSFS / "pcie-4gpu-2numa")],
                   help="TOPOMESH_SYSFS_ROOT of the two nodes (default: two fixture hosts)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    times: dict[str, list[float]] = {"torchrun": [], "topomesh": []}
    with tempfile.TemporaryDirectory(prefix="tm-bench-") as d:
        tmp = Path(d)
        (tmp / "trivial.py").write_text(SCRIPT)
        one_job("torchrun", tmp, -1, a.sysfs)  # warm the page cache for both
        one_job("topomesh", tmp, -1, a.sysfs)
        for i in range(a.repeats):
            order = ("torchrun", "topomesh") if i % 2 == 0 else ("topomesh", "torchrun")
            for kind in order:
                times[kind].append(one_job(kind, tmp, i, a.sysfs))
                print(f"{kind:<9} run {i}: {times[kind][-1]:.2f} s", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {
        "repeats": a.repeats,
        "torchrun_median_s": round(med["torchrun"], 3),
        "topomesh_median_s": round(med["topomesh"], 3),
        "ratio_of_medians": round(med["topomesh"] / med["torchrun"], 3),
        "torchrun_s": [round(t, 3) for t in times["torchrun"]],
        "topomesh_s": [round(t, 3) for t in times["topomesh"]],
        "cpus": os.cpu_count(),
        "load_avg_1min_at_end": round(os.getloadavg()[0], 2),
    }
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k:<22} {v}")
        print(f"target (ratio <= 1.10): {'met' if res['ratio_of_medians'] <= 1.10 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
