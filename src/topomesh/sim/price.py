"""Price a traced layout class on a cluster: seconds per segment, split by where they run.

A one-rank trace (:class:`~topomesh.trace.result.Trace`) is cut into the pieces a pipeline
stage is made of — the work before the blocks (embedding), one block, the work after the
blocks (final norm, head, loss), in forward, backward and optimizer — and each piece becomes
a :class:`Work`:

* ``compute_s``: its ops, each at its measured time (op table) or the efficiency-aware
  roofline of the device (:func:`topomesh.cost.ops.op_time_s`);
* ``blocking``: collectives whose result the next op needs at once — tensor, context and
  expert parallel (activations), and anything in the optimizer — which the compute stream
  waits for;
* ``gather``: parameter all-gathers over data-parallel axes (FSDP2) that the piece needs
  before it runs and that the framework issues one piece ahead (prefetch);
* ``reduce``: gradient reduce-scatters / all-reduces over data-parallel axes (FSDP2, DDP,
  HSDP) issued after the piece and only waited for by the optimizer.

On a cluster whose collectives run on the compute cores (gloo on CPU,
:attr:`~topomesh.cost.cluster.Cluster.collectives_share_compute`) nothing overlaps: every
collective is ``blocking`` and pays what a collective costs more between compute than back to
back (:attr:`~topomesh.cost.cluster.Cluster.collective_in_step_s`). Where ranks share cores, op times and host work are stretched by
:attr:`~topomesh.cost.cluster.Cluster.compute_share` (the measured stretch of the ranks' concurrent
compute, which includes their arriving at a collective at different times) and such collectives by
:attr:`~topomesh.cost.cluster.Cluster.core_share`.

Each collective is priced on the link its group crosses under the placement
(:func:`topomesh.cost.cluster.axis_link`) and runs on the stream of that link class
(``intra``: inside a node; ``net``: across nodes), so an NVLink collective and a network
collective can run at once. A block is priced once and repeated by the engine.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from topomesh.cost.cluster import AxisLink, Cluster, group_collective_time_s
from topomesh.cost.ops import OpClass, itemsize, op_class, op_time_s, profilable
from topomesh.layout.dims import Axis
from topomesh.trace.graph import CollectiveKind, CollectiveRecord, OpRecord, Phase, TensorMeta
from topomesh.trace.result import Part, Segment, StateBytes, Trace


class Stream(StrEnum):
    INTRA = "intra"
    """Collectives whose group stays inside one node (NVLink/NVSwitch/PCIe/SHM)."""
    NET = "net"
    """Collectives whose group spans nodes (IB/Ethernet)."""


_DP_AXES = (Axis.DP_SHARD.value, Axis.DP_REPLICATE.value)
FUNCTIONAL = "_c10d_functional."
"""The op prefix of collectives DTensor (and expert parallel's all-to-all) issue; FSDP2's are
plain ``c10d.`` ops. Each pays :attr:`Cluster.dtensor_collective_s` on the computing thread
(:meth:`Pricer._host_s`; all such costs are 0 on GPU presets)."""
PLAIN = "c10d."
"""The op prefix of FSDP2's collectives: a reduction in backward pays
:attr:`Cluster.fsdp_reduce_s` (its unit's hooks), an all-gather :attr:`Cluster.fsdp_gather_s`."""


@dataclass(frozen=True, slots=True)
class Comm:
    axis: str
    stream: Stream
    seconds: float
    role: str = ""
    """``"gather"`` (a parameter all-gather), ``"reduce"`` (a gradient reduction) or ``""``
    (:func:`param_role`): what a pipeline stage drops from the micro-batches that do not
    run it, wherever the collective is booked (``blocking`` on shared cores)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Work:
    """One priced piece of a stage's step (see the module docstring)."""

    compute_s: float = 0.0
    blocking: tuple[Comm, ...] = ()
    gather: tuple[Comm, ...] = ()
    reduce: tuple[Comm, ...] = ()
    flops: int = 0
    weight_grad_s: float = 0.0
    """Backward only: the weight-gradient GEMMs, which zero-bubble schedules run apart (W).
    Each linear layer's backward is two GEMMs of equal FLOPs (input and weight gradient),
    so this is half of the backward matmul time."""
    saved_bytes: int = 0
    """Forward only: activations kept for backward, per micro-batch."""
    peak_output_bytes: int = 0
    gather_bytes: int = 0
    """Parameters the piece's all-gathers bring in (their output buffers), bytes; in a piece
    that gathers nothing, the parameters it makes (:attr:`Segment.param_bytes
    <topomesh.trace.result.Segment.param_bytes>`: FSDP2 replicate's casts to the compute
    dtype)."""
    reduce_bytes: int = 0
    """Input buffers of the piece's gradient reductions over data-parallel axes (FSDP2's
    reduce-scatter input: the unsharded gradients in the reduce dtype), bytes."""
    weight_output_bytes: int = 0
    """Forward only: the outputs of the piece's matmuls, per micro-batch — in the built-in
    models each multiplies by a weight (attention runs fused) — whose gradients a zero-bubble
    schedule's I keeps for its W (``stage_backward_input`` stores the gradient at each node
    that leads to a weight)."""
    gather_s: float = 0.0
    """Of :attr:`compute_s`: what unsharding the piece's parameters costs the computing thread
    (the ops FSDP2 runs to gather or cast them, :func:`op_role` ``"gather"``, and its host work
    per all-gather), which a pipeline stage's later micro-batches do not run."""
    wait_reduce: bool = False
    """The rank's compute stream waits for the piece's reductions once its action is done (its
    sends posted): FSDP2 under a pipeline reduces a stage's gradients in
    ``PipelineStage.perform_reduce_grad`` after the stage's last backward, and its
    ``finalize_backward`` orders the compute stream after them (:func:`topomesh.sim.simulate._reducing_after`)."""
    reduce_s: float = 0.0
    """Of :attr:`compute_s`: what reducing the piece's gradients costs the computing thread
    (FSDP2's copies into and out of the reduction, :func:`op_role` ``"reduce"``), which a
    pipeline stage runs in its last backward only. Not FSDP2's host work per unit
    (:attr:`Cluster.fsdp_reduce_s <topomesh.cost.cluster.Cluster.fsdp_reduce_s>`, booked on the
    unit's reduction): its hooks run in every forward and backward."""

    @property
    def empty(self) -> bool:
        return not (self.compute_s or self.blocking or self.gather or self.reduce)

    def scaled(self, compute: float, comm: float) -> Work:
        """This work with its compute (and weight-gradient) seconds times ``compute`` and
        every collective's seconds times ``comm``."""
        def each(comms: tuple[Comm, ...]) -> tuple[Comm, ...]:
            return tuple(dataclasses.replace(c, seconds=c.seconds * comm) for c in comms)

        return dataclasses.replace(self, compute_s=self.compute_s * compute, weight_grad_s=self.weight_grad_s * compute,
                                   gather_s=self.gather_s * compute, reduce_s=self.reduce_s * compute,
                                   blocking=each(self.blocking), gather=each(self.gather), reduce=each(self.reduce))


@dataclass(frozen=True, slots=True, kw_only=True)
class PricedClass:
    """Every piece of one layout class, priced on one cluster and placement."""

    fwd_pre: Work
    fwd_block: Work
    fwd_post: Work
    bwd_post: Work
    bwd_block: Work
    bwd_pre: Work
    opt_block: Work
    opt_first: Work
    opt_last: Work
    block_state: StateBytes
    first_state: StateBytes
    last_state: StateBytes
    boundary_bytes: int
    """Bytes a pipeline stage sends downstream per micro-batch (a block's output)."""
    head_output_bytes: int = 0
    """:attr:`ClassDigest.head_output_bytes`."""
    measured_ops: int = 0
    roofline_ops: int = 0
    links: Mapping[str, AxisLink] = field(default_factory=dict)
    grad_add_s_per_byte: float = 0.0
    """Seconds per byte moved by adding gradients into those kept from the step's earlier
    micro-batches (:func:`grad_add_s_per_byte`, in the parameters' dtype)."""
    fsdp_grad_add_s_per_byte: float = 0.0
    """The same for FSDP2's unsharded accumulated gradient under a pipeline (the reduction's
    dtype += the all-gather's)."""
    grad_scale_s_per_byte: float = 0.0
    """Seconds per byte moved by a pipeline schedule's scaling of its gradients after the last
    backward (:func:`grad_scale_s_per_byte`, in the parameters' dtype)."""
    backward_split: tuple[float, float] | None = None
    """The cluster's measured (I, W) shares of a full backward
    (:attr:`~topomesh.cost.cluster.Cluster.backward_split`); None: W is half the backward matmuls."""


GRAD_ADD_PROBE_BYTES = 64 * 2**20


def grad_add_record(kept: str = "float32", new: str | None = None) -> OpRecord:
    """The probe :func:`grad_add_s_per_byte` prices: ``kept += new`` over 64 MiB of kept
    gradients in ``kept``'s dtype, the new ones in ``new``'s (default the same), counted as
    reading both and writing the kept. Far larger than a core's caches, as the kept gradients
    are when a micro-batch's backward adds into them: a whole forward and backward ran since
    they were last touched."""
    new = new or kept
    n = GRAD_ADD_PROBE_BYTES // itemsize(kept)
    k = TensorMeta(shape=(n,), dtype=kept, stride=(1,))
    w = TensorMeta(shape=(n,), dtype=new, stride=(1,))
    return OpRecord(op="aten.add_.Tensor", inputs=(k, w), outputs=(k,), flops=n,
                    bytes_moved=n * (2 * itemsize(kept) + itemsize(new)), phase=Phase.BACKWARD)


def grad_add_s_per_byte(pricer: Pricer, kept: str = "float32", new: str | None = None) -> float:
    """Seconds per byte moved (read or written) by the in-place add a backward makes of its
    gradients into the ones kept from the step's earlier micro-batches: autograd's
    ``AccumulateGrad`` (``grad += new``) and FSDP2's unsharded accumulated gradient under a
    pipeline (``FSDPParam.unsharded_accumulated_grad += unsharded_param.grad``), which the
    trace of one micro-batch does not contain. An elementwise add in the gradients' dtypes,
    priced like any op of the step (the op table, else the roofline at the device's memory
    bandwidth) on :func:`grad_add_record`. The dtypes matter on a CPU: 64 MiB added here
    (Xeon, one thread) took 0.048 ns a byte moved in float32, 0.177 in bfloat16 and 0.207
    for float32 += bfloat16 (the kernels convert element by element)."""
    return _s_per_byte(pricer, grad_add_record(kept, new))


def grad_scale_record(dtype: str = "float32") -> OpRecord:
    """The probe :func:`grad_scale_s_per_byte` prices: ``grad /= 2`` (a Python number, as the
    micro-batch count is) over 64 MiB of gradients in ``dtype``, counted as reading and
    writing them."""
    n = GRAD_ADD_PROBE_BYTES // itemsize(dtype)
    g = TensorMeta(shape=(n,), dtype=dtype, stride=(1,))
    return OpRecord(op="aten.div_.Scalar", inputs=(g,), outputs=(g,), flops=n,
                    bytes_moved=2 * n * itemsize(dtype), phase=Phase.OPTIMIZER, args=(2,))


def grad_scale_s_per_byte(pricer: Pricer, dtype: str = "float32") -> float:
    """Seconds per byte moved (read or written) when a pipeline schedule scales its stage's
    gradients after the step's last backward: every ``torch.distributed.pipelining`` schedule
    of more than one micro-batch ends in ``PipelineStage.perform_reduce_grad``, whose
    ``scale_grads`` divides each gradient by the micro-batch count (``scale_grads=True``, the
    default, which ``topomesh validate`` runs). Priced like any op of the step on
    :func:`grad_scale_record`. Here (Xeon, one thread) a stage of ``validate_llama.json``
    under ``pp=2`` (2.0 M bfloat16 gradients in 19 tensors) took 2.1-2.2 ms, 0.27 ns a byte
    moved (0.033 in float32), and a real ``pp=2`` step's first stage spent 1.6-2.1 ms after
    its last backward before the schedule returned."""
    return _s_per_byte(pricer, grad_scale_record(dtype))


def _s_per_byte(pricer: Pricer, probe: OpRecord) -> float:
    """Seconds per byte ``probe`` moves, at its price on ``pricer``'s cluster."""
    return pricer.op_s(probe)[0] / probe.bytes_moved


def grad_add_dtypes(trace: Trace) -> tuple[tuple[str, str], tuple[str, str]]:
    """The (kept, new) dtypes of ``trace``'s gradient adds: autograd's, the parameters' dtype
    both (:attr:`Trace.dtype`); under a pipeline with FSDP, its unsharded gradient in the
    reduction's dtype and the new one in the all-gather's (the parameters' compute dtype),
    read off the trace's first backward reduction and first all-gather of parameters."""
    reduce = gather = None
    for seg in trace.segments:
        for e in seg.events:
            if isinstance(e, CollectiveRecord) and e.group_size > 1:
                role = param_role(e)
                if role == "reduce" and reduce is None:
                    reduce = e.dtype
                elif role == "gather" and gather is None:
                    gather = e.dtype
        if reduce and gather:
            break
    plain = (trace.dtype, trace.dtype)
    return plain, (reduce or trace.dtype, gather or reduce or trace.dtype)


def grad_probe_records(trace: Trace) -> list[OpRecord]:
    """The probes pricing ``trace``'s gradient adds (:func:`grad_add_dtypes`) and a pipeline's
    gradient scaling (:func:`grad_scale_record`, in the parameters' dtype) looks up: ops to put
    in the op table with the trace's own (``topomesh validate`` profiles them)."""
    plain, fsdp = grad_add_dtypes(trace)
    return list(dict.fromkeys([grad_add_record(*plain), grad_add_record(*fsdp), grad_scale_record(plain[0])]))


def is_param_collective(rec: CollectiveRecord) -> bool:
    """FSDP/DDP traffic: gathers of parameters and reductions of gradients over data-parallel
    axes (``dp_shard``, ``dp_replicate`` or flattened groups that contain one)."""
    axes = (rec.mesh_axis or "").split("+")
    return any(a in _DP_AXES for a in axes) and rec.kind in (
        CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_REDUCE
    )


def param_role(rec: CollectiveRecord) -> str:
    """``"gather"`` or ``"reduce"`` for FSDP/DDP traffic outside the optimizer (what
    :meth:`Pricer.digest` sorts into ``gather`` and ``reduce`` where collectives overlap), else ``""``."""
    if not is_param_collective(rec) or rec.phase is Phase.OPTIMIZER:
        return ""
    return "gather" if rec.kind is CollectiveKind.ALL_GATHER else "reduce"


GATHER_HOOKS = frozenset({"pre_forward", "pre_backward", "all_gather", "all_gather_copy_in", "all_gather_copy_out",
                          "forward_prefetch", "backward_prefetch"})
"""FSDP2 hooks (:attr:`OpRecord.hook <topomesh.trace.graph.OpRecord.hook>`) whose ops unshard
parameters: the all-gather's copy-in and copy-out, a replicate-only unit's cast of its
parameters to the compute dtype. Under a pipeline they run in a stage's first forward only:
PyTorch's stage keeps its parameters unsharded for the step (torchtitan's
``reshard_after_forward`` off, as ``topomesh validate`` runs it). Not ``cast_forward_inputs``,
the cast of a unit's inputs, which every forward runs."""
REDUCE_HOOKS = frozenset({"post_backward_reduce"})
"""FSDP2 hooks whose ops reduce gradients: the copy into the reduction's buffer (with its cast
to the reduce dtype) and the copy of its result into the sharded gradient. Under a pipeline a
stage runs them in its last backward only (``PipelineStage.backward_maybe_with_nosync``)."""


def op_role(rec: OpRecord) -> str:
    """``"gather"`` or ``"reduce"`` for an op FSDP2 runs to unshard parameters or to reduce
    gradients (:data:`GATHER_HOOKS`, :data:`REDUCE_HOOKS`), as :func:`param_role` sorts their
    collectives, else ``""``.

    >>> from topomesh.trace.graph import OpRecord
    >>> [op_role(OpRecord(op="aten.copy_.default", inputs=(), outputs=(), hook=h))
    ...  for h in ("pre_forward", "all_gather_copy_out", "post_backward_reduce", "cast_forward_inputs", "")]
    ['gather', 'gather', 'reduce', '', '']
    """
    if rec.hook in GATHER_HOOKS:
        return "gather"
    return "reduce" if rec.hook in REDUCE_HOOKS else ""


class Pricer:
    """Prices records on one cluster and placement, each distinct op signature once."""

    def __init__(self, cluster: Cluster, link_of: Callable[[str], AxisLink], table: Mapping,
                 op_cache: dict[OpRecord, tuple[float, bool]] | None = None) -> None:
        self.cluster = cluster
        self.link_of = link_of
        self.table = table
        self._ops = {} if op_cache is None else op_cache
        """Op record -> (seconds, measured); share it between pricings on one cluster and table."""
        self.dispatch: dict[tuple[Phase, Part], float] = {}
        """Seconds DTensor adds to an op, by its phase and segment part, where ops run on
        DTensors (set per trace by :func:`digest_class`: :func:`dtensor_dispatch`)."""

    def op_s(self, rec: OpRecord) -> tuple[float, bool]:
        """(seconds on this cluster's share of cores, whether the op table measured it)."""
        hit = self._ops.get(rec)
        if hit is None:
            cost = op_time_s(rec, self.cluster.device, self.table)
            hit = self._ops[rec] = (cost.seconds, cost.measured)
        return hit[0] * self.cluster.compute_share, hit[1]

    def comm(self, rec: CollectiveRecord, gap_s: float = 0.0) -> Comm:
        """``rec`` priced on its link; on the compute cores (gloo), after ``gap_s`` seconds of
        compute: its calibrated time (and, issued as a functional collective, what that costs
        more: :meth:`~topomesh.cost.cluster.Cluster.functional_premium`) at the share of the
        cores the node's other ranks leave it
        (:meth:`~topomesh.cost.cluster.Cluster.collective_share`), and what it costs more after
        that compute (:meth:`~topomesh.cost.cluster.Cluster.in_step_extra_s`)."""
        link = self.link_of(rec.mesh_axis or "")
        seconds = group_collective_time_s(rec, link, self.cluster.profile)
        if self.cluster.collectives_share_compute:
            c = self.cluster
            ranks = link.ranks_per_node  # the group's on one node
            if rec.op.startswith(FUNCTIONAL):  # as DTensor issues it, not as the sweep did
                seconds += c.functional_premium(rec.kind.value, rec.dtype, rec.bytes)
            seconds = max(0.0, seconds * c.collective_share(ranks) + c.in_step_extra_s(gap_s, ranks))
        return Comm(axis=rec.mesh_axis or "?", stream=Stream.NET if link.nodes > 1 else Stream.INTRA, seconds=seconds,
                    role=param_role(rec))

    def work(self, segments: Iterable[Segment], *, exclude: Counter | None = None, extra_gather: Iterable = ()) -> Work:
        """One :class:`Work` from segments (summed); ``exclude`` drops records (a multiset)
        that belong to another piece, ``extra_gather`` adds records issued elsewhere."""
        return self.priced(self.digest(segments, exclude=exclude, extra_gather=extra_gather))

    def digest(self, segments: Iterable[Segment], *, exclude: Counter | None = None,
               extra_gather: Iterable = ()) -> Digest:
        """What :meth:`work` computes without the links: op times and the collectives sorted
        by how they run (the same on every placement, so :func:`price_trace` keeps it per trace)."""
        drop = Counter(exclude or ())
        compute = weight = 0.0
        role_s = {"gather": 0.0, "reduce": 0.0, "": 0.0}  # of compute: FSDP2's unsharding and reduction
        flops = saved = peak = gathered = reduced = made = measured = roofline = weight_out = 0
        blocking: list[CollectiveRecord] = []
        gather: list[CollectiveRecord] = []
        reduce: list[CollectiveRecord] = []
        shared = self.cluster.collectives_share_compute
        host = any((self.cluster.dtensor_collective_s, self.cluster.fsdp_reduce_s, self.cluster.fsdp_gather_s))
        gaps: list[float] = []  # shared: the compute before each blocking collective, in order
        since = 0.0
        seen: dict[int, tuple[float, bool, bool] | None] = {}  # per record object: traces repeat them
        made_by: dict[int, int] = {}  # per forward record object: its matmul output bytes (0: no matmul)
        for seg in segments:
            saved += seg.saved_bytes
            peak = max(peak, seg.peak_output_bytes)
            made += seg.param_bytes
            for e in seg.events:
                if drop and drop[e] > 0:
                    drop[e] -= 1
                    continue
                if isinstance(e, OpRecord):
                    key = id(e)
                    if e.phase is Phase.FORWARD:
                        out = made_by.get(key)
                        if out is None:
                            out = made_by[key] = (sum(math.prod(t.shape) * itemsize(t.dtype) for t in e.outputs)
                                                  if op_class(e.op) is OpClass.MATMUL else 0)
                        weight_out += out
                    if key in seen:
                        hit = seen[key]
                    else:
                        hit = seen[key] = self._op_cost(e) if profilable(e) else None
                    if hit is None:
                        continue
                    s, was_measured, matmul_grad = hit
                    s = max(0.0, s + self.dispatch.get((e.phase, seg.part), 0.0))  # measured: may be < 0
                    if was_measured:
                        measured += 1
                    else:
                        roofline += 1
                    compute += s
                    since += s
                    role_s[op_role(e)] += s
                    flops += e.flops
                    if matmul_grad:
                        weight += s / 2
                elif e.group_size > 1:
                    role = param_role(e)
                    if host:
                        h = self._host_s(e)
                        compute += h
                        since += h
                        if role == "gather":  # a unit's hooks (Cluster.fsdp_reduce_s) run every micro-batch
                            role_s[role] += h
                    gathered += e.bytes if role == "gather" else 0
                    reduced += e.bytes if role == "reduce" else 0
                    if shared or not role:
                        blocking.append(e)  # shared: no overlap, the compute cores run it
                        if shared:
                            gaps.append(since)
                            since = 0.0
                    else:
                        (gather if role == "gather" else reduce).append(e)
        extra = [e for e in extra_gather if isinstance(e, CollectiveRecord) and e.group_size > 1]
        if host:
            prefetched = sum(self._host_s(e) for e in extra)  # prefetched here
            compute += prefetched
            role_s["gather"] += prefetched
        (blocking if shared else gather).extend(extra)
        gathered += sum(e.bytes for e in extra)
        gaps = _wrapped_gaps(gaps, since, len(extra)) if shared else []
        # parameters a piece makes without gathering them: FSDP2's replicate-only units cast
        # theirs to the compute dtype in each pre-forward and pre-backward (no all-gather)
        gathered = gathered or made
        return Digest(compute_s=compute, blocking=tuple(blocking), blocking_gaps=tuple(gaps), gather=tuple(gather),
                      reduce=tuple(reduce),
                      flops=flops, weight_grad_s=weight, saved_bytes=saved, peak_output_bytes=peak,
                      weight_output_bytes=weight_out,
                      gather_bytes=gathered, reduce_bytes=reduced, measured=measured, roofline=roofline,
                      gather_s=role_s["gather"], reduce_s=role_s["reduce"])

    def _host_s(self, e: CollectiveRecord) -> float:
        """:func:`collective_host_s` at the cluster's compute share."""
        return collective_host_s(self.cluster, e) * self.cluster.compute_share

    def _op_cost(self, e: OpRecord) -> tuple[float, bool, bool]:
        """(seconds, from the op table?, a backward matmul?) of one op (DTensor dispatch apart:
        :attr:`dispatch`)."""
        s, was_measured = self.op_s(e)
        return s, was_measured, e.phase is Phase.BACKWARD and op_class(e.op) is OpClass.MATMUL

    def priced(self, d: Digest) -> Work:
        """``d`` with its collectives priced on their links."""
        gaps = d.blocking_gaps or (0.0,) * len(d.blocking)
        return Work(compute_s=d.compute_s, blocking=tuple(self.comm(e, g) for e, g in zip(d.blocking, gaps, strict=True)),
                    gather=tuple(self.comm(e) for e in d.gather), reduce=tuple(self.comm(e) for e in d.reduce),
                    flops=d.flops, weight_grad_s=d.weight_grad_s, saved_bytes=d.saved_bytes,
                    peak_output_bytes=d.peak_output_bytes, gather_bytes=d.gather_bytes, reduce_bytes=d.reduce_bytes,
                    weight_output_bytes=d.weight_output_bytes, gather_s=d.gather_s, reduce_s=d.reduce_s)


class SymbolicPricer(Pricer):
    """Prices ops as :class:`Pricer` does and every collective as 1 s named after its record
    (``"#i"``, ``records[i]``): plans priced so are templates (:class:`topomesh.sim.kernel.Template`)."""

    def __init__(self, cluster: Cluster, table: Mapping, op_cache: dict | None = None) -> None:
        super().__init__(cluster, lambda name: None, table, op_cache)  # type: ignore[arg-type, return-value]
        self.index: dict[tuple[CollectiveRecord, float], int] = {}

    @property
    def records(self) -> list[CollectiveRecord]:
        return [rec for rec, _ in self.index]

    @property
    def gaps(self) -> list[float]:
        """The compute before each of :attr:`records` (:meth:`Pricer.comm`'s ``gap_s``)."""
        return [gap for _, gap in self.index]

    def comm(self, rec: CollectiveRecord, gap_s: float = 0.0) -> Comm:
        i = self.index.setdefault((rec, gap_s), len(self.index))
        return Comm(axis=f"#{i}", stream=Stream.INTRA, seconds=1.0, role=param_role(rec))


@dataclass(frozen=True, slots=True, kw_only=True)
class Digest:
    """A piece before its collectives are priced (:meth:`Pricer.digest`)."""

    compute_s: float
    blocking: tuple[CollectiveRecord, ...]
    gather: tuple[CollectiveRecord, ...]
    reduce: tuple[CollectiveRecord, ...]
    flops: int
    weight_grad_s: float
    saved_bytes: int
    peak_output_bytes: int
    gather_bytes: int
    reduce_bytes: int
    measured: int
    """Op records of the piece priced from the op table (every occurrence counted)."""
    roofline: int
    """Op records of the piece priced by the roofline."""
    blocking_gaps: tuple[float, ...] = ()
    """Where collectives run on the compute cores: the seconds of compute before each of
    ``blocking`` (:func:`_wrapped_gaps`); empty otherwise."""
    weight_output_bytes: int = 0
    """:attr:`Work.weight_output_bytes`."""
    gather_s: float = 0.0
    """:attr:`Work.gather_s`."""
    reduce_s: float = 0.0
    """:attr:`Work.reduce_s`."""


def _wrapped_gaps(gaps: list[float], tail: float, prefetched: int) -> list[float]:
    """The compute before each blocking collective of a piece, in the order :meth:`Pricer.digest`
    lists them: its own collectives (``gaps``: the compute since the piece began or since the
    one before), then ``prefetched`` gathers issued when the piece begins. A piece repeats (a
    block) or follows one much like it, so what comes before its first collective is taken as
    its own compute after its last one (``tail``): the prefetched gathers follow that, back to
    back, and then the first own collective follows only its head; without them the first
    follows tail and head.

    >>> _wrapped_gaps([1.0, 2.0], 0.5, 0), _wrapped_gaps([1.0, 2.0], 0.5, 2), _wrapped_gaps([], 3.0, 1)
    ([1.5, 2.0], [1.0, 2.0, 0.5, 0.0], [3.0])
    """
    if prefetched:
        return [*gaps, tail, *(0.0,) * (prefetched - 1)]
    return [gaps[0] + tail, *gaps[1:]] if gaps else []


def _split(segments: Iterable[Segment], phase: Phase) -> tuple[list[Segment], list[Segment], list[Segment]]:
    """(before the blocks, the blocks, after the blocks) of one phase, in step order."""
    segs = [s for s in segments if s.phase is phase]
    idx = [i for i, s in enumerate(segs) if s.part is Part.BLOCK]
    if not idx:
        return segs, [], []
    return segs[: idx[0]], segs[idx[0] : idx[-1] + 1], segs[idx[-1] + 1 :]


def _per_block(work: Work, n: int) -> Work:
    if n <= 1:
        return work

    def each(comms: tuple[Comm, ...]) -> tuple[Comm, ...]:
        # n traced blocks issue n times the collectives of one: keep one block's share
        return comms[: len(comms) // n] if len(comms) % n == 0 else tuple(
            dataclasses.replace(c, seconds=c.seconds / n) for c in comms)

    return Work(compute_s=work.compute_s / n, blocking=each(work.blocking), gather=each(work.gather),
                reduce=each(work.reduce), flops=work.flops // n, weight_grad_s=work.weight_grad_s / n,
                saved_bytes=work.saved_bytes // n, peak_output_bytes=work.peak_output_bytes,
                gather_bytes=work.gather_bytes // n, reduce_bytes=work.reduce_bytes // n,
                weight_output_bytes=work.weight_output_bytes // n, gather_s=work.gather_s / n,
                reduce_s=work.reduce_s / n)


def collective_axes(trace: Trace) -> tuple[str, ...]:
    """Mesh-axis names the trace's collectives run on (what its pricing depends on)."""
    names = {e.mesh_axis or "" for s in trace.segments for e in (*s.events, *s.prefetch)
             if isinstance(e, CollectiveRecord) and e.group_size > 1}
    return tuple(sorted(names))


def dtensor_phases(layout: Iterable[tuple[str, int]]) -> frozenset[Phase]:
    """The phases whose ops run on DTensors under PyTorch's parallel APIs: forward and
    backward with tensor parallel (TP/SP turn every block, embedding and head tensor into a
    DTensor); the optimizer wherever a parameter is sharded or TP-split (FSDP2 keeps its
    sharded parameters as DTensors; its forward and backward compute on plain unsharded ones).

    >>> sorted(p.value for p in dtensor_phases([("dp_shard", 2)]))
    ['optimizer']
    >>> sorted(p.value for p in dtensor_phases([("tp", 2)]))
    ['backward', 'forward', 'optimizer']
    >>> dtensor_phases([("dp_shard", 1)])
    frozenset()
    """
    degrees = dict(layout)
    phases: set[Phase] = set()
    if degrees.get(Axis.TP.value, 1) > 1:
        phases |= {Phase.FORWARD, Phase.BACKWARD}
    if any(degrees.get(a.value, 1) > 1 for a in (Axis.TP, Axis.DP_SHARD, Axis.DP_REPLICATE, Axis.CP)):
        phases.add(Phase.OPTIMIZER)
    return frozenset(phases)


def dtensor_dispatch(cluster: Cluster, layout: Iterable[tuple[str, int]]) -> dict[tuple[Phase, Part], float]:
    """What DTensor adds to each op by (phase, part), for the phases :func:`dtensor_phases` runs
    on DTensors: under tensor parallel the figures measured inside and outside the blocks
    (:attr:`Cluster.dtensor_block_dispatch_s`, ``_rest_``) where the cluster has them, else the
    per-op figure of a chain (:attr:`Cluster.dtensor_dispatch_s`, also the optimizer's on
    sharded parameters); at the cluster's compute share. Where the layout's own step measured
    it (:attr:`Cluster.fb_host_s`), that figure for every forward and backward op, whatever the
    axes. Empty where nothing is charged.

    >>> import dataclasses
    >>> from topomesh.cost.cluster import load_cluster
    >>> c = dataclasses.replace(load_cluster("dgx-h100", gpus=2), dtensor_dispatch_s=1.0, dtensor_block_dispatch_s=3.0)
    >>> d = dtensor_dispatch(c, [("tp", 2)])
    >>> d[(Phase.FORWARD, Part.BLOCK)], d[(Phase.BACKWARD, Part.REST)], d[(Phase.OPTIMIZER, Part.BLOCK)]
    (3.0, 1.0, 1.0)
    >>> dtensor_dispatch(load_cluster("dgx-h100", gpus=2), [("tp", 2)])
    {}
    """
    out = {}
    phases = dtensor_phases(layout)
    if cluster.fb_host_s is not None:  # measured on this layout's own step, whatever its axes
        phases |= {Phase.FORWARD, Phase.BACKWARD}
    for phase in phases:
        for part in Part:
            s = cluster.dtensor_dispatch_s
            if phase is not Phase.OPTIMIZER and cluster.fb_host_s is not None:
                s = cluster.fb_host_s
            elif phase is not Phase.OPTIMIZER:
                s = (cluster.dtensor_block_dispatch_s if part is Part.BLOCK else cluster.dtensor_rest_dispatch_s) or s
            if s:
                out[(phase, part)] = s * cluster.compute_share
    return out


def collective_host_s(cluster: Cluster, e: CollectiveRecord) -> float:
    """Host work on the computing thread around collective ``e``, besides its transfer, on one
    rank's own core: DTensor's for its functional collectives, FSDP2's per all-gather and per
    reduction (a unit's hooks) for its plain c10d ones."""
    if e.op.startswith(FUNCTIONAL):
        return cluster.dtensor_collective_s
    if not e.op.startswith(PLAIN):
        return 0.0
    if e.kind is CollectiveKind.ALL_GATHER:
        return cluster.fsdp_gather_s
    if e.phase is Phase.BACKWARD and e.kind in (CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_REDUCE):
        return cluster.fsdp_reduce_s
    return 0.0


def with_fb_host(cluster: Cluster, trace: Trace, host_fb_s: float) -> Cluster:
    """``cluster`` with the host work of each forward and backward op (:attr:`Cluster.fb_host_s`)
    taken from ``host_fb_s``, the host work one micro-batch's forward and backward of ``trace``
    (composed to full depth) measured beyond its ops (:func:`topomesh.cost.instep.eager_fb_s`
    less the replay): what is left after its collectives' host work (:func:`collective_host_s`),
    per op :meth:`Pricer.digest` prices. Negative where the eager step ran its ops for less than
    the replay (:func:`topomesh.cost.instep.in_step_times`): each op then costs that much less,
    never below nothing.

    Where the trace has no such op, ``cluster`` as it is.
    """
    ops, colls = 0, 0.0
    for e in trace.events():  # composed: a one-block trace's block events n_layers times
        if e.phase not in (Phase.FORWARD, Phase.BACKWARD):
            continue
        if isinstance(e, OpRecord):
            ops += profilable(e)
        elif e.group_size > 1:
            colls += collective_host_s(cluster, e)
    if not ops:
        return cluster
    return dataclasses.replace(cluster, fb_host_s=(host_fb_s - colls) / ops)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClassDigest:
    """Everything the simulator reads from one layout class's trace, before any link is priced:
    each piece's :class:`Digest`, the stage boundary, the state bytes, the FLOPs of the step at
    full depth and the axes its collectives run on. Kept per trace in memory and on disk
    (:mod:`topomesh.sim.digest`), so a warm search never decodes a trace."""

    fwd_pre: Digest
    fwd_block: Digest
    fwd_post: Digest
    bwd_post: Digest
    bwd_block: Digest
    bwd_pre: Digest
    opt_block: Digest
    opt_rest: Digest
    """The optimizer work outside the blocks (shared by the first and last stage)."""
    boundary_bytes: int
    traced_layers: int
    block_state: StateBytes
    first_state: StateBytes
    last_state: StateBytes
    flops_by_phase: tuple[tuple[str, int], ...]
    """FLOPs per phase of the whole step at the model's depth (:meth:`Trace.summary`)."""
    axes: tuple[str, ...]
    """:func:`collective_axes` of the trace."""
    grad_dtypes: tuple[str, str] = ("float32", "float32")
    fsdp_grad_dtypes: tuple[str, str] = ("float32", "float32")
    """(kept, new) dtypes of the gradient adds (:func:`grad_add_dtypes`)."""
    head_output_bytes: int = 0
    """Bytes of the last forward matmul's output after the blocks (the head's logits): the last
    pipeline stage's output (:func:`head_output_bytes`)."""

    def pieces(self) -> dict[str, Digest]:
        return {name: getattr(self, name) for name in PIECES}


PIECES = ("fwd_pre", "fwd_block", "fwd_post", "bwd_post", "bwd_block", "bwd_pre", "opt_block", "opt_rest")


def head_output_bytes(segments: Iterable[Segment]) -> int:
    """Bytes of the last forward matmul's output in ``segments`` (the forward after the blocks:
    the head's projection, whose logits the loss then reads): what the last pipeline stage
    outputs per micro-batch. PyTorch's ``PipelineStage`` keeps a stage's output for each
    micro-batch until that micro-batch's backward (``fwd_cache``); without a pipeline the loss's
    own copy is what backward keeps. 0 where there is no matmul."""
    out = 0
    for seg in segments:
        for e in seg.events:
            if isinstance(e, OpRecord) and e.phase is Phase.FORWARD and op_class(e.op) is OpClass.MATMUL and e.outputs:
                out = e.outputs[0].numel * itemsize(e.outputs[0].dtype)
    return out


def price_trace(trace: Trace, pricer: Pricer, digests: dict | None = None) -> PricedClass:
    """Price a trace (as traced, not composed: blocks are priced once and repeated by the engine).

    ``digests`` (a dict kept between calls) holds each trace's link-free part
    (:func:`digest_class`), so pricing the same trace on other links only prices its
    collectives; exact, the digest is what the links do not change."""
    return price_digest(memo_digest(trace, pricer, digests), pricer)


def memo_digest(trace: Trace, pricer: Pricer, digests: dict | None = None) -> ClassDigest:
    """:func:`digest_class` of ``trace`` at its own depth, once per trace through ``digests``."""
    key = (id(trace.segments), trace.n_layers)
    hit = None if digests is None else digests.get(key)
    if hit is None:
        hit = (trace.segments, digest_class(trace, pricer))
        if digests is not None:
            digests[key] = hit
    return hit[1]


def price_digest(d: ClassDigest, pricer: Pricer) -> PricedClass:
    """The pieces of ``d`` with their collectives priced by ``pricer``."""
    n = d.traced_layers
    work = {name: pricer.priced(p) for name, p in d.pieces().items()}
    first, last = d.first_state.total, d.last_state.total
    share = first / (first + last) if first + last else 0.5
    return PricedClass(
        fwd_pre=work["fwd_pre"],
        fwd_block=_per_block(work["fwd_block"], n),
        fwd_post=work["fwd_post"],
        bwd_post=work["bwd_post"],
        bwd_block=_per_block(work["bwd_block"], n),
        bwd_pre=work["bwd_pre"],
        opt_block=_per_block(work["opt_block"], n),
        opt_first=_scaled(work["opt_rest"], share),
        opt_last=_scaled(work["opt_rest"], 1.0 - share),
        block_state=d.block_state,
        first_state=d.first_state,
        last_state=d.last_state,
        boundary_bytes=d.boundary_bytes,
        head_output_bytes=d.head_output_bytes,
        measured_ops=sum(p.measured for p in d.pieces().values()),
        roofline_ops=sum(p.roofline for p in d.pieces().values()),
        grad_add_s_per_byte=grad_add_s_per_byte(pricer, *d.grad_dtypes),
        fsdp_grad_add_s_per_byte=grad_add_s_per_byte(pricer, *d.fsdp_grad_dtypes),
        grad_scale_s_per_byte=grad_scale_s_per_byte(pricer, d.grad_dtypes[0]),
        backward_split=pricer.cluster.backward_split,
    )


def digest_class(trace: Trace, pricer: Pricer) -> ClassDigest:
    """The link-free part of pricing ``trace`` (op times, collectives sorted by how they run)
    and what else the simulator reads from it; ``trace.n_layers`` is the depth of the FLOPs."""
    pricer.dispatch = dtensor_dispatch(pricer.cluster, trace.layout)
    f_pre, f_blocks, f_post = _split(trace.segments, Phase.FORWARD)
    b_post, b_blocks, b_pre = _split(trace.segments, Phase.BACKWARD)
    o_pre, o_blocks, o_post = _split(trace.segments, Phase.OPTIMIZER)
    # FSDP's backward all-gather of the block that runs first in backward is issued by the
    # head: the records stay in that REST segment and are listed as the block's prefetch.
    prefetch = [e for s in b_blocks for e in s.prefetch]
    moved = Counter(prefetch)
    block_fwd = [e for s in f_blocks for e in s.events if isinstance(e, OpRecord) and profilable(e)]
    grads, fsdp_grads = grad_add_dtypes(trace)
    boundary = 0
    if block_fwd:
        out = block_fwd[-1].outputs
        boundary = sum(t.numel * itemsize(t.dtype) for t in out[:1])
    return ClassDigest(
        head_output_bytes=head_output_bytes(f_post),
        fwd_pre=pricer.digest(f_pre),
        fwd_block=pricer.digest(f_blocks),
        fwd_post=pricer.digest(f_post),
        bwd_post=pricer.digest(b_post, exclude=moved),
        bwd_block=pricer.digest(b_blocks, extra_gather=prefetch),
        bwd_pre=pricer.digest(b_pre, exclude=moved),
        opt_block=pricer.digest(o_blocks),
        opt_rest=pricer.digest([*o_pre, *o_post]),
        boundary_bytes=boundary,
        traced_layers=trace.traced_layers,
        block_state=trace.block_state,
        first_state=trace.first_state,
        last_state=trace.last_state,
        flops_by_phase=tuple(sorted(trace.summary().flops_by_phase.items())),
        axes=collective_axes(trace),
        grad_dtypes=grads,
        fsdp_grad_dtypes=fsdp_grads,
    )


def _scaled(work: Work, k: float) -> Work:
    """The optimizer work of the parameters outside the blocks, shared between the first and
    the last stage by their state bytes."""
    return dataclasses.replace(work.scaled(k, k), flops=int(work.flops * k))
