"""The 2-D (pp × tp) example of ``train_2d.py`` under Ray Train's ``TorchTrainer``.

Ray Train starts the workers and their gloo/NCCL process group; inside each worker the
training loop is exactly ``train_2d.train``: ``mesh_from_topology`` places the layout
using ``WORLD_TOPOLOGY_FILE``, which :class:`topomesh.ray.TopologyTorchConfig` builds
during worker-group start-up (one discovery per node, the same file ``topomesh launch``
writes). ``--topology PATH`` passes a given file to every worker instead.

Run on one machine, 4 CPU workers::

    RAY_AUTH_MODE=disabled python examples/ray_train_2d.py --steps 3

On a 2-CPU machine each worker asks for half a CPU, else the four workers never get
scheduled. (Ray 2.60 runs Train V2, whose driver reserves no CPU; ``trainer_resources``
is refused there.)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_2d  # noqa: E402  (the example next to this one)


def _loop(config: dict[str, object]) -> None:
    import ray.train

    args = argparse.Namespace(**config)
    record = train_2d.train(args, destroy=False)  # Ray Train owns the process group
    losses = record["losses"]
    ray.train.report({"loss": losses[-1] if losses else float("nan"), "stage": record["stage"]})


def main(argv: list[str] | None = None) -> None:
    import ray
    import ray.cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    p.add_argument("--out", default=None, help="directory for per-rank losses and gradients")
    p.add_argument("--topology", default=None, help="topology file for every worker (WORLD_TOPOLOGY_FILE)")
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray cluster")
    p.add_argument("--storage", default=None, help="Ray Train storage path (default: a temp dir)")
    a = p.parse_args(argv)

    env = {"OMP_NUM_THREADS": "1"}
    if a.topology:
        env["WORLD_TOPOLOGY_FILE"] = str(Path(a.topology).resolve())
    ray.init(num_cpus=a.num_cpus, runtime_env={"env_vars": env})
    # workers cannot import a script's sibling module by name: ship it by value
    ray.cloudpickle.register_pickle_by_value(train_2d)
    world = a.tp * a.pp
    loop_config = {
        "tp": a.tp, "pp": a.pp, "steps": a.steps, "schedule": a.schedule, "device": "cpu",
        "no_sequence_parallel": False, "out": str(Path(a.out).resolve()) if a.out else None,
    }
    storage = a.storage or os.path.join(os.environ.get("TMPDIR", "/tmp"), "topomesh-ray")
    from topomesh.ray import TopologyTorchConfig

    trainer = TorchTrainer(
        _loop,
        train_loop_config=loop_config,
        # with --topology the given file is used as is; otherwise Ray's backend builds one
        torch_config=None if a.topology else TopologyTorchConfig(topology_dir=os.path.join(storage, "topology")),
        scaling_config=ScalingConfig(
            num_workers=world,
            use_gpu=False,
            resources_per_worker={"CPU": a.num_cpus / world},
        ),
        run_config=RunConfig(name="topomesh-2d", storage_path=storage),
    )
    try:
        result = trainer.fit()
        if result.error:
            raise result.error
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
