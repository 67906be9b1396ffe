"""``topomesh profile`` on a records file: fills the table, reuses it, lists unknown ops."""

from __future__ import annotations

import json
import os

import pytest

from topomesh.cli.main import main
from topomesh.cost.ops import records_to_json
from topomesh.trace.graph import OpRecord, TensorMeta

A = TensorMeta(shape=(32, 32), dtype="float32", stride=(32, 1))


def _write(tmp_path):
    recs = [OpRecord(op="aten.mm.default", inputs=(A, A), outputs=(A,), flops=2 * 32**3)] * 4 + [
        OpRecord(op="aten.relu.default", inputs=(A,), outputs=(A,)),
        # an allowed op whose overload torch lacks: cannot run, priced by the roofline
        OpRecord(op="aten.relu.no_such_overload", inputs=(A,), outputs=(A,), bytes_moved=8192),
        OpRecord(op="aten.relu.no_such_overload", inputs=(A,), outputs=(A,), bytes_moved=8192),
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
    assert unknown["op"] == "aten.relu.no_such_overload" and unknown["count"] == 2
    # memory-bound, no flops: 2 ops x 8192 bytes at 0.9 (h100-sxm5-80gb.json kernel_efficiency.memory, cited
    # there) of 3350 GB/s = 16384 / 3.015e12 = 5.434e-9 s
    assert abs(unknown["roofline_s"] - 5.434e-9) < 1e-12
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
    assert f"topomesh: error: {bad}: op record 0 is malformed (no 'op' field)" in capsys.readouterr().err


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


def test_profile_takes_a_model_json_as_simulate_does(tmp_path, capsys):
    cfg = {"name": "p-test", "arch": "llama", "n_layers": 3, "hidden": 32, "n_heads": 4, "n_kv_heads": 2,
           "ffn_hidden": 64, "vocab_size": 64, "seq_len": 16}
    counts = []
    for layers in (3, 4):
        (tmp_path / "m.json").write_text(json.dumps({**cfg, "n_layers": layers}))
        assert main(["profile", "--model", str(tmp_path / "m.json"), "--db", str(tmp_path / "o.sqlite"),
                     "--no-profile", "--spec", "A100-SXM4-80GB", "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        counts.append(data["ops"])
    assert counts[1] > counts[0] > 0  # the file's depth is what was traced
    (tmp_path / "bad.json").write_text(json.dumps({**cfg, "n_heads": 5}))
    assert main(["profile", "--model", str(tmp_path / "bad.json"), "--no-profile", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("topomesh: error:") and err.count("\n") == 1, err


_MM = {"op": "aten.mm.default", "inputs": [{"shape": [4, 4], "dtype": "float32", "stride": [4, 1]}] * 2,
       "outputs": [{"shape": [4, 4], "dtype": "float32", "stride": [4, 1]}], "flops": 128, "args": []}


@pytest.mark.parametrize(
    "record, line",
    [
        ({"op": "aten.from_file.default", "args": ["PWNED", True, 16]},
         "op record 1 (aten.from_file.default) is refused: op 'aten.from_file.default' is not one a traced "
         "training step produces (allowed: the matmul, attention"),
        ({**_MM, "op": "aten._foobar.default"}, "op record 1 (aten._foobar.default) is refused: op "),
        ({**_MM, "op": "aten.mm.out"}, "op record 1 (aten.mm.out) is refused: op 'aten.mm.out' is not one"),
        ({**_MM, "flops": 10**30},
         "op record 1 (aten.mm.default) is refused: flops a 31-character number is not a whole number from 0 to "
         "1000000000000000000"),
        ({**_MM, "flops": "12"}, "is refused: flops 12 is not a whole number"),
        ({**_MM, "bytes_moved": -1}, "is refused: bytes_moved -1 is not a whole number from 0 to 1125899906842624"),
        ({**_MM, "inputs": [{"shape": [-1, 4], "dtype": "float32", "stride": [4, 1]}]},
         "is refused: input 0: size -1 is not a whole number from 0 to 4294967296"),
        ({**_MM, "inputs": [{"shape": [4, 4], "dtype": "float32", "stride": [4, -1]}]},
         "is refused: input 0: stride -1 is not a whole number"),
        ({**_MM, "inputs": [{"shape": [4, 4], "dtype": "float32", "stride": [1]}]},
         "is refused: input 0: 1 strides for 2 dimensions"),
        # 65,537 rows with a row stride of 65,537 span 1 + 65,536·65,537 = 4,295,032,833 elements > 2**32
        ({**_MM, "inputs": [{"shape": [65537, 1], "dtype": "float32", "stride": [65537, 1]}]},
         "is refused: input 0: shape [65537, 1] with strides [65537, 1] spans more than 4294967296 elements"),
        ({**_MM, "inputs": [{"shape": [1] * 17, "dtype": "float32", "stride": [1] * 17}]},
         "is refused: input 0: 17 dimensions, more than the 16 allowed"),
        ({**_MM, "outputs": [{"shape": [4], "dtype": "from_file", "stride": [1]}]},
         "is refused: output 0: dtype 'from_file' is not one of"),
        # two 4×4 float32 inputs (128 bytes) + 5 float64 outputs of 2**31 elements (5 · 2**34 bytes)
        ({**_MM, "outputs": [{"shape": [2**31], "dtype": "float64", "stride": [1]}] * 5},
         "is refused: its tensors take 85899346048 bytes, more than the 68719476736 allowed for one op"),
        ({**_MM, "args": [[[[[1]]]]]}, "is malformed (arguments nested more than 4 deep)"),
        ({**_MM, "args": ["x" * 65]}, "is malformed (a string argument longer than 64 characters)"),
        ({**_MM, "args": [2**63]}, "is malformed (integer argument 9223372036854775808… outside the int64 range)"),
        ({**_MM, "args": [{"a": 1}]}, "is malformed (an argument of type dict"),
        ({**_MM, "inputs": [[4, 4]]}, "is malformed (a tensor is list, not an object with shape, dtype and stride)"),
        ({"inputs": []}, "op record 1 is malformed (no 'op' field)"),
    ],
)
def test_profile_refuses_records_a_trace_cannot_produce(tmp_path, capsys, record, line):
    path = tmp_path / "recs.json"
    path.write_text(json.dumps([_MM, record]))
    cwd = os.getcwd()
    os.chdir(tmp_path)  # aten.from_file would create PWNED here
    try:
        assert main(["profile", "--records", str(path), "--db", str(tmp_path / "o.sqlite"), "--json"]) == 2
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert err.startswith(f"topomesh: error: {path}: ") and line in err and err.count("\n") == 1
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "o.sqlite").exists()
