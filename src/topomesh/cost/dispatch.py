"""Host time DTensor's dispatch adds to an op, and to each collective it issues, measured on this CPU.

An op on a :class:`~torch.distributed.tensor.DTensor` (tensor-parallel modules, FSDP2's
sharded parameters in the optimizer) runs through DTensor's Python dispatcher — sharding
propagation, unwrapping, rewrapping — before the local op. On a GPU the host issues
kernels ahead of the device and this time hides behind them while the kernels are larger
than it; on a CPU the host thread is the computing thread, so it adds to every such op.

:func:`measure_dtensor_dispatch_s` times a chain of small elementwise ops with autograd
(forward and backward) on plain tensors and on DTensors of a one-rank mesh (a fake process
group, so nothing is sent) on the thread's CPU clock; the difference per op is the
dispatch cost. :func:`dtensor_dispatch_s` caches it per CPU fingerprint (with the torch
thread count) and torch version. Measured here (AMD EPYC, 1 thread, torch 2.13): 29–32 µs per
op (a DTensor multiply alone: 49 µs against 5 µs for the plain one).

A collective DTensor issues (tensor parallel's all-gathers, reduce-scatters and all-reduces:
``_c10d_functional`` ops in a trace) costs host time besides the transfer the gloo calibration
measures with plain c10d calls: the redistribution plan, its autograd Function, the functional
collective's wrapper tensors and wait. :func:`measure_dtensor_collective_s` times
``redistribute`` of a tiny DTensor with autograd on a two-rank fake group (nothing is sent, so
all that is left is that host work), all-gather, reduce-scatter and all-reduce, and takes the
median of the three: 90–117 µs here, against 7–13 µs for a plain c10d call on the same group.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from topomesh.cost.devices import cpu_fingerprint, private_cache_dir, write_json_atomic
from topomesh.errors import CalibrationError

METHOD_VERSION = 1


def _chain_s(x: object, n: int, repeats: int) -> float:
    """Median thread CPU seconds of ``n`` multiplies on ``x`` forward and their backward."""

    def run() -> None:
        t = x
        for _ in range(n):
            t = t * 1.0001
        t.sum().backward()

    run()  # first call: lazy caches of the dispatcher
    times = []
    for _ in range(repeats):
        c0 = time.thread_time()
        run()
        times.append(time.thread_time() - c0)
    return statistics.median(times)


def measure_dtensor_dispatch_s(*, n: int = 200, repeats: int = 5) -> float:
    """Seconds DTensor dispatch adds per op (forward and backward ops averaged), >= 0."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from topomesh.layout import groups
    from topomesh.trace.tracer import fake_process_group

    plain = torch.randn(16, 16, dtype=torch.float32).requires_grad_()
    if dist.is_initialized():
        raise CalibrationError("measuring DTensor dispatch needs a process without a process group "
                               "(it builds a one-rank fake group).")
    with fake_process_group(1):
        mesh = groups.init_mesh("cpu", [1], ["x"])
        shard = distribute_tensor(plain.detach(), mesh, [Shard(0)]).requires_grad_()
        base = _chain_s(plain, n, repeats)
        wrapped = _chain_s(shard, n, repeats)
    # n forward multiplies and as many backward ones, plus the sum and its backward
    return max(0.0, (wrapped - base) / (2 * n))


def measure_dtensor_collective_s(*, repeats: int = 50) -> float:
    """Host seconds of one collective DTensor issues, beyond the transfer (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from topomesh.layout import groups
    from topomesh.trace.tracer import fake_process_group

    if dist.is_initialized():
        raise CalibrationError("measuring DTensor's collectives needs a process without a process group "
                               "(it builds a two-rank fake group).")
    with fake_process_group(2):
        mesh = groups.init_mesh("cpu", [2], ["x"])
        leaf = torch.randn(4, 8, requires_grad=True)
        cases = [(DTensor.from_local(leaf, mesh, [Shard(0)]), [Replicate()]),  # all-gather
                 (DTensor.from_local(leaf, mesh, [Partial()]), [Shard(0)]),  # reduce-scatter
                 (DTensor.from_local(leaf, mesh, [Partial()]), [Replicate()])]  # all-reduce
        medians = []
        for source, target in cases:
            source.redistribute(mesh, target)  # first call: the planner's caches
            times = []
            for _ in range(repeats):
                c0 = time.thread_time()
                source.redistribute(mesh, target)
                times.append(time.thread_time() - c0)
            medians.append(statistics.median(times))
    return statistics.median(medians)


def dtensor_dispatch_s(*, directory: Path | None = None, refresh: bool = False) -> float:
    """:func:`measure_dtensor_dispatch_s`, cached per CPU fingerprint and torch version in the
    private cache directory (``devices/dispatch-<hash>.json``)."""
    return _cached("dispatch", "dtensor_dispatch_s", measure_dtensor_dispatch_s,
                   "thread CPU time, DTensor minus plain, per op (fwd+bwd chain)", directory, refresh)


def dtensor_collective_s(*, directory: Path | None = None, refresh: bool = False) -> float:
    """:func:`measure_dtensor_collective_s`, cached as :func:`dtensor_dispatch_s` is
    (``devices/collective-host-<hash>.json``)."""
    return _cached("collective-host", "dtensor_collective_s", measure_dtensor_collective_s,
                   "thread CPU time of a redistribute with autograd on a 2-rank fake group, median of "
                   "all-gather, reduce-scatter, all-reduce", directory, refresh)


def _cached(stem: str, name: str, measure: Callable[[], float], method: str, directory: Path | None,
            refresh: bool) -> float:
    """``measure()`` kept in ``devices/<stem>-<hash>.json`` per CPU fingerprint, torch version and
    method version; measured again when missing, unreadable or ``refresh``."""
    import torch

    key = f"{cpu_fingerprint()} torch {torch.__version__} v{METHOD_VERSION}"
    try:
        path: Path | None = private_cache_dir("devices", root=directory) / (
            f"{stem}-" + hashlib.sha1(key.encode()).hexdigest()[:12] + ".json")
    except CalibrationError:
        path = None
    if path is not None and path.is_file() and not refresh:
        try:
            raw = json.loads(path.read_text())
            if raw.get("key") == key and isinstance(raw.get(name), float):
                return float(raw[name])
        except (OSError, json.JSONDecodeError):
            pass  # unreadable: measure again and overwrite
    seconds = measure()
    if path is not None:
        write_json_atomic(path, {"key": key, name: seconds, "method": method})
    return seconds
