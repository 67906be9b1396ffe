"""Host work a PyTorch pipeline schedule does per action, beyond its stage's own forward and backward.

``torch.distributed.pipelining`` runs every action of a schedule in Python on the stage's
computing thread: a forward finds its received activations and makes them leaves
(``_retrieve_recv_activations``), checks the outputs' shapes, keeps them for the backward,
builds its send operations and posts them (``batch_isend_irecv``), then waits for the
receives of the next action; a backward does the same for gradients around
``stage_backward``. The multi-stage schedules (interleaved, zero-bubble, V) read an action
list and keep more books per action. On a GPU that host work issues ahead of the kernels; on
a CPU the host thread is the computing thread, so every action pays it on top of its ops.

:func:`measure_pipeline_action` times it on two gloo ranks of one host: stages of one
``Linear(16, 16)`` each (their ops cost next to nothing), run by ``Schedule1F1B`` (one stage a
rank) and by ``ScheduleInterleaved1F1B`` (two stages a rank), on the thread's CPU clock
(waiting for a peer costs none). Each schedule steps at two micro-batch counts
(:data:`MICROBATCHES`); the same stage modules' forward, loss and backward run for as many
micro-batches without the schedule, and what the schedule costs more per extra action is the
slope: ``((step_hi - plain_hi) - (step_lo - plain_lo)) / (actions_hi - actions_lo)``, so what
a step costs once (splitting the batch, the gradient scaling, merging the losses) cancels.
The mean of the two ranks (the last one computes the loss, the first receives nothing).

Measured here (2-vCPU Xeon, one torch thread, torch 2.13; 2, 4, 8 and 16 micro-batches,
2026-11-27): ``Schedule1F1B`` 0.13 ms an action on the first rank and 0.15 on the last
(``ScheduleGPipe`` 0.14 / 0.17), ``ScheduleInterleaved1F1B`` 0.23 / 0.23 and
``ScheduleInterleavedZeroBubble`` (F, I and W actions) 0.20 / 0.24; a step's fixed part was
about 0.15 ms. In a real ``pp=2`` ``interleaved-zb`` step of ``benchmarks/validate_llama.json``
at 64 tokens the stepping thread's CPU exceeded its stage's forward and backward calls by
about 0.3 ms an action (6.5 ms over 20 actions): the whole of it is not the schedule's, but
none of it was priced, and those steps were predicted 15-17 % short.

:func:`measure_pipeline_handoff` times what a hand-off costs beyond that when the ranks compute
(``pipeline_action_s["handoff_wait"]``). In a steady 1F1B step the last stage, after each backward,
posts the gradient's send with the receive of the next forward's activation, which the first
stage sent long before; that rank's thread then waits for a core while the peer it woke and the
gloo threads run (``benchmarks/bench_pipeline_handoff.py``). A real ``pp=2`` step of
``benchmarks/validate_llama.json`` here (2-vCPU EPYC, 2026-12-07): those posts took 1.6-3.2 ms
each on average over three runs (4-7 ms at their worst, nearly all of it the thread's wait for a
core), where the simulator prices the hand-off at the calibrated send (0.8 ms for its 128 KiB);
its stages' forwards and backwards came within 2-4 % of their in-step replay. The figure is that
rank's wait for a core per such receive, with the stages computing less with them idle:
0.64-0.80 ms with two ranks in the world, 1.0-2.5 ms in a four-rank world (three each).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

MICROBATCHES = (2, 10)
"""The two micro-batch counts each schedule steps at; the cost per action is the slope between them."""
WIDTH = 16
"""Features of each stage's ``Linear``: its forward and backward take microseconds."""
ROWS = 2
"""Rows of a micro-batch."""
REPEATS = 20
"""Timed steps per schedule and count, after :data:`WARMUP`."""
WARMUP = 3
"""Steps discarded first (the stages' first step exchanges shapes with the peer)."""
HANDOFF_FORWARD_S = 0.010
"""Each stage's forward compute in :func:`measure_pipeline_handoff` (its backward twice that):
a micro-batch of ``benchmarks/validate_llama.json``'s stage here takes 9-11 ms forward and
19-24 ms backward. (At 5 ms the posts waited 0.4-2.0 ms on average, at 10 ms 1.0-2.9.)"""
HANDOFF_MICROBATCHES = (2, 5)
"""The micro-batch counts :func:`measure_pipeline_handoff` steps at (1 and 4 late receives a step)."""
HANDOFF_STEPS = 8
"""Timed steps per count and compute in :func:`measure_pipeline_handoff`, after :data:`WARMUP`
(the counts in turn)."""
HANDOFF_ROWS, HANDOFF_WIDTH = 256, 256
"""A hand-off's activation (bfloat16, 128 KiB): a micro-batch of ``benchmarks/validate_llama.json``."""
KINDS = ("single", "multi")
"""``single``: a schedule of one stage a rank (``Schedule1F1B``); ``multi``: of several
(``ScheduleInterleaved1F1B`` with two)."""


def _loss(out: Any, target: Any) -> Any:
    return (out.float() - target).pow(2).mean()


def _mean_thread_s(fn: Callable[[], None], *, repeats: int = REPEATS, warmup: int = WARMUP,
                   before: Callable[[], None] | None = None) -> float:
    """Mean thread CPU seconds of ``fn()`` over ``repeats`` calls after ``warmup``; ``before()``
    runs ahead of each call, untimed (a barrier, so the ranks step together)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        c0 = time.thread_time()
        fn()
        times.append(time.thread_time() - c0)
    return statistics.fmean(times)


def _one_schedule(kind: str, micro: int, pg: Any, me: int) -> tuple[float, float, int]:
    """(step CPU seconds, the same modules' plain CPU seconds, actions a step) of this rank
    (group rank ``me`` of the two in ``pg``) for schedule ``kind`` at ``micro`` micro-batches."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    per = 1 if kind == "single" else 2
    n_stages = 2 * per
    mine = [me + 2 * k for k in range(per)]  # loop order: stage s on rank s % 2
    stages = []
    for s in mine:
        torch.manual_seed(s)
        stages.append(PipelineStage(nn.Sequential(nn.Linear(WIDTH, WIDTH)), s, n_stages, torch.device("cpu"),
                                    group=pg))
    schedule = (Schedule1F1B(stages[0], n_microbatches=micro, loss_fn=_loss) if per == 1
                else ScheduleInterleaved1F1B(stages, n_microbatches=micro, loss_fn=_loss))
    x, target = torch.rand(micro * ROWS, WIDTH), torch.rand(micro * ROWS, WIDTH)

    def step() -> None:
        if me == 0:
            schedule.step(x)
        else:
            schedule.step(target=target)

    stepped = _mean_thread_s(step, before=lambda: dist.barrier(group=pg))

    def plain() -> None:
        for st in stages:
            last = st.stage_index == n_stages - 1
            for xs, ts in zip(x.tensor_split(micro), target.tensor_split(micro), strict=True):
                out = st.submod(xs.detach().requires_grad_())
                if last:
                    _loss(out, ts).backward()
                else:
                    out.backward(torch.ones_like(out))

    return stepped, _mean_thread_s(plain), actions_a_step(kind, micro, me)


def actions_a_step(kind: str, micro: int, me: int) -> int:
    """Compute actions (F and B) rank ``me`` of the two runs in one step of the :data:`KINDS`
    schedule at ``micro`` micro-batches, in the order the simulator takes from PyTorch's own
    schedule (:func:`~topomesh.sim.schedules.action_order`), so the per-action figure is per
    action as the simulator charges it."""
    from topomesh.sim.schedules import Schedule, action_order

    if kind == "single":
        return len(action_order(Schedule.ONE_F_ONE_B, pp=2, microbatches=micro)[me])
    return len(action_order(Schedule.INTERLEAVED_1F1B, pp=2, microbatches=micro, interleave=2)[me])


def per_action(lo: tuple[float, float, int], hi: tuple[float, float, int]) -> float:
    """What a schedule costs more per extra action between two counts, each (step seconds,
    the same work's plain seconds, actions a step): the step's fixed part and the stage's own
    work cancel.

    >>> # 4 actions: step 1.0 ms, plain 0.2; 20 actions: step 3.8 ms, plain 1.0 -> (2.8 - 0.8) / 16
    >>> round(per_action((1.0e-3, 0.2e-3, 4), (3.8e-3, 1.0e-3, 20)) * 1e6, 3)
    125.0
    """
    (s_lo, p_lo, a_lo), (s_hi, p_hi, a_hi) = lo, hi
    return ((s_hi - p_hi) - (s_lo - p_lo)) / (a_hi - a_lo)


def measure_pipeline_action(ranks: Sequence[int]) -> dict[str, float] | None:
    """Host seconds a pipeline schedule's action costs its stage's thread beyond the stage's
    own forward, loss and backward, per :data:`KINDS` (see the module docstring), on the first
    two of ``ranks`` (one host's; call on every rank of the world). Returns
    ``{"single": s, "multi": s}`` on ``ranks[0]``, None on the others."""
    import torch
    import torch.distributed as dist

    from topomesh.layout import groups as tm_groups

    me, team = dist.get_rank(), tuple(ranks[:2])
    pg = tm_groups.new_group(team)
    out: dict[str, float] = {}
    if me in team:
        lo, hi = MICROBATCHES
        mine = torch.zeros(len(KINDS), dtype=torch.float64)
        for i, kind in enumerate(KINDS):
            mine[i] = per_action(_one_schedule(kind, lo, pg, team.index(me)),
                                 _one_schedule(kind, hi, pg, team.index(me)))
        dist.all_reduce(mine, group=pg)
        out = {kind: float(mine[i]) / 2 for i, kind in enumerate(KINDS)}
    dist.barrier()
    return out if me == team[0] else None


def handoff_wait(busy: Sequence[float], idle: Sequence[float], micros: Sequence[int]) -> float:
    """Seconds a late hand-off costs the last stage of a two-stage 1F1B step when the ranks
    compute, beyond what it costs when they do not: per micro-batch count in ``micros``, its
    stepping thread's wait for a core over a step (``busy``, ``idle``: the mean per step), over
    the ``m - 1`` receives it posts after their data was sent (after each backward but the last),
    pooled over the counts. What the schedule's actions and transfers cost between idle ranks the
    simulator prices already (:attr:`~topomesh.cost.cluster.Cluster.pipeline_action_s` and the
    calibrated send).

    >>> # 2 and 5 micro-batches: 1 and 4 late receives; 3 + 9 ms of waiting computing, 0.5 + 0.5 idle
    >>> round(handoff_wait((3e-3, 9e-3), (0.5e-3, 0.5e-3), (2, 5)) * 1e3, 3)
    2.2
    """
    late = sum(m - 1 for m in micros)
    return (sum(busy) - sum(idle)) / late


def burn_stage(burn: Callable[[int], Any], k: int) -> Any:
    """A pipeline stage of known compute: a module of one bfloat16 scaling parameter whose
    forward calls ``burn(k)`` and whose backward ``burn(2 * k)`` (an autograd Function), passing
    its activation on (:func:`measure_pipeline_handoff`, ``benchmarks/bench_pipeline_handoff.py``)."""
    import torch
    from torch import nn

    class Burn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            burn(k)
            return x * 1.0

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            burn(2 * k)
            return g * 1.0

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1, dtype=torch.bfloat16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Burn.apply(x * self.scale)

    return Stage()


def _handoff_waits_s(micros: Sequence[int], chain: Callable[[int], Any], k: int, pg: Any, me: int) -> list[float]:
    """Per micro-batch count in ``micros``, the mean seconds a step of ``Schedule1F1B`` over two
    stages, whose forward runs ``chain(k)`` and whose backward ``chain(2 * k)``, keeps the
    last stage's stepping thread ready to run and waiting for a core (Linux's ``schedstat``;
    0 where it is absent); this rank is stage ``me`` of the two in ``pg``. The counts step in
    turn, one step each a round, so a slow spell of the host falls on all of them. (The step's
    wall-clock slope between the counts, tried first, scattered from -5.1 to 11.6 ms between
    measurements minutes apart: a step moves by 10-20 ms here.)"""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from topomesh.validate.worker import core_wait_ns

    steps = []
    for micro in micros:
        stage = PipelineStage(burn_stage(chain, k), me, 2, torch.device("cpu"), group=pg)
        schedule = Schedule1F1B(stage, n_microbatches=micro, loss_fn=_loss)
        x = torch.zeros(micro, HANDOFF_ROWS, HANDOFF_WIDTH, dtype=torch.bfloat16)
        target = torch.zeros(micro, HANDOFF_ROWS, HANDOFF_WIDTH)
        steps.append((lambda schedule=schedule, x=x: schedule.step(x)) if me == 0
                     else (lambda schedule=schedule, target=target: schedule.step(target=target)))
    waits = torch.zeros(len(micros), dtype=torch.float64)
    for i in range(WARMUP + HANDOFF_STEPS):
        for j, step in enumerate(steps):
            dist.barrier(group=pg)
            q0 = core_wait_ns()
            step()
            if i >= WARMUP and me == 1:
                waits[j] += (core_wait_ns() - q0) / 1e9 / HANDOFF_STEPS
    dist.all_reduce(waits, group=pg)  # the last stage's, on both
    return [float(w) for w in waits]


def measure_pipeline_handoff(ranks: Sequence[int]) -> float | None:
    """Seconds a late hand-off of a pipeline whose two ranks compute costs beyond what the same
    schedule's hand-offs cost between idle ranks (:func:`handoff_wait`; see the module
    docstring), on the first two of ``ranks`` (one host's; call on every rank of the world):
    ``Schedule1F1B`` over stages of :data:`HANDOFF_FORWARD_S` forward and twice that backward,
    then of none, at :data:`HANDOFF_MICROBATCHES`, the last stage's wait for a core. Returns the
    figure on ``ranks[0]``, None on the others."""
    import torch.distributed as dist

    from topomesh.cost.calibrate import _timed_chain
    from topomesh.layout import groups as tm_groups

    me, team = dist.get_rank(), tuple(ranks[:2])
    pg = tm_groups.new_group(team)
    out = None
    if me in team:
        chain, per = _timed_chain(team[0], group=pg)
        stage = team.index(me)
        busy = _handoff_waits_s(HANDOFF_MICROBATCHES, chain, round(HANDOFF_FORWARD_S / per), pg, stage)
        idle = _handoff_waits_s(HANDOFF_MICROBATCHES, chain, 0, pg, stage)
        out = handoff_wait(busy, idle, HANDOFF_MICROBATCHES)
    dist.barrier()
    return out if me == team[0] else None
