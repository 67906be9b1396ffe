"""mesh_from_plan: the plan's mesh, refused for another world or topology; and plan → launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from topomesh.errors import LayoutError
from topomesh.layout.api import plan_placement, read_plan
from topomesh.topology.build import build_topology, default_placement
from topomesh.topology.model import Host

HERE = Path(__file__).resolve().parent


def _plan(world: int = 4, hosts: int = 1) -> dict:
    # tp=2 fastest then pp=2; the planner placed logical ranks on (0, 2, 1, 3)
    layout = {"degrees": {"tp": 2, "pp": 2, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "ep": 1},
              "order": "tp-pp-dp_shard-dp_replicate-cp-ep"}
    entry = {"world_size": world, "layout": layout, "mesh": [[0, 2], [1, 3]], "mesh_dim_names": ["pp", "tp"],
             "feasible": True}
    return {"format": "topomesh-plan", "version": 1, "layouts": [entry], "best": entry,
            "inputs": {"cluster_name": "test", "world_size": world, "hosts": hosts, "ranks_per_host": [world // hosts]}}


def _topology(hosts: int, per_host: int):
    hs = [Host(hostname=f"h{i}") for i in range(hosts)]
    return build_topology(hs, default_placement(hs, [per_host] * hosts), source="test topology")


def test_placement_is_the_plans_mesh() -> None:
    p = plan_placement(_plan(), 4, topology=_topology(1, 4))
    assert p.mesh().tolist() == [[0, 2], [1, 3]]
    assert p.groups("tp") == [[0, 2], [1, 3]] and p.groups("pp") == [[0, 1], [2, 3]]


def test_refuses_another_world_naming_both() -> None:
    with pytest.raises(LayoutError, match=r"plan.json was scored for 4 ranks \(test, 4 ranks\) but this job has 8 ranks"):
        plan_placement(_plan(), 8, source="plan.json")


def test_refuses_another_topology_naming_both() -> None:
    with pytest.raises(LayoutError, match=r"scored on 1 host\(s\) with \[4\] ranks each .* this job's topology "
                                          r"\(test topology\) has 2 host\(s\) with \[2\]"):
        plan_placement(_plan(), 4, topology=_topology(2, 2))


def test_refuses_a_mesh_that_does_not_match_its_degrees() -> None:
    plan = _plan()
    plan["layouts"][0]["mesh"] = [[0, 2, 1, 3]]
    with pytest.raises(LayoutError, match=r"mesh \[1, 4\] over \['pp', 'tp'\] does not match"):
        plan_placement(plan, 4)
    plan["layouts"][0]["mesh"] = [[0, 0], [1, 3]]
    with pytest.raises(LayoutError, match="not a permutation"):
        plan_placement(plan, 4)


def test_read_plan_refuses_other_files(tmp_path: Path) -> None:
    f = tmp_path / "x.json"
    f.write_text(json.dumps({"format": "something", "version": 1}))
    with pytest.raises(LayoutError, match="not a version 1 topomesh plan file"):
        read_plan(f)


@pytest.mark.slow
def test_plan_then_launch_builds_the_planned_mesh(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "WORLD_TOPOLOGY", "TOPOMESH_PLAN"))}
    env.update(TOPOMESH_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1", TMPDIR=str(tmp_path),
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    topo, plan, out = tmp_path / "topo.json", tmp_path / "plan.json", tmp_path / "out"
    out.mkdir()
    run = lambda *a: subprocess.run([sys.executable, "-m", "topomesh", *a], env=env, capture_output=True,  # noqa: E731
                                    text=True, timeout=240)
    r = run("discover", "--nproc", "2", "-o", str(topo))
    assert r.returncode == 0, r.stderr
    r = run("plan", "--model", "tiny-llama", "--topology", str(topo), "--device", "cpu",
            "--strategies", "tp,dp_shard", "-o", str(plan))
    assert r.returncode == 0, r.stderr
    best = json.loads(plan.read_text())["best"]
    assert best is not None and best["world_size"] == 2
    r = subprocess.run([sys.executable, "-m", "topomesh", "launch", "--standalone", "--nproc-per-node", "2",
                        "--log-dir", str(tmp_path / "logs"), "--plan", str(plan), str(HERE / "plan_worker.py"), str(out)],
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in range(2):
        got = json.loads((out / f"rank{rank}.json").read_text())
        assert got["plan"] == str(plan.resolve())
        assert got["mesh"] == best["mesh"] and got["names"] == best["mesh_dim_names"]
        assert set(got["sums"].values()) == {2.0}  # each dim of size 2 all-reduces over both ranks


def test_launch_refuses_a_bad_plan_before_starting(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    r = subprocess.run([sys.executable, "-m", "topomesh", "launch", "--standalone", "--nproc-per-node", "1",
                        "--plan", str(bad), "x.py"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not a version 1 topomesh plan file" in r.stderr
