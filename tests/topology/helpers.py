"""Small hand-built hosts for tests of the core model (no discovery, no files)."""

from __future__ import annotations

from topomesh.topology.model import Device, DeviceKind, Host, LinkKind, Nic, NicKind, Path


def dgx_host(name: str, gpus: int = 8, nic_Gbps: float = 400.0, arch: str = "sm90") -> Host:
    """NVSwitch node: every GPU pair NV18 through switches, one IB NIC per GPU at PIX."""
    devs = tuple(Device(id=f"GPU{i}", kind=DeviceKind.GPU, index=i, arch=arch, numa_node=i * 2 // gpus) for i in range(gpus))
    nics = tuple(Nic(id=f"NIC{i}", name=f"mlx5_{i}", kind=NicKind.IB, speed_Gbps=nic_Gbps) for i in range(gpus))
    paths = [Path(a=f"GPU{i}", b=f"GPU{j}", kind=LinkKind.NVSWITCH, nvlink_count=18) for i in range(gpus) for j in range(i + 1, gpus)]
    paths += [
        Path(a=f"GPU{i}", b=f"NIC{j}", kind=LinkKind.PIX if i == j else LinkKind.NODE) for i in range(gpus) for j in range(gpus)
    ]
    return Host(hostname=name, devices=devs, nics=nics, paths=tuple(paths))


def pcie_host(name: str) -> Host:
    """Two NVLink-bridged pairs on two NUMA nodes, one 100 GbE NIC on NUMA 0."""
    devs = tuple(Device(id=f"GPU{i}", kind=DeviceKind.GPU, index=i, arch="sm86", numa_node=i // 2) for i in range(4))
    nics = (Nic(id="NIC0", name="eth0", kind=NicKind.ETHERNET, speed_Gbps=100.0),)
    paths = (
        Path(a="GPU0", b="GPU1", kind=LinkKind.NVLINK, nvlink_count=4),
        Path(a="GPU2", b="GPU3", kind=LinkKind.NVLINK, nvlink_count=4),
        Path(a="GPU0", b="GPU2", kind=LinkKind.SYS),
        Path(a="GPU0", b="GPU3", kind=LinkKind.SYS),
        Path(a="GPU1", b="GPU2", kind=LinkKind.SYS),
        Path(a="GPU1", b="GPU3", kind=LinkKind.SYS),
        Path(a="GPU0", b="NIC0", kind=LinkKind.PXB, bandwidth_GBps=31.504),
        Path(a="GPU1", b="NIC0", kind=LinkKind.PXB),
        Path(a="GPU2", b="NIC0", kind=LinkKind.SYS),
        Path(a="GPU3", b="NIC0", kind=LinkKind.SYS),
    )
    return Host(hostname=name, devices=devs, nics=nics, paths=paths)


def cpu_host(name: str, sockets: int = 1) -> Host:
    devs = tuple(Device(id=f"CPU{i}", kind=DeviceKind.CPU, index=i, numa_node=i) for i in range(sockets))
    nics = (Nic(id="NIC0", name="eth0", kind=NicKind.ETHERNET, speed_Gbps=10.0),)
    return Host(hostname=name, devices=devs, nics=nics)
