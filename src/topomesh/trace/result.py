"""A traced training step as ordered segments, and the reuse of one block for N layers.

The tracer cuts the graph of a step into segments at block boundaries (forward hooks,
gradient hooks and one optimizer per block mark them): ``REST`` segments (embedding, head,
loss, optimizer for non-block parameters) and ``BLOCK`` segments (one transformer block's
forward, backward or optimizer update). A trace of a model with two blocks composes any
depth (:meth:`Trace.compose`): :meth:`Trace.events` repeats the leading block of each phase
in place and :meth:`Trace.summary` multiplies its counts, so an 80-layer step costs no more
than the two-block trace it came from.
"""

from __future__ import annotations

import dataclasses
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
    trace_s: float = dataclasses.field(default=0.0, compare=False)
    """Wall time of the trace that produced this object."""

    @property
    def world_size(self) -> int:
        n = 1
        for _, d in self.layout:
            n *= d
        return n

    def compose(self, n_layers: int) -> Trace:
        """This trace standing for the same model with ``n_layers`` identical blocks.

        In every phase the block that runs first (layer 0 forward, the last layer backward)
        stands for ``n_layers - traced_layers + 1`` blocks and the others for one each: with
        FSDP's prefetching, the block that runs last in a phase differs from the rest (its
        backward all-gather is issued by the head), so a two-block trace composes exactly.
        """
        if not any(s.part is Part.BLOCK for s in self.segments):
            raise ValueError("This trace has no block segments (traced with split_blocks=False).")
        if n_layers < self.traced_layers:
            raise ValueError(
                f"Cannot compose {n_layers} layers from a trace of {self.traced_layers} blocks."
            )
        return dataclasses.replace(self, n_layers=n_layers)

    def multiplicities(self) -> tuple[int, ...]:
        """How often each segment stands in the step (see :meth:`compose`)."""
        extra = self.n_layers - self.traced_layers
        first: dict[Phase, int] = {}
        out = []
        for seg in self.segments:
            if seg.part is Part.BLOCK and extra:
                lead = first.setdefault(seg.phase, seg.layer if seg.layer is not None else -1)
                out.append(1 + extra if seg.layer == lead else 1)
            else:
                out.append(1)
        return tuple(out)

    def events(self) -> Iterator[Event]:
        """Every record of the step in order, the leading block of each phase repeated."""
        mult = self.multiplicities()
        i, segs = 0, self.segments
        while i < len(segs):
            j = i + 1
            if mult[i] > 1:  # the run of segments of this block, repeated as a unit
                while j < len(segs) and segs[j].layer == segs[i].layer and segs[j].phase is segs[i].phase:
                    j += 1
            for _ in range(mult[i]):
                for s in segs[i:j]:
                    yield from s.events
            i = j

    def summary(self) -> TraceSummary:
        """Counts, FLOPs and collective bytes of the whole step (composed segments multiplied)."""
        ops: Counter[str] = Counter()
        flops: Counter[str] = Counter()
        colls: dict[tuple[str, str, str], list[int]] = {}
        for seg, m in zip(self.segments, self.multiplicities(), strict=True):
            for e in seg.events:
                if isinstance(e, OpRecord):
                    ops[e.op] += m
                    flops[e.phase.value] += m * e.flops
                else:
                    key = (e.kind.value, e.mesh_axis or "?", e.phase.value)
                    c = colls.setdefault(key, [0, 0])
                    c[0] += m
                    c[1] += m * e.bytes
        return TraceSummary(
            op_counts=dict(ops),
            flops_by_phase=dict(flops),
            collectives={k: CollectiveStats(count=c, bytes=b) for k, (c, b) in colls.items()},
            unknown_ops={op: ops[op] for op in self.unknown_ops},
        )
