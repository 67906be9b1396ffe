"""``topomesh trace``: JSON keys and hand-checked counts; bad input exits 2 with one line."""

from __future__ import annotations

import json

import pytest

from topomesh.cli.main import main


def test_trace_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "tiny-llama", "--tp", "2", "--batch-size", "2", "--no-optimizer", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"model", "layout", "world_size", "flops", "flops_by_phase", "op_counts", "collectives",
            "unknown_ops", "n_layers", "traced_layers", "trace_s"} <= doc.keys()
    assert doc["layout"] == {"tp": 2} and doc["n_layers"] == 2 and doc["traced_layers"] == 1
    assert doc["unknown_ops"] == {}
    colls = {(c["kind"], c["mesh_axis"], c["phase"]): c for c in doc["collectives"]}
    # SP: 2 gathers per block forward, +1 before the vocab-parallel head; bytes b·s·h·2 each
    ag = colls[("all_gather", "tp", "forward")]
    assert ag["count"] == 2 * 2 + 1 and ag["bytes"] == ag["count"] * 2 * 32 * 64 * 2
    kinds = doc["ops_by_kind"]
    assert kinds["matmul"]["flops"] + kinds["attention"]["flops"] == doc["flops"]
    assert kinds["view"]["bytes"] == 0 and kinds["pointwise"]["flops"] == 0


def test_trace_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "tiny-gpt", "--dp-shard", "2", "--no-optimizer"]) == 0
    out = capsys.readouterr().out
    assert "Collectives per step" in out and "dp_shard" in out and "no unknown ops" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["trace", "gpt-9000"], "Unknown model preset 'gpt-9000'"),
        (["trace", "tiny-gpt", "--layout", "tp=0"], "layout entry 'tp=0' is not AXIS=DEGREE"),
        (["trace", "tiny-llama", "--ep", "2"], "topomesh: error: ep=2 needs a mixture-of-experts model; tiny-llama is dense."),
        (["trace", "tiny-moe", "--ep", "3"], "topomesh: error: ep=3 does not divide the 4 experts of tiny-moe."),
        (["trace", "tiny-llama", "--pp", "3"],
         "topomesh: error: pp=3 pipeline stages need at least as many layers; tiny-llama has 2."),
        (["trace", "tiny-gpt", "--tp", "2", "--mixed-precision"], "Mixed precision (param_dtype/reduce_dtype) is applied by FSDP2"),
        (["trace", "tiny-llama", "--cp", "3"], "Context parallel degree 3 needs a sequence length divisible by 2·3 = 6"),
    ],
)
def test_bad_input_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("topomesh: error:")


def test_trace_context_parallel(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "tiny-llama", "--cp", "2", "--dp-shard", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"] == {"dp_shard": 2, "cp": 2}
    axes = {c["mesh_axis"] for c in out["collectives"]}
    assert {"cp", "dp_shard+cp"} <= axes and not out["unknown_ops"]


def test_trace_mixed_precision(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "tiny-gpt", "--dp-shard", "2", "--mixed-precision", "--json"]) == 0
    mixed = json.loads(capsys.readouterr().out)
    assert main(["trace", "tiny-gpt", "--dp-shard", "2", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert mixed["mixed_precision"] and not plain["mixed_precision"]

    def rs(doc: dict) -> int:
        return next(c["bytes"] for c in doc["collectives"] if c["kind"] == "reduce_scatter")

    assert rs(mixed) == 2 * rs(plain)  # fp32 gradients instead of bf16
    assert main(["trace", "tiny-gpt", "--dp-shard", "2", "--mixed-precision"]) == 0
    assert "bfloat16 over float32 master weights" in " ".join(capsys.readouterr().out.split())


def test_layout_spec_equals_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "tiny-llama", "--layout", "tp=2", "--no-optimizer", "--json"]) == 0
    by_spec = json.loads(capsys.readouterr().out)
    assert main(["trace", "tiny-llama", "--tp", "2", "--no-optimizer", "--json"]) == 0
    by_flags = json.loads(capsys.readouterr().out)
    assert by_spec["layout"] == by_flags["layout"] == {"tp": 2}
    assert by_spec["collectives"] == by_flags["collectives"] and by_spec["flops"] == by_flags["flops"]
    assert main(["trace", "tiny-llama", "--tp", "2", "--layout", "tp=4"]) == 2
    assert "tp is 2 by its flag but 4 in --layout" in capsys.readouterr().err


def test_trace_gpu_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "tiny-llama", "--no-optimizer", "--json", "--gpu-kernels"]) == 0
    ops = json.loads(capsys.readouterr().out)["op_counts"]
    # 2 blocks of 2 norms and the final norm, one fused kernel each way; no CPU composite left
    assert ops["aten._fused_rms_norm.default"] == ops["aten._fused_rms_norm_backward.default"] == 5
    assert "aten.rsqrt.default" not in ops
    assert main(["trace", "tiny-llama", "--no-optimizer", "--json"]) == 0
    assert "aten._fused_rms_norm.default" not in json.loads(capsys.readouterr().out)["op_counts"]
