"""Reports of a search (``topomesh plan``): the ranked table and counts in the terminal, a
Pareto plot (step time against peak memory of every feasible layout, the front and the best
marked) as PNG, and one self-contained HTML page (table, plot as a base64 PNG, the best
layout's breakdown and simulated timeline, why the runners-up lose)."""

from __future__ import annotations

import base64
import html
import io
from typing import Any

from topomesh.report.plot import require_matplotlib
from topomesh.search.rank import why_loses
from topomesh.search.run import Entry, Plan


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}" if s < 1 else f"{s * 1e3:,.1f}"


def _mem(b: float) -> str:
    """Bytes as GB, or MB below 0.1 GB (tiny models would all read 0.00 GB)."""
    return f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.2f} MB"


def _links(r: Any) -> str:
    return " ".join(f"{a}:{v['link']}" for a, v in r.links.items() if v.get("group_size", 1) > 1)


def _knobs(e: Entry) -> str:
    lay = e.result.layout
    sched = f" {lay['schedule']}" + (f"×{lay['interleave']}" if lay["interleave"] > 1 else "") if lay["schedule"] else ""
    return f"mb {lay['micro_batch']} {lay['recompute']}{sched}"


def _rows(plan: Plan, top: int) -> list[list[str]]:
    best = plan.entries[0] if plan.entries else None
    rows = []
    for n, e in enumerate(plan.entries[:top], 1):
        r, b = e.result, e.result.breakdown
        rows.append([str(n), e.layout.describe(), _knobs(e), _ms(r.step_time_s), f"{r.tokens_per_s:,.0f}",
                     f"{r.mfu:.1%}", _mem(r.peak_memory_bytes), _links(r),
                     f"{_ms(b.compute_s)} / {_ms(sum(b.exposed_comm_s.values()))} / {_ms(b.bubble_s)}",
                     "best" if n == 1 and r.feasible else why_loses(best, e) if best else ""])
    return rows


HEADERS = ("#", "layout (fastest axis first)", "knobs", "step ms", "tokens/s", "MFU", "peak memory",
           "links", "compute / comm / bubble ms", "vs best")


def counts_lines(data: dict[str, Any]) -> list[str]:
    pruned = ", ".join(f"{k} {v:,}" for k, v in data["pruned"].items() if v) or "none"
    lines = [f"space {data['space_size']:,} layouts; pruned {sum(data['pruned'].values()):,} ({pruned})",
             f"traced classes {data['traced_classes']:,}; evaluated {data['evaluated']:,} "
             f"({data['simulated']:,} simulations); feasible {data['feasible']:,}; "
             f"elapsed {data['elapsed_s']:.1f} s"]
    if data["failed"]:
        lines.append(f"failed {sum(data['failed'].values()):,}: " + "; ".join(
            f"{n:,} × {msg[:160]}" for msg, n in list(data["failed"].items())[:3]))
    return lines


def print_plan(plan: Plan, data: dict[str, Any], *, top: int) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console()
    i = data["inputs"]
    t = Table(title=f"{plan.model_name} on {plan.cluster_name} ({plan.world_size} ranks), global batch "
                    f"{i['global_batch']}: the {min(top, len(plan.entries))} best layouts")
    for h in HEADERS[:-1]:  # "vs best" goes below the table: it is a sentence
        t.add_column(h, justify="right" if h in ("#", "step ms", "tokens/s", "MFU", "peak memory") else "left")
    rows = _rows(plan, top)
    for row in rows:
        t.add_row(*row[:-1])
    out.print(t)
    for row in rows[1:]:
        out.print(f"#{row[0]} {row[1]}: {row[-1]}", highlight=False)
    for line in counts_lines(data):
        out.print(line, highlight=False)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats in both coordinates (lower is better),
    sorted by the first coordinate.

    >>> pareto_front([(1, 5), (2, 3), (3, 4), (4, 1)])
    [0, 1, 3]
    """
    order = sorted(range(len(points)), key=lambda i: points[i])
    front, best_y = [], float("inf")
    for i in order:
        if points[i][1] < best_y:
            front.append(i)
            best_y = points[i][1]
    return front


def pareto_png(plan: Plan) -> bytes:
    """The Pareto plot as PNG bytes."""
    require_matplotlib("--png and --html")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    feas = [e for e in plan.entries if e.result.feasible]
    unit, per = ("GB", 1e9) if any(e.result.peak_memory_bytes >= 1e8 for e in feas) else ("MB", 1e6)
    pts = [(e.result.step_time_s * 1e3, e.result.peak_memory_bytes / per) for e in feas]
    fig, ax = plt.subplots(figsize=(8, 5))
    if pts:
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=10, color="#9ab", label=f"feasible layouts ({len(pts)})")
        front = pareto_front(pts)
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "-o", color="#d62", ms=4,
                label="Pareto front")
        ax.scatter([pts[0][0]], [pts[0][1]], marker="*", s=220, color="#2a2", zorder=5,
                   label=f"best: {feas[0].layout.describe()}")
    else:
        ax.text(0.5, 0.5, "no feasible layout", ha="center", va="center", transform=ax.transAxes)
    cap = feas[0].result.capacity_bytes / per if feas else None
    if cap and max(p[1] for p in pts) > 0.3 * cap:  # the line would squash every point to the axis
        ax.axhline(cap, color="#888", ls="--", lw=1, label=f"device memory {cap:,.0f} {unit}")
    ax.set_xlabel("step time (ms)")
    ax.set_ylabel(f"peak memory per GPU ({'GB' if not feas else unit})")
    ax.set_title(f"{plan.model_name} on {plan.cluster_name} ({plan.world_size} ranks)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def best_timeline(plan: Plan) -> dict[str, Any] | None:
    """The best layout simulated again with ``record=True`` (its Chrome trace)."""
    from topomesh.search.evaluate import Context

    if plan.best is None:
        return None
    ctx = Context.build(plan.inputs)
    e = plan.best
    return ctx.sim.simulate(e.layout, ctx.training(e.knobs), record=True).timeline


_COLORS = {"compute": "#4a7fd4", "nvlink": "#e0913a", "network": "#c94f4f"}


def timeline_svg(trace: dict[str, Any], *, width: int = 1100, max_spans: int = 4000) -> str:
    """A simple SVG bar chart of the timeline's spans: one row per (pipeline rank, stream)."""
    spans = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"][:max_spans]
    if not spans:
        return "<p>no spans</p>"
    rows = sorted({(e["pid"], e["cat"]) for e in spans})
    row_of = {r: i for i, r in enumerate(rows)}
    end = max(e["ts"] + e["dur"] for e in spans) or 1.0
    label_w, h = 170, 18
    scale = (width - label_w - 10) / end
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{len(rows) * h + 24}" '
             'font-family="sans-serif" font-size="11">']
    for (pid, cat), i in row_of.items():
        parts.append(f'<text x="4" y="{i * h + 13}">rank {pid} · {html.escape(str(cat))}</text>')
    for e in spans:
        x = label_w + e["ts"] * scale
        w = max(e["dur"] * scale, 0.5)
        color = _COLORS.get(str(e["cat"]), "#8a8")
        parts.append(f'<rect x="{x:.2f}" y="{row_of[(e["pid"], e["cat"])] * h + 2}" width="{w:.2f}" height="{h - 4}" '
                     f'fill="{color}"><title>{html.escape(str(e["name"]))}: {e["dur"] / 1e3:.3f} ms</title></rect>')
    parts.append(f'<text x="{label_w}" y="{len(rows) * h + 18}">0 ms</text>'
                 f'<text x="{width - 80}" y="{len(rows) * h + 18}">{end / 1e3:.2f} ms</text></svg>')
    return "".join(parts)


def html_report(plan: Plan, data: dict[str, Any], *, top: int) -> str:
    """One self-contained page (no external resources)."""
    esc = html.escape
    png = base64.b64encode(pareto_png(plan)).decode("ascii")
    table = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in _rows(plan, top))
    head = "".join(f"<th>{esc(h)}</th>" for h in HEADERS)
    best = plan.best
    detail = "<p>No feasible layout.</p>"
    if best is not None:
        r, b = best.result, best.result.breakdown
        parts = [("compute (forward + backward)", b.compute_s), *((f"exposed communication: {a} ({r.links.get(a, {}).get('link', '?')})", s)
                 for a, s in b.exposed_comm_s.items()), ("pipeline bubble", b.bubble_s),
                 ("pipeline p2p wait", b.p2p_s), ("optimizer", b.optimizer_s)]
        bars = "".join(
            f"<tr><td>{esc(n)}</td><td class=n>{_ms(s)}</td><td><div class=bar style='width:{400 * s / r.step_time_s:.1f}px'>"
            f"</div></td><td class=n>{s / r.step_time_s:.1%}</td></tr>" for n, s in parts if s > 0 or n.startswith("compute"))
        mem = "".join(f"<tr><td>{m.rank}</td><td class=n>{_mem(m.peak_bytes)}</td><td class=n>"
                      f"{_mem(m.params_bytes + m.grads_bytes + m.optimizer_bytes)}</td><td class=n>"
                      f"{_mem(m.activations_bytes)}</td><td class=n>{m.in_flight}</td></tr>" for m in r.memory)
        timeline = best_timeline(plan)
        detail = (f"<h2>Best layout: {esc(best.layout.describe())} (order {esc(best.layout.order_text())}, {esc(_knobs(best))})</h2>"
                  f"<p>step {_ms(r.step_time_s)} ms, {r.tokens_per_s:,.0f} tokens/s, MFU {r.mfu:.1%}, peak memory "
                  f"{_mem(r.peak_memory_bytes)} of {r.capacity_bytes / 1e9:.0f} GB; links: {esc(_links(r))}</p>"
                  f"<h3>Where the step goes</h3><table>{bars}</table>"
                  f"<h3>Memory per pipeline rank</h3><table><tr><th>rank</th><th>peak</th><th>state</th>"
                  f"<th>activations</th><th>in flight</th></tr>{mem}</table>"
                  f"<h3>Simulated timeline (hover a bar for its name)</h3>{timeline_svg(timeline) if timeline else ''}")
    runners = "".join(f"<li><b>{esc(e.layout.describe())}</b> ({esc(_knobs(e))}): {esc(why_loses(plan.entries[0], e))}</li>"
                      for e in plan.entries[1:top]) if best is not None else ""
    counts = "".join(f"<li>{esc(line)}</li>" for line in counts_lines(data))
    title = f"topomesh plan: {plan.model_name} on {plan.cluster_name} ({plan.world_size} ranks)"
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{esc(title)}</title><style>
body{{font-family:sans-serif;margin:24px;max-width:1200px;color:#222}} table{{border-collapse:collapse;margin:8px 0}}
td,th{{border:1px solid #ccc;padding:3px 6px;font-size:13px}} th{{background:#eef}} td.n{{text-align:right}}
.bar{{background:#4a7fd4;height:12px}} img{{max-width:100%}}
</style></head><body>
<h1>{esc(title)}</h1><ul>{counts}</ul>
<h2>Ranked layouts</h2><table><tr>{head}</tr>{table}</table>
<h2>Step time against peak memory</h2><img alt="Pareto plot" src="data:image/png;base64,{png}">
{detail}
<h2>Why the runners-up lose</h2><ul>{runners}</ul>
</body></html>
"""
