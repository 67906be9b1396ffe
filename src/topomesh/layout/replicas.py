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
group": member ``k`` of a group holds shard ``k % shard_over``. To gather the shards back,
PopXL documents exactly one valid grouping: the variable's grouping with ``group_size //
shard_over`` and the same stride.

**Instances** (the same guide, "Distributed PopXL Instances"): with ``num_instances`` host
processes, instance ``i`` drives the ``num_replicas // num_instances`` consecutive global
replicas starting at ``i · replicas_per_instance``; groupings are always defined over the
*global* replicas, so a group may span instances.

In topomesh a replica is a data-parallel rank; :func:`topomesh.layout.groups.replica_groups`
turns a grouping into torch process groups and :func:`hsdp_mesh_ranks` into the
``(replicate, shard)`` rank array of an HSDP ``DeviceMesh``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from topomesh.errors import LayoutError


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
        """The only grouping valid for gathering a weight sharded with ``shard_over``.

        PopXL documents it as this grouping with ``group_size // shard_over`` and the same
        stride. Every example PopXL gives has ``group_size == shard_over²``, where its groups
        are exactly :meth:`shard_domains`; when they are not (e.g. group_size 8, shard_over 2,
        whose documented gather groups would hold shard 0 twice) this raises rather than
        return groups that do not hold one copy of each shard.

        >>> g = ReplicaGrouping(num_replicas=16, group_size=4, stride=4)
        >>> g.gather_grouping(2).groups()[:3]
        [[0, 4], [1, 5], [2, 6]]
        """
        self._check_shard_over(shard_over)
        if not self.is_const:
            raise LayoutError("a grouping without a constant stride has no gather grouping")
        assert self.stride is not None
        gather = ReplicaGrouping(
            num_replicas=self.num_replicas, group_size=self.group_size // shard_over, stride=self.stride
        )
        if sorted(map(sorted, gather.groups())) != sorted(map(sorted, self.shard_domains(shard_over))):
            raise LayoutError(
                f"with group_size {self.group_size} and shard_over {shard_over} the documented gather "
                f"grouping (group_size {self.group_size // shard_over}, stride {self.stride}) does not "
                f"hold each of the {shard_over} shards once; use shard_domains({shard_over})"
            )
        return gather

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
