"""The layout space: every assignment of degrees to the chosen strategies, every order of
the strategies in use, and (on request) every combination of training knobs.

A *layout* gives each chosen strategy (by default all six :class:`~topomesh.layout.dims.Axis`)
a degree, with the degrees multiplying to the world size, and orders the strategies whose
degree is above 1 (fastest-varying first, as :attr:`Layout.order`). Strategies of degree 1
take no part in the order: every order of the unused ones gives the same rank grid.

Counting. A layout that uses ``t`` of the ``k`` strategies picks which ``t`` (``C(k, t)``),
an ordered factorization of the world into ``t`` factors above 1, and one of ``t!`` orders.
For a world of ``2^n`` ranks the ordered factorizations into ``t`` factors are the
compositions of ``n`` into ``t`` positive parts, ``C(n-1, t-1)``, so the space holds
``Σ_{t=1..k} C(k,t)·t!·C(n-1,t-1)`` layouts: 1,554,156 for 16,384 GPUs and six strategies.
Other world sizes use ordered factorizations over the divisors. A world of one rank has
exactly one layout (every degree 1, ``t = 0``).

Expert parallel is an independent strategy here, as in the count above and in
:class:`~topomesh.layout.dims.Layout`: ``ep`` is a factor of the world of its own, not carved
out of ``dp_shard × cp`` as torchtitan does. Its ranks shard the experts; the dense weights
are replicated over it and the global batch is split over ``dp_replicate × dp_shard`` only
(:func:`data_parallel_degree`).

Representation (compact, vectorized, because a search evaluates millions of layouts):

* ``degrees`` — one row per *degree assignment*, an int64 array ``(D, 6)`` whose columns are
  :data:`AXES`; a row's layouts differ only by order;
* ``n_orders`` — ``t!`` per row, and ``offsets`` — the first layout id of each row, so
  layout ``i`` is row ``r`` with ``offsets[r] <= i < offsets[r+1]`` and permutation index
  ``i - offsets[r]`` into :func:`permutations` of its ``t`` used axes;
* ``knobs`` — a :class:`KnobTable`; the full space is layouts × knob rows.

Order and knobs never change which layouts divide the model or fit in memory, so pruning
works on the ``D × K`` (row, knob) table and weighs each cell by its ``t!`` orders.

>>> sp = enumerate_space(8)
>>> sp.n_layouts, len(sp.degrees)
(186, 56)
>>> sp.layout(0)[0].describe()
'dp_replicate=8'
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache

import numpy as np

from topomesh.errors import LayoutError
from topomesh.layout.dims import Axis, Layout
from topomesh.sim.schedules import Schedule

AXES: tuple[Axis, ...] = tuple(Axis)
"""Column order of every degree array: dp_replicate, dp_shard, cp, tp, pp, ep."""

COLUMN: Mapping[Axis, int] = {a: i for i, a in enumerate(AXES)}
"""Column of each axis in a degree array."""


class Recompute(StrEnum):
    """Activation recomputation mode (``--recompute``), as ``ParallelOptions.checkpointing``."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


@cache
def permutations(t: int) -> np.ndarray:
    """Every order of ``t`` items, lexicographic, as an int8 array ``(t!, t)`` (read-only).

    Row ``p`` lists positions into a row's used axes (in :data:`AXES` order), fastest first.

    >>> permutations(3).tolist()
    [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]]
    """
    out = np.array(list(itertools.permutations(range(t))), dtype=np.int8).reshape(math.factorial(t), t)
    out.flags.writeable = False
    return out


def ordered_factorizations(n: int, parts: int) -> np.ndarray:
    """Every way to write ``n`` as an ordered product of ``parts`` factors above 1, as an
    int64 array ``(count, parts)``; for ``n = 2^m`` the count is ``C(m-1, parts-1)``.

    >>> ordered_factorizations(12, 2).tolist()
    [[2, 6], [3, 4], [4, 3], [6, 2]]
    >>> ordered_factorizations(1, 0).shape
    (1, 0)
    """
    divisors = [d for d in range(2, n + 1) if n % d == 0]
    rows: list[tuple[int, ...]] = []

    def walk(rest: int, prefix: tuple[int, ...]) -> None:
        left = parts - len(prefix)
        if left == 0:
            if rest == 1:
                rows.append(prefix)
            return
        if rest < 2**left:  # each remaining factor is at least 2
            return
        for d in divisors:
            if d > rest:
                break
            if rest % d == 0:
                walk(rest // d, (*prefix, d))

    walk(n, ())
    return np.array(rows, dtype=np.int64).reshape(len(rows), parts)


def data_parallel_degree(degrees: np.ndarray) -> np.ndarray:
    """The number of data-parallel replicas that split the global batch, per degree row:
    ``dp_replicate × dp_shard`` (``ep`` ranks shard experts, not the batch; see the module
    docstring)."""
    return degrees[..., COLUMN[Axis.DP_REPLICATE]] * degrees[..., COLUMN[Axis.DP_SHARD]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Knobs:
    """One combination of the training knobs a layout is scored with."""

    micro_batch: int
    """Samples per micro-batch on one data-parallel replica."""
    recompute: Recompute
    schedule: Schedule
    interleave: int
    """Model chunks per pipeline stage (virtual stages); 1 unless ``interleaved-1f1b``."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)  # arrays: compared by identity
class KnobTable:
    """The knob rows searched on top of every layout (one row when nothing is searched).

    ``micro_batch``, ``interleave`` (int64), ``recompute`` and ``schedule`` (int8 indices into
    the enums, in definition order) are parallel arrays of length ``len(self)``. Single-stage
    schedules (GPipe, 1F1B) take interleave 1, V-shaped ones (ZBV, DualPipeV) 2, the other
    multi-stage ones (``interleaved-1f1b`` …) every given interleave above 1: stages per rank,
    so ``pp × interleave`` is the number of stages (:func:`topomesh.sim.schedules.stage_count`).

    >>> t = KnobTable.product(micro_batch=(1, 2), schedule=("1f1b", "interleaved-1f1b"), interleave=(2, 4))
    >>> len(t), [(k.micro_batch, k.schedule.value, k.interleave) for k in t.rows()][:3]
    (6, [(1, '1f1b', 1), (1, 'interleaved-1f1b', 2), (1, 'interleaved-1f1b', 4)])
    """

    micro_batch: np.ndarray
    recompute: np.ndarray
    schedule: np.ndarray
    interleave: np.ndarray

    @classmethod
    def product(
        cls,
        *,
        micro_batch: Iterable[int] = (1,),
        recompute: Iterable[str | Recompute] = (Recompute.NONE,),
        schedule: Iterable[str | Schedule] = (Schedule.ONE_F_ONE_B,),
        interleave: Iterable[int] = (2,),
    ) -> KnobTable:
        """The cartesian product of the given values (micro-batch outermost, then recompute,
        then schedule × interleave)."""
        mbs = _unique_positive(micro_batch, "micro-batch size")
        recs = _unique(Recompute(r) for r in recompute)
        scheds = _unique(Schedule(s) for s in schedule)
        virtual = _unique_positive(interleave, "interleave")
        pipes: list[tuple[Schedule, int]] = []
        for s in scheds:
            if s.v_shape:  # two stages per rank, whatever the interleave
                pipes.append((s, 2))
            elif s.multi_stage:
                vs = [v for v in virtual if v > 1]
                if not vs:
                    raise LayoutError(f"the {s.value} schedule needs an interleave above 1; got {list(virtual)}")
                pipes.extend((s, v) for v in vs)
            else:
                pipes.append((s, 1))
        if not (mbs and recs and pipes):
            raise LayoutError("every searched knob needs at least one value")
        rows = list(itertools.product(mbs, recs, pipes))
        rec_index = {r: i for i, r in enumerate(Recompute)}
        sched_index = {s: i for i, s in enumerate(Schedule)}
        return cls(
            micro_batch=_frozen(np.array([m for m, _, _ in rows], dtype=np.int64)),
            recompute=_frozen(np.array([rec_index[r] for _, r, _ in rows], dtype=np.int8)),
            schedule=_frozen(np.array([sched_index[p[0]] for _, _, p in rows], dtype=np.int8)),
            interleave=_frozen(np.array([p[1] for _, _, p in rows], dtype=np.int64)),
        )

    def __len__(self) -> int:
        return len(self.micro_batch)

    def row(self, k: int) -> Knobs:
        return Knobs(
            micro_batch=int(self.micro_batch[k]),
            recompute=list(Recompute)[self.recompute[k]],
            schedule=list(Schedule)[self.schedule[k]],
            interleave=int(self.interleave[k]),
        )

    def rows(self) -> list[Knobs]:
        return [self.row(k) for k in range(len(self))]


def _unique(values: Iterable) -> list:
    return list(dict.fromkeys(values))


def _unique_positive(values: Iterable[int], what: str) -> list[int]:
    out = _unique(values)
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise LayoutError(f"every {what} must be a positive integer, got {v!r}")
    return [int(v) for v in out]


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)  # arrays: compared by identity
class Space:
    """Degree rows × orders × knob rows; see the module docstring for the layout."""

    world_size: int
    strategies: tuple[Axis, ...]
    """The strategies searched (``--strategies``), in :data:`AXES` order."""
    fixed: Mapping[Axis, int]
    """Degrees the user fixed (``--tp 8``); every row honours them."""
    degrees: np.ndarray
    """int64 ``(D, 6)``: the degree of each axis (columns :data:`AXES`) per row."""
    n_orders: np.ndarray
    """int64 ``(D,)``: ``t!`` orders of the row's ``t`` used axes."""
    offsets: np.ndarray
    """int64 ``(D + 1,)``: first layout id of each row; ``offsets[-1]`` layouts in all."""
    knobs: KnobTable = field(default_factory=KnobTable.product)

    @property
    def n_layouts(self) -> int:
        """Layouts (degrees × orders), without the knob rows."""
        return int(self.offsets[-1])

    @property
    def size(self) -> int:
        """Everything the search scores: layouts × knob rows."""
        return self.n_layouts * len(self.knobs)

    def layout_index(self) -> tuple[np.ndarray, np.ndarray]:
        """Every layout as (row, permutation index) int arrays of length :attr:`n_layouts`."""
        rows = np.repeat(np.arange(len(self.degrees), dtype=np.int32), self.n_orders)
        perm = np.arange(self.n_layouts, dtype=np.int64) - np.repeat(self.offsets[:-1], self.n_orders)
        return rows, perm.astype(np.int16 if self.n_orders.max(initial=1) < 2**15 else np.int32)

    def used_axes(self, row: int) -> tuple[Axis, ...]:
        """The axes of degree above 1 in ``row``, in :data:`AXES` order."""
        return tuple(a for a, d in zip(AXES, self.degrees[row], strict=True) if d > 1)

    def order(self, row: int, perm: int) -> tuple[Axis, ...]:
        """The used axes of ``row`` in permutation ``perm``, fastest first."""
        used = self.used_axes(row)
        return tuple(used[i] for i in permutations(len(used))[perm])

    def layout(self, index: int) -> tuple[Layout, Knobs]:
        """The layout and knobs of flat index ``index`` in ``range(self.size)`` (layout-major)."""
        if not 0 <= index < self.size:
            raise LayoutError(f"layout index {index} is outside the space of {self.size}")
        i, k = divmod(index, len(self.knobs))
        row = int(np.searchsorted(self.offsets, i, side="right")) - 1
        degrees = {a.value: int(d) for a, d in zip(AXES, self.degrees[row], strict=True)}
        lay = Layout(**degrees, order=self.order(row, i - int(self.offsets[row])))
        return lay, self.knobs.row(k)


def enumerate_space(
    world_size: int,
    *,
    strategies: Sequence[str | Axis] | None = None,
    fixed: Mapping[str | Axis, int] | None = None,
    knobs: KnobTable | None = None,
) -> Space:
    """Every layout of ``world_size`` ranks over ``strategies`` (default all six axes) whose
    degrees match ``fixed``; a fixed degree of 1 removes its axis from the search.

    Raises :class:`LayoutError` when the constraints leave no layout (a fixed degree that
    does not divide the world, or an axis fixed above 1 but not among the strategies).

    >>> sp = enumerate_space(16, strategies=["tp", "pp", "dp_shard"], fixed={"tp": 4})
    >>> sp.degrees[:, [COLUMN[Axis.DP_SHARD], COLUMN[Axis.TP], COLUMN[Axis.PP]]].tolist()
    [[4, 4, 1], [1, 4, 4], [2, 4, 2]]
    >>> sp.n_orders.tolist(), sp.n_layouts
    ([2, 2, 6], 10)
    >>> [a.value for a in sp.order(2, 3)]
    ['tp', 'pp', 'dp_shard']
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise LayoutError(f"the world size must be a positive integer, got {world_size!r}")
    chosen = set(AXES) if strategies is None else {Axis.parse(s) for s in strategies}
    if not chosen:
        raise LayoutError("--strategies names no parallel axis; give at least one, e.g. dp_shard")
    pinned: dict[Axis, int] = {}
    for name, degree in (fixed or {}).items():
        axis = Axis.parse(name)
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise LayoutError(f"the fixed degree of {axis.value} must be a positive integer, got {degree!r}")
        if degree > 1 and axis not in chosen:
            names = ",".join(a.value for a in AXES if a in chosen)
            raise LayoutError(f"{axis.value} is fixed to {degree} but is not among the strategies ({names})")
        pinned[axis] = degree
    pinned_product = math.prod(pinned.values())
    if world_size % pinned_product:
        shown = " × ".join(f"{a.value}={d}" for a, d in pinned.items() if d > 1)
        raise LayoutError(f"the fixed degrees {shown} ({pinned_product} ranks) do not divide the world of {world_size}")
    free = [a for a in AXES if a in chosen and a not in pinned]
    rest = world_size // pinned_product

    base = np.ones(len(AXES), dtype=np.int64)
    for a, d in pinned.items():
        base[COLUMN[a]] = d
    blocks = []
    for t in range(min(len(free), max(rest.bit_length() - 1, 0)) + 1):
        factors = ordered_factorizations(rest, t)
        if not len(factors):
            continue
        for combo in itertools.combinations(free, t):
            block = np.broadcast_to(base, (len(factors), len(AXES))).copy()
            block[:, [COLUMN[a] for a in combo]] = factors
            blocks.append(block)
    degrees = np.concatenate(blocks) if blocks else np.empty((0, len(AXES)), dtype=np.int64)
    n_used = (degrees > 1).sum(axis=1)
    n_orders = np.array([math.factorial(t) for t in range(len(AXES) + 1)], dtype=np.int64)[n_used]
    offsets = np.zeros(len(degrees) + 1, dtype=np.int64)
    np.cumsum(n_orders, out=offsets[1:])
    return Space(
        world_size=world_size,
        strategies=tuple(a for a in AXES if a in chosen),
        fixed=dict(pinned),
        degrees=_frozen(degrees),
        n_orders=_frozen(n_orders),
        offsets=_frozen(offsets),
        knobs=knobs if knobs is not None else KnobTable.product(),
    )
