"""A traced training step as ordered segments, and the reuse of one block for N layers.

The tracer cuts the graph of a step into segments at block boundaries (forward hooks,
gradient hooks and one optimizer per block mark them): ``REST`` segments (embedding, head,
loss, optimizer for non-block parameters) and ``BLOCK`` segments (one transformer block's
forward, backward or optimizer update). A trace of a model with one block composes any
depth (:meth:`Trace.compose`): :meth:`Trace.events` repeats the block segments in place and
:meth:`Trace.summary` multiplies their counts, so an 80-layer step costs no more than the
one-block trace it came from. Work a block's neighbour issues for it (FSDP2's prefetched
all-gathers) is found by data flow and repeated with the block.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

from topomesh.trace.graph import CollectiveRecord, OpRecord, Phase

Event = OpRecord | CollectiveRecord


class Part(StrEnum):
    REST = "rest"
    BLOCK = "block"


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """Consecutive records of one phase, either all inside one block or all outside."""

    part: Part
    phase: Phase
    layer: int | None = None
    """Index of the block in the traced model (BLOCK segments only)."""
    events: tuple[Event, ...]
    prefetch: tuple[Event, ...] = ()
    """Work for this block issued before it, from a REST segment (e.g. FSDP's backward
    all-gather of the block that runs first in backward, issued by the head). The records
    stay in that REST segment; a one-block trace repeats them for every further block."""
    saved_bytes: int = 0
    """Forward segments: bytes of the tensors this segment computes from the step's inputs
    that backward reads — the activations one micro-batch keeps alive between its forward
    and its backward (tensors sharing storage counted once; parameters and their views
    excluded). 0 for other phases."""
    peak_output_bytes: int = 0
    """Transient memory: the most bytes the segment's own temporaries (tensors it computes from
    the step's inputs and last reads itself) hold at once, by liveness in graph order
    (:func:`topomesh.trace.tracer._liveness`)."""
    param_bytes: int = 0
    """Bytes of the storages the segment makes from parameters alone, not from the step's
    inputs: FSDP2's parameters cast to the compute dtype (under mixed precision, in each unit's
    pre-forward and pre-backward) and its all-gather buffers, each counted once, where it is
    made (views share their base's storage)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StateBytes:
    """Training state one rank holds for a set of parameters (local shards), bytes."""

    params: int = 0
    grads: int = 0
    """Gradients as the optimizer sees them (the parameter's dtype and sharding)."""
    optimizer: int = 0
    """Optimizer state measured after a step (AdamW: two moments per parameter)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def __add__(self, other: StateBytes) -> StateBytes:
        return StateBytes(params=self.params + other.params, grads=self.grads + other.grads,
                          optimizer=self.optimizer + other.optimizer)

    def __mul__(self, k: int) -> StateBytes:
        return StateBytes(params=self.params * k, grads=self.grads * k, optimizer=self.optimizer * k)


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveStats:
    count: int
    bytes: int
    """Bytes per rank per step, summed over the collectives of this kind, axis and phase."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceSummary:
    """Totals of a step on one rank (local shapes)."""

    op_counts: dict[str, int]
    """Compute ops by ATen overload name."""
    op_flops: dict[str, int]
    """FLOPs by op name (ops with a formula only)."""
    op_bytes: dict[str, int]
    """Bytes read and written by op name."""
    flops_by_phase: dict[str, int]
    collectives: dict[tuple[str, str, str], CollectiveStats]
    """Keyed by (kind, mesh axis or ``"?"``, phase)."""
    unknown_ops: dict[str, int]

    @property
    def flops(self) -> int:
        return sum(self.flops_by_phase.values())

    def to_json(self) -> dict:
        return {
            "flops": self.flops,
            "flops_by_phase": dict(self.flops_by_phase),
            "op_counts": dict(sorted(self.op_counts.items())),
            "op_flops": dict(sorted(self.op_flops.items())),
            "op_bytes": dict(sorted(self.op_bytes.items())),
            "collectives": [
                {"kind": k, "mesh_axis": a, "phase": p, "count": s.count, "bytes": s.bytes}
                for (k, a, p), s in sorted(self.collectives.items())
            ],
            "unknown_ops": dict(sorted(self.unknown_ops.items())),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Trace:
    """One rank's training step: ops and collectives in graph order, by segment."""

    model: str
    layout: tuple[tuple[str, int], ...]
    """Degrees per mesh axis, in mesh order."""
    batch_size: int
    dtype: str
    traced_layers: int
    """Blocks in the model that was traced."""
    n_layers: int
    """Blocks this trace stands for: ``traced_layers`` or the depth given to :meth:`compose`."""
    segments: tuple[Segment, ...]
    unknown_ops: tuple[str, ...] = ()
    """Names of ops the cost model has no rule for (counted in :meth:`summary`)."""
    block_state: StateBytes = StateBytes()
    """Parameters, gradients and optimizer state of one traced block on this rank (the
    average over the traced blocks)."""
    first_state: StateBytes = StateBytes()
    """State of the parameters outside the blocks that a pipeline's first stage holds
    (embedding modules)."""
    last_state: StateBytes = StateBytes()
    """State of the other parameters outside the blocks (final norm, output head): the last stage's."""
    trace_s: float = dataclasses.field(default=0.0, compare=False)
    """Wall time of the trace that produced this object."""

    @property
    def world_size(self) -> int:
        return math.prod(d for _, d in self.layout)

    def compose(self, n_layers: int) -> Trace:
        """This trace standing for the same model with ``n_layers`` identical blocks.

        From a one-block trace every BLOCK segment is repeated ``n_layers`` times, all but the
        last copy preceded by the segment's ``prefetch`` (what the block before it issues on
        its behalf: FSDP's backward all-gather). From a trace of two or more blocks the block
        that runs first in each phase stands for ``n_layers - traced_layers + 1`` blocks and
        the others for one each (the last block of a phase differs: it gets no prefetch).
        """
        if not any(s.part is Part.BLOCK for s in self.segments):
            raise ValueError("This trace has no block segments (traced with split_blocks=False).")
        if n_layers < self.traced_layers:
            raise ValueError(
                f"Cannot compose {n_layers} layers from a trace of {self.traced_layers} blocks."
            )
        return dataclasses.replace(self, n_layers=n_layers)

    def multiplicities(self) -> tuple[int, ...]:
        """How often each segment's events stand in the step (see :meth:`compose`)."""
        extra = self.n_layers - self.traced_layers
        if self.traced_layers == 1:
            return tuple(self.n_layers if s.part is Part.BLOCK else 1 for s in self.segments)
        first: dict[Phase, int | None] = {}
        out = []
        for seg in self.segments:
            if seg.part is Part.BLOCK and extra:
                lead = first.setdefault(seg.phase, seg.layer)
                out.append(1 + extra if seg.layer == lead else 1)
            else:
                out.append(1)
        return tuple(out)

    def _prefetch_repeats(self, seg: Segment) -> int:
        return self.n_layers - 1 if self.traced_layers == 1 and seg.part is Part.BLOCK else 0

    def events(self) -> Iterator[Event]:
        """Every record of the step in order, composed block segments repeated in place."""
        for seg, m in zip(self.segments, self.multiplicities(), strict=True):
            pre = self._prefetch_repeats(seg)
            for k in range(m):
                if k < pre:
                    yield from seg.prefetch
                yield from seg.events

    def summary(self) -> TraceSummary:
        """Counts, FLOPs and collective bytes of the whole step (composed segments multiplied)."""
        ops: Counter[str] = Counter()
        op_flops: Counter[str] = Counter()
        op_bytes: Counter[str] = Counter()
        flops: Counter[str] = Counter()
        colls: dict[tuple[str, str, str], list[int]] = {}
        weighted = []
        for seg, m in zip(self.segments, self.multiplicities(), strict=True):
            weighted.append((seg.events, m))
            weighted.append((seg.prefetch, self._prefetch_repeats(seg)))
        for events, m in weighted:
            for e in events:
                if isinstance(e, OpRecord):
                    ops[e.op] += m
                    flops[e.phase.value] += m * e.flops
                    if e.flops:
                        op_flops[e.op] += m * e.flops
                    op_bytes[e.op] += m * (e.bytes_moved or 0)
                else:
                    key = (e.kind.value, e.mesh_axis or "?", e.phase.value)
                    c = colls.setdefault(key, [0, 0])
                    c[0] += m
                    c[1] += m * e.bytes
        return TraceSummary(
            op_counts=dict(ops),
            op_flops=dict(op_flops),
            op_bytes=dict(op_bytes),
            flops_by_phase=dict(flops),
            collectives={k: CollectiveStats(count=c, bytes=b) for k, (c, b) in colls.items()},
            unknown_ops={op: ops[op] for op in self.unknown_ops},
        )
