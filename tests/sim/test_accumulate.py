"""Gradient accumulation: every backward of a step but one adds its gradients into those
kept from the earlier micro-batches (autograd's ``grad += new``; FSDP2's unsharded
accumulated gradient under a pipeline), ``micro - 1`` memory-bound adds the trace of one
micro-batch does not contain; a pipeline schedule then divides them by the micro-batch count
(``PipelineStage.scale_grads``). Expected values are worked out by hand."""

from __future__ import annotations

import pytest

from topomesh.sim.engine import simulate_pipeline
from topomesh.sim.price import GRAD_ADD_PROBE_BYTES, PricedClass, Pricer, Work, grad_add_s_per_byte
from topomesh.sim.schedules import Schedule, action_order
from topomesh.sim.simulate import _stage_plan
from topomesh.trace.result import StateBytes


def _priced(*, rate: float, block_reduce_bytes: int = 0, block_gather_bytes: int = 0,
            fsdp_rate: float | None = None, scale_rate: float = 0.0) -> PricedClass:
    # per block: forward 0.5 s, backward 1.0 s; 1000 B of gradients per block, 200 B in the
    # embedding, 300 B in the head (as the optimizer sees them); ``rate`` per byte moved
    empty = Work()
    return PricedClass(fwd_pre=empty, fwd_block=Work(compute_s=0.5), fwd_post=empty, bwd_post=empty,
                       bwd_block=Work(compute_s=1.0, reduce_bytes=block_reduce_bytes, gather_bytes=block_gather_bytes), bwd_pre=empty,
                       opt_block=empty, opt_first=empty, opt_last=empty,
                       block_state=StateBytes(grads=1000), first_state=StateBytes(grads=200),
                       last_state=StateBytes(grads=300), boundary_bytes=0, grad_add_s_per_byte=rate,
                       fsdp_grad_add_s_per_byte=rate if fsdp_rate is None else fsdp_rate,
                       grad_scale_s_per_byte=scale_rate)


def _compute(pieces) -> float:  # noqa: ANN001
    return sum(pc.work.compute_s * pc.count for pc in pieces)


def test_each_backward_but_one_adds_the_kept_gradients():
    # one stage of 2 blocks, 4 micro-batches, 1 ms per byte moved, an add moving 3 bytes per
    # byte kept (read kept and new, write kept): forwards 4 x 1 s, the last backward 2 s, the
    # three others 2 s + 3 x (2 x 1000 + 200 + 300) B x 1 ms = 9.5 s: 34.5 s; without the adds 12 s
    from topomesh.sim import kernel

    plan = _stage_plan(_priced(rate=1e-3), 0, 1, 2)
    assert _compute(plan.backward) == pytest.approx(2.0) and _compute(plan.backward_early) == pytest.approx(9.5)
    assert _compute(plan.backward_weight_early) - _compute(plan.backward_weight) == pytest.approx(7.5)
    actions = action_order(Schedule.ONE_F_ONE_B, pp=1, microbatches=4)
    assert simulate_pipeline([plan], actions, [0], 0.0).step_time_s == pytest.approx(34.5)
    assert kernel.run([plan], Schedule.ONE_F_ONE_B, 1, 4, 1, [0], 0.0).step_time_s == pytest.approx(34.5)
    one = action_order(Schedule.ONE_F_ONE_B, pp=1, microbatches=1)  # one micro-batch: nothing kept, no add
    assert simulate_pipeline([plan], one, [0], 0.0).step_time_s == pytest.approx(3.0)
    free = _stage_plan(_priced(rate=0.0), 0, 1, 2)
    assert simulate_pipeline([free], actions, [0], 0.0).step_time_s == pytest.approx(12.0)


def test_a_pipeline_stage_with_fsdp_adds_its_unsharded_gradients():
    # FSDP under a pipeline with mixed precision keeps each unit's unsharded gradients in
    # float32 until the last backward: 4000 B a block (the reduction's input) where the
    # optimizer sees a 1000 B shard, and adds the new bfloat16 ones, 2000 B (as many as the
    # gathered parameters): 2 x 4000 + 2000 B moved. A middle stage (no embedding, no head) of
    # 2 blocks at 1 ms a byte: every backward but the last 2 x (1 + 10) s, the last 2 s. (Its
    # own rate: the plain one, for the parameters' dtype, is set apart.)
    plan = _stage_plan(_priced(rate=0.5e-3, fsdp_rate=1e-3, block_reduce_bytes=4000, block_gather_bytes=2000), 1, 3, 2,
                       pipelined=True)
    assert _compute(plan.backward_early) == pytest.approx(22.0) and _compute(plan.backward) == pytest.approx(2.0)
    assert _compute(plan.backward_weight_early) - _compute(plan.backward_weight) == pytest.approx(20.0)
    # without FSDP the stage adds the gradients the optimizer sees: 2 x (1 + 3) s; the first
    # stage adds its embedding's too: + 0.6 s
    assert _compute(_stage_plan(_priced(rate=1e-3), 1, 3, 2, pipelined=True).backward_early) == pytest.approx(8.0)
    assert _compute(_stage_plan(_priced(rate=1e-3), 0, 3, 2, pipelined=True).backward_early) == pytest.approx(8.6)


def test_the_add_is_priced_like_any_op():
    from topomesh.cost.cluster import load_cluster
    from topomesh.cost.ops import profile_key
    from topomesh.trace.graph import OpRecord, Phase, TensorMeta

    h100 = load_cluster("dgx-h100", gpus=8)
    # the roofline: 3.35 TB/s (datasheet) x 0.9 (the fraction memory-bound kernels reach,
    # h100-sxm5-80gb.json): 0.332 ps a byte moved (per-picosecond values:
    # pytest.approx's default absolute tolerance of 1e-12 would pass anything)
    assert grad_add_s_per_byte(Pricer(h100, lambda _: None, {})) == pytest.approx(1 / (3350e9 * 0.9), rel=1e-9, abs=0)
    # a measured time for the probe wins: 12 ms for 64 MiB added, 3 x 64 MiB moved
    n = GRAD_ADD_PROBE_BYTES // 4
    t = TensorMeta(shape=(n,), dtype="float32", stride=(1,))
    probe = OpRecord(op="aten.add_.Tensor", inputs=(t, t), outputs=(t,), flops=n, bytes_moved=3 * GRAD_ADD_PROBE_BYTES,
                     phase=Phase.BACKWARD)
    table = {profile_key(probe): 0.012}
    assert grad_add_s_per_byte(Pricer(h100, lambda _: None, table)) == pytest.approx(0.012 / (3 * GRAD_ADD_PROBE_BYTES), rel=1e-9, abs=0)
    # the pipeline's division likewise: the roofline, else 5 ms measured for 64 MiB of bfloat16
    # gradients read and written
    from topomesh.sim.price import grad_scale_s_per_byte

    assert grad_scale_s_per_byte(Pricer(h100, lambda _: None, {})) == pytest.approx(1 / (3350e9 * 0.9), rel=1e-9, abs=0)
    g = TensorMeta(shape=(GRAD_ADD_PROBE_BYTES // 2,), dtype="bfloat16", stride=(1,))
    div = OpRecord(op="aten.div_.Scalar", inputs=(g,), outputs=(g,), flops=g.shape[0], bytes_moved=2 * GRAD_ADD_PROBE_BYTES, args=(2,),
                   phase=Phase.OPTIMIZER)
    got = grad_scale_s_per_byte(Pricer(h100, lambda _: None, {profile_key(div): 0.005}), "bfloat16")
    assert got == pytest.approx(0.005 / (2 * GRAD_ADD_PROBE_BYTES), rel=1e-9, abs=0)


def test_a_step_of_several_micro_batches_pays_the_adds(monkeypatch):
    """tiny-llama on one H100, 4 micro-batches: the step is longer than with the adds priced at
    nothing by 3 adds of every gradient byte the rank holds, 3 bytes moved each, at the roofline."""
    from topomesh.cost.cluster import load_cluster
    from topomesh.layout.dims import Layout
    from topomesh.models.presets import get_preset
    from topomesh.sim import price
    from topomesh.sim.simulate import Simulator, Training, builtin_model

    def step(rate_fn) -> tuple[float, int]:  # noqa: ANN001
        monkeypatch.setattr(price, "grad_add_s_per_byte", rate_fn)
        sim = Simulator(model=builtin_model(get_preset("tiny-llama")), cluster=load_cluster("dgx-h100", gpus=1))
        r = sim.simulate(Layout(dp_shard=1), Training(global_batch=4))
        return r.step_time_s, r.memory[0].grads_bytes

    real = price.grad_add_s_per_byte
    with_adds, grads = step(real)
    asked = []
    without, _ = step(lambda pricer, *dtypes: asked.append(dtypes) or 0.0)
    # every add in the parameters' dtype (bf16; no FSDP, so no mixed precision)
    assert asked and all(a == ("bfloat16", "bfloat16") for a in asked)
    assert grads > 0
    assert with_adds - without == pytest.approx(3 * grads * 3 / (3350e9 * 0.9), rel=1e-6)


def test_the_add_is_priced_in_the_gradients_dtypes():
    """The probe is added in the gradients' own dtypes: a measured bfloat16 add (64 MiB kept,
    32 Mi elements, 2 + 2 + 2 bytes moved each) and float32 += bfloat16 (16 Mi elements,
    4 + 4 + 2 bytes each) give their own rates; a dtype the table lacks falls to the roofline."""
    from topomesh.cost.cluster import load_cluster
    from topomesh.cost.ops import profile_key
    from topomesh.sim.price import grad_add_record

    h100 = load_cluster("dgx-h100", gpus=8)
    bf16, mixed = grad_add_record("bfloat16"), grad_add_record("float32", "bfloat16")
    assert bf16.inputs[0].shape == (32 * 2**20,) and bf16.bytes_moved == 32 * 2**20 * 6
    assert mixed.inputs[1].dtype == "bfloat16" and mixed.bytes_moved == 16 * 2**20 * 10
    pricer = Pricer(h100, lambda _: None, {profile_key(bf16): 0.030, profile_key(mixed): 0.040})
    assert grad_add_s_per_byte(pricer, "bfloat16") == pytest.approx(0.030 / (32 * 2**20 * 6), rel=1e-9, abs=0)
    assert grad_add_s_per_byte(pricer, "float32", "bfloat16") == pytest.approx(0.040 / (16 * 2**20 * 10), rel=1e-9, abs=0)
    assert grad_add_s_per_byte(pricer, "float32") == pytest.approx(1 / (3350e9 * 0.9), rel=1e-9, abs=0)


@pytest.mark.parametrize(("degrees", "mixed", "want"), [
    ({"dp_shard": 1}, False, (("bfloat16", "bfloat16"), ("bfloat16", "bfloat16"))),
    ({"dp_shard": 2}, True, (("float32", "float32"), ("float32", "bfloat16"))),  # FSDP2: f32 reduce, bf16 gather
])
def test_the_gradient_dtypes_come_from_the_trace(degrees, mixed, want):
    from topomesh.cost.cluster import load_cluster
    from topomesh.layout.dims import Layout
    from topomesh.models.presets import get_preset
    from topomesh.sim.price import grad_add_dtypes, grad_probe_records
    from topomesh.sim.simulate import Simulator, Training, builtin_model

    sim = Simulator(model=builtin_model(get_preset("tiny-llama")), cluster=load_cluster("dgx-h100", gpus=2))
    trace = sim.trace(Layout(**degrees), Training(global_batch=4, dtype="bf16", mixed_precision=mixed))
    assert grad_add_dtypes(trace) == want
    probes = grad_probe_records(trace)
    assert {(r.inputs[0].dtype, r.inputs[1].dtype) for r in probes if r.op == "aten.add_.Tensor"} == set(want)
    # the pipeline's scaling of the gradients the optimizer sees, in their dtype
    assert [r.inputs[0].dtype for r in probes if r.op == "aten.div_.Scalar"] == [want[0][0]]


def test_in_a_pipeline_the_first_backward_adds_nothing_and_the_last_adds():
    # two stages of one block (forward 0.5 s, backward 1 s), 1F1B, 2 micro-batches, 1 ms a byte:
    # stage 0 adds 3 x (1000 + 200) B = 3.6 s, stage 1 (the head's) 3 x (1000 + 300) B = 3.9 s.
    # rank 1: F0 0.5-1, B0 1-2 (its first: no add), F1 2-2.5, B1 2.5-7.4 (1 + 3.9);
    # rank 0: F0 0-0.5, F1 0.5-1, B0 2-3 (no add), B1 7.4-12.0 (1 + 3.6): the step ends at 12.0 s.
    # (Booked on the backwards before the last instead, the adds hid in rank 0's wait: 11.5 s.)
    from topomesh.sim import kernel

    plans = [_stage_plan(_priced(rate=1e-3), s, 2, 1, pipelined=True) for s in range(2)]
    assert _compute(plans[0].backward_first) == pytest.approx(1.0) and _compute(plans[0].backward_last) == pytest.approx(4.6)
    actions = action_order(Schedule.ONE_F_ONE_B, pp=2, microbatches=2)
    assert simulate_pipeline(plans, actions, [0, 1], 0.0).step_time_s == pytest.approx(12.0)
    assert kernel.run(plans, Schedule.ONE_F_ONE_B, 2, 2, 1, [0, 1], 0.0).step_time_s == pytest.approx(12.0)
    one = action_order(Schedule.GPIPE, pp=2, microbatches=1)  # one micro-batch: no add anywhere
    assert simulate_pipeline(plans, one, [0, 1], 0.0).step_time_s == pytest.approx(0.5 + 0.5 + 1.0 + 1.0)
    assert kernel.run(plans, Schedule.GPIPE, 2, 1, 1, [0, 1], 0.0).step_time_s == pytest.approx(3.0)


def test_a_pipeline_divides_its_gradients_before_the_optimizer():
    # the same two stages, no adds, 1 ms a byte moved by the division (read + write): stage 0
    # 2 x (1000 + 200) B = 2.4 s, stage 1 2 x (1000 + 300) B = 2.6 s, before its optimizer.
    # rank 1: F0 0.5-1, B0 1-2, F1 2-2.5, B1 2.5-3.5, scaling 3.5-6.1;
    # rank 0: F0 0-0.5, F1 0.5-1, B0 2-3, B1 3.5-4.5, scaling 4.5-6.9: the step ends at 6.9 s.
    from topomesh.sim import kernel

    plans = [_stage_plan(_priced(rate=0.0, scale_rate=1e-3), s, 2, 1, pipelined=True, scaled=True) for s in range(2)]
    assert [_compute(p.optimizer) for p in plans] == [pytest.approx(2.4), pytest.approx(2.6)]
    actions = action_order(Schedule.ONE_F_ONE_B, pp=2, microbatches=2)
    run = simulate_pipeline(plans, actions, [0, 1], 0.0)
    assert run.step_time_s == pytest.approx(6.9)
    assert kernel.run(plans, Schedule.ONE_F_ONE_B, 2, 2, 1, [0, 1], 0.0).step_time_s == pytest.approx(6.9)
    unscaled = [_stage_plan(_priced(rate=0.0, scale_rate=1e-3), s, 2, 1, pipelined=True) for s in range(2)]
    assert simulate_pipeline(unscaled, actions, [0, 1], 0.0).step_time_s == pytest.approx(4.5)


def test_a_pipeline_of_one_micro_batch_does_not_divide():
    # torch's schedules divide only when the micro-batch count is not 1; the simulator keeps
    # the plans of both in one memo, and the one-micro-batch step must not borrow the others'
    from topomesh.cost.cluster import load_cluster
    from topomesh.layout.dims import Layout
    from topomesh.models.presets import get_preset
    from topomesh.sim.simulate import Simulator, Training, builtin_model

    def sim() -> Simulator:
        return Simulator(model=builtin_model(get_preset("tiny-llama")), cluster=load_cluster("dgx-h100", gpus=2))

    lay = Layout(pp=2)
    one, two = (Training(global_batch=g, schedule=Schedule.GPIPE) for g in (1, 2))
    warm = sim()
    several = warm.simulate(lay, two).breakdown.optimizer_s
    alone = sim().simulate(lay, one).breakdown.optimizer_s
    assert warm.simulate(lay, one).breakdown.optimizer_s == pytest.approx(alone, rel=1e-12)
    assert several > alone  # the division, on the H100's memory bandwidth
