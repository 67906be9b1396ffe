"""The compiled engine (sim/kernel.py) against hand-worked pipelines and the Python engine."""

from __future__ import annotations

import dataclasses

import pytest

from topomesh.sim import kernel
from topomesh.sim.engine import Piece, StagePlan, simulate_pipeline
from topomesh.sim.price import Comm, Stream, Work
from topomesh.sim.schedules import Schedule, action_order, rank_stages, stage_count, unshard_points


def piece(work: Work, count: int = 1) -> Piece:
    return Piece(work=work, count=count, label="p")


def owners(schedule: Schedule, pp: int, interleave: int) -> list[int]:
    n = stage_count(schedule, pp, interleave) if pp > 1 else 1
    out = [0] * n
    for r in range(pp):
        for s in rank_stages(schedule, pp, interleave, r) if pp > 1 else [0]:
            out[s] = r
    return out


def test_one_f_one_b_takes_m_plus_p_minus_one_rounds():
    # F = 1 s, B = 2 s, no communication: (m + p - 1)(F + B) = 11 × 3 = 33 s, bubble 3/11 of it
    plan = StagePlan(forward=(piece(Work(compute_s=1.0)),), backward=(piece(Work(compute_s=2.0)),),
                     backward_input=(), backward_weight=(), optimizer=())
    run = kernel.run([plan] * 4, Schedule.ONE_F_ONE_B, 4, 8, 1, [0, 1, 2, 3], 0.0)
    assert run.step_time_s == pytest.approx(33.0)
    assert run.ranks[run.critical_rank].bubble_s == pytest.approx(9.0)
    assert [st.compute_s for st in run.ranks] == pytest.approx([24.0] * 4)


def test_gpipe_with_sends_and_an_optimizer():
    # 3 stages, 4 micro-batches, F = B = 1 s, 0.5 s sends, each receive posted when the rank
    # reaches its action (PyTorch's GPipe), the transfer starting then if the data was sent
    # before. Forwards: stage 1 at 1.5, 3, 4.5, 6 (each after its previous forward + 0.5);
    # stage 2 at 3, 4.5, 6, 7.5; its backwards 8.5-12.5. Backwards: stage 1 at 10, 11.5, 13,
    # 14.5; stage 0 at 11.5, 13, 14.5, 16, done at 17 s; then the 0.25 s optimizer. The last
    # stage pays a send on every forward: 4 x 0.5 s of p2p. (Sends fired and forgotten,
    # arriving 0.5 s after the forward that made them, gave 2·4 + 2·2·1.5 = 14 s.)
    plan = StagePlan(forward=(piece(Work(compute_s=1.0)),), backward=(piece(Work(compute_s=1.0)),),
                     backward_input=(), backward_weight=(), optimizer=(piece(Work(compute_s=0.25)),))
    run = kernel.run([plan] * 3, Schedule.GPIPE, 3, 4, 1, [0, 1, 2], 0.5)
    assert run.step_time_s == pytest.approx(17.25)
    assert run.ranks[-1].p2p_s == pytest.approx(2.0)
    assert run.ranks[0].optimizer_s == pytest.approx(0.25)
    # the same step with receives posted ahead (as the multi-stage schedules' runtime does)
    ahead = simulate_pipeline([plan] * 3, action_order("gpipe", pp=3, microbatches=4), [0, 1, 2], 0.5)
    assert ahead.step_time_s == pytest.approx(14.25)


def test_repeated_blocks_with_a_slow_gather_fast_forward_to_the_hand_value():
    # one rank, 40 blocks of 1 s compute whose all-gather takes 1.5 s: the gathers run back to
    # back (40 × 1.5 = 60 s) and the last block computes after the last gather: 61 s
    blk = Work(compute_s=1.0, gather=(Comm("dp_shard", Stream.NET, 1.5),))
    plan = StagePlan(forward=(piece(blk, 40),), backward=(), backward_input=(), backward_weight=(), optimizer=())
    run = kernel.run([plan], Schedule.ONE_F_ONE_B, 1, 1, 1, [0], 0.0)
    assert run.step_time_s == pytest.approx(61.0)
    assert run.ranks[0].exposed == pytest.approx({"dp_shard": 21.0})


@pytest.mark.parametrize(("schedule", "pp", "interleave"), [
    (Schedule.ONE_F_ONE_B, 4, 1), (Schedule.GPIPE, 3, 1), (Schedule.INTERLEAVED_1F1B, 4, 2),
    (Schedule.INTERLEAVED_1F1B, 4, 4), (Schedule.ZBV, 4, 2), (Schedule.ONE_F_ONE_B, 1, 1)])
def test_equals_the_python_engine(schedule: Schedule, pp: int, interleave: int):
    blk = Work(compute_s=1.0, gather=(Comm("dp_shard", Stream.NET, 0.7),),
               blocking=(Comm("tp", Stream.INTRA, 0.2), Comm("cp", Stream.NET, 0.05)),
               reduce=(Comm("dp_shard", Stream.NET, 0.9), Comm("dp_replicate", Stream.NET, 0.3)), weight_grad_s=0.4)
    plan = StagePlan(forward=(piece(Work(compute_s=0.3)), piece(blk, 5)),
                     backward=(piece(dataclasses.replace(blk, compute_s=2.0), 5), piece(Work(compute_s=0.2))),
                     backward_input=(piece(dataclasses.replace(blk, compute_s=1.6, reduce=()), 5),),
                     backward_weight=(piece(Work(compute_s=0.4, reduce=blk.reduce), 5),),
                     optimizer=(piece(Work(compute_s=0.5, blocking=(Comm("dp_shard", Stream.NET, 0.1),))),),
                     forward_later=(piece(dataclasses.replace(blk, gather=()), 5),),
                     backward_early=(piece(dataclasses.replace(blk, compute_s=2.0, reduce=()), 5),))
    m = 8
    stage_rank = owners(schedule, pp, interleave)
    plans = [plan] * len(stage_rank)
    want = simulate_pipeline(plans, action_order(schedule, pp=pp, microbatches=m, interleave=interleave),
                             stage_rank, 0.3, late_receives=schedule.receives_at_action,
                             unshards=unshard_points(schedule, pp=pp, microbatches=m, interleave=interleave))
    got = kernel.run(plans, schedule, pp, m, interleave, stage_rank, 0.3)
    assert got.step_time_s == pytest.approx(want.step_time_s, rel=1e-9)
    assert got.critical_rank == want.critical_rank
    for a, b in zip(got.ranks, want.ranks, strict=True):
        assert (a.compute_free, a.compute_s, a.bubble_s, a.p2p_s, a.optimizer_s, a.reduce_end) == pytest.approx(
            (b.compute_free, b.compute_s, b.bubble_s, b.p2p_s, b.optimizer_s, b.reduce_end), rel=1e-9)
        assert a.exposed == pytest.approx(b.exposed, rel=1e-9)
        assert a.reduce_axis == b.reduce_axis


def test_the_last_repeated_block_prefetches_the_next_pieces_gather():
    # 10 blocks (1 s compute, 0.5 s gather) then a head whose 3 s gather is issued when the last
    # block starts (9.5 s): it ends at 12.5 s, the head computes 1 s: 13.5 s, 2 s of it exposed
    blk = Work(compute_s=1.0, gather=(Comm("dp_shard", Stream.NET, 0.5),))
    head = Work(compute_s=1.0, gather=(Comm("dp_shard", Stream.NET, 3.0),))
    plan = StagePlan(forward=(piece(blk, 10), piece(head)), backward=(), backward_input=(), backward_weight=(),
                     optimizer=())
    run = kernel.run([plan], Schedule.ONE_F_ONE_B, 1, 1, 1, [0], 0.0)
    assert run.step_time_s == pytest.approx(13.5)
    assert run.ranks[0].exposed == pytest.approx({"dp_shard": 0.5 + 2.0})


@pytest.mark.parametrize(("layout", "training"), [
    ("dp_shard=4,pp=4", dict(global_batch=16)),
    ("tp=2,dp_replicate=2,dp_shard=2,pp=2", dict(global_batch=16, micro_batch=2)),
    ("tp=2,dp_shard=2,pp=4", dict(global_batch=16, schedule="interleaved-1f1b", interleave=2)),
    ("dp_shard=4,pp=4", dict(global_batch=16, schedule="zbv")),
    ("tp=4,dp_shard=4", dict(global_batch=16)),
])
def test_simulate_equals_the_python_engine_on_priced_plans(layout: str, training: dict):
    """simulate() runs templates (plans encoded once, collectives priced per placement) in the
    compiled engine; record=True prices the plans on the links and runs the Python engine."""
    from topomesh.cost.cluster import load_cluster
    from topomesh.layout.dims import Layout
    from topomesh.models.presets import get_preset
    from topomesh.sim.simulate import Simulator, Training, builtin_model

    cfg = dataclasses.replace(get_preset("tiny-llama"), n_layers=8)
    sim = Simulator(model=builtin_model(cfg), cluster=load_cluster("dgx-a100-80gb", gpus=16))
    lay = Layout.parse(layout) if hasattr(Layout, "parse") else Layout(**{k: int(v) for k, v in
                                                                          (kv.split("=") for kv in layout.split(","))})
    t = Training(seq_len=512, **training)
    fast, slow = sim.simulate(lay, t), sim.simulate(lay, t, record=True)
    assert fast.step_time_s == pytest.approx(slow.step_time_s, rel=1e-9)
    a, b = fast.breakdown, slow.breakdown
    assert (a.compute_s, a.bubble_s, a.p2p_s, a.optimizer_s) == pytest.approx(
        (b.compute_s, b.bubble_s, b.p2p_s, b.optimizer_s), rel=1e-9, abs=1e-15)
    assert a.exposed_comm_s == pytest.approx(b.exposed_comm_s, rel=1e-9)
    assert fast.peak_memory_bytes == slow.peak_memory_bytes and fast.links == slow.links


def test_a_template_scales_each_records_price_by_its_factor():
    # symbolic plans: the block's tp all-reduce is record #0 (factor 1), a quarter of the
    # optimizer's dp all-reduce (#1) falls to this stage (factor 0.25). Priced 0.5 s and 2 s
    # on the links: forward 2 × (1 + 0.5) = 3 s, optimizer 1 + 0.25 × 2 = 1.5 s; 4.5 s in all
    import numpy as np

    from topomesh.trace.graph import CollectiveKind, CollectiveRecord

    tp = CollectiveRecord(kind=CollectiveKind.ALL_REDUCE, bytes=8, group_size=2, mesh_axis="tp")
    dp = CollectiveRecord(kind=CollectiveKind.ALL_REDUCE, bytes=8, group_size=2, mesh_axis="dp_shard")
    plan = StagePlan(forward=(piece(Work(compute_s=1.0, blocking=(Comm("#0", Stream.INTRA, 1.0),)), 2),),
                     backward=(), backward_input=(), backward_weight=(),
                     optimizer=(piece(Work(compute_s=1.0, blocking=(Comm("#1", Stream.INTRA, 0.25),))),))
    tpl = kernel.template([plan], [tp, dp])
    run = kernel.run_template(tpl, np.array([0.5, 2.0]), np.array([0, 1]), Schedule.ONE_F_ONE_B, 1, 1, 1, [0], 0.0)
    assert run.step_time_s == pytest.approx(4.5)
    assert run.ranks[0].exposed == pytest.approx({"tp": 1.0, "dp_shard": 0.5})
    assert run.ranks[0].stream_free[Stream.NET] == pytest.approx(4.5)  # the dp record ran on the net stream


def test_the_end_stages_share_the_optimizer_work_outside_the_blocks():
    """The embedding's and head's optimizer work (compute 2 s, a 4 s all-reduce, 10 FLOPs) goes
    to the first and the last stage by their state bytes: a quarter to one of them is 0.5 s of
    compute, a 1 s all-reduce and 2 FLOPs; three quarters to the other 1.5 s, 3 s and 7 FLOPs."""
    from topomesh.sim.price import _scaled

    rest = Work(compute_s=2.0, blocking=(Comm("dp_shard", Stream.NET, 4.0),), flops=10)
    quarter, rest_of_it = _scaled(rest, 0.25), _scaled(rest, 0.75)
    assert (quarter.compute_s, quarter.blocking[0].seconds, quarter.flops) == pytest.approx((0.5, 1.0, 2))
    assert (rest_of_it.compute_s, rest_of_it.blocking[0].seconds, rest_of_it.flops) == pytest.approx((1.5, 3.0, 7))
    assert quarter.blocking[0].axis == "dp_shard"


def test_a_multi_stage_runtime_unshards_every_stage_ahead_of_its_input():
    # tests/sim/test_engine.py's hand-worked step (interleaved 1F1B, pp=2, 2 micro-batches,
    # 1 s actions, a 3 s gather a stage, issued for both stages of a rank before its first
    # action): 14 s, 4 s of rank 0's gathering exposed, 2 s idle
    plan = StagePlan(forward=(piece(Work(compute_s=1.0, gather=(Comm("dp_shard", Stream.NET, 3.0),))),),
                     forward_later=(piece(Work(compute_s=1.0)),), backward=(piece(Work(compute_s=1.0)),),
                     backward_input=(), backward_weight=(), optimizer=())
    run = kernel.run([plan] * 4, Schedule.INTERLEAVED_1F1B, 2, 2, 2, [0, 1, 0, 1], 0.0)
    assert run.step_time_s == pytest.approx(14.0)
    r0 = run.ranks[0]
    assert (r0.compute_s, r0.exposed["dp_shard"], r0.bubble_s) == pytest.approx((8.0, 4.0, 2.0))


def test_a_stage_reduces_after_its_last_backward_and_the_rank_waits_once_its_send_is_posted():
    # tests/sim/test_engine.py's hand-worked step: each stage's 2.5 s reduction after its last
    # backward's send, the rank's compute waiting for it: 15 s, 5 s of rank 0's reduction exposed
    red = Piece(work=Work(reduce=(Comm("dp_shard", Stream.NET, 2.5),), wait_reduce=True), count=1, label="r")
    plan = StagePlan(forward=(piece(Work(compute_s=1.0)),), backward=(piece(Work(compute_s=1.0)),),
                     backward_last=(piece(Work(compute_s=1.0)), red), backward_input=(), backward_weight=(),
                     optimizer=())
    run = kernel.run([plan] * 4, Schedule.INTERLEAVED_1F1B, 2, 2, 2, [0, 1, 0, 1], 0.0)
    assert run.step_time_s == pytest.approx(15.0)
    r0 = run.ranks[0]
    assert (r0.compute_s, r0.exposed["dp_shard"], r0.bubble_s) == pytest.approx((8.0, 5.0, 2.0))
    assert run.ranks[1].compute_free == pytest.approx(14.0)
