"""Every cost test writes its caches (CPU spec, op table, profiles) under its own tmp dir."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(tmp_path / "topomesh-cache"))
