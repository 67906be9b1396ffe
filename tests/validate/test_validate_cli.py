"""``topomesh validate`` end to end on this machine: two layouts run for real and predicted.

The tight targets (mean |error| ≤ 2.5 %, max ≤ 6 %) live in the benchmark
(benchmarks/RESULTS.md); here the bound is wide enough that a loaded CI machine cannot trip
it: the CPU time a step costs within 50 % of the prediction (load makes a step wait for a
core, not cost more CPU), the wall time never much shorter than predicted, peak memory
within 50 %.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import matplotlib.image
import pytest

MODEL = {"name": "validate-test", "arch": "llama", "n_layers": 2, "hidden": 128, "n_heads": 4, "n_kv_heads": 2,
         "ffn_hidden": 352, "vocab_size": 512, "seq_len": 128}


@pytest.mark.slow
def test_validate_two_layouts(tmp_path):
    model = tmp_path / "model.json"
    model.write_text(json.dumps(MODEL))
    png = tmp_path / "v.png"
    (tmp_path / "cache").mkdir(mode=0o700)  # a fresh calibration: collectives and op table
    env = {**os.environ, "TOPOMESH_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "topomesh", "validate", "--model", str(model), "--layouts", "dp_shard=1",
         "--layouts", "dp_shard=2", "--steps", "4", "--repeats", "1", "--json", "--png", str(png)],
        env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert [r["layout"] for r in report["layouts"]] == ["dp_shard=1", "dp_shard=2"]
    assert report["global_batch"] == 4  # 2 x lcm(1, 2)
    # the calibration this run made priced it: named, minutes old at most
    prof = report["collective_profile"]
    assert prof["path"].startswith(str(tmp_path / "cache")) and 0 <= prof["age_h"] < 0.5
    for r in report["layouts"]:
        assert set(r) >= {"layout", "predicted_s", "measured_s", "error", "predicted_peak_bytes", "measured_peak_bytes"}
        assert r["error"] == pytest.approx((r["predicted_s"] - r["measured_s"]) / r["measured_s"])
        assert len(r["steps_s"]) == 4
        assert 0 <= r["core_wait_s"] <= r["measured_s"], r  # a part of the step, in seconds
        # the bound a loaded CI machine cannot trip: a shared runner doubled the CPU time of the
        # 2-rank steps (cpu_error -0.56 where an idle machine gives -0.08 to -0.21); a model off by
        # 5x still fails. The tight targets live in benchmarks/RESULTS.md. Upward too: one CI run
        # (2026-11-26 10:17) predicted the one process 58 % high, its in-step replay caught in a
        # slow spell the real run missed; it passed twice alone right after.
        assert -0.8 <= r["cpu_error"] <= 1.0, r
        assert r["predicted_s"] <= 2.0 * r["measured_s"], r
        # memory does not wait for a core: on an idle machine -2 % (one rank) and +7 to +10 %
        # (two); the bound leaves room for the measured peak's own spread
        assert abs(r["memory_error"]) <= 0.3, r
    errors = [abs(r["error"]) for r in report["layouts"]]
    assert report["mean_abs_error"] == pytest.approx(sum(errors) / 2)
    assert report["max_abs_error"] == pytest.approx(max(errors))
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 200 and image.shape[1] > 200


@pytest.mark.slow
def test_pipeline_stages_run_with_tensor_parallel(tmp_path):
    # pp x tp used to be refused after the calibration and tracing (the stages' outputs were
    # thought to be DTensors): the built-in plan hands plain local tensors between blocks, and
    # the last stage's vocab-sharded loss needs loss_parallel, without which it fails
    record = _one_real_step(tmp_path, {"pp": 2, "tp": 2})
    assert record["world_size"] == 4 and record["microbatches"] == 4 and len(record["step_s"]) == 1
    assert len(record["peak_bytes"]) == 4 and min(record["peak_bytes"]) > 0


@pytest.mark.slow
def test_fsdp_under_a_pipeline_gathers_each_unit_once_a_step(tmp_path):
    """pp=2 x dp_shard=2, 2 layers, global batch 4: 2 micro-batches a stage. Stage 0 holds
    two FSDP2 units (its block, and the root with the embeddings); the simulator gathers each
    once a step and reduces it once, as torchtitan runs FSDP under a pipeline. With FSDP's
    default resharding after forward, 1F1B's F0 F1 B0 B1 gathered at F0, F1 and B0: 6."""
    record = _one_real_step(tmp_path, {"pp": 2, "dp_shard": 2})
    assert record["microbatches"] == 2
    calls = record["collective_calls"]
    assert calls["c10d::_allgather_base_"] == 2
    assert calls["c10d::_reduce_scatter_base_"] == 2
    assert calls["c10d::send"] == 2  # one activation per micro-batch to stage 1


@pytest.mark.slow
def test_tensor_parallel_steps_take_their_loss_under_loss_parallel(tmp_path):
    # the vocab-sharded logits of a plain (no pipeline) step: without loss_parallel it fails
    record = _one_real_step(tmp_path, {"tp": 2})
    assert record["world_size"] == 2 and record["microbatches"] == 4 and len(record["step_s"]) == 1
    # one untimed step after the profiler's teardown, then the timed one (worker.SETTLE_STEPS)
    assert len(record["settle_s"]) == 1 and record["settle_s"][0] > 0


def _one_real_step(tmp_path, degrees: dict[str, int], **knobs) -> dict:
    """The validate worker's record of one measured step of ``degrees`` (tiny model, gloo);
    ``knobs``: more :class:`~topomesh.sim.simulate.Training` fields."""
    from topomesh.sim.simulate import Training
    from topomesh.validate.run import _knobs

    model = tmp_path / "model.json"
    model.write_text(json.dumps(MODEL))
    spec = {"model": str(model), "seq_len": None, "degrees": degrees, "threads": 1, "warmup": 2,
            "steps": 1, "training": _knobs(Training(global_batch=4, micro_batch=1, seq_len=128, **knobs))}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "out.json"
    world = math.prod(degrees.values())
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
         "--log-dir", str(tmp_path / "logs"),  # else torchrun leaves a torchelastic_* directory in /tmp
         "-m", "topomesh.validate.worker", "--spec", str(tmp_path / "spec.json"), "--out", str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("text", ["cp=2", "pp=2,cp=2", "dp_shard=2,cp=2"])
def test_context_parallel_is_refused_before_anything_runs(text):
    # a CPU run of ring attention stopped in its first forward ("shape '[1, 256, 1, 32]' is
    # invalid"), after the collective sweep and the in-step timing had run
    from topomesh.cli.validate import _layouts
    from topomesh.errors import LayoutError

    with pytest.raises(LayoutError, match=f"--layouts {text}: validate cannot run context parallel here"):
        _layouts([text])
    assert [text for text, _ in _layouts(["pp=2,tp=2", "ep=2"])] == ["pp=2,tp=2", "ep=2"]


@pytest.mark.slow
def test_recomputation_runs_in_a_pipeline_alone(tmp_path):
    # the worker parallelized only where a stage had an axis of its own besides pp, so a
    # pipeline alone ran without the recomputation the simulator priced:
    # benchmarks/validate_llama.json at pp=2 --recompute full measured 31.3 MB, as without it
    # (predicted 23.7)
    peaks = {}
    for mode in ("none", "full"):
        (tmp_path / mode).mkdir()
        peaks[mode] = max(_one_real_step(tmp_path / mode, {"pp": 2}, recompute=mode)["peak_bytes"])
    # a block keeps its input alone instead of every activation: per micro-batch in flight at
    # least its two bf16 feed-forward products (128 tokens x 352 x 2 bytes each), and more
    assert peaks["none"] - peaks["full"] >= 2 * 128 * 352 * 2, peaks
