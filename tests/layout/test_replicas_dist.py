"""Replica-grouped variables across real processes: ``topomesh launch`` agents on loopback
are PopXL's instances and their workers the local replicas (gloo).

Each replica adds ``100 · replica`` to what it holds before the data goes back to the host,
so every expected value below is worked out by hand from the host data, the grouping and
the sharding rule (member k of a group holds shard ``k % shard_over``; a shard is the k-th
equal piece of the flattened value, zero-padded at the end).

The guide's complex example has 16 replicas over 8 instances (24 processes with the agents);
on this 2-core machine the test runs the same shape scaled to 8 replicas over 4 instances
(group_size 4, stride 2, shard_over 2: still group_size = shard_over², stride > 1, every
group spanning all instances). The full 16-replica run is ``examples/replica_weights.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launch.conftest import Agents, free_port

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parent / "replicas_worker.py"


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Agents]:
    a = Agents(tmp_path)
    try:
        yield a
    finally:
        a.close()


def _launch(agents: Agents, nnodes: int, nproc: int, scenarios: list[str]) -> list[dict]:
    port = free_port()
    args = [f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=replicas"]
    procs = [agents.start(f"i{i}", args, env={"CHECK_SCENARIOS": ",".join(scenarios)}, script=[str(WORKER)])
             for i in range(nnodes)]
    for p in procs:
        assert agents.wait(p, timeout=240) == 0, agents.log(p)[-3000:]
    reports = agents.reports()
    assert [r["rank"] for r in reports] == list(range(nnodes * nproc))
    for r in reports:
        # the launcher's node is the instance, its local rank the local replica
        assert (r["instance_of"], r["local_index"]) == (r["group_rank"], r["local_rank"])
        assert r["same_again"] and r["member_groups_again"] == r["member_groups"], r  # groups are cached
    return reports


def _results(reports: list[dict], name: str) -> dict[int, dict]:
    return {r["rank"]: r["results"][name] for r in reports if r["results"][name] is not None}


def test_guide_two_instances_two_replicas(agents: Agents) -> None:
    reports = _launch(agents, 2, 1, ["guide_simple", "guide_rts_simple"])
    # group_size 1: replica r gets host[r], returns host[r] + 100 r; one group per replica
    simple = _results(reports, "guide_simple")
    assert [simple[r]["from_host"] for r in (0, 1)] == [[1, 2], [3, 4]]
    for r in (0, 1):
        assert simple[r]["one_per_group"] == simple[r]["all_replicas"] == [[1, 2], [103, 104]]
        assert "must have shape (2, 2); got shape (3, 2)" in simple[r]["wrong_host_error"]
    # one group of 2 sharded over both: [1, 2, 3] -> shards [1, 2], [3, 0 (padding)]
    rts = _results(reports, "guide_rts_simple")
    assert [rts[r]["from_host"] for r in (0, 1)] == [[1, 2], [3, 0]]
    for r in (0, 1):
        # replica 1's shard + 100 = [103, 100]; padding dropped; one group -> the value's shape
        assert rts[r]["one_per_group"] == [1, 2, 103]
        assert rts[r]["all_replicas"] == [[1, 2, 103], [1, 2, 103]]
        assert "must have shape (3,); got shape (3, 3)" in rts[r]["wrong_host_error"]


def test_four_instances_two_local_replicas(agents: Agents) -> None:
    names = ["complex_scaled", "one_group_of_8", "reversed_ranks", "even_ranks_only"]
    reports = _launch(agents, 4, 2, names)

    # groups [0 2 4 6] [1 3 5 7]; gather groups [0 2] [4 6] [1 3] [5 7]; values of 5 -> shards of 3
    cx = _results(reports, "complex_scaled")
    g0 = [[0, 1, 2], [3, 4, 0]]
    g1 = [[10, 11, 12], [13, 14, 0]]
    assert [cx[r]["from_host"] for r in range(8)] == [g0[0], g1[0], g0[1], g1[1]] * 2
    r02, r46 = [0, 1, 2, 203, 204], [400, 401, 402, 603, 604]
    r13, r57 = [110, 111, 112, 313, 314], [510, 511, 512, 713, 714]
    for r in range(8):
        assert cx[r]["one_per_group"] == [r02, r13]  # first replicas 0 and 1
        assert cx[r]["all_replicas"] == [r02, r13, r02, r13, r46, r57, r46, r57]

    # one group of 8, shard_over 2: [1, 2, 3] -> [1, 2], [3, 0]; gather groups [0 1] [2 3] ...
    og = _results(reports, "one_group_of_8")
    assert [og[r]["from_host"] for r in range(8)] == [[1, 2], [3, 0]] * 4
    for r in range(8):
        assert og[r]["one_per_group"] == [1, 2, 103]
        assert og[r]["all_replicas"] == [[1, 2, 103]] * 2 + [[201, 202, 303]] * 2 + [[401, 402, 503]] * 2 + [
            [601, 602, 703]] * 2

    # replica r on rank 7 - r; groups of 2 consecutive replicas
    rv = _results(reports, "reversed_ranks")
    assert [rv[7 - q]["from_host"] for q in range(8)] == [[0, 1], [0, 1], [10, 11], [10, 11], [20, 21], [20, 21],
                                                         [30, 31], [30, 31]]
    for r in range(8):
        assert rv[r]["one_per_group"] == [[0, 1], [210, 211], [420, 421], [630, 631]]
        assert rv[r]["all_replicas"] == [[0, 1], [100, 101], [210, 211], [310, 311], [420, 421], [520, 521],
                                         [630, 631], [730, 731]]
        assert "must have shape (4, 2); got shape (3, 2)" in rv[r]["wrong_host_error"]

    # the even ranks alone (odd ones never call): 0-d values 5..8, replica q on rank 2q
    ev = _results(reports, "even_ranks_only")
    assert sorted(ev) == [0, 2, 4, 6]
    assert [ev[2 * q]["from_host"] for q in range(4)] == [5, 6, 7, 8]
    for r in ev:
        assert ev[r]["one_per_group"] == ev[r]["all_replicas"] == [5, 106, 207, 308]
