"""What ``--topology-probe`` measures on this machine, and how long it takes.

Runs the in-node shared-memory probe (``topomesh.launch.localprobe.measure_shm``) and the
node-to-node TCP probe over loopback (``topomesh.launch.probe``) ``--repeats`` times and
prints the medians of the measured figures and of the wall time per probe.

    python benchmarks/bench_probe.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from topomesh.launch import localprobe, probe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=float, default=2.0, help="--topology-probe-budget, seconds")
    args = ap.parse_args()

    shm, shm_s = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        shm.append(localprobe.measure_shm(budget_s=args.budget))
        shm_s.append(time.perf_counter() - t0)
    tcp, tcp_s = [], []
    with probe.ProbeServer("127.0.0.1") as server:
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            got = probe.measure(server.address, budget_s=args.budget)
            tcp.append((got.latency_us, got.bandwidth_GBps))
            tcp_s.append(time.perf_counter() - t0)

    def med(rows: list[tuple[float, float]], i: int) -> float:
        return statistics.median(r[i] for r in rows)

    print(f"median of {args.repeats}, budget {args.budget:g} s")
    print(f"  SHM (pipe round trip / 2, one-core 64 MiB copy): latency {med(shm, 0):.2f} us, "
          f"bandwidth {med(shm, 1):.2f} GB/s, {statistics.median(shm_s):.3f} s per probe")
    print(f"  TCP over loopback (node-to-node probe):          latency {med(tcp, 0):.2f} us, "
          f"bandwidth {med(tcp, 1):.2f} GB/s, {statistics.median(tcp_s):.3f} s per probe")


if __name__ == "__main__":
    main()
