"""Format v0.1 of PyTorch's topology RFC (``WORLD_TOPOLOGY_FILE``), dense form.

Written exactly as the RFC's later text shows it::

    {"version": "0.1",
     "ranks": {"0": {"peers": {"1": {"connection": {
         "type": "NVLink",
         "latency": {"value": "0.6", "measurement": "us"},
         "bandwidth": {"value": "370.8", "measurement": "GB/s"},
         "channels": {"count": "18"}}}}}}}

Values are strings. The RFC asks for named properties so files can grow; topomesh adds
``pcie_class`` (PIX…SYS) and ``source`` (``measured``/``default``) to a connection,
``host``/``local_rank``/``device`` to a rank, and ``world_size``, ``run_id``,
``restart_count``, ``generator`` and ``hosts`` (each host's devices, NICs and paths) at
the top. Readers that know only the RFC ignore them.

The reader accepts both published variants (``channels.value`` without ``type``, and
``channels.count`` with it), numbers where strings are expected, and the units ``ns``,
``us``, ``ms``, ``s`` and ``GB/s``, ``GiB/s``, ``MB/s``, ``Gb/s`` (also ``Gb/sec``, bits as
InfiniBand's sysfs writes them), ``Mb/s``. A pair may be
listed in one direction or both; listed in both, the two must describe the same
connection (topomesh's model, like NCCL's, has one connection per pair), else the file is
refused naming both places. Rank keys are decimal digits exactly; ``world_size``,
``local_rank`` (below the world size) and ``restart_count`` are whole numbers.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Mapping
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from topomesh.errors import TopologyError
from topomesh.topology.build import _Matrices, _Palette
from topomesh.topology.defaults import default_connection, loc_connection
from topomesh.topology.model import (
    Connection,
    ConnectionTable,
    Host,
    LinkKind,
    RankInfo,
    Topology,
)

VERSION = "0.1"
GENERATOR = "topomesh"

_LATENCY_TO_US = {"ns": 1e-3, "us": 1.0, "µs": 1.0, "usec": 1.0, "ms": 1e3, "s": 1e6}
_BANDWIDTH_TO_GBPS = {
    "gb/s": 1.0,
    "gbps": 1.0,  # the RFC's table writes GB/s; "GBps" as in Calculon
    "gib/s": 1.073741824,
    "mb/s": 1e-3,
    "tb/s": 1e3,
    "gbit/s": 1 / 8,
    "gb/sec": 1.0,
}
_BITS = {"Gb/s": 1 / 8, "Gb/sec": 1 / 8, "Gbit/s": 1 / 8, "Mb/s": 1e-3 / 8, "Gbps": 1 / 8}  # sysfs IB: "200 Gb/sec"
MAX_INT = 2**31 - 1
"""Largest whole number accepted in an integer field (restart counts, channels, local ranks):
bigger values are damage, and would make over-long file names or overflow arithmetic."""
_RANK_KEY = re.compile(r"0|[1-9][0-9]{0,9}")  # fullmatch: no sign, no leading zero, no "\n"
_WHOLE = re.compile(r"-?(0|[1-9][0-9]{0,18})")


@cache
def schema() -> dict[str, Any]:
    """The JSON Schema of format v0.1 shipped with the package."""
    text = resources.files("topomesh.topology").joinpath("schema/topology-v0.1.schema.json").read_text()
    return json.loads(text)


def _fmt(x: float) -> str:
    """Shortest stable text for a number: '0.6', '370.8', '12'."""
    return format(float(x), ".6g")


def connection_to_dict(c: Connection) -> dict[str, Any]:
    src = "measured" if c.measured else "default"
    out: dict[str, Any] = {
        "type": c.kind.rfc_type,
        "latency": {"value": _fmt(c.latency_us), "measurement": "us", "source": src},
        "bandwidth": {"value": _fmt(c.bandwidth_GBps), "measurement": "GB/s", "source": src},
        "channels": {"count": str(c.channels)},
    }
    if c.kind.is_pcie:
        out["pcie_class"] = c.kind.value
    return out


def _entry(table: ConnectionTable, conns: list[dict[str, Any]], a: int, b: int) -> dict[str, Any]:
    """The connection object of one pair: the interned one, or a measured one built here."""
    if (table.measured_inter or table.measured_local) and table.measured(a, b) is not None:
        return connection_to_dict(table.connection(a, b))
    return conns[table.index(a, b)]


def to_dict(topo: Topology) -> dict[str, Any]:
    """The dense v0.1 document: every ordered pair of distinct ranks."""
    n = topo.world_size
    table = topo.table
    conns = [connection_to_dict(c) for c in table.palette]
    ranks: dict[str, Any] = {}
    for a in range(n):
        info = topo.ranks[a]
        entry: dict[str, Any] = {
            "host": topo.hosts[info.host].hostname,
            "local_rank": str(info.local_rank),
        }
        if info.device is not None:
            entry["device"] = info.device
        entry["peers"] = {str(b): {"connection": _entry(table, conns, a, b)} for b in range(n) if b != a}
        ranks[str(a)] = entry
    doc: dict[str, Any] = {"version": VERSION, "generator": GENERATOR, "world_size": str(n)}
    if topo.run_id is not None:
        doc["run_id"] = topo.run_id
    if topo.restart_count is not None:
        doc["restart_count"] = str(topo.restart_count)
    doc["ranks"] = ranks
    doc["hosts"] = {h.hostname: h.to_dict() for h in topo.hosts}
    return doc


def dumps(topo: Topology) -> str:
    """Deterministic text: the same topology gives byte-identical files on every node."""
    return json.dumps(to_dict(topo), indent=1, sort_keys=False) + "\n"


# ---------------------------------------------------------------------------- reading


def _show(value: Any) -> str:
    """``repr`` of a value from a file, cut short so an error stays one line."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"


def _num(value: Any, where: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TopologyError(f"expected a number, got {_show(value)}", source=source, where=where)
    try:
        x = float(value)
    except ValueError:
        raise TopologyError(f"expected a number, got {_show(value)}", source=source, where=where) from None
    except OverflowError:  # an int beyond a double's range
        raise TopologyError(f"expected a finite number >= 0, got {_show(value)}", source=source, where=where) from None
    if not np.isfinite(x) or x < 0:
        raise TopologyError(f"expected a finite number >= 0, got {_show(value)}", source=source, where=where)
    return x


def whole(value: Any, where: str, source: str, *, low: int = 0, high: int = MAX_INT) -> int:
    """An integer field: a JSON integer, a whole JSON number (``8.0``) or a decimal string
    (``"8"``, as the RFC writes values), within ``low..high``.

    Refused with the place: booleans, fractions (``8.7``), other text (``"+4"``, ``"٤"``,
    ``"8\n"``), and values out of range, which are checked before any conversion that
    could overflow.
    """
    x: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        x = value
    elif (isinstance(value, float) and np.isfinite(value) and value.is_integer()) or (
        isinstance(value, str) and _WHOLE.fullmatch(value)
    ):
        x = int(value)
    if x is None:
        raise TopologyError(f"expected a whole number, got {_show(value)}", source=source, where=where)
    if not low <= x <= high:
        raise TopologyError(f"expected a whole number in {low}..{high}, got {_show(value)}", source=source, where=where)
    return x


def _latency_us(m: Mapping[str, Any], where: str, source: str) -> float:
    unit = str(m.get("measurement", "us")).strip()
    factor = _LATENCY_TO_US.get(unit.lower())
    if factor is None:
        raise TopologyError(f"unknown latency unit {_show(unit)} (use us, ms, ns or s)", source=source, where=where)
    return _scaled(m.get("value"), factor, unit, where, source)


def _scaled(value: Any, factor: float, unit: str, where: str, source: str) -> float:
    """``value`` in ``unit`` converted by ``factor``; finite after the conversion too."""
    x = _num(value, where, source) * factor
    if not np.isfinite(x):
        raise TopologyError(f"{_show(value)} {unit} is too large once converted", source=source, where=where)
    return x


def _bandwidth_GBps(m: Mapping[str, Any], where: str, source: str) -> float:
    unit = str(m.get("measurement", "GB/s")).strip()
    factor = _BITS.get(unit)
    if factor is None:
        factor = _BANDWIDTH_TO_GBPS.get(unit.lower())
    if factor is None:
        raise TopologyError(
            f"unknown bandwidth unit {_show(unit)} (use GB/s, GiB/s, MB/s, Gb/s or Mb/s)", source=source, where=where
        )
    return _scaled(m.get("value"), factor, unit, where, source)


def connection_from_dict(c: Mapping[str, Any], where: str, source: str) -> Connection:
    """Parse one ``connection`` object of either RFC variant.

    A missing latency or bandwidth takes the default for the connection's kind.
    """
    kind = LinkKind.UNKNOWN
    if "type" in c:
        try:
            kind = LinkKind.parse(str(c["type"]))
        except ValueError:
            raise TopologyError(
                f"unknown connection type {c['type']!r} (known: {', '.join(k.value for k in LinkKind)}, PCIe)",
                source=source,
                where=where + ".type",
            ) from None
        pcie = c.get("pcie_class")
        if kind.is_pcie and pcie is not None:
            try:
                sub = LinkKind.parse(str(pcie))
            except ValueError:
                sub = None
            if sub is None or not sub.is_pcie:
                raise TopologyError(f"unknown pcie_class {pcie!r}", source=source, where=where + ".pcie_class")
            kind = sub
    fallback = default_connection(kind)
    lat = c.get("latency")
    bw = c.get("bandwidth")
    latency = _latency_us(lat, where + ".latency", source) if isinstance(lat, Mapping) else fallback.latency_us
    bandwidth = (
        _bandwidth_GBps(bw, where + ".bandwidth", source) if isinstance(bw, Mapping) else fallback.bandwidth_GBps
    )
    ch = c.get("channels")
    channels = 1
    if isinstance(ch, Mapping):
        raw = ch.get("count", ch.get("value"))
        x = _num(raw, where + ".channels", source)
        if x != int(x) or x > MAX_INT:
            raise TopologyError(
                f"channels must be a whole number in 0..{MAX_INT}, got {_show(raw)}", source=source, where=where + ".channels"
            )
        channels = int(x)
    measured = any(isinstance(m, Mapping) and m.get("source") == "measured" for m in (lat, bw))
    return Connection(kind=kind, latency_us=latency, bandwidth_GBps=bandwidth, channels=channels, measured=measured)


def validate(doc: Any, source: str) -> None:
    """Check ``doc`` against the shipped JSON Schema; the first error names its JSON path."""
    import jsonschema

    if not isinstance(doc, dict):
        raise TopologyError("the document is not a JSON object", source=source)
    if doc.get("version") != VERSION:
        raise TopologyError(
            f"unsupported version {doc.get('version')!r}; this reader understands {VERSION!r}",
            source=source,
            where="$.version",
        )
    validator = jsonschema.Draft202012Validator(schema())
    err = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if err is not None:
        path = "$" + "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
        raise TopologyError(err.message, source=source, where=path)


def from_dict(doc: Any, *, source: str = "<topology>") -> Topology:
    """Read a v0.1 document (either variant) into a :class:`Topology`."""
    validate(doc, source)
    raw_ranks: Mapping[str, Any] = doc["ranks"]
    n = len(raw_ranks)
    for k in raw_ranks:
        _rank_key(k, None, "rank", "$.ranks", source)
    missing = [r for r in range(n) if str(r) not in raw_ranks]
    if missing:
        raise TopologyError(f"ranks must be 0..{n - 1}; missing {missing[:5]}", source=source, where="$.ranks")
    if "world_size" in doc and whole(doc["world_size"], "$.world_size", source) != n:
        raise TopologyError(
            f"world_size is {_show(doc['world_size'])} but the file lists {n} ranks", source=source, where="$.world_size"
        )
    pairs: dict[tuple[int, int], Connection] = {}
    first: dict[tuple[int, int], str] = {}
    for a in range(n):
        peers = raw_ranks[str(a)]["peers"]
        for pk, pv in peers.items():
            b = _rank_key(pk, n, "peer", f"$.ranks.{a}.peers", source)
            where = f"$.ranks.{a}.peers.{b}.connection"
            if b == a:
                continue
            conn = connection_from_dict(pv["connection"], where, source)
            key = (min(a, b), max(a, b))
            seen = pairs.setdefault(key, conn)
            if seen != conn:
                # the model (and NCCL) has one connection per pair: a file that says two is damaged
                raise TopologyError(
                    f"ranks {a} and {b} disagree about their connection ({_describe(seen)} at {first[key]}, "
                    f"{_describe(conn)} here); a pair has one connection in both directions",
                    source=source,
                    where=where,
                )
            first.setdefault(key, where)
    for a in range(n):
        for b in range(a + 1, n):
            if (a, b) not in pairs:
                raise TopologyError(f"no connection between ranks {a} and {b} in either direction", source=source, where=f"$.ranks.{a}.peers")
    hosts, placement = _hosts_and_placement(doc, n, pairs, source)
    table = table_from_pairs(n, [r.host for r in placement], [r.local_rank for r in placement], lambda a, b: pairs[(min(a, b), max(a, b))])
    restart = doc.get("restart_count")
    return Topology(
        hosts=hosts,
        ranks=tuple(placement),
        table=table,
        run_id=doc.get("run_id") if isinstance(doc.get("run_id"), str) else None,
        restart_count=whole(restart, "$.restart_count", source) if restart is not None else None,
        source=source,
    )


def _rank_key(key: str, n: int | None, what: str, where: str, source: str) -> int:
    """A rank id used as a key: decimal digits exactly (no ``"1\n"``, ``"01"``, ``"+1"``),
    below the world size ``n`` when given; checked before ``int()`` so 5,000 digits cost
    nothing. ``what`` names the key in the error (``rank``, ``peer``)."""
    if not _RANK_KEY.fullmatch(key):
        raise TopologyError(
            f"{what} key {_show(key)} is not a rank id (0, 1, 2, ... without signs, spaces or leading zeros)",
            source=source,
            where=where,
        )
    r = int(key)
    if n is not None and r >= n:
        raise TopologyError(f"{what} {r} is not a rank of this {n}-rank world", source=source, where=where)
    return r


def _describe(c: Connection) -> str:
    return f"{c.kind.value} {c.latency_us:g} us {c.bandwidth_GBps:g} GB/s x{c.channels}"


def _hosts_and_placement(
    doc: Mapping[str, Any], n: int, pairs: Mapping[tuple[int, int], Connection], source: str
) -> tuple[tuple[Host, ...], list[RankInfo]]:
    raw_ranks = doc["ranks"]
    described = doc.get("hosts") if isinstance(doc.get("hosts"), Mapping) else {}
    names: list[str] = []
    if all(isinstance(raw_ranks[str(r)].get("host"), str) for r in range(n)):
        names = [raw_ranks[str(r)]["host"] for r in range(n)]
    else:
        # No host names: ranks joined by same-host link kinds are one host.
        parent = list(range(n))

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for (a, b), c in pairs.items():
            if c.kind.intra_host:
                ra, rb = find(a), find(b)
                parent[max(ra, rb)] = min(ra, rb)
        roots = sorted({find(r) for r in range(n)})
        label = {root: f"host{i}" for i, root in enumerate(roots)}
        names = [label[find(r)] for r in range(n)]
    order = list(dict.fromkeys(names))
    hosts: list[Host] = []
    for name in order:
        d = described.get(name)
        hosts.append(Host.from_dict(d, source=f"{source}: hosts.{name}") if d is not None else Host(hostname=name))
    index = {name: i for i, name in enumerate(order)}
    seen: Counter[str] = Counter()
    placement: list[RankInfo] = []
    for r in range(n):
        entry = raw_ranks[str(r)]
        host = hosts[index[names[r]]]
        local = entry.get("local_rank")
        local_rank = whole(local, f"$.ranks.{r}.local_rank", source, high=n - 1) if local is not None else seen[names[r]]
        seen[names[r]] += 1
        device = entry.get("device") if isinstance(entry.get("device"), str) else None
        if device is not None and host.devices and device not in {dv.id for dv in host.devices}:
            raise TopologyError(f"device {device!r} is not on host {host.hostname!r}", source=source, where=f"$.ranks.{r}.device")
        if device is not None and not host.devices:
            device = None
        placement.append(RankInfo(rank=r, host=index[names[r]], local_rank=local_rank, device=device))
    locals_by_host: dict[int, list[int]] = {}
    for p in placement:
        locals_by_host.setdefault(p.host, []).append(p.local_rank)
    for h, lr in locals_by_host.items():
        if len(set(lr)) != len(lr):
            raise TopologyError(f"host {order[h]!r} has duplicate local ranks {sorted(lr)}", source=source, where="$.ranks")
    return tuple(hosts), placement


def table_from_pairs(
    n: int,
    host_of: list[int],
    local_rank: list[int],
    lookup: Callable[[int, int], Connection],
) -> ConnectionTable:
    """A compact table from any pairwise ``lookup`` (used for files read pair by pair).

    Same-host pairs go into per-host matrices (deduplicated); different-host pairs take
    the most common inter-host connection, and the pairs that differ from it become
    overrides.
    """
    pal = _Palette()
    host_arr = np.asarray(host_of, dtype=np.int32) if n else np.zeros(0, dtype=np.int32)
    local_of = np.zeros(n, dtype=np.int32)
    members: dict[int, list[int]] = {}
    for r in range(n):
        members.setdefault(host_of[r], []).append(r)
    n_hosts = (max(host_of) + 1) if n else 0
    host_class = np.zeros(n_hosts, dtype=np.int32)
    mats = _Matrices()
    loc = loc_connection()
    for h, rs in members.items():
        rs.sort(key=lambda r: local_rank[r])
        k = len(rs)
        mat = np.zeros((k, k), dtype=np.int32)
        for i, a in enumerate(rs):
            local_of[a] = i
            for j, b in enumerate(rs):
                mat[i, j] = pal.id(loc if a == b else lookup(a, b))
        host_class[h] = mats.id(mat)
    counts: Counter[Connection] = Counter()
    inter_pairs: list[tuple[int, int, Connection]] = []
    for a in range(n):
        for b in range(a + 1, n):
            if host_of[a] != host_of[b]:
                c = lookup(a, b)
                counts[c] += 1
                inter_pairs.append((a, b, c))
    common = counts.most_common(1)[0][0] if counts else Connection(kind=LinkKind.UNKNOWN, latency_us=0.0, bandwidth_GBps=0.0)
    inter = np.array([[pal.id(common)]], dtype=np.int32)
    overrides = {(a, b): pal.id(c) for a, b, c in inter_pairs if c != common}
    return ConnectionTable(
        palette=tuple(pal.items),
        host_of=host_arr,
        local_of=local_of,
        host_class=host_class,
        local=tuple(mats.items),
        rail_of=np.zeros(n, dtype=np.int32),
        inter=inter,
        overrides=overrides,
    )


def loads(text: str, *, source: str = "<topology>") -> Topology:
    from topomesh.topology.api import loads_bounded  # api imports this module

    return from_dict(loads_bounded(text, source=source), source=source)
