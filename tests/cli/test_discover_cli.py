"""``topomesh discover`` on the fixture sysfs trees: tables, JSON, files, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from topomesh.cli.main import main
from topomesh.topology import api
from topomesh.topology.discover import ENV_SYSFS_ROOT
from topomesh.topology.model import LinkKind

SYSFS = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"


def _discover(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["discover", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(
    ("tree", "ranks", "kind_0_1", "channels"),
    [
        ("dgx-h100-8gpu-8ib", 8, "NVSwitch", "18"),
        ("pcie-4gpu-2numa", 4, "PCIe", "1"),
        ("nvlink-bridge-2gpu", 2, "NVLink", "4"),
        ("cpu-only", 1, None, None),
    ],
)
def test_json_for_each_fixture_tree(capsys, tree: str, ranks: int, kind_0_1: str | None, channels: str | None) -> None:
    rc, out, _ = _discover(capsys, "--sysfs-root", SYSFS / tree, "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["version"] == "0.1" and doc["world_size"] == str(ranks)
    assert list(doc["hosts"]) == [tree]  # the fixture's hostname file
    if kind_0_1:
        conn = doc["ranks"]["0"]["peers"]["1"]["connection"]
        assert (conn["type"], conn["channels"]["count"]) == (kind_0_1, channels)
    else:
        assert doc["ranks"]["0"]["peers"] == {}


def test_human_output_shows_nics_and_matrix(capsys) -> None:
    rc, out, _ = _discover(capsys, "--sysfs-root", SYSFS / "dgx-h100-8gpu-8ib")
    assert rc == 0
    assert "dgx-h100-8gpu-8ib" in out and "8 x NVIDIA H100 80GB" in out and "(sm90)" in out
    assert "mlx5_7 (IB 400G)" in out
    assert "R7  NV18" in out
    assert "source: discover" in out


def test_output_file_round_trips(capsys, tmp_path: Path) -> None:
    target = tmp_path / "topo.json"
    rc, _, err = _discover(capsys, "--sysfs-root", SYSFS / "pcie-4gpu-2numa", "-o", target)
    assert rc == 0 and err == f"wrote {target}\n"
    topo = api.read_source(target)
    assert topo.world_size == 4
    assert topo.connection(0, 1).kind is LinkKind.PIX and topo.connection(1, 2).kind is LinkKind.SYS
    compact_file = tmp_path / "topo.compact.json"
    rc, _, _ = _discover(capsys, "--sysfs-root", SYSFS / "pcie-4gpu-2numa", "-o", compact_file, "--form", "compact")
    assert json.loads(compact_file.read_text())["format"] == "topomesh-compact"
    again = api.read_source(compact_file)
    assert all(again.connection(a, b) == topo.connection(a, b) for a in range(4) for b in range(4))


def test_nproc_and_env_root(capsys, monkeypatch) -> None:
    monkeypatch.setenv(ENV_SYSFS_ROOT, str(SYSFS / "cpu-only"))
    rc, out, _ = _discover(capsys, "--nproc", "3", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["world_size"] == "3"
    # one NUMA node: every rank shares CPU0, so the processes talk over shared memory
    assert doc["ranks"]["0"]["peers"]["2"]["connection"]["type"] == "SHM"


def test_bad_output_path_is_one_line(capsys, tmp_path: Path) -> None:
    rc, out, err = _discover(capsys, "--sysfs-root", SYSFS / "cpu-only", "-o", tmp_path / "no" / "such" / "dir.json")
    assert rc == 2 and out == ""
    assert err.startswith("topomesh: error: ") and "cannot write the topology file" in err and err.count("\n") == 1


def test_bad_sysfs_root_in_a_process(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "topomesh", "discover", "--sysfs-root", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"topomesh: error: sysfs root '{tmp_path / 'nope'}' does not exist"]


def test_output_to_a_fifo_or_a_link_to_one_is_refused(capsys, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "null"  # stands in for /dev/null: a test that touched the real one could delete it as root
    link.symlink_to(fifo)
    for target, via in ((fifo, ""), (link, f" (a link to {fifo})")):
        rc, _, err = _discover(capsys, "--sysfs-root", SYSFS / "cpu-only", "-o", target, "--json")
        assert rc == 2
        assert err == (f"topomesh: error: {target}{via} is a named pipe (FIFO), not a regular file: refusing to "
                       "replace it; name a regular file or a new path\n")
    assert os.path.islink(link) and sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "null"]
