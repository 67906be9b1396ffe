"""FSDP2 under a pipeline: PyTorch's stage keeps its parameters unsharded for the step and
syncs gradients in its last backward only, so FSDP2's unsharding (the all-gather's copies, a
replicate-only unit's casts of its parameters) runs in a stage's first forward and its
reduction's copies in its last backward; the ops that run them carry their FSDP2 hook from the
trace (:attr:`OpRecord.hook`). Expected values are worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from topomesh.cost.cluster import load_cluster
from topomesh.cost.ops import profile_key
from topomesh.sim.price import PricedClass, Pricer, SymbolicPricer, Work, op_role
from topomesh.sim.simulate import _stage_plan
from topomesh.trace.graph import CollectiveKind, CollectiveRecord, OpRecord, Phase, TensorMeta
from topomesh.trace.result import Part, Segment, StateBytes


def _compute(pieces) -> float:  # noqa: ANN001
    return sum(pc.work.compute_s * pc.count for pc in pieces)


def _priced(*, gather_bytes: int = 2000, backward_split: tuple[float, float] | None = None) -> PricedClass:
    # per block: forward 0.5 s of which FSDP2's unsharding 0.2 s; backward 1.0 s of which its
    # unsharding again 0.1 s (pre-backward, after resharding) and its reduction's copies 0.3 s,
    # its weight-gradient matmuls 0.4 s; float32 gradients of 4000 B reduced, bfloat16 ones of
    # ``gather_bytes`` made; 1 ms a byte moved for FSDP2's casts and adds
    empty = Work()
    return PricedClass(fwd_pre=empty, fwd_block=Work(compute_s=0.5, gather_s=0.2), fwd_post=empty, bwd_post=empty,
                       bwd_block=Work(compute_s=1.0, gather_s=0.1, reduce_s=0.3, weight_grad_s=0.4,
                                      reduce_bytes=4000, gather_bytes=gather_bytes),
                       bwd_pre=empty, opt_block=empty, opt_first=empty, opt_last=empty,
                       block_state=StateBytes(grads=1000), first_state=StateBytes(), last_state=StateBytes(),
                       boundary_bytes=0, fsdp_grad_add_s_per_byte=1e-3, backward_split=backward_split)


def test_a_stage_unshards_in_its_first_forward_and_reduces_in_its_last_backward():
    # a middle stage of 2 blocks:
    # forward 2 x 0.5 = 1.0 s, later forwards 2 x (0.5 - 0.2) = 0.6 s;
    # every backward drops the unsharding: 2 x 0.9 = 1.8 s (the one backward of one micro-batch);
    # the first drops the reduction too, 2 x 0.6, and casts the new gradients to float32, a read
    #   of 2000 B and a write of 4000 B: 2 x (0.6 + 6) = 13.2 s;
    # the middle ones add them instead, 2 x 4000 + 2000 B: 2 x (0.6 + 10) = 21.2 s;
    # the last adds and reduces: 2 x (0.9 + 10) = 21.8 s
    plan = _stage_plan(_priced(), 1, 3, 2, pipelined=True)
    assert _compute(plan.forward) == pytest.approx(1.0)
    assert _compute(plan.forward_later) == pytest.approx(0.6)
    assert _compute(plan.backward) == pytest.approx(1.8)
    assert _compute(plan.backward_first) == pytest.approx(13.2)
    assert _compute(plan.backward_early) == pytest.approx(21.2)
    assert _compute(plan.backward_last) == pytest.approx(21.8)
    # outside a pipeline every micro-batch gathers and reduces (FSDP2's default)
    flat = _stage_plan(_priced(), 1, 3, 2)
    assert _compute(flat.forward) == pytest.approx(1.0) and _compute(flat.backward) == pytest.approx(2.0)


def test_without_mixed_precision_the_first_backward_casts_nothing():
    # bfloat16 gradients reduced in bfloat16 (4000 B either way): autograd keeps them as made
    plan = _stage_plan(_priced(gather_bytes=4000), 1, 3, 2, pipelined=True)
    assert _compute(plan.backward_first) == pytest.approx(1.2)


@pytest.mark.parametrize("split, i_s, w_s", [
    # W: the weight-gradient matmuls (0.4 s) and the reduction's copies (0.3 s); I: the rest
    (None, 0.3, 0.7),
    # measured shares of the backward without the reduction (0.7 s), the reduction with W
    ((0.8, 0.4), 0.56, 0.58),
])
def test_a_zero_bubble_weight_step_runs_the_reduction(split, i_s, w_s):  # noqa: ANN001
    priced = _priced(backward_split=split)
    flat = _stage_plan(priced, 1, 3, 1)
    assert _compute(flat.backward_input) == pytest.approx(i_s)
    assert _compute(flat.backward_weight) == pytest.approx(w_s)
    # under a pipeline I drops the unsharding (0.1 s a block) and the weight steps before the
    # last drop the reduction (0.3 s) and cast (6 s) or add (10 s)
    plan = _stage_plan(priced, 1, 3, 1, pipelined=True)
    assert _compute(plan.backward_input) == pytest.approx(i_s - 0.1)
    assert _compute(plan.backward_weight_first) == pytest.approx(w_s - 0.3 + 6)
    assert _compute(plan.backward_weight_early) == pytest.approx(w_s - 0.3 + 10)
    assert _compute(plan.backward_weight_last) == pytest.approx(w_s + 10)


def _op(name: str, hook: str = "", phase: Phase = Phase.FORWARD, n: int = 8) -> OpRecord:
    t = TensorMeta(shape=(n,), dtype="float32", stride=(1,))
    return OpRecord(op=name, inputs=(t,), outputs=(t,), phase=phase, hook=hook)


def test_the_digest_keeps_what_fsdp_runs_around_its_collectives():
    # ops from the table: a cast in the pre-forward 2 ms, a copy-out 3 ms, the model's matmul
    # 10 ms, the cast of the unit's inputs 1 ms, the reduction's copy-in 4 ms; FSDP2's host work
    # 0.5 ms an all-gather, 0.7 ms a unit (booked on its reduction), on one rank's own cores
    cast, copy_out = _op("aten._to_copy.default", "pre_forward"), _op("aten.copy_.default", "all_gather_copy_out")
    mm, inputs = _op("aten.mm.default"), _op("aten._to_copy.default", "cast_forward_inputs", n=4)
    copy_in = _op("fsdp.chunk_cat.default", "post_backward_reduce", Phase.BACKWARD)
    gather = CollectiveRecord(kind=CollectiveKind.ALL_GATHER, bytes=64, group_size=2, mesh_axis="dp_shard",
                              op="c10d._allgather_base_.default")
    reduce = CollectiveRecord(kind=CollectiveKind.REDUCE_SCATTER, bytes=64, group_size=2, mesh_axis="dp_shard",
                              phase=Phase.BACKWARD, op="c10d._reduce_scatter_base_.default")
    table = {profile_key(cast): 2e-3, profile_key(copy_out): 3e-3, profile_key(mm): 10e-3,
             profile_key(inputs): 1e-3, profile_key(copy_in): 4e-3}
    cluster = dataclasses.replace(load_cluster("dgx-h100", gpus=8), fsdp_gather_s=0.5e-3, fsdp_reduce_s=0.7e-3)
    pricer = Pricer(cluster, lambda _: None, table)
    fwd = pricer.digest([Segment(part=Part.BLOCK, phase=Phase.FORWARD, layer=0,
                                 events=(inputs, cast, gather, copy_out, mm))])
    assert fwd.compute_s == pytest.approx(16.5e-3)
    assert fwd.gather_s == pytest.approx(5.5e-3) and fwd.reduce_s == 0.0
    bwd = pricer.digest([Segment(part=Part.BLOCK, phase=Phase.BACKWARD, layer=0, events=(mm, copy_in, reduce))])
    assert bwd.compute_s == pytest.approx(14.7e-3)
    assert bwd.reduce_s == pytest.approx(4e-3) and bwd.gather_s == 0.0  # the unit's hooks run every backward
    # the priced piece carries them
    assert SymbolicPricer(cluster, table).priced(fwd).gather_s == pytest.approx(5.5e-3)


def test_op_roles_follow_fsdp_hooks():
    assert [op_role(_op("aten.copy_.default", h)) for h in
            ("pre_backward", "backward_prefetch", "all_gather", "post_backward_reduce", "post_forward", "")] == [
        "gather", "gather", "gather", "reduce", "", ""]


def test_role_seconds_follow_the_compute_they_are_part_of():
    # a piece of 2 traced blocks is 2 blocks' worth: one block holds half of each (4 s of
    # compute, of it 2 s unsharding and 1 s reduction, over 2); stretched 3x, all three are
    from topomesh.sim.price import _per_block

    one = _per_block(Work(compute_s=4.0, gather_s=2.0, reduce_s=1.0), 2)
    assert (one.compute_s, one.gather_s, one.reduce_s) == (2.0, 1.0, 0.5)
    scaled = one.scaled(3.0, 1.0)
    assert (scaled.compute_s, scaled.gather_s, scaled.reduce_s) == (6.0, 3.0, 1.5)


def test_a_stage_reduces_after_its_last_backward_in_one_piece_the_rank_waits_for():
    # PyTorch's schedules reduce a stage's gradients in perform_reduce_grad, after its last
    # backward: the two blocks' reductions (0.7 s each) and their copies (0.3 s each) leave the
    # block pieces (2 x (0.9 - 0.3 + 10) = 21.2 s of compute, nothing reduced) for one last piece
    # (0.6 s, both reductions, waited for); the 21.8 s in all stay. On shared cores, where the
    # reductions are booked blocking, the pieces stay as they were.
    from topomesh.sim.price import Comm, Stream

    red = Comm("dp_shard", Stream.NET, 0.7, role="reduce")
    p = _priced()
    p = dataclasses.replace(p, bwd_block=dataclasses.replace(p.bwd_block, reduce=(red,)))
    plan = _stage_plan(p, 1, 3, 2, pipelined=True)
    *blocks, last = plan.backward_last
    assert sum(len(pc.work.reduce) for pc in blocks) == 0 and _compute(blocks) == pytest.approx(21.2)
    assert last.count == 1 and last.work.wait_reduce and last.work.reduce == (red, red)
    assert last.work.compute_s == pytest.approx(0.6) and _compute(plan.backward_last) == pytest.approx(21.8)
    assert not any(pc.work.wait_reduce for pc in plan.backward_early)
    shared = dataclasses.replace(p, bwd_block=dataclasses.replace(p.bwd_block, reduce=(), blocking=(red,)))
    kept = _stage_plan(shared, 1, 3, 2, pipelined=True).backward_last
    assert len(kept) == 1 and kept[0].work.blocking == (red,) and not kept[0].work.wait_reduce
