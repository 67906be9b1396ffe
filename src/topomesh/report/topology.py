"""Terminal pictures of a :class:`~topomesh.topology.model.Topology` (rich renderables).

* :func:`hosts_table` — hosts with their GPUs, CPUs and NICs;
* :func:`ranks_table` — where each rank runs and which NIC it uses (poprun-style);
* :func:`rank_matrix` — the ``nvidia-smi topo -m`` matrix between ranks, with a legend;
* :func:`links_table` — every distinct connection with its numbers;
* :func:`domains_table` — NVLink islands, PCIe switch groups, hosts, network domains.

Large worlds are summarised: the tables stop after ``max_rows`` rows and the matrix
shows the first host's ranks, saying so in a caption.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import MappingProxyType

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from topomesh.report.text import printable
from topomesh.topology.model import Connection, DeviceKind, Host, LinkKind, Nic, NicKind, Topology

KIND_COLORS = MappingProxyType(
    {
        LinkKind.LOC: "#9e9e9e",
        LinkKind.NVSWITCH: "#1b9e77",
        LinkKind.NVLINK: "#66a61e",
        LinkKind.PIX: "#17becf",
        LinkKind.PXB: "#1f77b4",
        LinkKind.PHB: "#e6ab02",
        LinkKind.NODE: "#d95f02",
        LinkKind.SYS: "#d62728",
        LinkKind.SHM: "#7570b3",
        LinkKind.IB: "#e7298a",
        LinkKind.NIC: "#8c564b",
        LinkKind.UNKNOWN: "#7f7f7f",
    }
)
"""One colour per link kind, shared by the terminal matrix and the drawn graph."""

_LEGEND = MappingProxyType(
    {
        LinkKind.LOC: "X    = same device (or the rank itself)",
        LinkKind.NVSWITCH: "NV#  = NVLink through NVSwitches, # links per GPU",
        LinkKind.NVLINK: "NV#  = direct bonded set of # NVLinks",
        LinkKind.PIX: "PIX  = PCIe through at most one PCIe bridge",
        LinkKind.PXB: "PXB  = PCIe through several bridges, not the host bridge",
        LinkKind.PHB: "PHB  = PCIe through a PCIe host bridge (the CPU)",
        LinkKind.NODE: "NODE = PCIe and the interconnect between host bridges of one NUMA node",
        LinkKind.SYS: "SYS  = PCIe and the link between NUMA nodes (QPI/UPI)",
        LinkKind.SHM: "SHM  = same host, no accelerator (shared memory / loopback)",
        LinkKind.IB: "IB   = InfiniBand / RoCE between hosts",
        LinkKind.NIC: "NIC  = Ethernet (TCP) between hosts",
        LinkKind.UNKNOWN: "?    = the file names no connection type",
    }
)


def cell_label(conn: Connection) -> str:
    """The matrix cell of a connection: ``X``, ``NV18``, ``PIX``, ``IB``, ``?``.

    >>> from topomesh.topology.model import Connection, LinkKind
    >>> cell_label(Connection(kind=LinkKind.NVSWITCH, latency_us=0.6, bandwidth_GBps=370.8, channels=18))
    'NV18'
    """
    if conn.kind is LinkKind.LOC:
        return "X"
    if conn.kind.is_nvlink:
        return f"NV{conn.channels}"
    if conn.kind is LinkKind.UNKNOWN:
        return "?"
    return conn.kind.value


def rank_ranges(ranks: Iterable[int]) -> str:
    """Ranks as compact ranges.

    >>> rank_ranges([0, 1, 2, 3, 8, 10, 11])
    '0-3,8,10-11'
    """
    out: list[str] = []
    items = sorted(ranks)
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(out)


def _add_plain_row(table: Table, *cells: str) -> None:
    """Add a row of plain text: names from files (``[bold]``, ``[/]``) are not rich markup,
    and their control characters are shown escaped (:func:`~topomesh.report.text.printable`).
    A cell's own line breaks (one NIC per line) are kept: each line is escaped on its own."""
    table.add_row(*(Text("\n".join(printable(line) for line in c.split("\n"))) for c in cells))


def _gbps(x: float | None) -> str:
    return "?" if x is None else format(x, "g")


def _nic_label(nic: Nic, kind: str) -> str:
    """``mlx5_0 (IB 400G)``; the speed is left out when unknown."""
    speed = f" {_gbps(nic.speed_Gbps)}G" if nic.speed_Gbps else ""
    return f"{nic.name} ({kind}{speed})"


def _nic_text(host: Host) -> str:
    return "\n".join(_nic_label(n, n.kind.value) for n in host.nics) or "-"


def _gpu_text(host: Host) -> str:
    """``8 x A100 SXM4 80GB (sm80)``, or ``8 (sm80)`` / ``8`` when name or arch is unknown."""
    kinds: dict[tuple[str, str], int] = {}
    for g in host.gpus:
        key = (g.name, g.arch or "")
        kinds[key] = kinds.get(key, 0) + 1
    if not kinds:
        return "0"
    parts = []
    for (name, arch), count in kinds.items():
        text = f"{count} x {name}" if name else str(count)
        parts.append(text + (f" ({arch})" if arch else ""))
    return ", ".join(parts)


def hosts_table(topo: Topology, *, max_rows: int = 32) -> Table:
    """One row per host: ranks, GPUs (with arch and NUMA node), CPU sockets, NICs."""
    by_host = topo.ranks_by_host()
    table = Table(title=f"{len(topo.hosts)} host(s), {topo.world_size} rank(s)", title_justify="left")
    for col in ("host", "ranks", "GPUs", "CPUs", "NICs"):
        table.add_column(col, overflow="fold")
    for h, host in enumerate(topo.hosts[:max_rows]):
        gpu_text = _gpu_text(host)
        cpus = [d for d in host.devices if d.kind is DeviceKind.CPU]
        _add_plain_row(table, host.hostname, rank_ranges(by_host[h]) or "-", gpu_text, str(len(cpus)), _nic_text(host))
    if len(topo.hosts) > max_rows:
        table.caption = f"first {max_rows} of {len(topo.hosts)} hosts"
    return table


def ranks_table(topo: Topology, *, max_rows: int = 64) -> Table:
    """poprun-style placement: host, rank, local rank, device, NUMA node, nearest NIC."""
    multi = len(topo.hosts) > 1
    table = Table(title="ranks", title_justify="left")
    cols = ("rank", "host", "local", "device", "NUMA", "nearest NIC", "NIC path")
    for col in cols if multi else cols[:1] + cols[2:]:
        table.add_column(col, overflow="fold")
    for info in topo.ranks[:max_rows]:
        host = topo.hosts[info.host]
        dev = next((d for d in host.devices if d.id == info.device), None)
        nic = host.nearest_nic(info.device)
        path = host.path(info.device, nic.id) if nic is not None and info.device else None
        nic_text = "-" if nic is None else _nic_label(nic, "IB" if nic.kind is NicKind.IB else "Eth")
        _add_plain_row(
            table,
            str(info.rank),
            *([host.hostname] if multi else []),
            str(info.local_rank),
            info.device or "-",
            "-" if dev is None or dev.numa_node is None else str(dev.numa_node),
            nic_text,
            path.kind.value if path else "-",
        )
    if topo.world_size > max_rows:
        table.caption = f"first {max_rows} of {topo.world_size} ranks"
    return table


def _matrix_ranks(topo: Topology, max_ranks: int) -> tuple[list[int], str | None]:
    if topo.world_size <= max_ranks:
        return list(range(topo.world_size)), None
    first = next((g for g in topo.ranks_by_host() if g), [])[:max_ranks]
    host = topo.hosts[topo.ranks[first[0]].host].hostname if first else "-"
    note = f"ranks {rank_ranges(first)} of {topo.world_size} (host {printable(host)})"
    return first, note + ("; other hosts below" if len(topo.hosts) > 1 else "")


def rank_matrix(topo: Topology, *, max_ranks: int = 32) -> RenderableType:
    """The ``nvidia-smi topo -m`` picture between ranks, with a legend of the kinds shown."""
    ranks, note = _matrix_ranks(topo, max_ranks)
    table = Table(box=None, pad_edge=False)
    table.add_column("")
    for r in ranks:
        table.add_column(f"R{r}", justify="center")
    shown: set[LinkKind] = set()
    for a in ranks:
        cells = []
        for b in ranks:
            conn = topo.connection(a, b)
            shown.add(conn.kind)
            cells.append(Text(cell_label(conn), style=KIND_COLORS[conn.kind]))
        table.add_row(f"R{a}", *cells)
    parts: list[RenderableType] = [Text("rank-to-rank links", style="italic"), table]
    if note:
        parts.append(Text(note, style="italic"))
        inter = {topo.connection(ranks[0], b).kind for b in range(topo.world_size) if not topo.same_host(ranks[0], b)}
        shown |= inter
        if inter:
            kinds = ", ".join(sorted(k.value for k in inter))
            parts.append(Text(f"R{ranks[0]} reaches ranks on other hosts through: {kinds}"))
    legend = Text("Legend:\n")
    for kind in sorted(shown, key=lambda k: (k.tier, k.value)):
        legend.append(f"  {_LEGEND[kind]}\n", style=KIND_COLORS[kind])
    parts.append(legend)
    return Group(*parts)


def used_connections(topo: Topology) -> set[Connection]:
    """Connections some rank pair has (the table's palette may hold unused rail entries)."""
    t = topo.table
    ids: set[int] = set(t.overrides.values())
    hosts_used = {int(h) for h in t.host_of}
    for h in hosts_used:
        mat = t.local[t.host_class[h]]
        measured = t.measured_local.get(h, {})
        # a default a measurement replaces for every pair of slots is not used
        ids.update(int(mat[i, j]) for i in range(mat.shape[0]) for j in range(i, mat.shape[0])
                   if (i, j) not in measured)
    n_hosts = len(hosts_used)
    if n_hosts > 1 and len(t.measured_inter) < n_hosts * (n_hosts - 1) // 2:
        # rails r, s meet across hosts unless both are used on one and the same host only
        hosts_of_rail: dict[int, set[int]] = {}
        for rail, host in zip(t.rail_of.tolist(), t.host_of.tolist(), strict=True):
            hosts_of_rail.setdefault(rail, set()).add(host)
        for r, hr in hosts_of_rail.items():
            for s, hs in hosts_of_rail.items():
                if not (len(hr) == 1 and hr == hs):
                    ids.add(int(t.inter[r, s]))
    return {t.palette[i] for i in ids} | t.measured_connections()


def links_table(topo: Topology) -> Table:
    """Every distinct connection of the world with its latency, bandwidth and channels."""
    table = Table(title="connections", title_justify="left")
    for col, just in (("kind", "left"), ("cell", "left"), ("bandwidth GB/s", "right"), ("latency us", "right"), ("channels", "right"), ("measured", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    seen = sorted(used_connections(topo), key=lambda c: (c.kind.tier, c.kind.value, -c.bandwidth_GBps))
    for c in seen:
        table.add_row(
            Text(c.kind.value, style=KIND_COLORS[c.kind]),
            cell_label(c),
            format(c.bandwidth_GBps, "g"),
            format(c.latency_us, "g"),
            str(c.channels),
            "yes" if c.measured else "no",
        )
    return table


_DOMAIN_KINDS: Sequence[tuple[str, LinkKind]] = (
    ("NVLink islands", LinkKind.NVLINK),
    ("PXB or faster (PCIe switch)", LinkKind.PXB),
    ("hosts", LinkKind.SHM),
    ("IB or faster", LinkKind.IB),
)


def domains_table(topo: Topology, *, max_groups: int = 8) -> Table:
    """Groups of ranks joined by links at least as fast as each kind (``Topology.domains``)."""
    table = Table(title="domains", title_justify="left")
    for col in ("domain", "groups", "sizes", "members"):
        table.add_column(col, overflow="fold")
    for label, kind in _DOMAIN_KINDS:
        groups = topo.domains(kind)
        sizes = sorted({len(g) for g in groups})
        members = "  ".join(f"[{rank_ranges(g)}]" for g in groups[:max_groups])
        if len(groups) > max_groups:
            members += f"  ... {len(groups) - max_groups} more"
        _add_plain_row(table, label, str(len(groups)), ",".join(map(str, sizes)) or "-", members or "-")
    return table


def topology_report(topo: Topology, *, matrix: bool = True) -> Group:
    """Everything above, in reading order."""
    parts: list[RenderableType] = []
    if topo.source:
        parts.append(Text(f"source: {printable(topo.source)}", style="bold"))
    parts += [hosts_table(topo), ranks_table(topo)]
    if matrix and topo.world_size:
        parts.append(rank_matrix(topo))
    parts += [links_table(topo), domains_table(topo)]
    return Group(*parts)
