"""Local discovery on the fixture sysfs trees, on this machine, and on damaged trees."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import types
from pathlib import Path

import pytest

from topomesh.errors import TopologyError
from topomesh.topology import discover, nvml
from topomesh.topology.build import build_topology, default_placement, single_host_topology
from topomesh.topology.discover import PciDevice, discover_host, pcie_path_kind
from topomesh.topology.model import DeviceKind, Host, LinkKind, NicKind

SYSFS = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"
DGX, PCIE, BRIDGE, CPU = "dgx-h100-8gpu-8ib", "pcie-4gpu-2numa", "nvlink-bridge-2gpu", "cpu-only"


def fixture(name: str) -> Path:
    return SYSFS / name


def copy_fixture(name: str, tmp_path: Path) -> Path:
    dest = tmp_path / name
    shutil.copytree(SYSFS / name, dest, symlinks=True)
    return dest


def kind_matrix(host: Host, ids: list[str]) -> list[list[str]]:
    """``nvidia-smi topo -m``-like rows: kind value (+ link count) or X on the diagonal."""
    rows = []
    for a in ids:
        row = []
        for b in ids:
            p = host.path(a, b)
            row.append("X" if a == b else "-" if p is None else f"{p.kind.value}{p.nvlink_count or ''}")
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- fixtures


def test_dgx_devices_nics_numa():
    host = discover_host(fixture(DGX))
    assert host.hostname == DGX
    gpus = host.gpus
    assert [g.id for g in gpus] == [f"GPU{i}" for i in range(8)]
    assert {g.arch for g in gpus} == {"sm90"}
    assert {g.name for g in gpus} == {"NVIDIA H100 80GB HBM3"}
    assert {g.memory_bytes for g in gpus} == {81559 * 2**20}
    assert [g.numa_node for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.pci_bus_id for g in gpus] == sorted(g.pci_bus_id for g in gpus)
    cpus = [d for d in host.devices if d.kind is DeviceKind.CPU]
    assert [(c.id, c.index, c.numa_node) for c in cpus] == [("CPU0", 0, 0), ("CPU1", 1, 1)]
    # 8 HCAs; their IPoIB netdevs, lo and docker0 are not NICs of their own
    assert [(n.id, n.name, n.kind, n.speed_Gbps) for n in host.nics] == [
        (f"NIC{i}", f"mlx5_{i}", NicKind.IB, 400.0) for i in range(8)
    ]
    assert [n.numa_node for n in host.nics] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_dgx_gpu_matrix_is_nvswitch_18_and_each_gpu_has_a_pix_nic():
    host = discover_host(fixture(DGX))
    gids = [g.id for g in host.gpus]
    expect = [["X" if i == j else "NVSwitch18" for j in range(8)] for i in range(8)]
    assert kind_matrix(host, gids) == expect
    for i, g in enumerate(gids):
        nic_kinds = [host.path(g, f"NIC{j}").kind for j in range(8)]
        same_socket = {j for j in range(8) if j // 4 == i // 4}
        assert nic_kinds == [
            LinkKind.PIX if j == i else LinkKind.NODE if j in same_socket else LinkKind.SYS for j in range(8)
        ]
        assert host.nearest_nic(g).id == f"NIC{i}"
        # Gen5 x16 everywhere on the path: 16 lanes x 3.938 GB/s
        assert host.path(g, f"NIC{i}").bandwidth_GBps == pytest.approx(63.008)


def test_dgx_without_nvml_falls_back_to_pcie_classes_and_id_table():
    host = discover_host(fixture(DGX), use_nvml=False)
    gids = [g.id for g in host.gpus]
    m = kind_matrix(host, gids)
    for i in range(8):
        for j in range(8):
            if i != j:
                assert m[i][j] == ("NODE" if i // 4 == j // 4 else "SYS")
    # name and arch from data/gpu_pci_ids.json (10de:2330), no memory without NVML
    assert {(g.name, g.arch, g.memory_bytes) for g in host.gpus} == {("H100", "sm90", None)}


def test_pcie_4gpu_matrix_nic_and_numa():
    host = discover_host(fixture(PCIE))
    assert host.hostname == PCIE
    assert [(g.id, g.numa_node, g.arch) for g in host.gpus] == [
        ("GPU0", 0, "sm80"),
        ("GPU1", 0, "sm80"),
        ("GPU2", 1, "sm80"),
        ("GPU3", 1, "sm80"),
    ]
    assert [(n.name, n.kind, n.speed_Gbps, n.numa_node) for n in host.nics] == [
        ("enp33s0f0np0", NicKind.ETHERNET, 100.0, 0)
    ]
    assert kind_matrix(host, ["GPU0", "GPU1", "GPU2", "GPU3", "NIC0"])[:4] == [
        ["X", "PIX", "SYS", "SYS", "NODE"],
        ["PIX", "X", "SYS", "SYS", "NODE"],
        ["SYS", "SYS", "X", "PXB", "SYS"],
        ["SYS", "SYS", "PXB", "X", "SYS"],
    ]
    assert host.path("GPU0", "GPU1").bandwidth_GBps == pytest.approx(31.504)  # Gen4 x16
    assert all(host.nearest_nic(g.id).id == "NIC0" for g in host.gpus)
    # CPU ranks: the NIC hangs off socket 0
    assert host.path("CPU0", "NIC0").kind is LinkKind.PHB
    assert host.path("CPU1", "NIC0").kind is LinkKind.SYS


def test_nvlink_bridge_pair():
    host = discover_host(fixture(BRIDGE))
    assert [(g.id, g.arch, g.name) for g in host.gpus] == [
        ("GPU0", "sm86", "NVIDIA RTX A6000"),
        ("GPU1", "sm86", "NVIDIA RTX A6000"),
    ]
    p = host.path("GPU0", "GPU1")
    assert (p.kind, p.nvlink_count) == (LinkKind.NVLINK, 4)
    assert [(n.name, n.kind, n.speed_Gbps) for n in host.nics] == [("enp34s0f0np0", NicKind.ETHERNET, 25.0)]
    assert host.path("GPU0", "NIC0").kind is LinkKind.PHB
    assert host.path("GPU0", "NIC0").bandwidth_GBps == pytest.approx(7.88)  # NIC at Gen3 x8
    # without NVML the two root ports of one root complex give PHB
    assert discover_host(fixture(BRIDGE), use_nvml=False).path("GPU0", "GPU1").kind is LinkKind.PHB


def test_cpu_only_fixture():
    host = discover_host(fixture(CPU))
    assert host.hostname == CPU
    assert host.gpus == ()  # the ASPEED BMC VGA is not a GPU
    assert [(d.id, d.kind, d.numa_node) for d in host.devices] == [("CPU0", DeviceKind.CPU, 0)]
    assert [(n.name, n.kind, n.speed_Gbps, n.pci_bus_id) for n in host.nics] == [
        ("eno1", NicKind.ETHERNET, 10.0, "0000:18:00.0")
    ]
    assert host.nearest_nic("CPU0").name == "eno1"


def test_fixtures_are_what_the_generator_makes(tmp_path):
    """The checked-in trees equal a fresh run of make_fixtures.py (files, contents, links)."""
    sys.path.insert(0, str(SYSFS))
    try:
        import make_fixtures
    finally:
        sys.path.remove(str(SYSFS))
    for name in make_fixtures.NAMES:
        fresh = make_fixtures.build(name, tmp_path)
        assert _tree(fresh) == _tree(SYSFS / name), name


def _tree(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_file():
                out[rel] = p.read_text()
    return out


# --------------------------------------------------------------------------- root, env, names


def test_env_var_selects_root_and_hostname_override(monkeypatch):
    monkeypatch.setenv(discover.ENV_SYSFS_ROOT, str(fixture(PCIE)))
    assert len(discover_host().gpus) == 4
    assert discover_host(hostname="node-a").hostname == "node-a"


def test_missing_root_raises_naming_it(tmp_path, monkeypatch):
    missing = tmp_path / "nope"
    with pytest.raises(TopologyError, match="nope.*does not exist"):
        discover_host(missing)
    monkeypatch.setenv(discover.ENV_SYSFS_ROOT, str(missing))
    with pytest.raises(TopologyError, match=r"nope.*TOPOMESH_SYSFS_ROOT"):
        discover_host()
    (tmp_path / "file").write_text("x")
    with pytest.raises(TopologyError, match="not a directory"):
        discover_host(tmp_path / "file")
    with pytest.raises(TopologyError, match="no sys/ directory"):
        discover_host(tmp_path)


def _plain_sysfs_facts() -> tuple[int, list[int], set[str]]:
    """What /sys says, read here with plain file reads (not through discover): NVIDIA display
    functions (vendor 0x10de, class 0x0300xx 3D/VGA or 0x0302xx), NUMA nodes with CPUs, and
    netdevs other than lo that have a device link and are not down or IPoIB (type 32)."""
    def read(p: Path) -> str:
        try:
            return p.read_text().strip()
        except OSError:
            return ""

    gpus = sum(1 for d in Path("/sys/bus/pci/devices").glob("*")
               if read(d / "vendor") == "0x10de" and read(d / "class")[:6] in ("0x0300", "0x0302"))
    nodes = sorted(int(d.name[4:]) for d in Path("/sys/devices/system/node").glob("node[0-9]*") if read(d / "cpulist"))
    eth = {d.name for d in Path("/sys/class/net").glob("*") if d.name != "lo" and os.path.lexists(d / "device")
           and read(d / "operstate").lower() != "down" and read(d / "type") != "32"}
    return gpus, nodes, eth


def test_real_machine_gives_its_cpu_host():
    """This machine against /sys read by hand: as many GPUs as NVIDIA display functions, one
    CPU device per NUMA node with CPUs, its physical up netdevs, and never an exception."""
    host = discover_host("/", use_nvml=False)
    gpus, nodes, eth = _plain_sysfs_facts()
    assert len(host.gpus) == gpus
    cpus = [d for d in host.devices if d.kind is DeviceKind.CPU]
    assert [c.id for c in cpus] == [f"CPU{n}" for n in (nodes or [0])]
    found = {n.name for n in host.nics if n.kind is NicKind.ETHERNET}
    if os.listdir("/sys/class/infiniband") if os.path.isdir("/sys/class/infiniband") else []:
        assert found <= eth  # RDMA NICs' own netdevs are listed once, as RDMA devices
    else:
        assert found == eth
    if not os.path.exists("/hostname"):
        assert host.hostname == socket.gethostname()
    assert Host.from_dict(host.to_dict()) == host
    if not host.gpus:
        assert single_host_topology(host).world_size == len(cpus)


# --------------------------------------------------------------------------- damaged trees


def test_missing_attributes_give_a_smaller_host(tmp_path):
    root = copy_fixture(PCIE, tmp_path)
    gpu3 = root / "sys/bus/pci/devices/0000:86:00.0"
    (gpu3 / "class").unlink()  # GPU3 no longer identifiable
    (root / "sys/bus/pci/devices/0000:03:00.0/current_link_speed").unlink()
    (root / "sys/bus/pci/devices/0000:83:00.0/numa_node").unlink()
    shutil.rmtree(root / "sys/devices/system/node")
    (root / "hostname").unlink()
    host = discover_host(root, use_nvml=False)
    assert [g.pci_bus_id for g in host.gpus] == ["0000:03:00.0", "0000:04:00.0", "0000:83:00.0"]
    assert host.hostname  # falls back to this machine's name
    assert [d.id for d in host.devices if d.kind is DeviceKind.CPU] == ["CPU0"]
    # GPU0's own link speed is gone: the path's bottleneck comes from the rest of the path
    assert host.path("GPU0", "GPU1").bandwidth_GBps == pytest.approx(31.504)


def test_garbage_values_and_unreadable_files(tmp_path):
    root = copy_fixture(DGX, tmp_path)
    dev = root / "sys/bus/pci/devices"
    (dev / "0000:18:00.0/numa_node").write_text("banana\n")
    (dev / "0000:41:00.0/current_link_width").write_bytes(b"\xff\xfe\x00")
    (dev / "0000:50:00.0/vendor").unlink()
    (dev / "0000:50:00.0/vendor").mkdir()  # an attribute that is a directory
    (dev / "0000:5f:00.0/class").unlink()
    os.mkfifo(dev / "0000:5f:00.0/class")  # would block a naive open()
    ib = root / "sys/class/infiniband"
    (ib / "mlx5_1/ports/1/rate").write_text("fast\n")
    (ib / "mlx5_2/ports/1/state").write_text("1: DOWN\n")
    (root / "sys/devices/system/node/node1/cpulist").write_text("x-y,,7\n")
    sysfs_only = discover_host(root, use_nvml=False)
    assert [g.pci_bus_id for g in sysfs_only.gpus] == [
        "0000:18:00.0",
        "0000:41:00.0",
        "0000:9a:00.0",
        "0000:c0:00.0",
        "0000:ce:00.0",
        "0000:dc:00.0",
    ]
    host = discover_host(root)
    # NVML still knows all 8; the two that sysfs cannot identify keep their NVSwitch links
    # and, as their place in the PCI tree is still known, their PIX NIC
    assert len(host.gpus) == 8
    assert host.path("GPU2", "GPU3").kind is LinkKind.NVSWITCH
    mlx5_3 = next(n.id for n in host.nics if n.name == "mlx5_3")
    assert host.path("GPU3", mlx5_3).kind is LinkKind.PIX
    assert host.gpus[2].arch == "sm90"
    assert host.gpus[0].numa_node is None  # garbage numa_node on a 2-node host: unknown
    nics = {n.name: n for n in host.nics}
    assert nics["mlx5_1"].speed_Gbps is None
    assert "mlx5_2" not in nics  # its only port is down
    assert [d.id for d in host.devices if d.kind is DeviceKind.CPU] == ["CPU0", "CPU1"]
    assert host.path("GPU0", "GPU1").kind is LinkKind.NVSWITCH


def test_dangling_and_odd_symlinks(tmp_path):
    root = copy_fixture(PCIE, tmp_path)
    dev = root / "sys/bus/pci/devices"
    (dev / "0000:04:00.0").unlink()
    (dev / "0000:04:00.0").symlink_to("../../../devices/pci0000:00/gone/0000:04:00.0")
    (dev / "not-a-bus-id").symlink_to("nowhere")
    (dev / "0000:99:00.0").symlink_to("0000:99:00.0")  # a loop
    net = root / "sys/class/net"
    (net / "eth9").symlink_to("../../devices/pci0000:00/missing/net/eth9")
    nic_dir = Path(os.path.realpath(net / "enp33s0f0np0"))
    (nic_dir / "device").unlink()
    (nic_dir / "device").symlink_to("../../../does-not-exist")
    host = discover_host(root, use_nvml=False)
    assert [g.pci_bus_id for g in host.gpus] == ["0000:03:00.0", "0000:83:00.0", "0000:86:00.0"]
    assert [(n.name, n.pci_bus_id) for n in host.nics] == [("enp33s0f0np0", None)]
    assert host.path("GPU0", "NIC0") is None  # nothing known about where the NIC sits


# --------------------------------------------------------------------------- NVML


def test_nvml_absent_never_crashes(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert nvml.read_nvml() is None
    host = discover_host("/", use_nvml=True)
    assert all(d.kind is DeviceKind.CPU for d in host.devices) or host.gpus
    # without NVML the GPUs are sysfs's NVIDIA display functions, in bus order, and no
    # pair is NVLink (only NVML knows NVLink)
    sysfs_gpus = sorted((p.bus_id for p in discover.read_pci("/").values() if p.is_nvidia_gpu), key=discover._bus_key)
    assert [g.pci_bus_id for g in host.gpus] == sysfs_gpus
    assert not any(p.kind.is_nvlink for p in host.paths)
    assert [d.index for d in host.devices if d.kind is DeviceKind.CPU] == (sorted(discover.read_numa_nodes("/")) or [0])


def test_nvml_library_missing_gives_none_and_sysfs_gpus(monkeypatch, tmp_path):
    """The real nvidia-ml-py with libnvidia-ml.so.1 failing to load (as on any machine
    without the driver): read_nvml says None, and discovery keeps sysfs's GPUs, no NVLink."""
    pynvml = pytest.importorskip("pynvml")

    def no_library(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(pynvml, "nvmlLib", None)
    monkeypatch.setattr(pynvml, "CDLL", no_library)
    with pytest.raises(pynvml.NVMLError, match="NVML Shared Library Not Found"):
        pynvml.nvmlInit()  # what read_nvml must absorb
    assert nvml.read_nvml() is None
    root = copy_fixture(PCIE, tmp_path)
    (root / "nvml.json").unlink(missing_ok=True)  # use_nvml=True then asks the real library
    host = discover_host(root, use_nvml=True)
    assert [g.pci_bus_id for g in host.gpus] == ["0000:03:00.0", "0000:04:00.0", "0000:83:00.0", "0000:86:00.0"]
    assert not any(p.kind.is_nvlink for p in host.paths)


def test_nvml_failing_mid_read_gives_none_and_shuts_down(monkeypatch):
    fake = _fake_pynvml({"0000:18:00.0": []})
    calls = []
    fake.nvmlShutdown = lambda: calls.append("shutdown")

    def count():
        raise fake.NVMLError("GPU is lost")

    fake.nvmlDeviceGetCount = count
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert nvml.read_nvml() is None
    assert calls == ["shutdown"]


def _fake_pynvml(gpus: dict[str, list[tuple[int, str | None]]], *, fail_init: bool = False) -> types.ModuleType:
    """A stand-in for pynvml: ``gpus`` maps bus id -> per link (remote type, remote bus id)."""
    mod = types.ModuleType("pynvml")
    buses = list(gpus)

    class NVMLError(Exception):
        pass

    def init() -> None:
        if fail_init:
            raise NVMLError("Driver Not Loaded")

    def remote(handle: int, link: int) -> tuple[int, str | None]:
        links = gpus[buses[handle]]
        if link >= len(links):
            raise NVMLError("Invalid Argument")
        return links[link]

    mod.NVMLError = NVMLError
    mod.NVML_FEATURE_ENABLED = 1
    mod.NVML_NVLINK_MAX_LINKS = 18
    mod.NVML_NVLINK_DEVICE_TYPE_SWITCH = 2
    mod.nvmlInit = init
    mod.nvmlShutdown = lambda: None
    mod.nvmlDeviceGetCount = lambda: len(buses)
    mod.nvmlDeviceGetHandleByIndex = lambda i: i
    mod.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=("0000" + buses[h].upper()).encode())
    mod.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    mod.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)

    def memory(h: int) -> types.SimpleNamespace:
        raise NVMLError("Not Supported")

    mod.nvmlDeviceGetMemoryInfo = memory
    mod.nvmlDeviceGetNvLinkState = lambda h, link: (remote(h, link), 1)[1]
    mod.nvmlDeviceGetNvLinkRemotePciInfo = lambda h, link: types.SimpleNamespace(
        busId=("0000" + (remote(h, link)[1] or "ffff:ff:ff.0")).encode()
    )
    mod.nvmlDeviceGetNvLinkRemoteDeviceType = lambda h, link: remote(h, link)[0]
    return mod


def test_real_nvml_backend_reads_links(monkeypatch):
    """The pynvml code path, against a stand-in module: switch links and direct bonds."""
    a, b, c = "0000:18:00.0", "0000:41:00.0", "0000:50:00.0"
    fake = _fake_pynvml({a: [(2, None)] * 18, b: [(2, None)] * 18, c: [(0, a)] * 2})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    got = nvml.read_nvml()
    assert got is not None
    assert got[a].links_to(nvml.NVSWITCH) == 18
    assert got[c].links_to(a) == 2
    assert (got[a].name, got[a].arch, got[a].memory_bytes) == ("NVIDIA H100 80GB HBM3", "sm90", None)
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml({a: []}, fail_init=True))
    assert nvml.read_nvml() is None


def test_fake_nvml_file_switches_a_pcie_fixture_to_nvswitch(tmp_path):
    root = copy_fixture(PCIE, tmp_path)
    doc = {"gpus": {b: {"nvlinks": [{"remote": "nvswitch", "count": 12}]} for b in ("0000:03:00.0", "0000:04:00.0")}}
    (root / "nvml.json").write_text(json.dumps(doc))
    host = discover_host(root)
    p = host.path("GPU0", "GPU1")
    assert (p.kind, p.nvlink_count) == (LinkKind.NVSWITCH, 12)
    assert host.path("GPU2", "GPU3").kind is LinkKind.PXB  # not in nvml.json: PCIe class
    assert host.gpus[0].arch == "sm80"  # nvml.json without arch: the id table fills it


@pytest.mark.parametrize(
    "text, match",
    [
        ("{", "not valid JSON"),
        ('{"gpus": []}', '"gpus" object'),
        ('{"gpus": {"GPU0": {}}}', "not a PCI bus id"),
        ('{"gpus": {"0000:01:00.0": {"nvlinks": [{"remote": "x", "count": 1}]}}}', "remote must be"),
        ('{"gpus": {"0000:01:00.0": {"nvlinks": [{"remote": "nvswitch", "count": 0}]}}}', "count must be"),
        ('{"gpus": {"0000:01:00.0": {"memory_bytes": "80G"}}}', "memory_bytes must be"),
    ],
)
def test_malformed_fake_nvml_is_a_topology_error(tmp_path, text, match):
    root = copy_fixture(CPU, tmp_path)
    (root / "nvml.json").write_text(text)
    with pytest.raises(TopologyError, match=match) as err:
        discover_host(root)
    assert "nvml.json" in str(err.value)


# --------------------------------------------------------------------------- pure functions


def _dev(bus: str, chain: tuple[str, ...], hb: str = "pci0000:00", numa: int | None = 0) -> PciDevice:
    return PciDevice(bus_id=bus, host_bridge=hb, chain=chain, numa_node=numa)


def test_pcie_path_kind_rules():
    rp, up, d1, d2, d3, up2, d4 = "0:1", "1:0", "2:0", "2:1", "2:2", "5:0", "6:0"
    gpu = _dev("a", (rp, up, d1))
    nic = _dev("b", (rp, up, d2))
    deep = _dev("c", (rp, up, d3, up2, d4))
    other_rp = _dev("d", ("0:3",))
    same_fn = _dev("e", (rp, up, d1))
    assert pcie_path_kind(gpu, nic, single_numa=False) is LinkKind.PIX
    assert pcie_path_kind(gpu, same_fn, single_numa=False) is LinkKind.PIX
    assert pcie_path_kind(gpu, deep, single_numa=False) is LinkKind.PXB
    assert pcie_path_kind(gpu, other_rp, single_numa=False) is LinkKind.PHB
    far = _dev("f", (rp,), hb="pci0000:80", numa=1)
    near = _dev("g", (rp,), hb="pci0000:20", numa=0)
    assert pcie_path_kind(gpu, far, single_numa=False) is LinkKind.SYS
    assert pcie_path_kind(gpu, near, single_numa=False) is LinkKind.NODE
    unknown = _dev("h", (rp,), hb="pci0000:20", numa=None)
    assert pcie_path_kind(gpu, unknown, single_numa=False) is LinkKind.SYS
    assert pcie_path_kind(gpu, unknown, single_numa=True) is LinkKind.NODE


def test_parsers():
    assert discover.parse_cpulist("0-55,112-167")[-1] == 167
    assert len(discover.parse_cpulist("0-55,112-167")) == 112
    assert discover.ib_rate_Gbps("100 Gb/sec (2X HDR)") == 100.0
    assert discover.ib_rate_Gbps("0 Gb/sec") is None
    assert discover.pcie_gen("2.5 GT/s PCIe") == 1
    assert nvml.normalize_bus_id("00000000:1B:00.0") == "0000:1b:00.0"


# --------------------------------------------------------------------------- build on top


def test_single_host_topologies_of_the_fixtures():
    dgx = single_host_topology(discover_host(fixture(DGX)))
    c = dgx.connection(0, 7)
    assert (c.kind, c.channels) == (LinkKind.NVSWITCH, 18)
    assert c.bandwidth_GBps == pytest.approx(18 * 20.6)  # NCCL SM90_NVLINK_BW per link
    assert dgx.domains(LinkKind.NVLINK) == [list(range(8))]

    pcie = single_host_topology(discover_host(fixture(PCIE)))
    assert pcie.connection(0, 1).kind is LinkKind.PIX
    assert pcie.connection(0, 1).bandwidth_GBps == pytest.approx(31.504)
    assert pcie.connection(2, 3).kind is LinkKind.PXB
    assert pcie.connection(1, 2).kind is LinkKind.SYS
    assert pcie.connection(1, 2).bandwidth_GBps == pytest.approx(10.0)  # capped by the socket link
    assert pcie.domains(LinkKind.PXB) == [[0, 1], [2, 3]]

    pair = single_host_topology(discover_host(fixture(BRIDGE)))
    c = pair.connection(0, 1)
    assert (c.kind, c.channels, c.bandwidth_GBps) == (LinkKind.NVLINK, 4, pytest.approx(4 * 12.0))

    cpu = single_host_topology(discover_host(fixture(CPU)))
    assert cpu.world_size == 1


def test_two_fixture_hosts_in_one_world():
    hosts = [discover_host(fixture(DGX)), discover_host(fixture(DGX), hostname="dgx-b"), discover_host(fixture(PCIE))]
    topo = build_topology(hosts, default_placement(hosts, [8, 8, 4]))
    ib = topo.connection(0, 8)
    assert (ib.kind, ib.bandwidth_GBps) == (LinkKind.IB, pytest.approx(50.0))  # 400 Gb/s
    eth = topo.connection(0, 16)
    assert (eth.kind, eth.bandwidth_GBps) == (LinkKind.NIC, pytest.approx(12.5))  # 100 GbE end
    assert topo.connection(0, 1).kind is LinkKind.NVSWITCH


def test_roce_netdev_is_not_listed_twice(tmp_path):
    """An RDMA device in Ethernet mode (RoCE) and its netdev are one NIC, of kind IB."""
    root = copy_fixture(BRIDGE, tmp_path)
    fn = Path(os.path.realpath(root / "sys/bus/pci/devices/0000:22:00.0"))
    ib = fn / "infiniband" / "mlx5_0"
    (ib / "ports/1").mkdir(parents=True)
    (ib / "ports/1/rate").write_text("25 Gb/sec (1X EDR)\n")
    (ib / "ports/1/state").write_text("4: ACTIVE\n")
    (ib / "ports/1/link_layer").write_text("Ethernet\n")
    (ib / "device").symlink_to("../..")
    (root / "sys/class/infiniband").mkdir(parents=True)
    (root / "sys/class/infiniband/mlx5_0").symlink_to(os.path.relpath(ib, root / "sys/class/infiniband"))
    host = discover_host(root)
    assert [(n.name, n.kind, n.speed_Gbps, n.pci_bus_id) for n in host.nics] == [
        ("mlx5_0", NicKind.IB, 25.0, "0000:22:00.0")
    ]


_GARBAGE = ("", "-1", "0x", "nan", "1e400", "99999999999999999999999", "\x00\x01", "4: ACTIVE", "32.0 GT/s")


@pytest.mark.parametrize("name", [DGX, PCIE, BRIDGE, CPU])
def test_mutated_trees_give_a_host_or_a_topology_error(tmp_path, name):
    """Seeded damage to a third of a tree's files (garbage text, random bytes, deletion,
    a directory or a dangling link instead of a file): discovery still returns a host, or a
    TopologyError when the damage hit nvml.json; the host still builds a topology."""
    import random

    for seed in range(4):
        rng = random.Random(seed)
        root = copy_fixture(name, tmp_path / str(seed))
        files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
        nvml_hit = False
        for p in rng.sample(files, len(files) // 3):
            nvml_hit |= p.name == "nvml.json"
            op = rng.randrange(5)
            if op == 0:
                p.write_text(rng.choice(_GARBAGE))
            elif op == 1:
                p.write_bytes(rng.randbytes(rng.randrange(1, 64)))
            else:
                p.unlink()
                if op == 3:
                    p.mkdir()
                elif op == 4:
                    p.symlink_to("missing-target")
        try:
            host = discover_host(root)
        except TopologyError:
            assert nvml_hit, f"seed {seed}: TopologyError without damage to nvml.json"
            host = discover_host(root, use_nvml=False)
        topo = single_host_topology(host)
        assert topo.world_size >= 1


def test_allowed_cpus_are_the_affinity_sorted_or_every_cpu_without_it(monkeypatch):
    import os

    from topomesh.topology import discover

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {8, 1, 2}, raising=False)
    assert discover.allowed_cpus() == [1, 2, 8]  # a set iterates 8 first
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert discover.allowed_cpus() == [0, 1, 2]
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # unknown: one
    assert discover.allowed_cpus() == [0]
