"""Replica groupings with the semantics of PopXL's ``ReplicaGrouping(group_size, stride)``.

A grouping splits ``num_replicas`` global replicas into ``num_groups`` groups of
``group_size``; ``stride`` is the replica-index distance between neighbours in a group.
Groups fill blocks of ``group_size · stride`` replicas, ``stride`` interleaved groups per
block, as PopXL's ``ReplicaGrouping.assignment`` does (Graphcore PopXL user guide,
"Replication → Replica grouping", and ``popxl/replica_grouping.py``)::

    8 replicas, stride 1, group_size 2 → assignment [0, 0, 1, 1, 2, 2, 3, 3]
    8 replicas, stride 2, group_size 2 → assignment [0, 1, 0, 1, 2, 3, 2, 3]
    8 replicas, stride 2, group_size 4 → assignment [0, 1, 0, 1, 0, 1, 0, 1]
    16 replicas, stride 4, group_size 4 → groups [0 4 8 12] [1 5 9 13] [2 6 10 14] [3 7 11 15]

The **transpose** takes the k-th member of every group into new group k (PopXL's
``ReplicaGrouping.transpose``): ``[0,0,1,1] → [0,1,0,1]``, ``[0,1,0,1] → [0,0,1,1]``. Some
transposes have no constant stride (8 replicas, stride 2, group_size 2 transposes to
``[0,0,1,1,0,0,1,1]``); they are kept as an explicit assignment, as PopXL does.

**Sharding** (PopXL user guide, "Distributed PopXL Instances → Using shard_over"): a weight
of a group is "repeatedly sharded over every ``shard_over`` consecutive replicas of the
group": member ``k`` of a group holds shard ``k % shard_over``. The replicas holding the
distinct shards of one value are ``shard_over`` consecutive members of a group, i.e. the
grouping ``(group_size=shard_over, stride)`` (:meth:`ReplicaGrouping.gather_grouping`).
PopXL's guide writes the gather grouping as ``group_size // shard_over`` with the same
stride; the two agree on its worked example (group_size 4 = shard_over²) and differ
elsewhere, where only ``group_size=shard_over`` gathers every shard once.

**Instances** (the same guide, "Distributed PopXL Instances"): with ``num_instances`` host
processes, instance ``i`` drives the ``num_replicas // num_instances`` consecutive global
replicas starting at ``i · replicas_per_instance``; groupings are always defined over the
*global* replicas, so a group may span instances.

In topomesh a replica is a data-parallel rank; :func:`topomesh.layout.groups.replica_groups`
turns a grouping into torch process groups and :func:`hsdp_mesh_ranks` into the
``(replicate, shard)`` rank array of an HSDP ``DeviceMesh``. Under ``topomesh launch`` an
instance is a node's agent and its local replicas are that node's workers.

**Data in and out** (PopXL's ``Session.weights_from_host`` / ``weights_to_host``):
:func:`weights_from_host` gives every rank its replica's value (or shard) of the global host
data, and :func:`weights_to_host` collects the global data on every rank again, shards
gathered first, then one value per group or per replica exchanged between all instances.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np

from topomesh.errors import LayoutError

if TYPE_CHECKING:  # torch is imported where it is used: the pure groupings need none
    import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaGrouping:
    """Groups of global replicas: constant-stride (``stride`` set) or an explicit assignment.

    >>> g = ReplicaGrouping(num_replicas=16, group_size=4, stride=4)
    >>> g.num_groups, g.groups()[1], g.transpose().groups()[1]
    (4, [1, 5, 9, 13], [4, 5, 6, 7])
    """

    num_replicas: int
    group_size: int
    stride: int | None = 1
    """Distance between neighbours in a group; None for groupings without a constant stride."""
    explicit: tuple[int, ...] | None = field(default=None, repr=False)
    """The assignment, for groupings without a constant stride (``stride`` is None)."""

    def __post_init__(self) -> None:
        r, gs, st = self.num_replicas, self.group_size, self.stride
        if r < 1:
            raise LayoutError(f"the number of replicas must be at least 1, got {r}")
        if not 1 <= gs <= r or r % gs:
            raise LayoutError(f"group_size {gs} must divide the {r} replicas")
        if st is None:
            if self.explicit is None or len(self.explicit) != r:
                raise LayoutError("a grouping without a stride needs an assignment of every replica")
            return
        if self.explicit is not None:
            raise LayoutError("give either a stride or an explicit assignment, not both")
        if gs == 1:
            object.__setattr__(self, "stride", 1)  # stride has no effect on singleton groups
            return
        if st < 1 or r % (gs * st):
            raise LayoutError(
                f"group_size {gs} × stride {st} = {gs * st} must divide the {r} replicas "
                "(groups fill blocks of group_size·stride replicas)"
            )

    @classmethod
    def from_assignment(cls, assignment: Sequence[int]) -> ReplicaGrouping:
        """The grouping with this assignment (constant-stride when it has one).

        Groups must be equal in size and numbered 0, 1, … in order of first appearance.

        >>> ReplicaGrouping.from_assignment([0, 1, 0, 1, 2, 3, 2, 3]).stride
        2
        >>> ReplicaGrouping.from_assignment([0, 0, 1, 1, 0, 0, 1, 1]).stride is None
        True
        """
        a = [int(x) for x in assignment]
        if not a:
            raise LayoutError("an assignment needs at least one replica")
        first: list[int] = []
        for g in a:
            if g not in first:
                first.append(g)
        if first != list(range(len(first))):
            raise LayoutError(f"groups must be numbered 0, 1, … in order of first appearance, got {a}")
        sizes = {a.count(g) for g in first}
        if len(sizes) != 1:
            raise LayoutError(f"all groups must have the same size, got sizes {sorted(sizes)} in {a}")
        gs = sizes.pop()
        gaps = {m[i + 1] - m[i] for g in first for m in [_members(a, g)] for i in range(len(m) - 1)}
        if len(gaps) <= 1:
            stride = gaps.pop() if gaps else 1
            try:
                const = cls(num_replicas=len(a), group_size=gs, stride=stride)
            except LayoutError:
                const = None
            if const is not None and list(const.assignment()) == a:
                return const
        return cls(num_replicas=len(a), group_size=gs, stride=None, explicit=tuple(a))

    @property
    def is_const(self) -> bool:
        """True when the grouping has a constant stride (PopXL's ``is_const``)."""
        return self.stride is not None

    @property
    def num_groups(self) -> int:
        return self.num_replicas // self.group_size

    def group_of(self, replica: int) -> int:
        """Index of the group ``replica`` is in."""
        self._check(replica)
        if self.explicit is not None:
            return self.explicit[replica]
        assert self.stride is not None
        block, lane = divmod(replica, self.group_size * self.stride)
        return block * self.stride + lane % self.stride

    def index_in_group(self, replica: int) -> int:
        """Position of ``replica`` among its group's members (in replica order)."""
        self._check(replica)
        if self.explicit is not None:
            return _members(self.explicit, self.explicit[replica]).index(replica)
        assert self.stride is not None
        return (replica % (self.group_size * self.stride)) // self.stride

    def assignment(self) -> tuple[int, ...]:
        """The group of every replica (PopXL's ``assignment``).

        >>> ReplicaGrouping(num_replicas=8, group_size=4, stride=2).assignment()
        (0, 1, 0, 1, 0, 1, 0, 1)
        """
        return tuple(self.group_of(r) for r in range(self.num_replicas))

    def groups(self) -> list[list[int]]:
        """Members of every group, groups in index order, members in replica order."""
        out: list[list[int]] = [[] for _ in range(self.num_groups)]
        for r, g in enumerate(self.assignment()):
            out[g].append(r)
        return out

    def transpose(self) -> ReplicaGrouping:
        """The k-th member of every group forms new group k (PopXL's ``transpose``).

        >>> ReplicaGrouping(num_replicas=4, group_size=2).transpose().assignment()
        (0, 1, 0, 1)
        >>> ReplicaGrouping(num_replicas=8, group_size=2, stride=2).transpose().assignment()
        (0, 0, 1, 1, 0, 0, 1, 1)
        """
        return ReplicaGrouping.from_assignment([self.index_in_group(r) for r in range(self.num_replicas)])

    def _check_shard_over(self, shard_over: int) -> None:
        if shard_over < 1 or self.group_size % shard_over:
            raise LayoutError(f"shard_over {shard_over} must divide the group size {self.group_size}")

    def shard_index(self, replica: int, shard_over: int) -> int:
        """Which shard ``replica`` holds: member k of a group holds shard ``k % shard_over``.

        >>> g = ReplicaGrouping(num_replicas=4, group_size=4)
        >>> [g.shard_index(r, 2) for r in range(4)]   # PopXL's w = [1, 2] example: [1] [2] [1] [2]
        [0, 1, 0, 1]
        """
        self._check_shard_over(shard_over)
        return self.index_in_group(replica) % shard_over

    def shard_domains(self, shard_over: int) -> list[list[int]]:
        """Sets of ``shard_over`` consecutive members of each group: each holds one full copy."""
        self._check_shard_over(shard_over)
        return [g[i : i + shard_over] for g in self.groups() for i in range(0, len(g), shard_over)]

    def gather_grouping(self, shard_over: int) -> ReplicaGrouping:
        """The grouping whose groups hold the distinct shards of one value, once each.

        Member ``k`` of a group holds shard ``k % shard_over``, so members ``j·shard_over …
        j·shard_over + shard_over - 1`` of each group hold one whole value: with a constant
        stride that is ``ReplicaGrouping(group_size=shard_over, stride=self.stride)``, otherwise
        the explicit grouping of :meth:`shard_domains`. Gathering over it (in replica order)
        puts the shards in shard order.

        PopXL's guide writes this grouping as ``group_size // shard_over`` with the same
        stride. That agrees on its worked example (16 replicas, group_size 4, stride 4,
        shard_over 2: both give ``[0 4] [1 5] …``) because 4 = 2², and differs elsewhere:
        group_size 8, shard_over 2 would gather 4 replicas holding shards 0, 1, 0, 1, and
        group_size 2, shard_over 2 would gather nothing.

        >>> ReplicaGrouping(num_replicas=16, group_size=4, stride=4).gather_grouping(2).groups()[:3]
        [[0, 4], [1, 5], [2, 6]]
        >>> ReplicaGrouping(num_replicas=8, group_size=8).gather_grouping(2).groups()
        [[0, 1], [2, 3], [4, 5], [6, 7]]
        """
        self._check_shard_over(shard_over)
        if self.is_const:
            return ReplicaGrouping(num_replicas=self.num_replicas, group_size=shard_over, stride=self.stride)
        domains = sorted(self.shard_domains(shard_over))
        assignment = [0] * self.num_replicas
        for i, domain in enumerate(domains):
            for r in domain:
                assignment[r] = i
        return ReplicaGrouping.from_assignment(assignment)

    def to_dict(self) -> dict[str, object]:
        return {
            "num_replicas": self.num_replicas,
            "group_size": self.group_size,
            "stride": self.stride,
            "num_groups": self.num_groups,
            "assignment": list(self.assignment()),
        }

    def _check(self, replica: int) -> None:
        if not 0 <= replica < self.num_replicas:
            raise LayoutError(f"replica {replica} is outside the {self.num_replicas} replicas")


def _members(assignment: Sequence[int], group: int) -> list[int]:
    return [r for r, g in enumerate(assignment) if g == group]


@dataclass(frozen=True, slots=True, kw_only=True)
class Instances:
    """Global replicas spread over host instances (PopRun's ``--num-instances``).

    >>> inst = Instances(num_replicas=16, num_instances=8)
    >>> inst.replicas_per_instance, inst.replicas_of(3), inst.instance_of(7), inst.local_index(7)
    (2, [6, 7], 3, 1)
    """

    num_replicas: int
    num_instances: int

    def __post_init__(self) -> None:
        if self.num_instances < 1 or self.num_replicas % self.num_instances:
            raise LayoutError(
                f"{self.num_instances} instances must divide the {self.num_replicas} replicas evenly"
            )

    @property
    def replicas_per_instance(self) -> int:
        return self.num_replicas // self.num_instances

    def instance_of(self, replica: int) -> int:
        return replica // self.replicas_per_instance

    def local_index(self, replica: int) -> int:
        return replica % self.replicas_per_instance

    def replicas_of(self, instance: int) -> list[int]:
        if not 0 <= instance < self.num_instances:
            raise LayoutError(f"instance {instance} is outside the {self.num_instances} instances")
        n = self.replicas_per_instance
        return list(range(instance * n, (instance + 1) * n))

    def local_view(
        self, grouping: ReplicaGrouping, instance: int, shard_over: int | None = None
    ) -> list[dict[str, int]]:
        """What one instance sees: each local replica with its global index, group and shard."""
        if grouping.num_replicas != self.num_replicas:
            raise LayoutError(
                f"the grouping covers {grouping.num_replicas} replicas, the instances {self.num_replicas}"
            )
        rows = []
        for local, r in enumerate(self.replicas_of(instance)):
            row = {"instance": instance, "local_replica": local, "replica": r, "group": grouping.group_of(r),
                   "index_in_group": grouping.index_in_group(r)}
            if shard_over is not None:
                row["shard"] = grouping.shard_index(r, shard_over)
            rows.append(row)
        return rows

    def groups_spanning_instances(self, grouping: ReplicaGrouping) -> list[int]:
        """Groups whose members live on more than one instance."""
        return [i for i, g in enumerate(grouping.groups()) if len({self.instance_of(r) for r in g}) > 1]


def hsdp_mesh_ranks(shard: ReplicaGrouping, replica_ranks: Sequence[int] | None = None) -> np.ndarray:
    """The ``(replicate, shard)`` rank array of an HSDP mesh whose shard groups are ``shard``.

    Row ``i`` is shard group ``i``; column ``k`` is the k-th member of every group, i.e.
    the transpose grouping, which is what the replicate dim must all-reduce over.
    ``replica_ranks[r]`` is the torch rank of replica ``r`` (identity by default).

    >>> hsdp_mesh_ranks(ReplicaGrouping(num_replicas=8, group_size=4)).tolist()
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    >>> hsdp_mesh_ranks(ReplicaGrouping(num_replicas=8, group_size=4, stride=2)).tolist()
    [[0, 2, 4, 6], [1, 3, 5, 7]]
    """
    ranks = np.arange(shard.num_replicas) if replica_ranks is None else np.asarray(replica_ranks)
    if ranks.shape != (shard.num_replicas,):
        raise LayoutError(f"{len(ranks)} ranks given for {shard.num_replicas} replicas")
    return ranks[np.asarray(shard.groups())]


class RetrievalMode(StrEnum):
    """What :func:`weights_to_host` returns (PopXL's ``retrieval_mode`` of a variable)."""

    ONE_PER_GROUP = "one_per_group"
    """Each group's first replica: ``(num_groups, *shape)``, or ``shape`` for one group."""
    ALL_REPLICAS = "all_replicas"
    """Every replica's value: ``(num_replicas, *shape)``."""


def shard_length(numel: int, shard_over: int) -> int:
    """Elements in one shard: ``ceil(numel / shard_over)``; the last shard is padded at the end.

    >>> shard_length(10, 2), shard_length(7, 2), shard_length(3, 4)
    (5, 4, 1)
    """
    if shard_over < 1:
        raise LayoutError(f"shard_over must be at least 1, got {shard_over}")
    return -(-numel // shard_over)


def shard_of(value: torch.Tensor, index: int, shard_over: int) -> torch.Tensor:
    """Shard ``index`` of ``shard_over``: the index-th equal piece of the flattened value,
    zero-padded at the end when ``value.numel()`` does not divide (a new 1-D tensor).

    >>> import torch
    >>> [shard_of(torch.arange(5), k, 2).tolist() for k in range(2)]
    [[0, 1, 2], [3, 4, 0]]
    """
    import torch.nn.functional as F

    n = shard_length(value.numel(), shard_over)
    if not 0 <= index < shard_over:
        raise LayoutError(f"shard index {index} is outside the {shard_over} shards")
    flat = F.pad(value.reshape(-1), (0, n * shard_over - value.numel()))
    return flat[index * n : (index + 1) * n].clone()


def unshard(shards: Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
    """The whole value of ``shape`` from its shards in shard order (padding dropped).

    >>> import torch
    >>> unshard([torch.tensor([0, 1, 2]), torch.tensor([3, 4, 0])], (5,)).tolist()
    [0, 1, 2, 3, 4]
    """
    import torch

    numel = math.prod(shape)
    n = shard_length(numel, len(shards))
    bad = [tuple(s.shape) for s in shards if tuple(s.shape) != (n,)]
    if bad:
        raise LayoutError(
            f"shards of a value of shape {tuple(shape)} over {len(shards)} replicas must have shape ({n},); "
            f"got {bad[0]}"
        )
    return torch.cat(list(shards))[:numel].reshape(tuple(shape))


def replica_value(
    host: torch.Tensor,
    grouping: ReplicaGrouping,
    replica: int,
    *,
    shard_over: int | None = None,
    shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """What ``replica`` holds of the global host data: its group's value, or its shard of it.

    ``host`` has shape ``(num_groups, *shape)``, or ``shape`` when there is one group (PopXL's
    host data of a grouped variable). With ``shard_over`` the result is the 1-D shard
    ``grouping.shard_index(replica, shard_over)`` of the value (:func:`shard_of`). ``shape``,
    the shape of one value, is optional; given, ``host`` is checked against it (without it
    only the group dim can be checked).

    >>> import torch
    >>> g = ReplicaGrouping(num_replicas=4, group_size=4)
    >>> [replica_value(torch.tensor([1, 2]), g, r, shard_over=2).tolist() for r in range(4)]
    [[1], [2], [1], [2]]
    """
    import torch

    host = torch.as_tensor(host)
    n = grouping.num_groups
    if shape is not None:
        want = tuple(shape) if n == 1 else (n, *shape)
        if tuple(host.shape) != want:
            raise LayoutError(
                f"host data for {n} group(s) of values of shape {tuple(shape)} must have shape {want}; "
                f"got shape {tuple(host.shape)}"
            )
    elif n > 1 and (host.dim() == 0 or host.shape[0] != n):
        raise LayoutError(
            f"host data for a grouping of {n} groups must have shape ({n}, *shape), one value per group; "
            f"got shape {tuple(host.shape)}"
        )
    value = host if n == 1 else host[grouping.group_of(replica)]
    if shard_over is None:
        return value.clone()
    return shard_of(value, grouping.shard_index(replica, shard_over), shard_over)


def _replica_ranks(grouping: ReplicaGrouping, ranks: Sequence[int] | None) -> list[int]:
    out = list(range(grouping.num_replicas)) if ranks is None else [int(r) for r in ranks]
    if len(out) != grouping.num_replicas or len(set(out)) != len(out):
        raise LayoutError(
            f"ranks must name {grouping.num_replicas} distinct ranks, one per replica of the grouping; got {out}"
        )
    return out


def _my_replica(rank_of: Sequence[int]) -> int:
    import torch.distributed as dist

    me = dist.get_rank()
    if me not in rank_of:
        raise LayoutError(f"rank {me} holds none of the replicas, whose ranks are {list(rank_of)}")
    return list(rank_of).index(me)


def weights_from_host(
    host: torch.Tensor,
    grouping: ReplicaGrouping,
    *,
    shard_over: int | None = None,
    shape: Sequence[int] | None = None,
    ranks: Sequence[int] | None = None,
) -> torch.Tensor:
    """This rank's value of a replica-grouped variable (PopXL's ``weights_from_host``).

    Every rank passes the same global ``host`` data — ``(num_groups, *shape)``, or ``shape``
    for one group — and gets its replica's value (:func:`replica_value`): its group's slice,
    or with ``shard_over`` its 1-D shard of it. ``ranks[r]`` is the global rank of replica
    ``r`` (default: rank r; a layout's data-parallel ranks are the usual choice); ``shape``
    (one value's shape) checks ``host``. Local: no communication, since every rank has the
    global data.
    """
    rank_of = _replica_ranks(grouping, ranks)
    return replica_value(host, grouping, _my_replica(rank_of), shard_over=shard_over, shape=shape)


def weights_to_host(
    local: torch.Tensor,
    grouping: ReplicaGrouping,
    *,
    shard_over: int | None = None,
    shape: Sequence[int] | None = None,
    retrieval_mode: RetrievalMode | str = RetrievalMode.ONE_PER_GROUP,
    ranks: Sequence[int] | None = None,
) -> torch.Tensor:
    """The global data of a replica-grouped variable on every rank (PopXL's ``weights_to_host``).

    Collective over the replicas' ranks: each calls it with its own ``local`` value (or 1-D
    shard, with ``shard_over``; then ``shape``, the shape of one whole value, is required; without
    sharding it is optional and checked against ``local``). Shards are
    first all-gathered within :meth:`ReplicaGrouping.gather_grouping` and joined
    (:func:`unshard`). Then, ``one_per_group``: the groups' first replicas all-gather their
    values and each broadcasts the result to its group, giving ``(num_groups, *shape)``
    (``shape`` for one group, the shape :func:`weights_from_host` takes); ``all_replicas``:
    every replica's value is all-gathered, ``(num_replicas, *shape)``. These collectives span
    instances, which is PopXL's exchange between instances. Process groups come from
    :func:`topomesh.layout.groups.member_group` (created once, found again later).
    """
    import torch

    from topomesh.layout import groups

    try:
        mode = RetrievalMode(retrieval_mode)
    except ValueError:
        raise LayoutError(
            f"retrieval_mode must be one of {[m.value for m in RetrievalMode]}, got {retrieval_mode!r}"
        ) from None
    rank_of = _replica_ranks(grouping, ranks)
    me = _my_replica(rank_of)
    value = local
    if shard_over is not None:
        if shape is None:
            raise LayoutError("weights_to_host of a sharded value needs shape, the shape of one whole value")
        n = shard_length(math.prod(shape), shard_over)
        if tuple(local.shape) != (n,):
            raise LayoutError(
                f"replica {me}'s shard of a value of shape {tuple(shape)} over {shard_over} replicas must have "
                f"shape ({n},); got {tuple(local.shape)}"
            )
        gather = grouping.gather_grouping(shard_over)
        members = sorted(gather.groups()[gather.group_of(me)], key=lambda r: grouping.shard_index(r, shard_over))
        value = unshard(groups.all_gather_in_order(local, [rank_of[r] for r in members]), shape)
    elif shape is not None and tuple(local.shape) != tuple(shape):
        raise LayoutError(f"replica {me}'s value must have shape {tuple(shape)}; got {tuple(local.shape)}")
    if mode is RetrievalMode.ALL_REPLICAS:
        return torch.stack(groups.all_gather_in_order(value, rank_of))
    mine = grouping.groups()[grouping.group_of(me)]
    if me == mine[0]:
        firsts = [rank_of[g[0]] for g in grouping.groups()]
        out = torch.stack(groups.all_gather_in_order(value, firsts))
    else:
        out = value.new_empty((grouping.num_groups, *value.shape))
    groups.broadcast_from(out, rank_of[mine[0]], [rank_of[r] for r in mine])
    return out[0] if grouping.num_groups == 1 else out
