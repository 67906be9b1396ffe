"""Time topology-aware placement and the per-axis link report at cluster scale.

    python benchmarks/bench_layout_place.py [--hosts 2048]

Hosts are the 8×H100 NVSwitch + 8×400G IB fixture tree (discovered once, renamed per
host); ranks are numbered round-robin over hosts (rank r on host r % hosts), the case
where plain rank order puts TP groups across IB. Prints wall times (median of repeats)
for placing tp=8 × pp=8 × dp, and for the report, plus the link kind each axis crosses.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from topomesh.layout.dims import Layout
from topomesh.layout.place import axis_report, place
from topomesh.topology.build import build_topology
from topomesh.topology.discover import discover_host
from topomesh.topology.model import RankInfo

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "sysfs" / "dgx-h100-8gpu-8ib"


def world(n_hosts: int):
    base = discover_host(FIXTURE)
    hosts = [base.renamed(f"node-{h:05d}") for h in range(n_hosts)]
    gpus = [d.id for d in base.gpus]
    ranks = [
        RankInfo(rank=r, host=r % n_hosts, local_rank=r // n_hosts, device=gpus[r // n_hosts])
        for r in range(n_hosts * len(gpus))
    ]
    return build_topology(hosts, ranks)


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for n in args.hosts:
        topo = world(n)
        layout = Layout(tp=8, pp=8, dp_shard=topo.world_size // 64)
        t_place, placement = timed(lambda t=topo, lay=layout: place(t, lay), args.repeats)
        t_report, report = timed(lambda t=topo, p=placement: axis_report(t, p), args.repeats)
        links = ", ".join(f"{r.axis.value}={r.kind.value}" for r in report)
        print(f"{topo.world_size:6d} ranks: place {t_place:.3f} s, report {t_report:.3f} s; {links}")


if __name__ == "__main__":
    main()
