"""``topomesh show``: tables, matrix, JSON and PNG for every kind of source; bad input exits 2."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from topomesh.cli.main import main
from topomesh.report.plot import draw_topology
from topomesh.report.topology import cell_label, rank_matrix, rank_ranges, used_connections
from topomesh.topology import api
from topomesh.topology.build import build_topology, default_placement, single_host_topology
from topomesh.topology.model import LinkKind

from ..topology.helpers import cpu_host, dgx_host, pcie_host
from .test_png import CPU_DOT, GPU_DOT, NVSWITCH, SYS, _count, _decode

TESTS = Path(__file__).resolve().parents[1]
INPUTS = TESTS / "fixtures" / "inputs"
A100 = "real/nccl-topo/a100-sxm-8gpu-nvswitch-5nic.xml"
H100 = "real/nvidia-smi-topo/h100-sxm-8gpu-12nic.txt"
AZURE = "real/nccl-topo/azure-ndv5-h100-pci-only.xml"


def _show(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["show", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def _matrix_rows(out: str) -> dict[str, list[str]]:
    """The rank matrix of the human output: row label → cells."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("rank-to-rank links"))
    rows = {}
    for line in lines[start + 2 :]:
        fields = line.split()
        if not fields or not fields[0].startswith("R"):
            break
        rows[fields[0]] = fields[1:]
    return rows


def test_smi_file_shows_nvswitch_matrix_and_rails(capsys, shared_data: Path) -> None:
    rc, out, _ = _show(capsys, shared_data / H100)
    assert rc == 0
    rows = _matrix_rows(out)
    assert list(rows) == [f"R{i}" for i in range(8)]
    assert rows["R3"] == ["NV18"] * 3 + ["X"] + ["NV18"] * 4
    assert "NV#  = NVLink through NVSwitches, # links per GPU" in out
    assert "mlx5_5 (IB)" in out  # rank 3's nearest NIC, at PIX
    assert "NVLink islands" in out and "[0-7]" in out


def test_xml_file_and_no_matrix(capsys, shared_data: Path) -> None:
    rc, out, _ = _show(capsys, shared_data / AZURE, "--no-matrix")
    assert rc == 0 and "rank-to-rank links" not in out
    assert "8 (" not in out.split("ranks")[0]  # no arch in a PCI-only file: "8", not "8 (sm..)"
    rc, out, _ = _show(capsys, shared_data / AZURE)
    rows = _matrix_rows(out)
    assert rows["R0"] == ["X", "NODE", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"]


def test_json_is_the_v01_document(capsys, shared_data: Path) -> None:
    rc, out, _ = _show(capsys, shared_data / A100, "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["version"] == "0.1" and len(doc["ranks"]) == 8
    conn = doc["ranks"]["0"]["peers"]["5"]["connection"]
    assert conn["type"] == "NVSwitch" and conn["channels"] == {"count": "12"}
    assert conn["bandwidth"] == {"value": "240", "measurement": "GB/s", "source": "default"}
    again = api.parse_text(out)
    original = api.read_source(shared_data / A100)
    assert all(again.connection(a, b) == original.connection(a, b) for a in range(8) for b in range(8))


def test_json_of_a_large_world_is_compact(capsys, tmp_path: Path) -> None:
    hosts = [dgx_host(f"n{i}") for i in range(17)]  # 136 ranks > api.DENSE_MAX_RANKS
    topo = build_topology(hosts, default_placement(hosts, [8] * 17))
    path = api.save_topology(topo, tmp_path / "world.json")
    rc, out, _ = _show(capsys, path, "--json")
    assert rc == 0 and json.loads(out)["format"] == "topomesh-compact"
    rc, out, _ = _show(capsys, path)
    assert "first 64 of 136 ranks" in out
    assert "ranks 0-7 of 136 (host n0); other hosts below" in out
    assert "R0 reaches ranks on other hosts through: IB" in out


def test_own_inputs_show(capsys) -> None:
    rc, out, _ = _show(capsys, INPUTS / "smi-pcie-4gpu-2numa-2nic.txt")
    assert rc == 0
    assert _matrix_rows(out)["R1"] == ["PIX", "X", "SYS", "SYS"]
    rc, out, _ = _show(capsys, INPUTS / "nccl-4gpu-nvlink-mesh-ib-eth.xml")
    assert _matrix_rows(out)["R2"] == ["NV4", "NV4", "X", "NV4"]
    assert "NV#  = direct bonded set of # NVLinks" in out


def test_png_is_written(capsys, shared_data: Path, tmp_path: Path) -> None:
    png = tmp_path / "a100.png"
    rc, out, _ = _show(capsys, shared_data / A100, "--png", png)
    assert rc == 0 and f"drawn to {png}" in out
    img = _decode(png)  # 8 NVSwitch GPUs and 5 IB NICs: NVSwitch edges, GPU dots, nothing slower drawn
    assert _count(img, NVSWITCH) > 150 and _count(img, GPU_DOT) > 1500
    assert _count(img, SYS) == 0 and _count(img, CPU_DOT) == 0


def test_drawing_has_one_legend_entry_per_link_kind() -> None:
    hosts = [dgx_host("a", gpus=4), pcie_host("b"), cpu_host("c", sockets=2)]
    topo = build_topology(hosts, default_placement(hosts, [4, 4, 2]))
    fig = draw_topology(topo)
    (ax,) = fig.axes
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == [
        "NVLink (NV4, 48 GB/s)",
        "NVSwitch (NV18, 370.8 GB/s)",
        "SHM (12 GB/s)",
        "SYS (10 GB/s)",
        "NIC (1.25-12.5 GB/s)",
    ]
    # every rank is a dot, every same-host pair an edge (6 + 6 + 1), one stub per host
    assert len(ax.collections) == 10
    summary = draw_topology(topo, max_ranks=4)
    assert "(summarised)" in summary.axes[0].get_title()
    assert len(summary.axes[0].collections) == 0  # hosts only, no rank dots


def test_png_without_matplotlib_is_a_clear_error(capsys, monkeypatch, shared_data: Path, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc, _, err = _show(capsys, shared_data / H100, "--png", tmp_path / "x.png")
    assert rc == 2
    assert err == "topomesh: error: --png needs matplotlib, which is not installed: pip install 'topomesh[plot]'\n"


def test_labels_and_ranges() -> None:
    assert rank_ranges([5, 1, 2, 3, 9]) == "1-3,5,9"
    topo = build_topology([pcie_host("p")], default_placement([pcie_host("p")], [4]))
    assert [cell_label(topo.connection(0, b)) for b in range(4)] == ["X", "NV4", "SYS", "SYS"]
    assert topo.connection(0, 1).kind is LinkKind.NVLINK


@pytest.mark.parametrize("name", sorted(p.name for p in (INPUTS / "damaged").iterdir()))
def test_damaged_files_are_one_line_exit_2(capsys, name: str) -> None:
    path = INPUTS / "damaged" / name
    rc, out, err = _show(capsys, path)
    assert rc == 2 and out == ""
    assert err.startswith(f"topomesh: error: {path}: ") and err.count("\n") == 1


def test_cli_process_never_prints_a_traceback(tmp_path: Path) -> None:
    cases = [
        (["show", str(INPUTS / "damaged" / "garbage.bin")], "not UTF-8 text"),
        (["show", str(tmp_path)], "is a directory"),
    ]
    for argv, problem in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "topomesh", *argv], capture_output=True, text=True, timeout=120, check=False
        )
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("topomesh: error: ") and problem in lines[0]


def test_names_from_files_are_printed_literally(capsys, tmp_path: Path) -> None:
    """Host and NIC names are data: no rich markup, no matplotlib mathtext."""
    from topomesh.topology.model import Host, Nic, NicKind

    base = dgx_host("x", gpus=2)
    odd = Host(
        hostname="[bold]node[/]",
        devices=base.devices,
        nics=(Nic(id="NIC0", name="$\\frac{mlx$", kind=NicKind.IB, speed_Gbps=400.0), base.nics[1]),
        paths=base.paths,
    )
    topo = build_topology([odd, cpu_host("[/]")], default_placement([odd, cpu_host("[/]")], [2, 1]))
    path = api.save_topology(topo, tmp_path / "odd.json")
    rc, out, _ = _show(capsys, path, "--png", tmp_path / "odd.png")
    assert rc == 0
    assert "[bold]node[/]" in out and "$\\frac{mlx$ (IB 400G)" in out and "│ [/]" in out
    assert (tmp_path / "odd.png").read_bytes()[:4] == b"\x89PNG"


def test_links_table_lists_only_connections_some_pair_has() -> None:
    """The palette holds every rail pair; a rail used on one host only never meets itself."""
    hosts = [dgx_host("fast", nic_Gbps=400), dgx_host("slow", nic_Gbps=200)]
    topo = build_topology(hosts, default_placement(hosts, [8, 8]))
    assert len(topo.table.palette) == 4  # LOC, NVSwitch, IB 400G-400G, IB 400G-200G
    kinds = sorted((c.kind.value, c.bandwidth_GBps) for c in used_connections(topo))
    assert kinds == [("IB", 25.0), ("LOC", 5000.0), ("NVSwitch", 370.8)]
    hosts.append(dgx_host("fast2", nic_Gbps=400))  # now the 400G rail crosses hosts too
    topo = build_topology(hosts, default_placement(hosts, [8, 8, 8]))
    kinds = sorted((c.kind.value, c.bandwidth_GBps) for c in used_connections(topo))
    assert kinds == [("IB", 25.0), ("IB", 50.0), ("LOC", 5000.0), ("NVSwitch", 370.8)]


def test_links_table_shows_measured_links_and_drops_defaults_they_replace() -> None:
    hosts = [dgx_host("a", gpus=2), dgx_host("b", gpus=2)]
    topo = build_topology(hosts, default_placement(hosts, [2, 2]), measured_hosts={(0, 1): (4.0, 40.0)},
                          measured_devices={0: [("GPU0", "GPU1", 9.0, 300.0)]})
    got = sorted((c.kind.value, c.bandwidth_GBps, c.measured) for c in used_connections(topo))
    # host b's NVSwitch pair keeps its default; the only host pair is measured, so no default IB
    assert got == [("IB", 40.0, True), ("LOC", 5000.0, False), ("NVSwitch", 300.0, True), ("NVSwitch", 370.8, False)]


def test_large_single_host_matrix_is_cut() -> None:
    topo = single_host_topology(cpu_host("big", sockets=2), 40)
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(rank_matrix(topo, max_ranks=32))
    text = console.export_text()
    assert "ranks 0-31 of 40 (host big)\n" in text and "other hosts" not in text
    assert text.count("\nR") == 32


def test_show_layout_view_places_tp_on_nvlink(tmp_path, capsys):
    # two PCIe hosts with NVLink pairs, ranks interleaved over the hosts (not contiguous)
    hosts = [pcie_host("a"), pcie_host("b")]
    from topomesh.topology.model import RankInfo

    ranks = [RankInfo(rank=r, host=r % 2, local_rank=r // 2, device=f"GPU{r // 2}") for r in range(8)]
    path = tmp_path / "t.json"
    api.save_topology(build_topology(hosts, ranks), path)
    rc, out, _ = _show(capsys, str(path), "--layout", "tp=2,dp_shard=-1", "--json")
    assert rc == 0
    doc = json.loads(out)
    axes = {a["axis"]: a for a in doc["axes"]}
    assert axes["tp"]["link"] == "NVLink" and axes["dp_shard"]["degree"] == 4
    # the tp groups are the NVLink pairs of one host, although their ranks are not adjacent
    assert sorted(sorted(g) for g in axes["tp"]["groups"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    rc, out, _ = _show(capsys, str(path), "--layout", "tp=2,dp_shard=-1", "--no-matrix")
    assert rc == 0 and "placement of tp=2 dp_shard=4" in out


@pytest.mark.parametrize(("spec", "message"), [("tp", "AXIS=DEGREE"), ("tp=3", "needs 3 ranks"), ("warp=2", "warp")])
def test_show_bad_layout_is_one_line(capsys, spec, message):
    rc, out, err = _show(capsys, str(TESTS / "golden" / "two_hosts_nvlink_pairs.v01.json"), "--layout", spec)
    assert rc == 2 and out == "" and message in err and err.count("\n") == 1


def test_png_to_a_fifo_is_refused(capsys, shared_data: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    rc, _, err = _show(capsys, shared_data / A100, "--png", fifo)
    assert rc == 2 and err == (f"topomesh: error: {fifo} is a named pipe (FIFO), not a regular file: refusing "
                               "to replace it; name a regular file or a new path\n")
