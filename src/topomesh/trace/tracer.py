"""Trace one rank's training step of the user's own model and parallelize function.

``trace_step`` runs in one CPU process and allocates no parameter memory:

1. a fake process group of the layout's world size (``init_process_group("fake", ...)``)
   and a :class:`~torch.distributed.device_mesh.DeviceMesh` whose dimensions are the layout's
   axes (degrees as given; ``pp`` is left out — a pipeline stage's trace is the same step on
   fewer layers);
2. the model built under ``FakeTensorMode`` with the default dtype set to the training
   dtype (``.to(dtype)`` cannot swap fake parameters), then the user's ``parallelize(model,
   mesh)`` — outside fake mode, because mesh bookkeeping runs real ops on rank tables;
3. a warm-up (one whole step: forward, backward, optimizer step, eagerly on fake tensors)
   so the trace shows a steady-state step, then ``make_fx`` of forward + loss + backward + optimizer
   step; DTensor dispatch runs inside
   the trace, so the graph holds local-shard ops and the collectives DTensor, FSDP2 and
   expert parallel issue;
4. :mod:`topomesh.trace.convert` turns nodes into records; hooks placed during tracing cut
   the graph into phases (forward, backward, optimizer) and into block / rest segments.

Context parallel (a ``cp`` axis > 1): the inputs and labels are cut along the sequence dims
the :class:`ModelSpec` names (``seq_dims``), with
:func:`~topomesh.models.parallelize.cp_shard`. PyTorch's ring attention only has rules for
the CUDA attention kernels, and a CPU build cannot make fake CUDA tensors that survive
backward, so during such a trace ``F.scaled_dot_product_attention`` on CPU tensors is issued
as ``aten._scaled_dot_product_flash_attention`` — the kernel a GPU runs for it — whose fake
(meta) kernel and FLOP formula work on any device (:class:`_CudaAttentionKernels`).

Example (tiny model, TP 2 × FSDP 2)::

    spec = transformer_spec(get_preset("tiny-llama"))
    t = trace_step(spec, make_parallelize(), {"dp_shard": 2, "tp": 2}, n_layers=1)
    t.compose(spec.n_layers).summary().flops
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.device_mesh
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from topomesh.errors import LayoutError, TopomeshError, TraceError
from topomesh.layout import groups
from topomesh.layout.dims import Axis
from topomesh.models.transformer import Transformer, TransformerConfig
from topomesh.trace import chunks
from topomesh.trace.convert import GroupTable, is_known, node_records
from topomesh.trace.graph import CollectiveRecord, OpRecord, Phase
from topomesh.trace.kernels import GpuKernels, Replaced
from topomesh.trace.result import Part, Segment, StateBytes, Trace

ParallelizeFn = Callable[[nn.Module, "dist.device_mesh.DeviceMesh"], "nn.Module | None"]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token cross-entropy in float32, as torchtitan computes it."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def layer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a torchtitan-style model: the children of ``model.layers``."""
    layers = getattr(model, "layers", None)
    return list(layers.children()) if isinstance(layers, nn.Module) else []


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """How to build and drive the user's model for a trace."""

    name: str
    key: str
    """Identifies the model's shape in trace caches (e.g. the config's repr)."""
    n_layers: int
    """Depth of the real model; traces may build fewer layers and compose."""
    build: Callable[[int], nn.Module]
    """``build(n_layers)`` returns the model with that many blocks (called under fake mode)."""
    make_inputs: Callable[[int], tuple[tuple[torch.Tensor, ...], torch.Tensor]]
    """``make_inputs(batch_size)`` returns (forward args, labels) (called under fake mode)."""
    blocks: Callable[[nn.Module], list[nn.Module]] = layer_blocks
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = causal_lm_loss
    seq_dims: tuple[int, ...] | None = None
    """The sequence dim of each forward arg, then of the labels, for context parallel; None:
    the inputs cannot be cut along a sequence, so a ``cp`` axis > 1 is refused."""
    state_warm_up: bool = False
    """Reach the steady state without running a step (:func:`_warm_up_state`): true for the
    built-in models, whose first step differs from later ones only in FSDP2's lazy
    initialization and unsharded parameters and the optimizer's state (a test compares their
    traces with those after a whole step, record by record, for every parallelism they use).
    A user's model may keep other first-step state, so it warms up with a whole step."""


def default_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW, one parameter at a time (``foreach=False``), so its ops split per block."""
    return torch.optim.AdamW(params, lr=1e-4, foreach=False)


def normalize_layout(layout: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """The traced mesh: axes in the given order without ``pp``; degrees checked.

    >>> normalize_layout({"pp": 4, "dp_shard": 2, "tp": 8})
    (('dp_shard', 2), ('tp', 8))
    """
    out = []
    for axis, degree in layout.items():
        if not isinstance(degree, int) or degree < 1:
            raise LayoutError(f"Degree of mesh axis {axis!r} must be a positive integer, got {degree!r}.")
        if axis != Axis.PP:
            out.append((str(axis), degree))
    return tuple(out) or (("dp_shard", 1),)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A default process group on the fake backend for the duration of the block."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as exc:  # private module: fail loudly if a torch release moves it
        raise TraceError(
            f"torch {torch.__version__} has no fake process group "
            "(torch.testing._internal.distributed.fake_pg); tracing was tested on torch 2.13."
        ) from exc

    if dist.is_initialized():
        raise TraceError(
            f"A default process group ({dist.get_backend()}, world size {dist.get_world_size()}) "
            "already exists; trace in a process that has none, since the tracer needs its own "
            "fake group."
        )
    dist.init_process_group("fake", store=FakeStore(), world_size=world_size, rank=0)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """Clear DTensor's process-wide caches, which hold device meshes by value: a mesh of the
    next trace equal in shape and names to one of this trace (``tp`` over ranks 0, 1) would
    otherwise find this trace's mesh there, with the names of process groups destroyed with
    it ("Could not resolve the process group registered under the name 3")."""
    from torch.distributed.tensor import DTensor, _redistribute, _sharding_prop

    prop = DTensor._op_dispatcher.sharding_propagator
    for fn in (getattr(prop, "propagate_op_sharding", None), getattr(_redistribute, "_gen_transform_infos", None),
               getattr(_sharding_prop.ShardingPropagator, "_propagate_tensor_meta_cached", None)):
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    getattr(_redistribute, "_planner_cache", {}).clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's
    if clear_native is not None:
        clear_native()


_RING_FUNCTIONS = ("_templated_ring_attention", "_templated_ring_attention_backward")
ROUND = "round"
"""The label of a ring-round mark (:meth:`_Markers.watch_rounds`)."""
PHASE_META = "topomesh_phase"
"""The ``node.meta`` key :func:`with_step_graph` sets on every node of the graph it hands out:
the node's :class:`~topomesh.trace.graph.Phase`, as the trace's segments cut it."""


class _RingSize:
    """``torch.distributed`` as PyTorch's ring attention sees it, with its loop's world size set.

    The ring functions take their round count from ``dist.get_world_size(group)``; only calls
    made directly from those two functions get ``rounds`` (the rotaters, which move the real
    buffers over the real group, ask from their own methods and get the true size)."""

    def __init__(self, real: object, rounds: int) -> None:
        self._real = real
        self._rounds = rounds

    def get_world_size(self, group: object = None) -> int:
        import sys

        if sys._getframe(1).f_code.co_name in _RING_FUNCTIONS:
            return self._rounds
        return self._real.get_world_size(group)

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


@contextlib.contextmanager
def limited_ring(rounds: int, markers: _Markers | None = None) -> Iterator[None]:
    """Run context-parallel ring attention for ``rounds`` rounds (see :func:`trace_step`).

    On rank 0 (the traced rank) round 0 is the causal local block; every later round, with
    PyTorch's round-robin load balancing, attends the second half of the local queries to a
    whole received key/value chunk — the same shapes in every round — and each round but the
    last sends the chunk on. So a ring of ``n`` rounds is the ring of 4 plus ``n - 4`` copies
    of what the ring of 4 adds to the ring of 3 (:func:`topomesh.trace.cache.compose_rounds`).

    With ``markers``, the start of every later round is marked ``round:<i>`` in the graph
    (:meth:`_Markers.watch_rounds`), so one trace can also give the ring one round shorter
    (:func:`trace_rings`)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    real, real_create = _attention.dist, _attention._create_rotater

    def create(pg: object, seq_dim: int, method: object = None) -> object:
        rotater = real_create(pg, seq_dim, method)
        if method is None:  # the ring's key/value rotater (gradients rotate by an explicit method)
            markers.watch_rounds(rotater)
        return rotater

    _attention.dist = _RingSize(real, rounds)
    if markers is not None:
        _attention._create_rotater = create
    try:
        yield
    finally:
        _attention.dist, _attention._create_rotater = real, real_create


@contextlib.contextmanager
def _eager_checkpoint_policies() -> Iterator[None]:
    """Selective activation checkpointing as a run applies it: ops its policy does not save are
    recomputed in backward. Under ``make_fx`` PyTorch's selective checkpointing takes itself to
    be compiling (a proxy mode is on), saves every op's output and leaves the choice to a
    compiler's partitioner, which a trace does not run; its traced backward recomputed nothing."""
    from torch.utils import checkpoint

    real = getattr(checkpoint, "_is_compiling", None)
    if real is None:
        yield
        return
    checkpoint._is_compiling = lambda *_: False
    try:
        yield
    finally:
        checkpoint._is_compiling = real


_SDPA = F.scaled_dot_product_attention


def _flash_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: object, **kwargs: object) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, issued as the CUDA flash kernel when causal or plain
    on CPU tensors (see :class:`_CudaAttentionKernels`)."""
    bound = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale"), rest, strict=False), **kwargs)
    plain = bound.get("attn_mask") is None and not bound.get("dropout_p") and not bound.get("enable_gqa")
    if plain and q.device.type == "cpu":
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, bool(bound.get("is_causal", False)), scale=bound.get("scale")
        )
        return out[0]
    return _SDPA(q, k, v, *rest, **kwargs)


class _CudaAttentionKernels(Replaced):
    """Issue causal/plain ``F.scaled_dot_product_attention`` on CPU tensors as the CUDA flash
    kernel, ``aten._scaled_dot_product_flash_attention``, so PyTorch's context-parallel rules
    (written for the CUDA kernels) apply in a CPU trace. Calls with a mask, dropout, GQA or
    CUDA tensors pass through unchanged (:class:`~topomesh.trace.kernels.Replaced` says how
    calls reach :func:`_flash_sdpa`)."""

    def __init__(self) -> None:
        super().__init__(F, "scaled_dot_product_attention", _SDPA, _flash_sdpa)


def _cp_inputs(
    spec: ModelSpec, mesh: torch.distributed.device_mesh.DeviceMesh,
    inputs: tuple[torch.Tensor, ...], labels: torch.Tensor,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Inputs and labels cut along their sequence dims for context parallel."""
    from topomesh.models.parallelize import cp_shard

    buffers = [*inputs, labels]
    if spec.seq_dims is None or len(spec.seq_dims) != len(buffers):
        raise LayoutError(
            f"Context parallel degree {mesh[Axis.CP.value].size()} needs the sequence dim of each of the "
            f"{len(buffers)} inputs and labels of model {spec.name!r}; its ModelSpec gives "
            f"seq_dims={spec.seq_dims}."
        )
    *cut, cut_labels = cp_shard(mesh[Axis.CP.value], buffers, spec.seq_dims)
    return tuple(cut), cut_labels


class _Markers:
    """Labels placed in the graph while it is being traced (after the current last node)."""

    def __init__(self) -> None:
        self.marks: dict[torch.fx.Node | None, list[str]] = {}

    def mark(self, label: str) -> None:
        mode = get_proxy_mode()
        if mode is None:
            return
        nodes = mode.tracer.graph.nodes
        last = next(iter(reversed(nodes))) if len(nodes) else None
        self.marks.setdefault(last, []).append(label)

    def watch(self, block: nn.Module, index: int) -> None:
        """Mark the block's forward and, through gradient hooks, its backward."""

        def first_grad_tensor(x: object) -> torch.Tensor | None:
            for t in torch.utils._pytree.tree_leaves(x):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    return t
            return None

        def pre(_m: nn.Module, args: tuple) -> None:
            self.mark(f"start:{index}")
            t = first_grad_tensor(args)
            if t is not None:
                t.register_hook(lambda g: self.mark(f"end:{index}"))

        def post(_m: nn.Module, _args: tuple, out: object) -> None:
            self.mark(f"end:{index}")
            t = first_grad_tensor(out)
            if t is not None:
                t.register_hook(lambda g: self.mark(f"start:{index}"))

        # prepend: run before FSDP's hooks, so the marks enclose its all-gathers and
        # reduce-scatters (they hang off the tensors FSDP's hooks see).
        block.register_forward_pre_hook(pre, prepend=True)
        block.register_forward_hook(post, prepend=True)

    def watch_rounds(self, rotater: object) -> None:
        """Mark ``round:<i>`` where ring attention's round ``i`` (1, 2, ...) starts: each later
        round begins by taking the key/value buffer from ``rotater.next_buffer()``, in forward
        and in backward alike."""
        receive = rotater.next_buffer
        rounds = itertools.count(1)

        def next_buffer() -> torch.Tensor:
            self.mark(f"{ROUND}:{next(rounds)}")
            return receive()

        rotater.next_buffer = next_buffer

    def round_nodes(self, gm: torch.fx.GraphModule, cut: int) -> set[torch.fx.Node] | None:
        """The nodes of round ``cut`` of every ring (from its ``round:<cut>`` mark to its
        ``round:<cut + 1>`` mark); None unless every ring has both marks, in order."""
        nodes: set[torch.fx.Node] = set()
        cutting, rings = False, 0
        for node in gm.graph.nodes:
            if cutting:
                nodes.add(node)
            for label in self.marks.get(node, ()):
                what, _, index = label.partition(":")
                if what != ROUND or int(index) not in (cut, cut + 1):
                    continue
                if (int(index) == cut) == cutting:
                    return None
                cutting = not cutting
                rings += not cutting
        return nodes if rings and not cutting else None


def build_model(spec: ModelSpec, n_layers: int, dtype: torch.dtype, fake: FakeTensorMode | None = None) -> nn.Module:
    """``spec``'s model of ``n_layers`` blocks with ``dtype`` as the default dtype while it is
    built (under ``fake``: fake tensors, as a trace builds it; else real ones)."""
    previous = torch.get_default_dtype()
    try:
        with fake if fake is not None else contextlib.nullcontext():
            torch.set_default_dtype(dtype)
            return spec.build(n_layers)
    finally:
        torch.set_default_dtype(previous)


def loss_context(out: object) -> contextlib.AbstractContextManager:
    """Where the loss of ``out`` is taken: under ``loss_parallel`` when the logits are a
    DTensor (vocabulary-sharded under tensor parallel), as PyTorch asks, else as they are."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if isinstance(out, DTensor) else contextlib.nullcontext()


def _trace_error(spec: ModelSpec, stage: str, exc: BaseException) -> TraceError:
    func = getattr(exc, "func", None)
    if isinstance(exc, (DynamicOutputShapeException, DataDependentOutputException)):
        reason = "its output depends on tensor values, which a fake-tensor trace does not have"
    elif isinstance(exc, UnsupportedOperatorException):
        reason = "it has no fake-tensor (meta) implementation"
    else:
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    where = f" at op {func}" if func is not None else ""
    return TraceError(f"Model {spec.name!r} could not be traced ({stage}){where}: {reason}.")


def trace_step(
    spec: ModelSpec,
    parallelize: ParallelizeFn | None,
    layout: Mapping[str, int],
    *,
    n_layers: int | None = None,
    batch_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    split_blocks: bool = True,
    optimizer: OptimizerFactory | None = default_optimizer,
    warm_up: bool = True,
    ring_rounds: int | None = None,
    fewer_views: bool = True,
    gpu_kernels: bool = False,
) -> Trace:
    """Trace forward, backward and optimizer step of one rank under ``layout``.

    ``n_layers`` blocks are built (default: the real depth); with ``split_blocks`` each block's
    records form their own segments, so a one-block trace composes deeper models
    (:meth:`Trace.compose`).
    With ``warm_up`` one whole step runs first (eagerly, on fake tensors), so the trace shows
    a steady-state step: no first-step lazy initialization, optimizer state present, FSDP2's
    root resharded by backward as in every later step; for a spec with ``state_warm_up`` that
    state is made directly (:func:`_warm_up_state`, a third of the tracing time less). Raises
    :class:`TraceError` naming the op and the reason when the model does not trace.

    ``ring_rounds`` (context parallel only) runs PyTorch's ring attention for that many rounds
    instead of one per ``cp`` rank, with the real group and shapes (:func:`limited_ring`); the
    trace cache composes the full ring from two such traces.

    ``fewer_views`` makes only the shard pieces FSDP2 reads (:mod:`topomesh.trace.chunks`:
    the same records, minutes less at shard degrees of thousands); off, it traces as PyTorch
    runs, for the test that compares the two.

    ``gpu_kernels`` traces the step a GPU runs where a CPU build decomposes an op (fused
    RMSNorm: :mod:`topomesh.trace.kernels`); for GPU clusters.
    """
    return _trace(spec, parallelize, layout, n_layers=n_layers, batch_size=batch_size, dtype=dtype,
                  split_blocks=split_blocks, optimizer=optimizer, warm_up=warm_up, ring_rounds=ring_rounds,
                  fewer_views=fewer_views, gpu_kernels=gpu_kernels)[0]


def with_step_graph(
    spec: ModelSpec,
    parallelize: ParallelizeFn | None,
    layout: Mapping[str, int],
    use: Callable[[torch.fx.GraphModule, GroupTable], None],
    *,
    batch_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    optimizer: OptimizerFactory | None = default_optimizer,
) -> Trace:
    """:func:`trace_step` of the whole model, calling ``use(graph, groups)`` with the traced
    ``make_fx`` graph of the step while its fake process group exists (the graph's
    collectives name it), each node's phase in ``node.meta[PHASE_META]``: what
    :mod:`topomesh.cost.instep` runs for real to time each op where the step runs it. Context parallel is refused (its trace patches attention for the
    duration of the trace only)."""
    if dict(layout).get(Axis.CP.value, 1) > 1:
        raise LayoutError(f"the step graph of {dict(layout)} is not kept: context parallel traces a GPU attention kernel.")
    return _trace(spec, parallelize, layout, n_layers=None, batch_size=batch_size, dtype=dtype,
                  optimizer=optimizer, ring_rounds=None, on_graph=use)[0]


def trace_rings(
    spec: ModelSpec,
    parallelize: ParallelizeFn | None,
    layout: Mapping[str, int],
    *,
    ring_rounds: int,
    n_layers: int | None = None,
    batch_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    optimizer: OptimizerFactory | None = default_optimizer,
    gpu_kernels: bool = False,
) -> tuple[Trace | None, Trace]:
    """The traces of :func:`trace_step` with ``ring_rounds - 1`` and ``ring_rounds`` rounds
    (``ring_rounds`` ≥ 3, ``cp`` above it), from one trace: the long ring's, and the same graph
    without its last middle round (round ``ring_rounds - 2``). The short one is None when the
    round marks do not come out as expected (trace it with :func:`trace_step`).

    Why it is exact: on the traced rank every round after the first has the same shapes, and
    each but the last sends the key/value buffer on (:func:`limited_ring`); so rounds 0, 1 and
    the last of the long ring are, op for op, the short ring's rounds, and the rounds between
    are copies of round 1. What the graph keeps for backward is the attention's inputs and
    outputs, not a round's tensors. A test compares the short trace with one of the short ring,
    record by record (scalar arguments included), segment by segment.
    """
    if ring_rounds < 3 or dict(layout).get(Axis.CP.value, 1) <= ring_rounds:
        raise ValueError(f"trace_rings needs ring_rounds >= 3 below the cp degree, not {ring_rounds} for {layout}")
    long, short = _trace(spec, parallelize, layout, n_layers=n_layers, batch_size=batch_size, dtype=dtype,
                         optimizer=optimizer, ring_rounds=ring_rounds, cut_round=ring_rounds - 2,
                         gpu_kernels=gpu_kernels)
    return short, long


def _trace(
    spec: ModelSpec,
    parallelize: ParallelizeFn | None,
    layout: Mapping[str, int],
    *,
    n_layers: int | None,
    batch_size: int,
    dtype: torch.dtype,
    optimizer: OptimizerFactory | None,
    ring_rounds: int | None,
    split_blocks: bool = True,
    warm_up: bool = True,
    fewer_views: bool = True,
    cut_round: int | None = None,
    on_graph: Callable[[torch.fx.GraphModule, GroupTable], None] | None = None,
    gpu_kernels: bool = False,
) -> tuple[Trace, Trace | None]:
    """:func:`trace_step`, and with ``cut_round`` also the trace without that ring round.
    ``on_graph`` is called with the traced graph while the fake process group still exists."""
    axes = normalize_layout(layout)
    world = math.prod(d for _, d in axes)
    depth = spec.n_layers if n_layers is None else n_layers
    start = time.perf_counter()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_process_group(world), chunks.fewer_views() if fewer_views else contextlib.nullcontext():
        mesh = groups.init_mesh("cpu", [d for _, d in axes], [a for a, _ in axes])
        try:
            model = build_model(spec, depth, dtype, fake)
            if parallelize is not None:
                model = parallelize(model, mesh) or model
        except TopomeshError:
            raise
        except Exception as exc:  # the user's code: report, don't crash
            raise _trace_error(spec, "building and parallelizing", exc) from exc
        markers = _Markers()
        blocks = spec.blocks(model) if split_blocks else []
        for i, block in enumerate(blocks):
            markers.watch(block, i)
        optimizers = _optimizers(model, blocks, optimizer)
        step = _step_fn(spec, model, markers, optimizers)
        cp = dict(axes).get(Axis.CP.value, 1) > 1
        try:
            with (fake, _CudaAttentionKernels() if cp else contextlib.nullcontext(),
                  GpuKernels() if gpu_kernels else contextlib.nullcontext(),
                  limited_ring(ring_rounds, markers if cut_round else None) if cp and ring_rounds
                  else contextlib.nullcontext()):
                inputs, labels = spec.make_inputs(batch_size)
                if cp:
                    inputs, labels = _cp_inputs(spec, mesh, inputs, labels)
                if warm_up and spec.state_warm_up:
                    _warm_up_state(model, optimizers)
                elif warm_up:
                    _warm_up(step, model, inputs, labels)
                with _eager_checkpoint_policies():
                    gm = make_fx(step)(inputs, labels)
        except TopomeshError:
            raise
        except Exception as exc:
            raise _trace_error(spec, "forward, backward and optimizer step", exc) from exc
        table = GroupTable(mesh)
        if on_graph is not None:
            for node, (ph, _) in _node_keys(gm, markers):
                node.meta[PHASE_META] = ph
            on_graph(gm, table)
        segments, unknown = _segments(gm, markers, table)
        block_state, first_state, last_state = _state_bytes(model, blocks, optimizers)
        trace = Trace(
            model=spec.name,
            layout=axes,
            batch_size=batch_size,
            dtype=str(dtype).removeprefix("torch."),
            traced_layers=depth,
            n_layers=depth,
            segments=segments,
            unknown_ops=unknown,
            block_state=block_state,
            first_state=first_state,
            last_state=last_state,
            trace_s=time.perf_counter() - start,
        )
        cut = markers.round_nodes(gm, cut_round) if cp and cut_round else None
        if cut is None:
            return trace, None
        start = time.perf_counter()
        segments, unknown = _segments(gm, markers, table, drop=cut)
    return trace, dataclasses.replace(trace, segments=segments, unknown_ops=unknown,
                                      trace_s=time.perf_counter() - start)


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _state_bytes(
    model: nn.Module, blocks: Sequence[nn.Module], optimizers: list[tuple[int | None, torch.optim.Optimizer]]
) -> tuple[StateBytes, StateBytes, StateBytes]:
    """Training state on this rank: per block (averaged over the traced blocks), for the
    embedding modules outside the blocks (a pipeline's first stage) and for the other
    parameters outside the blocks (the last stage). A gradient takes the size of the one the
    traced backward left on the parameter, and the parameter's where there is none: they can
    differ, as under tensor parallel, where DTensor's backward of the vocab-sharded embedding
    (``RowwiseParallel``) leaves a replicated gradient of the whole table on every rank
    (measured on real gloo ranks: ``(2048, 256)`` against the ``(512, 256)`` weight at tp=4);
    optimizer state is what the optimizers hold after the traced step."""
    states: dict[int, int] = {}
    for _, opt in optimizers:
        for p, st in opt.state.items():
            states[id(p)] = sum(_local_bytes(v) for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)

    def total(params: Iterable[nn.Parameter]) -> StateBytes:
        ps = {id(p): p for p in params if p.requires_grad}
        nbytes = sum(_local_bytes(p) for p in ps.values())
        grads = sum(_local_bytes(p if p.grad is None else p.grad) for p in ps.values())
        return StateBytes(params=nbytes, grads=grads, optimizer=sum(states.get(i, 0) for i in ps))

    in_block = {id(p) for b in blocks for p in b.parameters()}
    first = [p for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters() if id(p) not in in_block]
    first_ids = {id(p) for p in first}
    last = [p for p in model.parameters() if id(p) not in in_block and id(p) not in first_ids]
    per_block = total(p for b in blocks for p in b.parameters())
    n = max(len(blocks), 1)
    block = StateBytes(params=per_block.params // n, grads=per_block.grads // n, optimizer=per_block.optimizer // n)
    return block, total(first), total(last)


def _optimizers(
    model: nn.Module, blocks: Sequence[nn.Module], optimizer: OptimizerFactory | None
) -> list[tuple[int | None, torch.optim.Optimizer]]:
    """One optimizer per block and one for the rest: the same per-parameter math as a single
    optimizer, with each block's updates landing in that block's segments."""
    if optimizer is None:
        return []
    groups: list[tuple[int | None, list[nn.Parameter]]] = []
    in_block = set()
    for i, b in enumerate(blocks):
        ps = [p for p in b.parameters() if p.requires_grad]
        in_block.update(id(p) for p in ps)
        groups.append((i, ps))
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in in_block]
    groups.append((None, rest))
    return [(i, optimizer(ps)) for i, ps in groups if ps]


def _warm_up(
    step: Callable[[tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor],
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    labels: torch.Tensor,
) -> None:
    """Run one whole step (forward, loss, backward, optimizer step) eagerly on fake tensors,
    then drop the gradients, so the traced step is a steady-state one.

    A first step differs from the rest: lazy initialization in the first forward (FSDP2
    builds its views there), the optimizer's state (AdamW's moments) created in the first
    update, and FSDP2's root, which keeps its parameters unsharded after forward with its
    default ``reshard_after_forward`` and is resharded only at the end of backward. A
    forward-only warm-up left the root unsharded, and the traced step lost its all-gather.
    """
    step(inputs, labels)
    model.zero_grad(set_to_none=True)


def _warm_up_state(model: nn.Module, optimizers: list[tuple[int | None, torch.optim.Optimizer]]) -> None:
    """The state :func:`_warm_up` leaves, made without running the model: FSDP2's lazy
    initialization (``_lazy_init`` of the root, as its first forward runs it), every FSDP
    module's unsharded parameters allocated (``unshard`` then ``reshard``: the first all-gather
    allocates them, later ones reuse them) and resharded as backward leaves them, and each
    optimizer's state as its first step leaves it (:func:`_first_step_state`)."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if fsdp:
        fsdp[0]._get_fsdp_state()._lazy_init()  # the outermost: the root
    for m in fsdp:
        m.unshard()
        m.reshard()
    for _, opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        _first_step_state(opt)
    model.zero_grad(set_to_none=True)


def _first_step_state(opt: torch.optim.Optimizer) -> None:
    """The state ``opt.step()`` leaves after a first step on zero gradients. Adam and AdamW:
    their own lazy initialization (``_init_group``: step count, both moments, zeros) and the
    step count advanced as their step advances it; on fake tensors the update itself changes
    nothing the trace reads (values), and it was most of the warm-up's time (DTensor dispatch of
    a dozen ops per parameter). Other optimizers take the step."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
        opt.step()
        return
    for group in opt.param_groups:
        steps: list[torch.Tensor] = []
        opt._init_group(group, [], [], [], [], [], steps)
        for step in steps:
            step += 1


def _step_fn(
    spec: ModelSpec,
    model: nn.Module,
    markers: _Markers,
    optimizers: list[tuple[int | None, torch.optim.Optimizer]],
) -> Callable[[tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor]:
    from torch.distributed.tensor import DTensor

    def step(inputs: tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
        out = model(*inputs)
        with loss_context(out):
            loss = spec.loss(out, labels)
            markers.mark(Phase.BACKWARD.value)
            loss.backward()
        markers.mark(Phase.OPTIMIZER.value)
        for i, opt in optimizers:
            if i is not None:
                markers.mark(f"start:{i}")
            opt.step()
            if i is not None:
                markers.mark(f"end:{i}")
        return loss.to_local() if isinstance(loss, DTensor) else loss

    return step


def _node_keys(gm: torch.fx.GraphModule, markers: _Markers) -> Iterator[tuple[torch.fx.Node, tuple[Phase, int | None]]]:
    """Each node of the graph in order with its (phase, block index or None), as the markers
    placed while tracing cut them."""
    phase: Phase = Phase.FORWARD
    layer: int | None = None

    def apply(labels: list[str]) -> None:
        nonlocal phase, layer
        for label in labels:
            what, _, index = label.partition(":")
            if what == "start":
                layer = int(index)
            elif what == "end":
                layer = None if layer == int(index) else layer
            elif what != ROUND:
                phase, layer = Phase(label), None

    apply(markers.marks.get(None, []))
    for node in gm.graph.nodes:
        yield node, (phase, layer)
        apply(markers.marks.get(node, []))


def _segments(
    gm: torch.fx.GraphModule, markers: _Markers, groups: GroupTable, drop: Set[torch.fx.Node] = frozenset(),
) -> tuple[tuple[Segment, ...], tuple[str, ...]]:
    """Cut the graph at the markers into segments of (phase, block or rest) and convert nodes;
    the nodes in ``drop`` are left out, as if they had not run (a ring round,
    :func:`trace_rings`)."""
    keys: list[tuple[Phase, int | None]] = []
    where: dict[torch.fx.Node, int] = {}  # node -> segment index
    for node, key in _node_keys(gm, markers):
        if node not in drop:
            if not keys or keys[-1] != key:
                keys.append(key)
            where[node] = len(keys) - 1

    records: dict[torch.fx.Node, tuple[OpRecord | CollectiveRecord, ...]] = {}
    unknown: set[str] = set()
    hooks = fsdp_hooks(gm)
    for node, i in where.items():
        recs = node_records(node, gm, groups, keys[i][0])
        if node in hooks:
            recs = tuple(dataclasses.replace(r, hook=hooks[node]) if isinstance(r, OpRecord) else r for r in recs)
        if recs:
            records[node] = recs
            if len(recs) == 1 and not isinstance(recs[0], CollectiveRecord) and not is_known(node.target):
                unknown.add(recs[0].op)
    prefetch = _prefetches(gm, where, keys, records)
    saved, peak, made = _liveness(gm, where, keys)
    events: list[list] = [[] for _ in keys]
    for node, recs in records.items():
        events[where[node]].extend(recs)
    segments = tuple(
        Segment(
            part=Part.REST if lay is None else Part.BLOCK, phase=ph, layer=lay,
            events=tuple(ev), prefetch=prefetch.get(i, ()), saved_bytes=saved.get(i, 0),
            peak_output_bytes=peak.get(i, 0), param_bytes=made.get(i, 0),
        )
        for i, ((ph, lay), ev) in enumerate(zip(keys, events, strict=True))
        if ev
    )
    return segments, tuple(sorted(unknown))


FSDP_LABEL = "FSDP::"
"""The prefix of the ``record_function`` labels FSDP2 wraps its hooks and their parts in
(``FSDP::pre_forward (layers.0)``, ``FSDP::all_gather_copy_out``, ``FSDP::post_backward_reduce``...)."""


def fsdp_hooks(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """Per node that ran inside an FSDP2 hook: the innermost one, its ``record_function``
    label's first word less :data:`FSDP_LABEL` (``FSDP::backward_prefetch for layers.0`` is
    ``backward_prefetch``). The labels reach the graph as the profiler's enter and exit ops,
    each exit taking its enter as input; labels of anything else (the optimizer's step) are
    passed over."""
    open_: list[tuple[torch.fx.Node, str]] = []  # entered, not yet exited: (enter node, hook or "")
    out: dict[torch.fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if "_record_function_enter" in name:
            label = node.args[0] if node.args and isinstance(node.args[0], str) else ""
            hook = label[len(FSDP_LABEL):].split(" ", 1)[0] if label.startswith(FSDP_LABEL) else ""
            open_.append((node, hook))
        elif "_record_function_exit" in name:
            entered = node.args[0] if node.args else None
            for i in range(len(open_) - 1, -1, -1):
                if open_[i][0] is entered:
                    del open_[i]
                    break
        else:
            hook = next((h for _, h in reversed(open_) if h), "")
            if hook:
                out[node] = hook
    return out


def _prefetches(
    gm: torch.fx.GraphModule,
    where: Mapping[torch.fx.Node, int],
    keys: Sequence[tuple[Phase, int | None]],
    records: Mapping[torch.fx.Node, tuple[OpRecord | CollectiveRecord, ...]],
) -> dict[int, tuple]:
    """Work issued outside a block on the block's behalf: by segment index of that block.

    FSDP2 prefetches: the all-gather of the block that runs next in backward is issued from
    the previous block's (or the head's) hooks. Such a collective depends on no step input
    (only parameters) and its result is read inside a block segment of the same phase; its
    ancestors within its own segment (buffer, copy-in, flattening views) go with it.
    """
    from_input: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or any(a in from_input for a in node.all_input_nodes):
            from_input.add(node)
    out: dict[int, list[torch.fx.Node]] = {}
    for node, recs in records.items():
        seg = where[node]
        if not isinstance(recs[0], CollectiveRecord) or keys[seg][1] is not None or node in from_input:
            continue
        results = [node]
        if str(node.target).startswith("c10d.") and node.args:  # in place: reads the buffer
            first = node.args[0]
            results += first if isinstance(first, (list, tuple)) else [first]
        readers = [u for r in results if isinstance(r, torch.fx.Node) for u in r.users]
        readers += [u for r in list(readers) for u in r.users]  # through wait_tensor / getitem
        blocks = {where[u] for u in readers
                  if u in where and keys[where[u]][1] is not None and keys[where[u]][0] is keys[seg][0]}
        if len(blocks) != 1:
            continue
        unit, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in unit or where.get(n) != seg:
                continue
            unit.add(n)
            stack.extend(n.all_input_nodes)
        out.setdefault(blocks.pop(), []).extend(unit)
    order = _order(gm)
    return {i: tuple(r for n in sorted(set(nodes), key=order) for r in records.get(n, ())) for i, nodes in out.items()}


def _forward_of(keys: Sequence[tuple[Phase, int | None]]) -> dict[int, int]:
    """Backward segment index -> the forward segment of the same part: a block's backward ->
    that block's forward; the rest before a phase's blocks <-> the rest after them (backward
    runs the head first, the embedding last). Segments with no counterpart are left out.

    >>> F, B = Phase.FORWARD, Phase.BACKWARD
    >>> _forward_of([(F, None), (F, 0), (F, 1), (F, None), (B, None), (B, 1), (B, 0), (B, None)])
    {4: 3, 5: 2, 6: 1, 7: 0}
    """
    def sides(phase: Phase) -> tuple[list[int], list[int]]:
        blocks = [i for i, (ph, lay) in enumerate(keys) if ph is phase and lay is not None]
        rests = [i for i, (ph, lay) in enumerate(keys) if ph is phase and lay is None]
        if not blocks:
            return [], []
        return [i for i in rests if i < blocks[0]], [i for i in rests if i > blocks[-1]]

    block_fwd: dict[int, int] = {}
    for i, (ph, lay) in enumerate(keys):
        if ph is Phase.FORWARD and lay is not None:
            block_fwd.setdefault(lay, i)
    out = {i: block_fwd[lay] for i, (ph, lay) in enumerate(keys)
           if ph is Phase.BACKWARD and lay is not None and lay in block_fwd}
    fwd_before, fwd_after = sides(Phase.FORWARD)
    bwd_before, bwd_after = sides(Phase.BACKWARD)
    if len(fwd_after) == 1:
        out.update(dict.fromkeys(bwd_before, fwd_after[0]))  # the head's backward
    if len(fwd_before) == 1:
        out.update(dict.fromkeys(bwd_after, fwd_before[0]))  # the embedding's backward
    return dict(sorted(out.items()))


def _liveness(
    gm: torch.fx.GraphModule, where: Mapping[torch.fx.Node, int], keys: Sequence[tuple[Phase, int | None]]
) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """Per segment index: bytes kept for backward, the most bytes its own temporaries hold
    at once, and the bytes of the storages it makes from parameters alone.

    A tensor is kept for backward when a forward node computed from the step's inputs
    (placeholders; parameters enter as constants, so weights and their transposes are not
    activations) has a user in the backward phase. It is counted once, by storage (views share
    their base's), in the forward segment whose backward reads it (:func:`_forward_of`): a
    block's output that the next block's norm keeps is that block's, the last block's output
    that the final norm keeps is the head's. Charged to the block that made it, a one-block
    trace composed to n blocks counted the final norm's input n times, and under activation
    checkpointing, where each block keeps its own input, once more per block.

    A segment's temporaries are the storages its nodes computed from the step's inputs make
    and last read inside it (views and in-place ops extend a storage's life to their own last
    reader): not parameters, optimizer state or what derives from them alone (FSDP2's
    gathered parameters: the simulator counts those), and not what leaves the segment
    (activations kept for backward, a block's output, gradients kept as training state or
    handed to a reduction in another piece). Each lives from the node that makes it to its
    last reader, so a node's inputs and outputs are live together; the peak is the largest
    sum over the segment's nodes. The loss's backward, for one, holds the gradients of the
    log-softmax and of the float32 and training-dtype logits at once, not only the largest.

    What a segment makes from parameters alone (a new storage from nodes whose inputs are
    parameters or made from them, not from the step's inputs, not from nothing) is counted
    where it is made: FSDP2's parameters cast to the compute dtype, which a replicate-only unit
    makes without an all-gather (the simulator counts gathered parameters by their all-gathers).
    """
    from torch.multiprocessing.reductions import StorageWeakRef

    def tensors(val: object) -> list[torch.Tensor]:
        return [t for t in torch.utils._pytree.tree_leaves(val) if isinstance(t, torch.Tensor)]

    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    counterpart = _forward_of(keys)
    from_input: set[torch.fx.Node] = set()
    external: set[object] = set()  # storages of the step's inputs, parameters and state
    from_params: set[torch.fx.Node] = set()  # parameters (constants) and what is made from them alone
    for node in gm.graph.nodes:
        if node.op == "placeholder" or any(a in from_input for a in node.all_input_nodes):
            from_input.add(node)
        elif node.op == "get_attr" or any(a in from_params for a in node.all_input_nodes):
            from_params.add(node)
        if node.op in ("placeholder", "get_attr"):
            val = node.meta.get("val") if node.op == "placeholder" else getattr(gm, str(node.target), None)
            external.update(StorageWeakRef(t.untyped_storage()).cdata for t in tensors(val))
    made: dict[int, int] = {}  # segment -> bytes of the storages it makes from parameters alone
    owner: dict[object, tuple[int, int]] = {}  # storage -> (segment that first keeps it, bytes)
    born: dict[object, tuple[int, int, int]] = {}  # temporary storage -> (segment, first node, bytes)
    dies: dict[object, int] = {}
    leaves: set[object] = set()
    for node, seg in where.items():
        vals = tensors(node.meta.get("val"))
        if not vals or node.op != "call_function":
            continue
        readers = {where[u] for u in node.users if u in where and keys[where[u]][0] is Phase.BACKWARD}
        if keys[seg][0] is Phase.FORWARD and node in from_input and readers:
            keeper = min((c for r in readers if (c := counterpart.get(r)) is not None and c >= seg), default=seg)
            for t in vals:
                st = t.untyped_storage()
                owner.setdefault(StorageWeakRef(st).cdata, (keeper, st.nbytes()))
        users = [u for u in node.users if u in where]
        escapes = any(where[u] != seg or u.op == "output" for u in users)
        last = max([order[node], *(order[u] for u in users if where[u] == seg)])
        for t in vals:
            st = t.untyped_storage()
            ref = StorageWeakRef(st).cdata
            if ref in external:
                continue
            if ref not in born:
                if node not in from_input:
                    external.add(ref)  # made from parameters alone, or from nothing
                    if node in from_params:
                        made[seg] = made.get(seg, 0) + st.nbytes()
                    continue
                born[ref] = (seg, order[node], st.nbytes())
            elif born[ref][0] != seg:
                leaves.add(ref)  # read (as a view, in place) by a later segment
            dies[ref] = max(dies.get(ref, 0), last)
            if escapes:
                leaves.add(ref)
    saved: dict[int, int] = {}
    for seg, nbytes in owner.values():
        saved[seg] = saved.get(seg, 0) + nbytes
    changes: dict[int, list[tuple[int, int]]] = {}
    for ref, (seg, first, nbytes) in born.items():
        if ref not in leaves:  # what backward keeps has a reader there: it leaves too
            changes.setdefault(seg, []).extend([(2 * first, nbytes), (2 * dies[ref] + 1, -nbytes)])
    peak: dict[int, int] = {}
    for seg, events in changes.items():
        live = most = 0
        for _, nbytes in sorted(events):  # alive through its last reader, freed after it
            live += nbytes
            most = max(most, live)
        peak[seg] = most
    return saved, peak, made


def _order(gm: torch.fx.GraphModule) -> Callable[[torch.fx.Node], int]:
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return index.__getitem__


def transformer_spec(cfg: TransformerConfig, *, seq_len: int | None = None) -> ModelSpec:
    """A :class:`ModelSpec` for the built-in :class:`~topomesh.models.transformer.Transformer`."""
    if seq_len is not None:
        cfg = dataclasses.replace(cfg, seq_len=seq_len)

    def build(n: int) -> nn.Module:
        return Transformer(dataclasses.replace(cfg, n_layers=n))

    def make_inputs(batch: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
        return (tokens,), tokens

    key = repr(cfg)
    return ModelSpec(
        name=cfg.name, key=key, n_layers=cfg.n_layers, build=build, make_inputs=make_inputs, seq_dims=(1, 1),
        state_warm_up=True,
    )
