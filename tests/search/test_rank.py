"""Plan-file exports for torchtitan and Megatron-LM, and the runner-up explanation."""

from __future__ import annotations

from topomesh.search.rank import export_megatron, export_torchtitan


def _layout(**over: object) -> dict:
    lay = {"degrees": {"tp": 8, "pp": 4, "dp_shard": 16, "dp_replicate": 2, "cp": 1, "ep": 1}, "order": "tp-pp",
           "micro_batch": 1, "global_batch": 1024, "seq_len": 8192, "schedule": "interleaved-1f1b", "interleave": 2,
           "recompute": "selective", "sequence_parallel": True}
    lay.update(over)
    return {"layout": lay}


def test_torchtitan_parallelism_section() -> None:
    text = export_torchtitan(_layout())
    # local batch = global / (dp_replicate · dp_shard) = 1024 / 32 = 32
    assert text == (
        "[parallelism]\n"
        "data_parallel_replicate_degree = 2\n"
        "data_parallel_shard_degree = 16\n"
        "tensor_parallel_degree = 8\n"
        "context_parallel_degree = 1\n"
        "pipeline_parallel_degree = 4\n"
        "expert_parallel_degree = 1\n"
        'pipeline_parallel_schedule = "Interleaved1F1B"\n'
        "pipeline_parallel_microbatch_size = 1\n"
        "\n[training]\nglobal_batch_size = 1024\nlocal_batch_size = 32\nseq_len = 8192\n"
        '\n[activation_checkpoint]\nmode = "selective"\n'
    )


def test_megatron_arguments() -> None:
    # 80 layers over pp=4 × interleave 2 = 8 virtual stages: 10 layers each
    args = export_megatron(_layout(), n_layers=80).split(" \\\n")
    assert args == ["--tensor-model-parallel-size 8", "--pipeline-model-parallel-size 4", "--context-parallel-size 1",
                    "--expert-model-parallel-size 1", "--num-layers-per-virtual-pipeline-stage 10",
                    "--micro-batch-size 1", "--global-batch-size 1024", "--seq-length 8192", "--sequence-parallel",
                    "--recompute-granularity selective", "--use-torch-fsdp2\n"]


def test_megatron_full_recompute_without_tp_has_no_sequence_parallel() -> None:
    lay = _layout(degrees={"tp": 1, "pp": 1, "dp_shard": 8}, recompute="full", schedule=None, interleave=1)
    text = export_megatron(lay, n_layers=32)
    assert "--sequence-parallel" not in text and "virtual" not in text
    assert "--recompute-granularity full \\\n--recompute-method uniform \\\n--recompute-num-layers 1" in text


def _entry(step_ms: float, compute_ms: float, tp_ms: float, bubble_ms: float, feasible: bool = True):
    from topomesh.layout.dims import Layout
    from topomesh.search.run import Entry
    from topomesh.search.space import Knobs, Recompute
    from topomesh.sim.result import StepBreakdown, StepResult
    from topomesh.sim.schedules import Schedule

    r = StepResult(step_time_s=step_ms / 1e3, tokens_per_s=1.0, mfu=0.5, hfu=0.5, peak_memory_bytes=1, memory=(),
                   feasible=feasible, reason=None if feasible else "memory: too big",
                   breakdown=StepBreakdown(compute_s=compute_ms / 1e3, exposed_comm_s={"tp": tp_ms / 1e3},
                                           bubble_s=bubble_ms / 1e3, optimizer_s=0.0, p2p_s=0.0),
                   links={"tp": {"link": "NVSwitch", "group_size": 8}}, layout={}, world_size=8, device="x",
                   capacity_bytes=2)
    return Entry(index=0, knob=0, layout=Layout(tp=8), result=r,
                 knobs=Knobs(micro_batch=1, recompute=Recompute.NONE, schedule=Schedule.ONE_F_ONE_B, interleave=1))


def test_why_a_runner_up_loses() -> None:
    from topomesh.search.rank import why_loses

    best = _entry(10, 8, 2, 0)
    # 15 ms = 8 compute + 6 tp + 1 bubble: 5 ms slower, 4 of them tp communication, 1 bubble
    assert why_loses(best, _entry(15, 8, 6, 1)) == "5 ms slower: +4 ms exposed tp comm (NVSwitch), +1 ms bubble"
    assert why_loses(best, _entry(15, 8, 6, 1, feasible=False)) == "memory: too big"
