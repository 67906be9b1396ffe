"""Where the launcher writes topology files, safely.

Files live in a per-user directory, ``$TMPDIR/topomesh-<uid>/<run_id>/`` by default, both
levels created with mode 0700 and refused when they are symlinks, owned by another user
or open to others (:mod:`topomesh.privdir`; when another user blocks the default, the
launcher falls back to ``$XDG_RUNTIME_DIR/topomesh`` or a fresh temporary directory).
The run id is reduced to a safe file name; an id that names a path (``..``, ``a/b``) is
rejected. File names carry the restart count and a hash of the
content, so two agents of one job on one host write the same name with the same bytes,
and two jobs (different run ids) never share a directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from topomesh.errors import LaunchError
from topomesh.launch.exchange import digest
from topomesh.privdir import private_directory, runtime_directory
from topomesh.topology.api import write_atomic

_SAFE = re.compile(r"[A-Za-z0-9._-]")


def safe_run_id(run_id: str) -> str:
    """A file-name-safe form of a torchrun run id.

    Letters, digits, ``.``, ``_`` and ``-`` are kept; any other character becomes ``_``
    and a short hash of the original is appended so distinct ids stay distinct. Ids that
    are or contain a path (``/``, ``\\``, a leading ``.``, NUL) are rejected.

    >>> safe_run_id("job-42")
    'job-42'
    >>> safe_run_id("job:42")
    'job_42-df66d774'
    """
    if not run_id or len(run_id) > 200:
        raise LaunchError(f"run id {run_id!r} must be 1 to 200 characters long")
    if "/" in run_id or "\\" in run_id or "\0" in run_id or run_id.startswith("."):
        raise LaunchError(
            f"run id {run_id!r} looks like a path; it may not contain '/', '\\' or NUL "
            "or start with '.'"
        )
    cleaned = "".join(c if _SAFE.fullmatch(c) else "_" for c in run_id)
    if cleaned != run_id:
        cleaned = f"{cleaned}-{digest(run_id)[:8]}"
    return cleaned


def run_directory(run_id: str, base: str | os.PathLike[str] | None = None) -> Path:
    """The private directory for one run's files, created if needed.

    ``base`` is ``--topology-dir``; by default :func:`topomesh.privdir.runtime_directory`
    (``$TMPDIR/topomesh-<uid>``, falling back with a warning when another user blocks it).
    Both levels go through :func:`topomesh.privdir.private_directory`.
    """
    what = "topology directory"
    if base is None:
        root = runtime_directory(what=what, error=LaunchError)
    else:
        root = private_directory(base, what=what, error=LaunchError)
    return private_directory(root / safe_run_id(run_id), what=what, error=LaunchError)


def write_topology_file(directory: Path, text: str, restart_count: int) -> Path:
    """Write one round's file atomically (mode 0600) and return its path."""
    name = f"topology-r{restart_count}-{digest(text)}.json"
    return write_atomic(directory / name, text, mode=0o600)
