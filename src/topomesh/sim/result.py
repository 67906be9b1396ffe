"""What a simulation returns: :class:`StepResult` (its fields are the ``--json`` keys)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class StepBreakdown:
    """Where the critical rank's step time goes; the parts add up to ``step_time_s``."""

    compute_s: float
    """Forward and backward ops on the compute stream."""
    exposed_comm_s: Mapping[str, float]
    """Per mesh axis (or flattened axes): seconds the compute stream waited for that axis's
    collectives (blocking collectives in full, prefetched/overlapped ones only where they
    ran past the compute that hid them)."""
    bubble_s: float
    """Pipeline: waiting for another stage's compute."""
    optimizer_s: float
    p2p_s: float
    """Pipeline: waiting for the activation or gradient send between stages."""

    @property
    def total_s(self) -> float:
        return self.compute_s + sum(self.exposed_comm_s.values()) + self.bubble_s + self.optimizer_s + self.p2p_s

    def to_dict(self) -> dict[str, Any]:
        return {"compute_s": self.compute_s, "exposed_comm_s": dict(self.exposed_comm_s),
                "bubble_s": self.bubble_s, "optimizer_s": self.optimizer_s, "p2p_s": self.p2p_s}


@dataclass(frozen=True, slots=True, kw_only=True)
class StageMemory:
    """Peak bytes on one rank of a pipeline stage (or rank holding several virtual stages)."""

    rank: int
    """Pipeline rank."""
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    """Kept for backward: per micro-batch bytes × micro-batches in flight at the peak (the
    moment the activations and the gradients that exist by then are most together)."""
    in_flight: int
    transient_bytes: int
    """Gathered parameters (FSDP, the current and the prefetched piece), in backward the
    gradient-reduction buffers (unsharded gradients, the reduce inputs of the piece and of
    the one before), and the largest tensor one op produces."""
    receive_bytes: int = 0
    """A pipeline's receive buffers: PyTorch's ``PipelineStage`` makes one per micro-batch for
    each stage's input (all but the first stage) and for its output's gradient (all but the
    last) before the first step, and keeps them."""
    grads_at_peak_bytes: int | None = None
    """Under a pipeline, the gradients that exist at the peak: a stage's appear at its first
    backward (or W), as it frees that micro-batch's activations, since the optimizer sets them
    to None every step. GPipe's last stage of ``pp=2`` with 2 micro-batches peaks with both
    micro-batches' activations and no gradients (without a pipeline: all of them). None: all of
    :attr:`grads_bytes`."""

    @property
    def peak_bytes(self) -> int:
        """Parameters, the gradients at the peak, optimizer state, activations, transient and
        receive buffers.

        >>> m = StageMemory(rank=0, params_bytes=10, grads_bytes=8, optimizer_bytes=20, activations_bytes=9,
        ...                 in_flight=2, transient_bytes=5, receive_bytes=1)
        >>> import dataclasses
        >>> m.peak_bytes, dataclasses.replace(m, grads_at_peak_bytes=0).peak_bytes
        (53, 45)
        """
        return (self.params_bytes + self.grads_live_bytes + self.optimizer_bytes + self.activations_bytes
                + self.transient_bytes + self.receive_bytes)

    @property
    def grads_live_bytes(self) -> int:
        """The gradients counted in :attr:`peak_bytes`: :attr:`grads_at_peak_bytes` where given,
        else all of :attr:`grads_bytes`."""
        return self.grads_bytes if self.grads_at_peak_bytes is None else self.grads_at_peak_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "peak_bytes": self.peak_bytes, "params_bytes": self.params_bytes,
                "grads_bytes": self.grads_bytes, "optimizer_bytes": self.optimizer_bytes,
                "activations_bytes": self.activations_bytes, "in_flight": self.in_flight,
                "transient_bytes": self.transient_bytes, "receive_bytes": self.receive_bytes,
                "grads_at_peak_bytes": self.grads_at_peak_bytes}


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    step_time_s: float
    tokens_per_s: float
    mfu: float
    """Model FLOPs (3 × the traced forward FLOPs: forward plus a backward of twice its work,
    the 6·N·tokens count of PaLM, arXiv:2204.02311 App. B, with attention included) per second
    over the world's peak dense FLOP/s."""
    hfu: float
    """FLOPs the hardware executes (forward, backward and recomputation, as traced) per
    second over the world's peak."""
    peak_memory_bytes: int
    """Largest peak over the pipeline ranks."""
    memory: tuple[StageMemory, ...]
    feasible: bool
    reason: str | None
    breakdown: StepBreakdown
    links: Mapping[str, Mapping[str, Any]]
    """Per mesh axis: the link its groups cross (kind, bandwidth, nodes, ranks per node)."""
    layout: Mapping[str, Any]
    """Degrees, order, micro-batch, micro-batches, schedule, interleave, recompute, sequence parallel."""
    world_size: int
    device: str
    capacity_bytes: int
    measured_ops: int = 0
    """Op records priced from the measured op table."""
    roofline_ops: int = 0
    """Op records priced by the efficiency-aware roofline."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    timeline: Any = field(default=None, compare=False, repr=False)
    """With ``record=True``: the Chrome trace of the simulated step (not in ``to_dict``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory": [m.to_dict() for m in self.memory],
            "feasible": self.feasible,
            "reason": self.reason,
            "breakdown": self.breakdown.to_dict(),
            "links": {k: dict(v) for k, v in self.links.items()},
            "layout": dict(self.layout),
            "world_size": self.world_size,
            "device": self.device,
            "capacity_bytes": self.capacity_bytes,
            "measured_ops": self.measured_ops,
            "roofline_ops": self.roofline_ops,
            **dict(self.extra),
        }
