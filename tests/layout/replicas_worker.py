"""Worker for the replica-grouped variable tests, run by ``topomesh launch`` agents.

Every rank runs the scenarios named in ``$CHECK_SCENARIOS`` (comma-separated) that it takes
part in: host data in (:func:`weights_from_host`), its replica adds ``100 · replica`` to what
it holds (value or shard), host data out (:func:`weights_to_host`, both retrieval modes).
Writes ``$CHECK_OUT/rank<RANK>.json``: the instance view from the launcher's environment
and, per scenario, the three results as nested lists. The test holds the expected values.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from topomesh.errors import LayoutError
from topomesh.layout.replicas import Instances, ReplicaGrouping, weights_from_host, weights_to_host

# name -> (grouping, shard_over, host data, whole-value shape, ranks of the replicas)
SCENARIOS = {
    # PopXL guide: 2 instances, 2 replicas, ReplicaGrouping(group_size=1)
    "guide_simple": (ReplicaGrouping(num_replicas=2, group_size=1), None, [[1, 2], [3, 4]], (2,), None),
    # PopXL guide: the same world, one group of both, default sharding over the group; 3 elements
    "guide_rts_simple": (ReplicaGrouping(num_replicas=2, group_size=2), 2, [1, 2, 3], (3,), None),
    # the guide's complex example scaled down: 8 replicas, group_size 4, stride 2, shard_over 2
    "complex_scaled": (
        ReplicaGrouping(num_replicas=8, group_size=4, stride=2), 2,
        [[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]], (5,), None,
    ),
    # group_size 8 != shard_over² = 4: PopXL's "group_size // shard_over" would gather 0,1,0,1
    "one_group_of_8": (ReplicaGrouping(num_replicas=8, group_size=8), 2, [1, 2, 3], (3,), None),
    # replicas on ranks in reverse order, groups of 2, 2-D values
    "reversed_ranks": (
        ReplicaGrouping(num_replicas=8, group_size=2), None,
        [[0, 1], [10, 11], [20, 21], [30, 31]], (2,), [7, 6, 5, 4, 3, 2, 1, 0],
    ),
    # only the even ranks: 4 singleton groups of 0-d values; odd ranks sit it out
    "even_ranks_only": (ReplicaGrouping(num_replicas=4, group_size=1), None, [5, 6, 7, 8], (), [0, 2, 4, 6]),
}


def run(name: str) -> dict | None:
    grouping, shard_over, host, shape, ranks = SCENARIOS[name]
    rank_of = list(range(grouping.num_replicas)) if ranks is None else ranks
    if dist.get_rank() not in rank_of:
        return None
    replica = rank_of.index(dist.get_rank())
    mine = weights_from_host(torch.tensor(host), grouping, shard_over=shard_over, shape=shape, ranks=ranks)
    updated = mine + 100 * replica
    out = {"from_host": mine.tolist()}
    for mode in ("one_per_group", "all_replicas"):
        got = weights_to_host(updated, grouping, shard_over=shard_over, shape=shape, retrieval_mode=mode, ranks=ranks)
        out[mode] = got.tolist()
    try:
        weights_from_host(torch.zeros(3, *shape), grouping, shard_over=shard_over, shape=shape, ranks=ranks)
    except LayoutError as exc:
        out["wrong_host_error"] = str(exc)
    return out


def member_groups() -> int:
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.tags_to_pg.get("user:topomesh:members", []))


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    names = os.environ["CHECK_SCENARIOS"].split(",")
    instances = Instances(num_replicas=world, num_instances=world // int(os.environ["LOCAL_WORLD_SIZE"]))
    report = {
        "rank": rank,
        "group_rank": int(os.environ["GROUP_RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "instance_of": instances.instance_of(rank),
        "local_index": instances.local_index(rank),
        "results": {n: run(n) for n in names},
    }
    report["member_groups"] = member_groups()
    again = {n: run(n) for n in names}  # the same calls again: same results, no new groups
    report["same_again"] = again == report["results"]
    report["member_groups_again"] = member_groups()
    dist.barrier()
    dist.destroy_process_group()
    Path(os.environ["CHECK_OUT"], f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
