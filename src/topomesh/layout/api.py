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

import numpy as np
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from topomesh.errors import LayoutError
from topomesh.layout import groups
from topomesh.layout.dims import Axis, Layout
from topomesh.layout.place import Placement, Strategy, place
from topomesh.layout.ranks import logical_mesh
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


PLAN_ENV_VAR = "TOPOMESH_PLAN"
"""Set by ``topomesh launch --plan FILE`` for every worker: the plan :func:`mesh_from_plan` builds."""


def read_plan(path: str | os.PathLike[str] | None = None) -> dict:
    """The plan file ``path`` (default: ``$TOPOMESH_PLAN``) written by ``topomesh plan``,
    checked for its format and version (:mod:`topomesh.search.rank`)."""
    from topomesh.topology.api import read_json

    where = path if path is not None else os.environ.get(PLAN_ENV_VAR)
    if not where:
        raise LayoutError(f"no plan: pass a path or start the job with topomesh launch --plan FILE ({PLAN_ENV_VAR} is unset)")
    plan = read_json(Path(where), what="plan", error=LayoutError)
    if not isinstance(plan, dict) or plan.get("format") != "topomesh-plan" or plan.get("version") != 1:
        raise LayoutError(f"{where}: not a version 1 topomesh plan file (format 'topomesh-plan', version 1)")
    return plan


def plan_placement(plan: Mapping, world_size: int, *, choice: int = 0, source: str = "the plan",
                   topology: Topology | None = None) -> Placement:
    """The :class:`Placement` of the plan's ``choice``-th ranked layout (0: the best), checked
    against the job: the same world size and, when ``topology`` is given, the same hosts and
    ranks per host as the cluster the plan scored. Pure (no torch.distributed)."""
    layouts = plan.get("layouts") or []
    if not isinstance(layouts, list) or not 0 <= choice < len(layouts):
        raise LayoutError(f"{source} has {len(layouts) if isinstance(layouts, list) else 0} ranked layouts; "
                          f"layout {choice} was asked for")
    entry = layouts[choice]
    inputs = plan.get("inputs") or {}
    scored = f"{inputs.get('cluster_name', '?')}, {inputs.get('world_size', '?')} ranks"
    if entry.get("world_size") != world_size:
        raise LayoutError(f"{source} was scored for {entry.get('world_size')} ranks ({scored}) but this job has "
                          f"{world_size} ranks")
    if topology is not None:
        mine = sorted({len(g) for g in topology.ranks_by_host()})
        hosts = len(topology.hosts)
        if (inputs.get("hosts"), inputs.get("ranks_per_host")) != (hosts, mine):
            raise LayoutError(
                f"{source} was scored on {inputs.get('hosts')} host(s) with {inputs.get('ranks_per_host')} ranks each "
                f"({scored}) but this job's topology ({topology.source or 'given'}) has {hosts} host(s) with {mine}")
    try:
        lay = entry["layout"]
        layout = Layout.from_degrees(lay["degrees"], order=lay["order"])
        mesh = np.asarray(entry["mesh"], dtype=np.int64)
        names = tuple(entry["mesh_dim_names"])
    except (KeyError, TypeError, ValueError) as exc:
        raise LayoutError(f"{source}: layout {choice} lacks a readable layout, mesh or mesh_dim_names ({exc})") from None
    layout.check_world(world_size)
    if names != tuple(a.value for a in layout.mesh_axes) or mesh.shape != layout.mesh_shape:
        raise LayoutError(f"{source}: layout {choice}'s mesh {list(mesh.shape)} over {list(names)} does not match "
                          f"its degrees {layout.describe()}")
    if sorted(mesh.ravel().tolist()) != list(range(world_size)):
        raise LayoutError(f"{source}: layout {choice}'s mesh is not a permutation of the {world_size} ranks")
    ranks = np.empty(world_size, dtype=np.int64)
    ranks[logical_mesh(layout).ravel()] = mesh.ravel()  # Placement.mesh() is ranks[logical_mesh]
    return Placement(layout=layout, ranks=tuple(int(r) for r in ranks), strategy=Strategy.TOPOLOGY)


def mesh_from_plan(path: str | os.PathLike[str] | None = None, *, choice: int = 0,
                   device_type: str | None = None) -> DeviceMesh:
    """Exactly the ``DeviceMesh`` the plan scored: its ``mesh`` rank array and
    ``mesh_dim_names``, from ``path`` or ``$TOPOMESH_PLAN`` (``topomesh launch --plan``).
    Refuses a plan scored for another world size, or, when ``WORLD_TOPOLOGY_FILE`` is set,
    for other hosts. Collective: every rank calls it.
    """
    plan = read_plan(path)
    source = str(path if path is not None else os.environ.get(PLAN_ENV_VAR))
    dev = device_type or groups.default_device_type()
    groups.ensure_process_group(dev)
    world = dist.get_world_size()
    topo = load_topology() if os.environ.get(ENV_VAR) else None
    return groups.build_mesh(plan_placement(plan, world, choice=choice, source=source, topology=topo), dev)
