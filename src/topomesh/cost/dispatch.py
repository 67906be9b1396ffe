"""Host time DTensor's dispatch adds to an op, measured on this CPU.

An op on a :class:`~torch.distributed.tensor.DTensor` (tensor-parallel modules, FSDP2's
sharded parameters in the optimizer) runs through DTensor's Python dispatcher — sharding
propagation, unwrapping, rewrapping — before the local op. On a GPU the host issues
kernels ahead of the device and this time hides behind them while the kernels are larger
than it; on a CPU the host thread is the computing thread, so it adds to every such op.

:func:`measure_dtensor_dispatch_s` times a chain of small elementwise ops with autograd
(forward and backward) on plain tensors and on DTensors of a one-rank mesh (a fake process
group, so nothing is sent) on the thread's CPU clock; the difference per op is the
dispatch cost. :func:`dtensor_dispatch_s` caches it per CPU fingerprint (with the torch
thread count) and torch version. Measured here (AMD EPYC, 1 thread, torch 2.13): 32 µs per
op (a DTensor multiply alone: 49 µs against 5 µs for the plain one).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
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


def dtensor_dispatch_s(*, directory: Path | None = None, refresh: bool = False) -> float:
    """:func:`measure_dtensor_dispatch_s`, cached per CPU fingerprint and torch version in the
    private cache directory (``devices/dispatch-<hash>.json``)."""
    import torch

    key = f"{cpu_fingerprint()} torch {torch.__version__} v{METHOD_VERSION}"
    try:
        path: Path | None = private_cache_dir("devices", root=directory) / (
            "dispatch-" + hashlib.sha1(key.encode()).hexdigest()[:12] + ".json")
    except CalibrationError:
        path = None
    if path is not None and path.is_file() and not refresh:
        try:
            raw = json.loads(path.read_text())
            if raw.get("key") == key and isinstance(raw.get("dtensor_dispatch_s"), float):
                return float(raw["dtensor_dispatch_s"])
        except (OSError, json.JSONDecodeError):
            pass  # unreadable: measure again and overwrite
    seconds = measure_dtensor_dispatch_s()
    if path is not None:
        write_json_atomic(path, {"key": key, "dtensor_dispatch_s": seconds,
                                 "method": "thread CPU time, DTensor minus plain, per op (fwd+bwd chain)"})
    return seconds
