"""Each layout class is traced once per cache; disk entries are reused across caches."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

import topomesh.trace.cache as cache_mod
from topomesh.models.parallelize import ParallelOptions, make_parallelize
from topomesh.models.presets import get_preset
from topomesh.trace.cache import TraceCache, callable_key, layout_class
from topomesh.trace.tracer import transformer_spec


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    calls: list[dict] = []
    real = cache_mod.trace_step

    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(dict(layout=args[2], **kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(cache_mod, "trace_step", wrapper)
    return calls


def test_layout_class_ignores_order_pp_and_unit_axes() -> None:
    assert layout_class({"tp": 2, "pp": 4, "dp_shard": 2, "cp": 1}) == layout_class({"dp_shard": 2, "tp": 2})


def test_one_trace_per_class_and_composed_depth(counted: list[dict], tmp_path) -> None:  # noqa: ANN001
    cfg = dataclasses.replace(get_preset("tiny-gpt"), n_layers=6)
    spec, par = transformer_spec(cfg), make_parallelize(ParallelOptions())
    cache = TraceCache(tmp_path)
    a = cache.get(spec, par, {"tp": 2, "dp_shard": 2})
    b = cache.get(spec, par, {"dp_shard": 2, "tp": 2, "pp": 3})
    assert len(counted) == 1 and counted[0]["n_layers"] == 1
    assert (cache.misses, cache.hits, len(cache)) == (1, 1, 1)
    assert a == b and a.n_layers == 6 and a.traced_layers == 1
    # another cache on the same directory reads the file instead of tracing
    again = TraceCache(tmp_path).get(spec, par, {"tp": 2, "dp_shard": 2})
    assert len(counted) == 1 and Counter(again.events()) == Counter(a.events())
    # a different parallelization is a different entry
    TraceCache(tmp_path).get(spec, make_parallelize(ParallelOptions(sequence_parallel=False)), {"tp": 2, "dp_shard": 2})
    assert len(counted) == 2


def test_corrupt_file_is_retraced(counted: list[dict], tmp_path) -> None:  # noqa: ANN001
    spec, par = transformer_spec(get_preset("tiny-gpt")), make_parallelize()
    TraceCache(tmp_path).get(spec, par, {"tp": 2})
    (path,) = tmp_path.glob("*.trace.pkl")
    path.write_bytes(b"not a pickle")
    t = TraceCache(tmp_path).get(spec, par, {"tp": 2})
    assert len(counted) == 2 and t.layout == (("tp", 2),)


def test_callable_key_names_bound_options() -> None:
    key = callable_key(make_parallelize(ParallelOptions(sequence_parallel=False)))
    assert key.startswith("topomesh.models.parallelize.parallelize_transformer(")
    assert "sequence_parallel=False" in key
