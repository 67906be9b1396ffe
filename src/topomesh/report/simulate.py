"""Terminal report of a simulated step: the headline numbers, where the time goes, memory per
pipeline rank, and the link every axis crosses."""

from __future__ import annotations

from topomesh.sim.result import StepResult


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}" if s < 1 else f"{s * 1e3:,.1f}"


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f}"


def print_result(r: StepResult, *, model: str, cluster: str) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console()
    lay = r.layout
    degrees = " × ".join(f"{a}={d}" for a, d in lay["degrees"].items() if d > 1) or "one rank"
    pipe = f", {lay['schedule']} ({lay['microbatches']} micro-batches" + (
        f", interleave {lay['interleave']})" if lay["interleave"] > 1 else ")") if lay["schedule"] else (
        f", {lay['microbatches']} micro-batch{'es' if lay['microbatches'] > 1 else ''}")
    out.print(f"[bold]{model}[/] on [bold]{cluster}[/] ({r.world_size} × {r.device}): {degrees}, order "
              f"{lay['order']}{pipe}; global batch {lay['global_batch']} × {lay['seq_len']} tokens, micro-batch "
              f"{lay['micro_batch']}, {lay['dtype']}{' (float32 master weights)' if lay.get('mixed_precision') else ''}, recompute {lay['recompute']}, sequence parallel "
              f"{'on' if lay['sequence_parallel'] else 'off'}", highlight=False)
    head = Table(show_header=False, box=None)
    head.add_row("step time", f"{_ms(r.step_time_s)} ms")
    head.add_row("tokens/s", f"{r.tokens_per_s:,.0f}")
    head.add_row("MFU", f"{r.mfu:.1%}  (3 × traced forward FLOPs per step / world peak)")
    head.add_row("HFU", f"{r.hfu:.1%}  (traced forward + backward FLOPs, recompute included / world peak)")
    head.add_row("peak memory", f"{_gb(r.peak_memory_bytes)} GB of {_gb(r.capacity_bytes)} GB")
    head.add_row("feasible", "yes" if r.feasible else f"[red]no[/]: {r.reason}")
    head.add_row("ops priced", f"{r.measured_ops} measured, {r.roofline_ops} by roofline")
    out.print(head)
    b = r.breakdown
    t = Table(title="Where the step goes (critical pipeline rank)")
    t.add_column("part")
    t.add_column("ms", justify="right")
    t.add_column("share", justify="right")
    rows = [("compute (forward + backward)", b.compute_s)]
    rows += [(f"exposed communication: {axis}", s) for axis, s in b.exposed_comm_s.items()]
    rows += [("pipeline bubble", b.bubble_s), ("pipeline p2p wait", b.p2p_s), ("optimizer", b.optimizer_s)]
    for name, s in rows:
        if s > 0 or name.startswith("compute"):
            t.add_row(name, _ms(s), f"{s / r.step_time_s:.1%}" if r.step_time_s else "-")
    t.add_row("[bold]total[/]", f"[bold]{_ms(b.total_s)}[/]", "100.0%")
    out.print(t)
    t = Table(title="Memory per pipeline rank (GB)")
    for c in ("rank", "params", "grads", "at peak", "optimizer", "activations", "in flight", "transient",
              "receive", "peak"):
        t.add_column(c, justify="right")
    for m in r.memory:
        t.add_row(str(m.rank), _gb(m.params_bytes), _gb(m.grads_bytes), _gb(m.grads_live_bytes), _gb(m.optimizer_bytes),
                  _gb(m.activations_bytes), str(m.in_flight), _gb(m.transient_bytes), _gb(m.receive_bytes),
                  _gb(m.peak_bytes))
    out.print(t)
    if r.links:
        t = Table(title="Links each axis crosses")
        for c in ("axis", "group", "link", "nodes", "ranks/node", "GB/s per rank"):
            t.add_column(c, justify="left" if c in ("axis", "link") else "right")
        for axis, link in r.links.items():
            t.add_row(axis, str(link["group_size"]), str(link["link"]), str(link["nodes"]),
                      str(link["ranks_per_node"]), f"{link['bandwidth_GBps']:.1f}")
        out.print(t)
