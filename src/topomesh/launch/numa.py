"""NUMA-aware workers: which CPUs each local rank is bound to.

torchrun's ``--numa-binding {node,socket,exclusive,core-complex}`` binds a worker to the
CPUs of the NUMA node of the CUDA GPU whose index equals its local rank
(``torch/numa/binding.py``). ``topomesh launch`` keeps that flag, its modes and torch's
implementation for CUDA workers, and uses the discovered topology where torch's does not
apply (no CUDA in the agent: CPU-only jobs, or a topology from a fixture tree):

* a worker with a GPU: the GPU's NUMA node (the device :func:`~topomesh.launch.local.local_devices`
  gave it, so ``CUDA_VISIBLE_DEVICES`` is honoured);
* a worker without a GPU on a host with GPUs: its NIC's NUMA node (the NIC it would use);
* a CPU-only host: workers spread over the NUMA nodes, local rank ``i`` on node
  ``nodes[i * len(nodes) // nproc]`` (consecutive ranks share a node, as they share a socket).

Modes on the topology path: ``node`` — all CPUs of the node; ``exclusive`` — the node's CPUs
split into equal consecutive parts, one per worker bound there; ``socket`` and
``core-complex`` need socket / L3 data the topology does not hold and bind to the node, as
``node`` does (logged). The CPUs are the node's CPUs this process may use
(``os.sched_getaffinity``). When the topology names CPUs this machine does not let the
agent use at all (a fixture tree, or a topology from another machine), the usable CPUs are
divided among the topology's NUMA nodes in order instead, so the split survives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from enum import StrEnum

from topomesh.errors import LaunchError
from topomesh.topology.model import DeviceKind, Host

ENV_VAR = "TOPOMESH_WORKER_CPUS"
"""Set for each worker to its CPU list (``0-3,8``); :mod:`topomesh.launch.bind` applies it."""


class BindMode(StrEnum):
    """torchrun's ``--numa-binding`` modes (``torch.numa.binding.AffinityMode``)."""

    NODE = "node"
    SOCKET = "socket"
    EXCLUSIVE = "exclusive"
    CORE_COMPLEX = "core-complex"


@dataclass(frozen=True, slots=True, kw_only=True)
class Binding:
    """One worker's NUMA node and the CPUs it is bound to."""

    numa_node: int
    cpus: tuple[int, ...]


def cpulist(cpus: Sequence[int]) -> str:
    """The sysfs/taskset form of a CPU set.

    >>> cpulist([0, 1, 2, 3, 8, 10, 11])
    '0-3,8,10-11'
    """
    out: list[str] = []
    xs = sorted(set(cpus))
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def numa_node_of(host: Host, device: str | None, local_rank: int, nproc: int, nodes: Sequence[int]) -> int | None:
    """The NUMA node a worker belongs to (see the module docs), or None when unknown."""
    dev = next((d for d in host.devices if d.id == device), None)
    if dev is not None and dev.kind is DeviceKind.GPU:
        return dev.numa_node
    if host.gpus:
        nic = host.nearest_nic(None)
        return nic.numa_node if nic is not None else None
    if not nodes:
        return None
    return sorted(nodes)[local_rank * len(nodes) // nproc]


def usable_cpus(numa_cpus: Mapping[int, Sequence[int]], allowed: Set[int]) -> dict[int, tuple[int, ...]]:
    """Each node's CPUs this process may use; when the topology's CPUs are none of the
    allowed ones for some node, the allowed CPUs divided among the nodes in order.

    >>> usable_cpus({0: range(0, 16), 1: range(16, 32)}, {0, 1, 2, 3, 20})
    {0: (0, 1, 2, 3), 1: (20,)}
    >>> usable_cpus({0: [0, 1, 32, 33], 1: [16, 17, 48, 49]}, {0, 1})   # a fixture on 2 CPUs
    {0: (0,), 1: (1,)}
    """
    mine = {n: tuple(sorted(set(c) & allowed)) for n, c in numa_cpus.items()}
    if all(mine.values()):
        return mine
    nodes, pool = sorted(numa_cpus), sorted(allowed)
    if len(pool) >= len(nodes):
        return {n: tuple(pool[k * len(pool) // len(nodes) : (k + 1) * len(pool) // len(nodes)]) for k, n in enumerate(nodes)}
    return {n: (pool[k % len(pool)],) for k, n in enumerate(nodes)}


def plan(
    host: Host,
    devices: Sequence[str | None],
    numa_cpus: Mapping[int, Sequence[int]],
    mode: BindMode | str,
    allowed: Set[int],
) -> list[Binding | None]:
    """The binding of each local rank (``devices[i]`` is local rank i's device), or None
    for a worker whose NUMA node is unknown (left unbound)."""
    mode = BindMode(mode)
    if not allowed:
        raise LaunchError("no CPUs are allowed for this process (os.sched_getaffinity is empty)")
    usable = usable_cpus(numa_cpus, allowed)
    nproc = len(devices)
    nodes = [numa_node_of(host, d, i, nproc, sorted(numa_cpus)) for i, d in enumerate(devices)]
    out: list[Binding | None] = []
    for i, node in enumerate(nodes):
        if node is None or node not in usable:
            out.append(None)
            continue
        cpus = usable[node]
        if mode is BindMode.EXCLUSIVE:
            peers = [j for j, n in enumerate(nodes) if n == node]
            cpus = exclusive_share(cpus, peers.index(i), len(peers))
        out.append(Binding(numa_node=node, cpus=cpus))
    return out


def exclusive_share(cpus: Sequence[int], k: int, m: int) -> tuple[int, ...]:
    """Worker ``k`` of ``m``'s part of ``cpus`` under ``exclusive``: equal consecutive slices,
    or one CPU each in turn when there are more workers than CPUs (slices would leave some
    empty and stack their workers on the first CPU).

    >>> exclusive_share(range(8), 1, 4), exclusive_share([0, 1], 2, 4), exclusive_share([0, 1], 3, 4)
    ((2, 3), (0,), (1,))
    """
    cpus = tuple(cpus)
    return cpus[k * len(cpus) // m : (k + 1) * len(cpus) // m] if m <= len(cpus) else (cpus[k % len(cpus)],)
