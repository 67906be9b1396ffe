"""simulate() end to end on small models: properties a correct step must have."""

from __future__ import annotations

import json

import pytest

from topomesh.cost.cluster import load_cluster
from topomesh.errors import LayoutError
from topomesh.layout.dims import Layout
from topomesh.models.presets import get_preset
from topomesh.models.transformer import Arch, TransformerConfig
from topomesh.sim.simulate import (
    Simulator,
    Training,
    builtin_model,
    check_model_layout,
    split_layers,
)

# 16 heads so that tp=16 divides them; wide enough that tensor parallel moves real bytes
WIDE = TransformerConfig(name="wide-test", arch=Arch.LLAMA, n_layers=4, hidden=2048, n_heads=16, n_kv_heads=16,
                         ffn_hidden=5632, vocab_size=32000, seq_len=1024)


@pytest.fixture(scope="module")
def wide16() -> Simulator:
    return Simulator(model=builtin_model(WIDE), cluster=load_cluster("dgx-h100", gpus=16))


def test_a_class_is_traced_once():
    sim = Simulator(model=builtin_model(get_preset("tiny-llama")), cluster=load_cluster("dgx-h100", gpus=8))
    layouts = (Layout(tp=2, dp_shard=4), Layout(dp_shard=4, tp=2, order="dp_shard-tp"))
    for layout in layouts:
        sim.simulate(layout, Training(global_batch=8))
    assert (sim.cache.misses, sim.cache.hits) == (1, 0)  # the order does not change a rank's trace
    # ... nor its digest: the second layout reads the first one's
    assert sim.digest(layouts[0], Training(global_batch=8)) is sim.digest(layouts[1], Training(global_batch=8))


def test_breakdown_accounts_for_every_second(wide16):
    for layout, training in [
        (Layout(tp=8, dp_shard=2), Training(global_batch=4)),
        (Layout(tp=4, pp=2, dp_shard=2), Training(global_batch=16)),
        (Layout(dp_shard=16), Training(global_batch=16, recompute="full")),
        (Layout(tp=2, dp_shard=8), Training(global_batch=8, recompute="selective")),  # Llama + SAC traces
    ]:
        r = wide16.simulate(layout, training)
        assert r.breakdown.total_s == pytest.approx(r.step_time_s, rel=1e-9)
        assert r.step_time_s > 0 and 0 < r.mfu <= r.hfu + 1e-12 < 1


def test_mfu_counts_model_flops_by_the_palm_formula(wide16):
    # PaLM (arXiv:2204.02311, App. B): 6·N + 12·L·h·s FLOPs per token, N the matmul
    # parameters: 4·h² (q, k, v, o with as many kv heads as heads) + 3·h·ffn per layer, and
    # the h·V output head. The traced count has the causal attention at half of 12·L·h·s,
    # hence the 5 % tolerance.
    h, L, s, V, ffn = WIDE.hidden, WIDE.n_layers, WIDE.seq_len, WIDE.vocab_size, WIDE.ffn_hidden
    n = L * (4 * h * h + 3 * h * ffn) + h * V
    r = wide16.simulate(Layout(tp=8, dp_shard=2), Training(global_batch=4))
    tokens = 4 * s
    peak = 16 * 989.5e12  # 16 H100 SXM at the datasheet's dense bf16 figure
    assert r.mfu == pytest.approx((6 * n + 12 * L * h * s) * tokens / (r.step_time_s * peak), rel=0.05)


def test_tp_that_outgrows_a_node_crosses_ib_and_costs_more(wide16):
    inside = wide16.simulate(Layout(tp=8, dp_shard=2), Training(global_batch=2))
    across = wide16.simulate(Layout(tp=16), Training(global_batch=1))
    assert inside.links["tp"]["link"] == "NVSwitch"
    assert across.links["tp"]["link"] == "IB" and across.links["tp"]["nodes"] == 2
    # per micro-batch the tp=16 rank moves 15/16 vs 7/8 of the same activations; over IB
    # that must cost several times the NVSwitch time
    assert across.breakdown.exposed_comm_s["tp"] > 3 * inside.breakdown.exposed_comm_s["tp"] / 2


def test_recompute_trades_memory_for_time(wide16):
    none = wide16.simulate(Layout(dp_shard=16), Training(global_batch=16, recompute="none"))
    full = wide16.simulate(Layout(dp_shard=16), Training(global_batch=16, recompute="full"))
    # full recompute keeps 2·s·b·h per block instead of every block activation; the head's
    # logits (kept either way) dominate what is left
    blocks_kept = 4 * 2 * WIDE.seq_len * WIDE.hidden
    assert full.memory[0].activations_bytes < none.memory[0].activations_bytes / 2
    assert none.memory[0].activations_bytes - full.memory[0].activations_bytes > 10 * blocks_kept
    assert full.step_time_s > none.step_time_s
    assert full.hfu > full.mfu  # recomputed forward counts as hardware FLOPs only


def test_fsdp_gathers_hide_behind_compute_when_compute_is_longer():
    # one node of DGX H100: 8-way FSDP over NVSwitch. Each block's gather runs under the
    # previous block's compute, so the exposed dp_shard time is far below the gathers' total.
    sim = Simulator(model=builtin_model(WIDE), cluster=load_cluster("dgx-h100", gpus=8))
    r = sim.simulate(Layout(dp_shard=8), Training(global_batch=64, micro_batch=8))
    exposed = r.breakdown.exposed_comm_s.get("dp_shard", 0.0)
    assert exposed < 0.2 * r.breakdown.compute_s
    # of all the FSDP traffic (gathers and reduce-scatters, priced on their link) at most
    # half is exposed; were the gathers blocking, all of it would be
    sim.simulate(Layout(dp_shard=8), Training(global_batch=64, micro_batch=8), record=True)  # prices the plans
    ((_, priced),) = sim._memo.priced.values()
    assert priced.fwd_block.gather and not priced.fwd_block.blocking

    def total(w) -> float:
        return sum(c.seconds for c in (*w.gather, *w.reduce))

    fsdp = WIDE.n_layers * (total(priced.fwd_block) + total(priced.bwd_block)) + sum(
        total(w) for w in (priced.fwd_pre, priced.fwd_post, priced.bwd_post, priced.bwd_pre))
    assert exposed < 0.5 * fsdp


def test_a_layout_over_capacity_is_infeasible_with_the_numbers():
    cfg = get_preset("llama3-70b")
    sim = Simulator(model=builtin_model(cfg, seq_len=1024), cluster=load_cluster("dgx-h100", gpus=8))
    r = sim.simulate(Layout(dp_shard=8), Training(global_batch=8))
    # FSDP2 mixed precision: float32 weights (4 B), gradients (4 B) and two Adam moments
    # (8 B) per parameter, sharded 8 ways: 70.6e9 × 16 / 8 = 141 GB per GPU > 80 GB
    assert not r.feasible
    assert "memory" in r.reason and "80.0 GB" in r.reason
    state = r.memory[0].params_bytes + r.memory[0].grads_bytes + r.memory[0].optimizer_bytes
    assert state == pytest.approx(70.6e9 * 16 / 8, rel=0.02)


def test_pipeline_stages_hold_their_share_of_layers(wide16):
    r = wide16.simulate(Layout(pp=4, tp=4), Training(global_batch=8))
    assert [m.in_flight for m in r.memory] == [4, 3, 2, 1]  # 1F1B warm-up depth per rank
    assert r.breakdown.bubble_s > 0 and r.layout["schedule"] == "1f1b"
    # a stage sends its block output: micro-batch 1 × (1024 / tp 4, sequence parallel) × 2048 × 2 B
    alone = Simulator(model=wide16.model, cluster=wide16.cluster, cache=wide16.cache)  # the trace is cached
    alone.simulate(Layout(pp=4, tp=4), Training(global_batch=8), record=True)  # record: plans priced on the links
    ((_, priced),) = alone._memo.priced.values()
    assert priced.boundary_bytes == 1 * 1024 // 4 * 2048 * 2
    assert split_layers(4, 4) == [1, 1, 1, 1]
    assert split_layers(10, 4) == [3, 3, 2, 2] and split_layers(7, 7) == [1] * 7


def test_bad_inputs_are_layout_errors(wide16):
    with pytest.raises(LayoutError, match="tp=3 does not divide the 16 attention heads"):
        check_model_layout(WIDE, Layout(tp=3), Training(global_batch=1))
    with pytest.raises(LayoutError, match="has 8 ranks, cluster dgx-h100 has 16"):
        wide16.simulate(Layout(tp=8), Training(global_batch=1))
    with pytest.raises(LayoutError, match="global batch 3 does not divide"):
        wide16.simulate(Layout(dp_shard=16), Training(global_batch=3))
    with pytest.raises(LayoutError, match="8 pipeline stages"):
        wide16.simulate(Layout(pp=8, dp_shard=2), Training(global_batch=16))
    with pytest.raises(LayoutError, match="ep=2 needs a mixture-of-experts model"):
        wide16.simulate(Layout(ep=2, dp_shard=8), Training(global_batch=8))


def test_timeline_is_a_chrome_trace(wide16):
    r = wide16.simulate(Layout(pp=2, tp=8), Training(global_batch=4), record=True)
    doc = json.loads(json.dumps(r.timeline))
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(r.step_time_s * 1e6, rel=1e-6)


def test_fsdp_under_a_pipeline_holds_unsharded_gradients_until_its_last_backward():
    """torch's pipeline schedules turn FSDP2's gradient sync off for every backward but the
    last, and FSDP2 then keeps each unit's unsharded gradient, accumulated in the reduce dtype
    (fp32 here) — seen on real gloo ranks (validate_llama pp=2,dp_shard=2: 2.95 MB per block
    unit and 2.1 MB for each stage's root, allocated by FSDP::post_backward_reshard, live at the
    peak). By hand for tiny-llama, one block per stage: a block holds 43,136 parameters (wq
    64x64, wk and wv 64x32, wo 64x64, w1 and w3 160x64, w2 64x160, two norms of 64); the first
    stage's root the embedding (256x64), the last one's the final norm (64) and the head (256x64)."""
    from topomesh.sim.simulate import Simulator, Training, builtin_model

    block = 64 * 64 * 2 + 64 * 32 * 2 + 160 * 64 * 3 + 64 * 2
    assert block == 43136
    sim = Simulator(model=builtin_model(get_preset("tiny-llama")), cluster=load_cluster("dgx-h100", gpus=4))
    first, last = sim.simulate(Layout(pp=2, dp_shard=2), Training(global_batch=8, micro_batch=1)).memory
    assert first.grads_bytes == (block + 256 * 64) * 4  # unsharded, fp32: not the sharded half
    assert last.grads_bytes == (block + 64 + 256 * 64) * 4
    flat = sim.simulate(Layout(dp_shard=4), Training(global_batch=8, micro_batch=1)).memory[0]
    assert flat.grads_bytes == flat.params_bytes  # synced every backward: sharded gradients only
