"""The engine's step loop (:mod:`topomesh.sim.engine`) compiled with numba, for searches.

:func:`topomesh.sim.engine.simulate_pipeline` runs one action at a time in Python, about
8 µs per action even with its memo; a search simulates millions of actions (one pipeline of
16 ranks × 512 actions per layout group). This module runs the same algorithm — the same
streams, prefetch, blocking collectives, reductions, pipeline dependencies, bookings and the
same exact fast-forward of repeated blocks — over plain arrays in compiled code:

* :func:`encode_plans` turns the stage plans (pieces of priced :class:`~topomesh.sim.price.Work`)
  into flat arrays: works, their comms (stream, seconds, axis index), piece lists, and for each
  stage the piece list of each action variant (:data:`VARIANTS`);
* :func:`encode_actions` turns a schedule's actions into arrays once per (schedule, ``pp``,
  micro-batches, interleave): the variant of each action (first forward, last backward ...),
  the slot of the action it waits for and whether that one runs on another rank;
* :func:`run` runs them and returns the ranks' clocks and bookings as
  :class:`~topomesh.sim.engine.RankState` objects.

Results equal the Python engine's up to float rounding (the Python engine replays memoized
deltas, this one recomputes; tests/sim/test_kernel.py compares them at 1e-9). The Python engine
stays for timelines (``record=True``), which this one does not draw.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numba
import numpy as np

from topomesh.errors import LayoutError
from topomesh.sim.engine import (
    EngineResult,
    Piece,
    RankState,
    StagePlan,
    first_and_last,
    without_gathers,
)
from topomesh.sim.price import Stream
from topomesh.sim.schedules import Kind, Schedule, action_order, stage_count, unshard_points

VARIANTS = ("forward", "forward_later", "backward", "backward_first", "backward_early", "backward_last",
            "backward_input", "backward_weight", "backward_weight_first", "backward_weight_early",
            "backward_weight_last", "optimizer", "forward_unsharded")
"""Piece lists of a stage, by variant index; the ``*_later``/``*_first``/``*_early``/``*_last``
ones fall back to the plain ones (:meth:`StagePlan.pieces <topomesh.sim.engine.StagePlan.pieces>`);
``forward_unsharded`` is ``forward`` without its all-gathers (a stage the multi-stage runtime
unsharded ahead: :func:`~topomesh.sim.schedules.unshard_points`)."""
(_F_FIRST, _F_LATER, _B_ONLY, _B_FIRST, _B_EARLY, _B_LAST, _I, _W_ONLY, _W_FIRST, _W_EARLY, _W_LAST, _OPT,
 _F_UNSHARDED) = range(13)
_STREAM_INDEX = {Stream.INTRA: 0, Stream.NET: 1}
# rank state columns (_HE, _HA: RankState.hold_end and the index of its axis)
_CF, _SF0, _SF1, _RE, _CS, _OS, _BS, _PS, _HE, _HA = range(10)
_COLUMNS = 10


@numba.njit(cache=True)
def _issue(st, r, c_stream, c_sec, c_axis, lo, hi, at):  # noqa: ANN001, ANN202
    end = at
    axis = 0
    for c in range(lo, hi):
        col = _SF0 + c_stream[c]
        s = max(at, st[r, col])
        e = s + c_sec[c]
        st[r, col] = e
        if e >= end:
            end = e
            axis = c_axis[c]
    return end, axis


@numba.njit(cache=True)
def _run_piece(st, ex, ra, r, w, w_compute, w_comm, c_stream, c_sec, c_axis, g_end, g_axis):  # noqa: ANN001, ANN202
    t = st[r, _CF]
    start = max(t, g_end)
    d = start - t
    if d > 0:
        ex[r, g_axis] += d
    t = start + w_compute[w]
    st[r, _CS] += w_compute[w]
    for c in range(w_comm[w, 1], w_comm[w, 2]):  # blocking
        col = _SF0 + c_stream[c]
        s = max(t, st[r, col])
        e = s + c_sec[c]
        st[r, col] = e
        d = e - t
        if d > 0:
            ex[r, c_axis[c]] += d
        t = e
    st[r, _CF] = t
    if w_comm[w, 3] > w_comm[w, 2]:  # reductions
        r_end, r_axis = _issue(st, r, c_stream, c_sec, c_axis, w_comm[w, 2], w_comm[w, 3], t)
        if r_end >= st[r, _RE]:
            st[r, _RE] = r_end
            ra[r] = r_axis
        if w_comm[w, 4]:  # Work.wait_reduce
            st[r, _HE] = r_end
            st[r, _HA] = r_axis
    return start


@numba.njit(cache=True)
def _same_shift(a, b):  # noqa: ANN001, ANN202
    lam = a[0] - b[0]
    tol = 1e-12 * max(1.0, abs(lam))
    for i in range(a.shape[0]):
        if abs((a[i] - b[i]) - lam) > tol:
            return False, lam
    return True, lam


@numba.njit(cache=True)
def _run_pieces(st, ex, ra, r, lo, hi, p_work, p_count, w_compute, w_comm, c_stream, c_sec, c_axis):  # noqa: ANN001, ANN202
    if hi <= lo:
        return
    n_axes = ex.shape[1]
    w0 = p_work[lo]
    pend_t, pend_a = _issue(st, r, c_stream, c_sec, c_axis, w_comm[w0, 0], w_comm[w0, 1], st[r, _CF])
    vec = np.empty((3, 5))
    acc = np.empty((3, 4 + n_axes))
    for i in range(lo, hi):
        w = p_work[i]
        count = p_count[i]
        nxt = p_work[i + 1] if i + 1 < hi else -1
        done = 0
        nh = 0
        while done < count:
            next_w = w if done != count - 1 else nxt
            start = max(st[r, _CF], pend_t)
            if next_w >= 0 and w_comm[next_w, 1] > w_comm[next_w, 0]:
                npt, npa = _issue(st, r, c_stream, c_sec, c_axis, w_comm[next_w, 0], w_comm[next_w, 1], start)
            else:
                npt, npa = start, 0
            _run_piece(st, ex, ra, r, w, w_compute, w_comm, c_stream, c_sec, c_axis, pend_t, pend_a)
            pend_t, pend_a = npt, npa
            done += 1
            if count - done > 1:  # fast-forward identical copies (see engine.run_pieces)
                vec[0] = vec[1]
                vec[1] = vec[2]
                acc[0] = acc[1]
                acc[1] = acc[2]
                t = st[r, _CF]
                vec[2, 0] = t
                vec[2, 1] = max(st[r, _SF0], t)
                vec[2, 2] = max(st[r, _SF1], t)
                vec[2, 3] = max(st[r, _RE], t)
                vec[2, 4] = pend_t
                acc[2, 0] = st[r, _CS]
                acc[2, 1] = st[r, _BS]
                acc[2, 2] = st[r, _PS]
                acc[2, 3] = st[r, _OS]
                acc[2, 4:] = ex[r]
                nh += 1
                if nh >= 3:
                    ok1, d1 = _same_shift(vec[2], vec[1])
                    ok2, d2 = _same_shift(vec[1], vec[0])
                    if ok1 and ok2 and abs(d1 - d2) <= 1e-12 * max(1.0, abs(d1)):
                        k = count - done - 1
                        shift = d1 * k
                        st[r, _CF] += shift
                        base = st[r, _CF] - shift
                        st[r, _SF0] = max(st[r, _SF0], base) + shift
                        st[r, _SF1] = max(st[r, _SF1], base) + shift
                        st[r, _RE] = max(st[r, _RE], base) + shift
                        st[r, _CS] += (acc[2, 0] - acc[1, 0]) * k
                        st[r, _BS] += (acc[2, 1] - acc[1, 1]) * k
                        st[r, _PS] += (acc[2, 2] - acc[1, 2]) * k
                        st[r, _OS] += (acc[2, 3] - acc[1, 3]) * k
                        for a in range(n_axes):
                            ex[r, a] += (acc[2, 4 + a] - acc[1, 4 + a]) * k
                        pend_t = pend_t + shift
                        done += k


@numba.njit(cache=True)
def _run_action(st, ex, ra, r, lst, memo_ok, memo_rel, memo_d, memo_ex, memo_axis, list_off, p_work, p_count,
                w_compute, w_comm, c_stream, c_sec, c_axis):  # noqa: ANN001, ANN202
    """:func:`_run_pieces` of piece list ``lst``, replayed when the list last ran from the same
    state relative to the compute clock (the Python engine's ``run_action`` memo, one entry per list)."""
    t = st[r, _CF]
    rel0 = max(st[r, _SF0], t) - t
    rel1 = max(st[r, _SF1], t) - t
    rel2 = max(st[r, _RE], t) - t
    if memo_ok[lst] and memo_rel[lst, 0] == rel0 and memo_rel[lst, 1] == rel1 and memo_rel[lst, 2] == rel2:
        st[r, _CF] = t + memo_d[lst, 0]
        st[r, _SF0] = t + memo_d[lst, 1]
        st[r, _SF1] = t + memo_d[lst, 2]
        if memo_axis[lst] >= 0:
            st[r, _RE] = t + memo_d[lst, 3]
            ra[r] = memo_axis[lst]
        st[r, _CS] += memo_d[lst, 4]
        for a in range(ex.shape[1]):
            ex[r, a] += memo_ex[lst, a]
        return
    compute = st[r, _CS]
    exposed = ex[r].copy()
    reduce_end = st[r, _RE]
    _run_pieces(st, ex, ra, r, list_off[lst], list_off[lst + 1], p_work, p_count, w_compute, w_comm, c_stream,
                c_sec, c_axis)
    for i in range(list_off[lst], list_off[lst + 1]):
        if w_comm[p_work[i], 4]:  # sets a hold, the action's own: never replayed
            return
    cf = st[r, _CF]
    memo_d[lst, 0] = cf - t
    memo_d[lst, 1] = max(st[r, _SF0], cf) - t
    memo_d[lst, 2] = max(st[r, _SF1], cf) - t
    memo_d[lst, 3] = max(st[r, _RE], cf) - t
    memo_axis[lst] = ra[r] if st[r, _RE] > reduce_end else -1
    memo_d[lst, 4] = st[r, _CS] - compute
    for a in range(ex.shape[1]):
        memo_ex[lst, a] = ex[r, a] - exposed[a]
    memo_rel[lst, 0] = rel0
    memo_rel[lst, 1] = rel1
    memo_rel[lst, 2] = rel2
    memo_ok[lst] = True


@numba.njit(cache=True)
def _unshard(st, r, s, plan_lists, list_off, p_work, p_count, w_comm, c_stream, c_sec, c_axis):  # noqa: ANN001, ANN202
    """Issue every all-gather of stage ``s``'s first forward at once; (end of the last, its axis)."""
    at = st[r, _CF]
    end = at
    axis = 0
    lst = plan_lists[s, _F_FIRST]
    for i in range(list_off[lst], list_off[lst + 1]):
        w = p_work[i]
        for _ in range(p_count[i]):
            e, a = _issue(st, r, c_stream, c_sec, c_axis, w_comm[w, 0], w_comm[w, 1], at)
            if w_comm[w, 1] > w_comm[w, 0] and e >= end:
                end = e
                axis = a
    return end, axis


@numba.njit(cache=True)
def _simulate(n_ranks, n_axes, p2p_s, late, act_off, act_stage, act_variant, act_dep, act_cross, act_slot, n_slots,
              un_off, un_stage, plan_lists, list_off, stage_rank, p_work, p_count, w_compute, w_comm, c_stream, c_sec,
              c_axis):  # noqa: ANN001, ANN202
    st = np.zeros((n_ranks, _COLUMNS))
    n_stages = plan_lists.shape[0]
    g_end = np.zeros((n_ranks, n_stages))  # a stage's unshard: when its gathers end (0: none pending)
    g_axis = np.zeros((n_ranks, n_stages), dtype=np.int64)
    issued = np.zeros(act_off[-1], dtype=np.bool_)
    ex = np.zeros((n_ranks, n_axes))
    ra = np.zeros(n_ranks, dtype=np.int64)
    done_t = np.zeros(n_slots)
    is_done = np.zeros(n_slots, dtype=np.bool_)
    idx = act_off[:-1].copy()
    remaining = act_off[-1]
    n_lists = list_off.shape[0] - 1
    memo_ok = np.zeros(n_lists, dtype=np.bool_)
    memo_rel = np.zeros((n_lists, 3))
    memo_d = np.zeros((n_lists, 5))
    memo_ex = np.zeros((n_lists, n_axes))
    memo_axis = np.zeros(n_lists, dtype=np.int64)
    while remaining > 0:
        progress = False
        for r in range(n_ranks):
            while idx[r] < act_off[r + 1]:
                a = idx[r]
                if not issued[a]:  # the runtime reaches this action's UNSHARDs
                    issued[a] = True
                    for u in range(un_off[a], un_off[a + 1]):
                        e, ax = _unshard(st, r, un_stage[u], plan_lists, list_off, p_work, p_count, w_comm,
                                         c_stream, c_sec, c_axis)
                        g_end[r, un_stage[u]] = e
                        g_axis[r, un_stage[u]] = ax
                dep = act_dep[a]
                if dep >= 0 and not is_done[dep]:
                    break
                ready = st[r, _CF]
                if dep >= 0:
                    cross = act_cross[a]
                    arrive = (max(done_t[dep], st[r, _CF]) if late else done_t[dep]) + p2p_s if cross else done_t[dep]
                    if arrive > st[r, _CF]:
                        wait = arrive - st[r, _CF]
                        part = min(wait, p2p_s) if cross else 0.0
                        st[r, _PS] += part
                        st[r, _BS] += wait - part
                        ready = arrive
                ge = g_end[r, act_stage[a]]
                if ge > 0.0:
                    g_end[r, act_stage[a]] = 0.0
                    if ge > ready:  # the stage's unshard is still gathering
                        ex[r, g_axis[r, act_stage[a]]] += ge - ready
                        ready = ge
                st[r, _CF] = ready
                _run_action(st, ex, ra, r, plan_lists[act_stage[a], act_variant[a]], memo_ok, memo_rel, memo_d,
                            memo_ex, memo_axis, list_off, p_work, p_count, w_compute, w_comm, c_stream, c_sec,
                            c_axis)
                done_t[act_slot[a]] = st[r, _CF]
                is_done[act_slot[a]] = True
                if st[r, _HE] > st[r, _CF]:  # its sends posted, the rank waits for its reductions
                    ex[r, int(st[r, _HA])] += st[r, _HE] - st[r, _CF]
                    st[r, _CF] = st[r, _HE]
                st[r, _HE] = 0.0
                idx[r] += 1
                remaining -= 1
                progress = True
        if not progress:
            return st, ex, ra, False
    for r in range(n_ranks):
        wait = st[r, _RE] - st[r, _CF]
        if wait > 0:
            ex[r, ra[r]] += wait
            st[r, _CF] = st[r, _RE]
        before = st[r, _CS]
        for s in range(stage_rank.shape[0]):
            if stage_rank[s] == r:
                lst = plan_lists[s, _OPT]
                _run_pieces(st, ex, ra, r, list_off[lst], list_off[lst + 1], p_work, p_count, w_compute, w_comm,
                            c_stream, c_sec, c_axis)
        st[r, _OS] += st[r, _CS] - before
        st[r, _CS] = before
    return st, ex, ra, True


class Encoded:
    """Stage plans as arrays (see :func:`encode_plans`)."""

    __slots__ = ("axes", "c_axis", "c_sec", "c_stream", "list_off", "p_count", "p_work", "plan_lists", "w_comm",
                 "w_compute")


def encode_plans(plans: Sequence[StagePlan]) -> Encoded:
    """The pieces of every stage's action variants as flat arrays; axis index 0 is ``""``."""
    axes: dict[str, int] = {"": 0}
    works: dict[int, int] = {}
    w_compute: list[float] = []
    w_comm: list[tuple[int, int, int, int]] = []
    c_stream: list[int] = []
    c_sec: list[float] = []
    c_axis: list[int] = []
    lists: dict[int, int] = {}
    list_off = [0]
    p_work: list[int] = []
    p_count: list[int] = []
    plan_lists = np.empty((len(plans), len(VARIANTS)), dtype=np.int64)

    def work_index(w) -> int:  # noqa: ANN001
        i = works.get(id(w))
        if i is None:
            start = len(c_sec)
            bounds = [start]
            for comms in (w.gather, w.blocking, w.reduce):
                for c in comms:
                    c_stream.append(_STREAM_INDEX[c.stream])
                    c_sec.append(c.seconds)
                    c_axis.append(axes.setdefault(c.axis, len(axes)))
                bounds.append(len(c_sec))
            i = works[id(w)] = len(w_compute)
            w_compute.append(w.compute_s)
            w_comm.append((bounds[0], bounds[1], bounds[2], bounds[3], int(w.wait_reduce)))
        return i

    def list_index(pieces: tuple[Piece, ...]) -> int:
        i = lists.get(id(pieces))
        if i is None:
            for pc in pieces:
                if pc.count > 0:
                    p_work.append(work_index(pc.work))
                    p_count.append(pc.count)
            list_off.append(len(p_work))
            i = lists[id(pieces)] = len(list_off) - 2
        return i

    keep = []  # the gather-less forwards made here, alive while their ids key `lists`
    for s, plan in enumerate(plans):
        for v, name in enumerate(VARIANTS):
            if name == "forward_unsharded":
                pieces = without_gathers(plan.forward)
                keep.append(pieces)
                plan_lists[s, v] = list_index(pieces)
                continue
            pieces = getattr(plan, name)
            if pieces is None:
                for suffix in ("_later", "_first", "_early", "_last"):
                    name = name.removesuffix(suffix)
                pieces = getattr(plan, name)
            plan_lists[s, v] = list_index(pieces)
    enc = Encoded()
    enc.axes = tuple(axes)
    enc.w_compute = np.array(w_compute, dtype=np.float64)
    enc.w_comm = np.array(w_comm, dtype=np.int64).reshape(len(w_comm), 5)
    enc.c_stream = np.array(c_stream, dtype=np.int64)
    enc.c_sec = np.array(c_sec, dtype=np.float64)
    enc.c_axis = np.array(c_axis, dtype=np.int64)
    enc.list_off = np.array(list_off, dtype=np.int64)
    enc.p_work = np.array(p_work, dtype=np.int64)
    enc.p_count = np.array(p_count, dtype=np.int64)
    enc.plan_lists = plan_lists
    return enc


@functools.lru_cache(maxsize=512)
def encode_actions(schedule: Schedule, pp: int, microbatches: int, interleave: int) -> tuple[np.ndarray, ...]:
    """The actions of :func:`~topomesh.sim.schedules.action_order` as arrays (read-only):
    rank offsets, stage, variant, the slot each waits for (-1: none), whether that slot is
    another rank's, the slot it fills, the number of slots, and the stages unsharded before
    each action (:func:`~topomesh.sim.schedules.unshard_points`: offsets per action, stages)."""
    actions = action_order(schedule, pp=pp, microbatches=microbatches, interleave=interleave)
    unshards = unshard_points(schedule, pp=pp, microbatches=microbatches, interleave=interleave)
    n_stages = stage_count(schedule, pp, interleave) if pp > 1 else 1
    last = n_stages - 1
    firsts, lasts = first_and_last(actions)
    slots: dict[tuple[int, str, int], int] = {}

    def slot(key: tuple[int, str, int]) -> int:
        return slots.setdefault(key, len(slots))

    owner = {}
    for r, acts in enumerate(actions):
        for a in acts:
            owner[(a.stage, "B" if a.kind is Kind.I else a.kind.value, a.mb)] = r
    off, stage, variant, dep, cross, done = [0], [], [], [], [], []
    un_off, un_stage = [0], []
    for r, acts in enumerate(actions):
        for i, a in enumerate(acts):
            un_stage.extend(unshards[r].get(i, ()) if unshards is not None else ())
            un_off.append(len(un_stage))
            first = firsts.get((a.stage, a.kind)) == a.mb
            at_end = lasts.get((a.stage, a.kind)) == a.mb
            position = 0 if first and at_end else 1 if first else 3 if at_end else 2  # only/first/early/last
            if a.kind is Kind.F:
                d = None if a.stage == 0 else (a.stage - 1, "F", a.mb)
                v = (_F_FIRST if unshards is None else _F_UNSHARDED) if first else _F_LATER
            elif a.kind is Kind.W:
                d = (a.stage, "B", a.mb)
                v = _W_ONLY + position
            else:
                d = (a.stage, "F", a.mb) if a.stage == last else (a.stage + 1, "B", a.mb)
                v = _I if a.kind is Kind.I else _B_ONLY + position
            stage.append(a.stage)
            variant.append(v)
            dep.append(-1 if d is None else slot(d))
            cross.append(d is not None and owner.get(d, r) != r)
            done.append(slot((a.stage, "B" if a.kind is Kind.I else a.kind.value, a.mb)))
        off.append(len(stage))
    out = (np.array(off, dtype=np.int64), np.array(stage, dtype=np.int64), np.array(variant, dtype=np.int64),
           np.array(dep, dtype=np.int64), np.array(cross, dtype=np.bool_), np.array(done, dtype=np.int64),
           np.array([len(slots)], dtype=np.int64), np.array(un_off, dtype=np.int64),
           np.array(un_stage, dtype=np.int64))
    for a in out:
        a.flags.writeable = False
    return out


class Template:
    """Stage plans encoded once per (trace, stage split) with their collectives as slots.

    Built from plans priced by :class:`~topomesh.sim.price.SymbolicPricer`, whose comms name
    a record of the trace (``"#i"``) and take 1 s: a comm's seconds in the plans are then the
    factor the record's price is scaled by (1, or a stage's share of the optimizer outside
    the blocks), so the plans of any placement are ``price[record] × factor`` without pricing
    or encoding the plans again (:func:`run_template`)."""

    __slots__ = ("axes", "c_axis", "c_factor", "c_rec", "enc", "extra", "records")


def template(plans: Sequence[StagePlan], records: Sequence[object], extra: object = None) -> Template:
    """The template of symbolically priced ``plans``; ``records[i]`` is the record ``"#i"``
    names; ``extra`` is kept with it (the symbolic priced class, for bytes)."""
    enc = encode_plans(plans)
    c_rec = np.array([int(enc.axes[a][1:]) for a in enc.c_axis.tolist()], dtype=np.int64)
    names = ["", *dict.fromkeys(getattr(r, "mesh_axis", None) or "?" for r in records)]
    index = {n: i for i, n in enumerate(names)}
    rec_axis = np.array([index[getattr(r, "mesh_axis", None) or "?"] for r in records] or [0], dtype=np.int64)
    tpl = Template()
    tpl.enc, tpl.records, tpl.extra = enc, tuple(records), extra
    tpl.axes = tuple(names)
    tpl.c_rec = c_rec
    tpl.c_factor = enc.c_sec.copy()
    tpl.c_axis = rec_axis[c_rec] if len(c_rec) else c_rec
    return tpl


def run_template(tpl: Template, rec_seconds: np.ndarray, rec_stream: np.ndarray, schedule: Schedule, pp: int,
                 microbatches: int, interleave: int, stage_rank: Sequence[int], p2p_s: float) -> EngineResult:
    """:func:`run` of the template's plans with record ``i`` priced ``rec_seconds[i]`` on stream
    ``rec_stream[i]`` (0 intra, 1 net)."""
    enc = tpl.enc
    c_sec = rec_seconds[tpl.c_rec] * tpl.c_factor if len(tpl.c_rec) else tpl.c_factor
    c_stream = rec_stream[tpl.c_rec] if len(tpl.c_rec) else enc.c_stream
    return _run_encoded(enc.plan_lists, enc.list_off, enc.p_work, enc.p_count, enc.w_compute, enc.w_comm, c_stream,
                        c_sec, tpl.c_axis, tpl.axes, schedule, pp, microbatches, interleave, stage_rank, p2p_s)


def run(plans: Sequence[StagePlan], schedule: Schedule, pp: int, microbatches: int, interleave: int,
        stage_rank: Sequence[int], p2p_s: float) -> EngineResult:
    """What :func:`topomesh.sim.engine.simulate_pipeline` returns for the actions of
    ``action_order(schedule, pp=pp, microbatches=microbatches, interleave=interleave)``
    (without spans), compiled."""
    enc = encode_plans(plans)
    return _run_encoded(enc.plan_lists, enc.list_off, enc.p_work, enc.p_count, enc.w_compute, enc.w_comm,
                        enc.c_stream, enc.c_sec, enc.c_axis, enc.axes, schedule, pp, microbatches, interleave,
                        stage_rank, p2p_s)


def _run_encoded(plan_lists: np.ndarray, list_off: np.ndarray, p_work: np.ndarray, p_count: np.ndarray,
                 w_compute: np.ndarray, w_comm: np.ndarray, c_stream: np.ndarray, c_sec: np.ndarray,
                 c_axis: np.ndarray, axes: tuple[str, ...], schedule: Schedule, pp: int, microbatches: int,
                 interleave: int, stage_rank: Sequence[int], p2p_s: float) -> EngineResult:
    off, stage, variant, dep, cross, done, n_slots, un_off, un_stage = encode_actions(schedule, pp, microbatches,
                                                                                     interleave)
    n_ranks = len(off) - 1
    ranks = np.asarray(stage_rank, dtype=np.int64)
    st, ex, ra, ok = _simulate(n_ranks, len(axes), float(p2p_s), schedule.receives_at_action, off, stage, variant, dep, cross, done,
                               int(n_slots[0]), un_off, un_stage, plan_lists, list_off, ranks, p_work, p_count,
                               w_compute, w_comm, c_stream, c_sec, c_axis)
    if not ok:
        raise LayoutError("pipeline schedule deadlocks; this is a bug in the schedule.")
    states = []
    for r in range(n_ranks):
        row = st[r].tolist()
        states.append(RankState(
            compute_free=row[_CF], stream_free={Stream.INTRA: row[_SF0], Stream.NET: row[_SF1]},
            reduce_end=row[_RE], reduce_axis=axes[int(ra[r])], compute_s=row[_CS], optimizer_s=row[_OS],
            bubble_s=row[_BS], p2p_s=row[_PS],
            exposed={axes[a]: v for a, v in enumerate(ex[r].tolist()) if v > 0}))
    end = [s.compute_free for s in states]
    crit = max(range(len(states)), key=end.__getitem__)
    return EngineResult(step_time_s=end[crit], critical_rank=crit, ranks=tuple(states))
