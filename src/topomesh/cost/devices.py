"""Device specifications: peak dense FLOP/s per dtype, memory bandwidth, capacity.

GPUs come from vendor datasheets, one JSON file per model under ``data/devices/`` (every
number cites its source there). The CPU of this machine is *measured* at first use
(:func:`measure_cpu`: matmul microbenchmarks per dtype, a large copy for memory bandwidth,
``/proc/meminfo`` for capacity) and cached as JSON in the user cache directory
(``$TOPOMESH_CACHE_DIR`` or ``~/.cache/topomesh``), with the method recorded.

>>> spec = device_spec("H100-SXM5-80GB")
>>> spec.peak_flops_per_s("bfloat16") / 1e12
989.5
>>> device_by_fingerprint("NVIDIA H100 80GB HBM3").name
'H100-SXM5-80GB'
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

from topomesh.errors import CalibrationError
from topomesh.privdir import private_directory
from topomesh.topology.api import read_json, write_atomic
from topomesh.topology.model import DeviceKind

CACHE_ENV = "TOPOMESH_CACHE_DIR"
CPU_SPEC_VERSION = 3
"""Bumped when the measurement method changes, so old cache files are re-measured."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """What a roofline needs to know about one device."""

    name: str
    kind: DeviceKind
    fingerprints: tuple[str, ...] = ()
    """Names the device reports (``torch.cuda.get_device_name``, CPU model) that map to it."""
    peak_flops: Mapping[str, float] = field(default_factory=dict)
    """Peak dense FLOP/s per torch dtype name (``tfloat32`` = float32 matmul on TF32 cores)."""
    memory_bandwidth_GBps: float
    """Main memory (HBM or DRAM) bandwidth, 10^9 bytes/s."""
    memory_bytes: int
    sources: Mapping[str, str] = field(default_factory=dict)
    """Where each number comes from (datasheet, or the measurement method)."""
    measured: bool = False
    """True when the numbers were measured on this machine rather than taken from a datasheet."""

    def __post_init__(self) -> None:
        if not self.peak_flops:
            raise CalibrationError(f"device spec {self.name!r} lists no peak FLOP/s")
        for dtype, v in self.peak_flops.items():
            if not v > 0:
                raise CalibrationError(f"device spec {self.name!r}: peak FLOP/s for {dtype} must be > 0, got {v}")
        if not self.memory_bandwidth_GBps > 0:
            raise CalibrationError(
                f"device spec {self.name!r}: memory bandwidth must be > 0 GB/s, got {self.memory_bandwidth_GBps}"
            )
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))

    def peak_flops_per_s(self, dtype: str, *, tf32: bool = False) -> float:
        """Peak dense FLOP/s for ops in ``dtype``.

        ``tf32=True`` prices float32 matmuls on TF32 cores (PyTorch's
        ``allow_tf32``; off by default). A dtype the device has no figure for (integers,
        FP8 on Ampere) falls back to the float32 figure.

        >>> device_spec("A100-SXM4-80GB").peak_flops_per_s("float32", tf32=True) / 1e12
        156.0
        >>> device_spec("A100-SXM4-80GB").peak_flops_per_s("float8_e4m3fn") / 1e12
        19.5
        """
        dtype = dtype.removeprefix("torch.")
        if dtype == "float32" and tf32 and "tfloat32" in self.peak_flops:
            return self.peak_flops["tfloat32"]
        return self.peak_flops.get(dtype, self.peak_flops["float32"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind.value,
            "fingerprints": list(self.fingerprints),
            "peak_dense_tflops": {k: v / 1e12 for k, v in self.peak_flops.items()},
            "memory_bandwidth_GBps": self.memory_bandwidth_GBps,
            "memory_GB": self.memory_bytes / 1e9,
            "sources": dict(self.sources),
            "measured": self.measured,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "device spec") -> DeviceSpec:
        try:
            return cls(
                name=str(raw["name"]),
                kind=DeviceKind(raw["kind"]),
                fingerprints=tuple(str(f) for f in raw.get("fingerprints", ())),
                peak_flops={k: float(v) * 1e12 for k, v in raw["peak_dense_tflops"].items()},
                memory_bandwidth_GBps=float(raw["memory_bandwidth_GBps"]),
                memory_bytes=int(float(raw["memory_GB"]) * 1e9),
                sources=dict(raw.get("sources", {})),
                measured=bool(raw.get("measured", False)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CalibrationError(f"{source}: malformed device spec ({exc!r})") from None


def _norm(name: str) -> str:
    return " ".join(name.lower().replace("_", "-").split())


@cache
def builtin_specs() -> tuple[DeviceSpec, ...]:
    """The datasheet specs shipped in ``data/devices/*.json``."""
    root = resources.files("topomesh.cost").joinpath("data/devices")
    out = []
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            out.append(DeviceSpec.from_dict(json.loads(entry.read_text()), source=entry.name))
    return tuple(out)


def device_spec(name: str) -> DeviceSpec:
    """A shipped spec by name (``H100-SXM5-80GB``) or by any fingerprint alias, case-insensitively."""
    key = _norm(name)
    for spec in builtin_specs():
        if _norm(spec.name) == key or key in (_norm(f) for f in spec.fingerprints):
            return spec
    known = ", ".join(s.name for s in builtin_specs())
    raise CalibrationError(f"no device spec named {name!r}; known devices: {known}")


def device_by_fingerprint(fingerprint: str) -> DeviceSpec | None:
    """The shipped spec a reported device name maps to, or None when there is none."""
    try:
        return device_spec(fingerprint)
    except CalibrationError:
        return None


# --------------------------------------------------------------------------- CPU


def cache_dir() -> Path:
    """``$TOPOMESH_CACHE_DIR``, else ``$XDG_CACHE_HOME/topomesh``, else ``~/.cache/topomesh``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "topomesh"


def private_cache_dir(*parts: str, root: Path | None = None) -> Path:
    """``root`` (default :func:`cache_dir`) joined with ``parts``, each level created 0700 and
    checked to be this user's alone (:func:`topomesh.privdir.private_directory`); a level that
    is not raises :class:`CalibrationError` saying which and why."""
    path = root or cache_dir()
    private_directory(path, what="topomesh cache directory", error=CalibrationError)
    for part in parts:
        path = private_directory(path / part, what="topomesh cache directory", error=CalibrationError)
    return path


def cpu_model_name(cpuinfo: str | None = None) -> str:
    """The CPU model from ``/proc/cpuinfo`` (``model name``), else ``platform.processor()``."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        if line.split(":")[0].strip() == "model name":
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_fingerprint(threads: int | None = None) -> str:
    """``cpu:<model> x<logical cpus> t<torch threads>``: thread count changes measured FLOP/s.
    ``threads`` names another thread count than this process's (a cluster's ranks)."""
    import torch

    return f"cpu:{cpu_model_name()} x{os.cpu_count()} t{torch.get_num_threads() if threads is None else threads}"


def table_fingerprints(spec: DeviceSpec, *, threads: int = 1) -> list[str]:
    """The fingerprints under which ``topomesh profile`` stores op tables for ``spec``: the
    names a GPU reports (its ``fingerprints``), or this CPU at ``threads`` torch threads per
    process."""
    if spec.kind is DeviceKind.CPU:
        return [cpu_fingerprint(threads)]
    return list(spec.fingerprints)


def cuda_fingerprint(index: int = 0) -> str:
    import torch

    return torch.cuda.get_device_name(index)


_DEVICE = re.compile(r"cpu|cuda(?::([0-9]{1,4}))?")


def device_fingerprint(device: str = "cpu") -> str:
    """Fingerprint of a torch device: the CUDA device name, or :func:`cpu_fingerprint`.

    Only ``cpu``, ``cuda`` and ``cuda:<index>`` of a device this machine has are accepted:
    anything else raises :class:`CalibrationError` (it must not be taken for this CPU, whose
    table it would fill with failures).
    """
    m = _DEVICE.fullmatch(device)
    if m is None:
        raise CalibrationError(f"device {device[:80]!r} is not cpu, cuda or cuda:<index>; refusing to profile it")
    if device == "cpu":
        return cpu_fingerprint()
    import torch

    index = int(m.group(1) or 0)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= count:
        raise CalibrationError(f"device {device!r} is not on this machine (it has {count} CUDA devices)")
    return cuda_fingerprint(index)


def mem_total_bytes(meminfo: str | None = None) -> int:
    """``MemTotal`` of ``/proc/meminfo`` in bytes.

    >>> mem_total_bytes("MemTotal:       24684096 kB\\nMemFree: 1 kB")
    25276514304
    """
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError as exc:
            raise CalibrationError(f"cannot read /proc/meminfo for the CPU memory capacity ({exc.strerror})") from None
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            value, unit = line.split()[1:3]
            assert unit == "kB", unit
            return int(value) * 1024
    raise CalibrationError("/proc/meminfo has no MemTotal line")


MATMUL_DTYPES = ("float32", "float64", "bfloat16", "float16")


def _best_seconds(fn: Any, *, min_reps: int, budget_s: float) -> float:
    """Fastest of >= ``min_reps`` timed calls within ``budget_s`` (after one warm-up call).

    The fastest, not the median: a spec is a peak, and on a shared machine the slow
    repeats measure the other tenants.
    """
    fn()  # warm-up
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return min(times)


def measure_cpu(*, matmul_n: int = 512, copy_bytes: int = 64 * 2**20, budget_s: float = 0.25) -> DeviceSpec:
    """Measure this CPU: FLOP/s per dtype, memory bandwidth and capacity (about 1-2 s).

    FLOP/s: fastest time of ``torch.mm`` on two n×n matrices per dtype (2·n³ FLOPs),
    with torch's current thread count; n grows from 128 to at most ``matmul_n`` until one
    product takes 5 ms, so slow dtypes do not take seconds. Bandwidth: fastest
    ``dst.copy_(src)`` over ``copy_bytes`` float32 (read + write = 2 × bytes moved).
    These are achieved, not theoretical peaks; a loaded machine measures lower.
    """
    import torch

    flops: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for name in MATMUL_DTYPES:
        dtype = getattr(torch, name)
        # Grow n from 128 until one product takes >= 5 ms (or n reaches matmul_n): slow
        # dtypes (bf16 without hardware support) are measured small, fast ones at full size.
        n = 128
        while True:
            a = torch.randn(n, n).to(dtype)
            b = torch.randn(n, n).to(dtype)
            torch.mm(a, b)  # the first call pays for thread-pool start and allocation
            probe = []
            for _ in range(2):
                t0 = time.perf_counter()
                torch.mm(a, b)
                probe.append(time.perf_counter() - t0)
            if n >= matmul_n or min(probe) >= 5e-3:
                break
            n *= 2
        t = _best_seconds(lambda a=a, b=b: torch.mm(a, b), min_reps=3, budget_s=budget_s)
        flops[name] = 2.0 * n**3 / t
        sizes[name] = n
    src = torch.ones(copy_bytes // 4)
    dst = torch.empty_like(src)
    t = _best_seconds(lambda: dst.copy_(src), min_reps=5, budget_s=budget_s)
    bw = 2.0 * copy_bytes / t / 1e9
    threads = torch.get_num_threads()
    method = (
        f"measured with torch {torch.__version__}, {threads} threads, at "
        f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
    )
    return DeviceSpec(
        name=f"CPU {cpu_model_name()}",
        kind=DeviceKind.CPU,
        fingerprints=(cpu_fingerprint(),),
        peak_flops=flops,
        memory_bandwidth_GBps=bw,
        memory_bytes=mem_total_bytes(),
        sources={
            "peak_dense_tflops": f"fastest of torch.mm on n x n matrices per dtype (2n^3 FLOPs; n = {sizes}, "
            f"the first power of two from 128 where one product takes >= 5 ms, at most {matmul_n}), "
            f"warm-up 1, best of >= 3 repeats within {budget_s} s; {method}",
            "memory_bandwidth_GBps": f"fastest Tensor.copy_ of {copy_bytes} bytes (counted as 2x bytes: read + "
            f"write), warm-up 1, best of >= 5 repeats within {budget_s} s; {method}",
            "memory_GB": "MemTotal of /proc/meminfo",
            "method_version": str(CPU_SPEC_VERSION),
        },
        measured=True,
    )


def _cpu_cache_path(devices_dir: Path) -> Path:
    digest = hashlib.sha1(cpu_fingerprint().encode()).hexdigest()[:12]
    return devices_dir / f"cpu-{digest}.json"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so concurrent readers see the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def cpu_spec(*, directory: Path | None = None, refresh: bool = False, **measure: Any) -> DeviceSpec:
    """This CPU's spec: read from the cache, or measured (:func:`measure_cpu`) and cached.

    The cache file is keyed by :func:`cpu_fingerprint`; ``refresh=True`` re-measures;
    ``measure`` goes to :func:`measure_cpu` (sizes, time budget).
    """
    try:
        path: Path | None = _cpu_cache_path(private_cache_dir("devices", root=directory))
    except CalibrationError as exc:
        warnings.warn(f"{exc}; measuring this CPU without caching the result", RuntimeWarning, stacklevel=2)
        path = None
    if not refresh and path is not None and path.is_file():
        try:
            raw = read_json(path, what="CPU spec cache", error=CalibrationError)
            if raw.get("sources", {}).get("method_version") == str(CPU_SPEC_VERSION):
                return DeviceSpec.from_dict(raw, source=str(path))
        except (CalibrationError, AttributeError):
            pass  # unreadable cache: measure again and overwrite it
    spec = measure_cpu(**measure)
    if path is not None:
        write_json_atomic(path, spec.to_dict())
    return spec


def current_device_spec(device: str = "cpu", *, directory: Path | None = None) -> DeviceSpec:
    """The spec of a torch device: a shipped GPU spec by its name, or the measured CPU."""
    if device.startswith("cuda"):
        fp = device_fingerprint(device)
        spec = device_by_fingerprint(fp)
        if spec is None:
            known = ", ".join(s.name for s in builtin_specs())
            raise CalibrationError(f"no device spec for GPU {fp!r}; known devices: {known}")
        return spec
    return cpu_spec(directory=directory)
