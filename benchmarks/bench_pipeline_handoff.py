"""What a two-stage pipeline on gloo loses between its actions on this host: the 1F1B hand-off
taken apart with stages of known compute.

    python benchmarks/bench_pipeline_handoff.py [--forward-ms 10] [--microbatches 2 8]
        [--steps 20] [--rounds 2]

Two gloo processes on loopback (one torch thread each) run ``torch.distributed.pipelining``'s
``Schedule1F1B`` over two stages whose forward burns ``--forward-ms`` of a matmul chain and
whose backward twice that (`topomesh.cost.pipeline.burn_stage`; the activation a
(1, 256, 256) bfloat16 tensor, 128 KiB, as ``benchmarks/validate_llama.json``'s). Per
micro-batch count, after three warm-up steps, it prints:

* the median step against its ideal, ``(m + 1) * (F + B)`` with F and B each rank's chain
  timed alone just before (a 2-stage 1F1B's critical path: rank 0's first forward, every
  micro-batch of rank 1, rank 0's last backward);
* the chain inside the pipeline over the chain alone (each rank, forward and backward): whether
  the compute itself slows when the other rank runs;
* the last stage's stepping thread's wait for a core (``schedstat``) per step and per
  steady-state hand-off (``m - 1`` a step: after each backward but the last it posts the
  gradient's send with the next forward's receive, whose data rank 0 sent long before);
* the CPU time per step of each rank's gloo threads (``gloo_tcp_loop``).

The slope between the two micro-batch counts, against ``F + B``, is what each more micro-batch
costs beyond its compute, with what a step costs once cancelled. The simulator prices a hand-off
as the boundary send's calibrated time (``p2p wait`` in a simulated timeline; 0.8 ms for 128 KiB
here) and the ranks' compute at processor sharing (``topomesh.sim.shared``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROWS, WIDTH = 256, 256
"""An activation's shape (one micro-batch of ``benchmarks/validate_llama.json``: 256 tokens × 256)."""
WARMUP = 3


def _gloo_cpu_ns() -> int:
    """CPU nanoseconds of this process's gloo I/O threads so far (``/proc/self/task``)."""
    total = 0
    for task in glob.glob("/proc/self/task/*"):
        try:
            if Path(task, "comm").read_text().strip() == "gloo_tcp_loop":
                total += int(Path(task, "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


def _rank(rank: int, store_path: str, forward_s: float, counts: list[int], steps: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from topomesh.cost.calibrate import _timed_chain
    from topomesh.cost.pipeline import burn_stage
    from topomesh.validate.worker import core_wait_ns

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    chain, per = _timed_chain(0)
    k = max(1, round(forward_s / per))
    inside: dict[str, list[float]] = {"F": [], "B": []}

    def burn(n: int) -> None:
        t0 = time.perf_counter()
        chain(n)
        inside["F" if n == k else "B"].append(time.perf_counter() - t0)

    results = []
    for m in counts:
        alone: dict[str, list[float]] = {"F": [], "B": []}
        for _ in range(5):  # each rank's chain alone, the other waiting at a barrier
            for who in (0, 1):
                dist.barrier()
                if rank == who:
                    for kind, n in (("F", k), ("B", 2 * k)):
                        t0 = time.perf_counter()
                        chain(n)
                        alone[kind].append(time.perf_counter() - t0)
        stage = PipelineStage(burn_stage(burn, k), rank, 2, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda o, t: (o.float() - t).pow(2).mean())
        x = torch.randn(m, ROWS, WIDTH, dtype=torch.bfloat16)
        target = torch.zeros(m, ROWS, WIDTH)
        walls: list[float] = []
        waits = gloo = 0
        for i in range(WARMUP + steps):
            if i == WARMUP:
                inside = {"F": [], "B": []}
                waits, gloo = -core_wait_ns(), -_gloo_cpu_ns()
            dist.barrier()
            t0 = time.perf_counter()
            schedule.step(*((x,) if rank == 0 else ()), target=target if rank == 1 else None)
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            walls.append(float(took))
        waits += core_wait_ns()
        gloo += _gloo_cpu_ns()
        mine = {"alone_F": statistics.fmean(alone["F"]), "alone_B": statistics.fmean(alone["B"]),
                "inside_F": statistics.fmean(inside["F"]), "inside_B": statistics.fmean(inside["B"]),
                "core_wait_s": waits / 1e9 / steps, "gloo_cpu_s": gloo / 1e9 / steps}
        every: list = [None, None]
        dist.all_gather_object(every, mine)
        results.append({"microbatches": m, "step_s": statistics.median(walls[WARMUP:]), "ranks": every})
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown here sometimes aborts; the result is written


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--forward-ms", type=float, default=10.0, help="each stage's forward compute (backward: twice)")
    p.add_argument("--microbatches", type=int, nargs=2, default=[2, 8], metavar=("LO", "HI"))
    p.add_argument("--steps", type=int, default=20, help="timed steps per micro-batch count")
    p.add_argument("--rounds", type=int, default=2, help="fresh process pairs, one after another")
    args = p.parse_args(argv)
    if not (0 < args.forward_ms <= 1000 and 1 <= args.microbatches[0] < args.microbatches[1] <= 64
            and 1 <= args.steps <= 1000 and 1 <= args.rounds <= 20):
        raise SystemExit("bench_pipeline_handoff: --forward-ms in (0, 1000], 1 <= LO < HI <= 64 micro-batches, "
                         "--steps in [1, 1000], --rounds in [1, 20]")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    lo, hi = args.microbatches
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            os.chmod(tmp, 0o700)
            out = str(Path(tmp) / "out.json")
            mp.spawn(_rank, args=(str(Path(tmp) / "store"), args.forward_ms / 1e3, [lo, hi], args.steps, out), nprocs=2)
            got = json.loads(Path(out).read_text())
        print(f"round {r + 1}/{args.rounds}: F {args.forward_ms:g} ms, B {2 * args.forward_ms:g} ms a stage")
        for res in got:
            m, ranks = res["microbatches"], res["ranks"]
            fb = statistics.fmean(rk["alone_F"] + rk["alone_B"] for rk in ranks)
            ideal = (m + 1) * fb
            last = ranks[1]
            print(f"  m={m:2d}: step {res['step_s'] * 1e3:7.1f} ms, ideal {ideal * 1e3:7.1f} "
                  f"({(res['step_s'] / ideal - 1) * 100:+.1f} %); chain inside / alone "
                  + ", ".join(f"rank {i} F {rk['inside_F'] / rk['alone_F']:.3f} B {rk['inside_B'] / rk['alone_B']:.3f}"
                              for i, rk in enumerate(ranks))
                  + f"; last stage's wait for a core {last['core_wait_s'] * 1e3:.2f} ms a step "
                  f"({last['core_wait_s'] / max(1, m - 1) * 1e3:.2f} a hand-off); gloo threads' CPU "
                  + " / ".join(f"{rk['gloo_cpu_s'] * 1e3:.2f}" for rk in ranks) + " ms a step")
        (a, b), fb = got, statistics.fmean(rk["alone_F"] + rk["alone_B"] for rk in got[1]["ranks"])
        slope = (b["step_s"] - a["step_s"]) / (hi - lo)
        print(f"  per micro-batch (slope m={lo}..{hi}): {slope * 1e3:.2f} ms against F + B {fb * 1e3:.2f} "
              f"({(slope - fb) * 1e3:+.2f} ms beyond the compute)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
