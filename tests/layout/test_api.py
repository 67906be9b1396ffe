"""The trainer helper's pure half: degrees with -1, which topology it uses, and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from topomesh.errors import LayoutError
from topomesh.layout.api import job_topology, place_layout, resolve_layout
from topomesh.layout.dims import Axis, Layout
from topomesh.topology.api import ENV_VAR, save_topology

from .topos import h100_host, interleaved


def test_minus_one_takes_the_rest_of_the_world() -> None:
    lay = resolve_layout({"tp": 8, "pp": 2, "dp_shard": -1}, 64)
    assert (lay.tp, lay.pp, lay.dp_shard) == (8, 2, 4)
    assert resolve_layout(Layout(tp=2), 2).tp == 2
    with pytest.raises(LayoutError, match="do not divide|does not divide"):
        resolve_layout({"tp": 3, "dp_shard": -1}, 8)
    with pytest.raises(LayoutError, match="degree of dp_replicate is given twice"):
        resolve_layout({"dp": 2, "dp_replicate": 2}, 4)


def test_topology_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    topo = interleaved([h100_host("a"), h100_host("b")])
    path = save_topology(topo, tmp_path / "world.json")
    monkeypatch.setenv(ENV_VAR, str(path))
    p = place_layout({"tp": 8, "pp": 2}, world_size=16)
    assert p.groups(Axis.TP)[0] == [0, 2, 4, 6, 8, 10, 12, 14]
    with pytest.raises(LayoutError, match="has 16 ranks but the job has 8"):
        place_layout({"tp": 8}, world_size=8)


def test_without_a_file_one_host_in_rank_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    topo = job_topology(None, 4)
    assert topo.world_size == 4 and len(topo.hosts) == 1 and topo.source == "single-host default"
    assert place_layout({"tp": 2, "pp": 2}, world_size=4).ranks == (0, 1, 2, 3)


def test_no_world_size_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(LayoutError, match="no process group and no WORLD_SIZE"):
        place_layout({"tp": 2})
