"""Class digests: what the simulator reads from a layout class's trace, stored so a warm search
never decodes a trace.

Simulating a layout reads its class's trace only through :func:`~topomesh.sim.price.digest_class`
— each piece's op time, FLOPs and bytes summed, its collectives sorted by how they run, the
state bytes, the FLOPs per phase and the axes of the collectives — and prices the collectives
on the layout's links afterwards. That digest is a few kilobytes where the trace is thousands
of records, and it is the same for every layout of the class on the same pricing inputs, so
it is kept next to the traces (:class:`DigestStore`).

A digest depends on the trace and on what prices an op: the device, the op table, the
cluster's core share, DTensor dispatch cost and whether collectives share the compute cores,
and the pricing code itself (the roofline, the kernel-efficiency model and its data). Its key
is the trace's key (:meth:`TraceCache.key <topomesh.trace.cache.TraceCache.key>`: model,
parallelization, class, knobs, torch version, trace format) plus :func:`pricing_fingerprint`
of all of those, so a changed table, device or pricing code digests again (from the stored
trace: no tracing). Exact: the numbers are the ones :func:`~topomesh.sim.price.digest_class`
computes, written as JSON (floats round-trip exactly) and read back as strictly as traces
(:func:`topomesh.trace.cache.load_document`, :mod:`topomesh.trace.codec`); a test compares
results simulated from stored digests with results from the traces, layout by layout.

On disk: ``<sha256(key)[:32]>.digest.json.gz`` in the trace cache directory, mode 0600; a
file that is not ours, too large, of another format or key, or fails the codec's checks is
logged and digested again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from topomesh.errors import TraceError
from topomesh.sim.price import PIECES, ClassDigest, Digest
from topomesh.trace import codec
from topomesh.trace.cache import load_document, write_document
from topomesh.trace.graph import CollectiveRecord

DIGEST_FORMAT = 6
"""Part of every digest key and file; raised when :class:`ClassDigest` changes shape."""
FILE_FORMAT = "topomesh-digest"
MAX_RECORDS = 1_000_000
"""Most distinct collective records in one stored digest."""


PRICING_CODE = ("sim/price.py", "sim/digest.py", "cost/ops.py", "cost/efficiency.py", "cost/devices.py",
                "cost/opdb.py", "cost/opcheck.py", "trace/result.py", "trace/graph.py", "cost/data")
"""The code and data (relative to the ``topomesh`` package) a digest's numbers come from: the
digest itself, op pricing (roofline, kernel efficiency, device specs, op-table keys) and the
records and sums it reads."""


@functools.cache
def code_fingerprint() -> str:
    """sha256 of the files of :data:`PRICING_CODE` (a directory: every file under it)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for name in PRICING_CODE:
        path = root / name
        for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if f.is_file() and f.suffix in (".py", ".json"):
                h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def pricing_fingerprint(cluster: Any, table: Mapping) -> str:
    """sha256 of everything besides the trace that a digest's numbers depend on (see the module
    docstring): the pricing code, the device, the op table and the cluster's sharing of cores."""
    h = hashlib.sha256()
    for part in (code_fingerprint(), repr(cluster.device), repr(cluster.core_share), repr(cluster.compute_share),
                 repr(cluster.dtensor_dispatch_s), repr(cluster.dtensor_collective_s), repr(cluster.collectives_share_compute),
                 repr(cluster.fsdp_reduce_s), repr(cluster.fsdp_gather_s), repr(cluster.dtensor_block_dispatch_s),
                 repr(cluster.dtensor_rest_dispatch_s), repr(cluster.fb_host_s)):
        h.update(part.encode() + b"\0")
    for k, v in sorted(table.items(), key=lambda kv: repr(kv[0])):
        h.update(repr(k).encode() + b"=" + repr(v).encode() + b"\0")
    return h.hexdigest()


def digest_key(trace_key: str, pricing: str) -> str:
    return f"{trace_key}|pricing={pricing}|digest{DIGEST_FORMAT}"


_LISTS = ("blocking", "gather", "reduce")


def digest_to_json(d: ClassDigest) -> dict:
    """``d`` with each distinct collective record stored once (pieces list indices)."""
    table: dict[CollectiveRecord, int] = {}
    pieces = {}
    for name in PIECES:
        p: Digest = getattr(d, name)
        raw = codec.to_json(dataclasses.replace(p, blocking=(), gather=(), reduce=()))
        for field in _LISTS:
            raw[field] = [table.setdefault(e, len(table)) for e in getattr(p, field)]
        pieces[name] = raw
    rest = codec.to_json(dataclasses.replace(d, **{name: _EMPTY for name in PIECES}))
    for name in PIECES:
        del rest[name]
    return {"records": [codec.to_json(e) for e in table], "pieces": pieces, "digest": rest}


_EMPTY = Digest(compute_s=0.0, blocking=(), gather=(), reduce=(), flops=0, weight_grad_s=0.0, saved_bytes=0,
                peak_output_bytes=0, gather_bytes=0, reduce_bytes=0, measured=0, roofline=0)


def digest_from_json(raw: Any, where: str = "$") -> ClassDigest:
    """The digest :func:`digest_to_json` wrote, checked strictly (:class:`TraceError` naming the place)."""
    if type(raw) is not dict or set(raw) != {"records", "pieces", "digest"}:
        raise TraceError(f"{where}: expected an object with exactly 'records', 'pieces' and 'digest'")
    records, pieces, rest = raw["records"], raw["pieces"], raw["digest"]
    if type(records) is not list or len(records) > MAX_RECORDS:
        raise TraceError(f"{where}.records: expected a list of at most {MAX_RECORDS} records")
    table = [codec.from_json(CollectiveRecord, r, f"{where}.records[{i}]") for i, r in enumerate(records)]
    if type(pieces) is not dict or set(pieces) != set(PIECES):
        raise TraceError(f"{where}.pieces: expected an object with exactly {list(PIECES)}")
    if type(rest) is not dict or any(name in rest for name in PIECES):
        raise TraceError(f"{where}.digest: expected an object without the pieces")
    decoded = {}
    for name in PIECES:
        p = pieces[name]
        path = f"{where}.pieces.{name}"
        if type(p) is not dict:
            raise TraceError(f"{path}: expected an object for Digest, got {type(p).__name__}")
        picked = {}
        for field in _LISTS:
            idx = p.get(field, [])
            if type(idx) is not list or len(idx) > codec.MAX_ITEMS or not all(
                    type(k) is int and 0 <= k < len(table) for k in idx):
                raise TraceError(f"{path}.{field}: expected a list of record indices below {len(table)}")
            picked[field] = tuple(table[k] for k in idx)
        decoded[name] = dataclasses.replace(codec.from_json(Digest, {**p, **dict.fromkeys(_LISTS, [])}, path),
                                            **picked)
        gaps = decoded[name].blocking_gaps  # each a finite number >= 0: the codec checked
        if gaps and len(gaps) != len(picked["blocking"]):
            raise TraceError(f"{path}.blocking_gaps: expected a time per blocking record, {len(picked['blocking'])}")
    empty = codec.to_json(_EMPTY)
    d = codec.from_json(ClassDigest, {**rest, **dict.fromkeys(PIECES, empty)}, f"{where}.digest")
    if d.traced_layers < 1:
        raise TraceError(f"{where}.digest.traced_layers: must be at least 1, got {d.traced_layers}")
    return dataclasses.replace(d, **decoded)


class DigestStore:
    """Class digests by key, in memory and, when given a directory (the trace cache's, already
    checked private), in files there."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory
        self._digests: dict[str, ClassDigest] = {}
        self.hits = 0
        self.misses = 0

    def get(self, key: str, build: Callable[[], ClassDigest]) -> ClassDigest:
        """The digest stored under ``key``, else ``build()`` stored (one object per key in this
        process, so memos keyed by its id share it)."""
        hit = self._digests.get(key)
        if hit is not None:
            return hit
        hit = self._load(key)
        if hit is None:
            self.misses += 1
            hit = build()
            self._store(key, hit)
        else:
            self.hits += 1
        self._digests[key] = hit
        return hit

    def _path(self, key: str) -> Path | None:
        if self.directory is None:
            return None
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.digest.json.gz"

    def _load(self, key: str) -> ClassDigest | None:
        return load_document(self._path(key), key, FILE_FORMAT, DIGEST_FORMAT,
                             lambda doc: digest_from_json(doc.get("digest"), "digest"),
                             what="digest cache", again="digesting the trace again")

    def _store(self, key: str, d: ClassDigest) -> None:
        path = self._path(key)
        if path is not None:
            write_document(path, key, FILE_FORMAT, DIGEST_FORMAT, {"digest": digest_to_json(d)})
