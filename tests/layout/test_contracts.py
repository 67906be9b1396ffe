"""DESIGN.md: torch process groups and device meshes are created only in layout/groups.py."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "topomesh"
# direct torch calls; calls through our own groups module (groups.new_group) are the point
_CREATES = re.compile(r"(?<!groups\.)\b(new_group|new_subgroups\w*|init_device_mesh)\s*\(|\bDeviceMesh\(")


def test_only_groups_module_creates_process_groups() -> None:
    offenders = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if p != SRC / "layout" / "groups.py" and _CREATES.search(p.read_text())
    ]
    assert offenders == []
