"""Topologies for layout tests: real 8×H100 hosts (nvidia-smi dump) and hand-built ones."""

from __future__ import annotations

from functools import cache

from topomesh.topology.api import parse_host_text
from topomesh.topology.build import build_topology, default_placement
from topomesh.topology.model import (
    Device,
    DeviceKind,
    Host,
    LinkKind,
    Nic,
    NicKind,
    RankInfo,
    Topology,
)
from topomesh.topology.model import Path as HostPath

from ..conftest import SHARED_DATA

SMI = SHARED_DATA / "real" / "nvidia-smi-topo" / "h100-sxm-8gpu-12nic.txt"


@cache
def _h100() -> Host:
    if SMI.is_file():
        return parse_host_text(SMI.read_text(), source=str(SMI))
    return islands_host("h100", island=8, gpus=8, nvlink=LinkKind.NVSWITCH)


def h100_host(name: str) -> Host:
    """An 8×H100 SXM host (NVSwitch, IB NICs) from the real `nvidia-smi topo -m` dump."""
    return _h100().renamed(name)


def islands_host(name: str, *, island: int, gpus: int = 8, nvlink: LinkKind = LinkKind.NVLINK) -> Host:
    """A host whose GPUs form NVLink islands of ``island`` GPUs, PCIe (SYS) between them."""
    devices = tuple(Device(id=f"GPU{i}", kind=DeviceKind.GPU, index=i, arch="sm80") for i in range(gpus))
    nic = Nic(id="NIC0", name="mlx5_0", kind=NicKind.IB, speed_Gbps=200.0)
    paths = []
    for i in range(gpus):
        for j in range(i + 1, gpus):
            same = i // island == j // island
            paths.append(
                HostPath(a=f"GPU{i}", b=f"GPU{j}", kind=nvlink if same else LinkKind.SYS, nvlink_count=4 if same else 0)
            )
        paths.append(HostPath(a=f"GPU{i}", b="NIC0", kind=LinkKind.PIX if i < gpus // 2 else LinkKind.SYS))
    return Host(hostname=name, devices=devices, nics=(nic,), paths=tuple(paths))


def contiguous(hosts: list[Host], per_host: int = 8) -> Topology:
    """torchrun's numbering: host after host."""
    return build_topology(hosts, default_placement(hosts, [per_host] * len(hosts)))


def interleaved(hosts: list[Host], per_host: int = 8) -> Topology:
    """Rank r on host r % len(hosts): no two consecutive ranks share a host."""
    n = len(hosts)
    ranks = [RankInfo(rank=r, host=r % n, local_rank=r // n, device=f"GPU{r // n}") for r in range(n * per_host)]
    return build_topology(hosts, ranks)


def permuted(hosts: list[Host], host_of: list[int]) -> Topology:
    """Rank r on host ``host_of[r]``, local ranks in rank order."""
    seen = [0] * len(hosts)
    ranks = []
    for r, h in enumerate(host_of):
        ranks.append(RankInfo(rank=r, host=h, local_rank=seen[h], device=f"GPU{seen[h]}"))
        seen[h] += 1
    return build_topology(hosts, ranks)


def cpu_topology(nproc: int) -> Topology:
    """One CPU host, ``nproc`` processes (what the gloo tests run on)."""
    host = Host(hostname="cpu0")
    return build_topology([host], default_placement([host], [nproc]))
