"""The worked examples in the layout docstrings are true, and only groups.py makes groups."""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

MODULES = ["dims", "ranks", "place", "replicas", "api"]
LAYOUT = Path(__file__).resolve().parents[2] / "src" / "topomesh" / "layout"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    mod = importlib.import_module(f"topomesh.layout.{name}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0, f"topomesh.layout.{name} has no docstring examples to check"


def test_only_groups_module_creates_process_groups() -> None:
    pattern = re.compile(r"\b(new_group|new_subgroups\w*|init_device_mesh|init_process_group)\s*\(|DeviceMesh\(")
    offenders = [
        p.name for p in LAYOUT.glob("*.py") if p.name != "groups.py" and pattern.search(p.read_text())
    ]
    assert offenders == []
