"""Real `topomesh launch` agents on loopback: two nodes, restarts, elasticity, isolation."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path

import pytest

from tests.launch.conftest import Agents, free_port, wait_listening

pytestmark = pytest.mark.slow

TWO_NODES = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d"]


def _rdzv(port: int, run_id: str) -> list[str]:
    return [f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}"]


def test_two_nodes_different_hosts_get_identical_files_with_right_kinds(agents: Agents) -> None:
    port = free_port()
    expect = json.dumps({"same": {"dgx-h100-8gpu-8ib": "NVSwitch", "pcie-4gpu-2numa": "PIX"}, "cross": "NIC"})
    # each "node" writes into its own directory, as separate machines would
    dir_a, dir_b = agents.tmp / "topo-a", agents.tmp / "topo-b"
    common = [*TWO_NODES, *_rdzv(port, "two-hosts")]
    a = agents.start("a", [*common, f"--topology-dir={dir_a}"], sysfs="dgx-h100-8gpu-8ib", env={"CHECK_EXPECT": expect})
    b = agents.start("b", [*common, f"--topology-dir={dir_b}"], sysfs="pcie-4gpu-2numa", env={"CHECK_EXPECT": expect})
    assert agents.wait(a) == 0, agents.log(a)[-3000:]
    assert agents.wait(b) == 0, agents.log(b)[-3000:]

    reports = agents.reports()
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3]
    # every worker checked every pair's kind itself; here: one file content for all four
    assert len({r["bytes"] for r in reports}) == 1
    r0 = reports[0]
    assert sorted(set(r0["hostnames"])) == ["dgx-h100-8gpu-8ib", "pcie-4gpu-2numa"]
    # torchrun's order: ranks of one node are consecutive
    assert r0["hostnames"][0] == r0["hostnames"][1] and r0["hostnames"][2] == r0["hostnames"][3]
    assert {r["run_id"] for r in reports} == {"two-hosts"}
    assert {r["file_restart_count"] for r in reports} == {0}
    # the two nodes wrote byte-identical files under the same name, each in its own
    # private run directory
    files_a = sorted((dir_a / "two-hosts").iterdir())
    files_b = sorted((dir_b / "two-hosts").iterdir())
    assert [f.name for f in files_a] == [f.name for f in files_b] == [Path(r0["file"]).name]
    assert files_a[0].read_bytes() == files_b[0].read_bytes()
    for d, f in ((dir_a, files_a[0]), (dir_b, files_b[0])):
        assert stat.S_IMODE((d / "two-hosts").stat().st_mode) == 0o700
        assert stat.S_IMODE(f.stat().st_mode) == 0o600


def _copy_fixture(src: str, dst: Path, hostname: str) -> Path:
    """A fixture sysfs tree under another host name (symlinks kept as they are)."""
    import shutil

    from tests.launch.conftest import SYSFS

    shutil.copytree(SYSFS / src, dst, symlinks=True)
    (dst / "hostname").write_text(hostname + "\n")
    return dst


def test_restart_after_worker_failure_rebuilds_file(agents: Agents) -> None:
    """Rank 3 fails in round 0; with --max-restarts=1 the job completes in round 1.

    Both nodes are DGX hosts (IB rails). The failing node restarts (its own count 1), the
    other one re-forms because a node is waiting (its own count stays 0); the file of the
    new round records the job's count, 1, on both nodes, and gloo works over the new world.
    """
    port = free_port()
    b_root = _copy_fixture("dgx-h100-8gpu-8ib", agents.tmp / "sysfs-b", "dgx-b")
    expect = json.dumps({"same": {"dgx-h100-8gpu-8ib": "NVSwitch", "dgx-b": "NVSwitch"}, "cross": "IB"})
    common = [*TWO_NODES, *_rdzv(port, "restarts"), "--max-restarts=1"]
    env = {"CHECK_EXPECT": expect, "CHECK_FAIL_RANK": "3", "CHECK_GLOO": "1"}
    a = agents.start("a", common, sysfs="dgx-h100-8gpu-8ib", env=env)
    b = agents.start("b", common, sysfs=str(b_root), env=env)
    assert agents.wait(a) == 0, agents.log(a)[-3000:]
    assert agents.wait(b) == 0, agents.log(b)[-3000:]

    reports = agents.reports()
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3]  # only round-1 workers report
    assert {r["file_restart_count"] for r in reports} == {1}
    assert sorted({r["env_restart_count"] for r in reports}) in ([0, 1], [1])
    assert len({r["bytes"] for r in reports}) == 1
    assert {r["allreduce"] for r in reports} == {4.0}
    # round 0 and round 1 files both exist in the default per-user directory under $TMPDIR
    run_dir = agents.tmp / f"topomesh-{os.getuid()}" / "restarts"
    names = sorted(f.name for f in run_dir.iterdir())
    assert any(n.startswith("topology-r0-") for n in names) and any(n.startswith("topology-r1-") for n in names)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(run_dir.parent.stat().st_mode) == 0o700


def _wait_for(cond, timeout: float, what: str, agents: Agents, *procs) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"agent exited ({p.returncode}) while waiting for {what}:\n{agents.log(p)[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}:\n" + "\n".join(agents.log(p)[-2000:] for p in procs))


def test_elastic_scale_down_rebuilds_file_for_new_world(agents: Agents) -> None:
    """--nnodes=1:2: node b is killed (agent and workers) while a 4-rank world trains;
    node a's collectives fail, it re-forms alone and its new file has WORLD_SIZE 2."""
    port = free_port()
    conf = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=60"
    common = ["--nnodes=1:2", "--nproc-per-node=2", "--rdzv-backend=c10d", *_rdzv(port, "elastic"),
              "--max-restarts=2", f"--topology-dir={agents.tmp / 'topo'}"]
    env = {"CHECK_HOLD": "1"}
    a = agents.start("a", [*common, f"--rdzv-conf=is_host=1,{conf}"], sysfs="dgx-h100-8gpu-8ib", env=env)
    wait_listening(port)
    b = agents.start("b", [*common, f"--rdzv-conf=is_host=0,{conf}"], sysfs="pcie-4gpu-2numa", env=env)

    def reports(world: int) -> list[dict]:
        return [r for r in agents.reports() if r["world_size"] == world]

    # ">=": rounds can repeat (see below), and polling may miss the moment a count is exact
    _wait_for(lambda: len(reports(4)) >= 4, 60, "the 4-rank round", agents, a, b)
    round4 = max(r["file_restart_count"] for r in reports(4))
    four = [r for r in reports(4) if r["file_restart_count"] == round4]
    assert len({r["bytes"] for r in four}) == 1
    victims = agents.worker_pids(b.pid)
    assert len(victims) >= 2
    agents.kill(b)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)

    def survivors() -> list[dict]:
        return [r for r in reports(2) if r["file_restart_count"] > round4]

    _wait_for(lambda: len(survivors()) >= 2, 60, "the re-formed 2-rank round", agents, a)
    (agents.out / "release").touch()
    assert agents.wait(a) == 0, agents.log(a)[-3000:]
    # The survivor may re-form more than once (torchrun's c10d handler can open another
    # round while the dead node's keep-alive expires). Every 2-rank round is checked; the
    # last one, which the job finished in, must be whole.
    rounds: dict[int, list[dict]] = {}
    for r in survivors():
        rounds.setdefault(r["file_restart_count"], []).append(r)
    assert sorted(r["rank"] for r in rounds[max(rounds)]) == [0, 1]
    for count, after in rounds.items():
        assert len({r["rank"] for r in after}) == len(after) and {r["rank"] for r in after} <= {0, 1}, count
        assert len({r["bytes"] for r in after}) == 1, count
        assert all(set(r["hostnames"]) == {"dgx-h100-8gpu-8ib"} for r in after), count
        assert after[0]["kinds"]["0,1"] == "NVSwitch"
        assert after[0]["file"] != four[0]["file"]


def test_static_rendezvous_with_restart(agents: Agents) -> None:
    """The static backend's store is not scoped to a round: keys carry the agent's round.

    Every worker fails in round 0 (with static rendezvous a node restarts only when its
    own workers fail); round 1's file must come from round 1's entries: restart count 1.
    """
    port = free_port()
    common = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=static", "--master-addr=127.0.0.1",
              f"--master-port={port}", "--max-restarts=1", f"--topology-dir={agents.tmp / 't'}"]
    env = {"CHECK_FAIL_RANK": "all"}
    a = agents.start("a", [*common, "--node-rank=0"], sysfs="nvlink-bridge-2gpu", env=env)
    b = agents.start("b", [*common, "--node-rank=1"], sysfs="cpu-only", env=env)
    assert agents.wait(a) == 0, agents.log(a)[-3000:]
    assert agents.wait(b) == 0, agents.log(b)[-3000:]
    reports = agents.reports()
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert {r["file_restart_count"] for r in reports} == {1}
    assert len({r["bytes"] for r in reports}) == 1
    assert reports[0]["hostnames"] == ["nvlink-bridge-2gpu", "cpu-only"]  # node rank order


def test_checkpoint_replica_example_copies_shards_to_the_other_host(agents: Agents) -> None:
    """examples/checkpoint_replicas.py on two nodes × 2 workers: each shard's copy lands on the
    other host, on the same local rank, and arrives intact."""
    port = free_port()
    example = Path(__file__).resolve().parents[2] / "examples" / "checkpoint_replicas.py"
    out = agents.tmp / "replicas"
    script = [str(example), "--copies", "1", "--numel", "1024", "--out", str(out)]
    common = [*TWO_NODES, *_rdzv(port, "replicas"), f"--topology-dir={agents.tmp / 't'}"]
    a = agents.start("a", common, sysfs="dgx-h100-8gpu-8ib", script=script)
    b = agents.start("b", common, sysfs="pcie-4gpu-2numa", script=script)
    assert agents.wait(a) == 0, agents.log(a)[-3000:]
    assert agents.wait(b) == 0, agents.log(b)[-3000:]
    reports = {r["rank"]: r for r in (json.loads(f.read_text()) for f in out.glob("replicas-rank*.json"))}
    assert sorted(reports) == [0, 1, 2, 3]
    assert {r: rep["peers"] for r, rep in reports.items()} == {0: [2], 1: [3], 2: [0], 3: [1]}
    assert all(rep["peer_hosts"] != [rep["host"]] for rep in reports.values())
    assert all(rep["received_from"] == rep["peers"] and not rep["corrupt_from"] for rep in reports.values())
    assert "rank 0 (dgx-h100-8gpu-8ib): copies on 2 (pcie-4gpu-2numa, NIC)" in agents.log(a)


def test_node_lost_inside_the_exchange_is_a_membership_change(agents: Agents) -> None:
    """--nnodes=1:2 --max-restarts=0: node b dies after the rendezvous, before publishing its
    topology. Node a re-forms the rendezvous alone and finishes, as torchrun's survivor does,
    without spending a restart (there are none) and long before a failure would surface."""
    port = free_port()
    # last call 5 s: long enough for b to join a's first round (agents start in seconds here)
    conf = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=60"
    common = ["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d", *_rdzv(port, "lost"),
              "--max-restarts=0", "--topology-timeout=3", f"--topology-dir={agents.tmp / 'topo'}"]
    a = agents.start("a", [*common, f"--rdzv-conf=is_host=1,{conf}"], sysfs="dgx-h100-8gpu-8ib")
    b = agents.start("b", [*common, f"--rdzv-conf=is_host=0,{conf}"], sysfs="pcie-4gpu-2numa",
                     env={"TOPOMESH_TEST_HOLD_EXCHANGE_S": "120"})
    _wait_for(lambda: "holding the exchange" in agents.log(b), 60, "node b inside the exchange", agents, a, b)
    agents.kill(b)
    assert agents.wait(a, timeout=60) == 0, agents.log(a)[-3000:]
    reports = agents.reports()
    assert [(r["rank"], r["world_size"], r["hostnames"]) for r in reports] == [(0, 1, ["dgx-h100-8gpu-8ib"])]
    assert "re-forming the rendezvous without it (1 of 3)" in agents.log(a)
