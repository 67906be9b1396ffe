from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from topomesh.errors import LayoutError
from topomesh.models.presets import get_preset
from topomesh.models.transformer import Arch, Transformer, TransformerConfig
from topomesh.search.prune import (
    PruneReason,
    PruneSetup,
    StateBytes,
    memory_lower_bound_bytes,
    prune,
)
from topomesh.search.space import KnobTable, enumerate_space

# 6 layers, 8 heads, 2 KV heads, MLP width 100, sequence 24.
DENSE = TransformerConfig(
    name="t-dense", arch=Arch.LLAMA, n_layers=6, hidden=64, n_heads=8, n_kv_heads=2,
    ffn_hidden=100, vocab_size=256, seq_len=24,
)
MHA = dataclasses.replace(DENSE, name="t-mha", n_kv_heads=None)
MOE = dataclasses.replace(DENSE, name="t-moe", n_experts=4, top_k=2)
BIG = 2**40


def reason_of(cfg, degrees, *, global_batch=96, memory=BIG, knobs=None) -> list[str | None]:
    """The prune verdict of the single layout with these degrees, per knob row."""
    world = int(np.prod(list(degrees.values())))
    space = enumerate_space(world, strategies=list(degrees), fixed=degrees, knobs=knobs)
    assert len(space.degrees) == 1
    res = prune(space, PruneSetup(model=cfg, global_batch=global_batch, device_memory_bytes=memory))
    return [None if r < 0 else list(PruneReason)[r].value for r in res.reason[0]]


@pytest.mark.parametrize(
    ("cfg", "degrees", "expected"),
    [
        (DENSE, {"tp": 16}, "tp_heads"),  # 8 heads % 16
        (DENSE, {"tp": 4}, "tp_kv_heads"),  # 2 KV heads % 4
        (MHA, {"tp": 8}, "tp_ffn"),  # 8 heads, 8 KV heads, but 100 % 8 = 4
        (MHA, {"tp": 4}, None),  # 100 % 4 = 0
        (DENSE, {"pp": 4}, "pp_layers"),  # 6 % 4
        (DENSE, {"pp": 3}, None),
        (DENSE, {"cp": 8}, "cp_sequence"),  # 24 % 16
        (DENSE, {"cp": 3}, None),  # 24 % 6 = 0
        (DENSE, {"ep": 2}, "ep_dense_model"),
        (MOE, {"ep": 8}, "ep_experts"),  # 4 experts % 8
        (MOE, {"ep": 4}, None),
        (DENSE, {"dp_shard": 64}, "dp_batch"),  # 96 % 64
        (DENSE, {"dp_shard": 32, "dp_replicate": 3}, None),  # 96 % 96 = 0
        (DENSE, {"dp_shard": 32, "dp_replicate": 6}, "dp_batch"),  # 96 % 192
        (MOE, {"dp_shard": 32, "ep": 4}, None),  # ep does not split the batch
    ],
)
def test_each_divisibility_reason(cfg, degrees, expected):
    assert reason_of(cfg, degrees) == [expected]


def test_the_first_failed_check_is_the_reason():
    # tp=16 fails heads, KV heads and the MLP width; counted once, under heads.
    assert reason_of(DENSE, {"tp": 16}) == ["tp_heads"]


def test_micro_batch_and_interleave_knobs():
    knobs = KnobTable.product(micro_batch=(1, 2, 4), schedule=("1f1b", "interleaved-1f1b"), interleave=(2, 3))
    got = reason_of(DENSE, {"pp": 2, "dp_shard": 12}, knobs=knobs)
    # 96 samples over 12 replicas: 8 per replica, so micro-batch 1, 2, 4 divide.
    # 6 layers: pp*v = 4 does not divide, pp*v = 6 does.
    assert got == [None, "pp_interleave_layers", None] * 3
    got = reason_of(DENSE, {"pp": 2, "dp_shard": 32}, knobs=KnobTable.product(micro_batch=(1, 2, 3)))
    assert got == [None, "dp_batch", None]  # 96 = 32 * 3 per replica


def test_v_shaped_schedules_hold_two_stages_per_rank():
    knobs = KnobTable.product(schedule=("zbv", "dualpipev"), interleave=(3,))
    assert knobs.interleave.tolist() == [2, 2]
    # 6 layers in 2 * pp stages: pp=3 gives 6 stages, pp=2 gives 4.
    assert reason_of(DENSE, {"pp": 3}, knobs=knobs) == [None, None]
    assert reason_of(DENSE, {"pp": 2}, knobs=knobs) == ["pp_interleave_layers"] * 2


def test_schedules_count_once_without_a_pipeline():
    knobs = KnobTable.product(micro_batch=(1, 2), schedule=("gpipe", "1f1b"))
    assert reason_of(DENSE, {"tp": 2}, knobs=knobs) == [None, "schedule_without_pp"] * 2
    assert reason_of(DENSE, {"tp": 2, "pp": 2}, knobs=knobs) == [None, None] * 2


def test_counts_weigh_each_row_by_its_orders():
    # tiny-llama (2 layers, 8 heads, 4 KV heads, ffn 160) on 8 ranks over tp, pp, cp (seq 32):
    #   tp=8 (1 order): KV heads; pp=8 (1), tp=2 pp=4 (2), pp=4 cp=2 (2): layers;
    #   cp=8 (1): 32 % 16 = 0 kept; tp=4 pp=2 (2), tp=4 cp=2 (2), tp=2 cp=4 (2), pp=2 cp=4 (2),
    #   tp=2 pp=2 cp=2 (6) kept.
    space = enumerate_space(8, strategies=["tp", "pp", "cp"])
    res = prune(space, PruneSetup(model=get_preset("tiny-llama"), global_batch=4, device_memory_bytes=BIG))
    assert res.pruned["tp_kv_heads"] == 1
    assert res.pruned["pp_layers"] == 1 + 2 + 2
    assert res.kept == 1 + 2 + 2 + 2 + 2 + 6
    assert res.kept + res.n_pruned == space.size == 3 + 3 * 2 * 2 + 6


def test_memory_reason_at_the_bound():
    # tiny-llama, tp=2: the hand-computed bound of the single stage (see the next test's
    # method): params (16384 emb + 2 * 43136 blocks + 16448 head) / 2 * 16 B = 952,832;
    # activations 2 layers * 2 B * 1 * 32 * 64 / 2 = 4,096.
    bound = (16384 + 2 * 43136 + 16448) // 2 * 16 + 2 * 2 * 32 * 64 // 2
    assert bound == 956_928
    cfg = get_preset("tiny-llama")
    assert reason_of(cfg, {"tp": 2}, global_batch=4, memory=bound) == [None]
    assert reason_of(cfg, {"tp": 2}, global_batch=4, memory=bound - 1) == ["memory"]


def stage0_params(cfg: TransformerConfig, layers: int) -> int:
    """Parameters of the embeddings and the first ``layers`` blocks, counted by torch."""
    with torch.device("meta"):
        model = Transformer(cfg)
    parts = [model.tok_embeddings, *list(model.layers.values())[:layers]]
    if model.pos_embeddings is not None:
        parts.append(model.pos_embeddings)
    return sum(p.numel() for m in parts for p in m.parameters())


def test_memory_bound_by_hand_dense_llama():
    cfg = get_preset("tiny-llama")  # hidden 64, 8 heads, 4 KV heads (width 32), ffn 160, vocab 256
    block = (64 * 64 * 2 + 2 * 64 * 32) + 3 * 64 * 160 + 2 * 64  # attn + SwiGLU + 2 RMSNorms
    assert block == 43_136
    assert stage0_params(cfg, 1) == 256 * 64 + block == 59_520
    # tp=2, pp=2, dp_shard=2, micro-batch 4, sequence parallel: 59,520 / 2 / 2 = 14,880 parameters,
    # 14 B of weights and optimizer state each = 208,320; gradients 2 B each = 29,760; one block
    # input 2 B * 4 * 32 * 64 / 2 = 8,192 — under a pipeline the larger of those two, not both
    got = memory_lower_bound_bytes(cfg, tp=2, pp=2, dp_shard=2, micro_batch=4)
    assert float(got) == 208_320 + 29_760
    # without a pipeline both (the gradients exist all along): pp=1 holds both blocks and the head
    got = memory_lower_bound_bytes(cfg, tp=2, dp_shard=2, micro_batch=4)
    head = 256 * 64 + 64
    assert float(got) == (59_520 + block + head) / 4 * 16 + 2 * 8_192


def test_memory_bound_by_hand_moe_without_sequence_parallel():
    cfg = get_preset("tiny-moe")  # 4 experts of 3 * 64 * 96, router 64 * 4
    experts = 4 * 3 * 64 * 96
    dense_block = (64 * 64 * 2 + 2 * 64 * 32) + 64 * 4 + 2 * 64
    assert stage0_params(cfg, 1) == 256 * 64 + dense_block + experts
    # tp=2, pp=2, ep=4: dense (16384 + 12672) / 2 = 14,528, experts 73,728 / 4 = 18,432;
    # (14,528 + 18,432) * 16 B = 527,360 with the gradients (65,920), which under a pipeline
    # count instead of the block input (not split by tp: 2 * 1 * 32 * 64 = 4,096), the smaller.
    got = memory_lower_bound_bytes(cfg, tp=2, pp=2, ep=4, sequence_parallel=False)
    assert float(got) == 527_360


def test_memory_bound_by_hand_gpt_single_stage_with_cp():
    cfg = get_preset("tiny-gpt")  # hidden 64, 4 heads, ffn 256, vocab 256, seq 32, biases, LayerNorm
    with torch.device("meta"):
        total = sum(p.numel() for p in Transformer(cfg).parameters())
    block = (4 * 64 * 64 + 4 * 64) + (2 * 64 * 256 + 256 + 64) + 2 * 2 * 64
    assert total == (256 * 64 + 32 * 64) + 2 * block + (256 * 64 + 2 * 64) == 134_912
    # pp=1 holds everything; FSDP over dp_shard * cp = 8: 134,912 / 8 * 16 B = 269,824;
    # 2 blocks of input, sequence 32 / cp 2: 2 * 2 B * 2 * 16 * 64 = 8,192.
    got = memory_lower_bound_bytes(cfg, dp_shard=4, cp=2, micro_batch=2)
    assert float(got) == 269_824 + 8_192
    # Megatron's fp32 gradients: 18 B per parameter (NOTES.md).
    got = memory_lower_bound_bytes(cfg, dp_shard=4, cp=2, micro_batch=2, state=StateBytes(grad=4))
    assert float(got) == 134_912 / 8 * 18 + 8_192


def test_memory_bound_broadcasts_over_arrays():
    cfg = get_preset("llama3-70b")
    tp = np.array([1, 2, 4, 8])
    got = memory_lower_bound_bytes(cfg, tp=tp, pp=8, dp_shard=16)
    assert got.shape == (4,)
    assert np.all(np.diff(got) < 0)  # more tp, less per rank
    assert got[3] == memory_lower_bound_bytes(cfg, tp=8, pp=8, dp_shard=16)


def test_setup_errors():
    with pytest.raises(LayoutError, match="positive integer global_batch, got 0"):
        PruneSetup(model=DENSE, global_batch=0, device_memory_bytes=1)
    with pytest.raises(LayoutError, match="positive integer seq_len, got -4"):
        PruneSetup(model=DENSE, global_batch=8, device_memory_bytes=1, seq_len=-4)
