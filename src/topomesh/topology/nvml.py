"""What NVML knows about a host's GPUs and sysfs does not: NVLink peers, arch, name, memory.

Two backends give the same answer, a mapping ``PCI bus id -> NvmlGpu``:

* :func:`read_nvml` asks the driver through nvidia-ml-py (``import pynvml``). It never
  raises: no package, no library, no driver or any NVML error gives ``None`` (the caller
  then falls back to sysfs alone).
* :func:`read_fake_nvml` reads an ``nvml.json`` file, the fake backend that fixture trees
  use (format in ``docs/discovery.md``)::

      {"gpus": {"0000:18:00.0": {"name": "NVIDIA H100 80GB HBM3", "arch": "sm90",
                                  "memory_bytes": 85520809984,
                                  "nvlinks": [{"remote": "nvswitch", "count": 18}]}}}

  ``remote`` is the PCI bus id of a peer GPU, or ``"nvswitch"``; ``count`` the number of
  links to it (entries to the same remote add up).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from topomesh.errors import TopologyError

NVSWITCH = "nvswitch"
"""The ``remote`` of a link that ends at an NVSwitch rather than at a GPU."""

_BUS_ID = re.compile(r"^([0-9a-fA-F]{1,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


def normalize_bus_id(text: str | bytes | None) -> str | None:
    """A PCI bus id in sysfs form (``dddd:bb:dd.f``, lower case), or None if it is not one.

    NVML writes an 8-digit domain; sysfs uses 4 digits unless the domain needs more.

    >>> normalize_bus_id("00000000:1B:00.0")
    '0000:1b:00.0'
    >>> normalize_bus_id(b"0000:c3:00.1")
    '0000:c3:00.1'
    >>> normalize_bus_id("10000:01:00.0")
    '10000:01:00.0'
    >>> normalize_bus_id("GPU-1234") is None
    True
    """
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    if not isinstance(text, str):
        return None
    m = _BUS_ID.match(text.strip().rstrip("\x00"))
    if not m:
        return None
    domain = int(m.group(1), 16)
    return f"{domain:04x}:{m.group(2).lower()}:{m.group(3).lower()}.{m.group(4)}"


@dataclass(frozen=True, slots=True, kw_only=True)
class NvLink:
    """A bond of NVLinks from one GPU to one remote end."""

    remote: str
    """PCI bus id of the peer GPU (sysfs form), or :data:`NVSWITCH`."""
    count: int
    """Links in the bond (>= 1)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NvmlGpu:
    """One GPU as NVML (or a fake ``nvml.json``) describes it."""

    bus_id: str
    name: str = ""
    arch: str | None = None
    """``sm<major><minor>`` from the CUDA compute capability, e.g. ``sm90``."""
    memory_bytes: int | None = None
    nvlinks: tuple[NvLink, ...] = ()

    def links_to(self, remote: str) -> int:
        """Total links from this GPU to ``remote`` (a bus id or :data:`NVSWITCH`)."""
        return sum(link.count for link in self.nvlinks if link.remote == remote)


# --------------------------------------------------------------------------- fake backend


def read_fake_nvml(path: str | os.PathLike[str]) -> dict[str, NvmlGpu]:
    """Parse a fake-NVML ``nvml.json``; raises :class:`TopologyError` naming the bad field."""
    src = os.fspath(path)
    try:
        with open(src, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyError(f"cannot read the fake NVML file ({exc})", source=src) from None
    except json.JSONDecodeError as exc:
        raise TopologyError(f"not valid JSON ({exc.msg})", source=src, where=f"line {exc.lineno}") from None
    gpus = data.get("gpus") if isinstance(data, Mapping) else None
    if not isinstance(gpus, Mapping):
        raise TopologyError('expected an object with a "gpus" object keyed by PCI bus id', source=src)
    out: dict[str, NvmlGpu] = {}
    for key, entry in gpus.items():
        where = f"gpus.{key}"
        bus = normalize_bus_id(key)
        if bus is None:
            raise TopologyError(f"{key!r} is not a PCI bus id like '0000:18:00.0'", source=src, where=where)
        if not isinstance(entry, Mapping):
            raise TopologyError("expected an object", source=src, where=where)
        out[bus] = NvmlGpu(
            bus_id=bus,
            name=_typed(entry, "name", str, "", src, where),
            arch=_typed(entry, "arch", str, None, src, where),
            memory_bytes=_typed(entry, "memory_bytes", int, None, src, where),
            nvlinks=_fake_links(entry.get("nvlinks", []), src, where),
        )
    return out


def _typed(entry: Mapping[str, Any], key: str, kind: type, default: Any, src: str, where: str) -> Any:
    value = entry.get(key, default)
    if value is default or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise TopologyError(f"{key} must be a {kind.__name__}, got {value!r}", source=src, where=where)


def _fake_links(raw: Any, src: str, where: str) -> tuple[NvLink, ...]:
    if not isinstance(raw, list):
        raise TopologyError(f"nvlinks must be a list, got {raw!r}", source=src, where=where)
    links: list[NvLink] = []
    for i, item in enumerate(raw):
        at = f"{where}.nvlinks[{i}]"
        if not isinstance(item, Mapping):
            raise TopologyError("expected an object with remote and count", source=src, where=at)
        remote = item.get("remote")
        count = item.get("count", 1)
        if remote != NVSWITCH:
            remote = normalize_bus_id(remote) if isinstance(remote, str) else None
        if remote is None:
            raise TopologyError(
                f"remote must be a PCI bus id or {NVSWITCH!r}, got {item.get('remote')!r}", source=src, where=at
            )
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise TopologyError(f"count must be an integer >= 1, got {count!r}", source=src, where=at)
        links.append(NvLink(remote=remote, count=count))
    return tuple(links)


# --------------------------------------------------------------------------- real backend


def read_nvml(is_nvswitch: Callable[[str], bool] | None = None) -> dict[str, NvmlGpu] | None:
    """Ask the NVIDIA driver through nvidia-ml-py; None when NVML is unusable for any reason.

    ``is_nvswitch(bus_id)`` decides the far end of a link when the driver cannot say
    (``nvmlDeviceGetNvLinkRemoteDeviceType`` missing, drivers before r460): discovery passes
    a test of the PCI class in sysfs (0x0680, bridge/other = NVSwitch).
    """
    try:
        import pynvml
    except Exception:  # ImportError, or a broken install
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None
    try:
        return _read_all(pynvml, is_nvswitch)
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _read_all(nv: Any, is_nvswitch: Callable[[str], bool] | None) -> dict[str, NvmlGpu]:
    gpus: list[tuple[str, Any]] = []
    for i in range(nv.nvmlDeviceGetCount()):
        handle = nv.nvmlDeviceGetHandleByIndex(i)
        bus = normalize_bus_id(_text(nv.nvmlDeviceGetPciInfo(handle).busId))
        if bus is not None:
            gpus.append((bus, handle))
    known = {bus for bus, _ in gpus}
    out: dict[str, NvmlGpu] = {}
    for bus, handle in gpus:
        out[bus] = NvmlGpu(
            bus_id=bus,
            name=_optional(lambda h=handle: _text(nv.nvmlDeviceGetName(h))) or "",
            arch=_optional(lambda h=handle: "sm{}{}".format(*nv.nvmlDeviceGetCudaComputeCapability(h))),
            memory_bytes=_optional(lambda h=handle: int(nv.nvmlDeviceGetMemoryInfo(h).total)),
            nvlinks=_real_links(nv, handle, known, is_nvswitch),
        )
    return out


def _optional(fn: Callable[[], Any]) -> Any:
    """``fn()``, or None when NVML says the query is not supported on this device."""
    try:
        return fn()
    except Exception:
        return None


def _real_links(
    nv: Any, handle: Any, gpus: set[str], is_nvswitch: Callable[[str], bool] | None
) -> tuple[NvLink, ...]:
    remote_pci = getattr(nv, "nvmlDeviceGetNvLinkRemotePciInfo_v2", None) or nv.nvmlDeviceGetNvLinkRemotePciInfo
    remote_type = getattr(nv, "nvmlDeviceGetNvLinkRemoteDeviceType", None)
    switch_type = getattr(nv, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    counts: dict[str, int] = {}
    for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            if nv.nvmlDeviceGetNvLinkState(handle, link) != nv.NVML_FEATURE_ENABLED:
                continue
        except Exception:  # NotSupported (no NVLink) or InvalidArgument (past the last link)
            continue
        bus = _optional(lambda lk=link: normalize_bus_id(_text(remote_pci(handle, lk).busId)))
        kind = _optional(lambda lk=link: remote_type(handle, lk)) if remote_type else None
        if kind == switch_type or (kind is None and bus not in gpus and bus and is_nvswitch and is_nvswitch(bus)):
            remote = NVSWITCH
        elif bus in gpus:
            remote = bus
        else:
            continue  # a CPU (IBM NPU) or an end we cannot name
        counts[remote] = counts.get(remote, 0) + 1
    return tuple(NvLink(remote=r, count=c) for r, c in sorted(counts.items()))
