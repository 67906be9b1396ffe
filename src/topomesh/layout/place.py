"""Topology-aware placement: which physical rank holds each logical grid position.

The logical grid (:mod:`topomesh.layout.ranks`) puts the fastest-varying axis of the
layout's order in blocks of consecutive logical ranks, the next axis in blocks of the
product of the first two, and so on. Placement therefore only has to list the physical
ranks so that *consecutive ranks are as close as possible*: hosts one after another,
inside a host its PCIe/NUMA domains, inside those its NVLink islands. Then logical rank
``i`` goes to the ``i``-th rank of that list.

With torchrun's host-contiguous numbering on uniform hosts this is the identity. When
the numbering is not host-contiguous (``--rdzv`` round-robin, a scheduler's own rank
file, a rank map from a previous job), the naive identity mapping puts TP groups across
hosts; the locality order does not::

    2 hosts × 8 GPUs, rank r on host r % 2:   naive tp=8 group [0..7]  → 4 + 4 GPUs, IB
                                              placed tp=8 group [0, 2, 4, …, 14] → NVSwitch

Every rank computes the same mapping from the same topology file: the order depends only
on the topology (domains sorted by their smallest rank, then local rank, then rank).

:func:`axis_report` says, per axis, the slowest link kind between two members of any of
its groups, the bottleneck bandwidth, and a sentence when the axis cannot fit where it
should (``tp=16 cannot fit in 8-GPU NVLink islands: crosses IB``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from topomesh.errors import LayoutError
from topomesh.layout.dims import Axis, Layout
from topomesh.layout.ranks import axis_groups, logical_mesh, rank_to_coords
from topomesh.topology.model import LinkKind, Topology

# Domain levels from coarse to fine; each level's domains nest inside the previous one's
# (Topology.domains(kind) joins ranks over links at least as fast as kind).
# The inter-host fabric is not a level: with every host on one fabric it is a single
# domain, and the SYS level already puts whole hosts in order of their smallest rank.
_LEVELS: tuple[LinkKind, ...] = (
    LinkKind.SYS,  # a whole host (every same-host kind is at least this fast)
    LinkKind.NODE,
    LinkKind.PHB,
    LinkKind.PXB,
    LinkKind.PIX,
    LinkKind.NVLINK,
)

_MODEL_AXES = (Axis.TP, Axis.CP, Axis.EP)
"""Axes that communicate inside every layer and belong on NVLink when there is some."""

_EXACT_PAIRS_MAX = 64
"""Groups up to this size are checked pair by pair; larger ones through representatives."""


class Strategy(StrEnum):
    TOPOLOGY = "topology"  # the locality order described above
    RANK_ORDER = "rank-order"  # logical rank i on physical rank i (what a plain script does)


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """A layout laid onto physical ranks: ``ranks[logical] = physical``.

    With ``tp=2, pp=2`` (tp fastest) on ranks numbered round-robin over two hosts, rank
    ``r`` on host ``r % 2``, the topology placement lists host 0's ranks first:

    >>> p = Placement(layout=Layout(tp=2, pp=2), ranks=(0, 2, 1, 3), strategy=Strategy.TOPOLOGY)
    >>> p.groups("tp"), p.groups("pp"), p.mesh().tolist()
    ([[0, 2], [1, 3]], [[0, 1], [2, 3]], [[0, 2], [1, 3]])
    >>> p.logical_rank(2), {a.value: c for a, c in p.coords(2).items() if c}
    (1, {'tp': 1})
    """

    layout: Layout
    ranks: tuple[int, ...]
    strategy: Strategy
    _logical: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """The inverse of ``ranks``: ``_logical[physical] = logical``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_logical", _inverse(self.ranks, self.layout.world_size))

    def mesh(self) -> np.ndarray:
        """Physical ranks shaped ``layout.mesh_shape`` (dims ``layout.mesh_axes``)."""
        return np.asarray(self.ranks, dtype=np.int64)[logical_mesh(self.layout)]

    def groups(self, axes: Axis | str | Iterable[Axis | str]) -> list[list[int]]:
        """Physical rank groups of one axis or several axes together (logical order)."""
        return [[self.ranks[i] for i in g] for g in axis_groups(self.layout, axes)]

    def logical_rank(self, rank: int) -> int:
        """The grid position physical ``rank`` holds (O(1): reports call it for every rank)."""
        if not 0 <= rank < len(self._logical):
            raise LayoutError(f"rank {rank} is not in this placement of {len(self.ranks)} ranks")
        return self._logical[rank]

    def coords(self, rank: int) -> dict[Axis, int]:
        """Grid coordinates of physical ``rank``."""
        return rank_to_coords(self.logical_rank(rank), self.layout)


_INVERSES: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
"""The last few rank lists checked, by id (a search places thousands of layouts on one list)."""


def _inverse(ranks: tuple[int, ...], world: int) -> tuple[int, ...]:
    """``logical[physical]`` of a rank list that uses each of ``world`` ranks once."""
    hit = _INVERSES.get(id(ranks))
    if hit is not None and hit[0] is ranks and len(ranks) == world:
        return hit[1]
    if sorted(ranks) != list(range(world)):
        raise LayoutError(f"a placement must use each of the {world} ranks once, got {list(ranks)}")
    logical = [0] * len(ranks)
    for i, r in enumerate(ranks):
        logical[r] = i
    if len(_INVERSES) >= 16:
        _INVERSES.clear()
    _INVERSES[id(ranks)] = (ranks, tuple(logical))
    return _INVERSES[id(ranks)][1]


def locality_order(topo: Topology) -> list[int]:
    """Physical ranks with close ranks next to each other (see the module docstring).

    The key of a rank is its domain at every level from its host down to its
    NVLink island (domains numbered by their smallest rank), then its local rank and rank.
    """
    keys: list[list[int]] = [[] for _ in range(topo.world_size)]
    for level in _LEVELS:
        for index, dom in enumerate(topo.domains(level)):
            for r in dom:
                keys[r].append(index)
    for r, info in enumerate(topo.ranks):
        keys[r].extend((info.local_rank, r))
    return sorted(range(topo.world_size), key=lambda r: keys[r])


def place(topo: Topology, layout: Layout, strategy: Strategy | str = Strategy.TOPOLOGY) -> Placement:
    """Map ``layout``'s logical ranks to ``topo``'s physical ranks.

    Raises :class:`LayoutError` when the degrees do not multiply to the world size.
    """
    strategy = Strategy(strategy)
    layout.check_world(topo.world_size)
    if strategy is Strategy.RANK_ORDER:
        return Placement(layout=layout, ranks=tuple(range(topo.world_size)), strategy=strategy)
    return Placement(layout=layout, ranks=tuple(locality_order(topo)), strategy=strategy)


@dataclass(frozen=True, slots=True, kw_only=True)
class AxisReport:
    """What the groups of one axis cross."""

    axis: Axis
    degree: int
    num_groups: int
    kind: LinkKind
    """Slowest link kind between two members of any group (``LOC`` for degree 1)."""
    bottleneck_GBps: float
    """Lowest bandwidth between two members of any group, GB/s."""
    latency_us: float
    """Highest latency between two members of any group, microseconds."""
    hosts_per_group: int
    """Most hosts one group spans."""
    note: str | None = None
    """A sentence when the axis cannot fit where it belongs, or does not although it could."""

    def to_dict(self) -> dict[str, object]:
        return {
            "axis": self.axis.value,
            "degree": self.degree,
            "num_groups": self.num_groups,
            "link": self.kind.value,
            "bottleneck_GBps": self.bottleneck_GBps,
            "latency_us": self.latency_us,
            "hosts_per_group": self.hosts_per_group,
            "note": self.note,
        }


def _representatives(topo: Topology, members: Sequence[int]) -> list[int]:
    """Members whose pairs show every default link kind and bandwidth of a large group.

    Ranks on different hosts connect through their rails only, so one member per rail is
    enough between hosts. Same-host pairs depend on the host's class (its local matrix) and
    on which of its slots are members: the first host of every such kind is kept whole, and
    so are the first two hosts (for one pair of hosts). Measured figures and override pairs
    are not seen here; :func:`_group_links` adds them.
    """
    if len(members) <= _EXACT_PAIRS_MAX:
        return list(members)
    t = topo.table
    on_host: dict[int, list[int]] = {}
    for r in members:
        on_host.setdefault(topo.ranks[r].host, []).append(r)
    whole: set[int] = set()
    kinds: set[tuple[int, tuple[int, ...]]] = set()
    for h, rs in on_host.items():
        kind = (int(t.host_class[h]), tuple(sorted(int(t.local_of[r]) for r in rs)))
        if len(whole) < 2 or kind not in kinds:
            whole.add(h)
        kinds.add(kind)
    out: list[int] = []
    rails: set[int] = set()
    for r in members:
        rail = int(t.rail_of[r])
        if topo.ranks[r].host in whole or rail not in rails:
            out.append(r)
        rails.add(rail)
    return out


def _exceptions(topo: Topology, members: Sequence[int]) -> list[tuple[LinkKind, float, float]]:
    """(kind, bandwidth, latency) of every override pair and measured figure among ``members``."""
    t = topo.table
    if not (t.overrides or t.measured_inter or t.measured_local):
        return []
    out: list[tuple[LinkKind, float, float]] = []
    inside = set(members)
    for (a, b) in t.overrides:
        if a in inside and b in inside:
            c = topo.connection(a, b)
            out.append((c.kind, c.bandwidth_GBps, c.latency_us))
    slots: dict[int, set[int]] = {}
    for r in members:
        slots.setdefault(topo.ranks[r].host, set()).add(int(t.local_of[r]))
    for (ha, hb), (lat, bw) in t.measured_inter.items():
        if ha in slots and hb in slots:
            out.append((LinkKind.LOC, bw, lat))
    for h, pairs in t.measured_local.items():
        for (la, lb), (lat, bw) in pairs.items():
            if la in slots.get(h, ()) and lb in slots.get(h, ()):
                out.append((LinkKind.LOC, bw, lat))
    return out


def _group_links(topo: Topology, members: Sequence[int]) -> tuple[LinkKind, float, float]:
    reps = _representatives(topo, members)
    worst = LinkKind.LOC
    bw = float("inf")
    lat = 0.0
    for i, a in enumerate(reps):
        for b in reps[i + 1 :]:
            c = topo.connection(a, b)
            if c.kind.tier > worst.tier:
                worst = c.kind
            bw = min(bw, c.bandwidth_GBps)
            lat = max(lat, c.latency_us)
    if len(reps) < len(members):
        # measured figures keep their pair's kind (seen through the representatives)
        for kind, b, lt in _exceptions(topo, members):
            if kind.tier > worst.tier:
                worst = kind
            bw, lat = min(bw, b), max(lat, lt)
    return worst, (0.0 if bw == float("inf") else bw), lat


def nvlink_island_size(topo: Topology) -> int:
    """Ranks in the largest NVLink/NVSwitch island; 1 when there is no NVLink at all.

    Ranks that share one device (``LOC``, e.g. CPU processes on one socket) do not make
    an island.
    """
    best = 1
    for dom in topo.domains(LinkKind.NVLINK):
        if len(dom) > best and any(topo.connection(dom[0], r).kind.is_nvlink for r in dom[1:]):
            best = len(dom)
    return best


def axis_report(topo: Topology, placement: Placement) -> list[AxisReport]:
    """One :class:`AxisReport` per mesh axis of the placement's layout (slowest first)."""
    layout = placement.layout
    island_max = nvlink_island_size(topo)
    out: list[AxisReport] = []
    for axis in layout.mesh_axes:
        groups = placement.groups(axis)
        worst, bw, lat, span = LinkKind.LOC, float("inf"), 0.0, 1
        for g in groups:
            k, b, lt = _group_links(topo, g)
            if k.tier > worst.tier:
                worst = k
            bw, lat = min(bw, b), max(lat, lt)
            span = max(span, len({topo.ranks[r].host for r in g}))
        degree = layout.degree(axis)
        out.append(
            AxisReport(
                axis=axis,
                degree=degree,
                num_groups=len(groups),
                kind=worst,
                bottleneck_GBps=0.0 if degree == 1 else bw,
                latency_us=lat,
                hosts_per_group=span,
                note=_note(axis, degree, worst, island_max, placement),
            )
        )
    return out


def _note(axis: Axis, degree: int, worst: LinkKind, island_max: int, placement: Placement) -> str | None:
    if axis not in _MODEL_AXES or degree == 1 or island_max <= 1 or worst.is_nvlink:
        return None
    layout = placement.layout
    if degree > island_max:
        return f"{axis.value}={degree} cannot fit in {island_max}-GPU NVLink islands: crosses {worst.value}"
    if placement.strategy is Strategy.RANK_ORDER:
        return (
            f"{axis.value}={degree} fits in {island_max}-GPU NVLink islands, but in rank order its "
            f"groups cross {worst.value}; the topology placement keeps them inside"
        )
    inner = [a.value for a in layout.order[: layout.order.index(axis)] if layout.degree(a) > 1]
    span = degree
    for a in inner:
        span *= layout.degree(a)
    if span > island_max and inner:
        return (
            f"{axis.value}={degree} would fit in an NVLink island, but {'×'.join(inner)} {'vary' if len(inner) > 1 else 'varies'} faster "
            f"in the order ({layout.order_text()}), so its groups cross {worst.value}"
        )
    return f"{axis.value}={degree} does not fit the NVLink islands of this topology evenly: crosses {worst.value}"
