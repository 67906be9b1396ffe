"""Trace composition on hand-built traces: multiplicities and events at exactly the traced
depth and beyond, counted by hand from the rule in Trace.compose's docstring."""

from __future__ import annotations

import pytest

from topomesh.trace.graph import CollectiveKind, CollectiveRecord, OpRecord, Phase
from topomesh.trace.result import Part, Segment, Trace

FWD, BWD, OPT = Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER


def _op(name: str, phase: Phase, flops: int) -> OpRecord:
    return OpRecord(op=name, inputs=(), outputs=(), flops=flops, bytes_moved=0, phase=phase)


def _seg(part: Part, phase: Phase, *events, layer=None, prefetch=()) -> Segment:
    return Segment(part=part, phase=phase, layer=layer, events=tuple(events), prefetch=tuple(prefetch))


EMB, HEAD, HEAD_B = _op("emb", FWD, 1), _op("head", FWD, 3), _op("head_b", BWD, 6)
A0, A1 = _op("a0", FWD, 10), _op("a1", FWD, 10)
B0, B1 = _op("b0", BWD, 20), _op("b1", BWD, 20)
O0, O1 = _op("o0", OPT, 2), _op("o1", OPT, 2)


def two_block_trace() -> Trace:
    """Forward runs block 0 then 1, backward block 1 then 0, the optimizer block 0 then 1."""
    segs = (
        _seg(Part.REST, FWD, EMB),
        _seg(Part.BLOCK, FWD, A0, layer=0),
        _seg(Part.BLOCK, FWD, A1, layer=1),
        _seg(Part.REST, FWD, HEAD),
        _seg(Part.REST, BWD, HEAD_B),
        _seg(Part.BLOCK, BWD, B1, layer=1),
        _seg(Part.BLOCK, BWD, B0, layer=0),
        _seg(Part.BLOCK, OPT, O0, layer=0),
        _seg(Part.BLOCK, OPT, O1, layer=1),
    )
    return Trace(model="m", layout=(("tp", 2),), batch_size=1, dtype="bfloat16", traced_layers=2, n_layers=2,
                 segments=segs)


def test_two_block_trace_at_exactly_its_depth_is_itself():
    t = two_block_trace().compose(2)
    assert t.multiplicities() == (1,) * 9
    assert [e.op for e in t.events()] == ["emb", "a0", "a1", "head", "head_b", "b1", "b0", "o0", "o1"]
    # forward 1 + 10 + 10 + 3 = 24, backward 6 + 20 + 20 = 46, optimizer 2 + 2 = 4
    assert t.summary().flops_by_phase == {"forward": 24, "backward": 46, "optimizer": 4}


def test_two_block_trace_composed_deeper_repeats_the_first_block_of_each_phase():
    t = two_block_trace().compose(5)  # 3 extra blocks, carried by the first block of each phase
    assert t.multiplicities() == (1, 4, 1, 1, 1, 4, 1, 4, 1)
    ops = [e.op for e in t.events()]
    assert ops == ["emb"] + ["a0"] * 4 + ["a1", "head", "head_b"] + ["b1"] * 4 + ["b0"] + ["o0"] * 4 + ["o1"]
    s = t.summary()
    assert s.op_counts == {"emb": 1, "a0": 4, "a1": 1, "head": 1, "head_b": 1, "b1": 4, "b0": 1, "o0": 4, "o1": 1}
    # forward 1 + 5*10 + 3 = 54; backward 6 + 5*20 = 106; optimizer 5*2 = 10
    assert s.flops_by_phase == {"forward": 54, "backward": 106, "optimizer": 10}


def test_compose_refuses_fewer_layers_than_traced():
    with pytest.raises(ValueError, match="Cannot compose 1 layers from a trace of 2 blocks"):
        two_block_trace().compose(1)
    rest_only = Trace(model="m", layout=(), batch_size=1, dtype="float32", traced_layers=1, n_layers=1,
                      segments=(_seg(Part.REST, FWD, EMB),))
    with pytest.raises(ValueError, match="has no block segments"):
        rest_only.compose(1)


AG = CollectiveRecord(kind=CollectiveKind.ALL_GATHER, bytes=100, group_size=2, mesh_axis="dp_shard", phase=BWD)


def one_block_trace() -> Trace:
    """The head's backward issues the block's backward all-gather (FSDP prefetch)."""
    segs = (
        _seg(Part.REST, FWD, EMB),
        _seg(Part.BLOCK, FWD, A0, layer=0),
        _seg(Part.REST, BWD, HEAD_B, AG),
        _seg(Part.BLOCK, BWD, B0, layer=0, prefetch=(AG,)),
    )
    return Trace(model="m", layout=(("dp_shard", 2),), batch_size=1, dtype="bfloat16", traced_layers=1,
                 n_layers=1, segments=segs)


def test_one_block_trace_at_exactly_its_depth_adds_no_prefetch():
    t = one_block_trace().compose(1)
    assert t.multiplicities() == (1, 1, 1, 1)
    assert list(t.events()) == [EMB, A0, HEAD_B, AG, B0]
    assert t.summary().collectives[("all_gather", "dp_shard", "backward")].count == 1


def test_one_block_trace_composed_prefetches_for_all_but_the_last_copy():
    t = one_block_trace().compose(3)
    assert t.multiplicities() == (1, 3, 1, 3)
    # the head issues the first block's gather; each of the first two copies issues the next one's
    assert list(t.events()) == [EMB, A0, A0, A0, HEAD_B, AG, AG, B0, AG, B0, B0]
    stats = t.summary().collectives[("all_gather", "dp_shard", "backward")]
    assert (stats.count, stats.bytes) == (3, 300)
