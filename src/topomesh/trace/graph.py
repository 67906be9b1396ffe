"""Our own graph of a traced training step: the contract between trace/ and cost/.

The tracer (``topomesh.trace``) turns a ``make_fx`` graph into these records; the cost
models (``topomesh.cost``) price them. Records are plain frozen dataclasses so that
traces can be cached, compared and serialized without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum


class CollectiveKind(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND_RECV = "send_recv"


class Phase(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str
    """torch dtype name without the ``torch.`` prefix, e.g. ``bfloat16``."""
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class OpRecord:
    """One compute op of the traced graph, on local (sharded) shapes."""

    op: str
    """ATen overload name, e.g. ``aten.mm.default``."""
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    flops: int = 0
    """FLOPs counted on the local shapes (0 for ops without a formula)."""
    bytes_moved: int | None = None
    """Bytes read plus written; 0 for ops that move nothing (views); None when unknown
    (cost models then take the input plus output tensor sizes)."""
    phase: Phase = Phase.FORWARD
    args: tuple = field(default=(), compare=False)
    """Non-tensor arguments that change the cost (e.g. dims, transposes), as a hashable tuple."""
    hook: str = ""
    """The FSDP2 hook the op ran in: the innermost ``FSDP::`` ``record_function`` label around it,
    its first word less the prefix (``pre_forward``, ``all_gather_copy_out``,
    ``post_backward_reduce``, ...); ``""`` outside FSDP's hooks. What tells a parameter's
    unsharding and a gradient's reduction apart from the model's own ops
    (:func:`topomesh.sim.price.op_role`)."""

    @property
    def signature(self) -> tuple:
        """What an op profile is keyed by: op, shapes, dtypes, strides and scalar args."""
        return (
            self.op,
            tuple((t.shape, t.dtype, t.stride) for t in self.inputs),
            self.args,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveRecord:
    """One collective of the traced graph."""

    kind: CollectiveKind
    bytes: int
    """Bytes of the per-rank buffer: input for all-reduce/reduce-scatter/all-to-all, output for all-gather."""
    group_size: int
    mesh_axis: str | None = None
    """Name of the mesh axis (or ``"+"``-joined axes) whose groups run it; None if unknown."""
    dtype: str = "float32"
    phase: Phase = Phase.FORWARD
    op: str = ""
    """The traced op, e.g. ``_c10d_functional.all_gather_into_tensor.default``."""
