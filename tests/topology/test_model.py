from __future__ import annotations

import pytest

from topomesh.errors import TopologyError
from topomesh.topology.build import build_topology, default_placement, single_host_topology
from topomesh.topology.model import Connection, Host, LinkKind, RankInfo

from .helpers import cpu_host, dgx_host, pcie_host


def two_dgx():
    hosts = [dgx_host("a"), dgx_host("b")]
    return build_topology(hosts, default_placement(hosts, [8, 8]))


def test_link_kind_order_and_rfc_type():
    kinds = sorted(LinkKind, key=lambda k: k.tier)
    assert kinds[0] is LinkKind.LOC and kinds[-1] is LinkKind.UNKNOWN
    assert LinkKind.PIX.tier < LinkKind.PXB.tier < LinkKind.PHB.tier < LinkKind.NODE.tier < LinkKind.SYS.tier
    assert LinkKind.SYS.tier < LinkKind.IB.tier < LinkKind.NIC.tier
    assert {k.rfc_type for k in LinkKind if k.is_pcie} == {"PCIe"}
    assert LinkKind.parse("nvswitch") is LinkKind.NVSWITCH
    assert LinkKind.parse("NV18") is LinkKind.NVLINK
    assert LinkKind.parse("Ethernet") is LinkKind.NIC
    with pytest.raises(ValueError, match="unknown link kind"):
        LinkKind.parse("carrier-pigeon")


def test_connections_on_dgx_pair():
    t = two_dgx()
    nv = t.connection(0, 7)
    assert nv.kind is LinkKind.NVSWITCH and nv.channels == 18
    assert nv.bandwidth_GBps == pytest.approx(18 * 20.6)  # NCCL SM90_NVLINK_BW per link
    ib = t.connection(3, 11)
    assert ib.kind is LinkKind.IB and ib.bandwidth_GBps == pytest.approx(400 / 8)
    assert t.connection(5, 5).kind is LinkKind.LOC
    assert t.connection(2, 9) == t.connection(9, 2)
    assert t.same_host(0, 7) and not t.same_host(7, 8)


def test_table_is_compact_for_identical_hosts():
    hosts = [dgx_host(f"n{i}") for i in range(64)]
    t = build_topology(hosts, default_placement(hosts, [8] * 64))
    assert len(t.table.local) == 1  # every host shares one local matrix
    assert t.table.inter.shape == (1, 1)  # one rail class: 400G IB
    assert len(t.table.palette) == 3  # LOC, NVSwitch, IB


def test_domains_and_hosts():
    hosts = [pcie_host("p0"), pcie_host("p1")]
    t = build_topology(hosts, default_placement(hosts, [4, 4]))
    assert t.domains(LinkKind.NVLINK) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.domains(LinkKind.SYS) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert t.domains("NIC") == [list(range(8))]
    # Ethernet hosts are not joined at the IB level
    assert t.domains(LinkKind.IB) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert t.connection(0, 2).kind is LinkKind.SYS
    assert t.connection(0, 2).bandwidth_GBps == pytest.approx(10.0)  # capped by inter-socket default
    assert t.connection(0, 5).kind is LinkKind.NIC


def test_rails_follow_nearest_nic():
    h = pcie_host("p")
    assert h.nearest_nic("GPU0").name == "eth0"
    d = dgx_host("d")
    assert [d.nearest_nic(f"GPU{i}").name for i in range(8)] == [f"mlx5_{i}" for i in range(8)]


def test_mixed_rails_use_slower_end():
    hosts = [dgx_host("fast", nic_Gbps=400), dgx_host("slow", nic_Gbps=200)]
    t = build_topology(hosts, default_placement(hosts, [8, 8]))
    assert t.connection(0, 8).bandwidth_GBps == pytest.approx(25.0)
    assert t.table.inter.shape == (2, 2)


def test_ib_to_ethernet_is_nic():
    hosts = [dgx_host("ib"), cpu_host("eth")]
    t = build_topology(hosts, default_placement(hosts, [8, 2]))
    c = t.connection(0, 8)
    assert c.kind is LinkKind.NIC and c.bandwidth_GBps == pytest.approx(10 / 8)


def test_cpu_only_host_is_shm():
    t = single_host_topology(cpu_host("c", sockets=2), 4)
    assert t.connection(0, 1).kind is LinkKind.SHM
    # local ranks 0 and 2 share CPU0: still two processes talking over shared memory
    assert t.connection(0, 2).kind is LinkKind.SHM
    assert t.connection(2, 2).kind is LinkKind.LOC


def test_replica_peers_prefer_other_hosts_same_rail():
    hosts = [dgx_host(f"n{i}") for i in range(4)]
    t = build_topology(hosts, default_placement(hosts, [8] * 4))
    assert t.replica_peers(3, 3) == [11, 19, 27]
    assert t.replica_peers(27, 2) == [3, 11]
    # more peers than other hosts: another round over the other hosts (next local rank),
    # never the rank's own host while another host has a rank left
    assert t.replica_peers(0, 5) == [8, 16, 24, 9, 17]
    peers = t.replica_peers(0, 26)
    assert len(set(peers)) == 26 and {t.ranks[p].host for p in peers[:24]} == {1, 2, 3}
    assert peers[24:] == [1, 2]  # then its own host (one NVSwitch island here)
    with pytest.raises(TopologyError, match="cannot pick 32"):
        t.replica_peers(0, 32)


def test_measured_override_wins():
    hosts = [dgx_host("a"), dgx_host("b")]
    m = Connection(kind=LinkKind.IB, latency_us=3.1, bandwidth_GBps=46.2, measured=True)
    t = build_topology(hosts, default_placement(hosts, [8, 8]), measured={(9, 1): m})
    assert t.connection(1, 9) == m and t.connection(9, 1) == m
    assert not t.connection(2, 9).measured


def test_bad_inputs_raise_topology_error():
    h = dgx_host("a")
    with pytest.raises(TopologyError, match="placed on host 3"):
        build_topology([h], [RankInfo(rank=0, host=3, local_rank=0)])
    with pytest.raises(TopologyError, match="in order"):
        build_topology([h], [RankInfo(rank=1, host=0, local_rank=0)])
    with pytest.raises(TopologyError, match="no device 'GPU9'"):
        build_topology([h], [RankInfo(rank=0, host=0, local_rank=0, device="GPU9")])
    with pytest.raises(TopologyError, match="unique"):
        build_topology([h, h], [])
    with pytest.raises(TopologyError, match="outside the world"):
        two_dgx().connection(0, 16)
    with pytest.raises(TopologyError, match="latency"):
        Connection(kind=LinkKind.IB, latency_us=float("nan"), bandwidth_GBps=1.0)


def test_host_dict_round_trip_and_validation():
    h = pcie_host("p")
    assert Host.from_dict(h.to_dict()) == h
    bad = h.to_dict()
    bad["paths"][0]["kind"] = "warp-drive"
    with pytest.raises(TopologyError, match="node-7: malformed host"):
        Host.from_dict(bad, source="node-7")
    dup = h.to_dict()
    dup["devices"].append(dup["devices"][0])
    with pytest.raises(TopologyError, match="duplicate endpoint"):
        Host.from_dict(dup)
    with pytest.raises(TopologyError, match="malformed"):
        Host.from_dict(["not", "a", "dict"])


def test_renamed_host_shares_index_and_equals_a_fresh_one():
    h = dgx_host("a")
    r = h.renamed("b")
    assert r == dgx_host("b") and r.hostname == "b" and h.hostname == "a"
    assert r.path("GPU0", "NIC0").kind is LinkKind.PIX
    with pytest.raises(TopologyError, match="non-empty string"):
        h.renamed("")
