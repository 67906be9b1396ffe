"""The worked examples in docstrings are true (pytest does not run doctests by itself).

Every module of the package is checked; the modules whose examples carry facts other tests
rely on (rank math, placement, bus factors, ring steps, sweep sizes, layout classes, op
kinds) must keep having some.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import topomesh

# ray.py needs the optional ray extra and has no examples; __main__ modules run on import.
MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(topomesh.__path__, "topomesh.")
    if m.name != "topomesh.ray" and not m.name.endswith("__main__")
)
MUST_HAVE_EXAMPLES = {
    "topomesh.layout.dims",
    "topomesh.layout.ranks",
    "topomesh.layout.place",
    "topomesh.layout.replicas",
    "topomesh.layout.api",
    "topomesh.cost.collectives",
    "topomesh.cost.calibrate",
    "topomesh.cost.ops",
    "topomesh.cost.devices",
    "topomesh.trace.cache",
    "topomesh.trace.tracer",
    "topomesh.trace.convert",
}


def test_the_listed_modules_exist():
    assert set(MODULES) >= MUST_HAVE_EXAMPLES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    if name in MUST_HAVE_EXAMPLES:
        assert result.attempted > 0, f"{name} has no docstring examples to check"
