"""Each layout class is traced once per cache; disk entries are reused across caches."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import logging
import os
import pickle
import re
import stat
from collections import Counter
from pathlib import Path

import pytest
import torch

import topomesh.trace.cache as cache_mod
from topomesh.errors import TraceError
from topomesh.models.parallelize import ParallelOptions, make_parallelize
from topomesh.models.presets import get_preset
from topomesh.trace.cache import TRACE_FORMAT, TraceCache, callable_key, layout_class
from topomesh.trace.tracer import default_optimizer, transformer_spec


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Every trace the cache makes: ``trace_step`` calls, and ``trace_rings`` calls (``rings``)."""
    calls: list[dict] = []

    def counting(real, **extra):  # noqa: ANN001, ANN003, ANN202
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls.append(dict(layout=args[2], **kwargs, **extra))
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(cache_mod, "trace_step", counting(cache_mod.trace_step))
    monkeypatch.setattr(cache_mod, "trace_rings", counting(cache_mod.trace_rings, rings=True))
    return calls


@pytest.fixture(scope="module")
def tiny_trace():  # noqa: ANN201
    from topomesh.trace.tracer import trace_step

    return trace_step(transformer_spec(get_preset("tiny-gpt")), make_parallelize(), {"tp": 2}, n_layers=1)


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch, tiny_trace) -> list[dict]:  # noqa: ANN001
    """Like ``counted``, but every trace is the module's one real trace (no tracing per test)."""
    calls: list[dict] = []

    def fake(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(dict(layout=args[2], **kwargs))
        return tiny_trace

    def fake_rings(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(dict(layout=args[2], **kwargs, rings=True))
        return tiny_trace, tiny_trace

    monkeypatch.setattr(cache_mod, "trace_step", fake)
    monkeypatch.setattr(cache_mod, "trace_rings", fake_rings)
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
    _entry(tmp_path).write_bytes(b"not gzip'd JSON")
    t = TraceCache(tmp_path).get(spec, par, {"tp": 2})
    assert len(counted) == 2 and t.layout == (("tp", 2),)


def test_callable_key_names_bound_options() -> None:
    key = callable_key(make_parallelize(ParallelOptions(sequence_parallel=False)))
    assert key.startswith("topomesh.models.parallelize.parallelize_transformer(")
    assert "sequence_parallel=False" in key


def _entry(tmp_path) -> Path:  # noqa: ANN001
    (path,) = tmp_path.glob("*.trace.json.gz")
    return path


def test_files_are_private_json_and_hold_the_full_key(fast: list[dict], tmp_path) -> None:  # noqa: ANN001
    spec, par = transformer_spec(get_preset("tiny-gpt")), make_parallelize()
    d = tmp_path / "traces"
    cache = TraceCache(d)
    trace = cache.get(spec, par, {"tp": 2})
    path = _entry(d)
    key = cache.key(spec, par, {"tp": 2}, batch_size=1, dtype=torch.bfloat16, optimizer=default_optimizer)
    assert path.name == hashlib.sha256(key.encode()).hexdigest()[:32] + ".trace.json.gz"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
    doc = json.loads(gzip.decompress(path.read_bytes()))
    assert (doc["format"], doc["version"], doc["key"]) == ("topomesh-trace", TRACE_FORMAT, key)
    assert key.endswith(f"|format{TRACE_FORMAT}")
    body = doc["trace"]["trace"]
    assert body["layout"] == [["tp", 2]] and body["model"] == trace.model
    # each distinct record once; segments list indices
    events = [i for seg in body["segments"] for i in seg["events"]]
    assert len(doc["trace"]["records"]) == len(set(events)) == len(set(trace.segments[0].events + sum(
        (s.events + s.prefetch for s in trace.segments[1:]), ())))


class _Payload:
    """Unpickling this creates ``marker``: what an attacker's pickle would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (str(self.marker), "w"))


def test_a_planted_pickle_is_never_executed(fast: list[dict], tmp_path) -> None:  # noqa: ANN001
    spec, par = transformer_spec(get_preset("tiny-gpt")), make_parallelize()
    d = tmp_path / "traces"
    cache = TraceCache(d)
    key = cache.key(spec, par, {"tp": 2}, batch_size=1, dtype=torch.bfloat16, optimizer=default_optimizer)
    stem = hashlib.sha256(key.encode()).hexdigest()[:32]
    marker = tmp_path / "pwned"
    bomb = pickle.dumps((key, _Payload(marker)))
    (d / f"{stem}.trace.pkl").write_bytes(bomb)  # the name the pickle cache used
    (d / f"{stem}.trace.json.gz").write_bytes(bomb)  # and the name it has now
    (d / f"{stem}.trace.json.gz").chmod(0o600)
    assert not marker.exists()
    trace = cache.get(spec, par, {"tp": 2})
    assert not marker.exists() and len(fast) == 1 and trace.layout == (("tp", 2),)
    # the planted file was replaced by a real entry that the next cache reads
    TraceCache(d).get(spec, par, {"tp": 2})
    assert len(fast) == 1 and not marker.exists()


def _tamper(path: Path, edit) -> None:  # noqa: ANN001
    doc = json.loads(gzip.decompress(path.read_bytes()))
    edit(doc)
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))


def _first_op(doc: dict) -> dict:
    return next(e for e in doc["trace"]["records"] if e["type"] == "OpRecord" and e["flops"])


@pytest.mark.parametrize(
    "edit, reason",
    [
        (lambda doc: _first_op(doc).update(flops=10**400), "flops: expected an integer from 0 to 2\\*\\*63-1"),
        (lambda doc: _first_op(doc).update(flops=-5), "flops: expected an integer"),
        (lambda doc: _first_op(doc).update(flops="1e9"), "flops: expected an integer"),
        (lambda doc: _first_op(doc).update(flops=True), "flops: expected an integer"),
        (lambda doc: _first_op(doc)["inputs"][0]["stride"].append(1), "inputs\\[0\\]: shape .* same length"),
        (lambda doc: _first_op(doc).update(evil=1), "unknown keys \\['evil'\\]"),
        (lambda doc: doc["trace"]["trace"].update(n_layers=0), "traced_layers 1, n_layers 0"),
        (lambda doc: doc["trace"]["trace"]["segments"][0]["events"].append(10**6), "events: expected a list of record indices"),
        (lambda doc: doc["trace"]["trace"]["segments"][0]["events"].append(-1), "events: expected a list of record indices"),
        (lambda doc: doc["trace"]["trace"]["segments"][0]["events"].append(True), "events: expected a list of record indices"),
        (lambda doc: doc["trace"]["trace"]["segments"][0].update(prefetch="0"), "prefetch: expected a list of record indices"),
        (lambda doc: doc["trace"].update(extra=[]), "expected an object with exactly 'records' and 'trace'"),
        (lambda doc: doc.update(key="someone else's key"), "stored for a different key"),
        (lambda doc: doc.update(version=TRACE_FORMAT - 1), f"not a topomesh-trace file of version {TRACE_FORMAT}"),
    ],
)
def test_a_tampered_entry_is_ignored_and_replaced(fast, tmp_path, caplog, edit, reason) -> None:  # noqa: ANN001
    spec, par = transformer_spec(get_preset("tiny-gpt")), make_parallelize()
    first = TraceCache(tmp_path).get(spec, par, {"tp": 2})
    path = _entry(tmp_path)
    _tamper(path, edit)
    with caplog.at_level(logging.WARNING, logger="topomesh"):
        again = TraceCache(tmp_path).get(spec, par, {"tp": 2})
    assert len(fast) == 2 and again == first
    assert re.search(f"ignoring the trace cache file .*{reason}", caplog.text), caplog.text
    TraceCache(tmp_path).get(spec, par, {"tp": 2})  # overwritten with a good entry
    assert len(fast) == 2


@pytest.mark.parametrize(
    "data",
    [
        b"not gzip",
        gzip.compress(b"[" * 100_000 + b"]" * 100_000),  # RecursionError in json
        gzip.compress(b'{"format": "topomesh-trace", "version": NaN}'),
        gzip.compress(b'{"version": ' + b"9" * 5000 + b"}"),  # past int's digit limit
        gzip.compress(b"\xff\xfe not utf-8"),
    ],
)
def test_malformed_files_never_crash(fast: list[dict], tmp_path, data: bytes) -> None:  # noqa: ANN001
    spec, par = transformer_spec(get_preset("tiny-gpt")), make_parallelize()
    TraceCache(tmp_path).get(spec, par, {"tp": 2})
    _entry(tmp_path).write_bytes(data)
    TraceCache(tmp_path).get(spec, par, {"tp": 2})
    assert len(fast) == 2


def test_gzip_bombs_are_refused_unpacked_only_to_the_limit(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(cache_mod, "MAX_JSON_BYTES", 1000)
    path = tmp_path / "x.trace.json.gz"
    path.write_bytes(gzip.compress(b" " * 10**6))
    with pytest.raises(TraceError, match="unpacks to more than 1000 bytes"):
        cache_mod._read_entry(path, "k")


def test_a_shared_or_foreign_directory_is_not_used(fast, tmp_path, caplog, monkeypatch) -> None:  # noqa: ANN001
    spec, par = transformer_spec(get_preset("tiny-gpt")), make_parallelize()
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="topomesh"):
        cache = TraceCache(open_dir)
    assert cache.directory is None and "mode 0777" in caplog.text and "in memory only" in caplog.text
    cache.get(spec, par, {"tp": 2})
    assert list(open_dir.iterdir()) == []
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    real = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real + 1)
    assert TraceCache(theirs).directory is None


def test_default_directory_under_the_cache_dir(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(tmp_path / "c"))
    assert cache_mod.default_directory() == tmp_path / "c" / "traces"


def test_only_regular_files_of_this_user_are_read(fast, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    spec, par = transformer_spec(get_preset("tiny-gpt")), make_parallelize()
    cache = TraceCache(tmp_path)
    cache.get(spec, par, {"tp": 2})
    key = cache.key(spec, par, {"tp": 2}, batch_size=1, dtype=torch.bfloat16, optimizer=default_optimizer)
    path = _entry(tmp_path)
    assert cache_mod._read_entry(path, key).layout == (("tp", 2),)
    real = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real + 1)  # the file now belongs to "someone else"
    with pytest.raises(TraceError, match="not a regular file of this user"):
        cache_mod._read_entry(path, key)
    monkeypatch.setattr(os, "getuid", lambda: real)
    link = tmp_path / "link.trace.json.gz"
    link.symlink_to(path)
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        cache_mod._read_entry(link, key)


def test_hsdp_with_context_parallel_traces_whatever_order_the_layout_gives() -> None:
    """A class's mesh is built slowest axis first: sorted by name, cp came before dp_replicate
    and HSDP could not slice (dp_replicate, dp_shard_cp) ("ascending order")."""
    from topomesh.models.parallelize import make_parallelize
    from topomesh.models.presets import get_preset
    from topomesh.trace.tracer import transformer_spec

    trace = TraceCache().get(transformer_spec(get_preset("tiny-llama")), make_parallelize(),
                             {"cp": 2, "dp_shard": 2, "dp_replicate": 2})
    assert trace.layout == (("dp_replicate", 2), ("dp_shard", 2), ("cp", 2))
    axes = {e.mesh_axis for s in trace.segments for e in s.events if hasattr(e, "mesh_axis")}
    assert "cp" in axes and any("dp_shard" in (a or "") for a in axes)


@pytest.mark.parametrize("layout", [{"dp_replicate": 4}, {"dp_replicate": 4, "dp_shard": 2},
                                    {"dp_replicate": 8, "tp": 2}])
def test_a_replicate_degree_shares_the_trace_at_two_exactly(layout: dict, counted: list[dict]) -> None:
    """A class with dp_replicate above 2 is the dp_replicate=2 trace with the group sizes of
    its replicate collectives rewritten; record by record it equals a trace at the degree itself."""
    from topomesh.trace.tracer import trace_step

    spec, par = transformer_spec(get_preset("tiny-llama")), make_parallelize()
    cache = TraceCache()
    shared = cache.get(spec, par, layout)
    assert [c["layout"] for c in counted] == [{**layout, "dp_replicate": 2}]
    real = trace_step(spec, par, dict(layout_class(layout)), n_layers=1).compose(spec.n_layers)
    assert shared.layout == real.layout == layout_class(layout)
    assert shared.segments == real.segments
    groups = {e.group_size for e in shared.events() if getattr(e, "mesh_axis", None) == "dp_replicate"}
    assert groups == {layout["dp_replicate"]}
    # a second degree reuses the same trace: still one traced class
    cache.get(spec, par, {**layout, "dp_replicate": 16})
    assert len(counted) == 1


def test_regroup_refuses_collectives_whose_bytes_scale_with_the_group(tiny_trace) -> None:  # noqa: ANN001
    from topomesh.trace.cache import regroup
    from topomesh.trace.graph import CollectiveKind, CollectiveRecord
    from topomesh.trace.result import Segment

    gather = CollectiveRecord(kind=CollectiveKind.ALL_GATHER, bytes=64, group_size=2, mesh_axis="dp_replicate")
    seg = dataclasses.replace(tiny_trace.segments[0], events=(gather,))
    trace = dataclasses.replace(tiny_trace, segments=(seg,), layout=(("dp_replicate", 2),))
    assert regroup(trace, {"dp_replicate": 4}) is None
    reduce = dataclasses.replace(gather, kind=CollectiveKind.ALL_REDUCE)
    ok = regroup(dataclasses.replace(trace, segments=(Segment(part=seg.part, phase=seg.phase, events=(reduce,)),)),
                 {"dp_replicate": 4})
    assert ok is not None and ok.segments[0].events[0].group_size == 4 and ok.layout == (("dp_replicate", 4),)


@pytest.mark.parametrize("layout", [{"cp": 8}, {"cp": 8, "dp_shard": 2}, {"cp": 16, "tp": 2}])
def test_a_long_ring_is_composed_from_rings_of_three_and_four_rounds_exactly(layout: dict, counted: list[dict]) -> None:
    """cp above 4: one trace of ring attention for 4 rounds gives the rings of 3 and 4 rounds
    and the middle round is repeated; per segment the records (as a multiset), the kept
    activations and the largest tensor equal a trace of the whole ring."""
    from topomesh.trace.tracer import trace_step

    spec, par = transformer_spec(get_preset("tiny-llama")), make_parallelize()
    composed = TraceCache().get(spec, par, layout)
    assert [(c["ring_rounds"], c.get("rings")) for c in counted] == [(4, True)]
    real = trace_step(spec, par, dict(layout_class(layout)), n_layers=1).compose(spec.n_layers)
    assert composed.layout == real.layout and len(composed.segments) == len(real.segments)
    for a, b in zip(composed.segments, real.segments, strict=True):
        assert Counter(a.events) == Counter(b.events) and Counter(a.prefetch) == Counter(b.prefetch)
        assert (a.saved_bytes, a.peak_output_bytes) == (b.saved_bytes, b.peak_output_bytes)
    assert composed.summary() == real.summary()
    sends = [e for e in composed.events() if getattr(e, "mesh_axis", None) == "cp"]
    assert sends and {e.group_size for e in sends} == {layout["cp"]}


def test_a_ring_whose_rounds_cannot_be_cut_is_traced_short_by_itself(counted: list[dict],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """When the round marks do not come out (``round_nodes`` None) the ring of 3 rounds is traced
    by itself, and the composed trace is the same."""
    from topomesh.trace import tracer

    spec, par = transformer_spec(get_preset("tiny-llama")), make_parallelize()
    cut = TraceCache().get(spec, par, {"cp": 8})
    counted.clear()
    monkeypatch.setattr(tracer._Markers, "round_nodes", lambda *a: None)
    whole = TraceCache().get(spec, par, {"cp": 8})
    assert [(c["ring_rounds"], c.get("rings")) for c in counted] == [(4, True), (3, None)]
    assert dataclasses.replace(whole, trace_s=0.0) == dataclasses.replace(cut, trace_s=0.0)


def test_stored_says_whether_get_would_trace(fast: list[dict], tmp_path) -> None:  # noqa: ANN001
    spec, par = transformer_spec(get_preset("tiny-gpt")), make_parallelize()
    d = tmp_path / "traces"
    assert not TraceCache(d).stored(spec, par, {"tp": 2}) and not TraceCache().stored(spec, par, {"tp": 2})
    TraceCache(d).get(spec, par, {"tp": 2, "dp_replicate": 2})
    TraceCache(d).get(spec, par, {"cp": 8})
    fresh = TraceCache(d)
    assert fresh.stored(spec, par, {"tp": 2, "dp_replicate": 64})  # the shared dp_replicate=2 file
    assert fresh.stored(spec, par, {"cp": 8})  # both ring files
    assert not fresh.stored(spec, par, {"cp": 16, "tp": 2}) and not fresh.stored(spec, par, {"tp": 2})
    assert not fresh.stored(spec, par, {"tp": 2, "dp_replicate": 2}, batch_size=2)
    calls = len(fast)
    fresh.get(spec, par, {"cp": 8})
    assert len(fast) == calls  # stored means read, not traced
    (next(d.iterdir())).unlink()
    assert not TraceCache(d).stored(spec, par, {"cp": 8}) or not TraceCache(d).stored(spec, par, {"tp": 2, "dp_replicate": 2})


def _failing(monkeypatch: pytest.MonkeyPatch, cause: BaseException | None) -> list[dict]:
    """trace_step raising the tracer's TraceError for ``cause`` (as :func:`_trace_error` wraps it)."""
    calls: list[dict] = []

    def fail(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(dict(layout=args[2], **kwargs))
        raise TraceError(f"Model 'tiny-gpt' could not be traced (step): {cause!r}.") from cause

    monkeypatch.setattr(cache_mod, "trace_step", fail)
    return calls


def test_a_class_that_cannot_be_traced_is_not_traced_again(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    calls = _failing(monkeypatch, NotImplementedError("FSDP does not support uneven sharding"))
    spec, par = transformer_spec(get_preset("tiny-gpt")), make_parallelize()
    with pytest.raises(TraceError, match="uneven sharding") as first:
        TraceCache(tmp_path).get(spec, par, {"tp": 2})
    again = TraceCache(tmp_path)
    assert again.failure(spec, par, {"tp": 2}) == str(first.value)
    with pytest.raises(TraceError) as second:
        again.get(spec, par, {"tp": 2})
    assert str(second.value) == str(first.value) and len(calls) == 1
    (path,) = tmp_path.glob("*.failed2.json.gz")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert TraceCache(tmp_path).failure(spec, par, {"tp": 4}) is None  # another class: not failed


def test_refusals_of_an_older_tracer_are_not_read(monkeypatch, tmp_path, tiny_trace) -> None:  # noqa: ANN001
    """A tracer that learned to trace a class (``FAILURE_VERSION`` raised) traces it again, and a
    stored trace removes its class's failure file."""
    _failing(monkeypatch, NotImplementedError("no sharding strategy"))
    spec, par = transformer_spec(get_preset("tiny-gpt")), make_parallelize()
    with pytest.raises(TraceError):
        TraceCache(tmp_path).get(spec, par, {"tp": 2})
    (old,) = tmp_path.glob("*.failed*.json.gz")
    monkeypatch.setattr(cache_mod, "FAILURE_VERSION", cache_mod.FAILURE_VERSION + 1)
    monkeypatch.setattr(cache_mod, "trace_step", lambda *a, **k: tiny_trace)
    cache = TraceCache(tmp_path)
    assert cache.failure(spec, par, {"tp": 2}) is None and cache.get(spec, par, {"tp": 2}).layout == (("tp", 2),)
    cache._store_failure(cache.key(spec, par, {"tp": 2}, batch_size=1, dtype=torch.bfloat16,
                                   optimizer=default_optimizer), "refused")
    assert len(list(tmp_path.glob("*.failed*.json.gz"))) == 2
    cache._store(cache.key(spec, par, {"tp": 2}, batch_size=1, dtype=torch.bfloat16, optimizer=default_optimizer),
                 tiny_trace)
    assert list(tmp_path.glob("*.failed*.json.gz")) == [old]  # the current one removed, the old one never read


@pytest.mark.parametrize("cause", [
    RuntimeError("Could not resolve the process group registered under the name 3"),
    MemoryError(),
    OSError("disk full"),
    torch.OutOfMemoryError("out of memory"),
])
def test_a_failure_that_need_not_repeat_is_not_stored(monkeypatch, tmp_path, cause) -> None:  # noqa: ANN001
    calls = _failing(monkeypatch, cause)
    spec, par = transformer_spec(get_preset("tiny-gpt")), make_parallelize()
    for _ in range(2):
        with pytest.raises(TraceError):
            TraceCache(tmp_path).get(spec, par, {"tp": 2})
    assert len(calls) == 2 and not list(tmp_path.glob("*.failed2.json.gz"))


@pytest.mark.parametrize("edit", [
    lambda doc: doc.update(error=5),
    lambda doc: doc.update(error=""),
    lambda doc: doc.update(key="someone else's key"),
])
def test_a_tampered_failure_is_ignored(monkeypatch, tmp_path, caplog, edit) -> None:  # noqa: ANN001
    calls = _failing(monkeypatch, ValueError("shape '[1, 8, 1, 128]' is invalid"))
    spec, par = transformer_spec(get_preset("tiny-gpt")), make_parallelize()
    with pytest.raises(TraceError):
        TraceCache(tmp_path).get(spec, par, {"tp": 2})
    (path,) = tmp_path.glob("*.failed2.json.gz")
    _tamper(path, edit)
    with caplog.at_level(logging.WARNING, logger="topomesh"), pytest.raises(TraceError):
        TraceCache(tmp_path).get(spec, par, {"tp": 2})
    assert len(calls) == 2 and "ignoring the trace cache file" in caplog.text
