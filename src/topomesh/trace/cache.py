"""Trace each (model, parallelization, layout class) once; reuse it for every layout of the class.

A *layout class* is what a rank's trace depends on: the degrees of the traced mesh axes
(``pp`` excluded — a stage runs the same block step; axes of degree 1 add no collective).
Axis order does not change one rank's ops or group sizes, so ``{"tp": 8, "dp_shard": 4}``
and ``{"dp_shard": 4, "tp": 8}`` share a trace.

:class:`TraceCache` keeps traces in a dict it owns and, when given a directory, in pickle
files there (written atomically, keyed by a SHA-256 of the key, the torch version and
:data:`TRACE_FORMAT`), so separate searches reuse them too. A deep model is traced with one
block and composed (:meth:`~topomesh.trace.result.Trace.compose`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from topomesh.layout.dims import Axis
from topomesh.topology.api import write_atomic
from topomesh.trace.result import Trace
from topomesh.trace.tracer import (
    ModelSpec,
    OptimizerFactory,
    ParallelizeFn,
    default_optimizer,
    trace_step,
)

REUSE_LAYERS = 1
"""Blocks in the model actually traced; deeper models are composed from it."""


def layout_class(layout: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """The part of a layout a rank's trace depends on, in a canonical order.

    >>> layout_class({"tp": 8, "pp": 4, "dp_replicate": 1, "dp_shard": 2})
    (('dp_shard', 2), ('tp', 8))
    """
    return tuple(sorted((str(a), int(d)) for a, d in layout.items() if a != Axis.PP and d > 1))


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


TRACE_FORMAT = 2
"""Part of every cache key; raised when the tracer or the built-in models change what a trace
holds, so traces stored by an older topomesh are not reused (2: context parallel, attention
as its own ``sdpa`` module, GPT positions as a buffer)."""


class TraceCache:
    """Traces by (model key, parallelize key, layout class, batch size, dtype)."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self._traces: dict[str, Trace] = {}
        self.directory = Path(directory) if directory is not None else None
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
    ) -> Trace:
        """The step of ``spec`` at full depth under ``layout``, traced at most once per class."""
        key = self.key(spec, parallelize, layout, batch_size=batch_size, dtype=dtype, optimizer=optimizer)
        trace = self._traces.get(key) or self._load(key)
        if trace is None:
            self.misses += 1
            traced = min(REUSE_LAYERS, spec.n_layers)
            trace = trace_step(
                spec, parallelize, dict(layout_class(layout)),
                n_layers=traced, batch_size=batch_size, dtype=dtype, optimizer=optimizer,
            )
            self._store(key, trace)
        else:
            self.hits += 1
        self._traces[key] = trace
        return trace.compose(spec.n_layers) if spec.n_layers > trace.traced_layers else trace

    def __len__(self) -> int:
        return len(self._traces)

    def _path(self, key: str) -> Path | None:
        if self.directory is None:
            return None
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.trace.pkl"

    def _load(self, key: str) -> Trace | None:
        path = self._path(key)
        if path is None or not path.is_file():
            return None
        try:
            with path.open("rb") as f:
                stored_key, trace = pickle.load(f)
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError):
            return None  # unreadable or stale: trace again and overwrite
        return trace if stored_key == key and isinstance(trace, Trace) else None

    def _store(self, key: str, trace: Trace) -> None:
        path = self._path(key)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, pickle.dumps((key, trace), protocol=pickle.HIGHEST_PROTOCOL))
