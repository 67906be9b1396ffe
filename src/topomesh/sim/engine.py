"""Event simulation of one training step: every pipeline rank, one compute stream each, and a
communication stream per link class.

Per rank the engine keeps the time its compute stream is free, the time each
communication stream (:class:`~topomesh.sim.price.Stream`) is free, and when its last
gradient reduction ends. It runs the rank's actions (:mod:`topomesh.sim.schedules`) in
order; an action is a list of priced pieces (:class:`~topomesh.sim.price.Work`) run one
after the other:

* a piece's parameter all-gathers are issued when the piece before it starts (FSDP2's
  one-ahead prefetch; the first piece of an action issues its own), queue on their stream,
  and the piece cannot start before they end; under a multi-stage schedule a stage's
  all-gathers are issued together where PyTorch's runtime unshards it, ahead of its input
  (``unshards``);
* the piece computes, then its blocking collectives run on their streams while the compute
  stream waits (tensor/context/expert parallel: the consumer needs the result);
* its gradient reductions are issued when it ends and only the optimizer waits for them
  (``Work.wait_reduce``: the rank's compute waits for them once the action is done, as FSDP2
  under a pipeline does after a stage's last backward).

Streams are FIFO in issue order, so a prefetch and a tensor-parallel collective on the same
link class share it, and an NVLink collective and a network collective overlap.
Pipeline dependencies: forward of stage s after forward of s-1 plus the p2p send on the
pipeline link; backward (or I) of stage s after that of s+1; W after I. Sends are
asynchronous (the sender does not wait).

Every second of a rank's compute stream is booked to one bucket (compute, optimizer, an
axis's exposed communication, p2p wait, pipeline bubble), so the critical rank's buckets add
up to the step time exactly. Repeated identical blocks are simulated until the state
advances by the same amount in every component, then fast-forwarded (exact: the update is
max-plus linear, so a uniform shift repeats).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from topomesh.errors import LayoutError
from topomesh.sim.price import Comm, Stream, Work
from topomesh.sim.schedules import Action, Kind

_STREAMS = (Stream.INTRA, Stream.NET)

ActionKey = tuple[int, str, int]
"""(global stage, ``Kind`` value or ``"opt"``, micro-batch) of one action of the step."""


@dataclass(slots=True)
class Span:
    """One interval on a track of the timeline (for the Chrome trace)."""

    track: str
    name: str
    start: float
    end: float


@dataclass(slots=True)
class RankState:
    compute_free: float = 0.0
    stream_free: dict[Stream, float] = field(default_factory=lambda: dict.fromkeys(_STREAMS, 0.0))
    reduce_end: float = 0.0
    reduce_axis: str = ""
    hold_end: float = 0.0
    """End of reductions the compute stream waits for once the running action is done
    (:attr:`Work.wait_reduce <topomesh.sim.price.Work.wait_reduce>`), and their axis."""
    hold_axis: str = ""
    compute_s: float = 0.0
    optimizer_s: float = 0.0
    bubble_s: float = 0.0
    p2p_s: float = 0.0
    exposed: dict[str, float] = field(default_factory=dict)
    spans: list[Span] | None = None
    busy: list[tuple[float, float, ActionKey]] = field(default_factory=list)
    """(start, end, action) of every action the rank ran, from the end of its wait for the
    action's input; the optimizer as ``(stage, "opt", 0)``."""
    costs: dict[ActionKey, tuple[float, float]] = field(default_factory=dict)
    """Per action of :attr:`busy`: the seconds of compute it ran and of communication it waited
    for (what :func:`topomesh.sim.shared.shared_pipeline` shares out)."""

    def book(self, axis: str, seconds: float) -> None:
        if seconds > 0:
            self.exposed[axis] = self.exposed.get(axis, 0.0) + seconds

    def span(self, track: str, name: str, start: float, end: float) -> None:
        if self.spans is not None and end > start:
            self.spans.append(Span(track, name, start, end))

    def vector(self) -> tuple[float, ...]:
        t = self.compute_free
        return (t, *(max(self.stream_free[s], t) for s in _STREAMS), max(self.reduce_end, t))


def _issue(state: RankState, comms: Sequence[Comm], at: float, label: str) -> tuple[float, str]:
    """Queue ``comms`` on their streams at time ``at``; (end of the last, its axis)."""
    end, axis = at, ""
    for c in comms:
        s = max(at, state.stream_free[c.stream])
        state.stream_free[c.stream] = s + c.seconds
        state.span(f"comm:{c.stream.value}", f"{label} {c.axis}", s, s + c.seconds)
        if s + c.seconds >= end:
            end, axis = s + c.seconds, c.axis
    return end, axis


def _run_piece(state: RankState, work: Work, gather_end: tuple[float, str], label: str) -> float:
    """Run one piece whose gathers end at ``gather_end``; returns the piece's start time."""
    t = state.compute_free
    g_end, g_axis = gather_end
    start = max(t, g_end)
    state.book(g_axis, start - t)
    t = start + work.compute_s
    state.compute_s += work.compute_s
    state.span("compute", label, start, t)
    for c in work.blocking:
        s = max(t, state.stream_free[c.stream])
        state.stream_free[c.stream] = s + c.seconds
        state.book(c.axis, s + c.seconds - t)
        state.span(f"comm:{c.stream.value}", f"{label} {c.axis}", s, s + c.seconds)
        t = s + c.seconds
    state.compute_free = t
    if work.reduce:
        r_end, r_axis = _issue(state, work.reduce, t, f"{label} reduce")
        if r_end >= state.reduce_end:
            state.reduce_end, state.reduce_axis = r_end, r_axis
        if work.wait_reduce:
            state.hold_end, state.hold_axis = r_end, r_axis
    return start


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    work: Work
    count: int
    label: str


def run_pieces(state: RankState, pieces: Sequence[Piece]) -> None:
    """Run pieces in order with one-ahead gather prefetch; repeated blocks fast-forwarded."""
    flat = [p for p in pieces if p.count > 0]
    if not flat:
        return
    pending = _issue(state, flat[0].work.gather, state.compute_free, "gather")  # the first piece's own
    for i, p in enumerate(flat):
        nxt = flat[i + 1] if i + 1 < len(flat) else None
        done = 0
        history: list[tuple[tuple[float, ...], tuple, float]] = []
        while done < p.count:
            last_copy = done == p.count - 1
            next_work = p.work if not last_copy else (nxt.work if nxt else None)
            t0 = state.compute_free
            start = max(state.compute_free, pending[0])
            if next_work is not None and next_work.gather:
                nxt_pending = _issue(state, next_work.gather, start, "gather")
            else:
                nxt_pending = (start, "")
            _run_piece(state, p.work, pending, p.label)
            pending = nxt_pending
            done += 1
            # fast-forward identical copies once every component advances by the same amount
            if state.spans is None and p.count - done > 1:
                vec = (*state.vector(), pending[0])
                acc = _accounts(state)
                history.append((vec, acc, t0))
                if len(history) >= 3:
                    d1 = _diff(history[-1][0], history[-2][0])
                    d2 = _diff(history[-2][0], history[-3][0])
                    if d1 is not None and d2 is not None and abs(d1 - d2) <= 1e-12 * max(1.0, abs(d1)):
                        k = p.count - done - 1  # leave the last copy to run for real (its prefetch differs)
                        _advance(state, d1 * k, _acc_diff(history[-1][1], history[-2][1]), k)
                        pending = (pending[0] + d1 * k, pending[1])
                        done += k


def run_action(state: RankState, pieces: Sequence[Piece], memo: dict | None) -> None:
    """:func:`run_pieces`, memoized on the state relative to the compute clock.

    The engine's update is max-plus linear: shifting every time of the state by ``c`` shifts
    every result by ``c``. So an action that starts from the same relative state (streams and
    pending reductions measured from the compute clock, clamped at it: a stream free before
    the clock behaves as free at the clock) ends in the same relative state with the same
    bookings. Pipeline schedules repeat actions in that state over and over.
    """
    if memo is None or state.spans is not None:
        run_pieces(state, pieces)
        return
    t = state.compute_free
    rel = (*(max(state.stream_free[s], t) - t for s in _STREAMS), max(state.reduce_end, t) - t)
    key = (id(pieces), rel)
    hit = memo.get(key)
    if hit is None:
        compute, exposed, reduce_end = state.compute_s, dict(state.exposed), state.reduce_end
        run_pieces(state, pieces)
        if any(p.work.wait_reduce for p in pieces):  # a hold is the action's own: never replayed
            return
        delta = (
            state.compute_free - t,
            tuple(max(state.stream_free[s], state.compute_free) - t for s in _STREAMS),
            max(state.reduce_end, state.compute_free) - t,
            state.reduce_axis if state.reduce_end > reduce_end else None,
            state.compute_s - compute,
            {k: v - exposed.get(k, 0.0) for k, v in state.exposed.items() if v != exposed.get(k, 0.0)},
        )
        memo[key] = (pieces, delta)  # the pieces are kept alive so their id stays theirs
        return
    d_free, d_streams, d_reduce, axis, d_compute, d_exposed = hit[1]
    state.compute_free = t + d_free
    for s, d in zip(_STREAMS, d_streams, strict=True):
        state.stream_free[s] = t + d
    if axis is not None:  # the action's reductions end last; otherwise the pending end stands
        state.reduce_end, state.reduce_axis = t + d_reduce, axis
    state.compute_s += d_compute
    for k, v in d_exposed.items():
        state.exposed[k] = state.exposed.get(k, 0.0) + v


def _diff(a: tuple[float, ...], b: tuple[float, ...]) -> float | None:
    d = [x - y for x, y in zip(a, b, strict=True)]
    lam = d[0]
    if all(abs(x - lam) <= 1e-12 * max(1.0, abs(lam)) for x in d):
        return lam
    return None


def _accounts(state: RankState) -> tuple:
    return (state.compute_s, state.bubble_s, state.p2p_s, state.optimizer_s, tuple(sorted(state.exposed.items())))


def _acc_diff(a: tuple, b: tuple) -> tuple:
    ea, eb = dict(a[4]), dict(b[4])
    return (a[0] - b[0], a[1] - b[1], a[2] - b[2], a[3] - b[3], {k: v - eb.get(k, 0.0) for k, v in ea.items()})


def _advance(state: RankState, shift: float, per: tuple, k: int) -> None:
    state.compute_free += shift
    for s in _STREAMS:
        state.stream_free[s] = max(state.stream_free[s], state.compute_free - shift) + shift
    state.reduce_end = max(state.reduce_end, state.compute_free - shift) + shift
    state.compute_s += per[0] * k
    state.bubble_s += per[1] * k
    state.p2p_s += per[2] * k
    state.optimizer_s += per[3] * k
    for axis, v in per[4].items():
        state.exposed[axis] = state.exposed.get(axis, 0.0) + v * k


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePlan:
    """The pieces of one global stage's actions."""

    forward: tuple[Piece, ...]
    backward: tuple[Piece, ...]
    backward_input: tuple[Piece, ...]
    backward_weight: tuple[Piece, ...]
    optimizer: tuple[Piece, ...]
    forward_later: tuple[Piece, ...] | None = None
    """Forward of every micro-batch but the stage's first, when it differs (FSDP under a
    pipeline gathers parameters once per step: PyTorch's stage keeps them unsharded)."""
    backward_first: tuple[Piece, ...] | None = None
    """Backward (or W) of the stage's first micro-batch when it is not also its last: nothing
    kept yet to add into (autograd's first ``AccumulateGrad`` takes the gradient as it is), and
    under a pipeline with FSDP no reduction either."""
    backward_early: tuple[Piece, ...] | None = None
    """Backward (or W) of every micro-batch between the stage's first and last: the gradients
    added into the kept ones; under a pipeline with FSDP no reduction (no gradient sync before
    the last backward)."""
    backward_last: tuple[Piece, ...] | None = None
    """Backward (or W) of the stage's last micro-batch when it is not also its first: it adds
    its gradients as the earlier ones did, and reduces. ``backward`` is the one backward of a
    stage that has one micro-batch (no add); each of these variants falls back to it."""
    backward_weight_first: tuple[Piece, ...] | None = None
    backward_weight_early: tuple[Piece, ...] | None = None
    backward_weight_last: tuple[Piece, ...] | None = None

    def with_each_action(self, extra: tuple[Piece, ...]) -> StagePlan:
        """This plan with ``extra`` run at the end of every action (every piece list but the
        optimizer's; a variant that falls back to its plain list keeps falling back)."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name) + extra
                                            for f in dataclasses.fields(self)
                                            if f.name != "optimizer" and getattr(self, f.name) is not None})

    def pieces(self, kind: Kind, first: bool, last: bool) -> tuple[Piece, ...]:
        """The pieces of an action of ``kind``; ``first``/``last``: whether it is the stage's
        first/last action of that kind (by micro-batch order of the schedule)."""
        if kind is Kind.F:
            return self.forward if first or self.forward_later is None else self.forward_later
        if kind is Kind.I:
            return self.backward_input
        if kind is Kind.W:
            base, variants = self.backward_weight, (self.backward_weight_first, self.backward_weight_early,
                                                    self.backward_weight_last)
        else:
            base, variants = self.backward, (self.backward_first, self.backward_early, self.backward_last)
        if first and last:
            return base
        got = variants[0] if first else variants[2] if last else variants[1]
        return base if got is None else got


def without_gathers(pieces: tuple[Piece, ...]) -> tuple[Piece, ...]:
    """``pieces`` without their all-gathers (a stage the multi-stage runtime unsharded ahead:
    :func:`~topomesh.sim.schedules.unshard_points`); the compute that unshards stays."""
    return tuple(dataclasses.replace(p, work=dataclasses.replace(p.work, gather=())) if p.work.gather else p
                 for p in pieces)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineResult:
    step_time_s: float
    critical_rank: int
    ranks: tuple[RankState, ...]


def simulate_pipeline(
    plans: Sequence[StagePlan],
    actions: Sequence[Sequence[Action]],
    stage_rank: Sequence[int],
    p2p_s: float,
    *,
    record: bool = False,
    scale: Mapping[ActionKey, tuple[float, float]] | None = None,
    late_receives: bool = False,
    late_handoff_s: float = 0.0,
    unshards: Sequence[Mapping[int, Sequence[int]]] | None = None,
) -> EngineResult:
    """Run every pipeline rank's actions; ``plans[s]`` prices global stage ``s``,
    ``stage_rank[s]`` is the rank holding it, ``p2p_s`` one boundary send. ``scale`` stretches
    single actions: (factor on its compute, factor on its collectives) by action key.

    A transfer between ranks starts when both sides are in it (NCCL's and gloo's send/recv
    are rendezvous). With ``late_receives`` a rank posts its receive only when it reaches the
    action (PyTorch's single-stage schedules, GPipe and 1F1B, batch the receive with the
    action's wait), so a receiver later than the send still waits ``p2p_s`` for the data;
    without it the receive was posted ahead (the multi-stage schedules' runtime places each
    RECV where the sender's compute is lowered) and data sent early is there. With
    ``late_receives``, a receive posted after its data was sent also pays ``late_handoff_s``
    (:attr:`~topomesh.cost.cluster.Cluster.pipeline_handoff_s`: ranks sharing a host's cores).

    ``unshards`` (:func:`~topomesh.sim.schedules.unshard_points`, the multi-stage runtime's
    ``UNSHARD`` actions): rank ``r`` issues the all-gathers of each stage in ``unshards[r][i]``
    (those of every piece of the stage's first forward, all at once) when it reaches its action
    ``i``, before waiting for that action's input; the stage's next action waits for them
    (booked as their axis's exposed communication), and its first forward gathers nothing
    itself. Without it a stage gathers in its first forward, piece by piece."""
    ranks = [RankState(spans=[] if record else None) for _ in actions]
    stage_gathers: list[tuple[Comm, ...]] = []
    if unshards is not None:  # each stage's first forward without its gathers, and the gathers
        stage_gathers = [tuple(c for p in plan.forward for _ in range(p.count) for c in p.work.gather) for plan in plans]
        plans = [dataclasses.replace(plan, forward=without_gathers(plan.forward)) for plan in plans]
    gathering: dict[tuple[int, int], tuple[float, str]] = {}  # (rank, stage): its unshard's end, axis
    issued = [-1] * len(actions)
    scaled: dict[tuple[int, float, float], tuple[Piece, ...]] = {}

    def priced(pieces: tuple[Piece, ...], key: ActionKey) -> tuple[Piece, ...]:
        f = scale.get(key) if scale else None
        if f is None or f == (1.0, 1.0):
            return pieces
        hit = scaled.get((id(pieces), *f))
        if hit is None:
            hit = scaled[(id(pieces), *f)] = tuple(dataclasses.replace(p, work=p.work.scaled(*f)) for p in pieces)
        return hit

    firsts, lasts = first_and_last(actions)
    done: dict[tuple[int, str, int], float] = {}
    memo: dict = {}
    idx = [0] * len(actions)
    last = len(plans) - 1
    remaining = sum(len(a) for a in actions)
    while remaining:
        progress = False
        for r, acts in enumerate(actions):
            state = ranks[r]
            while idx[r] < len(acts):
                a = acts[idx[r]]
                if unshards is not None and issued[r] < idx[r]:  # the runtime reaches this action's UNSHARDs
                    issued[r] = idx[r]
                    for s in unshards[r].get(idx[r], ()):
                        gathering[(r, s)] = _issue(state, stage_gathers[s], state.compute_free, f"unshard {s}")
                dep = _dependency(a, last)
                if dep is not None and dep not in done:
                    break
                ready = state.compute_free
                if dep is not None:
                    cross = stage_rank[dep[0]] != r
                    arrive = done[dep]
                    hop = p2p_s
                    if cross:  # the transfer starts when both sides are in it
                        if late_receives and state.compute_free > arrive:  # sent before it was posted
                            hop += late_handoff_s
                        arrive = (max(arrive, state.compute_free) if late_receives else arrive) + hop
                    if arrive > state.compute_free:
                        wait = arrive - state.compute_free
                        p2p_part = min(wait, hop) if cross else 0.0
                        state.p2p_s += p2p_part
                        state.bubble_s += wait - p2p_part
                        state.span("compute", "bubble" if wait > p2p_part else "p2p wait", state.compute_free, arrive)
                        ready = arrive
                state.compute_free = ready
                g_end, g_axis = gathering.pop((r, a.stage), (0.0, ""))
                if g_end > ready:  # the stage's unshard is still gathering
                    state.book(g_axis, g_end - ready)
                    state.span("compute", f"wait for unshard {a.stage}", ready, g_end)
                    state.compute_free = ready = g_end
                first_mb = firsts.get((a.stage, a.kind)) == a.mb
                last_mb = lasts.get((a.stage, a.kind)) == a.mb
                key = (a.stage, a.kind.value, a.mb)
                compute, waited = state.compute_s, sum(state.exposed.values())
                run_action(state, priced(plans[a.stage].pieces(a.kind, first_mb, last_mb), key), memo)
                state.costs[key] = (state.compute_s - compute, sum(state.exposed.values()) - waited)
                state.busy.append((ready, state.compute_free, key))
                done[(a.stage, "B" if a.kind is Kind.I else a.kind.value, a.mb)] = state.compute_free
                if state.hold_end > state.compute_free:  # its sends posted, the rank waits for its reductions
                    state.book(state.hold_axis, state.hold_end - state.compute_free)
                    state.span("compute", f"wait for stage {a.stage}'s gradient reductions", state.compute_free,
                               state.hold_end)
                    state.compute_free = state.hold_end
                state.hold_end = 0.0
                idx[r] += 1
                remaining -= 1
                progress = True
        if not progress:
            stuck = {r: str(actions[r][idx[r]]) for r in range(len(actions)) if idx[r] < len(actions[r])}
            raise LayoutError(f"pipeline schedule deadlocks (next actions {stuck}); this is a bug in the schedule.")
    for r, state in enumerate(ranks):
        wait = state.reduce_end - state.compute_free
        if wait > 0:
            state.book(state.reduce_axis, wait)
            state.span("compute", "wait for gradient reductions", state.compute_free, state.reduce_end)
            state.compute_free = state.reduce_end
        before = state.compute_s
        for s, plan in enumerate(plans):
            if stage_rank[s] == r:
                start, compute, waited = state.compute_free, state.compute_s, sum(state.exposed.values())
                run_pieces(state, priced(plan.optimizer, (s, "opt", 0)))
                state.costs[(s, "opt", 0)] = (state.compute_s - compute, sum(state.exposed.values()) - waited)
                state.busy.append((start, state.compute_free, (s, "opt", 0)))
        state.optimizer_s += state.compute_s - before
        state.compute_s = before
    end = [s.compute_free for s in ranks]
    crit = max(range(len(ranks)), key=end.__getitem__)
    return EngineResult(step_time_s=end[crit], critical_rank=crit, ranks=tuple(ranks))


def first_and_last(actions: Sequence[Sequence[Action]]) -> tuple[dict[tuple[int, Kind], int], dict[tuple[int, Kind], int]]:
    """Per (stage, kind) the micro-batch of its first action and of its last, in the order the
    schedule runs them: the actions whose pieces differ (:meth:`StagePlan.pieces`)."""
    firsts: dict[tuple[int, Kind], int] = {}
    lasts: dict[tuple[int, Kind], int] = {}
    for acts in actions:
        for a in acts:
            firsts.setdefault((a.stage, a.kind), a.mb)
            lasts[(a.stage, a.kind)] = a.mb
    return firsts, lasts


def _dependency(a: Action, last: int) -> tuple[int, str, int] | None:
    if a.kind is Kind.F:
        return None if a.stage == 0 else (a.stage - 1, "F", a.mb)
    if a.kind is Kind.W:
        return (a.stage, "B", a.mb)
    return (a.stage, "F", a.mb) if a.stage == last else (a.stage + 1, "B", a.mb)
