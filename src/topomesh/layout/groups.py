"""The one module that creates torch process groups and device meshes.

Everything here is collective: every rank of the default process group must call the
same function with the same arguments in the same order (torch requires that of
``new_group`` and ``DeviceMesh``). The arguments come from pure functions of the
topology file and the layout, so every rank computes them identically.

* :func:`build_mesh` — a ``DeviceMesh`` whose dims are the layout's mesh axes and whose
  rank tensor is the placement (physical ranks, not ``arange``), built with
  ``DeviceMesh(device_type, mesh_tensor, mesh_dim_names=...)``; torch creates one
  process group per dim.
* :func:`axis_groups` — the process group of each axis for this rank (``mesh.get_group``).
* :func:`flatten` — several axes as one dim (e.g. ``dp`` = dp_replicate × dp_shard).
* :func:`replica_groups` / :func:`hsdp_mesh` — torch groups and an HSDP mesh from a
  :class:`~topomesh.layout.replicas.ReplicaGrouping`.
* :func:`member_group`, :func:`all_gather_in_order`, :func:`broadcast_from` — groups over
  any rank set, called by its members only (the exception to the rule above), created once
  and found again; used by ``weights_to_host``.

Backends: gloo for ``cpu``, NCCL for ``cuda`` (:func:`backend_for`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from topomesh.errors import LayoutError
from topomesh.layout.dims import Axis
from topomesh.layout.place import Placement
from topomesh.layout.replicas import ReplicaGrouping, hsdp_mesh_ranks


def default_device_type() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device_type: str) -> str:
    """The collective backend for a device type: NCCL for ``cuda``, gloo otherwise."""
    return "nccl" if device_type == "cuda" else "gloo"


def ensure_process_group(device_type: str) -> None:
    """Initialise the default process group from the launcher's environment if needed.

    On ``cuda`` also selects the GPU of ``LOCAL_RANK``. Does nothing when a group exists.
    """
    if device_type == "cuda" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend_for(device_type))


def new_group(ranks: Sequence[int], *, backend: str | None = None) -> dist.ProcessGroup | None:
    """A process group over ``ranks`` (collective: every rank calls it, members or not).

    Returns None for the whole world (use the default group), as torch code expects.
    Used by calibration sweeps, which measure arbitrary rank sets rather than mesh axes.
    """
    ranks = sorted(ranks)
    if ranks == list(range(dist.get_world_size())):
        return None
    return dist.new_group(ranks, backend=backend)


def init_mesh(device_type: str, shape: Sequence[int], names: Sequence[str]) -> DeviceMesh:
    """A mesh over ``arange(world)`` in row-major order (no placement), e.g. for a fake
    process group while tracing, where no physical ranks exist."""
    return dist.device_mesh.init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))


def build_mesh(placement: Placement, device_type: str) -> DeviceMesh:
    """The placement as a ``DeviceMesh`` with named dims (``layout.mesh_axes``)."""
    world = dist.get_world_size()
    layout = placement.layout
    if layout.world_size != world:
        raise LayoutError(f"the layout needs {layout.world_size} ranks but the process group has {world}")
    names = tuple(a.value for a in layout.mesh_axes)
    return DeviceMesh(device_type, torch.as_tensor(placement.mesh()), mesh_dim_names=names)


def axis_groups(mesh: DeviceMesh) -> dict[Axis, dist.ProcessGroup]:
    """This rank's process group along every named dim of ``mesh``."""
    names = mesh.mesh_dim_names or ()
    return {Axis.parse(n): mesh.get_group(n) for n in names}


def flatten(mesh: DeviceMesh, axes: Iterable[Axis | str], name: str) -> DeviceMesh:
    """A 1-D mesh over several dims of ``mesh`` taken together (``DeviceMesh._flatten``).

    Example: ``flatten(mesh, ["dp_replicate", "dp_shard"], "dp")`` for the loss all-reduce
    of HSDP. The dims must appear in ``mesh`` in the order given. Uses a private torch
    method (checked on torch 2.13).
    """
    names = tuple(Axis.parse(a).value for a in axes)
    missing = [n for n in names if n not in (mesh.mesh_dim_names or ())]
    if missing:
        raise LayoutError(f"the mesh has no dims {missing}; it has {list(mesh.mesh_dim_names or ())}")
    return mesh[names]._flatten(name)


def replica_groups(
    grouping: ReplicaGrouping, replica_ranks: Sequence[int] | None = None, *, backend: str | None = None
) -> tuple[dist.ProcessGroup, list[dist.ProcessGroup]]:
    """One torch group per replica group; returns (this rank's group, all groups).

    ``replica_ranks[r]`` is the torch rank of replica ``r`` (identity by default), so a
    grouping over data-parallel replicas maps onto the ranks a placement chose for them.
    """
    ranks = list(range(grouping.num_replicas)) if replica_ranks is None else list(replica_ranks)
    if len(ranks) != grouping.num_replicas:
        raise LayoutError(f"{len(ranks)} ranks given for {grouping.num_replicas} replicas")
    lists = [[ranks[r] for r in g] for g in grouping.groups()]
    mine, groups = dist.new_subgroups_by_enumeration(lists, backend=backend)
    return mine, groups


def hsdp_mesh(
    shard: ReplicaGrouping, device_type: str, replica_ranks: Sequence[int] | None = None
) -> DeviceMesh:
    """A 2-D ``(dp_replicate, dp_shard)`` mesh whose shard groups are ``shard``'s groups.

    The replicate dim is then ``shard.transpose()`` — what FSDP2's ``fully_shard`` with a
    2-D mesh (HSDP) all-reduces over.
    """
    mesh = hsdp_mesh_ranks(shard, replica_ranks)
    return DeviceMesh(
        device_type, torch.as_tensor(mesh), mesh_dim_names=(Axis.DP_REPLICATE.value, Axis.DP_SHARD.value)
    )


_MEMBER_TAG = "topomesh:members"
"""Tag of the groups :func:`member_group` creates, under which torch's registry finds them again."""


def member_group(ranks: Sequence[int]) -> dist.ProcessGroup:
    """This rank's process group over ``ranks`` (which must include it), created on first use.

    Only the members call it, so ranks outside the set may be doing something else, and
    later calls with the same set return the same group: torch's own registry of groups by
    tag is the cache, so it ends with the default group (``destroy_process_group``) and
    holds no module state here. The whole world is the default group.

    Why not ``new_group(ranks, use_local_synchronization=True)``: torch names such a group
    by its ranks *and the number of groups the calling process already has*, so members
    that created different numbers of groups before (one was the first replica of its
    group, another was not) name it differently and wait for each other forever (measured
    here: 8 gloo ranks, ranks 0 and 1 with one extra group, hang creating ``[0 2 4 6]`` and
    ``[1 3 5 7]``). The name here depends on the ranks alone; the group is built with
    torch's own helper. Private torch API, checked on torch 2.13.
    """
    import hashlib

    from torch.distributed import distributed_c10d as c10d

    members = sorted(int(r) for r in ranks)
    me = dist.get_rank()
    if me not in members:
        raise LayoutError(f"rank {me} asked for a group over ranks {members} it is not in")
    if members == list(range(dist.get_world_size())):
        return dist.group.WORLD
    found = c10d._find_pg_by_ranks_and_tag(_MEMBER_TAG, members)
    if found is not None:
        return found
    default = c10d._get_default_group()
    backend, store = c10d._world.pg_map[default]
    name = "topomesh_members_" + hashlib.sha1("_".join(map(str, members)).encode(), usedforsecurity=False).hexdigest()
    pg, _ = c10d._new_process_group_helper(
        len(members), members.index(me), members, backend, store, c10d.GroupName(name),
        timeout=c10d._get_default_timeout(backend), pg_tag=_MEMBER_TAG, device_id=default.bound_device_id,
        group_desc="topomesh_members",
    )
    c10d._world.pg_group_ranks[pg] = {r: i for i, r in enumerate(members)}
    return pg


def all_gather_in_order(tensor: torch.Tensor, ranks: Sequence[int]) -> list[torch.Tensor]:
    """Every member's ``tensor`` (same shape and dtype everywhere), in the order of ``ranks``.

    Collective over ``ranks`` (global ranks, this one among them), on :func:`member_group`.
    """
    ranks = [int(r) for r in ranks]
    if len(ranks) == 1:
        return [tensor]
    group = member_group(ranks)
    out = [torch.empty_like(tensor) for _ in ranks]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return [out[dist.get_group_rank(group, r)] for r in ranks]


def broadcast_from(tensor: torch.Tensor, src: int, ranks: Sequence[int]) -> None:
    """Broadcast ``tensor`` in place from global rank ``src`` to ``ranks`` (collective over them)."""
    if len(ranks) > 1:
        dist.broadcast(tensor, src=src, group=member_group(ranks))
