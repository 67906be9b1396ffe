"""The validation picture: predicted against measured step time, one point per layout,
the diagonal (a perfect prediction) drawn."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any

from topomesh.errors import OutputError
from topomesh.report.plot import require_matplotlib


def draw_validation(results: Sequence[Any]) -> Any:
    """A matplotlib figure of :class:`~topomesh.validate.run.LayoutResult` points (ms)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5.0))
    xs = [r.measured_s * 1e3 for r in results]
    ys = [r.predicted_s * 1e3 for r in results]
    hi = max(xs + ys) * 1.15
    ax.plot([0, hi], [0, hi], color="grey", linestyle="--", linewidth=1, label="predicted = measured")
    ax.scatter(xs, ys, color="tab:blue", zorder=3, label="wall time (median step)")
    cpu = [(r.measured_cpu_s * 1e3, y) for r, y in zip(results, ys, strict=True) if r.measured_cpu_s]
    if cpu:
        ax.scatter(*zip(*cpu, strict=True), facecolors="none", edgecolors="tab:orange", zorder=3,
                   label="CPU time of the slowest rank")
    for i, (r, x, y) in enumerate(zip(results, xs, ys, strict=True)):
        ax.annotate(f"{r.layout} ({r.error * 100:+.1f}%)", (x, y), textcoords="offset points",
                    xytext=(6, -4 - 10 * (i % 3)), fontsize=8)
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("measured step time (ms, median)")
    ax.set_ylabel("predicted step time (ms, local cluster)")
    ax.set_title("topomesh validate")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def save_validation_png(results: Sequence[Any], path: str | os.PathLike[str]) -> None:
    """Draw ``results`` and write the PNG through the one writer (refuses devices, FIFOs)."""
    from topomesh.topology.api import write_atomic

    fig = draw_validation(results)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    try:
        write_atomic(path, buf.getvalue())
    except OutputError:
        raise
    except OSError as exc:
        raise OutputError(f"{path}: cannot write the validation picture ({exc.strerror or exc}).") from None
