"""NUMA-aware workers (``--numa-binding``) from the discovered topology.

Fixture ``pcie-4gpu-2numa``: GPU0, GPU1 and NIC0 on NUMA node 0 (CPUs 0-15,32-47), GPU2,
GPU3 on node 1 (CPUs 16-31,48-63) — read from its sysfs tree by hand.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.launch.conftest import SYSFS, Agents
from topomesh.errors import TopologyError
from topomesh.launch.numa import Binding, BindMode, cpulist, plan, usable_cpus
from topomesh.topology.discover import discover_host, read_numa_nodes
from topomesh.topology.model import Device, DeviceKind, Host

WORKER = Path(__file__).resolve().parent / "env_worker.py"
NODE0 = tuple(range(0, 16)) + tuple(range(32, 48))
NODE1 = tuple(range(16, 32)) + tuple(range(48, 64))
ALL = set(range(64))  # as if this machine were the fixture's


def _fixture() -> tuple[Host, dict[int, tuple[int, ...]]]:
    root = str(SYSFS / "pcie-4gpu-2numa")
    return discover_host(sysfs_root=root, use_nvml=False), read_numa_nodes(root)


def test_gpu_workers_bind_to_their_gpus_node() -> None:
    host, numa = _fixture()
    got = plan(host, ["GPU0", "GPU1", "GPU2", "GPU3"], numa, "node", ALL)
    assert got == [Binding(numa_node=0, cpus=NODE0)] * 2 + [Binding(numa_node=1, cpus=NODE1)] * 2
    # CUDA_VISIBLE_DEVICES=2,3 gave local ranks 0, 1 GPU2, GPU3: both on node 1
    assert [b.numa_node for b in plan(host, ["GPU2", "GPU3"], numa, "node", ALL)] == [1, 1]


def test_exclusive_splits_a_node_among_its_workers() -> None:
    host, numa = _fixture()
    got = plan(host, ["GPU0", "GPU1", "GPU2", "GPU3"], numa, BindMode.EXCLUSIVE, ALL)
    assert [b.cpus for b in got] == [tuple(range(0, 16)), tuple(range(32, 48)), tuple(range(16, 32)),
                                     tuple(range(48, 64))]
    # one worker on node 0 keeps all of it; node 1's two split it in local-rank order
    got = plan(host, ["GPU0", "GPU2", "GPU3"], numa, BindMode.EXCLUSIVE, ALL)
    assert [b.cpus for b in got] == [NODE0, tuple(range(16, 32)), tuple(range(48, 64))]


def test_workers_without_a_gpu_take_their_nics_node() -> None:
    host, numa = _fixture()
    got = plan(host, ["GPU2", None], numa, "node", ALL)
    assert got == [Binding(numa_node=1, cpus=NODE1), Binding(numa_node=0, cpus=NODE0)]  # NIC0 is on node 0


def test_cpu_only_workers_spread_over_nodes() -> None:
    host = Host(hostname="c", devices=tuple(Device(id=f"CPU{n}", kind=DeviceKind.CPU, index=n, numa_node=n)
                                            for n in range(2)))
    numa = {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}
    got = plan(host, ["CPU0", "CPU0", "CPU0", "CPU0"], numa, "exclusive", set(range(8)))
    assert got == [Binding(numa_node=0, cpus=(0, 1)), Binding(numa_node=0, cpus=(2, 3)),
                   Binding(numa_node=1, cpus=(4, 5)), Binding(numa_node=1, cpus=(6, 7))]
    # more workers than a node's CPUs (five a node; node 1 may use CPUs 4 and 5): one each, in turn
    got = plan(host, ["CPU0"] * 10, numa, "exclusive", {0, 1, 2, 3, 4, 5})
    assert [b.cpus for b in got if b.numa_node == 1] == [(4,), (5,), (4,), (5,), (4,)]
    assert [b.cpus for b in got if b.numa_node == 0] == [(0,), (1,), (2,), (3,), (0,)]


def test_cpus_the_process_may_use() -> None:
    # a cgroup that allows only some CPUs of each node: the intersection
    assert usable_cpus({0: NODE0, 1: NODE1}, {1, 2, 17, 40}) == {0: (1, 2, 40), 1: (17,)}
    # a topology of CPUs this machine does not have (a fixture on 2 CPUs): split in order
    assert usable_cpus({0: NODE0, 1: NODE1}, {0, 1}) == {0: (0,), 1: (1,)}
    assert usable_cpus({0: NODE0, 1: NODE1}, {5}) == {0: (5,), 1: (5,)}


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to tell the nodes apart")
def test_workers_report_the_cpus_of_their_node(agents: Agents) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    # the fixture's CPUs are not this machine's: its CPUs are split among the 2 nodes in order
    half = len(allowed) // 2
    node0, node1 = allowed[:half], allowed[half:]
    args = ["--standalone", "--nproc-per-node=4", "--numa-binding=node", f"--topology-dir={agents.tmp / 't'}"]
    a = agents.start("a", args, sysfs="pcie-4gpu-2numa", script=[str(WORKER)])
    assert agents.wait(a) == 0, agents.log(a)[-3000:]
    got = {r["rank"]: r["cpus"] for r in agents.reports()}
    assert got == {0: node0, 1: node0, 2: node1, 3: node1}  # read back with os.sched_getaffinity
    # the file records each rank's NUMA node and CPU list (through its host and local rank)
    lists = {0: cpulist(node0), 1: cpulist(node0), 2: cpulist(node1), 3: cpulist(node1)}
    assert {r["rank"]: r["binding"] for r in agents.reports()} == {
        k: [0 if k < 2 else 1, lists[k]] for k in range(4)}
    # without --numa-binding nothing is bound
    for f in agents.out.glob("rank*.json"):
        f.unlink()
    b = agents.start("b", args[:2] + args[3:], sysfs="pcie-4gpu-2numa", script=[str(WORKER)])
    assert agents.wait(b) == 0, agents.log(b)[-3000:]
    assert {tuple(r["cpus"]) for r in agents.reports()} == {tuple(allowed)}
    assert {r["binding"] for r in agents.reports()} == {None}


def test_bindings_round_trip_in_the_host_record() -> None:
    h = Host(hostname="n", numa_bindings=((0, 0, "0-15,32-47"), (1, 1, "16-31")))
    assert h.to_dict()["numa_bindings"] == [{"local_rank": 0, "numa_node": 0, "cpus": "0-15,32-47"},
                                            {"local_rank": 1, "numa_node": 1, "cpus": "16-31"}]
    assert Host.from_dict(h.to_dict()) == h and h.numa_binding(1) == (1, "16-31") and h.numa_binding(2) is None
    assert "numa_bindings" not in Host(hostname="n").to_dict()  # unchanged files when nothing is bound
    bad = {"hostname": "n", "numa_bindings": [{"local_rank": 0, "numa_node": 0, "cpus": "0-3;rm"}]}
    with pytest.raises(TopologyError, match="cpus must be a CPU list like '0-3,8', got '0-3;rm'"):
        Host.from_dict(bad)


def test_binding_without_cuda_and_without_the_topology_is_refused_before_any_worker(monkeypatch) -> None:
    from topomesh.errors import LaunchError
    from topomesh.launch import cli

    monkeypatch.setattr(cli, "_cuda", lambda: False)
    started = []
    monkeypatch.setattr("torch.distributed.run.run", lambda args: started.append(args))
    with pytest.raises(LaunchError, match="--numa-binding exclusive without CUDA .* not --topology off"):
        cli.main(["--standalone", "--nproc-per-node=2", "--numa-binding=exclusive", "--topology", "off", "x.py"])
    assert started == []
    cli.main(["--standalone", "--nproc-per-node=2", "--topology", "off", "x.py"])  # no binding asked: torchrun runs
    assert len(started) == 1
