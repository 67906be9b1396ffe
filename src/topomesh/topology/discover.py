"""Discover the local host: GPUs, NICs, NUMA nodes and the paths between them.

Everything comes from sysfs under a root that can be pointed elsewhere (argument, or env
``TOPOMESH_SYSFS_ROOT``), so tests run on fixture trees (``tests/fixtures/sysfs/<name>``):

* ``sys/bus/pci/devices/*`` — PCI class, vendor, device, ``numa_node``, link speed and
  width; the symlink target names the chain of parent bridges up to the host bridge.
* ``sys/class/infiniband/*/ports/*/{rate,state}`` — RDMA NICs (InfiniBand or RoCE).
* ``sys/class/net/*/{speed,operstate,device}`` — Ethernet NICs (``lo`` and virtual
  interfaces without a ``device`` link are skipped, as are netdevs of an RDMA NIC).
* ``sys/devices/system/node/node*/cpulist`` — NUMA nodes, one CPU :class:`Device` each.

NVLink is not in sysfs; NVML is (:mod:`topomesh.topology.nvml`). A fixture tree carries a
fake ``nvml.json`` instead. Missing or garbled data gives a smaller host, never an
exception; only an unusable root raises :class:`~topomesh.errors.TopologyError`.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from itertools import combinations
from pathlib import Path as FsPath

from topomesh.errors import TopologyError
from topomesh.topology.defaults import LinkDefaults, link_defaults
from topomesh.topology.model import Device, DeviceKind, Host, LinkKind, Nic, NicKind, Path
from topomesh.topology.nvml import NVSWITCH, NvmlGpu, normalize_bus_id, read_fake_nvml, read_nvml

ENV_SYSFS_ROOT = "TOPOMESH_SYSFS_ROOT"
FAKE_NVML_FILE = "nvml.json"
HOSTNAME_FILE = "hostname"

NVIDIA_VENDOR = 0x10DE
_GPU_CLASSES = (0x0300, 0x0302)  # VGA-compatible / 3D controller (PCI class code, upper 16 bits)
_NVSWITCH_CLASS = 0x0680  # bridge, other: how NVSwitches appear on the PCI bus
_ARPHRD_INFINIBAND = 32  # /sys/class/net/*/type of an IPoIB netdev

_BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$", re.IGNORECASE)
_HOST_BRIDGE = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$", re.IGNORECASE)
_GTPS = re.compile(r"^\s*([0-9.]+)\s*GT/s", re.IGNORECASE)
_IB_RATE = re.compile(r"^\s*([0-9.]+)\s*Gb/sec")
# PCIe generation by per-lane transfer rate (PCI-SIG base specifications, Gen1..Gen6).
_GEN_BY_GTPS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}


# --------------------------------------------------------------------------- sysfs reading


def _read(path: str | os.PathLike[str]) -> str | None:
    """A sysfs attribute, stripped; None when missing, unreadable, not a file or not text."""
    try:
        if not os.path.isfile(path):  # never open a FIFO or device node planted in a tree
            return None
        with open(path, encoding="utf-8") as fh:
            return fh.read(4096).strip()
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _read_int(path: str | os.PathLike[str], base: int = 10) -> int | None:
    text = _read(path)
    if not text:
        return None
    try:
        return int(text.split()[0], base)
    except ValueError:
        return None


def _listdir(path: str | os.PathLike[str]) -> list[str]:
    try:
        return sorted(os.listdir(path), key=_natural)
    except OSError:
        return []


def _natural(name: str) -> tuple:
    """Sort key that puts ``mlx5_2`` before ``mlx5_10``."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def _realpath(path: str | os.PathLike[str]) -> str | None:
    try:
        return os.path.realpath(path)
    except (OSError, RuntimeError, ValueError):
        return None


def _bdfs_in(path: str | None) -> list[str]:
    """The PCI addresses among the components of a resolved sysfs path, top first."""
    return [c for c in (path or "").split(os.sep) if _BDF.match(c)]


def parse_cpulist(text: str | None) -> tuple[int, ...]:
    """CPU numbers of a sysfs cpulist; garbage parts are skipped.

    >>> parse_cpulist("0-3,8,10-11")
    (0, 1, 2, 3, 8, 10, 11)
    >>> parse_cpulist("")
    ()
    """
    cpus: list[int] = []
    for part in (text or "").split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            continue
        if 0 <= first <= last:
            cpus.extend(range(first, last + 1))
    return tuple(cpus)


def pcie_gen(link_speed: str | None) -> int | None:
    """PCIe generation from a ``current_link_speed`` text.

    >>> pcie_gen("32.0 GT/s PCIe")
    5
    >>> pcie_gen("8 GT/s") , pcie_gen("Unknown")
    (3, None)
    """
    m = _GTPS.match(link_speed or "")
    if not m:
        return None
    try:
        return _GEN_BY_GTPS.get(float(m.group(1)))
    except ValueError:
        return None


def ib_rate_Gbps(rate: str | None) -> float | None:
    """Line rate of an InfiniBand port from its ``rate`` attribute.

    >>> ib_rate_Gbps("400 Gb/sec (4X NDR)")
    400.0
    >>> ib_rate_Gbps("garbage") is None
    True
    """
    m = _IB_RATE.match(rate or "")
    try:
        value = float(m.group(1)) if m else None
    except ValueError:
        return None
    return value if value and value > 0 else None


# --------------------------------------------------------------------------- PCI tree


@dataclass(frozen=True, slots=True, kw_only=True)
class PciDevice:
    """One PCI function and where it hangs in the PCI tree."""

    bus_id: str
    host_bridge: str | None
    """The root complex it sits under (``pci0000:00``), None when the path names none."""
    chain: tuple[str, ...]
    """Bus ids of its parent bridges, from the root port down to its direct parent."""
    class_code: int | None = None
    vendor: int | None = None
    device: int | None = None
    numa_node: int | None = None
    link_gen: int | None = None
    link_width: int | None = None

    @property
    def is_nvidia_gpu(self) -> bool:
        return self.vendor == NVIDIA_VENDOR and self.class_code is not None and (self.class_code >> 8) in _GPU_CLASSES


def read_pci(root: str | os.PathLike[str]) -> dict[str, PciDevice]:
    """Every PCI function under ``<root>/sys/bus/pci/devices``, keyed by bus id."""
    base = os.path.join(root, "sys", "bus", "pci", "devices")
    out: dict[str, PciDevice] = {}
    for name in _listdir(base):
        bus = normalize_bus_id(name)
        if bus is None:
            continue
        entry = os.path.join(base, name)
        host_bridge, chain = _position(_realpath(entry), bus)
        numa = _read_int(os.path.join(entry, "numa_node"))
        width = _read_int(os.path.join(entry, "current_link_width"))
        out[bus] = PciDevice(
            bus_id=bus,
            host_bridge=host_bridge,
            chain=chain,
            class_code=_read_int(os.path.join(entry, "class"), 16),
            vendor=_read_int(os.path.join(entry, "vendor"), 16),
            device=_read_int(os.path.join(entry, "device"), 16),
            numa_node=numa if numa is not None and numa >= 0 else None,
            link_gen=pcie_gen(_read(os.path.join(entry, "current_link_speed"))),
            link_width=width if width and width > 0 else None,
        )
    return out


def _position(real: str | None, bus: str) -> tuple[str | None, tuple[str, ...]]:
    """Host bridge and parent bridges from a resolved ``/sys/devices/pci.../...`` path."""
    parts = (real or "").split(os.sep)
    starts = [i for i, c in enumerate(parts) if _HOST_BRIDGE.match(c)]
    host_bridge = parts[starts[-1]] if starts else None
    below = parts[starts[-1] + 1 :] if starts else parts
    chain = [normalize_bus_id(c) for c in below if _BDF.match(c)]
    if chain and chain[-1] == bus:
        chain.pop()
    return host_bridge, tuple(c for c in chain if c and c != bus)


def pcie_path_kind(a: PciDevice, b: PciDevice, *, single_numa: bool) -> LinkKind:
    """The ``nvidia-smi topo -m`` class of the PCIe path between two functions.

    Different host bridges: NODE on one NUMA node, SYS across (or unknown, when the host
    has several nodes). Same host bridge, no common bridge: PHB. Otherwise count the bridges
    on the path (up from ``a`` to the deepest common bridge, then down to ``b``): one PCIe
    switch is three (downstream port, upstream port, downstream port) and gives PIX, more
    gives PXB. Worked example, a GPU and a NIC under one switch, and a GPU under a second
    switch below it::

        GPU0  pci0000:00/00:01.0/01:00.0/02:00.0/03:00.0   chain (00:01.0, 01:00.0, 02:00.0)
        NIC0  pci0000:00/00:01.0/01:00.0/02:01.0/04:00.0   chain (00:01.0, 01:00.0, 02:01.0)
        GPU1  .../02:02.0/05:00.0/06:00.0/07:00.0          chain (..., 02:02.0, 05:00.0, 06:00.0)

    GPU0-NIC0 shares 2 bridges: 1 + 1 + 1 = 3 bridges, PIX. GPU0-GPU1: 1 + 3 + 1 = 5, PXB.
    """
    if a.host_bridge != b.host_bridge:
        if a.numa_node is not None and b.numa_node is not None:
            return LinkKind.NODE if a.numa_node == b.numa_node else LinkKind.SYS
        return LinkKind.NODE if single_numa else LinkKind.SYS
    common = _common_prefix(a.chain, b.chain)
    if common == 0:
        return LinkKind.PHB
    bridges = (len(a.chain) - common) + (len(b.chain) - common) + 1
    return LinkKind.PIX if bridges <= 3 else LinkKind.PXB


def _common_prefix(x: Sequence[str], y: Sequence[str]) -> int:
    n = 0
    for p, q in zip(x, y, strict=False):
        if p != q:
            break
        n += 1
    return n


def pcie_path_GBps(
    a: PciDevice, b: PciDevice | None, pci: Mapping[str, PciDevice], d: LinkDefaults
) -> float | None:
    """Bottleneck bandwidth of the path: the slowest gen x width among the links it uses.

    The links used are each end's own and those of the bridges below the deepest common
    bridge (whose own upstream link is not crossed). ``b`` None: ``a`` up to the CPU.
    """
    common = _common_prefix(a.chain, b.chain) if b is not None and a.host_bridge == b.host_bridge else 0
    hops = [a, *(pci[c] for c in a.chain[common:] if c in pci)]
    if b is not None:
        hops += [b, *(pci[c] for c in b.chain[common:] if c in pci)]
    rates = [d.pcie_GBps(h.link_gen, h.link_width) for h in hops if h.link_gen and h.link_width]
    return min(rates) if rates else None


# --------------------------------------------------------------------------- NICs and NUMA


@dataclass(frozen=True, slots=True, kw_only=True)
class _FoundNic:
    name: str
    kind: NicKind
    speed_Gbps: float | None
    bus_id: str | None


def _device_bus_id(link: str) -> str | None:
    """PCI bus id of the function behind a ``device`` symlink (the nearest PCI ancestor).

    None when the link dangles: a removed device's old place in the tree is not evidence.
    """
    if not os.path.exists(link):
        return None
    bdfs = _bdfs_in(_realpath(link))
    return normalize_bus_id(bdfs[-1]) if bdfs else None


def read_ib_nics(root: str | os.PathLike[str]) -> list[_FoundNic]:
    """RDMA devices under ``sys/class/infiniband``; those with no ACTIVE port are skipped.

    The speed is the fastest active port's rate (every port when no state is readable).
    """
    base = os.path.join(root, "sys", "class", "infiniband")
    out: list[_FoundNic] = []
    for name in _listdir(base):
        dev = os.path.join(base, name)
        ports = os.path.join(dev, "ports")
        rates: list[float] = []
        active: list[float] = []
        states = actives = 0
        for port in _listdir(ports):
            rate = ib_rate_Gbps(_read(os.path.join(ports, port, "rate")))
            state = _read(os.path.join(ports, port, "state"))
            if state is not None:
                states += 1
                if "ACTIVE" in state.upper():
                    actives += 1
                    active += [rate] if rate else []
            rates += [rate] if rate else []
        if states and not actives:
            continue  # every port is down: not a usable rail
        speeds = active if actives else rates
        out.append(
            _FoundNic(
                name=name,
                kind=NicKind.IB,
                speed_Gbps=max(speeds) if speeds else None,
                bus_id=_device_bus_id(os.path.join(dev, "device")),
            )
        )
    return out


def read_eth_nics(root: str | os.PathLike[str], skip_bus_ids: set[str]) -> list[_FoundNic]:
    """Physical netdevs under ``sys/class/net`` that are up (or whose state is unknown).

    Skipped: ``lo``, interfaces without a ``device`` link (bridges, veth, docker, ifb),
    administratively down ones, IPoIB, and netdevs of a PCI function in ``skip_bus_ids``
    (an RDMA NIC already listed).
    """
    base = os.path.join(root, "sys", "class", "net")
    out: list[_FoundNic] = []
    for name in _listdir(base):
        dev = os.path.join(base, name)
        link = os.path.join(dev, "device")
        if name == "lo" or not os.path.lexists(link):
            continue
        if (_read(os.path.join(dev, "operstate")) or "").lower() == "down":
            continue
        if _read_int(os.path.join(dev, "type")) == _ARPHRD_INFINIBAND:
            continue
        bus = _device_bus_id(link)
        if bus is not None and bus in skip_bus_ids:
            continue
        mbps = _read_int(os.path.join(dev, "speed"))
        out.append(
            _FoundNic(
                name=name,
                kind=NicKind.ETHERNET,
                speed_Gbps=mbps / 1000.0 if mbps and mbps > 0 else None,
                bus_id=bus,
            )
        )
    return out


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, sorted (``os.sched_getaffinity``; every CPU of
    ``os.cpu_count`` where the platform lacks it)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def read_numa_nodes(root: str | os.PathLike[str]) -> dict[int, tuple[int, ...]]:
    """NUMA node number -> its CPUs; nodes without CPUs (memory-only) are left out."""
    base = os.path.join(root, "sys", "devices", "system", "node")
    out: dict[int, tuple[int, ...]] = {}
    for name in _listdir(base):
        m = re.fullmatch(r"node(\d+)", name)
        if not m:
            continue
        cpus = parse_cpulist(_read(os.path.join(base, name, "cpulist")))
        if cpus:
            out[int(m.group(1))] = cpus
    return out


# --------------------------------------------------------------------------- GPU id table


@cache
def _gpu_table() -> dict[int, dict[int, tuple[str, str]]]:
    """``data/gpu_pci_ids.json``: vendor -> device id -> (name, arch)."""
    raw = json.loads(resources.files("topomesh.topology").joinpath("data/gpu_pci_ids.json").read_text())
    return {
        int(vendor, 16): {int(dev, 16): (e["name"], e["arch"]) for dev, e in devs.items() if not dev.startswith("_")}
        for vendor, devs in raw.items()
        if not vendor.startswith("_")
    }


def gpu_from_table(vendor: int | None, device: int | None) -> tuple[str, str] | None:
    """(name, arch) of a known GPU model, from its PCI ids.

    >>> gpu_from_table(0x10DE, 0x2330)
    ('H100', 'sm90')
    """
    if vendor is None or device is None:
        return None
    return _gpu_table().get(vendor, {}).get(device)


# --------------------------------------------------------------------------- the host


def discover_host(
    sysfs_root: str | os.PathLike[str] | None = None,
    *,
    hostname: str | None = None,
    use_nvml: bool | None = None,
) -> Host:
    """The :class:`Host` this machine (or the sysfs tree at ``sysfs_root``) describes.

    ``sysfs_root`` defaults to ``$TOPOMESH_SYSFS_ROOT``, else ``/``. ``hostname`` defaults
    to the first line of ``<root>/hostname`` when present, else this machine's name.
    ``use_nvml``: ``False`` reads sysfs only; ``None`` (default) uses ``<root>/nvml.json``
    when present, else real NVML only when the root is ``/``; ``True`` uses ``nvml.json``
    when present, else real NVML whatever the root. NVML that cannot load is skipped.

    GPUs are ``GPU0..`` in PCI bus order (nvidia-smi's order), NUMA nodes ``CPU<n>``, NICs
    ``NIC0..`` (RDMA devices first, then Ethernet, each in name order).
    """
    root = _check_root(sysfs_root)
    pci = read_pci(root)
    numa = read_numa_nodes(root)
    single_numa = len(numa) <= 1

    def numa_of(bus: str | None) -> int | None:
        dev = pci.get(bus) if bus else None
        if dev is not None and dev.numa_node is not None:
            return dev.numa_node
        return next(iter(numa), 0) if single_numa else None  # no NUMA info: one node, 0

    nvml = _nvml_data(root, use_nvml, pci)
    # NVML is trusted about which GPUs exist (a container may hide them from sysfs)
    gpu_buses = {p.bus_id for p in pci.values() if p.is_nvidia_gpu} | set(nvml or {})
    devices: list[Device] = []
    for i, bus in enumerate(sorted(gpu_buses, key=_bus_key)):
        info = nvml.get(bus) if nvml else None
        p = pci.get(bus)
        known = gpu_from_table(p.vendor, p.device) if p else None
        devices.append(
            Device(
                id=f"GPU{i}",
                kind=DeviceKind.GPU,
                index=i,
                name=(info.name if info and info.name else (known[0] if known else "")),
                pci_bus_id=bus,
                numa_node=numa_of(bus),
                arch=(info.arch if info and info.arch else (known[1] if known else None)),
                memory_bytes=info.memory_bytes if info else None,
            )
        )
    cpu_nodes = sorted(numa) or [0]
    for n in cpu_nodes:
        devices.append(Device(id=f"CPU{n}", kind=DeviceKind.CPU, index=n, numa_node=n))

    ib = read_ib_nics(root)
    found = ib + read_eth_nics(root, {n.bus_id for n in ib if n.bus_id})
    nics = [
        Nic(id=f"NIC{i}", name=f.name, kind=f.kind, speed_Gbps=f.speed_Gbps, pci_bus_id=f.bus_id, numa_node=numa_of(f.bus_id))
        for i, f in enumerate(found)
    ]
    paths = _paths(devices, nics, pci, nvml or {}, single_numa, link_defaults())
    return Host(hostname=hostname or _default_hostname(root), devices=tuple(devices), nics=tuple(nics), paths=paths)


def _check_root(sysfs_root: str | os.PathLike[str] | None) -> str:
    raw = sysfs_root if sysfs_root is not None else (os.environ.get(ENV_SYSFS_ROOT) or "/")
    root = os.fspath(raw)
    where = f"sysfs root {root!r}" + (f" (from ${ENV_SYSFS_ROOT})" if sysfs_root is None and os.environ.get(ENV_SYSFS_ROOT) else "")
    if not os.path.exists(root):
        raise TopologyError(f"{where} does not exist")
    if not os.path.isdir(root):
        raise TopologyError(f"{where} is not a directory")
    if not os.path.isdir(os.path.join(root, "sys")):
        raise TopologyError(f"{where} has no sys/ directory, so it is not a sysfs tree")
    return root


def _default_hostname(root: str) -> str:
    text = _read(os.path.join(root, HOSTNAME_FILE))
    first = text.splitlines()[0].strip() if text else ""
    first = "".join(ch for ch in first if ch.isprintable() and not ch.isspace())
    return first or socket.gethostname() or "localhost"


def _bus_key(bus: str) -> tuple[int, ...]:
    return tuple(int(x, 16) for x in re.split(r"[:.]", bus))


def _is_root(root: str) -> bool:
    return FsPath(root).resolve() == FsPath("/").resolve()


def _nvml_data(root: str, use_nvml: bool | None, pci: Mapping[str, PciDevice]) -> dict[str, NvmlGpu] | None:
    if use_nvml is False:
        return None
    fake = os.path.join(root, FAKE_NVML_FILE)
    if os.path.isfile(fake):
        return read_fake_nvml(fake)
    if use_nvml is None and not _is_root(root):
        return None  # a fixture tree without nvml.json must not pick up this machine's GPUs

    def is_nvswitch(bus: str) -> bool:
        dev = pci.get(bus)
        return bool(dev and dev.class_code is not None and dev.class_code >> 8 == _NVSWITCH_CLASS)

    return read_nvml(is_nvswitch)


def _paths(
    devices: Sequence[Device],
    nics: Sequence[Nic],
    pci: Mapping[str, PciDevice],
    nvml: Mapping[str, NvmlGpu],
    single_numa: bool,
    d: LinkDefaults,
) -> tuple[Path, ...]:
    """GPU-GPU (NVLink first, else PCIe class), GPU-NIC (PCIe class), CPU-NIC (PHB/SYS).

    Pairs with an end whose place in the PCI tree is unknown get no path.
    """

    def pcie(a_id: str, a_bus: str | None, b_id: str, b_bus: str | None) -> Path | None:
        a, b = pci.get(a_bus or ""), pci.get(b_bus or "")
        if a is None or b is None:
            return None
        kind = pcie_path_kind(a, b, single_numa=single_numa)
        return Path(a=a_id, b=b_id, kind=kind, bandwidth_GBps=pcie_path_GBps(a, b, pci, d))

    gpus = [g for g in devices if g.kind is DeviceKind.GPU]
    out: list[Path | None] = []
    for a, b in combinations(gpus, 2):
        out.append(_nvlink_path(a, b, nvml) or pcie(a.id, a.pci_bus_id, b.id, b.pci_bus_id))
    out += [pcie(g.id, g.pci_bus_id, n.id, n.pci_bus_id) for g in gpus for n in nics]
    for c in (dev for dev in devices if dev.kind is DeviceKind.CPU):
        for n in nics:
            if c.numa_node is None or n.numa_node is None:
                continue
            kind = LinkKind.PHB if c.numa_node == n.numa_node else LinkKind.SYS
            own = pcie_path_GBps(pci[n.pci_bus_id], None, pci, d) if n.pci_bus_id in pci else None
            out.append(Path(a=c.id, b=n.id, kind=kind, bandwidth_GBps=own))
    return tuple(p for p in out if p is not None)


def _nvlink_path(a: Device, b: Device, nvml: Mapping[str, NvmlGpu]) -> Path | None:
    """NVSwitch when both GPUs have switch links (count: the fewer of the two), else a direct bond."""
    na, nb = nvml.get(a.pci_bus_id or ""), nvml.get(b.pci_bus_id or "")
    if na is None or nb is None:
        return None
    via_switch = min(na.links_to(NVSWITCH), nb.links_to(NVSWITCH))
    direct = max(na.links_to(nb.bus_id), nb.links_to(na.bus_id))
    if via_switch and via_switch >= direct:
        return Path(a=a.id, b=b.id, kind=LinkKind.NVSWITCH, nvlink_count=via_switch)
    if direct:
        return Path(a=a.id, b=b.id, kind=LinkKind.NVLINK, nvlink_count=direct)
    return None
