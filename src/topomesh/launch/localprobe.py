"""``--topology-probe`` inside a node: measured links between the node's own devices.

What can be measured depends on the node:

* **GPUs** — every pair of distinct GPUs its workers use: a copy from one to the other
  (``dst.copy_(src)``, peer-to-peer where the driver allows it, the path NCCL's P2P transport
  takes): latency is the median time of a 4-byte copy, bandwidth the best of repeated 64 MiB
  copies. This runs in a short-lived child process (``python -m topomesh.launch.localprobe``)
  so the agent never creates CUDA contexts it would keep for the job's lifetime. The child
  numbers GPUs in PCI bus order (``CUDA_DEVICE_ORDER=PCI_BUS_ID``), the order discovery uses;
  when ``CUDA_VISIBLE_DEVICES`` is set that mapping is unknown and GPUs are not measured.
* **CPU-only** — workers sharing one CPU socket talk through shared memory (``SHM``): latency is
  half the median round trip of one byte between this process and a child over a pipe;
  bandwidth is the best one-core copy rate of a 64 MiB buffer in host memory, the bound of
  a shared-memory transport's copies. Neither needs torch.

Pairs on different CPU sockets, and GPU↔CPU pairs, keep their defaults. Everything is
bounded by a time box; a measurement that fails or runs out of time leaves the defaults and
the caller logs a warning. Results are rows of :class:`LocalResult` (one per device pair),
published in the node's entry and applied to every rank pair on those two devices
(``build_topology(measured_devices=...)``).

This module's GPU path has only been run against stand-ins: no GPU machine was available
when it was written.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from topomesh.errors import LaunchError
from topomesh.topology.model import DeviceKind, Host

BULK_BYTES = 64 << 20
"""Bytes of one bandwidth copy (64 MiB)."""
GPU_START_ALLOWANCE_S = 30.0
"""Time the child process gets on top of the budget to import torch and start CUDA."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalResult:
    """One measured pair of devices on a node (``device_a == device_b`` for SHM pairs)."""

    device_a: str
    device_b: str
    latency_us: float
    bandwidth_GBps: float

    def row(self) -> list[object]:
        return [self.device_a, self.device_b, round(self.latency_us, 3), round(self.bandwidth_GBps, 3)]


def device_pairs(host: Host, devices: Sequence[str | None]) -> tuple[list[tuple[str, str]], list[str]]:
    """The pairs to measure for workers on ``devices``: distinct GPU pairs, and CPU sockets
    with two or more workers. Returns (GPU pairs, shared CPU devices).

    >>> from topomesh.topology.model import Device, DeviceKind, Host
    >>> h = Host(hostname="n", devices=tuple(
    ...     Device(id=f"GPU{i}", kind=DeviceKind.GPU, index=i) for i in range(3)))
    >>> device_pairs(h, ["GPU0", "GPU1", "GPU2", "GPU1"])
    ([('GPU0', 'GPU1'), ('GPU0', 'GPU2'), ('GPU1', 'GPU2')], [])
    """
    used = sorted({d for d in devices if d is not None}, key=lambda d: (host.device(d).kind.value, host.device(d).index))
    gpus = [d for d in used if host.device(d).kind is DeviceKind.GPU]
    shared_cpus = [d for d in used if host.device(d).kind is DeviceKind.CPU and list(devices).count(d) > 1]
    return list(itertools.combinations(gpus, 2)), shared_cpus


def measure_local(host: Host, devices: Sequence[str | None], *, budget_s: float = 2.0) -> list[LocalResult]:
    """Measure the links between the devices of this node's workers (see the module doc).

    Raises :class:`LaunchError` when a measurement fails; returns ``[]`` when there is
    nothing to measure (one worker, or workers on different CPU sockets only).
    """
    gpu_pairs, shared_cpus = device_pairs(host, devices)
    out: list[LocalResult] = []
    if shared_cpus:
        lat, bw = measure_shm(budget_s=budget_s / (2 if gpu_pairs else 1))
        out += [LocalResult(device_a=d, device_b=d, latency_us=lat, bandwidth_GBps=bw) for d in shared_cpus]
    if gpu_pairs:
        out += _measure_gpus_in_child(host, gpu_pairs, budget_s=budget_s / (2 if shared_cpus else 1))
    return out


_ECHO = "import sys\nr, w = sys.stdin.buffer, sys.stdout.buffer\nwhile (b := r.read(1)):\n    w.write(b); w.flush()\n"


def measure_shm(*, budget_s: float = 1.0, pings: int = 200, copies: int = 5) -> tuple[float, float]:
    """(latency_us, bandwidth_GBps) of shared-memory transport on this host (module doc)."""
    deadline = time.perf_counter() + budget_s
    child = subprocess.Popen([sys.executable, "-c", _ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    rtts: list[float] = []
    try:
        assert child.stdin is not None and child.stdout is not None
        for i in range(pings + 5):
            t0 = time.perf_counter()
            child.stdin.write(b"p")
            child.stdin.flush()
            if child.stdout.read(1) != b"p":
                raise LaunchError("the shared-memory latency child stopped answering")
            if i >= 5:  # the first round trips include the child's start-up
                rtts.append(time.perf_counter() - t0)
            if time.perf_counter() > deadline - budget_s / 2:
                break
    finally:
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    src, dst = bytearray(BULK_BYTES), bytearray(BULK_BYTES)
    src_v, dst_v = memoryview(src), memoryview(dst)
    best = 0.0
    for _ in range(copies):
        t0 = time.perf_counter()
        dst_v[:] = src_v
        dt = time.perf_counter() - t0
        best = max(best, BULK_BYTES / dt / 1e9)
        if time.perf_counter() > deadline:
            break
    if not rtts or best <= 0:
        raise LaunchError(f"the shared-memory probe ran out of its {budget_s:g} s budget")
    return statistics.median(rtts) / 2 * 1e6, best


def _measure_gpus_in_child(host: Host, pairs: Sequence[tuple[str, str]], *, budget_s: float) -> list[LocalResult]:
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        raise LaunchError("CUDA_VISIBLE_DEVICES is set in the agent, so its GPU numbering cannot be matched "
                          "to the discovered GPUs; local GPU links keep their defaults")
    request = {
        "pairs": [[a, b, host.device(a).index, host.device(b).index] for a, b in pairs],
        "bytes": BULK_BYTES,
        "budget_s": budget_s,
    }
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "topomesh.launch.localprobe", json.dumps(request)],
            capture_output=True, timeout=budget_s + GPU_START_ALLOWANCE_S, env=env, check=False,
        )
    except subprocess.TimeoutExpired:
        raise LaunchError(f"the local GPU probe took longer than {budget_s + GPU_START_ALLOWANCE_S:g} s") from None
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise LaunchError(f"the local GPU probe failed: {tail[0]}")
    return parse_rows(done.stdout, {d for p in pairs for d in p})


def parse_rows(raw: bytes, devices: set[str]) -> list[LocalResult]:
    """Rows ``[device_a, device_b, latency_us, bandwidth_GBps]`` (JSON) as results; checks them."""
    try:
        rows = json.loads(raw)
        out = [
            LocalResult(device_a=str(a), device_b=str(b), latency_us=float(lat), bandwidth_GBps=float(bw))
            for a, b, lat, bw in rows
        ]
    except (ValueError, TypeError) as exc:
        raise LaunchError(f"the local probe printed something unreadable ({exc})") from None
    for r in out:
        if {r.device_a, r.device_b} - devices or not (0 < r.latency_us < 1e9 and 0 < r.bandwidth_GBps < 1e6):
            raise LaunchError(f"the local probe printed an impossible row {r.row()}")
    return out


def _gpu_child(request: dict) -> list[list[object]]:
    """In the child: time copies between each GPU pair (CUDA ordinals in PCI bus order).

    ``request["device_type"]`` (default ``cuda``) lets the tests run the same timing on CPU.
    """
    import torch

    deadline = time.perf_counter() + float(request["budget_s"])
    nbytes = int(request["bytes"])
    kind = request.get("device_type", "cuda")
    rows = []
    for a, b, ia, ib in request["pairs"]:
        da, db = torch.device(kind, int(ia)), torch.device(kind, int(ib))

        def sync(da: torch.device = da, db: torch.device = db) -> None:
            if kind == "cuda":
                torch.cuda.synchronize(da)
                torch.cuda.synchronize(db)

        small_src, small_dst = torch.zeros(1, device=da), torch.empty(1, device=db)
        big_src = torch.empty(nbytes, dtype=torch.uint8, device=da)
        big_dst = torch.empty(nbytes, dtype=torch.uint8, device=db)
        big_dst.copy_(big_src)  # warm-up: peer mappings, allocator
        sync()
        lats = []
        for _ in range(50):
            t0 = time.perf_counter()
            small_dst.copy_(small_src)
            sync()
            lats.append(time.perf_counter() - t0)
        best = 0.0
        for _ in range(20):
            t0 = time.perf_counter()
            big_dst.copy_(big_src)
            sync()
            best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
            if time.perf_counter() > deadline:
                break
        rows.append([a, b, statistics.median(lats) * 1e6, best])
        del big_src, big_dst
        if time.perf_counter() > deadline:
            break
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m topomesh.launch.localprobe REQUEST_JSON``: print the measured rows as JSON."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m topomesh.launch.localprobe REQUEST_JSON", file=sys.stderr)
        return 2
    print(json.dumps(_gpu_child(json.loads(args[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
