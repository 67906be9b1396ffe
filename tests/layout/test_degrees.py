from __future__ import annotations

import pytest

from topomesh.errors import LayoutError
from topomesh.layout.dims import merge_degrees, parse_decimal, parse_degrees


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
        # int() reads each of these as a number; a degree is plain ASCII digits only
        ("tp=+4", r"^layout entry 'tp=\+4' is not AXIS=DEGREE with a positive integer as the degree, written in "
                  r"plain ASCII digits \(no sign, underscore or leading zero\)$"),
        ("tp=\u0664", "layout entry 'tp=\u0664' is not AXIS=DEGREE"),  # ARABIC-INDIC DIGIT FOUR
        ("tp=4_0", "layout entry 'tp=4_0' is not AXIS=DEGREE"),  # int("4_0") == 40
        ("tp=04", "layout entry 'tp=04' is not AXIS=DEGREE"),
        ("tp=2,,pp=2", r"^the layout 'tp=2,,pp=2' has an empty entry \(two commas in a row, or one at an end\)"),
        ("tp=2,", "has an empty entry"),
        ("tp=1048577", r"^layout entry 'tp=1048577': the degree 1048577 is more than 1048576, the largest world"),
        ("tp=" + "9" * 19, "is not AXIS=DEGREE"),  # more digits than any degree: not even converted
    ],
)
def test_parse_degrees_rejects(text, message):
    with pytest.raises(LayoutError, match=message):
        parse_degrees(text)


def test_parse_degrees_bounds_and_rest():
    assert parse_degrees("tp=1048576") == {"tp": 1048576}
    assert parse_degrees("tp = 2 ,pp=-1", allow_rest=True) == {"tp": 2, "pp": -1}
    with pytest.raises(LayoutError, match=r"'pp=-2' is not AXIS=DEGREE with a positive integer or -1 \(the rest\)"):
        parse_degrees("pp=-2", allow_rest=True)


@pytest.mark.parametrize(("text", "value"), [("0", 0), ("7", 7), ("1048576", 1048576), ("9" * 18, 10**18 - 1),
                                              ("9" * 19, None), ("+7", None), ("7_0", None), ("07", None),
                                              (" 7", None), ("\u0667", None), ("7.0", None), ("-7", None), ("", None)])
def test_parse_decimal(text, value):
    assert parse_decimal(text) == value


def test_merge_degrees():
    assert merge_degrees({"tp": 1, "pp": 2}, {"tp": 4}) == {"tp": 4, "pp": 2}
    assert merge_degrees({"tp": 4}, {"tp": 4}) == {"tp": 4}
    with pytest.raises(LayoutError, match="tp is 2 by its flag but 4"):
        merge_degrees({"tp": 2}, {"tp": 4})
