"""Clusters: the world a layout is simulated on — topology, device spec, collective profile.

A :class:`Cluster` is a :class:`~topomesh.topology.model.Topology` (the same model the
runtime writes, so placement and link lookup are the real ones), the
:class:`~topomesh.cost.devices.DeviceSpec` of its ranks and the
:class:`~topomesh.cost.collectives.CollectiveProfile` that prices its collectives.

* Presets (``data/clusters/*.json``, every number cited there): ``dgx-a100-80gb``,
  ``dgx-h100``, ``dgx-h200`` — one node built with :func:`build_topology` and repeated to
  ``gpus`` ranks — and ``local``: this machine, measured (:func:`load_cluster`).
* Any file ``topomesh show`` reads, with the device by name or detected
  (:func:`cluster_from_topology`).

:func:`axis_link` says what the groups of one mesh axis (or of several flattened axes)
cross on the placed layout: the slowest link kind, how many nodes a group spans, how many
of its members share a node, and the bandwidth the group gets. Inside a node that is the
link's bandwidth; across nodes it is the rail share — every group of the axis runs the
same collective at once, so the ranks of a node share its NICs::

    bandwidth = NIC line rate × NICs per node × ranks_per_node / ranks on the node

(DGX A100, 8 × 25 GB/s HDR, 8 ranks per node: a dp group with one rank per node gets one
NIC, 25 GB/s; a group with all 8 ranks of each node gets all 8 NICs, 200 GB/s.)
:func:`group_collective_time_s` prices a collective on such a group.
"""

from __future__ import annotations

import json
import math
import operator
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from topomesh.cost.calibrate import profile_directory
from topomesh.cost.collectives import (
    CollectiveProfile,
    builtin_profile,
    builtin_profile_names,
    collective_time_s,
    hierarchical_time_s,
    load_profile,
)
from topomesh.cost.devices import (
    DeviceSpec,
    builtin_specs,
    cpu_spec,
    device_by_fingerprint,
    device_spec,
)
from topomesh.errors import CalibrationError, ClusterError
from topomesh.layout.dims import Axis
from topomesh.layout.place import Placement
from topomesh.topology.api import read_source
from topomesh.topology.build import build_topology, default_placement
from topomesh.topology.model import (
    Connection,
    Device,
    DeviceKind,
    Host,
    LinkKind,
    Nic,
    NicKind,
    RankInfo,
    Topology,
)
from topomesh.topology.model import (
    Path as HostPath,
)
from topomesh.trace.graph import CollectiveKind

GPUS_MAX = 1_048_576
"""Largest world a cluster is built for (2^20 ranks)."""

LOCAL = "local"


def cores_share(ranks: float, threads: int, cores: int) -> float:
    """How many times slower CPU work runs with ``ranks`` ranks of ``threads`` threads busy on
    ``cores`` cores than on cores of its own (at least 1): what :attr:`Cluster.core_share` and
    :meth:`Cluster.cores_share_at` price with, and what the calibration takes a collective's
    sweep time at beside other ranks (:func:`topomesh.cost.calibrate.measure_collective_in_step`).

    >>> cores_share(4, 1, 2), cores_share(1.5, 3, 2), cores_share(2, 1, 8)
    (2.0, 2.25, 1.0)
    """
    return max(1.0, ranks * threads / cores)


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """A world to simulate on: topology, device, collective profile."""

    name: str
    topology: Topology
    """The N-rank world, the model the runtime writes (``WORLD_TOPOLOGY_FILE``)."""
    device: DeviceSpec
    """The spec of every rank's device."""
    profile: CollectiveProfile
    """Prices collectives per link kind (with a fallback profile for kinds it lacks)."""
    gpus_per_node: int
    """Ranks on one node."""
    source: str
    """Where the cluster came from: the preset's data file, or the topology file."""
    cores: int | None = None
    """CPU cores the ranks of a node share for their work (the ``local`` cluster: CPU processes);
    None where every rank has a device of its own (GPUs)."""
    threads_per_rank: int = 1
    """Compute threads each rank runs (torch threads) when ranks share ``cores``."""
    collectives_share_compute: bool = False
    """Collectives run on the cores that compute (gloo on CPU: its threads copy and reduce the
    data), so they do not overlap compute and take cores as compute does; False for GPUs,
    whose collectives run on the copy engines / NICs beside the compute stream."""
    dtensor_dispatch_s: float = 0.0
    """Host seconds DTensor's dispatch adds to each op run on DTensors, on the computing
    thread (:mod:`topomesh.cost.dispatch`, measured for ``local``); 0 for GPU presets, whose
    host issues kernels ahead of the device."""
    dtensor_collective_s: float = 0.0
    """Host seconds each collective DTensor issues (a ``_c10d_functional`` record) costs on the
    computing thread besides its transfer (:func:`topomesh.cost.dispatch.measure_dtensor_collective_s`,
    measured for ``local``); 0 for GPU presets, as :attr:`dtensor_dispatch_s`."""
    dtensor_block_dispatch_s: float = 0.0
    dtensor_rest_dispatch_s: float = 0.0
    """Where measured (``local``), what each forward or backward op on DTensors costs the
    computing thread under tensor parallel, inside the blocks and outside them (embedding,
    final norm, head and the vocabulary-parallel loss), in place of :attr:`dtensor_dispatch_s`
    for those phases: the built-in model's own TP step at a tiny width, minus the plain model
    and the collectives' host work, per traced op (:func:`topomesh.cost.dispatch.measure_tp_host_s`).
    It holds what a chain of one op does not: the parallel styles' hooks, layouts and
    redistributions, autograd around them, the loss's many small ops. 0: not measured."""
    fb_host_s: float | None = None
    """Where ``validate`` measured it on the layout's own eager step
    (:func:`topomesh.sim.price.with_fb_host`): what each traced forward or backward op costs the
    computing thread beyond the op itself (DTensor's dispatch, the parallel styles', expert
    parallel's and checkpointing's hooks, autograd around them), negative where the eager step
    ran its ops for less than their replay (:func:`topomesh.cost.instep.in_step_times`); it takes
    the place of :attr:`dtensor_block_dispatch_s` and ``_rest_`` for those phases. None: not
    measured."""
    fsdp_reduce_s: float = 0.0
    """Host seconds an FSDP2 unit's hooks and reduction cost on the computing thread per forward
    and backward, paid per reduction FSDP2 issues (a ``c10d.`` reduce-scatter or all-reduce
    record in backward) (:func:`topomesh.cost.dispatch.measure_fsdp_host_s`, measured for
    ``local``); 0 for GPU presets, as :attr:`dtensor_dispatch_s`."""
    fsdp_gather_s: float = 0.0
    """Host seconds an FSDP2 all-gather (a ``c10d.`` all-gather record) adds, as :attr:`fsdp_reduce_s`."""
    backward_split: tuple[float, float] | None = None
    """Measured where the ranks compute on CPUs (``local``): what a zero-bubble schedule's
    backward for inputs (I) and for weights (W) cost as shares of a full backward of the same
    piece, as PyTorch's ``stage_backward_input`` and ``stage_backward_weight`` run them
    (:func:`topomesh.cost.dispatch.measure_split_shares`; about 0.9 and 0.3 here). None: the
    simulator's split (W half the backward matmuls, I the rest; GPU presets)."""
    compute_stretch: float | None = None
    """Measured where ranks share a host's cores (``local``): how many times longer compute takes
    until every rank of the node has finished it, all running it at once, than on one rank alone
    (:func:`topomesh.cost.calibrate.measure_compute_stretch`). It holds what a lock-step model
    misses, ranks reaching a collective at different times, and on more ranks than cores their
    taking turns; where set it prices compute and host work instead of :attr:`core_share`
    (:attr:`compute_share`). None: not measured (GPU presets; a profile from before it)."""
    compute_stretches: tuple[tuple[int, float], ...] = ()
    """Every ``(rank count, stretch)`` the calibration measured on the node (:attr:`compute_stretch`
    is the one of all its ranks): what :meth:`lock_step_stretch` reads for a pipeline stage's
    ranks. Empty: not measured."""
    collective_cpu_share: float | None = None
    """Measured where collectives run on the computing cores (``local``): the share of a
    collective's time its ranks' processes spend on a core
    (:func:`topomesh.cost.calibrate.measure_collective_cpu_share`: 0.62-0.77 with gloo here);
    the rest they wait, leaving the core to a rank that computes. What a pipeline's ranks on
    shared cores take of each other (:func:`topomesh.sim.shared.shared_pipeline`). None: not
    measured (GPU presets; a profile from before it): a collective holds its core throughout."""
    collective_in_step_s: tuple[tuple[float, float], ...] = ()
    """Measured where collectives run on the computing cores (``local``): (seconds of compute
    before a collective, how much longer it then takes than back to back, as the calibration
    sweep times it), by compute (:func:`topomesh.cost.calibrate.measure_collective_in_step`);
    priced per collective by :meth:`in_step_extra_s`. Empty: not measured (GPU presets; a
    profile from before it)."""
    collective_in_step_pairs_s: tuple[tuple[float, float], ...] = ()
    """The same for a pair of a node's ranks while all of them step in pairs (more than two):
    what it takes more than its calibrated time at :meth:`collective_share`, measured so
    (:func:`topomesh.cost.calibrate.measure_collective_in_step` ``together``). Four ranks on two
    cores: a 128 KiB all-gather after 2 / 8 ms of compute took 1.42 / 3.38 ms with the other
    pair stepping, 0.52 / 0.88 with it idle. Empty: as :attr:`collective_in_step_node_s`."""
    collective_in_step_node_s: tuple[tuple[float, float], ...] = ()
    """The same for a group of all of a node's ranks, where there are more than two, measured
    with all of them (:func:`topomesh.cost.calibrate.measure_collective_in_step` with ``count``):
    four ranks on two cores take turns on the cores, and a collective after compute waits for
    the peers that still compute, 0-5 ms here where two ranks pay under 1. Empty: not measured
    (two ranks a node, GPU presets, a calibration of another rank count)."""
    pipeline_action_s: float = 0.0
    """Measured where ranks compute on CPUs (``local``): host seconds each action of a pipeline
    schedule of one stage a rank (``1f1b``, ``gpipe``) costs the stage's computing thread beyond
    its forward, loss and backward ops (:func:`topomesh.cost.pipeline.measure_pipeline_action`;
    0.12-0.15 ms here in nine sweeps). 0: not measured (GPU presets, whose host issues ahead of
    the kernels; a profile from before it)."""
    pipeline_multi_action_s: float = 0.0
    """As :attr:`pipeline_action_s`, for the schedules of several stages a rank (interleaved,
    zero-bubble, V): 0.17-0.21 ms here."""
    pipeline_handoff_s: float = 0.0
    """Measured where a pipeline's ranks share a host's cores (``local``): what a receive the
    stage posts after its data was sent (a single-stage schedule's steady state: the last stage,
    after each backward, posts the gradient's send with the next forward's receive) costs beyond
    the calibrated send while the ranks compute: its thread waits for a core the peer it woke and
    the gloo threads hold (:func:`topomesh.cost.pipeline.measure_pipeline_handoff`, that wait per
    such receive: 0.64-0.80 ms here with two ranks in the world, 1.0-2.5 ms in a four-rank world).
    0: not measured (GPU presets; a profile from before it)."""
    functional_premium_s: tuple[tuple[str, str, int, float], ...] = ()
    """Measured where collectives run on the computing cores (``local``): (collective, dtype,
    bytes, seconds) a collective issued as a functional collective on an activation (what
    DTensor, so tensor parallel, issues) takes more than the sweep's plain call
    (:func:`topomesh.cost.calibrate.measure_functional_premium`); priced by
    :meth:`functional_premium`. Empty: not measured (GPU presets; a profile from before it)."""
    rail_nics: np.ndarray = field(init=False, repr=False, compare=False)
    """Per host: NICs that some GPU of the host sends through (its rail; at least 1)."""
    ranks_on_host: np.ndarray = field(init=False, repr=False, compare=False)
    """Per host: ranks placed on it."""

    def __post_init__(self) -> None:
        topo = self.topology
        by_class: dict[tuple[int, int], int] = {}  # renamed hosts share these tuples
        rails = np.ones(len(topo.hosts), dtype=np.int64)
        for h, host in enumerate(topo.hosts):
            key = (id(host.nics), id(host.paths))
            if key not in by_class:
                used = {host.nearest_nic(d.id) for d in host.gpus} - {None}
                by_class[key] = max(1, len(used))
            rails[h] = by_class[key]
        object.__setattr__(self, "rail_nics", rails)
        object.__setattr__(self, "ranks_on_host", np.bincount(topo.table.host_of, minlength=len(topo.hosts)))

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def core_share(self) -> float:
        """How many times slower a rank's CPU work runs than on cores of its own: the threads
        of a node's ranks over its ``cores`` (at least 1); 1 without shared cores.

        >>> import dataclasses
        >>> c = load_cluster("dgx-h100", gpus=8)
        >>> c.core_share, dataclasses.replace(c, cores=2, threads_per_rank=1).core_share
        (1.0, 4.0)
        """
        return self.cores_share_at(self.gpus_per_node)

    @property
    def compute_share(self) -> float:
        """How many times longer a rank's compute and host work take here than the op table's
        one-rank times: the measured :attr:`compute_stretch`, else :attr:`core_share`, and never
        less than :attr:`core_share`: ranks that all compute need that many times their work in
        core time. (Until the calibration timed every rank from a common start, a rank that got
        a core only when another finished started late and then timed what it took alone: four
        ranks on two cores measured 1.50-1.88 here, while four one-process steps at once took 2.0
        times one alone; from the common start 2.09-2.31.) Collectives take
        :meth:`collective_share` instead: their calibration already ran every rank of their group
        at once.

        >>> import dataclasses
        >>> c = dataclasses.replace(load_cluster("dgx-h100", gpus=8), cores=2, threads_per_rank=1)
        >>> c.compute_share, dataclasses.replace(c, compute_stretch=4.4).compute_share
        (4.0, 4.4)
        >>> dataclasses.replace(c, compute_stretch=1.5).compute_share  # fewer core-seconds than the work needs
        4.0
        """
        return self.core_share if self.compute_stretch is None else max(self.compute_stretch, self.core_share)

    def collective_share(self, ranks: int) -> float:
        """How many times its calibrated time a collective of ``ranks`` of a node takes while all
        the node's ranks step: :attr:`core_share` over the share its own ranks had when the
        sweep ran them, alone on the node (at least 1). A group of all of them: 1.

        >>> import dataclasses
        >>> c = dataclasses.replace(load_cluster("dgx-h100", gpus=4), cores=2, threads_per_rank=1)
        >>> c.collective_share(2), c.collective_share(4), dataclasses.replace(c, cores=None).collective_share(2)
        (2.0, 1.0, 1.0)
        """
        return self.core_share / self.cores_share_at(ranks)

    def cores_share_at(self, ranks: float) -> float:
        """:attr:`core_share` with ``ranks`` of a node's ranks busy at once (a mean over an
        interval, so fractional) instead of all of them.

        >>> import dataclasses
        >>> c = dataclasses.replace(load_cluster("dgx-h100", gpus=4), cores=2, threads_per_rank=1)
        >>> c.cores_share_at(1.5), c.cores_share_at(3), c.cores_share_at(4) == c.core_share
        (1.0, 1.5, True)
        """
        return 1.0 if self.cores is None else cores_share(ranks, self.threads_per_rank, self.cores)

    def lock_step_stretch(self, ranks: int) -> float:
        """How many times longer ``ranks`` ranks of the node take for compute they run in lock-step
        (meeting at collectives), on cores no one else uses, than one alone: the measured
        stretch of that many ranks (:attr:`compute_stretches`), never below their core share
        (:meth:`cores_share_at`); 1 for one rank.

        >>> import dataclasses
        >>> c = dataclasses.replace(load_cluster("dgx-h100", gpus=4), cores=2, threads_per_rank=1,
        ...                         compute_stretches=((2, 1.12), (4, 1.9)))
        >>> c.lock_step_stretch(1), c.lock_step_stretch(2), c.lock_step_stretch(4), c.lock_step_stretch(3)
        (1.0, 1.12, 2.0, 1.5)
        """
        if ranks <= 1:
            return 1.0
        measured = dict(self.compute_stretches).get(ranks, 0.0)
        return max(measured, self.cores_share_at(ranks))

    def lock_step_loss(self, ranks: float) -> float:
        """What ``ranks`` of the node computing in lock-step lose beyond their share of the
        cores (:meth:`lock_step_stretch` over :meth:`cores_share_at`): 1 for one rank, linear
        between the rank counts measured (fractional counts: a mean over an interval), the
        last one's beyond them; 1 where nothing was measured.

        >>> import dataclasses
        >>> c = dataclasses.replace(load_cluster("dgx-h100", gpus=4), cores=2, threads_per_rank=1,
        ...                         compute_stretches=((2, 1.2), (4, 2.2)))
        >>> [round(c.lock_step_loss(n), 3) for n in (1, 1.5, 2, 3, 4, 8)]
        [1.0, 1.1, 1.2, 1.15, 1.1, 1.1]
        """
        counts = [1, *sorted(n for n, _ in self.compute_stretches if n > 1)]
        losses = [1.0, *(self.lock_step_stretch(n) / self.cores_share_at(n) for n in counts[1:])]
        return float(np.interp(ranks, counts, losses))

    def in_step_extra_s(self, gap_s: float, ranks: int = 2) -> float:
        """What a collective of ``ranks`` of a node costs more after ``gap_s`` seconds of compute,
        as priced (the node's ranks computing at once), than back to back: linear between the
        measured points and (0, 0), the last point's beyond it; 0 where nothing was measured.
        Where the node has more than two ranks and they were measured so, the points of a group
        of all of them (:attr:`collective_in_step_node_s`) or of a pair among them
        (:attr:`collective_in_step_pairs_s`), else :attr:`collective_in_step_s` (two ranks
        alone). A point's gap is one rank's compute alone, which the ranks it was measured on
        took :meth:`lock_step_stretch` times as long to run at once: ``gap_s`` is read at that.

        >>> import dataclasses
        >>> c = dataclasses.replace(load_cluster("dgx-h100", gpus=2),
        ...                         collective_in_step_s=((0.001, 2e-4), (0.004, 8e-4)))
        >>> [round(c.in_step_extra_s(g) * 1e6) for g in (0.0, 0.0005, 0.0025, 0.004, 1.0)]
        [0, 100, 500, 800, 800]
        >>> c4 = dataclasses.replace(c, gpus_per_node=4, collective_in_step_node_s=((0.004, 4e-3),), cores=2,
        ...                          threads_per_rank=1, compute_stretches=((2, 1.25), (4, 2.5)))
        >>> [round(c4.in_step_extra_s(0.005, n) * 1e6) for n in (2, 4)]  # read at 4 ms and 2 ms
        [800, 2000]
        >>> round(dataclasses.replace(c4, collective_in_step_pairs_s=((0.004, 1e-3),)).in_step_extra_s(0.005) * 1e6)
        500
        """
        n, points = self.gpus_per_node, self.collective_in_step_s
        if n > 2 and ranks >= n and self.collective_in_step_node_s:
            points = self.collective_in_step_node_s
        elif n > 2 and ranks == 2 and self.collective_in_step_pairs_s:
            points = self.collective_in_step_pairs_s
        else:
            n = 2  # measured on two ranks alone
        gap_s /= self.lock_step_stretch(n)
        if not points:
            return 0.0
        gaps = [0.0, *(g for g, _ in points)]
        extra = [0.0, *(x for _, x in points)]
        return float(np.interp(gap_s, gaps, extra))

    def functional_premium(self, kind: str, dtype: str, nbytes: int) -> float:
        """:attr:`functional_premium_s` of ``kind`` on ``dtype`` (float32's where ``dtype`` was
        not measured) at ``nbytes``: linear in bytes between the measured sizes, the nearest
        one's outside them; 0 where the kind was not measured.

        >>> import dataclasses
        >>> c = dataclasses.replace(load_cluster("dgx-h100", gpus=2), functional_premium_s=(
        ...     ("reduce_scatter", "bfloat16", 4096, 1e-4), ("reduce_scatter", "bfloat16", 12288, 5e-4),
        ...     ("reduce_scatter", "float32", 4096, 2e-4)))
        >>> [round(c.functional_premium("reduce_scatter", "bfloat16", b) * 1e6) for b in (512, 8192, 10**6)]
        [100, 300, 500]
        >>> round(c.functional_premium("reduce_scatter", "float16", 8192) * 1e6), c.functional_premium("all_gather", "float32", 8)
        (200, 0.0)
        """
        points = [(b, x) for k, d, b, x in self.functional_premium_s if k == kind and d == dtype]
        if not points:
            points = [(b, x) for k, d, b, x in self.functional_premium_s if k == kind and d == "float32"]
        if not points:
            return 0.0
        points.sort()
        return float(np.interp(nbytes, [b for b, _ in points], [x for _, x in points]))

    @property
    def nodes(self) -> int:
        return len(self.topology.hosts)


# ------------------------------------------------------------------ presets


@dataclass(frozen=True, slots=True, kw_only=True)
class NodePreset:
    """One node of a GPU cluster preset, as its data file describes it."""

    name: str
    device: str
    gpus_per_node: int
    gpu_name: str
    gpu_arch: str
    gpu_link: LinkKind
    nvlinks_per_gpu: int
    nics_per_node: int
    nic_kind: NicKind
    nic_speed_Gbps: float
    gpu_nic_path: LinkKind
    profile: str
    source: str

    def host(self, hostname: str = "node0") -> Host:
        """The node as a :class:`Host`: GPUs on ``gpu_link``, GPU i next to NIC i (its rail)."""
        gpus = tuple(Device(id=f"GPU{i}", kind=DeviceKind.GPU, index=i, name=self.gpu_name, arch=self.gpu_arch)
                     for i in range(self.gpus_per_node))
        nics = tuple(Nic(id=f"NIC{i}", name=f"mlx5_{i}", kind=self.nic_kind, speed_Gbps=self.nic_speed_Gbps)
                     for i in range(self.nics_per_node))
        paths = [HostPath(a=a.id, b=b.id, kind=self.gpu_link, nvlink_count=self.nvlinks_per_gpu)
                 for i, a in enumerate(gpus) for b in gpus[i + 1:]]
        paths += [HostPath(a=g.id, b=f"NIC{g.index % len(nics)}", kind=self.gpu_nic_path) for g in gpus if nics]
        return Host(hostname=hostname, devices=gpus, nics=nics, paths=tuple(paths))


def _clusters_root() -> Any:
    return resources.files("topomesh.cost").joinpath("data/clusters")


def cluster_names() -> list[str]:
    """The built-in presets (``dgx-a100-80gb``, ``dgx-h100``, ``dgx-h200``, ``local``)."""
    return sorted(e.name.removesuffix(".json") for e in _clusters_root().iterdir() if e.name.endswith(".json"))


@cache
def node_preset(name: str) -> NodePreset:
    """The GPU node of preset ``name``; raises :class:`ClusterError` for an unknown name."""
    names = cluster_names()
    if name not in names or name == LOCAL:
        gpu = [n for n in names if n != LOCAL]
        raise ClusterError(f"no GPU cluster preset named {name!r}; the presets are {', '.join(gpu)} (and local)")
    path = f"data/clusters/{name}.json"
    raw = json.loads(_clusters_root().joinpath(f"{name}.json").read_text())
    try:
        return NodePreset(
            name=str(raw["name"]), device=str(raw["device"]), gpus_per_node=int(raw["gpus_per_node"]),
            gpu_name=str(raw["gpu_name"]), gpu_arch=str(raw["gpu_arch"]), gpu_link=LinkKind.parse(raw["gpu_link"]),
            nvlinks_per_gpu=int(raw["nvlinks_per_gpu"]), nics_per_node=int(raw["nics_per_node"]),
            nic_kind=NicKind(raw["nic_kind"]), nic_speed_Gbps=float(raw["nic_speed_Gbps"]),
            gpu_nic_path=LinkKind.parse(raw["gpu_nic_path"]), profile=str(raw["profile"]),
            source=f"topomesh/cost/{path}",
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ClusterError(f"cluster preset file {path} is malformed ({exc!r})") from None


def world_shape(gpus: int | None, per_node: int, what: str) -> tuple[int, int]:
    """(nodes, ranks per node) of a world of ``gpus`` ranks built from ``per_node``-rank nodes.

    ``None`` is one full node; at most one node, a partial node; more, a whole number of nodes.

    >>> world_shape(None, 8, "x"), world_shape(4, 8, "x"), world_shape(32, 8, "x")
    ((1, 8), (1, 4), (4, 8))
    """
    if gpus is None:
        return 1, per_node
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ClusterError(f"--gpus for {what} must be a positive whole number, got {gpus!r}")
    if gpus > GPUS_MAX:
        raise ClusterError(f"--gpus {gpus} for {what} is over the largest world topomesh builds ({GPUS_MAX:,} ranks)")
    if gpus <= per_node:
        return 1, gpus
    if gpus % per_node:
        raise ClusterError(
            f"--gpus {gpus} for {what} is not a multiple of its {per_node} GPUs per node; "
            f"use {gpus // per_node * per_node} or {(gpus // per_node + 1) * per_node}"
        )
    return gpus // per_node, per_node


def replicate_node(host: Host, nodes: int, devices: Sequence[str | None], *, source: str) -> Topology:
    """``nodes`` copies of ``host`` numbered host after host (torchrun's order), rank
    ``h·k + i`` on host ``h`` and device ``devices[i]`` (``k = len(devices)``)."""
    k = len(devices)
    hosts = [host.renamed(f"{host.hostname}-{h}") for h in range(nodes)] if nodes > 1 else [host]
    ranks = [RankInfo(rank=h * k + i, host=h, local_rank=i, device=devices[i]) for h in range(nodes) for i in range(k)]
    return build_topology(hosts, ranks, source=source)


def load_cluster(name: str, *, gpus: int | None = None) -> Cluster:
    """A built-in preset with ``gpus`` ranks (``None``: one node).

    GPU presets: the node of ``data/clusters/<name>.json`` repeated ``gpus / gpus_per_node``
    times. ``local``: :func:`local_cluster`.
    """
    if name == LOCAL:
        return local_cluster(gpus=gpus)
    preset = node_preset(name)
    nodes, per_node = world_shape(gpus, preset.gpus_per_node, f"cluster {name}")
    host = preset.host("node")
    devices = [g.id for g in host.gpus[:per_node]]
    topo = replicate_node(host, nodes, devices, source=f"cluster preset {name}")
    return Cluster(name=name, topology=topo, device=device_spec(preset.device),
                   profile=builtin_profile(preset.profile), gpus_per_node=per_node, source=preset.source)


def preset_for_device(spec: DeviceSpec) -> str:
    """The GPU cluster preset whose nodes hold ``spec``'s device (``H100-SXM5-80GB`` ->
    ``dgx-h100``): what ``topomesh validate --device cuda`` predicts a GPU of this machine on.

    >>> preset_for_device(device_spec("H200-SXM-141GB"))
    'dgx-h200'
    """
    for name in cluster_names():
        if name != LOCAL and node_preset(name).device == spec.name:
            return name
    gpu = [n for n in cluster_names() if n != LOCAL]
    raise ClusterError(f"no cluster preset has {spec.name} GPUs; the presets are {', '.join(gpu)}")


# ------------------------------------------------------------------ local


def local_profile(directory: Path | None = None, hostname: str | None = None) -> tuple[CollectiveProfile, Path]:
    """The newest gloo profile ``topomesh calibrate`` saved for this host, and its path.

    Looks in ``<cache dir>/collectives/*.json`` (where ``topomesh calibrate`` writes without
    ``--output``) for profiles measured with gloo on exactly this host. There is no built-in
    gloo profile: without one, :class:`ClusterError` says to run the calibration.
    """
    try:
        folder = profile_directory(directory)
    except CalibrationError as exc:
        raise ClusterError(f"the local cluster's collective profiles: {exc}") from None
    host = hostname or socket.gethostname()
    found: list[tuple[str, Path, CollectiveProfile]] = []
    for path in sorted(folder.glob("*.json")):
        try:
            prof = load_profile(path)  # bounded and checked
        except CalibrationError:
            continue  # not a profile, or one of an older format: not this machine's measurement
        meta = prof.meta
        if prof.backend == "gloo" and list(meta.get("hosts", [])) == [host]:
            found.append((str(meta.get("measured_at", "")), path, prof))
    if not found:
        raise ClusterError(
            f"the local cluster needs a collective profile measured on this host ({host}) and none is saved in "
            f"{folder}; run `topomesh calibrate --local 2` first (there is no built-in gloo profile to fall back to)"
        )
    _, path, prof = max(found, key=lambda t: (t[0], str(t[1])))
    return prof, path


def _cpu_share(raw: Any) -> float | None:
    """A profile's ``collective_cpu_share`` (``{"2": share}``): the share, None where it is
    missing or not a number in (0, 1].

    >>> _cpu_share({"2": 0.7}), _cpu_share({"2": 1.5}), _cpu_share(None), _cpu_share({"2": "x"}), _cpu_share({"2": True})
    (0.7, None, None, None, None)
    """
    v = _number(raw, "2")
    return v if v is not None and 0.0 < v <= 1.0 else None


def _premium_points(raw: Any) -> tuple[tuple[str, str, int, float], ...]:
    """``meta.functional_premium_s`` (``{"kind/dtype/bytes": seconds}``) as points; an entry that
    is not a known collective, a dtype name, a positive size and seconds under 0.1 either way is
    dropped.

    >>> _premium_points({"all_gather/bfloat16/4096": 2e-4, "all_gather/bf16/x": 1.0, "nope/float32/8": 0.0})
    (('all_gather', 'bfloat16', 4096, 0.0002),)
    """
    out = []
    kinds = {k.value for k in CollectiveKind}
    for key, v in (raw.items() if isinstance(raw, dict) else ()):
        parts = str(key).split("/")
        if (len(parts) == 3 and parts[0] in kinds and parts[1].isidentifier() and parts[2].isdigit()
                and int(parts[2]) > 0 and isinstance(v, int | float) and not isinstance(v, bool)
                and math.isfinite(v) and abs(v) < 0.1):
            out.append((parts[0], parts[1], int(parts[2]), float(v)))
    return tuple(sorted(out))


def _in_step_points(raw: Any) -> tuple[tuple[float, float], ...]:
    """``meta.collective_in_step_s`` (``{"gap seconds": extra seconds}``) as sorted points; a
    point that is not a gap in (0, 1] s with an extra under 0.1 s either way is dropped.

    >>> _in_step_points({"0.008": 1e-3, "0.0005": 1e-4, "x": 1.0, "0.002": "slow", "0.004": 5.0})
    ((0.0005, 0.0001), (0.008, 0.001))
    """
    points = []
    for key, extra in (raw.items() if isinstance(raw, dict) else ()):
        try:
            gap = float(key)
        except ValueError:
            continue
        if 0 < gap <= 1 and isinstance(extra, int | float) and not isinstance(extra, bool) and abs(extra) < 0.1:
            points.append((gap, float(extra)))
    return tuple(sorted(points))


def _stretches(raw: Any) -> tuple[tuple[int, float], ...]:
    """``meta.compute_stretch`` (``{"ranks": stretch}``) as sorted pairs; an entry that is not
    a rank count of 2 or more with a stretch in [1, 1000] is dropped.

    >>> _stretches({"4": 2.1, "2": 1.07, "8": "fast", "3": 0.2, "x": 1.5, "1": 1.0})
    ((2, 1.07), (4, 2.1))
    """
    out = []
    for key, v in (raw.items() if isinstance(raw, dict) else ()):
        n = int(key) if isinstance(key, str) and key.isdigit() else 0
        if n >= 2 and isinstance(v, int | float) and not isinstance(v, bool) and 1 <= v <= 1e3:
            out.append((n, float(v)))
    return tuple(sorted(out))


def _action_seconds(raw: Any, kind: str) -> float:
    """``meta.pipeline_action_s[kind]`` (seconds) where it is a number in [0, 0.1), else 0.

    >>> [_action_seconds(r, "single") for r in ({"single": 1e-4}, {"single": -1e-5}, {"single": True}, None)]
    [0.0001, 0.0, 0.0, 0.0]
    """
    v = _number(raw, kind)
    return v if v is not None and 0 <= v < 0.1 else 0.0


def _number(raw: Any, key: str) -> float | None:
    """``raw[key]`` where ``raw`` is a dict and it is a number (not a bool), else None."""
    v = raw.get(key) if isinstance(raw, dict) else None
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def local_cluster(*, gpus: int | None = None, directory: Path | None = None) -> Cluster:
    """This machine: ``gpus`` CPU processes on one host (default: as many as the calibration
    measured), the measured CPU spec, the calibrated gloo profile (:func:`local_profile`).

    The processes share this host's cores (``os.sched_getaffinity``), each running torch's
    current thread count (the op table and the CPU spec are keyed by it), gloo's
    collectives run on those cores (:attr:`Cluster.collectives_share_compute`), and an op on
    DTensors pays DTensor's dispatch on the computing thread (:attr:`Cluster.dtensor_dispatch_s`),
    a collective DTensor issues its host work there too (:attr:`Cluster.dtensor_collective_s`), and
    so does FSDP2 per unit and all-gather (:attr:`Cluster.fsdp_reduce_s`, :attr:`Cluster.fsdp_gather_s`)
    and a pipeline schedule per action (:attr:`Cluster.pipeline_action_s`, :attr:`Cluster.pipeline_multi_action_s`)
    and per late hand-off (:attr:`Cluster.pipeline_handoff_s`)."""
    prof, path = local_profile(directory)
    measured = prof.meta.get("world_size")
    n = gpus if gpus is not None else (measured if isinstance(measured, int) and measured > 0 else 2)
    world_shape(n, n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1, "the local cluster")
    import torch

    from topomesh.cost.dispatch import (
        dtensor_collective_s,
        dtensor_dispatch_s,
        fsdp_host_s,
        split_shares,
        tp_host_s,
    )
    from topomesh.topology.discover import allowed_cpus

    host = Host(hostname=socket.gethostname())
    topo = build_topology([host], default_placement([host], [n]), source="local")
    cores = len(allowed_cpus())
    fsdp_reduce, fsdp_gather = fsdp_host_s(directory=directory)
    tp_block, tp_rest = tp_host_s(directory=directory)
    stretches = _stretches(prof.meta.get("compute_stretch"))
    stretch = dict(stretches).get(n) if n > 1 else None
    in_step = _in_step_points(prof.meta.get("collective_in_step_s"))
    whole = n == measured and n > 2  # measured on as many ranks as this cluster has
    in_step_pairs = _in_step_points(prof.meta.get("collective_in_step_pairs_s")) if whole else ()
    in_step_node = _in_step_points(prof.meta.get("collective_in_step_node_s")) if whole else ()
    pipe = prof.meta.get("pipeline_action_s")
    return Cluster(name=LOCAL, topology=topo, device=cpu_spec(directory=directory), profile=prof,
                   gpus_per_node=n, source=str(path), cores=cores, threads_per_rank=torch.get_num_threads(),
                   collectives_share_compute=True, dtensor_dispatch_s=dtensor_dispatch_s(directory=directory),
                   dtensor_collective_s=dtensor_collective_s(directory=directory),
                   dtensor_block_dispatch_s=tp_block, dtensor_rest_dispatch_s=tp_rest,
                   fsdp_reduce_s=fsdp_reduce, fsdp_gather_s=fsdp_gather,
                   backward_split=split_shares(directory=directory),
                   compute_stretch=stretch, compute_stretches=stretches,
                   collective_in_step_s=in_step if n > 1 else (), collective_in_step_node_s=in_step_node,
                   collective_in_step_pairs_s=in_step_pairs,
                   pipeline_action_s=_action_seconds(pipe, "single"),
                   pipeline_multi_action_s=_action_seconds(pipe, "multi"),
                   pipeline_handoff_s=_action_seconds(pipe, "handoff_wait"),
                   collective_cpu_share=_cpu_share(prof.meta.get("collective_cpu_share")) if n > 1 else None,
                   functional_premium_s=_premium_points(prof.meta.get("functional_premium_s")) if n > 1 else ())


# ------------------------------------------------------------------ topology files


def detect_device(topo: Topology) -> DeviceSpec:
    """The shipped spec every rank's GPU maps to, by the names the topology records."""
    names: set[str] = set()
    for r in topo.ranks:
        if r.device is not None:
            dev = topo.hosts[r.host].device(r.device)
            if dev.kind is DeviceKind.GPU and dev.name:
                names.add(dev.name)
    specs = {n: device_by_fingerprint(n) for n in sorted(names)}
    found = {s.name for s in specs.values() if s is not None}
    known = ", ".join(s.name for s in builtin_specs())
    if len(found) == 1 and all(specs.values()):
        return device_spec(found.pop())
    where = topo.source or "the topology"
    if not names:
        raise ClusterError(f"{where} names no GPU model to detect the device from; give --device NAME ({known}, or cpu)")
    raise ClusterError(
        f"{where} has GPUs named {', '.join(sorted(names))}, which map to "
        f"{'no single shipped spec' if found else 'no shipped spec'}; give --device NAME ({known}, or cpu)"
    )


def default_profile_for(spec: DeviceSpec) -> CollectiveProfile:
    """The built-in profile whose ``meta.devices`` lists ``spec``, else ``nccl-default``."""
    for name in builtin_profile_names():
        prof = builtin_profile(name)
        if spec.name in prof.meta.get("devices", ()):
            return prof
    return builtin_profile("nccl-default")


def cluster_from_topology(path: str, *, device: str | None = None, gpus: int | None = None,
                          profile: str | None = None) -> Cluster:
    """A cluster from any file ``topomesh show`` reads.

    ``device``: a shipped spec name, ``cpu`` (this machine's measured CPU), or ``None`` to
    detect it from the GPU names the file records. ``gpus``: repeat a one-host file to that
    many ranks (the file's ranks per host each time). ``profile``: a built-in profile name or
    a profile JSON file (falling back to the device's built-in profile for link kinds it
    lacks); ``None`` picks the built-in profile for the device.
    """
    topo = read_source(path)
    spec = cpu_spec() if device is not None and device.lower() == "cpu" else (
        device_spec(device) if device is not None else detect_device(topo))
    per_host = max(len(rs) for rs in topo.ranks_by_host())
    if gpus is not None and gpus != topo.world_size:
        if len(topo.hosts) != 1:
            raise ClusterError(
                f"--gpus {gpus} repeats a one-host topology, but {path} describes {len(topo.hosts)} hosts "
                f"({topo.world_size} ranks); leave --gpus out to use its world as it is"
            )
        nodes, k = world_shape(gpus, topo.world_size, f"topology {path}")
        devices = [topo.ranks[i].device for i in range(k)]
        topo = replicate_node(topo.hosts[0], nodes, devices, source=str(path))
        per_host = k
    base = default_profile_for(spec)
    if profile is None:
        prof = base
    elif profile in builtin_profile_names():
        prof = builtin_profile(profile)
    elif Path(profile).is_file():
        prof = load_profile(profile).with_fallback(base)
    else:
        raise ClusterError(
            f"--profile {profile!r} is neither a profile file nor a built-in profile ({', '.join(builtin_profile_names())})"
        )
    return Cluster(name=Path(path).name, topology=topo, device=spec, profile=prof, gpus_per_node=per_host,
                   source=str(path))


# ------------------------------------------------------------------ links per axis


@dataclass(frozen=True, slots=True, kw_only=True)
class AxisLink:
    """What one group of a mesh axis (or of flattened axes) crosses on the placed layout."""

    axis: str
    """Mesh axis name, or ``"+"``-joined flattened axes (``dp_shard+cp``)."""
    group_size: int
    kind: LinkKind
    """Slowest link kind between two members of one group (``LOC`` for a group of one)."""
    nodes: int
    """Hosts one group spans."""
    ranks_per_node: int
    """Members of one group on one host (``group_size // nodes`` for uniform groups)."""
    intra_kind: LinkKind
    """Slowest link between members on one host (``LOC`` when ``ranks_per_node == 1``)."""
    bandwidth_GBps: float
    """Bandwidth the group's collective runs at, GB/s, when the profile's term has no bus
    bandwidth of its own. Inside a node: the slowest link between members. Across nodes:
    the rail share ``line rate × NICs per node × ranks_per_node / ranks on the node`` (every
    group of the axis runs at once and the node's ranks share its NICs), capped by the
    intra-node link when several members share a node (the ring crosses both)."""
    latency_us: float
    """Highest one-way latency between two members, microseconds."""

    def to_dict(self) -> dict[str, Any]:
        return {"axis": self.axis, "group_size": self.group_size, "link": self.kind.value, "nodes": self.nodes,
                "ranks_per_node": self.ranks_per_node, "intra_link": self.intra_kind.value,
                "bandwidth_GBps": self.bandwidth_GBps, "latency_us": self.latency_us}


def _parse_axes(axes: str | Axis | Sequence[str | Axis]) -> tuple[Axis, ...]:
    items = axes.split("+") if isinstance(axes, str) else ([axes] if isinstance(axes, Axis) else list(axes))
    out = tuple(Axis.parse(a) for a in items)
    if not out or len(set(out)) != len(out):
        raise ClusterError(f"axes {axes!r} must name one or more distinct mesh axes")
    return out


def _logical_group(sizes: Sequence[int], mask: Sequence[bool], first: bool) -> np.ndarray:
    """Logical ranks of the first (or last) group of the masked axes (Megatron order)."""
    members = np.zeros(1, dtype=np.int64)
    base = 0
    stride = 1
    for size, m in zip(sizes, mask, strict=True):
        if m:
            members = (members[:, None] + np.arange(size, dtype=np.int64) * stride).ravel()
        elif not first:
            base += (size - 1) * stride
        stride *= size
    return members + base


def _pairs_stats(topo: Topology, a_side: Sequence[int], b_side: Sequence[int] | None) -> tuple[LinkKind, float, float]:
    """Slowest kind, lowest bandwidth, highest latency over pairs within ``a_side`` (or across sides).

    Without probe measurements or per-pair overrides the connections come straight from the
    table's matrices (one host's local matrix, or the rail matrix), vectorized.
    """
    t = topo.table
    if t.overrides or t.measured_local or t.measured_inter:
        conns = [topo.connection(a, b) for i, a in enumerate(a_side)
                 for b in (a_side[i + 1:] if b_side is None else b_side)]
    else:
        a = np.asarray(a_side, dtype=np.int64)
        if b_side is None:
            mat = t.local[t.host_class[t.host_of[a[0]]]]
            slots = t.local_of[a]
            ids = mat[np.ix_(slots, slots)][np.triu_indices(len(a), 1)]
        else:
            ids = t.inter[np.ix_(t.rail_of[a], t.rail_of[np.asarray(b_side, dtype=np.int64)])].ravel()
        conns = [t.palette[i] for i in np.unique(ids).tolist()]
    worst, bw, lat = LinkKind.LOC, float("inf"), 0.0
    for c in conns:
        if c.kind.tier > worst.tier:
            worst = c.kind
        bw, lat = min(bw, c.bandwidth_GBps), max(lat, c.latency_us)
    return worst, bw, lat


def _group_link(cluster: Cluster, name: str, phys: np.ndarray) -> AxisLink:
    topo = cluster.topology
    table = topo.table
    hosts = table.host_of[phys]
    counts = np.bincount(hosts)
    nodes, per_node = int(np.count_nonzero(counts)), int(counts.max())
    h0 = int(hosts[0])
    first = phys[hosts == h0][:64].tolist()
    intra, intra_bw, intra_lat = _pairs_stats(topo, first, None)
    if nodes == 1:
        bw = 0.0 if intra_bw == float("inf") else intra_bw
        return AxisLink(axis=name, group_size=len(phys), kind=intra, nodes=1, ranks_per_node=per_node,
                        intra_kind=intra, bandwidth_GBps=bw, latency_us=intra_lat)
    # Across hosts a connection depends only on the two ranks' rails: one member per rail
    # on the first host and on one other host shows every kind the group crosses.
    h1 = int(hosts[np.flatnonzero(hosts != h0)[0]])
    other = phys[hosts == h1]

    def per_rail(ranks: Sequence[int]) -> list[int]:
        seen: dict[int, int] = {}
        for r in ranks:
            seen.setdefault(int(table.rail_of[r]), int(r))
        return list(seen.values())

    kind, line_GBps, lat = _pairs_stats(topo, per_rail(first), per_rail(other.tolist()))
    nics, on_node = int(cluster.rail_nics[h0]), int(cluster.ranks_on_host[h0])
    share = line_GBps * min(nics, on_node) * per_node / on_node
    bw = min(share, intra_bw) if per_node > 1 else share
    return AxisLink(axis=name, group_size=len(phys), kind=kind, nodes=nodes, ranks_per_node=per_node,
                    intra_kind=intra if per_node > 1 else LinkKind.LOC, bandwidth_GBps=bw,
                    latency_us=max(lat, intra_lat))


def axis_link(cluster: Cluster, placement: Placement, axes: str | Axis | Sequence[str | Axis]) -> AxisLink:
    """The :class:`AxisLink` of the groups of ``axes`` (one axis, a ``"+"``-joined name or a
    sequence: their flattened groups) under ``placement`` on ``cluster``.

    Looks at the first and the last group only (on a uniform cluster all groups are
    congruent under the layout's rank math) and returns the slower of the two.
    """
    wanted = _parse_axes(axes)
    layout = placement.layout
    if layout.world_size != cluster.world_size:
        raise ClusterError(
            f"the layout has {layout.world_size} ranks but cluster {cluster.name} has {cluster.world_size}"
        )
    name = "+".join(a.value for a in wanted)
    mask = [a in wanted for a in layout.order]
    get = operator.itemgetter
    links = []
    whole = all(m or s == 1 for m, s in zip(mask, layout.sizes, strict=True))  # one group: first == last
    for first in (True,) if whole else (True, False):
        logical = _logical_group(layout.sizes, mask, first)
        phys = get(*logical.tolist())(placement.ranks) if len(logical) > 1 else (placement.ranks[int(logical[0])],)
        links.append(_group_link(cluster, name, np.asarray(phys, dtype=np.int64)))
    return min(links, key=lambda link: (-link.kind.tier, link.bandwidth_GBps, -link.nodes))


def axis_links(cluster: Cluster, placement: Placement) -> dict[str, AxisLink]:
    """One :class:`AxisLink` per mesh axis of degree > 1, keyed by axis name."""
    layout = placement.layout
    return {a.value: axis_link(cluster, placement, (a,)) for a in layout.mesh_axes if layout.degree(a) > 1}


def group_collective_time_s(record: Any, link: AxisLink, profile: CollectiveProfile) -> float:
    """Seconds one collective (a :class:`~topomesh.trace.graph.CollectiveRecord`) takes on a
    group with ``link``; pure.

    Inside a node: the profile's model for ``link.kind`` at ``link.bandwidth_GBps``
    (:func:`~topomesh.cost.collectives.collective_time_s`). Across nodes: NCCL-like
    hierarchical (:func:`~topomesh.cost.collectives.hierarchical_time_s`) at the rail share.
    """
    if record.group_size <= 1:
        return 0.0
    if link.nodes <= 1:
        conn = Connection(kind=link.kind, latency_us=link.latency_us, bandwidth_GBps=link.bandwidth_GBps)
        return collective_time_s(record, conn, profile)
    return hierarchical_time_s(record, inter_kind=link.kind, intra_kind=link.intra_kind, nodes=link.nodes,
                               ranks_per_node=link.ranks_per_node, network_GBps=link.bandwidth_GBps,
                               profile=profile)
