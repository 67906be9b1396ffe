"""Rank math at its bounds: exactly the grid size and one coordinate past an axis."""

from __future__ import annotations

import pytest

from topomesh.errors import LayoutError
from topomesh.layout.dims import Layout
from topomesh.layout.ranks import compose, coords_to_rank, decompose


def test_logical_rank_bounds_at_exactly_the_grid_size():
    # sizes [2, 3, 2] (fastest first): 12 ranks, strides 1, 2, 6; rank 11 = 1 + 2*2 + 1*6
    assert decompose(11, [2, 3, 2]) == (1, 2, 1)
    assert compose((1, 2, 1), [2, 3, 2]) == 11
    with pytest.raises(LayoutError, match="rank 12 is outside a grid of 12 ranks"):
        decompose(12, [2, 3, 2])
    with pytest.raises(LayoutError, match="rank -1 is outside a grid of 12 ranks"):
        decompose(-1, [2, 3, 2])
    with pytest.raises(LayoutError, match="coordinate 3 is outside an axis of size 3"):
        compose((0, 3, 0), [2, 3, 2])
    with pytest.raises(LayoutError, match="coordinate -1 is outside an axis of size 2"):
        compose((-1, 0, 0), [2, 3, 2])
    with pytest.raises(LayoutError, match="coordinate 2 is outside an axis of size 2"):
        coords_to_rank({"tp": 2}, Layout(tp=2, pp=2))
    assert coords_to_rank({"tp": 1, "pp": 1}, Layout(tp=2, pp=2)) == 3
