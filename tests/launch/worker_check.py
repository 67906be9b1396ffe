"""Worker script for the launch tests: read WORLD_TOPOLOGY_FILE, check it, report.

Writes ``$CHECK_OUT/rank<RANK>-r<restart>.json`` with what it saw. Behaviour per round is
keyed on the file's ``restart_count`` (the job-wide count), not on the node's own
``TORCHELASTIC_RESTART_COUNT``: a node that restarts because a peer failed keeps its own
count at 0.

Env knobs: ``CHECK_EXPECT`` = JSON ``{"same": {hostname: kind}, "cross": kind}`` to assert
link kinds for every pair; ``CHECK_FAIL_RANK`` = a rank (or ``all``) that exits 3 in round 0
while the others wait to be restarted; ``CHECK_GLOO`` = 1 to all-reduce over gloo; ``CHECK_HOLD`` =
1 to all-reduce in a loop until the test creates ``$CHECK_OUT/release`` (the report is
written before the loop), so a node that disappears makes the others' collectives fail.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from topomesh.topology.api import load_topology, write_atomic


def _publish(out: Path, report: dict) -> None:
    """Write ``report`` where the test polls for it, whole or not at all (the test reads the
    directory while ranks write: a partly written file once failed a run's JSON parse)."""
    write_atomic(out, json.dumps(report))


def main() -> int:
    pids = Path(os.environ["CHECK_OUT"]) / "pids"
    pids.mkdir(exist_ok=True)
    (pids / f"{os.getpid()}-{os.getppid()}").touch()  # so the test can clean up
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    path = os.environ["WORLD_TOPOLOGY_FILE"]
    topo = load_topology()
    assert topo.world_size == world, (topo.world_size, world)
    round_ = topo.restart_count or 0
    kinds = {f"{a},{b}": topo.connection(a, b).kind.value for a in range(world) for b in range(world)}
    expect = os.environ.get("CHECK_EXPECT")
    if expect:
        exp = json.loads(expect)
        for a in range(world):
            for b in range(world):
                if a == b:
                    want = "LOC"
                elif topo.same_host(a, b):
                    want = exp["same"][topo.host_of(a).hostname.split("~")[0]]
                else:
                    want = exp["cross"]
                got = topo.connection(a, b).kind.value
                assert got == want, f"rank {rank}: pair ({a},{b}) is {got}, expected {want}"
    report = {
        "rank": rank,
        "world_size": world,
        "file": path,
        "bytes": Path(path).read_bytes().decode(),
        "run_id": topo.run_id,
        "file_restart_count": topo.restart_count,
        "env_restart_count": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        "hostnames": [topo.host_of(r).hostname for r in range(world)],
        "kinds": kinds,
        "measured": [topo.connection(a, b).measured for a in range(world) for b in range(world)],
    }
    fail_rank = os.environ.get("CHECK_FAIL_RANK")
    if fail_rank is not None and round_ == 0:
        if fail_rank == "all" or rank == int(fail_rank):
            return 3
        time.sleep(120)  # the agent restarts us when it sees the failed node rejoin
        return 4
    out = Path(os.environ["CHECK_OUT"]) / f"rank{rank}-r{round_}-w{world}.json"
    if os.environ.get("CHECK_GLOO") == "1" or os.environ.get("CHECK_HOLD") == "1":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        report["allreduce"] = t.item()
        if os.environ.get("CHECK_HOLD") == "1":
            _publish(out, report)
            release = Path(os.environ["CHECK_OUT"]) / "release"
            while not release.exists():  # a collective per step, as training would do
                dist.all_reduce(t)
                time.sleep(0.2)
        dist.destroy_process_group()
    _publish(out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
