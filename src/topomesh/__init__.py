"""topomesh: topology-aware distributed PyTorch, from launch to layout."""

from __future__ import annotations

from topomesh.errors import (
    CalibrationError,
    LaunchError,
    LayoutError,
    ModelConfigError,
    TopologyError,
    TopomeshError,
    TraceError,
)
from topomesh.topology.api import load_topology
from topomesh.topology.model import Connection, Host, LinkKind, Topology

__version__ = "0.1.0"

__all__ = [
    "CalibrationError",
    "Connection",
    "Host",
    "LaunchError",
    "LayoutError",
    "ModelConfigError",
    "LinkKind",
    "Topology",
    "TopologyError",
    "TopomeshError",
    "TraceError",
    "__version__",
    "load_topology",
]
