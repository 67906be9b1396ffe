"""DeviceMesh and process groups from a placed layout: 4 gloo processes on CPU."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from topomesh.layout.api import mesh_from_topology, place_layout
from topomesh.layout.dims import Layout
from topomesh.layout.groups import axis_groups, flatten, hsdp_mesh, replica_groups
from topomesh.layout.place import Strategy, axis_report, place
from topomesh.layout.replicas import ReplicaGrouping
from topomesh.topology.api import ENV_VAR, save_topology
from topomesh.topology.model import LinkKind

from .topos import interleaved, islands_host

WORLD = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_host_interleaved() -> object:
    """2 hosts × 2 NVLinked GPUs with IB between, rank r on host r % 2 (not host-contiguous).

    The processes run on CPU with gloo; the mesh only depends on the rank numbers.
    """
    return interleaved([islands_host(f"n{i}", island=2, gpus=2) for i in range(2)], per_host=2)


def _worker(rank: int, port: int, topo_file: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    os.environ[ENV_VAR] = topo_file
    torch.set_num_threads(1)
    try:
        mesh = mesh_from_topology({"tp": 2, "pp": 2}, device_type="cpu")
        result: dict[str, object] = {"dims": list(mesh.mesh_dim_names), "mesh": mesh.mesh.tolist()}
        for axis, pg in axis_groups(mesh).items():
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=pg)
            result[axis.value] = {"ranks": dist.get_process_group_ranks(pg), "sum": t.item()}
        flat = flatten(mesh, ["pp", "tp"], "pp_tp")
        result["flat"] = dist.get_process_group_ranks(flat.get_group())
        grouping = ReplicaGrouping(num_replicas=WORLD, group_size=2, stride=2)
        mine, _ = replica_groups(grouping, replica_ranks=[3, 2, 1, 0])
        result["replica"] = dist.get_process_group_ranks(mine)
        hs = hsdp_mesh(ReplicaGrouping(num_replicas=WORLD, group_size=2), "cpu")
        result["hsdp"] = {n: dist.get_process_group_ranks(hs.get_group(n)) for n in hs.mesh_dim_names}
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_mesh_groups_follow_the_topology(tmp_path: Path) -> None:
    topo = _two_host_interleaved()
    topo_file = save_topology(topo, tmp_path / "world.json")
    placement = place_layout(Layout(tp=2, pp=2), topology=topo, world_size=WORLD)
    assert placement.groups("tp") == [[0, 2], [1, 3]]  # one host each; rank order would give [0, 1]
    links = {r.axis.value: r.kind for r in axis_report(topo, placement)}
    naive = {r.axis.value: r.kind for r in axis_report(topo, place(topo, Layout(tp=2, pp=2), Strategy.RANK_ORDER))}
    assert links == {"tp": LinkKind.NVLINK, "pp": LinkKind.IB}
    assert naive == {"tp": LinkKind.IB, "pp": LinkKind.NVLINK}
    mp.spawn(_worker, args=(_free_port(), str(topo_file), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got["dims"] == ["pp", "tp"]
        assert got["mesh"] == placement.mesh().tolist() == [[0, 2], [1, 3]]
        tp = next(g for g in placement.groups("tp") if rank in g)
        pp = next(g for g in placement.groups("pp") if rank in g)
        assert got["tp"] == {"ranks": tp, "sum": float(sum(tp))}
        assert got["pp"] == {"ranks": pp, "sum": float(sum(pp))}
        assert sorted(got["flat"]) == [0, 1, 2, 3]
        # replicas 0..3 on ranks 3, 2, 1, 0; groups {0, 2} and {1, 3} of replicas
        assert sorted(got["replica"]) == ([1, 3] if rank in (1, 3) else [0, 2])
        assert got["hsdp"]["dp_shard"] == ([0, 1] if rank < 2 else [2, 3])
        assert got["hsdp"]["dp_replicate"] == [rank % 2, rank % 2 + 2]
