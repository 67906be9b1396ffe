"""The trainer's entry point: one call from degrees and the topology file to a DeviceMesh.

.. code-block:: python

    from topomesh.layout.api import mesh_from_topology

    mesh = mesh_from_topology({"tp": 8, "pp": 2, "dp_shard": -1})
    tp_mesh, pp_group = mesh["tp"], mesh.get_group("pp")

It reads ``WORLD_TOPOLOGY_FILE`` (set by ``topomesh launch`` and the Ray integration),
places the layout so TP sits inside NVLink islands and DP/PP cross hosts
(:mod:`topomesh.layout.place`), initialises the default process group when the script
has not (gloo on CPU, NCCL on GPU) and builds the mesh. Without the variable it falls
back to one host in rank order, so the same script runs under plain ``torchrun``.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from topomesh.errors import LayoutError
from topomesh.layout import groups
from topomesh.layout.dims import Axis, Layout
from topomesh.layout.place import Placement, Strategy, place
from topomesh.topology.api import ENV_VAR, load_topology
from topomesh.topology.build import build_topology, default_placement
from topomesh.topology.model import Host, Topology

Degrees = Layout | Mapping[str, int]


def resolve_layout(layout_or_degrees: Degrees, world_size: int, *, order: str | None = None) -> Layout:
    """A :class:`Layout` for ``world_size`` ranks; one degree may be ``-1`` (the rest).

    >>> resolve_layout({"tp": 2, "dp_shard": -1}, 8).dp_shard
    4
    """
    if isinstance(layout_or_degrees, Layout):
        layout = layout_or_degrees
    else:
        # keys stay as given, so Layout.from_degrees sees an axis named twice (dp, dp_replicate)
        deg = {k: int(v) for k, v in layout_or_degrees.items()}
        free = [k for k, v in deg.items() if v == -1]
        bad = {Axis.parse(k).value: v for k, v in deg.items() if v < 1 and v != -1}
        if bad:
            raise LayoutError(f"degrees must be positive (or -1 for the rest of the world), got {bad}")
        if len(free) > 1:
            raise LayoutError(f"only one degree may be -1, got {[Axis.parse(k).value for k in free]}")
        if free:
            known = math.prod(v for k, v in deg.items() if k != free[0])
            if world_size % known:
                raise LayoutError(f"the other degrees multiply to {known}, which does not divide the world of {world_size}")
            deg[free[0]] = world_size // known
        layout = Layout.from_degrees(deg, order=order)
    layout.check_world(world_size)
    return layout


def _world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    raise LayoutError("no process group and no WORLD_SIZE: start the script with topomesh launch or torchrun")


def job_topology(topology: Topology | str | os.PathLike[str] | None, world_size: int) -> Topology:
    """``topology``, else the file ``WORLD_TOPOLOGY_FILE`` names, else one host in rank order."""
    if isinstance(topology, Topology):
        topo = topology
    elif topology is not None:
        topo = load_topology(Path(topology))
    elif os.environ.get(ENV_VAR):
        topo = load_topology()
    else:
        host = Host(hostname=socket.gethostname() or "localhost")
        topo = build_topology([host], default_placement([host], [world_size]), source="single-host default")
    if topo.world_size != world_size:
        raise LayoutError(
            f"the topology ({topo.source or 'given'}) has {topo.world_size} ranks but the job has {world_size}"
        )
    return topo


def place_layout(
    layout_or_degrees: Degrees,
    *,
    topology: Topology | str | os.PathLike[str] | None = None,
    world_size: int | None = None,
    order: str | None = None,
    strategy: Strategy | str = Strategy.TOPOLOGY,
) -> Placement:
    """The placement :func:`mesh_from_topology` uses, without touching torch.distributed."""
    world = world_size if world_size is not None else _world_size()
    topo = job_topology(topology, world)
    return place(topo, resolve_layout(layout_or_degrees, world, order=order), strategy)


def mesh_from_topology(
    layout_or_degrees: Degrees,
    *,
    device_type: str | None = None,
    topology: Topology | str | os.PathLike[str] | None = None,
    order: str | None = None,
    strategy: Strategy | str = Strategy.TOPOLOGY,
) -> DeviceMesh:
    """A topology-placed ``DeviceMesh`` with one named dim per parallel axis of degree > 1.

    ``layout_or_degrees`` is a :class:`Layout` or ``{"tp": 8, "pp": 2, ...}`` (one value may
    be ``-1``); ``device_type`` defaults to ``cuda`` when available; ``topology`` is a
    :class:`Topology` or a path, by default ``WORLD_TOPOLOGY_FILE``. Collective: every
    rank calls it.
    """
    dev = device_type or groups.default_device_type()
    groups.ensure_process_group(dev)
    placement = place_layout(
        layout_or_degrees, topology=topology, world_size=dist.get_world_size(), order=order, strategy=strategy
    )
    return groups.build_mesh(placement, dev)
