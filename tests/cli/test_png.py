"""``--png`` pictures decoded and looked at: size, ink, and the colour of each link kind drawn,
written out here from the one colour table (report.topology.KIND_COLORS, shared with the
terminal matrix): NVSwitch #1b9e77, NVLink #66a61e, SYS #d62728, IB #e7298a, Ethernet
#8c564b; GPU ranks are dark dots #2b2b2b, CPU ranks grey #9c9c9c."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from topomesh.cli.main import main
from topomesh.topology import api
from topomesh.topology.build import build_topology, default_placement

from ..topology.helpers import cpu_host, dgx_host, pcie_host

image = pytest.importorskip("matplotlib.image")

SYSFS = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"
NVSWITCH, NVLINK, SYS, IB, ETH = "#1b9e77", "#66a61e", "#d62728", "#e7298a", "#8c564b"
GPU_DOT, CPU_DOT = "#2b2b2b", "#9c9c9c"


def _rgb(hex_colour: str) -> np.ndarray:
    return np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)]) / 255.0


def _decode(path: Path) -> np.ndarray:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = image.imread(str(path))
    assert img.ndim == 3 and img.shape[2] in (3, 4)
    return img[:, :, :3]


def _count(img: np.ndarray, hex_colour: str, tol: float = 0.02) -> int:
    """Pixels within ``tol`` of the colour on every channel whose 8 neighbours are too: the
    inside of a drawn line or dot, not the anti-aliased rim of text or of another colour."""
    m = np.all(np.abs(img - _rgb(hex_colour)) <= tol, axis=2)
    inner = m[1:-1, 1:-1].copy()
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            inner &= m[1 + dy : m.shape[0] - 1 + dy, 1 + dx : m.shape[1] - 1 + dx]
    return int(inner.sum())


def _ink(img: np.ndarray) -> float:
    """Share of pixels that are not (almost) white."""
    return float((img.min(axis=2) < 0.95).mean())


def _show_png(capsys, topo, tmp_path: Path, name: str) -> np.ndarray:
    src = api.save_topology(topo, tmp_path / f"{name}.json")
    png = tmp_path / f"{name}.png"
    assert main(["show", str(src), "--png", str(png)]) == 0
    capsys.readouterr()
    return _decode(png)


def test_two_nvswitch_hosts_show_nvswitch_and_ib(capsys, tmp_path):
    hosts = [dgx_host("a", gpus=4), dgx_host("b", gpus=4)]
    img = _show_png(capsys, build_topology(hosts, default_placement(hosts, [4, 4])), tmp_path, "dgx")
    h, w = img.shape[:2]
    assert 300 < w < 3000 and 200 < h < 3000
    assert 0.01 < _ink(img) < 0.6
    # a legend line alone is about 60 solid pixels, a dot about 275 (measured on this picture)
    assert _count(img, NVSWITCH) > 150  # the legend and the vertical/horizontal edges of each host
    assert _count(img, IB) > 120  # the legend and each host's line down to the network
    assert _count(img, GPU_DOT) > 1500  # 8 GPU ranks
    for absent in (NVLINK, SYS, ETH, CPU_DOT):
        assert _count(img, absent) == 0, absent


def test_pcie_host_shows_nvlink_pairs_and_sys(capsys, tmp_path):
    host = pcie_host("p")
    img = _show_png(capsys, build_topology([host], default_placement([host], [4])), tmp_path, "pcie")
    assert _count(img, NVLINK) > 30 and _count(img, SYS) > 30  # legend entries (the edges are diagonal)
    assert _count(img, GPU_DOT) > 800  # 4 GPU ranks
    for absent in (NVSWITCH, IB, ETH):  # one host: no network drawn
        assert _count(img, absent) == 0, absent


def test_cpu_hosts_are_grey_dots_on_ethernet(capsys, tmp_path):
    hosts = [cpu_host("c0"), cpu_host("c1")]
    img = _show_png(capsys, build_topology(hosts, default_placement(hosts, [2, 2])), tmp_path, "cpu")
    assert _count(img, CPU_DOT) > 800 and _count(img, ETH) > 120  # 4 CPU ranks; the legend and two stubs
    assert _count(img, GPU_DOT) == 0 and _count(img, IB) == 0


def test_more_hosts_make_a_larger_picture(capsys, tmp_path):
    one = _show_png(capsys, build_topology([dgx_host("a", gpus=2)], default_placement([dgx_host("a", gpus=2)], [2])),
                    tmp_path, "one")
    hosts = [dgx_host(f"n{i}", gpus=2) for i in range(9)]  # a 3 x 3 grid of hosts
    nine = _show_png(capsys, build_topology(hosts, default_placement(hosts, [2] * 9)), tmp_path, "nine")
    assert nine.shape[0] > 1.5 * one.shape[0] and nine.shape[1] > 1.5 * one.shape[1]


def test_discover_png_of_an_nvlink_bridge_pair(capsys, tmp_path):
    png = tmp_path / "node.png"
    assert main(["discover", "--sysfs-root", str(SYSFS / "nvlink-bridge-2gpu"), "--png", str(png), "--json"]) == 0
    capsys.readouterr()
    img = _decode(png)
    assert _count(img, NVLINK) > 120 and _count(img, GPU_DOT) > 400  # the legend and the bridge; 2 GPUs
    assert _count(img, NVSWITCH) == 0 and _count(img, SYS) == 0
