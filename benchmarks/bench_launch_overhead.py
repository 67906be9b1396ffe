"""Launch overhead of `topomesh launch` against plain torchrun.

Each repeat starts two agents (two "nodes" on loopback, c10d rendezvous on a fresh port)
with two workers each running a trivial script, and measures the wall time until both
agents have exited. Plain ``torchrun`` and ``topomesh launch`` (``--topology auto``:
discovery, exchange through the rendezvous store, build, write) alternate, so load drifts
on a shared machine hit both alike. Reported: the median of each and the ratio of medians
(issue 3 target: <= 1.10).

Because whole jobs are dominated by process start-up (and, on a shared machine, by other
load), the script also times the topology step alone: two ``TopologyAgent`` objects in two
threads run the per-round code (discover once, publish, lead, fetch, build, write) over a
real loopback ``TCPStore``, once per fresh round prefix, and the median per round is shown.

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


def topology_step_s(rounds: int, sysfs: list[str], tmp: Path) -> list[float]:
    """Wall time of the agents' per-round topology step, two agents in two threads."""
    import threading
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from topomesh.launch.agent import TopologyAgent, TopologyOptions
    from topomesh.topology.discover import discover_host

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
    agents = []
    for node, store in enumerate((server, client)):
        agent = TopologyAgent.__new__(TopologyAgent)  # no torchrun spec: only the topology step
        agent._topology = TopologyOptions(directory=str(tmp / "step"))
        agent._host = discover_host(sysfs[node])  # discovery runs once per agent, not per round
        agent._rounds = 0
        agent._remaining_restarts = 0
        agents.append((agent, store))
    handler = SimpleNamespace(get_run_id=lambda: "bench", get_backend=lambda: "c10d")
    spec = SimpleNamespace(rdzv_handler=handler, local_world_size=2, max_restarts=0)
    out = []
    for r in range(rounds):
        done: list[float] = [0.0, 0.0]

        def one(node: int, r: int = r, done: list[float] = done) -> None:
            agent, store = agents[node]
            wg = SimpleNamespace(
                spec=spec, store=dist.PrefixStore(f"round{r}", store), group_rank=node, group_world_size=2,
                master_addr="127.0.0.1",
                workers=[SimpleNamespace(global_rank=node * 2 + i, local_rank=i, world_size=4) for i in range(2)],
            )
            t0 = time.perf_counter()
            agent._round_file(wg)
            done[node] = time.perf_counter() - t0

        threads = [threading.Thread(target=one, args=(n,)) for n in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out.append(max(done))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--sysfs", nargs=2, default=[str(DEFAULT_SYSFS / "dgx-h100-8gpu-8ib"), str(DEFAULT_SYSFS / "pcie-4gpu-2numa")],
                   help="TOPOMESH_SYSFS_ROOT of the two nodes (default: two fixture hosts)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--step-only", action="store_true", help="only time the in-agent topology step")
    a = p.parse_args(argv)
    if a.step_only:
        with tempfile.TemporaryDirectory(prefix="tm-bench-") as d:
            step = topology_step_s(max(20, a.repeats), a.sysfs, Path(d))
        print(json.dumps({"topology_step_median_s": round(statistics.median(step), 4),
                          "topology_step_max_s": round(max(step), 4), "rounds": len(step)}))
        return 0
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
        step = topology_step_s(max(20, a.repeats), a.sysfs, tmp)
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {
        "repeats": a.repeats,
        "torchrun_median_s": round(med["torchrun"], 3),
        "topomesh_median_s": round(med["topomesh"], 3),
        "ratio_of_medians": round(med["topomesh"] / med["torchrun"], 3),
        "torchrun_s": [round(t, 3) for t in times["torchrun"]],
        "topomesh_s": [round(t, 3) for t in times["topomesh"]],
        "topology_step_median_s": round(statistics.median(step), 4),
        "topology_step_max_s": round(max(step), 4),
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
