"""Op costs: real timing, the shared SQLite table across processes, roofline, corrupt files."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from topomesh.cost.devices import device_fingerprint, device_spec
from topomesh.cost.opdb import OpProfileDB
from topomesh.cost.ops import (
    OpClass,
    cost_summary,
    default_efficiency,
    make_tensor,
    op_class,
    op_time_s,
    profile_key,
    profile_ops,
    records_from_json,
    records_to_json,
    roofline_time_s,
    time_op,
)
from topomesh.trace.graph import OpRecord, Phase, TensorMeta

A = TensorMeta(shape=(64, 64), dtype="float32", stride=(64, 1))
AT = TensorMeta(shape=(64, 64), dtype="float32", stride=(1, 64))
SCALAR = TensorMeta(shape=(), dtype="float32", stride=())
MM = OpRecord(op="aten.mm.default", inputs=(A, A), outputs=(A,), flops=2 * 64**3)


def _records() -> list[OpRecord]:
    return [
        MM,
        MM,  # a repeat: same signature, profiled once
        OpRecord(op="aten.mm.default", inputs=(A, AT), outputs=(A,), flops=2 * 64**3),  # other strides
        OpRecord(op="aten.add.Tensor", inputs=(A, A), outputs=(A,)),
        OpRecord(op="aten.sum.dim_IntList", inputs=(A,), outputs=(A,), args=((1,), False)),
    ]


def test_make_tensor_respects_shape_dtype_and_strides():
    t = make_tensor(TensorMeta(shape=(3, 4), dtype="bfloat16", stride=(1, 3)), "cpu")
    assert tuple(t.shape) == (3, 4) and t.stride() == (1, 3) and str(t.dtype) == "torch.bfloat16"
    e = make_tensor(TensorMeta(shape=(5, 2), dtype="float32", stride=(0, 1)), "cpu")  # expanded
    assert e.stride() == (0, 1)
    i = make_tensor(TensorMeta(shape=(7,), dtype="int64", stride=(1,)), "cpu")
    assert int(i.abs().sum()) == 0  # valid indices


def test_small_mm_is_timed_for_real():
    timing = time_op(MM, "cpu", min_repeats=5, budget_s=0.01)
    assert timing.repeats >= 5 and timing.warmup == 2
    assert 0 < timing.median_s < 1.0
    assert timing.key == profile_key(MM)
    assert "perf_counter" in timing.method or "thread_time" in timing.method


@pytest.mark.parametrize("threads, clock", [(1, "thread_time"), (2, "perf_counter")])
def test_one_thread_is_timed_on_the_thread_cpu_clock(threads, clock):
    """With one torch thread the op runs on the calling thread: its CPU clock leaves out time
    spent waiting for a core on a loaded machine; with more threads the wall clock counts."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        timing = time_op(MM, "cpu", min_repeats=5, budget_s=0.01)
    finally:
        torch.set_num_threads(before)
    assert timing.method.startswith(f"cpu {clock}, {threads} threads")
    assert 0 < timing.median_s < 1.0


def test_one_thread_reads_the_thread_clock(monkeypatch):
    """A thread clock that advances 1 s per reading gives exactly 1 s per call: the timing
    reads it (and not the wall clock) around each call."""
    import itertools
    import time

    import torch

    ticks = itertools.count()
    monkeypatch.setattr(time, "thread_time", lambda: float(next(ticks)))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        timing = time_op(MM, "cpu", min_repeats=5, max_repeats=5)
    finally:
        torch.set_num_threads(before)
    assert timing.median_s == 1.0


@pytest.mark.parametrize(
    "op, inputs, args",
    [
        ("aten.sum.dim_IntList", (A,), ((1,), True)),
        # the tracer records a tensor list as a tuple of None placeholders
        ("aten.cat.default", (A, A, A), ((None, None, None), 1)),
        # optional tensors: given, then one left out (None among the scalars)
        ("aten.native_layer_norm.default", (A, TensorMeta(shape=(64,), dtype="float32", stride=(1,))) * 1
         + (TensorMeta(shape=(64,), dtype="float32", stride=(1,)),), ((64,), 1e-5)),
        ("aten.native_layer_norm.default", (A, TensorMeta(shape=(64,), dtype="float32", stride=(1,))),
         ((64,), None, 1e-5)),
        # an optional tensor left out before a later tensor parameter (total_weight)
        ("aten.nll_loss_backward.default",
         (SCALAR, A, TensorMeta(shape=(64,), dtype="int64", stride=(1,)), SCALAR), (None, 1, -100)),
        # dtypes are recorded as strings
        ("aten._log_softmax_backward_data.default", (A, A), (1, "torch.float32")),
    ],
)
def test_scalar_args_are_passed_by_schema(op, inputs, args):
    rec = OpRecord(op=op, inputs=inputs, outputs=(), args=args)
    assert time_op(rec, "cpu", min_repeats=1, budget_s=0.0).median_s > 0


def test_a_time_budget_leaves_the_rest_for_a_later_run(tmp_path):
    with OpProfileDB(tmp_path / "p.sqlite") as db:
        run = profile_ops(_records(), db, fingerprint="fp", max_seconds=0.0, min_repeats=1, budget_s=0.0)
        assert (run.profiled, run.left) == (1, 3)  # the first op always runs
        run = profile_ops(_records(), db, fingerprint="fp", min_repeats=1, budget_s=0.0)
        assert (run.cached, run.profiled, run.left) == (1, 3, 0)


def test_profile_then_reuse_in_the_same_process(tmp_path):
    fp = device_fingerprint("cpu")
    with OpProfileDB(tmp_path / "p.sqlite") as db:
        first = profile_ops(_records(), db, fingerprint=fp, min_repeats=3, budget_s=0.0)
        assert (first.distinct, first.cached, first.profiled, dict(first.failed)) == (4, 0, 4, {})
        assert db.count(fp) == 4
        second = profile_ops(_records(), db, fingerprint=fp)
        assert (second.cached, second.profiled) == (4, 0)
        table = db.table(fp)
    cost = op_time_s(MM, device_spec("H100-SXM5-80GB"), table)
    assert cost.measured and cost.seconds == table[profile_key(MM)]


_CHILD = textwrap.dedent(
    """
    import json, sys
    from topomesh.cost.opdb import OpProfileDB
    from topomesh.cost.ops import profile_ops, records_from_json
    from topomesh.cost.devices import device_fingerprint
    recs = records_from_json(json.loads(sys.argv[2]))
    with OpProfileDB(sys.argv[1]) as db:
        run = profile_ops(recs, db, fingerprint=device_fingerprint("cpu"), min_repeats=3, budget_s=0.0)
        print(json.dumps({"profiled": run.profiled, "cached": run.cached, "rows": db.count()}))
    """
)


def _child(db_path, records) -> subprocess.Popen:
    payload = json.dumps(records_to_json(records))
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(db_path), payload], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={"OMP_NUM_THREADS": "1", **_env()})


def _results(procs: list[subprocess.Popen]) -> list[dict]:
    """Each child's JSON line; children still running after the timeout are killed."""
    try:
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=180)
            assert p.returncode == 0, stderr
            out.append(json.loads(stdout))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


@pytest.mark.slow
def test_a_second_process_hits_the_cache_and_profiles_nothing(tmp_path):
    db_path = tmp_path / "shared.sqlite"
    out = [_results([_child(db_path, _records())])[0] for _ in range(2)]
    assert out[0] == {"profiled": 4, "cached": 0, "rows": 4}
    assert out[1] == {"profiled": 0, "cached": 4, "rows": 4}


@pytest.mark.slow
def test_concurrent_processes_share_one_table_without_errors(tmp_path):
    db_path = tmp_path / "shared.sqlite"
    results = _results([_child(db_path, _records()) for _ in range(3)])
    # INSERT OR IGNORE: whoever measured first wins; the table never holds duplicates.
    with OpProfileDB(db_path) as db:
        assert db.count() == 4
    assert sum(r["profiled"] for r in results) >= 4
    assert all(r["rows"] == 4 for r in results)
    mode = sqlite3.connect(db_path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_roofline_for_an_op_never_profiled():
    h100 = device_spec("H100-SXM5-80GB")
    n = 8192
    big = TensorMeta(shape=(n, n), dtype="bfloat16", stride=(n, 1))
    mm = OpRecord(op="aten.mm.default", inputs=(big, big), outputs=(big,), flops=2 * n**3)
    # compute-bound: 2 n^3 at 989.5e12 x the MAMF ceiling 0.8033 x wave quantization: 64 x 32 = 2048
    # tiles of 128x256 on 132 SMs take 16 waves (2112 slots)
    assert roofline_time_s(mm, h100) == pytest.approx(2 * n**3 / (989.5e12 * 0.8033 * 2048 / 2112))
    gelu = OpRecord(op="aten.gelu.default", inputs=(big,), outputs=(big,), flops=0)
    # memory-bound: read + write n^2 bf16 at 3350 GB/s x 0.9 achievable
    assert roofline_time_s(gelu, h100) == pytest.approx(2 * n * n * 2 / (3350e9 * 0.9))
    unknown = OpRecord(op="aten.not_an_op.default", inputs=(big,), outputs=(big,), bytes_moved=10**9)
    cost = op_time_s(unknown, h100, {})
    assert not cost.measured and cost.seconds == pytest.approx(1e9 / (3350e9 * 0.9))
    # an explicit table of 1.0 is the pure roofline
    assert roofline_time_s(mm, h100, default_efficiency()) == pytest.approx(2 * n**3 / 989.5e12)


def test_unknown_and_unprofilable_ops_are_listed_with_counts_and_roofline(tmp_path):
    fp = device_fingerprint("cpu")
    bad = OpRecord(op="aten.not_an_op.default", inputs=(A,), outputs=(A,))
    recs = [MM, bad, bad, bad]
    with OpProfileDB(tmp_path / "p.sqlite") as db:
        run = profile_ops(recs, db, fingerprint=fp, min_repeats=1, budget_s=0.0)
        assert run.profiled == 1 and "aten.not_an_op.default" in run.failed
        assert profile_ops(recs, db, fingerprint=fp).cached == 2  # the failure is not retried
        spec = device_spec("A100-SXM4-80GB")
        summary = cost_summary(recs, spec, db.table(fp), db.failures(fp))
    assert summary.ops == 4
    [u] = summary.unknown
    assert (u.op, u.count) == ("aten.not_an_op.default", 3)
    assert u.roofline_s == pytest.approx(3 * roofline_time_s(bad, spec))
    assert u.reason.startswith("ValueError: aten.not_an_op.default is not run: op 'aten.not_an_op.default' is not "
                               "one a traced training step produces")


def test_corrupt_database_is_moved_aside_and_rebuilt(tmp_path):
    path = tmp_path / "p.sqlite"
    path.write_bytes(b"this is not an sqlite file" * 100)
    with pytest.warns(RuntimeWarning, match="corrupt"), OpProfileDB(path) as db:
        assert db.rebuilt_from is not None and db.rebuilt_from.exists()
        assert db.count() == 0
        profile_ops([MM], db, fingerprint="fp", min_repeats=1, budget_s=0.0)
        assert db.count() == 1
    assert b"not an sqlite" in next(tmp_path.glob("p.sqlite.corrupt-*")).read_bytes()


def test_damaged_pages_are_detected_by_integrity_check(tmp_path):
    path = tmp_path / "p.sqlite"
    with OpProfileDB(path) as db:
        profile_ops(_records(), db, fingerprint="fp", min_repeats=1, budget_s=0.0)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()
    data = bytearray(path.read_bytes())
    page = 4096
    for i in range(page + 100, min(len(data), 3 * page)):  # scribble over the table's pages
        data[i] = 0xA5
    path.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="corrupt"), OpProfileDB(path) as db:
        assert db.count() == 0


def test_op_classes_and_json_round_trip():
    assert op_class("aten.bmm.default") is OpClass.MATMUL
    assert op_class("aten.convolution.default") is OpClass.CONVOLUTION
    recs = _records()
    back = records_from_json(json.loads(json.dumps(records_to_json(recs))))
    assert [profile_key(r) for r in back] == [profile_key(r) for r in recs]
    assert back[0].phase is Phase.FORWARD
