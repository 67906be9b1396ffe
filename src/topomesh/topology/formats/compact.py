"""The compact topology file, for worlds too large for the dense v0.1 form.

The dense form has ``world_size * (world_size - 1)`` connection entries (16,384 ranks:
268 million). The compact form stores the :class:`~topomesh.topology.model.ConnectionTable`
directly, so its size grows with ranks, not ranks²::

    {"format": "topomesh-compact", "format_version": "1", "version": "0.1",
     "world_size": "16384", "run_id": ..., "restart_count": ...,
     "connections": [<v0.1 connection objects>],        # the palette
     "host_templates": [<host without hostname>],        # hosts that look alike share one
     "hosts": [["node-0", 0], ...],                      # name, template
     "local_classes": [[[0, 1], [1, 0]], ...],           # palette ids between local slots
     "host_class": [0, 0, ...],                          # per host
     "rank_host": [...], "rank_local_rank": [...], "rank_device": [...], "rank_rail": [...],
     "inter": [[2]],                                     # palette ids between rails
     "overrides": [[a, b, id], ...],
     "measured_inter": [[host_a, host_b, latency_us, bandwidth_GBps], ...],
     "measured_local": [[host, slot_a, slot_b, latency_us, bandwidth_GBps], ...]}

``version`` is the RFC format the connection objects follow; ``format_version`` versions
the compact layout itself: 2 adds the two ``measured_*`` lists (probe results, one row per
measurement; kind and channels come from the rules above) and is written only when there are
measurements; otherwise the file is version 1, as before. Both are read.
Readers see the same :class:`Topology` as from a dense file.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from topomesh.errors import TopologyError
from topomesh.topology.formats.rfc import VERSION, connection_from_dict, connection_to_dict, whole
from topomesh.topology.model import ConnectionTable, Host, RankInfo, Topology

FORMAT = "topomesh-compact"
FORMAT_VERSION = "2"
READABLE_VERSIONS = ("1", "2")
MAX_WORLD_SIZE = 1 << 20
"""Most ranks (and hosts) a compact file may declare: 1,048,576, 64x the 16,384-rank worlds
the format was designed for."""
MAX_CONNECTIONS = 1 << 16
"""Most distinct connection objects (the palette). A world has a few per link kind; probe
results go to the ``measured_*`` rows, not here. Each costs ~30 µs to read, so this bounds
reading the palette to about two seconds."""


def to_dict(topo: Topology) -> dict[str, Any]:
    t = topo.table
    templates: dict[tuple, int] = {}
    template_list: list[dict[str, Any]] = []
    hosts: list[list[Any]] = []
    for h in topo.hosts:
        key = (h.devices, h.nics, h.paths, h.socket_ifname, h.numa_bindings)
        if key not in templates:
            templates[key] = len(template_list)
            d = h.to_dict()
            d.pop("hostname")
            template_list.append(d)
        hosts.append([h.hostname, templates[key]])
    doc: dict[str, Any] = {
        "format": FORMAT,
        "format_version": READABLE_VERSIONS[0],
        "version": VERSION,
        "generator": "topomesh",
        "world_size": str(topo.world_size),
    }
    if topo.run_id is not None:
        doc["run_id"] = topo.run_id
    if topo.restart_count is not None:
        doc["restart_count"] = str(topo.restart_count)
    doc.update(
        connections=[connection_to_dict(c) for c in t.palette],
        host_templates=template_list,
        hosts=hosts,
        local_classes=[m.tolist() for m in t.local],
        host_class=t.host_class.tolist(),
        rank_host=[r.host for r in topo.ranks],
        rank_local_rank=[r.local_rank for r in topo.ranks],
        rank_device=[r.device for r in topo.ranks],
        rank_rail=t.rail_of.tolist(),
        inter=t.inter.tolist(),
        overrides=[[a, b, i] for (a, b), i in sorted(t.overrides.items())],
    )
    if t.measured_inter or t.measured_local:
        # only files with probe results need the version-2 reader
        doc["format_version"] = FORMAT_VERSION
        doc["measured_inter"] = [[a, b, lat, bw] for (a, b), (lat, bw) in sorted(t.measured_inter.items())]
        doc["measured_local"] = [
            [h, la, lb, lat, bw]
            for h, slots in sorted(t.measured_local.items())
            for (la, lb), (lat, bw) in sorted(slots.items())
        ]
    return doc


def dumps(topo: Topology) -> str:
    return json.dumps(to_dict(topo), separators=(",", ":")) + "\n"


def _int_array(doc: dict[str, Any], key: str, length: int | None, bound: int, source: str) -> np.ndarray:
    raw = doc.get(key)
    if not isinstance(raw, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        raise TopologyError("expected a list of integers", source=source, where=f"$.{key}")
    if length is not None and len(raw) != length:
        raise TopologyError(f"expected {length} entries, found {len(raw)}", source=source, where=f"$.{key}")
    if any(not 0 <= x < bound for x in raw):
        raise TopologyError(f"values must be in 0..{bound - 1}", source=source, where=f"$.{key}")
    arr = np.asarray(raw, dtype=np.int64)
    return arr.astype(np.int32)


def _at_most(items: list[Any], limit: int, what: str, where: str, source: str) -> None:
    """Refuse a list longer than ``limit`` before anything is built from it."""
    if len(items) > limit:
        raise TopologyError(f"{len(items)} entries, more than the limit of {limit} {what}", source=source, where=where)


def _matrix(raw: Any, bound: int, where: str, source: str, square: bool) -> np.ndarray:
    try:
        arr = np.asarray(raw, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise TopologyError("expected a matrix of integers in range", source=source, where=where) from None
    if arr.ndim != 2 or (square and arr.shape[0] != arr.shape[1]) or arr.dtype.kind != "i":
        raise TopologyError("expected a square matrix of integers", source=source, where=where)
    if arr.size and (arr.min() < 0 or arr.max() >= bound):
        raise TopologyError(f"connection ids must be in 0..{bound - 1}", source=source, where=where)
    if square and not np.array_equal(arr, arr.T):
        raise TopologyError("connections must be symmetric (matrix != its transpose)", source=source, where=where)
    return arr.astype(np.int32)


def _measured_rows(doc: dict[str, Any], key: str, bounds: tuple[int, ...], source: str) -> list[tuple[Any, ...]]:
    """Rows of integer indices below ``bounds`` followed by latency_us and bandwidth_GBps.

    Returns ``(first index, rest of the indices, (latency, bandwidth))`` per row; for
    two-index rows (host pairs) the rest is the second index itself.
    """
    raw = doc.get(key, [])
    if not isinstance(raw, list):
        raise TopologyError("expected a list of rows", source=source, where=f"$.{key}")
    k = len(bounds)
    out = []
    for i, row in enumerate(raw):
        ok = isinstance(row, list) and len(row) == k + 2
        ok = ok and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < b for x, b in zip(row[:k], bounds, strict=True))
        ok = ok and all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1e12 for x in row[k:])
        if not ok:
            raise TopologyError(
                f"expected [{k} indices in range, latency_us, bandwidth_GBps]", source=source, where=f"$.{key}[{i}]"
            )
        rest = row[1] if k == 2 else tuple(row[1:k])
        out.append((row[0], rest, (float(row[k]), float(row[k + 1]))))
    return out


def from_dict(doc: Any, *, source: str = "<topology>") -> Topology:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TopologyError(f"not a {FORMAT} document", source=source)
    if doc.get("format_version") not in READABLE_VERSIONS:
        raise TopologyError(
            f"unsupported compact format_version {doc.get('format_version')!r}; this reader understands "
            f"{', '.join(map(repr, READABLE_VERSIONS))}",
            source=source,
            where="$.format_version",
        )
    n = whole(doc.get("world_size"), "$.world_size", source, high=MAX_WORLD_SIZE)
    conns_raw = doc.get("connections")
    if not isinstance(conns_raw, list) or not conns_raw:
        raise TopologyError("expected a non-empty list of connections", source=source, where="$.connections")
    _at_most(conns_raw, MAX_CONNECTIONS, "connections", "$.connections", source)
    palette = []
    for i, c in enumerate(conns_raw):
        if not isinstance(c, dict):
            raise TopologyError("expected an object", source=source, where=f"$.connections[{i}]")
        palette.append(connection_from_dict(c, f"$.connections[{i}]", source))
    templates = doc.get("host_templates")
    hosts_raw = doc.get("hosts")
    if not isinstance(templates, list) or not isinstance(hosts_raw, list) or not hosts_raw:
        raise TopologyError("expected host_templates and a non-empty hosts list", source=source, where="$.hosts")
    _at_most(hosts_raw, max(n, 1), f"hosts (the world has {n} ranks)", "$.hosts", source)
    _at_most(templates, len(hosts_raw), f"host templates (there are {len(hosts_raw)} hosts)", "$.host_templates", source)
    parsed: dict[int, Host] = {}
    hosts: list[Host] = []
    for i, h in enumerate(hosts_raw):
        ok = isinstance(h, list) and len(h) == 2 and isinstance(h[0], str) and isinstance(h[1], int)
        if not ok or not 0 <= h[1] < len(templates) or not isinstance(templates[h[1]], dict) or not h[0]:
            raise TopologyError("expected [hostname, template index]", source=source, where=f"$.hosts[{i}]")
        tpl = parsed.get(h[1])
        if tpl is None:
            where = f"{source}: host_templates[{h[1]}]"
            tpl = parsed[h[1]] = Host.from_dict({**templates[h[1]], "hostname": h[0]}, source=where)
        hosts.append(tpl.renamed(h[0]))
    if len({h.hostname for h in hosts}) != len(hosts):
        raise TopologyError("host names must be unique", source=source, where="$.hosts")
    classes_raw = doc.get("local_classes")
    if not isinstance(classes_raw, list):
        raise TopologyError("expected a list of matrices", source=source, where="$.local_classes")
    _at_most(classes_raw, len(hosts), f"local classes (there are {len(hosts)} hosts)", "$.local_classes", source)
    local = tuple(
        _matrix(m, len(palette), f"$.local_classes[{i}]", source, square=True) for i, m in enumerate(classes_raw)
    )
    host_class = _int_array(doc, "host_class", len(hosts), max(len(local), 1), source)
    rank_host = _int_array(doc, "rank_host", n, len(hosts), source)
    rank_local = _int_array(doc, "rank_local_rank", n, max(n, 1), source)
    inter = _matrix(doc.get("inter"), len(palette), "$.inter", source, square=True)
    rail = _int_array(doc, "rank_rail", n, max(inter.shape[0], 1), source)
    devices = doc.get("rank_device")
    if not isinstance(devices, list) or len(devices) != n or not all(d is None or isinstance(d, str) for d in devices):
        raise TopologyError(f"expected {n} device ids or nulls", source=source, where="$.rank_device")
    # local slot of each rank = its position among its host's ranks by local rank
    local_of = np.zeros(n, dtype=np.int32)
    members: dict[int, list[int]] = {}
    for r in range(n):
        members.setdefault(int(rank_host[r]), []).append(r)
    for h, rs in members.items():
        rs.sort(key=lambda r: rank_local[r])
        size = local[host_class[h]].shape[0] if local else 0
        if size != len(rs):
            raise TopologyError(
                f"host {hosts[h].hostname!r} has {len(rs)} ranks but its local class is {size}x{size}",
                source=source,
                where="$.host_class",
            )
        if len({int(rank_local[r]) for r in rs}) != len(rs):
            raise TopologyError(f"host {hosts[h].hostname!r} has duplicate local ranks", source=source, where="$.rank_local_rank")
        for slot, r in enumerate(rs):
            local_of[r] = slot
    overrides: dict[tuple[int, int], int] = {}
    ov = doc.get("overrides", [])
    if not isinstance(ov, list):
        raise TopologyError("expected a list of [a, b, id]", source=source, where="$.overrides")
    for i, item in enumerate(ov):
        ok = isinstance(item, list) and len(item) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in item)
        if not ok or not (0 <= item[0] < n and 0 <= item[1] < n and 0 <= item[2] < len(palette)):
            raise TopologyError("expected [rank, rank, connection id] within range", source=source, where=f"$.overrides[{i}]")
        overrides[(min(item[0], item[1]), max(item[0], item[1]))] = item[2]
    measured_inter: dict[tuple[int, int], tuple[float, float]] = {}
    for a, b, figures in _measured_rows(doc, "measured_inter", (len(hosts), len(hosts)), source):
        if a == b:
            raise TopologyError(f"measured host pair ({a}, {b}) is one host", source=source, where="$.measured_inter")
        measured_inter[(min(a, b), max(a, b))] = figures
    measured_local: dict[int, dict[tuple[int, int], tuple[float, float]]] = {}
    for h, (la, lb), figures in _measured_rows(doc, "measured_local", (len(hosts), 1 << 30, 1 << 30), source):
        size = local[host_class[h]].shape[0] if local else 0
        if not (la < size and lb < size) or la == lb:
            raise TopologyError(f"local slots ({la}, {lb}) are not two of the {size} on host {h}",
                                source=source, where="$.measured_local")
        measured_local.setdefault(h, {})[(min(la, lb), max(la, lb))] = figures
    ranks = []
    for r in range(n):
        dev = devices[r]
        host = hosts[int(rank_host[r])]
        if dev is not None and host.devices and dev not in {d.id for d in host.devices}:
            raise TopologyError(f"device {dev!r} is not on host {host.hostname!r}", source=source, where=f"$.rank_device[{r}]")
        ranks.append(RankInfo(rank=r, host=int(rank_host[r]), local_rank=int(rank_local[r]), device=dev))
    table = ConnectionTable(
        palette=tuple(palette),
        host_of=rank_host,
        local_of=local_of,
        host_class=host_class,
        local=local,
        rail_of=rail,
        inter=inter,
        overrides=overrides,
        measured_inter=measured_inter,
        measured_local=measured_local,
    )
    restart = doc.get("restart_count")
    restart_count = whole(restart, "$.restart_count", source) if restart is not None else None
    run_id = doc.get("run_id")
    return Topology(
        hosts=tuple(hosts),
        ranks=tuple(ranks),
        table=table,
        run_id=run_id if isinstance(run_id, str) else None,
        restart_count=restart_count,
        source=source,
    )
