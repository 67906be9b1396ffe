"""``topomesh profile`` on a records file: fills the table, reuses it, lists unknown ops."""

from __future__ import annotations

import json

import pytest

from topomesh.cli.main import main
from topomesh.cost.ops import records_to_json
from topomesh.trace.graph import OpRecord, TensorMeta

A = TensorMeta(shape=(32, 32), dtype="float32", stride=(32, 1))


def _write(tmp_path):
    recs = [OpRecord(op="aten.mm.default", inputs=(A, A), outputs=(A,), flops=2 * 32**3)] * 4 + [
        OpRecord(op="aten.relu.default", inputs=(A,), outputs=(A,)),
        OpRecord(op="aten.no_such_op.default", inputs=(A,), outputs=(A,), bytes_moved=8192),
        OpRecord(op="aten.no_such_op.default", inputs=(A,), outputs=(A,), bytes_moved=8192),
    ]
    path = tmp_path / "recs.json"
    path.write_text(json.dumps(records_to_json(recs)))
    return path


def test_profile_fills_the_table_then_reuses_it(tmp_path, capsys):
    recs, db = _write(tmp_path), tmp_path / "ops.sqlite"
    argv = ["profile", "--records", str(recs), "--db", str(db), "--threads", "1", "--spec", "H100-SXM5-80GB", "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert (first["distinct"], first["profiled_now"], first["cached"]) == (3, 2, 0)
    assert first["ops"] == 7 and first["measured_s"] > 0
    [unknown] = first["unknown"]
    assert unknown["op"] == "aten.no_such_op.default" and unknown["count"] == 2
    assert abs(unknown["roofline_s"] - 2 * 8192 / 3350e9) < 1e-15
    assert main(argv) == 0
    second = json.loads(capsys.readouterr().out)
    assert (second["profiled_now"], second["cached"]) == (0, 3)
    assert second["measured_s"] == first["measured_s"]


def test_profile_bad_input_is_one_line_exit_2(tmp_path, capsys):
    assert main(["profile", "--records", str(tmp_path / "missing.json")]) == 2
    assert "no such op-records file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"inputs": []}]))
    assert main(["profile", "--records", str(bad)]) == 2
    assert "op record 0 is malformed" in capsys.readouterr().err


@pytest.mark.slow
def test_profile_a_traced_preset_under_a_layout(tmp_path, capsys):
    argv = ["profile", "--model", "tiny-llama", "--layout", "tp=2,dp_shard=2", "--db", str(tmp_path / "o.sqlite"),
            "--threads", "1", "--spec", "A100-SXM4-80GB", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    # every distinct op of the traced step (forward, backward, AdamW, FSDP copy-in/out) ran for real
    assert data["distinct"] > 50 and data["profiled_now"] == data["distinct"] and data["failed"] == {}
    assert data["ops"] > data["distinct"] and data["unknown"] == [] and data["measured_s"] > 0
    assert main(["profile", "--model", "tiny-llama", "--layout", "tp=two"]) == 2
    assert "not AXIS=DEGREE" in capsys.readouterr().err
