"""Collective calibration: measure this cluster's collectives once, fit, save a profile.

Run on every rank of a job, e.g.::

    torchrun --nproc-per-node 8 --nnodes 2 ... -m topomesh.cost.calibrate --output prof.json
    topomesh launch --nproc-per-node 2 -m topomesh.cost.calibrate
    topomesh calibrate --local 2          # spawns 2 local gloo processes itself

Every rank runs the same sweep: all-reduce, all-gather, reduce-scatter, all-to-all,
broadcast and send/recv over log-spaced sizes (1 KiB .. 64 MiB by default), for group
sizes 2, 4, ... up to the world, separately for a group inside one host (intra-node) and
a group of one rank per host (inter-node). The link kind of a group is its slowest ring
link in ``WORLD_TOPOLOGY_FILE`` when the launcher wrote one, else SHM (CPU) / PHB (GPU)
inside a host and NIC between hosts. Each point is timed ``repeats`` times between
barriers, interleaved across sizes; a point's time is the slowest rank's mean (:data:`STATISTIC`). Rank 0 fits every collective ×
link kind (:func:`topomesh.cost.collectives.fit_collective`: alpha-beta or piecewise,
error on held-out sizes) and writes the profile JSON. On CPU it also records how much the
compute of ranks sharing a host stretches when they run at once (:func:`measure_compute_stretch`,
``meta["compute_stretch"]``), which the ``local`` cluster prices compute with, what a collective
costs more after compute (:func:`measure_collective_in_step`) and the host work of a pipeline
schedule's action (:func:`topomesh.cost.pipeline.measure_pipeline_action`, ``meta["pipeline_action_s"]``), and a
hand-off between computing pipeline ranks (:func:`topomesh.cost.pipeline.measure_pipeline_handoff`, its ``handoff_wait`` key),
and the share of a collective's time its processes spend on a core (:func:`measure_collective_cpu_share`,
``meta["collective_cpu_share"]``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import signal
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from topomesh.cost.collectives import CollectiveProfile, Sample, fit_collective
from topomesh.cost.devices import private_cache_dir, write_json_atomic
from topomesh.cost.pipeline import measure_pipeline_action, measure_pipeline_handoff
from topomesh.errors import CalibrationError
from topomesh.topology.model import LinkKind
from topomesh.trace.graph import CollectiveKind

KiB = 1024
MiB = 1024 * KiB
ALL_COLLECTIVES = tuple(CollectiveKind)


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepConfig:
    min_bytes: int = 1 * KiB
    max_bytes: int = 64 * MiB
    factor: int = 2
    """Ratio between consecutive sizes (log-spaced sweep)."""
    collectives: tuple[CollectiveKind, ...] = ALL_COLLECTIVES
    max_group: int | None = None
    """Largest group size measured (default: the world)."""
    bytes_per_point: int = 128 * MiB
    """Repeats per point = bytes_per_point / size, clamped to [min_repeats, max_repeats]."""
    min_repeats: int = 3
    max_repeats: int = 20
    warmup: int = 1

    def __post_init__(self) -> None:
        if not 4 <= self.min_bytes <= self.max_bytes:
            raise CalibrationError(f"size range {self.min_bytes}..{self.max_bytes} bytes is empty or below 4 bytes")
        if self.factor < 2:
            raise CalibrationError(f"size factor must be >= 2, got {self.factor}")
        if not 1 <= self.min_repeats <= self.max_repeats:
            raise CalibrationError(f"repeats {self.min_repeats}..{self.max_repeats} are not a valid range")

    def sizes(self) -> list[int]:
        """Log-spaced sizes.

        >>> SweepConfig(min_bytes=1024, max_bytes=16384, factor=2).sizes()
        [1024, 2048, 4096, 8192, 16384]
        """
        out, s = [], self.min_bytes
        while s <= self.max_bytes:
            out.append(s)
            s *= self.factor
        return out

    def repeats(self, nbytes: int) -> int:
        """Deterministic (every rank computes the same count, so collectives stay matched).

        >>> SweepConfig().repeats(1024), SweepConfig().repeats(64 * MiB)
        (20, 3)
        """
        return max(self.min_repeats, min(self.max_repeats, self.bytes_per_point // max(nbytes, 1)))


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupSpec:
    ranks: tuple[int, ...]
    link: LinkKind
    scope: str
    """``intra`` (one host) or ``inter`` (one rank per host)."""


def plan_groups(hosts: Sequence[str], link_of: Callable[[tuple[int, ...]], LinkKind],
                max_group: int | None = None) -> list[GroupSpec]:
    """Groups to measure: per power-of-two size, the first ranks of the first host (intra)
    and the first rank of each of the first hosts (inter). Pure; ``hosts[r]`` is rank r's host.

    >>> [ (g.ranks, g.scope) for g in plan_groups(["a", "a", "b", "b"], lambda r: LinkKind.SHM)]
    [((0, 1), 'intra'), ((0, 2), 'inter')]
    """
    world = len(hosts)
    limit = min(world, max_group or world)
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(h, []).append(r)
    host_lists = list(by_host.values())
    heads = [rs[0] for rs in host_lists]
    out: list[GroupSpec] = []
    g = 2
    while g <= limit:
        first = host_lists[0]
        if len(first) >= g:
            ranks = tuple(first[:g])
            out.append(GroupSpec(ranks=ranks, link=link_of(ranks), scope="intra"))
        if len(heads) >= g:
            ranks = tuple(heads[:g])
            out.append(GroupSpec(ranks=ranks, link=link_of(ranks), scope="inter"))
        g *= 2
    return out


def _hosts_and_links(hostnames: Sequence[str], device: str
                     ) -> tuple[list[str], Callable[[tuple[int, ...]], LinkKind], str]:
    """Each rank's host and how to name a group's link.

    With ``WORLD_TOPOLOGY_FILE`` (set by ``topomesh launch``): hosts and the slowest ring link
    from the topology. Without: hosts by hostname, SHM (CPU) or PHB (GPU) inside a host,
    NIC between hosts.
    """
    from topomesh.topology.api import ENV_VAR, load_topology

    if os.environ.get(ENV_VAR):
        topo = load_topology()
        if topo.world_size != len(hostnames):
            raise CalibrationError(
                f"{os.environ[ENV_VAR]} describes {topo.world_size} ranks but this job has {len(hostnames)}"
            )

        def from_topology(ranks: tuple[int, ...]) -> LinkKind:
            kinds = [topo.connection(a, b).kind for a, b in zip(ranks, ranks[1:] + ranks[:1], strict=True)]
            return max(kinds, key=lambda k: k.tier)

        hosts = [topo.hosts[topo.ranks[r].host].hostname for r in range(topo.world_size)]
        return hosts, from_topology, f"topology file {os.environ[ENV_VAR]}"
    intra = LinkKind.SHM if device == "cpu" else LinkKind.PHB

    def by_host(ranks: tuple[int, ...]) -> LinkKind:
        return intra if len({hostnames[r] for r in ranks}) == 1 else LinkKind.NIC

    return list(hostnames), by_host, f"no topology file: {intra.value} inside a host, NIC between hosts"


def _elems(nbytes: int, n: int) -> int:
    """Float32 elements of the per-rank buffer for a ``nbytes`` point: divisible by the group size ``n``.

    >>> _elems(1000, 3), _elems(4, 8)
    (249, 8)
    """
    return max(n, nbytes // 4 // n * n)


def _buffers(kind: CollectiveKind, nbytes: int, n: int, device: str) -> tuple[Any, Any]:
    import torch

    elems = _elems(nbytes, n)
    big = torch.ones(elems, device=device)
    if kind is CollectiveKind.ALL_GATHER:
        return big[: elems // n].clone(), big
    if kind is CollectiveKind.REDUCE_SCATTER:
        return big, torch.empty(elems // n, device=device)
    if kind is CollectiveKind.ALL_TO_ALL:
        return big, torch.empty_like(big)
    return big, big


def _op(kind: CollectiveKind, inp: Any, out: Any, group: Any, ranks: tuple[int, ...], me: int) -> Callable[[], None]:
    import torch.distributed as dist

    if kind is CollectiveKind.ALL_REDUCE:
        return lambda: dist.all_reduce(inp, group=group)
    # torch 2.13 renamed the tensor forms (*_single); older releases only have the old names.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if kind is CollectiveKind.ALL_GATHER:
        return lambda: all_gather(out, inp, group=group)
    if kind is CollectiveKind.REDUCE_SCATTER:
        return lambda: reduce_scatter(out, inp, group=group)
    if kind is CollectiveKind.ALL_TO_ALL:
        return lambda: dist.all_to_all_single(out, inp, group=group)
    if kind is CollectiveKind.BROADCAST:
        return lambda: dist.broadcast(inp, src=ranks[0], group=group)
    if me == ranks[0]:
        return lambda: dist.send(inp, dst=ranks[1])
    return lambda: dist.recv(inp, src=ranks[0])


MEASURED_AT = "%Y-%m-%dT%H:%M:%SZ"
"""How a profile's ``meta.measured_at`` is written (UTC)."""

STATISTIC = "mean"
"""What a point's repeats are reduced to, recorded in a profile's ``meta``. The mean: a step pays
the sum of its collectives' times, whose expectation is the sum of their means. The median
would be the lower choice wherever the times are skewed: gloo's all-reduce of 256 KiB between
two processes on this 2-core VM took a median of 0.54-0.58 ms and a mean of 1.90-1.95 ms over
100 repeats (p10 0.3 ms, p90 4 ms: a peer's thread waits for a core); 2.8 MiB 1.7-3.5 ms and
2.6-3.7 ms. On GPUs (NCCL) the two are close."""


def _time_once(fn: Callable[[], None], group: Any, device: str) -> float:
    import torch
    import torch.distributed as dist

    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _measure_sizes(cfg: SweepConfig, kind: CollectiveKind, spec: GroupSpec, pg: Any, me: int, device: str,
                   progress: Callable[[str], None] | None) -> list[float]:
    """Mean seconds per size on this rank (:data:`STATISTIC`). Repeats are interleaved across sizes (round
    robin), so a burst of load from other processes spreads over many sizes instead of
    spoiling every repeat of one."""
    import torch

    sizes = cfg.sizes()
    fns = []
    for nbytes in sizes:
        inp, out = _buffers(kind, nbytes, len(spec.ranks), device)
        fns.append(_op(kind, inp, out, pg, spec.ranks, me))
    for fn in fns:
        for _ in range(cfg.warmup):
            fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    reps = [cfg.repeats(b) for b in sizes]
    times: list[list[float]] = [[] for _ in sizes]
    for r in range(max(reps)):
        for i, fn in enumerate(fns):
            if r < reps[i]:
                times[i].append(_time_once(fn, pg, device))
                if progress and r == reps[i] - 1:
                    progress(f"{kind.value} n={len(spec.ranks)} {spec.scope} {sizes[i]} B")
    return [statistics.fmean(t) for t in times]


def run_sweep(cfg: SweepConfig, groups: Sequence[GroupSpec], device: str,
              progress: Callable[[str], None] | None = None) -> list[Sample]:
    """Measure every collective × size on every group (call on all ranks; collective).

    Returns the samples this rank measured as group rank 0 (the slowest rank's means).
    """
    import torch
    import torch.distributed as dist

    from topomesh.layout import groups as tm_groups

    me = dist.get_rank()
    samples: list[Sample] = []
    for spec in groups:
        pg = tm_groups.new_group(spec.ranks)
        if me in spec.ranks:
            n = len(spec.ranks)
            for kind in cfg.collectives:
                if kind is CollectiveKind.SEND_RECV and n != 2:
                    continue
                means = _measure_sizes(cfg, kind, spec, pg, me, device, progress)
                worst = torch.tensor(means, dtype=torch.float64, device=device)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=pg)
                if me == spec.ranks[0]:
                    for nbytes, t in zip(cfg.sizes(), worst.tolist(), strict=True):
                        # record the per-rank buffer as CollectiveRecord defines it
                        samples.append(Sample(collective=kind, link=spec.link, group_size=n,
                                              nbytes=_elems(nbytes, n) * 4, seconds=t))
        dist.barrier()
    return samples


STRETCH_SEGMENTS_S = (0.002, 0.008, 0.032)
"""Lengths (one rank alone) of the compute segments :func:`measure_compute_stretch` times: the
stretches of a step between two synchronizations here, from a tensor-parallel block's pieces
(1-3 ms) over an FSDP2 unit's (5-10 ms) to a pipeline stage's micro-batch (10-30 ms)."""


COMPUTE_SEGMENT = 4
"""How a sweep timed its compute segments (the compute stretch's and the in-step costs'),
recorded in a profile's ``meta.compute_segment`` (pooled and reused only with the same).
1 (no key, before 2026-11-27): :func:`_matmul_chain`'s values shrank by half a matmul, were
subnormal after about 110 and zero after 150, so the 400 matmuls that timed one ran mostly on
subnormals, 136 µs each against 16 µs on normal values; the segments meant as 0.5 / 2 / 8 ms
took 0.08 / 0.24 / 1.6 ms, and the 32 ms one 52 ms. 2: the chain on normal values, but each
rank of the stretch timed its segment from when it got going after a barrier, which leaves
out the wait for a core of the ranks that outnumber the cores: four ranks on this 2-core VM
came out at 1.67-1.73 (two ranks 1.02-1.08). 3: the ranks start at a common instant
(:func:`measure_compute_stretch`): 1.95-2.14 per length for four ranks, 1.01-1.09 for two.
4: the in-step costs timed from the last rank's arrival (:func:`measure_collective_in_step`),
without the first rank's wait, which the stretch already holds."""


STRETCH_START_S = 0.002
"""How far ahead of its own clock the lead sets each repeat's common start: after a barrier,
the broadcast that carries it reaches four idle ranks here in well under a millisecond."""


def _monotonic() -> float:
    """The host's monotonic clock (``CLOCK_MONOTONIC``: one clock for every process of a host,
    so ranks of one host can start at an instant one of them sets)."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def _wait_until(at: float) -> None:
    """Sleep until shortly before ``at`` (:func:`_monotonic`), then spin to it: a sleep
    overshoots by tens of microseconds."""
    while (left := at - _monotonic()) > 3e-4:
        time.sleep(left - 2e-4)
    while _monotonic() < at:
        pass


def _matmul_chain() -> Callable[[int], Any]:
    """``chain(k)``: ``k`` 96×96 matmuls in a row, each followed by a tanh, the compute segment
    :func:`measure_compute_stretch` and :func:`measure_collective_in_step` time; returns the last
    value. ``b``'s rows sum to about 2, so the values settle at the fixed point of
    ``x = tanh(2x)`` (0.96) within a few matmuls and every matmul costs the same: with rows
    summing to 0.5 they shrank to subnormals, whose arithmetic is an order of magnitude slower."""
    import torch

    a, b = torch.rand(96, 96), torch.rand(96, 96) * (4 / 96)

    def chain(k: int) -> Any:
        x = a
        for _ in range(k):
            x = torch.mm(x, b).tanh_()
        return x

    return chain


def _timed_chain(lead: int, group: Any = None) -> tuple[Callable[[int], None], float]:
    """A warmed :func:`_matmul_chain` and the seconds one of its matmuls takes, timed on rank
    ``lead`` and broadcast over ``group`` (call on every rank of it), so every rank runs the
    same counts (at least 1e-7 s)."""
    import torch
    import torch.distributed as dist

    chain = _matmul_chain()
    chain(50)
    per = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank() == lead:
        t0 = time.perf_counter()
        chain(400)
        per[0] = (time.perf_counter() - t0) / 400
    dist.broadcast(per, src=lead, group=group)
    return chain, max(float(per[0]), 1e-7)


def measure_compute_stretch(ranks: Sequence[int], *, budget_s: float = 1.5) -> dict[str, Any]:
    """How much longer compute takes, until every one of ``n`` ranks has finished it, when ``n``
    ranks of one host run it at once than when one runs it alone; per ``n`` in 2, 4, ... and
    ``len(ranks)`` (call on every rank of the world; ``ranks`` are one host's).

    A lock-step simulation prices a rank's compute and lets every rank reach the next
    collective at the same time. Here they do not: ranks that share a host's cores and memory
    finish the same work at different times (two ranks on this 2-core VM: the last one 6-13 %
    after the mean, whatever the length), and a collective starts when the last one arrives;
    where there are more ranks than cores, they also take turns on the cores. Both are in
    ``E[max over the n ranks] / E[one rank alone]``. For each length in
    :data:`STRETCH_SEGMENTS_S`, rank ``ranks[0]`` finds the matmul count of that length and
    broadcasts it, runs it alone (the others wait at a barrier), then ``n`` ranks run it
    together, repeated for about ``budget_s``; the stretch of ``n`` is the mean over lengths
    of the ratio of means (:data:`STATISTIC`).

    Each repeat starts, after a barrier, at an instant the lead broadcasts
    (:data:`STRETCH_START_S` ahead), and each rank's time runs from that instant, not from
    when it got going: a rank that waits for a core does so inside its time, as inside a
    step. Timed from each rank's own start (before :data:`COMPUTE_SEGMENT` 3), four ranks on
    this 2-core VM came out at 1.67-1.73, less than the two cores' share they need; from the
    common start 1.95-2.14, and the same chain in four processes started together by a
    semaphore 2.07-2.15 (two ranks: 1.01-1.09 either way). In ``topomesh validate``'s sweeps,
    among its other processes: four ranks 2.09-2.31, two 1.09-1.24 in eight sweeps (1.05-1.07 before).
    Returns ``{"n": stretch, ...}`` on ``ranks[0]`` and ``{}`` on the others."""
    import torch
    import torch.distributed as dist

    me, lead = dist.get_rank(), ranks[0]
    counts = sorted({2 ** i for i in range(1, len(ranks).bit_length())} | {len(ranks)} - {1})
    ratios: dict[int, list[float]] = {n: [] for n in counts}
    chain, per = _timed_chain(lead)

    start = torch.zeros(1, dtype=torch.float64)

    def timed(team: Sequence[int], k: int, reps: int) -> torch.Tensor:
        """This rank's time for ``chain(k)`` in each of ``reps`` repeats, from the instant all
        of ``team`` start at (0 where this rank is not in ``team``)."""
        mine = torch.zeros(reps, dtype=torch.float64)
        for i in range(reps):
            dist.barrier()
            if me == lead:
                start[0] = _monotonic() + STRETCH_START_S
            dist.broadcast(start, src=lead)
            if me in team:
                at = float(start[0])
                _wait_until(at)
                chain(k)
                mine[i] = _monotonic() - at
        return mine

    for seconds in STRETCH_SEGMENTS_S:
        k = max(1, round(seconds / per))
        reps = max(10, round(budget_s / (seconds + STRETCH_START_S)))
        alone = timed(ranks[:1], k, reps).tolist()  # the lead's own
        for n in counts:
            team = ranks[:n]
            mine = timed(team, k, reps)
            every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)
            if me == lead:
                ratios[n].append(stretch_of(alone, [[float(every[r][i]) for r in team] for i in range(reps)]))
    return {str(n): statistics.fmean(r) for n, r in ratios.items()} if me == lead else {}


IN_STEP_GAPS_S = (0.0005, 0.002, 0.008)
"""Compute between two collectives :func:`measure_collective_in_step` runs: from a
tensor-parallel block's pieces (0.5-3 ms here) to an FSDP2 unit's (5-10 ms)."""
IN_STEP_POINTS = ((CollectiveKind.ALL_GATHER, 128 * KiB), (CollectiveKind.REDUCE_SCATTER, 128 * KiB),
                  (CollectiveKind.ALL_REDUCE, 256 * KiB))
"""(collective, bytes of the full buffer) :func:`measure_collective_in_step` times: a small
transformer's activations (128-256 KiB)."""


def measure_collective_in_step(ranks: Sequence[int], *, count: int = 2, together: bool = False,
                               budget_s: float = 0.5) -> dict[str, float] | None:
    """How much longer a collective of ``count`` ranks of one host (CPU; the first of
    ``ranks``, which are one host's) takes after ``gap`` seconds of compute, as in a step, than
    back to back between barriers, as the sweep times it: per gap in :data:`IN_STEP_GAPS_S`, the
    mean over :data:`IN_STEP_POINTS` (call on every rank of the world). ``count`` 2 prices every
    collective; the host's rank count (when above 2) prices a group of all of them
    (:attr:`~topomesh.cost.cluster.Cluster.collective_in_step_node_s`). ``together``: every
    ``count`` ranks of ``ranks`` (a leftover idles) step at once, each group timing its own
    collectives, as a layout's groups of a host do; what the first group pays more than its
    sweep time at the share of the cores the others leave it (the simulator's price of a
    collective beside them, :meth:`~topomesh.cost.cluster.Cluster.collective_share`) is kept
    (:attr:`~topomesh.cost.cluster.Cluster.collective_in_step_pairs_s`).

    Per point and gap, both ranks run [collective, then a matmul chain of ``gap`` seconds]
    (about ``budget_s``), and the collective is timed from the last rank's arrival at it
    (:func:`after_last_arrival`); the same collective after a barrier, timed so, is taken off.
    The wait of the rank that arrives first is not in it: the compute stretch holds that
    (:func:`measure_compute_stretch` times the last rank to finish), and a step priced with
    both would pay it twice. Until :data:`COMPUTE_SEGMENT` 4 this function timed the loop
    against the chain alone, which put the wait in: two gloo ranks here, 2026-11-27, the old
    figure against the one from the last arrival, after 0.5 / 2 / 8 ms of compute: all-gather
    of 128 KiB 0.29 / 0.54 / 0.85 against 0.14 / 0.19 / 0.66 ms, reduce-scatter of 128 KiB
    0.26 / 0.81 / 0.58 against 0.20 / 0.67 / 0.40, all-reduce of 256 KiB 0.96 / 0.58 / 1.56
    against 0.83 / 0.34 / 0.89; the mean wait (the ranks' arrivals apart) 0.1-1.2 ms. An
    FSDP2 unit's sizes pay about nothing more (3 MiB all-gather -0.72 / -0.50 / -0.18 ms,
    6 MiB reduce-scatter -0.08 / 0.35 / 0.54). The compute after a collective is not what
    slows (a 2 or 8 ms chain after one took 0.0-0.2 ms longer than after a barrier): the
    collective is, once the ranks have computed a while.

    Four ranks on the two cores (all four in each collective, 2026-11-27; from the last
    arrival, after 0.5 / 2 / 8 ms of compute alone): all-gather of 128 KiB -0.03 / 1.03 / 3.33
    ms more than the 2.82 back to back, reduce-scatter 1.93 / 2.96 / 4.48 (4.69), all-reduce
    -0.23 / 1.59 / 4.40 (5.56); an FSDP2 unit's 3 MiB all-gather 0.03 / 0.86 / 3.87 and 6 MiB
    reduce-scatter 2.23 / 2.82 / 4.59. Two of the four take turns on the cores with the
    other two, and a rank whose peers still compute waits for one. Pairs of the four, both
    pairs stepping, the first pair from its last arrival (0.32 / 0.46 / 1.06 ms back to back,
    alone): all-gather of 128 KiB 1.27 / 1.42 / 3.38 ms, reduce-scatter 1.56 / 2.39 / 4.67,
    all-reduce 1.49 / 3.59 / 5.27, against 0.57 / 0.52 / 0.88, 0.68 / 0.74 / 1.28 and 0.84 /
    1.18 / 1.33 with the other pair idle; a 6 MiB reduce-scatter 12.6-14.8 ms (7.0 alone).
    Returns ``{"gap": seconds}`` on ``ranks[0]``, None on the others."""
    import torch
    import torch.distributed as dist

    from topomesh.cost.cluster import cores_share
    from topomesh.layout import groups as tm_groups
    from topomesh.topology.discover import allowed_cpus

    me = dist.get_rank()
    teams = ([tuple(ranks[i:i + count]) for i in range(0, len(ranks) - count + 1, count)] if together
             else [tuple(ranks[:count])])
    pgs = [tm_groups.new_group(team) for team in teams]  # every rank makes every group, in order
    mine = next((i for i, team in enumerate(teams) if me in team), None)
    busy = sum(len(t) for t in teams)
    threads, cores = torch.get_num_threads(), len(allowed_cpus())
    share = cores_share(busy, threads, cores) / cores_share(count, threads, cores)  # as Cluster.collective_share
    extra: dict[float, list[float]] = {gap: [] for gap in IN_STEP_GAPS_S}
    chain, per = _timed_chain(ranks[0])  # timed alone, so a gap is one rank's compute alone
    if mine is not None:
        team, pg = teams[mine], pgs[mine]
    for kind, nbytes in IN_STEP_POINTS:
        between = 0.0
        if mine is not None:
            inp, out = _buffers(kind, nbytes, len(team), "cpu")
            fn = _op(kind, inp, out, pg, team, me)
            for _ in range(3):
                fn()
            if mine == 0:  # as the sweep times it: this group alone
                between = _stamped_s(fn, None, 0, 100, pg)
        for gap in IN_STEP_GAPS_S:
            dist.barrier()  # the groups step at once
            if mine is not None:
                k = max(1, round(gap / per))
                repeats = max(20, round(budget_s / (gap + 0.002)))  # the same on every rank
                took = _stamped_s(fn, chain, k, repeats, pg)
                extra[gap].append(took - between * share)
    dist.barrier()
    return {str(gap): statistics.fmean(v) for gap, v in extra.items()} if me == teams[0][0] else None


FUNCTIONAL_DTYPES = ("bfloat16", "float32")
"""The dtypes :func:`measure_functional_premium` times (tensor parallel's activations, and float32)."""

FUNCTIONAL_POINTS = (*IN_STEP_POINTS, (CollectiveKind.ALL_TO_ALL, 128 * KiB))
"""(collective, bytes of the full buffer) :func:`measure_functional_premium` times: the in-step
points and expert parallel's all-to-all of tokens."""

FUNCTIONAL_SMALL = 4 * KiB
"""The small size :func:`measure_functional_premium` times besides :data:`FUNCTIONAL_POINTS`' (a
step's scalars and norms: tensor parallel's all-reduces of 0.5-1 KiB)."""


def measure_functional_premium(ranks: Sequence[int], *, repeats: int = 100) -> dict[str, float] | None:
    """How much longer a collective of two ranks of one host (the first two of ``ranks``) takes
    issued as tensor and expert parallel issue it than as the sweep times it: per
    ``"kind/dtype/bytes"`` of :data:`FUNCTIONAL_POINTS` (and each kind at :data:`FUNCTIONAL_SMALL`)
    × :data:`FUNCTIONAL_DTYPES`, a functional collective
    (``torch.distributed._functional_collectives``, what DTensor calls) on an activation-shaped
    tensor (1, tokens, 256), gathered or scattered along its tokens (dimension 1, as sequence
    parallel's; an all-to-all of its rows, as expert parallel's) and waited for at once, less
    the sweep's plain c10d call on a flat float32 buffer of the same bytes (the bytes a trace's
    record holds: :class:`~topomesh.trace.graph.CollectiveRecord`); both after a barrier and
    timed from the last rank's arrival (:func:`_stamped_s`). Call on every rank of the world;
    returns on ``ranks[0]``, None on the others.

    Measured first (two gloo ranks, 2-vCPU Xeon, 2026-11-27; 128 KiB, after a barrier / after
    1.5 ms of compute): a reduce-scatter as c10d on float32 0.33-0.60 / 0.83-0.97 ms, functional
    on bfloat16 along dimension 1 0.91-0.97 / 1.39-1.45 ms; an all-gather 0.34-0.50 / 0.50-0.58
    against 0.48-0.49 / 0.75-0.86. A real ``tp=2`` step's reduce-scatters took 1.41 ms and its
    all-gathers 0.85 from the last arrival. DTensor's own host work around the call (its
    redistribution plan, on a fake group: :func:`~topomesh.cost.dispatch.measure_dtensor_collective_s`)
    is not in either call, and the functional wrapper's (tens of microseconds) is in both that
    and this."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from topomesh.layout import groups as tm_groups

    me = dist.get_rank()
    pair = tuple(ranks[:2])
    pg = tm_groups.new_group(pair)  # every rank makes it; None: the world
    group = pg if pg is not None else dist.group.WORLD  # what functional collectives take
    out: dict[str, float] = {}
    if me in pair:
        for kind, nbytes in [(k, b) for k, big in FUNCTIONAL_POINTS for b in (FUNCTIONAL_SMALL, big)]:
            inp, buf = _buffers(kind, nbytes, 2, "cpu")
            plain = _op(kind, inp, buf, pg, pair, me)
            for _ in range(3):
                plain()
            base = _stamped_s(plain, None, 0, repeats, pg)
            for name in FUNCTIONAL_DTYPES:
                dtype = getattr(torch, name)
                tokens = max(2, nbytes // (256 * dtype.itemsize)) // 2 * 2
                full = torch.ones(1, tokens, 256, dtype=dtype)
                issue = _functional_op(funcol, kind, full, group)
                for _ in range(3):
                    issue()
                out[f"{kind.value}/{name}/{nbytes}"] = _stamped_s(issue, None, 0, repeats, pg) - base
    dist.barrier()
    return out if me == pair[0] else None


CPU_SHARE_POINTS = ((CollectiveKind.ALL_GATHER, 128 * KiB), (CollectiveKind.REDUCE_SCATTER, 128 * KiB),
                    (CollectiveKind.ALL_REDUCE, 256 * KiB), (CollectiveKind.ALL_GATHER, 4 * MiB),
                    (CollectiveKind.REDUCE_SCATTER, 4 * MiB))
"""(collective, bytes of the full buffer) :func:`measure_collective_cpu_share` times: tensor
parallel's activations and an FSDP2 unit's parameters."""


def measure_collective_cpu_share(ranks: Sequence[int], *, repeats: int = 50) -> dict[str, float] | None:
    """The share of a collective's time that two ranks of one host (the first two of ``ranks``)
    spend on a core: per point of :data:`CPU_SHARE_POINTS`, ``repeats`` calls back to back after
    a barrier, each rank's process CPU time (every thread: gloo's own run the transfer) over
    its wall time, averaged over the points and the two ranks; the rest of the time they wait
    for each other or for the socket, leaving the core to another rank
    (:attr:`~topomesh.cost.cluster.Cluster.collective_cpu_share`). Call on every rank of the
    world; returns ``{"2": share}`` on ``ranks[0]``, None on the others.

    Two gloo ranks on the 2-vCPU EPYC VM, 2026-12-08, 200 calls a point: all-reduce of 4 KiB /
    128 KiB / 1 MiB / 4 MiB 64 / 62 / 67 / 70 %, all-gather 67 / 69 / 75 / 77 %."""
    import torch
    import torch.distributed as dist

    from topomesh.layout import groups as tm_groups

    me = dist.get_rank()
    pair = tuple(ranks[:2])
    pg = tm_groups.new_group(pair)  # every rank makes it; None: the world
    shares = torch.zeros(len(CPU_SHARE_POINTS), dtype=torch.float64)
    if me in pair:
        for i, (kind, nbytes) in enumerate(CPU_SHARE_POINTS):
            inp, buf = _buffers(kind, nbytes, 2, "cpu")
            call = _op(kind, inp, buf, pg, pair, me)
            for _ in range(3):
                call()
            dist.barrier(group=pg)
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(repeats):
                call()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            shares[i] = min(1.0, cpu / wall) if wall > 0 else 1.0
        dist.all_reduce(shares, group=pg)
    dist.barrier()
    return {"2": float(shares.mean()) / 2} if me == pair[0] else None


def _functional_op(funcol: Any, kind: CollectiveKind, full: Any, pg: Any) -> Callable[[], None]:
    """``kind`` as DTensor issues it on ``full`` (an all-gather of its first half along dimension 1),
    waited for."""
    # torch 2.13 renamed them *_single (what DTensor calls there); older releases only have these
    all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    if kind is CollectiveKind.ALL_GATHER:
        half = full[:, : full.shape[1] // 2].contiguous()
        return lambda: funcol.wait_tensor(all_gather(half, gather_dim=1, group=pg))
    if kind is CollectiveKind.REDUCE_SCATTER:
        return lambda: funcol.wait_tensor(reduce_scatter(full, "sum", scatter_dim=1, group=pg))
    if kind is CollectiveKind.ALL_TO_ALL:  # expert parallel's: tokens (rows) split evenly
        rows = full.reshape(-1, full.shape[-1])
        return lambda: funcol.wait_tensor(funcol.all_to_all_single(rows, None, None, group=pg))
    return lambda: funcol.wait_tensor(funcol.all_reduce(full, "sum", group=pg))


def _stamped_s(fn: Callable[[], None], chain: Callable[[int], None] | None, k: int, repeats: int, pg: Any) -> float:
    """:func:`after_last_arrival` of ``repeats`` calls of ``fn`` on the ranks of ``pg`` (the
    same on each): each after a barrier (``chain`` None), else in a loop of [``fn()``,
    ``chain(k)``] between two barriers. Stamps are the host's monotonic clock, one for the
    processes of a host."""
    import torch
    import torch.distributed as dist

    arrived, ended = [], []
    dist.barrier(group=pg)
    for _ in range(repeats):
        if chain is None:
            dist.barrier(group=pg)
        arrived.append(_monotonic())
        fn()
        ended.append(_monotonic())
        if chain is not None:
            chain(k)
    dist.barrier(group=pg)
    stamps = torch.tensor([arrived, ended], dtype=torch.float64)
    every = [torch.zeros_like(stamps) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(every, stamps, group=pg)
    return after_last_arrival([t[0].tolist() for t in every], [t[1].tolist() for t in every])


def after_last_arrival(arrivals: Sequence[Sequence[float]], ends: Sequence[Sequence[float]]) -> float:
    """The mean over repeats of how long the ranks' calls ran after the last rank arrived
    (each rank's end less the latest arrival, averaged over ranks): ``arrivals[r][i]`` and
    ``ends[r][i]`` are rank ``r``'s stamps of repeat ``i``, on one clock.

    >>> after_last_arrival([[0.0, 10.0], [1.0, 10.5]], [[3.0, 12.0], [3.0, 13.0]])  # ((2 + 2) / 2 + (1.5 + 2.5) / 2) / 2
    2.0
    """
    repeats = len(arrivals[0])
    return statistics.fmean(
        statistics.fmean(end[i] for end in ends) - max(arr[i] for arr in arrivals) for i in range(repeats)
    )


def stretch_of(alone: Sequence[float], together: Sequence[Sequence[float]]) -> float:
    """``E[the last of the ranks to finish] / E[one rank alone]``: ``together[i]`` holds every
    rank's time for repeat ``i`` (the means: :data:`STATISTIC`).

    >>> stretch_of([2.0, 2.0], [[2.0, 3.0], [2.2, 2.2]])  # (3.0 + 2.2) / 2 / 2.0
    1.3
    """
    return statistics.fmean(max(times) for times in together) / statistics.fmean(alone)


MAX_POOL = 64
"""Most sweeps ``--pool`` fits over (a profile then holds up to 64 sweeps' rows)."""

POOLED_KEYS = ("world_size", "hosts", "devices", "link_source", "sizes_bytes", "collectives", "max_repeats",
               "torch", "statistic", "groups", "rank_cpus", "compute_segment")
"""What two sweeps must share to be pooled into one fit (``meta`` of a profile): the same
ranks, hosts, links, sizes, collectives, repeats, torch, statistic, CPU binding and compute
segment (:data:`COMPUTE_SEGMENT`)."""


def pool_sweeps(old: Any, new: dict[str, Any], keep: int) -> tuple[dict[str, Any], str | None]:
    """``new``'s meta (one sweep just measured) pooled with the newest ``keep - 1`` sweeps of
    ``old`` (a saved profile's meta, or None), and why ``old`` was not pooled (None when it
    was, or when there was nothing to pool).

    A gloo collective's time on a small VM is heavy-tailed (a peer's thread waits for a
    core): three sweeps of 20 repeats a point, taken back to back here, fitted a 2-rank
    all-gather 23-31 % apart and send/recv 44-53 %; with 5 repeats a point, 64-114 %. The
    mean of more repeats is the cure, and repeats spread over separate launches also sample
    what a launch settles once (where its threads run). The pooled meta keeps every sweep's
    rows in ``samples``, in order, and per sweep in ``sweeps`` when it was measured, how many
    rows it holds, its compute stretch, its :func:`measure_collective_in_step` (two ranks,
    pairs of the host's ranks stepping together, all of them) and its
    :func:`~topomesh.cost.pipeline.measure_pipeline_action`, :func:`measure_functional_premium` and
    :func:`measure_collective_cpu_share`; ``compute_stretch``, ``collective_in_step_s``,
    ``collective_in_step_pairs_s``, ``collective_in_step_node_s``, ``pipeline_action_s``,
    ``functional_premium_s`` and ``collective_cpu_share`` are the means of the sweeps'.

    >>> one = {"measured_at": "t1", "samples": [["all_reduce", "SHM", 2, 8, 1.0]],
    ...        "compute_stretch": {"2": 1.2}, "world_size": 2}
    >>> two = {**one, "measured_at": "t2", "compute_stretch": {"2": 1.4}}
    >>> meta, why = pool_sweeps(one, two, keep=4)
    >>> why, [s["measured_at"] for s in meta["sweeps"]], round(meta["compute_stretch"]["2"], 2), len(meta["samples"])
    (None, ['t1', 't2'], 1.3, 2)
    >>> pool_sweeps(one, {**two, "world_size": 4}, keep=4)[1]
    'it measured world_size 2, this sweep 4'
    """
    this = _sweep_entry(new)
    alone = {**new, "sweeps": [this]}
    if keep < 2 or old is None:
        return alone, None
    reason = _unpoolable(old, new)
    if reason:
        return alone, reason
    rows = old["samples"]
    sweeps = old.get("sweeps") or [_sweep_entry(old)]  # a profile from before pooling: one sweep
    starts = [0]
    for sw in sweeps:
        starts.append(starts[-1] + sw["points"])
    kept = sweeps[-(keep - 1):]
    rows = rows[starts[len(sweeps) - len(kept)]:] + list(new["samples"])
    kept = [*kept, this]
    return {**new, "samples": rows, "sweeps": kept,
            "compute_stretch": _mean_per_key([sw.get("compute_stretch") for sw in kept]),
            "collective_in_step_s": _mean_per_key([sw.get("collective_in_step_s") for sw in kept]) or None,
            "collective_in_step_pairs_s": _mean_per_key([sw.get("collective_in_step_pairs_s") for sw in kept]) or None,
            "collective_in_step_node_s": _mean_per_key([sw.get("collective_in_step_node_s") for sw in kept]) or None,
            "pipeline_action_s": _mean_per_key([sw.get("pipeline_action_s") for sw in kept]) or None,
            "functional_premium_s": _mean_per_key([sw.get("functional_premium_s") for sw in kept]) or None,
            "collective_cpu_share": _mean_per_key([sw.get("collective_cpu_share") for sw in kept]) or None}, None


def _sweep_entry(meta: dict[str, Any]) -> dict[str, Any]:
    """What ``meta.sweeps`` keeps of a one-sweep profile's ``meta``."""
    return {"measured_at": meta.get("measured_at"), "points": len(meta["samples"]),
            "compute_stretch": meta.get("compute_stretch") or {}, "sweep_seconds": meta.get("sweep_seconds"),
            "collective_in_step_s": meta.get("collective_in_step_s"),
            "collective_in_step_pairs_s": meta.get("collective_in_step_pairs_s"),
            "collective_in_step_node_s": meta.get("collective_in_step_node_s"),
            "pipeline_action_s": meta.get("pipeline_action_s"),
            "functional_premium_s": meta.get("functional_premium_s"),
            "collective_cpu_share": meta.get("collective_cpu_share")}


def _mean_per_key(dicts: Sequence[Any]) -> dict[str, float]:
    """Per key, the mean of the finite numbers the ``dicts`` hold for it (other entries skipped).

    >>> _mean_per_key([{"a": 1.0, "b": 2.0}, None, {"a": 3.0, "b": "x"}])
    {'a': 2.0, 'b': 2.0}
    """
    values: dict[str, list[float]] = {}
    for d in dicts:
        for key, v in (d.items() if isinstance(d, dict) else ()):
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                values.setdefault(str(key), []).append(float(v))
    return {key: statistics.fmean(v) for key, v in values.items()}


def _unpoolable(old: Any, new: dict[str, Any]) -> str | None:
    """Why a saved profile's ``meta`` cannot be pooled with ``new`` (None when it can): it was
    measured otherwise (:data:`POOLED_KEYS`) or its rows do not add up to its sweeps."""
    if not isinstance(old, dict):
        return "it has no meta"
    for key in POOLED_KEYS:
        if old.get(key) != new.get(key):
            return f"it measured {key} {old.get(key)}, this sweep {new.get(key)}"
    rows, sweeps = old.get("samples"), old.get("sweeps")
    if not isinstance(rows, list) or not all(_is_row(r) for r in rows):
        return "its samples are not [collective, link, group size, bytes, seconds] rows"
    if sweeps is not None and not (
            isinstance(sweeps, list) and sweeps
            and all(isinstance(sw, dict) and type(sw.get("points")) is int and sw["points"] >= 0 for sw in sweeps)
            and sum(sw["points"] for sw in sweeps) == len(rows)):
        return "its sweeps do not add up to its samples"
    return None


_KINDS = frozenset(k.value for k in CollectiveKind)
_LINKS = frozenset(k.value for k in LinkKind)


def _is_row(row: Any) -> bool:
    return (isinstance(row, list) and len(row) == 5 and row[0] in _KINDS
            and row[1] in _LINKS and type(row[2]) is int and type(row[3]) is int
            and isinstance(row[4], int | float) and math.isfinite(row[4]) and row[4] >= 0)


def points_per_rank0(cfg: SweepConfig, groups: Sequence[GroupSpec]) -> int:
    total = 0
    for g in groups:
        kinds = [k for k in cfg.collectives if k is not CollectiveKind.SEND_RECV or len(g.ranks) == 2]
        total += len(kinds) * len(cfg.sizes())
    return total


def mean_points(samples: Sequence[Sample]) -> list[Sample]:
    """One sample per point (collective, link, group size, bytes): the mean of its samples'
    seconds, in first-seen order.

    Pooled sweeps repeat every point once per sweep, each a mean of the same number of
    repeats, so their mean is the mean of all the repeats (:data:`STATISTIC`). Fitting the
    repeated points instead would not: the fit minimizes *relative* error, and for one size
    measured t1..tk that lands on sum(1/t) / sum(1/t**2), below the mean wherever they differ.
    Here eight pooled sweeps, fitted point by point, priced ``tp=2``'s step's collectives at
    159 ms, below seven of the eight sweeps fitted alone (125-205 ms, mean 178).

    >>> from dataclasses import replace
    >>> a = Sample(collective=CollectiveKind.ALL_REDUCE, link=LinkKind.SHM, group_size=2, nbytes=8, seconds=1.0)
    >>> [s.seconds for s in mean_points([a, replace(a, seconds=3.0), replace(a, nbytes=16)])]
    [2.0, 1.0]
    """
    points: dict[tuple[CollectiveKind, LinkKind, int, int], list[float]] = {}
    for s in samples:
        points.setdefault((s.collective, s.link, s.group_size, s.nbytes), []).append(s.seconds)
    return [Sample(collective=c, link=k, group_size=g, nbytes=b, seconds=statistics.fmean(t))
            for (c, k, g, b), t in points.items()]


def fit_profile(samples: Sequence[Sample], *, name: str, backend: str, fingerprint: str,
                meta: dict[str, Any]) -> tuple[CollectiveProfile, dict[str, str]]:
    """Fit every (collective, link) of ``samples`` on each point's mean (:func:`mean_points`);
    returns the profile and what could not be fitted."""
    groups: dict[tuple[CollectiveKind, LinkKind], list[Sample]] = {}
    for s in mean_points(samples):
        groups.setdefault((s.collective, s.link), []).append(s)
    models, skipped = {}, {}
    for key, ss in groups.items():
        try:
            models[key] = fit_collective(ss, source=f"measured: {len(ss)} points, {backend}")
        except CalibrationError as exc:
            skipped[f"{key[0].value}/{key[1].value}"] = str(exc)
    prof = CollectiveProfile(name=name, backend=backend, source="topomesh calibrate", models=models,
                             cluster_fingerprint=fingerprint, meta=meta)
    return prof, skipped


def cluster_fingerprint(ranks: Sequence[tuple[str, str]], backend: str) -> str:
    """sha1 over (host, device name) per rank and the backend: same cluster shape, same id."""
    blob = json.dumps({"backend": backend, "ranks": sorted(map(list, ranks))}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def profile_directory(root: Path | None = None) -> Path:
    """Where ``topomesh calibrate`` saves a profile without ``--output`` and the ``local``
    cluster reads them: ``<cache dir>/collectives``, each level created 0700 and refused when
    another user could write it (:func:`~topomesh.cost.devices.private_cache_dir`): the
    simulator trusts what it reads there."""
    return private_cache_dir("collectives", root=root)


def default_profile_path(fingerprint: str) -> Path:
    return profile_directory() / f"{fingerprint}.json"


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-bytes", type=int, default=1 * KiB, help="smallest message (default 1 KiB)")
    p.add_argument("--max-bytes", type=int, default=64 * MiB, help="largest message (default 64 MiB)")
    p.add_argument("--factor", type=int, default=2, help="ratio between sizes (default 2)")
    p.add_argument("--collectives", default=",".join(k.value for k in ALL_COLLECTIVES),
                   help="comma-separated subset of " + ", ".join(k.value for k in ALL_COLLECTIVES))
    p.add_argument("--max-group", type=int, default=None, help="largest group size (default: the world)")
    p.add_argument("--max-repeats", type=int, default=20)
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: nccl when CUDA is available, else gloo")
    p.add_argument("--output", type=Path, default=None,
                   help="profile JSON to write (default: the cache dir, by cluster fingerprint)")
    p.add_argument("--pool", type=int, default=1, metavar="N",
                   help="fit over this sweep and the newest N-1 saved in the output profile, where they were "
                        "measured the same way (default 1: this sweep alone)")
    p.add_argument("--result-file", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    try:
        kinds = tuple(CollectiveKind(k.strip()) for k in args.collectives.split(",") if k.strip())
    except ValueError as exc:
        raise CalibrationError(f"--collectives: {exc}") from None
    if not 1 <= getattr(args, "pool", 1) <= MAX_POOL:
        raise CalibrationError(f"--pool must be 1 to {MAX_POOL} sweeps, got {args.pool}")
    return SweepConfig(min_bytes=args.min_bytes, max_bytes=args.max_bytes, factor=args.factor,
                       collectives=kinds, max_group=args.max_group, max_repeats=args.max_repeats,
                       min_repeats=min(3, args.max_repeats))


def worker(args: argparse.Namespace) -> dict[str, Any] | None:
    """The per-rank body: init the process group, sweep, and on rank 0 fit and save."""
    import torch
    import torch.distributed as dist

    from topomesh.topology.discover import allowed_cpus

    cfg = config_from_args(args)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise CalibrationError(
            "RANK/WORLD_SIZE are not set: run under torchrun or `topomesh launch` "
            "(… -m topomesh.cost.calibrate), or use `topomesh calibrate --local N`"
        )
    if args.output is None and os.environ["RANK"] == "0":
        profile_directory()  # a cache directory we may not use fails here, not after the sweep
    backend = args.backend if args.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    device = "cpu"
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    started = time.perf_counter()
    dist.init_process_group(backend)
    try:
        me = dist.get_rank()
        dev_name = torch.cuda.get_device_name(device) if device != "cpu" else "cpu"
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, (socket.gethostname(), dev_name))
        hosts, link_of, link_source = _hosts_and_links([h for h, _ in ranks], "cpu" if device == "cpu" else "cuda")
        groups = plan_groups(hosts, link_of, cfg.max_group)
        if not groups:
            raise CalibrationError(f"a world of {len(hosts)} rank(s) has no group of 2 or more to measure")
        samples = _sweep_with_progress(cfg, groups, device, show=me == 0 and not args.no_progress)
        # ranks sharing a host's cores (CPU): how much their concurrent compute stretches
        local = [r for r, h in enumerate(hosts) if h == hosts[0]]
        stretch = measure_compute_stretch(local) if device == "cpu" else {}
        pair = device == "cpu" and len(local) >= 2  # two ranks of one host computing on its cores
        in_step = measure_collective_in_step(local) if pair else None
        # where the host has more than two ranks: pairs while all of them step, and a group of all
        more = pair and len(local) > 2
        in_step_pairs = measure_collective_in_step(local, together=True) if more else None
        in_step_node = measure_collective_in_step(local, count=len(local)) if more else None
        pipe = measure_pipeline_action(local) if pair else None
        handoff = measure_pipeline_handoff(local) if pair else None  # every rank: it ends in a barrier
        if pipe is not None:  # rank 0's; "handoff" (ddb19bc-b88b3b0) held the step's slope, not read
            pipe["handoff_wait"] = handoff
        functional = measure_functional_premium(local) if pair else None
        cpu_share = measure_collective_cpu_share(local) if pair else None
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, samples)
        rank_cpus: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rank_cpus, allowed_cpus())
        if me != 0:
            return None
        all_samples = [s for part in gathered for s in part]
        fp = cluster_fingerprint([tuple(r) for r in ranks], backend)
        elapsed = time.perf_counter() - started
        meta = {
            "world_size": len(hosts), "hosts": sorted(set(hosts)), "devices": sorted({d for _, d in ranks}),
            "link_source": link_source, "sizes_bytes": cfg.sizes(), "collectives": [k.value for k in cfg.collectives],
            "max_repeats": cfg.max_repeats, "torch": torch.__version__, "statistic": STATISTIC,
            "compute_stretch": stretch, "compute_stretch_segments_s": list(STRETCH_SEGMENTS_S),
            "compute_segment": COMPUTE_SEGMENT,
            "collective_in_step_s": in_step,
            "collective_in_step_pairs_s": in_step_pairs,
            "collective_in_step_node_s": in_step_node,
            "pipeline_action_s": pipe,
            "functional_premium_s": functional,
            "collective_cpu_share": cpu_share,
            "rank_cpus": rank_cpus,
            "measured_at": time.strftime(MEASURED_AT, time.gmtime()),
            "groups": [{"ranks": list(g.ranks), "link": g.link.value, "scope": g.scope} for g in groups],
            "samples": [[s.collective.value, s.link.value, s.group_size, s.nbytes, s.seconds] for s in all_samples],
            "sweep_seconds": elapsed,
        }
        out = Path(args.output or default_profile_path(fp))
        meta, not_pooled = pool_sweeps(_saved_meta(out, fp) if args.pool > 1 and out.exists() else None, meta,
                                       args.pool)
        pooled = [Sample(collective=CollectiveKind(c), link=LinkKind(k), group_size=g, nbytes=b, seconds=float(t))
                  for c, k, g, b, t in meta["samples"]]
        prof, skipped = fit_profile(pooled, name=f"calibrated-{fp}", backend=backend, fingerprint=fp, meta=meta)
        prof_dict = prof.to_dict()
        write_json_atomic(out, prof_dict)
        result = {"profile": str(out), "cluster_fingerprint": fp, "sweep_seconds": elapsed,
                  "sweeps": len(meta["sweeps"]), "not_pooled": not_pooled,
                  "models": list(prof_dict["models"]), "skipped": skipped}
        if args.result_file:
            write_json_atomic(args.result_file, result)
        return result
    finally:
        dist.destroy_process_group()


def _saved_meta(path: Path, fingerprint: str) -> Any:
    """The meta of the profile saved at ``path`` to pool with (None where it is another
    cluster's or not a profile: it is then replaced, as without ``--pool``)."""
    from topomesh.topology.api import read_json

    try:
        raw = read_json(path, what="collective profile", error=CalibrationError)
    except CalibrationError:
        return None
    return raw.get("meta") if isinstance(raw, dict) and raw.get("cluster_fingerprint") == fingerprint else None


def _sweep_with_progress(cfg: SweepConfig, groups: Sequence[GroupSpec], device: str, *, show: bool) -> list[Sample]:
    if not show:
        return run_sweep(cfg, groups, device)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("calibrate"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), TextColumn("{task.description}"),
                  console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task("", total=points_per_rank0(cfg, groups))
        return run_sweep(cfg, groups, device, progress=lambda d: bar.update(task, advance=1, description=d))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def died_of_signal(returncode: int, output: str) -> str | None:
    """The signal that killed the child or one of the processes it launched (a negative exit
    code, or torchrun's report of a worker's), as its name, else None.

    >>> died_of_signal(-6, ""), died_of_signal(1, "traceback : Signal 11 (SIGSEGV) received by PID 7")
    ('SIGABRT', 'SIGSEGV')
    >>> died_of_signal(1, "exitcode  : -6 (pid: 9)"), died_of_signal(1, "RuntimeError: boom"), died_of_signal(0, "")
    ('SIGABRT', None, None)
    """
    number = -returncode if returncode < 0 else None
    if number is None and returncode != 0:
        hit = re.search(r"Signal (\d+) \(SIG\w+\) received|exitcode\s*:\s*-(\d+)", output)
        number = int(hit.group(1) or hit.group(2)) if hit else None
    if number is None:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def spawn_local(nproc: int, worker_argv: Sequence[str], *, timeout_s: float = 600.0,
                threads_per_proc: int = 1) -> dict[str, Any]:
    """Run ``nproc`` calibration workers on this host over loopback (gloo) and wait for them.

    Returns rank 0's result. Workers are this module run as ``python -m``; rank 0's stderr
    (the progress bar) is passed through, the others' is kept and shown on failure.
    """
    import subprocess
    import tempfile

    if nproc < 2:
        raise CalibrationError(f"--local needs at least 2 processes to measure a collective, got {nproc}")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="topomesh-calibrate-") as tmp:
        result_file = Path(tmp) / "result.json"
        procs: list[subprocess.Popen[bytes]] = []
        logs = []
        try:
            for rank in range(nproc):
                env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc),
                       "GROUP_RANK": "0", "OMP_NUM_THREADS": str(threads_per_proc)}
                extra = ["--result-file", str(result_file)] if rank == 0 else ["--no-progress"]
                log = open(Path(tmp) / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
                logs.append(log)
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "topomesh.cost.calibrate", *worker_argv, *extra], env=env,
                    stdout=log, stderr=None if rank == 0 else log))
            deadline = time.monotonic() + timeout_s
            codes = {}
            while len(codes) < nproc:
                for rank, proc in enumerate(procs):
                    if rank not in codes and proc.poll() is not None:
                        codes[rank] = proc.returncode
                if any(c != 0 for c in codes.values()) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            for log in logs:
                log.close()
        bad = {r: c for r, c in codes.items() if c != 0}
        if bad or len(codes) < nproc:
            rank = next(iter(bad), None)
            tail = ""
            if rank is not None:
                tail = (Path(tmp) / f"rank{rank}.log").read_text(errors="replace").strip().splitlines()[-5:]
                tail = " | ".join(tail)
            what = f"timed out after {timeout_s} s"
            if rank is not None:  # a signal: SIGABRT where native code found its heap corrupt
                killed = died_of_signal(bad[rank], "")
                what = f"rank {rank} was killed by {killed}" if killed else f"rank {rank} exited with {bad[rank]}"
            raise CalibrationError(f"local calibration failed: {what}. {tail}".strip())
        return json.loads(result_file.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m topomesh.cost.calibrate",
                                     description="Per-rank collective calibration (run under torchrun).")
    add_sweep_arguments(parser)
    args = parser.parse_args(argv)
    try:
        result = worker(args)
    except CalibrationError as exc:
        print(f"topomesh calibrate: error: {exc}", file=sys.stderr)
        return 2
    if result is not None:
        print(f"wrote {result['profile']} ({result['sweep_seconds']:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown, as the validate worker does: a joinable C++ thread of gloo
    # destroyed there aborted a rank that had finished ("terminate called without an active
    # exception", exit -6) in about one calibration of ten here, after the profile was written.
    os._exit(code)
