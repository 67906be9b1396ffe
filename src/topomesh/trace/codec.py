"""Traces as plain JSON, read back strictly: the only format a trace is stored in.

:func:`to_json` and :func:`from_json` walk a frozen dataclass by its type hints (``int``,
``float``, ``str``, ``bool``, a ``StrEnum``, ``X | None``, ``tuple[X, ...]``, fixed tuples,
nested dataclasses, a union of dataclasses tagged by ``"type"``, and the free-form scalar
``args`` of an op), so a field added to :class:`~topomesh.trace.result.Trace` or a record is
stored without a second list of fields to keep in step. Nothing in the format can run code
(the trace cache used pickle before :data:`topomesh.trace.cache.TRACE_FORMAT` 3).

Reading is strict: every value must have its field's type (``true`` is not an integer),
integers lie in ``[0, 2**63)``, floats are finite and non-negative, strings are at most
:data:`MAX_STR` characters without control characters, lists hold at most
:data:`MAX_ITEMS` items, unknown keys are refused, and per-class checks reject records no
tracer writes (a tensor with more than 64 dimensions or 2**50 elements, a collective over
no ranks, a trace composed to fewer layers than it traced). A violation raises
:class:`~topomesh.errors.TraceError` naming the place (``trace.segments[3].events[7].flops``).
Non-finite floats inside ``args`` (``-inf`` fill values) are written as ``{"float": "-inf"}``
so the JSON itself stays standard (no ``NaN``/``Infinity`` literals).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import operator
import re
import types
import typing
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from topomesh.errors import TraceError
from topomesh.trace.graph import CollectiveRecord, TensorMeta
from topomesh.trace.result import Trace

MAX_INT = 2**63 - 1
"""Largest integer accepted anywhere (FLOPs, bytes, sizes): an int64, as torch stores them."""
MAX_STR = 1000
"""Longest string accepted (op names, dtypes, axis names, model keys)."""
MAX_ITEMS = 10_000_000
"""Longest list accepted (records of a segment, dims of a shape...)."""
MAX_ARGS_DEPTH = 8
MAX_ARGS_ITEMS = 2**20
"""Longest list in an op's scalar arguments: ``aten.cat`` holds a slot per input tensor, and
FSDP2 concatenates one piece per shard rank (8,192 in a 16,384-GPU search)."""
"""Deepest nesting of an op's scalar arguments (lists of lists of ints)."""
MAX_DIMS = 64
MAX_NUMEL = 2**50
"""Most elements of one tensor (2**50 bf16 elements are 2 PiB: no device holds that)."""
MAX_GROUP = 2**24
"""Most ranks in one collective's group."""

_NONFINITE = MappingProxyType({"inf": math.inf, "-inf": -math.inf, "nan": math.nan})


def _check_tensor(t: TensorMeta) -> str | None:
    if len(t.shape) > MAX_DIMS or len(t.stride) != len(t.shape):
        return f"shape {list(t.shape)} and stride {list(t.stride)} must have the same length, at most {MAX_DIMS}"
    if math.prod(t.shape) > MAX_NUMEL:
        return f"shape {list(t.shape)} has more than {MAX_NUMEL} elements"
    return None


def _check_collective(c: CollectiveRecord) -> str | None:
    return None if 1 <= c.group_size <= MAX_GROUP else f"group_size {c.group_size} is not in [1, {MAX_GROUP}]"


def _check_trace(t: Trace) -> str | None:
    if not 1 <= t.traced_layers <= t.n_layers or t.batch_size < 1:
        return (f"traced_layers {t.traced_layers}, n_layers {t.n_layers} and batch_size {t.batch_size} must "
                "satisfy 1 <= traced_layers <= n_layers and batch_size >= 1")
    if any(d < 1 for _, d in t.layout):
        return f"layout {list(t.layout)} has a degree below 1"
    return None


_CHECKS: Mapping[type, Callable[[Any], str | None]] = MappingProxyType(
    {TensorMeta: _check_tensor, CollectiveRecord: _check_collective, Trace: _check_trace}
)
"""Checks a record must pass beyond its field types; a message says what is wrong."""


@functools.cache
def _hints(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    """(name, resolved type, required) for each init field of dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (f.name, hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in dataclasses.fields(cls)
        if f.init
    )


def _union_members(tp: Any) -> tuple[Any, ...] | None:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return typing.get_args(tp)
    return None


def to_json(value: Any, tp: Any = None) -> Any:
    """``value`` (a dataclass, or of type ``tp``) as JSON-ready lists, dicts and scalars."""
    return _encoder(type(value) if tp is None else tp)(value)


@functools.cache
def _encoder(tp: Any) -> Callable[[Any], Any]:
    """The function :func:`to_json` applies for type ``tp``, built once per type (writing a
    trace walks thousands of records; resolving type hints per value took a tenth of a trace)."""
    members = _union_members(tp)
    if members is not None:
        return _union_encoder(members)
    if dataclasses.is_dataclass(tp):
        hints = _hints(tp)
        names = tuple(name for name, _, _ in hints)
        encs = tuple(None if hint in (int, str, bool) else _encoder(hint) for _, hint, _ in hints)
        get = operator.attrgetter(*names) if len(names) > 1 else (lambda v: tuple(getattr(v, n) for n in names))
        return lambda value: {n: v if e is None else e(v) for n, v, e in zip(names, get(value), encs, strict=True)}
    if tp is tuple:
        return _args_to_json
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            if args[0] in (int, str, bool):
                return list
            each = _encoder(args[0])
            return lambda value: [each(v) for v in value]
        encs = [_encoder(a) for a in args]
        return lambda value: [enc(v) for v, enc in zip(value, encs, strict=True)]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return lambda value: value.value
    if tp in (int, str, bool):
        return lambda value: value
    if tp is float:
        return float
    raise TypeError(f"to_json: unsupported field type {tp!r}")


def _union_encoder(members: tuple[Any, ...]) -> Callable[[Any], Any]:
    tagged = sum(dataclasses.is_dataclass(m) for m in members) > 1
    choices = [m for m in members if m is not type(None)]

    def encode(value: Any) -> Any:
        if value is None:
            return None
        (match,) = [m for m in choices if isinstance(value, m)] or [type(value)]
        out = _encoder(match)(value)
        return {"type": match.__name__, **out} if tagged else out

    return encode


def _args_to_json(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_args_to_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    return value


def from_json(tp: Any, raw: Any, where: str = "$") -> Any:
    """The value of type ``tp`` that ``raw`` (parsed JSON) stands for; :class:`TraceError`
    naming ``where`` (a JSON path) when ``raw`` is not exactly that.

    Each type gets a decoder built once (:func:`_decoder`), so reading a trace does not walk
    type hints per value; paths are kept as ``(parent, key)`` pairs and spelled out only in
    an error."""
    return _decoder(tp)(raw, where)


Path = Any
"""A JSON path: a string (the root) or ``(parent path, field name or list index)``."""


def _where(path: Path) -> str:
    keys = []
    while isinstance(path, tuple):
        path, key = path
        keys.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return str(path) + "".join(reversed(keys))


@functools.cache
def _decoder(tp: Any) -> Callable[[Any, Path], Any]:
    members = _union_members(tp)
    if members is not None:
        return _union_decoder(members)
    if dataclasses.is_dataclass(tp):
        return _dataclass_decoder(tp)
    if tp is tuple:
        return lambda raw, path: _args_from_json(raw, path, 0)
    if typing.get_origin(tp) is tuple:
        return _tuple_decoder(typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_decoder(tp)
    if tp in _SCALARS:
        return _SCALARS[tp]
    raise TypeError(f"from_json: unsupported field type {tp!r}")


def _union_decoder(members: tuple[Any, ...]) -> Callable[[Any, Path], Any]:
    optional = type(None) in members
    classes = [m for m in members if dataclasses.is_dataclass(m)]
    if len(classes) > 1:
        by_name = {c.__name__: _decoder(c) for c in classes}
        names = [c.__name__ for c in classes]

        def tagged(raw: Any, path: Path) -> Any:
            if raw is None and optional:
                return None
            if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
                raise TraceError(f"{_where(path)}: expected an object with a 'type' of {names}")
            dec = by_name.get(raw["type"])
            if dec is None:
                raise TraceError(f"{_where(path)}.type: {raw['type'][:40]!r} is not one of {sorted(by_name)}")
            return dec({k: v for k, v in raw.items() if k != "type"}, path)

        return tagged
    (inner,) = [m for m in members if m is not type(None)]
    dec = _decoder(inner)
    if not optional:
        return dec
    return lambda raw, path: None if raw is None else dec(raw, path)


def _dataclass_decoder(cls: type) -> Callable[[Any, Path], Any]:
    fields = [(name, _decoder(hint), required) for name, hint, required in _hints(cls)]
    names = frozenset(name for name, _, _ in fields)
    check = _CHECKS.get(cls)

    def decode(raw: Any, path: Path) -> Any:
        if type(raw) is not dict:
            raise TraceError(f"{_where(path)}: expected an object for {cls.__name__}, got {type(raw).__name__}")
        if not names.issuperset(raw):
            raise TraceError(f"{_where(path)}: unknown keys {sorted(set(raw) - names)[:5]} for {cls.__name__}")
        values = {}
        for name, dec, required in fields:
            if name in raw:
                values[name] = dec(raw[name], (path, name))
            elif required:
                raise TraceError(f"{_where(path)}: {cls.__name__} needs the key {name!r}")
        try:
            obj = cls(**values)
        except (TypeError, ValueError) as exc:
            raise TraceError(f"{_where(path)}: not a valid {cls.__name__} ({exc})") from None
        problem = check(obj) if check else None
        if problem:
            raise TraceError(f"{_where(path)}: {problem}")
        return obj

    return decode


_INT = {int}


def _tuple_decoder(args: tuple[Any, ...]) -> Callable[[Any, Path], Any]:
    def listed(raw: Any, path: Path) -> None:
        if type(raw) is not list or len(raw) > MAX_ITEMS:
            raise TraceError(f"{_where(path)}: expected a list of at most {MAX_ITEMS} items")

    if len(args) == 2 and args[1] is Ellipsis:
        if args[0] is int:  # shapes and strides: checked in one pass
            def ints(raw: Any, path: Path) -> tuple[int, ...]:
                if type(raw) is list and len(raw) <= MAX_ITEMS and (
                        not raw or (set(map(type, raw)) == _INT and min(raw) >= 0 and max(raw) <= MAX_INT)):
                    return tuple(raw)
                listed(raw, path)
                for i, v in enumerate(raw):
                    _int(v, (path, i))
                return tuple(raw)

            return ints
        dec = _decoder(args[0])

        def each(raw: Any, path: Path) -> tuple:
            listed(raw, path)
            return tuple([dec(v, (path, i)) for i, v in enumerate(raw)])

        return each
    decs = [_decoder(a) for a in args]

    def fixed(raw: Any, path: Path) -> tuple:
        listed(raw, path)
        if len(raw) != len(decs):
            raise TraceError(f"{_where(path)}: expected a list of {len(decs)} items, got {len(raw)}")
        return tuple(d(v, (path, i)) for i, (v, d) in enumerate(zip(raw, decs, strict=True)))

    return fixed


def _enum_decoder(tp: type[enum.Enum]) -> Callable[[Any, Path], Any]:
    members = {m.value: m for m in tp}

    def decode(raw: Any, path: Path) -> Any:
        m = members.get(raw) if type(raw) is str else None
        if m is None:
            try:
                return tp(raw)
            except (ValueError, TypeError):
                raise TraceError(f"{_where(path)}: {str(raw)[:40]!r} is not one of {list(members)}") from None
        return m

    return decode


def _int(raw: Any, path: Path) -> int:
    if type(raw) is not int or not 0 <= raw <= MAX_INT:
        raise TraceError(f"{_where(path)}: expected an integer from 0 to 2**63-1, got {_show(raw)}")
    return raw


def _float(raw: Any, path: Path) -> float:
    if type(raw) not in (int, float) or not math.isfinite(raw) or raw < 0:
        raise TraceError(f"{_where(path)}: expected a finite non-negative number, got {_show(raw)}")
    return float(raw)


def _bool(raw: Any, path: Path) -> bool:
    if type(raw) is not bool:
        raise TraceError(f"{_where(path)}: expected true or false, got {_show(raw)}")
    return raw


_PRINTABLE = re.compile(r"[^\x00-\x1f\x7f]*")


def _str(raw: Any, path: Path) -> str:
    if type(raw) is not str or len(raw) > MAX_STR or not _PRINTABLE.fullmatch(raw):
        raise TraceError(f"{_where(path)}: expected a string of at most {MAX_STR} printable characters, got {_show(raw)}")
    return raw


_SCALARS: Mapping[type, Callable[[Any, Path], Any]] = MappingProxyType({int: _int, float: _float, bool: _bool, str: _str})


def _show(raw: Any) -> str:
    """A short, printable form of a bad value for a message."""
    if type(raw) is int:
        return str(raw) if raw.bit_length() < 128 else f"an integer of {raw.bit_length()} bits"
    return ascii(raw)[:40]


def _args_from_json(raw: Any, path: Path, depth: int) -> Any:
    if isinstance(raw, list):
        if depth >= MAX_ARGS_DEPTH or len(raw) > MAX_ARGS_ITEMS:
            raise TraceError(f"{_where(path)}: op arguments nested deeper than {MAX_ARGS_DEPTH} or longer than "
                             f"{MAX_ARGS_ITEMS}")
        return tuple(_args_from_json(v, (path, i), depth + 1) for i, v in enumerate(raw))
    if isinstance(raw, dict):
        if set(raw) == {"float"} and raw["float"] in _NONFINITE:
            return _NONFINITE[raw["float"]]
        raise TraceError(f"{_where(path)}: an op argument object must be {{'float': 'inf' | '-inf' | 'nan'}}")
    if type(raw) is int and abs(raw) > MAX_INT + 1:
        raise TraceError(f"{_where(path)}: integer argument {_show(raw)} is outside int64")
    if type(raw) is float and not math.isfinite(raw):
        raise TraceError(f"{_where(path)}: non-finite argument must be written as {{'float': ...}}")
    if type(raw) is str:
        return _str(raw, path)
    if raw is None or type(raw) in (int, float, bool):
        return raw
    raise TraceError(f"{_where(path)}: unsupported op argument {_show(raw)}")


MAX_RECORDS = 1_000_000
"""Most distinct records in one stored trace."""


def trace_to_json(trace: Trace) -> dict:
    """``trace`` with each distinct record stored once: ``{"records": [...], "trace": {...}}``
    where every segment's ``events`` and ``prefetch`` list indices into ``records``. A trace
    repeats few records many times (14,183 events, 445 distinct, in a 70B context-parallel
    trace), so this reads about that much faster than :func:`to_json` of the whole trace."""
    from topomesh.trace.result import Event

    table: dict[Any, int] = {}
    segments = []
    for seg in trace.segments:
        raw = to_json(dataclasses.replace(seg, events=(), prefetch=()))
        raw["events"] = [table.setdefault(e, len(table)) for e in seg.events]
        raw["prefetch"] = [table.setdefault(e, len(table)) for e in seg.prefetch]
        segments.append(raw)
    doc = to_json(dataclasses.replace(trace, segments=()))
    doc["segments"] = segments
    return {"records": [to_json(e, Event) for e in table], "trace": doc}


def trace_from_json(raw: Any, where: str = "$") -> Trace:
    """The trace :func:`trace_to_json` wrote, checked as strictly as :func:`from_json` (each
    record once, then every index: an integer within ``records``)."""
    from topomesh.trace.result import Event, Segment

    if type(raw) is not dict or set(raw) != {"records", "trace"}:
        raise TraceError(f"{where}: expected an object with exactly 'records' and 'trace'")
    records, doc = raw["records"], raw["trace"]
    if type(records) is not list or len(records) > MAX_RECORDS:
        raise TraceError(f"{where}.records: expected a list of at most {MAX_RECORDS} records")
    event = _decoder(Event)
    table = [event(r, ((where, "records"), i)) for i, r in enumerate(records)]
    if type(doc) is not dict or type(doc.get("segments")) is not list or len(doc["segments"]) > MAX_ITEMS:
        raise TraceError(f"{where}.trace: expected an object with a list of segments")
    segment = _decoder(Segment)
    segments = []
    for i, s in enumerate(doc["segments"]):
        path = (((where, "trace"), "segments"), i)
        if type(s) is not dict:
            raise TraceError(f"{_where(path)}: expected an object for Segment, got {type(s).__name__}")
        picked = {}
        for name in ("events", "prefetch"):
            idx = s.get(name, [])
            if type(idx) is not list or len(idx) > MAX_ITEMS or not all(
                    type(k) is int and 0 <= k < len(table) for k in idx):
                raise TraceError(f"{_where((path, name))}: expected a list of record indices below {len(table)}")
            picked[name] = tuple(table[k] for k in idx)
        seg = segment({**s, "events": [], "prefetch": []}, path)
        segments.append(dataclasses.replace(seg, **picked))
    trace = _decoder(Trace)({**doc, "segments": []}, (where, "trace"))
    return dataclasses.replace(trace, segments=tuple(segments))
