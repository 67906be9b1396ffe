"""topomesh validate's pure parts: the report, the peak-memory window, the shared global
batch, and the pipeline stage model the real runs train."""

from __future__ import annotations

import argparse
import dataclasses
import json
from functools import partial
from pathlib import Path

import pytest
import torch

from topomesh.cli.validate import _global_batch, _layouts
from topomesh.errors import CalibrationError, LayoutError
from topomesh.models.presets import get_preset
from topomesh.models.transformer import Transformer
from topomesh.sim.result import StepBreakdown
from topomesh.validate.run import LayoutResult, ValidateError, compare, layout_result
from topomesh.validate.worker import (
    StageModel,
    allocation_records,
    close_collective_blocks,
    collective_deadline,
    peak_in_window,
)


def _r(name: str, pred: float, meas: float, pmem: int = 100, mmem: int = 100) -> LayoutResult:
    return LayoutResult(layout=name, predicted_s=pred, measured_s=meas, predicted_peak_bytes=pmem,
                        measured_peak_bytes=mmem)


def test_compare_errors_by_hand():
    # errors: (0.9-1.0)/1.0 = -10 %, (0.55-0.5)/0.5 = +10 %, (2.4-2.0)/2.0 = +20 %
    out = compare([_r("a", 0.9, 1.0, 110, 100), _r("b", 0.55, 0.5), _r("c", 2.4, 2.0, 75, 100)])
    assert [round(x["error"], 9) for x in out["layouts"]] == [-0.1, 0.1, 0.2]
    assert out["mean_abs_error"] == pytest.approx(0.4 / 3)
    assert out["max_abs_error"] == pytest.approx(0.2)
    assert out["fastest_predicted"] == out["fastest_measured"] == "b" and out["fastest_correct"] is True
    assert out["max_abs_memory_error"] == pytest.approx(0.25)  # c: 75 predicted of 100 measured


def test_compare_flags_a_wrong_fastest():
    # predicted a (0.4) fastest, measured b (0.45 < 0.5)
    out = compare([_r("a", 0.4, 0.5), _r("b", 0.6, 0.45)])
    assert (out["fastest_predicted"], out["fastest_measured"], out["fastest_correct"]) == ("a", "b", False)


def test_step_spread_is_the_interquartile_range_over_the_median(capsys, monkeypatch):
    # eight steps 100..170 ms by 10: inclusive quartiles at positions 1.75 and 5.25 of the
    # sorted steps, 117.5 and 152.5 ms; median 135 ms: (152.5 - 117.5) / 135
    steps = tuple(x / 1000 for x in (170, 100, 160, 110, 150, 120, 140, 130))
    r = dataclasses.replace(_r("a", 0.13, 0.135), steps_s=steps)
    assert r.spread == pytest.approx(35 / 135)
    assert _r("b", 1.0, 1.0).spread is None  # no steps kept
    out = compare([r])
    assert out["layouts"][0]["measured_spread"] == pytest.approx(35 / 135)
    from topomesh.cli.validate import _print

    monkeypatch.setenv("COLUMNS", "200")  # every column of the table on one line
    _print({**out, "model": "m", "global_batch": 4, "threads": 1})
    assert "25.9%" in capsys.readouterr().out  # the table's step IQR column


def test_compare_needs_a_layout():
    with pytest.raises(LayoutError, match="at least one layout"):
        compare([])


def test_peak_in_window_counts_what_is_live_when_it_opens():
    # 100 B live before the window; inside: +50 (150), -50 (100), +20 (120); after it: +500
    recs = [(20, 500, 5), (7, 20, 4), (1, 100, 1), (6, -50, 2), (5, 50, 2)]  # any order
    assert peak_in_window(recs, 4, 10) == 150
    # a window after the free: live 100+50-50 = 100, then +20 -> 120
    assert peak_in_window(recs, 7, 10) == 120
    # a window ending before the +20: 100 live all along
    assert peak_in_window(recs, 6.5, 6.9) == 100
    # no record inside the window: what is live then
    assert peak_in_window([(1, 100, 1), (2, -30, None)], 5, 9) == 70
    # only frees inside the window: the peak is what was live when it opened
    assert peak_in_window([(1, 100, 1), (5, -50, None), (6, -20, None)], 4, 10) == 100


def test_peak_in_window_drops_a_block_freed_where_the_profiler_did_not_look():
    """A free on a thread the profiler does not follow is not recorded (seen with a Python
    thread); malloc giving the address out again proves the block was freed before."""
    recs = [(1, 100, 0xA0), (2, 40, 0xB0), (3, 60, 0xA0), (6, 10, 0xC0), (7, -40, 0xB0)]
    # 0xA0's first 100 B were freed unseen before t=3: live 100+40 -> 40+60 = 100, then +10
    assert peak_in_window(recs, 4, 10) == 110
    # without addresses every record is believed: 100+40+60+10 = 210
    assert peak_in_window([(t, b, None) for t, b, _ in recs], 4, 10) == 210


def test_collective_deadline_is_the_wait_that_ends_the_collective():
    waits = [7, 12, 20]  # ends of the thread's wait_tensor events
    # a functional collective ending at 9 is waited for by the wait ending at 12, not 7
    fn = [("aten::empty", 5), ("_c10d_functional::all_gather_into_tensor", 9), ("Redistribute", 30)]
    assert collective_deadline(fn, waits) == 12
    # gloo's copy inside the c10d call a functional reduce-scatter makes: still the wait
    rs = [("aten::clone", 4), ("c10d::reduce_scatter_tensor_coalesced_", 8),
          ("_c10d_functional::reduce_scatter_tensor", 13)]
    assert collective_deadline(rs, waits) == 20
    # a plain c10d call (FSDP2's reduce-scatter, async_op=False) is over when it returns
    assert collective_deadline([("aten::clone", 5), ("c10d::_reduce_scatter_base_", 8),
                                ("FSDP::post_backward_reduce", 30)], waits) == 8
    # nothing waited for after the call, or no collective at all: no deadline
    assert collective_deadline(fn, [7]) is None
    assert collective_deadline([("aten::mm", 5), ("aten::linear", 6)], waits) is None


def test_close_collective_blocks_frees_what_gloo_freed_unseen():
    # a 64 B block at 0xA allocated at 1 by a collective done at 5; 32 B at 0xB elsewhere
    recs = [(1, 64, 0xA), (2, 32, 0xB), (9, 16, 0xA)]
    closed = close_collective_blocks(recs, {0: 5})
    assert closed == [(1, 64, 0xA), (2, 32, 0xB), (5, -64, 0xA), (9, 16, 0xA)]
    # the window 6..10 sees 32 live, then +16: 48 (the address rule alone would also drop the
    # 64 B at 9, but counts it live at 6..9: 96)
    assert peak_in_window(closed, 6, 10) == 48
    assert peak_in_window(recs, 6, 10) == 96
    # freed where the profiler looks, after the deadline: nothing added (no double free)
    assert close_collective_blocks([(1, 64, 0xA), (8, -64, 0xA)], {0: 5}) == [(1, 64, 0xA), (8, -64, 0xA)]
    # its address handed out again before the deadline: the address rule already dropped it
    assert close_collective_blocks([(1, 64, 0xA), (3, 8, 0xA)], {0: 5}) == [(1, 64, 0xA), (3, 8, 0xA)]
    # never seen again: freed at the deadline
    assert close_collective_blocks([(1, 64, 0xA)], {0: 5}) == [(1, 64, 0xA), (5, -64, 0xA)]


def test_allocation_records_free_a_collectives_block_at_its_wait():
    """The profiler's event tree, faked: a functional all-gather (10..20) on thread 1 allocates
    100 B at 0xA that gloo frees on its own thread (no record); thread 1 waits 25..40, then
    allocates 50 B. The block is free once the wait ends, so the step's peak is 100, not 150."""
    from types import SimpleNamespace as NS

    from torch._C._profiler import _EventType

    def ev(name, start, end, children=(), tag=None, fields=None):
        e = NS(name=name, start_time_ns=start, end_time_ns=end, children=list(children), tag=tag,
               extra_fields=fields, start_tid=1, parent=None)
        for c in e.children:
            c.parent = e
        return e

    alloc = ev("[memory]", 12, 12, tag=_EventType.Allocation, fields=NS(alloc_size=100, ptr=0xA))
    later = ev("[memory]", 45, 45, tag=_EventType.Allocation, fields=NS(alloc_size=50, ptr=0xB))
    gather = ev("_c10d_functional::all_gather_into_tensor", 10, 20, [ev("aten::empty", 11, 13, [alloc])])
    step = ev("topomesh_validate_step", 5, 100, [gather, ev("_c10d_functional::wait_tensor", 25, 40), later])
    prof = NS(profiler=NS(kineto_results=NS(experimental_event_tree=lambda: [step])))
    records, windows = allocation_records(prof)
    assert windows == [(5, 100)]
    assert sorted(records) == [(12, 100, 0xA), (40, -100, 0xA), (45, 50, 0xB)]
    assert peak_in_window(records, *windows[0]) == 100


def test_allocation_records_see_the_profilers_addresses():
    import threading

    from torch.profiler import ProfilerActivity, profile, record_function

    box = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        box.append(torch.empty(1 << 16, dtype=torch.uint8))
        freer = threading.Thread(target=box.clear)  # freed where the profiler does not look
        freer.start()
        freer.join()
        with record_function("topomesh_validate_step"):
            x = torch.empty(1 << 16, dtype=torch.uint8)
            del x
    allocs, windows = allocation_records(prof)
    assert len(windows) == 1 and windows[0][0] < windows[0][1]
    sizes = sorted(b for _, b, _ in allocs)
    assert sizes == [-(1 << 16), 1 << 16, 1 << 16]  # the other thread's free is missing
    assert all(isinstance(a, int) and a > 0 for _, _, a in allocs)
    assert peak_in_window(allocs, *windows[0]) <= 2 << 16


def test_layout_result_takes_the_median_and_the_largest_rank():
    class _P:
        step_time_s, peak_memory_bytes = 0.13, 1000
        breakdown = StepBreakdown(compute_s=0.1, exposed_comm_s={"dp_shard": 0.02}, bubble_s=0.0, optimizer_s=0.01,
                                  p2p_s=0.0)

    rec = {"step_s": [0.2, 0.1, 0.5, 0.12, 0.11], "cpu_s": [0.1, 0.09, 0.3, 0.1, 0.08], "peak_bytes": [900, 1250],
           "world_size": 2, "microbatches": 2, "loadavg_before": [1.5, 1, 1], "loadavg_after": [2.5, 1, 1],
           "page_faults": [7, 0, 900, 3, 5], "core_wait_s": [0.004, 0.0, 0.002, 0.03, 0.001]}
    r = layout_result("dp_shard=2", _P(), rec)
    assert (r.measured_s, r.measured_cpu_s, r.measured_peak_bytes) == (0.12, 0.1, 1250)
    assert r.page_faults == 5 and r.to_dict()["page_faults"] == 5
    assert r.core_wait_s == 0.002 and r.to_dict()["core_wait_s"] == 0.002
    assert r.error == pytest.approx((0.13 - 0.12) / 0.12) and r.memory_error == pytest.approx(-250 / 1250)
    assert r.loadavg == (1.5, 2.5)


def test_one_global_batch_for_every_layout():
    def gb(specs, micro=1, given=None):
        return _global_batch(argparse.Namespace(global_batch=given, micro_batch=micro), _layouts(specs))

    # data-parallel degrees 1, 2, 2, 1, 1, 2: lcm 2, twice that
    assert gb(["dp_shard=1", "dp_replicate=2", "dp_shard=2", "tp=2", "pp=2", "tp=2,dp_shard=2"]) == 4
    assert gb(["dp_shard=3", "dp_replicate=2,dp_shard=2"], micro=2) == 2 * 2 * 12  # lcm(3, 4) = 12
    assert gb(["dp_shard=2"], given=6) == 6


def test_pipeline_stages_compose_to_the_whole_model():
    cfg = dataclasses.replace(get_preset("tiny-llama"), n_layers=3)
    torch.manual_seed(0)
    full = Transformer(cfg)
    first = StageModel(cfg, 2, first=True, last=False)
    last = StageModel(cfg, 1, first=False, last=True)
    assert first.output is None and last.tok_embeddings is None
    first.tok_embeddings.load_state_dict(full.tok_embeddings.state_dict())
    for i in range(2):
        first.layers[str(i)].load_state_dict(full.layers[str(i)].state_dict())
    last.layers["0"].load_state_dict(full.layers["2"].state_dict())
    last.norm.load_state_dict(full.norm.state_dict())
    last.output.load_state_dict(full.output.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    hidden = first(tokens)
    assert hidden.shape == (2, cfg.seq_len, cfg.hidden)
    torch.testing.assert_close(last(hidden), full(tokens))


def test_real_runs_keep_freed_memory_for_the_next_step(monkeypatch, tmp_path):
    """The worker processes get glibc settings that reuse freed memory (no page faults per step)
    and one thread per library."""
    import subprocess

    from topomesh.layout.api import resolve_layout
    from topomesh.sim.simulate import Training
    from topomesh.validate import run as vrun

    seen = {}

    def fake_run(cmd, env, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.update(env)
        out = cmd[cmd.index("--out") + 1]
        Path(out).write_text("{}")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(vrun.subprocess, "run", fake_run)
    vrun.measure("tiny-llama", None, resolve_layout({"dp_shard": 2}, 2), Training(global_batch=4), steps=1, warmup=2,
                 threads=1)
    assert seen["MALLOC_MMAP_THRESHOLD_"] == str(32 * 2**20) and int(seen["MALLOC_TRIM_THRESHOLD_"]) >= 2**32
    assert seen["OMP_NUM_THREADS"] == "1"


def test_in_step_tables_replay_in_a_child_like_the_real_runs(monkeypatch, tmp_path, capsys):
    """The replay runs in a child with the real runs' malloc and thread settings; a
    context-parallel layout is not sent (its trace patches attention), the others come back
    by their text."""
    import subprocess

    from topomesh.layout.api import resolve_layout
    from topomesh.sim.simulate import Training
    from topomesh.validate import run as vrun

    seen: dict = {}
    key = ["aten.mm.default", "[[2,3],[3,2]]", '["float32","float32"]', "[[3,1],[2,1]]", "[]"]

    def fake_run(cmd, env, **kw):  # noqa: ANN001, ANN003, ANN202
        seen["env"] = env
        spec = json.loads(Path(cmd[cmd.index("--spec") + 1]).read_text())
        seen["spec"] = spec
        out = {item["text"]: {"ops": [[key, 0.002]], "host_fb_s": 0.03} for item in spec["layouts"]}
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps(out))
        return subprocess.CompletedProcess(cmd, 0, "", "USDT noise\ntopomesh: {'tp': 2}: a fallback taken\n")

    monkeypatch.setattr(vrun.subprocess, "run", fake_run)
    from topomesh.cost.instep import InStep

    layouts = [("tp=2", resolve_layout({"tp": 2}, 2)), ("cp=2", resolve_layout({"cp": 2}, 2))]
    got = vrun.in_step_tables("tiny-llama", None, layouts, Training(global_batch=4), threads=1)
    assert got == {"tp=2": InStep({tuple(key): 0.002}, 0.03)}
    err = capsys.readouterr().err
    assert "topomesh: {'tp': 2}: a fallback taken" in err and "USDT" not in err  # the child's word passed on
    assert [i["text"] for i in seen["spec"]["layouts"]] == ["tp=2"] and seen["spec"]["layouts"][0]["degrees"]["tp"] == 2
    assert seen["env"]["MALLOC_MMAP_THRESHOLD_"] == str(32 * 2**20) and seen["env"]["OMP_NUM_THREADS"] == "1"
    assert vrun.in_step_tables("tiny-llama", None, layouts[1:], Training(global_batch=4), threads=1) == {}


def test_in_step_tables_replay_one_process_after_another_and_average_them(monkeypatch):
    """``replays`` children one after another, never two at once, their figures averaged: op
    times 1 and 3 ms -> 2 ms; host work 10 and 30 -> 20 ms. With ``copies`` too, every child of
    every round counts: 2 x 2 children of 1, 3, 5, 7 ms -> 4 ms."""
    import subprocess
    import threading

    from topomesh.layout.api import resolve_layout
    from topomesh.sim.simulate import Training
    from topomesh.validate import run as vrun

    key = ["aten.mm.default", "[[2,3],[3,2]]", '["float32","float32"]', "[[3,1],[2,1]]", "[]"]
    values = iter([0.001, 0.003, 0.001, 0.003, 0.005, 0.007])
    running, most = [0], [0]
    lock = threading.Lock()

    def fake_run(cmd, env, **kw):  # noqa: ANN001, ANN003, ANN202
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            v = next(values)
        out = {"pp=2": {"ops": [[key, v]], "host_fb_s": 10 * v}}
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps(out))
        with lock:
            running[0] -= 1
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(vrun.subprocess, "run", fake_run)
    layouts = [("pp=2", resolve_layout({"pp": 2}, 2))]
    got = vrun.in_step_tables("tiny-llama", None, layouts, Training(global_batch=4), threads=1, replays=2)
    assert got["pp=2"].table == {tuple(key): pytest.approx(0.002)}
    assert got["pp=2"].host_fb_s == pytest.approx(0.02)
    assert most[0] == 1
    got = vrun.in_step_tables("tiny-llama", None, layouts, Training(global_batch=4), threads=1, replays=2, copies=2)
    assert got["pp=2"].table == {tuple(key): pytest.approx(0.004)}


def test_in_step_tables_replay_several_copies_at_once_and_average_them(monkeypatch):
    """``copies`` children run at the same time (each waits at a barrier for the others) and
    their figures are averaged: op times 1, 2 and 6 ms -> 3 ms; host work 10, 20, 60 -> 30 ms."""
    import subprocess
    import threading

    from topomesh.cost.instep import InStep
    from topomesh.layout.api import resolve_layout
    from topomesh.sim.simulate import Training
    from topomesh.validate import run as vrun

    key = ["aten.mm.default", "[[2,3],[3,2]]", '["float32","float32"]', "[[3,1],[2,1]]", "[]"]
    together = threading.Barrier(3, timeout=30)
    values = iter([0.001, 0.002, 0.006])
    lock = threading.Lock()

    def fake_run(cmd, env, **kw):  # noqa: ANN001, ANN003, ANN202
        together.wait()  # raises unless all three children are running at once
        with lock:
            v = next(values)
        out = {"tp=2,dp_shard=2": {"ops": [[key, v]], "host_fb_s": 10 * v}}
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps(out))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(vrun.subprocess, "run", fake_run)
    layouts = [("tp=2,dp_shard=2", resolve_layout({"tp": 2, "dp_shard": 2}, 4))]
    got = vrun.in_step_tables("tiny-llama", None, layouts, Training(global_batch=4), threads=1, copies=3)
    assert got["tp=2,dp_shard=2"].table == {tuple(key): pytest.approx(0.003)}
    assert got["tp=2,dp_shard=2"].host_fb_s == pytest.approx(0.03)
    assert isinstance(got["tp=2,dp_shard=2"], InStep)


def test_pipeline_runs_keep_no_outputs(monkeypatch):
    """torch's schedules keep every micro-batch's output on the last stage unless told not to
    (4.2 MB at its peak for benchmarks/validate_llama.json); the worker trains, so it does not."""
    import torch.distributed.pipelining as pipelining
    import torch.distributed.pipelining.schedules as schedules

    from topomesh.sim.simulate import Training
    from topomesh.validate import worker

    calls = []

    class FakeSchedule:
        def __init__(self, stage, n_microbatches, loss_fn):  # noqa: ANN001
            pass

        def step(self, *args, **kwargs):  # noqa: ANN002, ANN003
            calls.append(kwargs)

    monkeypatch.setattr(pipelining, "PipelineStage", lambda *a, **k: object())
    monkeypatch.setattr(schedules, "get_schedule_class", lambda name: FakeSchedule)
    step = worker._pipeline_step([torch.nn.Linear(2, 2)], [1], 2, _FakeMesh(), 4, Training(global_batch=4))
    step(torch.zeros(4, 2, dtype=torch.long))
    assert calls and calls[0]["return_outputs"] is False and calls[0]["target"] is not None


class _FakeMesh:
    def get_group(self, name):  # noqa: ANN001
        return None


@pytest.mark.parametrize("schedule, stages, n_stages, named, first, last", [
    ("1f1b", [1], 2, "1F1B", False, True),
    ("interleaved-1f1b", [0, 2], 4, "Interleaved1F1B", True, False),  # looped: rank 0 of pp=2, interleave 2
    ("zbv", [1, 2], 4, "ZBVZeroBubble", False, False),  # V: rank 1 of pp=2 holds stages 1 and 2
    ("zbv", [0, 3], 4, "ZBVZeroBubble", True, True),  # rank 0: the first stage and the last
])
def test_a_pipeline_rank_runs_every_stage_it_holds(monkeypatch, schedule, stages, n_stages, named, first, last):
    """Multi-stage schedules get this rank's stages as a list, in order, each a PipelineStage
    of its global index; the rank feeds tokens where it holds stage 0 and targets where it
    holds the last."""
    import torch.distributed.pipelining as pipelining
    import torch.distributed.pipelining.schedules as schedules

    from topomesh.sim.schedules import Schedule
    from topomesh.sim.simulate import Training
    from topomesh.validate import worker

    made, got = [], {}

    class FakeSchedule:
        def __init__(self, stage, n_microbatches, loss_fn):  # noqa: ANN001
            got["stage"], got["n"] = stage, n_microbatches

        def step(self, *args, **kwargs):  # noqa: ANN002, ANN003
            got["args"], got["target"] = args, kwargs["target"]

    def fake_stage(module, index, n, device, group):  # noqa: ANN001, ANN202
        made.append((index, n))
        return f"stage{index}"

    monkeypatch.setattr(pipelining, "PipelineStage", fake_stage)
    monkeypatch.setattr(schedules, "get_schedule_class", lambda name: got.setdefault("class", name) and FakeSchedule)
    training = Training(global_batch=4, schedule=Schedule(schedule), interleave=2 if schedule.startswith("inter") else 1)
    step = worker._pipeline_step([torch.nn.Linear(2, 2) for _ in stages], stages, n_stages, _FakeMesh(), 4, training)
    step(torch.zeros(4, 2, dtype=torch.long))
    assert made == [(s, n_stages) for s in stages] and got["class"] == named and got["n"] == 4
    multi = Schedule(schedule).multi_stage
    assert got["stage"] == ([f"stage{s}" for s in stages] if multi else f"stage{stages[0]}")
    assert (len(got["args"]) == 1) == first and (got["target"] is not None) == last


def test_a_failed_child_is_one_error_naming_what_and_its_cause(monkeypatch):
    import subprocess

    from topomesh.layout.api import resolve_layout
    from topomesh.sim.simulate import Training
    from topomesh.validate import run as vrun

    def fake_run(cmd, env, **kw):  # noqa: ANN001, ANN003, ANN202
        return subprocess.CompletedProcess(cmd, 1, "", "USDT noise\nRuntimeError: boom\nlast words\n")

    monkeypatch.setattr(vrun.subprocess, "run", fake_run)
    with pytest.raises(vrun.ValidateError, match=r"real run of layout .* failed \(exit 1\): RuntimeError: boom"):
        vrun.measure("tiny-llama", None, resolve_layout({"dp_shard": 2}, 2), Training(global_batch=4), steps=1,
                     warmup=2, threads=1)
    with pytest.raises(vrun.ValidateError, match=r"ops in their steps failed \(exit 1\).*last words"):
        vrun.in_step_tables("tiny-llama", None, [("tp=2", resolve_layout({"tp": 2}, 2))], Training(global_batch=4),
                            threads=1)


def test_a_shared_cache_directory_is_named_before_any_calibration_starts(tmp_path, monkeypatch):
    # it used to be swallowed as "no profile", then a calibration child died with "rank 0 exited with 2"
    from topomesh.errors import CalibrationError
    from topomesh.validate import run

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    (shared / "collectives").mkdir(mode=0o700)
    (shared / "collectives").chmod(0o770)
    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(shared))
    from topomesh.cost import calibrate

    def spawn(*_a, **_k):
        raise AssertionError("a calibration started")

    monkeypatch.setattr(calibrate, "spawn_local", spawn)
    with pytest.raises(CalibrationError, match=f"'{shared / 'collectives'}' has mode 0770"):
        run.ensure_collectives(2, timeout_s=5)


FREE = [[0, 1]] * 4  # 4 ranks each free to run on both CPUs, as the real runs' ranks are
ALL = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"]
STRETCH = {"2": 1.1, "4": 1.9}


SEG = {"compute_segment": 4, "pipeline_action_s": {"single": 1e-4, "multi": 2e-4, "handoff_wait": 2e-3}}


@pytest.mark.parametrize("meta, again", [
    ({"world_size": 4, "statistic": "mean", "compute_stretch": STRETCH, "rank_cpus": FREE, "collectives": ALL, **SEG},
     False),
    ({"world_size": 4, "statistic": "mean", "compute_stretch": STRETCH, "collectives": ALL, **SEG},
     False),  # before rank_cpus
    ({"world_size": 4, "statistic": "mean", "compute_stretch": STRETCH, "rank_cpus": FREE, "collectives": ALL,
      "compute_segment": 4, "pipeline_action_s": {"single": 1e-4, "multi": 2e-4}}, True),  # before the hand-off
    ({"world_size": 4, "statistic": "mean", "compute_stretch": STRETCH, "rank_cpus": FREE, "collectives": ALL,
      "compute_segment": 4, "pipeline_action_s": {"single": 1e-4, "multi": 2e-4, "handoff": 2e-3}},
     True),  # the hand-off as the step's slope (ddb19bc-b88b3b0)
    ({"world_size": 4, "statistic": "mean", "compute_stretch": STRETCH, "rank_cpus": FREE, "collectives": ALL},
     True),  # stretch and in-step costs timed on the chain that ran on subnormals
    ({"world_size": 4, "statistic": "mean", "compute_stretch": STRETCH, "rank_cpus": FREE, "collectives": ALL,
      "compute_segment": 2}, True),  # each rank of the stretch timed from its own start
    ({"world_size": 4, "statistic": "mean", "compute_stretch": STRETCH, "rank_cpus": FREE, "collectives": ALL,
      "compute_segment": 3}, True),  # in-step costs with the first rank's wait in them
    ({"world_size": 4, "statistic": "mean", "compute_stretch": {"2": 1.1}, "rank_cpus": FREE, "collectives": ALL},
     True),  # no stretch for 4 ranks
    ({"world_size": 4, "statistic": "mean", "rank_cpus": FREE, "collectives": ALL}, True),  # before the stretch
    ({"world_size": 2, "statistic": "mean", "compute_stretch": STRETCH, "rank_cpus": FREE[:2], "collectives": ALL},
     True),
    ({"world_size": 4, "statistic": "median", "compute_stretch": STRETCH, "rank_cpus": FREE, "collectives": ALL}, True),
    ({"world_size": 4, "statistic": "mean", "compute_stretch": STRETCH, "rank_cpus": [[0], [1], [0], [1]],
      "collectives": ALL}, True),  # ranks bound one CPU each
    ({"world_size": 4, "statistic": "mean", "compute_stretch": STRETCH, "rank_cpus": FREE,
      "collectives": [c for c in ALL if c != "all_to_all"]}, True),  # cp and ep layouts could not be priced
    ({"world_size": 4, "statistic": "mean", "compute_stretch": STRETCH, "rank_cpus": FREE}, True),  # no list
])
def test_a_profile_without_what_the_layouts_need_is_calibrated_again(tmp_path, monkeypatch, meta, again):
    from types import SimpleNamespace

    from topomesh.cost import calibrate, cluster
    from topomesh.validate import run

    monkeypatch.setattr("topomesh.topology.discover.allowed_cpus", lambda: [0, 1])
    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(tmp_path))
    saved = tmp_path / "saved.json"
    monkeypatch.setattr(cluster, "local_profile", lambda: (SimpleNamespace(meta=meta), saved))
    spawned = []

    def spawn(n, argv, timeout_s):
        spawned.append(n)
        return {"profile": str(tmp_path / "new.json")}

    monkeypatch.setattr(calibrate, "spawn_local", spawn)
    got = run.ensure_collectives(4)
    assert (got, spawned) == ((tmp_path / "new.json", [4]) if again else (saved, []))


class _Prediction:
    def __init__(self, step: float, peak: int = 10):
        self.step_time_s, self.peak_memory_bytes = step, peak
        self.breakdown = StepBreakdown(compute_s=0.1, exposed_comm_s={}, bubble_s=0.0, optimizer_s=0.01, p2p_s=0.0)


def _record(steps: list[float], peak: int, load: float) -> dict:
    return {"step_s": steps, "cpu_s": [s / 2 for s in steps], "page_faults": [1] * len(steps), "peak_bytes": [peak, 1],
            "world_size": 2, "microbatches": 1, "loadavg_before": [load, 0, 0], "loadavg_after": [load + 1, 0, 0]}


def test_repeated_runs_pool_every_step_and_take_the_middle_prediction():
    from topomesh.validate.run import pooled_result

    passes = [(_Prediction(1.0), _record([2.0, 4.0], 7, 0.5)), (_Prediction(3.0), _record([3.0, 9.0, 1.0], 9, 1.5)),
              (_Prediction(2.0), _record([5.0], 8, 2.5))]
    r = pooled_result("tp=2", passes)
    # steps 2, 4, 3, 9, 1, 5 -> sorted 1 2 3 4 5 9: median (3 + 4) / 2; predictions 1, 3, 2 -> 2
    assert (r.measured_s, r.predicted_s) == (3.5, 2.0)
    assert r.measured_cpu_s == 1.75 and r.measured_peak_bytes == 8  # CPU halves; peaks 7, 9, 8: the middle one
    assert r.runs_s == (3.0, 3.0, 5.0) and r.predicted_runs_s == (1.0, 3.0, 2.0)  # each run's own median
    assert r.steps_s == (2.0, 4.0, 3.0, 9.0, 1.0, 5.0) and r.loadavg == (0.5, 1.5, 1.5, 2.5, 2.5, 3.5)
    d = r.to_dict()
    assert d["measured_runs_s"] == [3.0, 3.0, 5.0] and d["predicted_runs_s"] == [1.0, 3.0, 2.0]
    # an even count takes the median as the steps do: 1, 3 -> 2; the breakdown is the lower one's
    two = pooled_result("tp=2", passes[:2])
    assert two.predicted_s == 2.0 and two.breakdown == passes[0][0].breakdown.to_dict()
    one = pooled_result("tp=2", passes[2:])
    assert (one.measured_s, one.predicted_s, one.runs_s) == (5.0, 2.0, (5.0,))
    with pytest.raises(ValidateError, match="layout tp=2 has no real run"):
        pooled_result("tp=2", [])
    with pytest.raises(ValidateError, match="a real run of layout tp=2 timed no steps"):
        pooled_result("tp=2", [passes[0], (_Prediction(1.0), _record([], 7, 0.5))])


def test_repeats_run_the_layouts_in_turn_and_pool_them(monkeypatch, capsys, tmp_path):
    """The CLI with its calibration, tracing and real runs faked: the layouts are taken in
    turn, each run after its own prediction, and the report pools them."""
    from types import SimpleNamespace

    from topomesh.cli import validate as cli
    from topomesh.cost import cluster
    from topomesh.sim import simulate
    from topomesh.validate import run as vrun

    order: list[str] = []
    steps = {"dp_shard=1": iter([[1.0, 1.2], [1.4, 1.6]]), "tp=2": iter([[2.0], [3.0]])}
    predictions = iter([1.1, 2.4, 1.3, 2.6])

    class FakeSim:
        def __init__(self, *, model, cluster, cache, table=None):  # noqa: ANN001
            self.cluster = cluster

        def trace(self, layout, training):  # noqa: ANN001, ANN202
            return SimpleNamespace(traced_layers=99, events=list, segments=(), dtype="float32")

        def simulate(self, layout, training):  # noqa: ANN001, ANN202
            return _Prediction(next(predictions))

    def measure(model, seq_len, layout, training, **kw):  # noqa: ANN001, ANN003, ANN202
        text = "tp=2" if layout.world_size == 2 else "dp_shard=1"
        order.append(text)
        return _record(next(steps[text]), 5, 0.0)

    monkeypatch.setattr(simulate, "Simulator", FakeSim)
    monkeypatch.setattr(cluster, "local_cluster", lambda gpus: None)
    saved = _profile_file(tmp_path / "profile.json", {"measured_at": "2026-11-26T05:55:03Z"})
    monkeypatch.setattr(vrun, "ensure_collectives", lambda world: order.append(f"reuse {world}") or saved)
    monkeypatch.setattr(vrun, "pooled_collectives", lambda world: order.append(f"sweep {world}") or saved)
    monkeypatch.setattr(vrun, "ensure_ops", lambda records, progress=None, **kw: {})
    monkeypatch.setattr(vrun, "measure", measure)
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args_text = ["--model", "tiny-llama", "--layouts", "dp_shard=1", "--layouts", "tp=2", "--repeats", "2",
                 "--no-in-step", "--json"]
    args = p.parse_args(args_text)
    assert cli.run(args) == 0
    # one more collective sweep (of the largest world) before each pass's runs
    assert order == ["sweep 2", "dp_shard=1", "tp=2", "sweep 2", "dp_shard=1", "tp=2"]
    report = json.loads(capsys.readouterr().out)
    assert report["repeats"] == 2 and report["replays"] == 0  # --no-in-step: nothing replayed
    one, two = report["layouts"]
    assert one["measured_s"] == pytest.approx(1.3) and one["measured_runs_s"] == pytest.approx([1.1, 1.5])
    assert one["predicted_runs_s"] == [1.1, 1.3] and one["predicted_s"] == pytest.approx(1.2)  # the median of two
    assert two["measured_s"] == 2.5 and two["predicted_s"] == pytest.approx(2.5)  # 2.4, 2.6
    assert report["collective_profile"]["path"] == str(saved)  # the profile that priced the run
    assert report["collective_profile"]["measured_at"] == "2026-11-26T05:55:03Z"
    monkeypatch.setenv("COLUMNS", "250")  # every column of the table on one line
    cli._print(report)
    shown = capsys.readouterr().out
    assert "1100/1500" in shown  # each run's median, in the order run
    assert "calibrated 2026-11-26T05:55:03Z" in shown
    order.clear()
    steps = {"dp_shard=1": iter([[1.0], [1.0]]), "tp=2": iter([[2.0], [2.0]])}
    predictions = iter([1.1, 2.4, 1.3, 2.6])
    assert cli.run(p.parse_args([*args_text, "--no-sweep-each-pass"])) == 0
    assert order == ["reuse 2", "dp_shard=1", "tp=2", "dp_shard=1", "tp=2"]  # the saved profile, once
    assert json.loads(capsys.readouterr().out)["failed_sweeps"] == []
    # a sweep that dies (a rank killed by a signal) costs no pass: the saved profile prices it
    order.clear()
    steps = {"dp_shard=1": iter([[1.0], [1.0]]), "tp=2": iter([[2.0], [2.0]])}
    predictions = iter([1.1, 2.4, 1.3, 2.6])
    sweeps = iter([saved, CalibrationError("local calibration failed: rank 1 was killed by SIGABRT.")])

    def sweep(world):  # noqa: ANN001, ANN202
        order.append(f"sweep {world}")
        got = next(sweeps)
        if isinstance(got, Exception):
            raise got
        return got

    monkeypatch.setattr(vrun, "pooled_collectives", sweep)
    assert cli.run(p.parse_args(args_text)) == 0
    assert order == ["sweep 2", "dp_shard=1", "tp=2", "sweep 2", "reuse 2", "dp_shard=1", "tp=2"]
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["failed_sweeps"] == ["run 2/2: local calibration failed: rank 1 was killed by SIGABRT."]
    assert len(report["layouts"][0]["measured_runs_s"]) == 2  # both passes kept
    assert "the collective sweep failed" in captured.err and "priced with the saved profile" in captured.err
    args.repeats = 0
    with pytest.raises(LayoutError, match="--repeats must be a positive integer, got 0"):
        cli.run(args)


def test_on_a_gpu_one_rank_runs_there_priced_on_its_preset_without_sweeps(monkeypatch, capsys):
    """``--device cuda`` with CUDA faked: no collective sweep, no in-step replay; the ops are
    timed on the GPU into ``--db``, the run is on the GPU, the prediction on the GPU's preset."""
    from topomesh.cli import validate as cli
    from topomesh.cost import devices
    from topomesh.validate import run as vrun

    seen: dict[str, object] = {}

    def ensure_ops(records, progress=None, **kw):  # noqa: ANN001, ANN003, ANN202
        seen["ops"] = kw
        return {}

    def measure(model, seq_len, layout, training, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.setdefault("runs", []).append(kw["device"])
        return {**_record([0.05, 0.05], 5, 0.0), "device": "NVIDIA H100 80GB HBM3"}

    def refuse(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("no collective sweep or in-step replay on a GPU")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(devices, "device_fingerprint", lambda device="cpu": "NVIDIA H100 80GB HBM3")
    for name in ("pooled_collectives", "ensure_collectives", "in_step_tables"):
        monkeypatch.setattr(vrun, name, refuse)
    monkeypatch.setattr(vrun, "ensure_ops", ensure_ops)
    monkeypatch.setattr(vrun, "measure", measure)
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--device", "cuda", "--model", "tiny-llama", "--db", "ops.sqlite", "--repeats", "2", "--json"])
    assert cli.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert seen == {"ops": {"device": "cuda", "db": "ops.sqlite"}, "runs": ["cuda", "cuda"]}
    assert report["cluster"] == "dgx-h100" and report["device"] == "NVIDIA H100 80GB HBM3"
    assert report["replays"] == 0  # a GPU's ops are timed as kernels, not replayed
    assert [r["layout"] for r in report["layouts"]] == ["dp_shard=1"]  # the default on a GPU
    assert report["layouts"][0]["predicted_s"] > 0
    with pytest.raises(LayoutError, match="--device cuda validates one GPU.*got tp=2"):
        cli.run(p.parse_args(["--device", "cuda", "--model", "tiny-llama", "--layouts", "tp=2"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CalibrationError, match="--device cuda: CUDA is not available"):
        cli.run(p.parse_args(["--device", "cuda", "--model", "tiny-llama"]))


def test_a_layout_with_more_ranks_than_cpus_is_replayed_once_per_rank_at_once(monkeypatch, capsys):
    # four ranks on two CPUs run their ops among each other's; one replay alone times them on a
    # core of their own (four at once priced tp=2,dp_shard=2's compute 7 % higher on average)
    from types import SimpleNamespace

    from topomesh.cli import validate as cli
    from topomesh.cost import cluster
    from topomesh.sim import simulate
    from topomesh.validate import run as vrun

    seen: dict[str, int] = {}

    class FakeSim:
        def __init__(self, *, model, cluster, cache, table=None):  # noqa: ANN001
            pass

        def trace(self, layout, training):  # noqa: ANN001, ANN202
            return SimpleNamespace(traced_layers=99, events=list, segments=(), dtype="float32")

        def simulate(self, layout, training):  # noqa: ANN001, ANN202
            return _Prediction(1.0)

    def in_step(model, seq_len, layouts, training, *, threads, copies=1, replays=1):  # noqa: ANN001, ANN202
        [(text, _)] = layouts
        seen[text] = (copies, replays)
        return {}

    monkeypatch.setattr("topomesh.topology.discover.allowed_cpus", lambda: [0, 1])
    monkeypatch.setattr(simulate, "Simulator", FakeSim)
    monkeypatch.setattr(cluster, "local_cluster", lambda gpus: None)
    monkeypatch.setattr(vrun, "ensure_collectives", lambda world: None)
    monkeypatch.setattr(vrun, "profile_info", lambda path: {})
    monkeypatch.setattr(vrun, "ensure_ops", lambda records, progress=None, **kw: {})
    monkeypatch.setattr(vrun, "in_step_tables", in_step)
    monkeypatch.setattr(vrun, "measure", lambda *a, **kw: _record([1.0], 5, 0.0))
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--model", "tiny-llama", "--layouts", "dp_shard=2", "--layouts", "tp=2,dp_shard=2",
                         "--repeats", "1", "--no-sweep-each-pass", "--json"])
    assert cli.run(args) == 0
    assert seen == {"dp_shard=2": (1, 2), "tp=2,dp_shard=2": (4, 2)}  # two replays each by default
    assert json.loads(capsys.readouterr().out)["replays"] == 2


@pytest.mark.parametrize(("layouts", "extra", "message"), [
    (["dp_shard=2", "tp=3"], [], r"--layouts tp=3: tp=3 does not divide the 8 attention heads and 4 kv heads of tiny-llama"),
    (["ep=2"], [], r"--layouts ep=2: ep=2 needs a mixture-of-experts model; tiny-llama is dense"),
    (["pp=4"], [], r"--layouts pp=4: 4 pipeline stages \(pp=4\) need at least as many layers; tiny-llama has 2"),
    (["dp_shard=2"], ["--global-batch", "3"], r"--layouts dp_shard=2: global batch 3 does not divide into "
                                               r"data-parallel degree 2 × micro-batch 1"),
])
def test_a_layout_the_model_cannot_take_is_refused_before_any_sweep(monkeypatch, layouts, extra, message):
    # a pp=8 of a 4-layer model swept 8 processes for 71 s before the simulator said no
    from topomesh.cli import validate as cli
    from topomesh.sim import simulate
    from topomesh.validate import run as vrun

    def refuse(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("nothing is calibrated, traced or run for a layout the model cannot take")

    for name in ("pooled_collectives", "ensure_collectives", "in_step_tables", "ensure_ops", "measure"):
        monkeypatch.setattr(vrun, name, refuse)
    monkeypatch.setattr(simulate, "Simulator", refuse)
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = ["--model", "tiny-llama", *extra, *(x for text in layouts for x in ("--layouts", text))]
    with pytest.raises(LayoutError, match=message):
        cli.run(p.parse_args(args))


def test_the_wait_for_a_core_is_schedstat_s_second_field(tmp_path):
    from topomesh.validate.worker import core_wait_ns

    stat = tmp_path / "schedstat"
    stat.write_text("1122200000 56600000 347\n")  # on a CPU, waiting on a run queue (ns), timeslices
    assert core_wait_ns(str(stat)) == 56_600_000
    stat.write_text("garbage")
    assert core_wait_ns(str(stat)) == 0 and core_wait_ns(str(tmp_path / "absent")) == 0
    assert core_wait_ns() >= 0  # this thread's own, where Linux has it


def _profile_file(path, meta):  # noqa: ANN001, ANN202
    from topomesh.cost.collectives import CollectiveProfile

    path.write_text(json.dumps(CollectiveProfile(name="t", backend="gloo", source="test", models={},
                                                 meta=meta).to_dict()))
    return path


def test_the_report_names_the_collective_profile_and_its_age(tmp_path):
    from topomesh.errors import CalibrationError
    from topomesh.validate.run import profile_info

    prof = _profile_file(tmp_path / "p.json", {"measured_at": "2026-11-26T05:55:03Z"})
    # by hand: 2026-11-26 05:55:03 UTC is 1,795,672,503 s after the epoch; 2 h 15 min later
    assert profile_info(prof, now=1_795_672_503 + 8_100) == {
        "path": str(prof), "measured_at": "2026-11-26T05:55:03Z", "age_h": 2.25, "sweeps": 1}
    _profile_file(prof, {"measured_at": "2026-11-26T05:55:03Z", "sweeps": [{"points": 1}] * 3})
    assert profile_info(prof)["sweeps"] == 3  # a profile pooled over three launches' sweeps
    _profile_file(prof, {"measured_at": "yesterday"})
    assert profile_info(prof)["age_h"] is None
    _profile_file(prof, {})
    assert profile_info(prof) == {"path": str(prof), "measured_at": None, "age_h": None, "sweeps": 1}
    prof.write_text("[1, 2]")
    with pytest.raises(CalibrationError, match="malformed collective profile"):
        profile_info(prof)
    with pytest.raises(CalibrationError, match="collective profile"):
        profile_info(tmp_path / "absent.json")


def test_the_report_carries_how_far_each_layouts_runs_lay_apart():
    # two layouts run three times each: medians 0.20 / 0.22 / 0.18 (spread 0.04 / 0.20 = 0.2)
    # and 1.0 / 1.0 / 1.1 (0.1 / 1.0); one layout run once has none and is left out of the mean
    runs = [LayoutResult(layout="a", predicted_s=0.2, measured_s=0.2, predicted_peak_bytes=1, measured_peak_bytes=1,
                         runs_s=(0.20, 0.22, 0.18)),
            LayoutResult(layout="b", predicted_s=1.0, measured_s=1.0, predicted_peak_bytes=1, measured_peak_bytes=1,
                         runs_s=(1.0, 1.0, 1.1)),
            LayoutResult(layout="c", predicted_s=0.5, measured_s=0.5, predicted_peak_bytes=1, measured_peak_bytes=1,
                         runs_s=(0.5,))]
    out = compare(runs)
    assert [r["runs_spread"] for r in out["layouts"]] == [pytest.approx(0.2), pytest.approx(0.1), None]
    assert out["mean_runs_spread"] == pytest.approx(0.15)


@pytest.mark.parametrize("outcomes, calls, ok", [
    (["abort", "ok"], 2, True),  # a native crash: run again, once
    (["abort", "segv"], 2, False),  # crashed twice: the error
    (["error", "ok"], 1, False),  # a Python error: at once, not run again
])
def test_a_child_killed_by_a_signal_runs_once_more(monkeypatch, capsys, outcomes, calls, ok):
    import subprocess

    from topomesh.validate import run as vrun

    seen = []
    words = {"abort": (1, "traceback : Signal 6 (SIGABRT) received by PID 5"), "segv": (-11, ""),
             "error": (1, "RuntimeError: bad layout")}

    def fake_run(cmd, **kw):  # noqa: ANN001, ANN003, ANN202
        what = outcomes[len(seen)]
        seen.append(what)
        if what == "ok":
            Path(cmd[cmd.index("--out") + 1]).write_text('{"steps": 3}')
            return subprocess.CompletedProcess(cmd, 0, "", "")
        code, err = words[what]
        return subprocess.CompletedProcess(cmd, code, "", err)

    monkeypatch.setattr(vrun.subprocess, "run", fake_run)
    call = partial(vrun._run_child, "the real run of layout x", {}, lambda tmp: ["-c", "pass"],
                   lambda out: json.loads(out.read_text()), threads=1, timeout_s=5)
    if ok:
        assert call() == {"steps": 3}
        assert "the real run of layout x crashed (SIGABRT); running it again" in capsys.readouterr().err
    else:
        with pytest.raises(vrun.ValidateError, match="the real run of layout x failed"):
            call()
    assert len(seen) == calls
