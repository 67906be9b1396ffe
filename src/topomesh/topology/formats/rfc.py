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
from collections.abc import Mapping
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


_PEERS = ("$defs", "rank", "properties", "peers")
"""Where the schema describes a rank's ``peers`` map: the one part of a dense file that
grows as ranks², checked per distinct key and per distinct entry (see :func:`validate`)."""


@cache
def _validators() -> tuple[Any, Any, Any]:
    """Three validators cut from the shipped schema (never a copy of its text).

    ``skeleton``: the whole schema less the two keywords of ``peers`` that apply per key
    (``propertyNames``, ``additionalProperties``), so it walks version, ranks and each
    rank, but no peer; ``key`` and ``entry``: those two keywords as ``$ref``s into the
    schema, applied to one peer key and one peer entry (``{"connection": ...}``).
    """
    import copy

    import jsonschema

    root = schema()
    node: Any = root
    for part in _PEERS:
        node = node[part]
    # additionalProperties covers every key only while no properties/patternProperties exist
    assert "properties" not in node and "patternProperties" not in node, "peers schema changed: update _validators"
    skeleton = copy.deepcopy(root)
    cut: Any = skeleton
    for part in _PEERS:
        cut = cut[part]
    cut.pop("propertyNames", None)
    cut.pop("additionalProperties", None)
    pointer = "#/" + "/".join(_PEERS)

    def ref(keyword: str) -> Any:
        if keyword not in node:
            return jsonschema.Draft202012Validator(True)
        # the root's identity and definitions only: its own keywords would apply to the part too
        frame = {k: root[k] for k in ("$schema", "$id", _PEERS[0]) if k in root}
        return jsonschema.Draft202012Validator({**frame, "$ref": f"{pointer}/{keyword}"})

    return jsonschema.Draft202012Validator(skeleton), ref("propertyNames"), ref("additionalProperties")


def _check(validator: Any, instance: Any, where: str, source: str) -> None:
    """Raise the best of ``validator``'s errors for ``instance``, at ``where`` + its path."""
    import jsonschema

    err = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    if err is not None:
        path = where + "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
        raise TopologyError(err.message, source=source, where=path)


def _check_skeleton(doc: Any, source: str) -> None:
    """The version, then the schema on everything but the peers' keys and entries."""
    if not isinstance(doc, dict):
        raise TopologyError("the document is not a JSON object", source=source)
    if doc.get("version") != VERSION:
        raise TopologyError(
            f"unsupported version {doc.get('version')!r}; this reader understands {VERSION!r}",
            source=source,
            where="$.version",
        )
    _check(_validators()[0], doc, "$", source)


def _entry_key(value: Any) -> str | None:
    """Exact text of a parsed JSON value: equal texts mean equal values of equal types
    (``repr`` tells ``1`` from ``1.0``, ``True`` and ``"1"``); None when it cannot be
    written (an integer of more than 4,300 digits, nesting beyond the stack)."""
    try:
        return repr(value)
    except (ValueError, RecursionError):
        return None


def validate(doc: Any, source: str) -> None:
    """Check ``doc`` against the shipped JSON Schema; the first error names its JSON path.

    Every check of the schema is made, in time linear in the file: the skeleton once, then
    each distinct peer key and each distinct peer entry once (a dense file repeats a
    handful of connection objects ranks² times); a failing one is reported at the first
    place it occurs.
    """
    _check_skeleton(doc, source)
    _, key_v, entry_v = _validators()
    keys: set[str] = set()
    entries: set[str] = set()
    for r, rank in doc["ranks"].items():
        for pk, pv in rank["peers"].items():
            if pk not in keys:
                _check(key_v, pk, f"$.ranks.{r}.peers", source)
                keys.add(pk)
            k = _entry_key(pv)
            if k is None or k not in entries:
                _check(entry_v, pv, f"$.ranks.{r}.peers.{pk}", source)
                if k is not None:
                    entries.add(k)


def from_dict(doc: Any, *, source: str = "<topology>") -> Topology:
    """Read a v0.1 document (either variant) into a :class:`Topology`.

    Linear in the number of pairs with small constants: each distinct peer entry is
    validated and parsed once, pairs are kept as palette ids in an ``n x n`` array, and
    the symmetry and completeness checks run on that array.
    """
    _check_skeleton(doc, source)
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
    _, key_v, entry_v = _validators()
    index = {str(r): r for r in range(n)}  # exactly the keys _rank_key accepts below n
    pal = _Palette()
    parsed: dict[str, int] = {}  # peer entry's exact text -> palette id
    ids = np.full((n, n), -1, dtype=np.int32)
    for a in range(n):
        row = [-1] * n
        for pk, pv in raw_ranks[str(a)]["peers"].items():
            b = index.get(pk)
            if b is None:
                _check(key_v, pk, f"$.ranks.{a}.peers", source)
                b = _rank_key(pk, n, "peer", f"$.ranks.{a}.peers", source)
            k = _entry_key(pv)
            cid = parsed.get(k) if k is not None else None
            if cid is None:
                _check(entry_v, pv, f"$.ranks.{a}.peers.{b}", source)
                if b == a:
                    continue
                cid = pal.id(connection_from_dict(pv["connection"], f"$.ranks.{a}.peers.{b}.connection", source))
                if k is not None:
                    parsed[k] = cid
            row[b] = cid
        row[a] = -1
        ids[a] = row
    _check_pairs(ids, raw_ranks, pal.items, source)
    both = np.where(ids >= 0, ids, ids.T)
    hosts, placement = _hosts_and_placement(doc, n, both, pal.items, source)
    table = table_from_ids([r.host for r in placement], [r.local_rank for r in placement], both, pal.items)
    restart = doc.get("restart_count")
    return Topology(
        hosts=hosts,
        ranks=tuple(placement),
        table=table,
        run_id=doc.get("run_id") if isinstance(doc.get("run_id"), str) else None,
        restart_count=whole(restart, "$.restart_count", source) if restart is not None else None,
        source=source,
    )


def _check_pairs(ids: np.ndarray, raw_ranks: Mapping[str, Any], palette: list[Connection], source: str) -> None:
    """Each pair listed in at least one direction, and alike when listed in both.

    ``ids[a, b]`` is the palette id of what rank ``a`` lists for peer ``b`` (-1: not
    listed). A disagreement is reported where a reader going rank by rank, peer by peer
    meets it: at the later rank, naming the place of the earlier one.
    """
    n = ids.shape[0]
    upper = np.triu(np.ones((n, n), dtype=bool), 1)
    clash = upper & (ids >= 0) & (ids.T >= 0) & (ids != ids.T)
    if clash.any():
        b = int(np.flatnonzero(clash.any(axis=0))[0])  # the earliest later rank
        wrong = set(np.flatnonzero(clash[:, b]).tolist())
        a = next(r for r in map(int, raw_ranks[str(b)]["peers"]) if r in wrong)
        first, here = palette[ids[a, b]], palette[ids[b, a]]
        raise TopologyError(
            f"ranks {b} and {a} disagree about their connection ({_describe(first)} at "
            f"$.ranks.{a}.peers.{b}.connection, {_describe(here)} here); a pair has one connection in both directions",
            source=source,
            where=f"$.ranks.{b}.peers.{a}.connection",
        )
    gap = np.argwhere(upper & (ids < 0) & (ids.T < 0))
    if gap.size:
        a, b = map(int, gap[0])
        raise TopologyError(f"no connection between ranks {a} and {b} in either direction", source=source, where=f"$.ranks.{a}.peers")


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
    doc: Mapping[str, Any], n: int, ids: np.ndarray, palette: list[Connection], source: str
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

        same_host = np.array([c.kind.intra_host for c in palette] + [False])[ids]  # ids: -1 only on the diagonal
        for a, b in np.argwhere(np.triu(same_host, 1)).tolist():
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


def table_from_ids(host_of: list[int], local_rank: list[int], ids: np.ndarray, palette: list[Connection]) -> ConnectionTable:
    """A compact table from the ``n x n`` array ``ids`` of indices into ``palette`` (the
    connection of every pair of distinct ranks, both directions alike; the diagonal is
    ignored).

    Same-host pairs go into per-host matrices (deduplicated); different-host pairs take
    the most common inter-host connection (on a tie, the one met first row by row), and
    the pairs that differ from it become overrides. The table's palette lists connections
    in the order they are first met: host by host, then the common one, then overrides.
    """
    n = len(host_of)
    pal = _Palette()
    host_arr = np.asarray(host_of, dtype=np.int32) if n else np.zeros(0, dtype=np.int32)
    local_of = np.zeros(n, dtype=np.int32)
    members: dict[int, list[int]] = {}
    for r in range(n):
        members.setdefault(host_of[r], []).append(r)
    n_hosts = (max(host_of) + 1) if n else 0
    host_class = np.zeros(n_hosts, dtype=np.int32)
    mats = _Matrices()
    loc_id = len(palette)
    conns = [*palette, loc_connection()]  # one more id: the rank itself
    for h, rs in members.items():
        rs.sort(key=lambda r: local_rank[r])
        local_of[rs] = np.arange(len(rs), dtype=np.int32)
        sub = ids[np.ix_(rs, rs)].copy()
        np.fill_diagonal(sub, loc_id)
        mat = np.array([pal.id(conns[i]) for i in sub.ravel().tolist()], dtype=np.int32).reshape(sub.shape)
        host_class[h] = mats.id(mat)
    a_idx, b_idx = np.nonzero(np.triu(host_arr[:, None] != host_arr[None, :], 1))  # row by row
    inter_ids = ids[a_idx, b_idx]
    if inter_ids.size:
        counts = np.bincount(inter_ids, minlength=len(palette))
        tops = np.flatnonzero(counts == counts.max())
        _, first = np.unique(inter_ids, return_index=True)  # unique ids sorted; first[i] for the i-th
        first_at = dict(zip(np.unique(inter_ids).tolist(), first.tolist(), strict=True))
        common_id = min(tops.tolist(), key=first_at.__getitem__)
        common = palette[common_id]
    else:
        common_id, common = -1, Connection(kind=LinkKind.UNKNOWN, latency_us=0.0, bandwidth_GBps=0.0)
    inter = np.array([[pal.id(common)]], dtype=np.int32)
    odd = np.flatnonzero(inter_ids != common_id)
    overrides = {
        (a, b): pal.id(palette[c])
        for a, b, c in zip(a_idx[odd].tolist(), b_idx[odd].tolist(), inter_ids[odd].tolist(), strict=True)
    }
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
