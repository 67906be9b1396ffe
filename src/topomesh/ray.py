"""Ray Train integration: ``WORLD_TOPOLOGY_FILE`` for ``TorchTrainer`` workers.

Use :class:`TopologyTorchConfig` where you would use ``ray.train.torch.TorchConfig``::

    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from topomesh.ray import TopologyTorchConfig

    trainer = TorchTrainer(
        train_loop,
        torch_config=TopologyTorchConfig(),            # backend, timeout_s, ... as usual
        scaling_config=ScalingConfig(num_workers=16, use_gpu=True),
    )

Each time Ray starts the worker group (the first start and every restart after a
failure), before the process group is set up, the backend:

1. asks every worker for its node id and the GPUs Ray gave it; workers are in world-rank
   order, nodes numbered by their first worker (Ray's own rank assignment);
2. discovers each node once, on its first worker, which returns the same node entry
   ``topomesh launch`` publishes (:func:`topomesh.launch.exchange.encode_node`) through
   the Ray object store;
3. validates the entries, assembles the world and builds the file exactly as the torchrun
   agent does (same checks, same bytes for the same world);
4. writes the file on each node (one writer per node, private directory, atomic) and sets
   ``WORLD_TOPOLOGY_FILE`` in every worker;
5. sets ``NCCL_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME`` (where the worker has none) to the
   interface that reaches rank 0's node, recorded per node in the file (``socket_ifname``).

Inside the training function, :func:`topomesh.topology.api.load_topology` reads it.
``ray`` is an optional extra (``pip install topomesh[ray]``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

from topomesh.launch import exchange
from topomesh.launch.files import run_directory, write_topology_file
from topomesh.topology import api
from topomesh.topology.build import build_topology


def _worker_identity() -> tuple[str, list[int]]:
    """(Ray node id, GPU ordinals Ray assigned to this worker)."""
    return ray.get_runtime_context().get_node_id(), [int(g) for g in ray.get_gpu_ids()]


def _node_address() -> str:
    return ray.util.get_node_ip_address()


def _node_entry(
    group_rank: int, slots: Sequence[tuple[int, int, list[int]]], nproc: int, socket_ifname: str | None = None
) -> tuple[bytes, str, bytes]:
    """Discover this node and describe its workers: ``(world_rank, local_rank, gpu_ids)``;
    ``socket_ifname`` is recorded for the node."""
    import dataclasses

    from topomesh.launch.local import discover_local_host, local_devices

    host = dataclasses.replace(discover_local_host(), socket_ifname=socket_ifname)
    by_index = {d.index: d.id for d in host.gpus}
    fallback = local_devices(host, nproc)
    workers = []
    for rank, local, gpus in slots:
        dev = by_index.get(gpus[0]) if gpus else None
        workers.append(exchange.WorkerSlot(global_rank=rank, local_rank=local, device=dev or fallback[local]))
    entry = exchange.NodeEntry(group_rank=group_rank, host=host, workers=tuple(workers))
    return (exchange.encode_node(entry), *exchange.host_class(host))


def _write_file(base: str | None, run_id: str, text: str, restart_count: int) -> str:
    return str(write_topology_file(run_directory(run_id, base), text, restart_count))


def _set_env(path: str) -> None:
    os.environ[api.ENV_VAR] = path


def _choose_ifname(mode: str, master: str) -> str | None:
    """On a node: the interface that reaches rank 0's node (``mode`` auto), or the given name."""
    import logging

    from topomesh.errors import LaunchError
    from topomesh.launch import ifname

    try:
        name = ifname.choose(mode, master)
    except LaunchError as exc:
        logging.getLogger("topomesh.ray").warning("topomesh: %s; NCCL/Gloo choose their own interface", exc)
        return None
    if name is not None:
        logging.getLogger("topomesh.ray").info(
            "topomesh: workers' socket interface %s on %s (towards %s)", name, _node_address(), master)
    return name


def _set_ifname_env(name: str | None) -> None:
    from topomesh.launch import ifname

    os.environ.update(ifname.worker_env(name, os.environ))  # the user's own setting wins


@dataclass
class TopologyTorchConfig(TorchConfig):
    """``TorchConfig`` whose workers get ``WORLD_TOPOLOGY_FILE`` (see the module docs)."""

    topology_dir: str | None = None
    """Base directory for the files on every node; default ``$TMPDIR/topomesh-<uid>``."""
    topology_form: str = "auto"
    """``auto``, ``dense`` (RFC v0.1) or ``compact``."""
    run_id: str | None = None
    """Directory name for this run's files; a random one when not given."""
    socket_ifname: str = "auto"
    """``NCCL_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME`` for workers that have none: ``auto`` = the
    interface that reaches rank 0's node (the process group's rendezvous), ``off``, or a name."""

    @property
    def backend_cls(self) -> type[_TorchBackend]:
        return _TopologyBackend


class _TopologyBackend(_TorchBackend):
    """Ray's torch backend plus one topology exchange per worker-group start."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._starts = 0
        self._run_id: str | None = None

    def on_start(self, worker_group: Any, backend_config: TopologyTorchConfig) -> None:
        self._run_id = self._run_id or backend_config.run_id or f"ray-{uuid.uuid4().hex[:12]}"
        publish_topology(worker_group, backend_config, run_id=self._run_id, restart_count=self._starts)
        self._starts += 1
        super().on_start(worker_group, backend_config)


def publish_topology(worker_group: Any, config: TopologyTorchConfig, *, run_id: str, restart_count: int) -> list[str]:
    """Build the world's file from one discovery per node; returns each worker's path."""
    idents = worker_group.execute(_worker_identity)
    nodes: dict[str, list[int]] = {}
    for rank, (node_id, _) in enumerate(idents):
        nodes.setdefault(node_id, []).append(rank)
    first = {node_id: ranks[0] for node_id, ranks in nodes.items()}
    master = ray.get(worker_group.execute_single_async(0, _node_address))
    mode = getattr(config, "socket_ifname", "auto")
    names = ray.get([worker_group.execute_single_async(first[n], _choose_ifname, mode, master) for n in nodes])
    blobs = ray.get(
        [
            worker_group.execute_single_async(
                first[node_id],
                _node_entry,
                g,
                [(r, local, idents[r][1]) for local, r in enumerate(ranks)],
                len(ranks),
                names[g],
            )
            for g, (node_id, ranks) in enumerate(nodes.items())
        ]
    )
    ray.get([worker_group.execute_single_async(r, _set_ifname_env, names[g])
             for g, ranks in enumerate(nodes.values()) for r in ranks])
    classes = exchange.HostClasses()
    entries = []
    for g, (node_blob, digest, body) in enumerate(blobs):
        classes.add(digest, body, group_rank=g)
        entries.append(exchange.decode_node(node_blob, group_rank=g, classes=classes))
    world = exchange.decode_world(exchange.assemble_world(entries))
    topo = build_topology(world.hosts, world.ranks, run_id=run_id, restart_count=restart_count, source="ray")
    text = api.dumps(topo, config.topology_form)
    paths = ray.get(
        [
            worker_group.execute_single_async(first[node_id], _write_file, config.topology_dir, run_id, text, restart_count)
            for node_id in nodes
        ]
    )
    per_rank = [""] * len(idents)
    for path, ranks in zip(paths, nodes.values(), strict=True):
        for r in ranks:
            per_rank[r] = path
    ray.get([worker_group.execute_single_async(r, _set_env, p) for r, p in enumerate(per_rank)])
    return per_rank
