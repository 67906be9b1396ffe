"""NCCL topology XML import: the real dumps in shared/data and hand-written inputs."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import pytest

from topomesh.errors import TopologyError
from topomesh.topology import api
from topomesh.topology.defaults import link_defaults
from topomesh.topology.formats.nccl_xml import parse_nccl_xml
from topomesh.topology.model import DeviceKind, LinkKind, NicKind

INPUTS = Path(__file__).resolve().parents[1] / "fixtures" / "inputs"


def _parse(path: Path):
    return parse_nccl_xml(path.read_text(), source=str(path))


def test_a100_nvswitch_dump(shared_data: Path) -> None:
    path = shared_data / "real/nccl-topo/a100-sxm-8gpu-nvswitch-5nic.xml"
    host = _parse(path)
    assert host.hostname == "a100-sxm-8gpu-nvswitch-5nic"
    gpus = host.gpus
    assert [g.id for g in gpus] == [f"GPU{i}" for i in range(8)]
    assert {g.arch for g in gpus} == {"sm80"}
    assert {g.name for g in gpus} == {"A100 SXM4 80GB"}  # PCI device 0x20b2, from gpu_pci_ids.json
    assert [g.numa_node for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert gpus[0].pci_bus_id == "0000:13:00.0"
    assert [d.id for d in host.devices if d.kind is DeviceKind.CPU] == ["CPU0", "CPU1"]
    for a, b in combinations(gpus, 2):
        p = host.path(a.id, b.id)
        assert p.kind is LinkKind.NVSWITCH and p.nvlink_count == 12  # 6 switches x 2 links
    assert [n.name for n in host.nics] == [f"mlx5_bond_{i}" for i in range(5)]
    assert {(n.kind, n.speed_Gbps) for n in host.nics} == {(NicKind.IB, 200.0)}
    assert [n.numa_node for n in host.nics] == [0, 0, 0, 1, 1]
    # NIC1 (0000:1a) sits under the switch that also holds GPU1's switch chain
    assert host.path("GPU1", "NIC1").kind is LinkKind.PXB
    # NIC0 hangs off its own root port: another host bridge of NUMA 0
    assert host.path("GPU0", "NIC0").kind is LinkKind.NODE
    assert host.path("GPU0", "NIC3").kind is LinkKind.SYS
    gen4_x16 = link_defaults().pcie_GBps(4, 16)
    assert host.path("GPU1", "NIC1").bandwidth_GBps == pytest.approx(gen4_x16)
    topo = api.read_source(path)
    assert topo.world_size == 8
    c = topo.connection(0, 7)
    assert c.kind is LinkKind.NVSWITCH and c.channels == 12
    assert c.bandwidth_GBps == pytest.approx(12 * link_defaults().nvlink_per_link("sm80"))
    assert topo.domains(LinkKind.NVLINK) == [list(range(8))]


def test_azure_pci_only_tree(shared_data: Path) -> None:
    host = _parse(shared_data / "real/nccl-topo/azure-ndv5-h100-pci-only.xml")
    gpus = host.gpus
    assert len(gpus) == 8 and all(g.arch is None for g in gpus)  # no <gpu>: PCI class only
    assert [g.pci_bus_id for g in gpus[:4]] == ["0001:00:00.0", "0002:00:00.0", "0003:00:00.0", "0008:00:00.0"]
    assert len(host.nics) == 8
    assert {n.kind for n in host.nics} == {NicKind.IB} and {n.speed_Gbps for n in host.nics} == {None}
    # each GPU's nearest NIC is the one under its own bridge
    nearest = [host.nearest_nic(g.id).pci_bus_id for g in gpus]
    assert nearest == [f"01{i:02x}:00:00.0" for i in range(1, 9)]
    for g in gpus:
        assert host.path(g.id, host.nearest_nic(g.id).id).kind is LinkKind.PIX
    for a, b in combinations(gpus, 2):
        expect = LinkKind.NODE if a.numa_node == b.numa_node else LinkKind.SYS
        assert host.path(a.id, b.id).kind is expect
    gen5_x16 = link_defaults().pcie_GBps(5, 16)  # "32.0 GT/s PCIe" x16
    assert host.path("GPU0", "NIC0").bandwidth_GBps == pytest.approx(gen5_x16)
    assert api.read_source(shared_data / "real/nccl-topo/azure-ndv5-h100-pci-only.xml").connection(0, 4).kind is LinkKind.SYS


def test_gpu_to_gpu_nvlinks_and_mixed_nics() -> None:
    host = _parse(INPUTS / "nccl-4gpu-nvlink-mesh-ib-eth.xml")
    for a, b in combinations(range(4), 2):
        p = host.path(f"GPU{a}", f"GPU{b}")
        assert p.kind is LinkKind.NVLINK and p.nvlink_count == 4  # both ends list the bond once each
    ib, eth = host.nics
    assert (ib.name, ib.kind, ib.speed_Gbps) == ("mlx5_0", NicKind.IB, 200.0)
    assert (eth.name, eth.kind, eth.speed_Gbps) == ("eth0", NicKind.ETHERNET, 25.0)
    assert host.path("GPU0", "NIC0").kind is LinkKind.PIX
    # the NIC's Gen3 x8 link is the narrowest on the path
    assert host.path("GPU0", "NIC0").bandwidth_GBps == pytest.approx(link_defaults().pcie_GBps(3, 8))
    assert host.path("GPU2", "NIC0").kind is LinkKind.SYS
    assert host.path("GPU2", "NIC1").kind is LinkKind.NODE
    assert host.nearest_nic("GPU3").name == "mlx5_0"  # IB preferred over Ethernet, as NCCL does


def test_pci_only_tree_skips_bmc_graphics() -> None:
    host = _parse(INPUTS / "nccl-2gpu-pci-only-bmc-vga-eth.xml")
    assert [g.pci_bus_id for g in host.gpus] == ["0000:18:00.0", "0000:19:00.0"]
    assert host.path("GPU0", "GPU1").kind is LinkKind.PIX
    assert host.path("GPU0", "GPU1").bandwidth_GBps == pytest.approx(link_defaults().pcie_GBps(3, 16))
    (nic,) = host.nics
    assert nic.kind is NicKind.ETHERNET and nic.name == "0000:65:00.0"
    assert host.path("GPU0", "NIC0").kind is LinkKind.NODE


def _system(body: str) -> str:
    return f'<system version="1"><cpu numaid="0">{body}</cpu></system>'


def test_nvswitch_by_pci_class_and_one_sided_links() -> None:
    gpu = '<pci busid="{b}" class="0x030200"><gpu dev="{d}" sm="90">{links}</gpu></pci>'
    text = _system(
        '<pci busid="0000:c0:00.0" class="0x068000"/>'
        + gpu.format(b="0000:01:00.0", d=0, links='<nvlink target="c0:00.0" count="18"/><nvlink target="0000:02:00.0" count="2"/>')
        + gpu.format(b="0000:02:00.0", d=1, links='<nvlink target="0000:c0:00.0" count="18"/>')
        + gpu.format(b="0000:03:00.0", d=2, links='<nvlink target="0000:01:00.0" count="2" tclass="0x030200"/>')
    )
    host = parse_nccl_xml(text, source="<t>")
    p01 = host.path("GPU0", "GPU1")
    assert p01.kind is LinkKind.NVSWITCH and p01.nvlink_count == 18  # switch by the target's PCI class
    p02 = host.path("GPU0", "GPU2")
    assert p02.kind is LinkKind.NVLINK and p02.nvlink_count == 2  # listed by GPU2 only
    assert host.path("GPU1", "GPU2").kind is LinkKind.NODE
    assert host.hostname == "localhost"


def test_gpu_without_dev_takes_free_index_and_nics_under_cpu() -> None:
    text = _system(
        '<pci busid="0000:01:00.0" class="0x030200"><gpu sm="80"/></pci>'
        '<pci busid="0000:02:00.0" class="0x030200"><gpu dev="0" sm="80"/></pci>'
        '<nic><net name="ib0" speed="100000"/></nic>'
    )
    host = parse_nccl_xml(text, source="node7.xml")
    assert [(g.id, g.pci_bus_id) for g in host.gpus] == [("GPU0", "0000:02:00.0"), ("GPU1", "0000:01:00.0")]
    assert host.hostname == "node7"
    assert host.nics[0].kind is NicKind.IB and host.nics[0].speed_Gbps == 100.0
    assert host.path("GPU0", "NIC0").kind is LinkKind.PHB  # a NIC with no PCI place: through the CPU


def test_empty_system_gives_cpu_only_world() -> None:
    topo = api.parse_text('<system version="1"><cpu numaid="0"/><cpu numaid="1"/></system>')
    assert topo.world_size == 2 and topo.connection(0, 1).kind is LinkKind.SHM


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("<system><cpu", "not well-formed XML"),
        ("<topology/>", "root element is <topology>"),
        ('<!DOCTYPE x [<!ENTITY a "b">]><system/>', "DOCTYPE/ENTITY"),
        (_system('<pci class="0x030200"/>'), "has no busid"),
        (_system('<pci busid="1:0.0" class="0xzz"/>'), "class='0xzz' is not a hex integer"),
        (_system('<pci busid="01:00.0"><gpu dev="-1"/></pci>'), "negative"),
        (_system('<pci busid="01:00.0"><gpu dev="0"/></pci><pci busid="02:00.0"><gpu dev="0"/></pci>'), "two GPUs with dev=0"),
        (_system('<pci busid="01:00.0"><gpu dev="0"><nvlink count="2"/></gpu></pci>'), "<nvlink> has no target"),
        (_system('<nic><net name="x" speed="fast"/></nic>'), "speed='fast'"),
        ('<system><cpu numaid="0"/><cpu numaid="0"/></system>', "two <cpu> elements with numaid=0"),
        (_system('<nic><net name="x" speed="1' + "0" * 400 + '"/></nic>'), r"speed='1000.*\(401 characters\) is out of range"),
    ],
)
def test_bad_xml_names_the_place(text: str, match: str) -> None:
    with pytest.raises(TopologyError, match=match) as info:
        parse_nccl_xml(text, source="bad.xml")
    assert str(info.value).startswith("bad.xml")


def test_error_names_element_path() -> None:
    text = _system('<pci busid="01:00.0"><pci busid="02:00.0"><gpu dev="x"/></pci></pci>')
    with pytest.raises(TopologyError, match=r"^f\.xml: /system/cpu\[1\]/pci\[1\]/pci\[1\]/gpu\[1\]: <gpu> attribute dev='x'") as info:
        parse_nccl_xml(text, source="f.xml")
    assert info.value.where == "/system/cpu[1]/pci[1]/pci[1]/gpu[1]"


def test_deep_nesting_is_refused_at_the_depth_limit() -> None:
    def nested(depth: int) -> str:
        text = "<system><cpu numaid='0'>" + "".join(f"<pci busid='{i:04x}:00:00.0'>" for i in range(depth))
        return text + "<gpu dev='0'/>" + "</pci>" * depth + "</cpu></system>"

    # system, cpu, 61 pci and the gpu are 64 levels: the limit, accepted
    assert len(parse_nccl_xml(nested(61), source="<deep>").gpus) == 1
    # one more pci puts the gpu at level 65, element 65 in document order
    with pytest.raises(TopologyError, match=r"deeper than the limit of 64 \(at <gpu>, element 65\)"):
        parse_nccl_xml(nested(62), source="<deep>")
    # 5,000 deep (memory grew with depth squared): refused at the first element past the limit
    with pytest.raises(TopologyError, match=r"deeper than the limit of 64 \(at <pci>, element 65\)"):
        parse_nccl_xml(nested(5000), source="<deep>")


def test_device_and_element_counts_are_bounded() -> None:
    gpus = "".join(f"<gpu dev='{i}'/>" for i in range(257))
    with pytest.raises(TopologyError, match="lists 257 GPUs and NICs, more than the limit of 256 devices per host"):
        parse_nccl_xml(f"<system><cpu numaid='0'>{gpus}</cpu></system>", source="<many>")
    many = "<nic/>" * 100_000  # with system and cpu: 100,002 elements
    with pytest.raises(TopologyError, match="more than the limit of 100000 XML elements"):
        parse_nccl_xml(f"<system><cpu numaid='0'>{many}</cpu></system>", source="<many>")


def test_huge_attribute_number_is_refused_before_conversion() -> None:
    text = f"<system><cpu numaid='{'9' * 5000}'/></system>"
    with pytest.raises(TopologyError, match=r"<cpu> attribute numaid='9999.*\(5000 characters\) is out of range"):
        parse_nccl_xml(text, source="<digits>")
