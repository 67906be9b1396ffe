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

import socket
import socketserver
import statistics
import struct
import threading
import time
from dataclasses import dataclass

from topomesh.errors import LaunchError

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
