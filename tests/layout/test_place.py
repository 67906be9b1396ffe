"""Placement on fixture topologies where the naive rank order crosses IB and ours does not."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from topomesh.errors import LayoutError
from topomesh.layout.dims import Axis, Layout
from topomesh.layout.place import Strategy, axis_report, locality_order, place
from topomesh.topology.api import load_topology, save_topology
from topomesh.topology.model import LinkKind

from .topos import contiguous, cpu_topology, h100_host, interleaved, islands_host, permuted


def _hosts(n: int) -> list:
    return [h100_host(f"node{i}") for i in range(n)]


def _kinds(topo, placement) -> dict[Axis, LinkKind]:
    return {r.axis: r.kind for r in axis_report(topo, placement)}


def test_interleaved_ranks_tp_stays_on_nvswitch_pp_crosses_ib() -> None:
    topo = interleaved(_hosts(2))
    lay = Layout(tp=8, pp=2)
    naive = place(topo, lay, Strategy.RANK_ORDER)
    ours = place(topo, lay)
    assert naive.groups("tp")[0] == [0, 1, 2, 3, 4, 5, 6, 7]  # half on each host
    assert _kinds(topo, naive)[Axis.TP] is LinkKind.IB
    assert ours.groups("tp") == [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]]
    report = {r.axis: r for r in axis_report(topo, ours)}
    assert report[Axis.TP].kind is LinkKind.NVSWITCH and report[Axis.TP].hosts_per_group == 1
    assert report[Axis.PP].kind is LinkKind.IB and report[Axis.PP].hosts_per_group == 2
    assert report[Axis.TP].bottleneck_GBps > 10 * report[Axis.PP].bottleneck_GBps
    assert report[Axis.TP].note is None
    naive_tp = next(r for r in axis_report(topo, naive) if r.axis is Axis.TP)
    assert naive_tp.note and "in rank order its groups cross IB" in naive_tp.note


def test_host_contiguous_is_identity() -> None:
    topo = contiguous(_hosts(2))
    assert place(topo, Layout(tp=4, dp_shard=2, pp=2)).ranks == tuple(range(16))


def test_tp16_cannot_fit_in_8_gpu_islands() -> None:
    topo = contiguous(_hosts(2))
    (tp,) = axis_report(topo, place(topo, Layout(tp=16)))
    assert tp.kind is LinkKind.IB
    assert tp.note == "tp=16 cannot fit in 8-GPU NVLink islands: crosses IB"


def test_islands_of_four_keep_tp4_inside_cp_crosses_pcie() -> None:
    hosts = [islands_host(f"n{i}", island=4) for i in range(2)]
    topo = interleaved(hosts)
    p = place(topo, Layout(tp=4, cp=2, pp=2))
    kinds = _kinds(topo, p)
    assert kinds[Axis.TP] is LinkKind.NVLINK
    assert kinds[Axis.CP] is LinkKind.SYS  # across the two islands of one host
    assert kinds[Axis.PP] is LinkKind.IB
    too_big = {r.axis: r for r in axis_report(topo, place(topo, Layout(tp=8, pp=2)))}
    assert too_big[Axis.TP].note == "tp=8 cannot fit in 4-GPU NVLink islands: crosses SYS"


def test_order_that_puts_dp_inside_is_reported() -> None:
    topo = contiguous(_hosts(2))
    p = place(topo, Layout(tp=4, dp_shard=4, order="dp_shard-tp"))
    (tp,) = [r for r in axis_report(topo, p) if r.axis is Axis.TP]
    assert tp.kind is LinkKind.IB
    assert "dp_shard varies faster in the order" in (tp.note or "")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_any_rank_order_keeps_tp_on_one_host(seed: int) -> None:
    host_of = [h for h in range(4) for _ in range(8)]
    random.Random(seed).shuffle(host_of)
    topo = permuted(_hosts(4), host_of)
    p = place(topo, Layout(tp=8, dp_replicate=2, pp=2))
    for g in p.groups("tp"):
        assert len({topo.ranks[r].host for r in g}) == 1
    # dp pairs up two hosts, pp the other two: every axis group stays a set of whole ranks
    assert sorted(r for g in p.groups("pp") for r in g) == list(range(32))
    for axis in ("dp_replicate", "pp"):
        # each group joins one GPU of each of two hosts, on the same local rank (the same rail)
        groups = p.groups(axis)
        assert all(len({topo.ranks[r].host for r in g}) == 2 for g in groups)
        assert all(len({topo.ranks[r].local_rank for r in g}) == 1 for g in groups)
        assert len({frozenset(topo.ranks[r].host for r in g) for g in groups}) == 2


def test_same_mapping_from_the_same_file(tmp_path) -> None:
    topo = interleaved(_hosts(2))
    path = save_topology(topo, tmp_path / "world.json")
    again = load_topology(path)
    lay = Layout(tp=8, pp=2)
    assert place(again, lay).ranks == place(topo, lay).ranks
    assert locality_order(again) == locality_order(topo)


def test_wrong_world_size_is_a_layout_error() -> None:
    with pytest.raises(LayoutError, match="needs 8 ranks .* but the world has 4"):
        place(cpu_topology(4), Layout(tp=4, pp=2))


def test_cpu_world_reports_shm_without_notes() -> None:
    topo = cpu_topology(4)
    rep = axis_report(topo, place(topo, Layout(tp=2, pp=2)))
    assert [(r.axis, r.kind, r.note) for r in rep] == [(Axis.PP, LinkKind.SHM, None), (Axis.TP, LinkKind.SHM, None)]


def test_placement_mesh_and_coords_agree() -> None:
    topo = interleaved(_hosts(2))
    p = place(topo, Layout(tp=8, pp=2))
    mesh = p.mesh()
    assert mesh.shape == (2, 8)
    for pp in range(2):
        for tp in range(8):
            assert p.coords(int(mesh[pp, tp]))[Axis.TP] == tp
            assert p.coords(int(mesh[pp, tp]))[Axis.PP] == pp
    assert mesh[0].tolist() == p.groups("tp")[0]
    assert [p.logical_rank(r) for r in p.ranks] == list(range(16))
    for bad in (-1, 16):
        with pytest.raises(LayoutError, match=f"rank {bad} is not in this placement of 16 ranks"):
            p.logical_rank(bad)


def test_ranks_sharing_a_cpu_socket_are_not_an_nvlink_island() -> None:
    from topomesh.layout.place import nvlink_island_size
    from topomesh.topology.build import build_topology, default_placement
    from topomesh.topology.model import Device, DeviceKind, Host

    host = Host(hostname="cpu", devices=(Device(id="CPU0", kind=DeviceKind.CPU, index=0),))
    topo = build_topology([host], default_placement([host], [4]))
    assert nvlink_island_size(topo) == 1
    assert nvlink_island_size(contiguous(_hosts(2))) == 8
    assert all(r.note is None for r in axis_report(topo, place(topo, Layout(tp=4))))


def test_a_checked_rank_list_is_checked_again_for_another_world():
    """Placements share the inverse of a rank list they already checked (a search places
    thousands of layouts on one list); the same list under a layout of another size is refused."""
    from topomesh.layout.place import Placement

    ranks = (0, 2, 1, 3)
    assert Placement(layout=Layout(tp=4), ranks=ranks, strategy=Strategy.TOPOLOGY).logical_rank(2) == 1
    with pytest.raises(LayoutError, match="must use each of the 2 ranks once"):
        Placement(layout=Layout(tp=2), ranks=ranks, strategy=Strategy.TOPOLOGY)
    same = tuple([0, 2, 1, 3])  # an equal list, another object: checked on its own
    assert Placement(layout=Layout(tp=4), ranks=same, strategy=Strategy.TOPOLOGY).logical_rank(3) == 3
