"""A search's ranking as the plan file, CSV rows, framework settings, and the reason each
runner-up loses to the best.

The plan file (DESIGN.md "Plan file") is versioned JSON::

    {"format": "topomesh-plan", "version": 1, "inputs": {...}, "space_size": ..., "pruned": {reason: n},
     "traced_classes": ..., "evaluated": ..., "simulated": ..., "feasible": ..., "failed": {error: n},
     "elapsed_s": ..., "best": <layout or null>, "layouts": [<layout>, ...]}

``layouts`` holds the top K, best first; each is a ``StepResult.to_dict()`` plus ``rank``
(1-based), ``layout_id`` and ``knob_row`` (position in the space), ``mesh`` (the physical
ranks in mesh-dim order, the array :func:`topomesh.layout.api.mesh_from_plan` builds) and
``mesh_dim_names``. ``best`` is ``layouts[0]`` when it is feasible.
"""

from __future__ import annotations

import csv
import io
from typing import Any

import numpy as np

from topomesh.layout.dims import Axis, Layout
from topomesh.layout.ranks import logical_mesh
from topomesh.search.run import Entry, Plan
from topomesh.sim.schedules import Schedule

PLAN_FORMAT = "topomesh-plan"
PLAN_VERSION = 1


def mesh_of(layout: Layout, placed: tuple[int, ...]) -> np.ndarray:
    """Physical ranks of ``layout`` shaped ``layout.mesh_shape`` (as ``Placement.mesh()``)."""
    return np.asarray(placed, dtype=np.int64)[logical_mesh(layout)]


def layout_dict(plan: Plan, entry: Entry, rank: int) -> dict[str, Any]:
    """One ranked layout of the plan file."""
    return {
        "rank": rank,
        "layout_id": entry.index,
        "knob_row": entry.knob,
        **entry.result.to_dict(),
        "mesh": mesh_of(entry.layout, plan.placed).tolist(),
        "mesh_dim_names": [a.value for a in entry.layout.mesh_axes],
    }


def plan_dict(plan: Plan, *, top: int = 10) -> dict[str, Any]:
    """The plan file's content with the ``top`` best layouts."""
    i = plan.inputs
    knobs = plan.space.knobs.rows()
    layouts = [layout_dict(plan, e, n + 1) for n, e in enumerate(plan.entries[:max(top, 1)])]
    return {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "inputs": {
            "model": i.model, "model_name": plan.model_name, "cluster": i.cluster, "topology": i.topology,
            "device": i.device, "cluster_name": plan.cluster_name, "world_size": plan.world_size,
            "hosts": len(plan.hosts), "ranks_per_host": sorted(set(plan.hosts)),
            "global_batch": i.global_batch, "seq_len": i.seq_len, "dtype": i.dtype,
            "sequence_parallel": i.sequence_parallel, "mixed_precision": i.mixed_precision,
            "strategies": [a.value for a in plan.space.strategies],
            "fixed": {a.value: d for a, d in plan.space.fixed.items()},
            "knobs": {
                "micro_batch": sorted({k.micro_batch for k in knobs}),
                "recompute": list(dict.fromkeys(k.recompute.value for k in knobs)),
                "schedule": list(dict.fromkeys(k.schedule.value for k in knobs)),
                "interleave": sorted({k.interleave for k in knobs}),
            },
            "exhaustive": bool(plan.extra.get("exhaustive")),
        },
        "space_size": plan.space.size,
        "pruned": dict(plan.pruning.pruned),
        "traced_classes": plan.traced_classes,
        "evaluated": plan.evaluated,
        "simulated": plan.simulated,
        "feasible": plan.feasible,
        "failed": dict(plan.failed),
        "elapsed_s": plan.elapsed_s,
        "best": layouts[0] if layouts and layouts[0]["feasible"] else None,
        "layouts": layouts,
    }


CSV_COLUMNS = ("rank", "layout_id", "knob_row", *(a.value for a in Axis), "order", "micro_batch", "recompute",
               "schedule", "interleave", "feasible", "step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes",
               "compute_s", "exposed_comm_s", "bubble_s", "optimizer_s", "p2p_s", "reason")


def csv_text(plan: Plan) -> str:
    """Every scored layout, one row each, best first (:data:`CSV_COLUMNS`)."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for n, e in enumerate(plan.entries, 1):
        r, b = e.result, e.result.breakdown
        w.writerow([n, e.index, e.knob, *(e.layout.degree(a) for a in Axis), e.layout.order_text(),
                    e.knobs.micro_batch, e.knobs.recompute.value, r.layout.get("schedule") or "",
                    r.layout.get("interleave"), int(r.feasible), repr(r.step_time_s), repr(r.tokens_per_s),
                    repr(r.mfu), r.peak_memory_bytes, repr(b.compute_s), repr(sum(b.exposed_comm_s.values())),
                    repr(b.bubble_s), repr(b.optimizer_s), repr(b.p2p_s), r.reason or ""])
    return out.getvalue()


def why_loses(best: Entry, other: Entry) -> str:
    """One line: where ``other``'s step time goes beyond ``best``'s (the largest differences
    of the breakdown, per axis for communication), or why it does not fit."""
    r = other.result
    if not r.feasible:
        return r.reason or "infeasible"
    parts = _parts(r)
    base = _parts(best.result)
    diffs = sorted(((parts.get(k, 0.0) - base.get(k, 0.0), k) for k in set(parts) | set(base)), reverse=True)
    worse = [f"+{d * 1e3:.3g} ms {k}" for d, k in diffs[:2] if d > 0]
    slower = (r.step_time_s - best.result.step_time_s) * 1e3
    if slower <= 0:
        return "as fast; ranked lower by peak memory or position"
    return f"{slower:.3g} ms slower: " + (", ".join(worse) or "no single part stands out")


def _parts(r: Any) -> dict[str, float]:
    b = r.breakdown
    out = {"compute": b.compute_s, "bubble": b.bubble_s, "optimizer": b.optimizer_s, "p2p": b.p2p_s}
    for axis, s in b.exposed_comm_s.items():
        link = r.links.get(axis, {}).get("link")
        out[f"exposed {axis} comm" + (f" ({link})" if link else "")] = s
    return out


def export_torchtitan(layout: dict[str, Any]) -> str:
    """The ``[parallelism]`` (and batch, activation checkpoint) settings of a torchtitan TOML
    for one plan-file layout (torchtitan ``JobConfig``: ``parallelism``, ``training``,
    ``activation_checkpoint``)."""
    deg = {a.value: 1 for a in Axis} | dict(layout["layout"]["degrees"])
    lay = layout["layout"]
    lines = [
        "[parallelism]",
        f"data_parallel_replicate_degree = {deg['dp_replicate']}",
        f"data_parallel_shard_degree = {deg['dp_shard']}",
        f"tensor_parallel_degree = {deg['tp']}",
        f"context_parallel_degree = {deg['cp']}",
        f"pipeline_parallel_degree = {deg['pp']}",
        f"expert_parallel_degree = {deg['ep']}",
    ]
    if deg["pp"] > 1 and lay.get("schedule"):
        lines.append(f'pipeline_parallel_schedule = "{Schedule(lay["schedule"]).torch_name}"')
        lines.append(f"pipeline_parallel_microbatch_size = {lay['micro_batch']}")
    lines += ["", "[training]", f"global_batch_size = {lay['global_batch']}",
              f"local_batch_size = {lay['global_batch'] // (deg['dp_replicate'] * deg['dp_shard'])}",
              f"seq_len = {lay['seq_len']}", "", "[activation_checkpoint]", f'mode = "{lay["recompute"]}"']
    return "\n".join(lines) + "\n"


def export_megatron(layout: dict[str, Any], n_layers: int | None = None) -> str:
    """Megatron-LM arguments for one plan-file layout. Megatron's data-parallel size is the
    rest of the world (world / (tp·pp·cp)) and holds expert parallel inside it."""
    deg = {a.value: 1 for a in Axis} | dict(layout["layout"]["degrees"])
    lay = layout["layout"]
    args = [f"--tensor-model-parallel-size {deg['tp']}", f"--pipeline-model-parallel-size {deg['pp']}",
            f"--context-parallel-size {deg['cp']}", f"--expert-model-parallel-size {deg['ep']}"]
    v = lay.get("interleave") or 1
    if deg["pp"] > 1 and v > 1 and n_layers:
        args.append(f"--num-layers-per-virtual-pipeline-stage {n_layers // (deg['pp'] * v)}")
    args += [f"--micro-batch-size {lay['micro_batch']}", f"--global-batch-size {lay['global_batch']}",
             f"--seq-length {lay['seq_len']}"]
    if lay.get("sequence_parallel") and deg["tp"] > 1:
        args.append("--sequence-parallel")
    if lay["recompute"] == "selective":
        args.append("--recompute-granularity selective")
    elif lay["recompute"] == "full":
        args += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    if deg["dp_shard"] > 1:
        args.append("--use-torch-fsdp2")
    return " \\\n".join(args) + "\n"
