"""Clusters: presets, links per axis (rail sharing), collective times on real topologies.

Expected values are worked out by hand in the comments from the data files' figures
(NIC line rates, NVLink counts, NCCL tuning.cc constants), not by the code under test.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from topomesh.cost import cluster as cl
from topomesh.cost.cluster import (
    GPUS_MAX,
    axis_link,
    axis_links,
    cluster_from_topology,
    cluster_names,
    group_collective_time_s,
    load_cluster,
)
from topomesh.cost.devices import device_spec
from topomesh.errors import ClusterError
from topomesh.layout.dims import Layout
from topomesh.layout.place import place
from topomesh.topology.model import LinkKind
from topomesh.trace.graph import CollectiveKind, CollectiveRecord

GiB = 2**30
SMI = Path(__file__).resolve().parents[2] / "examples" / "data" / "real" / "nvidia-smi-topo" / "h100-sxm-8gpu-12nic.txt"


def _links(name: str, gpus: int, **degrees: int) -> tuple[cl.Cluster, dict[str, cl.AxisLink]]:
    c = load_cluster(name, gpus=gpus)
    return c, axis_links(c, place(c.topology, Layout(**degrees)))


def test_preset_names():
    assert cluster_names() == ["dgx-a100-80gb", "dgx-h100", "dgx-h200", "local"]


def test_preset_node_has_nvswitch_inside_and_ib_across():
    c = load_cluster("dgx-h100", gpus=16)
    assert (c.world_size, c.nodes, c.gpus_per_node) == (16, 2, 8)
    inside, across = c.topology.connection(0, 7), c.topology.connection(0, 8)
    assert inside.kind is LinkKind.NVSWITCH
    assert inside.bandwidth_GBps == pytest.approx(18 * 20.6)  # 18 NVLinks x NCCL's sm90 20.6 GB/s
    assert across.kind is LinkKind.IB
    assert across.bandwidth_GBps == pytest.approx(400 / 8)  # 400 Gb/s NDR = 50 GB/s
    assert c.device.name == "H100-SXM5-80GB" and c.profile.name == "nccl-dgx-h100"
    h200 = load_cluster("dgx-h200")
    assert (h200.world_size, h200.device.name, h200.profile.name) == (8, "H200-SXM-141GB", "nccl-dgx-h100")
    a100 = load_cluster("dgx-a100-80gb", gpus=4)  # part of one node
    assert (a100.world_size, a100.nodes) == (4, 1)
    assert a100.topology.connection(0, 3).bandwidth_GBps == pytest.approx(12 * 20.0)  # 12 NVLinks x 20 GB/s


def test_sixteen_thousand_ranks_build_fast():
    t0 = time.perf_counter()
    c = load_cluster("dgx-h100", gpus=16384)
    elapsed = time.perf_counter() - t0
    assert (c.world_size, c.nodes) == (16384, 2048)
    assert c.topology.connection(16383, 0).kind is LinkKind.IB
    assert elapsed < 5.0  # ~0.7 s measured on the 2-core dev VM under load; generous for CI


@pytest.mark.parametrize(("gpus", "match"), [
    (12, r"--gpus 12 for cluster dgx-a100-80gb is not a multiple of its 8 GPUs per node; use 8 or 16"),
    (GPUS_MAX + 8, r"over the largest world topomesh builds \(1,048,576 ranks\)"),
    (0, r"must be a positive whole number, got 0"),
])
def test_bad_gpu_counts(gpus, match):
    with pytest.raises(ClusterError, match=match):
        load_cluster("dgx-a100-80gb", gpus=gpus)


def test_unknown_preset():
    with pytest.raises(ClusterError, match=r"no GPU cluster preset named 'dgx-b300'; the presets are dgx-a100-80gb"):
        load_cluster("dgx-b300")


def test_links_of_tp_and_dp_on_dgx_a100():
    _, links = _links("dgx-a100-80gb", 32, tp=8, dp_replicate=4)
    tp, dp = links["tp"], links["dp_replicate"]
    assert (tp.kind, tp.nodes, tp.ranks_per_node, tp.bandwidth_GBps) == (LinkKind.NVSWITCH, 1, 8, 240.0)
    # one rank per node: 8 NICs x 25 GB/s shared by the node's 8 ranks -> one NIC each
    assert (dp.kind, dp.nodes, dp.ranks_per_node, dp.intra_kind) == (LinkKind.IB, 4, 1, LinkKind.LOC)
    assert dp.bandwidth_GBps == pytest.approx(25.0)


def test_rail_sharing_factor():
    c = load_cluster("dgx-a100-80gb", gpus=32)
    # tp=4 fastest: dp groups {0, 4, 8, ..., 28} put 2 members on each of 4 nodes
    dp = axis_link(c, place(c.topology, Layout(tp=4, dp_replicate=8)), "dp_replicate")
    assert (dp.nodes, dp.ranks_per_node, dp.intra_kind) == (4, 2, LinkKind.NVSWITCH)
    assert dp.bandwidth_GBps == pytest.approx(25.0 * 8 * 2 / 8)  # 50 GB/s: two NICs' worth
    # all 8 ranks of each node in the group: all 8 NICs, 200 GB/s (under the 240 GB/s NVSwitch)
    flat = axis_link(c, place(c.topology, Layout(tp=8, dp_replicate=4)), ("tp", "dp_replicate"))
    assert (flat.axis, flat.group_size, flat.nodes, flat.ranks_per_node) == ("tp+dp_replicate", 32, 4, 8)
    assert flat.bandwidth_GBps == pytest.approx(200.0)
    # H100: 8 x 50 GB/s = 400 GB/s of NICs, capped by the 370.8 GB/s NVLink the ring also crosses
    h = load_cluster("dgx-h100", gpus=32)
    hflat = axis_link(h, place(h.topology, Layout(tp=8, dp_shard=4)), "dp_shard+tp")
    assert hflat.bandwidth_GBps == pytest.approx(370.8)


def test_tp_beyond_a_node_crosses_ib():
    _, links = _links("dgx-h100", 32, tp=16, dp_replicate=2)
    assert (links["tp"].kind, links["tp"].nodes, links["tp"].ranks_per_node) == (LinkKind.IB, 2, 8)


def test_axis_link_is_fast_at_16k_ranks():
    c = load_cluster("dgx-h100", gpus=16384)
    p = place(c.topology, Layout(tp=8, pp=8, dp_shard=256))
    t0 = time.perf_counter()
    for _ in range(20):
        link = axis_link(c, p, "dp_shard")
    per_call = (time.perf_counter() - t0) / 20
    assert (link.nodes, link.ranks_per_node, link.bandwidth_GBps) == (256, 1, 50.0)
    assert per_call < 0.01  # ~0.3 ms on an idle core; 10 ms leaves room for a loaded CI machine


def test_dp_all_reduce_across_four_nodes():
    # DGX A100, dp=4 with one rank per node, 1 GiB all-reduce, profile nccl-dgx-a100 (IB terms):
    #   ring Simple: latency 8.4 + 6 steps x 14.0 = 92.4 us (2(n-1) = 6 steps, all on the network)
    #                bandwidth 25 GB/s rail x 0.96 = 24 GB/s; 2(n-1)/n = 1.5 -> 1.5 x 2^30 / 24e9 = 67.108864 ms
    #   ring LL: 22.8 us + 1.5 x 2^30 / 6e9 = 268 ms; tree Simple: 112 us + 2^30 / (24 x 0.92 x 0.5 GB/s) = 97 ms
    c, links = _links("dgx-a100-80gb", 32, tp=8, dp_replicate=4)
    ar = CollectiveRecord(kind=CollectiveKind.ALL_REDUCE, bytes=GiB, group_size=4)
    assert group_collective_time_s(ar, links["dp_replicate"], c.profile) == pytest.approx(0.0672012640, rel=1e-9)


def test_tp_all_reduce_inside_a_node():
    # tp=8 on NVSwitch, nccl-dgx-a100 (bus bandwidth capped at 235 GB/s by NCCL for sm80):
    #   Simple: 8.4 + 14 steps x 3.4 = 56.0 us + 1.75 x 2^30 / 235e9 = 7.995949753 ms -> 8.051949753 ms
    c, links = _links("dgx-a100-80gb", 8, tp=8)
    ar = CollectiveRecord(kind=CollectiveKind.ALL_REDUCE, bytes=GiB, group_size=8)
    assert group_collective_time_s(ar, links["tp"], c.profile) == pytest.approx(0.008051949753, rel=1e-9)


def test_all_gather_across_nodes_charges_intra_and_network_hops():
    # 32 ranks on 4 DGX A100 nodes, all-gather of 1 GiB (output):
    #   ring Simple: 31 steps, 3 on the network: 8.4 + 3 x 14.0 + 28 x 3.4 = 145.6 us
    #                bandwidth 200 GB/s (8 NICs) x 0.96 = 192 GB/s; 31/32 x 2^30 / 192e9 = 5.417642667 ms
    c = load_cluster("dgx-a100-80gb", gpus=32)
    link = axis_link(c, place(c.topology, Layout(tp=8, dp_replicate=4)), "tp+dp_replicate")
    ag = CollectiveRecord(kind=CollectiveKind.ALL_GATHER, bytes=GiB, group_size=32)
    assert group_collective_time_s(ag, link, c.profile) == pytest.approx(0.005563242667, rel=1e-9)


def test_tree_wins_small_all_reduce_over_many_nodes():
    # 1 MiB all-reduce over 256 H100 nodes, one rank each (rail 50 GB/s, NDR efficiency 0.95):
    #   ring Simple latency alone 8.4 + 510 x 14 us = 7.1 ms; ring LL 6.6 + 510 x 2.7 = 1.38 ms + 0.18 ms
    #   tree LL: 6.8 + 2 x (0 + log2(256) = 8 x 5.0) = 86.8 us; bandwidth 47.5 x 0.242105 x 0.5 GB/s
    c, links = _links("dgx-h100", 2048, tp=8, dp_replicate=256)
    ar = CollectiveRecord(kind=CollectiveKind.ALL_REDUCE, bytes=2**20, group_size=256)
    expected = 86.8e-6 + 2**20 / (47.5 * 0.242105 * 0.5 * 1e9)
    assert group_collective_time_s(ar, links["dp_replicate"], c.profile) == pytest.approx(expected, rel=1e-9)


def test_topology_file_with_named_device_and_repeated_node():
    with pytest.raises(ClusterError, match=r"names no GPU model to detect the device from; give --device NAME"):
        cluster_from_topology(str(SMI), gpus=16)
    c = cluster_from_topology(str(SMI), device="H100-SXM5-80GB", gpus=16)
    assert (c.world_size, c.nodes, c.gpus_per_node, c.profile.name) == (16, 2, 8, "nccl-dgx-h100")
    # 12 NICs on the host, but only the 8 PIX-attached to a GPU are rails
    assert int(c.rail_nics[0]) == 8
    links = axis_links(c, place(c.topology, Layout(tp=8, dp_replicate=2)))
    assert links["tp"].kind is LinkKind.NVSWITCH and links["tp"].bandwidth_GBps == pytest.approx(18 * 20.0)
    # the smi dump gives no NIC speed: NCCL's NET_BW default 12 GB/s, one NIC per rank
    assert links["dp_replicate"].kind is LinkKind.IB and links["dp_replicate"].bandwidth_GBps == pytest.approx(12.0)
    with pytest.raises(ClusterError, match=r"is not a multiple of its 8 GPUs per node"):
        cluster_from_topology(str(SMI), device="H100-SXM5-80GB", gpus=20)


def _write_profile(folder: Path, name: str, measured_at: str, host: str, **meta: object) -> None:
    raw = {
        "version": 1, "name": name, "backend": "gloo", "source": "topomesh calibrate", "cluster_fingerprint": name,
        "meta": {"hosts": [host], "world_size": 2, "measured_at": measured_at, **meta},
        "models": [{"collective": "all_reduce", "link": "SHM", "model": "alpha_beta", "select": "min",
                    "terms": [{"alpha_us": 50.0, "hop_us": 0.0, "busbw_GBps": 2.0, "bw_scale": 1.0,
                               "upto_bytes": None}]}],
    }
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(raw))


def test_local_needs_a_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(tmp_path))
    with pytest.raises(ClusterError, match=r"run `topomesh calibrate --local 2` first"):
        load_cluster("local")


def test_local_uses_the_newest_calibration_of_this_host(tmp_path, monkeypatch):
    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(tmp_path))
    cpu = device_spec("A100-SXM4-80GB")  # stands in for the measured CPU spec (measuring takes seconds)
    monkeypatch.setattr(cl, "cpu_spec", lambda directory=None: cpu)
    host = socket.gethostname()
    _write_profile(tmp_path / "collectives", "old", "2024-01-01T00:00:00Z", host)
    _write_profile(tmp_path / "collectives", "new", "2025-01-01T00:00:00Z", host)
    _write_profile(tmp_path / "collectives", "other", "2026-01-01T00:00:00Z", "not-" + host)
    c = load_cluster("local")
    assert (c.name, c.world_size, c.profile.name, c.device) == ("local", 2, "new", cpu)
    assert c.topology.connection(0, 1).kind is LinkKind.SHM
    # 2 ranks, all-reduce of 2 GB at 2 GB/s bus bandwidth: 50 us + 1.0 x 2e9 / 2e9 = 1.00005 s
    link = axis_link(c, place(c.topology, Layout(dp_replicate=2)), "dp_replicate")
    ar = CollectiveRecord(kind=CollectiveKind.ALL_REDUCE, bytes=2 * 10**9, group_size=2)
    assert group_collective_time_s(ar, link, c.profile) == pytest.approx(1.00005, rel=1e-9)
    assert load_cluster("local", gpus=4).world_size == 4


def test_local_profiles_come_only_from_a_private_directory(tmp_path, monkeypatch, capsys):
    # the simulator trusts a saved profile: one another user could write must not be read,
    # and `topomesh calibrate` must not create its folder open to others (it once did: 0755)
    from topomesh.cli.main import main
    from topomesh.cost.calibrate import default_profile_path

    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(tmp_path / "fresh"))
    path = default_profile_path("abc")
    assert path == tmp_path / "fresh" / "collectives" / "abc.json"
    assert [oct(p.stat().st_mode & 0o777) for p in (path.parent.parent, path.parent)] == ["0o700", "0o700"]

    shared = tmp_path / "shared"
    _write_profile(shared / "collectives", "new", "2025-01-01T00:00:00Z", socket.gethostname())
    shared.chmod(0o700)
    (shared / "collectives").chmod(0o775)
    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(shared))
    with pytest.raises(ClusterError, match=f"cache directory '{shared / 'collectives'}' has mode 0775"):
        load_cluster("local")
    started = time.monotonic()
    assert main(["calibrate", "--local", "2"]) == 2  # refused before any process starts
    assert time.monotonic() - started < 5
    assert "has mode 0775" in capsys.readouterr().err


@pytest.mark.timeout(20)
def test_local_profiles_are_read_bounded(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cl, "cpu_spec", lambda directory=None: device_spec("A100-SXM4-80GB"))
    _write_profile(tmp_path / "collectives", "good", "2025-01-01T00:00:00Z", socket.gethostname())
    os.mkfifo(tmp_path / "collectives" / "a-fifo.json")  # opening it for reading would wait for a writer
    (tmp_path / "collectives" / "to-zero.json").symlink_to("/dev/zero")  # reading it would never end
    assert load_cluster("local").profile.name == "good"


def test_local_takes_the_compute_stretch_measured_for_its_rank_count(tmp_path, monkeypatch):
    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cl, "cpu_spec", lambda directory=None: device_spec("A100-SXM4-80GB"))
    _write_profile(tmp_path / "collectives", "p", "2025-01-01T00:00:00Z", socket.gethostname(),
                   compute_stretch={"2": 1.07, "4": "fast", "8": 0.2})
    two, three, four, eight = (load_cluster("local", gpus=n) for n in (2, 3, 4, 8))
    # the measured stretch, never below the share of cores (two ranks of this test's threads)
    assert (two.compute_stretch, two.compute_share) == (1.07, max(1.07, two.core_share))
    # every measured count kept for a pipeline stage's ranks; the bad entries dropped
    assert two.compute_stretches == eight.compute_stretches == ((2, 1.07),)
    assert eight.lock_step_stretch(2) == max(1.07, eight.cores_share_at(2))
    cores = two.cores
    for c in (three, four, eight):  # not measured, not a number, below 1: the share of cores
        assert c.compute_stretch is None
        assert c.compute_share == c.core_share == max(1.0, c.world_size * c.threads_per_rank / cores)
    assert load_cluster("local", gpus=1).compute_stretch is None  # one rank waits for no one


@pytest.mark.parametrize("key, saved, taken, one_rank", [
    ("collective_in_step_s", {"0.008": 1.5e-3, "0.0005": 2e-4}, ((0.0005, 2e-4), (0.008, 1.5e-3)), ()),  # by compute
    ("collective_in_step_s", {"0.002": -1e-4, "0.008": 3.0, "slow": 1e-3, "2.0": 1e-3}, ((0.002, -1e-4),), ()),
    ("collective_in_step_s", 4.5e-4, (), ()), ("collective_in_step_s", None, (), ()),  # not the measured shape
    ("collective_cpu_share", {"2": 0.64}, 0.64, None), ("collective_cpu_share", {"2": 1.3}, None, None),
    ("collective_cpu_share", {"2": -0.1}, None, None), ("collective_cpu_share", "0.6", None, None),
    ("collective_cpu_share", None, None, None),
])
def test_local_takes_a_collective_figure_where_it_is_sane(tmp_path, monkeypatch, key, saved, taken, one_rank):
    # the in-step costs: 3 s, no gap and a 2 s gap dropped; the CPU share: a number in (0, 1]
    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cl, "cpu_spec", lambda directory=None: device_spec("A100-SXM4-80GB"))
    _write_profile(tmp_path / "collectives", "p", "2025-01-01T00:00:00Z", socket.gethostname(), **{key: saved})
    assert getattr(load_cluster("local", gpus=2), key) == taken
    assert getattr(load_cluster("local", gpus=1), key) == one_rank  # one rank issues no collective


def test_local_takes_the_functional_premium_where_it_is_sane(tmp_path, monkeypatch):
    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cl, "cpu_spec", lambda directory=None: device_spec("A100-SXM4-80GB"))
    _write_profile(tmp_path / "collectives", "p", "2025-01-01T00:00:00Z", socket.gethostname(),
                   functional_premium_s={"reduce_scatter/bfloat16/4096": 1e-4, "reduce_scatter/bfloat16/131072": 5e-4,
                                         "reduce_scatter/bf16/x": 1e-4, "gather/float32/8": 1e-4,
                                         "all_gather/float32/8": 5.0})  # no size, no collective, 5 s: dropped
    two = load_cluster("local", gpus=2)
    assert two.functional_premium_s == (("reduce_scatter", "bfloat16", 4096, 1e-4),
                                        ("reduce_scatter", "bfloat16", 131072, 5e-4))
    # half way in bytes, half way in seconds (by hand: 1e-4 + (5e-4 - 1e-4) / 2)
    assert two.functional_premium("reduce_scatter", "bfloat16", (4096 + 131072) // 2) == pytest.approx(3e-4)
    assert load_cluster("local", gpus=1).functional_premium_s == ()  # one rank issues no collective


def test_local_takes_a_whole_nodes_collectives_cost_only_for_as_many_ranks_as_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cl, "cpu_spec", lambda directory=None: device_spec("A100-SXM4-80GB"))
    _write_profile(tmp_path / "collectives", "p", "2025-01-01T00:00:00Z", socket.gethostname(), world_size=4,
                   collective_in_step_s={"0.008": 1e-3}, collective_in_step_node_s={"0.008": 4e-3, "x": 1.0})
    four, two, eight = (load_cluster("local", gpus=n) for n in (4, 2, 8))
    assert four.collective_in_step_node_s == ((0.008, 4e-3),)
    assert two.collective_in_step_node_s == eight.collective_in_step_node_s == ()  # measured on four
    assert two.collective_in_step_s == four.collective_in_step_s == ((0.008, 1e-3),)
    # a group of all four pays the four's; a pair of the four the pair's (past the last point,
    # whatever stretch the gap is read at on this machine)
    assert (four.in_step_extra_s(1.0, 4), four.in_step_extra_s(1.0, 2)) == (4e-3, 1e-3)
    assert eight.in_step_extra_s(1.0, 8) == 1e-3


@pytest.mark.parametrize("saved, single, multi, handoff", [
    ({"single": 1.4e-4, "multi": 2.3e-4, "handoff_wait": 2.5e-3}, 1.4e-4, 2.3e-4, 2.5e-3),
    ({"single": 1.4e-4, "multi": 2.3e-4, "handoff": 2.5e-3}, 1.4e-4, 2.3e-4, 0.0),  # the step's slope (ddb19bc): not read
    ({"single": 1.4e-4, "multi": 2.3e-4}, 1.4e-4, 2.3e-4, 0.0),  # a profile from before the hand-off
    ({"single": -1e-5, "multi": 0.5, "handoff_wait": -1e-3}, 0.0, 0.0, 0.0),  # negative, half a second: not a host cost
    ({"single": "fast"}, 0.0, 0.0, 0.0), (1e-4, 0.0, 0.0, 0.0), (None, 0.0, 0.0, 0.0),  # not the measured shape
])
def test_local_takes_the_pipeline_actions_host_work_where_it_is_sane(tmp_path, monkeypatch, saved, single, multi,
                                                                     handoff):
    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cl, "cpu_spec", lambda directory=None: device_spec("A100-SXM4-80GB"))
    _write_profile(tmp_path / "collectives", "p", "2025-01-01T00:00:00Z", socket.gethostname(),
                   pipeline_action_s=saved)
    got = load_cluster("local", gpus=2)
    assert (got.pipeline_action_s, got.pipeline_multi_action_s, got.pipeline_handoff_s) == (single, multi, handoff)


def test_axis_link_sees_a_last_group_that_crosses_hosts():
    # ranks 6, 7 on host 1 and 14, 15 on host 0: with rank-order placement and tp=4 the
    # first tp group [0..3] stays on host 0 but the last one [12..15] spans both hosts.
    host = cl.node_preset("dgx-h100").host("n")
    hosts = [host.renamed("n0"), host.renamed("n1")]
    on = [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]
    seen = [0, 0]
    ranks = []
    for r, h in enumerate(on):
        ranks.append(cl.RankInfo(rank=r, host=h, local_rank=seen[h], device=f"GPU{seen[h]}"))
        seen[h] += 1
    topo = cl.build_topology(hosts, ranks)
    c = cl.Cluster(name="odd", topology=topo, device=device_spec("H100-SXM5-80GB"),
                   profile=load_cluster("dgx-h100").profile, gpus_per_node=8, source="test")
    link = axis_link(c, place(topo, Layout(tp=4, dp_replicate=4), "rank-order"), "tp")
    assert (link.kind, link.nodes, link.ranks_per_node) == (LinkKind.IB, 2, 2)


def test_detect_device_refuses_gpus_it_cannot_all_name():
    def world(*names: str) -> cl.Topology:
        hosts = [cl.Host(hostname=f"h{i}", devices=(cl.Device(id="GPU0", kind=cl.DeviceKind.GPU, index=0, name=n),))
                 for i, n in enumerate(names)]
        return cl.build_topology(hosts, [cl.RankInfo(rank=i, host=i, local_rank=0, device="GPU0")
                                         for i in range(len(names))])

    assert cl.detect_device(world("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB")).name == "A100-SXM4-80GB"
    with pytest.raises(ClusterError, match=r"GPUs named NVIDIA A100-SXM4-80GB, Tesla X1, which map to no single"):
        cl.detect_device(world("NVIDIA A100-SXM4-80GB", "Tesla X1"))
    with pytest.raises(ClusterError, match=r"which map to no single shipped spec"):
        cl.detect_device(world("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"))
