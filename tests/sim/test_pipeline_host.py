"""The host work of a pipeline schedule's actions (:mod:`topomesh.cost.pipeline`): every F, B,
I and W of a stage pays it on top of its ops where it was measured (the ``local`` cluster), a
schedule of several stages a rank its own figure. Expected values are worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from topomesh.cost.cluster import load_cluster
from topomesh.cost.pipeline import per_action
from topomesh.layout.dims import Layout
from topomesh.models.presets import get_preset
from topomesh.sim.engine import simulate_pipeline
from topomesh.sim.price import PricedClass, Work
from topomesh.sim.schedules import Kind, Schedule, action_order
from topomesh.sim.simulate import Simulator, Training, _stage_plan, action_host_s, builtin_model
from topomesh.trace.result import StateBytes


def _priced() -> PricedClass:
    # per block: forward 0.5 s, backward 1.0 s (I 0.6, W 0.4); nothing else costs anything
    empty = Work()
    return PricedClass(fwd_pre=empty, fwd_block=Work(compute_s=0.5), fwd_post=empty, bwd_post=empty,
                       bwd_block=Work(compute_s=1.0, weight_grad_s=0.4), bwd_pre=empty,
                       opt_block=empty, opt_first=empty, opt_last=empty,
                       block_state=StateBytes(), first_state=StateBytes(), last_state=StateBytes(), boundary_bytes=0)


def _compute(pieces) -> float:  # noqa: ANN001
    return sum(pc.work.compute_s * pc.count for pc in pieces)


def test_every_action_of_a_stage_pays_the_schedules_host_work():
    # two stages of one block, 1F1B, 2 micro-batches, 0.1 s an action. Without it (by hand):
    # rank 0 F0 0-0.5, F1 0.5-1; rank 1 F0 0.5-1, B0 1-2, F1 2-2.5, B1 2.5-3.5; rank 0 B0 2-3,
    # B1 3.5-4.5: 4.5 s. With it: rank 0 F0 0-0.6, F1 0.6-1.2; rank 1 F0 0.6-1.2, B0 1.2-2.3,
    # F1 2.3-2.9, B1 2.9-4.0; rank 0 B0 2.3-3.4, B1 4.0-5.1: 5.1 s.
    from topomesh.sim import kernel

    plans = [_stage_plan(_priced(), s, 2, 1, pipelined=True, action_s=0.1) for s in range(2)]
    for kind, base in ((Kind.F, 0.5), (Kind.B, 1.0), (Kind.I, 0.6), (Kind.W, 0.4)):
        for first, last in ((True, True), (True, False), (False, False), (False, True)):
            assert _compute(plans[1].pieces(kind, first, last)) == pytest.approx(base + 0.1), (kind, first, last)
    assert _compute(plans[0].optimizer) == 0.0  # not an action of the schedule
    actions = action_order(Schedule.ONE_F_ONE_B, pp=2, microbatches=2)
    assert simulate_pipeline(plans, actions, [0, 1], 0.0).step_time_s == pytest.approx(5.1)
    assert kernel.run(plans, Schedule.ONE_F_ONE_B, 2, 2, 1, [0, 1], 0.0).step_time_s == pytest.approx(5.1)
    free = [_stage_plan(_priced(), s, 2, 1, pipelined=True) for s in range(2)]
    assert simulate_pipeline(free, actions, [0, 1], 0.0).step_time_s == pytest.approx(4.5)
    # without a pipeline there is no schedule to pay
    assert _compute(_stage_plan(_priced(), 0, 1, 1, action_s=0.1).forward) == pytest.approx(0.5)


def test_the_figure_follows_the_schedule_and_the_cores():
    gpu = load_cluster("dgx-h100", gpus=4)
    assert action_host_s(gpu, Schedule.ONE_F_ONE_B) == 0.0  # not measured: the GPU's host issues ahead
    cpu = dataclasses.replace(gpu, cores=2, threads_per_rank=1, pipeline_action_s=1e-4, pipeline_multi_action_s=3e-4)
    # four ranks on two cores: each rank's host work takes twice as long
    assert action_host_s(cpu, Schedule.ONE_F_ONE_B) == pytest.approx(2e-4)
    assert action_host_s(cpu, Schedule.GPIPE) == pytest.approx(2e-4)
    assert action_host_s(cpu, Schedule.INTERLEAVED_1F1B) == pytest.approx(6e-4)
    assert action_host_s(cpu, Schedule.INTERLEAVED_ZB) == pytest.approx(6e-4)


def test_a_simulated_step_pays_it_on_its_critical_path():
    # GPipe, two stages, one micro-batch: F(stage 0), F(1), B(1), B(0) one after the other, every
    # one on the critical path: 1 ms an action adds 4 ms to the step, whatever the ops cost
    model = builtin_model(get_preset("tiny-llama"))
    gpu = load_cluster("dgx-h100", gpus=2)
    training = Training(global_batch=1, schedule=Schedule.GPIPE)
    base = Simulator(model=model, cluster=gpu).simulate(Layout(pp=2), training).step_time_s
    paying = dataclasses.replace(gpu, pipeline_action_s=1e-3, pipeline_multi_action_s=5e-3)
    got = Simulator(model=model, cluster=paying).simulate(Layout(pp=2), training).step_time_s
    assert got - base == pytest.approx(4e-3, rel=1e-6)
    # no pipeline: no schedule
    one, two = Layout(dp_shard=2), Training(global_batch=2, schedule=Schedule.GPIPE)
    assert (Simulator(model=model, cluster=paying).simulate(one, two).step_time_s
            == pytest.approx(Simulator(model=model, cluster=gpu).simulate(one, two).step_time_s, rel=1e-12))


def test_the_measured_slope_leaves_out_the_steps_fixed_part():
    # stepped at 4 and 20 actions: 1.0 and 3.8 ms a step, the stage's own work 0.2 and 1.0 ms;
    # (3.8 - 1.0) - (1.0 - 0.2) = 2.0 ms over 16 more actions: 125 us each (a step's fixed
    # 0.3 ms and the plain work are in neither)
    assert per_action((1.0e-3, 0.2e-3, 4), (3.8e-3, 1.0e-3, 20)) == pytest.approx(125e-6)
    # the same step with a fixed part 1 ms larger: the same figure
    assert per_action((2.0e-3, 0.2e-3, 4), (4.8e-3, 1.0e-3, 20)) == pytest.approx(125e-6)


def test_schedules_of_one_stage_split_do_not_share_their_action_cost():
    # GPipe and interleaved-zb at one virtual stage a rank split the model alike, so the
    # simulator's plan templates could be shared between them; each pays its own figure
    model = builtin_model(get_preset("tiny-llama"))
    paying = dataclasses.replace(load_cluster("dgx-h100", gpus=2), pipeline_action_s=1e-3, pipeline_multi_action_s=5e-3)
    gpipe, zb = (Training(global_batch=2, schedule=s, interleave=1) for s in (Schedule.GPIPE, Schedule.INTERLEAVED_ZB))
    warm = Simulator(model=model, cluster=paying)
    warm.simulate(Layout(pp=2), gpipe)
    alone = Simulator(model=model, cluster=paying).simulate(Layout(pp=2), zb).step_time_s
    assert warm.simulate(Layout(pp=2), zb).step_time_s == pytest.approx(alone, rel=1e-12)


def test_the_measurement_counts_the_actions_of_a_step():
    # 1F1B on two ranks: an F and a B per micro-batch on each rank; interleaved 1F1B with two
    # stages a rank: two of each per micro-batch (by hand, the MICROBATCHES the calibration steps at)
    from topomesh.cost.pipeline import actions_a_step

    for me in (0, 1):
        assert [actions_a_step("single", m, me) for m in (2, 10)] == [4, 20]
        assert [actions_a_step("multi", m, me) for m in (2, 10)] == [8, 40]
