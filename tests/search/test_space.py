from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest

from topomesh.errors import LayoutError
from topomesh.layout.dims import Axis
from topomesh.search.space import (
    AXES,
    KnobTable,
    Recompute,
    Schedule,
    enumerate_space,
    ordered_factorizations,
)

ALL = [a.value for a in Axis]


def formula(n: int, k: int) -> int:
    """The issue's closed form for 2^n ranks and k strategies."""
    return sum(math.comb(k, t) * math.factorial(t) * math.comb(n - 1, t - 1) for t in range(1, k + 1))


@pytest.mark.parametrize("k", range(1, 7))
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 10, 14])
def test_count_matches_the_closed_formula(n, k):
    space = enumerate_space(2**n, strategies=ALL[:k])
    assert space.n_layouts == formula(n, k)
    assert space.size == space.n_layouts  # no knobs searched: one knob row


def test_the_published_count_for_16384_gpus():
    assert enumerate_space(16_384).n_layouts == 1_554_156


def brute_force(world: int, strategies: list[str], fixed: dict[str, int]) -> set[tuple]:
    """Every (degrees, order) by trying every divisor on every axis and every order."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    out = set()
    for combo in itertools.product(divisors, repeat=len(AXES)):
        degrees = dict(zip(ALL, combo, strict=True))
        if math.prod(combo) != world:
            continue
        if any(d > 1 and a not in strategies for a, d in degrees.items()):
            continue
        if any(degrees[a] != d for a, d in fixed.items()):
            continue
        used = [a for a in ALL if degrees[a] > 1]
        for order in itertools.permutations(used):
            out.add((combo, order))
    return out


@pytest.mark.parametrize(
    ("world", "strategies", "fixed"),
    [
        (1, ALL, {}),
        (2, ALL, {}),
        (8, ALL, {}),
        (12, ALL, {}),
        (30, ALL, {}),
        (16, ["tp", "pp", "dp_shard", "cp"], {"tp": 4}),
        (24, ALL, {"tp": 2, "ep": 1}),
        (36, ["dp_replicate", "pp", "cp"], {}),
    ],
)
def test_enumeration_equals_brute_force(world, strategies, fixed):
    space = enumerate_space(world, strategies=strategies, fixed=fixed)
    rows, perms = space.layout_index()
    got = [
        (tuple(int(d) for d in space.degrees[r]), tuple(a.value for a in space.order(r, p)))
        for r, p in zip(rows.tolist(), perms.tolist(), strict=True)
    ]
    assert len(got) == len(set(got)) == space.n_layouts  # no duplicates
    assert set(got) == brute_force(world, strategies, fixed)


def test_layout_by_index_is_a_valid_layout_of_the_world():
    space = enumerate_space(12, knobs=KnobTable.product(micro_batch=(1, 2)))
    seen = set()
    for i in range(space.size):
        lay, knobs = space.layout(i)
        lay.check_world(12)
        seen.add((tuple(lay.degree(a) for a in AXES), lay.order_text(), knobs.micro_batch))
    assert len(seen) == space.size == 2 * space.n_layouts
    with pytest.raises(LayoutError, match="layout index 9999 is outside the space of"):
        space.layout(9999)


def test_world_of_one_has_the_single_trivial_layout():
    space = enumerate_space(1)
    assert space.n_layouts == 1
    assert space.layout(0)[0].describe() == "1 rank"


def test_fixed_degrees_and_strategies_are_always_honoured():
    space = enumerate_space(1024, strategies=["tp", "pp", "dp_shard", "cp"], fixed={"tp": 8, "cp": 1})
    deg = {a: space.degrees[:, i] for i, a in enumerate(AXES)}
    assert (deg[Axis.TP] == 8).all()
    for a in (Axis.CP, Axis.EP, Axis.DP_REPLICATE):
        assert (deg[a] == 1).all()
    assert (space.degrees.prod(axis=1) == 1024).all()
    # 128 = 2^7 over two free axes (pp, dp_shard), tp always in use:
    # t >= 1 free axes used: C(2,t) * C(6,t-1) degree splits, (t+1)! orders with tp.
    assert space.n_layouts == 2 * 1 * 2 + 1 * 6 * 6


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fixed": {"tp": 3}}, r"the fixed degrees tp=3 \(3 ranks\) do not divide the world of 16"),
        ({"strategies": ["pp"], "fixed": {"tp": 2}}, "tp is fixed to 2 but is not among the strategies"),
        ({"fixed": {"tp": 0}}, "fixed degree of tp must be a positive integer"),
        ({"strategies": []}, "names no parallel axis"),
        ({"strategies": ["warp"]}, "unknown parallel axis 'warp'"),
    ],
)
def test_impossible_constraints_are_refused(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        enumerate_space(16, **kwargs)


def test_ordered_factorizations_of_a_non_power_of_two():
    # 12 = 2*2*3: three factors in any order are the 3 arrangements of {2, 2, 3}.
    assert sorted(map(tuple, ordered_factorizations(12, 3).tolist())) == [(2, 2, 3), (2, 3, 2), (3, 2, 2)]
    assert ordered_factorizations(12, 1).tolist() == [[12]]
    assert len(ordered_factorizations(12, 4)) == 0
    assert len(ordered_factorizations(7, 2)) == 0


def test_knob_table_is_the_product_of_the_requested_values():
    table = KnobTable.product(
        micro_batch=(1, 2, 4),
        recompute=("none", "full"),
        schedule=("gpipe", "1f1b", "interleaved-1f1b"),
        interleave=(1, 2, 4),
    )
    # 3 micro-batches x 2 recompute x (gpipe, 1f1b, interleaved v=2, interleaved v=4)
    assert len(table) == 3 * 2 * 4
    rows = table.rows()
    assert len(set(rows)) == len(rows)
    assert {(k.schedule, k.interleave) for k in rows} == {
        (Schedule.GPIPE, 1), (Schedule.ONE_F_ONE_B, 1),
        (Schedule.INTERLEAVED_1F1B, 2), (Schedule.INTERLEAVED_1F1B, 4),
    }
    assert {k.recompute for k in rows} == {Recompute.NONE, Recompute.FULL}
    space = enumerate_space(8, knobs=table)
    assert space.size == formula(3, 6) * 24


def test_every_multi_stage_schedule_takes_the_interleaves():
    table = KnobTable.product(schedule=("interleaved-zb", "looped-bfs", "gpipe"), interleave=(1, 2, 4))
    assert [(k.schedule.value, k.interleave) for k in table.rows()] == [
        ("interleaved-zb", 2), ("interleaved-zb", 4), ("looped-bfs", 2), ("looped-bfs", 4), ("gpipe", 1),
    ]


def test_knob_errors_name_the_value():
    with pytest.raises(LayoutError, match=r"interleaved-1f1b schedule needs an interleave above 1; got \[1\]"):
        KnobTable.product(schedule=("interleaved-1f1b",), interleave=(1,))
    with pytest.raises(LayoutError, match="every micro-batch size must be a positive integer, got 0"):
        KnobTable.product(micro_batch=(0,))
    with pytest.raises(ValueError, match="'zigzag' is not a valid Schedule"):
        KnobTable.product(schedule=("zigzag",))


def test_recompute_modes_are_the_parallelize_checkpointing_modes():
    from topomesh.models.parallelize import Checkpointing

    assert {r.value for r in Recompute} == {c.value for c in Checkpointing}


def test_arrays_are_read_only():
    space = enumerate_space(16)
    with pytest.raises(ValueError, match="read-only"):
        space.degrees[0, 0] = 5
    assert np.array_equal(space.offsets[1:] - space.offsets[:-1], space.n_orders)


def test_the_16384_gpu_space_enumerates_well_under_a_second():
    # Measured 10-31 ms (index arrays 8-18 ms) on the 2 shared cores (benchmarks/RESULTS.md).
    t0 = time.perf_counter()
    rows, perms = enumerate_space(16_384).layout_index()
    elapsed = time.perf_counter() - t0
    assert len(rows) == len(perms) == 1_554_156
    assert elapsed < 1.0
