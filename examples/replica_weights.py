"""PopXL's replica-grouped variables on torch.distributed: host data in, train, host data out.

    # the PopXL guide's complex example: 16 replicas over 8 instances (nodes), groups of 4
    # with stride 4, each group's value sharded over 2 replicas; here 8 agents on one host
    for i in 0 1 2 3 4 5 6 7; do
      topomesh launch --nnodes 8 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29500 examples/replica_weights.py &
    done; wait
    # the same on one node
    topomesh launch --standalone --nproc-per-node 16 examples/replica_weights.py

Every rank passes the same global host data, ``(num_groups, *shape)``, to
``weights_from_host`` and gets its replica's shard; each replica "trains" by adding
``100 · replica`` to its shard; ``weights_to_host`` gathers the shards back and exchanges
one value per group (or per replica) between all instances, so every rank ends with the
whole global data. Rank 0 prints what each instance's local replicas hold and both results.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from topomesh.layout.replicas import Instances, ReplicaGrouping, weights_from_host, weights_to_host


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--stride", type=int, default=4)
    ap.add_argument("--shard-over", type=int, default=2, help="0: no sharding")
    ap.add_argument("--numel", type=int, default=5, help="elements in one value (need not divide)")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    grouping = ReplicaGrouping(num_replicas=world, group_size=args.group_size, stride=args.stride)
    instances = Instances(num_replicas=world, num_instances=world // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    shard_over = args.shard_over or None
    shape = (args.numel,)
    host = torch.arange(grouping.num_groups * args.numel).reshape(grouping.num_groups, *shape) * 10
    if grouping.num_groups == 1:
        host = host[0]

    mine = weights_from_host(host, grouping, shard_over=shard_over, shape=shape)
    trained = mine + 100 * rank
    one = weights_to_host(trained, grouping, shard_over=shard_over, shape=shape)
    every = weights_to_host(trained, grouping, shard_over=shard_over, shape=shape, retrieval_mode="all_replicas")

    held = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(held, mine)  # only for the printout
    if rank == 0:
        print(f"{world} replicas over {instances.num_instances} instances; groups {grouping.groups()}; "
              f"shard_over {shard_over}; gather groups "
              f"{grouping.gather_grouping(shard_over).groups() if shard_over else None}")
        for i in range(instances.num_instances):
            for row in instances.local_view(grouping, i, shard_over):
                print(f"  instance {i} local replica {row['local_replica']}: replica {row['replica']} "
                      f"group {row['group']} holds {held[row['replica']].tolist()}")
        print("one_per_group:", one.tolist())
        print("all_replicas:", every.tolist())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
