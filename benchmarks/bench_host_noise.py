"""How steady this host's cores are: the noise floor under ``topomesh validate``'s comparisons.

    python benchmarks/bench_host_noise.py [--seconds 40] [--window 1.0] [--slow 1.10]

One process per allowed CPU, each bound to its CPU with one torch thread, times the same
stretch of the calibration's compute segment (``topomesh.cost.calibrate``'s matmul chain, the one
the compute stretch and the in-step costs are timed on: 440 of its 96 x 96 matmuls, each with
a tanh, about 20 ms on the 2-vCPU EPYC VM) over and over for ``--seconds``, all at once. Per CPU it prints the median chain, and per
``--window`` of wall time the median chain over the CPU's own median: the share of windows
slower than ``--slow`` and the slowest window. Then the share of windows in which *some* CPU was
slow, which is what ranks that meet at every collective or hand-off see, and the steal time
``/proc/stat`` recorded meanwhile (time the hypervisor ran something else on a vCPU).

The chain's operands fit in a core's L1 cache, so what moves it is the core itself
(a busy sibling thread of another tenant, the clock), not this program. A host whose windows
are slow now and then moves a layout's step by as much, and no prediction made before the run
can follow it: ``validate``'s runs' spread (``mean_runs_spread``) is of that size.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import time

CHAIN = 440
"""Matmuls of the calibration's chain a sample times (about 20 ms here)."""
WARMUP_CHAINS = 20


def _steal_ticks() -> int:
    """Steal ticks of all CPUs so far (the eighth figure of ``/proc/stat``'s ``cpu`` line); 0 where unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) if fields[0] == "cpu" and len(fields) > 8 else 0
    except (OSError, ValueError):
        return 0


def _probe(cpu: int, start: float, seconds: float, out: mp.Queue) -> None:
    """Bound to ``cpu``: wait for ``start`` (all CPUs begin together), then time the chain until
    ``start + seconds``; put ``(cpu, [(wall offset, seconds), ...])``."""
    import torch

    from topomesh.cost.calibrate import _matmul_chain

    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    segment = _matmul_chain()

    def chain() -> float:
        t0 = time.perf_counter()
        segment(CHAIN)
        return time.perf_counter() - t0

    for _ in range(WARMUP_CHAINS):
        chain()
    while time.time() < start:
        time.sleep(0.001)
    samples = []
    end = start + seconds
    while time.time() < end:
        t = time.time() - start
        samples.append((t, chain()))
    out.put((cpu, samples))


def window_ratios(samples: list[tuple[float, float]], window: float) -> dict[int, float]:
    """Per window of ``window`` seconds (by start offset), its median sample over the median of all.

    >>> window_ratios([(0.1, 2.0), (0.5, 2.0), (1.2, 3.0), (1.6, 2.0), (2.3, 2.0)], 1.0)
    {0: 1.0, 1: 1.25, 2: 1.0}
    """
    overall = statistics.median(d for _, d in samples)
    windows: dict[int, list[float]] = {}
    for t, d in samples:
        windows.setdefault(int(t // window), []).append(d)
    return {w: statistics.median(ds) / overall for w, ds in sorted(windows.items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=40.0, help="how long every CPU times its chain (default 40)")
    p.add_argument("--window", type=float, default=1.0, help="seconds a window spans (default 1)")
    p.add_argument("--slow", type=float, default=1.10, help="a window this many times the CPU's median is slow")
    args = p.parse_args()
    if not (1.0 <= args.seconds <= 3600.0 and 0.1 <= args.window <= args.seconds and args.slow > 1.0):
        p.error("need 1 <= --seconds <= 3600, 0.1 <= --window <= --seconds and --slow > 1")
    cpus = sorted(os.sched_getaffinity(0))
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    start = time.time() + 5.0  # every process imported torch and warmed up by then
    steal0 = _steal_ticks()
    procs = [ctx.Process(target=_probe, args=(cpu, start, args.seconds, out)) for cpu in cpus]
    for proc in procs:
        proc.start()
    try:
        got = dict(out.get(timeout=args.seconds + 120.0) for _ in procs)
    except queue.Empty:
        codes = [proc.exitcode for proc in procs]
        raise SystemExit(f"bench_host_noise: a probe gave no result within {args.seconds + 120.0:g} s "
                         f"(exit codes {codes})") from None
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    steal = _steal_ticks() - steal0
    hz = os.sysconf("SC_CLK_TCK")
    print(f"{len(cpus)} CPUs, {args.seconds:g} s each, all at once; windows of {args.window:g} s, "
          f"slow past {args.slow:.2f}x the CPU's median")
    ratios = {}
    for cpu in cpus:
        samples = got[cpu]
        ratios[cpu] = window_ratios(samples, args.window)
        slow = [r for r in ratios[cpu].values() if r > args.slow]
        print(f"  cpu {cpu}: {len(samples)} chains, median {statistics.median(d for _, d in samples) * 1e3:.2f} ms; "
              f"slow windows {len(slow)}/{len(ratios[cpu])} ({100 * len(slow) / len(ratios[cpu]):.0f} %), "
              f"slowest {max(ratios[cpu].values()):.2f}x")
    shared = set.intersection(*(set(r) for r in ratios.values()))
    some = [w for w in shared if any(ratios[c][w] > args.slow for c in cpus)]
    print(f"  some CPU slow: {len(some)}/{len(shared)} windows ({100 * len(some) / max(1, len(shared)):.0f} %)")
    print(f"  steal: {steal / hz * 1e3:.0f} ms of {len(cpus) * args.seconds:g} CPU-seconds")


if __name__ == "__main__":
    main()
