"""Where the launcher writes topology files, safely.

Files live in a per-user directory, ``$TMPDIR/topomesh-<uid>/<run_id>/`` by default, both
levels created with mode 0700 and refused when they are symlinks, owned by another user
or open to others (:mod:`topomesh.privdir`; when another user blocks the default, the
launcher falls back to ``$XDG_RUNTIME_DIR/topomesh`` or a fresh temporary directory).
The run id is reduced to a safe directory name (an id that could name a path, such as
``..`` or ``a/b``, is hashed). File names carry the restart count and a hash of the
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

_SAFE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")
"""Run ids used as they are: nothing that can name a path, a hidden file, ``.`` or ``..``."""
_KEEP = re.compile(r"[A-Za-z0-9._-]")


def safe_run_id(run_id: str) -> str:
    """A directory name for a torchrun run id; every id torchrun accepts gets one.

    Ids of up to 64 letters, digits, ``.``, ``_`` and ``-`` not starting with ``.`` are
    used as they are. Any other id (a leading ``.``, ``/``, spaces, more than 64
    characters) keeps its first 48 characters, each other character and a leading ``.``
    replaced by ``_``, plus a hash of the whole id: the name never leaves the base
    directory, and distinct ids stay distinct.

    >>> safe_run_id("job-42")
    'job-42'
    >>> safe_run_id("job:42")
    'job_42-df66d7748717a3c6'
    """
    if _SAFE.fullmatch(run_id):
        return run_id
    kept = "".join(c if _KEEP.fullmatch(c) else "_" for c in run_id[:48])
    if kept.startswith("."):
        kept = "_" + kept[1:]
    return f"{kept}-{digest(run_id)}"


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
