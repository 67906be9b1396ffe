"""``--png``: draw a topology with matplotlib (optional extra ``topomesh[plot]``).

Hosts are boxes in a grid, ranks are dots inside them (on a circle), and every same-host
rank pair is an edge coloured by its link kind. Hosts hang off a network bar below,
each line coloured by how that host's first rank reaches other hosts (IB or Ethernet).
Worlds larger than ``max_ranks`` ranks are summarised: hosts only, labelled with their
rank count and fastest local link, and at most ``max_hosts`` of them.

Figures are drawn on matplotlib's Agg canvas directly, so no GUI backend and no global
``pyplot`` state are involved.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from topomesh.errors import OutputError, TopologyError, TopomeshError
from topomesh.report.topology import KIND_COLORS, cell_label
from topomesh.topology.model import Connection, DeviceKind, LinkKind, Topology

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_BOX = 1.0  # host box side, axis units
_GAP = 0.45


def require_matplotlib(flags: str = "--png") -> None:
    """Raise the one-line install hint when matplotlib (the ``plot`` extra) is missing;
    commands call it on their plot flags before long work, and the drawers again."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise TopomeshError(
            f"{flags} needs matplotlib, which is not installed: pip install 'topomesh[plot]'"
        ) from None


def _legend_label(kind: LinkKind, conns: list[Connection]) -> str:
    cells = sorted({cell_label(c) for c in conns})
    bws = sorted({c.bandwidth_GBps for c in conns})
    bw = f"{bws[0]:g} GB/s" if len(bws) == 1 else f"{bws[0]:g}-{bws[-1]:g} GB/s"
    cell = f"{', '.join(cells)}, " if cells != [kind.value] else ""
    return f"{kind.value} ({cell}{bw})"


def draw_topology(topo: Topology, *, max_ranks: int = 64, max_hosts: int = 16) -> Figure:
    """A matplotlib ``Figure`` of ``topo`` (see the module docstring for the picture)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyBboxPatch

    detailed = topo.world_size <= max_ranks and len(topo.hosts) <= max_hosts
    hosts = list(range(min(len(topo.hosts), max_hosts)))
    cols = max(1, math.ceil(math.sqrt(len(hosts))))
    rows = max(1, math.ceil(len(hosts) / cols))
    fig = Figure(figsize=(2.2 + 2.6 * cols, 1.8 + 2.6 * rows))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_axis_off()
    ax.set_aspect("equal")
    by_host = topo.ranks_by_host()
    used: dict[LinkKind, list[Connection]] = {}
    step = _BOX + _GAP
    net_y = -(rows - 1) * step - _BOX - _GAP / 2
    multi = len(topo.hosts) > 1
    for slot, h in enumerate(hosts):
        x0, y0 = (slot % cols) * step, -(slot // cols) * step
        cx, cy = x0 + _BOX / 2, y0 - _BOX / 2
        ranks = by_host[h]
        if multi and ranks:
            other = next((r for r in range(topo.world_size) if not topo.same_host(ranks[0], r)), None)
            if other is not None:
                conn = topo.connection(ranks[0], other)
                used.setdefault(conn.kind, []).append(conn)
                bus_y = y0 - _BOX - _GAP / 2
                ax.plot([cx, cx], [y0 - _BOX, bus_y], color=KIND_COLORS[conn.kind], lw=2.5, zorder=1)
        ax.add_patch(
            FancyBboxPatch(
                (x0, y0 - _BOX), _BOX, _BOX, boxstyle="round,pad=0.02", fc="white", ec="#333333", lw=1.2, zorder=2
            )
        )
        name = topo.hosts[h].hostname
        if detailed:
            ax.text(cx, y0 + 0.06, name, ha="center", va="bottom", fontsize=8, zorder=5, parse_math=False)
            _draw_ranks(ax, topo, ranks, cx, cy, used)
        else:
            fastest = _fastest_local(topo, ranks)
            label = f"{name}\n{len(ranks)} ranks"
            if fastest is not None:
                label += f"\n{cell_label(fastest)} {fastest.kind.value}"
                used.setdefault(fastest.kind, []).append(fastest)
            ax.text(cx, cy, label, ha="center", va="center", fontsize=7, zorder=5, parse_math=False)
    if multi:
        # the network as a comb: one bus under each row of hosts, joined on the right
        spine_x = cols * step - _GAP / 2
        for row in range(rows):
            bus_y = -row * step - _BOX - _GAP / 2
            ax.plot([0, spine_x], [bus_y, bus_y], color="#333333", lw=1.5, zorder=0)
        ax.plot([spine_x, spine_x], [-_BOX - _GAP / 2, net_y], color="#333333", lw=1.5, zorder=0)
        more = len(topo.hosts) - len(hosts)
        note = f"network ({more} more hosts not drawn)" if more > 0 else "network"
        ax.text(spine_x / 2, net_y - 0.06, note, ha="center", va="top", fontsize=8)
    handles = [
        Line2D([], [], color=KIND_COLORS[k], lw=2.5, label=_legend_label(k, used[k]))
        for k in sorted(used, key=lambda k: (k.tier, k.value))
    ]
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    title = f"{len(topo.hosts)} host(s), {topo.world_size} rank(s)"
    if not detailed:
        title += " (summarised)"
    ax.set_title(title, fontsize=10)
    ax.autoscale_view()
    ax.margins(0.08)
    fig.tight_layout()
    return fig


def _fastest_local(topo: Topology, ranks: list[int]) -> Connection | None:
    best = None
    for b in ranks[1:]:
        c = topo.connection(ranks[0], b)
        if best is None or c.kind.tier < best.kind.tier:
            best = c
    return best


def _draw_ranks(ax, topo: Topology, ranks: list[int], cx: float, cy: float, used: dict[LinkKind, list[Connection]]) -> None:
    radius = 0.0 if len(ranks) == 1 else 0.33
    pos = {
        r: (cx + radius * math.sin(2 * math.pi * i / len(ranks)), cy + radius * math.cos(2 * math.pi * i / len(ranks)))
        for i, r in enumerate(ranks)
    }
    for i, a in enumerate(ranks):
        for b in ranks[i + 1 :]:
            conn = topo.connection(a, b)
            if conn.kind is LinkKind.LOC:
                continue
            used.setdefault(conn.kind, []).append(conn)
            (xa, ya), (xb, yb) = pos[a], pos[b]
            ax.plot([xa, xb], [ya, yb], color=KIND_COLORS[conn.kind], lw=1.0 + 2.0 / (1 + conn.kind.tier), zorder=3)
    host = topo.hosts[topo.ranks[ranks[0]].host] if ranks else None
    for r, (x, y) in pos.items():
        dev = topo.ranks[r].device
        is_gpu = host is not None and any(d.id == dev and d.kind is DeviceKind.GPU for d in host.devices)
        ax.scatter([x], [y], s=260, c="#2b2b2b" if is_gpu else "#9c9c9c", zorder=4, edgecolors="white")
        ax.text(x, y, str(r), color="white", ha="center", va="center", fontsize=7, zorder=5)


def save_png(topo: Topology, path: str | os.PathLike[str], **kwargs: int) -> None:
    """Draw ``topo`` and write it as a PNG file."""
    import io

    from topomesh.topology.api import write_atomic

    fig = draw_topology(topo, **kwargs)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    try:
        write_atomic(path, buf.getvalue())  # the one writer: refuses devices, FIFOs, directories
    except OutputError:
        raise
    except OSError as exc:
        raise TopologyError(f"cannot write the picture ({exc.strerror or exc})", source=str(path)) from None
