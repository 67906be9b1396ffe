"""``nvidia-smi topo -m`` text → one :class:`Host`.

The command prints a matrix, a legend and (on recent drivers) a NIC legend::

            GPU0    GPU1    NIC0    CPU Affinity    NUMA Affinity   GPU NUMA ID
    GPU0     X      NV4     PIX     0-23            0               N/A
    GPU1    NV4      X      SYS     24-47           1               N/A
    NIC0    PIX     SYS      X

    Legend: ...
    NIC Legend:
      NIC0: mlx5_0

Cells are ``X`` (self), ``NV#`` (a bond of # NVLinks) or a PCIe class ``PIX``, ``PXB``,
``PHB``, ``NODE``, ``SYS`` (older drivers print ``SOC`` for ``SYS``). Older drivers name
NIC columns by device (``mlx5_0``) instead of ``NIC#``. Columns are separated by tabs;
text copied from a web page often has spaces instead, which is accepted too.

NIC kind comes from the device name (``mlx5_*``, ``ib*``, ... are RDMA: ``IB``; anything
else Ethernet); the matrix gives no line rate, so NIC speeds are unknown (None).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from topomesh.errors import TopologyError
from topomesh.topology.defaults import link_defaults
from topomesh.topology.formats.nccl_xml import MAX_ATTR_INT, host_name_for, is_rdma_name
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

_AFFINITY = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_HEADER_TOKEN = re.compile(r"CPU Affinity|NUMA Affinity|GPU NUMA ID|\S+")
# ASCII digits only ("\d" takes "٤"), and "\Z" (not "$", which matches before a final "\n")
_GPU = re.compile(r"GPU([0-9]+)\Z")
_NIC = re.compile(r"NIC([0-9]+)\Z")
_NV = re.compile(r"NV([0-9]+)\Z")
_NIC_LEGEND = re.compile(r"^\s*(NIC[0-9]+)\s*:\s*(\S+)\s*$")
_CELL = re.compile(r"(X|NV[0-9]+|PIX|PXB|PHB|NODE|SYS|SOC)\Z")
_MAX_INDEX_DIGITS = 6

@dataclass(frozen=True, slots=True, kw_only=True)
class _Row:
    label: str
    cells: tuple[str, ...]
    extra: tuple[str, ...]
    line: int


def _split(line: str) -> list[str]:
    """Fields of a matrix line: tab-separated (empty cells kept) or whitespace-separated."""
    if "\t" in line:
        return [f.strip() for f in line.split("\t")]
    return line.split()


def _find_header(lines: list[str], source: str) -> tuple[int, list[str]]:
    for i, line in enumerate(lines):
        tokens = _HEADER_TOKEN.findall(line)
        if tokens and (_GPU.match(tokens[0]) or _NIC.match(tokens[0])) and not any(_CELL.match(t) for t in tokens):
            return i, tokens
    raise TopologyError("no matrix header (a line of column names GPU0, GPU1, ...) found", source=source)


def _rows(lines: list[str], start: int, labels: list[str], source: str) -> dict[str, _Row]:
    rows: dict[str, _Row] = {}
    for i in range(start, len(lines)):
        line = lines[i]
        if not line.strip() or line.strip().startswith("Legend"):
            break
        fields = _split(line)
        label = fields[0] if fields else ""
        if label not in labels:
            raise TopologyError(f"row label {label!r} is not a column of the header", source=source, where=f"line {i + 1}")
        if label in rows:
            raise TopologyError(f"second row for {label}", source=source, where=f"line {i + 1}")
        cells = tuple(fields[1 : 1 + len(labels)])
        if len(cells) < len(labels):
            raise TopologyError(
                f"row {label} has {len(cells)} cells, the header names {len(labels)} columns",
                source=source,
                where=f"line {i + 1}",
            )
        for col, cell in zip(labels, cells, strict=True):
            nv = _NV.match(cell)
            if nv and (len(nv.group(1)) > 10 or int(nv.group(1)) > MAX_ATTR_INT):  # length first: no int() of 5,000 digits
                raise TopologyError(f"NV# between {label} and {col} has {len(cell) - 2} digits: out of range", source=source, where=f"line {i + 1}")
            if not _CELL.match(cell):
                raise TopologyError(
                    f"unknown link {cell[:20]!r} between {label} and {col} (expected X, NV#, PIX, PXB, PHB, NODE or SYS)",
                    source=source,
                    where=f"line {i + 1}",
                )
            if (cell == "X") != (col == label):
                raise TopologyError(
                    f"{label} to {col} is {cell!r}; X belongs on the diagonal only", source=source, where=f"line {i + 1}"
                )
        rows[label] = _Row(label=label, cells=cells, extra=tuple(fields[1 + len(labels) :]), line=i + 1)
    return rows


def _numa(row: _Row | None, header_extra: list[str]) -> int | None:
    """The NUMA Affinity column of a GPU row, when it is a single node number."""
    if row is None or "NUMA Affinity" not in header_extra:
        return None
    pos = header_extra.index("NUMA Affinity")
    if pos >= len(row.extra):
        return None
    value = row.extra[pos]
    return int(value) if re.fullmatch(r"[0-9]{1,6}", value) else None  # not str.isdigit: "²" is a digit


def parse_smi_topo(text: str, *, source: str) -> Host:
    """Read ``nvidia-smi topo -m`` output into one :class:`Host` (GPUs, NICs, paths)."""
    lines = text.splitlines()
    start, tokens = _find_header(lines, source)
    labels = [t for t in tokens if t not in _AFFINITY]
    header_extra = [t for t in tokens if t in _AFFINITY]
    if len(labels) > MAX_HOST_DEVICES:
        raise TopologyError(
            f"the header names {len(labels)} columns, more than the limit of {MAX_HOST_DEVICES} devices per host",
            source=source,
            where=f"line {start + 1}",
        )
    if len(set(labels)) != len(labels):
        raise TopologyError("the header names a column twice", source=source, where=f"line {start + 1}")
    rows = _rows(lines, start + 1, labels, source)
    if not rows:
        raise TopologyError("the matrix header is not followed by any row", source=source, where=f"line {start + 2}")
    legend = {m.group(1): m.group(2) for line in lines if (m := _NIC_LEGEND.match(line))}

    gpus: list[Device] = []
    nics: list[Nic] = []
    ids: dict[str, str] = {}
    for label in labels:
        g = _GPU.match(label)
        if g:
            if len(g.group(1)) > _MAX_INDEX_DIGITS:
                raise TopologyError(f"column {label[:20]!r}... has an index of {len(g.group(1))} digits", source=source, where=f"line {start + 1}")
            idx = int(g.group(1))
            other = next((d.id for d in gpus if d.index == idx), None)
            if other is not None:
                raise TopologyError(f"columns {other} and {label} both name GPU index {idx}", source=source, where=f"line {start + 1}")
            gpus.append(Device(id=label, kind=DeviceKind.GPU, index=idx, numa_node=_numa(rows.get(label), header_extra)))
            ids[label] = label
            continue
        # NIC# columns (names from the NIC legend) or, on older drivers, device names
        name = legend.get(label, label)
        nic_id = label if _NIC.match(label) else f"NIC{len(nics)}"
        if nic_id in ids.values():
            raise TopologyError(f"NIC column {label!r} clashes with {nic_id}", source=source, where=f"line {start + 1}")
        kind = NicKind.IB if is_rdma_name(name) else NicKind.ETHERNET
        nics.append(Nic(id=nic_id, name=name, kind=kind))
        ids[label] = nic_id

    cell = _cells(rows, labels, source)
    paths = []
    nv_kind = _nvlink_kind(gpus, cell)
    gpu_labels = [g.id for g in gpus]
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            value = cell.get((a, b))
            if value is None:
                continue
            nv = _NV.match(value)
            if nv:
                if a not in gpu_labels or b not in gpu_labels:
                    raise TopologyError(f"{a} to {b} is {value}: NVLink joins GPUs only", source=source)
                paths.append(Path(a=ids[a], b=ids[b], kind=nv_kind, nvlink_count=int(nv.group(1))))
            else:
                paths.append(Path(a=ids[a], b=ids[b], kind=LinkKind(value)))  # a PCIe class, SOC already read as SYS
    numas = sorted({g.numa_node for g in gpus if g.numa_node is not None})
    cpus = tuple(Device(id=f"CPU{n}", kind=DeviceKind.CPU, index=n, numa_node=n) for n in numas)
    return Host(
        hostname=host_name_for(source),
        devices=(*sorted(gpus, key=lambda d: d.index), *cpus),
        nics=tuple(nics),
        paths=tuple(paths),
    )


def _cells(rows: dict[str, _Row], labels: list[str], source: str) -> dict[tuple[str, str], str]:
    """Cell of every pair, from either row; the two rows must agree when both are there."""
    out: dict[tuple[str, str], str] = {}
    col = {label: j for j, label in enumerate(labels)}
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            ab = rows[a].cells[col[b]] if a in rows else None
            ba = rows[b].cells[col[a]] if b in rows else None
            if ab is not None and ba is not None and _norm(ab) != _norm(ba):
                raise TopologyError(
                    f"the matrix is not symmetric: {a} to {b} is {ab} but {b} to {a} is {ba}",
                    source=source,
                    where=f"line {rows[b].line}",
                )
            value = ab if ab is not None else ba
            if value is not None:
                out[(a, b)] = _norm(value)
    return out


def _norm(cell: str) -> str:
    return "SYS" if cell == "SOC" else cell


def _nvlink_kind(gpus: list[Device], cell: dict[tuple[str, str], str]) -> LinkKind:
    """NVSwitch when every GPU pair shows the same ``NV#`` and a direct mesh is impossible.

    ``nvidia-smi`` prints NVSwitch-connected GPUs as ``NV#`` with # the GPU's links to the
    fabric. All-to-all with equal counts on 4 or more GPUs is a switch, unless a direct
    mesh with that count fits in one GPU's links (4-GPU HGX boards: NV4 on A100, NV6 on
    H100, are direct meshes): ``(gpus - 1) * count > nvlinks_per_gpu_max`` (data/links.json) decides.
    """
    ids = [g.id for g in gpus]
    counts = set()
    for i, a in enumerate(ids):
        for b in ids[i + 1 :]:
            nv = _NV.match(cell.get((a, b), ""))
            if not nv:
                return LinkKind.NVLINK
            counts.add(int(nv.group(1)))
    if len(ids) >= 4 and len(counts) == 1 and (len(ids) - 1) * counts.pop() > link_defaults().nvlinks_per_gpu_max:
        return LinkKind.NVSWITCH
    return LinkKind.NVLINK
