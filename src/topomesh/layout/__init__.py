"""Parallel layouts placed on the topology: ranks, groups, device meshes, replica groupings.

Pure parts are importable without ``torch.distributed`` set up; the trainer's entry point
is :func:`topomesh.layout.api.mesh_from_topology` (see ``docs/layout.md``).
"""

from topomesh.layout.dims import DEFAULT_ORDER, Axis, Layout, parse_order
from topomesh.layout.place import AxisReport, Placement, Strategy, axis_report, place
from topomesh.layout.replicas import Instances, ReplicaGrouping

__all__ = [
    "DEFAULT_ORDER",
    "Axis",
    "AxisReport",
    "Instances",
    "Layout",
    "Placement",
    "ReplicaGrouping",
    "Strategy",
    "axis_report",
    "parse_order",
    "place",
]
