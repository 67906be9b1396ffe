"""Build a world :class:`Topology` from hosts and a rank placement.

This is what the launcher does after each rendezvous round, and what ``topomesh discover``
does for one host. Hosts that look alike share one local matrix, and ranks on different
hosts share one matrix per pair of rails (NIC classes), so building a 16k-rank world is
linear in the number of ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from topomesh.errors import TopologyError
from topomesh.topology.defaults import (
    LinkDefaults,
    link_defaults,
    loc_connection,
    network_connection,
    path_connection,
)
from topomesh.topology.model import (
    Connection,
    ConnectionTable,
    DeviceKind,
    Host,
    LinkKind,
    Nic,
    RankInfo,
    Topology,
)


class _Palette:
    """Interns connections so the table stores small integers."""

    def __init__(self) -> None:
        self.items: list[Connection] = []
        self._ids: dict[Connection, int] = {}

    def id(self, c: Connection) -> int:
        got = self._ids.get(c)
        if got is None:
            got = self._ids[c] = len(self.items)
            self.items.append(c)
        return got


class _Matrices:
    """Interns local matrices: hosts whose matrices are equal share one class."""

    def __init__(self) -> None:
        self.items: list[np.ndarray] = []
        self._ids: dict[bytes, int] = {}

    def id(self, mat: np.ndarray) -> int:
        key = mat.tobytes() + str(mat.shape).encode()
        got = self._ids.get(key)
        if got is None:
            got = self._ids[key] = len(self.items)
            self.items.append(mat)
        return got


def default_placement(hosts: Sequence[Host], nproc_per_host: Sequence[int]) -> list[RankInfo]:
    """torchrun's rank order: host after host, local ranks in order, GPU i for local rank i.

    Local rank ``i`` uses the ``i``-th GPU when the host has that many, else the CPU socket
    ``i % sockets`` (or no device at all on a host with none).
    """
    if len(hosts) != len(nproc_per_host):
        raise TopologyError(f"{len(hosts)} hosts but {len(nproc_per_host)} process counts")
    out: list[RankInfo] = []
    for h, (host, n) in enumerate(zip(hosts, nproc_per_host, strict=True)):
        gpus = host.gpus
        cpus = [d for d in host.devices if d.kind is DeviceKind.CPU]
        for local in range(n):
            if local < len(gpus):
                dev: str | None = gpus[local].id
            elif cpus:
                dev = cpus[local % len(cpus)].id
            else:
                dev = None
            out.append(RankInfo(rank=len(out), host=h, local_rank=local, device=dev))
    return out


def build_topology(
    hosts: Sequence[Host],
    ranks: Sequence[RankInfo],
    *,
    defaults: LinkDefaults | None = None,
    measured: Mapping[tuple[int, int], Connection] | None = None,
    measured_hosts: Mapping[tuple[int, int], tuple[float, float]] | None = None,
    measured_devices: Mapping[int, Sequence[tuple[str, str, float, float]]] | None = None,
    run_id: str | None = None,
    restart_count: int | None = None,
    source: str | None = None,
) -> Topology:
    """The rank-to-rank graph of ``ranks`` placed on ``hosts``.

    Same-host pairs take the host's path between their devices (same device: ``LOC``;
    CPU-only: ``SHM``). Pairs on different hosts go through each rank's nearest NIC (its
    rail): ``IB`` when both ends have RDMA NICs, else Ethernet, at the slower line rate.
    ``measured`` replaces the connection of individual rank pairs. Probe results keep the
    kind and replace latency and bandwidth: ``measured_hosts`` maps a host pair to
    ``(latency_us, bandwidth_GBps)`` for every rank pair between the two hosts;
    ``measured_devices`` maps a host to rows ``(device_a, device_b, latency_us,
    bandwidth_GBps)`` for every rank pair of that host on those two devices.
    """
    d = defaults or link_defaults()
    n = len(ranks)
    if len({h.hostname for h in hosts}) != len(hosts):
        raise TopologyError("host names must be unique")
    pal = _Palette()
    host_of = np.empty(n, dtype=np.int32)
    local_of = np.empty(n, dtype=np.int32)
    rail_of = np.empty(n, dtype=np.int32)
    per_host: list[list[RankInfo]] = [[] for _ in hosts]
    for i, r in enumerate(ranks):
        if r.rank != i:
            raise TopologyError(f"ranks must be numbered 0..{n - 1} in order; found {r.rank} at position {i}")
        if not 0 <= r.host < len(hosts):
            raise TopologyError(f"rank {i} is placed on host {r.host}, but there are {len(hosts)} hosts")
        per_host[r.host].append(r)
        host_of[i] = r.host

    rails: dict[tuple[str, float | None], tuple[int, Nic | None]] = {}
    local_mats = _Matrices()
    host_class = np.zeros(len(hosts), dtype=np.int32)
    mat_cache: dict[tuple[int, tuple[str | None, ...]], np.ndarray] = {}
    host_sig: dict[int, int] = {}
    sig_ids: dict[tuple, int] = {}
    for h, (host, members) in enumerate(zip(hosts, per_host, strict=True)):
        members.sort(key=lambda r: r.local_rank)
        devs = tuple(r.device for r in members)
        for slot, r in enumerate(members):
            local_of[r.rank] = slot
            if r.device is not None:
                host.device(r.device)  # validates the id
            nic = host.nearest_nic(r.device)
            # rails are classes of NIC (kind, speed), not individual NICs
            key = (nic.kind.value, nic.speed_Gbps) if nic else ("none", None)
            if key not in rails:
                rails[key] = (len(rails), nic)
            rail_of[r.rank] = rails[key][0]
        sig = sig_ids.setdefault(_host_signature(host), len(sig_ids))
        host_sig[h] = sig
        mat = mat_cache.get((sig, devs))
        if mat is None:
            mat = _local_matrix(host, devs, pal, d)
            mat_cache[(sig, devs)] = mat
        host_class[h] = local_mats.id(mat)

    nics = [nic for _, nic in sorted(rails.values(), key=lambda t: t[0])]
    inter = np.empty((len(nics), len(nics)), dtype=np.int32)
    for i, a in enumerate(nics):
        for j, b in enumerate(nics):
            inter[i, j] = pal.id(network_connection(a, b, d))

    overrides: dict[tuple[int, int], int] = {}
    for (a, b), conn in (measured or {}).items():
        if not (0 <= a < n and 0 <= b < n):
            raise TopologyError(f"measured pair ({a}, {b}) is outside the world of {n} ranks")
        overrides[(min(a, b), max(a, b))] = pal.id(conn)
    measured_inter: dict[tuple[int, int], tuple[float, float]] = {}
    for (ha, hb), figures in (measured_hosts or {}).items():
        if not (0 <= ha < len(hosts) and 0 <= hb < len(hosts)) or ha == hb:
            raise TopologyError(f"measured host pair ({ha}, {hb}) is not two of the {len(hosts)} hosts")
        measured_inter[(min(ha, hb), max(ha, hb))] = _figures(figures)
    measured_local: dict[int, dict[tuple[int, int], tuple[float, float]]] = {}
    for h, rows in (measured_devices or {}).items():
        if not 0 <= h < len(hosts):
            raise TopologyError(f"measured devices of host {h}, but there are {len(hosts)} hosts")
        by_pair = {frozenset((a, b)): _figures((lat, bw)) for a, b, lat, bw in rows}
        members = per_host[h]
        slots = {}
        for i, ra in enumerate(members):
            for rb in members[i + 1:]:
                got = by_pair.get(frozenset((ra.device, rb.device)))
                if got is not None:
                    slots[(int(local_of[ra.rank]), int(local_of[rb.rank]))] = got
        if slots:
            measured_local[h] = slots

    table = ConnectionTable(
        palette=tuple(pal.items),
        host_of=host_of,
        local_of=local_of,
        host_class=host_class,
        local=tuple(local_mats.items),
        rail_of=rail_of,
        inter=inter,
        overrides=overrides,
        measured_inter=measured_inter,
        measured_local=measured_local,
    )
    return Topology(
        hosts=tuple(hosts),
        ranks=tuple(ranks),
        table=table,
        run_id=run_id,
        restart_count=restart_count,
        source=source,
    )


def _host_signature(host: Host) -> tuple:
    """Everything about a host that changes its local matrix (not its name)."""
    return (host.devices, host.nics, tuple(sorted(host.paths, key=lambda p: (p.a, p.b))))


def _figures(figures: Sequence[float]) -> tuple[float, float]:
    lat, bw = (round(float(x), 3) for x in figures)
    # the same checks a Connection makes
    Connection(kind=LinkKind.UNKNOWN, latency_us=lat, bandwidth_GBps=bw)
    return lat, bw


def local_connection(host: Host, a: str | None, b: str | None, d: LinkDefaults | None = None) -> Connection:
    """The default connection between two different ranks of ``host`` on devices ``a``, ``b``."""
    d = d or link_defaults()
    dev_a = host.device(a) if a else None
    if a is not None and a == b and dev_a.kind is DeviceKind.GPU:
        return loc_connection(d)  # two ranks sharing one GPU
    if a is None or b is None or a == b:
        # no device, or two CPU processes on one socket: shared memory
        return path_connection(None, None, d)
    return path_connection(host.path(a, b), dev_a, d)


def _local_matrix(host: Host, devs: tuple[str | None, ...], pal: _Palette, d: LinkDefaults) -> np.ndarray:
    k = len(devs)
    mat = np.empty((k, k), dtype=np.int32)
    for i, a in enumerate(devs):
        for j, b in enumerate(devs):
            if j < i:
                mat[i, j] = mat[j, i]
                continue
            mat[i, j] = pal.id(loc_connection(d) if i == j else local_connection(host, a, b, d))
    return mat


def single_host_topology(host: Host, nproc: int | None = None, *, source: str | None = None) -> Topology:
    """One rank per GPU (or per CPU socket when there are none) on one host."""
    if nproc is None:
        nproc = len(host.gpus) or max(1, sum(1 for d in host.devices if d.kind is DeviceKind.CPU))
    return build_topology([host], default_placement([host], [nproc]), source=source)
