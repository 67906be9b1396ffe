"""The world model against hand-worked cases: rank bounds at the world size, the NIC each
device sends through (nearest, then fastest, IB before Ethernet, as NCCL picks), and the
IB domains that join hosts."""

from __future__ import annotations

import pytest

from topomesh.errors import TopologyError
from topomesh.topology.build import build_topology, default_placement
from topomesh.topology.model import Device, DeviceKind, Host, LinkKind, Nic, NicKind, Path

from .helpers import cpu_host, dgx_host, pcie_host


def _world(n_hosts: int = 2):
    hosts = [pcie_host(f"p{i}") for i in range(n_hosts)]
    return build_topology(hosts, default_placement(hosts, [4] * n_hosts))


def test_topology_rank_bounds_at_exactly_the_world_size():
    topo = _world()  # 8 ranks
    assert topo.connection(7, 0).kind is LinkKind.NIC
    assert topo.host_of(7).hostname == "p1"
    assert topo.same_host(7, 4) and not topo.same_host(7, 3)
    for call in (lambda: topo.connection(0, 8), lambda: topo.connection(8, 0), lambda: topo.host_of(8),
                 lambda: topo.same_host(8, 1)):
        with pytest.raises(TopologyError, match="rank 8 is outside the world of 8 ranks"):
            call()
    with pytest.raises(TopologyError, match="rank -1 is outside the world of 8 ranks"):
        topo.host_of(-1)


def test_replica_peer_count_bounds():
    topo = _world()
    # k = world - 1 = 7 is every other rank: host p1 first (local rank 0's rail first), then
    # rank 0's own host, its NVLink partner (rank 1) last
    assert topo.replica_peers(0, 7) == [4, 5, 6, 7, 2, 3, 1]
    with pytest.raises(TopologyError, match="cannot pick 8 replica peers for rank 0 in a world of 8"):
        topo.replica_peers(0, 8)
    with pytest.raises(TopologyError, match="cannot pick -1 replica peers for rank 0 in a world of 8"):
        topo.replica_peers(0, -1)
    with pytest.raises(TopologyError, match="rank 8 is outside the world of 8 ranks"):
        topo.replica_peers(8, 1)


def _nic_host(nics: list[tuple[str, NicKind, float | None, LinkKind]]) -> Host:
    """GPU0 plus the given NICs (id, kind, Gb/s, path class from GPU0)."""
    devs = (Device(id="GPU0", kind=DeviceKind.GPU, index=0, arch="sm90"),)
    out = tuple(Nic(id=i, name=i.lower(), kind=k, speed_Gbps=s) for i, k, s, _ in nics)
    paths = tuple(Path(a="GPU0", b=i, kind=p) for i, _, _, p in nics)
    return Host(hostname="h", devices=devs, nics=out, paths=paths)


IB, ETH = NicKind.IB, NicKind.ETHERNET


@pytest.mark.parametrize(
    ("nics", "want"),
    [
        # nearest wins over fastest: PIX 200 Gb/s before SYS 400 Gb/s
        ([("N0", IB, 400.0, LinkKind.SYS), ("N1", IB, 200.0, LinkKind.PIX)], "N1"),
        # PXB before PHB, PHB before NODE
        ([("N0", IB, 400.0, LinkKind.NODE), ("N1", IB, 100.0, LinkKind.PHB), ("N2", IB, 400.0, LinkKind.PXB)], "N2"),
        # same class: the fastest
        ([("N0", IB, 200.0, LinkKind.PIX), ("N1", IB, 400.0, LinkKind.PIX)], "N1"),
        # same class and speed: the first listed
        ([("N0", IB, 400.0, LinkKind.PIX), ("N1", IB, 400.0, LinkKind.PIX)], "N0"),
        # IB before Ethernet even when the Ethernet NIC is nearer and faster (NCCL prefers IB)
        ([("E0", ETH, 800.0, LinkKind.PIX), ("N0", IB, 100.0, LinkKind.SYS)], "N0"),
        # unknown speed counts as slowest
        ([("N0", IB, None, LinkKind.PIX), ("N1", IB, 100.0, LinkKind.PIX)], "N1"),
    ],
)
def test_nearest_nic(nics, want):
    assert _nic_host(nics).nearest_nic("GPU0").id == want


def test_nearest_nic_without_a_device_or_a_path_takes_the_fastest():
    host = _nic_host([("N0", IB, 200.0, LinkKind.PIX), ("N1", IB, 400.0, LinkKind.SYS)])
    assert host.nearest_nic(None).id == "N1"
    # a NIC with no path from the device ranks after every PCIe class
    host = Host(hostname="h", devices=host.devices, nics=host.nics + (Nic(id="N2", name="n2", kind=IB, speed_Gbps=800.0),),
                paths=host.paths)
    assert host.nearest_nic("GPU0").id == "N0"
    assert Host(hostname="e").nearest_nic("GPU0") is None


def _two_rail_host(name: str) -> Host:
    """GPU0 next to a 200 Gb/s IB NIC, GPU1 next to a 400 Gb/s one (each SYS from the other)."""
    devs = tuple(Device(id=f"GPU{i}", kind=DeviceKind.GPU, index=i, arch="sm90") for i in range(2))
    nics = (Nic(id="NIC0", name="mlx5_0", kind=IB, speed_Gbps=200.0), Nic(id="NIC1", name="mlx5_1", kind=IB, speed_Gbps=400.0))
    paths = (Path(a="GPU0", b="GPU1", kind=LinkKind.SYS), Path(a="GPU0", b="NIC0", kind=LinkKind.PIX),
             Path(a="GPU0", b="NIC1", kind=LinkKind.SYS), Path(a="GPU1", b="NIC0", kind=LinkKind.SYS),
             Path(a="GPU1", b="NIC1", kind=LinkKind.PIX))
    return Host(hostname=name, devices=devs, nics=nics, paths=paths)


def test_inter_host_bandwidth_follows_each_rank_s_own_rail():
    hosts = [_two_rail_host("a"), _two_rail_host("b")]
    topo = build_topology(hosts, default_placement(hosts, [2, 2]))  # ranks 0,1 on a; 2,3 on b
    # GPU1-GPU1: 400 / 8 = 50 GB/s; GPU0-GPU0: 200 / 8 = 25; mixed: the slower end, 25
    assert topo.connection(1, 3).bandwidth_GBps == 50.0
    assert topo.connection(0, 2).bandwidth_GBps == 25.0
    assert topo.connection(1, 2).bandwidth_GBps == 25.0
    assert {topo.connection(a, b).kind for a in (0, 1) for b in (2, 3)} == {LinkKind.IB}


def test_ib_domains_join_ib_hosts_and_leave_ethernet_hosts_alone():
    # hosts: 0 IB 400, 1 Ethernet, 2 IB 400, 3 Ethernet, 4 IB 200 (another rail class)
    hosts = [dgx_host("i0", gpus=2), cpu_host("e1"), dgx_host("i2", gpus=2), cpu_host("e3"),
             dgx_host("i4", gpus=2, nic_Gbps=200.0)]
    topo = build_topology(hosts, default_placement(hosts, [2] * 5))  # host h: ranks 2h, 2h+1
    # IB: hosts 0, 2 (same class) and 4 (IB to both) are one domain; the Ethernet hosts reach
    # each other and the rest over Ethernet only, slower than IB: each is its own domain
    assert topo.domains(LinkKind.IB) == [[0, 1, 4, 5, 8, 9], [2, 3], [6, 7]]
    assert topo.domains("NIC") == [list(range(10))]
    assert topo.domains(LinkKind.SHM) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    # only IB hosts of one class: joined among themselves
    same = [dgx_host("a", gpus=2), dgx_host("b", gpus=2), cpu_host("c")]
    topo = build_topology(same, default_placement(same, [2, 2, 2]))
    assert topo.domains(LinkKind.IB) == [[0, 1, 2, 3], [4, 5]]
