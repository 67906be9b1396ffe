"""Pipeline action orders: PyTorch's schedules, checked against hand-written orders."""

from __future__ import annotations

import pytest

from topomesh.errors import LayoutError
from topomesh.sim.schedules import Kind, Schedule, action_order, in_flight, rank_stages, stage_count


def names(acts) -> list[str]:
    return [str(a) for a in acts]


def test_one_f_one_b_orders_as_its_runtime_runs():
    # torch's Schedule1F1B._step_microbatches: min(m, p - stage) warm-up forwards, then B/F pairs
    order = action_order("1f1b", pp=3, microbatches=4)
    assert names(order[0]) == ["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3"]
    assert names(order[2]) == ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3"]


def test_gpipe_all_forwards_then_all_backwards():
    assert names(action_order("gpipe", pp=2, microbatches=3)[1]) == ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]


def test_without_a_pipeline_micro_batches_accumulate():
    assert names(action_order("1f1b", pp=1, microbatches=2)[0]) == ["0F0", "0B0", "0F1", "0B1"]


def test_interleaved_holds_looped_stages_and_every_action_once():
    p, m, v = 4, 8, 2
    order = action_order("interleaved-1f1b", pp=p, microbatches=m, interleave=v)
    assert stage_count(Schedule.INTERLEAVED_1F1B, p, v) == 8
    assert rank_stages(Schedule.INTERLEAVED_1F1B, p, v, 1) == [1, 5]
    for r, acts in enumerate(order):
        assert {a.stage for a in acts} == {r, r + p}
        assert sorted((a.stage, a.kind.value, a.mb) for a in acts) == sorted(
            (s, k, mb) for s in (r, r + p) for k in ("F", "B") for mb in range(m))


def test_zero_bubble_splits_backward_into_input_and_weight():
    acts = action_order("zbv", pp=2, microbatches=4)[0]
    kinds = {a.kind for a in acts}
    assert Kind.I in kinds and Kind.W in kinds
    assert {a.stage for a in acts} == {0, 3}  # V shape: rank 0 holds the first and the last stage


def test_in_flight_is_the_1f1b_warm_up_depth():
    # 1F1B keeps at most p - rank micro-batches alive on rank r (Narayanan et al. 2021, §2.2)
    order = action_order("1f1b", pp=4, microbatches=8)
    assert [in_flight(a) for a in order] == [4, 3, 2, 1]
    assert in_flight(action_order("gpipe", pp=4, microbatches=8)[0]) == 8


def test_torch_refusals_become_layout_errors():
    with pytest.raises(LayoutError, match="1F1B schedule refuses pp=4, micro-batches=2"):
        action_order("1f1b", pp=4, microbatches=2)
    with pytest.raises(LayoutError, match="needs --interleave 2"):
        action_order("interleaved-1f1b", pp=2, microbatches=4, interleave=1)


@pytest.mark.parametrize("schedule", list(Schedule))
def test_receives_are_posted_at_the_action_only_by_torchs_single_stage_schedules(schedule):
    """GPipe and 1F1B (PipelineScheduleSingle) batch a receive with the action's wait; the
    runtime schedules (_PipelineScheduleRuntime) post it where the sender's action is lowered."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    assert schedule.receives_at_action == issubclass(get_schedule_class(schedule.torch_name), PipelineScheduleSingle)


def test_the_multi_stage_runtime_unshards_up_to_three_stages_ahead():
    # PyTorch's lowering (_add_unshard_reshard) keeps the next three distinct stages a rank will
    # compute unsharded. Two stages a rank: both before the first action, never again. Four
    # stages a rank (interleaved 1F1B, pp=4, 8 micro-batches): rank 0 computes stages 0, 4, 8, 12
    # four micro-batches at a time (0F0-3, 4F0-3, 8F0-3, 12F0-3, ...), so it unshards 0, 4 and 8
    # first, 12 when it reaches 4F0 (action 4, stage 0 no longer among the next three), and
    # stage 0 again at 8F0 (action 8).
    from topomesh.sim.schedules import unshard_points

    assert unshard_points("zbv", pp=2, microbatches=4) == ({0: (0, 3)}, {0: (1, 2)})
    acts = action_order("interleaved-1f1b", pp=4, microbatches=8, interleave=4)[0]
    assert [str(a) for a in acts[:12:4]] == ["0F0", "4F0", "8F0"]
    points = unshard_points("interleaved-1f1b", pp=4, microbatches=8, interleave=4)[0]
    assert {i: points[i] for i in (0, 4, 8)} == {0: (0, 4, 8), 4: (12,), 8: (0,)}
    assert unshard_points("gpipe", pp=2, microbatches=2) is None
