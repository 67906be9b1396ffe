"""Worker that reports its socket-interface variables and its host's record in the file."""

from __future__ import annotations

import json
import os
from pathlib import Path

from topomesh.topology.api import load_topology, write_atomic

rank = int(os.environ["RANK"])
topo = load_topology()
report = {
    "rank": rank,
    "env": {k: os.environ.get(k) for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")},
    "host_ifname": topo.host_of(rank).socket_ifname,
    "cpus": sorted(os.sched_getaffinity(0)),
    "binding": topo.host_of(rank).numa_binding(int(os.environ["LOCAL_RANK"])),
}
# whole or not at all: the test may poll the directory while ranks write
write_atomic(Path(os.environ["CHECK_OUT"], f"rank{rank}.json"), json.dumps(report))
