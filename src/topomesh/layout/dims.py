"""Parallel axes and a :class:`Layout`: the degree of each axis and which varies fastest.

A layout splits a world of ``world_size`` ranks into a grid whose axes are the parallel
dimensions of training:

========================  =============================================================
axis                      meaning
========================  =============================================================
``dp_replicate``          data parallel, replicated weights (DDP; HSDP's replicate dim)
``dp_shard``              data parallel, sharded weights (FSDP / ZeRO; HSDP's shard dim)
``cp``                    context parallel (sequence split across ranks in attention)
``tp``                    tensor parallel (Megatron column/row split; sequence parallel)
``pp``                    pipeline parallel (layers split into stages)
``ep``                    expert parallel (MoE experts split across ranks)
========================  =============================================================

Here every axis is its own factor of the world: ``world_size`` is the product of all six
degrees. (Frameworks that fold EP into ``dp_shard × cp``, as torchtitan does, are not
modelled: give such a layout with ``ep=1`` and split experts over the dp groups yourself.)

The ``order`` lists the axes fastest first, as in Megatron-LM's ``order="tp-cp-ep-dp-pp"``:
the first axis varies fastest along the logical rank, so with the default order and
``tp=2, pp=2`` logical ranks 0 and 1 are one TP group. Which *physical* rank holds each
logical position is the placement's business (:mod:`topomesh.layout.place`).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from topomesh.errors import LayoutError


class Axis(StrEnum):
    """A parallel mesh axis (``axis`` = mesh axis; ``dim`` is kept for tensor dims)."""

    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"
    PP = "pp"
    EP = "ep"

    @classmethod
    def parse(cls, text: str | Axis) -> Axis:
        """Parse an axis name; ``dp`` is accepted for ``dp_replicate``.

        >>> Axis.parse("TP"), Axis.parse("dp")
        (<Axis.TP: 'tp'>, <Axis.DP_REPLICATE: 'dp_replicate'>)
        """
        if isinstance(text, Axis):
            return text
        key = str(text).strip().lower().replace("-", "_")
        if key == "dp":
            return cls.DP_REPLICATE
        try:
            return cls(key)
        except ValueError:
            names = ", ".join(a.value for a in cls)
            raise LayoutError(f"unknown parallel axis {text!r}; the axes are {names} (and dp)") from None


MAX_DEGREE = 1 << 20
"""The largest degree of one axis: the largest world topomesh handles (1,048,576 ranks, the
compact file form's limit)."""

_DECIMAL = re.compile(r"(?:0|[1-9][0-9]{0,17})")
"""Plain ASCII decimal digits, no sign, underscore or leading zero, at most 18 of them."""


def parse_decimal(text: str) -> int | None:
    """``text`` as a whole number when it is plain ASCII decimal digits, else None.

    Python's ``int()`` also reads ``+4``, ``4_0`` (as 40), `` 4 `` and digits of other
    scripts (``٤``); a degree, a count or a size written any of those ways is a typo or a
    trick, and is refused instead of read as something else.

    >>> parse_decimal("40"), parse_decimal("0")
    (40, 0)
    >>> [parse_decimal(t) for t in ("+4", "4_0", "\u0664", "04", "-1", "", "4.0")]
    [None, None, None, None, None, None, None]
    """
    return int(text) if isinstance(text, str) and _DECIMAL.fullmatch(text) else None


def parse_degrees(text: str, *, allow_rest: bool = False) -> dict[str, int]:
    """A layout written as ``AXIS=DEGREE`` pairs, as every command's ``--layout`` takes it.

    Axis names are normalized (``dp`` is ``dp_replicate``). A degree is plain ASCII digits
    (:func:`parse_decimal`) from 1 to :data:`MAX_DEGREE`; with ``allow_rest`` one degree may
    be ``-1``: the rest of the world (:func:`topomesh.layout.api.resolve_layout`). Spaces
    around entries are allowed, empty entries (``tp=2,,pp=2``) are not.

    >>> parse_degrees("tp=8, dp=2")
    {'tp': 8, 'dp_replicate': 2}
    >>> parse_degrees("tp=2,dp_shard=-1", allow_rest=True)
    {'tp': 2, 'dp_shard': -1}
    """
    parts = [x.strip() for x in str(text).split(",")]
    if not any(parts):
        raise LayoutError(f"the layout {text!r} has no AXIS=DEGREE pairs; write e.g. tp=8,pp=2")
    out: dict[str, int] = {}
    for part in parts:
        if not part:
            raise LayoutError(f"the layout {text!r} has an empty entry (two commas in a row, or one at an "
                              "end); write e.g. tp=8,pp=2")
        name, eq, degree = part.partition("=")
        degree = degree.strip()
        value = -1 if allow_rest and degree == "-1" else parse_decimal(degree)
        if not eq or value is None or value == 0:
            want = "a positive integer" + (" or -1 (the rest)" if allow_rest else "")
            raise LayoutError(f"layout entry {part!r} is not AXIS=DEGREE with {want} as the degree, written in "
                              "plain ASCII digits (no sign, underscore or leading zero)")
        if value > MAX_DEGREE:
            raise LayoutError(f"layout entry {part!r}: the degree {value} is more than {MAX_DEGREE}, the largest "
                              "world topomesh handles")
        axis = Axis.parse(name).value
        if axis in out:
            raise LayoutError(f"the degree of {axis} is given twice in the layout {text!r}")
        out[axis] = value
    return out


def merge_degrees(flags: Mapping[str, int], spec: Mapping[str, int], *, unset: int = 1) -> dict[str, int]:
    """Per-axis flags (``--tp 8``) and a ``--layout`` spec together; an axis set both ways
    with different degrees is an error. Flags equal to ``unset`` count as not given.

    >>> merge_degrees({"tp": 8, "pp": 1}, {"pp": 2})
    {'tp': 8, 'pp': 2}
    """
    out = dict(flags)
    for axis, degree in spec.items():
        flag = out.get(axis, unset)
        if flag != unset and flag != degree:
            raise LayoutError(f"{axis} is {flag} by its flag but {degree} in --layout; give it once")
        out[axis] = degree
    return out


_AXIS_NAMES: tuple[str, ...] = tuple(a.value for a in Axis)
_NAMES: dict[Axis, str] = {a: a.value for a in Axis}
"""Each axis's field name; a plain string equal to one finds it too (an Axis is a str)."""

DEFAULT_ORDER: tuple[Axis, ...] = (
    Axis.TP,
    Axis.CP,
    Axis.EP,
    Axis.DP_SHARD,
    Axis.DP_REPLICATE,
    Axis.PP,
)
"""Fastest first, as Megatron's default ``tp-cp-ep-dp-pp``: model-parallel axes that talk
every layer innermost (on NVLink), pipeline outermost (point-to-point, across hosts)."""


def parse_order(order: str | Iterable[str | Axis]) -> tuple[Axis, ...]:
    """An order from ``"tp-cp-dp_shard-pp"`` (or ``,``/space separated) or a sequence.

    Axes left out are appended in :data:`DEFAULT_ORDER` order, so ``"pp-tp"`` makes PP
    fastest and TP second and keeps the rest where they were. Unknown and repeated axes
    raise :class:`LayoutError`.

    >>> [a.value for a in parse_order("pp-tp")]
    ['pp', 'tp', 'cp', 'ep', 'dp_shard', 'dp_replicate']
    """
    if type(order) is tuple and all(type(a) is Axis for a in order):
        return _complete_order(order)  # the common case (layouts built in a search): memoized
    if isinstance(order, str):
        parts = [p for p in order.replace(",", " ").replace("-", " ").split() if p]
    else:
        parts = list(order)
    return _complete_order(tuple(Axis.parse(p) for p in parts), tuple(parts))


@functools.lru_cache(maxsize=8192)
def _complete_order(axes: tuple[Axis, ...], parts: Sequence[str | Axis] | None = None) -> tuple[Axis, ...]:
    if parts is None:
        parts = axes
    seen: set[Axis] = set()
    for a in axes:
        if a in seen:
            raise LayoutError(f"axis {a.value!r} appears twice in the order {_show_order(parts)}")
        seen.add(a)
    return tuple(axes) + tuple(a for a in DEFAULT_ORDER if a not in seen)


def _show_order(parts: Sequence[str | Axis]) -> str:
    return "-".join(str(p) for p in parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """Degrees of the parallel axes and the order in which they vary.

    >>> lay = Layout(tp=2, pp=2)
    >>> lay.world_size, lay.mesh_axes, lay.mesh_shape
    (4, (<Axis.PP: 'pp'>, <Axis.TP: 'tp'>), (2, 2))
    """

    dp_replicate: int = 1
    """Replicated data-parallel degree (DDP, or the replicate dim of HSDP)."""
    dp_shard: int = 1
    """Sharded data-parallel degree (FSDP / ZeRO, or the shard dim of HSDP)."""
    cp: int = 1
    """Context-parallel degree."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (number of stages)."""
    ep: int = 1
    """Expert-parallel degree."""
    order: tuple[Axis, ...] = DEFAULT_ORDER
    """Every axis once, fastest-varying first."""

    def __post_init__(self) -> None:
        for name in _AXIS_NAMES:
            d = getattr(self, name)
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise LayoutError(f"{name} must be a positive integer degree, got {d!r}")
        object.__setattr__(self, "order", parse_order(self.order))

    @classmethod
    def from_degrees(
        cls, degrees: Mapping[str | Axis, int] | None = None, *, order: str | Iterable[str | Axis] | None = None, **kw: int
    ) -> Layout:
        """Build from ``{"tp": 8, "pp": 2}`` and/or keywords; unknown axes raise.

        >>> Layout.from_degrees({"tp": 2}, pp=2, order="tp-pp").world_size
        4
        """
        merged: dict[Axis, int] = {}
        for k, v in [*(degrees or {}).items(), *kw.items()]:
            a = Axis.parse(k)
            if a in merged:
                raise LayoutError(f"the degree of {a.value} is given twice ({merged[a]} and {v})")
            merged[a] = v
        extra = {"order": parse_order(order)} if order is not None else {}
        return cls(**{a.value: d for a, d in merged.items()}, **extra)

    def degree(self, axis: Axis | str) -> int:
        name = _NAMES.get(axis) if isinstance(axis, str) else None
        return int(getattr(self, name or Axis.parse(axis).value))

    @property
    def world_size(self) -> int:
        return math.prod(self.degree(a) for a in Axis)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Degrees in ``order``, fastest first (Megatron's ``parallel_size``)."""
        return tuple(self.degree(a) for a in self.order)

    @property
    def mesh_axes(self) -> tuple[Axis, ...]:
        """Axes with degree > 1, slowest first: the dims of a DeviceMesh (last varies fastest).

        A layout of one rank gives the fastest axis, so a mesh always has one dim.
        """
        active = tuple(a for a in reversed(self.order) if self.degree(a) > 1)
        return active or (self.order[0],)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.degree(a) for a in self.mesh_axes)

    def describe(self) -> str:
        """Short form, fastest first, e.g. ``tp=8 pp=2``; ``1 rank`` for the trivial one."""
        parts = [f"{a.value}={self.degree(a)}" for a in self.order if self.degree(a) > 1]
        return " ".join(parts) or "1 rank"

    def order_text(self) -> str:
        return "-".join(a.value for a in self.order)

    def check_world(self, world_size: int) -> None:
        """Raise unless the degrees multiply to ``world_size``."""
        if self.world_size != world_size:
            prod = " × ".join(f"{a.value}={self.degree(a)}" for a in self.order if self.degree(a) > 1) or "1"
            raise LayoutError(
                f"the layout needs {self.world_size} ranks ({prod}) but the world has {world_size}"
            )

    def check_model(
        self,
        *,
        n_heads: int | None = None,
        n_kv_heads: int | None = None,
        n_layers: int | None = None,
        n_experts: int | None = None,
        seq_len: int | None = None,
        global_batch: int | None = None,
    ) -> None:
        """Raise :class:`LayoutError` when a degree does not divide what it splits.

        ``tp`` splits heads (and KV heads), ``pp`` layers, ``ep`` experts, ``cp`` the
        sequence (in 2·cp chunks for load-balanced causal attention, as torch's
        context_parallel does), and the data-parallel degrees the global batch.
        """
        checks: list[tuple[str, int | None, int, str]] = [
            ("tp", n_heads, self.tp, "attention heads"),
            ("tp", n_kv_heads, self.tp, "KV heads"),
            ("pp", n_layers, self.pp, "layers"),
            ("ep", n_experts, self.ep, "experts"),
            ("cp", seq_len, 2 * self.cp if self.cp > 1 else 1, "sequence chunks (2·cp)"),
            ("dp", global_batch, self.dp_replicate * self.dp_shard, "samples of the global batch"),
        ]
        for name, count, deg, what in checks:
            if count is None or deg == 1:
                continue
            if count % deg:
                shown = f"{name}={self.degree(name) if name != 'dp' else deg}"
                raise LayoutError(f"{shown} does not divide the {count} {what} (needs a multiple of {deg})")

    def to_dict(self) -> dict[str, object]:
        """Stable JSON form: every degree and the order."""
        return {**{a.value: self.degree(a) for a in Axis}, "order": [a.value for a in self.order]}
