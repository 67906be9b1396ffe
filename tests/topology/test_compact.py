from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from topomesh.errors import TopologyError
from topomesh.topology import api
from topomesh.topology.build import build_topology, default_placement
from topomesh.topology.formats import compact
from topomesh.topology.model import Connection, LinkKind

from .helpers import dgx_host

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def test_compact_golden_round_trip():
    text = (GOLDEN / "two_hosts_nvlink_pairs.compact.json").read_text()
    topo = api.parse_text(text, source="golden")
    assert api.dumps(topo, "compact") == text
    dense = api.read_source(GOLDEN / "two_hosts_nvlink_pairs.v01.json")
    for a in range(4):
        for b in range(4):
            assert topo.connection(a, b) == dense.connection(a, b)


def test_large_world_is_compact_and_small():
    hosts = [dgx_host(f"node-{i:04d}") for i in range(256)]
    t = build_topology(hosts, default_placement(hosts, [8] * 256))
    text = api.dumps(t)  # auto: 2048 ranks > DENSE_MAX_RANKS
    assert json.loads(text)["format"] == "topomesh-compact"
    assert len(text) < 100_000  # linear in ranks: ~40 bytes per rank here
    back = api.parse_text(text)
    rng = random.Random(0)
    for _ in range(500):
        a, b = rng.randrange(2048), rng.randrange(2048)
        assert back.connection(a, b) == t.connection(a, b)
    assert back.domains(LinkKind.NVLINK)[5] == list(range(40, 48))


def test_overrides_and_non_contiguous_ranks_survive():
    hosts = [dgx_host("a", gpus=2), dgx_host("b", gpus=2)]
    # torchrun may interleave hosts: ranks 0,2 on a; 1,3 on b
    from topomesh.topology.model import RankInfo

    ranks = [RankInfo(rank=r, host=r % 2, local_rank=r // 2, device=f"GPU{r // 2}") for r in range(4)]
    m = Connection(kind=LinkKind.IB, latency_us=4.0, bandwidth_GBps=44.0, measured=True)
    t = build_topology(hosts, ranks, measured={(0, 1): m})
    back = api.parse_text(api.dumps(t, "compact"))
    assert back.connection(0, 1) == m and back.connection(0, 1).measured
    assert back.connection(0, 2).kind is LinkKind.NVSWITCH
    assert back.connection(2, 3).kind is LinkKind.IB and not back.connection(2, 3).measured


def test_probe_measurements_are_stored_once_each_and_survive_both_forms():
    hosts = [dgx_host(f"n{i}", gpus=4) for i in range(3)]
    ranks = default_placement(hosts, [4, 4, 4])
    t = build_topology(
        hosts, ranks, measured_hosts={(1, 0): (4.25, 41.5)},
        measured_devices={2: [("GPU3", "GPU1", 11.5, 280.25)]},
    )
    doc = json.loads(api.dumps(t, "compact"))
    assert doc["format_version"] == "2"
    assert doc["measured_inter"] == [[0, 1, 4.25, 41.5]] and doc["measured_local"] == [[2, 1, 3, 11.5, 280.25]]
    for back in (api.parse_text(json.dumps(doc)), api.parse_text(api.dumps(t, "dense"))):
        for a in range(12):
            for b in range(12):
                assert back.connection(a, b) == t.connection(a, b), (a, b)
    assert t.connection(1, 6) == Connection(kind=LinkKind.IB, latency_us=4.25, bandwidth_GBps=41.5, measured=True)
    assert t.connection(9, 11).measured and t.connection(9, 11).kind is LinkKind.NVSWITCH
    assert not t.connection(9, 10).measured and not t.connection(1, 9).measured
    # unprobed files stay version 1, byte for byte what they were
    assert json.loads(api.dumps(build_topology(hosts, ranks), "compact"))["format_version"] == "1"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(format_version="9"), "unsupported compact format_version"),
        (lambda d: d.update(measured_inter=[[0, 0, 1.0, 2.0]]), r"is one host"),
        (lambda d: d.update(measured_inter=[[0, 1, -1.0, 2.0]]), r"\$\.measured_inter\[0\]"),
        (lambda d: d.update(measured_local=[[0, 0, 5, 1.0, 2.0]]), r"local slots \(0, 5\) are not two"),
        (lambda d: d.update(measured_local=[[0, 1]]), r"\$\.measured_local\[0\]"),
        (lambda d: d.update(rank_host=[0, 0, 5, 1]), r"\$\.rank_host: values must be in 0\.\.1"),
        (lambda d: d.update(inter=[[0, 99]]), r"\$\.inter"),
        (lambda d: d["local_classes"][0][0].__setitem__(0, 77), r"connection ids must be in"),
        (lambda d: d.update(rank_local_rank=[0, 0, 0, 1]), "duplicate local ranks|ranks but its local class"),
        (lambda d: d.update(overrides=[[0, 9, 0]]), r"\$\.overrides\[0\]"),
        (lambda d: d.update(world_size="many"), r"\$\.world_size: expected a whole number, got 'many'"),
        (lambda d: d.update(world_size=8.7), r"\$\.world_size: expected a whole number, got 8\.7"),
        (lambda d: d.update(world_size=float("inf")), r"\$\.world_size: expected a whole number, got inf"),
        (lambda d: d.update(world_size=2**20 + 1), r"\$\.world_size: expected a whole number in 0\.\.1048576"),
        (lambda d: d.update(restart_count="-1"), r"\$\.restart_count: expected a whole number in 0\.\.2147483647"),
        (lambda d: d.update(restart_count="1" * 300), r"\$\.restart_count: expected a whole number, got '1111"),
        (lambda d: d.update(rank_local_rank=[0, 1, 0, 4]), r"\$\.rank_local_rank: values must be in 0\.\.3"),
        (lambda d: d.update(connections=[{}] * (2**16 + 1)), r"\$\.connections: 65537 entries, more than the limit of 65536"),
        (lambda d: d.update(hosts=[[f"h{i}", 0] for i in range(5)]), r"\$\.hosts: 5 entries, more than the limit of 4 hosts"),
        (lambda d: d.update(local_classes=[[[0]]] * 3), r"\$\.local_classes: 3 entries, more than the limit of 2 local"),
        (lambda d: d.update(rank_device=["GPU0", "GPU1", "GPU7", 3]), r"\$\.rank_device"),
        (lambda d: d["hosts"].append(d["hosts"][0]), "host names must be unique|has 0 ranks|host_class"),
    ],
)
def test_bad_compact_documents(mutate, message):
    doc = json.loads((GOLDEN / "two_hosts_nvlink_pairs.compact.json").read_text())
    mutate(doc)
    with pytest.raises(TopologyError, match=message):
        compact.from_dict(doc, source="c.json")
