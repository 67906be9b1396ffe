"""The worked examples in the cost-model and tracer docstrings are true (pytest does not run
doctests by itself): bus factors, ring steps, sweep sizes, layout classes, op kinds."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "topomesh.cost.collectives",
    "topomesh.cost.calibrate",
    "topomesh.cost.ops",
    "topomesh.cost.devices",
    "topomesh.trace.cache",
    "topomesh.trace.tracer",
    "topomesh.trace.convert",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0, f"{name} has no docstring examples to check"
