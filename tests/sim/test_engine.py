"""The event engine on hand-built pieces with answers worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from topomesh.sim.engine import Piece, RankState, StagePlan, run_pieces, simulate_pipeline
from topomesh.sim.price import Comm, Stream, Work
from topomesh.sim.schedules import action_order


def piece(work: Work, count: int = 1, label: str = "p") -> Piece:
    return Piece(work=work, count=count, label=label)


def test_two_ops_and_an_overlapped_gather():
    # A computes 3 s; B needs a 4 s all-gather, prefetched when A starts (t=0), so it ends
    # at 4 and B (2 s) starts at 4, not at 3: 1 s of the gather is exposed. Total 6 s.
    a = Work(compute_s=3.0)
    b = Work(compute_s=2.0, gather=(Comm("dp_shard", Stream.NET, 4.0),))
    st = RankState()
    run_pieces(st, [piece(a), piece(b)])
    assert st.compute_free == pytest.approx(6.0)
    assert st.exposed == {"dp_shard": pytest.approx(1.0)}
    assert st.compute_s == pytest.approx(5.0)


def test_a_blocking_collective_is_never_hidden():
    # 3 s of compute then a 2 s tensor-parallel all-reduce the next op needs: 5 s, all 2 s exposed.
    w = Work(compute_s=3.0, blocking=(Comm("tp", Stream.INTRA, 2.0),))
    st = RankState()
    run_pieces(st, [piece(w)])
    assert st.compute_free == pytest.approx(5.0)
    assert st.exposed == {"tp": pytest.approx(2.0)}


def test_reductions_overlap_later_pieces_and_the_optimizer_waits():
    # backward pieces of 1 s each issue a 1.5 s reduce-scatter on the network stream:
    # reduce i starts at max(end of piece i, end of reduce i-1): 1, 2.5, 4 -> last ends at 5.5.
    w = Work(compute_s=1.0, reduce=(Comm("dp_shard", Stream.NET, 1.5),))
    plan = StagePlan(forward=(), backward=(piece(w, 3),), backward_input=(), backward_weight=(),
                     optimizer=(piece(Work(compute_s=0.5)),))
    run = simulate_pipeline([plan], action_order("1f1b", pp=1, microbatches=1), [0], 0.0)
    st = run.ranks[0]
    # compute 3 s, wait 2.5 s for the reductions, optimizer 0.5 s
    assert run.step_time_s == pytest.approx(6.0)
    assert st.exposed == {"dp_shard": pytest.approx(2.5)}
    assert st.optimizer_s == pytest.approx(0.5)


def test_streams_of_different_link_classes_run_at_once():
    # two 4 s gathers for the second piece: on one stream they queue (8 s), on two they overlap (4 s)
    same = Work(compute_s=1.0, gather=(Comm("a", Stream.NET, 4.0), Comm("b", Stream.NET, 4.0)))
    split = Work(compute_s=1.0, gather=(Comm("a", Stream.NET, 4.0), Comm("b", Stream.INTRA, 4.0)))
    for w, end in ((same, 9.0), (split, 5.0)):
        st = RankState()
        run_pieces(st, [piece(Work(compute_s=1.0)), piece(w)])
        assert st.compute_free == pytest.approx(end)


@pytest.mark.parametrize("gather_s", [0.5, 1.0, 2.5, 7.0])
@pytest.mark.parametrize("count", [1, 2, 5, 80])
def test_repeated_blocks_fast_forward_exactly(gather_s, count):
    """The fast-forward of identical blocks gives the same times as running every copy
    (recording spans turns the fast-forward off)."""
    blk = Work(compute_s=1.0, gather=(Comm("dp_shard", Stream.NET, gather_s),),
               blocking=(Comm("tp", Stream.INTRA, 0.25),), reduce=(Comm("dp_shard", Stream.NET, 0.75),))
    pieces = [piece(Work(compute_s=0.3)), piece(blk, count), piece(Work(compute_s=0.2))]
    fast, slow = RankState(), RankState(spans=[])
    run_pieces(fast, pieces)
    run_pieces(slow, pieces)
    assert fast.compute_free == pytest.approx(slow.compute_free, rel=1e-12)
    assert fast.reduce_end == pytest.approx(slow.reduce_end, rel=1e-12)
    assert fast.exposed.keys() == slow.exposed.keys()
    for k in fast.exposed:
        assert fast.exposed[k] == pytest.approx(slow.exposed[k], rel=1e-9)


@pytest.mark.parametrize("backlog_s", [0.0, 3.7, 12.0])
def test_fast_forward_waits_out_a_transient(backlog_s):
    """A backlog on the network stream (a long reduction issued just before) makes the first
    blocks wait for their gathers unevenly; the fast-forward must not extrapolate until the
    state advances uniformly."""
    head = Work(compute_s=0.1, reduce=(Comm("dp_shard", Stream.NET, backlog_s),))
    blk = Work(compute_s=1.0, gather=(Comm("dp_shard", Stream.NET, 0.4),), reduce=(Comm("dp_shard", Stream.NET, 0.3),))
    pieces = [piece(head), piece(blk, 40)]
    fast, slow = RankState(), RankState(spans=[])
    run_pieces(fast, pieces)
    run_pieces(slow, pieces)
    assert fast.compute_free == pytest.approx(slow.compute_free, rel=1e-12)
    assert fast.exposed.get("dp_shard", 0.0) == pytest.approx(slow.exposed.get("dp_shard", 0.0), rel=1e-9)


def test_no_fast_forward_while_a_stream_falls_behind():
    # reductions (1.5 s) outpace the blocks (1 s): the compute clock advances evenly but the
    # network stream falls further behind every block, so copies must not be extrapolated
    blk = Work(compute_s=1.0, reduce=(Comm("dp_shard", Stream.NET, 1.5),))
    fast, slow = RankState(), RankState(spans=[])
    run_pieces(fast, [piece(blk, 30)])
    run_pieces(slow, [piece(blk, 30)])
    assert slow.reduce_end == pytest.approx(30 * 1.5 + 1.0)  # first starts at 1, then back to back
    assert fast.reduce_end == pytest.approx(slow.reduce_end, rel=1e-12)


def test_one_f_one_b_bubble_matches_the_analytic_value():
    # uniform stages, F = 1 s, B = 2 s, no communication: 1F1B takes (m + p - 1)(F + B) and
    # the bubble is (p - 1)/(m + p - 1) of the step (Narayanan et al. 2021, §2.2).
    p, m = 4, 8
    plan = StagePlan(forward=(piece(Work(compute_s=1.0)),), backward=(piece(Work(compute_s=2.0)),),
                     backward_input=(), backward_weight=(), optimizer=())
    run = simulate_pipeline([plan] * p, action_order("1f1b", pp=p, microbatches=m), list(range(p)), 0.0)
    assert run.step_time_s == pytest.approx((m + p - 1) * 3.0)
    crit = run.ranks[run.critical_rank]
    assert crit.bubble_s / run.step_time_s == pytest.approx((p - 1) / (m + p - 1))
    for st in run.ranks:  # every rank computes m (F + B); the rest of the step it idles
        assert st.compute_s == pytest.approx(m * 3.0)


def test_gpipe_bubble_and_p2p_wait():
    # GPipe with a 0.5 s send between stages: the last stage's first forward waits 3 sends;
    # each send is booked as p2p wait on the receiver, the rest of its wait as bubble.
    p, m, send = 3, 4, 0.5
    plan = StagePlan(forward=(piece(Work(compute_s=1.0)),), backward=(piece(Work(compute_s=1.0)),),
                     backward_input=(), backward_weight=(), optimizer=())
    run = simulate_pipeline([plan] * p, action_order("gpipe", pp=p, microbatches=m), list(range(p)), send)
    # critical path: forwards of stage 0 (m), sends and forwards down (p-1)(1+send), then all
    # backwards on the last stage (m) and back up (p-1)(1+send): 2m + 2(p-1)(1+send) = 8 + 6 = 14
    assert run.step_time_s == pytest.approx(2 * m + 2 * (p - 1) * (1 + send))
    last = run.ranks[-1]
    assert last.p2p_s == pytest.approx(send)  # waits once for the first activation, later ones arrive in time
    for st in run.ranks:
        assert st.compute_s + st.bubble_s + st.p2p_s + sum(st.exposed.values()) == pytest.approx(st.compute_free)


def test_a_late_receive_still_waits_for_the_transfer():
    """Two stages, 1F1B, 3 micro-batches, F = 1 s, B = 1 s on stage 0 and 3 s on the last,
    0.25 s sends. Posted ahead, the last stage finds F1 and F2 there when it gets to them (sent
    at 2 and 7.5 s, needed at 5.25 and 9.25 s): F0 at 1.25 s, then no gap, done at 13.25 s;
    stage 0's last backward ends at 14.5 s. Posted late (PyTorch's 1F1B batches the receive
    with the action's wait, and gloo and NCCL move nothing until both sides are in), each of
    those two forwards waits 0.25 s after the backward before it: the last stage ends at
    13.75 s, stage 0 at 15.0 s."""
    def plan(bwd: float) -> StagePlan:
        return StagePlan(forward=(piece(Work(compute_s=1.0)),), backward=(piece(Work(compute_s=bwd)),),
                         backward_input=(), backward_weight=(), optimizer=())

    actions = action_order("1f1b", pp=2, microbatches=3)
    ahead = simulate_pipeline([plan(1.0), plan(3.0)], actions, [0, 1], 0.25)
    late = simulate_pipeline([plan(1.0), plan(3.0)], actions, [0, 1], 0.25, late_receives=True)
    assert (ahead.ranks[1].compute_free, ahead.step_time_s) == pytest.approx((13.25, 14.5))
    assert (late.ranks[1].compute_free, late.step_time_s) == pytest.approx((13.75, 15.0))
    assert late.ranks[1].p2p_s == pytest.approx(3 * 0.25)  # the first forward's and the two late ones
    assert ahead.ranks[1].p2p_s == pytest.approx(0.25)
    from topomesh.sim import kernel
    from topomesh.sim.schedules import Schedule

    compiled = kernel.run([plan(1.0), plan(3.0)], Schedule.ONE_F_ONE_B, 2, 3, 1, [0, 1], 0.25)
    assert compiled.step_time_s == pytest.approx(15.0)  # PyTorch's 1F1B: receives posted late


def test_a_receive_posted_after_its_data_pays_the_hand_off():
    """The pipeline of the test above with a 0.5 s hand-off (ranks sharing a host's cores:
    :attr:`Cluster.pipeline_handoff_s`). The last stage posts F1's receive at 5.25 s and F2's at
    10.0 s, after stage 0 sent them (2 and 7.5 s): each waits 0.25 + 0.5 s, so F1 runs 6.0-7.0,
    B1 to 10.0, F2 10.75-11.75, B2 to 14.75. F0's receive and stage 0's gradient receives are
    posted before their data is sent and pay the send alone: stage 0's last backward starts at
    14.75 + 0.25 and the step ends at 16.0 s. Receives posted ahead (multi-stage schedules) pay
    no hand-off."""
    def plan(bwd: float) -> StagePlan:
        return StagePlan(forward=(piece(Work(compute_s=1.0)),), backward=(piece(Work(compute_s=bwd)),),
                         backward_input=(), backward_weight=(), optimizer=())

    actions = action_order("1f1b", pp=2, microbatches=3)
    plans = [plan(1.0), plan(3.0)]
    late = simulate_pipeline(plans, actions, [0, 1], 0.25, late_receives=True, late_handoff_s=0.5)
    assert (late.ranks[1].compute_free, late.step_time_s) == pytest.approx((14.75, 16.0))
    assert late.ranks[1].p2p_s == pytest.approx(0.25 + 2 * 0.75)  # booked as the hand-off's wait
    assert late.ranks[0].p2p_s == pytest.approx(3 * 0.25)  # its gradients: sent while it waited
    ahead = simulate_pipeline(plans, actions, [0, 1], 0.25, late_handoff_s=0.5)
    assert ahead.step_time_s == pytest.approx(14.5)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zbv"])
def test_memoized_actions_equal_running_every_action(schedule):
    """Repeated pipeline actions are replayed from a memo keyed by the state relative to the
    compute clock; recording spans turns the memo off. Both must give the same step."""
    blk = Work(compute_s=1.0, gather=(Comm("dp_shard", Stream.NET, 0.7),),
               blocking=(Comm("tp", Stream.INTRA, 0.2),), reduce=(Comm("dp_shard", Stream.NET, 0.9),),
               weight_grad_s=0.4)
    fwd = (piece(blk, 3),)
    bwd = (piece(dataclasses.replace(blk, compute_s=2.0), 3),)
    plan = StagePlan(forward=fwd, backward=bwd,
                     backward_input=(piece(dataclasses.replace(blk, compute_s=1.6, reduce=()), 3),),
                     backward_weight=(piece(Work(compute_s=0.4, reduce=blk.reduce), 3),),
                     optimizer=(piece(Work(compute_s=0.5)),),
                     forward_later=(piece(dataclasses.replace(blk, gather=()), 3),))
    p, v, m = 4, 2, 8
    order = action_order(schedule, pp=p, microbatches=m, interleave=v)
    stages = max(a.stage for acts in order for a in acts) + 1
    owner = {a.stage: r for r, acts in enumerate(order) for a in acts}
    runs = [simulate_pipeline([plan] * stages, order, [owner[s] for s in range(stages)], 0.3, record=rec)
            for rec in (False, True)]
    assert runs[0].step_time_s == pytest.approx(runs[1].step_time_s, rel=1e-12)
    for a, b in zip(runs[0].ranks, runs[1].ranks, strict=True):
        assert (a.compute_s, a.bubble_s, a.p2p_s) == pytest.approx((b.compute_s, b.bubble_s, b.p2p_s), rel=1e-9)
        assert a.exposed == pytest.approx(b.exposed, rel=1e-9)


def test_a_multi_stage_runtime_unshards_every_stage_ahead_of_its_input():
    # interleaved 1F1B, pp=2, two stages a rank, 2 micro-batches; F = B = 1 s, each stage's
    # forward gathers 3 s on the network, p2p free. Rank 0 runs 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1,
    # rank 1 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1. PyTorch's runtime unshards both stages of a rank
    # before its first action: gathers 0-3 s and 3-6 s on each rank. Rank 0: 0F0 3-4 (3 s
    # exposed), 0F1 4-5, 2F0 waits for its gather to 6 (1 s exposed): 6-7, 2F1 7-8. Rank 1:
    # 1F0 4-5, 1F1 5-6, 3F0 7-8, 3B0 8-9, 3F1 9-10, 3B1 10-11, 1B0 11-12, 1B1 12-13. Rank 0:
    # 2B0 9-10, 2B1 11-12, 0B0 12-13, 0B1 13-14: a 14 s step, 4 s of it gathering, 2 s idle.
    # (Gathered in each stage's first forward, once its input is there, 1F0 would start at 7
    # and 2F0 at 11.)
    from topomesh.sim.schedules import unshard_points

    plan = StagePlan(forward=(piece(Work(compute_s=1.0, gather=(Comm("dp_shard", Stream.NET, 3.0),))),),
                     forward_later=(piece(Work(compute_s=1.0)),), backward=(piece(Work(compute_s=1.0)),),
                     backward_input=(), backward_weight=(), optimizer=())
    acts = action_order("interleaved-1f1b", pp=2, microbatches=2, interleave=2)
    run = simulate_pipeline([plan] * 4, acts, [0, 1, 0, 1], 0.0,
                            unshards=unshard_points("interleaved-1f1b", pp=2, microbatches=2, interleave=2))
    assert run.step_time_s == pytest.approx(14.0)
    r0 = run.ranks[0]
    assert (r0.compute_s, r0.exposed["dp_shard"], r0.bubble_s) == pytest.approx((8.0, 4.0, 2.0))
    assert run.ranks[1].compute_free == pytest.approx(13.0)


def test_a_stage_reduces_after_its_last_backward_and_the_rank_waits_once_its_send_is_posted():
    # interleaved 1F1B as above (F = B = 1 s, no gathers); each stage's last backward is followed
    # by its gradient reduction (2.5 s on the network), which PyTorch's REDUCE_GRAD issues after
    # the backward's SEND_B and which the compute stream then waits for. Rank 1: 3F0 3-4,
    # 3B0 4-5, 3F1 5-6, 3B1 6-7 (sent at 7), reduce 7-9.5; 1B0 9.5-10.5, 1B1 10.5-11.5, reduce
    # 11.5-14. Rank 0: 2F0 2-3, 2F1 3-4, 2B0 5-6, 2B1 7-8 (sent at 8), reduce 8-10.5; 0B0
    # 10.5-11.5, 0B1 11.5-12.5, reduce 12.5-15. A 15 s step: 8 s of compute, 5 s of reduction
    # waited for, 2 s idle. (Reductions that only the optimizer waits for: 13 s.)
    from topomesh.sim.schedules import unshard_points

    red = piece(Work(reduce=(Comm("dp_shard", Stream.NET, 2.5),), wait_reduce=True), label="reduce gradients")
    plan = StagePlan(forward=(piece(Work(compute_s=1.0)),), backward=(piece(Work(compute_s=1.0)),),
                     backward_last=(piece(Work(compute_s=1.0)), red), backward_input=(), backward_weight=(),
                     optimizer=())
    acts = action_order("interleaved-1f1b", pp=2, microbatches=2, interleave=2)
    for record in (False, True):
        run = simulate_pipeline([plan] * 4, acts, [0, 1, 0, 1], 0.0, record=record,
                                unshards=unshard_points("interleaved-1f1b", pp=2, microbatches=2, interleave=2))
        assert run.step_time_s == pytest.approx(15.0)
        r0 = run.ranks[0]
        assert (r0.compute_s, r0.exposed["dp_shard"], r0.bubble_s) == pytest.approx((8.0, 5.0, 2.0))
        assert run.ranks[1].compute_free == pytest.approx(14.0)
