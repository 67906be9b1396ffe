"""v0.1 reader and writer against literal values: every unit, host inference, measured flags.

Expected values are unit conversions done by hand (1 ms = 1000 us, 1 Gb/s = 1/8 GB/s,
1 GiB/s = 2^30 / 10^9 GB/s = 1.073741824 GB/s, ...), not computed by the reader's tables.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from topomesh.errors import TopologyError
from topomesh.topology.build import build_topology, default_placement
from topomesh.topology.formats import rfc
from topomesh.topology.model import LinkKind

from .helpers import cpu_host, pcie_host

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def _with_units(latency, bandwidth):
    """The RFC's second example with the 0->2 connection's figures replaced."""
    doc = json.loads((GOLDEN / "rfc_example_variant_b.json").read_text())
    c = doc["ranks"]["0"]["peers"]["2"]["connection"]
    c["latency"] = {"value": latency[0], "measurement": latency[1]}
    c["bandwidth"] = {"value": bandwidth[0], "measurement": bandwidth[1]}
    return rfc.from_dict(doc, source="units.json").connection(0, 2)


@pytest.mark.parametrize(
    ("value", "unit", "want_us"),
    [
        ("600", "ns", 0.6),  # 600 ns = 0.6 us
        ("22", "us", 22.0),
        ("22", "µs", 22.0),
        ("22", "usec", 22.0),
        ("0.6", "ms", 600.0),  # 0.6 ms = 600 us
        ("0.000002", "s", 2.0),  # 2e-6 s = 2 us
        ("1.5", "MS", 1500.0),  # units are case-insensitive
        (3, "US", 3.0),  # a JSON number where the RFC writes a string
    ],
)
def test_every_latency_unit(value, unit, want_us):
    assert _with_units((value, unit), ("1", "GB/s")).latency_us == pytest.approx(want_us, rel=1e-12)


@pytest.mark.parametrize(
    ("value", "unit", "want_GBps"),
    [
        ("64", "GB/s", 64.0),
        ("64", "GBps", 64.0),  # bytes, as Calculon writes it
        ("64", "GB/sec", 64.0),
        ("64", "gb/s", 64.0),
        ("2", "GiB/s", 2.147483648),  # 2 * 2^30 B/s = 2.147483648e9 B/s
        ("1500", "MB/s", 1.5),  # 1500e6 B/s
        ("0.9", "TB/s", 900.0),  # 0.9e12 B/s
        ("200", "Gb/s", 25.0),  # 200 Gbit/s / 8 = 25 GB/s (an HDR port)
        ("200", "Gb/sec", 25.0),  # bits, as /sys/class/infiniband/*/ports/*/rate writes it (was read as bytes)
        ("400", "Gbit/s", 50.0),  # NDR: 400 / 8
        ("400", "gbit/s", 50.0),
        ("100", "Gbps", 12.5),  # bits: NCCL's NET_BW of 12 GB/s is about this line rate
        ("800", "Mb/s", 0.1),  # 800e6 bit/s / 8 = 100e6 B/s
    ],
)
def test_every_bandwidth_unit(value, unit, want_GBps):
    assert _with_units(("1", "us"), (value, unit)).bandwidth_GBps == pytest.approx(want_GBps, rel=1e-12)


@pytest.mark.parametrize(
    ("latency", "bandwidth", "message"),
    [
        (("1", "min"), ("1", "GB/s"), r"units\.json: \$\.ranks\.0\.peers\.2\.connection\.latency: unknown latency unit 'min'"),
        (("1", "us"), ("1", "B/s"), r"\$\.ranks\.0\.peers\.2\.connection\.bandwidth: unknown bandwidth unit 'B/s'"),
    ],
)
def test_unknown_units_are_refused_naming_the_place(latency, bandwidth, message):
    with pytest.raises(TopologyError, match=message):
        _with_units(latency, bandwidth)


def _conn(kind):
    return {"connection": {"type": kind}}


def test_hosts_inferred_from_same_host_links_when_the_file_names_none():
    """Five ranks, no host names: 0-3 NVLink and 3-4 PCIe join {0, 3, 4} (transitively, 0-4 is
    IB in the file); every other pair is IB or Ethernet. Hosts are numbered by their smallest
    rank: host0 = {0, 3, 4}, host1 = {1}, host2 = {2}; local ranks count up in rank order."""
    intra = {(0, 3): "NVLink", (3, 4): "PCIe"}
    ranks = {}
    for a in range(5):
        peers = {}
        for b in range(a + 1, 5):
            peers[str(b)] = _conn(intra.get((a, b), "NIC" if (a + b) % 2 else "IB"))
        ranks[str(a)] = {"peers": peers}
    topo = rfc.from_dict({"version": "0.1", "ranks": ranks}, source="nohosts.json")
    assert [h.hostname for h in topo.hosts] == ["host0", "host1", "host2"]
    assert [r.host for r in topo.ranks] == [0, 1, 2, 0, 0]
    assert [r.local_rank for r in topo.ranks] == [0, 0, 0, 1, 2]
    assert topo.ranks_by_host() == [[0, 3, 4], [1], [2]]
    assert topo.connection(4, 3).kind is LinkKind.PHB
    assert topo.domains(LinkKind.NVLINK) == [[0, 3], [1], [2], [4]]


def test_hosts_named_in_the_file_are_kept_in_first_seen_order():
    doc = {"version": "0.1", "ranks": {
        "0": {"host": "b", "peers": {"1": _conn("IB"), "2": _conn("SHM")}},
        "1": {"host": "a", "peers": {"2": _conn("IB")}},
        "2": {"host": "b", "peers": {}},
    }}
    topo = rfc.from_dict(doc)
    assert [h.hostname for h in topo.hosts] == ["b", "a"]
    assert [(r.host, r.local_rank) for r in topo.ranks] == [(0, 0), (1, 0), (0, 1)]


def _measured_world():
    """Two CPU hosts of 2 ranks and a PCIe host of 2 GPUs; host pair (0, 1) probed at 3.5 us and
    9.25 GB/s, host 2's GPU0-GPU1 pair probed at 1.25 us and 40.5 GB/s."""
    hosts = [cpu_host("c0"), cpu_host("c1"), pcie_host("g")]
    return build_topology(hosts, default_placement(hosts, [2, 2, 2]), measured_hosts={(1, 0): (3.5, 9.25)},
                          measured_devices={2: [("GPU1", "GPU0", 1.25, 40.5)]})


def test_writer_marks_measured_figures_and_only_those():
    doc = rfc.to_dict(_measured_world())
    measured = {(a, b) for a in range(6) for b in range(6) if a != b
                and doc["ranks"][str(a)]["peers"][str(b)]["connection"]["latency"]["source"] == "measured"}
    # ranks 0,1 on c0, 2,3 on c1, 4,5 on g: every c0-c1 pair in both directions, and 4-5
    want = {(a, b) for a in (0, 1) for b in (2, 3)} | {(b, a) for a in (0, 1) for b in (2, 3)} | {(4, 5), (5, 4)}
    assert measured == want
    c = doc["ranks"]["3"]["peers"]["0"]["connection"]
    assert c["latency"] == {"value": "3.5", "measurement": "us", "source": "measured"}
    assert c["bandwidth"] == {"value": "9.25", "measurement": "GB/s", "source": "measured"}
    c = doc["ranks"]["4"]["peers"]["5"]["connection"]
    assert (c["type"], c["latency"]["value"], c["bandwidth"]["value"]) == ("NVLink", "1.25", "40.5")
    assert c["bandwidth"]["source"] == "measured"
    # a default figure says so: rank 0 to rank 4 crosses Ethernet (10 GbE and 100 GbE NICs)
    c = doc["ranks"]["0"]["peers"]["4"]["connection"]
    assert c["latency"]["source"] == "default" and c["bandwidth"]["source"] == "default"
    assert c["bandwidth"]["value"] == "1.25"  # the slower end, 10 Gb/s / 8


def test_measured_flags_survive_a_round_trip():
    topo = rfc.loads(rfc.dumps(_measured_world()), source="m.json")
    assert topo.connection(1, 2).measured and topo.connection(1, 2).latency_us == 3.5
    assert topo.connection(5, 4).measured and topo.connection(5, 4).bandwidth_GBps == 40.5
    assert not topo.connection(0, 1).measured and not topo.connection(3, 4).measured


def test_writer_marks_a_world_with_only_device_measurements():
    hosts = [pcie_host("g")]
    topo = build_topology(hosts, default_placement(hosts, [4]), measured_devices={0: [("GPU2", "GPU3", 1.5, 30.0)]})
    doc = rfc.to_dict(topo)
    c = doc["ranks"]["3"]["peers"]["2"]["connection"]
    assert c["latency"] == {"value": "1.5", "measurement": "us", "source": "measured"}
    assert c["bandwidth"] == {"value": "30", "measurement": "GB/s", "source": "measured"}
    assert doc["ranks"]["0"]["peers"]["1"]["connection"]["latency"]["source"] == "default"
