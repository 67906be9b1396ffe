"""Simulate one training step of a layout: trace its class (cached), price it on the cluster
under the placement, run the pipeline schedule, and account memory.

>>> import torch
>>> from topomesh.cost.cluster import load_cluster
>>> from topomesh.layout.dims import Layout
>>> from topomesh.models.presets import get_preset
>>> model = builtin_model(get_preset("tiny-llama"))
>>> r = simulate(model, load_cluster("dgx-h100", gpus=8), Layout(tp=2, dp_shard=4),
...              Training(global_batch=8, micro_batch=1))
>>> r.feasible, r.world_size, round(r.breakdown.total_s / r.step_time_s, 6)
(True, 8, 1.0)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from topomesh.cost.cluster import AxisLink, Cluster, axis_link
from topomesh.cost.devices import DeviceKind
from topomesh.errors import LayoutError
from topomesh.layout.dims import Axis, Layout
from topomesh.layout.place import Placement, Strategy, locality_order
from topomesh.sim.engine import EngineResult, Piece, StagePlan, simulate_pipeline
from topomesh.sim.price import (
    ClassDigest,
    PricedClass,
    Pricer,
    Stream,
    SymbolicPricer,
    Work,
    memo_digest,
    price_digest,
)
from topomesh.sim.result import StageMemory, StepBreakdown, StepResult
from topomesh.sim.schedules import (
    RUNTIME_UNSHARDED_STAGES,
    Action,
    Kind,
    Schedule,
    action_order,
    rank_stages,
    stage_count,
    unshard_points,
)
from topomesh.sim.timeline import chrome_trace
from topomesh.trace.cache import TraceCache
from topomesh.trace.graph import CollectiveKind, CollectiveRecord
from topomesh.trace.result import StateBytes, Trace
from topomesh.trace.tracer import ModelSpec, ParallelizeFn, default_optimizer

if TYPE_CHECKING:
    from topomesh.sim.digest import DigestStore

RECOMPUTE = ("none", "selective", "full")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


@dataclass(frozen=True, slots=True, kw_only=True)
class Training:
    """The training knobs of a step (the same names as the CLI flags)."""

    global_batch: int
    """Samples per optimizer step over the whole job."""
    micro_batch: int = 1
    """Samples per micro-batch on one data-parallel rank."""
    seq_len: int | None = None
    """Tokens per sample (for tokens/s); the model's own when None."""
    dtype: str = "bf16"
    recompute: str = "none"
    sequence_parallel: bool = True
    schedule: Schedule = Schedule.ONE_F_ONE_B
    interleave: int = 1
    """Virtual stages per pipeline rank (interleaved schedules)."""
    mixed_precision: bool = True
    """With a data-parallel or context-parallel axis (where FSDP2 runs): float32 master
    weights and optimizer state, parameters gathered and computed in ``dtype``, gradients
    reduced in float32 — as torchtitan trains. Without one, or off: everything in ``dtype``."""

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batch", "interleave"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise LayoutError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}.")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise LayoutError(f"--seq-len must be a positive integer, got {self.seq_len!r}.")
        if self.dtype not in DTYPES:
            raise LayoutError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}.")
        if self.recompute not in RECOMPUTE:
            raise LayoutError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}.")
        object.__setattr__(self, "schedule", Schedule(self.schedule))


@dataclass(frozen=True, slots=True, kw_only=True)
class Model:
    """What the simulator traces: the user's model and parallelize function per knob setting."""

    spec: ModelSpec
    parallelize: Callable[[Training, bool], ParallelizeFn | None]
    """The parallelize function for a setting of the knobs (recompute, sequence parallel) and
    whether FSDP2 mixed precision applies (see :attr:`Training.mixed_precision`)."""
    seq_len: int | None = None
    config: object | None = None
    """The :class:`~topomesh.models.transformer.TransformerConfig` of a built-in model, for
    up-front divisibility checks; None for a user's own model (tracing then says what fails)."""


def builtin_model(cfg: object, *, seq_len: int | None = None) -> Model:
    """A :class:`Model` for a :class:`~topomesh.models.transformer.TransformerConfig`."""
    from topomesh.models.parallelize import Checkpointing, ParallelOptions, make_parallelize
    from topomesh.trace.tracer import transformer_spec

    if seq_len is not None:
        cfg = dataclasses.replace(cfg, seq_len=seq_len)

    def parallelize(t: Training, mixed: bool) -> ParallelizeFn:
        precision = {"param_dtype": DTYPES[t.dtype], "reduce_dtype": torch.float32} if mixed else {}
        return make_parallelize(ParallelOptions(sequence_parallel=t.sequence_parallel,
                                                checkpointing=Checkpointing(t.recompute), **precision))

    return Model(spec=transformer_spec(cfg), parallelize=parallelize, seq_len=cfg.seq_len, config=cfg)


def check_model_layout(cfg: object, layout: Layout, training: Training) -> None:
    """Divisibility a built-in transformer needs; one :class:`LayoutError` naming the problem."""
    tp, cp, ep, pp = (layout.degree(a) for a in (Axis.TP, Axis.CP, Axis.EP, Axis.PP))
    kv = cfg.n_kv_heads or cfg.n_heads
    if cfg.n_heads % tp or kv % tp:
        raise LayoutError(f"tp={tp} does not divide the {cfg.n_heads} attention heads and {kv} kv heads of {cfg.name}.")
    if cfg.seq_len % (2 * cp) and cp > 1:
        raise LayoutError(f"cp={cp} needs the sequence ({cfg.seq_len}) to divide by 2·cp = {2 * cp} (load balancing).")
    if ep > 1 and not cfg.n_experts:
        raise LayoutError(f"ep={ep} needs a mixture-of-experts model; {cfg.name} is dense.")
    if ep > 1 and cfg.n_experts % ep:
        raise LayoutError(f"ep={ep} does not divide the {cfg.n_experts} experts of {cfg.name}.")
    stages = stage_count(training.schedule, pp, training.interleave) if pp > 1 else 1
    if stages > cfg.n_layers:
        raise LayoutError(f"{stages} pipeline stages (pp={pp}) need at least as many layers; {cfg.name} has {cfg.n_layers}.")


def micro_batches(layout: Layout, training: Training) -> int:
    """Micro-batches each data-parallel replica runs a step; a :class:`LayoutError` where the
    global batch does not divide into them.

    >>> t = Training(global_batch=8, micro_batch=2, seq_len=16)
    >>> micro_batches(Layout.from_degrees({"dp_shard": 2}), t)
    2
    >>> micro_batches(Layout.from_degrees({"dp_shard": 3}), t)
    Traceback (most recent call last):
    ...
    topomesh.errors.LayoutError: global batch 8 does not divide into data-parallel degree 3 × micro-batch 2.
    """
    dp = layout.degree(Axis.DP_REPLICATE) * layout.degree(Axis.DP_SHARD)
    if training.global_batch % (dp * training.micro_batch):
        raise LayoutError(
            f"global batch {training.global_batch} does not divide into data-parallel degree {dp} × "
            f"micro-batch {training.micro_batch}.")
    return training.global_batch // (dp * training.micro_batch)


def split_layers(n_layers: int, stages: int) -> list[int]:
    """Blocks per global stage: equal shares, the first ``n_layers % stages`` one more.

    >>> split_layers(10, 4)
    [3, 3, 2, 2]
    """
    if stages > n_layers:
        raise LayoutError(f"{stages} pipeline stages need at least as many layers, the model has {n_layers}.")
    base, extra = divmod(n_layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


@dataclass(slots=True)
class Simulator:
    """Simulates layouts of one model on one cluster, sharing traces and link lookups."""

    model: Model
    cluster: Cluster
    cache: TraceCache = field(default_factory=TraceCache)
    table: Mapping = field(default_factory=dict)
    """Measured op times (``OpProfileDB.table(fingerprint)``); ops not in it use the roofline."""

    def trace(self, layout: Layout, training: Training) -> Trace:
        return trace_layout(self.model, layout, training, self.cache, gpu=gpu_kernels(self.cluster))

    _memo: SimMemo = field(default_factory=lambda: SimMemo())
    _digests: DigestStore | None = None
    _pricing: str | None = None

    def digest(self, layout: Layout, training: Training) -> ClassDigest:
        """The :class:`~topomesh.sim.price.ClassDigest` of ``layout``'s class: from memory, from
        the trace cache directory (:mod:`topomesh.sim.digest`), else digested from its trace."""
        from topomesh.sim.digest import DigestStore, digest_key, pricing_fingerprint

        if self._digests is None:
            self._digests = DigestStore(self.cache.directory)
            self._pricing = pricing_fingerprint(self.cluster, self.table)
        args, kw = trace_request(self.model, layout, training, gpu=gpu_kernels(self.cluster))
        key = digest_key(self.cache.key(*args, **kw, optimizer=default_optimizer), self._pricing)

        def build() -> ClassDigest:
            trace = self.trace(layout, training)
            return memo_digest(trace, SymbolicPricer(self.cluster, self.table, self._memo.ops), self._memo.digests)

        return self._digests.get(key, build)

    def simulate(self, layout: Layout, training: Training, *, record: bool = False,
                 digest: ClassDigest | None = None) -> StepResult:
        """``digest``: :meth:`digest` of ``layout`` under ``training`` when the caller has it."""
        return simulate(self.model, self.cluster, layout, training, cache=self.cache, table=self.table,
                        record=record, digest=digest or self.digest(layout, training), memo=self._memo)


@dataclass(slots=True)
class SimMemo:
    """Work shared between simulations of one model on one cluster and op table: op times,
    a priced class per (class digest, links of its collective axes), each trace's digest.
    Sharing is exact: the same inputs give the same numbers."""

    ops: dict = field(default_factory=dict)
    priced: dict = field(default_factory=dict)
    ranks: dict = field(default_factory=dict)
    """The topology placement's rank list per cluster (:func:`topomesh.layout.place.locality_order`
    depends only on the topology, not on the layout)."""
    links: dict = field(default_factory=dict)
    """:class:`AxisLink` per (cluster, link name, :func:`link_key`)."""
    memory: dict = field(default_factory=dict)
    """Memory per pipeline rank per (digest, schedule, pp, micro-batches, interleave, depth)."""
    digests: dict = field(default_factory=dict)
    """A trace's :class:`~topomesh.sim.price.ClassDigest` per (trace, depth) (:func:`~topomesh.sim.price.memo_digest`)."""
    templates: dict = field(default_factory=dict)
    """Encoded stage plans per (digest, layers per stage, pipelined) (:func:`topomesh.sim.kernel.template`)."""
    comms: dict = field(default_factory=dict)
    """A collective record's price per (record, link)."""


def link_key(layout: Layout, axes: tuple[Axis, ...]) -> tuple[tuple[int, int], ...]:
    """What :func:`~topomesh.cost.cluster.axis_link` of ``axes`` depends on besides the cluster and
    the placement's rank list: the (stride, size) of each of ``axes`` in the logical grid, in
    ``layout.order``. Exact: the first group of the axes is ``Σ stride·i`` over them; the last is
    offset by ``Σ (size-1)·stride`` over the others, which is ``world - 1 - Σ (size-1)·stride``
    over them; one group covers the world exactly when their sizes multiply to it.

    >>> link_key(Layout(tp=2, pp=4, dp_shard=2, order="tp-dp_shard-pp"), (Axis.PP,))
    ((4, 4),)
    """
    out, stride = [], 1
    for a in layout.order:
        size = getattr(layout, a.value)
        if a in axes:
            out.append((stride, size))
        stride *= size
    return tuple(out)


def placed_ranks(cluster: Cluster, memo: SimMemo) -> tuple[int, ...]:
    """The topology placement's rank list on ``cluster`` (what :func:`place` gives every layout)."""
    if id(cluster) not in memo.ranks:  # the cluster is kept with its ranks, so its id stays its own
        memo.ranks[id(cluster)] = (cluster, tuple(locality_order(cluster.topology)))
    return memo.ranks[id(cluster)][1]


def memo_axis_link(cluster: Cluster, layout: Layout, name: str, memo: SimMemo,
                   placement: Placement | Callable[[], Placement] | None = None) -> AxisLink:
    """The link the groups of ``name`` (a mesh axis or ``+``-joined axes, as a trace's collectives
    name them) cross under ``layout``'s topology placement; an unknown name is priced on the
    largest axis. Shared through ``memo`` by :func:`link_key` (exact)."""
    axes = _name_axes(name)
    if axes is None:
        axes = (max(layout.mesh_axes, key=layout.degree),)  # unknown group: the largest axis
    key = (id(cluster), "+".join(a.value for a in axes), link_key(layout, axes))
    if key not in memo.links:
        if placement is None:
            placement = Placement(layout=layout, ranks=placed_ranks(cluster, memo), strategy=Strategy.TOPOLOGY)
        elif callable(placement):  # built only on a miss
            placement = placement()
        memo.links[key] = axis_link(cluster, placement, [a.value for a in axes])
    return memo.links[key]


@functools.lru_cache(maxsize=256)
def _name_axes(name: str) -> tuple[Axis, ...] | None:
    """The axes of a collective's ``+``-joined axis name; None when it names none or an unknown one."""
    parts = [a for a in name.split("+") if a]
    known = {a.value: a for a in Axis}
    if not parts or any(a not in known for a in parts):
        return None
    return tuple(known[a] for a in parts)


def mixed_precision(layout: Layout, training: Training) -> bool:
    """Whether FSDP2 mixed precision applies (see :attr:`Training.mixed_precision`)."""
    sharded = any(layout.degree(a) > 1 for a in (Axis.DP_SHARD, Axis.DP_REPLICATE, Axis.CP))
    return training.mixed_precision and sharded and DTYPES[training.dtype] is not torch.float32


def gpu_kernels(cluster: Cluster) -> bool:
    """Whether ``cluster``'s steps are traced as a GPU runs them (:mod:`topomesh.trace.kernels`):
    every cluster but one of CPU processes (``local``)."""
    return cluster.device.kind is not DeviceKind.CPU


def trace_request(model: Model, layout: Layout, training: Training, *, gpu: bool = False) -> tuple[tuple, dict]:
    """The arguments of :meth:`TraceCache.get` for ``layout``'s class under ``training``
    (``gpu``: traced as a GPU runs it, :func:`gpu_kernels`)."""
    degrees = {a.value: layout.degree(a) for a in layout.mesh_axes if a is not Axis.PP}
    mixed = mixed_precision(layout, training)
    dtype = torch.float32 if mixed else DTYPES[training.dtype]
    return (model.spec, model.parallelize(training, mixed), degrees), {"batch_size": training.micro_batch,
                                                                         "dtype": dtype,
                                                                         **({"gpu_kernels": True} if gpu else {})}


def trace_layout(model: Model, layout: Layout, training: Training, cache: TraceCache | None = None, *,
                 gpu: bool = False) -> Trace:
    """The trace of ``layout``'s class under ``training``'s knobs (traced once per class)."""
    cache = cache if cache is not None else TraceCache()  # an empty cache is falsy (it has a length)
    args, kw = trace_request(model, layout, training, gpu=gpu)
    return cache.get(*args, **kw)


def simulate(model: Model, cluster: Cluster, layout: Layout, training: Training, *,
             cache: TraceCache | None = None, table: Mapping | None = None, record: bool = False,
             trace: Trace | None = None, memo: SimMemo | None = None, digest: ClassDigest | None = None
             ) -> StepResult:
    """One layout's training step on ``cluster`` (see the module docstring). ``digest`` (its
    class's, :meth:`Simulator.digest`) stands for the trace; else ``trace``, else the class is
    traced through ``cache``."""
    if layout.world_size != cluster.world_size:
        raise LayoutError(
            f"layout {layout.describe()} has {layout.world_size} ranks, cluster {cluster.name} has "
            f"{cluster.world_size}; the degrees must multiply to the world size.")
    if model.config is not None:
        check_model_layout(model.config, layout, training)
    micro = micro_batches(layout, training)
    pp = layout.degree(Axis.PP)
    memo = memo or SimMemo()
    if digest is None:
        if trace is None:
            trace = trace_layout(model, layout, training, cache, gpu=gpu_kernels(cluster))
        if model.spec.n_layers > trace.traced_layers:
            trace = trace.compose(model.spec.n_layers)  # the FLOPs of the whole model
        digest = memo_digest(trace, SymbolicPricer(cluster, table or {}, memo.ops), memo.digests)
    placed: list[Placement] = []  # built on the first link the memo does not hold (it takes milliseconds)
    links: dict[str, AxisLink] = {}

    def placement() -> Placement:
        if not placed:
            placed.append(Placement(layout=layout, ranks=placed_ranks(cluster, memo), strategy=Strategy.TOPOLOGY))
        return placed[0]

    def link_of(name: str) -> AxisLink:
        if name not in links:
            links[name] = memo_axis_link(cluster, layout, name, memo, placement)
        return links[name]

    for a in layout.mesh_axes:
        if layout.degree(a) > 1:
            link_of(a.value)
    schedule = training.schedule if pp > 1 else Schedule.ONE_F_ONE_B
    interleave = training.interleave if schedule.multi_stage else 1
    stages = stage_count(schedule, pp, interleave) if pp > 1 else 1
    layers = split_layers(model.spec.n_layers, stages)
    stage_rank = [0] * stages
    for r in range(pp):
        for s in (rank_stages(schedule, pp, interleave, r) if pp > 1 else [0]):
            stage_rank[s] = r
    # the plans of this trace and stage split, with their collectives as slots (link-free)
    scaled = pp > 1 and micro > 1  # the schedule divides the gradients by the micro-batch count
    action_s = action_host_s(cluster, schedule) if pp > 1 else 0.0
    tpl_key = (id(digest), tuple(layers), pp > 1, scaled, action_s)
    from topomesh.sim import kernel  # numba: imported when a step is first simulated

    hit = memo.templates.get(tpl_key)
    if hit is None:
        sym = SymbolicPricer(cluster, table or {}, memo.ops)
        sym_priced = price_digest(digest, sym)
        sym_plans = [_stage_plan(sym_priced, s, stages, n, pipelined=pp > 1, scaled=scaled, action_s=action_s)
                     for s, n in enumerate(layers)]
        hit = memo.templates[tpl_key] = (digest, kernel.template(sym_plans, sym.records,
                                                                 (sym_priced, sym_plans, tuple(sym.gaps))))
    tpl = hit[1]
    sym_priced, sym_plans, sym_gaps = tpl.extra
    p2p_s = 0.0
    if pp > 1:
        rec = CollectiveRecord(kind=CollectiveKind.SEND_RECV, bytes=sym_priced.boundary_bytes, group_size=2,
                               mesh_axis=Axis.PP.value)
        boundary = Pricer(cluster, link_of, {}, memo.ops)
        p2p_s = boundary.comm(rec, gap_s=math.inf).seconds  # a hand-off follows a stage's micro-batch: long compute
    # a pipeline on shared cores: its ranks are not all busy at once (topomesh.sim.shared)
    shared = pp > 1 and cluster.cores is not None
    if record or shared:  # the Python engine, on plans priced on this layout's links
        signature = (id(digest), tuple(link_of(a) for a in digest.axes))
        priced = memo.priced.get(signature)
        if priced is None:
            priced = memo.priced[signature] = (digest, price_digest(digest, Pricer(cluster, link_of, table or {},
                                                                                   memo.ops)))
        priced = priced[1]
        plans = [_stage_plan(priced, s, stages, n, pipelined=pp > 1, scaled=scaled, action_s=action_s)
                 for s, n in enumerate(layers)]
        actions = action_order(schedule, pp=pp, microbatches=micro, interleave=interleave)
        if shared:
            from topomesh.sim.shared import shared_pipeline

            # a late receive's measured hand-off was timed against idle stages, so it holds what the
            # send costs more after compute than back to back, which p2p_s holds too: counted once
            late_s = (max(0.0, cluster.pipeline_handoff_s - (p2p_s - boundary.comm(rec).seconds))
                      if cluster.pipeline_handoff_s else 0.0)
            run = shared_pipeline(plans, actions, stage_rank, p2p_s, cluster, ranks_per_stage=layout.world_size // pp,
                                  lock_step_ranks=meeting_ranks(plans, layout),
                                  record=record, late_receives=schedule.receives_at_action,
                                  late_handoff_s=late_s)
        else:
            run = simulate_pipeline(plans, actions, stage_rank, p2p_s, record=True,
                                    late_receives=schedule.receives_at_action,
                                    unshards=unshard_points(schedule, pp=pp, microbatches=micro, interleave=interleave))
    else:
        pricer = Pricer(cluster, link_of, table or {}, memo.ops)
        secs, streams = [], []
        for r, gap in zip(tpl.records, sym_gaps, strict=True):
            key = (r, gap, link_of(r.mesh_axis or ""))
            c = memo.comms.get(key)
            if c is None:
                c = memo.comms[key] = pricer.comm(r, gap)
            secs.append(c.seconds)
            streams.append(0 if c.stream is Stream.INTRA else 1)
        run = kernel.run_template(tpl, np.array(secs, dtype=np.float64), np.array(streams, dtype=np.int64),
                                  schedule, pp, micro, interleave, stage_rank, p2p_s)
    memory_key = (id(digest), schedule, pp, micro, interleave, model.spec.n_layers)
    memory = memo.memory.get(memory_key)
    if memory is None:  # bytes only: the same on every placement
        actions = action_order(schedule, pp=pp, microbatches=micro, interleave=interleave)
        memory = tuple(_memory(sym_priced, sym_plans, layers, actions[r], r, stage_rank) for r in range(len(actions)))
        memo.memory[memory_key] = (digest, memory)
    else:
        memory = memory[1]
    return _result(model, cluster, layout, training, dict(digest.flops_by_phase), sym_priced, run, memory, micro,
                   links, schedule, interleave)


def action_host_s(cluster: Cluster, schedule: Schedule) -> float:
    """Host seconds each action of ``schedule`` costs a pipeline stage's computing thread on
    ``cluster`` beyond its ops (:attr:`Cluster.pipeline_action_s`, or
    :attr:`Cluster.pipeline_multi_action_s` for a schedule of several stages a rank), stretched
    as the rank's compute is (:attr:`Cluster.compute_share`); 0 where not measured (GPUs)."""
    per = cluster.pipeline_multi_action_s if schedule.multi_stage else cluster.pipeline_action_s
    return per * cluster.compute_share


def meeting_ranks(plans: Sequence[StagePlan], layout: Layout) -> int:
    """How many of a pipeline stage's ranks meet in every micro-batch (the lock-step stretch's,
    :func:`topomesh.sim.shared.shared_pipeline`): the product of the degrees of the axes the
    stages' repeating actions issue collectives on, a later micro-batch's forward and an earlier
    one's backward. Tensor, context and expert parallel meet in every layer; under a pipeline
    FSDP gathers in a stage's first forward and reduces in its last backward only, so its data
    parallel ranks (replicated or sharded) step on their own in between: four ranks of
    ``pp=2,dp_replicate=2`` priced as lock-step pairs came out 16-26 % over their runs, whose
    steps took twice a rank's CPU time.

    >>> from topomesh.sim.engine import Piece
    >>> from topomesh.sim.price import Comm, Stream, Work
    >>> tp = Piece(work=Work(blocking=(Comm(axis="tp", stream=Stream.INTRA, seconds=1.0),)), count=1, label="b")
    >>> plan = StagePlan(forward=(tp,), backward=(tp,), backward_input=(), backward_weight=(), optimizer=())
    >>> meeting_ranks([plan], Layout(pp=2, tp=2, dp_replicate=2))
    2
    """
    axes: set[str] = set()
    for plan in plans:
        for piece in (*(plan.forward_later or plan.forward), *(plan.backward_first or plan.backward)):
            if piece.count:
                axes.update(c.axis for c in (*piece.work.blocking, *piece.work.gather, *piece.work.reduce))
    return math.prod(layout.degree(a) for a in layout.mesh_axes if a is not Axis.PP and a.value in axes)


def _stage_plan(p: PricedClass, s: int, stages: int, n: int, *, pipelined: bool = False,
                scaled: bool = False, action_s: float = 0.0) -> StagePlan:
    """The pieces of global stage ``s`` (``n`` blocks). Under a pipeline, PyTorch's stage runs
    FSDP without resharding after backward and without gradient sync until the last backward
    (``PipelineStage.backward_maybe_with_nosync``), and FSDP keeps its parameters after
    forward (``reshard_after_forward`` off: torchtitan's default under PP, "to avoid
    per-microbatch all-gathers", and what ``topomesh validate`` runs): parameters are gathered
    in the stage's first forward only and gradients reduced in its last backward only.

    Every backward but the stage's first also adds its gradients into those kept from the
    step's earlier micro-batches (:func:`_accumulating`): ``micro - 1`` adds a step, on the
    backwards after the first (``backward_early``, ``backward_last``); the first has nothing to
    add into (``backward_first``), and the one backward of a single micro-batch neither
    (``backward``). Where they fall matters in a pipeline: the last backward of the first stage
    ends the step, and the first waits for the next stage anyway.

    ``scaled`` (a pipeline of more than one micro-batch): the stage's optimizer starts with the
    schedule's scaling of its gradients (:func:`_scaling`). ``action_s`` (under a pipeline):
    every action of the stage (F, B, I, W) also runs the schedule's own host work, a
    ``pipeline action`` piece of that many seconds (:func:`action_host_s`)."""
    plan = _pieces(p, s, stages, n)
    if scaled:
        plan = dataclasses.replace(plan, optimizer=_scaling(p, plan.optimizer))
    if not pipelined:
        added = _accumulating(p, plan.backward, pipelined=False)
        added_w = _accumulating(p, plan.backward_weight, pipelined=False)
        return dataclasses.replace(plan, backward_early=added, backward_last=added,
                                   backward_weight_early=added_w, backward_weight_last=added_w)

    backward = _without_role(plan.backward, "gather")
    quiet = _without_role(backward, "reduce")
    quiet_w = _without_role(plan.backward_weight, "reduce")
    plan = dataclasses.replace(
        plan, backward=_reducing_after(backward), backward_input=_without_role(plan.backward_input, "gather"),
        forward_later=_without_role(plan.forward, "gather"),
        backward_first=_casting(p, quiet), backward_early=_accumulating(p, quiet, pipelined=True),
        backward_last=_reducing_after(_accumulating(p, backward, pipelined=True)),
        backward_weight=_reducing_after(plan.backward_weight),
        backward_weight_first=_casting(p, quiet_w),
        backward_weight_early=_accumulating(p, quiet_w, pipelined=True),
        backward_weight_last=_reducing_after(_accumulating(p, plan.backward_weight, pipelined=True)))
    if not action_s:
        return plan
    return plan.with_each_action((Piece(work=Work(compute_s=action_s), count=1, label="pipeline action"),))


def _reducing_after(pieces: tuple[Piece, ...]) -> tuple[Piece, ...]:
    """A pipeline stage's last backward (or W) ``pieces`` with their gradient reductions issued
    together after them, which the rank then waits for: PyTorch's schedules run a stage's
    backwards without gradient sync and reduce in ``PipelineStage.perform_reduce_grad`` once
    the last is done and its sends are posted (GPipe and 1F1B at the end of the step, the
    multi-stage runtime in a ``REDUCE_GRAD`` action after the stage's last backward and its
    ``SEND_B``), where FSDP2's ``post_backward`` issues every unit's reduction and
    ``finalize_backward`` orders the compute stream after them. So none overlaps the backward's
    compute, and under a multi-stage schedule none overlaps the rank's next action
    (:attr:`Work.wait_reduce`). FSDP2's copies around them (``Work.reduce_s``) go with them.
    Collectives booked blocking (shared cores, where FSDP2 reduces synchronously) stay as
    they are."""
    reduce = tuple(c for pc in pieces for _ in range(pc.count) for c in pc.work.reduce)
    if not reduce:
        return pieces
    copies = sum(pc.work.reduce_s * pc.count for pc in pieces)
    last = Work(compute_s=copies, reduce_s=copies, reduce=reduce, wait_reduce=True)
    return (*_without_role(pieces, "reduce"), Piece(work=last, count=1, label="reduce gradients"))


def _without_role(pieces: tuple[Piece, ...], what: str) -> tuple[Piece, ...]:
    """``pieces`` without the collectives of a role (``"gather"`` or ``"reduce"``; where they
    share the compute cores they are all booked blocking) and the ops and host work FSDP2 runs
    around them (``Work.gather_s``, ``Work.reduce_s``)."""
    def without(w: Work) -> Work:
        own = getattr(w, f"{what}_s")
        return dataclasses.replace(w, **{what: (), f"{what}_s": 0.0}, compute_s=max(0.0, w.compute_s - own),
                                   blocking=tuple(c for c in w.blocking if c.role != what))
    return tuple(dataclasses.replace(pc, work=without(pc.work)) for pc in pieces)


def _scaling(p: PricedClass, pieces: tuple[Piece, ...]) -> tuple[Piece, ...]:
    """Optimizer ``pieces`` that first divide their gradients by the micro-batch count, as every
    PyTorch pipeline schedule does once the stage's last backward and its sends are done
    (``PipelineStage.scale_grads``): a read and a write of the gradients the optimizer sees
    (:attr:`StateBytes.grads`, sharded under FSDP: it runs after the reduction) at
    :attr:`PricedClass.grad_scale_s_per_byte`. The first stage's runs after the step's last
    backward, on the critical path."""
    state = {"optimizer": p.block_state, "optimizer (embed)": p.first_state, "optimizer (head)": p.last_state}
    return _plus_compute(pieces, lambda pc: 2 * state[pc.label].grads * p.grad_scale_s_per_byte)


def _plus_compute(pieces: tuple[Piece, ...], extra_s: Callable[[Piece], float]) -> tuple[Piece, ...]:
    """``pieces`` each with ``extra_s(piece)`` more seconds of compute."""
    return tuple(dataclasses.replace(pc, work=dataclasses.replace(pc.work, compute_s=pc.work.compute_s + extra_s(pc)))
                 for pc in pieces)


def _accumulating(p: PricedClass, pieces: tuple[Piece, ...], *, pipelined: bool) -> tuple[Piece, ...]:
    """Backward ``pieces`` with the add of their gradients into the kept ones, which reads the
    kept and the new gradients and writes the kept, at :attr:`PricedClass.grad_add_s_per_byte`
    (FSDP2's unsharded ones under a pipeline at :attr:`PricedClass.fsdp_grad_add_s_per_byte`).
    Kept: the gradients the optimizer sees (:attr:`StateBytes.grads`, the parameters' dtype
    and sharding; FSDP2 reduces each micro-batch's and adds the shard), new ones alike; under
    a pipeline with FSDP each unit's unsharded gradient in the reduce dtype (the reduction's
    input, ``reduce_bytes``) and new ones in the dtype the parameters are gathered in
    (``gather_bytes``): float32 += bfloat16 under mixed precision. The first backward's cast
    of them to the reduce dtype is :func:`_casting`'s."""
    state = {"embed": p.first_state, "block": p.block_state, "head": p.last_state}

    def add_s(pc: Piece) -> float:
        w = pc.work
        if pipelined and w.reduce_bytes:
            return (2 * w.reduce_bytes + (w.gather_bytes or w.reduce_bytes)) * p.fsdp_grad_add_s_per_byte
        return 3 * state[pc.label.split()[0]].grads * p.grad_add_s_per_byte

    return _plus_compute(pieces, add_s)


def _casting(p: PricedClass, pieces: tuple[Piece, ...]) -> tuple[Piece, ...]:
    """A pipeline stage's first backward ``pieces`` (FSDP2 without gradient sync) with FSDP2's
    cast of each unit's new gradients to the reduce dtype, which it keeps and adds the later
    micro-batches' into (``FSDPParam.to_accumulated_grad_if_needed``): a read of the new
    gradients (``gather_bytes``, the compute dtype) and a write of the kept (``reduce_bytes``),
    at :attr:`PricedClass.fsdp_grad_add_s_per_byte` as :func:`_accumulating`'s add. Without
    mixed precision (the two sizes equal) FSDP2 casts nothing and autograd keeps the gradient."""
    def cast_s(pc: Piece) -> float:
        w = pc.work
        mixed = w.reduce_bytes and w.gather_bytes and w.gather_bytes != w.reduce_bytes
        return (w.reduce_bytes + w.gather_bytes) * p.fsdp_grad_add_s_per_byte if mixed else 0.0

    return _plus_compute(pieces, cast_s)


def _pieces(p: PricedClass, s: int, stages: int, n: int) -> StagePlan:
    first, last = s == 0, s == stages - 1

    def pieces(*items: tuple[Work, int, str, bool]) -> tuple[Piece, ...]:
        return tuple(Piece(work=w, count=c, label=lbl) for w, c, lbl, keep in items if keep and c)

    fwd = pieces((p.fwd_pre, 1, "embed fwd", first), (p.fwd_block, n, "block fwd", True), (p.fwd_post, 1, "head fwd", last))
    bwd_items = ((p.bwd_post, 1, "head bwd", last), (p.bwd_block, n, "block bwd", True), (p.bwd_pre, 1, "embed bwd", first))
    bwd = pieces(*bwd_items)
    def split(w: Work) -> tuple[float, float]:  # (I, W) seconds of a piece's backward
        # the gradients' reduction (FSDP2's copies around it) follows the weight gradients: W's
        own = w.compute_s - w.reduce_s
        if p.backward_split is None:
            return own - w.weight_grad_s, w.weight_grad_s + w.reduce_s
        return own * p.backward_split[0], own * p.backward_split[1] + w.reduce_s

    bwd_i = tuple(Piece(work=dataclasses.replace(w, reduce=(), reduce_s=0.0, compute_s=split(w)[0]), count=c,
                        label=lbl.replace("bwd", "bwd-I")) for w, c, lbl, keep in bwd_items if keep and c)
    bwd_w = tuple(Piece(work=Work(compute_s=split(w)[1], reduce=w.reduce, gather_bytes=w.gather_bytes,
                                  reduce_bytes=w.reduce_bytes, reduce_s=w.reduce_s), count=c,
                        label=lbl.replace("bwd", "bwd-W"))
                  for w, c, lbl, keep in bwd_items if keep and c)
    opt = pieces((p.opt_block, n, "optimizer", True), (p.opt_first, 1, "optimizer (embed)", first),
                 (p.opt_last, 1, "optimizer (head)", last))
    return StagePlan(forward=fwd, backward=bwd, backward_input=bwd_i, backward_weight=bwd_w, optimizer=opt)


def _memory(p: PricedClass, plans: list[StagePlan], layers: list[int], actions: list[Action], rank: int,
            stage_rank: list[int]) -> StageMemory:
    mine = [s for s, r in enumerate(stage_rank) if r == rank]
    last = len(layers) - 1
    state = StateBytes()
    saved: dict[int, int] = {}
    held: dict[int, int] = {}  # per stage: the gradients a zero-bubble I keeps for its W
    grads: dict[int, int] = {}  # per stage: its gradients, once its first B or W has made them
    output: dict[int, int] = {}  # per stage: its output per micro-batch, from its F to its B (or I)
    gathered = peak_out = 0
    stage_gathered: list[int] = []
    for s in mine:
        own = p.block_state * layers[s]
        if s == 0:
            own = own + p.first_state
        if s == last:
            own = own + p.last_state
        state = state + own
        grads[s] = own.grads
        saved[s] = (p.fwd_block.saved_bytes * layers[s] + (p.fwd_pre.saved_bytes if s == 0 else 0)
                    + (p.fwd_post.saved_bytes if s == last else 0))
        held[s] = (p.fwd_block.weight_output_bytes * layers[s] + (p.fwd_pre.weight_output_bytes if s == 0 else 0)
                   + (p.fwd_post.weight_output_bytes if s == last else 0))
        # a pipeline stage keeps its output until the micro-batch's backward (PipelineStage's
        # fwd_cache): the boundary activation, the last stage its logits; whole-model traces
        # charge the one to the next block, and keep only the loss's copy of the other
        output[s] = (p.head_output_bytes if s == last else p.boundary_bytes) if len(layers) > 1 else 0
        works = [pc.work for pc in (*plans[s].forward, *plans[s].backward)]
        if plans[s].forward_later is not None:  # a pipeline stage keeps all its gathered parameters
            stage_gathered.append(_stage_bytes(p, plans[s].forward, s, last, "gather_bytes", p.fwd_pre, p.fwd_post))
            # and FSDP2 syncs gradients only in the stage's last backward: until then each unit
            # holds its unsharded gradients, accumulated in the reduce dtype
            # (FSDPParam.unsharded_accumulated_grad), the bytes its reduction then reads
            grads[s] = max(grads[s], _stage_bytes(p, plans[s].backward, s, last, "reduce_bytes", p.bwd_pre, p.bwd_post))
        else:  # the gathered piece and the one prefetched; in backward also the piece's unsharded
            # gradients (as many bytes as its gathered parameters) and the gradient-reduction
            # inputs of this piece and of the one before, which FSDP2 holds until this one is issued
            gathered = max([gathered, *(2 * w.gather_bytes + 2 * w.reduce_bytes for w in works)])
        peak_out = max([peak_out, *(w.peak_output_bytes for w in works)])
    # with more stages a rank than the multi-stage runtime keeps unsharded, at most that many at once
    gathered += sum(sorted(stage_gathered)[-RUNTIME_UNSHARDED_STAGES:])
    live: dict[tuple[int, int], int] = {}
    most = total = 0
    one_stage = len(layers) == 1 and plans[0].forward_later is None
    # the optimizer sets gradients to None every step; a stage's first B (or W) makes them as
    # it frees that micro-batch's activations (without a pipeline: there all along)
    graded = set(mine) if one_stage else set()
    made = sum(grads[s] for s in graded)  # the gradients that exist so far
    peak = act_peak = grads_at_peak = 0  # the most activations and gradients live at once
    for a in actions:
        if a.kind is Kind.F:
            keep = saved.get(a.stage, 0) + output.get(a.stage, 0)
            total += keep - live.get((a.stage, a.mb), 0)
            live[(a.stage, a.mb)] = keep
            most = max(most, len(live))
        elif a.kind is Kind.I:
            # a zero-bubble I keeps the graph (``stage_backward_input``: retain_graph) and so its
            # saved tensors, and the gradient at every node leading to a weight; its W frees all;
            # the stage's output goes at the I
            more = held.get(a.stage, 0) - output.get(a.stage, 0)
            total += more
            live[(a.stage, a.mb)] = live.get((a.stage, a.mb), 0) + more
        elif a.kind is Kind.B or a.kind is Kind.W:
            total -= live.pop((a.stage, a.mb), 0)
            if a.stage not in graded:
                graded.add(a.stage)
                made += grads[a.stage]
        if total + made > peak:
            peak, act_peak, grads_at_peak = total + made, total, made
    transient = gathered + peak_out
    # PipelineStage's receive buffers, one per micro-batch and stage boundary it receives over
    micro = 1 + max((a.mb for a in actions), default=-1)
    receive = p.boundary_bytes * micro * sum((s > 0) + (s < last) for s in mine) if len(layers) > 1 else 0
    if one_stage and most == 1:  # one micro-batch at a time: what is live when, piece by piece
        transient = max(0, _one_pass_bytes(p, plans[0]) - act_peak)
    # the sharded gradients appear only when those reductions run (set_to_none between steps)
    return StageMemory(rank=rank, params_bytes=state.params, grads_bytes=sum(grads.values()),
                       optimizer_bytes=state.optimizer,
                       activations_bytes=act_peak, in_flight=most, transient_bytes=transient,
                       receive_bytes=receive, grads_at_peak_bytes=grads_at_peak)


def _one_pass_bytes(p: PricedClass, plan: StagePlan) -> int:
    """Most bytes beyond the model state that one micro-batch's forward and backward hold at
    once on a rank without a pipeline, following the pieces in order instead of adding the
    largest activations to the largest transient of any piece (they are not live together:
    the activations are fullest when the backward starts, a unit's gradient reduction runs
    when its own activations are gone).

    Forward piece: the activations saved so far with its own, its gathered parameters and the
    prefetched next unit's (FSDP), its largest output. Backward piece, when it starts: the
    activations not yet consumed with its own, its gathered parameters and the prefetched
    ones, its largest output; when it ends (FSDP2 reshards, then reduces): the activations
    without its own, the prefetched parameters, its reduction's input and as much again (the
    previous unit's input FSDP2 keeps until this one is issued; on gloo, the reduce-scatter's
    copy of its input), its largest output. The root unit (embedding and head, gathered
    again for the head's backward and reduced after the embedding's) stays gathered from the
    head's backward to the end."""
    forward_saved = {"embed": p.fwd_pre.saved_bytes, "block": p.fwd_block.saved_bytes, "head": p.fwd_post.saved_bytes}
    most = saved = 0
    for pc in plan.forward:  # the activations only grow: a repeated piece holds most at its last copy
        w = pc.work
        saved += w.saved_bytes * pc.count
        most = max(most, saved + 2 * w.gather_bytes + w.peak_output_bytes)
    held = 0
    for pc in plan.backward:  # they only shrink: a repeated piece holds most at its first copy
        w = pc.work
        own = forward_saved.get(pc.label.split()[0], 0)
        start = saved + held + 2 * w.gather_bytes + w.peak_output_bytes
        end = saved - own + held + w.gather_bytes + 2 * w.reduce_bytes + w.peak_output_bytes
        most = max(most, start, end)
        saved -= own * pc.count
        if w.gather_bytes and not w.reduce_bytes:  # gathered here, reduced by a later piece
            held += w.gather_bytes
    return most


def _stage_bytes(p: PricedClass, pieces: Sequence[Piece], s: int, last: int, field: str, pre: Work, post: Work) -> int:
    """Gathered (or reduced) bytes of stage ``s``'s pieces, with the root FSDP unit's shared out.
    The trace has one root unit for the parameters outside the blocks, gathered and reduced with
    the embedding; under a pipeline each end stage's root holds only its own (the embedding on
    the first, norm and head on the last), so the root's bytes go to the two ends in proportion
    to their parameters."""
    total = sum(getattr(pc.work, field) * pc.count for pc in pieces)
    root = getattr(pre, field) + getattr(post, field)
    if s == 0:
        total -= getattr(pre, field)
    if s == last:
        total -= getattr(post, field)
    ends = p.first_state.params + p.last_state.params
    mine = (p.first_state.params if s == 0 else 0) + (p.last_state.params if s == last else 0)
    return total + (root * mine // ends if ends else 0)


def _result(model: Model, cluster: Cluster, layout: Layout, training: Training, by_phase: Mapping[str, int],
            priced: PricedClass, run: EngineResult, memory: tuple[StageMemory, ...], micro: int,
            links: Mapping[str, AxisLink], schedule: Schedule, interleave: int) -> StepResult:
    crit = run.ranks[run.critical_rank]
    breakdown = StepBreakdown(compute_s=crit.compute_s, exposed_comm_s=dict(sorted(crit.exposed.items())),
                              bubble_s=crit.bubble_s, optimizer_s=crit.optimizer_s, p2p_s=crit.p2p_s)
    step = run.step_time_s
    replicas = cluster.world_size // layout.degree(Axis.PP)
    fwd = by_phase.get("forward", 0) * micro * replicas
    executed = (by_phase.get("forward", 0) + by_phase.get("backward", 0)) * micro * replicas
    peak = cluster.device.peak_flops_per_s(str(DTYPES[training.dtype]).removeprefix("torch."))
    world_peak = peak * cluster.world_size
    seq = training.seq_len or model.seq_len or 0
    top = max(memory, key=lambda m: m.peak_bytes)
    capacity = cluster.device.memory_bytes
    feasible = top.peak_bytes <= capacity
    reason = None if feasible else (
        f"memory: pipeline rank {top.rank} needs {top.peak_bytes / 1e9:.1f} GB at its peak "
        f"(state {(top.params_bytes + top.grads_bytes + top.optimizer_bytes) / 1e9:.1f} GB, activations "
        f"{top.activations_bytes / 1e9:.1f} GB for {top.in_flight} micro-batches, transient "
        f"{top.transient_bytes / 1e9:.1f} GB) but {cluster.device.name} has {capacity / 1e9:.1f} GB")
    return StepResult(
        step_time_s=step,
        tokens_per_s=training.global_batch * seq / step if step > 0 else 0.0,
        mfu=3 * fwd / (step * world_peak) if step > 0 else 0.0,
        hfu=executed / (step * world_peak) if step > 0 else 0.0,
        peak_memory_bytes=top.peak_bytes,
        memory=memory,
        feasible=feasible,
        reason=reason,
        breakdown=breakdown,
        links={k: v.to_dict() for k, v in sorted(links.items())},
        layout={
            "degrees": {a.value: layout.degree(a) for a in layout.order},
            "order": layout.order_text(),
            "micro_batch": training.micro_batch,
            "microbatches": micro,
            "global_batch": training.global_batch,
            "seq_len": seq,
            "dtype": training.dtype,
            "schedule": schedule.value if layout.degree(Axis.PP) > 1 else None,
            "interleave": interleave,
            "recompute": training.recompute,
            "sequence_parallel": training.sequence_parallel,
            "mixed_precision": mixed_precision(layout, training),
        },
        world_size=cluster.world_size,
        device=cluster.device.name,
        capacity_bytes=capacity,
        measured_ops=priced.measured_ops,
        roofline_ops=priced.roofline_ops,
        extra={"critical_rank": run.critical_rank} if layout.degree(Axis.PP) > 1 else {},
        timeline=chrome_trace(run.ranks, title=f"{model.spec.name} {layout.describe()} on {cluster.name}")
        if run.ranks[0].spans is not None else None,
    )
