"""The op-profile database: validated rows, expiring failures, schema checks, private default
location, refused devices and paths, and several processes sharing one (corrupted) file."""

from __future__ import annotations

import json
import multiprocessing
import os
import sqlite3
import time
from pathlib import Path

import pytest

from topomesh.cli.main import main
from topomesh.cost.devices import device_fingerprint
from topomesh.cost.opdb import FAILURE_TTL_S, OpProfileDB, OpTiming, valid_timing
from topomesh.cost.ops import profile_ops, records_to_json
from topomesh.errors import CalibrationError
from topomesh.trace.graph import OpRecord, TensorMeta


def _key(i: int) -> tuple[str, str, str, str, str]:
    return ("aten.mm.default", f"[[{i},{i}],[{i},{i}]]", '["float32","float32"]', f"[[{i},1],[{i},1]]", "[]")


def _timing(i: int, median_s: float = 1e-5) -> OpTiming:
    return OpTiming(key=_key(i), median_s=median_s, repeats=5, warmup=2, method="test")


def _raw(path: Path, sql: str, *params: object) -> None:
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(sql, params)
    conn.close()


def test_valid_timing_bounds() -> None:
    assert [valid_timing(v) for v in (1e-9, 3600.0, 3600.5, 0, -1e-9, float("nan"), float("-inf"), "0.1", None)] == [
        True, True, False, False, False, False, False, False, False]


def test_invalid_rows_are_ignored_with_a_note_and_replaced_by_the_next_measurement(tmp_path: Path) -> None:
    path = tmp_path / "p.sqlite"
    with OpProfileDB(path) as db:
        assert db.put("fp", [_timing(i) for i in range(5)]) == 5
    # poison four rows the way a bad writer could: negative, zero, infinite, absurdly long
    for i, value in enumerate((-1.0, 0.0, float("inf"), 1e9)):
        _raw(path, "UPDATE op_profiles SET median_s = ? WHERE shapes = ?", value, _key(i)[1])
    with OpProfileDB(path) as db:
        with pytest.warns(RuntimeWarning, match=r"ignored 4 row\(s\) for 'fp' whose time is not a number"):
            table = db.table("fp")
        assert table == {_key(4): 1e-5}
        # a new measurement replaces a poisoned row; a valid row is kept (the first measurement wins)
        assert db.put("fp", [_timing(0, 2e-5), _timing(4, 3e-5)]) == 1
        with pytest.warns(RuntimeWarning, match=r"ignored 3 row"):
            assert db.table("fp") == {_key(0): 2e-5, _key(4): 1e-5}


@pytest.mark.parametrize("bad", [0.0, -1e-6, float("nan"), float("inf")])
def test_invalid_timings_are_not_stored(tmp_path: Path, bad: float) -> None:
    with OpProfileDB(tmp_path / "p.sqlite") as db, pytest.raises(CalibrationError, match="refusing to store aten.mm"):
        db.put("fp", [_timing(0, bad)])


def test_failures_expire_and_belong_to_one_torch_version(tmp_path: Path) -> None:
    path = tmp_path / "p.sqlite"
    with OpProfileDB(path) as db:
        db.put_failure("fp", _key(1), "LookupError: nope")
        now = time.time()
        assert db.failures("fp", now=now) == {_key(1): "LookupError: nope"}
        assert db.failures("fp", now=now + FAILURE_TTL_S - 60) == {_key(1): "LookupError: nope"}
        assert db.failures("fp", now=now + FAILURE_TTL_S + 60) == {}  # a week later: retried
        assert FAILURE_TTL_S == 7 * 24 * 3600
    _raw(path, "UPDATE op_failures SET torch_version = '1.0.0'")
    with OpProfileDB(path) as db:
        assert db.failures("fp") == {}  # another torch: retried
    _raw(path, "UPDATE op_failures SET torch_version = ?, created_at = 1e18", __import__("torch").__version__)
    with OpProfileDB(path) as db:
        assert db.failures("fp") == {}  # a timestamp in the future cannot make a failure permanent


def test_an_expired_failure_is_retried_and_a_success_clears_it(tmp_path: Path) -> None:
    a = TensorMeta(shape=(8, 8), dtype="float32", stride=(8, 1))
    mm = OpRecord(op="aten.mm.default", inputs=(a, a), outputs=(a,), flops=2 * 8**3)
    from topomesh.cost.ops import profile_key

    path = tmp_path / "p.sqlite"
    with OpProfileDB(path) as db:
        db.put_failure("fp", profile_key(mm), "RuntimeError: flaky")
        assert profile_ops([mm], db, fingerprint="fp", min_repeats=1, budget_s=0.0).cached == 1
    _raw(path, "UPDATE op_failures SET created_at = ?", time.time() - FAILURE_TTL_S - 1)
    with OpProfileDB(path) as db:
        run = profile_ops([mm], db, fingerprint="fp", min_repeats=1, budget_s=0.0)
        assert (run.cached, run.profiled) == (0, 1)
        assert list(db.table("fp")) == [profile_key(mm)]
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT COUNT(*) FROM op_failures").fetchone() == (0,)
    conn.close()


def _v1_database(path: Path) -> None:
    """The first schema: failures with no torch version, schema_version 1."""
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
        "INSERT INTO meta VALUES ('schema_version', '1');"
        "CREATE TABLE op_failures (device TEXT NOT NULL, op TEXT NOT NULL, shapes TEXT NOT NULL, dtypes TEXT "
        "NOT NULL, strides TEXT NOT NULL, args TEXT NOT NULL, reason TEXT NOT NULL, created_at REAL NOT NULL, "
        "PRIMARY KEY (device, op, shapes, dtypes, strides, args));"
    )
    conn.close()


def test_another_schema_is_moved_aside_and_rebuilt(tmp_path: Path) -> None:
    path = tmp_path / "p.sqlite"
    _v1_database(path)
    with pytest.warns(RuntimeWarning, match="table op_failures has columns"), OpProfileDB(path) as db:
        assert db.rebuilt_from is not None and db.rebuilt_from.name.startswith("p.sqlite.corrupt-")
        assert db.put("fp", [_timing(0)]) == 1
    with OpProfileDB(path) as db:  # the rebuilt file is kept
        assert db.rebuilt_from is None and db.count() == 1
    _raw(path, "UPDATE meta SET value = '9' WHERE key = 'schema_version'")
    with pytest.warns(RuntimeWarning, match="schema version '9', this topomesh writes 2"), OpProfileDB(path) as db:
        assert db.count() == 0


@pytest.mark.parametrize("column, value", [("median_s", "fast"), ("repeats", 2.5), ("created_at", "yesterday")])
def test_a_value_of_the_wrong_type_is_detected_and_rebuilt(tmp_path: Path, column: str, value: object) -> None:
    path = tmp_path / "p.sqlite"
    with OpProfileDB(path) as db:
        db.put("fp", [_timing(0)])
    _raw(path, f"UPDATE op_profiles SET {column} = ?", value)
    with pytest.warns(RuntimeWarning, match="op_profiles holds a value of the wrong type"), OpProfileDB(path) as db:
        assert db.count() == 0 and db.table("fp") == {}


def test_paths_that_cannot_hold_a_database_are_one_line_errors(tmp_path: Path) -> None:
    plain = tmp_path / "file"
    plain.write_text("x")
    with pytest.raises(CalibrationError, match="cannot create the op-profile database's directory .*regular file"):
        OpProfileDB(plain / "x.sqlite")
    with pytest.raises(CalibrationError, match="must be a regular file"):
        OpProfileDB(tmp_path)
    with pytest.raises(CalibrationError, match="must be a regular file"):
        OpProfileDB("/dev/null")


def test_the_default_location_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(tmp_path / "fresh"))
    with OpProfileDB() as db:
        assert db.path == tmp_path / "fresh" / "op_profiles.sqlite"
    assert oct((tmp_path / "fresh").stat().st_mode & 0o777) == "0o700"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)
    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(shared))
    with pytest.raises(CalibrationError, match=f"cache directory '{shared}' has mode 0775"):
        OpProfileDB()


@pytest.mark.parametrize("device, message", [
    ("npu", "'npu' is not cpu, cuda or cuda:<index>"),
    ("cpu:0", "is not cpu, cuda or cuda:<index>"),
    ("cuda:x", "is not cpu, cuda or cuda:<index>"),
    ("", "is not cpu, cuda or cuda:<index>"),
])
def test_unknown_devices_are_refused(device: str, message: str) -> None:
    with pytest.raises(CalibrationError, match=message):
        device_fingerprint(device)


def test_a_cuda_index_this_machine_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(CalibrationError, match="'cuda:2' is not on this machine \\(it has 2 CUDA devices\\)"):
        device_fingerprint("cuda:2")


def _records_file(tmp_path: Path) -> Path:
    a = TensorMeta(shape=(8, 8), dtype="float32", stride=(8, 1))
    path = tmp_path / "recs.json"
    path.write_text(json.dumps(records_to_json([OpRecord(op="aten.mm.default", inputs=(a, a), outputs=(a,))])))
    return path


def test_profile_cli_refuses_unknown_device_and_db_under_a_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    recs, db = _records_file(tmp_path), tmp_path / "ops.sqlite"
    base = ["profile", "--records", str(recs), "--spec", "H100-SXM5-80GB", "--json"]
    assert main([*base, "--device", "npu", "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("topomesh: error: ") and "'npu' is not cpu, cuda or cuda:<index>" in err
    assert len(err.strip().splitlines()) == 1 and not db.exists()  # nothing stored under this CPU's name
    assert main([*base, "--db", str(recs / "x.sqlite")]) == 2
    err = capsys.readouterr().err
    assert "cannot create the op-profile database's directory" in err and len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------------- several processes

N_WRITERS = 4
ROWS = 15


def _writer(path: str, index: int, barrier, out) -> None:  # noqa: ANN001
    """Phase 1: open the (corrupt) file at once with the others and write ROWS rows one by one.
    Phase 2: after the file was replaced by garbage, write one more row on the old connection."""
    try:
        barrier.wait()
        with OpProfileDB(path) as db:
            added = sum(db.put(f"w{index}", [_timing(i)]) for i in range(ROWS))
            barrier.wait()  # all phase-1 writes done
            barrier.wait()  # the file has been replaced
            added += db.put(f"w{index}", [_timing(ROWS)])
        out.put((index, added, None))
    except BaseException as exc:  # report, do not hang the barrier
        out.put((index, -1, f"{type(exc).__name__}: {exc}"))
        barrier.abort()


@pytest.mark.slow
def test_processes_sharing_a_corrupted_file_rebuild_once_and_lose_no_write(tmp_path: Path) -> None:
    path = tmp_path / "shared.sqlite"
    path.write_bytes(b"garbage, not a database " * 200)
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(N_WRITERS + 1, timeout=120), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(path), i, barrier, out)) for i in range(N_WRITERS)]
    for p in procs:
        p.start()
    try:
        barrier.wait()  # everyone opens the corrupt file at the same moment
        barrier.wait()  # phase 1 done
        assert len(list(tmp_path.glob("shared.sqlite.corrupt-*[0-9]"))) == 1  # moved aside once, not per process
        garbage = tmp_path / "garbage"
        garbage.write_bytes(b"garbage again " * 300)
        os.replace(garbage, path)  # replace it (and its write-ahead log) under the open connections
        for side in ("-wal", "-shm"):
            Path(f"{path}{side}").unlink(missing_ok=True)
        barrier.wait()
        results = sorted(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [r[2] for r in results] == [None] * N_WRITERS  # no "database is locked", no "disk I/O error"
    assert [r[1] for r in results] == [ROWS + 1] * N_WRITERS
    assert len(list(tmp_path.glob("shared.sqlite.corrupt-*[0-9]"))) == 2  # once per corruption
    with OpProfileDB(path) as db:
        # every write reported after the second corruption is in the file at the path
        assert {w: set(db.table(f"w{w}")) for w in range(N_WRITERS)} == {w: {_key(ROWS)} for w in range(N_WRITERS)}
