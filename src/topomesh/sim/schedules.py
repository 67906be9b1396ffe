"""Pipeline schedules: each rank's order of actions, taken from PyTorch's own schedule classes.

``torch.distributed.pipelining`` computes every rank's action list (``pipeline_order``) in
the schedule's constructor from the stages' indices alone. :func:`action_order` builds the
schedule with stand-in stages (index, count, group size and rank — no module, no process
group) and keeps the compute actions, so the order simulated is the order torch runs:

>>> [str(a) for a in action_order(Schedule.ONE_F_ONE_B, pp=2, microbatches=3)[1]]
['1F0', '1B0', '1F1', '1B1', '1F2', '1B2']
>>> [str(a) for a in action_order(Schedule.GPIPE, pp=2, microbatches=2)[0]]
['0F0', '0F1', '0B0', '0B1']

Actions are ``F`` (forward), ``B`` (full backward), and for zero-bubble schedules ``I``
(backward for inputs) and ``W`` (backward for weights), each on one (global) stage and one
micro-batch. With ``pp == 1`` there is no schedule: micro-batches run forward then
backward, one after the other (gradient accumulation).
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from enum import StrEnum

from topomesh.errors import LayoutError


class Schedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    LOOPED_BFS = "looped-bfs"
    INTERLEAVED_ZB = "interleaved-zb"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"

    @property
    def torch_name(self) -> str:
        return _TORCH_NAMES[self]

    @property
    def multi_stage(self) -> bool:
        """Several (virtual) stages per rank."""
        return self not in (Schedule.GPIPE, Schedule.ONE_F_ONE_B)

    @property
    def receives_at_action(self) -> bool:
        """Whether PyTorch posts a stage's receive only when the rank reaches the action (GPipe's
        and 1F1B's ``_step_microbatches`` batch it with the action's wait), rather than ahead
        (the multi-stage runtime's ``_add_send_recv`` places each RECV where the sender's
        action is lowered). Send/recv are rendezvous, so a late receive still waits one transfer
        (:func:`topomesh.sim.engine.simulate_pipeline`'s ``late_receives``)."""
        return not self.multi_stage

    @property
    def v_shape(self) -> bool:
        """Two stages per rank placed in a V (rank r holds stages r and 2p-1-r)."""
        return self in (Schedule.ZBV, Schedule.DUALPIPEV)


_TORCH_NAMES = {
    Schedule.GPIPE: "GPipe",
    Schedule.ONE_F_ONE_B: "1F1B",
    Schedule.INTERLEAVED_1F1B: "Interleaved1F1B",
    Schedule.LOOPED_BFS: "LoopedBFS",
    Schedule.INTERLEAVED_ZB: "InterleavedZeroBubble",
    Schedule.ZBV: "ZBVZeroBubble",
    Schedule.DUALPIPEV: "DualPipeV",
}


class Kind(StrEnum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - torch's name for backward-for-inputs
    W = "W"


@dataclass(frozen=True, slots=True)
class Action:
    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}"


def stage_count(schedule: Schedule, pp: int, interleave: int) -> int:
    """Global stages: ``pp`` for single-stage schedules, ``pp * interleave`` otherwise (2·pp
    for the V-shaped ones)."""
    if not schedule.multi_stage:
        return pp
    return 2 * pp if schedule.v_shape else pp * interleave


def rank_stages(schedule: Schedule, pp: int, interleave: int, rank: int) -> list[int]:
    """The global stages rank ``rank`` holds (looped: r, r+p, ...; V: r and 2p-1-r)."""
    if not schedule.multi_stage:
        return [rank]
    if schedule.v_shape:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(interleave)]


def _stand_in(stage: int, stages: int, pp: int, rank: int) -> object:
    import torch

    return types.SimpleNamespace(
        stage_index=stage, num_stages=stages, group_size=pp, group_rank=rank,
        is_first=stage == 0, is_last=stage == stages - 1, has_backward=True, submod=torch.nn.Module(),
    )


def action_order(schedule: Schedule | str, *, pp: int, microbatches: int, interleave: int = 1) -> list[list[Action]]:
    """Compute actions of every pipeline rank in the order PyTorch's schedule runs them."""
    return [list(acts) for acts in _lowered(Schedule(schedule), pp, microbatches, interleave)[0]]


RUNTIME_UNSHARDED_STAGES = 3
"""How many of a rank's stages PyTorch's multi-stage runtime keeps unsharded at once
(``_add_unshard_reshard``'s ``max_active_stages``, which the runtime leaves at its default)."""


def unshard_points(schedule: Schedule | str, *, pp: int, microbatches: int,
                   interleave: int = 1) -> tuple[dict[int, tuple[int, ...]], ...] | None:
    """Where each pipeline rank unshards its stages' FSDP parameters, as PyTorch's multi-stage
    runtime does: per rank, ``{i: stages}``, the stages whose ``UNSHARD`` runs just before the
    rank's compute action ``i`` (an index into :func:`action_order`'s list for that rank).
    ``None`` for GPipe and 1F1B, whose stage gathers in its first forward (FSDP2's pre-forward
    hook, once the input has arrived), and without a pipeline (``pp`` 1).

    The runtime (``_PipelineScheduleRuntime``, every multi-stage schedule) lowers the compute
    actions with ``_add_unshard_reshard``: before each action it unshards the next three
    distinct stages the rank will compute (``unshard(async_op=True)`` on every FSDP module of
    the stage: their all-gathers issued at once) and reshards the ones that fell out of them;
    a stage's action waits for its all-gathers. With two or three stages a rank, each is
    unsharded once, ahead of the step's first action; with more, stages are evicted and
    gathered again as the rank cycles through them:

    >>> unshard_points("interleaved-1f1b", pp=2, microbatches=4, interleave=2)[0]
    {0: (0, 2)}
    >>> unshard_points("1f1b", pp=2, microbatches=4) is None
    True
    >>> unshard_points("interleaved-1f1b", pp=1, microbatches=2, interleave=2) is None
    True
    """
    return _lowered(Schedule(schedule), pp, microbatches, interleave)[1] if pp > 1 else None


@functools.lru_cache(maxsize=256)
def _lowered(schedule: Schedule, pp: int, microbatches: int,
             interleave: int) -> tuple[tuple[tuple[Action, ...], ...], tuple[dict[int, tuple[int, ...]], ...] | None]:
    """Every rank's compute actions and :func:`unshard_points`, built once per argument set
    (torch's constructors take tens of ms)."""
    order, sched = _build_order(schedule, pp, microbatches, interleave)
    actions = tuple(tuple(acts) for acts in order)
    lowered = getattr(sched, "pipeline_order_with_comms", None) if schedule.multi_stage else None
    if not lowered:
        return actions, None
    points: list[dict[int, tuple[int, ...]]] = []
    for rank, acts in enumerate(actions):
        here: dict[int, tuple[int, ...]] = {}
        pending: list[int] = []
        seen: list[Action] = []
        for a in lowered.get(rank, []):
            kind = a.computation_type.value
            if kind == "UNSHARD":
                pending.append(a.stage_index)
            for sub in a.sub_actions or (a,):
                if sub.computation_type.value in ("F", "B", "I", "W"):
                    if pending:
                        here[len(seen)] = tuple(pending)
                        pending = []
                    seen.append(Action(sub.stage_index, Kind(sub.computation_type.value), sub.microbatch_index))
        if tuple(seen) != acts:
            raise LayoutError(f"PyTorch's lowered {schedule.torch_name} schedule runs rank {rank}'s compute actions "
                              f"in another order than its pipeline_order; this is a bug in topomesh's reading of it.")
        points.append(here)
    return actions, tuple(points)


def _build_order(schedule: Schedule, pp: int, microbatches: int, interleave: int) -> tuple[list[list[Action]], object]:
    if pp < 1 or microbatches < 1:
        raise LayoutError(f"a pipeline needs pp >= 1 and micro-batches >= 1, got pp={pp}, micro-batches={microbatches}.")
    if pp == 1 and not schedule.multi_stage:
        return [[a for m in range(microbatches) for a in (Action(0, Kind.F, m), Action(0, Kind.B, m))]], None
    if schedule.multi_stage and not schedule.v_shape and interleave < 2 and schedule is Schedule.INTERLEAVED_1F1B:
        raise LayoutError("schedule interleaved-1f1b needs --interleave 2 or more virtual stages per rank.")
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = torch_schedules.get_schedule_class(schedule.torch_name)
    stages = stage_count(schedule, pp, interleave)
    try:
        if schedule.multi_stage:
            sched = cls([_stand_in(s, stages, pp, 0) for s in rank_stages(schedule, pp, interleave, 0)], microbatches)
        else:
            sched = cls(_stand_in(0, stages, pp, 0), microbatches)
    except (ValueError, RuntimeError, AssertionError) as exc:
        raise LayoutError(
            f"PyTorch's {schedule.torch_name} schedule refuses pp={pp}, micro-batches={microbatches}, "
            f"interleave={interleave}: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
        ) from None
    if not schedule.multi_stage:
        return [_single_stage(schedule, pp, microbatches, r) for r in range(pp)], sched
    out: list[list[Action]] = []
    for rank in range(pp):
        acts: list[Action] = []
        for a in sched.pipeline_order.get(rank, []):
            for sub in (a.sub_actions or (a,)) if a is not None else ():  # OVERLAP_F_B holds an F and a B
                kind = sub.computation_type.value
                if kind in ("F", "B", "I", "W"):
                    acts.append(Action(sub.stage_index, Kind(kind), sub.microbatch_index))
        out.append(acts)
    return out, sched


def _single_stage(schedule: Schedule, pp: int, m: int, rank: int) -> list[Action]:
    """GPipe and 1F1B as their ``_step_microbatches`` run them (the schedule IR torch builds
    for these two is informational and disagrees with the runtime, e.g. ``1F3`` for three
    micro-batches): GPipe all forwards then all backwards; 1F1B ``min(m, pp - rank)``
    warm-up forwards, then one backward and one forward while forwards remain, then the
    remaining backwards."""
    if schedule is Schedule.GPIPE:
        return [Action(rank, Kind.F, i) for i in range(m)] + [Action(rank, Kind.B, i) for i in range(m)]
    warm = min(m, pp - rank)
    acts = [Action(rank, Kind.F, i) for i in range(warm)]
    for i in range(m):
        acts.append(Action(rank, Kind.B, i))
        if warm + i < m:
            acts.append(Action(rank, Kind.F, warm + i))
    return acts


def in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward ran on this rank and whose backward has not (per
    stage, summed; a zero-bubble micro-batch until its W: ``stage_backward_input`` keeps the
    graph): how many micro-batches' activations the rank holds at its peak.

    >>> in_flight(action_order("1f1b", pp=4, microbatches=8)[0])
    4
    """
    live: set[tuple[int, int]] = set()
    best = 0
    for a in actions:
        if a.kind is Kind.F:
            live.add((a.stage, a.mb))
            best = max(best, len(live))
        elif a.kind in (Kind.B, Kind.W):
            live.discard((a.stage, a.mb))
    return best
