from __future__ import annotations

import pytest

from topomesh.errors import LayoutError
from topomesh.layout.dims import merge_degrees, parse_degrees


def test_parse_degrees_normalizes_axes():
    assert parse_degrees(" tp=8 , DP=2,dp-shard=4") == {"tp": 8, "dp_replicate": 2, "dp_shard": 4}
    assert parse_degrees("pp=-1", allow_rest=True) == {"pp": -1}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tp", "not AXIS=DEGREE"),
        ("tp=x", "not AXIS=DEGREE"),
        ("tp=0", "positive integer as"),
        ("tp=-1", "positive integer as"),  # -1 only where the command allows the rest
        ("warp=2", "unknown parallel axis 'warp'"),
        ("tp=2,tp=2", "given twice"),
        (" , ", "no AXIS=DEGREE pairs"),
    ],
)
def test_parse_degrees_rejects(text, message):
    with pytest.raises(LayoutError, match=message):
        parse_degrees(text)


def test_merge_degrees():
    assert merge_degrees({"tp": 1, "pp": 2}, {"tp": 4}) == {"tp": 4, "pp": 2}
    assert merge_degrees({"tp": 4}, {"tp": 4}) == {"tp": 4}
    with pytest.raises(LayoutError, match="tp is 2 by its flag but 4"):
        merge_degrees({"tp": 2}, {"tp": 4})
