"""Fewer fake views at large shard degrees: the same trace, record by record."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

from topomesh.models.parallelize import ParallelOptions, make_parallelize
from topomesh.models.presets import get_preset
from topomesh.trace import chunks
from topomesh.trace.tracer import trace_step, transformer_spec


@pytest.mark.parametrize(("model", "layout", "ops"), [
    # kv and wq weights have fewer rows than shards -> Shard(1): copy-out and gradient copy-in
    ("tiny-llama", {"dp_shard": 32, "tp": 2}, {"chunk_cat", "chunk_cat_out"}),
    ("tiny-moe", {"dp_shard": 16, "ep": 2, "tp": 2}, {"chunk_cat", "chunk_cat_out"}),  # experts too
    ("tiny-llama", {"cp": 8, "dp_shard": 2}, {"chunk_piece"}),  # the ring's gathered key/value pieces
])
def test_fewer_views_gives_the_trace_pytorch_gives(model: str, layout: dict, ops: set,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With every chunk taken the short way (``MIN_PIECES`` 2), the trace equals one traced
    as PyTorch runs: per segment the records as a multiset, prefetches, kept activations, the
    largest tensor; and the training state. The short way is really taken."""
    monkeypatch.setattr(chunks, "MIN_PIECES", 2)
    expanded = []
    real_expand = chunks.expand
    monkeypatch.setattr(chunks, "expand", lambda *a: expanded.append(a[0].split(".")[1]) or real_expand(*a))
    spec = transformer_spec(get_preset(model))
    par = make_parallelize(ParallelOptions(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    fast = trace_step(spec, par, layout, n_layers=1, dtype=torch.float32)
    assert set(expanded) == ops
    slow = trace_step(spec, par, layout, n_layers=1, dtype=torch.float32, fewer_views=False)
    assert len(fast.segments) == len(slow.segments)
    for a, b in zip(fast.segments, slow.segments, strict=True):
        assert (a.part, a.phase, a.layer) == (b.part, b.phase, b.layer)
        assert _records(a.events) == _records(b.events)
        assert _records(a.prefetch) == _records(b.prefetch)
        assert (a.saved_bytes, a.peak_output_bytes) == (b.saved_bytes, b.peak_output_bytes)
    assert (fast.block_state, fast.first_state, fast.last_state) == (slow.block_state, slow.first_state,
                                                                     slow.last_state)
    assert fast.unknown_ops == slow.unknown_ops


def _records(events: tuple) -> Counter:
    """Records as a multiset, with their scalar args (left out of a record's equality, part
    of the op-table key)."""
    return Counter((e, getattr(e, "args", None)) for e in events)


def test_split_and_cat_records_name_the_pieces_like_make_fx() -> None:
    """A 4-row, 6-column tensor cut in 2 along dim 0 and joined along dim 1: split records the
    piece size alone (dim 0 is the default), cat records its dim and one slot per piece."""
    t = torch.empty(4, 6)
    split, cat = chunks.expand("topomesh.chunk_cat.default", [t, 2, 0, 1], torch.empty(2, 12))
    assert split[0] is torch.ops.aten.split.Tensor and split[4] == (2,)
    assert [tuple(p.shape) for p in split[3]] == [(2, 6), (2, 6)] and split[3][1].stride() == (6, 1)
    assert cat[0] is torch.ops.aten.cat.default and cat[4] == ((None, None), 1)
    out = torch.empty(2, 12)
    _, cat_out = chunks.expand("topomesh.chunk_cat_out.default", [t, 2, 1, 0, out], None)
    assert cat_out[0] is torch.ops.aten.cat.out and cat_out[2] == {"out": out} and cat_out[4] == ((None, None),)


@pytest.mark.parametrize(("chunk_dim", "cat_dim"), [(0, 1), (1, 0)])
def test_chunk_cat_ops_compute_cat_of_chunk(chunk_dim: int, cat_dim: int) -> None:
    t = torch.arange(48.0).reshape(4, 12)
    want = torch.cat(torch.chunk(t, 4, chunk_dim), cat_dim)
    assert torch.equal(torch.ops.topomesh.chunk_cat(t, 4, chunk_dim, cat_dim), want)
    out = torch.empty_like(want)
    torch.ops.topomesh.chunk_cat_out(t, 4, chunk_dim, cat_dim, out)
    assert torch.equal(out, want)


@pytest.mark.parametrize(("rows", "n"), [(10, 4), (7, 8), (3, 8), (16, 4), (1, 5)])
def test_lazy_shard_pieces_are_the_pieces_fsdp_makes(rows: int, n: int) -> None:
    """torch.chunk's pieces then empty ones up to n: 10 rows in 4 gives 3, 3, 3, 1; 3 rows in
    8 gives 1, 1, 1 and five empty; same shape, stride and offset as FSDP2's own list."""
    t = torch.arange(rows * 3.0).reshape(rows, 3)
    want = _chunk_with_empty(t, n, 0)
    got = chunks._ShardPieces(t, n, 0)
    assert len(got) == n
    for i in range(n):
        a, b = got[i], want[i]
        assert (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset())
        assert a.numel() == 0 or a.data_ptr() == b.data_ptr()
    assert got[-1].shape == want[-1].shape
    with pytest.raises(IndexError):
        got[n]


def test_deferred_pieces_read_as_pieces_are_torch_chunks_own() -> None:
    fake_torch = chunks._Torch(2)
    t = torch.arange(8.0)
    pieces = fake_torch.chunk(t, 4)
    assert isinstance(pieces, chunks._Pieces)
    assert [p.tolist() for p in pieces] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    assert torch.equal(fake_torch.cat(pieces), t)  # made already: a plain cat
    assert not isinstance(fake_torch.chunk(t, 3), chunks._Pieces)  # uneven: torch.chunk itself
    assert not isinstance(fake_torch.chunk(t.requires_grad_(), 4), chunks._Pieces)  # autograd on


def test_chunk_piece_is_the_view_chunk_picks() -> None:
    t = torch.arange(24.0).reshape(8, 3)
    got = torch.ops.topomesh.chunk_piece(t, 4, 3)
    want = t.chunk(4)[3]
    assert torch.equal(got, want) and got.data_ptr() == want.data_ptr() and got.stride() == want.stride()
    (split,) = chunks.expand("topomesh.chunk_piece.default", [t, 4, 3], got)
    assert split[0] is torch.ops.aten.split.Tensor and split[4] == (2,) and len(split[3]) == 4
