"""Traces as strict JSON: exact round trips, and every kind of bad value refused with its place."""

from __future__ import annotations

import json
import math

import pytest

from topomesh.errors import TraceError
from topomesh.trace.codec import from_json, to_json
from topomesh.trace.graph import CollectiveKind, CollectiveRecord, OpRecord, Phase, TensorMeta
from topomesh.trace.result import Part, Segment, Trace

A = TensorMeta(shape=(4, 8), dtype="bfloat16", stride=(8, 1))
MM = OpRecord(op="aten.mm.default", inputs=(A, A), outputs=(A,), flops=2 * 4 * 8 * 8, bytes_moved=None,
              phase=Phase.BACKWARD, args=((1, 2), -math.inf, None, True, "torch.float32", 0.5))
AR = CollectiveRecord(kind=CollectiveKind.ALL_REDUCE, bytes=64, group_size=2, mesh_axis="tp", dtype="bfloat16",
                      op="_c10d_functional.all_reduce.default")
TRACE = Trace(
    model="m", layout=(("tp", 2),), batch_size=1, dtype="bfloat16", traced_layers=1, n_layers=4,
    segments=(Segment(part=Part.REST, phase=Phase.FORWARD, events=(MM,), prefetch=(AR,)),
              Segment(part=Part.BLOCK, phase=Phase.BACKWARD, layer=0, events=(AR, MM))),
    unknown_ops=("aten.foo.default",), trace_s=0.25,
)


def test_round_trip_is_exact_through_standard_json() -> None:
    text = json.dumps(to_json(TRACE), allow_nan=False)  # no NaN/Infinity literals needed
    raw = json.loads(text)
    assert raw["segments"][0]["events"][0]["type"] == "OpRecord"
    assert raw["segments"][0]["events"][0]["args"] == [[1, 2], {"float": "-inf"}, None, True, "torch.float32", 0.5]
    assert raw["segments"][1]["events"][0] == {
        "type": "CollectiveRecord", "kind": "all_reduce", "bytes": 64, "group_size": 2, "mesh_axis": "tp",
        "dtype": "bfloat16", "phase": "forward", "op": "_c10d_functional.all_reduce.default",
    }
    back = from_json(Trace, raw, "trace")
    assert back == TRACE and back.trace_s == 0.25
    mm = back.segments[0].events[0]
    assert mm.args == ((1, 2), -math.inf, None, True, "torch.float32", 0.5)  # args are compare=False
    assert type(mm.args[0]) is tuple and mm.phase is Phase.BACKWARD and mm.bytes_moved is None


def test_nan_in_args_survives() -> None:
    rec = OpRecord(op="aten.fill.Scalar", inputs=(A,), outputs=(A,), args=(math.nan,))
    assert math.isnan(from_json(OpRecord, json.loads(json.dumps(to_json(rec), allow_nan=False))).args[0])


def test_a_cat_of_one_piece_per_shard_rank_round_trips() -> None:
    """FSDP2 at a shard degree of 8,192 concatenates 8,192 pieces: the cat's argument list
    has a slot per piece (the trace cache refused such files before, and traced them again)."""
    cat = OpRecord(op="aten.cat.out", inputs=(A,) * 8192, outputs=(A,), args=((None,) * 8192, 1))
    back = from_json(OpRecord, json.loads(json.dumps(to_json(cat))))
    assert back == cat and back.args == ((None,) * 8192, 1)
    with pytest.raises(TraceError, match="longer than 1048576"):
        from_json(OpRecord, dict(to_json(cat), args=[[None] * (2**20 + 1)]), "rec")


def _raw() -> dict:
    return json.loads(json.dumps(to_json(TRACE)))


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("segments", 0, "events", 0, "flops"), 10**400, "trace.segments\\[0\\].events\\[0\\].flops: .*an integer of 1329 bits"),
        (("segments", 0, "events", 0, "flops"), 2**63, "flops: expected an integer from 0 to 2\\*\\*63-1"),
        (("segments", 0, "events", 0, "flops"), 1.0, "flops: expected an integer"),
        (("segments", 0, "events", 0, "flops"), False, "flops: expected an integer"),
        (("segments", 0, "events", 0, "bytes_moved"), -1, "bytes_moved: expected an integer"),
        (("segments", 0, "events", 0, "phase"), "sideways", "phase: 'sideways' is not one of"),
        (("segments", 0, "events", 0, "op"), "aten.mm\x1b[2J", "op: expected a string of at most 1000 printable"),
        (("segments", 0, "events", 0, "op"), "x" * 1001, "op: expected a string of at most 1000"),
        (("segments", 0, "events", 0, "type"), "Bomb", "type: 'Bomb' is not one of \\['CollectiveRecord', 'OpRecord'\\]"),
        (("segments", 0, "events", 0, "inputs", 0, "shape"), [2**40, 2**40], "has more than 1125899906842624 elements"),
        (("segments", 0, "events", 0, "inputs", 0, "shape"), [1] * 65, "same length, at most 64"),
        (("segments", 0, "events", 0, "args"), [{"float": "1e999"}], "args\\[0\\]: an op argument object must be"),
        (("segments", 0, "events", 0, "args"), [[[[[[[[[1]]]]]]]]], "nested deeper than 8"),
        (("segments", 0, "events", 0, "args"), [10**30], "outside int64"),
        (("segments", 1, "events", 0, "group_size"), 0, "group_size 0 is not in \\[1, 16777216\\]"),
        (("segments", 1, "layer"), "0", "layer: expected an integer"),
        (("segments", 1, "part"), None, "part: 'None' is not one of"),
        (("layout",), [["tp", 2, 3]], "layout\\[0\\]: expected a list of 2 items, got 3"),
        (("layout",), [["tp", 0]], "layout \\[\\('tp', 0\\)\\] has a degree below 1"),
        (("n_layers",), 0, "traced_layers 1, n_layers 0"),
        (("trace_s",), math.inf, "trace_s: expected a finite non-negative number"),
        (("segments",), {"0": {}}, "segments: expected a list"),
    ],
)
def test_bad_values_are_refused_with_their_place(path: tuple, value: object, message: str) -> None:
    raw = _raw()
    node = raw
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    with pytest.raises(TraceError, match=message):
        from_json(Trace, raw, "trace")


def test_missing_and_unknown_keys_are_refused() -> None:
    raw = _raw()
    del raw["model"]
    with pytest.raises(TraceError, match="trace: Trace needs the key 'model'"):
        from_json(Trace, raw, "trace")
    raw = _raw()
    raw["segments"][0]["__class__"] = "os.system"
    with pytest.raises(TraceError, match="trace.segments\\[0\\]: unknown keys \\['__class__'\\] for Segment"):
        from_json(Trace, raw, "trace")
    with pytest.raises(TraceError, match="trace: expected an object for Trace, got list"):
        from_json(Trace, [], "trace")
