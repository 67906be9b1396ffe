"""Ray Train workers that read the topology file built by ``topomesh.ray``.

Run on a laptop (CPU, gloo): ``RAY_AUTH_MODE=disabled python examples/ray_topology.py``.
On a GPU cluster pass ``--gpus`` to put one worker per GPU.
"""

from __future__ import annotations

import argparse


def train_loop(config: dict) -> None:
    import torch.distributed as dist

    from topomesh.topology.api import load_topology

    topo = load_topology()
    rank = dist.get_rank()
    if rank == 0:
        print(f"world of {topo.world_size} ranks on {len(topo.hosts)} host(s), run {topo.run_id}")
        for group in topo.domains("NVLink"):
            print("  NVLink island:", group)
        if topo.world_size > 1:
            c = topo.connection(0, topo.world_size - 1)
            print(f"  rank 0 <-> rank {topo.world_size - 1}: {c.kind.value}, {c.bandwidth_GBps} GB/s")


def main() -> None:
    import ray
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    from topomesh.ray import TopologyTorchConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--gpus", action="store_true")
    a = p.parse_args()
    ray.init()
    TorchTrainer(
        train_loop,
        torch_config=TopologyTorchConfig(),
        scaling_config=ScalingConfig(num_workers=a.workers, use_gpu=a.gpus),
    ).fit()


if __name__ == "__main__":
    main()
