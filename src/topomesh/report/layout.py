"""Pictures of a layout placed on a topology: a poprun-style table and per-axis links.

``render_layout(topo, layout)`` returns a rich renderable (for ``topomesh layout`` and
``topomesh show --layout``); ``layout_to_dict`` the same facts as stable JSON.

The placement table has one row per host, like ``poprun --print-topology`` turned on its
side: the host, its ranks (one process, i.e. instance, each) in local-rank order, the
device each drives, and for every mesh axis the coordinate each of those ranks has along
it. The axis table lists every axis's groups, the slowest
link between two members of a group, the bottleneck bandwidth, and what the plain rank
order would have crossed instead.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from topomesh.layout.dims import Layout
from topomesh.layout.place import AxisReport, Placement, Strategy, axis_report, place
from topomesh.report.text import printable
from topomesh.topology.model import Topology

MAX_HOST_ROWS = 32
"""Hosts shown in the placement table; the JSON always has all of them."""
MAX_GROUPS_SHOWN = 4


def _fmt_groups(groups: list[list[int]]) -> str:
    shown = " ".join("[" + " ".join(map(str, g)) + "]" for g in groups[:MAX_GROUPS_SHOWN])
    more = len(groups) - MAX_GROUPS_SHOWN
    return shown + (f" … +{more}" if more > 0 else "")


def layout_to_dict(topo: Topology, layout: Layout, strategy: Strategy | str = Strategy.TOPOLOGY) -> dict[str, Any]:
    """Stable JSON: layout, mesh (dims and physical ranks), hosts, ranks, and every axis.

    Keys: ``layout``, ``world_size``, ``strategy``, ``mesh`` {``dims``, ``ranks``},
    ``hosts`` [{``host``, ``hostname``, ``ranks``}], ``ranks`` [{``rank``, ``host``,
    ``local_rank``, ``device``, ``coords``}], ``axes`` [{``axis``, ``degree``,
    ``num_groups``, ``link``, ``bottleneck_GBps``, ``latency_us``, ``hosts_per_group``,
    ``note``, ``groups``, ``rank_order_link``, ``rank_order_bottleneck_GBps``}].
    """
    placement = place(topo, layout, strategy)
    naive = {r.axis: r for r in axis_report(topo, place(topo, layout, Strategy.RANK_ORDER))}
    axes = []
    for rep in axis_report(topo, placement):
        d = rep.to_dict()
        d["groups"] = placement.groups(rep.axis)
        d["rank_order_link"] = naive[rep.axis].kind.value
        d["rank_order_bottleneck_GBps"] = naive[rep.axis].bottleneck_GBps
        axes.append(d)
    by_host = _host_ranks(topo)
    return {
        "layout": layout.to_dict(),
        "world_size": topo.world_size,
        "strategy": Strategy(strategy).value,
        "mesh": {"dims": [a.value for a in layout.mesh_axes], "ranks": placement.mesh().tolist()},
        "hosts": [
            {"host": h, "hostname": host.hostname, "ranks": by_host[h]}
            for h, host in enumerate(topo.hosts)
        ],
        "ranks": [
            {
                "rank": r.rank,
                "host": r.host,
                "local_rank": r.local_rank,
                "device": r.device,
                "coords": {a.value: c for a, c in placement.coords(r.rank).items() if layout.degree(a) > 1},
            }
            for r in topo.ranks
        ],
        "axes": axes,
    }


def _host_ranks(topo: Topology) -> list[list[int]]:
    """The ranks of every host in local-rank order."""
    return [sorted(g, key=lambda r: topo.ranks[r].local_rank) for g in topo.ranks_by_host()]


def _short(device: str) -> str:
    """``GPU3`` → ``3`` (the column header says what they are); other ids unchanged."""
    return device[3:] if device.startswith(("GPU", "CPU")) and device[3:].isdigit() else device


def placement_table(topo: Topology, placement: Placement) -> Table:
    """One row per host: its ranks and each rank's coordinate along every mesh axis."""
    layout = placement.layout
    table = Table(title=f"placement of {layout.describe()} on {topo.world_size} ranks ({placement.strategy.value})")
    table.add_column("host")
    table.add_column("ranks")
    table.add_column("devices")
    for axis in layout.mesh_axes:
        table.add_column(f"{axis.value} ({layout.degree(axis)})")
    by_host = _host_ranks(topo)
    for h in range(min(len(topo.hosts), MAX_HOST_ROWS)):
        ranks = by_host[h]
        coords = {r: placement.coords(r) for r in ranks}
        width = max([len(str(r)) for r in ranks] + [1])
        devices = [printable(topo.ranks[r].device or "-") for r in ranks]
        width = max([width] + [len(_short(d)) for d in devices])
        cells = [" ".join(str(r).rjust(width) for r in ranks), " ".join(_short(d).rjust(width) for d in devices)]
        for axis in layout.mesh_axes:
            cells.append(" ".join(str(coords[r][axis]).rjust(width) for r in ranks))
        table.add_row(*(Text(printable(c)) for c in (topo.hosts[h].hostname, *cells)))  # names are not markup
    if len(topo.hosts) > MAX_HOST_ROWS:
        table.add_row(f"… {len(topo.hosts) - MAX_HOST_ROWS} more hosts", "", "", *["" for _ in layout.mesh_axes])
    return table


def axis_table(reports: list[AxisReport], placement: Placement, naive: list[AxisReport]) -> Table:
    """Groups of every axis, the link they cross and what rank order would cross."""
    table = Table(title="axes (slowest link between two members of a group)")
    for col in ("axis", "groups", "link", "GB/s", "hosts/group", "rank order"):
        table.add_column(col, justify="right" if col in ("GB/s", "hosts/group") else "left")
    by_axis = {r.axis: r for r in naive}
    for rep in reports:
        n = by_axis[rep.axis]
        table.add_row(
            f"{rep.axis.value}={rep.degree}",
            _fmt_groups(placement.groups(rep.axis)),
            rep.kind.value,
            f"{rep.bottleneck_GBps:g}",
            str(rep.hosts_per_group),
            f"{n.kind.value} {n.bottleneck_GBps:g} GB/s",
        )
    return table


def render_layout(topo: Topology, layout: Layout, strategy: Strategy | str = Strategy.TOPOLOGY) -> RenderableType:
    """Placement table, axis table and any notes, as one rich renderable."""
    placement = place(topo, layout, strategy)
    reports = axis_report(topo, placement)
    naive = axis_report(topo, place(topo, layout, Strategy.RANK_ORDER))
    parts: list[RenderableType] = [placement_table(topo, placement), axis_table(reports, placement, naive)]
    parts.extend(Text(f"note: {printable(r.note)}", style="yellow") for r in reports if r.note)
    return Group(*parts)
