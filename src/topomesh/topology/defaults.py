"""Default link numbers, read from ``data/links.json`` (every value cites its source there).

Pure functions turn a host-level :class:`~topomesh.topology.model.Path` or a NIC pair into a
:class:`~topomesh.topology.model.Connection` when nothing was measured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from topomesh.topology.model import Connection, Device, DeviceKind, LinkKind, Nic, NicKind, Path


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkDefaults:
    """The numbers of ``links.json``; see its ``_sources`` for where each comes from."""

    nvlink_GBps_per_link: dict[str, float]
    pcie_GBps_per_lane: dict[int, float]
    pcie_GBps_default: float
    inter_socket_GBps: float
    loc_GBps: float
    shm_GBps: float
    net_GBps_default: float
    nvlinks_per_gpu_max: int
    latency_us: dict[str, float]

    def latency(self, kind: LinkKind) -> float:
        key = "PCIe" if kind.is_pcie else kind.value
        return self.latency_us[key]

    def nvlink_per_link(self, arch: str | None) -> float:
        return self.nvlink_GBps_per_link.get(arch or "", self.nvlink_GBps_per_link["default"])

    def pcie_GBps(self, gen: int | None, width: int | None) -> float:
        """PCIe bandwidth for a link of generation ``gen`` and ``width`` lanes."""
        if gen in self.pcie_GBps_per_lane and width:
            return round(self.pcie_GBps_per_lane[gen] * width, 3)
        return self.pcie_GBps_default


@cache
def link_defaults() -> LinkDefaults:
    raw: dict[str, Any] = json.loads(
        resources.files("topomesh.topology").joinpath("data/links.json").read_text()
    )

    def value(key: str) -> float:
        return float(raw[key]["value"])

    return LinkDefaults(
        nvlink_GBps_per_link={k: float(v) for k, v in raw["nvlink_GBps_per_link"].items() if not k.startswith("_")},
        pcie_GBps_per_lane={int(k): float(v) for k, v in raw["pcie_GBps_per_lane"].items() if not k.startswith("_")},
        pcie_GBps_default=value("pcie_GBps_default"),
        inter_socket_GBps=value("inter_socket_GBps"),
        loc_GBps=value("loc_GBps"),
        shm_GBps=value("shm_GBps"),
        net_GBps_default=value("net_GBps_default"),
        nvlinks_per_gpu_max=int(value("nvlinks_per_gpu_max")),
        latency_us={k: float(v) for k, v in raw["latency_us"].items() if not k.startswith("_")},
    )


def loc_connection(d: LinkDefaults | None = None) -> Connection:
    d = d or link_defaults()
    return Connection(kind=LinkKind.LOC, latency_us=d.latency(LinkKind.LOC), bandwidth_GBps=d.loc_GBps)


def path_connection(path: Path | None, a: Device | None, d: LinkDefaults | None = None) -> Connection:
    """Connection for a same-host path between two devices.

    ``a`` is one end (its ``arch`` selects the NVLink generation). A missing path between
    GPUs is taken as SYS (the slowest PCIe class); between CPU-only ranks it is SHM.
    """
    d = d or link_defaults()
    if path is None:
        kind = LinkKind.SHM if a is None or a.kind is DeviceKind.CPU else LinkKind.SYS
        path = Path(a="?", b="?", kind=kind)
    kind = path.kind
    if kind.is_nvlink:
        links = max(path.nvlink_count, 1)
        bw = path.bandwidth_GBps or d.nvlink_per_link(a.arch if a else None) * links
        return Connection(kind=kind, latency_us=d.latency(kind), bandwidth_GBps=round(bw, 3), channels=links)
    if kind is LinkKind.SHM:
        bw = path.bandwidth_GBps or d.shm_GBps
    elif kind is LinkKind.SYS:
        bw = min(path.bandwidth_GBps or d.pcie_GBps_default, d.inter_socket_GBps)
    elif kind is LinkKind.LOC:
        return loc_connection(d)
    else:
        bw = path.bandwidth_GBps or d.pcie_GBps_default
    return Connection(kind=kind, latency_us=d.latency(kind), bandwidth_GBps=round(bw, 3))


def nic_GBps(nic: Nic | None, d: LinkDefaults | None = None) -> float:
    d = d or link_defaults()
    if nic is None or not nic.speed_Gbps:
        return d.net_GBps_default
    return round(nic.speed_Gbps / 8.0, 3)


def network_connection(a: Nic | None, b: Nic | None, d: LinkDefaults | None = None) -> Connection:
    """Connection between ranks on two hosts that send through NICs ``a`` and ``b``.

    IB when both ends are RDMA NICs, Ethernet (``NIC``) otherwise; the bandwidth is the
    slower end's line rate.
    """
    d = d or link_defaults()
    both_ib = a is not None and b is not None and a.kind is NicKind.IB and b.kind is NicKind.IB
    kind = LinkKind.IB if both_ib else LinkKind.NIC
    bw = min(nic_GBps(a, d), nic_GBps(b, d))
    return Connection(kind=kind, latency_us=d.latency(kind), bandwidth_GBps=bw)


def default_connection(kind: LinkKind, d: LinkDefaults | None = None) -> Connection:
    """The default connection of a kind, with nothing else known about it."""
    d = d or link_defaults()
    if kind in (LinkKind.IB, LinkKind.NIC, LinkKind.UNKNOWN):
        conn = network_connection(None, None, d)
        return Connection(kind=kind, latency_us=d.latency(kind), bandwidth_GBps=conn.bandwidth_GBps)
    if kind is LinkKind.LOC:
        return loc_connection(d)
    return path_connection(Path(a="?", b="?", kind=kind, nvlink_count=1 if kind.is_nvlink else 0), None, d)
