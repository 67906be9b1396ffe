"""The simulated step as a Chrome trace (the JSON PyTorch's profiler writes), which Perfetto
(ui.perfetto.dev) and chrome://tracing open: one process per pipeline rank, one track per
stream (compute, intra-node and network communication)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from topomesh.sim.engine import RankState

_TRACKS = {"compute": 0, "comm:intra": 1, "comm:net": 2}


def chrome_trace(ranks: Sequence[RankState], *, title: str) -> dict[str, Any]:
    """``{"traceEvents": [...]}`` with complete events (``ph: "X"``) in microseconds."""
    events: list[dict[str, Any]] = []
    for r, state in enumerate(ranks):
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                       "args": {"name": f"pipeline rank {r}" if len(ranks) > 1 else "rank"}})
        for track, tid in _TRACKS.items():
            events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": track}})
        for s in state.spans or ():
            events.append({"ph": "X", "name": s.name, "cat": s.track, "pid": r, "tid": _TRACKS.get(s.track, 3),
                           "ts": round(s.start * 1e6, 3), "dur": round((s.end - s.start) * 1e6, 3)})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": title}}
