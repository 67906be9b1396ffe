"""Worker for test_plan_mesh: build the plan's mesh and report it (run by topomesh launch --plan)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from topomesh.layout.api import mesh_from_plan


def main() -> None:
    mesh = mesh_from_plan(device_type="cpu")
    rank = dist.get_rank()
    sums = {}
    for name in mesh.mesh_dim_names:
        t = torch.ones(1)
        dist.all_reduce(t, group=mesh.get_group(name))
        sums[name] = t.item()
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps({
        "plan": os.environ["TOPOMESH_PLAN"], "mesh": mesh.mesh.tolist(), "names": list(mesh.mesh_dim_names),
        "sums": sums}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
