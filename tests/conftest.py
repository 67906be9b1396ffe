"""Shared test fixtures and helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# shared/data beside the checkout (CI, developers); the repo carries the same real dumps
# under examples/data for a plain clone.
SHARED_DATA = next(
    (p for p in (REPO.parent / "shared" / "data", REPO / "examples" / "data") if (p / "real").is_dir()),
    REPO.parent / "shared" / "data",
)
FIXTURES = Path(__file__).resolve().parent / "fixtures"

# Tests never talk to a Ray cluster with auth, and never write logs outside tmp dirs.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA
