"""Traced steps against hand-derived formulas (Megatron TP/SP, FSDP, FLOPs, EP, checkpointing).

Shapes: tiny-llama has hidden h=64, 8 heads (4 kv heads, head dim 8), ffn 160, vocab 256,
sequence s=32; batch b=2; bf16 (2 bytes). One TP activation is b·s·h·2 = 8192 bytes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from topomesh.models.parallelize import Checkpointing, ParallelOptions, make_parallelize
from topomesh.models.presets import get_preset
from topomesh.trace.graph import CollectiveKind, CollectiveRecord, OpRecord, Phase
from topomesh.trace.result import CollectiveStats, Part, Trace
from topomesh.trace.tracer import ModelSpec, default_optimizer, trace_step, transformer_spec

B = 2
BF16 = 2


@functools.cache
def _trace(preset: str, layout: tuple, opts: ParallelOptions | None = None, *,
           layers: int = 2, optimizer: bool = False, split: bool = True) -> Trace:
    spec = transformer_spec(dataclasses.replace(get_preset(preset), n_layers=layers))
    kw = {} if optimizer else {"optimizer": None}
    return trace_step(spec, make_parallelize(opts), dict(layout), n_layers=layers, batch_size=B,
                      split_blocks=split, **kw)


def _block_collectives(t: Trace, phase: Phase) -> list[list[tuple[str, int, str | None]]]:
    return [
        sorted((e.kind.value, e.bytes, e.mesh_axis) for e in s.events if isinstance(e, CollectiveRecord))
        for s in t.segments if s.part is Part.BLOCK and s.phase is phase
    ]


def test_tp_without_sp_is_megatron_pattern() -> None:
    t = _trace("tiny-llama", (("tp", 2),), ParallelOptions(sequence_parallel=False))
    act = B * 32 * 64 * BF16
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        blocks = _block_collectives(t, phase)
        assert len(blocks) == 2
        # two all-reduces of one activation per block and direction (after wo / w2 forward,
        # at the attention / MLP inputs backward)
        assert all(b == [("all_reduce", act, "tp")] * 2 for b in blocks), blocks


def test_tp_with_sp_gathers_and_scatters_full_sequence() -> None:
    t = _trace("tiny-llama", (("tp", 2),))
    act = B * 32 * 64 * BF16  # the full sequence: gathered output / scattered input
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        for b in _block_collectives(t, phase):
            assert b == [("all_gather", act, "tp")] * 2 + [("reduce_scatter", act, "tp")] * 2
    rec = next(e for e in t.events() if isinstance(e, CollectiveRecord))
    assert rec.group_size == 2 and rec.dtype == "bfloat16"


def test_fsdp_bytes_are_the_parameters() -> None:
    cfg = dataclasses.replace(get_preset("tiny-gpt"), n_layers=4)
    t = _trace("tiny-gpt", (("dp_shard", 2),), layers=1).compose(4)
    coll = t.summary().collectives
    params_bytes = cfg.total_params() * BF16  # every dim is even: no FSDP padding
    # all-gather output = the unsharded parameters; each rank contributes params/dp_shard
    fwd = coll[("all_gather", "dp_shard", "forward")]
    assert (fwd.count, fwd.bytes) == (cfg.n_layers + 1, params_bytes)  # blocks + root
    # resharded after forward, so gathered again for backward; gradients reduce-scattered
    assert coll[("all_gather", "dp_shard", "backward")].bytes == params_bytes
    assert coll[("reduce_scatter", "dp_shard", "backward")].bytes == params_bytes
    assert all(e.group_size == 2 for e in t.events() if isinstance(e, CollectiveRecord))


def test_flops_on_local_shapes() -> None:
    tp, layers = 2, 4
    cfg = dataclasses.replace(get_preset("tiny-llama"), n_layers=layers)
    h, s, v, kv = cfg.hidden, cfg.seq_len, cfg.vocab_size, cfg.kv_heads * cfg.head_dim
    mm_params = layers * (2 * h * h + 2 * h * kv + 3 * h * cfg.ffn_hidden) + v * h
    tokens = B * s
    attn_fwd = layers * 4 * B * s * s * h  # QKᵀ and AV, non-causal as FlopCounterMode
    attn_bwd = layers * 10 * B * s * s * h  # recomputed scores + 4 gradient matmuls
    flops = _trace("tiny-llama", (("tp", tp), ("dp_shard", 2)), layers=1).compose(layers).summary().flops_by_phase
    assert flops["forward"] == (2 * tokens * mm_params + attn_fwd) // tp
    assert flops["backward"] == (4 * tokens * mm_params + attn_bwd) // tp
    # ≈ 6·N·tokens plus attention, divided by tp
    assert flops["forward"] + flops["backward"] == pytest.approx(
        (6 * mm_params * tokens + attn_fwd + attn_bwd) / tp, rel=1e-9
    )


@pytest.mark.parametrize("traced", [1, 2])
def test_composed_equals_full_trace(traced: int) -> None:
    # FSDP2 x TP/SP with AdamW: same ops (shapes, dtypes, strides, args) and collectives
    layout = (("dp_shard", 2), ("tp", 2))
    composed = _trace("tiny-llama", layout, layers=traced, optimizer=True).compose(3)
    full = _trace("tiny-llama", layout, layers=3, optimizer=True, split=False)
    assert Counter(composed.events()) == Counter(full.events())
    assert composed.summary() == full.summary()
    if traced == 1:  # FSDP's backward all-gather of the next block is carried as prefetch
        (bwd,) = [s for s in composed.segments if s.part is Part.BLOCK and s.phase is Phase.BACKWARD]
        assert [e.kind for e in bwd.prefetch if isinstance(e, CollectiveRecord)] == [CollectiveKind.ALL_GATHER]


def _block_params(cfg) -> int:  # noqa: ANN001
    h, kv = cfg.hidden, cfg.kv_heads * cfg.head_dim
    return 2 * h * h + 2 * h * kv + 3 * h * cfg.ffn_hidden + 2 * h  # wq wo, wk wv, MLP, 2 norms


def test_context_parallel_ring_attention_by_hand() -> None:
    """cp=2 without data parallel: PyTorch's ring attention, head-tail load balanced.

    Each rank holds L = s/cp tokens (two chunks of s/2cp). Per block forward: one all-gather
    of the concatenated k and v (GQA heads already repeated, 8 heads) — gathered output
    2·b·heads·s·head_dim bf16 — and cp flash-attention calls, the first L×L, the others
    half of q or of kv (L·L/2). Backward gathers k and v again and passes the fp32 key/value
    gradients around the ring in cp all-to-alls of 2·b·heads·L·head_dim·4 bytes. The
    weights are replicated over cp, so FSDP2 shards them over cp and reduce-scatters the
    gradients there.
    """
    cp = 2
    cfg = get_preset("tiny-llama")
    heads, hd, s, h = cfg.n_heads, cfg.head_dim, cfg.seq_len, cfg.hidden
    local = s // cp
    t = _trace("tiny-llama", (("cp", cp),))
    block = _block_params(cfg) * BF16
    kv_gathered = 2 * B * heads * s * hd * BF16
    dkv = 2 * B * heads * local * hd * 4
    for b in _block_collectives(t, Phase.FORWARD):
        assert b == sorted([("all_gather", block, "cp"), ("all_gather", kv_gathered, "cp")])
    # the last block's backward (the first to run) also gathers its weights again
    # (FSDP reshards after forward); the others' gathers run as prefetch in the block before
    for b in _block_collectives(t, Phase.BACKWARD):
        b = [c for c in b if c != ("all_gather", block, "cp")]
        assert b == sorted([("all_gather", kv_gathered, "cp"), ("reduce_scatter", block, "cp")]
                           + [("all_to_all", dkv, "cp")] * cp)
    attn = [e for e in t.events() if isinstance(e, OpRecord) and e.op == "aten._scaled_dot_product_flash_attention.default"]
    assert sorted(e.flops for e in attn) == sorted([4 * B * h * local * local, 4 * B * h * local * local // 2] * 2)
    # every other matmul runs on the local L tokens: half the FLOPs of cp=1
    mm = {lay: _trace("tiny-llama", lay).summary().op_flops["aten.mm.default"] for lay in ((("cp", cp),), (("dp_shard", 2),))}
    assert mm[(("cp", cp),)] * cp == mm[(("dp_shard", 2),)]


def test_context_parallel_with_tp_and_fsdp_composes() -> None:
    """dp_shard × cp × tp: FSDP2 shards over dp_shard and cp flattened (torchtitan's
    dp_shard_cp), ring attention stays on cp with tp's share of the heads, and one traced
    block composes to the full model."""
    layout = (("dp_shard", 2), ("cp", 2), ("tp", 2))
    composed = _trace("tiny-llama", layout, layers=1).compose(2)
    full = _trace("tiny-llama", layout, layers=2, split=False)
    assert Counter(composed.events()) == Counter(full.events())
    coll = composed.summary().collectives
    assert coll[("reduce_scatter", "dp_shard+cp", "backward")].count == 3  # blocks + root
    cfg = get_preset("tiny-llama")
    kv_gathered = 2 * B * (cfg.n_heads // 2) * cfg.seq_len * cfg.head_dim * BF16
    assert coll[("all_gather", "cp", "forward")] == CollectiveStats(count=2, bytes=2 * kv_gathered)
    assert {e.group_size for e in composed.events() if isinstance(e, CollectiveRecord) and e.mesh_axis == "dp_shard+cp"} == {4}
    # another order of the same axes gives the same labels: the trace cache shares them
    other = _trace("tiny-llama", (("tp", 2), ("cp", 2), ("dp_shard", 2)), layers=1).compose(2)
    assert other.summary().collectives == coll


def test_mixed_precision_gathers_bf16_reduces_fp32_updates_fp32() -> None:
    """FSDP2 MixedPrecisionPolicy over fp32 master weights: all-gathers move bf16 parameters,
    reduce-scatters fp32 gradients, matmuls run in bf16 and AdamW updates fp32 shards."""
    import torch

    cfg = get_preset("tiny-gpt")
    spec = transformer_spec(cfg)
    opts = ParallelOptions(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    t = trace_step(spec, make_parallelize(opts), {"dp_shard": 2}, n_layers=cfg.n_layers, batch_size=B,
                   dtype=torch.float32)
    coll = t.summary().collectives
    params = cfg.total_params()
    assert coll[("all_gather", "dp_shard", "forward")].bytes == params * BF16
    assert coll[("reduce_scatter", "dp_shard", "backward")].bytes == params * 4
    ops = [e for e in t.events() if isinstance(e, OpRecord)]
    assert {e.inputs[0].dtype for e in ops if e.op == "aten.mm.default"} == {"bfloat16"}
    steps = [e for e in ops if e.phase is Phase.OPTIMIZER and e.op == "aten.addcdiv_.default"]
    assert steps and {e.inputs[0].dtype for e in steps} == {"float32"}


def test_composed_equals_full_trace_moe_expert_parallel() -> None:
    layout = (("dp_shard", 2), ("ep", 2))
    composed = _trace("tiny-moe", layout, layers=1).compose(3)
    full = _trace("tiny-moe", layout, layers=3, split=False)
    assert Counter(composed.events()) == Counter(full.events())


def test_expert_parallel_all_to_all() -> None:
    cfg = get_preset("tiny-moe")
    t = _trace("tiny-moe", (("ep", 2),))
    cap = -(-B * cfg.seq_len * cfg.top_k // cfg.n_experts)  # capacity factor 1
    buf = cfg.n_experts * cap * cfg.hidden * BF16
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        for b in _block_collectives(t, phase):
            assert b == [("all_to_all", buf, "ep")] * 2


def test_full_checkpointing_recomputes_forward_and_selective_keeps_matmuls() -> None:
    layout = (("dp_shard", 2),)
    base_trace = _trace("tiny-gpt", layout, split=False)
    full_trace = _trace("tiny-gpt", layout, ParallelOptions(checkpointing=Checkpointing.FULL), split=False)
    base, full = base_trace.summary(), full_trace.summary()
    sel_trace = _trace("tiny-gpt", layout, ParallelOptions(checkpointing=Checkpointing.SELECTIVE), split=False)
    sel = sel_trace.summary()
    cfg = get_preset("tiny-gpt")
    head_fwd = 2 * B * cfg.seq_len * cfg.hidden * cfg.vocab_size
    blocks_fwd = base.flops_by_phase["forward"] - head_fwd
    # Non-reentrant checkpointing stops recomputing once every saved tensor is back: the
    # last matmul of each block (w2) is not rerun, its output is not needed for backward.
    w2_fwd = 2 * B * cfg.seq_len * cfg.ffn_hidden * cfg.hidden
    recomputed = blocks_fwd - cfg.n_layers * w2_fwd
    assert full.flops_by_phase["backward"] == base.flops_by_phase["backward"] + recomputed
    assert sel.flops_by_phase["backward"] == base.flops_by_phase["backward"]
    # selective, as a run applies it: each block's two layer norms and GELU rerun in backward
    rerun = Counter(e.op for seg in sel_trace.segments if seg.phase is Phase.BACKWARD for e in seg.events
                    if getattr(e, "op", "") in ("aten.native_layer_norm.default", "aten.gelu.default"))
    assert rerun == {"aten.native_layer_norm.default": 2 * cfg.n_layers, "aten.gelu.default": cfg.n_layers}
    kept = [sum(seg.saved_bytes for seg in t.segments) for t in (full_trace, sel_trace, base_trace)]
    assert kept[0] < kept[1] < kept[2]  # full keeps the least, selective some, none the most


def test_optimizer_updates_every_local_parameter_once() -> None:
    cfg = dataclasses.replace(get_preset("tiny-llama"), n_layers=3)
    t = _trace("tiny-llama", (("dp_shard", 2),), layers=1, optimizer=True).compose(3)
    n_params = 3 * len(list(_param_names(cfg, block=True))) + len(list(_param_names(cfg, block=False)))
    lerps = [e for e in t.events() if isinstance(e, OpRecord) and e.op == "aten.lerp_.Scalar"]
    assert len(lerps) == n_params and all(e.phase is Phase.OPTIMIZER for e in lerps)
    # each rank updates its FSDP shard: half of every parameter
    assert sum(e.inputs[0].numel for e in lerps) == cfg.total_params() // 2


def _param_names(cfg, *, block: bool):  # noqa: ANN001, ANN202
    from torch._subclasses.fake_tensor import FakeTensorMode

    from topomesh.models.transformer import Transformer

    with FakeTensorMode():
        m = Transformer(dataclasses.replace(cfg, n_layers=1))
    for name, _ in m.named_parameters():
        if name.startswith("layers.") == block:
            yield name


def test_collective_kinds_are_ours() -> None:
    t = _trace("tiny-llama", (("tp", 2),))
    kinds = {e.kind for e in t.events() if isinstance(e, CollectiveRecord)}
    assert kinds <= set(CollectiveKind) and CollectiveKind.ALL_GATHER in kinds


def test_gpt175b_preset_tp8_fsdp4_by_hand() -> None:
    # The real GPT-3 175B shape: h=12288, 96 layers, seq 2048, vocab 51200, batch 1; tp=8 with
    # SP and FSDP over dp_shard=4. One block traced, composed to 96.
    cfg = get_preset("gpt-175b")
    h, s, v, L, tp = cfg.hidden, cfg.seq_len, cfg.vocab_size, cfg.n_layers, 8
    spec = transformer_spec(cfg)
    t = trace_step(spec, make_parallelize(), {"dp_shard": 4, "tp": tp}, n_layers=1,
                   optimizer=None).compose(L)
    summary = t.summary()
    act = 1 * s * h * BF16
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        (block,) = _block_collectives(t, phase)
        tp_colls = [c for c in block if c[2] == "tp" and c[0] != "all_reduce"]
        assert tp_colls == [("all_gather", act, "tp")] * 2 + [("reduce_scatter", act, "tp")] * 2
        # SP leaves the LayerNorm weight and bias gradients partial over the sequence shards:
        # 4 small all-reduces per block before FSDP reduce-scatters them
        norm_grads = [c for c in block if c[0] == "all_reduce"]
        assert norm_grads == ([("all_reduce", h * BF16, "tp")] * 4 if phase is Phase.BACKWARD else [])
    # Parameters one TP rank holds (FSDP gathers exactly these over dp_shard):
    # column-parallel weights and biases /tp, row-parallel weights /tp with full biases,
    # LayerNorms replicated; embeddings, positions and head split by rows.
    block_local = (4 * h * h + 8 * h * h) // tp + (3 * h + 4 * h) // tp + 2 * h + 4 * h
    rest_local = (2 * v * h + s * h) // tp + 2 * h
    fwd = summary.collectives[("all_gather", "dp_shard", "forward")]
    assert (fwd.count, fwd.bytes) == (L + 1, (L * block_local + rest_local) * BF16)
    tokens = s
    assert summary.flops_by_phase["forward"] == (2 * tokens * (L * 12 * h * h + v * h) + L * 4 * s * s * h) // tp


def test_mixtral_expert_parallel_fsdp_bytes() -> None:
    # ep=8 leaves one expert per rank; FSDP shards it on dim 1 (dim 0 has 1 row), so the
    # all-gather carries the local expert plus the dense part of the block, nothing padded.
    cfg = get_preset("mixtral-8x7b")
    h, f, e = cfg.hidden, cfg.ffn_hidden, cfg.n_experts
    kv = cfg.kv_heads * cfg.head_dim
    t = trace_step(transformer_spec(cfg), make_parallelize(), {"dp_shard": 8, "ep": 8}, n_layers=1, optimizer=None)
    (fwd,) = _block_collectives(t, Phase.FORWARD)
    dense = 2 * h * h + 2 * h * kv + h * e + 2 * h  # attention, router, norms
    experts = e // 8 * 3 * h * f
    assert ("all_gather", (dense + experts) * BF16, "dp_shard") in fwd
    cap = -(-cfg.seq_len * cfg.top_k // e)
    assert [c for c in fwd if c[0] == "all_to_all"] == [("all_to_all", e * cap * h * BF16, "ep")] * 2


class _MlpBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class _Mlp(nn.Module):
    """Not a preset: an input layer, ``n`` residual MLP blocks in ``layers``, a 4-class head."""

    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(d, d), nn.Linear(d, 4)
        self.layers = nn.ModuleList(_MlpBlock(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.layers:
            x = block(x)
        return self.out(x)


def _fsdp2_defaults(model: nn.Module, mesh) -> nn.Module:  # noqa: ANN001
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # FSDP2's defaults: the root stays unsharded after forward
    return model


@pytest.mark.parametrize("optimizer", [None, default_optimizer])
def test_fsdp2_default_root_is_gathered_every_step(optimizer) -> None:  # noqa: ANN001
    # By hand, d=16, fp32: a block is fc1 16·32+32 = 544 plus fc2 32·16+16 = 528 → 1072
    # parameters; the root owns inp 16·16+16 = 272 and out 16·4+4 = 68 → 340.
    d, layers = 16, 3
    block_bytes, root_bytes = 1072 * 4, 340 * 4
    spec = ModelSpec(
        name="mlp", key="mlp", n_layers=layers, build=lambda n: _Mlp(d, n),
        make_inputs=lambda b: ((torch.randn(b, d),), torch.randint(0, 4, (b,))),
        loss=lambda out, labels: F.cross_entropy(out.float(), labels),
    )
    t = trace_step(spec, _fsdp2_defaults, {"dp_shard": 2}, batch_size=B, dtype=torch.float32, optimizer=optimizer)
    coll = t.summary().collectives
    # steady state: backward resharded the root, so forward gathers it again with every block
    fwd = coll[("all_gather", "dp_shard", "forward")]
    assert (fwd.count, fwd.bytes) == (layers + 1, layers * block_bytes + root_bytes)
    # the root stays gathered from forward into backward; only the blocks are gathered again
    bwd = coll[("all_gather", "dp_shard", "backward")]
    assert (bwd.count, bwd.bytes) == (layers, layers * block_bytes)
    rs = coll[("reduce_scatter", "dp_shard", "backward")]
    assert (rs.count, rs.bytes) == (layers + 1, layers * block_bytes + root_bytes)


def test_warm_up_leaves_no_gradients_behind() -> None:
    # A plain model's first step is already its steady state: the warm-up may change nothing
    # in the traced step (gradients left from it would add an accumulation per parameter).
    spec = ModelSpec(
        name="mlp", key="mlp", n_layers=2, build=lambda n: _Mlp(16, n),
        make_inputs=lambda b: ((torch.randn(b, 16),), torch.randint(0, 4, (b,))),
        loss=lambda out, labels: F.cross_entropy(out.float(), labels),
    )
    warm, cold = (trace_step(spec, None, {}, batch_size=B, optimizer=None, warm_up=w).summary() for w in (True, False))
    assert warm.op_counts == cold.op_counts
    # 6 linears (inp, 2 × fc1/fc2, out): 6 addmm forward; backward 6 weight-gradient mm and 5
    # input-gradient mm (the model's input needs none); adds: 2 residuals, 2 gradient sums
    assert (warm.op_counts["aten.addmm.default"], warm.op_counts["aten.mm.default"]) == (6, 11)
    assert warm.op_counts["aten.add.Tensor"] == 4


def test_traces_in_one_process_do_not_share_meshes() -> None:
    """DTensor caches sharding decisions by mesh value; a tp mesh of the next trace equal to
    one of the last (ranks 0, 1, named tp) found the last trace's mesh there, whose process
    groups were destroyed with it, and failed ("Could not resolve the process group ...")."""
    spec = transformer_spec(get_preset("tiny-llama"))
    mixed = make_parallelize(ParallelOptions(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    trace_step(spec, mixed, {"dp_shard": 4, "tp": 2}, n_layers=1, dtype=torch.float32)
    t = trace_step(spec, make_parallelize(), {"dp_shard": 2, "cp": 2, "tp": 2}, n_layers=1)
    assert ("cp", 2) in t.layout


def test_replication_alone_is_ddp_traffic() -> None:
    """dp_replicate without a shard axis is HSDP with shards of one: every gradient is
    all-reduced over dp_replicate once (bf16: 2 bytes per parameter) and nothing is gathered."""
    cfg = get_preset("tiny-llama")
    t = _trace("tiny-llama", (("dp_replicate", 2),), split=False).summary()
    kinds = {(k, axis, phase) for (k, axis, phase) in t.collectives}
    assert kinds == {("all_reduce", "dp_replicate", "backward")}
    assert t.collectives[("all_reduce", "dp_replicate", "backward")].bytes == 2 * cfg.total_params()


MIXED = ParallelOptions(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@pytest.mark.parametrize(
    "preset, layout, opts, dtype, rounds",
    [
        ("tiny-llama", {"dp_shard": 4}, None, torch.bfloat16, None),
        ("tiny-llama", {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, MIXED, torch.float32, None),
        ("tiny-llama", {"dp_replicate": 4}, None, torch.bfloat16, None),
        ("tiny-llama", {"dp_shard": 2, "cp": 2, "tp": 2}, None, torch.bfloat16, None),
        ("tiny-llama", {"cp": 8}, None, torch.bfloat16, 3),
        ("tiny-llama", {"tp": 2, "dp_shard": 2}, ParallelOptions(checkpointing=Checkpointing.FULL), torch.bfloat16, None),
        ("tiny-llama", {"dp_shard": 2}, ParallelOptions(checkpointing=Checkpointing.SELECTIVE, reshard_after_forward=False),
         torch.bfloat16, None),
        ("tiny-moe", {"dp_shard": 2, "ep": 2}, MIXED, torch.float32, None),
        ("tiny-gpt", {"tp": 2}, None, torch.bfloat16, None),
    ],
)
def test_the_state_warm_up_gives_the_trace_a_whole_step_warm_up_gives(preset, layout, opts, dtype, rounds) -> None:  # noqa: ANN001
    """The built-in models reach the steady state without running a step (``state_warm_up``):
    the traced step is the same, record by record, as after a whole eager step."""
    spec = transformer_spec(dataclasses.replace(get_preset(preset), n_layers=2))
    assert spec.state_warm_up
    kw = dict(n_layers=1, batch_size=B, dtype=dtype, ring_rounds=rounds)
    state = trace_step(spec, make_parallelize(opts), layout, **kw)
    whole = trace_step(dataclasses.replace(spec, state_warm_up=False), make_parallelize(opts), layout, **kw)
    assert dataclasses.replace(state, trace_s=0.0) == dataclasses.replace(whole, trace_s=0.0)
    for a, b in zip(state.segments, whole.segments, strict=True):  # scalar args too (the op-table key)
        assert [getattr(e, "args", None) for e in a.events] == [getattr(e, "args", None) for e in b.events]
    cold = trace_step(spec, make_parallelize(opts), layout, warm_up=False, **kw)  # a first step differs
    assert dataclasses.replace(cold, trace_s=0.0) != dataclasses.replace(whole, trace_s=0.0)


@pytest.mark.parametrize(
    "preset, layout, opts, dtype",
    [
        ("tiny-llama", {"cp": 8}, None, torch.bfloat16),
        ("tiny-llama", {"dp_shard": 2, "cp": 8, "tp": 2}, MIXED, torch.float32),
        ("tiny-moe", {"dp_shard": 2, "cp": 8, "ep": 2}, MIXED, torch.float32),
        ("tiny-gpt", {"dp_replicate": 2, "cp": 16}, None, torch.bfloat16),
        # recompute: the forward ring rerun inside backward is cut as well
        ("tiny-llama", {"cp": 8, "dp_shard": 2}, ParallelOptions(checkpointing=Checkpointing.FULL), torch.bfloat16),
        ("tiny-llama", {"cp": 8, "dp_shard": 2}, ParallelOptions(checkpointing=Checkpointing.SELECTIVE), torch.bfloat16),
    ],
)
def test_one_trace_gives_the_ring_one_round_shorter(preset, layout, opts, dtype) -> None:  # noqa: ANN001
    """The ring of 3 rounds cut out of a trace of 4 (``trace_rings``) is the trace of 3 rounds,
    record by record in order with scalar args, kept activations and largest tensor per
    segment; the ring of 4 is the plain trace of 4."""
    from topomesh.trace.tracer import trace_rings

    spec = transformer_spec(dataclasses.replace(get_preset(preset), n_layers=2))
    kw = dict(n_layers=1, batch_size=B, dtype=dtype)
    short, long = trace_rings(spec, make_parallelize(opts), layout, ring_rounds=4, **kw)
    three = trace_step(spec, make_parallelize(opts), layout, ring_rounds=3, **kw)
    four = trace_step(spec, make_parallelize(opts), layout, ring_rounds=4, **kw)
    assert dataclasses.replace(long, trace_s=0.0) == dataclasses.replace(four, trace_s=0.0)
    assert short is not None and dataclasses.replace(short, trace_s=0.0) == dataclasses.replace(three, trace_s=0.0)
    for a, b in zip(short.segments, three.segments, strict=True):
        assert [(e, getattr(e, "args", None)) for e in a.events] == [(e, getattr(e, "args", None)) for e in b.events]
        assert a.prefetch == b.prefetch and (a.saved_bytes, a.peak_output_bytes) == (b.saved_bytes, b.peak_output_bytes)
    assert len(list(short.events())) < len(list(long.events()))  # a round really was cut


def test_round_marks_out_of_order_cut_nothing() -> None:
    """``round_nodes`` gives None, not a wrong cut, when a ring's marks are missing or out of order."""
    import torch.fx

    from topomesh.trace.tracer import _Markers

    g = torch.fx.Graph()
    x = g.placeholder("x")
    nodes = [g.call_function(torch.neg, (x,)) for _ in range(4)]
    gm = torch.fx.GraphModule(nn.Module(), g)
    ok = _Markers()
    ok.marks = {nodes[0]: ["round:2"], nodes[2]: ["round:3"]}
    assert ok.round_nodes(gm, 2) == {nodes[1], nodes[2]}
    for marks in ({nodes[0]: ["round:2"]}, {nodes[0]: ["round:3"], nodes[2]: ["round:2"]},
                  {nodes[0]: ["round:2"], nodes[1]: ["round:2"], nodes[2]: ["round:3"]}, {}):
        bad = _Markers()
        bad.marks = marks
        assert bad.round_nodes(gm, 2) is None


@pytest.mark.parametrize("mode, recomputed", [(Checkpointing.FULL, 3), (Checkpointing.SELECTIVE, 0)])
def test_context_parallel_traces_under_activation_checkpointing(mode: Checkpointing, recomputed: int) -> None:
    """Checkpointing recomputes the forward inside backward, where the tracer's attention mode
    is off: the recomputed attention is still the CUDA flash kernel ring attention runs on, so
    full recompute repeats the 3-round ring's 3 attention calls in backward, and selective
    (attention outputs saved) repeats none; the module attribute is restored afterwards."""
    spec = transformer_spec(dataclasses.replace(get_preset("tiny-llama"), n_layers=2))
    t = trace_step(spec, make_parallelize(ParallelOptions(checkpointing=mode)), {"cp": 8, "dp_shard": 2},
                   n_layers=1, batch_size=B, ring_rounds=3)
    flash = Counter(s.phase for s in t.segments for e in s.events
                    if getattr(e, "op", "") == "aten._scaled_dot_product_flash_attention.default")
    assert flash == Counter({Phase.FORWARD: 3, Phase.BACKWARD: recomputed}) - Counter()
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def test_gradients_are_the_ones_backward_makes() -> None:
    """Under TP the embedding is vocab-sharded (RowwiseParallel) but DTensor's backward leaves
    a replicated gradient of the whole table on each rank (seen on real gloo ranks: a
    (2048, 256) gradient on a (512, 256) weight at tp=4); every other gradient is its
    parameter's size. By hand for tiny-llama (vocab 256, hidden 64, bf16) at tp=2."""
    cfg = get_preset("tiny-llama")
    t = _trace("tiny-llama", (("tp", 2),))
    table = cfg.vocab_size * cfg.hidden * BF16
    assert t.first_state.params == table // 2
    assert t.first_state.grads == table
    assert t.block_state.grads == t.block_state.params and t.last_state.grads == t.last_state.params
    one = _trace("tiny-llama", ())
    assert one.first_state.grads == one.first_state.params == table


def test_fsdp_hooks_are_the_innermost_fsdp_label() -> None:
    """Each op carries the innermost ``FSDP::`` ``record_function`` label around it, its first
    word less the prefix; labels of anything else are passed over, not nested into."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from topomesh.trace.tracer import fsdp_hooks

    def f(x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.profiler.record_function("FSDP::pre_forward (layers.0)"):
            y = x * 2
            with torch.autograd.profiler.record_function("FSDP::backward_prefetch for layers.1"):
                z = y + 1
            with torch.autograd.profiler.record_function("Optimizer.step#AdamW.step"):
                w = z - 1
        return w.sin()

    gm = make_fx(f)(torch.ones(3))
    got = {str(n.target): hook for n, hook in fsdp_hooks(gm).items()}
    assert got == {"aten.mul.Tensor": "pre_forward", "aten.add.Tensor": "backward_prefetch",
                   "aten.sub.Tensor": "pre_forward"}


def test_fsdp_unsharding_and_reduction_ops_carry_their_hooks() -> None:
    """A replicate-only FSDP2 unit (mixed precision) casts its parameters to bfloat16 in its
    pre-forward and pre-backward, and copies its gradients into the all-reduce (the cast to
    float32 with them) in its post-backward: those ops say so; the model's own ops, the cast of
    a unit's inputs, and the optimizer's do not."""
    cfg = get_preset("tiny-llama")
    opts = ParallelOptions(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    t = trace_step(transformer_spec(cfg), make_parallelize(opts), {"dp_replicate": 2}, n_layers=cfg.n_layers,
                   batch_size=B, dtype=torch.float32)
    ops = [e for e in t.events() if isinstance(e, OpRecord)]
    hooked = Counter((e.phase, e.hook, e.op) for e in ops if e.hook)
    casts = [e for e in ops if e.hook == "pre_forward" and e.op == "aten._to_copy.default"]
    assert casts and {(e.inputs[0].dtype, e.outputs[0].dtype) for e in casts} == {("float32", "bfloat16")}
    assert hooked[(Phase.BACKWARD, "pre_backward", "aten._to_copy.default")] == len(casts)
    assert hooked[(Phase.BACKWARD, "post_backward_reduce", "fsdp.chunk_cat.default")] >= 1
    assert not [e for e in ops if e.hook and e.phase is Phase.OPTIMIZER]
    assert not [e for e in ops if e.hook and e.op in ("aten.mm.default", "aten.addcdiv_.default")]
