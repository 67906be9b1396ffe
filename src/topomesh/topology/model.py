"""The topology data model every part of topomesh reads.

Two levels:

* **Host level** — what one node looks like: its :class:`Device` s (GPUs, CPU sockets),
  :class:`Nic` s and the :class:`Path` between any two of them (the ``nvidia-smi topo -m``
  classes, or an NVLink bond). Discovery and the imports produce a :class:`Host`.
* **World level** — a :class:`Topology`: hosts, which rank runs on which host and device
  (:class:`RankInfo`) and the rank-to-rank :class:`Connection` s, kept in a compact
  :class:`ConnectionTable` so that 16k-rank worlds need no ranks² storage.

Units are in the names: ``_us`` microseconds, ``_GBps`` gigabytes/s (bytes),
``_Gbps`` gigabits/s (NIC line rates).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from topomesh.errors import TopologyError


class LinkKind(StrEnum):
    """How two endpoints are connected, fastest first.

    ``PIX``…``SYS`` are the PCIe classes of the ``nvidia-smi topo -m`` legend:
    PIX = at most one PCIe bridge, PXB = several bridges without the host bridge,
    PHB = through a PCIe host bridge (the CPU), NODE = between host bridges of one NUMA
    node, SYS = across the inter-socket link (QPI/UPI).
    """

    LOC = "LOC"  # the same device
    NVSWITCH = "NVSwitch"  # NVLink through an NVSwitch fabric
    NVLINK = "NVLink"  # direct (bonded) NVLink
    PIX = "PIX"
    PXB = "PXB"
    PHB = "PHB"
    NODE = "NODE"
    SYS = "SYS"
    SHM = "SHM"  # same host, no accelerator: CPU processes over shared memory / loopback
    IB = "IB"  # InfiniBand (or RoCE) between hosts
    NIC = "NIC"  # Ethernet / TCP between hosts
    UNKNOWN = "UNKNOWN"  # a file that names no type (the RFC's first variant)

    @property
    def tier(self) -> int:
        """Speed class, 0 fastest; kinds of one tier are interchangeable for placement."""
        return _TIER[self]

    @property
    def is_pcie(self) -> bool:
        return self in _PCIE

    @property
    def is_nvlink(self) -> bool:
        return self in (LinkKind.NVLINK, LinkKind.NVSWITCH)

    @property
    def intra_host(self) -> bool:
        """True when both ends are on one host."""
        return self not in (LinkKind.IB, LinkKind.NIC, LinkKind.UNKNOWN)

    @property
    def rfc_type(self) -> str:
        """The connection ``type`` string of the RFC file (PCIe classes collapse to PCIe)."""
        return "PCIe" if self.is_pcie else self.value

    @classmethod
    def parse(cls, text: str) -> LinkKind:
        """Parse a kind name, case-insensitively; also the RFC's ``PCIe`` (→ PHB) and ``NV#``."""
        key = text.strip()
        for kind in cls:
            if kind.value.lower() == key.lower():
                return kind
        low = key.lower()
        if low == "pcie":
            return cls.PHB
        if low in ("ethernet", "eth", "tcp", "roce_eth"):
            return cls.NIC
        if low.startswith("nv") and low[2:].isdigit():
            return cls.NVLINK
        raise ValueError(f"unknown link kind {text!r}")


_PCIE = frozenset({LinkKind.PIX, LinkKind.PXB, LinkKind.PHB, LinkKind.NODE, LinkKind.SYS})
_TIER = {
    LinkKind.LOC: 0,
    LinkKind.NVSWITCH: 1,
    LinkKind.NVLINK: 1,
    LinkKind.PIX: 2,
    LinkKind.PXB: 3,
    LinkKind.PHB: 4,
    LinkKind.NODE: 5,
    LinkKind.SYS: 6,
    LinkKind.SHM: 6,
    LinkKind.IB: 7,
    LinkKind.NIC: 8,
    LinkKind.UNKNOWN: 9,
}


class DeviceKind(StrEnum):
    GPU = "GPU"
    CPU = "CPU"


class NicKind(StrEnum):
    IB = "IB"  # InfiniBand or RoCE (an RDMA device under /sys/class/infiniband)
    ETHERNET = "Ethernet"


@dataclass(frozen=True, slots=True, kw_only=True)
class Connection:
    """One rank-to-rank connection as the RFC file records it."""

    kind: LinkKind
    latency_us: float
    """One-way small-message latency, microseconds."""
    bandwidth_GBps: float
    """Unidirectional bandwidth, GB/s (10^9 bytes per second)."""
    channels: int = 1
    """Parallel links or channels (NVLink count of the bond, 1 otherwise)."""
    measured: bool = False
    """True when latency and bandwidth were measured by a probe, not taken from defaults."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, LinkKind):
            raise TopologyError(f"connection kind must be a LinkKind, got {self.kind!r}")
        if not (self.latency_us >= 0 and np.isfinite(self.latency_us)):
            raise TopologyError(f"latency must be a finite number >= 0 us, got {self.latency_us}")
        if not (self.bandwidth_GBps >= 0 and np.isfinite(self.bandwidth_GBps)):
            raise TopologyError(
                f"bandwidth must be a finite number >= 0 GB/s, got {self.bandwidth_GBps}"
            )
        if self.channels < 0:
            raise TopologyError(f"channels must be >= 0, got {self.channels}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    """A compute device on a host: a GPU, or a CPU socket / NUMA node for CPU-only ranks."""

    id: str
    """Stable name on its host, e.g. ``GPU0`` or ``CPU1``."""
    kind: DeviceKind
    index: int
    """Index among devices of its kind (CUDA ordinal for GPUs, NUMA node for CPUs)."""
    name: str = ""
    """Model name, e.g. ``NVIDIA H100 80GB HBM3``."""
    pci_bus_id: str | None = None
    numa_node: int | None = None
    arch: str | None = None
    """Compute capability as ``sm<major><minor>``, e.g. ``sm90``; selects NVLink speeds."""
    memory_bytes: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Nic:
    """A network interface that can carry inter-host traffic."""

    id: str
    """Stable name on its host, e.g. ``NIC0``."""
    name: str
    """OS name: ``mlx5_0`` for RDMA devices, ``eth0`` for Ethernet."""
    kind: NicKind
    speed_Gbps: float | None = None
    """Line rate in gigabits per second, when known."""
    pci_bus_id: str | None = None
    numa_node: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Path:
    """How two endpoints (devices or NICs) of one host reach each other."""

    a: str
    b: str
    kind: LinkKind
    nvlink_count: int = 0
    """Links in the NVLink bond (the ``#`` of ``NV#``); 0 for PCIe paths."""
    bandwidth_GBps: float | None = None
    """Known bottleneck bandwidth (e.g. PCIe gen x width); None = default for the kind."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Host:
    """One node: its devices, NICs and the paths between them."""

    hostname: str
    devices: tuple[Device, ...] = ()
    nics: tuple[Nic, ...] = ()
    paths: tuple[Path, ...] = ()
    socket_ifname: str | None = None
    """The network interface this node's workers use for NCCL/Gloo sockets (the one that
    reaches the rendezvous endpoint), when ``topomesh launch`` chose or was given one."""
    numa_bindings: tuple[tuple[int, int, str], ...] = ()
    """``(local_rank, numa_node, cpulist)`` of each worker ``topomesh launch`` bound to CPUs
    (``--numa-binding``); the rank entries map ranks to (host, local rank)."""
    _index: dict[frozenset[str], Path] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        ids = [d.id for d in self.devices] + [n.id for n in self.nics]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise TopologyError(f"duplicate endpoint ids {dup}", source=self.hostname)
        known = set(ids)
        for p in self.paths:
            if p.a not in known or p.b not in known:
                missing = p.a if p.a not in known else p.b
                raise TopologyError(f"path names unknown endpoint {missing!r}", source=self.hostname)
            if p.a == p.b:
                raise TopologyError(f"path from {p.a!r} to itself", source=self.hostname)
            self._index[frozenset((p.a, p.b))] = p

    def renamed(self, hostname: str) -> Host:
        """This host under another name, sharing the validated path index.

        ``dataclasses.replace`` would re-validate and re-index every path; for 2,048 alike
        hosts that is most of the time of decoding a world.
        """
        if not isinstance(hostname, str) or not hostname:
            raise TopologyError(f"a host name must be a non-empty string, got {hostname!r}")
        new = object.__new__(Host)
        for name in ("devices", "nics", "paths", "socket_ifname", "numa_bindings", "_index"):
            object.__setattr__(new, name, getattr(self, name))
        object.__setattr__(new, "hostname", hostname)
        return new

    @property
    def gpus(self) -> tuple[Device, ...]:
        return tuple(d for d in self.devices if d.kind is DeviceKind.GPU)

    def device(self, device_id: str) -> Device:
        for d in self.devices:
            if d.id == device_id:
                return d
        raise TopologyError(f"no device {device_id!r}", source=self.hostname)

    def path(self, a: str, b: str) -> Path | None:
        """The path between two endpoints, or None when the host does not say."""
        return self._index.get(frozenset((a, b)))

    def nearest_nic(self, device_id: str | None) -> Nic | None:
        """The NIC a device should use (rail): fastest PCIe class, then fastest NIC, then order.

        IB NICs are preferred over Ethernet ones, as NCCL does.
        """
        if not self.nics:
            return None

        def key(item: tuple[int, Nic]) -> tuple[int, int, float, int]:
            i, nic = item
            p = self.path(device_id, nic.id) if device_id else None
            tier = p.kind.tier if p else LinkKind.SYS.tier + 1
            return (0 if nic.kind is NicKind.IB else 1, tier, -(nic.speed_Gbps or 0.0), i)

        return min(enumerate(self.nics), key=key)[1]

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form, used to exchange hosts through the rendezvous store."""
        out: dict[str, Any] = {
            "hostname": self.hostname,
            "devices": [_fields(d) for d in self.devices],
            "nics": [_fields(n) for n in self.nics],
            "paths": [_fields(p) for p in self.paths],
        }
        if self.socket_ifname is not None:  # absent when unset: older files stay byte-identical
            out["socket_ifname"] = self.socket_ifname
        if self.numa_bindings:
            out["numa_bindings"] = [{"local_rank": r, "numa_node": n, "cpus": c} for r, n, c in self.numa_bindings]
        return out

    def numa_binding(self, local_rank: int) -> tuple[int, str] | None:
        """``(numa_node, cpulist)`` the launcher bound this local rank to, or None."""
        return next(((n, c) for r, n, c in self.numa_bindings if r == local_rank), None)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "host") -> Host:
        """Inverse of :meth:`to_dict`; raises :class:`TopologyError` on any malformed field."""
        try:
            if not isinstance(data, Mapping):
                raise TypeError("expected an object")
            _bounded_host_lists(data)
            devices = tuple(
                Device(**{**_typed(Device, d), "kind": DeviceKind(d["kind"])})
                for d in _list(data, "devices")
            )
            nics = tuple(
                Nic(**{**_typed(Nic, n), "kind": NicKind(n["kind"])}) for n in _list(data, "nics")
            )
            paths = tuple(
                Path(**{**_typed(Path, p), "kind": LinkKind.parse(p["kind"])})
                for p in _list(data, "paths")
            )
            hostname = data["hostname"]
            if not isinstance(hostname, str) or not hostname:
                raise TypeError("hostname must be a non-empty string")
            ifname = data.get("socket_ifname")
            if ifname is not None and not (isinstance(ifname, str) and ifname.isprintable() and 0 < len(ifname) <= 255):
                raise TypeError(f"socket_ifname must be a non-empty printable string, got {ifname!r}")
            raw_bindings = _list(data, "numa_bindings")
            if len(raw_bindings) > MAX_HOST_WORKERS:
                raise TypeError(f"{len(raw_bindings)} NUMA bindings, more than the limit of {MAX_HOST_WORKERS} per host")
            bindings = tuple(_binding(b) for b in raw_bindings)
            return cls(hostname=hostname, devices=devices, nics=nics, paths=paths, socket_ifname=ifname,
                       numa_bindings=bindings)
        except TopologyError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise TopologyError(f"malformed host description ({exc})", source=source) from None


MAX_HOST_DEVICES = 256
"""Most devices (GPUs, CPUs) and NICs one host description may list, in every reader. Real
servers list a few dozen (a DGX H100: 8 GPUs, 12 NICs in ``nvidia-smi topo -m``); readers
build a path per pair, so the limit keeps that work to ~33,000 pairs."""


MAX_HOST_WORKERS = 4096
"""Most NUMA bindings (workers) one host description may carry."""


def _binding(b: Any) -> tuple[int, int, str]:
    """One ``numa_bindings`` entry: ``{"local_rank": int, "numa_node": int, "cpus": "0-3,8"}``."""
    if not isinstance(b, Mapping) or set(b) != {"local_rank", "numa_node", "cpus"}:
        raise TypeError(f"a NUMA binding must be {{local_rank, numa_node, cpus}}, got {b!r}")
    r, n, c = b["local_rank"], b["numa_node"], b["cpus"]
    if not (isinstance(r, int) and isinstance(n, int) and r >= 0 and n >= 0) or isinstance(r, bool):
        raise TypeError(f"a NUMA binding's local_rank and numa_node must be whole numbers, got {b!r}")
    if not (isinstance(c, str) and len(c) <= 4096 and re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", c)):
        raise TypeError(f"a NUMA binding's cpus must be a CPU list like '0-3,8', got {c!r}")
    return (r, n, c)


def _bounded_host_lists(data: Mapping[str, Any]) -> None:
    """Refuse oversized lists before a dataclass is built per entry."""
    endpoints = sum(len(v) for k in ("devices", "nics") if isinstance(v := data.get(k), list))
    paths = data.get("paths")
    max_paths = MAX_HOST_DEVICES * (MAX_HOST_DEVICES - 1) // 2
    if endpoints > MAX_HOST_DEVICES:
        raise TypeError(f"{endpoints} devices and NICs, more than the limit of {MAX_HOST_DEVICES} per host")
    if isinstance(paths, list) and len(paths) > max_paths:
        raise TypeError(f"{len(paths)} paths, more than the limit of {max_paths} (one per pair of endpoints)")


_JSON_TYPES: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "float": (int, float)}


def _list(data: Mapping[str, Any], key: str) -> list[Any]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise TypeError(f"{key} must be a list")
    return value


def _typed(cls: type, raw: Any) -> dict[str, Any]:
    """Check the JSON types of a flat dataclass's fields (enums are converted by the caller)."""
    if not isinstance(raw, Mapping):
        raise TypeError(f"a {cls.__name__} must be an object")
    names = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key, value in raw.items():
        f = names.get(key)
        if f is None:
            raise TypeError(f"unknown {cls.__name__} field {key!r}")
        if key == "kind":
            continue
        want = str(f.type).split(" | ")
        if value is None and "None" in want:
            continue
        allowed = tuple(t for name in want for t in _JSON_TYPES.get(name, ()))
        if isinstance(value, bool) or not isinstance(value, allowed):
            raise TypeError(f"{cls.__name__}.{key} must be {' or '.join(want)}, got {value!r}")
        if isinstance(value, float) and not np.isfinite(value):
            raise TypeError(f"{cls.__name__}.{key} must be finite, got {value!r}")
    return dict(raw)


def _fields(obj: Any) -> dict[str, Any]:
    """Shallow JSON form of a flat dataclass: enums as their values, None fields left out."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if v is not None:
            out[f.name] = v.value if isinstance(v, StrEnum) else v
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class RankInfo:
    """Where one rank runs."""

    rank: int
    host: int
    """Index into :attr:`Topology.hosts`."""
    local_rank: int
    device: str | None = None
    """Device id on its host (``GPU3``), or None when the rank has no device of its own."""


@dataclass(frozen=True, eq=False, kw_only=True)
class ConnectionTable:
    """Rank-to-rank connections in O(hosts + ranks) space with O(1) lookup.

    Connections are interned in ``palette``. Ranks on one host look up a small matrix
    shared by every host of the same class (``local[host_class[h]][local_of[a], local_of[b]]``);
    ranks on different hosts look up ``inter[rail_of[a], rail_of[b]]``, where a rail is a
    class of NIC (kind and speed) a rank sends through. ``overrides`` holds the pairs that
    fit neither rule (irregular files), keyed ``(min, max)``.

    Probe measurements keep the kind and channels those rules give and replace latency and
    bandwidth: ``measured_inter`` per host pair ``(min, max)`` (every rank pair between the
    two hosts) and ``measured_local`` per host and local slot pair ``(min, max)``. Stored per
    measurement, not per rank pair, so a probed world stays about as small as an unprobed one.
    """

    palette: tuple[Connection, ...]
    host_of: np.ndarray
    local_of: np.ndarray
    host_class: np.ndarray
    local: tuple[np.ndarray, ...]
    rail_of: np.ndarray
    inter: np.ndarray
    overrides: Mapping[tuple[int, int], int] = field(default_factory=dict)
    measured_inter: Mapping[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    measured_local: Mapping[int, Mapping[tuple[int, int], tuple[float, float]]] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return int(self.host_of.shape[0])

    def measured(self, a: int, b: int) -> tuple[float, float] | None:
        """Measured (latency_us, bandwidth_GBps) between ranks ``a`` and ``b``, if probed."""
        if a == b or (self.overrides and ((a, b) if a <= b else (b, a)) in self.overrides):
            return None
        ha, hb = int(self.host_of[a]), int(self.host_of[b])
        if ha == hb:
            slots = self.measured_local.get(ha)
            if not slots:
                return None
            la, lb = int(self.local_of[a]), int(self.local_of[b])
            return slots.get((la, lb) if la <= lb else (lb, la))
        if not self.measured_inter:
            return None
        return self.measured_inter.get((ha, hb) if ha <= hb else (hb, ha))

    def connection(self, a: int, b: int) -> Connection:
        """The connection between ranks ``a`` and ``b``, measured figures applied."""
        base = self.palette[self.index(a, b)]
        if self.measured_inter or self.measured_local:
            got = self.measured(a, b)
            if got is not None:
                return dataclasses.replace(base, latency_us=got[0], bandwidth_GBps=got[1], measured=True)
        return base

    def measured_connections(self) -> set[Connection]:
        """Every distinct measured connection some rank pair has."""
        out: set[Connection] = set()
        members: dict[int, list[int]] = {}
        for r, h in enumerate(self.host_of.tolist()):
            members.setdefault(h, []).append(r)
        for h, slots in self.measured_local.items():
            by_slot = {int(self.local_of[r]): r for r in members.get(h, [])}
            for (la, lb), _ in slots.items():
                if la in by_slot and lb in by_slot:
                    out.add(self.connection(by_slot[la], by_slot[lb]))
        for ha, hb in self.measured_inter:
            for ra in members.get(ha, []):
                for rb in members.get(hb, []):
                    out.add(self.connection(ra, rb))
        return out

    def index(self, a: int, b: int) -> int:
        """Palette index of the connection between ranks ``a`` and ``b``."""
        if self.overrides:
            hit = self.overrides.get((a, b) if a <= b else (b, a))
            if hit is not None:
                return hit
        ha = self.host_of[a]
        if ha == self.host_of[b]:
            return int(self.local[self.host_class[ha]][self.local_of[a], self.local_of[b]])
        return int(self.inter[self.rail_of[a], self.rail_of[b]])


@dataclass(frozen=True, eq=False, kw_only=True)
class Topology:
    """The world: hosts, rank placement and every rank-to-rank connection."""

    hosts: tuple[Host, ...]
    ranks: tuple[RankInfo, ...]
    table: ConnectionTable
    run_id: str | None = None
    restart_count: int | None = None
    source: str | None = None
    """Where this topology came from (a file path, ``discover``, ``rendezvous``)."""

    def __post_init__(self) -> None:
        for i, r in enumerate(self.ranks):
            if r.rank != i:
                raise TopologyError(f"ranks must be 0..{len(self.ranks) - 1} in order; got {r.rank} at {i}")
            if not 0 <= r.host < len(self.hosts):
                raise TopologyError(f"rank {i} names host index {r.host}, but there are {len(self.hosts)} hosts")
        if self.table.world_size != len(self.ranks):
            raise TopologyError(
                f"connection table covers {self.table.world_size} ranks, topology has {len(self.ranks)}"
            )

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def _check(self, rank: int) -> None:
        if not 0 <= rank < len(self.ranks):
            raise TopologyError(f"rank {rank} is outside the world of {len(self.ranks)} ranks")

    def connection(self, a: int, b: int) -> Connection:
        """The connection between ranks ``a`` and ``b`` (``LOC`` when ``a == b``)."""
        self._check(a)
        self._check(b)
        return self.table.connection(a, b)

    def host_of(self, rank: int) -> Host:
        self._check(rank)
        return self.hosts[self.ranks[rank].host]

    def same_host(self, a: int, b: int) -> bool:
        self._check(a)
        self._check(b)
        return self.ranks[a].host == self.ranks[b].host

    def ranks_by_host(self) -> list[list[int]]:
        """Ranks of each host, in host order; hosts without ranks give empty lists."""
        groups: list[list[int]] = [[] for _ in self.hosts]
        for r in self.ranks:
            groups[r.host].append(r.rank)
        return groups

    def domains(self, kind: LinkKind | str) -> list[list[int]]:
        """Groups of ranks that reach each other through links at least as fast as ``kind``.

        ``domains(LinkKind.NVLINK)`` gives the NVLink islands, ``domains("PXB")`` the ranks
        under common PCIe switches, ``domains(LinkKind.SHM)`` or any inter-host kind's
        predecessor gives whole hosts; ``domains(LinkKind.NIC)`` the whole world. Groups are
        sorted by their smallest rank; every rank is in exactly one group.
        """
        kind = LinkKind.parse(kind) if isinstance(kind, str) else kind
        if not kind.intra_host:
            if kind is LinkKind.IB:
                # ranks joined by IB or anything faster: hosts with an IB rail form one domain
                return _union_inter(self, max_tier=kind.tier)
            return [list(range(self.world_size))]
        out: list[list[int]] = []
        for ranks in self.ranks_by_host():
            out.extend(_components(self, ranks, kind.tier))
        return sorted(out, key=lambda g: g[0])

    def replica_peers(self, rank: int, k: int) -> list[int]:
        """``k`` ranks in other failure domains to hold copies of ``rank``'s checkpoint shard.

        Other hosts first, round-robin starting after the rank's own host: each round takes
        one more rank per host, the same local rank first (so copies use the same rail),
        then the next local ranks. Only when every other host's ranks are taken does it use
        the rank's own host: other NVLink islands first, then its own island. Raises when
        ``k`` exceeds the ranks available.
        """
        self._check(rank)
        if k < 0 or k > self.world_size - 1:
            raise TopologyError(f"cannot pick {k} replica peers for rank {rank} in a world of {self.world_size}")
        me = self.ranks[rank]
        by_host = self.ranks_by_host()
        order = [(me.host + i) % len(self.hosts) for i in range(1, len(self.hosts))]

        def rail_order(h: int) -> list[int]:
            cands = by_host[h]
            return sorted(cands, key=lambda r: ((self.ranks[r].local_rank - me.local_rank) % max(len(cands), 1), r))

        queues = [rail_order(h) for h in order]
        picked: list[int] = []
        while len(picked) < k and any(queues):
            for q in queues:
                if q and len(picked) < k:
                    picked.append(q.pop(0))
        if len(picked) < k:
            island = next(g for g in self.domains(LinkKind.NVLINK) if rank in g)
            local = sorted((r for r in by_host[me.host] if r != rank), key=lambda r: (r in island, r))
            picked += local[: k - len(picked)]
        return picked


def _components(topo: Topology, ranks: Sequence[int], max_tier: int) -> list[list[int]]:
    """Connected components of ``ranks`` over links of tier <= ``max_tier`` (union-find)."""
    parent = {r: r for r in ranks}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i, a in enumerate(ranks):
        for b in ranks[i + 1 :]:
            if topo.connection(a, b).kind.tier <= max_tier:
                ra, rb = find(a), find(b)
                if ra != rb:
                    parent[max(ra, rb)] = min(ra, rb)
    groups: dict[int, list[int]] = {}
    for r in ranks:
        groups.setdefault(find(r), []).append(r)
    return list(groups.values())


def _union_inter(topo: Topology, max_tier: int) -> list[list[int]]:
    """Hosts joined when some rank pair between them is connected at tier <= ``max_tier``.

    Inter-host connections depend only on the rails of the two ranks, so hosts are grouped
    by their set of rails and only those classes are compared (hosts with one rail set
    form one class): linear in hosts, not quadratic. Override pairs join their hosts too.
    """
    t = topo.table
    ok = np.array([[t.palette[i].kind.tier <= max_tier for i in row] for row in t.inter], dtype=bool)
    by_host = topo.ranks_by_host()
    classes: dict[frozenset[int], list[int]] = {}
    for h, ranks in enumerate(by_host):
        if ranks:
            classes.setdefault(frozenset(int(t.rail_of[r]) for r in ranks), []).append(h)
    parent = list(range(len(by_host)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    def linked(x: frozenset[int], y: frozenset[int]) -> bool:
        return any(ok[a, b] for a in x for b in y)

    keys = list(classes)
    for i, ki in enumerate(keys):
        if linked(ki, ki):
            for h in classes[ki][1:]:
                union(classes[ki][0], h)
        for kj in keys[i + 1 :]:
            if linked(ki, kj):
                union(classes[ki][0], classes[kj][0])
    for (a, b), idx in t.overrides.items():
        if t.palette[idx].kind.tier <= max_tier:
            union(topo.ranks[a].host, topo.ranks[b].host)
    groups: dict[int, list[int]] = {}
    for h, ranks in enumerate(by_host):
        if ranks:
            groups.setdefault(find(h), []).extend(ranks)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])
