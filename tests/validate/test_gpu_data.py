"""The one-GPU validation kept in the repo (benchmarks/data/gpu, made by
``bash benchmarks/gpu_validate.sh`` on an H200): its op table still prices the two steps as
``topomesh validate --device cuda`` priced them there, and its reports are whole."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from topomesh.cost.cluster import load_cluster
from topomesh.cost.opdb import OpProfileDB, host_fingerprint
from topomesh.layout.dims import Layout
from topomesh.sim.inputs import load_model
from topomesh.sim.schedules import Schedule
from topomesh.sim.simulate import Simulator, Training

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "benchmarks" / "data" / "gpu"
GPU = "NVIDIA H200"


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> dict:
    copy = tmp_path_factory.mktemp("gpu") / "ops.sqlite"  # the store writes a lock file beside the table
    shutil.copy(DATA / "h200_ops.sqlite", copy)
    with OpProfileDB(copy) as db:
        out = db.table(GPU)
        assert len(db.table(host_fingerprint(GPU))) > 0.9 * len(out)  # issue times beside the kernel times
    return out


@pytest.mark.parametrize(("model", "report", "micro"), [
    ("validate_gpu_llama.json", "validate_gpu.json", 2),
    ("validate_gpu_llama8b.json", "validate_gpu_8b.json", 1),
])
def test_the_kept_op_table_prices_the_step_as_it_was_priced_on_the_gpu(table, model, report, micro):
    rep = json.loads((DATA / report).read_text())
    (row,) = rep["layouts"]
    assert rep["device"] == GPU and rep["cluster"] == "dgx-h200" and row["layout"] == "dp_shard=1"
    assert row["error"] == pytest.approx(row["predicted_s"] / row["measured_s"] - 1)
    assert len(row["steps_s"]) == rep["steps"] * rep["repeats"]
    m = load_model(str(ROOT / "benchmarks" / model))
    training = Training(global_batch=rep["global_batch"], micro_batch=micro, seq_len=m.seq_len, dtype="bf16",
                        schedule=Schedule("1f1b"))
    sim = Simulator(model=m, cluster=load_cluster("dgx-h200", gpus=1), table=table)
    got = sim.simulate(Layout.from_degrees({"dp_shard": 1}), training)
    # traced here with this machine's torch, there with the GPU's: the same records, the same price
    assert got.step_time_s == pytest.approx(row["predicted_s"], rel=2e-3)
    assert got.peak_memory_bytes == pytest.approx(row["predicted_peak_bytes"], rel=2e-3)
