"""Turn the nodes of a ``make_fx`` graph into our records (:mod:`topomesh.trace.graph`).

Every ``call_function`` node becomes one of:

* a :class:`~topomesh.trace.graph.CollectiveRecord` — functional collectives
  (``_c10d_functional.all_reduce`` / ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` /
  ``all_to_all_single`` / ``broadcast``) and the in-place c10d ops FSDP2 and ``torch.distributed``
  emit (``c10d._allgather_base_``, ``c10d._reduce_scatter_base_``, ``c10d.allreduce_`` …);
  the group comes from the group-name argument or the traced ``ProcessGroup`` object;
* nothing, for bookkeeping nodes (``getitem``, ``wait_tensor``, profiler ranges);
* an :class:`~topomesh.trace.graph.OpRecord` otherwise, with FLOPs from PyTorch's own
  formulas (``torch.utils.flop_counter.flop_registry``) evaluated on the node's local
  shapes, plus the CPU flash-attention ops that registry lacks.

FLOPs follow ``FlopCounterMode``: matmuls ``2·m·n·k``, attention as non-causal (the full
``S²`` score matrix), elementwise ops 0.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from topomesh.layout.dims import Axis
from topomesh.trace import chunks
from topomesh.trace.graph import CollectiveKind, CollectiveRecord, OpRecord, Phase, TensorMeta
from topomesh.trace.kernels import ATEN_NAMES

_SKIP = {
    "_operator.getitem",
    "_c10d_functional.wait_tensor.default",
    "profiler._record_function_enter_new.default",
    "profiler._record_function_exit._RecordFunction",
    "profiler._record_function_exit.default",
}

# Collective op (overload name) -> (kind, index of the tensor whose bytes count).
# Bytes are the per-rank buffer: input for all-reduce/reduce-scatter/all-to-all/broadcast,
# output (the gathered tensor) for all-gather; "out" means the node's own output.
_COLLECTIVES: dict[str, tuple[CollectiveKind, int | str]] = {
    "_c10d_functional.all_reduce.default": (CollectiveKind.ALL_REDUCE, 0),
    "_c10d_functional.all_reduce_.default": (CollectiveKind.ALL_REDUCE, 0),
    "_c10d_functional.all_reduce_coalesced.default": (CollectiveKind.ALL_REDUCE, 0),
    "_c10d_functional.all_gather_into_tensor.default": (CollectiveKind.ALL_GATHER, "out"),
    "_c10d_functional.all_gather_into_tensor_coalesced.default": (CollectiveKind.ALL_GATHER, "out"),
    "_c10d_functional.reduce_scatter_tensor.default": (CollectiveKind.REDUCE_SCATTER, 0),
    "_c10d_functional.reduce_scatter_tensor_coalesced.default": (CollectiveKind.REDUCE_SCATTER, 0),
    "_c10d_functional.all_to_all_single.default": (CollectiveKind.ALL_TO_ALL, 0),
    "_c10d_functional.broadcast.default": (CollectiveKind.BROADCAST, 0),
    "_c10d_functional.broadcast_.default": (CollectiveKind.BROADCAST, 0),
    "c10d._allgather_base_.default": (CollectiveKind.ALL_GATHER, 0),
    "c10d._reduce_scatter_base_.default": (CollectiveKind.REDUCE_SCATTER, 1),
    "c10d.allreduce_.default": (CollectiveKind.ALL_REDUCE, 0),
    "c10d.allgather_.default": (CollectiveKind.ALL_GATHER, 0),
    "c10d.allgather_into_tensor_coalesced_.default": (CollectiveKind.ALL_GATHER, 0),
    "c10d.reduce_scatter_.default": (CollectiveKind.REDUCE_SCATTER, 1),
    "c10d.reduce_scatter_tensor_coalesced_.default": (CollectiveKind.REDUCE_SCATTER, 1),
    "c10d.alltoall_base_.default": (CollectiveKind.ALL_TO_ALL, 1),
    "c10d.alltoall_.default": (CollectiveKind.ALL_TO_ALL, 1),
    "c10d.broadcast_.default": (CollectiveKind.BROADCAST, 0),
    "c10d.send.default": (CollectiveKind.SEND_RECV, 0),
    "c10d.recv_.default": (CollectiveKind.SEND_RECV, 0),
}

# Op families (overload packets) the cost model can price without a FLOP formula:
# copies, creation, indexing, reductions, norms, losses, FSDP's copy-in/out helpers.
_KNOWN_PACKETS = frozenset(
    {
        "aten._to_copy", "aten.clone", "aten.copy", "aten.copy_", "aten.contiguous", "aten.empty",
        "aten.empty_like", "aten.empty_strided", "aten.zeros", "aten.zeros_like", "aten.ones",
        "aten.ones_like", "aten.full", "aten.full_like", "aten.new_zeros", "aten.new_empty",
        "aten.new_empty_strided", "aten.new_ones", "aten.new_full", "aten.fill_", "aten.zero_",
        "aten.arange", "aten.scalar_tensor", "aten.lift_fresh_copy", "aten.cat", "aten.stack",
        "aten.split", "aten.split_with_sizes", "aten.chunk", "aten.unbind", "aten.embedding",
        "aten.embedding_dense_backward", "aten.index", "aten.index_put", "aten.index_put_",
        "aten.index_add", "aten.index_add_", "aten.index_select", "aten.gather", "aten.scatter",
        "aten.scatter_add", "aten.scatter_add_", "aten.repeat", "aten.repeat_interleave",
        "aten.one_hot", "aten.cumsum", "aten.topk", "aten.sort", "aten.argmax", "aten.sum",
        "aten.mean", "aten.amax", "aten.amin", "aten.max", "aten.min", "aten.var_mean", "aten.prod",
        "aten.norm", "aten.linalg_vector_norm", "aten._softmax", "aten._softmax_backward_data",
        "aten._log_softmax", "aten._log_softmax_backward_data", "aten.nll_loss_forward",
        "aten.nll_loss_backward", "aten.nll_loss2d_forward", "aten.nll_loss2d_backward",
        "aten.native_layer_norm", "aten.native_layer_norm_backward", "aten._fused_rms_norm",
        "aten._fused_rms_norm_backward", "aten.gelu_backward", "aten.silu_backward",
        "aten.threshold_backward", "aten.native_dropout", "aten.native_dropout_backward",
        "aten._foreach_add_", "aten._foreach_mul_", "aten._foreach_lerp_", "aten._foreach_addcmul_",
        "aten._foreach_addcdiv_", "aten._foreach_sqrt", "aten._foreach_div_", "aten.where",
        "aten.masked_fill", "aten.tril", "aten.triu", "aten.constant_pad_nd", "aten.detach",
        "aten.alias", "aten._unsafe_view", "aten._local_scalar_dense", "aten.select_backward",
        "aten.slice_backward", "aten.masked_fill_", "aten.resize_", "aten.set_",
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward", "aten.log_sigmoid_forward",
        "aten.log_sigmoid_backward", "aten.mse_loss",
        "aten.mse_loss_backward", "aten.smooth_l1_loss", "aten.smooth_l1_loss_backward",
        "aten.binary_cross_entropy_with_logits", "fsdp.all_gather_copy_in",
        "fsdp.split_with_sizes_copy", "fsdp.chunk_cat", "fsdp.copy_",
    }
)


def _cpu_flash_fwd(q, k, v, *args, out_val=None, **kwargs) -> int:  # noqa: ANN001
    return sdpa_flop_count(q.shape, k.shape, v.shape)


def _cpu_flash_bwd(grad_out, q, k, v, *args, out_val=None, **kwargs) -> int:  # noqa: ANN001
    return sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)


_EXTRA_FLOPS = {
    "aten._scaled_dot_product_flash_attention_for_cpu": _cpu_flash_fwd,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": _cpu_flash_bwd,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupInfo:
    """A process group the trace ran collectives on."""

    size: int
    mesh_axis: str | None


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    """Shape, dtype and stride of a (fake) tensor.

    >>> tensor_meta(torch.zeros(2, 3)).stride
    (3, 1)
    """
    return TensorMeta(shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."), stride=tuple(t.stride()))


def _val(a: object) -> object:
    if isinstance(a, torch.fx.Node):
        return a.meta.get("val")
    if isinstance(a, (list, tuple)):
        return type(a)(_val(x) for x in a)
    return a


def _tensors(x: object) -> Iterable[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _hashable(x: object) -> object:
    if isinstance(x, torch.fx.Node):
        return None
    if isinstance(x, (list, tuple)):
        return tuple(_hashable(y) for y in x)
    if isinstance(x, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(x)
    if isinstance(x, (int, float, bool, str)) or x is None:
        return x
    return type(x).__name__


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def is_known(target: object) -> bool:
    """Whether the cost model can price ``target`` (FLOP formula, view, pointwise or a known family)."""
    packet = str(getattr(target, "overloadpacket", target))
    if packet in _KNOWN_PACKETS or packet in _EXTRA_FLOPS or str(target) in ATEN_NAMES:
        return True
    if getattr(target, "overloadpacket", None) in flop_registry:
        return True
    if getattr(target, "is_view", False):
        return True
    tags = getattr(target, "tags", ())
    return torch.Tag.pointwise in tags or torch.Tag.reduction in tags


class OpKind(StrEnum):
    """Coarse classes of compute ops, for reports."""

    MATMUL = "matmul"
    ATTENTION = "attention"
    POINTWISE = "pointwise"
    REDUCTION = "reduction"
    VIEW = "view"
    MEMORY = "copy/alloc"
    OTHER = "other"


_VIEW_LIKE = {"aten._unsafe_view", "aten.detach", "aten.alias"}
"""Not views in the alias sense, but no data moves (a reshape of a fresh tensor, a detach)."""
_MATMUL = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm"}
_MEMORY_PREFIXES = ("aten._to_copy", "aten.clone", "aten.copy", "aten.empty", "aten.zeros",
                    "aten.ones", "aten.full", "aten.new_", "aten.cat", "aten.split", "aten.stack",
                    "aten.index", "aten.gather", "aten.scatter", "aten.embedding", "aten.repeat",
                    "aten.lift_fresh", "aten.fill_", "aten.zero_", "aten.arange", "aten.scalar_tensor",
                    "aten.slice_backward", "aten.select_backward", "aten._local_scalar_dense", "fsdp.")


def op_kind(name: str) -> OpKind:
    """The class of the op called ``name`` (an ATen overload name such as ``aten.mm.default``).

    >>> op_kind("aten.mm.default"), op_kind("aten.add.Tensor"), op_kind("aten.view.default")
    (<OpKind.MATMUL: 'matmul'>, <OpKind.POINTWISE: 'pointwise'>, <OpKind.VIEW: 'view'>)
    """
    packet = name.rsplit(".", 1)[0] if name.count(".") >= 2 else name
    if packet in _MATMUL:
        return OpKind.MATMUL
    if "scaled_dot_product" in packet or "flash_attention" in packet or "efficient_attention" in packet:
        return OpKind.ATTENTION
    overload = _resolve_op(name)
    if overload is not None:
        if getattr(overload, "is_view", False) or packet in _VIEW_LIKE:
            return OpKind.VIEW
        tags = getattr(overload, "tags", ())
        if torch.Tag.pointwise in tags:
            return OpKind.POINTWISE
        if torch.Tag.reduction in tags:
            return OpKind.REDUCTION
    if packet.startswith(_MEMORY_PREFIXES):
        return OpKind.MEMORY
    return OpKind.OTHER


def _resolve_op(name: str) -> object | None:
    parts = name.split(".")
    obj: object = torch.ops
    try:
        for p in parts:
            obj = getattr(obj, p)
    except (AttributeError, RuntimeError):
        return None
    return obj


def op_record(node: torch.fx.Node, phase: Phase) -> OpRecord:
    """The :class:`OpRecord` of a compute node; FLOPs on the node's own (local) shapes."""
    return _record(
        node.target, [_val(a) for a in node.args], {k: _val(v) for k, v in node.kwargs.items()},
        node.meta.get("val"), tuple(_hashable(a) for a in node.args if not isinstance(a, torch.fx.Node)), phase,
    )


def _record(target: object, args: list, kwargs: dict, out: object, scalars: tuple, phase: Phase) -> OpRecord:
    """The :class:`OpRecord` of ``target`` called on argument values ``args``/``kwargs``
    (``scalars``: its non-tensor positional arguments as recorded) giving ``out``."""
    inputs = tuple(tensor_meta(t) for t in _tensors(args)) + tuple(
        tensor_meta(t) for t in _tensors(list(kwargs.values()))
    )
    outputs = tuple(tensor_meta(t) for t in _tensors(out))
    packet = getattr(target, "overloadpacket", None)
    flops = 0
    formula = flop_registry.get(packet) if packet is not None else None
    formula = formula or _EXTRA_FLOPS.get(str(packet))
    if formula is not None:
        flops = int(formula(*args, out_val=out, **kwargs))
    moved = 0
    if not getattr(target, "is_view", False) and str(packet) not in _VIEW_LIKE:
        moved = sum(_nbytes(t) for t in _tensors(args)) + sum(_nbytes(t) for t in _tensors(out))
    return OpRecord(
        op=ATEN_NAMES.get(str(target), str(target)), inputs=inputs, outputs=outputs, flops=flops, bytes_moved=moved,
        phase=phase, args=scalars,
    )


class GroupTable:
    """Process group name → :class:`GroupInfo`, for the groups of one traced mesh.

    Groups of a mesh dimension are named after it. Any other group (a flattened or
    concatenated mesh a parallelize function builds, e.g. ``dp_shard`` × ``cp``) is placed by
    its ranks: the mesh axes along which its members' coordinates vary, joined by ``+`` in
    :class:`~topomesh.layout.dims.Axis` order (``dp_shard+cp`` whatever the mesh's order).
    """

    def __init__(self, mesh: torch.distributed.device_mesh.DeviceMesh) -> None:
        self._ranks = mesh.mesh.reshape(-1).tolist()
        self._shape = tuple(mesh.mesh.shape)
        self._names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
        self._known: dict[str, GroupInfo | None] = {}
        for i, name in enumerate(self._names):
            pg = mesh.get_group(i)
            self._known[pg.group_name] = GroupInfo(size=pg.size(), mesh_axis=name)

    def __contains__(self, name: object) -> bool:
        return name in self._known

    def lookup(self, name: str) -> GroupInfo | None:
        """The group called ``name``, or None if no process group has that name."""
        if name not in self._known:
            self._known[name] = self._resolve(name)
        return self._known[name]

    def _resolve(self, name: str) -> GroupInfo | None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        try:
            pg = _resolve_process_group(name)
        except (RuntimeError, ValueError, KeyError):
            return None
        ranks = dist.get_process_group_ranks(pg)
        coords = []
        for r in ranks:
            flat = self._ranks.index(r) if r in self._ranks else None
            if flat is None:
                return GroupInfo(size=pg.size(), mesh_axis=None)
            c = []
            for dim in reversed(self._shape):
                c.append(flat % dim)
                flat //= dim
            coords.append(tuple(reversed(c)))
        varying = [n for d, n in enumerate(self._names) if len({c[d] for c in coords}) > 1]
        # in the canonical axis order, so the label does not depend on the order the layout
        # gave (traces are shared by every order of one layout class)
        canonical = [a.value for a in Axis]
        varying.sort(key=lambda n: canonical.index(n) if n in canonical else len(canonical))
        return GroupInfo(size=pg.size(), mesh_axis="+".join(varying) or None)


def _group_of(node: torch.fx.Node, gm: torch.fx.GraphModule, groups: GroupTable) -> GroupInfo | None:
    from torch.distributed.distributed_c10d import ProcessGroup

    for a in node.args:  # c10d ops take the ProcessGroup object (traced as a constant)
        if isinstance(a, torch.fx.Node) and a.op == "get_attr":
            obj = getattr(gm, a.target, None)
            if isinstance(obj, torch.ScriptObject):
                try:
                    return groups.lookup(ProcessGroup.unbox(obj).group_name)
                except RuntimeError:
                    continue
    for a in node.args:
        if isinstance(a, str) and a in groups:
            return groups.lookup(a)
    last = node.args[-1] if node.args else None  # functional collectives: group name last
    return groups.lookup(last) if isinstance(last, str) else None


def collective_record(
    node: torch.fx.Node, gm: torch.fx.GraphModule, groups: GroupTable, phase: Phase
) -> CollectiveRecord:
    """The :class:`CollectiveRecord` of a collective node (bytes of the per-rank buffer)."""
    op = str(node.target)
    kind, which = _COLLECTIVES[op]
    src = node.meta.get("val") if which == "out" else _val(node.args[which])
    tensors = list(_tensors(src))
    info = _group_of(node, gm, groups)
    return CollectiveRecord(
        kind=kind,
        bytes=sum(_nbytes(t) for t in tensors),
        group_size=info.size if info else 0,
        mesh_axis=info.mesh_axis if info else None,
        dtype=str(tensors[0].dtype).removeprefix("torch.") if tensors else "float32",
        phase=phase,
        op=op,
    )


def node_records(
    node: torch.fx.Node, gm: torch.fx.GraphModule, groups: GroupTable, phase: Phase
) -> tuple[OpRecord | CollectiveRecord, ...]:
    """Our records for one graph node: none for placeholders and bookkeeping, two for the
    tracer's ``topomesh::chunk_cat`` (the ``torch.chunk`` and ``torch.cat`` it stands for,
    :mod:`topomesh.trace.chunks`), one otherwise."""
    if node.op != "call_function":
        return ()
    name = "_operator.getitem" if node.target is operator.getitem else str(node.target)
    if name in _SKIP:
        return ()
    if name in _COLLECTIVES:
        return (collective_record(node, gm, groups, phase),)
    if name in chunks.OPS:
        return tuple(_record(*call, phase) for call in chunks.expand(name, [_val(a) for a in node.args], node.meta.get("val")))
    return (op_record(node, phase),)
