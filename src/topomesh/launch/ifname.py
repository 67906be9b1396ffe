"""The network interface workers should use for NCCL and Gloo sockets.

On hosts with several interfaces (a VPN, docker bridges, a management and a data network)
NCCL and Gloo may pick one that does not reach the other nodes and hang. The interface
that does is the one whose address this node uses to reach the rendezvous endpoint: the
kernel picks it when a UDP socket ``connect()``\\ s there (no packet is sent), and
``getsockname()`` tells the address; the interface that holds that address
(``SIOCGIFADDR`` for IPv4, ``/proc/net/if_inet6`` for IPv6) is the answer.

``--socket-ifname {auto,off,NAME}`` of ``topomesh launch`` (and ``socket_ifname`` of the
Ray integration): ``auto`` finds it, ``NAME`` is passed as given (NCCL's own syntax, e.g.
``eth0`` or ``^docker``), ``off`` leaves both variables alone. A variable the user set
always wins.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping
from pathlib import Path

from topomesh.errors import LaunchError

ENV_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
AUTO, OFF = "auto", "off"
_SIOCGIFADDR = 0x8915  # linux/sockios.h


def address_towards(host: str) -> str:
    """The local address this node uses to reach ``host`` (IPv4 or IPv6; nothing is sent).

    >>> address_towards("127.0.0.1")
    '127.0.0.1'
    """
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 9, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0]).split("%")[0]
    except OSError as exc:
        raise LaunchError(f"cannot find the local address that reaches the rendezvous host {host!r}: {exc}") from exc


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on this interface
            return None
    return socket.inet_ntoa(raw[20:24])


def _ipv6_interfaces(proc: Path = Path("/proc/net/if_inet6")) -> dict[str, str]:
    """IPv6 address -> interface, from ``/proc/net/if_inet6`` (address, index, prefix, scope,
    flags, name per line)."""
    out: dict[str, str] = {}
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) == 6:
            out[str(ipaddress.IPv6Address(bytes.fromhex(parts[0])))] = parts[5]
    return out


def interface_of(address: str) -> str | None:
    """The name of the local interface that holds ``address``, or None.

    >>> interface_of("127.0.0.1")
    'lo'
    """
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        return _ipv6_interfaces().get(str(ip))
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == str(ip):
            return name
    return None


def choose(mode: str, rdzv_host: str | None) -> str | None:
    """The interface name for ``mode`` (``auto``, ``off`` or a name), or None for none.

    ``auto`` needs the rendezvous host; when no interface holds the address that reaches
    it, the answer is None (the launcher logs it and sets nothing).
    """
    if mode == OFF:
        return None
    if mode != AUTO:
        return mode
    if not rdzv_host:
        return None
    return interface_of(address_towards(rdzv_host))


def worker_env(ifname: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to set for workers: each of :data:`ENV_VARS` the user has not set.

    >>> worker_env("eth1", {"NCCL_SOCKET_IFNAME": "ib0"})
    {'GLOO_SOCKET_IFNAME': 'eth1'}
    """
    if ifname is None:
        return {}
    return {var: ifname for var in ENV_VARS if var not in environ}


def check_mode(value: str) -> str:
    """Validate a ``--socket-ifname`` value (argparse type)."""
    if not value or not value.isprintable() or any(c.isspace() for c in value):
        raise LaunchError(f"--socket-ifname must be 'auto', 'off' or an interface name, got {value!r}")
    return value


def rdzv_host_of(endpoint: str | None) -> str | None:
    """The host part of a torchrun ``--rdzv-endpoint`` (``host``, ``host:port``, ``[v6]:port``).

    >>> rdzv_host_of("head:29400"), rdzv_host_of("[::1]:29400"), rdzv_host_of("10.0.0.1")
    ('head', '::1', '10.0.0.1')
    """
    if not endpoint:
        return None
    if endpoint.startswith("["):
        return endpoint[1:].split("]", 1)[0]
    if endpoint.count(":") > 1:  # a bare IPv6 address
        return endpoint
    return endpoint.rsplit(":", 1)[0] if ":" in endpoint else endpoint
