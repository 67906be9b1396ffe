"""Fewer fake views in a trace at large shard and context-parallel degrees, with the same records.

FSDP2 cuts tensors into one piece per shard rank with ``torch.chunk``, and PyTorch's ring
attention cuts its gathered keys and values into one piece per ``cp`` rank every round. On
fake tensors every piece is a Python object that costs 40–60 µs to make (FakeTensor
construction, and in ``make_fx`` a graph node per piece), so at degrees of thousands a 70B
trace spent most of its time making pieces nobody reads: 31.5 s at ``tp=4, dp_shard=4096``,
35.8 s for a 3-round ring at ``cp=4096``, against 1–2 s at small degrees. Three places
make them:

- **Wrapping** (``FSDPParam`` init): ``_chunk_with_empty(param, F, dim)`` builds all ``F``
  pieces, and FSDP2 reads two (its own rank's and piece 0, the padded size). Under
  :func:`fewer_views` that list is lazy: a piece is made when it is read, as the view
  ``torch.chunk`` would have given. Wrapping runs before the trace, so no record changes.
- **Every step**, for parameters FSDP2 shards on a dim other than 0 (ours: those with fewer
  rows than shards, :func:`~topomesh.models.parallelize._fsdp_placement`): the gathered
  parameters are copied out, and the gradients copied in, as ``torch.cat(torch.chunk(x, F,
  d), d')``. Under :func:`fewer_views` FSDP2's collectives module sees a ``torch`` that runs
  that pair as one op (``topomesh::chunk_cat``, or ``chunk_cat_out`` for ``cat(..., out=)``)
  — a module attribute, as :func:`~topomesh.trace.tracer.limited_ring` sets one, because
  the copies run in autograd hooks, where a ``TorchFunctionMode`` is not seen. :func:`expand`
  turns the op's graph node back into the two records ``make_fx`` gives the pair,
  ``aten.split.Tensor`` then ``aten.cat``, with the same shapes, strides, bytes and
  arguments. They sit at the cat's place in the segment, after any op that ran between the
  two calls; the simulator reads a segment's ops as a multiset, so that changes nothing it
  computes.
- **Every ring round** (``_AllGatherRotater.next_buffer``, the default rotation):
  ``gathered.chunk(cp)[rank - round]``. Under :func:`fewer_views` it is
  ``topomesh::chunk_piece``, a view of the gathered buffer like the piece it stands for (so
  liveness, which follows storages, is unchanged), and :func:`expand` gives back the
  ``aten.split.Tensor`` record; the ``getitem`` that picked the piece has no record.

Only a chunk into at least :data:`MIN_PIECES` even pieces with autograd off is taken this
way; the pieces used in any other way than as the one input of ``torch.cat`` are made then,
by ``torch.chunk`` itself. Tests trace with and without, record by record.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

MIN_PIECES = 64
"""Chunks into fewer pieces than this run as they are (the saving is a few ms)."""


@torch.library.custom_op("topomesh::chunk_cat", mutates_args=())
def chunk_cat(t: torch.Tensor, pieces: int, chunk_dim: int, cat_dim: int) -> torch.Tensor:
    """``torch.cat(torch.chunk(t, pieces, chunk_dim), cat_dim)``."""
    return torch.cat(torch.chunk(t, pieces, chunk_dim), cat_dim)


@chunk_cat.register_fake
def _(t: torch.Tensor, pieces: int, chunk_dim: int, cat_dim: int) -> torch.Tensor:
    return t.new_empty(_cat_shape(t.shape, pieces, chunk_dim, cat_dim))


@torch.library.custom_op("topomesh::chunk_cat_out", mutates_args=("out",))
def chunk_cat_out(t: torch.Tensor, pieces: int, chunk_dim: int, cat_dim: int, out: torch.Tensor) -> None:
    """``torch.cat(torch.chunk(t, pieces, chunk_dim), cat_dim, out=out)``."""
    torch.cat(torch.chunk(t, pieces, chunk_dim), cat_dim, out=out)


@chunk_cat_out.register_fake
def _(t: torch.Tensor, pieces: int, chunk_dim: int, cat_dim: int, out: torch.Tensor) -> None:
    return None


_LIB = torch.library.Library("topomesh", "FRAGMENT")  # the op below; kept for the process
_LIB.define("chunk_piece(Tensor(a) self, int pieces, int index) -> Tensor(a)")


def _piece(t: torch.Tensor, pieces: int, index: int) -> torch.Tensor:
    rows = t.shape[0] // pieces
    return t.narrow(0, index * rows, rows)


for _key in ("CPU", "Meta"):
    _LIB.impl("chunk_piece", _piece, _key)
# ``topomesh::chunk_piece(t, n, i)``: ``t.chunk(n)[i]`` for n even pieces, a view of ``t``.

OPS = {"topomesh.chunk_cat.default", "topomesh.chunk_cat_out.default", "topomesh.chunk_piece.default"}
"""Graph targets :func:`expand` turns back into records."""


def _cat_shape(shape: Sequence[int], pieces: int, chunk_dim: int, cat_dim: int) -> list[int]:
    out = list(shape)
    out[chunk_dim] //= pieces
    out[cat_dim] *= pieces
    return out


class _Pieces(Sequence):
    """``torch.chunk(t, pieces, dim)`` not made yet: made (by ``torch.chunk``) on first use
    other than as ``torch.cat``'s input."""

    def __init__(self, t: torch.Tensor, pieces: int, dim: int) -> None:
        self.t, self.pieces, self.dim = t, pieces, dim
        self._made: tuple[torch.Tensor, ...] | None = None

    def made(self) -> tuple[torch.Tensor, ...]:
        if self._made is None:
            self._made = torch.chunk(self.t, self.pieces, self.dim)
        return self._made

    def __len__(self) -> int:
        return len(self.made())

    def __getitem__(self, i: Any) -> Any:
        return self.made()[i]


class _Torch:
    """``torch`` as FSDP2's collectives module sees it while :func:`fewer_views` is open:
    ``chunk`` into at least ``least`` even pieces with autograd off is deferred, and ``cat`` of
    deferred pieces is one ``topomesh::chunk_cat`` op; everything else is ``torch``."""

    def __init__(self, least: int) -> None:
        self._least = least

    def chunk(self, t: torch.Tensor, chunks: int, dim: int = 0) -> Sequence[torch.Tensor]:
        size = t.shape[dim] if type(dim) is int and t.dim() else 0
        if chunks < self._least or size == 0 or size % chunks or torch.is_grad_enabled() and t.requires_grad:
            return torch.chunk(t, chunks, dim=dim)
        return _Pieces(t, chunks, dim)

    def cat(self, tensors: Sequence[torch.Tensor], dim: int = 0, *, out: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(tensors, _Pieces) or tensors._made is not None or type(dim) is not int:
            tensors = tensors.made() if isinstance(tensors, _Pieces) else tensors
            return torch.cat(tensors, dim=dim, **({"out": out} if out is not None else {}))
        if out is None:
            return torch.ops.topomesh.chunk_cat(tensors.t, tensors.pieces, tensors.dim, dim)
        torch.ops.topomesh.chunk_cat_out(tensors.t, tensors.pieces, tensors.dim, dim, out)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def expand(target: str, args: Sequence[Any], out: torch.Tensor) -> tuple[tuple, ...]:
    """The (target, args, kwargs, value, scalars) of the calls a ``topomesh::`` node stands
    for, as ``make_fx`` records them (a default dim of 0 left out, as it does):
    ``aten.split.Tensor`` then ``aten.cat`` for ``chunk_cat[_out]``; ``aten.split.Tensor``
    alone for ``chunk_piece`` (the piece it picks is a ``getitem``, which has no record).

    The pieces are made on the meta device (a few µs each, no fake tensors)."""
    if target == "topomesh.chunk_piece.default":
        args = (args[0], args[1], 0, 0)
    t, pieces, chunk_dim, cat_dim = args[:4]
    base = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
    parts = list(torch.chunk(base, pieces, chunk_dim))
    size = t.shape[chunk_dim] // pieces
    split_scalars = (size,) if chunk_dim == 0 else (size, chunk_dim)
    split = (torch.ops.aten.split.Tensor, [t, *split_scalars], {}, parts, split_scalars)
    if target == "topomesh.chunk_piece.default":
        return (split,)
    nodes = (None,) * pieces
    cat_scalars = (nodes,) if cat_dim == 0 else (nodes, cat_dim)
    if len(args) > 4:  # chunk_cat_out
        cat = (torch.ops.aten.cat.out, [parts, *cat_scalars[1:]], {"out": args[4]}, args[4], cat_scalars)
    else:
        cat = (torch.ops.aten.cat.default, [parts, *cat_scalars[1:]], {}, out, cat_scalars)
    return split, cat


@contextlib.contextmanager
def fewer_views(min_pieces: int | None = None) -> Iterator[None]:
    """While open, FSDP2 makes only the shard pieces it reads (see the module docstring):
    wrapping gets lazy piece lists, and FSDP2's collectives module a ``torch`` whose
    ``cat(chunk(...))`` is one op. A torch without these hook points is left as it is
    (slower, the same trace)."""
    least = MIN_PIECES if min_pieces is None else min_pieces
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param
    except ImportError:  # pragma: no cover - a torch without FSDP2
        yield
        return
    real = getattr(_fsdp_param, "_chunk_with_empty", None)

    def chunk_with_empty(tensor: torch.Tensor, num_chunks: int, dim: int) -> Sequence[torch.Tensor]:
        if num_chunks < least or tensor.shape[dim] == 0:
            return real(tensor, num_chunks, dim)
        return _ShardPieces(tensor, num_chunks, dim)

    rotater = _all_gather_rotater()
    saved = [(mod, name, getattr(mod, name)) for mod, name in ((_fsdp_param, "_chunk_with_empty"),
                                                                  (_fsdp_collectives, "torch"),
                                                                  (rotater, "next_buffer"))
             if getattr(mod, name, None) is not None]
    if real is not None:
        _fsdp_param._chunk_with_empty = chunk_with_empty
    if getattr(_fsdp_collectives, "torch", None) is torch:
        _fsdp_collectives.torch = _Torch(least)
    if rotater is not None:
        rotater.next_buffer = _next_buffer(rotater.next_buffer, least)
    try:
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


class _ShardPieces(Sequence):
    """``_chunk_with_empty(t, n, dim)``: ``torch.chunk``'s pieces (``ceil(size / n)`` rows
    each, the last shorter, fewer than ``n`` when the rows run out) and then empty tensors up
    to ``n``, each made when read."""

    def __init__(self, t: torch.Tensor, n: int, dim: int) -> None:
        self.t, self.n, self.dim = t, n, dim
        size = t.shape[dim]
        self.rows = -(-size // n)
        self.full = -(-size // self.rows)  # pieces torch.chunk returns

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        if i < self.full:
            start = i * self.rows
            return self.t.narrow(self.dim, start, min(self.rows, self.t.shape[self.dim] - start))
        return self[0].new_empty(0)


def _all_gather_rotater() -> type | None:
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:  # pragma: no cover - a torch without context parallel
        return None
    rotater = getattr(_attention, "_AllGatherRotater", None)
    return rotater if rotater is not None and hasattr(rotater, "next_buffer") else None


def _next_buffer(real: Any, least: int) -> Any:
    """``_AllGatherRotater.next_buffer`` (context-parallel ring attention, every round):
    ``gathered.chunk(cp)[rank - round]``, as ``topomesh::chunk_piece`` when ``cp`` is at least
    ``least`` and divides the gathered rows; PyTorch's own method otherwise."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    def next_buffer(self: Any) -> torch.Tensor:
        buf = getattr(self, "_aggregated_buffer", None)
        if buf is None:
            return real(self)
        buf = self._aggregated_buffer = _attention._maybe_wait(buf)
        n = _attention.dist.get_world_size(self._pg)
        if n < least or buf.dim() == 0 or buf.shape[0] % n:
            return real(self)
        return torch.ops.topomesh.chunk_piece(buf, n, (_attention.dist.get_rank(self._pg) - self._idx) % n)

    return next_buffer
