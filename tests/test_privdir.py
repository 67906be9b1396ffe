"""Private directories: created 0700, refused when linked, shared or someone else's; fallbacks."""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

import pytest

from topomesh.errors import LaunchError
from topomesh.launch import files
from topomesh.privdir import private_directory, runtime_directory


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_created_with_parents_and_mode_0700(tmp_path: Path) -> None:
    d = private_directory(tmp_path / "a" / "b", what="test directory", error=LaunchError)
    assert d == tmp_path / "a" / "b" and d.is_dir() and _mode(d) == 0o700
    assert private_directory(d, what="test directory", error=LaunchError) == d  # existing private dir: fine
    assert _mode(tmp_path / "a") == 0o700  # a parent made here is private too


def test_trace_cache_first_leaves_the_cache_root_usable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fresh home the trace cache (``<root>/traces``) is often made first; the cache root
    it creates on the way must pass the op database's own check afterwards."""
    from topomesh.cost.devices import private_cache_dir
    from topomesh.trace.cache import TraceCache, default_directory

    monkeypatch.delenv("TOPOMESH_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert TraceCache(default_directory()).directory is not None
    assert (tmp_path / "xdg" / "topomesh" / "traces").is_dir()
    assert private_cache_dir() == tmp_path / "xdg" / "topomesh"


@pytest.mark.parametrize("mode", [0o750, 0o705, 0o770, 0o777, 0o701])
def test_any_access_for_others_is_refused(tmp_path: Path, mode: int) -> None:
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(mode)
    with pytest.raises(LaunchError, match=f"test directory '{d}' has mode {mode:04o}; .*chmod 700"):
        private_directory(d, what="test directory", error=LaunchError)


def test_someone_elses_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    real = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real + 1)  # we are now someone else
    with pytest.raises(LaunchError, match=f"belongs to uid {real}, not to this user \\({real + 1}\\)"):
        private_directory(d, what="test directory", error=LaunchError)


def test_symlinks_and_files_are_refused(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(LaunchError, match="is a symlink or not a directory"):
        private_directory(tmp_path / "link", what="test directory", error=LaunchError)
    (tmp_path / "file").write_text("x")
    with pytest.raises(LaunchError, match="'.*file' is not a directory"):
        private_directory(tmp_path / "file", what="test directory", error=LaunchError)
    with pytest.raises(LaunchError, match="'.*file/sub' is not a directory .*a directory above it"):
        private_directory(tmp_path / "file" / "sub", what="test directory", error=LaunchError)


def test_blocked_tmp_directory_falls_back_to_xdg_runtime_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    blocked = tmp_path / f"topomesh-{os.getuid()}"
    blocked.mkdir()
    blocked.chmod(0o777)  # as if another user had made it for everyone
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    with caplog.at_level(logging.WARNING, logger="topomesh"):
        d = files.run_directory("job")
    assert d == runtime / "topomesh" / "job" and _mode(d) == 0o700 and _mode(d.parent) == 0o700
    assert f"'{blocked}' has mode 0777" in caplog.text and f"using {runtime / 'topomesh'} instead" in caplog.text


def test_blocked_everywhere_falls_back_to_a_fresh_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    fake_uid = os.getuid() + 1
    # Both candidates exist and belong to the real uid, i.e. to "another user" once getuid is faked.
    (tmp_path / f"topomesh-{fake_uid}").mkdir(mode=0o700)
    runtime = tmp_path / "run"
    (runtime / "topomesh").mkdir(parents=True, mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setattr(os, "getuid", lambda: fake_uid)
    with caplog.at_level(logging.WARNING, logger="topomesh"):
        d = runtime_directory(what="topology directory", error=LaunchError)
    assert d.parent == tmp_path and d.name.startswith(f"topomesh-{fake_uid}-") and _mode(d) == 0o700
    assert "belongs to uid" in caplog.text and f"using the fresh directory {d} instead" in caplog.text
    assert runtime_directory(what="topology directory", error=LaunchError) != d  # fresh each time


def test_explicit_topology_dir_does_not_fall_back(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    base.chmod(0o755)
    with pytest.raises(LaunchError, match="topology directory .* has mode 0755"):
        files.run_directory("job", base)
