"""The work of one search task, run in a worker process or a Ray task: trace layout classes,
and score every order and knob row of degree rows.

A task gets only plain, picklable inputs (:class:`PlanInputs`: the command line's model,
cluster and training values; :class:`Cell`: a degree row and its knob rows) and rebuilds the
model, the cluster and a :class:`~topomesh.sim.simulate.Simulator` from them, so the same
function runs in this process, in a local worker or on a Ray node.

Sharing (fast path, :func:`score_cell`). What :func:`~topomesh.sim.simulate.simulate` returns
for a layout depends on the order of its axes only through the links its groups cross
(``StepResult.links``: one :class:`~topomesh.cost.cluster.AxisLink` per collective axis of the
trace and per mesh axis) and the two order fields of ``StepResult.layout``. So the orders of a
(degree row, knob row) are grouped by the tuple of those links (their *link signature*, from
the memoized :func:`~topomesh.sim.simulate.memo_axis_link`); one order per group is simulated
and the others get its result with their own order written in. ``exhaustive`` simulates every
order instead; the two agree exactly (tests/search/test_run.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from topomesh.errors import TopomeshError
from topomesh.layout.dims import Axis, Layout
from topomesh.search.space import AXES, Knobs, permutations
from topomesh.sim.result import StepResult


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanInputs:
    """What a task needs to rebuild the model, the cluster and the simulator (picklable)."""

    model: str
    """``--model``: a preset, a config .json or ``path.py:fn``."""
    global_batch: int
    """Samples per optimizer step."""
    seq_len: int | None = None
    cluster: str | None = None
    topology: str | None = None
    device: str | None = None
    gpus: int | None = None
    dtype: str = "bf16"
    sequence_parallel: bool = True
    mixed_precision: bool = True
    db: str | None = None
    """Op-profile database (``--db``); the shared default when present."""
    cache_dir: str | None = None
    """Trace cache directory; ``None`` keeps traces in memory only."""

    @property
    def gpu(self) -> bool:
        """Whether the cluster's ranks are GPUs, whose steps are traced as a GPU runs them
        (:func:`~topomesh.sim.simulate.gpu_kernels`), told without building the cluster: all
        but the ``local`` preset and a topology file priced as this CPU (``--device cpu``), as
        :func:`~topomesh.sim.inputs.cluster_from_args` builds them."""
        from topomesh.cost.cluster import LOCAL

        if self.topology is not None:
            return (self.device or "").lower() != "cpu"
        return self.cluster != LOCAL


@dataclass(frozen=True, slots=True, kw_only=True)
class Cell:
    """One degree row of the space and the knob rows of it that survived pruning."""

    row: int
    degrees: tuple[int, ...]
    """Degrees in :data:`~topomesh.search.space.AXES` order."""
    knobs: tuple[tuple[int, Knobs], ...]
    """(knob row index, knobs)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Scored:
    """One simulated layout and every (order, knob row) of the same cell that shares its result."""

    row: int
    result: StepResult | None
    """``None`` when the class could not be traced or simulated (see ``error``)."""
    members: tuple[tuple[int, int], ...]
    """(permutation index, knob row index) of every layout this result is for."""
    error: str | None = None


@dataclass(slots=True)
class Context:
    """The model, cluster and simulator of one task (built once per task)."""

    inputs: PlanInputs
    model: Any
    cluster: Any
    sim: Any

    @classmethod
    def build(cls, inputs: PlanInputs) -> Context:
        from topomesh.cost.opdb import device_table
        from topomesh.sim.inputs import load_model
        from topomesh.sim.simulate import Simulator
        from topomesh.trace.cache import TraceCache

        model = load_model(inputs.model, seq_len=inputs.seq_len)
        cluster = build_cluster(inputs)
        sim = Simulator(model=model, cluster=cluster, cache=TraceCache(inputs.cache_dir),
                        table=device_table(cluster.device, db=inputs.db, threads=cluster.threads_per_rank))
        return cls(inputs=inputs, model=model, cluster=cluster, sim=sim)

    def training(self, knobs: Knobs) -> Any:
        return training_for(self.inputs, self.model, knobs)


def training_for(inputs: PlanInputs, model: Any, knobs: Knobs) -> Any:
    """The :class:`~topomesh.sim.simulate.Training` of one knob row."""
    from topomesh.sim.simulate import Training

    i = inputs
    return Training(global_batch=i.global_batch, micro_batch=knobs.micro_batch, seq_len=i.seq_len or model.seq_len,
                    dtype=i.dtype, recompute=knobs.recompute.value, sequence_parallel=i.sequence_parallel,
                    schedule=knobs.schedule, interleave=knobs.interleave, mixed_precision=i.mixed_precision)


def build_cluster(inputs: PlanInputs) -> Any:
    """The cluster ``--cluster``/``--topology``/``--gpus`` name (as ``topomesh simulate`` builds it)."""
    import argparse

    from topomesh.sim.inputs import cluster_from_args

    return cluster_from_args(argparse.Namespace(cluster=inputs.cluster, topology=inputs.topology,
                                                device=inputs.device, gpus=inputs.gpus))


def cell_layouts(cell: Cell) -> list[Layout]:
    """Every order of the cell's used axes, in :func:`~topomesh.search.space.permutations` order."""
    used = [a for a, d in zip(AXES, cell.degrees, strict=True) if d > 1]
    degrees = {a.value: d for a, d in zip(AXES, cell.degrees, strict=True)}
    return [Layout(**degrees, order=tuple(used[i] for i in perm)) for perm in permutations(len(used)).tolist()]


def trace_classes(inputs: PlanInputs, classes: Sequence[tuple[tuple[int, ...], Knobs]]) -> list[str | None]:
    """Trace each (degrees, knobs) class into the cache; per class ``None`` or the error.
    Builds the model only (a cluster of many thousand ranks takes seconds to build)."""
    from topomesh.sim.inputs import load_model
    from topomesh.trace.cache import TraceCache

    model = load_model(inputs.model, seq_len=inputs.seq_len)
    cache = TraceCache(inputs.cache_dir)
    return [trace_one(inputs, model, cache, degrees, knobs) for degrees, knobs in classes]


def trace_and_digest(inputs: PlanInputs,
                     items: Sequence[tuple[tuple[tuple[int, ...], Knobs], Sequence[tuple[int, ...]]]]) -> list[str | None]:
    """Trace each class of ``items`` (``((degrees, knobs), real degree rows)``) into the cache and
    store the digest of each real row it serves (:mod:`topomesh.sim.digest`) while the trace is
    in memory, so scoring reads neither; per item ``None`` or the trace error. A real row that
    cannot be digested is left for scoring, which reports it."""
    ctx = _context(inputs)
    out: list[str | None] = []
    for (degrees, knobs), reals in items:
        err = trace_one(inputs, ctx.model, ctx.sim.cache, degrees, knobs)
        out.append(err)
        if err is not None:
            continue
        training = ctx.training(knobs)
        for real in reals:
            with contextlib.suppress(TopomeshError):
                ctx.sim.digest(layout_of(real, AXES), training)
    return out


def stored(inputs: PlanInputs, model: Any, cache: Any, degrees: tuple[int, ...], knobs: Knobs) -> tuple[bool, str | None]:
    """Whether the trace cache holds what scoring the class reads (:meth:`TraceCache.stored`),
    and why the class failed to trace before when the cache keeps that (:meth:`TraceCache.failure`)."""
    from topomesh.sim.simulate import trace_request

    args, kw = trace_request(model, layout_of(degrees, AXES), training_for(inputs, model, knobs), gpu=inputs.gpu)
    return cache.stored(*args, **kw), cache.failure(*args, **kw)


def trace_one(inputs: PlanInputs, model: Any, cache: Any, degrees: tuple[int, ...], knobs: Knobs) -> str | None:
    """Trace one class (``None``) or say why it cannot be traced."""
    from topomesh.sim.simulate import trace_layout

    try:
        trace_layout(model, layout_of(degrees, AXES), training_for(inputs, model, knobs), cache, gpu=inputs.gpu)
    except TopomeshError as exc:
        return str(exc)
    return None


def score_cells(inputs: PlanInputs, cells: Sequence[Cell], exhaustive: bool = False) -> list[Scored]:
    """:func:`score_cell` for each cell, on the task process's context for ``inputs``."""
    ctx = _context(inputs)
    return [s for cell in cells for s in score_cell(ctx, cell, exhaustive=exhaustive)]


_CONTEXTS: dict[PlanInputs, Context] = {}


def _context(inputs: PlanInputs) -> Context:
    """One context per process and inputs (the last one kept): a pool runs several tasks in one
    process, and building a cluster of many thousand ranks and its placement takes seconds. Its
    memo only shares exact results (see :class:`~topomesh.sim.simulate.SimMemo`)."""
    ctx = _CONTEXTS.get(inputs)
    if ctx is None:
        ctx = Context.build(inputs)
        use_context(ctx)
    return ctx


def use_context(ctx: Context | None) -> None:
    """Make ``ctx`` the context :func:`score_cells` uses in this process for its inputs (the
    search's own process scores batches too, on the context it already built); ``None``
    forgets it (the search is done with it)."""
    _CONTEXTS.clear()
    if ctx is not None:
        _CONTEXTS[ctx.inputs] = ctx


def score_cells_exhaustive(inputs: PlanInputs, cells: Sequence[Cell]) -> list[Scored]:
    """:func:`score_cells` simulating every order (``--exhaustive``)."""
    return score_cells(inputs, cells, exhaustive=True)


def score_cell(ctx: Context, cell: Cell, *, exhaustive: bool = False) -> list[Scored]:
    """Every order × knob row of ``cell`` (see the module docstring for the sharing)."""
    from topomesh.sim.simulate import memo_axis_link

    layouts = cell_layouts(cell)
    out: list[Scored] = []
    for k, knobs in cell.knobs:
        training = ctx.training(knobs)
        try:
            digest = ctx.sim.digest(layouts[0], training)
        except TopomeshError as exc:
            out.append(Scored(row=cell.row, result=None, members=tuple((p, k) for p in range(len(layouts))),
                              error=str(exc)))
            continue
        if exhaustive:
            out.extend(_simulate(ctx, cell.row, lay, training, ((p, k),)) for p, lay in enumerate(layouts))
            continue
        names = sorted(set(digest.axes) | {a.value for a in layouts[0].mesh_axes
                                                      if layouts[0].degree(a) > 1})
        groups: dict[tuple, list[int]] = {}
        memo = ctx.sim._memo
        for p, lay in enumerate(layouts):
            signature = tuple(memo_axis_link(ctx.cluster, lay, n, memo) for n in names)
            groups.setdefault(signature, []).append(p)
        for perms in groups.values():
            out.append(_simulate(ctx, cell.row, layouts[perms[0]], training, tuple((p, k) for p in perms), digest))
    return out


def _simulate(ctx: Context, row: int, layout: Layout, training: Any, members: tuple[tuple[int, int], ...],
              digest: Any = None) -> Scored:
    try:
        result = ctx.sim.simulate(layout, training, digest=digest)
    except TopomeshError as exc:
        return Scored(row=row, result=None, members=members, error=str(exc))
    return Scored(row=row, result=result, members=members)


def with_order(result: StepResult, layout: Layout) -> StepResult:
    """``result`` (of a layout with the same degrees and links) for ``layout``'s order."""
    names, text = _order_names(layout.order)
    shown = {**result.layout, "degrees": {n: getattr(layout, n) for n in names}, "order": text}
    return dataclasses.replace(result, layout=shown, timeline=None)


@functools.lru_cache(maxsize=8192)
def _order_names(order: tuple[Axis, ...]) -> tuple[tuple[str, ...], str]:
    """The axis names of an order and its text (``Layout.order_text``), once per order."""
    names = tuple(a.value for a in order)
    return names, "-".join(names)


def layout_of(degrees: Sequence[int], order: Sequence[Axis]) -> Layout:
    return Layout(**{a.value: int(d) for a, d in zip(AXES, degrees, strict=True)}, order=tuple(order))
