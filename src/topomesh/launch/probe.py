"""``--topology-probe``: a short, bounded TCP measurement between nodes.

Each agent runs a :class:`ProbeServer` on the address it uses to reach the rendezvous
leader (so a loopback job probes over loopback), publishes ``host:port`` in its node entry,
and measures the next node in group-rank order (a ring: ``n`` measurements for ``n``
nodes, not ``n²``). A measurement is a ping-pong of one byte (median round trip / 2 is the
latency) and a bulk send of a few MiB acknowledged by the server (bandwidth); the whole
probe of one peer is bounded by ``budget_s``. The results travel in the world document,
replace the default latency/bandwidth of every rank pair between the two nodes and are
marked as measured (``"source": "measured"`` in the file).

What it measures is the TCP path between the agents, i.e. Ethernet or IPoIB: for IB
pairs NCCL's RDMA path is usually faster. A probe that fails or runs out of time leaves
the defaults in place and logs a warning.
"""

from __future__ import annotations

import dataclasses
import socket
import socketserver
import statistics
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from topomesh.errors import LaunchError
from topomesh.topology.build import local_connection
from topomesh.topology.defaults import network_connection
from topomesh.topology.model import Connection, Host, Nic, RankInfo

_PING = b"P"
_BULK = b"B"
_ACK = b"K"
_CHUNK_BYTES = 1 << 20
MAX_BULK_BYTES = 256 << 20
"""Largest bulk transfer the server accepts (256 MiB)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeResult:
    """One measured node pair."""

    latency_us: float
    """Median one-way small-message latency (round trip / 2), microseconds."""
    bandwidth_GBps: float
    """Bulk TCP throughput, GB/s (10^9 bytes per second)."""


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(10.0)
        chunk = memoryview(bytearray(_CHUNK_BYTES))
        try:
            while True:
                cmd = sock.recv(1)
                if not cmd:
                    return
                if cmd == _PING:
                    sock.sendall(_PING)
                elif cmd == _BULK:
                    (n,) = struct.unpack("!Q", _recv_exact(sock, 8))
                    if n > MAX_BULK_BYTES:
                        return
                    while n:
                        got = sock.recv_into(chunk[: min(n, _CHUNK_BYTES)])
                        if not got:
                            return
                        n -= got
                    sock.sendall(_ACK)
                else:
                    return
        except OSError:
            return


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed the connection")
        buf += part
    return bytes(buf)


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


class ProbeServer:
    """A background TCP echo/sink server; use as a context manager."""

    def __init__(self, bind_addr: str) -> None:
        self._server = _Server((bind_addr, 0), _Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="topomesh-probe", daemon=True)

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def __enter__(self) -> ProbeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def local_address_towards(peer_host: str) -> str:
    """The local IP this host uses to reach ``peer_host`` (no packet is sent).

    >>> local_address_towards("127.0.0.1")
    '127.0.0.1'
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(peer_host), 9))
        return s.getsockname()[0]


def measure(addr: str, *, budget_s: float = 2.0, pings: int = 50) -> ProbeResult:
    """Latency and bandwidth to the probe server at ``addr`` within ``budget_s`` seconds.

    Bulk sends start at 1 MiB and double while they take less than a tenth of the budget;
    the fastest of them gives the bandwidth. Raises :class:`LaunchError` on any failure.
    """
    host, _, port = addr.rpartition(":")
    deadline = time.monotonic() + budget_s
    try:
        with socket.create_connection((host, int(port)), timeout=budget_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rtts: list[float] = []
            for _ in range(pings):
                t0 = time.perf_counter()
                sock.sendall(_PING)
                _recv_exact(sock, 1)
                rtts.append(time.perf_counter() - t0)
                if time.monotonic() > deadline - 0.5 * budget_s:
                    break
            size = 1 << 20
            best_GBps = 0.0
            payload = bytes(min(MAX_BULK_BYTES, 64 << 20))
            while time.monotonic() < deadline:
                sock.settimeout(max(0.05, deadline - time.monotonic()))
                t0 = time.perf_counter()
                sock.sendall(_BULK + struct.pack("!Q", size))
                view = memoryview(payload)
                left = size
                while left:
                    n = min(left, len(view))
                    sock.sendall(view[:n])
                    left -= n
                if _recv_exact(sock, 1) != _ACK:
                    raise ConnectionError("no acknowledgement from the probe server")
                dt = time.perf_counter() - t0
                best_GBps = max(best_GBps, size / dt / 1e9)
                if dt > budget_s / 10 or size >= MAX_BULK_BYTES:
                    break
                size *= 2
    except (OSError, ValueError, struct.error) as exc:
        raise LaunchError(f"probe of {addr} failed ({exc})") from None
    if not rtts or best_GBps <= 0:
        raise LaunchError(f"probe of {addr} ran out of its {budget_s:g} s budget")
    return ProbeResult(latency_us=statistics.median(rtts) / 2 * 1e6, bandwidth_GBps=best_GBps)


def measured_overrides(
    hosts: Sequence[Host],
    ranks: Sequence[RankInfo],
    node_pairs: Mapping[tuple[int, int], tuple[float, float]],
    local: Mapping[int, Sequence[tuple[str, str, float, float]]] | None = None,
) -> dict[tuple[int, int], Connection]:
    """Rank-pair connections for every rank pair between two measured nodes, and for every
    rank pair of one node on two measured devices (``local``: rows by node, see
    :mod:`topomesh.launch.localprobe`).

    The kind stays what the NICs say (IB or Ethernet) or what the host's path says (NVLink,
    PCIe class, SHM); latency and bandwidth are the measured ones and the connection is
    marked ``measured``.
    """
    by_host: dict[int, list[RankInfo]] = {}
    for r in ranks:
        by_host.setdefault(r.host, []).append(r)
    out: dict[tuple[int, int], Connection] = {}
    # Alike hosts share their device/NIC/path tuples (Host.renamed), so kinds and rails are
    # worked out once per kind of host, not once per rank pair: 2,048 probed nodes give
    # about 190,000 measured rank pairs.
    conns: dict[tuple[object, ...], Connection] = {}
    for h, rows in sorted((local or {}).items()):
        figures = {frozenset((a, b)): (lat, bw) for a, b, lat, bw in rows}
        members = by_host.get(h, [])
        for i, ra in enumerate(members):
            for rb in members[i + 1:]:
                got = figures.get(frozenset((ra.device, rb.device)))
                if got is None:
                    continue
                key = (id(hosts[h].paths), ra.device, rb.device, got)
                if key not in conns:
                    default = local_connection(hosts[h], ra.device, rb.device)
                    conns[key] = dataclasses.replace(
                        default, latency_us=round(got[0], 3), bandwidth_GBps=round(got[1], 3), measured=True
                    )
                out[(min(ra.rank, rb.rank), max(ra.rank, rb.rank))] = conns[key]
    rail: dict[tuple[int, int, str | None], Nic | None] = {}

    def nic_of(r: RankInfo) -> Nic | None:
        key = (id(hosts[r.host].nics), id(hosts[r.host].paths), r.device)
        if key not in rail:
            rail[key] = hosts[r.host].nearest_nic(r.device)
        return rail[key]

    for (ha, hb), (lat_us, bw_GBps) in sorted(node_pairs.items()):
        for ra in by_host.get(ha, ()):
            nic_a = nic_of(ra)
            for rb in by_host.get(hb, ()):
                nic_b = nic_of(rb)
                key = (id(nic_a), id(nic_b), lat_us, bw_GBps)
                if key not in conns:
                    conns[key] = Connection(
                        kind=network_connection(nic_a, nic_b).kind, latency_us=round(lat_us, 3),
                        bandwidth_GBps=round(bw_GBps, 3), measured=True,
                    )
                out[(min(ra.rank, rb.rank), max(ra.rank, rb.rank))] = conns[key]
    return out
