"""Every node writes the same topology file: the world built in two separate processes with
different hash seeds, and with the leader's inputs listed in a different order, gives
byte-identical dense and compact files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: three nodes (two kinds of host), probe rows between the nodes
# and inside node 1, workers and rows listed forwards or backwards; prints the files' text.
SCRIPT = r"""
import json, sys
from tests.launch.conftest import SYSFS
from topomesh.launch import exchange as ex
from topomesh.topology import api
from topomesh.topology.build import build_topology
from topomesh.topology.discover import discover_host

backwards = sys.argv[1] == "backwards"
flip = (lambda xs: list(reversed(xs))) if backwards else list
dgx = discover_host(SYSFS / "dgx-h100-8gpu-8ib")
pcie = discover_host(SYSFS / "pcie-4gpu-2numa")
hosts = [dgx.renamed("node-a"), pcie.renamed("node-b"), dgx.renamed("node-c")]
local = (("GPU0", "GPU1", 3.25, 22.5), ("GPU2", "GPU3", 3.5, 21.0))
entries = [
    ex.NodeEntry(group_rank=g, host=h,
                 workers=tuple(flip([ex.WorkerSlot(global_rank=4 * g + i, local_rank=i, device=f"GPU{i}")
                                     for i in range(4)])),
                 local_measured=tuple(flip(local)) if g == 1 else ())
    for g, h in enumerate(hosts)
]
rows = flip([[0, 1, 5.5, 20.25], [1, 2, 6.0, 10.5], [0, 2, 4.0, 40.0]])
world = ex.decode_world(ex.assemble_world(entries, rows))
topo = build_topology(world.hosts, world.ranks, measured_hosts=world.measured,
                      measured_devices=world.local_measured, run_id="job", restart_count=world.restart_count)
print(json.dumps({"dense": api.dumps(topo, "dense"), "compact": api.dumps(topo, "compact")}))
"""


def _build(seed: str, order: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, order], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout)


def test_world_files_are_identical_across_processes_hash_seeds_and_input_order():
    a = _build("1", "forwards")
    b = _build("4242", "backwards")
    assert a["dense"] == b["dense"]
    assert a["compact"] == b["compact"]
    # and they hold what went in: 12 ranks, node pair (0, 1) at 5.5 us, node 1's GPU2-GPU3 pair
    dense = json.loads(a["dense"])
    assert dense["world_size"] == "12"
    c = dense["ranks"]["0"]["peers"]["4"]["connection"]
    assert (c["latency"]["value"], c["bandwidth"]["value"], c["latency"]["source"]) == ("5.5", "20.25", "measured")
    c = dense["ranks"]["6"]["peers"]["7"]["connection"]
    assert (c["latency"]["value"], c["bandwidth"]["value"]) == ("3.5", "21")
    compact = json.loads(a["compact"])
    assert compact["measured_inter"] == [[0, 1, 5.5, 20.25], [0, 2, 4.0, 40.0], [1, 2, 6.0, 10.5]]
