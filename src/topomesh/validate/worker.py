"""One real training run of a layout, measured: the worker ``topomesh validate`` launches.

Started on every rank by ``topomesh launch --standalone --nproc-per-node N -m
topomesh.validate.worker --spec FILE.json --out FILE.json``. The spec (written by
:mod:`topomesh.validate.run`) names a built-in model config, the layout's degrees and the
training knobs — the same :class:`~topomesh.sim.simulate.Training` the simulator priced —
and the worker trains exactly what the simulator traced:

* the reference :class:`~topomesh.models.transformer.Transformer`, built in the dtype the
  trace used (float32 under FSDP2 mixed precision, else the training dtype), parallelized
  by the built-in parallelize (:func:`~topomesh.sim.simulate.builtin_model`: TP+SP,
  FSDP2/HSDP, mixed precision, recomputation) on the topology-placed mesh;
* AdamW one parameter at a time (the tracer's :func:`~topomesh.trace.tracer.default_optimizer`),
  the float32 token cross-entropy (``loss_parallel`` when the logits are vocab-sharded);
* with ``pp > 1``: a ``PipelineStage`` for each stage the pipeline rank holds — one, or with
  a multi-stage schedule the stages :func:`~topomesh.sim.schedules.rank_stages` gives it
  (looped for the interleaved ones, a V for ZBV and DualPipeV), each parallelized on its
  own — holding the layers :func:`~topomesh.sim.simulate.split_layers` gives that stage, run
  by the torch schedule class the simulator takes its action order from
  (:mod:`topomesh.sim.schedules`), its outputs not kept (``return_outputs=False``: a training
  loop reads only the losses);
* without a pipeline: the micro-batches one after the other (gradient accumulation).

Measurement: ``torch.set_num_threads(threads)`` in every process (and one inter-op thread);
``warmup`` steps discarded, the first of them a full first step (lazy init, optimizer
state) and the last recorded by the profiler with ``profile_memory=True``: the peak of
PyTorch's own allocation records inside that step (:func:`peak_in_window`), counted from
the start of the process so parameters and optimizer state are in it. gloo frees what a
collective allocated on its own thread, where the profiler records nothing: such a block is
freed when the issuing thread has waited for its collective (:func:`collective_deadline`), any
other block freed unseen when its address is handed out again (:func:`peak_in_window`). On CPU one more
step runs untimed after the profiler has stopped and its records were read
(:data:`SETTLE_STEPS`; its time is reported as ``settle_s``). Then ``steps`` timed
steps, each started after a barrier and timed on every rank; a step's time is the slowest
rank's (all-reduce MAX), wall clock, and so is its CPU time (``time.process_time``: every
thread of the process, gloo's included) — on a machine others load, the CPU time shows
what the step cost apart from waiting for a core — and the most minor page faults a rank took
in it (:data:`topomesh.validate.run.STEADY_MALLOC` keeps them near zero). Rank 0 writes the
times, the peaks of every rank, the load average before and after, the thread count, and
the c10d calls its profiled step made (:func:`collective_calls`).

On a GPU (the spec's ``device`` is ``cuda``: ``topomesh validate --device cuda``) the model,
tokens and optimizer state live on ``LOCAL_RANK``'s GPU, the process group is NCCL, each timed
step ends with ``torch.cuda.synchronize`` (its kernels done, not only issued), and the peak is
``torch.cuda.max_memory_allocated`` over the last warm-up step, counted from what is allocated
when it starts (parameters, gradients' storage, optimizer state); the profiler is not run.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import gc
import json
import os
import resource
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from topomesh.errors import LayoutError
from topomesh.models.transformer import Transformer, TransformerConfig


def peak_in_window(records: Iterable[tuple[int, int, int | None]], start_ns: int, end_ns: int) -> int:
    """Most bytes allocated at once inside ``[start_ns, end_ns]``.

    ``records`` are (time ns, bytes, address) allocation records in any order, frees negative,
    from the beginning of the process: what is allocated when the window opens counts. The
    profiler records a free only on a thread it follows: a tensor freed on another thread
    (gloo's, holding a collective's buffers) looks allocated for ever. Such a block is known
    free once malloc hands its address out again, and is dropped then (address None: no check).

    >>> peak_in_window([(1, 100, 1), (5, 50, 2), (6, -50, 2), (7, 20, 3), (20, 500, 4)], 4, 10)
    150
    >>> peak_in_window([(1, 100, 1), (5, 100, 1), (6, 30, 2)], 4, 10)  # 1 freed unseen before 5
    130
    """
    live = peak = 0
    opened = False
    blocks: dict[int, int] = {}  # address -> bytes of the block the records say is there
    for t, nbytes, address in sorted(records, key=lambda r: r[0]):
        if t > end_ns:
            break
        if t >= start_ns and not opened:
            opened, peak = True, live
        if address is not None:
            if nbytes > 0:
                live -= blocks.pop(address, 0)  # still "live": freed where the profiler did not look
                blocks[address] = nbytes
            else:
                blocks.pop(address, None)
        live += nbytes
        if opened:
            peak = max(peak, live)
    return peak if opened else live


SETTLE_STEPS = 1
"""Untimed steps between the profiled warm-up step (its records walked, freed, collected) and
the timed ones, on CPU. Without one, the first timed step was slower than the median of the
seven after it in 17 of 18 real runs of the default set (2-vCPU EPYC VM, 2026-11-27), by a
median 13 % (-2 … +47 %): the step after the profiler's teardown is not yet a steady one."""

WAIT = "_c10d_functional::wait_tensor"
"""The profiler's name for a thread waiting on a functional collective (DTensor's, TP's)."""


def collective_deadline(ancestors: Iterable[tuple[str, int]], waits: list[int]) -> int | None:
    """When a block allocated inside a collective is freed at the latest, or None when it was
    not allocated inside one.

    ``ancestors`` are the (name, end ns) of the allocation's enclosing profiler events,
    innermost first; ``waits`` the sorted end times of the allocating thread's
    :data:`WAIT` events. gloo keeps what a collective allocates (reduce-scatter's copy of its
    input, a functional all-gather's output) in its work object, released on gloo's thread
    once the collective is done: a free the profiler does not record. The issuing thread
    learns it is done at its next wait — for a functional collective
    (``_c10d_functional::*``), the first ``wait_tensor`` after the call; for a plain c10d call
    (``c10d::*``: FSDP2's reduce-scatter), at its end, since ``torch.distributed`` waits before
    returning when called with ``async_op=False``, as FSDP2's ``foreach_reduce`` calls it. An
    asynchronous plain call that allocated would be closed early; in the runs here only gloo's
    reduce-scatter copies and functional all-gather outputs are freed unseen.

    >>> collective_deadline([("aten::empty", 5), ("_c10d_functional::all_gather_into_tensor", 9)], [7, 12, 20])
    12
    >>> collective_deadline([("aten::clone", 5), ("c10d::_reduce_scatter_base_", 8), ("FSDP::post_backward_reduce", 30)], [])
    8
    >>> collective_deadline([("aten::mm", 5), ("aten::linear", 6)], [7]) is None
    True
    """
    plain = None
    for name, end in ancestors:
        if name.startswith("_c10d_functional::") and name != WAIT:
            k = bisect.bisect_right(waits, end)
            return waits[k] if k < len(waits) else None
        if plain is None and name.startswith("c10d::"):
            plain = end
    return plain


def close_collective_blocks(records: list[tuple[int, int, int]], deadlines: dict[int, int]
                            ) -> list[tuple[int, int, int]]:
    """``records`` (time ns, bytes, address; frees negative) with a free added at its deadline
    for every block ``deadlines`` names (record index -> ns, :func:`collective_deadline`) whose
    free the records lack: its address is handed out again after the deadline, or never.

    >>> close_collective_blocks([(1, 64, 7), (2, 32, 8), (9, 16, 7)], {0: 5})
    [(1, 64, 7), (2, 32, 8), (5, -64, 7), (9, 16, 7)]
    >>> close_collective_blocks([(1, 64, 7), (8, -64, 7)], {0: 5})  # freed where the profiler looks
    [(1, 64, 7), (8, -64, 7)]
    """
    order = sorted(range(len(records)), key=lambda i: records[i][0])
    following: dict[int, tuple[int, int]] = {}  # record index -> (time, bytes) of the next record at its address
    last: dict[int, tuple[int, int]] = {}
    for i in reversed(order):
        t, nbytes, address = records[i]
        if address in last:
            following[i] = last[address]
        last[address] = (t, nbytes)
    added = []
    for i, deadline in deadlines.items():
        nbytes, nxt = records[i][1], following.get(i)
        if nbytes > 0 and (nxt is None or (nxt[1] > 0 and nxt[0] > deadline)):
            added.append((deadline, -nbytes, records[i][2]))
    return sorted(records + added, key=lambda r: r[0])


def allocation_records(prof: Any) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """(time ns, bytes, address) of every allocation and free ``prof`` recorded, and the
    (start, end) ns of each ``topomesh_validate_step`` range, from the profiler's event tree.
    A block allocated inside a collective gets a free at its :func:`collective_deadline`
    when the records show none before it (:func:`close_collective_blocks`)."""
    from torch._C._profiler import _EventType

    allocations: list[tuple[int, int, int]] = []
    inside: dict[int, tuple[int, list[tuple[str, int]]]] = {}  # record index -> (thread, ancestors)
    waits: dict[int, list[int]] = {}
    windows: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            if int(f.alloc_size) > 0:
                ancestors, p = [], e.parent
                while p is not None:
                    ancestors.append((p.name, p.end_time_ns))
                    p = p.parent
                if any(n.startswith(("c10d::", "_c10d_functional::")) for n, _ in ancestors):
                    inside[len(allocations)] = (e.start_tid, ancestors)
            allocations.append((e.start_time_ns, int(f.alloc_size), int(f.ptr)))
        elif e.name == WAIT:
            waits.setdefault(e.start_tid, []).append(e.end_time_ns)
        elif e.name == "topomesh_validate_step":
            windows.append((e.start_time_ns, e.end_time_ns))
    for ends in waits.values():
        ends.sort()
    deadlines = {i: d for i, (tid, ancestors) in inside.items()
                 if (d := collective_deadline(ancestors, waits.get(tid, []))) is not None}
    return close_collective_blocks(allocations, deadlines), sorted(windows)


def collective_calls(prof: Any, start_ns: int, end_ns: int) -> dict[str, int]:
    """How many times each c10d op (``c10d::_allgather_base_``, ``c10d::send``, ...) was called
    on a thread ``prof`` follows inside ``[start_ns, end_ns]``: what the step ran, to set
    against what the simulator assumes (one all-gather per FSDP unit under a pipeline)."""
    calls: dict[str, int] = {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.name.startswith("c10d::") and start_ns <= e.start_time_ns <= end_ns:
            calls[e.name] = calls.get(e.name, 0) + 1
            continue  # an op's own children are its implementation, not more calls
        stack.extend(e.children)
    return dict(sorted(calls.items()))


class StageModel(Transformer):
    """One pipeline stage of the reference transformer: its share of the blocks, the
    embeddings on the first stage, the final norm and head on the last; ``forward`` takes
    tokens (first stage) or the previous stage's hidden states."""

    def __init__(self, cfg: TransformerConfig, n_layers: int, *, first: bool, last: bool) -> None:
        super().__init__(dataclasses.replace(cfg, n_layers=n_layers))
        if not first:
            self.tok_embeddings = None
            self.pos_embeddings = None
        if not last:
            self.norm = None
            self.output = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(x)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(self.positions[: x.shape[1]])
        rope = self.rope()
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


NO_CP = ("validate cannot run context parallel here: PyTorch's ring attention has rules for the CUDA attention "
         "kernels only (none for the CPU kernel), and validate's runs of several ranks are gloo on CPU.")
"""Why a ``cp`` axis > 1 is refused before anything is calibrated or run (torch 2.13:
``torch.distributed.tensor.experimental._context_parallel`` maps the flash, efficient and
cuDNN kernels, not ``_scaled_dot_product_flash_attention_for_cpu``; ``--device cuda`` runs
one rank). The simulator still prices such layouts: the tracer issues the GPU kernel."""


def _load_spec(path: Path) -> dict[str, Any]:
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise LayoutError(f"{path}: a validate worker spec must be a JSON object.")
    return raw


def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def run(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Train and measure (see the module docstring); rank 0 returns the record."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from topomesh.layout.api import mesh_from_topology
    from topomesh.layout.dims import Axis
    from topomesh.sim.inputs import load_model
    from topomesh.sim.schedules import Schedule, rank_stages, stage_count
    from topomesh.sim.simulate import DTYPES, Training, mixed_precision, split_layers
    from topomesh.trace.tracer import default_optimizer

    threads = int(spec["threads"])
    device = torch.device(str(spec.get("device", "cpu")))
    cuda = device.type == "cuda"
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    load_before = _loadavg()
    model_def = load_model(spec["model"], seq_len=spec.get("seq_len"))
    cfg = model_def.config
    if cfg is None:
        raise LayoutError(f"--model {spec['model']!r}: only built-in transformer configs can be run for real.")
    cfg = dataclasses.replace(cfg, seq_len=model_def.seq_len)
    training = Training(**{**spec["training"], "schedule": Schedule(spec["training"]["schedule"])})
    degrees: dict[str, int] = spec["degrees"]
    # on a GPU torch.cuda's own peak counter, on CPU the profiler's allocation records
    recorder = contextlib.nullcontext() if cuda else profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with recorder as prof:
        mesh = mesh_from_topology(degrees, device_type=device.type, order=spec.get("order"))
        if cuda:
            device = torch.device("cuda", torch.cuda.current_device())  # LOCAL_RANK's (ensure_process_group)
        from topomesh.layout.api import resolve_layout

        layout = resolve_layout(degrees, dist.get_world_size(), order=spec.get("order"))
        pp = layout.degree(Axis.PP)
        if layout.degree(Axis.CP) > 1:
            raise LayoutError(NO_CP)
        mixed = mixed_precision(layout, training)
        dtype = torch.float32 if mixed else DTYPES[training.dtype]
        dp = layout.degree(Axis.DP_REPLICATE) * layout.degree(Axis.DP_SHARD)
        micro = training.global_batch // (dp * training.micro_batch)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            torch.manual_seed(0)
            with device:  # parameters and buffers made where they train
                if pp > 1:
                    # single-stage and V schedules ignore --interleave, as the simulator does
                    n_stages = stage_count(training.schedule, pp, training.interleave)
                    stages = rank_stages(training.schedule, pp, training.interleave, mesh.get_local_rank(Axis.PP.value))
                    layers = split_layers(cfg.n_layers, n_stages)
                    modules: list[nn.Module] = [StageModel(cfg, layers[s], first=s == 0, last=s == n_stages - 1)
                                                for s in stages]
                else:
                    n_stages, stages, modules = 1, [0], [Transformer(cfg)]
        finally:
            torch.set_default_dtype(previous)
        sub = [a.value for a in layout.mesh_axes if a is not Axis.PP]
        # a stage's own axes; with none (one process, or a pipeline alone) the whole mesh, whose
        # axes are then 1 or pp: parallelize still applies what the knobs ask (recomputation), as
        # the tracer's parallelize did for the prediction
        inner = mesh[tuple(sub)] if sub and pp > 1 else mesh
        parallelize = model_def.parallelize(training, mixed)
        if parallelize is not None:
            modules = [parallelize(m, inner) or m for m in modules]
        optimizer = default_optimizer([p for m in modules for p in m.parameters() if p.requires_grad])
        tp = layout.degree(Axis.TP)
        step_fn = (_pipeline_step(modules, stages, n_stages, mesh, micro, training, tp=tp, device=device) if pp > 1
                   else _plain_step(modules[0], micro))
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, cfg.vocab_size, (training.micro_batch * micro, cfg.seq_len), generator=g).to(device)

        def one_step() -> None:
            optimizer.zero_grad(set_to_none=True)
            step_fn(tokens)
            optimizer.step()

        warmup = max(2, int(spec["warmup"]))
        for i in range(warmup):
            dist.barrier()
            if i == warmup - 1:
                if cuda:  # the peak from here on; what is allocated now (parameters, optimizer state) counts
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                with record_function("topomesh_validate_step"):
                    one_step()
            else:
                one_step()
        _sync(device)
        dist.barrier()
    if cuda:
        peak, calls = torch.cuda.max_memory_allocated(device), {}
    else:
        mem, window = allocation_records(prof)
        peak = peak_in_window(mem, *window[-1]) if window else 0
        calls = collective_calls(prof, *window[-1]) if window else {}
        del prof, mem
        gc.collect()  # the records' objects, now, not inside a timed step
    settle: list[float] = []
    for _ in range(0 if cuda else SETTLE_STEPS):  # after the profiler's teardown, untimed
        dist.barrier()
        t0 = time.perf_counter()
        one_step()
        settle.append(time.perf_counter() - t0)
    times: list[float] = []
    cpu: list[float] = []
    faults: list[int] = []
    waits: list[float] = []
    for _ in range(int(spec["steps"])):
        dist.barrier()
        _sync(device)
        t0, c0, f0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        w0 = core_wait_ns()
        one_step()
        _sync(device)  # a GPU step ends when its kernels have
        w1 = core_wait_ns()
        f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        dt = torch.tensor([time.perf_counter() - t0, time.process_time() - c0, f1 - f0, (w1 - w0) / 1e9],
                          dtype=torch.float64, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(float(dt[0]))
        cpu.append(float(dt[1]))
        faults.append(int(dt[2]))
        waits.append(float(dt[3]))
    peaks = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor([peak], dtype=torch.int64, device=device))
    out = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "degrees": degrees,
        "world_size": dist.get_world_size(),
        "threads": threads,
        "step_s": times,
        "settle_s": settle,
        "cpu_s": cpu,
        "page_faults": faults,
        "core_wait_s": waits,
        "peak_bytes": [int(p.item()) for p in peaks],
        "microbatches": micro,
        "collective_calls": calls,
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
    }
    return out if dist.get_rank() == 0 else None


def core_wait_ns(path: str = "/proc/thread-self/schedstat") -> int:
    """Nanoseconds the calling thread has spent ready to run but waiting for a core (the second
    field of Linux's ``schedstat``); 0 where the file is absent or unreadable.

    On this 2-vCPU VM a two-stage pipeline's ranks each have a computing thread, and gloo's
    transport thread (``gloo_tcp_loop``) wakes for every piece of a hand-off: the stepping
    thread is then sometimes queued behind it or the other rank for a scheduler slice
    (2-6 ms). A step's wait tells how much of its time is that, which one core per rank (what
    the simulator assumes) never pays.
    """
    try:
        with open(path, "rb") as f:
            return int(f.read(128).split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _plain_step(module: nn.Module, micro: int) -> Any:
    from topomesh.trace.tracer import causal_lm_loss, loss_context

    def step(tokens: torch.Tensor) -> None:
        for chunk in tokens.chunk(micro):
            out = module(chunk)
            with loss_context(out):
                causal_lm_loss(out, chunk).backward()

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pipeline_step(modules: list[nn.Module], stages: list[int], n_stages: int, mesh: Any, micro: int,
                   training: Any, *, tp: int = 1, device: torch.device | None = None) -> Any:
    """One step of torch's pipeline schedule over this rank's stages (``modules[i]`` is global
    stage ``stages[i]`` of ``n_stages``): single-stage schedules get the one stage, multi-stage
    ones the list. Under tp the blocks hand each other (and so each stage the next) this rank's
    plain local piece of the residual stream — the built-in plan's styles return local
    outputs — so stages send plain tensors; only the last stage's vocab-sharded logits are
    DTensors, whose loss and its backward run under ``loss_parallel`` as in a plain step."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torch.distributed.tensor.parallel import loss_parallel

    from topomesh.trace.tracer import causal_lm_loss

    group = mesh.get_group("pp")
    pipes = []
    for module, s in zip(modules, stages, strict=True):
        if isinstance(module, FSDPModule):
            # torchtitan's default under PP: parameters stay gathered from a stage's first forward
            # to its last backward. With the default, every forward resharded them and the next
            # action gathered again: 5 all-gathers per unit in a 4-micro-batch 1F1B step, not 1.
            module.set_reshard_after_forward(False)
        pipes.append(PipelineStage(module, s, n_stages, device or torch.device("cpu"), group=group))
    cls = get_schedule_class(training.schedule.torch_name)
    schedule = cls(pipes if training.schedule.multi_stage else pipes[0], n_microbatches=micro, loss_fn=causal_lm_loss)
    first, last = 0 in stages, n_stages - 1 in stages
    sharded_loss = tp > 1 and last

    def step(tokens: torch.Tensor) -> None:
        args = (tokens,) if first else ()
        # return_outputs=False: by default the last stage keeps every micro-batch's output (the
        # logits) to return them merged, 4.2 MB more at its peak here that training never reads
        with loss_parallel() if sharded_loss else contextlib.nullcontext():
            schedule.step(*args, target=tokens if last else None, return_outputs=False)

    return step


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    p = argparse.ArgumentParser(description="one measured training run of a layout (topomesh validate)")
    p.add_argument("--spec", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    record = run(_load_spec(args.spec))
    if record is not None:
        from topomesh.topology.api import write_atomic

        write_atomic(args.out, json.dumps(record, indent=2))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a joinable C++ thread (gloo / the profiler) destroyed there
    # intermittently aborts a finished run ("terminate called without an active exception").
    os._exit(code)
