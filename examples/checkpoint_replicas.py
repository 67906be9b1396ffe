"""Copy each rank's checkpoint shard to ranks in other failure domains, chosen from the topology.

    topomesh launch --standalone --nproc-per-node 4 examples/checkpoint_replicas.py --copies 1

Every rank reads ``WORLD_TOPOLOGY_FILE`` (``topomesh.load_topology``) and asks
``replica_peers(rank, k)`` where its ``k`` copies go: other hosts first, the same local rank
(and so the same NIC rail) on each. Every rank can work out the whole plan from the file, so
each also knows whose copies it receives. The copies travel by point-to-point sends
(``torch.distributed.batch_isend_irecv``; gloo here, NCCL on GPUs) and are checked on
arrival. Rank 0 prints the plan; with ``--out DIR`` every rank writes what it sent and got.
On a single host the copies necessarily stay on that host (the plan says so).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from topomesh import load_topology


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=1, help="copies of each shard (k)")
    ap.add_argument("--numel", type=int, default=1 << 16, help="elements in each rank's shard")
    ap.add_argument("--out", type=Path, default=None, help="directory for per-rank JSON reports")
    args = ap.parse_args()

    topo = load_topology()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if topo.world_size != world:
        print(f"rank {rank}: the topology has {topo.world_size} ranks, the job {world}", file=sys.stderr)
        return 1
    plan = {r: topo.replica_peers(r, args.copies) for r in range(world)}
    senders = [r for r in range(world) if rank in plan[r]]

    shard = torch.full((args.numel,), float(rank))  # stands in for this rank's checkpoint shard
    inbox = {r: torch.empty(args.numel) for r in senders}
    ops = [dist.P2POp(dist.isend, shard, peer) for peer in plan[rank]]
    ops += [dist.P2POp(dist.irecv, buf, r) for r, buf in inbox.items()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    bad = [r for r, buf in inbox.items() if not torch.equal(buf, torch.full_like(buf, float(r)))]
    dist.barrier()

    def host(r: int) -> str:
        return topo.hosts[topo.ranks[r].host].hostname

    if rank == 0:
        for r in range(world):
            where = ", ".join(f"{p} ({host(p)}, {topo.connection(r, p).kind.value})" for p in plan[r])
            print(f"rank {r} ({host(r)}): copies on {where}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {
            "rank": rank, "host": host(rank), "peers": plan[rank], "peer_hosts": [host(p) for p in plan[rank]],
            "received_from": senders, "corrupt_from": bad,
        }
        (args.out / f"replicas-rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()
    if bad:
        print(f"rank {rank}: copies from {bad} arrived damaged", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main() if "RANK" in os.environ else (print(__doc__) or 2))
