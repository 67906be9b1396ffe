"""Rank math against a brute-force reference (Megatron's loop form) and worked examples."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from topomesh.errors import LayoutError
from topomesh.layout.dims import Axis, Layout
from topomesh.layout.ranks import (
    axis_groups,
    compose,
    coords_to_rank,
    decompose,
    logical_mesh,
    orthogonal_groups,
    rank_to_coords,
)


def megatron_reference(world: int, sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """Megatron-LM's generate_masked_orthogonal_rank_groups, written out as plain loops."""

    def prefix(a: list[int]) -> list[int]:
        out, acc = [1], 1
        for v in a:
            acc *= v
            out.append(acc)
        return out

    def dec(index: int, shape: list[int]) -> list[int]:
        return [(index // d) % s for s, d in zip(shape, prefix(shape), strict=False)]

    masked = [s for s, m in zip(sizes, mask, strict=True) if m]
    unmasked = [s for s, m in zip(sizes, mask, strict=True) if not m]
    gstride = prefix(sizes)
    mstride = [d for d, m in zip(gstride, mask, strict=False) if m]
    ustride = [d for d, m in zip(gstride, mask, strict=False) if not m]
    gsize = prefix(masked)[-1]
    out = []
    for g in range(world // gsize):
        gi = dec(g, unmasked)
        out.append(
            [
                sum(x * y for x, y in zip(dec(r, masked), mstride, strict=True))
                + sum(x * y for x, y in zip(gi, ustride, strict=True))
                for r in range(gsize)
            ]
        )
    return out


shapes = st.lists(st.integers(1, 4), min_size=1, max_size=5).filter(lambda s: math.prod(s) <= 256)


@settings(max_examples=150, deadline=None)
@given(sizes=shapes, data=st.data())
def test_orthogonal_groups_match_megatron(sizes: list[int], data: st.DataObject) -> None:
    mask = data.draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    got = orthogonal_groups(sizes, mask)
    assert got == megatron_reference(math.prod(sizes), sizes, mask)
    # a partition of the world into equal groups
    flat = sorted(r for g in got for r in g)
    assert flat == list(range(math.prod(sizes)))


@settings(max_examples=100, deadline=None)
@given(sizes=shapes, data=st.data())
def test_decompose_compose_roundtrip(sizes: list[int], data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, math.prod(sizes) - 1))
    coords = decompose(rank, sizes)
    assert compose(coords, sizes) == rank
    assert all(0 <= c < s for c, s in zip(coords, sizes, strict=True))


degrees = st.fixed_dictionaries({a.value: st.sampled_from([1, 2, 3]) for a in Axis}).filter(
    lambda d: math.prod(d.values()) <= 64
)


@settings(max_examples=100, deadline=None)
@given(deg=degrees, perm=st.permutations(list(Axis)), data=st.data())
def test_axis_groups_brute_force(deg: dict[str, int], perm: list[Axis], data: st.DataObject) -> None:
    """A group of axes S = ranks whose coordinates agree on every axis outside S."""
    lay = Layout(**deg, order=tuple(perm))
    chosen = data.draw(st.sets(st.sampled_from(list(Axis)), min_size=1))
    groups = axis_groups(lay, chosen)
    coords = {r: rank_to_coords(r, lay) for r in range(lay.world_size)}
    key = {r: tuple(c for a, c in coords[r].items() if a not in chosen) for r in coords}
    expect: dict[tuple[int, ...], set[int]] = {}
    for r, k in key.items():
        expect.setdefault(k, set()).add(r)
    assert sorted(map(sorted, groups)) == sorted(map(sorted, expect.values()))
    assert {len(g) for g in groups} == {math.prod(lay.degree(a) for a in chosen)}


@settings(max_examples=100, deadline=None)
@given(deg=degrees, perm=st.permutations(list(Axis)))
def test_logical_mesh_indexes_coordinates(deg: dict[str, int], perm: list[Axis]) -> None:
    lay = Layout(**deg, order=tuple(perm))
    mesh = logical_mesh(lay)
    assert mesh.shape == lay.mesh_shape
    for idx in itertools.product(*(range(s) for s in mesh.shape)):
        coords = dict(zip(lay.mesh_axes, idx, strict=True))
        assert mesh[idx] == coords_to_rank(coords, lay)


def test_worked_example_tp_dp_pp() -> None:
    lay = Layout(tp=2, dp_replicate=2, pp=2, order=("tp", "cp", "dp_replicate", "pp"))
    assert axis_groups(lay, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(lay, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(lay, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert axis_groups(lay, ["tp", "dp"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rank_to_coords(6, lay)[Axis.PP] == 1


def test_layout_validation_names_numbers() -> None:
    with pytest.raises(LayoutError, match=r"needs 16 ranks \(tp=8 × pp=2\) but the world has 8"):
        Layout(tp=8, pp=2).check_world(8)
    with pytest.raises(LayoutError, match="unknown parallel axis 'xp'"):
        Layout.from_degrees({"xp": 2})
    with pytest.raises(LayoutError, match="'tp' appears twice"):
        Layout(order="tp-pp-tp")
    with pytest.raises(LayoutError, match="'tp' appears twice"):
        Layout(order=(Axis.TP,) * len(Axis))  # as long as a full order, but not every axis
    with pytest.raises(LayoutError, match="tp must be a positive integer degree, got 0"):
        Layout(tp=0)
    with pytest.raises(LayoutError, match="tp=3 does not divide the 32 attention heads"):
        Layout(tp=3).check_model(n_heads=32)
    with pytest.raises(LayoutError, match="pp=3 does not divide the 8 layers"):
        Layout(pp=3).check_model(n_layers=8)
    Layout(tp=4, pp=2).check_model(n_heads=32, n_kv_heads=8, n_layers=8)


def test_order_parsing() -> None:
    lay = Layout.from_degrees(tp=2, pp=2, order="pp,tp")
    assert lay.order[:2] == (Axis.PP, Axis.TP)
    assert len(lay.order) == len(Axis)
    assert Layout(order=("tp", "pp")).order[:2] == (Axis.TP, Axis.PP)
