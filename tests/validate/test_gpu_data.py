"""The one-GPU validations kept in the repo (benchmarks/data/gpu, made by
``topomesh validate --device cuda`` on an H100 and an H200 as ``benchmarks/gpu_validate.sh``
runs it): each op table still prices its steps as they were priced on the GPU, and the
reports are whole."""

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
GPUS = {"h100": ("NVIDIA H100 80GB HBM3", "dgx-h100"), "h200": ("NVIDIA H200", "dgx-h200")}


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> dict[str, dict]:
    out = {}
    for gpu, (name, _) in GPUS.items():
        copy = tmp_path_factory.mktemp(gpu) / "ops.sqlite"  # the store writes a lock file beside the table
        shutil.copy(DATA / f"{gpu}_ops.sqlite", copy)
        with OpProfileDB(copy) as db:
            out[gpu] = db.table(name)
            assert len(db.table(host_fingerprint(name))) > 0.9 * len(out[gpu])  # issue times beside kernel times
    return out


@pytest.mark.parametrize("gpu", sorted(GPUS))
@pytest.mark.parametrize(("model", "report", "micro"), [
    ("validate_gpu_llama.json", "validate_gpu", 2),
    ("validate_gpu_llama8b.json", "validate_gpu_8b", 1),
])
def test_the_kept_op_table_prices_the_step_as_it_was_priced_on_the_gpu(tables, gpu, model, report, micro):
    name, preset = GPUS[gpu]
    rep = json.loads((DATA / f"{report}_{gpu}.json").read_text())
    (row,) = rep["layouts"]
    assert rep["device"] == name and rep["cluster"] == preset and row["layout"] == "dp_shard=1"
    assert row["error"] == pytest.approx(row["predicted_s"] / row["measured_s"] - 1)
    assert len(row["steps_s"]) == rep["steps"] * rep["repeats"]
    m = load_model(str(ROOT / "benchmarks" / model))
    training = Training(global_batch=rep["global_batch"], micro_batch=micro, seq_len=m.seq_len, dtype="bf16",
                        schedule=Schedule("1f1b"))
    sim = Simulator(model=m, cluster=load_cluster(preset, gpus=1), table=tables[gpu])
    got = sim.simulate(Layout.from_degrees({"dp_shard": 1}), training)
    # traced here with this machine's torch, there with the GPU's: the same records, the same price
    assert got.step_time_s == pytest.approx(row["predicted_s"], rel=2e-3)
    assert got.peak_memory_bytes == pytest.approx(row["predicted_peak_bytes"], rel=2e-3)
