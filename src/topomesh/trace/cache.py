"""Trace each (model, parallelization, layout class) once; reuse it for every layout of the class.

A *layout class* is what a rank's trace depends on: the degrees of the traced mesh axes
(``pp`` excluded — a stage runs the same block step; axes of degree 1 add no collective).
Axis order does not change one rank's ops or group sizes, so ``{"tp": 8, "dp_shard": 4}``
and ``{"dp_shard": 4, "tp": 8}`` share a trace.

:class:`TraceCache` keeps traces in a dict it owns and, when given a directory, in files
there, so separate searches reuse them too. A deep model is traced with one block and
composed (:meth:`~topomesh.trace.result.Trace.compose`).

On disk a trace is gzip'd JSON (:mod:`topomesh.trace.codec`; nothing in it can run code):
``{"format": "topomesh-trace", "version": TRACE_FORMAT, "key": <full key>, "trace": {...}}``
in ``<sha256(key)[:32]>.trace.json.gz``, written atomically with mode 0600 into a private
directory (:func:`topomesh.privdir.private_directory`: 0700, ours; a directory that is not
gets a warning and the cache stays in memory). A file is used only when it is a regular
file of ours, at most :data:`MAX_FILE_BYTES` (:data:`MAX_JSON_BYTES` unpacked), of this
format and version, stores exactly the key asked for and passes the codec's checks;
anything else is logged, traced again and overwritten. The default directory is
``$TOPOMESH_CACHE_DIR/traces`` (:func:`default_directory`).
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import json
import logging
import math
import os
import stat
import zlib
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from topomesh.errors import TraceError
from topomesh.layout.dims import DEFAULT_ORDER, Axis
from topomesh.privdir import private_directory
from topomesh.topology.api import write_atomic
from topomesh.trace import codec
from topomesh.trace.result import Trace
from topomesh.trace.tracer import (
    ModelSpec,
    OptimizerFactory,
    ParallelizeFn,
    default_optimizer,
    trace_rings,
    trace_step,
)

T = TypeVar("T")

REUSE_LAYERS = 1
"""Blocks in the model actually traced; deeper models are composed from it."""


def layout_class(layout: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """The part of a layout a rank's trace depends on, in a canonical order: the default
    mesh order, slowest axis first (a traced mesh needs ``dp_replicate`` before ``dp_shard``
    and ``cp``, whose flattened ``dp_shard_cp`` dim HSDP slices after it).

    >>> layout_class({"tp": 8, "pp": 4, "dp_replicate": 1, "dp_shard": 2})
    (('dp_shard', 2), ('tp', 8))
    >>> layout_class({"cp": 2, "dp_shard": 2, "dp_replicate": 2})
    (('dp_replicate', 2), ('dp_shard', 2), ('cp', 2))
    """
    rank = {a.value: i for i, a in enumerate(reversed(DEFAULT_ORDER))}
    items = [(str(Axis.parse(a).value), int(d)) for a, d in layout.items() if a != Axis.PP and d > 1]
    return tuple(sorted(items, key=lambda kv: rank[kv[0]]))


SHARED_REPLICATE = 2
"""The ``dp_replicate`` degree every class with ``dp_replicate`` above 1 is traced at."""


def shared_class(layout: Mapping[str, int]) -> dict[str, int]:
    """The class actually traced for ``layout``'s class: ``dp_replicate`` above 1 traced at
    :data:`SHARED_REPLICATE` (see :func:`regroup` for why that is exact).

    >>> shared_class({"dp_replicate": 64, "dp_shard": 8, "tp": 8})
    {'dp_replicate': 2, 'dp_shard': 8, 'tp': 8}
    """
    out = dict(layout_class(layout))
    if out.get(Axis.DP_REPLICATE.value, 1) > 1:
        out[Axis.DP_REPLICATE.value] = SHARED_REPLICATE
    return out


def regroup(trace: Trace, layout: Mapping[str, int]) -> Trace | None:
    """``trace`` (traced at :func:`shared_class` of ``layout``) as the trace of ``layout``'s
    class; ``None`` when that is not exact for this trace.

    Why it is exact: replicas over ``dp_replicate`` hold the same parameters and run the same
    micro-batch shapes (the micro-batch size is part of the class), so one rank's ops, their
    shapes and every tensor it keeps are the same for any replicate degree above 1; what the
    degree changes is the size of the groups of the collectives that run over it. For an
    all-reduce (FSDP2's HSDP gradient sync, DDP) and a broadcast the per-rank buffer does not
    depend on the group size either, so only ``group_size`` is rewritten. A trace with any
    other kind of collective over ``dp_replicate`` (its per-rank bytes would scale with the
    group) is not shared: ``None``, and the class is traced itself. A test compares a shared
    trace with one traced at the degree itself, record by record.
    """
    from topomesh.trace.graph import CollectiveKind, CollectiveRecord

    real = dict(layout_class(layout))
    traced = dict(trace.layout)
    if set(real) != set(traced):
        return None
    size_free = {CollectiveKind.ALL_REDUCE, CollectiveKind.BROADCAST}

    def fix(e):
        if not isinstance(e, CollectiveRecord) or not e.mesh_axis:
            return e
        axes = e.mesh_axis.split("+")
        if Axis.DP_REPLICATE.value not in axes:
            return e
        if e.kind not in size_free or any(a not in real for a in axes):
            raise _NotShared
        if e.group_size != math.prod(traced[a] for a in axes):
            raise _NotShared
        return dataclasses.replace(e, group_size=math.prod(real[a] for a in axes))

    try:
        segments = tuple(dataclasses.replace(s, events=tuple(fix(e) for e in s.events),
                                             prefetch=tuple(fix(e) for e in s.prefetch))
                         for s in trace.segments)
    except _NotShared:
        return None
    return dataclasses.replace(trace, segments=segments, layout=tuple((a, real[a]) for a, _ in trace.layout))


class _NotShared(Exception):
    pass


RING_ROUNDS = 4
"""Classes with ``cp`` above this are traced with rings of ``RING_ROUNDS - 1`` and
``RING_ROUNDS`` rounds and composed (:func:`compose_rounds`)."""


def compose_rounds(short: Trace, long: Trace, cp: int) -> Trace | None:
    """The trace of a full ring of ``cp`` rounds from traces whose ring attention ran
    ``RING_ROUNDS - 1`` (``short``) and ``RING_ROUNDS`` (``long``) rounds; ``None`` unless
    ``long`` is ``short`` plus records, segment by segment.

    Why it is exact (see :func:`topomesh.trace.tracer.limited_ring`): both traces run the real
    mesh, group sizes and shapes; the ring's middle rounds are identical on the traced rank, so
    what ``long`` adds to ``short`` is one middle round (its ops, its send, the activations it
    keeps), and the full ring is ``long`` plus ``cp - RING_ROUNDS`` more of it. The pricing
    reads a segment's records as a multiset (compute sums, a piece's collectives queue on their
    streams), so the copies are appended to the segment. Anything else that differs (parameter
    state, segment structure, the largest tensor) refuses the composition. A test compares a
    composed trace with one of the whole ring, record by record.
    """
    if (len(short.segments) != len(long.segments) or short.block_state != long.block_state
            or short.first_state != long.first_state or short.last_state != long.last_state):
        return None
    extra = cp - RING_ROUNDS
    segments = []
    for a, b in zip(short.segments, long.segments, strict=True):
        if (a.part, a.phase, a.layer) != (b.part, b.phase, b.layer) or a.peak_output_bytes != b.peak_output_bytes:
            return None
        rounds = []
        for x, y in ((a.events, b.events), (a.prefetch, b.prefetch)):
            more = Counter(y)
            more.subtract(Counter(x))
            if any(n < 0 for n in more.values()):
                return None
            added = []
            for e in y:  # the added records in the long trace's order
                if more[e] > 0:
                    added.append(e)
                    more[e] -= 1
            rounds.append(tuple(added))
        if b.saved_bytes < a.saved_bytes:
            return None
        segments.append(dataclasses.replace(
            b, events=b.events + rounds[0] * extra, prefetch=b.prefetch + rounds[1] * extra,
            saved_bytes=b.saved_bytes + (b.saved_bytes - a.saved_bytes) * extra))
    return dataclasses.replace(long, segments=tuple(segments), trace_s=short.trace_s + long.trace_s)


def callable_key(fn: Callable | None) -> str:
    """A stable name for a parallelize function: qualified name plus bound arguments.

    >>> callable_key(functools.partial(max, default=0))
    'builtins.max(default=0)'
    """
    if fn is None:
        return "none"
    if isinstance(fn, functools.partial):
        args = [repr(a) for a in fn.args] + [f"{k}={v!r}" for k, v in sorted(fn.keywords.items())]
        return f"{callable_key(fn.func)}({', '.join(args)})"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


TRACE_FORMAT = 10
"""Part of every cache key and file; raised when the tracer or the built-in models change what a
trace holds, so traces stored by an older topomesh are not reused (2: context parallel, attention
as its own ``sdpa`` module, GPT positions as a buffer; 3: JSON files instead of pickle; 4: each
distinct record stored once, :func:`topomesh.trace.codec.trace_to_json`; 5: selective activation
checkpointing recomputes in backward what its policy does not save, as a run does; 6: a segment's
transient memory is its temporaries' live peak, not its largest tensor; 7: a parameter's gradient
bytes are those of the gradient the traced backward made, not the parameter's; 8: a segment's
``param_bytes``, what it makes from parameters alone; 9: a kept tensor's bytes in the forward
segment whose backward reads it, not the one that made it; 10: each op's FSDP2 hook,
:attr:`~topomesh.trace.graph.OpRecord.hook`)."""

FILE_FORMAT = "topomesh-trace"
FAILURE_FORMAT = "topomesh-trace-failure"
"""A class that cannot be traced: ``<sha256(key)[:32]>.failed<FAILURE_VERSION>.json.gz`` holds
the error (see :func:`_repeatable`), so a search does not trace it again to fail again."""
FAILURE_VERSION = 2
"""Part of a failure file's name and document; raised when the tracer learns to trace what it
refused before, so the old refusals are not read (2: context parallel under activation
checkpointing). A successful trace removes its class's failure file."""
MAX_FILE_BYTES = 64 * 2**20
"""Largest cache file read (gzip'd)."""
MAX_JSON_BYTES = 512 * 2**20
"""Largest unpacked JSON accepted from a cache file (a bound against gzip bombs)."""

log = logging.getLogger("topomesh")


def default_directory() -> Path:
    """``$TOPOMESH_CACHE_DIR/traces`` (default ``~/.cache/topomesh/traces``)."""
    from topomesh.cost.devices import cache_dir

    return cache_dir() / "traces"


class TraceCache:
    """Traces by (model key, parallelize key, layout class, batch size, dtype)."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        """Traces in memory, and in ``directory`` when given (see :func:`default_directory`).

        A directory that cannot be made private (another user's, open to others, a symlink,
        not a directory) is not used: a warning says why and traces stay in memory.
        """
        self._traces: dict[str, Trace] = {}
        self._regrouped: dict[tuple, tuple] = {}  # (id of the shared trace's segments, class) -> (segments, trace)
        self.directory = _usable_directory(Path(directory)) if directory is not None else None
        self.hits = 0
        self.misses = 0

    def key(
        self,
        spec: ModelSpec,
        parallelize: ParallelizeFn | None,
        layout: Mapping[str, int],
        *,
        batch_size: int,
        dtype: torch.dtype,
        optimizer: OptimizerFactory | None,
        ring_rounds: int | None = None,
        gpu_kernels: bool = False,
    ) -> str:
        parts = (
            spec.key,
            callable_key(parallelize),
            repr(layout_class(layout)),
            str(batch_size),
            str(dtype),
            callable_key(optimizer),
            torch.__version__,
            f"format{TRACE_FORMAT}",
            *((f"ring{ring_rounds}",) if ring_rounds else ()),
            *(("gpu-kernels",) if gpu_kernels else ()),
        )
        return "|".join(parts)

    def get(
        self,
        spec: ModelSpec,
        parallelize: ParallelizeFn | None,
        layout: Mapping[str, int],
        *,
        batch_size: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        optimizer: OptimizerFactory | None = default_optimizer,
        gpu_kernels: bool = False,
    ) -> Trace:
        """The step of ``spec`` at full depth under ``layout``, traced at most once per class
        (``gpu_kernels``: as a GPU runs it, :func:`~topomesh.trace.tracer.trace_step`)."""
        wanted = dict(layout_class(layout))
        traced_class = shared_class(wanted)

        def exact() -> Trace:
            return self._get_exact(spec, parallelize, wanted, batch_size, dtype, optimizer, gpu_kernels=gpu_kernels)

        if traced_class != wanted:
            base = self.get(spec, parallelize, traced_class, batch_size=batch_size, dtype=dtype, optimizer=optimizer,
                            gpu_kernels=gpu_kernels)
            trace = self._derived((id(base.segments), tuple(sorted(wanted.items()))), base.segments,
                                  lambda: regroup(base, wanted), exact)
        elif wanted.get(Axis.CP.value, 1) > RING_ROUNDS:
            parts = [self._get_exact(spec, parallelize, wanted, batch_size, dtype, optimizer, ring_rounds=n,
                                     gpu_kernels=gpu_kernels)
                     for n in (RING_ROUNDS - 1, RING_ROUNDS)]
            trace = self._derived((id(parts[0].segments), id(parts[1].segments), wanted[Axis.CP.value]), parts,
                                  lambda: compose_rounds(parts[0], parts[1], wanted[Axis.CP.value]), exact)
        else:
            return exact()
        return trace.compose(spec.n_layers) if spec.n_layers > trace.traced_layers else trace

    def _derived(self, memo_key: tuple, keep: object, build: Callable[[], Trace | None],
                 exact: Callable[[], Trace]) -> Trace:
        """A trace derived from stored ones (:func:`regroup`, :func:`compose_rounds`), built once
        per ``memo_key`` (ids of the sources, kept alive with it by ``keep``); the class traced
        itself (``exact``) when the derivation would not be exact."""
        hit = self._regrouped.get(memo_key)
        if hit is None:
            trace = build()
            if trace is None:
                return exact()
            hit = self._regrouped[memo_key] = (keep, trace)
        return hit[1]

    def stored(
        self,
        spec: ModelSpec,
        parallelize: ParallelizeFn | None,
        layout: Mapping[str, int],
        *,
        batch_size: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        optimizer: OptimizerFactory | None = default_optimizer,
        gpu_kernels: bool = False,
    ) -> bool:
        """Whether every trace :meth:`get` reads for ``layout`` is in memory or has a file (not
        opened: a bad file is still found, logged and traced again by :meth:`get`)."""
        for key in self._read_keys(spec, parallelize, layout, batch_size, dtype, optimizer, gpu_kernels):
            path = self._path(key)
            if key not in self._traces and (path is None or not path.is_file()):
                return False
        return True

    def _read_keys(self, spec: ModelSpec, parallelize: ParallelizeFn | None, layout: Mapping[str, int],
                   batch_size: int, dtype: torch.dtype, optimizer: OptimizerFactory | None,
                   gpu_kernels: bool = False) -> list[str]:
        """The keys of the traces :meth:`get` reads for ``layout``: its shared class, as both
        short rings when its ring is composed."""
        wanted = shared_class(layout)
        rounds = (RING_ROUNDS - 1, RING_ROUNDS) if wanted.get(Axis.CP.value, 1) > RING_ROUNDS else (None,)
        return [self.key(spec, parallelize, wanted, batch_size=batch_size, dtype=dtype, optimizer=optimizer,
                         ring_rounds=n, gpu_kernels=gpu_kernels) for n in rounds]

    def _get_exact(self, spec: ModelSpec, parallelize: ParallelizeFn | None, layout: Mapping[str, int],
                   batch_size: int, dtype: torch.dtype, optimizer: OptimizerFactory | None,
                   ring_rounds: int | None = None, gpu_kernels: bool = False) -> Trace:
        key = self.key(spec, parallelize, layout, batch_size=batch_size, dtype=dtype, optimizer=optimizer,
                       ring_rounds=ring_rounds, gpu_kernels=gpu_kernels)
        trace = self._traces.get(key) or self._load(key)
        if trace is None:
            failed = self._load_failure(key)
            if failed is not None:
                self.hits += 1
                raise TraceError(failed)
            self.misses += 1
            kw = dict(n_layers=min(REUSE_LAYERS, spec.n_layers), batch_size=batch_size, dtype=dtype,
                      optimizer=optimizer, **({"gpu_kernels": True} if gpu_kernels else {}))
            try:
                if ring_rounds == RING_ROUNDS - 1:
                    trace = self._short_ring(spec, parallelize, layout, kw)
                else:
                    trace = trace_step(spec, parallelize, dict(layout_class(layout)), ring_rounds=ring_rounds, **kw)
            except TraceError as exc:
                if _repeatable(exc):
                    self._store_failure(key, str(exc))
                raise
            self._store(key, trace)
        else:
            self.hits += 1
        self._traces[key] = trace
        return trace.compose(spec.n_layers) if spec.n_layers > trace.traced_layers else trace

    def _short_ring(self, spec: ModelSpec, parallelize: ParallelizeFn | None, layout: Mapping[str, int],
                    kw: dict[str, Any]) -> Trace:
        """The ring of ``RING_ROUNDS - 1`` rounds; the ring of ``RING_ROUNDS``, which :meth:`get`
        reads next, comes from the same trace (:func:`~topomesh.trace.tracer.trace_rings`) and is
        kept and stored under its own key. The short ring is traced by itself only when its
        rounds cannot be cut out of the long one."""
        wanted = dict(layout_class(layout))
        short, long = trace_rings(spec, parallelize, wanted, ring_rounds=RING_ROUNDS, **kw)
        key = self.key(spec, parallelize, layout, batch_size=kw["batch_size"], dtype=kw["dtype"],
                       optimizer=kw["optimizer"], ring_rounds=RING_ROUNDS, gpu_kernels=kw.get("gpu_kernels", False))
        if key not in self._traces:
            self._traces[key] = long
            self._store(key, long)
        if short is None:
            log.info("topomesh: the ring rounds of %s could not be cut from one trace; tracing the short ring", wanted)
            short = trace_step(spec, parallelize, wanted, ring_rounds=RING_ROUNDS - 1, **kw)
        return short

    def failure(
        self,
        spec: ModelSpec,
        parallelize: ParallelizeFn | None,
        layout: Mapping[str, int],
        *,
        batch_size: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        optimizer: OptimizerFactory | None = default_optimizer,
        gpu_kernels: bool = False,
    ) -> str | None:
        """Why ``layout``'s class (as :meth:`get` traces it) failed to trace before, when a
        stored failure says so (see :func:`_repeatable`); None otherwise."""
        for key in self._read_keys(spec, parallelize, layout, batch_size, dtype, optimizer, gpu_kernels):
            failed = self._load_failure(key)
            if failed is not None:
                return failed
        return None

    def __len__(self) -> int:
        return len(self._traces)

    def _failure_path(self, key: str) -> Path | None:
        path = self._path(key)
        return None if path is None else path.with_name(path.name.replace(".trace.", f".failed{FAILURE_VERSION}."))

    def _load_failure(self, key: str) -> str | None:
        def error_of(doc: dict) -> str:
            failed = doc.get("error")
            if type(failed) is not str or not failed or len(failed) > codec.MAX_STR * 8:
                raise TraceError("the error is not a non-empty string of at most 8,000 characters")
            return failed

        return load_document(self._failure_path(key), key, FAILURE_FORMAT, FAILURE_VERSION, error_of,
                             what="trace cache", again="tracing again")

    def _store_failure(self, key: str, message: str) -> None:
        path = self._failure_path(key)
        if path is not None:
            write_document(path, key, FAILURE_FORMAT, FAILURE_VERSION, {"error": message[: codec.MAX_STR * 8]})

    def _path(self, key: str) -> Path | None:
        if self.directory is None:
            return None
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.trace.json.gz"

    def _load(self, key: str) -> Trace | None:
        return load_document(self._path(key), key, FILE_FORMAT, TRACE_FORMAT, _trace_of,
                             what="trace cache", again="tracing again")

    def _store(self, key: str, trace: Trace) -> None:
        path = self._path(key)
        if path is not None:
            write_document(path, key, FILE_FORMAT, TRACE_FORMAT, {"trace": codec.trace_to_json(trace)})
            self._failure_path(key).unlink(missing_ok=True)


_REPEATABLE = (NotImplementedError, ValueError, TypeError, AssertionError, IndexError, RuntimeError)


def _repeatable(exc: TraceError) -> bool:
    """Whether a failure to trace says what the class itself is (stored, not traced again): our
    own refusals and PyTorch's refusals of the model or layout (an op without a fake or sharding
    implementation, uneven FSDP sharding, a view of a shape that does not divide). Not stored:
    anything that can depend on the process (memory, files, interrupted runs) and the fake process
    group's state left behind between traces (see
    :func:`topomesh.search.run._retry_isolated`), which fails once and traces alone."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    cause = exc.__cause__
    if "process group" in str(exc) or isinstance(cause, torch.OutOfMemoryError):
        return False
    return cause is None or isinstance(cause, (*_REPEATABLE, DataDependentOutputException, DynamicOutputShapeException,
                                               UnsupportedOperatorException))


def _usable_directory(directory: Path) -> Path | None:
    try:
        return private_directory(directory, what="trace cache directory", error=TraceError)
    except TraceError as exc:
        log.warning("topomesh: %s; keeping traces in memory only", exc)
        return None


def _read_entry(path: Path, key: str) -> Trace:
    """The trace stored in ``path`` for ``key``; OSError or TraceError saying why not."""
    return _trace_of(read_document(path, key, FILE_FORMAT, TRACE_FORMAT))


def _trace_of(doc: dict) -> Trace:
    try:
        return codec.trace_from_json(doc.get("trace"), "trace")
    except RecursionError:
        raise TraceError("nested too deeply") from None


def load_document(path: Path | None, key: str, file_format: str, version: int, decode: Callable[[dict], T], *,
                  what: str, again: str) -> T | None:
    """``decode`` of the document :func:`read_document` reads from ``path`` (None: no file, or no
    directory); a file that cannot be used is logged ("ignoring the ``what`` file ...;
    ``again``") and None returned, so the caller makes the entry again."""
    if path is None:
        return None
    try:
        return decode(read_document(path, key, file_format, version))
    except FileNotFoundError:
        return None
    except (OSError, TraceError) as exc:
        log.warning("topomesh: ignoring the %s file %s (%s); %s", what, path, exc, again)
        return None


def read_document(path: Path, key: str, file_format: str, version: int) -> dict:
    """The JSON object stored gzip'd in ``path`` for ``key`` as ``file_format`` ``version``:
    only from a regular file of this user (not followed if a symlink), at most
    :data:`MAX_FILE_BYTES` packed and :data:`MAX_JSON_BYTES` unpacked, standard JSON (no
    ``NaN``), with exactly these ``format``, ``version`` and ``key``; OSError or TraceError
    saying why not."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise TraceError("not a regular file of this user")
        packed = f.read(MAX_FILE_BYTES + 1)
    if len(packed) > MAX_FILE_BYTES:
        raise TraceError(f"larger than {MAX_FILE_BYTES} bytes")
    try:
        unpacker = zlib.decompressobj(wbits=31)  # gzip container
        data = unpacker.decompress(packed, MAX_JSON_BYTES + 1)
    except zlib.error as exc:
        raise TraceError(f"not gzip data ({exc})") from None
    if len(data) > MAX_JSON_BYTES or unpacker.unconsumed_tail:
        raise TraceError(f"unpacks to more than {MAX_JSON_BYTES} bytes")
    try:
        doc: Any = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, 4300+ digit numbers
        raise TraceError(f"not valid JSON ({type(exc).__name__}: {str(exc)[:80]})") from None
    if not isinstance(doc, dict) or doc.get("format") != file_format or doc.get("version") != version:
        raise TraceError(f"not a {file_format} file of version {version}")
    if doc.get("key") != key:
        raise TraceError("stored for a different key")
    return doc


def write_document(path: Path, key: str, file_format: str, version: int, body: dict[str, Any]) -> None:
    """``{"format", "version", "key", **body}`` gzip'd into ``path`` (atomically, mode 0600);
    a failure is logged, not raised (a cache that cannot write still works in memory)."""
    doc = {"format": file_format, "version": version, "key": key, **body}
    data = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    try:
        write_atomic(path, gzip.compress(data, compresslevel=6, mtime=0), mode=0o600)
    except OSError as exc:
        log.warning("topomesh: cannot write the cache file %s (%s)", path, exc.strerror or exc)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")
