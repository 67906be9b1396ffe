"""A layout's collectives as its step issues them, timed for real between its compute, against
what the simulator prices them at: the tensor-parallel gap of ``topomesh validate`` taken apart.

    python benchmarks/bench_collectives_in_step.py [--model benchmarks/validate_llama.json]
        [--seq-len N] [--layout tp=2] [--rounds 4]
    python benchmarks/bench_collectives_in_step.py --model tiny-moe --seq-len 128 --layout ep=2

(all-gather, reduce-scatter, all-reduce and all-to-all: the layouts of tensor, data and expert
parallel on two ranks.)

The layout's step is traced and its ops timed inside it (the in-step replay validate runs, in a
child process, with the eager forward and backward's host work where it measures one). The
forward and backward's collectives, in their order, with the priced compute before each,
make a skeleton of the step. Two gloo processes on loopback then run it three ways, in turn,
``--rounds`` times:

* ``chain``: the collectives back to back (functional collectives, each waited on at once,
  as DTensor's are);
* ``skeleton``: each after its compute (a matmul loop burning that much thread CPU time);
* ``compute``: the compute alone, on both ranks at once.

``skeleton - compute`` is what the collectives cost inside the step. The simulator's figure
is the same layout's tensor-parallel communication in its forward and backward (its
timeline's comm events, optimizer excluded), priced with the saved collective profile.
The stepping thread's wait for a core (``schedstat``) is printed per mode.

``--real-step`` times the layout's own step instead of a skeleton, for layouts whose
collectives are plain c10d calls (FSDP2 and its replicate-only form; no pipeline)::

    python benchmarks/bench_collectives_in_step.py --layout dp_shard=2 --real-step [--steps 8]

``topomesh validate``'s worker runs it under ``topomesh launch`` with every plain c10d call
FSDP2 makes (``all_gather_single``, ``reduce_scatter_single``, ``all_reduce``) timed on each
rank, the call and its work's ``wait`` both, and each step's forward and backward spanned;
per rank the median over the timed steps of the forward and backward, of the collectives
inside it, and of the rest (the compute outside them), against the simulator's exposed
forward and backward communication, compute and optimizer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _burn(seconds: float, a: torch.Tensor, b: torch.Tensor) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        torch.mm(a, b)


def _rank(rank: int, store_path: str, skeleton: list, rounds: int, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    from topomesh.validate.worker import core_wait_ns

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    group = dist.group.WORLD
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    items = []
    for seconds, kind, nbytes, dtype in skeleton:
        n = nbytes // dtype.itemsize
        items.append((seconds, kind, torch.ones(n // 2 if kind == "all_gather" else n, dtype=dtype)))

    def issue(kind: str, t: torch.Tensor) -> None:
        if kind == "all_gather":
            fc.wait_tensor(fc.all_gather_tensor(t, 0, group))
        elif kind == "reduce_scatter":
            fc.wait_tensor(fc.reduce_scatter_tensor(t, "sum", 0, group))
        elif kind == "all_to_all":
            fc.wait_tensor(fc.all_to_all_single(t, None, None, group))
        elif kind == "all_reduce":
            fc.wait_tensor(fc.all_reduce(t, "sum", group))
        else:
            raise SystemExit(f"bench_collectives_in_step: no functional form for a {kind} here")

    def one(mode: str) -> tuple[float, float]:
        dist.barrier()
        q0, t0 = core_wait_ns(), time.perf_counter()
        for seconds, kind, t in items:
            if mode != "chain":
                _burn(seconds, a, b)
            if mode != "compute":
                issue(kind, t)
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        wait = (core_wait_ns() - q0) / 1e6
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took), wait

    modes = ("chain", "skeleton", "compute")
    for m in modes:  # warm-up
        one(m)
    res: dict[str, list] = {m: [] for m in modes}
    for _ in range(rounds):
        for m in modes:
            res[m].append(one(m))
    waits = [None, None]
    dist.all_gather_object(waits, {m: statistics.median(w for _, w in v) for m, v in res.items()})
    if rank == 0:
        Path(out).write_text(json.dumps({"s": {m: [s for s, _ in v] for m, v in res.items()}, "core_wait_ms": waits}))
    dist.barrier()
    # not destroy_process_group: after functional collectives gloo's teardown here sometimes
    # aborts ("terminate called without an active exception"); the result is written
    sys.stdout.flush()
    os._exit(0)


TIMED_CALLS = ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_gather_into_tensor",
               "reduce_scatter_tensor")
"""The plain c10d functions ``--real-step`` times (FSDP2 issues the first three on CPU)."""


def _as_worker(argv: list[str]) -> None:
    """Under ``topomesh launch``: the validate worker with :data:`TIMED_CALLS` timed and each
    plain step's forward and backward spanned; rank ``r`` writes ``OUT.rank{r}.json``."""
    import torch.distributed as dist

    from topomesh.validate import worker

    calls: list[dict] = []
    spans: list[tuple[float, float]] = []

    class TimedWork:
        def __init__(self, work: object, rec: dict) -> None:
            self._work, self._rec = work, rec

        def wait(self, *a: object, **k: object) -> object:
            t0 = time.perf_counter()
            out = self._work.wait(*a, **k)
            self._rec["s"] += time.perf_counter() - t0
            return out

        def __getattr__(self, name: str) -> object:
            return getattr(self._work, name)

    def timed(fn):  # noqa: ANN001, ANN202
        def call(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            work = fn(*a, **k)
            rec = {"op": fn.__name__, "t": t0, "s": time.perf_counter() - t0}
            calls.append(rec)
            return None if work is None else TimedWork(work, rec)
        return call

    for name in TIMED_CALLS:
        setattr(dist, name, timed(getattr(dist, name)))
    plain = worker._plain_step

    def spanned(*a, **k):  # noqa: ANN002, ANN003, ANN202
        step = plain(*a, **k)

        def run(tokens: torch.Tensor) -> None:
            t0 = time.perf_counter()
            step(tokens)
            spans.append((t0, time.perf_counter()))
        return run

    worker._plain_step = spanned
    code = worker.main(argv)
    out = argv[argv.index("--out") + 1]
    Path(f"{out}.rank{os.environ['RANK']}.json").write_text(json.dumps({"calls": calls, "spans": spans}))
    sys.stdout.flush()
    os._exit(code)


def _real_step(args: argparse.Namespace, text: str, layout: object, training: object) -> tuple[dict, list[dict]]:
    """The validate worker's record of ``layout`` run for real (:func:`_as_worker`), and each
    rank's timings."""
    from topomesh.validate.run import _run_child, worker_spec

    spec = worker_spec(args.model, args.seq_len, layout, training, steps=args.steps, warmup=2, threads=1)

    def argv(tmp: Path) -> list[str]:
        return ["-m", "topomesh", "launch", "--standalone", "--nproc-per-node", str(layout.world_size),
                "--log-dir", str(tmp / "logs"), "--topology", "off", str(Path(__file__).resolve()), "--as-worker"]

    def read(out: Path) -> tuple[dict, list[dict]]:
        ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(layout.world_size)]
        return json.loads(out.read_text()), ranks

    return _run_child(f"the timed real run of {text}", spec, argv, read, threads=1, timeout_s=900.0)


def _report_real(text: str, record: dict, ranks: list[dict], steps: int, priced: object, priced_comm: float) -> None:
    print(f"{text}: the real step ({steps} timed steps; median {statistics.median(record['step_s']) * 1e3:.1f} ms "
          f"with the optimizer) against the simulator's parts")
    for r, got in enumerate(ranks):
        rows = []
        for a, b in got["spans"][-steps:]:
            coll = sum(c["s"] for c in got["calls"] if a <= c["t"] <= b)
            n = sum(1 for c in got["calls"] if a <= c["t"] <= b)
            rows.append((b - a, coll, b - a - coll, n))
        fb, coll, rest = (statistics.median(x[i] for x in rows) * 1e3 for i in range(3))
        print(f"  rank {r}: forward+backward {fb:.1f} ms, its {rows[-1][3]} collectives {coll:.1f} ms "
              f"({' '.join(f'{x[1] * 1e3:.0f}' for x in rows)}), compute outside them {rest:.1f} ms")
    b = priced.breakdown
    print(f"  simulator: forward/backward communication {priced_comm * 1e3:.1f} ms, compute {b.compute_s * 1e3:.1f} ms, "
          f"optimizer {b.optimizer_s * 1e3:.1f} ms, step {priced.step_time_s * 1e3:.1f} ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(Path(__file__).with_name("validate_llama.json")))
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--layout", default="tp=2", help="a two-rank layout whose forward and backward issue collectives")
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--real-step", action="store_true", help="time the layout's own step (FSDP2 layouts, no pipeline)")
    p.add_argument("--steps", type=int, default=8, help="timed steps of --real-step (default 8)")
    args = p.parse_args()
    torch.set_num_threads(1)

    import torch.multiprocessing as mp

    from topomesh.cli.validate import _layouts
    from topomesh.cost.cluster import local_cluster
    from topomesh.cost.ops import op_time_s, profilable
    from topomesh.layout.dims import Axis
    from topomesh.sim.inputs import load_model
    from topomesh.sim.price import collective_host_s, grad_probe_records, with_fb_host
    from topomesh.sim.simulate import DTYPES, Simulator, Training, micro_batches
    from topomesh.trace.cache import TraceCache, default_directory
    from topomesh.trace.graph import CollectiveRecord, OpRecord, Phase
    from topomesh.validate.run import ensure_ops, in_step_tables

    model = load_model(args.model, seq_len=args.seq_len)
    [(text, layout)] = _layouts([args.layout])
    if layout.world_size != 2:
        raise SystemExit(f"--layout {args.layout}: two ranks only (got {layout.world_size})")
    training = Training(global_batch=args.global_batch, micro_batch=1, seq_len=model.seq_len)
    cluster, cache = local_cluster(gpus=2), TraceCache(default_directory())
    trace = Simulator(model=model, cluster=cluster, cache=cache).trace(layout, training)
    full = trace.compose(model.spec.n_layers) if model.spec.n_layers > trace.traced_layers else trace
    records = [e for e in full.events() if isinstance(e, OpRecord)]
    table = ensure_ops(records + grad_probe_records(trace))
    step = in_step_tables(args.model, args.seq_len, [(text, layout)], training, threads=1)[text]
    table = {**table, **step.table}
    if step.host_fb_s is not None:  # the host work per op and per collective, as validate prices it
        cluster = with_fb_host(cluster, full, step.host_fb_s)
    # the compute before each forward and backward collective, as the simulator prices it on
    # shared cores: each op from the table (else its roofline) and its host work, stretched
    one_mb: list[tuple] = []
    compute = 0.0
    for e in full.events():
        if e.phase not in (Phase.FORWARD, Phase.BACKWARD):
            continue
        if isinstance(e, OpRecord):
            compute += op_time_s(e, cluster.device, table).seconds + (cluster.fb_host_s or 0.0) * profilable(e)
        elif isinstance(e, CollectiveRecord) and e.group_size > 1:
            compute += collective_host_s(cluster, e)
            one_mb.append((compute * cluster.compute_share, e.kind.value, e.bytes, DTYPES[e.dtype]))
            compute = 0.0
    micro = micro_batches(layout, training)
    skeleton = one_mb * micro
    priced = Simulator(model=model, cluster=cluster, cache=cache, table=table).simulate(layout, training, record=True)
    priced_comm = sum(ev["dur"] for ev in priced.timeline["traceEvents"]
                      if ev.get("ph") == "X" and ev.get("pid") == 0 and ev.get("tid") != 0
                      and not ev["name"].startswith("optimizer")) / 1e6

    if args.real_step:
        if layout.degree(Axis.PP) > 1:
            raise SystemExit(f"--layout {args.layout}: --real-step times a step without a pipeline")
        record, ranks = _real_step(args, text, layout, training)
        _report_real(text, record, ranks, args.steps, priced, priced_comm)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o700)
        out = str(Path(tmp) / "out.json")
        mp.spawn(_rank, args=(str(Path(tmp) / "store"), skeleton, args.rounds, out), nprocs=2)
        got = json.loads(Path(out).read_text())
    med = {m: statistics.median(v) for m, v in got["s"].items()}
    n = len(skeleton)
    print(f"{model.spec.name} {text}: {n} collectives in {micro} micro-batches' forward and backward, "
          f"{sum(s for s, *_ in skeleton) * 1e3:.1f} ms of priced compute between them")
    for m, v in got["s"].items():
        waits = "/".join(f"{w[m]:.1f}" for w in got["core_wait_ms"])
        print(f"  {m:9s} {' '.join(f'{x * 1e3:6.1f}' for x in v)} ms  median {med[m] * 1e3:6.1f}  "
              f"core wait (ranks) {waits} ms")
    inside = med["skeleton"] - med["compute"]
    print(f"collectives back to back: {med['chain'] * 1e3:.1f} ms ({med['chain'] / n * 1e3:.3f} a collective)")
    print(f"collectives inside the step (skeleton - compute): {inside * 1e3:.1f} ms ({inside / n * 1e3:.3f} a collective)")
    print(f"simulator's priced forward/backward communication: {priced_comm * 1e3:.1f} ms "
          f"({priced_comm / n * 1e3:.3f} a collective): {(priced_comm / inside - 1) * 100:+.1f} % against inside the step")
    return 0


if __name__ == "__main__":
    if "--as-worker" in sys.argv:
        _as_worker([a for a in sys.argv[1:] if a != "--as-worker"])
    sys.exit(main())
