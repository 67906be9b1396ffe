"""A pipeline whose ranks share a host's cores (the ``local`` cluster: gloo processes on a CPU).

Lock-step pricing stretches every rank's compute by the measured stretch of all the node's
ranks computing at once (:attr:`~topomesh.cost.cluster.Cluster.compute_share`) and its
collectives by the core share of all of them. A pipeline's ranks are not all busy at once:
they wait for each other in the warm-up, the cool-down and the bubbles, and a rank that
computes while others wait has more of the cores.

:func:`shared_pipeline` runs the engine again and again. Each action is stretched by the core
share of the ranks busy, on average, while it ran in the run before
(:meth:`~topomesh.cost.cluster.Cluster.cores_share_at`: processor sharing), starting from
lock-step, until the stretches settle. Ranks of one stage (its data, tensor and context
parallel peers) run in lock-step and count together.

Processor sharing, not the measured stretch: a pipeline action computes for tens of
milliseconds at a time, and over long stretches the cores are shared evenly and nothing is
lost to it. One-process steps of ``benchmarks/validate_llama.json`` (one thread, 12 s each,
on the 2-core VM) took 91.3 ms alone, 88–90 ms two at once and 183–185 ms four at once, with
91.4, 88–89 and 92.1 ms of CPU time: 1.0x and 2.0x, the core shares. The measured stretch
comes from 2–32 ms segments between barriers (1.77 for four ranks there), which is what
lock-step ranks meeting at every layer's collective see.

Where a stage has several ranks (``pp=2,tp=2``: a tensor-parallel pair a stage), those do meet
at every layer's collective: alone, their compute keeps the measured lock-step stretch of that
many ranks (:meth:`~topomesh.cost.cluster.Cluster.lock_step_stretch`, 1.12 for two here) over
their own core share. A pair alone on the two cores computes at 1.12 times one rank's time,
not 1.0; beside the other stages' ranks it loses no more than all of them would in lock-step
(see below). A stage's data-parallel ranks meet only
where FSDP gathers (its first forward) and reduces (its last backward), so they keep no such
stretch (:func:`~topomesh.sim.simulate.meeting_ranks`): with it ``pp=2,dp_replicate=2`` was
priced 16-26 % over its runs (GPipe and 1F1B), whose steps took twice a rank's CPU time, the
cores kept busy; without it GPipe +3.6 %.

Only what runs on a core is shared (:func:`action_stretch`): a rank waiting in a collective
(for its peer, for the socket) leaves its core to another stage's rank, and so does a pair
waiting for each other at a collective. Until 2026-12-08 the sharing multiplied the whole
action, the pair's lock-step stretch and its collectives included: a ``tp=2,pp=2`` step's
actions with both stages busy were priced at twice their time alone where the runs took 1.5
times (a /tmp timeline of the real step: stage 1's backward 47 ms alone, 70 ms beside stage 0).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Sequence

from topomesh.cost.cluster import Cluster
from topomesh.sim.engine import ActionKey, EngineResult, StagePlan, simulate_pipeline
from topomesh.sim.schedules import Action

ROUNDS = 16
"""Most rounds after the lock-step run; the stretches move by under :data:`SETTLED` before
(10–14 engine runs in all on the validate pipelines, ``pp=2`` to ``pp=4``)."""
SETTLED = 1e-4
"""The rounds end when no action's stretch factor moved by more than this."""
DAMPING = 0.5
"""Each run's stretches move half way to what the run before implies: without it a rank that
was slowed stops overlapping the others, is sped up, overlaps again, and so on."""


def action_stretch(cost: tuple[float, float], share: float, *, alone: float, lock: float, loss: float,
                   cpu: float) -> tuple[float, float]:
    """(factor on compute, factor on communication) over one rank's own times of an action
    whose compute and communication take ``cost`` seconds at those times, with its
    stage's ranks sharing the cores ``alone`` times over on their own and ``share`` times over
    with the other ranks busy while it runs (:meth:`~topomesh.cost.cluster.Cluster.cores_share_at`).

    The larger of two floors. Alone the stage runs at its own share, its compute stretched by
    its ranks' ``lock``-step loss (waiting for each other at every collective). With more
    ranks busy than cores, the cores are the limit: each rank's work on a core is its compute,
    stretched by the ``loss`` of that many ranks in lock-step (the waits of one stage cannot
    cost more: another stage computes in them), and the ``cpu`` share of its communication (the
    rest of a collective's time it waits, off the core).

    Four ranks on two cores, two tensor-parallel pairs each meeting at an all-reduce of 4 KiB
    (1.56 ms back to back, 64 % of it on a core) after every ~4 ms of compute (2026-12-08, /tmp
    experiment, the 2-vCPU EPYC VM): one pair alone took 1.80 times one rank's compute alone,
    both pairs at once 2.69 (1.49 times the pair alone, not the two cores' 2.0); after every
    ~34 ms, 1.17 and 2.30. Until then the stretch was the share times the pair's own pace,
    3.60 and 2.34; this gives 2.0 × 1.125 + 2.0 × 0.64 × 1.56 / 4 = 2.75, and 2.30 (four ranks'
    lock-step loss 1.125, as calibrated then).

    >>> action_stretch((2.0, 1.0), 2.0, alone=1.0, lock=1.2, loss=1.1, cpu=0.5)  # cores bound
    (2.2, 1.0)
    >>> action_stretch((2.0, 1.0), 1.0, alone=1.0, lock=1.2, loss=1.1, cpu=0.5)  # its own pace
    (1.2, 1.0)
    """
    compute, comm = cost
    own = (alone * lock, alone)
    busy = (share * loss, share * cpu)
    return busy if compute * busy[0] + comm * busy[1] > compute * own[0] + comm * own[1] else own


def busy_ranks(busy: Sequence[Sequence[tuple[float, float, ActionKey]]], ranks_per_stage: int
               ) -> dict[ActionKey, float]:
    """Per action, the mean number of the node's ranks busy while it ran: its own stage's
    ``ranks_per_stage``, plus as many for each other pipeline rank times the share of the
    action's interval that rank was busy. A rank's intervals follow each other in time.

    >>> busy_ranks([[(0.0, 2.0, (0, "F", 0))], [(1.0, 3.0, (1, "F", 0))]], 2)
    {(0, 'F', 0): 3.0, (1, 'F', 0): 3.0}
    """
    clocks = [_BusyClock(mine) for mine in busy]
    out: dict[ActionKey, float] = {}
    for r, mine in enumerate(busy):
        for start, end, key in mine:
            length = end - start
            seen = sum(c.until(end) - c.until(start) for q, c in enumerate(clocks) if q != r)
            out[key] = ranks_per_stage * (1.0 + (seen / length if length > 0 else 0.0))
    return out


class _BusyClock:
    """Seconds one rank was busy up to a time, from its intervals in order (bisection)."""

    def __init__(self, intervals: Sequence[tuple[float, float, ActionKey]]) -> None:
        self.starts = [s for s, _, _ in intervals]
        self.ends = [e for _, e, _ in intervals]
        self.before = list(itertools.accumulate((e - s for s, e, _ in intervals), initial=0.0))

    def until(self, t: float) -> float:
        i = bisect.bisect_right(self.starts, t) - 1
        if i < 0:
            return 0.0
        return self.before[i] + min(t, self.ends[i]) - self.starts[i]


def shared_pipeline(plans: Sequence[StagePlan], actions: Sequence[Sequence[Action]], stage_rank: Sequence[int],
                    p2p_s: float, cluster: Cluster, *, ranks_per_stage: int, lock_step_ranks: int | None = None,
                    record: bool = False, late_receives: bool = False, late_handoff_s: float = 0.0
                    ) -> EngineResult:
    """The engine's run with each action stretched by the ranks busy while it runs (see the
    module docstring). ``plans`` are priced lock-step, as :class:`~topomesh.sim.price.Pricer`
    prices them on ``cluster``. ``lock_step_ranks``: how many of a stage's ranks meet in every
    micro-batch (default all of them; :func:`~topomesh.sim.simulate.meeting_ranks`).
    ``late_receives`` and ``late_handoff_s`` as :func:`~topomesh.sim.engine.simulate_pipeline` takes them."""
    full_compute, full_comm = cluster.compute_share, cluster.core_share
    # a stage's ranks that meet at its collectives: their lock-step stretch on top of the sharing
    meet = ranks_per_stage if lock_step_ranks is None else lock_step_ranks
    lock = cluster.lock_step_stretch(meet) / cluster.cores_share_at(meet)
    alone = cluster.cores_share_at(ranks_per_stage)
    cpu = 1.0 if cluster.collective_cpu_share is None else cluster.collective_cpu_share
    scale: dict[ActionKey, tuple[float, float]] = {}
    engine = functools.partial(simulate_pipeline, plans, actions, stage_rank, p2p_s, late_receives=late_receives,
                               late_handoff_s=late_handoff_s)
    run = engine()
    # per action, its compute and communication at one rank's own times (the run was lock-step)
    costs = {key: (c / full_compute, x / full_comm) for st in run.ranks for key, (c, x) in st.costs.items()}
    for _ in range(ROUNDS):
        moved = 0.0
        for key, k in busy_ranks([st.busy for st in run.ranks], ranks_per_stage).items():
            target = action_stretch(costs[key], cluster.cores_share_at(k), alone=alone, lock=lock,
                                    loss=min(lock, cluster.lock_step_loss(k)), cpu=cpu)
            compute, comm = scale.get(key, (1.0, 1.0))
            step_compute = DAMPING * (target[0] / full_compute - compute)
            step_comm = DAMPING * (target[1] / full_comm - comm)
            scale[key] = (compute + step_compute, comm + step_comm)
            moved = max(moved, abs(step_compute), abs(step_comm))
        run = engine(scale=scale)
        if moved < SETTLED:
            break
    if record:
        run = engine(scale=scale, record=True)
    return run
