"""``nvidia-smi topo -m`` import: the real H100 dump and hand-written matrices."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import pytest

from topomesh.errors import TopologyError
from topomesh.topology import api
from topomesh.topology.formats.smi import parse_smi_topo
from topomesh.topology.model import DeviceKind, LinkKind, NicKind

INPUTS = Path(__file__).resolve().parents[1] / "fixtures" / "inputs"
H100 = "real/nvidia-smi-topo/h100-sxm-8gpu-12nic.txt"


def _parse(path: Path):
    return parse_smi_topo(path.read_text(), source=str(path))


def _pix_pairs(host) -> set[tuple[str, str]]:
    return {tuple(sorted((p.a, p.b))) for p in host.paths if p.kind is LinkKind.PIX}


def test_h100_dump(shared_data: Path) -> None:
    host = _parse(shared_data / H100)
    assert host.hostname == "h100-sxm-8gpu-12nic"
    assert [g.id for g in host.gpus] == [f"GPU{i}" for i in range(8)]
    assert {g.numa_node for g in host.gpus} == {0}
    assert [d.id for d in host.devices if d.kind is DeviceKind.CPU] == ["CPU0"]
    for a, b in combinations(host.gpus, 2):
        p = host.path(a.id, b.id)
        assert p.kind is LinkKind.NVSWITCH and p.nvlink_count == 18
    assert [n.name for n in host.nics] == [f"mlx5_{i}" for i in range(12)]
    assert {n.kind for n in host.nics} == {NicKind.IB} and {n.speed_Gbps for n in host.nics} == {None}
    # exactly the PIX cells of the file (GPU-NIC and NIC-NIC), everything else NODE
    expect = {("GPU0", "NIC0"), ("GPU1", "NIC1"), ("GPU2", "NIC2"), ("GPU3", "NIC5"), ("GPU4", "NIC6"),
              ("GPU5", "NIC7"), ("GPU6", "NIC8"), ("GPU7", "NIC11"), ("NIC3", "NIC4"), ("NIC10", "NIC9")}
    assert _pix_pairs(host) == expect
    others = {p.kind for p in host.paths if p.kind not in (LinkKind.PIX, LinkKind.NVSWITCH)}
    assert others == {LinkKind.NODE}
    assert len(host.paths) == 20 * 19 // 2
    assert [host.nearest_nic(f"GPU{i}").name for i in range(8)] == [
        "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_5", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_11"]
    topo = api.read_source(shared_data / H100)
    assert topo.world_size == 8
    assert topo.connection(3, 6).kind is LinkKind.NVSWITCH and topo.connection(3, 6).channels == 18


def test_spaces_instead_of_tabs_give_the_same_host(shared_data: Path) -> None:
    text = (shared_data / H100).read_text()
    assert parse_smi_topo(text.replace("\t", "    "), source="x") == parse_smi_topo(text, source="x")


def test_pcie_4gpu_two_numa_two_nics() -> None:
    host = _parse(INPUTS / "smi-pcie-4gpu-2numa-2nic.txt")
    assert [g.numa_node for g in host.gpus] == [0, 0, 1, 1]
    assert [d.id for d in host.devices if d.kind is DeviceKind.CPU] == ["CPU0", "CPU1"]
    assert [(n.name, n.kind) for n in host.nics] == [("mlx5_0", NicKind.IB), ("eno1np0", NicKind.ETHERNET)]
    assert host.path("GPU0", "GPU1").kind is LinkKind.PIX
    assert host.path("GPU1", "GPU2").kind is LinkKind.SYS
    assert host.path("GPU0", "NIC0").kind is LinkKind.PXB
    assert host.path("GPU3", "NIC1").kind is LinkKind.NODE
    topo = api.read_source(INPUTS / "smi-pcie-4gpu-2numa-2nic.txt")
    assert topo.domains(LinkKind.NVLINK) == [[0], [1], [2], [3]]
    assert topo.domains(LinkKind.PIX) == [[0, 1], [2, 3]]


def test_nv4_pair_is_a_direct_bond() -> None:
    host = _parse(INPUTS / "smi-nv4-pair-1eth.txt")
    p = host.path("GPU0", "GPU1")
    assert p.kind is LinkKind.NVLINK and p.nvlink_count == 4
    assert host.nics[0].name == "enp5s0" and host.nics[0].kind is NicKind.ETHERNET
    assert host.path("GPU1", "NIC0").kind is LinkKind.PHB


def test_four_gpu_mesh_without_nics_is_not_a_switch() -> None:
    # NV6 to each of 3 peers = 18 links: fits one H100, so a direct mesh (HGX 4-GPU board)
    host = _parse(INPUTS / "smi-hgx-4gpu-nv6-mesh-nonic.txt")
    assert host.nics == ()
    assert {(p.kind, p.nvlink_count) for p in host.paths} == {(LinkKind.NVLINK, 6)}
    topo = api.read_source(INPUTS / "smi-hgx-4gpu-nv6-mesh-nonic.txt")
    assert topo.world_size == 4 and topo.domains(LinkKind.NVLINK) == [[0, 1, 2, 3]]
    assert topo.ranks[0].device == "GPU0"


def test_legacy_driver_columns_and_soc() -> None:
    host = _parse(INPUTS / "smi-legacy-spaces-mlx-columns.txt")
    assert [(n.id, n.name, n.kind) for n in host.nics] == [("NIC0", "mlx5_0", NicKind.IB), ("NIC1", "mlx5_2", NicKind.IB)]
    assert host.path("GPU0", "GPU3").nvlink_count == 2 and host.path("GPU0", "GPU1").nvlink_count == 1
    assert {p.kind for p in host.paths if p.a.startswith("GPU") and p.b.startswith("GPU")} == {LinkKind.NVLINK}
    assert host.path("GPU0", "NIC1").kind is LinkKind.SYS  # SOC = SYS on old drivers
    assert all(g.numa_node is None for g in host.gpus)  # no NUMA Affinity column


def _matrix(n: int, cell: str) -> str:
    head = "\t" + "\t".join(f"GPU{i}" for i in range(n)) + "\n"
    rows = ["\t".join([f"GPU{i}", *(" X " if i == j else cell for j in range(n))]) for i in range(n)]
    return head + "\n".join(rows) + "\n"


@pytest.mark.parametrize(
    ("n", "cell", "kind"),
    [(8, "NV12", LinkKind.NVSWITCH), (16, "NV6", LinkKind.NVSWITCH), (4, "NV4", LinkKind.NVLINK), (3, "NV18", LinkKind.NVLINK)],
)
def test_all_to_all_switch_rule(n: int, cell: str, kind: LinkKind) -> None:
    host = parse_smi_topo(_matrix(n, cell), source="<t>")
    assert {p.kind for p in host.paths} == {kind}


def test_missing_rows_use_the_other_direction() -> None:
    text = "\tGPU0\tGPU1\tGPU2\nGPU0\t X \tNV2\tSYS\n"
    host = parse_smi_topo(text, source="<t>")
    assert host.path("GPU1", "GPU0").kind is LinkKind.NVLINK
    assert host.path("GPU0", "GPU2").kind is LinkKind.SYS
    assert host.path("GPU1", "GPU2") is None  # neither row says


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("hello GPU0\n", "no matrix header"),
        ("\tGPU0\tGPU1\n\nLegend:\n", "not followed by any row"),
        ("\tGPU0\tGPU1\nGPU0\t X \tFOO\n", "unknown link 'FOO' between GPU0 and GPU1"),
        ("\tGPU0\tGPU1\nGPU0\t X \tNV2\nGPU1\tSYS\t X \n", "not symmetric"),
        ("\tGPU0\tGPU1\nGPU0\tPIX\tNV2\n", "X belongs on the diagonal"),
        ("\tGPU0\tGPU1\nGPU0\t X \n", "row GPU0 has 1 cells"),
        ("\tGPU0\tGPU1\nGPU7\t X \tNV2\n", "'GPU7' is not a column"),
        ("\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU0\t X \tPIX\n", "second row"),
        ("\tGPU0\tGPU0\n", "names a column twice"),
        ("\tGPU0\tNIC0\nGPU0\t X \tNV2\n", "NVLink joins GPUs only"),
        ("\tGPU0\tGPU1\nGPU0\t X \tNV" + "9" * 30 + "\n", "30 digits: out of range"),
    ],
)
def test_bad_matrix_names_the_problem(text: str, match: str) -> None:
    with pytest.raises(TopologyError, match=match) as info:
        parse_smi_topo(text, source="bad.txt")
    assert str(info.value).startswith("bad.txt")


def _labelled_matrix(labels: list[str], cells: dict[tuple[int, int], str] | None = None) -> str:
    """A tab-separated matrix with SYS everywhere off the diagonal unless ``cells`` says."""
    rows = ["\t" + "\t".join(labels)]
    for i, a in enumerate(labels):
        row = [(cells or {}).get((i, j), "X" if i == j else "SYS") for j in range(len(labels))]
        rows.append("\t".join([a, *row]))
    return "\n".join(rows) + "\n"


def test_columns_are_bounded_before_rows_are_read() -> None:
    header = "\t" + "\t".join(f"GPU{i}" for i in range(10_000)) + "\n"
    with pytest.raises(TopologyError, match=r"line 1: the header names 10000 columns, more than the limit of 256"):
        parse_smi_topo(header + "GPU0\tX\n", source="wide.txt")
    assert len(parse_smi_topo(_labelled_matrix([f"GPU{i}" for i in range(256)]), source="w.txt").gpus) == 256


@pytest.mark.parametrize(
    ("labels", "cells", "match"),
    [
        (["GPU0", "GPU1", "GPU01"], None, r"line 1: columns GPU1 and GPU01 both name GPU index 1"),
        (["GPU0", "GPU" + "1" * 5000], None, r"line 1: column 'GPU1111.*has an index of 5000 digits"),
        (["GPU0", "GPU1"], {(0, 1): "NV" + "9" * 5000, (1, 0): "NV" + "9" * 5000}, r"line 2: NV# between GPU0 and GPU1 has 5000 digits"),
        (["GPU0", "GPU1"], {(0, 1): "NV٤", (1, 0): "NV٤"}, r"line 2: unknown link 'NV٤' between GPU0 and GPU1"),
    ],
)
def test_hostile_labels_and_cells(labels: list[str], cells: dict | None, match: str) -> None:
    with pytest.raises(TopologyError, match=match):
        parse_smi_topo(_labelled_matrix(labels, cells), source="bad.txt")
