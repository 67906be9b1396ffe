"""Op times measured where the step runs them: the traced step graph replayed for real.

:func:`~topomesh.cost.ops.time_op` times an op by calling it again and again on the same
inputs: its data, its code and the branch history are hot in the core's caches. Inside a
training step every op follows a different one; its inputs were written by another op, or
(weights, optimizer state, activations kept for backward) touched last a whole phase ago, and
its kernel's code was last run an op or a layer before. On this CPU that makes ops of a step
slower than their table times: measured on the one-process step of
``benchmarks/validate_llama.json``, ``mm`` 13-15 %, the flash-attention backward 4-7 %,
``_to_copy`` and views 2.5-4 times, 19-23 % over the whole graph (the same ops, both timed
in one process minutes apart, thread CPU clock).

:func:`in_step_times` measures that directly: it traces a layout's step with
:func:`~topomesh.trace.tracer.with_step_graph`, gives the graph real tensors of the traced
shapes, dtypes and strides (parameters, optimizer state and buffers as small positive
numbers, integer tensors as zeros so every index is in range, the inputs from the model
spec's own ``make_inputs``), and runs it node by node (``torch.fx.Interpreter``, which frees
each value after its last use, as the step does) under the fake process group the trace made
(collectives return at once: they are priced by the collective model). Each compute node is
timed alone on the thread's CPU clock (one torch thread; wall clock with more), so the
interpreter's own Python is not in any op's time; a node's time is its mean over
``repeats`` runs after ``warmup``, scaled so the graph's nodes sum to its median run
(:func:`time_nodes`), and a signature's (:func:`~topomesh.cost.ops.profile_key`) the mean
over the nodes that run it, so the table prices the replayed step at the sum of its
measured ops. The mean, not the median, as for collectives
(:data:`~topomesh.cost.calibrate.STATISTIC`): a step pays the sum of its ops, whose
expectation is the sum of their means, and op times here are skewed to the right. Eleven
replays of the one-process step of ``benchmarks/validate_llama.json`` (2-vCPU Xeon, thread
CPU clock): the priced nodes' medians summed to 64.1 ms, their means to 65.7, and the median
of the eleven runs' own sums was 65.1. This is per-op timing in the op's real context, as
trace-driven predictors of training time do (Daydream, ATC '20; dPRO, MLSys '22), not a fit
to step times: what the step adds beyond its ops (Python, autograd, DTensor, collectives,
other ranks) stays the simulator's to model.

``python -m topomesh.cost.instep --spec FILE --out FILE`` does it for a list of layouts in a
fresh process, so the replay runs under the same thread count and malloc settings as the real
runs :mod:`topomesh.validate.run` starts.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx

from topomesh.cost.ops import Key, profilable, profile_key
from topomesh.errors import LayoutError

REPEATS = 5
WARMUP = 1
EAGER_REPEATS = 3
"""The eager forward and backward runs :func:`in_step_times` takes the median of, per replay
repeat: now that it prices every layout's forward and backward (a one-process layout's exactly),
its median should outlast a slow spell of the host. Sixteen eager runs after the replay in each
of four fresh processes (``benchmarks/validate_llama.json``, one process, 2-vCPU EPYC,
2026-11-27): the median of runs 3-7 was 65.4, 64.5, 65.4 and 81.4 ms, of runs 4-16 65.8, 67.4,
64.3 and 76.2 (the fourth process ran into a slow spell: 89, 88, 84, ... 64 ms); the first two
or three runs of a process are 5-8 % slower than the rest."""


def real_tensor(fake: torch.Tensor) -> torch.Tensor:
    """A real CPU tensor of ``fake``'s shape, strides and dtype: floating and complex values
    in [0.01, 0.1) (positive, so square roots and logs of optimizer state are finite; far from
    subnormal), integers and booleans zero (an in-range index of any dim)."""
    out = torch.empty_strided(tuple(fake.shape), tuple(fake.stride()), dtype=fake.dtype, device="cpu")
    if fake.dtype.is_floating_point or fake.dtype.is_complex:
        out.copy_(torch.rand(tuple(fake.shape), dtype=torch.float32).mul_(0.09).add_(0.01))
    else:
        out.zero_()
    return out


def materialize(gm: torch.fx.GraphModule, inputs: list[Any]) -> list[Any]:
    """Swap every fake tensor the graph holds as an attribute (parameters, buffers, optimizer
    state) for :func:`real_tensor`; returns the placeholders' values: ``inputs`` (real tensors
    in placeholder order) where their shapes match, else real tensors like the traced ones."""
    from torch._subclasses.fake_tensor import FakeTensor

    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        obj = getattr(gm, node.target)
        if isinstance(obj, FakeTensor) or (isinstance(obj, torch.nn.Parameter) and isinstance(obj.data, FakeTensor)):
            real = real_tensor(obj)
            if isinstance(obj, torch.nn.Parameter):
                real = torch.nn.Parameter(real, requires_grad=obj.requires_grad)
            setattr(gm, node.target, real)
    args = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        val = node.meta.get("val")
        given = inputs[i] if i < len(inputs) else None
        if isinstance(given, torch.Tensor) and isinstance(val, torch.Tensor) and given.shape == val.shape \
                and given.dtype == val.dtype:
            args.append(given)
        else:
            args.append(torch.utils._pytree.tree_map_only(torch.Tensor, real_tensor, val))
    return args


def clock_floor_ns(clock: Callable[[], int], pairs: int = 2001) -> float:
    """What timing a call with ``clock`` adds to it: the median of ``pairs`` differences of two
    back-to-back reads (the first read's return, the second's entry, the Python between).

    The thread CPU clock is a system call, not a vDSO read: 0.58-0.60 µs a pair here, against
    0.06 µs for ``perf_counter_ns``. A node timed alone pays it once, and a step has 750-1,400
    nodes a micro-batch; replayed in turn with the real step in one process (eight rounds, one
    micro-batch each, the medians of their ratios), the replay's node sum was over the eager
    step's CPU time by 5.8 % (tiny-llama at 256 tokens, 748 nodes), 2.5 %
    (``benchmarks/validate_llama.json``) and 1.4 % (``validate_gpt.json``), and by 2.7, 1.2 and
    0.2 % less this floor."""
    diffs = []
    for _ in range(pairs):
        a = clock()
        diffs.append(clock() - a)
    return statistics.median(diffs)


def time_nodes(gm: torch.fx.GraphModule, args: list[Any], *, repeats: int = REPEATS,
               warmup: int = WARMUP) -> dict[torch.fx.Node, float]:
    """Seconds of each ``call_function`` node: its mean over ``repeats`` runs of the whole
    graph (after ``warmup`` runs), each node timed alone on the thread CPU clock (one torch
    thread) or the wall clock (more), less what the clock's reads add (:func:`clock_floor_ns`),
    all scaled by one factor so the nodes sum to the median run's sum (:func:`median_run_scale`).

    The real runs are measured at their median step; a slow spell of the machine falls on a
    whole run of the graph, not on single ops, and the plain means carried it into every node.
    Twelve runs of the one-process step of ``benchmarks/validate_llama.json`` in each of three
    fresh processes (2-vCPU EPYC VM, 2026-11-27, validate's malloc settings), forward and
    backward's priced nodes summed per run, the first left out: 74.3 65.9 64.7 66.7 63.7 75.1
    67.3 68.2 73.1 63.9 66.2, 70.1 73.5 78.7 64.5 63.4 63.3 64.5 64.9 74.6 76.6 66.1 and 68.7
    66.7 63.9 64.9 66.1 67.1 68.9 64.4 66.6 65.6 64.5 ms."""
    clock = time.thread_time_ns if torch.get_num_threads() == 1 else time.perf_counter_ns
    floor = clock_floor_ns(clock)
    times: dict[torch.fx.Node, list[int]] = defaultdict(list)

    class Timed(torch.fx.Interpreter):
        def __init__(self, into: dict | None) -> None:
            super().__init__(gm)  # frees each value after its last use, as the step does
            self.into = into

        def run_node(self, n: torch.fx.Node) -> Any:  # noqa: D102
            if n.op != "call_function":
                return super().run_node(n)
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            t0 = clock()
            out = n.target(*args, **kwargs)
            took = clock() - t0
            if self.into is not None:
                self.into[n].append(took)
            return out

    with torch.no_grad():
        for i in range(warmup + repeats):
            Timed(times if i >= warmup else None).run(*args)
    scale = median_run_scale([[t - floor for t in ts] for ts in times.values()])
    return {n: max(0.0, statistics.fmean(ts) - floor) * scale / 1e9 for n, ts in times.items()}


def median_run_scale(node_times: Sequence[Sequence[float]]) -> float:
    """The factor that takes the nodes' mean times to the median run's: the median over runs of
    each run's sum of its nodes, over the mean of those sums (1.0 with no run or no time).
    ``node_times[n][r]``: node ``n``'s time in run ``r``.

    >>> median_run_scale([[1.0, 1.0, 4.0], [2.0, 2.0, 2.0]])  # run sums 3, 3, 6: median 3, mean 4
    0.75
    """
    if not node_times or not node_times[0]:
        return 1.0
    sums = [math.fsum(run) for run in zip(*node_times, strict=True)]
    mean = statistics.fmean(sums)
    return statistics.median(sums) / mean if mean > 0 else 1.0


def priced_nodes(gm: torch.fx.GraphModule, groups: Any, node_s: Mapping[torch.fx.Node, float]
                 ) -> list[tuple[torch.fx.Node, Key, float]]:
    """(node, op-table key, seconds) of the timed nodes the simulator prices by the table: those
    whose single record is a profilable op (collectives and nodes that stand for several
    records are left out)."""
    from topomesh.trace.convert import node_records
    from topomesh.trace.graph import OpRecord, Phase

    out = []
    for node, seconds in node_s.items():
        records = node_records(node, gm, groups, Phase.FORWARD)
        if len(records) == 1 and isinstance(records[0], OpRecord) and profilable(records[0]):
            out.append((node, profile_key(records[0]), seconds))
    return out


def signature_times(gm: torch.fx.GraphModule, groups: Any, node_s: Mapping[torch.fx.Node, float]) -> dict[Key, float]:
    """Per op-table key, the mean in-step seconds of the nodes whose single record has that
    key (:func:`priced_nodes`)."""
    acc: dict[Key, list[float]] = defaultdict(list)
    for _, key, seconds in priced_nodes(gm, groups, node_s):
        acc[key].append(seconds)
    return {k: statistics.fmean(v) for k, v in acc.items()}


@dataclass(frozen=True, slots=True)
class InStep:
    """What one layout's replay measured: the op table of its step (:func:`signature_times`)
    and the host work its eager forward and backward do beyond those ops (:func:`eager_fb_s`
    less the replay's forward and backward; :func:`in_step_times` says why)."""

    table: dict[Key, float]
    host_fb_s: float | None = None
    """Thread seconds of one micro-batch's eager forward and backward on the fake group beyond
    the replay's sum of the same ops, negative where the eager step ran them for less; None:
    not measured (the eager step failed, or ``host=False``)."""


def mean_in_step(steps: Sequence[InStep]) -> InStep:
    """Several replays of one layout as one: each op's mean over the replays that timed it, the
    mean host work where every replay measured it (else None).

    >>> mean_in_step([InStep({("mm",): 1.0, ("add",): 0.5}, 2.0), InStep({("mm",): 3.0}, 4.0)])
    InStep(table={('mm',): 2.0, ('add',): 0.5}, host_fb_s=3.0)
    >>> mean_in_step([InStep({}, 2.0), InStep({}, None)]).host_fb_s is None
    True
    """
    acc: dict[Key, list[float]] = defaultdict(list)
    for step in steps:
        for key, seconds in step.table.items():
            acc[key].append(seconds)
    hosts = [st.host_fb_s for st in steps]
    host = None if not hosts or any(h is None for h in hosts) else statistics.fmean(hosts)
    return InStep({k: statistics.fmean(v) for k, v in acc.items()}, host)


def in_step_times(spec: Any, parallelize: Any, degrees: Mapping[str, int], *, batch_size: int,
                  dtype: torch.dtype, repeats: int = REPEATS, warmup: int = WARMUP,
                  host: bool = True) -> InStep:
    """In-step seconds per op-table key for one rank of ``degrees`` (see the module docstring);
    with ``host`` also the host work of its forward and backward beyond its ops, signed.

    Some steps run more than their graph's ops: tensor parallel (DTensor's dispatch, the styles'
    hooks and redistributions), expert parallel (its dispatch and combine hooks around the
    all-to-alls), activation checkpointing (saved-tensor hooks; ``selective``'s caching dispatch
    mode around every op of a block), FSDP2 (its units' hooks). Measured on ``tiny-moe`` at 128
    tokens, ``ep=2`` (one micro-batch, fake group, 2-vCPU Xeon): eager 16.3 and 17.3 ms against
    13.5 and 13.1 ms of replayed forward and backward ops. And a step can run its ops for less than
    the replay: the replay calls every node from Python through its ``OpOverload``, where the
    eager step calls the pieces of a composite op (``linear``'s transpose and matmul) and every
    backward op from C++. On ``tiny-moe`` at 128 tokens, one process, whose ops take 5-6 µs each
    (2-vCPU EPYC, 2026-11-27): the replayed forward and backward came to 1.19 times the eager
    step (median of five rounds; 1035 nodes), and the eager less the replay was -0.8, -1.1 and
    -1.9 ms of 11 ms a micro-batch in three fresh rounds; on ``benchmarks/validate_llama.json``
    (65 ms a micro-batch) -0.3 to -5.2 ms. Until 2026-11-27 only tensor and expert parallel and
    recomputation were measured so, and the difference was kept only where positive:
    ``tiny-moe``'s one-process step came out 27 % over (63.0 ms predicted, 49.5 measured)."""
    from topomesh.trace.graph import Phase
    from topomesh.trace.tracer import PHASE_META, with_step_graph

    out: dict[Key, float] = {}
    replayed: list[float] = []

    def use(gm: torch.fx.GraphModule, groups: Any) -> None:
        inputs, labels = spec.make_inputs(batch_size)
        real = [t for t in torch.utils._pytree.tree_leaves((inputs, labels)) if isinstance(t, torch.Tensor)]
        args = materialize(gm, real)
        node_s = time_nodes(gm, args, repeats=repeats, warmup=warmup)
        out.update(signature_times(gm, groups, node_s))
        replayed.append(sum(s for node, _, s in priced_nodes(gm, groups, node_s)
                            if node.meta.get(PHASE_META) in (Phase.FORWARD, Phase.BACKWARD)))

    with_step_graph(spec, parallelize, degrees, use, batch_size=batch_size, dtype=dtype)
    if not host:
        return InStep(out)
    try:
        eager = eager_fb_s(spec, parallelize, degrees, batch_size=batch_size, dtype=dtype,
                           repeats=EAGER_REPEATS * repeats, warmup=3)
    except Exception as exc:  # the user's model on real tensors: the per-CPU figures price it instead
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        print(f"topomesh: {dict(degrees)}: the eager step for the host work beyond its ops failed "
              f"({type(exc).__name__}: {first}); its ops keep this CPU's measured figures", file=sys.stderr)
        return InStep(out)
    return InStep(out, eager - replayed[0])


def eager_fb_s(spec: Any, parallelize: Any, degrees: Mapping[str, int], *, batch_size: int, dtype: torch.dtype,
               repeats: int = REPEATS, warmup: int = 2) -> float:
    """Median seconds (the clock :func:`time_nodes` uses) of one eager forward, loss and
    backward of a rank of ``degrees``, real tensors on a fake process group (collectives return
    at once), after ``warmup`` runs (lazy initialization).

    The replay prices a step's ops; the eager step also runs what is not an op of its graph:
    under tensor parallel, DTensor's dispatch, the parallel styles' hooks and redistributions,
    autograd around them. Measured on ``benchmarks/validate_llama.json`` at ``tp=2`` (one
    micro-batch, one thread, 2-vCPU Xeon): 71.7 ms eager against 30.2 ms of replayed forward
    and backward ops; less the collectives' host work, 33 µs a traced op beyond them (28 µs in
    another run minutes before), where the built-in model at hidden 64
    (:func:`~topomesh.cost.dispatch.measure_tp_host_s`) gave 26-36 µs in three runs within minutes.
    Taken in the same child as the replay, just before the real run, it follows the VM's drift."""
    from topomesh.layout import groups
    from topomesh.trace.tracer import (
        build_model,
        fake_process_group,
        loss_context,
        normalize_layout,
    )

    axes = normalize_layout(degrees)
    clock = time.thread_time_ns if torch.get_num_threads() == 1 else time.perf_counter_ns
    with fake_process_group(math.prod(d for _, d in axes)):
        mesh = groups.init_mesh("cpu", [d for _, d in axes], [a for a, _ in axes])
        torch.manual_seed(0)
        model = build_model(spec, spec.n_layers, dtype)
        if parallelize is not None:
            model = parallelize(model, mesh) or model
        inputs, labels = spec.make_inputs(batch_size)
        times = []
        for i in range(warmup + repeats):
            model.zero_grad(set_to_none=True)
            t0 = clock()
            out = model(*inputs)
            with loss_context(out):
                spec.loss(out, labels).backward()
            if i >= warmup:
                times.append(clock() - t0)
    return statistics.median(times) / 1e9


def run(spec: Mapping[str, Any]) -> dict[str, dict]:
    """The child process's work: ``spec`` names the model, training knobs, thread count and
    layouts (``{"text", "degrees", "order"}``); returns per layout text ``{"ops": [[key,
    seconds], ...], "host_fb_s": seconds or None}`` (:class:`InStep`)."""
    from topomesh.layout.api import resolve_layout
    from topomesh.sim.inputs import load_model
    from topomesh.sim.schedules import Schedule
    from topomesh.sim.simulate import Training, trace_request

    torch.set_num_threads(int(spec["threads"]))
    torch.set_num_interop_threads(1)
    model = load_model(spec["model"], seq_len=spec.get("seq_len"))
    training = Training(**{**spec["training"], "schedule": Schedule(spec["training"]["schedule"])})
    result: dict[str, dict] = {}
    for item in spec["layouts"]:
        degrees = {str(k): int(v) for k, v in item["degrees"].items()}
        layout = resolve_layout(degrees, math.prod(degrees.values()), order=item.get("order"))
        (mspec, parallelize, traced), kw = trace_request(model, layout, training)
        got = in_step_times(mspec, parallelize, traced, batch_size=kw["batch_size"], dtype=kw["dtype"],
                            repeats=int(spec.get("repeats", REPEATS)))
        result[item["text"]] = {"ops": [[list(k), s] for k, s in got.table.items()], "host_fb_s": got.host_fb_s}
    return result


def read_result(path: Path) -> dict[str, InStep]:
    """The child's output file, checked: per layout text, its :class:`InStep`."""
    from topomesh.topology.api import read_json

    raw = read_json(path, what="in-step op times", error=LayoutError)
    if not isinstance(raw, dict):
        raise LayoutError(f"{path}: in-step op times must be a JSON object.")
    out: dict[str, InStep] = {}
    for layout, item in raw.items():
        where = f"{path}: layout {str(layout)[:40]}"
        if not isinstance(item, dict) or not isinstance(item.get("ops"), list):
            raise LayoutError(f"{where}: expected an object with an \"ops\" list.")
        table: dict[Key, float] = {}
        for row in item["ops"]:
            ok = (isinstance(row, list) and len(row) == 2 and isinstance(row[0], list) and len(row[0]) == 5
                  and all(isinstance(x, str) for x in row[0]) and isinstance(row[1], int | float) and 0 <= row[1] < 1e4)
            if not ok:
                raise LayoutError(f"{where}: a malformed in-step op time.")
            table[tuple(row[0])] = float(row[1])
        host = item.get("host_fb_s")
        if host is not None and not (isinstance(host, int | float) and -1e4 < host < 1e4):
            raise LayoutError(f"{where}: host_fb_s must be seconds in (-1e4, 1e4) or null, got {str(host)[:40]}.")
        out[str(layout)] = InStep(table, None if host is None else float(host))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="in-step op times of layouts' traced steps (topomesh validate)")
    p.add_argument("--spec", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    from topomesh.topology.api import write_atomic

    write_atomic(args.out, json.dumps(run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
