"""A pipeline whose ranks share cores: each action stretched by the ranks busy while it runs
(:mod:`topomesh.sim.shared`), on hand-built plans with answers worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from topomesh.cost.cluster import load_cluster
from topomesh.sim.engine import Piece, StagePlan, simulate_pipeline
from topomesh.sim.price import Comm, Stream, Work
from topomesh.sim.schedules import Action, Kind
from topomesh.sim.shared import busy_ranks, shared_pipeline


def plan(forward_s: float, backward_s: float = 0.0, comm_s: float = 0.0) -> StagePlan:
    """One stage's pieces, priced lock-step; no optimizer."""
    fwd = (Piece(work=Work(compute_s=forward_s), count=1, label="f"),)
    bwd = (Piece(work=Work(compute_s=backward_s, blocking=(Comm("tp", Stream.INTRA, comm_s),) if comm_s else ()),
                 count=1, label="b"),) if backward_s or comm_s else ()
    return StagePlan(forward=fwd, backward=bwd, backward_input=(), backward_weight=(), optimizer=())


def sharing(cores: int):
    """Two ranks, one thread each, on ``cores`` cores; no measured stretch (compute_share = core_share)."""
    return dataclasses.replace(load_cluster("dgx-h100", gpus=2), cores=cores, threads_per_rank=1)


def test_busy_ranks_counts_the_others_share_of_each_interval():
    # rank 0 busy [0, 4]; rank 1 busy [2, 3] and [5, 6]. Rank 0's action saw rank 1 for 1 s of
    # its 4: 1.25 ranks; rank 1's first action saw rank 0 throughout: 2; its second, nobody: 1.
    # Two ranks a stage double every count.
    busy = [[(0.0, 4.0, (0, "F", 0))], [(2.0, 3.0, (1, "F", 0)), (5.0, 6.0, (1, "F", 1))]]
    assert busy_ranks(busy, 1) == {(0, "F", 0): 1.25, (1, "F", 0): 2.0, (1, "F", 1): 1.0}
    assert busy_ranks(busy, 2) == {(0, "F", 0): 2.5, (1, "F", 0): 4.0, (1, "F", 1): 2.0}
    # an interval across several of another rank's, cutting two of them: rank 0 busy [0, 1],
    # [1.5, 2.5], [3, 5]; rank 1's [0.5, 4] saw 0.5 + 1 + 1 = 2.5 s of them in its 3.5 s
    busy = [[(0.0, 1.0, (0, "F", 0)), (1.5, 2.5, (0, "F", 1)), (3.0, 5.0, (0, "B", 0))], [(0.5, 4.0, (1, "F", 0))]]
    got = busy_ranks(busy, 1)
    assert got[(1, "F", 0)] == pytest.approx(1 + 2.5 / 3.5)
    assert got[(0, "F", 0)] == pytest.approx(1.5) and got[(0, "F", 1)] == 2.0 and got[(0, "B", 0)] == 1.5


@pytest.mark.parametrize("stretch", [None, 2.4])
def test_ranks_that_never_overlap_each_run_alone(stretch):
    # two ranks on one core: lock-step prices compute at the measured stretch (2.4; never below the core
    # share, 2) and collectives at the core share: F 1 s and B 2 s alone, a 0.5 s collective
    # alone at 1 s. One micro-batch: F0, F1, B1, B0 run one after the other, each alone at
    # share 1: 1 + 1 + (2 + 0.5) + (2 + 0.5) = 7 s, half the lock-step 14 s without a stretch.
    cluster = dataclasses.replace(sharing(cores=1), compute_stretch=stretch)
    c = cluster.compute_share
    assert cluster.core_share == 2.0 and c == (stretch or 2.0)
    plans = [plan(1.0 * c, 2.0 * c, 1.0), plan(1.0 * c, 2.0 * c, 1.0)]
    actions = [[Action(0, Kind.F, 0), Action(0, Kind.B, 0)], [Action(1, Kind.F, 0), Action(1, Kind.B, 0)]]
    lock_step = simulate_pipeline(plans, actions, [0, 1], 0.0)
    assert lock_step.step_time_s == pytest.approx(6.0 * c + 2.0)
    run = shared_pipeline(plans, actions, [0, 1], 0.0, cluster, ranks_per_stage=1)
    assert run.step_time_s == pytest.approx(7.0, rel=1e-3)
    assert run.ranks[0].exposed["tp"] == pytest.approx(0.5, rel=1e-3)


def test_a_stages_own_ranks_keep_their_lock_step_stretch():
    # four ranks on two cores, two a stage (tensor parallel): measured stretches 1.2 for two
    # ranks and 2.5 for all four, so lock-step prices compute at 2.5 (F 1 s alone -> 2.5, B 2 s
    # -> 5). One micro-batch: F0, F1, B1, B0 one after the other, each with its stage's two ranks
    # alone on the two cores, who still meet at every collective: 1.2 each, not 1.0:
    # 1.2 + 1.2 + 2.4 + 2.4 = 7.2 s (6.0 as plain processor sharing).
    cluster = dataclasses.replace(load_cluster("dgx-h100", gpus=4), cores=2, threads_per_rank=1, compute_stretch=2.5,
                                  compute_stretches=((2, 1.2), (4, 2.5)))
    assert cluster.compute_share == 2.5
    plans = [plan(2.5, 5.0), plan(2.5, 5.0)]
    actions = [[Action(0, Kind.F, 0), Action(0, Kind.B, 0)], [Action(1, Kind.F, 0), Action(1, Kind.B, 0)]]
    run = shared_pipeline(plans, actions, [0, 1], 0.0, cluster, ranks_per_stage=2)
    assert run.step_time_s == pytest.approx(7.2, rel=1e-3)
    unmeasured = dataclasses.replace(cluster, compute_stretches=())  # lock-step stretch unknown: the share of cores
    assert shared_pipeline(plans, actions, [0, 1], 0.0, unmeasured, ranks_per_stage=2).step_time_s == pytest.approx(
        6.0, rel=1e-3)
    # replicas (two a stage that never meet in its layers): plain processor sharing, 6.0 s
    replicas = shared_pipeline(plans, actions, [0, 1], 0.0, cluster, ranks_per_stage=2, lock_step_ranks=1)
    assert replicas.step_time_s == pytest.approx(6.0, rel=1e-3)


def test_ranks_that_overlap_share_the_core():
    # F only (1 s alone, 2 s lock-step), two micro-batches. F(0,0) runs alone: 1 s. Then
    # F(0,1) and F(1,0) run together from 1 s, both at share 2: to 3 s. F(1,1) alone: to 4 s.
    cluster = sharing(cores=1)
    plans = [plan(2.0), plan(2.0)]
    actions = [[Action(0, Kind.F, 0), Action(0, Kind.F, 1), Action(0, Kind.B, 0), Action(0, Kind.B, 1)],
               [Action(1, Kind.F, 0), Action(1, Kind.B, 0), Action(1, Kind.F, 1), Action(1, Kind.B, 1)]]
    run = shared_pipeline(plans, actions, [0, 1], 0.0, cluster, ranks_per_stage=1)
    assert run.step_time_s == pytest.approx(4.0, rel=1e-3)
    spans = {key: (start, end) for st in run.ranks for start, end, key in st.busy if end > start}
    assert spans[(0, "F", 1)] == pytest.approx((1.0, 3.0), rel=1e-3)
    assert spans[(1, "F", 0)] == pytest.approx((1.0, 3.0), rel=1e-3)


def test_with_a_core_each_nothing_changes():
    cluster = sharing(cores=2)
    assert cluster.core_share == 1.0
    plans = [plan(1.0, 2.0, 0.5), plan(1.5, 3.0, 0.5)]
    actions = [[Action(0, Kind.F, 0), Action(0, Kind.F, 1), Action(0, Kind.B, 0), Action(0, Kind.B, 1)],
               [Action(1, Kind.F, 0), Action(1, Kind.B, 0), Action(1, Kind.F, 1), Action(1, Kind.B, 1)]]
    shared = shared_pipeline(plans, actions, [0, 1], 0.1, cluster, ranks_per_stage=1)
    assert shared.step_time_s == pytest.approx(simulate_pipeline(plans, actions, [0, 1], 0.1).step_time_s, rel=1e-12)


def test_the_local_cluster_prices_pipelines_so(monkeypatch):
    """``simulate`` takes this path for a pipeline wherever ranks share cores, and only there."""
    from topomesh.layout.dims import Layout
    from topomesh.models.presets import get_preset
    from topomesh.sim import shared
    from topomesh.sim.simulate import Simulator, Training, builtin_model

    calls = []
    real = shared.shared_pipeline
    monkeypatch.setattr(shared, "shared_pipeline", lambda *a, **k: calls.append(k) or real(*a, **k))
    model = builtin_model(get_preset("tiny-llama"))
    gpu = load_cluster("dgx-h100", gpus=2)
    training = Training(global_batch=4)
    Simulator(model=model, cluster=gpu).simulate(Layout(pp=2), training)
    Simulator(model=model, cluster=dataclasses.replace(gpu, cores=1, threads_per_rank=1)).simulate(Layout(dp_shard=2),
                                                                                                    training)
    assert calls == []
    alone = Simulator(model=model, cluster=gpu).simulate(Layout(pp=2), training)
    one_core = Simulator(model=model, cluster=dataclasses.replace(gpu, cores=1, threads_per_rank=1)).simulate(
        Layout(pp=2), training)
    assert calls == [{"ranks_per_stage": 1, "lock_step_ranks": 1, "record": False,
                      "late_receives": True, "late_handoff_s": 0.0}]  # 1F1B posts receives late; none measured
    # a stage's data-parallel ranks do not meet in its layers: two a stage, none of them lock-step
    calls.clear()
    four = dataclasses.replace(load_cluster("dgx-h100", gpus=4), cores=2, threads_per_rank=1)
    Simulator(model=model, cluster=four).simulate(Layout(pp=2, dp_replicate=2), training)
    Simulator(model=model, cluster=four).simulate(Layout(pp=2, tp=2), training)
    Simulator(model=model, cluster=four).simulate(Layout(pp=2, dp_shard=2), training)  # FSDP: first F, last B only
    assert [(k["ranks_per_stage"], k["lock_step_ranks"]) for k in calls] == [(2, 1), (2, 2), (2, 1)]
    # two ranks on one core: never faster than each alone, never slower than lock-step at share 2
    assert alone.step_time_s < one_core.step_time_s < 2 * alone.step_time_s
    # a measured hand-off reaches the engine: the last stage's forwards 1-3 of the four post their
    # receives after stage 0 sent the data, and each pays it on the step's critical path
    calls.clear()
    handoff = dataclasses.replace(gpu, cores=1, threads_per_rank=1, pipeline_handoff_s=1e-3)
    paying = Simulator(model=model, cluster=handoff).simulate(Layout(pp=2), training)
    assert calls[0]["late_handoff_s"] == 1e-3
    assert paying.step_time_s - one_core.step_time_s == pytest.approx(3e-3, rel=0.05)
    # where the boundary send is priced with what it costs more after compute (gloo on the compute
    # cores: 0.4 ms at the 8 ms point), that part of the measured hand-off is in it already
    calls.clear()
    shared = dataclasses.replace(handoff, collectives_share_compute=True, collective_in_step_s=((0.008, 4e-4),))
    Simulator(model=model, cluster=shared).simulate(Layout(pp=2), training)
    assert calls[0]["late_handoff_s"] == pytest.approx(1e-3 - 4e-4)


def _f_only(compute_s: float, comm_s: float) -> StagePlan:
    """A stage whose forward computes ``compute_s`` then waits for a ``comm_s`` collective
    (lock-step prices); its backward costs nothing."""
    fwd = (Piece(work=Work(compute_s=compute_s, blocking=(Comm("tp", Stream.INTRA, comm_s),)), count=1, label="f"),)
    return StagePlan(forward=fwd, backward=(), backward_input=(), backward_weight=(), optimizer=())


@pytest.mark.parametrize("cpu, expected", [(None, 6.0), (0.5, 5.5)])
def test_ranks_that_overlap_share_the_core_for_what_their_collectives_run_on_it(cpu, expected):
    # One core, one rank a stage. Each forward is 1 s of compute and a 0.5 s collective alone
    # (2 and 1 s lock-step at share 2). F(0,0) alone: 1.5 s. F(0,1) and F(1,0) run together:
    # the compute at share 2 (2 s), the collective at share 2 only for the half it spends on the
    # core (0.5 s: 1 s with cpu 1) -> 2.5 s (3 s). F(1,1) alone: 1.5 s.
    # 1.5 + 2.5 + 1.5 = 5.5 s; 6.0 when a collective holds its core throughout.
    cluster = dataclasses.replace(sharing(cores=1), collective_cpu_share=cpu)
    plans = [_f_only(2.0, 1.0), _f_only(2.0, 1.0)]
    actions = [[Action(0, Kind.F, 0), Action(0, Kind.F, 1), Action(0, Kind.B, 0), Action(0, Kind.B, 1)],
               [Action(1, Kind.F, 0), Action(1, Kind.B, 0), Action(1, Kind.F, 1), Action(1, Kind.B, 1)]]
    run = shared_pipeline(plans, actions, [0, 1], 0.0, cluster, ranks_per_stage=1)
    assert run.step_time_s == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("stretches, expected", [(((2, 1.2), (4, 2.2)), 7.6), (((2, 1.2), (4, 2.6)), 7.8)])
def test_a_stage_in_lock_step_loses_no_more_than_all_the_ranks_would(stretches, expected, monkeypatch):
    # Four ranks on two cores, tensor-parallel pairs: measured stretch 1.2 for two ranks, 2.2 for
    # all four (a loss of 2.2 / 2 = 1.1 over the cores' share). A forward is 1 s of compute and a
    # 1 s collective alone (2.2 and 2 s lock-step), half of it on a core. Alone the pair takes
    # 1.2 + 1 = 2.2 s. Both pairs at once: 2 x 1.1 + 2 x 0.5 = 3.2 s, not 2 x 1.2 + 2 x 0.5 =
    # 3.4: the pair's own waits are another pair's compute. 2.2 + 3.2 + 2.2 = 7.6 s. With four
    # ranks losing more (2.6 / 2 = 1.3) the pair's own 1.2 is the limit: 2.4 + 1 -> 7.8 s.
    cluster = dataclasses.replace(load_cluster("dgx-h100", gpus=4), cores=2, threads_per_rank=1,
                                  compute_stretch=dict(stretches)[4], compute_stretches=stretches,
                                  collective_cpu_share=0.5)
    full = cluster.compute_share
    plans = [_f_only(1.0 * full, 2.0), _f_only(1.0 * full, 2.0)]
    actions = [[Action(0, Kind.F, 0), Action(0, Kind.F, 1), Action(0, Kind.B, 0), Action(0, Kind.B, 1)],
               [Action(1, Kind.F, 0), Action(1, Kind.B, 0), Action(1, Kind.F, 1), Action(1, Kind.B, 1)]]
    from topomesh.sim import shared

    seen = []
    real = shared.action_stretch
    monkeypatch.setattr(shared, "action_stretch", lambda cost, *a, **k: seen.append(cost) or real(cost, *a, **k))
    run = shared_pipeline(plans, actions, [0, 1], 0.0, cluster, ranks_per_stage=2)
    assert run.step_time_s == pytest.approx(expected, rel=1e-3)
    # every forward weighed at one rank's own times (1 s and 1 s), not at the lock-step prices;
    # the backwards and optimizers cost nothing
    forwards = [cost for cost in seen if cost != (0.0, 0.0)]
    assert forwards and all(cost == pytest.approx((1.0, 1.0)) for cost in forwards)


def test_a_stage_alone_keeps_its_own_share_of_the_cores():
    # Four ranks on one core, two a stage, one micro-batch: the stages never overlap. Each forward
    # is 1 s of compute and a 1 s collective alone (4 and 4 s lock-step at share 4). Alone a stage's
    # two ranks share the core: 2 x 1 + 2 x 1 = 4 s, the collective's time off the core included
    # (no other rank is there to use it). F0 then F1: 8 s.
    cluster = dataclasses.replace(load_cluster("dgx-h100", gpus=4), cores=1, threads_per_rank=1,
                                  collective_cpu_share=0.5)
    assert cluster.compute_share == cluster.core_share == 4.0
    plans = [_f_only(4.0, 4.0), _f_only(4.0, 4.0)]
    actions = [[Action(0, Kind.F, 0), Action(0, Kind.B, 0)], [Action(1, Kind.F, 0), Action(1, Kind.B, 0)]]
    run = shared_pipeline(plans, actions, [0, 1], 0.0, cluster, ranks_per_stage=2)
    assert run.step_time_s == pytest.approx(8.0, rel=1e-3)
