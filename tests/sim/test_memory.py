"""Activation memory from the traced graph's liveness, against Korthikanti et al.'s formulas.

Korthikanti et al. (arXiv:2205.05198, Table 2) count, per GPT layer and micro-batch,
s·b·h·(34 + 5·a·s/h) bytes in 16-bit training. Their block has two dropouts whose masks
(s·b·h bytes each) this model does not have, and it stores the attention scores (the
5·a·s²·b term) that a fused (flash) attention kernel never materializes: it keeps its output
(already among the 34) and the float32 log-sum-exp, 4·a·s·b bytes. So the formula for this
block is s·b·h·32 + 4·a·s·b (+ 4·s·b for the two layer norms' 16-bit statistics).
Full recompute keeps the block input only: 2·s·b·h.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from topomesh.models.parallelize import Checkpointing, ParallelOptions, make_parallelize
from topomesh.models.presets import get_preset
from topomesh.trace.result import Part, Phase
from topomesh.trace.tracer import trace_step, transformer_spec


def block_saved(preset: str, *, batch: int, checkpointing: str = "none", layout: dict | None = None,
                sequence_parallel: bool = True) -> int:
    cfg = get_preset(preset)
    opts = ParallelOptions(checkpointing=Checkpointing(checkpointing), sequence_parallel=sequence_parallel)
    t = trace_step(transformer_spec(cfg), make_parallelize(opts),
                   layout or {"dp_shard": 1}, n_layers=1, batch_size=batch, dtype=torch.bfloat16)
    (seg,) = [s for s in t.segments if s.part is Part.BLOCK and s.phase is Phase.FORWARD]
    return seg.saved_bytes


@pytest.mark.parametrize("preset", ["gpt-22b", "gpt-175b"])
def test_gpt_block_activations_match_the_formula(preset):
    cfg = get_preset(preset)
    s, b, h, a = cfg.seq_len, 1, cfg.hidden, cfg.n_heads
    formula = s * b * h * 32 + 4 * a * s * b
    got = block_saved(preset, batch=b)
    assert got == pytest.approx(formula, rel=0.10)
    # the unmodified paper figure with dropout masks and stored scores is far larger
    assert got < s * b * h * (34 + 5 * a * s / h)


def test_full_recompute_keeps_only_the_block_input():
    cfg = get_preset("gpt-22b")
    assert block_saved("gpt-22b", batch=2, checkpointing="full") == 2 * cfg.seq_len * 2 * cfg.hidden


def test_tensor_parallel_without_sequence_parallel():
    # TP shards the attention and MLP insides (24/t of the 34) and keeps the 10·s·b·h of
    # layer-norm inputs and block edges whole (Table 2, "TP" row); the two dropout masks of
    # those 10 are absent here, and flash attention keeps 4·(a/t)·s·b of log-sum-exp.
    cfg = get_preset("gpt-22b")
    s, h, t = cfg.seq_len, cfg.hidden, 8
    got = block_saved("gpt-22b", batch=1, layout={"tp": t}, sequence_parallel=False)
    assert got == pytest.approx(s * h * (8 + 24 / t) + 4 * cfg.n_heads // t * s, rel=0.10)


def test_sequence_parallel_as_pytorch_saves_it():
    # Megatron's TP+SP keeps s·b·h/t·34 (Table 2). PyTorch's SequenceParallel feeds the QKV and
    # the first MLP matmul with the all-gathered (full-sequence) layer-norm output and autograd
    # saves that gathered tensor: 2·s·b·h each instead of 2·s·b·h/t. So this block keeps
    # s·b·h/t·32 + 2·(2·s·b·h)·(1 - 1/t) + 4·(a/t)·s·b.
    cfg = get_preset("gpt-22b")
    s, h, t, a = cfg.seq_len, cfg.hidden, 8, cfg.n_heads
    got = block_saved("gpt-22b", batch=1, layout={"tp": t}, sequence_parallel=True)
    assert got == pytest.approx(s * h / t * 32 + 4 * s * h * (1 - 1 / t) + 4 * a // t * s, rel=0.10)


def test_one_f_one_b_activations_peak_at_p_minus_r_micro_batches():
    """1F1B: rank r runs p - r forwards before its first backward and then one of each, so it
    keeps p - r micro-batches of activations at most (Narayanan et al. 2021, §2.2). Stage
    blocks keep 100 B each, 2 blocks per stage: rank r peaks at (4 - r) × 200 B."""
    from topomesh.sim.price import PricedClass, Work
    from topomesh.sim.schedules import action_order
    from topomesh.sim.simulate import _memory, _stage_plan
    from topomesh.trace.result import StateBytes

    empty = Work()
    p = PricedClass(fwd_pre=empty, fwd_block=Work(saved_bytes=100), fwd_post=empty, bwd_post=empty, bwd_block=empty,
                    bwd_pre=empty, opt_block=empty, opt_first=empty, opt_last=empty, block_state=StateBytes(),
                    first_state=StateBytes(), last_state=StateBytes(), boundary_bytes=0)
    layers = [2, 2, 2, 2]
    plans = [_stage_plan(p, s, 4, n, pipelined=True) for s, n in enumerate(layers)]
    actions = action_order("1f1b", pp=4, microbatches=8)
    got = [_memory(p, plans, layers, actions[r], r, [0, 1, 2, 3]).activations_bytes for r in range(4)]
    assert got == [800, 600, 400, 200]


def test_one_pass_follows_what_is_live_piece_by_piece():
    """A one-stage FSDP rank, 2 blocks; hand numbers. Forward saves 10 (embedding), 100 a
    block, 50 (head); the root unit gathers 40 for the embedding's forward and again for the
    head's backward (reduced, 80, with the embedding's backward); a block gathers 20 and
    reduces 30; largest outputs 5 (forward), 7 (head backward), 6 (block backward), 3
    (embedding backward).

    Forward: embedding 10 + 2 x 40 + 5 = 95; block 1: 110 + 2 x 20 + 5 = 155; block 2: 255;
    head: 260 + 0 + 5 = 265. Backward: head starts at 260 + 2 x 40 + 7 = 347 (its own 50
    gone: 210 + 40 + 7 = 257 at its end), the root's 40 then held; block 2 starts at
    210 + 40 + 2 x 20 + 6 = 296, ends at 110 + 40 + 20 + 2 x 30 + 6 = 236; block 1 196 and
    136; embedding 10 + 40 + 3 = 53 and 0 + 40 + 2 x 80 + 3 = 203. The most: 347, where adding
    the largest activations (260) to the largest transient (2 x 20 + 2 x 30 + 6 = 106 for a
    block, 2 x 80 + 3 = 163 for the embedding) would say 423."""
    from topomesh.sim.engine import Piece, StagePlan
    from topomesh.sim.price import PricedClass, Work
    from topomesh.sim.simulate import _one_pass_bytes
    from topomesh.trace.result import StateBytes

    fwd_pre = Work(saved_bytes=10, gather_bytes=40, peak_output_bytes=5)
    fwd_block = Work(saved_bytes=100, gather_bytes=20, peak_output_bytes=5)
    fwd_post = Work(saved_bytes=50, peak_output_bytes=5)
    bwd_post = Work(gather_bytes=40, peak_output_bytes=7)
    bwd_block = Work(gather_bytes=20, reduce_bytes=30, peak_output_bytes=6)
    bwd_pre = Work(reduce_bytes=80, peak_output_bytes=3)
    empty, state = Work(), StateBytes()
    p = PricedClass(fwd_pre=fwd_pre, fwd_block=fwd_block, fwd_post=fwd_post, bwd_post=bwd_post, bwd_block=bwd_block,
                    bwd_pre=bwd_pre, opt_block=empty, opt_first=empty, opt_last=empty, block_state=state,
                    first_state=state, last_state=state, boundary_bytes=0)
    def pieces(*items: tuple[Work, int, str]) -> tuple[Piece, ...]:
        return tuple(Piece(work=w, count=n, label=label) for w, n, label in items)

    plan = StagePlan(forward=pieces((fwd_pre, 1, "embed fwd"), (fwd_block, 2, "block fwd"), (fwd_post, 1, "head fwd")),
                     backward=pieces((bwd_post, 1, "head bwd"), (bwd_block, 2, "block bwd"), (bwd_pre, 1, "embed bwd")),
                     backward_input=(), backward_weight=(), optimizer=())
    assert _one_pass_bytes(p, plan) == 347
    # a large reduction at the end now sets the peak: embedding's 80 -> 200 ends at 40 + 400 + 3
    bigger = dataclasses.replace(plan, backward=(*plan.backward[:2], *pieces((dataclasses.replace(bwd_pre, reduce_bytes=200), 1, "embed bwd"))))
    assert _one_pass_bytes(p, bigger) == 443


def _stage_class(saved: int, boundary: int, weight_out: int = 0, grads: int = 0, head: int = 0):  # noqa: ANN202
    from topomesh.sim.price import PricedClass, Work
    from topomesh.trace.result import StateBytes

    empty = Work()
    return PricedClass(fwd_pre=empty, fwd_block=Work(saved_bytes=saved, weight_output_bytes=weight_out),
                       fwd_post=empty, bwd_post=empty,
                       bwd_block=empty, bwd_pre=empty, opt_block=empty, opt_first=empty, opt_last=empty,
                       block_state=StateBytes(grads=grads), first_state=StateBytes(), last_state=StateBytes(),
                       boundary_bytes=boundary, head_output_bytes=head)


def test_a_pipeline_stage_keeps_its_output_until_the_micro_batch_s_backward():
    """PyTorch's PipelineStage keeps each micro-batch's output (fwd_cache) until its backward
    (or I): the boundary activation (10 here) on a first stage, the logits (40) on the last.
    1F1B, pp=2, 2 micro-batches, 100 saved a micro-batch: stage 0 F0 F1 B0 B1 holds 110, 220;
    stage 1 F0 B0 F1 B1 holds 140 at most. F0 I0 F1 W0 I1 W1 on stage 0 (30 kept from I to W):
    110, 130 (the output gone at I), 240, 110, 130, 0. ``validate_llama.json`` under GPipe, pp=2,
    4 micro-batches: the last stage measured 58.3 MB with four micro-batches' 1.05 MB of bf16
    logits live, predicted 54.0 MB without them, 58.2 MB with."""
    from topomesh.sim.schedules import Action, Kind, action_order
    from topomesh.sim.simulate import _memory, _stage_plan

    p = _stage_class(100, 10, weight_out=30, head=40)
    plans = [_stage_plan(p, s, 2, 1, pipelined=True) for s in range(2)]
    order = action_order("1f1b", pp=2, microbatches=2)
    assert [_memory(p, plans, [1, 1], order[r], r, [0, 1]).activations_bytes for r in (0, 1)] == [220, 140]
    zb = [Action(0, Kind.F, 0), Action(0, Kind.I, 0), Action(0, Kind.F, 1), Action(0, Kind.W, 0),
          Action(0, Kind.I, 1), Action(0, Kind.W, 1)]
    assert _memory(p, plans, [1, 1], zb, 0, [0, 1]).activations_bytes == 240
    one = _memory(p, [_stage_plan(p, 0, 1, 2)], [2], action_order("1f1b", pp=1, microbatches=2)[0], 0, [0])
    assert one.activations_bytes == 200  # no pipeline: no stage output kept (the loss keeps its own copy)


def test_the_head_output_is_the_last_forward_matmul_after_the_blocks():
    from topomesh.sim.price import head_output_bytes
    from topomesh.trace.graph import OpRecord, Phase, TensorMeta
    from topomesh.trace.result import Part, Segment

    def rec(op, shape, dtype="bfloat16", phase=Phase.FORWARD):  # noqa: ANN001, ANN202
        meta = TensorMeta(shape=shape, dtype=dtype, stride=(shape[1], 1))
        return OpRecord(op=op, inputs=(), outputs=(meta,), flops=0, phase=phase)

    # a projection of a user's own head, final norm, the vocabulary projection (256 tokens x
    # 2048, bf16), then the loss's float32 copy
    post = Segment(part=Part.REST, phase=Phase.FORWARD, events=(
        rec("aten.mm.default", (256, 64)), rec("aten._fused_rms_norm.default", (256, 256)),
        rec("aten.mm.default", (256, 2048)),
        rec("aten._to_copy.default", (256, 2048), "float32"), rec("aten._log_softmax.default", (256, 2048), "float32")))
    assert head_output_bytes([post]) == 256 * 2048 * 2
    assert head_output_bytes([]) == 0


@pytest.mark.parametrize("schedule, rank, micro, want", [
    # GPipe, last stage: F0 F1 hold 200 before any gradient; B0 leaves 100 and the gradients (80)
    ("gpipe", 1, 2, 200),
    # 1F1B, last stage: F0 B0 F1 B1 — never more than one micro-batch, gradients from B0 on
    ("1f1b", 1, 2, 180),
    # the same over 3 micro-batches: F2 holds 100 with the gradients made once (80), not per B
    ("1f1b", 1, 3, 180),
    # 1F1B, first stage of two with 2 micro-batches: F0 F1 (200) B0 B1 — as GPipe there
    ("1f1b", 0, 2, 200),
])
def test_gradients_exist_from_a_ranks_first_backward(schedule, rank, micro, want):
    """The optimizer sets the gradients to None every step; a rank's first backward makes
    them as it frees its activations. ``validate_llama.json``, ``pp=2,dp_replicate=2``, GPipe,
    2 micro-batches: its last stage measured 53.4 MB, predicted 59.2 MB with both micro-batches'
    activations and the gradients together; 1F1B measured 51.1 MB. Hand counts: 100 saved a
    micro-batch, gradients 80, pp=2."""
    from topomesh.sim.schedules import action_order
    from topomesh.sim.simulate import _memory, _stage_plan

    p = _stage_class(100, 0, grads=80)
    plans = [_stage_plan(p, s, 2, 1, pipelined=True) for s in range(2)]
    got = _memory(p, plans, [1, 1], action_order(schedule, pp=2, microbatches=micro)[rank], rank, [0, 1])
    assert got.grads_bytes == 80 and got.peak_bytes == want


def test_each_stage_s_gradients_exist_from_its_own_first_backward():
    """Rank 1 of ``pp=2``, interleaved zero-bubble, 2 micro-batches, holds stages 1 and 3
    (100 saved a micro-batch, 30 kept from I to W, gradients 80 each). Its order F1.0 F1.1 F3.0
    I3.0 F3.1 I3.1 W3.0 I1.0 W3.1 I1.1 W1.0 W1.1 holds 100, 200, 300, 330, 430, 460, then 330
    with stage 3's gradients (410), 360 (440), 230 (310), 260 (340), 130 with both stages' (290),
    0 (160): peak 460, before any W. Counting all of a rank's gradients from its first W would
    say 360 + 160 = 520; the old sum, 460 + 160 = 620. ``validate_llama.json`` at 64 tokens:
    this rank measured 19.2 MB, predicted 21.3 before, 19.8 now."""
    from topomesh.sim.schedules import Schedule, action_order, rank_stages
    from topomesh.sim.simulate import _memory, _stage_plan

    p = _stage_class(100, 0, weight_out=30, grads=80)
    plans = [_stage_plan(p, s, 4, 1, pipelined=True) for s in range(4)]
    stage_rank = [0] * 4
    for r in range(2):
        for s in rank_stages(Schedule("interleaved-zb"), 2, 2, r):
            stage_rank[s] = r
    order = action_order("interleaved-zb", pp=2, microbatches=2, interleave=2)[1]
    assert [f"{a.kind.value}{a.stage}.{a.mb}" for a in order] == [
        "F1.0", "F1.1", "F3.0", "I3.0", "F3.1", "I3.1", "W3.0", "I1.0", "W3.1", "I1.1", "W1.0", "W1.1"]
    got = _memory(p, plans, [1] * 4, order, 1, stage_rank)
    assert (got.grads_bytes, got.activations_bytes, got.grads_at_peak_bytes, got.peak_bytes) == (160, 460, 0, 460)


@pytest.mark.parametrize("schedule, pp, interleave, micro, want", [
    # 1F1B, 4 stages: the first and the last stage receive in one direction, the middle ones in both
    ("1f1b", 4, 1, 8, [8 * 10, 16 * 10, 16 * 10, 8 * 10]),
    # interleaved, 4 stages on 2 ranks: rank 0 holds 0 (a gradient) and 2 (both), rank 1 holds 1 (both) and 3 (an input)
    ("interleaved-1f1b", 2, 2, 4, [3 * 4 * 10, 3 * 4 * 10]),
    # V: rank 0 holds 0 and 3 (one each), rank 1 holds 1 and 2 (both each)
    ("zbv", 2, 1, 4, [2 * 4 * 10, 4 * 4 * 10]),
])
def test_pipeline_stages_keep_a_receive_buffer_per_micro_batch(schedule, pp, interleave, micro, want):
    """PyTorch's PipelineStage makes, before the first step, one buffer per micro-batch for its
    input (all but the first stage) and for its output's gradient (all but the last), each the
    boundary's bytes (10 here): measured on ``validate_llama.json``, pp=2, 8 micro-batches,
    8 blocks of 128 KiB a rank with 1F1B, 24 interleaved."""
    from topomesh.sim.schedules import Schedule, action_order, rank_stages, stage_count
    from topomesh.sim.simulate import _memory, _stage_plan

    p = _stage_class(100, 10)
    stages = stage_count(Schedule(schedule), pp, interleave)
    layers = [1] * stages
    stage_rank = [0] * stages
    for r in range(pp):
        for s in rank_stages(Schedule(schedule), pp, interleave, r):
            stage_rank[s] = r
    plans = [_stage_plan(p, s, stages, n, pipelined=True) for s, n in enumerate(layers)]
    actions = action_order(schedule, pp=pp, microbatches=micro, interleave=interleave)
    got = [_memory(p, plans, layers, actions[r], r, stage_rank) for r in range(pp)]
    assert [m.receive_bytes for m in got] == want
    assert all(m.peak_bytes == m.activations_bytes + m.transient_bytes + m.receive_bytes for m in got)
    one = _memory(p, [_stage_plan(p, 0, 1, 2)], [2], action_order("1f1b", pp=1, microbatches=4)[0], 0, [0])
    assert one.receive_bytes == 0  # no pipeline, nothing received


def test_a_zero_bubble_micro_batch_keeps_its_activations_until_its_weight_gradients():
    """``stage_backward_input`` runs autograd with ``retain_graph``: the saved tensors stay until
    the W, and with them the gradient at each node leading to a weight (its matmuls' outputs,
    30 here). Hand order F0 I0 F1 W0 I1 W1 on one stage saving 100 a micro-batch: 100, 130,
    230, 100, 130, 0 — peak 230 with both in flight (freeing at I would say 100)."""
    from topomesh.sim.schedules import Action, Kind, in_flight
    from topomesh.sim.simulate import _memory, _stage_plan

    p = _stage_class(100, 0, weight_out=30)
    order = [Action(0, Kind.F, 0), Action(0, Kind.I, 0), Action(0, Kind.F, 1), Action(0, Kind.W, 0),
             Action(0, Kind.I, 1), Action(0, Kind.W, 1)]
    got = _memory(p, [_stage_plan(p, 0, 1, 1, pipelined=True)], [1], order, 0, [0])
    assert (got.activations_bytes, got.in_flight) == (230, 2)
    one_f_one_b = [Action(0, Kind.F, 0), Action(0, Kind.B, 0), Action(0, Kind.F, 1), Action(0, Kind.B, 1)]
    assert _memory(p, [_stage_plan(p, 0, 1, 1, pipelined=True)], [1], one_f_one_b, 0, [0]).activations_bytes == 100
    assert in_flight(order) == 2


def test_a_piece_counts_its_forward_matmuls_outputs_as_what_a_zero_bubble_i_keeps():
    """Two forward ``mm`` of (4, 8) float32 outputs (128 B each), a forward ``add`` and a backward
    ``mm``: 256 B — the gradients ``stage_backward_input`` stores at the nodes leading to weights."""
    from topomesh.cost.cluster import load_cluster
    from topomesh.sim.price import Pricer
    from topomesh.trace.graph import OpRecord, Phase, TensorMeta
    from topomesh.trace.result import Part, Segment

    a = TensorMeta(shape=(4, 8), dtype="float32", stride=(8, 1))

    def op(name, phase):  # noqa: ANN001, ANN202
        return OpRecord(op=name, inputs=(a, a), outputs=(a,), flops=512, phase=phase)

    mm = op("aten.mm.default", Phase.FORWARD)
    fwd = Segment(part=Part.BLOCK, phase=Phase.FORWARD, layer=0,
                  events=(mm, op("aten.add.Tensor", Phase.FORWARD), mm))  # one record object twice
    bwd = Segment(part=Part.BLOCK, phase=Phase.BACKWARD, layer=0, events=(op("aten.mm.default", Phase.BACKWARD),))
    pricer = Pricer(load_cluster("dgx-h100", gpus=1), lambda name: None, {})
    assert pricer.digest([fwd]).weight_output_bytes == 2 * 4 * 8 * 4
    assert pricer.digest([bwd]).weight_output_bytes == 0


@pytest.mark.parametrize("interleave, want", [(2, 70 + 20), (4, 70 + 2 * 20)])
def test_the_multi_stage_runtime_keeps_at_most_three_stages_unsharded(interleave, want):
    """Under a pipeline FSDP keeps a stage's gathered parameters (20 a one-block stage here, 50
    more for the embedding on stage 0) for the step, and PyTorch's multi-stage runtime keeps at
    most three of a rank's stages unsharded at once (``_add_unshard_reshard``'s
    ``max_active_stages``): rank 0 with stages 0 and 2 holds 90; with 0, 2, 4 and 6 at most
    70 + 20 + 20 = 110, not 130."""
    import inspect

    from torch.distributed.pipelining import schedules as torch_schedules

    from topomesh.sim.price import Work
    from topomesh.sim.schedules import (
        RUNTIME_UNSHARDED_STAGES,
        Schedule,
        action_order,
        rank_stages,
        stage_count,
    )
    from topomesh.sim.simulate import _memory, _stage_plan
    from topomesh.trace.result import StateBytes

    default = inspect.signature(torch_schedules._add_unshard_reshard).parameters["max_active_stages"].default
    assert RUNTIME_UNSHARDED_STAGES == default == 3
    p = dataclasses.replace(_stage_class(100, 0), fwd_block=Work(saved_bytes=100, gather_bytes=20),
                            fwd_pre=Work(gather_bytes=50), first_state=StateBytes(params=1))
    stages = stage_count(Schedule.INTERLEAVED_1F1B, 2, interleave)
    stage_rank = [0] * stages
    for s in rank_stages(Schedule.INTERLEAVED_1F1B, 2, interleave, 1):
        stage_rank[s] = 1
    plans = [_stage_plan(p, s, stages, 1, pipelined=True) for s in range(stages)]
    order = action_order("interleaved-1f1b", pp=2, microbatches=4, interleave=interleave)
    assert _memory(p, plans, [1] * stages, order[0], 0, stage_rank).transient_bytes == want
