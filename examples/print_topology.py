"""A worker that reads the topology file topomesh launch built for it, and checks it.

    topomesh launch --standalone --nproc-per-node 2 examples/print_topology.py

Each rank prints its host and device and the link kind to every peer; it exits non-zero
if the file is missing or disagrees with torchrun's WORLD_SIZE / RANK / LOCAL_RANK.
"""

from __future__ import annotations

import os
import sys

from topomesh import load_topology


def main() -> int:
    topo = load_topology()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if topo.world_size != world:
        print(f"rank {rank}: file has {topo.world_size} ranks, WORLD_SIZE is {world}", file=sys.stderr)
        return 1
    me = topo.ranks[rank]
    if me.local_rank != int(os.environ["LOCAL_RANK"]):
        print(f"rank {rank}: file says local rank {me.local_rank}", file=sys.stderr)
        return 1
    links = ", ".join(f"{p}:{topo.connection(rank, p).kind.value}" for p in range(world) if p != rank)
    host = topo.hosts[me.host].hostname
    print(f"rank {rank}/{world} on {host} device={me.device} restart={topo.restart_count} -> {links}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
