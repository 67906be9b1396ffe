"""Replica groupings: PopXL's assignment algorithm as reference, and its documented examples."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from topomesh.errors import LayoutError
from topomesh.layout.replicas import (
    Instances,
    ReplicaGrouping,
    hsdp_mesh_ranks,
    replica_value,
    shard_of,
    unshard,
    weights_from_host,
    weights_to_host,
)


def popxl_assignment(num_replicas: int, stride: int, group_size: int) -> list[int]:
    """PopXL's ReplicaGrouping._get_assignment, written out: fill groups at the first gap."""
    assign: list[int | None] = [None] * num_replicas
    offset = 0
    for i in range(num_replicas // group_size):
        while assign[offset] is not None:
            offset += 1
        for k in range(group_size):
            assign[offset + k * stride] = i
    return assign  # type: ignore[return-value]


@st.composite
def groupings(draw: st.DrawFn) -> ReplicaGrouping:
    gs = draw(st.sampled_from([1, 2, 3, 4]))
    stride = draw(st.sampled_from([1, 2, 3, 4]))
    blocks = draw(st.integers(1, 4))
    return ReplicaGrouping(num_replicas=gs * stride * blocks, group_size=gs, stride=stride)


@settings(max_examples=150, deadline=None)
@given(g=groupings())
def test_assignment_matches_popxl(g: ReplicaGrouping) -> None:
    assert list(g.assignment()) == popxl_assignment(g.num_replicas, g.stride or 1, g.group_size)
    for r in range(g.num_replicas):
        assert g.groups()[g.group_of(r)][g.index_in_group(r)] == r


@settings(max_examples=150, deadline=None)
@given(g=groupings())
def test_transpose_is_the_group_matrix_transposed(g: ReplicaGrouping) -> None:
    t = g.transpose()
    matrix = g.groups()
    assert t.groups() == [list(col) for col in zip(*matrix, strict=True)]
    assert t.num_groups == g.group_size and t.group_size == g.num_groups
    assert sorted(map(sorted, t.transpose().groups())) == sorted(map(sorted, matrix))
    # PopXL's closed form where the transpose has a constant stride
    if g.stride == 1 or (g.stride or 1) * g.group_size == g.num_replicas:
        assert t.is_const
        assert t.stride == (1 if (g.stride or 1) > 1 else g.group_size) or t.group_size == 1


def test_popxl_documented_assignments_and_transposes() -> None:
    def a(r: int, s: int, gs: int) -> list[int]:
        return list(ReplicaGrouping(num_replicas=r, group_size=gs, stride=s).assignment())

    assert a(8, 1, 8) == [0] * 8
    assert a(8, 1, 1) == list(range(8))
    assert a(8, 1, 2) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert a(8, 2, 2) == [0, 1, 0, 1, 2, 3, 2, 3]
    assert a(8, 2, 4) == [0, 1, 0, 1, 0, 1, 0, 1]
    for before, after in [([0, 0, 0, 0], [0, 1, 2, 3]), ([0, 1, 0, 1], [0, 0, 1, 1]),
                          ([0, 0, 1, 1], [0, 1, 0, 1]), ([0, 1, 2, 3], [0, 0, 0, 0])]:
        assert list(ReplicaGrouping.from_assignment(before).transpose().assignment()) == after
    odd = ReplicaGrouping(num_replicas=8, group_size=2, stride=2).transpose()
    assert not odd.is_const and list(odd.assignment()) == [0, 0, 1, 1, 0, 0, 1, 1]
    assert ReplicaGrouping(num_replicas=16, group_size=4, stride=4).groups() == [
        [0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_two_instances_two_replicas_group_size_1() -> None:
    """PopXL guide: 2 instances, 2 global replicas, ReplicaGrouping(group_size=1, stride=1)."""
    g = ReplicaGrouping(num_replicas=2, group_size=1)
    inst = Instances(num_replicas=2, num_instances=2)
    assert g.num_groups == 2 and g.groups() == [[0], [1]]
    # instance 0 sends w_data[0] to global replica 0 (its local replica 0), instance 1 w_data[1]
    assert inst.local_view(g, 0) == [{"instance": 0, "local_replica": 0, "replica": 0, "group": 0, "index_in_group": 0}]
    assert inst.local_view(g, 1) == [{"instance": 1, "local_replica": 0, "replica": 1, "group": 1, "index_in_group": 0}]
    assert inst.groups_spanning_instances(g) == []
    # the default grouping (one group of both) spans the two instances; default sharding over it
    whole = ReplicaGrouping(num_replicas=2, group_size=2)
    assert inst.groups_spanning_instances(whole) == [0]
    assert [whole.shard_index(r, 2) for r in range(2)] == [0, 1]


def test_sixteen_replicas_eight_instances_gs4_stride4_shard_over_2() -> None:
    """PopXL guide's complex example: 8 instances, 16 replicas, (group_size 4, stride 4), shard_over 2."""
    g = ReplicaGrouping(num_replicas=16, group_size=4, stride=4)
    inst = Instances(num_replicas=16, num_instances=8)
    assert g.num_groups == 4
    assert [inst.replicas_of(i) for i in range(8)] == [[2 * i, 2 * i + 1] for i in range(8)]
    # each group of 4 shards its value twice over: members 0,1 hold shards 0,1; members 2,3 again
    assert [g.shard_index(r, 2) for r in range(16)] == ([0] * 4 + [1] * 4) * 2
    gather = g.gather_grouping(2)
    assert (gather.group_size, gather.stride) == (2, 4)
    assert gather.groups() == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert sorted(gather.groups()) == sorted(g.shard_domains(2))
    for grp in gather.groups():
        assert sorted(g.shard_index(r, 2) for r in grp) == [0, 1]
    # every group spans 4 instances; instance 2 holds replicas 4, 5 = member 1 of groups 0, 1
    assert inst.groups_spanning_instances(g) == [0, 1, 2, 3]
    assert [(row["replica"], row["group"], row["index_in_group"], row["shard"]) for row in inst.local_view(g, 2, 2)] == [
        (4, 0, 1, 1), (5, 1, 1, 1)]


def test_gather_grouping_is_shard_over_consecutive_members() -> None:
    # one group of 8, shard_over 2: members hold shards 0,1,0,1,...; PopXL's text (group_size
    # 8 // 2 = 4) would gather [0 1 2 3], shards 0,1,0,1; pairs hold each shard once
    g = ReplicaGrouping(num_replicas=8, group_size=8)
    assert g.gather_grouping(2).groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # group_size 2 = shard_over: PopXL's text would give singletons, which gather nothing
    pairs = ReplicaGrouping(num_replicas=8, group_size=2, stride=4)
    assert pairs.gather_grouping(2).groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # no constant stride (the transpose of group_size 2, stride 2 on 8): [0 1 4 5] [2 3 6 7]
    odd = ReplicaGrouping(num_replicas=8, group_size=2, stride=2).transpose()
    assert odd.gather_grouping(2).groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for grouping, so in ((g, 2), (pairs, 2), (odd, 2), (ReplicaGrouping(num_replicas=12, group_size=6, stride=2), 3)):
        for grp in grouping.gather_grouping(so).groups():
            assert sorted(grouping.shard_index(r, so) for r in grp) == list(range(so))
            assert len({grouping.group_of(r) for r in grp}) == 1
    with pytest.raises(LayoutError, match="shard_over 3 must divide the group size 8"):
        g.shard_index(0, 3)


def test_shards_of_a_value_that_does_not_divide() -> None:
    value = torch.arange(1, 8).reshape(7)  # 7 elements over 3 -> shards of 3, 2 zeros of padding
    assert [shard_of(value, k, 3).tolist() for k in range(3)] == [[1, 2, 3], [4, 5, 6], [7, 0, 0]]
    assert unshard([shard_of(value, k, 3) for k in range(3)], (7,)).tolist() == list(range(1, 8))
    m = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert unshard([shard_of(m, k, 4) for k in range(4)], (2, 3)).tolist() == [[1, 2, 3], [4, 5, 6]]
    with pytest.raises(LayoutError, match=r"must have shape \(3,\); got \(2,\)"):
        unshard([torch.zeros(3), torch.zeros(2), torch.zeros(3)], (7,))


def test_replica_values_follow_popxl() -> None:
    # PopXL guide: w = [1, 2], 4 replicas in the group, shard_over 2 -> [1] [2] [1] [2]
    g = ReplicaGrouping(num_replicas=4, group_size=4)
    assert [replica_value(torch.tensor([1, 2]), g, r, shard_over=2).tolist() for r in range(4)] == [[1], [2], [1], [2]]
    # 2 groups (stride 2): replica r gets host[r % 2]
    g2 = ReplicaGrouping(num_replicas=4, group_size=2, stride=2)
    host = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert [replica_value(host, g2, r).tolist() for r in range(4)] == [[1, 2, 3], [4, 5, 6]] * 2


def test_host_data_of_the_wrong_shape() -> None:
    g2 = ReplicaGrouping(num_replicas=4, group_size=2)
    with pytest.raises(LayoutError, match=r"2 groups must have shape \(2, \*shape\).*got shape \(3, 5\)"):
        replica_value(torch.zeros(3, 5), g2, 0)
    with pytest.raises(LayoutError, match=r"2 groups must have shape \(2, \*shape\).*got shape \(\)"):
        replica_value(torch.tensor(1.0), g2, 0)
    with pytest.raises(LayoutError, match=r"values of shape \(4,\) must have shape \(2, 4\); got shape \(2, 5\)"):
        replica_value(torch.zeros(2, 5), g2, 0, shape=(4,))
    one = ReplicaGrouping(num_replicas=4, group_size=4)  # one group: the host data is the value
    with pytest.raises(LayoutError, match=r"values of shape \(4,\) must have shape \(4,\); got shape \(1, 4\)"):
        replica_value(torch.zeros(1, 4), one, 0, shape=(4,))
    with pytest.raises(LayoutError, match="4 distinct ranks, one per replica"):
        weights_from_host(torch.zeros(4), one, ranks=[0, 1, 1, 2])
    with pytest.raises(LayoutError, match="retrieval_mode must be one of"):
        weights_to_host(torch.zeros(4), one, retrieval_mode="first")


def test_bad_groupings() -> None:
    with pytest.raises(LayoutError, match="group_size 3 must divide the 8 replicas"):
        ReplicaGrouping(num_replicas=8, group_size=3)
    with pytest.raises(LayoutError, match="group_size 4 × stride 4 = 16 must divide the 8 replicas"):
        ReplicaGrouping(num_replicas=8, group_size=4, stride=4)
    with pytest.raises(LayoutError, match="same size"):
        ReplicaGrouping.from_assignment([0, 0, 1])
    with pytest.raises(LayoutError, match="order of first appearance"):
        ReplicaGrouping.from_assignment([1, 0])
    with pytest.raises(LayoutError, match="3 instances must divide the 16 replicas"):
        Instances(num_replicas=16, num_instances=3)


def test_hsdp_mesh_rows_shard_columns_replicate() -> None:
    shard = ReplicaGrouping(num_replicas=8, group_size=4)
    mesh = hsdp_mesh_ranks(shard, replica_ranks=[10, 11, 12, 13, 14, 15, 16, 17])
    assert mesh.tolist() == [[10, 11, 12, 13], [14, 15, 16, 17]]
    rep = shard.transpose()
    assert [list(c) for c in mesh.T] == [[10 + r for r in grp] for grp in rep.groups()]


def test_layout_dp_axes_are_a_grouping_and_its_transpose() -> None:
    """HSDP in a Layout (dp_shard fastest) is ReplicaGrouping(group_size=dp_shard) and its transpose."""
    from topomesh.layout.dims import Layout
    from topomesh.layout.ranks import axis_groups, logical_mesh

    lay = Layout(dp_shard=4, dp_replicate=2)
    shard = ReplicaGrouping(num_replicas=8, group_size=4)
    assert axis_groups(lay, "dp_shard") == shard.groups()
    assert axis_groups(lay, "dp_replicate") == shard.transpose().groups()
    assert logical_mesh(lay).tolist() == hsdp_mesh_ranks(shard).tolist()
