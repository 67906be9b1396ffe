"""NCCL topology XML (``NCCL_TOPO_FILE`` / ``NCCL_TOPO_DUMP_FILE``) → one :class:`Host`.

NCCL writes the machine as a tree::

    <system version="1">
      <cpu numaid="0" ...>
        <pci busid="0000:0c:00.0" class="0x060400" link_speed="16 GT/s" link_width="16">
          <pci busid="0000:13:00.0" class="0x030200" ...>
            <gpu dev="0" sm="80" rank="0">
              <nvlink target="0000:c3:00.0" count="2" tclass="0x068000"/>
            </gpu>
          </pci>
          <pci busid="0000:1a:00.0" class="0x020000" ...>
            <nic><net name="mlx5_1" dev="1" speed="200000" gdr="1"/></nic>
          </pci>
        </pci>
      </cpu>
    </system>

A ``<pci>`` element with children is a PCIe switch (NCCL skips the switch's downstream
ports when it builds the tree, so one element is one switch). From the tree this module
derives, for every GPU pair and every GPU-NIC pair, the ``nvidia-smi topo -m`` class:

* endpoints under different ``<cpu>`` (NUMA nodes): ``SYS``;
* under the same ``<cpu>`` but different top-level ``<pci>`` subtrees: ``NODE`` (each
  top-level element hangs off its own root port; the XML does not say which host bridge,
  and on current servers such pairs are reported as ``NODE``);
* an endpoint attached to the ``<cpu>`` without any PCI element: ``PHB``;
* otherwise the number of switches on the path: one → ``PIX``, more → ``PXB``.

NVLinks: ``<nvlink tclass="0x068000">`` goes to an NVSwitch; two GPUs that both reach
switches are ``NVSwitch`` with the GPU's total switch links as ``nvlink_count``. An
``<nvlink>`` whose target is another GPU's bus id is a direct ``NVLink`` bond of ``count``
links. PCIe bandwidth is the narrowest ``link_speed`` x ``link_width`` on the path.

Partial files give what they allow: without ``<gpu>`` elements the GPUs are the PCI
devices of display class (0x0300/0x0302), without ``<net>`` elements the NICs are the PCI
devices of network class (0x0207 InfiniBand, 0x0200 Ethernet).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import PurePath

from topomesh.errors import TopologyError
from topomesh.topology.defaults import link_defaults
from topomesh.topology.discover import gpu_from_table, pcie_gen
from topomesh.topology.model import (
    MAX_HOST_DEVICES,
    Device,
    DeviceKind,
    Host,
    LinkKind,
    Nic,
    NicKind,
    Path,
)

# PCI class codes (base class << 8 | subclass), PCI-SIG Code and ID Assignment Spec.
_CLASS_VGA = 0x0300
_CLASS_3D = 0x0302
_CLASS_ETHERNET = 0x0200
_CLASS_INFINIBAND = 0x0207
_CLASS_NVSWITCH = 0x0680  # "other bridge": what NVSwitches report
_VENDOR_ASPEED = 0x1A03  # BMC graphics, never a compute GPU

# RDMA device names as the kernel's ib_core names them (mlx5_0, ib0, irdma0, bnxt_re0, ...).
_RDMA_NAME = re.compile(r"^(mlx\d|ib|irdma|bnxt_re|qedr|hfi1|efa|rxe|siw|erdma|ionic)", re.IGNORECASE)
_DTD = re.compile(r"<!\s*(DOCTYPE|ENTITY)", re.IGNORECASE)


MAX_ATTR_INT = 2**31 - 1
"""Largest integer attribute accepted (link counts, speeds in Mb/s, widths): bigger values
are damage, and would overflow floats in bandwidth arithmetic."""
MAX_XML_ELEMENTS = 100_000
"""Most elements in an NCCL topology file: a DGX A100's has 102 (examples/data/real)."""
MAX_XML_DEPTH = 64
"""Deepest element nesting accepted: NCCL writes system/cpu/pci/pci/gpu/nvlink (6)."""
_XML_CHUNK = 1 << 16


def host_name_for(source: str) -> str:
    """A host name for a file that names none: the file's stem, else ``localhost``.

    >>> host_name_for("/data/a100-node.xml")
    'a100-node'
    >>> host_name_for("<text>")
    'localhost'
    """
    if not source or source.startswith("<"):
        return "localhost"
    return PurePath(source).stem or "localhost"


def is_rdma_name(name: str) -> bool:
    """True for RDMA (InfiniBand / RoCE) device names: ``mlx5_0``, ``ib0``, ``irdma1``."""
    return bool(_RDMA_NAME.match(name))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Pci:
    """One ``<pci>`` element: where it sits and its link."""

    key: int  # position in document order
    busid: str
    pci_class: int | None
    vendor: int | None
    device: int | None
    gen: int | None
    width: int | None
    where: str


@dataclass(frozen=True, slots=True, kw_only=True)
class _Place:
    """Where an endpoint sits: its NUMA node and the PCI elements from the CPU down to it."""

    cpu: int | None
    chain: tuple[_Pci, ...]


def _short(raw: str, limit: int = 40) -> str:
    """``repr`` of a value from a file, cut short so an error stays one readable line."""
    return repr(raw) if len(raw) <= limit else repr(raw[:limit]) + f"... ({len(raw)} characters)"


def _attr_int(el: ET.Element, name: str, where: str, source: str, base: int = 10) -> int | None:
    raw = el.get(name)
    if raw is None or raw.strip() == "":
        return None
    if len(raw) > 24:  # checked before int(): 5,000 digits would be slow, then a ValueError
        raise TopologyError(f"<{el.tag}> attribute {name}={_short(raw)} is out of range", source=source, where=where)
    try:
        value = int(raw.strip(), base)
    except ValueError:
        raise TopologyError(
            f"<{el.tag}> attribute {name}={_short(raw)} is not {'a hex' if base == 16 else 'an'} integer",
            source=source,
            where=where,
        ) from None
    if abs(value) > MAX_ATTR_INT:
        raise TopologyError(f"<{el.tag}> attribute {name}={_short(raw)} is out of range", source=source, where=where)
    return value


def _pci_class(el: ET.Element, where: str, source: str, attr: str = "class") -> int | None:
    """The class as ``base << 8 | subclass``; NCCL writes the 24-bit code ``0x030200``."""
    raw = el.get(attr)
    if raw is None or not raw.strip():
        return None
    text = raw.strip().lower()
    digits = text[2:] if text.startswith("0x") else text
    value = _attr_int(el, attr, where, source, base=16)
    assert value is not None
    return value >> 8 if len(digits) > 4 else value


def normalize_busid(busid: str) -> str:
    """Lower case with a PCI domain: ``13:00.0`` → ``0000:13:00.0``."""
    b = busid.strip().lower()
    return b if b.count(":") >= 2 else f"0000:{b}"


def _child_paths(parent: ET.Element, where: str) -> list[tuple[ET.Element, str]]:
    """Children with their element paths, e.g. ``/system/cpu[2]/pci[1]``."""
    seen: dict[str, int] = {}
    out = []
    for child in parent:
        if not isinstance(child.tag, str):
            continue
        seen[child.tag] = seen.get(child.tag, 0) + 1
        out.append((child, f"{where}/{child.tag}[{seen[child.tag]}]"))
    return out


@dataclass(slots=True, kw_only=True)
class _Collected:
    """What one pass over the tree found (mutable while walking, then discarded)."""

    cpus: list[tuple[int, str]]
    gpus: list[tuple[ET.Element | None, _Pci | None, _Place, str]]  # <gpu>, its pci, place, where
    class_gpus: list[tuple[_Pci, _Place]]
    nics: list[tuple[str, NicKind, float | None, _Pci | None, _Place]]
    switches: set[str]  # bus ids of NVSwitches listed as PCI devices


def _walk(root: ET.Element, source: str) -> _Collected:
    found = _Collected(cpus=[], gpus=[], class_gpus=[], nics=[], switches=set())
    counter = 0
    # explicit stack: deep (hostile) nesting must not hit Python's recursion limit
    stack: list[tuple[ET.Element, str, int | None, tuple[_Pci, ...]]] = [(root, "/system", None, ())]
    while stack:
        el, where, cpu, chain = stack.pop()
        children = _child_paths(el, where)
        pending = []
        for child, cwhere in children:
            tag = child.tag
            if tag == "cpu":
                numa = _attr_int(child, "numaid", cwhere, source)
                if numa is None:
                    numa = len(found.cpus)
                if numa < 0:
                    raise TopologyError(f"<cpu> numaid={numa} is negative", source=source, where=cwhere)
                found.cpus.append((numa, cwhere))
                pending.append((child, cwhere, numa, ()))
            elif tag == "pci":
                counter += 1
                busid = child.get("busid")
                if not busid or not busid.strip():
                    raise TopologyError("<pci> has no busid", source=source, where=cwhere)
                pci = _Pci(
                    key=counter,
                    busid=normalize_busid(busid),
                    pci_class=_pci_class(child, cwhere, source),
                    vendor=_attr_int(child, "vendor", cwhere, source, base=16),
                    device=_attr_int(child, "device", cwhere, source, base=16),
                    gen=pcie_gen(child.get("link_speed")),
                    width=_attr_int(child, "link_width", cwhere, source),
                    where=cwhere,
                )
                sub = (*chain, pci)
                if pci.pci_class == _CLASS_NVSWITCH:
                    found.switches.add(pci.busid)
                if pci.pci_class in (_CLASS_VGA, _CLASS_3D) and pci.vendor != _VENDOR_ASPEED:
                    found.class_gpus.append((pci, _Place(cpu=cpu, chain=sub)))
                has_net = any(c.tag == "nic" and any(n.tag == "net" for n in c) for c in child)
                if not has_net and pci.pci_class in (_CLASS_INFINIBAND, _CLASS_ETHERNET):
                    kind = NicKind.IB if pci.pci_class == _CLASS_INFINIBAND else NicKind.ETHERNET
                    found.nics.append((pci.busid, kind, None, pci, _Place(cpu=cpu, chain=sub)))
                pending.append((child, cwhere, cpu, sub))
            elif tag == "gpu":
                pci = chain[-1] if chain else None
                found.gpus.append((child, pci, _Place(cpu=cpu, chain=chain), cwhere))
            elif tag == "nic":
                pci = chain[-1] if chain else None
                for net, nwhere in _child_paths(child, cwhere):
                    if net.tag != "net":
                        continue
                    found.nics.append(_net(net, nwhere, pci, _Place(cpu=cpu, chain=chain), source))
        # reversed so that the stack pops children in document order
        stack.extend(reversed(pending))
    return found


def _net(
    net: ET.Element, where: str, pci: _Pci | None, place: _Place, source: str
) -> tuple[str, NicKind, float | None, _Pci | None, _Place]:
    name = (net.get("name") or "").strip()
    dev = (net.get("dev") or "").strip()
    if not name:
        name = f"net{dev}" if dev else (pci.busid if pci else "net")
    speed_Mbps = _attr_int(net, "speed", where, source)
    speed_Gbps = speed_Mbps / 1000.0 if speed_Mbps and speed_Mbps > 0 else None
    rdma = (
        is_rdma_name(name)
        or net.get("gdr", "").strip() == "1"
        or (pci is not None and pci.pci_class == _CLASS_INFINIBAND)
    )
    return name, NicKind.IB if rdma else NicKind.ETHERNET, speed_Gbps, pci, place


def _common_depth(a: _Place, b: _Place) -> int:
    """How many PCI elements, from the CPU down, the two endpoints' chains share."""
    common = 0
    for x, y in zip(a.chain, b.chain, strict=False):
        if x.key != y.key:
            break
        common += 1
    return common


def _pcie_class(a: _Place, b: _Place) -> LinkKind | None:
    """The ``nvidia-smi topo -m`` class between two endpoints, None when unknowable."""
    if a.cpu != b.cpu:
        return LinkKind.SYS if a.cpu is not None and b.cpu is not None else None
    if not a.chain or not b.chain:
        return LinkKind.PHB
    common = _common_depth(a, b)
    if common == 0:
        return LinkKind.NODE
    ends = {a.chain[-1].key, b.chain[-1].key}
    switches = {p.key for p in a.chain[common - 1 :] + b.chain[common - 1 :]} - ends
    return LinkKind.PIX if len(switches) <= 1 else LinkKind.PXB


def _path_GBps(a: _Place, b: _Place) -> float | None:
    """Narrowest PCIe link on the path between two endpoints, when the file gives speeds."""
    d = link_defaults()
    common = _common_depth(a, b)
    # the link of the common ancestor itself is not on the path; every element below it is
    on_path = a.chain[common:] + b.chain[common:]
    speeds = [d.pcie_GBps(p.gen, p.width) for p in on_path if p.gen and p.width]
    return min(speeds) if speeds else None


def parse_nccl_xml(text: str, *, source: str) -> Host:
    """Read an NCCL topology XML file into one :class:`Host`.

    Raises :class:`TopologyError` naming the element path for malformed input.
    """
    if _DTD.search(text):
        # NCCL never writes DTDs; refusing them rules out entity-expansion attacks
        raise TopologyError("DOCTYPE/ENTITY declarations are not allowed in a topology file", source=source)
    root = _parse_bounded(text, source)
    if root.tag != "system":
        raise TopologyError(f"root element is <{root.tag}>, expected <system>", source=source, where="/")
    found = _walk(root, source)
    count = len(found.gpus or found.class_gpus) + len(found.nics)
    if count > MAX_HOST_DEVICES:
        raise TopologyError(
            f"the file lists {count} GPUs and NICs, more than the limit of {MAX_HOST_DEVICES} devices per host",
            source=source,
        )

    cpus: list[Device] = []
    for numa, where in found.cpus:
        if any(c.index == numa for c in cpus):
            raise TopologyError(f"two <cpu> elements with numaid={numa}", source=source, where=where)
        cpus.append(Device(id=f"CPU{numa}", kind=DeviceKind.CPU, index=numa, numa_node=numa))

    gpus, places, busids, nvlinks = _gpus(found, source)
    nics = tuple(
        Nic(id=f"NIC{i}", name=name, kind=kind, speed_Gbps=speed, pci_bus_id=pci.busid if pci else None, numa_node=place.cpu)
        for i, (name, kind, speed, pci, place) in enumerate(found.nics)
    )
    for nic, entry in zip(nics, found.nics, strict=True):
        places[nic.id] = entry[4]

    paths: list[Path] = []
    nv = _nvlink_paths(gpus, busids, nvlinks, found)
    for i, a in enumerate(gpus):
        for b in gpus[i + 1 :]:
            link = nv.get((a.id, b.id))
            if link is not None:
                paths.append(Path(a=a.id, b=b.id, kind=link[0], nvlink_count=link[1]))
                continue
            kind = _pcie_class(places[a.id], places[b.id])
            if kind is not None:
                paths.append(Path(a=a.id, b=b.id, kind=kind, bandwidth_GBps=_path_GBps(places[a.id], places[b.id])))
        for nic in nics:
            kind = _pcie_class(places[a.id], places[nic.id])
            if kind is not None:
                paths.append(
                    Path(a=a.id, b=nic.id, kind=kind, bandwidth_GBps=_path_GBps(places[a.id], places[nic.id]))
                )
    return Host(
        hostname=host_name_for(source),
        devices=(*gpus, *sorted(cpus, key=lambda c: c.index)),
        nics=nics,
        paths=tuple(paths),
    )


def _parse_bounded(text: str, source: str) -> ET.Element:
    """The XML tree of ``text``, parsed in chunks so that too many elements or too deep a
    nesting is refused after at most one chunk more than the limit (no tree of millions of
    elements is ever built)."""
    parser = ET.XMLPullParser(events=("start", "end"))
    root: ET.Element | None = None
    depth = count = 0
    try:
        for start in range(0, len(text), _XML_CHUNK):
            parser.feed(text[start : start + _XML_CHUNK])
            for event, el in parser.read_events():
                if event == "end":
                    depth -= 1
                    continue
                root = el if root is None else root
                depth += 1
                count += 1
                if depth > MAX_XML_DEPTH:
                    raise TopologyError(
                        f"elements nested deeper than the limit of {MAX_XML_DEPTH} (at <{_short(str(el.tag), 20)[1:-1]}>, element {count})",
                        source=source,
                    )
                if count > MAX_XML_ELEMENTS:
                    raise TopologyError(f"more than the limit of {MAX_XML_ELEMENTS} XML elements", source=source)
        parser.close()
    except ET.ParseError as exc:
        line, col = exc.position
        msg = str(exc).split(":")[0]
        raise TopologyError(f"not well-formed XML ({msg})", source=source, where=f"line {line} column {col + 1}") from None
    if root is None:
        raise TopologyError("no XML element found", source=source)
    return root


_NvLinks = dict[str, list[tuple[str, int, int | None, str]]]  # gpu id → (target, count, tclass, where)


def _gpus(found: _Collected, source: str) -> tuple[list[Device], dict[str, _Place], dict[str, str], _NvLinks]:
    """GPUs from ``<gpu>`` elements, else from display-class PCI devices, in document order."""
    entries: list[tuple[int | None, str | None, _Pci | None, _Place, ET.Element | None, str]] = []
    if found.gpus:
        for el, pci, place, where in found.gpus:
            assert el is not None
            dev = _attr_int(el, "dev", where, source)
            sm = _attr_int(el, "sm", where, source)
            if dev is not None and dev < 0:
                raise TopologyError(f"<gpu> dev={dev} is negative", source=source, where=where)
            entries.append((dev, f"sm{sm}" if sm is not None else None, pci, place, el, where))
    else:
        entries = [(None, None, pci, place, None, pci.where) for pci, place in found.class_gpus]
    taken = {e[0] for e in entries if e[0] is not None}
    free = (i for i in range(len(entries) + len(taken) + 1) if i not in taken)
    devices: list[Device] = []
    places: dict[str, _Place] = {}
    busids: dict[str, str] = {}
    nvlinks: _NvLinks = {}
    for dev, arch, pci, place, el, where in entries:
        index = dev if dev is not None else next(free)
        gid = f"GPU{index}"
        if gid in places:
            raise TopologyError(f"two GPUs with dev={index}", source=source, where=where)
        # model name (and arch when <gpu sm> is missing) from the PCI ids, as discovery does
        known = gpu_from_table(pci.vendor, pci.device) if pci is not None else None
        devices.append(
            Device(
                id=gid,
                kind=DeviceKind.GPU,
                index=index,
                name=known[0] if known else "",
                pci_bus_id=pci.busid if pci else None,
                numa_node=place.cpu,
                arch=arch or (known[1] if known else None),
            )
        )
        places[gid] = place
        if pci is not None:
            busids[pci.busid] = gid
        links = []
        for link, lwhere in _child_paths(el, where) if el is not None else []:
            if link.tag != "nvlink":
                continue
            target = link.get("target")
            if not target or not target.strip():
                raise TopologyError("<nvlink> has no target", source=source, where=lwhere)
            count = _attr_int(link, "count", lwhere, source)
            if count is not None and count < 0:
                raise TopologyError(f"<nvlink> count={count} is negative", source=source, where=lwhere)
            tclass = _pci_class(link, lwhere, source, attr="tclass")
            links.append((normalize_busid(target), 1 if count is None else count, tclass, lwhere))
        nvlinks[gid] = links
    devices.sort(key=lambda d: d.index)
    return devices, places, busids, nvlinks


def _nvlink_paths(
    gpus: list[Device], busids: dict[str, str], nvlinks: _NvLinks, found: _Collected
) -> dict[tuple[str, str], tuple[LinkKind, int]]:
    """NVLink paths between GPU pairs, keyed by (lower id, higher id) in device order."""
    switch_busids = found.switches
    to_switch: dict[str, int] = {}
    direct: dict[frozenset[str], int] = {}
    for gid, links in nvlinks.items():
        per_peer: dict[str, int] = {}
        for target, count, tclass, _ in links:
            peer = busids.get(target)
            if tclass == _CLASS_NVSWITCH or (tclass is None and target in switch_busids):
                to_switch[gid] = to_switch.get(gid, 0) + count
            elif peer is not None and peer != gid and count > 0:
                per_peer[peer] = per_peer.get(peer, 0) + count
        for peer, count in per_peer.items():
            key = frozenset((gid, peer))
            # both ends list the same bond: take the larger side, do not add them up
            direct[key] = max(direct.get(key, 0), count)
    out: dict[tuple[str, str], tuple[LinkKind, int]] = {}
    for i, a in enumerate(gpus):
        for b in gpus[i + 1 :]:
            sw = min(to_switch.get(a.id, 0), to_switch.get(b.id, 0))
            dl = direct.get(frozenset((a.id, b.id)), 0)
            if sw > 0 and sw >= dl:
                out[(a.id, b.id)] = (LinkKind.NVSWITCH, sw)
            elif dl > 0:
                out[(a.id, b.id)] = (LinkKind.NVLINK, dl)
    return out
