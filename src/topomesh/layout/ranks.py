"""Pure rank math: logical rank ↔ coordinates, and the rank groups of axes.

A layout with degrees ``sizes`` (fastest first) numbers its grid positions the way
Megatron-LM's ``RankGenerator`` does: the coordinate of axis ``i`` is
``(rank // stride_i) % sizes[i]`` with ``stride_i = sizes[0] · … · sizes[i-1]``.

Worked example, ``order = tp-cp-dp-pp`` with ``tp=2, cp=1, dp=2, pp=2`` (8 ranks)::

    rank  tp dp pp       strides: tp 1, dp 2, pp 4
      0    0  0  0
      1    1  0  0       rank 6 = tp 0 · 1 + dp 1 · 2 + pp 1 · 4
      2    0  1  0
      …
      6    0  1  1

    tp groups: [0, 1] [2, 3] [4, 5] [6, 7]   (tp varies, dp and pp fixed)
    dp groups: [0, 2] [1, 3] [4, 6] [5, 7]
    pp groups: [0, 4] [1, 5] [2, 6] [3, 7]
    tp×dp groups (e.g. a flattened DP+TP domain): [0, 1, 2, 3] [4, 5, 6, 7]

These are *logical* ranks. :mod:`topomesh.layout.place` maps them to physical ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from topomesh.errors import LayoutError
from topomesh.layout.dims import Axis, Layout


def strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """Prefix products: the rank distance between neighbours along each axis.

    >>> strides([2, 1, 2, 2])
    (1, 2, 2, 4)
    """
    out, acc = [], 1
    for s in sizes:
        out.append(acc)
        acc *= s
    return tuple(out)


def decompose(rank: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """Coordinates of ``rank`` for axes of ``sizes`` (fastest first).

    >>> decompose(6, [2, 1, 2, 2])
    (0, 0, 1, 1)
    """
    world = math.prod(sizes)
    if not 0 <= rank < world:
        raise LayoutError(f"rank {rank} is outside a grid of {world} ranks")
    return tuple((rank // st) % s for s, st in zip(sizes, strides(sizes), strict=True))


def compose(coords: Sequence[int], sizes: Sequence[int]) -> int:
    """Inverse of :func:`decompose`.

    >>> compose((0, 0, 1, 1), [2, 1, 2, 2])
    6
    """
    if len(coords) != len(sizes):
        raise LayoutError(f"{len(coords)} coordinates for {len(sizes)} axes")
    for c, s in zip(coords, sizes, strict=True):
        if not 0 <= c < s:
            raise LayoutError(f"coordinate {c} is outside an axis of size {s}")
    return sum(c * st for c, st in zip(coords, strides(sizes), strict=True))


def orthogonal_groups(sizes: Sequence[int], mask: Sequence[bool]) -> list[list[int]]:
    """Groups of ranks that differ only along the masked axes (Megatron semantics).

    Equal to Megatron-LM's ``generate_masked_orthogonal_rank_groups(world, sizes, mask)``:
    inside a group the masked axes vary (the fastest masked axis fastest); groups are
    listed with the unmasked axes varying (the fastest unmasked axis fastest).

    With ``sizes = [tp=2, dp=3]``: ``mask=[True, False]`` gives the tp groups
    ``[[0, 1], [2, 3], [4, 5]]``, ``mask=[False, True]`` the dp groups
    ``[[0, 2, 4], [1, 3, 5]]`` and ``mask=[True, True]`` one group of all six.

    >>> orthogonal_groups([2, 3], [False, True])
    [[0, 2, 4], [1, 3, 5]]
    """
    if len(sizes) != len(mask):
        raise LayoutError(f"{len(mask)} mask entries for {len(sizes)} axes")
    n = len(sizes)
    grid = np.arange(math.prod(sizes)).reshape(tuple(reversed(sizes)) or (1,))
    # numpy axis k of `grid` is layout axis n-1-k; C order makes the last numpy axis fastest.
    unmasked = [n - 1 - i for i in reversed(range(n)) if not mask[i]]
    masked = [n - 1 - i for i in reversed(range(n)) if mask[i]]
    group_size = math.prod(s for s, m in zip(sizes, mask, strict=True) if m)
    return grid.transpose(unmasked + masked).reshape(-1, group_size).tolist() if n else [[0]]


def rank_to_coords(rank: int, layout: Layout) -> dict[Axis, int]:
    """Coordinates of a logical rank, keyed by axis (in ``layout.order``).

    >>> lay = Layout(tp=2, dp_replicate=2, pp=2)
    >>> {a.value: c for a, c in rank_to_coords(6, lay).items() if lay.degree(a) > 1}
    {'tp': 0, 'dp_replicate': 1, 'pp': 1}
    """
    return dict(zip(layout.order, decompose(rank, layout.sizes), strict=True))


def coords_to_rank(coords: Mapping[Axis | str, int], layout: Layout) -> int:
    """Logical rank at ``coords``; axes left out are at coordinate 0.

    >>> coords_to_rank({"tp": 1, "pp": 1}, Layout(tp=2, pp=2))
    3
    """
    given = {Axis.parse(k): v for k, v in coords.items()}
    return compose([given.get(a, 0) for a in layout.order], layout.sizes)


def axis_groups(layout: Layout, axes: Axis | str | Iterable[Axis | str]) -> list[list[int]]:
    """Logical rank groups of one axis or of several axes together.

    >>> axis_groups(Layout(tp=2, dp_replicate=2, pp=2), "dp_replicate")
    [[0, 2], [1, 3], [4, 6], [5, 7]]
    >>> axis_groups(Layout(tp=2, pp=2), ["tp", "pp"])
    [[0, 1, 2, 3]]
    """
    wanted = {Axis.parse(axes)} if isinstance(axes, str | Axis) else {Axis.parse(a) for a in axes}
    return orthogonal_groups(layout.sizes, [a in wanted for a in layout.order])


def logical_mesh(layout: Layout) -> np.ndarray:
    """Logical ranks as an array of ``layout.mesh_shape`` (``mesh_axes``, slowest first).

    Indexing it with mesh coordinates gives the logical rank; axes of degree 1 are
    dropped. This is the shape torch's ``DeviceMesh`` takes.

    With tp fastest the mesh dims are ``(pp, tp)`` and each row is a TP group; with pp
    fastest they are ``(tp, pp)`` and each row is a pipeline:

    >>> logical_mesh(Layout(tp=2, pp=2, order=("tp", "pp"))).tolist()
    [[0, 1], [2, 3]]
    >>> lay = Layout(tp=2, dp_shard=2, pp=2, order=("pp", "tp", "dp_shard"))
    >>> [a.value for a in lay.mesh_axes], logical_mesh(lay).tolist()
    (['dp_shard', 'tp', 'pp'], [[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    """
    full = np.arange(layout.world_size).reshape(tuple(reversed(layout.sizes)))
    # numpy axes of `full` are the layout axes slowest first; keep the mesh axes in that order.
    slowest_first = list(reversed(layout.order))
    keep = [slowest_first.index(a) for a in layout.mesh_axes]
    perm = keep + [i for i in range(len(slowest_first)) if i not in keep]
    return full.transpose(perm).reshape(layout.mesh_shape)
