"""Run a search: enumerate the space, prune it, trace each layout class once, score every
layout, rank them.

Work is split into tasks of plain inputs (:mod:`topomesh.search.evaluate`) and run here
(``workers=1``), in local worker processes (``concurrent.futures.ProcessPoolExecutor``, spawned
so no torch threads are forked) or as Ray tasks on an existing Ray cluster (``ray_address``).
Results are put in a canonical order before ranking, so every way of running gives the
same plan.

1. **Tracing**: one task item per traced class — (degrees other than ``pp``, ``dp_replicate``
   above 1 at its shared degree, micro-batch, recompute) — with the layout classes it serves;
   the trace lands in the on-disk trace cache (:class:`~topomesh.trace.cache.TraceCache`) and
   the digest of each class it serves next to it (:mod:`topomesh.sim.digest`), made while the
   trace is in memory, where the scoring tasks find them (a task whose cache misses traces or
   digests again: slower, never different).
2. **Scoring**: one item per degree row and its surviving knob rows; the orders share
   results by link signature (:func:`~topomesh.search.evaluate.score_cell`) unless
   ``exhaustive``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from topomesh.errors import LayoutError
from topomesh.layout.dims import Layout
from topomesh.search.evaluate import (
    Cell,
    Context,
    PlanInputs,
    Scored,
    score_cells,
    trace_and_digest,
    trace_classes,
    with_order,
)
from topomesh.search.prune import PruneResult, PruneSetup, prune
from topomesh.search.space import (
    AXES,
    COLUMN,
    Knobs,
    KnobTable,
    Space,
    enumerate_space,
    permutations,
)
from topomesh.sim.result import StepResult
from topomesh.sim.simulate import placed_ranks

TRACE_BATCH = 8
"""Most classes in one tracing task."""

Progress = Callable[[str, int, int], None]
"""``progress(phase, done, total)``; phase is ``"tracing"`` or ``"scoring"``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One scored layout."""

    index: int
    """Layout id in the space (degree row and order)."""
    knob: int
    """Knob row."""
    layout: Layout
    knobs: Knobs
    result: StepResult


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Everything a search found (see DESIGN.md "Plan file")."""

    inputs: PlanInputs
    space: Space
    pruning: PruneResult
    traced_classes: int
    evaluated: int
    """Layouts scored (every order and knob row counted)."""
    simulated: int
    """Simulator runs (one per link-signature group on the fast path)."""
    failed: dict[str, int]
    """Layouts that could not be traced or simulated, by the error's message."""
    elapsed_s: float
    entries: tuple[Entry, ...]
    """Every scored layout, best first: feasible ones by step time, then peak memory."""
    world_size: int
    cluster_name: str
    model_name: str
    placed: tuple[int, ...]
    """The topology placement's rank list (``placed[logical] = physical``) every layout uses."""
    hosts: tuple[int, ...]
    """Ranks on each host of the cluster's topology, in host order."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def feasible(self) -> int:
        return sum(1 for e in self.entries if e.result.feasible)

    @property
    def best(self) -> Entry | None:
        return self.entries[0] if self.entries and self.entries[0].result.feasible else None


def search(
    inputs: PlanInputs,
    *,
    strategies: Sequence[str] | None = None,
    fixed: dict[str, int] | None = None,
    knobs: KnobTable | None = None,
    exhaustive: bool = False,
    workers: int = 1,
    ray_address: str | None = None,
    progress: Progress | None = None,
    chunks_per_worker: int = 4,
) -> Plan:
    """Search every layout of ``inputs``' model on its cluster (see the module docstring)."""
    t0 = time.perf_counter()
    if workers < 1:
        raise LayoutError(f"--workers must be a positive integer, got {workers}.")
    ctx = Context.build(inputs)
    world = ctx.cluster.world_size
    space = enumerate_space(world, strategies=strategies, fixed=fixed, knobs=knobs)
    pruning = _prune(ctx, inputs, space)
    cells = _cells(space, pruning)
    classes = list(dict.fromkeys(_trace_class(c.degrees, kn) for c in cells for _, kn in c.knobs))
    serves: dict[tuple, dict[tuple[int, ...], None]] = {}  # trace class -> the layout classes it serves
    for c in cells:
        for _, kn in c.knobs:
            serves.setdefault(_trace_class(c.degrees, kn), {})[_without_pp(c.degrees)] = None
    parallel = workers > 1 or ray_address is not None
    slots = (workers if ray_address is None else max(workers, 1)) * chunks_per_worker

    errors: dict[tuple, str] = {}
    from topomesh.search.evaluate import stored

    # reading every stored trace only to find it there would cost more than scoring (scoring
    # reads the class digests, :mod:`topomesh.sim.digest`): skip those, and the classes that
    # failed to trace before for a reason that would repeat (the cache keeps why)
    to_trace = []
    for c in classes:
        have, failed = stored(inputs, ctx.model, ctx.sim.cache, *c)
        if failed is not None:
            errors[c] = failed
        elif not have:
            to_trace.append(c)
    if parallel:
        # small batches (a trace takes seconds): no worker idles long while another finishes
        items = [(c, tuple(serves[c])) for c in to_trace]
        batches = _split(items, max(slots, math.ceil(len(items) / TRACE_BATCH)))
        done = 0
        for batch, result in _run(trace_and_digest, inputs, batches, workers, ray_address):
            for (cls, _), err in zip(batch, result, strict=True):
                if err is not None:
                    errors[cls] = err
            done += len(batch)
            _tell(progress, "tracing", done + len(classes) - len(to_trace), len(classes))
    else:
        from topomesh.search.evaluate import trace_one

        for i, (degrees, kn) in enumerate(to_trace):
            err = trace_one(inputs, ctx.model, ctx.sim.cache, degrees, kn)
            if err is not None:
                errors[(degrees, kn)] = err
            _tell(progress, "tracing", i + 1 + len(classes) - len(to_trace), len(classes))

    suspect = {c: e for c, e in errors.items() if "process group" in e}  # the symptom, see _retry_isolated
    if suspect and inputs.cache_dir is not None:
        still = _retry_isolated(inputs, suspect, workers)
        errors = {c: e for c, e in errors.items() if c not in suspect or c in still}
    retried = len(suspect)
    scored: list[Scored] = []
    if errors:  # a class that failed to trace fails for every layout of it: not traced again
        cells, failed_cells = _drop_failed(cells, errors)
        scored.extend(failed_cells)
    if parallel:
        from topomesh.search.evaluate import use_context

        use_context(ctx)  # this process scores batches too (see _run), on the context it built
        done = 0
        try:
            for batch, result in _run(_score_task(exhaustive), inputs, _split_by_trace(cells, slots), workers,
                                      ray_address, here=True):
                scored.extend(result)
                done += len(batch)
                _tell(progress, "scoring", done, len(cells))
        finally:
            use_context(None)
    else:
        from topomesh.search.evaluate import score_cell

        for i, cell in enumerate(cells):
            scored.extend(score_cell(ctx, cell, exhaustive=exhaustive))
            _tell(progress, "scoring", i + 1, len(cells))

    entries, failed = _entries(space, scored)
    return Plan(
        inputs=inputs, space=space, pruning=pruning, traced_classes=len(classes),
        evaluated=len(entries), simulated=sum(1 for s in scored if s.result is not None), failed=failed,
        elapsed_s=time.perf_counter() - t0, entries=entries, world_size=world, cluster_name=ctx.cluster.name,
        model_name=ctx.model.spec.name, placed=placed_ranks(ctx.cluster, ctx.sim._memo),
        hosts=tuple(len(g) for g in ctx.cluster.topology.ranks_by_host()),
        extra={"trace_errors": len(errors), "trace_retried": retried, "exhaustive": exhaustive, "n_layers": ctx.model.spec.n_layers},
    )


def _tell(progress: Progress | None, phase: str, done: int, total: int) -> None:
    if progress is not None:
        progress(phase, done, total)


def _prune(ctx: Context, inputs: PlanInputs, space: Space) -> PruneResult:
    """Pruning for a built-in model; a user's own model keeps every cell (simulating says what fails)."""
    from topomesh.search.prune import _REASONS

    cfg = ctx.model.config
    if cfg is None:
        shape = (len(space.degrees), len(space.knobs))
        return PruneResult(reason=np.full(shape, -1, dtype=np.int8),
                           memory_lower_bound_bytes=np.zeros(shape), pruned={r.value: 0 for r in _REASONS},
                           kept=space.size)
    setup = PruneSetup(model=cfg, global_batch=inputs.global_batch, device_memory_bytes=ctx.cluster.device.memory_bytes,
                       seq_len=inputs.seq_len or ctx.model.seq_len, sequence_parallel=inputs.sequence_parallel,
                       activation_bytes=4 if inputs.dtype in ("fp32", "float32") else 2)
    return prune(space, setup)


def _cells(space: Space, pruning: PruneResult) -> list[Cell]:
    knob_rows = space.knobs.rows()
    keep = pruning.keep
    out = []
    for r in np.flatnonzero(keep.any(axis=1)).tolist():
        ks = tuple((k, knob_rows[k]) for k in np.flatnonzero(keep[r]).tolist())
        out.append(Cell(row=r, degrees=tuple(int(d) for d in space.degrees[r]), knobs=ks))
    return out


def _retry_isolated(inputs: PlanInputs, errors: dict[tuple, str], workers: int) -> dict[tuple, str]:
    """Trace each failed class again alone in a fresh process; the errors that remain.

    Tracing several classes one after another in one process can fail where the same class
    traced alone succeeds (state the tracer leaves behind between fake process groups: seen as
    "Could not resolve the process group registered under the name N"). A class's result must
    not depend on what was traced before it in the same worker, so a failure is only believed
    when it repeats alone. The traces land in the on-disk cache, where scoring finds them.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    classes = list(errors)
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(classes))), max_tasks_per_child=1,
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(trace_classes, [inputs] * len(classes), [[c] for c in classes]))
    return {c: r[0] for c, r in zip(classes, results, strict=True) if r[0] is not None}


def _drop_failed(cells: list[Cell], errors: dict[tuple, str]) -> tuple[list[Cell], list[Scored]]:
    kept: list[Cell] = []
    failed: list[Scored] = []
    for c in cells:
        ok = []
        for k, kn in c.knobs:
            err = errors.get(_trace_class(c.degrees, kn))
            if err is None:
                ok.append((k, kn))
            else:
                n = math.factorial(sum(1 for d in c.degrees if d > 1))
                failed.append(Scored(row=c.row, result=None, members=tuple((p, k) for p in range(n)), error=err))
        if ok:
            kept.append(Cell(row=c.row, degrees=c.degrees, knobs=tuple(ok)))
    return kept, failed


def _trace_class(degrees: tuple[int, ...], knobs: Knobs) -> tuple[tuple[int, ...], Knobs]:
    """What one trace serves (:func:`~topomesh.trace.cache.shared_class`): the degrees without
    ``pp`` (a stage runs the same block step) and with ``dp_replicate`` above 1 at its shared
    degree, and the knobs a trace depends on."""
    from topomesh.layout.dims import Axis
    from topomesh.trace.cache import SHARED_REPLICATE

    out = list(_without_pp(degrees))
    if out[COLUMN[Axis.DP_REPLICATE]] > 1:
        out[COLUMN[Axis.DP_REPLICATE]] = SHARED_REPLICATE
    return tuple(out), _class_knobs(knobs)


def _without_pp(degrees: tuple[int, ...]) -> tuple[int, ...]:
    """The degrees of a layout class (``pp`` does not change a rank's trace)."""
    from topomesh.layout.dims import Axis

    out = list(degrees)
    out[COLUMN[Axis.PP]] = 1
    return tuple(out)


def _class_knobs(k: Knobs) -> Knobs:
    """The knobs a trace depends on (micro-batch, recompute); schedule and interleave set to
    their first values, so classes that differ only there are traced once."""
    from topomesh.sim.schedules import Schedule

    return Knobs(micro_batch=k.micro_batch, recompute=k.recompute, schedule=Schedule.ONE_F_ONE_B, interleave=1)


def _split(items: Sequence, parts: int) -> list[list]:
    """``items`` in up to ``parts`` interleaved batches (big and small rows spread evenly)."""
    parts = max(1, min(parts, len(items)))
    return [list(items[i::parts]) for i in range(parts)] if items else []


def _split_by_trace(cells: Sequence[Cell], parts: int) -> list[list[Cell]]:
    """``cells`` in up to ``parts`` batches of about equal layouts, the cells of one trace in one
    batch (a task reads each trace it scores from the cache once)."""
    groups: dict[tuple, list[Cell]] = {}
    for c in cells:
        groups.setdefault(_trace_class(c.degrees, c.knobs[0][1]), []).append(c)
    weight = {k: sum(math.factorial(sum(1 for d in c.degrees if d > 1)) * len(c.knobs) for c in g)
              for k, g in groups.items()}
    parts = max(1, min(parts, len(groups)))
    batches: list[list[Cell]] = [[] for _ in range(parts)]
    load = [0] * parts
    for k in sorted(groups, key=lambda k: -weight[k]):  # heaviest first onto the lightest batch
        i = load.index(min(load))
        batches[i].extend(groups[k])
        load[i] += weight[k]
    return [b for b in batches if b]


def _score_task(exhaustive: bool) -> Callable[[PlanInputs, list[Cell]], list[Scored]]:
    """A plain function (Ray tasks take no partials)."""
    from topomesh.search.evaluate import score_cells_exhaustive

    return score_cells_exhaustive if exhaustive else score_cells


def _run(fn: Callable[[PlanInputs, list], list], inputs: PlanInputs, batches: list[list], workers: int,
         ray_address: str | None, *, here: bool = False) -> Iterator[tuple[list, list]]:
    """``fn(inputs, batch)`` for every batch, as they finish: Ray tasks or local processes.

    ``here``: with local processes, this process is one of the ``workers`` — it runs batches
    itself between collecting the others' — so only ``workers - 1`` are started (a started
    worker spends seconds importing torch and building the cluster that this process holds)."""
    if not batches:
        return
    if ray_address is not None:
        yield from _run_ray(fn, inputs, batches, ray_address)
        return
    import multiprocessing
    from collections import deque
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    started = workers - 1 if here else workers
    if started < 1:
        for b in batches:
            yield b, fn(inputs, b)
        return
    pending = deque(batches)  # heaviest first: the pool takes from the front, this process from the back
    pool = ProcessPoolExecutor(max_workers=started, mp_context=multiprocessing.get_context("spawn"))
    running: dict = {}
    try:
        while pending or running:
            while pending and len(running) < (2 * started if here else len(batches)):
                b = pending.popleft()
                running[pool.submit(fn, inputs, b)] = b
            if here and pending:
                b = pending.pop()
                yield b, fn(inputs, b)
                finished = [f for f in running if f.done()]
            else:
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in finished:
                yield running.pop(f), f.result()
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    # every result is in: the workers exit (a second or more, freeing what they built) while
    # this process ranks the results; the interpreter joins them at exit at the latest
    pool.shutdown(wait=False)


def _run_ray(fn: Callable[[PlanInputs, list], list], inputs: PlanInputs, batches: list[list],
             address: str) -> Iterator[tuple[list, list]]:
    try:
        import ray
    except ImportError:
        raise LayoutError("--ray needs Ray: pip install 'topomesh[ray]'.") from None
    if not ray.is_initialized():
        ray.init(address=None if address in ("", "local") else address, log_to_driver=False,
                 include_dashboard=False)
    remote = ray.remote(fn)
    pending = {remote.remote(inputs, b): b for b in batches}
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            yield pending.pop(ref), ray.get(ref)


def _entries(space: Space, scored: list[Scored]) -> tuple[tuple[Entry, ...], dict[str, int]]:
    """Every scored layout as an :class:`Entry`, ranked; failures counted by message."""
    knob_rows = space.knobs.rows()
    failed: dict[str, int] = {}
    out: list[Entry] = []
    for s in scored:
        if s.result is None:
            failed[s.error or "unknown"] = failed.get(s.error or "unknown", 0) + len(s.members)
            continue
        base = int(space.offsets[s.row])
        degrees = {a.value: int(d) for a, d in zip(AXES, space.degrees[s.row], strict=True)}
        used = space.used_axes(s.row)
        perms = permutations(len(used)).tolist()
        for i, (perm, k) in enumerate(s.members):
            lay = Layout(**degrees, order=tuple(used[j] for j in perms[perm]))
            result = s.result if i == 0 else with_order(s.result, lay)
            out.append(Entry(index=base + perm, knob=k, layout=lay, knobs=knob_rows[k], result=result))
    out.sort(key=rank_key)
    return tuple(out), dict(sorted(failed.items()))


def rank_key(e: Entry) -> tuple:
    """Feasible first, then step time, peak memory, and the layout id and knob row (a total order)."""
    r = e.result
    return (not r.feasible, r.step_time_s, r.peak_memory_bytes, e.index, e.knob)
