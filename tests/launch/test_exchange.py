"""The node/world exchange without processes: validation, limits, leader errors."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zlib
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.launch.conftest import SYSFS
from topomesh.errors import LaunchError
from topomesh.launch import exchange as ex
from topomesh.topology.discover import discover_host
from topomesh.topology.model import Device, DeviceKind, Host


@pytest.fixture(scope="module")
def dgx() -> Host:
    return discover_host(SYSFS / "dgx-h100-8gpu-8ib")


def _entry(host: Host, g: int, n: int = 2, base: int | None = None) -> ex.NodeEntry:
    base = g * n if base is None else base
    return ex.NodeEntry(
        group_rank=g,
        host=host,
        workers=tuple(ex.WorkerSlot(global_rank=base + i, local_rank=i, device=f"GPU{i}") for i in range(n)),
    )


def _classes(*hosts: Host) -> ex.HostClasses:
    classes = ex.HostClasses()
    for h in hosts:
        classes.add(*ex.host_class(h), group_rank=0)
    return classes


def test_node_roundtrip_and_real_host_size(dgx: Host) -> None:
    blob = ex.encode_node(_entry(dgx, 1))
    assert ex.decode_node(blob, group_rank=1, classes=_classes(dgx)) == _entry(dgx, 1)
    assert len(blob) < 400  # the entry is small; the host travels once per kind of node
    assert len(ex.host_class(dgx)[1]) < ex.MAX_NODE_BYTES // 50
    renamed = Host(hostname="other", devices=dgx.devices, nics=dgx.nics, paths=dgx.paths)
    assert ex.host_class(renamed) == ex.host_class(dgx)


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda d: b"x" * (ex.MAX_NODE_BYTES + 1), "more than the limit of 1048576"),
        (lambda d: b"\xff\xfe", "not UTF-8 (byte 0)"),
        (lambda d: b"[1, 2]", "expected a JSON object"),
        (lambda d: json.dumps({**d, "format": "other/9"}).encode(), "format is 'other/9'"),
        (lambda d: json.dumps({**d, "group_rank": 0}).encode(), "claims group rank 0"),
        (lambda d: json.dumps({**d, "workers": [[2, 0, "GPU9"]]}).encode(), "no device 'GPU9'"),
        (lambda d: json.dumps({**d, "workers": [[-1, 0, None]]}).encode(), "global rank must be an integer from 0 to 2147483647, got -1"),
        (lambda d: json.dumps({**d, "restart_count": "1"}).encode(), "restart_count must be an integer"),
        (lambda d: json.dumps({**d, "hostname": ""}).encode(), "hostname must be a non-empty printable string"),
        (lambda d: json.dumps({**d, "host_class": "0" * 32}).encode(), "which nobody published"),
        (lambda d: json.dumps({**d, "local_measured": [["GPU0", "GPU9", 5.0, 100.0]]}).encode(), "no device 'GPU9'"),
        (lambda d: json.dumps({**d, "local_measured": [["GPU0", "GPU1", 5.0, -1.0]]}).encode(),
         "impossible local_measured row"),
        (lambda d: json.dumps({**d, "local_measured": [["GPU0", 5.0]]}).encode(), "is not [device_a, device_b"),
        (lambda d: json.dumps({**d, "local_measured": {}}).encode(), "local_measured must be a list"),
        # hostile entries (issue 8): each was a traceback in the leader or a file nobody could read
        (lambda d: b'{"workers": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "JSON nested deeper than the limit of 64 levels"),
        (lambda d: json.dumps({**d, "restart_count": 10**299}).encode(), "a number has more than the 40 digits allowed"),
        (lambda d: json.dumps({**d, "restart_count": 2**31}).encode(),
         "restart_count must be an integer from 0 to 2147483647, got 2147483648"),
        (lambda d: json.dumps({**d, "restart_count": 1.0}).encode(), "restart_count must be an integer"),
        (lambda d: json.dumps({**d, "workers": [[2, 0, "GPU0"], [3, 0, "GPU1"]]}).encode(),
         "its 2 workers have local ranks [0, 0], not 0..1"),
        (lambda d: json.dumps({**d, "workers": [[2, 0, "GPU0"], [2, 1, "GPU1"]]}).encode(),
         "two of its workers have the same global rank"),
        (lambda d: json.dumps({**d, "workers": [[2, 1, "GPU0"]]}).encode(), "local ranks [1], not 0..0"),
        (lambda d: json.dumps(d).replace('"restart_count": 0', '"restart_count": 1e400').encode(),
         "a number has an exponent of 3 or more digits"),
        (lambda d: json.dumps({**d, "local_measured": [["GPU0", "GPU1", "5", 100.0]]}).encode(),
         "latency_us must be a number, got '5'"),
        (lambda d: json.dumps({**d, "hostname": "evil\x1b[2J"}).encode(), r"printable string of at most 255 characters, got 'evil\x1b[2J'"),
        (lambda d: json.dumps({**d, "probe_addr": "10.0.0.1:" + "9" * 400}).encode(), "probe_addr '10.0.0.1:99999"),
        (lambda d: json.dumps({**d, "probe_addr": "10.0.0.1:0"}).encode(), "with a port from 1 to 65535"),
        (lambda d: json.dumps({**d, "workers": [["x" * 100_000, 0, None]]}).encode(), "got 'xxxx"),
    ],
)
def test_bad_node_entries_are_rejected_naming_the_node(dgx: Host, mutate, why: str) -> None:
    doc = json.loads(ex.encode_node(_entry(dgx, 1)))
    with pytest.raises(LaunchError, match="^node 1 published a topology entry that was rejected") as info:
        ex.decode_node(mutate(doc), group_rank=1, classes=_classes(dgx))
    msg = str(info.value)
    assert msg.startswith("node 1 published a topology entry that was rejected"), msg
    assert why in msg, msg
    assert len(msg) < 300 and "\n" not in msg  # one line, whatever the peer sent


def _device_field(key: str, value: object):
    def mutate(d: dict) -> bytes:
        d["devices"][0][key] = value
        return json.dumps(d).encode()

    return mutate


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda d: b" " * (ex.MAX_NODE_BYTES + 1), "host description is 1048577 bytes"),
        (lambda d: b"[]", "not a JSON object"),
        (lambda d: json.dumps({**d, "paths": [{"a": "GPU0", "b": "GPU42", "kind": "PIX"}]}).encode(), "unknown endpoint 'GPU42'"),
        (_device_field("arch", ["sm90"]), "arch must be str"),
        (_device_field("index", "0"), "index must be int"),
        (lambda d: json.dumps(d, separators=(",", ":")).replace('"speed_Gbps":400.0', '"speed_Gbps":NaN').encode(),
         "NaN is not a number JSON allows"),
        (_device_field("index", 10**50), "a number has more than the 40 digits allowed"),
        (lambda d: b"[" * 100_000, "JSON nested deeper than the limit of 64 levels"),
    ],
)
def test_bad_host_descriptions_are_rejected_naming_the_node(dgx: Host, mutate, why: str) -> None:
    body = mutate(json.loads(ex.host_class(dgx)[1]))
    digest = hashlib.sha256(body).hexdigest()[:32]
    with pytest.raises(LaunchError, match="^node 3 published a topology entry that was rejected") as info:
        ex.HostClasses().add(digest, body, group_rank=3)
    msg = str(info.value)
    assert msg.startswith("node 3 published a topology entry that was rejected"), msg
    assert why in msg, msg


def test_host_description_must_match_its_digest(dgx: Host) -> None:
    digest, body = ex.host_class(dgx)
    with pytest.raises(LaunchError, match="^node 2 .* does not match its digest"):
        ex.HostClasses().add(digest, body.replace(b"GPU7", b"GPU8"), group_rank=2)


def test_world_folds_identical_hosts(dgx: Host) -> None:
    # determinism across processes and hash seeds: test_world_determinism.py
    other = Host(hostname="node-b", devices=dgx.devices, nics=dgx.nics, paths=dgx.paths)
    entries = [_entry(dgx, 0), _entry(other, 1)]
    blob = ex.assemble_world(entries)
    doc = json.loads(zlib.decompress(blob))
    assert len(doc["classes"]) == 1  # one class for two hosts that differ only by name
    world = ex.decode_world(blob)
    assert [h.hostname for h in world.hosts] == ["dgx-h100-8gpu-8ib", "node-b"]
    assert world.hosts[1].path("GPU0", "GPU1") == dgx.path("GPU0", "GPU1")
    assert [(r.rank, r.host, r.local_rank, r.device) for r in world.ranks] == [
        (0, 0, 0, "GPU0"), (1, 0, 1, "GPU1"), (2, 1, 0, "GPU0"), (3, 1, 1, "GPU1")
    ]


def test_same_hostname_on_two_nodes_becomes_two_hosts(dgx: Host) -> None:
    world = ex.decode_world(ex.assemble_world([_entry(dgx, 0), _entry(dgx, 1)]))
    assert [h.hostname for h in world.hosts] == ["dgx-h100-8gpu-8ib", "dgx-h100-8gpu-8ib~1"]


def test_world_rejects_rank_gaps_and_bombs(dgx: Host) -> None:
    with pytest.raises(LaunchError, match="not 0..3"):
        ex.assemble_world([_entry(dgx, 0), _entry(dgx, 1, base=3)])
    bomb = zlib.compress(b" " * (1 << 20))
    with pytest.raises(LaunchError, match="larger than 1000 bytes"):
        ex.decode_world(bomb, max_bytes=1000)


def test_local_probe_rows_travel_from_entry_to_world(dgx: Host) -> None:
    rows = (("GPU0", "GPU1", 12.5, 150.0),)
    entry = dataclasses.replace(_entry(dgx, 1), local_measured=rows)
    assert ex.decode_node(ex.encode_node(entry), group_rank=1, classes=_classes(dgx)) == entry
    world = ex.decode_world(ex.assemble_world([_entry(dgx, 0), entry]))
    assert world.local_measured == {1: rows}
    # nodes without local rows publish the same bytes as before the field existed
    assert b"local_measured" not in ex.encode_node(_entry(dgx, 0))


def test_world_document_carries_probe_results_and_is_checked(dgx: Host) -> None:
    doc = json.loads(zlib.decompress(ex.assemble_world([_entry(dgx, 0), _entry(dgx, 1)], [[0, 1, 5.0, 2.0]])))
    assert ex.decode_world(zlib.compress(json.dumps(doc).encode())).measured == {(0, 1): (5.0, 2.0)}
    gap = [{**doc["nodes"][0], "workers": [[0, 0, "GPU0"], [2, 1, "GPU1"]]}]
    for bad, why in [
        ({**doc, "format": "other/9"}, "unknown format"),
        ({**doc, "measured": [[1, 0, 5.0, 2.0]]}, r"measured node pair \(1, 0\)"),
        ({**doc, "nodes": gap}, "global ranks have gaps"),
        ({**doc, "classes": []}, "malformed"),
    ]:
        with pytest.raises(LaunchError, match=f"^the world document from node 0 .*{why}"):
            ex.decode_world(zlib.compress(json.dumps(bad).encode()))


def test_leader_publishes_the_error_naming_the_bad_node(dgx: Host) -> None:
    store = dist.HashStore()
    ex.publish_node(store, "t", _entry(dgx, 0))
    store.set(ex.node_key("t", 1), b"\x00" * (ex.MAX_NODE_BYTES + 5))
    with pytest.raises(LaunchError, match="^node 1 published a topology entry that was rejected: it is 1048581 bytes"):
        ex.lead(store, "t", 2, timeout_s=1)
    # the other node fails with the same sentence instead of waiting
    with pytest.raises(LaunchError, match="^node 1 published a topology entry that was rejected") as info:
        ex.fetch_world(store, "t", timeout_s=1)
    assert not isinstance(info.value, ex.PeerMissingError)  # a bad entry ends the job; no new round


def test_leader_names_a_node_that_never_publishes(dgx: Host) -> None:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    ex.publish_node(store, "t", _entry(dgx, 0))
    with pytest.raises(ex.PeerMissingError, match="^node 1 did not publish its topology within 0.2 s"):
        ex.lead(store, "t", 2, timeout_s=0.2)
    # the others learn it at once, as a lost node (their agents re-form), not as a bad entry
    with pytest.raises(ex.PeerMissingError, match="^node 1 did not publish its topology within 0.2 s"):
        ex.fetch_world(store, "t", timeout_s=0.2)
    with pytest.raises(ex.PeerMissingError, match=r"^node 0 \(the leader\) did not publish its topology within 0.2 s"):
        ex.fetch_world(dist.HashStore(), "t", timeout_s=0.2)


def test_probe_results_are_validated_and_deduplicated(dgx: Host) -> None:
    store = dist.HashStore()
    store.set(ex.probe_key("t", 0), json.dumps({"peer": 1, "latency_us": 12.3456, "bandwidth_GBps": 1.5}))
    store.set(ex.probe_key("t", 1), json.dumps({"peer": 0, "latency_us": 99.0, "bandwidth_GBps": 9.0}))
    assert ex.gather_probes(store, "t", 2, timeout_s=1) == [[0, 1, 12.346, 1.5]]
    store.set(ex.probe_key("t", 1), json.dumps({"peer": 1, "latency_us": 1.0, "bandwidth_GBps": 1.0}))
    with pytest.raises(LaunchError, match="^node 1 .* impossible probe result"):
        ex.gather_probes(store, "t", 2, timeout_s=1)


def test_cpu_only_entry_without_devices_roundtrips() -> None:
    host = Host(hostname="c", devices=(Device(id="CPU0", kind=DeviceKind.CPU, index=0),))
    e = ex.NodeEntry(group_rank=0, host=host, workers=(ex.WorkerSlot(global_rank=0, local_rank=0),))
    assert ex.decode_node(ex.encode_node(e), group_rank=0, classes=_classes(host)) == e


def test_leader_fetches_each_host_class_once(dgx: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    store = dist.HashStore()
    other = Host(hostname="node-b", devices=dgx.devices, nics=dgx.nics, paths=dgx.paths)
    ex.publish_node(store, "t", _entry(dgx, 0))
    ex.publish_node(store, "t", _entry(other, 1))
    fetched: list[str] = []
    real_get = ex.HostClasses.add

    def counting_add(self, digest, body, *, group_rank):
        fetched.append(digest)
        return real_get(self, digest, body, group_rank=group_rank)

    monkeypatch.setattr(ex.HostClasses, "add", counting_add)
    ex.lead(store, "t", 2, timeout_s=1)
    assert fetched == [ex.host_class(dgx)[0]]
    assert [h.hostname for h in ex.fetch_world(store, "t", 1).hosts] == ["dgx-h100-8gpu-8ib", "node-b"]


@pytest.mark.parametrize(
    ("blob", "why"),
    [
        (b"[" * 200_000, "JSON nested deeper than the limit of 64 levels"),
        (b'{"restart_count": ' + b"9" * 300 + b"}", "a number has more than the 40 digits allowed"),
    ],
)
def test_hostile_entry_ends_every_node_with_one_line_naming_it(dgx: Host, blob: bytes, why: str) -> None:
    store = dist.HashStore()
    ex.publish_node(store, "t", _entry(dgx, 0))
    store.set(ex.node_key("t", 1), blob)
    expected = f"^node 1 published a topology entry that was rejected: {why}"
    with pytest.raises(LaunchError, match=expected):
        ex.lead(store, "t", 2, timeout_s=1)
    with pytest.raises(LaunchError, match=expected):
        ex.fetch_world(store, "t", timeout_s=1)


def test_hostile_probe_results_and_world_documents_are_one_error(dgx: Host) -> None:
    store = dist.HashStore()
    store.set(ex.probe_key("t", 0), json.dumps({"peer": 1, "latency_us": 10**50, "bandwidth_GBps": 1.0}))
    with pytest.raises(LaunchError, match=r"^node 0 .* malformed probe result \(a number has more than the 40 digits"):
        ex.gather_probes(store, "t", 2, timeout_s=1)
    store.set(ex.probe_key("t", 0), b"[" * 4000)
    with pytest.raises(LaunchError, match=r"^node 0 .* malformed probe result \(JSON nested deeper than the limit"):
        ex.gather_probes(store, "t", 2, timeout_s=1)
    doc = json.loads(zlib.decompress(ex.assemble_world([_entry(dgx, 0)])))
    # a global rank of 2**31 - 1 would have been a list of two billion slots
    far = {**doc, "nodes": [{**doc["nodes"][0], "workers": [[0, 0, "GPU0"], [2**31 - 1, 1, "GPU1"]]}]}
    with pytest.raises(LaunchError, match="^the world document from node 0 is malformed .*global ranks have gaps"):
        ex.decode_world(zlib.compress(json.dumps(far).encode()))
    assert len(zlib.decompress(ex.error_document("x" * 10_000))) < 2100  # the leader publishes it bounded
    with pytest.raises(LaunchError, match=r"^x{2000}$"):
        ex.decode_world(ex.error_document("x" * 10_000))
