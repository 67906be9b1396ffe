"""The network interface workers use for NCCL/Gloo sockets (``--socket-ifname``)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.launch.conftest import Agents
from topomesh.errors import LaunchError, TopologyError
from topomesh.launch import ifname
from topomesh.launch.cli import build_parser, options_from_args
from topomesh.topology.model import Host

WORKER = Path(__file__).resolve().parent / "env_worker.py"


def test_loopback_endpoint_is_lo() -> None:
    # Linux names its loopback interface "lo" and gives it 127.0.0.1 (and ::1)
    assert ifname.address_towards("127.0.0.1") == "127.0.0.1"
    assert ifname.choose("auto", "127.0.0.1") == "lo"
    assert ifname.choose("auto", "localhost") == "lo"
    assert ifname.choose("off", "127.0.0.1") is None
    assert ifname.choose("ib0", "127.0.0.1") == "ib0"  # a name is passed as given


def test_every_ipv4_interface_maps_back_to_itself() -> None:
    for _, name in socket.if_nameindex():
        addr = ifname._ipv4_of(name)
        if addr is not None:
            assert ifname.interface_of(addr) == name
    assert ifname.interface_of("192.0.2.1") is None  # TEST-NET-1 (RFC 5737): held by no one here


def test_ipv6_table_is_parsed(tmp_path: Path) -> None:
    # the format of /proc/net/if_inet6 (address, index, prefix length, scope, flags, name)
    table = tmp_path / "if_inet6"
    table.write_text("00000000000000000000000000000001 01 80 10 80       lo\n"
                     "fe800000000000000000000000000001 04 40 20 80     eth0\n")
    assert ifname._ipv6_interfaces(table) == {"::1": "lo", "fe80::1": "eth0"}


def test_the_users_setting_wins() -> None:
    assert ifname.worker_env("lo", {}) == {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
    assert ifname.worker_env("lo", {"GLOO_SOCKET_IFNAME": "eth9"}) == {"NCCL_SOCKET_IFNAME": "lo"}
    assert ifname.worker_env(None, {}) == {}


def test_rendezvous_host_from_torchrun_flags() -> None:
    def opts(*argv: str):  # noqa: ANN202
        return options_from_args(build_parser().parse_args([*argv, "train.py"]))

    assert opts("--standalone").rdzv_host == "localhost"
    assert opts("--rdzv-backend=c10d", "--rdzv-endpoint=[fd00::2]:29400").rdzv_host == "fd00::2"
    assert opts("--rdzv-backend=c10d", "--rdzv-endpoint=head:29400").rdzv_host == "head"
    assert opts("--master-addr=10.1.2.3").rdzv_host == "10.1.2.3"  # static rendezvous
    assert opts("--standalone", "--socket-ifname=off").socket_ifname == "off"
    with pytest.raises(LaunchError, match="--socket-ifname must be 'auto', 'off' or an interface name, got 'a b'"):
        opts("--socket-ifname=a b")


def test_host_record_round_trips_and_is_absent_when_unset() -> None:
    h = Host(hostname="n0", socket_ifname="eth1")
    assert h.to_dict()["socket_ifname"] == "eth1"
    assert Host.from_dict(h.to_dict()) == h
    assert h.renamed("n1").socket_ifname == "eth1"
    assert "socket_ifname" not in Host(hostname="n0").to_dict()
    with pytest.raises(TopologyError, match="socket_ifname must be a non-empty printable string"):
        Host.from_dict({"hostname": "n0", "socket_ifname": ""})


@pytest.mark.slow
def test_workers_get_lo_for_a_loopback_endpoint(agents: Agents) -> None:
    args = ["--standalone", "--nproc-per-node=2", f"--topology-dir={agents.tmp / 'topo'}"]
    a = agents.start("a", args, script=[str(WORKER)])
    assert agents.wait(a) == 0, agents.log(a)[-3000:]
    reports = agents.reports()
    assert [r["env"] for r in reports] == [{"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}] * 2
    assert [r["host_ifname"] for r in reports] == ["lo", "lo"]  # recorded for the node in the file
    for f in agents.out.glob("rank*.json"):
        f.unlink()
    # the user's own setting wins; the other variable is still set
    b = agents.start("b", args, env={"NCCL_SOCKET_IFNAME": "eth7"}, script=[str(WORKER)])
    assert agents.wait(b) == 0, agents.log(b)[-3000:]
    assert [r["env"] for r in agents.reports()] == [{"NCCL_SOCKET_IFNAME": "eth7", "GLOO_SOCKET_IFNAME": "lo"}] * 2
    assert agents.reports()[0]["host_ifname"] == "lo"
