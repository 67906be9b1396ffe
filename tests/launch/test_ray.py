"""Ray Train: TorchTrainer workers get WORLD_TOPOLOGY_FILE built the launcher's way."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray.train.torch")

from tests.launch.conftest import SYSFS  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def _train_loop(config: dict) -> None:
    import torch
    import torch.distributed as dist

    from topomesh.topology.api import load_topology

    topo = load_topology()
    rank, world = dist.get_rank(), dist.get_world_size()
    assert topo.world_size == world
    assert topo.connection(0, 1).kind.value == "NVSwitch"  # dgx fixture, local ranks 0 and 1
    t = torch.ones(1)
    dist.all_reduce(t)
    out = Path(config["out"]) / f"rank{rank}.json"
    out.write_text(json.dumps({
        "file": os.environ["WORLD_TOPOLOGY_FILE"],
        "bytes": Path(os.environ["WORLD_TOPOLOGY_FILE"]).read_text(),
        "world": world, "sum": t.item(), "run_id": topo.run_id,
        "hosts": [topo.host_of(r).hostname for r in range(world)],
        "ifname": {k: os.environ.get(k) for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")},
        "host_ifname": topo.host_of(rank).socket_ifname,
        "node_ip": __import__("ray").util.get_node_ip_address(),
    }))


@pytest.mark.timeout(600)  # Ray start-up on starved cores can pass the suite's 300 s default
def test_torch_trainer_workers_read_the_topology(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from topomesh.ray import TopologyTorchConfig

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("TOPOMESH_SYSFS_ROOT", str(SYSFS / "dgx-h100-8gpu-8ib"))
    monkeypatch.setenv("RAY_TRAIN_V2_ENABLED", "1")
    out = tmp_path / "out"
    out.mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="tmray", dir="/tmp")  # AF_UNIX paths must stay short
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=ray_tmp, runtime_env={"env_vars": {"TOPOMESH_SYSFS_ROOT": str(SYSFS / "dgx-h100-8gpu-8ib")}})
    try:
        trainer = TorchTrainer(
            _train_loop,
            train_loop_config={"out": str(out)},
            torch_config=TopologyTorchConfig(topology_dir=str(tmp_path / "topo"), run_id="ray-test"),
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(storage_path=str(tmp_path / "results"), name="t"),
        )
        trainer.fit()
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    reports = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    assert len(reports) == 2
    assert {r["sum"] for r in reports} == {2.0}
    assert len({r["bytes"] for r in reports}) == 1 and len({r["file"] for r in reports}) == 1
    assert reports[0]["run_id"] == "ray-test"
    assert reports[0]["hosts"] == ["dgx-h100-8gpu-8ib"] * 2  # one node, discovered once
    assert Path(reports[0]["file"]).parent == tmp_path / "topo" / "ray-test"
    # the interface that holds the address rank 0's node is reached at, for both libraries
    from topomesh.launch.ifname import _ipv4_of

    name = reports[0]["host_ifname"]
    assert _ipv4_of(name) == reports[0]["node_ip"]
    assert [r["ifname"] for r in reports] == [{"NCCL_SOCKET_IFNAME": name, "GLOO_SOCKET_IFNAME": name}] * 2
