"""The op-profile table: measured op times in one SQLite file shared by runs and processes.

Rows are keyed by (device fingerprint, op, shapes, dtypes, strides, args), the last five
as canonical JSON (:func:`topomesh.cost.ops.profile_key`). Several processes may
profile at once: the file runs in WAL mode with a busy timeout, and rows are written with
``INSERT OR IGNORE`` so the first valid measurement of a key wins.

Concurrency, with a sibling lock file (``<name>.lock``, ``fcntl.flock``): opening — the
integrity and schema checks, and the rebuild of a bad file — holds the lock exclusively,
every read and write holds it shared. So a bad file is moved aside once (a process that
waited for the lock finds the rebuilt file, which passes), a file is never moved aside in
the middle of someone's write, and each operation first checks that the path still names
the file its connection has open (else it reconnects), so a write reported as done is in
the file at the path. Transient SQLite errors ("database is locked", "disk I/O error")
reconnect and retry, at most :data:`RETRIES` times.

A file that is not a database, fails ``PRAGMA integrity_check``, has another schema or
schema version, or holds a value of the wrong type in a column (text in a number column)
is moved aside (``<name>.corrupt-<time>-<pid>``) with a warning and an empty table is
created in its place. Rows are validated again on read: a timing that is not a finite
number in (0, :data:`MAX_OP_SECONDS`] is ignored with a warning, never used, and replaced
by the next measurement. Failures (ops that could not run here) expire after
``failure_ttl_s`` (default :data:`FAILURE_TTL_S`) or when torch's version changes, so
they are retried. The default file lives in the private cache directory
(:func:`topomesh.cost.devices.private_cache_dir`).
"""

from __future__ import annotations

import fcntl
import math
import os
import sqlite3
import stat
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from topomesh.cost.devices import DeviceSpec, cache_dir, private_cache_dir, table_fingerprints
from topomesh.errors import CalibrationError

SCHEMA_VERSION = "2"
"""2: failures carry the torch version and expire; rows are validated on read."""
BUSY_TIMEOUT_S = 60.0
RETRIES = 5
"""Attempts of one operation that meets a transient SQLite error (each after reconnecting)."""
FAILURE_TTL_S = 7 * 24 * 3600.0
"""Age after which a stored failure is retried (seconds; one week)."""
MAX_OP_SECONDS = 3600.0
"""Longest op time accepted from the table: no single kernel of a training step runs an hour."""
CLOCK_SKEW_S = 3600.0
"""How far in the future a failure's timestamp may lie (clocks of nodes sharing the file)."""

_COLUMNS = {
    "meta": [("key", "TEXT"), ("value", "TEXT")],
    "op_profiles": [
        ("device", "TEXT"), ("op", "TEXT"), ("shapes", "TEXT"), ("dtypes", "TEXT"), ("strides", "TEXT"),
        ("args", "TEXT"), ("median_s", "REAL"), ("repeats", "INTEGER"), ("warmup", "INTEGER"),
        ("method", "TEXT"), ("created_at", "REAL"),
    ],
    "op_failures": [
        ("device", "TEXT"), ("op", "TEXT"), ("shapes", "TEXT"), ("dtypes", "TEXT"), ("strides", "TEXT"),
        ("args", "TEXT"), ("reason", "TEXT"), ("torch_version", "TEXT"), ("created_at", "REAL"),
    ],
}
"""Every table's columns and declared types: a file with others has another schema."""

_KEY_COLUMNS = "device TEXT NOT NULL, op TEXT NOT NULL, shapes TEXT NOT NULL, dtypes TEXT NOT NULL, " \
    "strides TEXT NOT NULL, args TEXT NOT NULL"
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS op_profiles (
    {_KEY_COLUMNS}, median_s REAL NOT NULL, repeats INTEGER NOT NULL, warmup INTEGER NOT NULL,
    method TEXT NOT NULL, created_at REAL NOT NULL,
    PRIMARY KEY (device, op, shapes, dtypes, strides, args)
);
CREATE TABLE IF NOT EXISTS op_failures (
    {_KEY_COLUMNS}, reason TEXT NOT NULL, torch_version TEXT NOT NULL, created_at REAL NOT NULL,
    PRIMARY KEY (device, op, shapes, dtypes, strides, args)
);
"""

_VALID_TIMING = f"(typeof(median_s) IN ('real', 'integer') AND median_s > 0 AND median_s <= {MAX_OP_SECONDS})"
"""The read-side rule (:func:`valid_timing`) in SQL: a stored row that breaks it may be replaced."""

Key = tuple[str, str, str, str, str]
"""(op, shapes, dtypes, strides, args) as :func:`topomesh.cost.ops.profile_key` gives them."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class OpTiming:
    """One measured op: median seconds over ``repeats`` runs after ``warmup`` runs."""

    key: Key
    median_s: float
    repeats: int
    warmup: int
    method: str
    """How it was timed, e.g. ``cpu perf_counter`` or ``cuda events``."""
    host_s: float | None = None
    """On a GPU: the host's seconds to issue one call (stored under :func:`host_fingerprint`)."""


def host_fingerprint(fingerprint: str) -> str:
    """Where a GPU's table of host issue times is kept: beside its op table, under this name.

    >>> host_fingerprint("NVIDIA H100 80GB HBM3")
    'NVIDIA H100 80GB HBM3 | host issue'
    """
    return f"{fingerprint} | host issue"


def valid_timing(median_s: Any) -> bool:
    """Whether a stored median can be used: a finite number of seconds in (0, MAX_OP_SECONDS].

    >>> [valid_timing(v) for v in (1e-6, 0.0, -1e-6, float("nan"), float("inf"), "1e-6", True)]
    [True, False, False, False, False, False, False]
    """
    return type(median_s) in (int, float) and math.isfinite(median_s) and 0 < median_s <= MAX_OP_SECONDS


def default_db_path() -> Path:
    """``$TOPOMESH_CACHE_DIR/op_profiles.sqlite`` (the directory is checked when the file is opened)."""
    return cache_dir() / "op_profiles.sqlite"


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _transient(exc: sqlite3.Error) -> bool:
    text = str(exc).lower()
    return isinstance(exc, sqlite3.OperationalError) and any(
        s in text for s in ("locked", "busy", "disk i/o error", "unable to open")
    )


class OpProfileDB:
    """A connection to the shared op-profile file (one per process; not thread-safe)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, failure_ttl_s: float = FAILURE_TTL_S) -> None:
        if path is None:
            self.path = private_cache_dir() / "op_profiles.sqlite"
        else:
            self.path = Path(path)
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CalibrationError(
                    f"{self.path}: cannot create the op-profile database's directory "
                    f"({exc.strerror or exc}; is a parent a regular file?)"
                ) from None
        self.failure_ttl_s = failure_ttl_s
        self.rebuilt_from: Path | None = None
        """Where a bad file was moved to when this connection rebuilt it, else None."""
        self._conn: sqlite3.Connection | None = None
        self._ino: tuple[int, int] | None = None
        lock = self.path.with_name(self.path.name + ".lock")
        try:
            st = self.path.stat()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise CalibrationError(f"{self.path}: cannot use the op-profile database ({exc.strerror or exc})") from None
        else:
            if not stat.S_ISREG(st.st_mode):
                raise CalibrationError(f"{self.path}: the op-profile database must be a regular file")
        try:
            self._lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise CalibrationError(f"{lock}: cannot open the op-profile database's lock file ({exc.strerror})") from None
        try:
            self._reconnect()
        except BaseException:
            os.close(self._lock_fd)
            raise

    # ------------------------------------------------------------------ opening

    @contextmanager
    def _locked(self, how: int) -> Iterator[None]:
        fcntl.flock(self._lock_fd, how)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _reconnect(self) -> None:
        """(Re)open the file under the exclusive lock; move a bad file aside and start a new one."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        with self._locked(fcntl.LOCK_EX):
            for attempt in range(RETRIES):
                try:
                    self._conn = self._open()
                    break
                except sqlite3.Error as exc:
                    if _transient(exc) and attempt < RETRIES - 1:
                        continue
                    if isinstance(exc, sqlite3.OperationalError) and _transient(exc):
                        raise CalibrationError(f"{self.path}: cannot open the op-profile database ({exc})") from None
                    self.rebuilt_from = self._move_aside(str(exc))
            else:  # pragma: no cover - the loop always breaks or raises
                raise AssertionError
            st = os.stat(self.path)
            self._ino = (st.st_dev, st.st_ino)

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            check = conn.execute("PRAGMA integrity_check").fetchall()
            if check != [("ok",)]:
                raise sqlite3.DatabaseError(f"integrity_check: {'; '.join(str(r[0]) for r in check[:3])}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.executescript(_SCHEMA)
            conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
            _check_schema(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _move_aside(self, reason: str) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{os.getpid()}")
        n = 1
        while target.exists():  # a second bad file within the same second: keep the first one too
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{os.getpid()}-{n}")
            n += 1
        with suppress(FileNotFoundError):
            os.replace(self.path, target)
        for suffix in ("-wal", "-shm"):
            side = self.path.with_name(self.path.name + suffix)
            with suppress(FileNotFoundError):
                os.replace(side, target.with_name(target.name + suffix))
        warnings.warn(
            f"op-profile database {self.path} is unusable ({reason}); moved it to {target} and "
            "started an empty one (ops will be profiled again)",
            RuntimeWarning,
            stacklevel=4,
        )
        return target

    def _replaced(self) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self._ino

    def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn(conn)`` under the shared lock on the file the path names now, retried on
        transient errors after reconnecting; a file found bad on reconnecting is rebuilt."""
        for attempt in range(RETRIES):
            stale = False
            with self._locked(fcntl.LOCK_SH):
                if self._conn is not None and not self._replaced():
                    try:
                        return fn(self._conn)
                    except sqlite3.Error as exc:
                        # any database error: reconnect (which rebuilds a bad file) and try again
                        if attempt == RETRIES - 1 or not isinstance(exc, sqlite3.DatabaseError):
                            raise CalibrationError(f"{self.path}: op-profile database error ({exc})") from None
                stale = True
            if stale:
                self._reconnect()
        raise CalibrationError(f"{self.path}: the op-profile database kept changing under this process")

    # ------------------------------------------------------------------ use

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        with suppress(OSError):
            os.close(self._lock_fd)

    def __enter__(self) -> OpProfileDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _write(conn: sqlite3.Connection, sql: str, rows: list[tuple]) -> int:
        conn.execute("BEGIN IMMEDIATE")
        try:
            before = conn.total_changes
            conn.executemany(sql, rows)
            added = conn.total_changes - before
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return added

    def put(self, device: str, timings: Iterable[OpTiming]) -> int:
        """Store timings for ``device``; keys already present with a valid timing are left
        alone (an invalid stored row is replaced). Returns rows added or replaced.

        Raises :class:`CalibrationError` for a timing that :func:`valid_timing` refuses."""
        timings = list(timings)
        for t in timings:
            if not valid_timing(t.median_s) or t.repeats < 1 or t.warmup < 0:
                raise CalibrationError(
                    f"{self.path}: refusing to store {t.key[0]} with median {t.median_s!r} s over {t.repeats} repeats"
                )
        now = time.time()
        rows = [(device, *t.key, float(t.median_s), t.repeats, t.warmup, t.method, now) for t in timings]
        sql = (
            "INSERT INTO op_profiles (device, op, shapes, dtypes, strides, args, median_s, repeats, warmup, method, "
            "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (device, op, shapes, dtypes, strides, "
            "args) DO UPDATE SET median_s = excluded.median_s, repeats = excluded.repeats, warmup = excluded.warmup, "
            "method = excluded.method, created_at = excluded.created_at WHERE NOT "
            + _VALID_TIMING.replace("median_s", "op_profiles.median_s")
        )

        def write(conn: sqlite3.Connection) -> int:
            added = self._write(conn, sql, rows)
            self._write(conn, "DELETE FROM op_failures WHERE device = ? AND op = ? AND shapes = ? AND dtypes = ? "
                        "AND strides = ? AND args = ?", [(device, *t.key) for t in timings])
            return added

        return self._run(write)

    def put_failure(self, device: str, key: Key, reason: str) -> None:
        """Remember that an op signature cannot be profiled here (retried once it expires)."""
        row = (device, *key, reason[:500], _torch_version(), time.time())
        self._run(lambda conn: self._write(
            conn,
            "INSERT OR REPLACE INTO op_failures (device, op, shapes, dtypes, strides, args, reason, torch_version, "
            "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [row],
        ))

    def table(self, device: str) -> dict[Key, float]:
        """Every valid measured median (seconds) for ``device``, keyed like :func:`profile_key`.

        Rows :func:`valid_timing` refuses are left out with a warning (they are profiled again)."""
        rows = self._run(lambda conn: conn.execute(
            "SELECT op, shapes, dtypes, strides, args, median_s FROM op_profiles WHERE device = ?", (device,)
        ).fetchall())
        good = {tuple(r[:5]): float(r[5]) for r in rows if valid_timing(r[5])}
        bad = [r for r in rows if not valid_timing(r[5])]
        if bad:
            warnings.warn(
                f"op-profile database {self.path}: ignored {len(bad)} row(s) for {device!r} whose time is not a "
                f"number of seconds in (0, {MAX_OP_SECONDS:g}] (e.g. {bad[0][0][:80]}: {str(bad[0][5])[:40]!r}); "
                "they will be profiled again",
                RuntimeWarning,
                stacklevel=2,
            )
        return good  # type: ignore[return-value]

    def failures(self, device: str, *, now: float | None = None) -> dict[Key, str]:
        """Ops that could not be profiled on ``device``, from this torch version, stored within
        ``failure_ttl_s`` of ``now`` (older ones, or ones from another version, are retried)."""
        now = time.time() if now is None else now
        rows = self._run(lambda conn: conn.execute(
            "SELECT op, shapes, dtypes, strides, args, reason FROM op_failures WHERE device = ? AND torch_version = ? "
            "AND typeof(created_at) IN ('real', 'integer') AND created_at > ? AND created_at <= ?",
            (device, _torch_version(), now - self.failure_ttl_s, now + CLOCK_SKEW_S),
        ).fetchall())
        return {tuple(row[:5]): str(row[5]) for row in rows}  # type: ignore[misc]

    def count(self, device: str | None = None) -> int:
        if device is None:
            return int(self._run(lambda conn: conn.execute("SELECT COUNT(*) FROM op_profiles").fetchone()[0]))
        return int(self._run(lambda conn: conn.execute(
            "SELECT COUNT(*) FROM op_profiles WHERE device = ?", (device,)).fetchone()[0]))


def _check_schema(conn: sqlite3.Connection) -> None:
    """Raise ``sqlite3.DatabaseError`` when the file's tables, version or value types are not ours."""
    for table, columns in _COLUMNS.items():
        got = [(r[1], r[2].upper()) for r in conn.execute(f"PRAGMA table_info({table})")]
        if got != columns:
            raise sqlite3.DatabaseError(f"table {table} has columns {got}, expected {columns}")
    version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if version is None or version[0] != SCHEMA_VERSION:
        raise sqlite3.DatabaseError(f"schema version {version and version[0]!r}, this topomesh writes {SCHEMA_VERSION}")
    for table, columns in _COLUMNS.items():
        wrong = " OR ".join(
            f"typeof({name}) NOT IN ('real', 'integer')" if kind == "REAL" else f"typeof({name}) != '{kind.lower()}'"
            for name, kind in columns
        )
        row = conn.execute(f"SELECT * FROM {table} WHERE {wrong} LIMIT 1").fetchone()
        if row is not None:
            raise sqlite3.DatabaseError(f"table {table} holds a value of the wrong type (e.g. {str(row)[:120]})")


def device_table(spec: DeviceSpec, *, db: str | os.PathLike[str] | None = None, threads: int = 1) -> dict[Key, float]:
    """Measured op times for ``spec`` (see :func:`~topomesh.cost.devices.table_fingerprints`)
    from ``db`` or, when it exists, the shared database; empty when there are none."""
    path = Path(db) if db is not None else default_db_path()
    if db is None and not path.is_file():
        return {}
    with OpProfileDB(path) as store:
        for fp in table_fingerprints(spec, threads=threads):
            table = store.table(fp)
            if table:
                return table
    return {}
