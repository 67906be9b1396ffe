"""The op-profile table: measured op times in one SQLite file shared by runs and processes.

Rows are keyed by (device fingerprint, op, shapes, dtypes, strides, args), the last five
as canonical JSON (:func:`topomesh.cost.ops.profile_key`). Several processes may
profile at once: the file runs in WAL mode with a busy timeout, and rows are written with
``INSERT OR IGNORE`` so the first measurement of a key wins and later ones are dropped.

A file that is not a database or fails ``PRAGMA integrity_check`` is moved aside
(``<name>.corrupt-<time>``) with a warning and an empty table is created in its place.
"""

from __future__ import annotations

import os
import sqlite3
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from topomesh.cost.devices import cache_dir
from topomesh.errors import CalibrationError

SCHEMA_VERSION = "1"
BUSY_TIMEOUT_S = 60.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS op_profiles (
    device TEXT NOT NULL, op TEXT NOT NULL, shapes TEXT NOT NULL, dtypes TEXT NOT NULL,
    strides TEXT NOT NULL, args TEXT NOT NULL,
    median_s REAL NOT NULL, repeats INTEGER NOT NULL, warmup INTEGER NOT NULL,
    method TEXT NOT NULL, created_at REAL NOT NULL,
    PRIMARY KEY (device, op, shapes, dtypes, strides, args)
);
CREATE TABLE IF NOT EXISTS op_failures (
    device TEXT NOT NULL, op TEXT NOT NULL, shapes TEXT NOT NULL, dtypes TEXT NOT NULL,
    strides TEXT NOT NULL, args TEXT NOT NULL, reason TEXT NOT NULL, created_at REAL NOT NULL,
    PRIMARY KEY (device, op, shapes, dtypes, strides, args)
);
"""

Key = tuple[str, str, str, str, str]
"""(op, shapes, dtypes, strides, args) as :func:`topomesh.cost.ops.profile_key` gives them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OpTiming:
    """One measured op: median seconds over ``repeats`` runs after ``warmup`` runs."""

    key: Key
    median_s: float
    repeats: int
    warmup: int
    method: str
    """How it was timed, e.g. ``cpu perf_counter`` or ``cuda events``."""


def default_db_path() -> Path:
    return cache_dir() / "op_profiles.sqlite"


class OpProfileDB:
    """A connection to the shared op-profile file (one per process; not thread-safe)."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else default_db_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rebuilt_from: Path | None = None
        """Where a corrupt file was moved to when this connection rebuilt it, else None."""
        try:
            self._conn = self._open()
        except sqlite3.OperationalError as exc:
            # locked / busy past the timeout, unwritable directory: not corruption, keep the file
            raise CalibrationError(f"{self.path}: cannot open the op-profile database ({exc})") from None
        except sqlite3.DatabaseError as exc:
            self.rebuilt_from = self._move_aside(str(exc))
            try:
                self._conn = self._open()
            except sqlite3.DatabaseError as exc2:
                raise CalibrationError(f"{self.path}: cannot create an op-profile database ({exc2})") from None

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
            got = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
            if got != SCHEMA_VERSION:
                raise sqlite3.DatabaseError(f"schema version {got}, this topomesh writes {SCHEMA_VERSION}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _move_aside(self, reason: str) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{os.getpid()}")
        with suppress(FileNotFoundError):  # another process may have moved it first
            os.replace(self.path, target)
        for suffix in ("-wal", "-shm"):
            side = self.path.with_name(self.path.name + suffix)
            with suppress(FileNotFoundError):
                os.replace(side, target.with_name(target.name + suffix))
        warnings.warn(
            f"op-profile database {self.path} is corrupt ({reason}); moved it to {target} and "
            "started an empty one (ops will be profiled again)",
            RuntimeWarning,
            stacklevel=3,
        )
        return target

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> OpProfileDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def put(self, device: str, timings: Iterable[OpTiming]) -> int:
        """Store timings for ``device``; keys already present are left alone. Returns rows added."""
        now = time.time()
        rows = [(device, *t.key, t.median_s, t.repeats, t.warmup, t.method, now) for t in timings]
        with self._transaction() as conn:
            before = conn.total_changes
            conn.executemany(
                "INSERT OR IGNORE INTO op_profiles (device, op, shapes, dtypes, strides, args, median_s, "
                "repeats, warmup, method, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            return conn.total_changes - before

    def put_failure(self, device: str, key: Key, reason: str) -> None:
        """Remember that an op signature cannot be profiled here (so it is not retried)."""
        with self._transaction() as conn:
            conn.execute(
                "INSERT OR IGNORE INTO op_failures (device, op, shapes, dtypes, strides, args, reason, "
                "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (device, *key, reason[:500], time.time()),
            )

    def table(self, device: str) -> dict[Key, float]:
        """Every measured median (seconds) for ``device``, keyed like :func:`profile_key`."""
        cur = self._conn.execute(
            "SELECT op, shapes, dtypes, strides, args, median_s FROM op_profiles WHERE device = ?", (device,)
        )
        return {tuple(row[:5]): float(row[5]) for row in cur}  # type: ignore[misc]

    def failures(self, device: str) -> dict[Key, str]:
        cur = self._conn.execute(
            "SELECT op, shapes, dtypes, strides, args, reason FROM op_failures WHERE device = ?", (device,)
        )
        return {tuple(row[:5]): str(row[5]) for row in cur}  # type: ignore[misc]

    def count(self, device: str | None = None) -> int:
        if device is None:
            return int(self._conn.execute("SELECT COUNT(*) FROM op_profiles").fetchone()[0])
        return int(self._conn.execute("SELECT COUNT(*) FROM op_profiles WHERE device = ?", (device,)).fetchone()[0])
