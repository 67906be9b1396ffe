"""Private directories: the one place topomesh decides whether a directory is safe to use.

Every directory topomesh reads back what it wrote — the launcher's topology files, the
trace cache, the op-profile database's default location, the measured CPU spec — goes
through :func:`private_directory`: created with mode 0700 when missing, and refused when
it is a symlink or not a directory, belongs to another user, or is open to other users
(any of the group/other mode bits). A directory someone else controls could feed us files
(a poisoned op table, a forged topology) or read what we write.

:func:`runtime_directory` is the per-user directory for short-lived files
(``$TMPDIR/topomesh-<uid>``). Another user can create that name first and block it; then
``$XDG_RUNTIME_DIR/topomesh`` and finally a fresh :func:`tempfile.mkdtemp` are used
instead, with a warning that says why.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

from topomesh.errors import TopomeshError

log = logging.getLogger("topomesh")


def private_directory(path: str | os.PathLike[str], *, what: str, error: type[TopomeshError]) -> Path:
    """``path`` as a directory only this user can use, created (mode 0700) if missing.

    Missing parents are created too, each with mode 0700: a parent this call creates may
    itself be checked as private later (the trace cache's ``~/.cache/topomesh/traces`` makes
    ``~/.cache/topomesh``, which the op database then requires private). Parents that exist
    are left as they are.
    ``what`` names the directory in messages (e.g. ``"trace cache directory"``); problems
    raise ``error`` with one sentence naming the directory and what is wrong with it.
    """
    p = Path(path)
    try:
        for parent in reversed(p.parents):
            if not parent.exists():
                parent.mkdir(mode=0o700, exist_ok=True)
        p.mkdir(mode=0o700, exist_ok=True)
        st = p.lstat()
    except (FileExistsError, NotADirectoryError):
        raise error(f"the {what} {str(p)!r} is not a directory (it, or a directory above it, is a file)") from None
    except OSError as exc:
        raise error(f"cannot create the {what} {str(p)!r} ({exc.strerror or exc})") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise error(f"the {what} {str(p)!r} is a symlink or not a directory; refusing to use it")
    uid = os.getuid()
    if st.st_uid != uid:
        raise error(f"the {what} {str(p)!r} belongs to uid {st.st_uid}, not to this user ({uid}); refusing to use it")
    if st.st_mode & 0o077:
        raise error(
            f"the {what} {str(p)!r} has mode {stat.S_IMODE(st.st_mode):04o}; it must not be accessible to "
            f"other users (run `chmod 700 {p}`)"
        )
    return p


def runtime_directory(*, what: str, error: type[TopomeshError]) -> Path:
    """A private per-user directory for this session's short-lived files.

    ``$TMPDIR/topomesh-<uid>`` when it is (or can be made) private; else
    ``$XDG_RUNTIME_DIR/topomesh``; else a fresh ``tempfile.mkdtemp`` (mode 0700, ours by
    construction). Each fallback logs a warning naming the directory refused and why.
    """
    default = Path(tempfile.gettempdir()) / f"topomesh-{os.getuid()}"
    try:
        return private_directory(default, what=what, error=error)
    except TopomeshError as exc:
        reason = str(exc)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_absolute():
        try:
            got = private_directory(Path(runtime) / "topomesh", what=what, error=error)
        except TopomeshError as exc:
            reason = f"{reason}; {exc}"
        else:
            log.warning("topomesh: %s; using %s instead", reason, got)
            return got
    try:
        got = Path(tempfile.mkdtemp(prefix=f"topomesh-{os.getuid()}-"))
    except OSError as exc:
        raise error(f"{reason}; and cannot create a fresh {what} ({exc.strerror or exc})") from None
    log.warning("topomesh: %s; using the fresh directory %s instead", reason, got)
    return got
