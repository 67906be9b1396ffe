"""Private directories, the probe, local placement, hook checks and the parser."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import socketserver
import stat
from pathlib import Path

import pytest

from tests.launch.conftest import SYSFS
from topomesh.errors import LaunchError, TopologyError
from topomesh.launch import files, local, localprobe, probe
from topomesh.launch.exchange import digest
from topomesh.topology.build import build_topology, default_placement
from topomesh.topology.discover import discover_host
from topomesh.topology.model import LinkKind, RankInfo, Topology


@pytest.mark.parametrize(
    ("run_id", "kept"),
    [
        ("..", "_."), ("../x", "_._x"), ("a/b", "a_b"), ("a\\b", "a_b"), (".hidden", "_hidden"), ("", ""),
        ("x\0y", "x_y"), ("r" * 201, "r" * 48), ("r" * 65, "r" * 48), ("job 1", "job_1"),
    ],
)
def test_every_run_id_torchrun_accepts_gets_a_directory_inside_the_base(run_id: str, kept: str, tmp_path: Path) -> None:
    """Path-like, hidden and long ids are hashed, not refused (torchrun accepts them)."""
    name = files.safe_run_id(run_id)
    assert name == f"{kept}-{hashlib.sha256(run_id.encode()).hexdigest()[:16]}"
    d = files.run_directory(run_id, tmp_path / "base")
    assert d.parent == tmp_path / "base" and d.name == name


def test_plain_run_ids_are_kept_as_they_are() -> None:
    for run_id in ("job-42", "a.b_c", "r" * 64, "0"):
        assert files.safe_run_id(run_id) == run_id


def test_run_ids_are_made_safe_and_stay_distinct() -> None:
    assert files.safe_run_id("job-1.a_b") == "job-1.a_b"
    assert files.safe_run_id("job 1") != files.safe_run_id("job*1")
    assert all(c.isalnum() or c in "._-" for c in files.safe_run_id("ü:*? x"))


def test_run_directory_is_private_and_files_atomic(tmp_path: Path) -> None:
    d = files.run_directory("job", tmp_path / "base")
    assert d == tmp_path / "base" / "job"
    for p in (d, d.parent):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700
    f = files.write_topology_file(d, "{}", restart_count=3)
    assert f.name == f"topology-r3-{digest('{}')}.json"
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert [p.name for p in d.iterdir()] == [f.name]  # no temp file left


def test_default_directory_under_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    d = files.run_directory("abc")
    assert d == tmp_path / f"topomesh-{os.getuid()}" / "abc"


def test_open_or_linked_directories_are_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    with pytest.raises(LaunchError, match="mode 0755"):
        files.run_directory("job", open_dir)
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    base = tmp_path / "base"
    base.mkdir(mode=0o700)
    (base / "job").symlink_to(target)
    with pytest.raises(LaunchError, match="symlink"):
        files.run_directory("job", base)


def test_probe_measures_loopback() -> None:
    with probe.ProbeServer("127.0.0.1") as server:
        got = probe.measure(server.address, budget_s=1.0)
    assert 0 < got.latency_us < 100_000  # sanity bounds: CI machines may be loaded
    assert got.bandwidth_GBps > 0.001
    assert not socketserver.ThreadingTCPServer.allow_reuse_address  # no process-wide side effect


def test_probe_failure_is_a_launch_error() -> None:
    with probe.ProbeServer("127.0.0.1") as server:
        addr = server.address
    with pytest.raises(LaunchError, match=f"probe of {addr} failed"):
        probe.measure(addr, budget_s=0.5)


def _measured_pairs(topo: Topology) -> list[tuple[int, int]]:
    n = topo.world_size
    return [(a, b) for a in range(n) for b in range(a + 1, n) if topo.connection(a, b).measured]


def test_measured_hosts_keep_kind_per_rail() -> None:
    dgx = discover_host(SYSFS / "dgx-h100-8gpu-8ib")
    pcie = discover_host(SYSFS / "pcie-4gpu-2numa")
    ranks = default_placement([dgx, pcie], [2, 1])
    topo = build_topology([dgx, pcie], ranks, measured_hosts={(0, 1): (20.0, 3.0)})
    assert _measured_pairs(topo) == [(0, 2), (1, 2)]
    got = [topo.connection(a, b) for a, b in [(0, 2), (2, 1)]]
    assert {c.kind.value for c in got} == {"NIC"}  # IB to Ethernet is Ethernet
    assert all(c.measured and c.latency_us == 20.0 and c.bandwidth_GBps == 3.0 for c in got)
    with pytest.raises(TopologyError, match="not two of the 2 hosts"):
        build_topology([dgx, pcie], ranks, measured_hosts={(0, 0): (20.0, 3.0)})


def test_measured_devices_apply_to_one_node_and_keep_the_path_kind() -> None:
    dgx = discover_host(SYSFS / "dgx-h100-8gpu-8ib")
    pcie = discover_host(SYSFS / "pcie-4gpu-2numa")
    ranks = default_placement([dgx, pcie], [3, 2])
    before = build_topology([dgx, pcie], ranks)
    rows = {0: [("GPU1", "GPU0", 9.0, 300.0)], 1: [("GPU0", "GPU1", 7.0, 20.0)]}
    topo = build_topology([dgx, pcie], ranks, measured_devices=rows)
    assert _measured_pairs(topo) == [(0, 1), (3, 4)]  # GPU0-GPU1 on each node; GPU2 pairs keep defaults
    for a, b in [(0, 1), (3, 4)]:
        c, default = topo.connection(b, a), before.connection(a, b)
        assert c.measured and (c.kind, c.channels) == (default.kind, default.channels)
    assert (topo.connection(0, 1).kind.value, topo.connection(0, 1).bandwidth_GBps) == ("NVSwitch", 300.0)
    assert (topo.connection(3, 4).latency_us, topo.connection(3, 4).bandwidth_GBps) == (7.0, 20.0)
    # the table stores one row per measurement, not per rank pair
    assert topo.table.measured_local == {0: {(0, 1): (9.0, 300.0)}, 1: {(0, 1): (7.0, 20.0)}}
    with pytest.raises(TopologyError, match="bandwidth must be a finite number"):
        build_topology([dgx, pcie], ranks, measured_devices={0: [("GPU0", "GPU1", 1.0, float("nan"))]})


def test_local_probe_measures_shm_and_refuses_what_it_cannot_map(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = discover_host(SYSFS / "cpu-only")
    (shm,) = localprobe.measure_local(cpu, ["CPU0", "CPU0"], budget_s=0.5)
    assert (shm.device_a, shm.device_b) == ("CPU0", "CPU0") and shm.latency_us > 0 and shm.bandwidth_GBps > 0
    assert localprobe.measure_local(cpu, ["CPU0"], budget_s=0.5) == []  # one worker: nothing to measure
    dgx = discover_host(SYSFS / "dgx-h100-8gpu-8ib")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    with pytest.raises(LaunchError, match="CUDA_VISIBLE_DEVICES is set"):
        localprobe.measure_local(dgx, ["GPU0", "GPU1"], budget_s=0.5)
    with pytest.raises(LaunchError, match="impossible row"):
        localprobe.parse_rows(b'[["GPU0", "GPU1", 0, 5]]', {"GPU0", "GPU1"})
    with pytest.raises(LaunchError, match="impossible row"):
        localprobe.parse_rows(b'[["GPU0", "GPU7", 1, 5]]', {"GPU0", "GPU1"})
    with pytest.raises(LaunchError, match="unreadable"):
        localprobe.parse_rows(b"nope", {"GPU0"})


def test_local_gpu_child_times_copies_and_prints_rows() -> None:
    """The child's timing loop, run on CPU tensors (``device_type``): what the agent parses."""
    import json
    import subprocess
    import sys

    request = {"pairs": [["GPU0", "GPU1", 0, 0]], "bytes": 1 << 20, "budget_s": 0.5, "device_type": "cpu"}
    done = subprocess.run([sys.executable, "-m", "topomesh.launch.localprobe", json.dumps(request)],
                          capture_output=True, timeout=120, check=True)
    (row,) = localprobe.parse_rows(done.stdout, {"GPU0", "GPU1"})
    assert (row.device_a, row.device_b) == ("GPU0", "GPU1") and row.latency_us > 0 and row.bandwidth_GBps > 0
    assert localprobe.main([]) == 2


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA failure path")
def test_local_gpu_probe_without_cuda_fails_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    dgx = discover_host(SYSFS / "dgx-h100-8gpu-8ib")
    with pytest.raises(LaunchError, match="the local GPU probe failed"):
        localprobe.measure_local(dgx, ["GPU0", "GPU1"], budget_s=0.5)


def test_local_devices_follow_cuda_visible_devices() -> None:
    dgx = discover_host(SYSFS / "dgx-h100-8gpu-8ib")
    assert local.local_devices(dgx, 3) == ["GPU0", "GPU1", "GPU2"]
    assert local.local_devices(dgx, 2, visible="6,7") == ["GPU6", "GPU7"]
    assert local.local_devices(dgx, 2, visible="GPU-uuid-a,GPU-uuid-b") == ["GPU0", "GPU1"]
    cpu = discover_host(SYSFS / "cpu-only")
    assert local.local_devices(cpu, 1) == ["CPU0"]
    assert local.local_devices(cpu, 2) == ["CPU0", "CPU0"]
    # two processes on one socket are SHM apart, not LOC
    topo = build_topology([cpu], [RankInfo(rank=i, host=0, local_rank=i, device="CPU0") for i in range(2)])
    assert topo.connection(0, 1).kind is LinkKind.SHM


def test_discovery_failure_falls_back_to_cpu_only(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    monkeypatch.setenv("TOPOMESH_SYSFS_ROOT", str(tmp_path / "missing"))
    import topomesh.topology.discover as discover

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("sysfs unreadable")

    monkeypatch.setattr(discover, "discover_host", broken)
    with caplog.at_level(logging.WARNING, logger="topomesh.launch"):
        host = local.discover_local_host()
    assert [d.id for d in host.devices] == ["CPU0"] and not host.nics
    assert "host discovery failed (OSError: sysfs unreadable)" in caplog.text


def test_missing_torchrun_hook_names_the_torch_version(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from topomesh.launch import agent

    agent.check_hooks()  # present on the installed torch
    monkeypatch.delattr(LocalElasticAgent, "_set_local_rank_env")
    with pytest.raises(LaunchError, match=re.escape(f"torch {torch.__version__} lacks") + ".*_set_local_rank_env"):
        agent.check_hooks()


def test_parser_is_torchruns_plus_topology_options() -> None:
    from torch.distributed.run import get_args_parser

    from topomesh.launch.cli import build_parser, options_from_args

    ours = {s for a in build_parser()._actions for s in a.option_strings}
    theirs = {s for a in get_args_parser()._actions for s in a.option_strings}
    assert theirs <= ours
    assert ours - theirs == {
        "--topology", "--topology-probe", "--topology-dir", "--topology-form",
        "--topology-timeout", "--topology-probe-budget", "--socket-ifname", "--plan",
    }
    args = build_parser().parse_args(["--nnodes=1:4", "--topology-form=compact", "--topology-probe", "train.py", "--lr", "1"])
    assert args.nnodes == "1:4" and args.training_script == "train.py" and args.training_script_args == ["--lr", "1"]
    opts = options_from_args(args)
    assert opts.probe and opts.form.value == "compact" and opts.mode.value == "auto"
    with pytest.raises(LaunchError, match="neither 'auto', 'off' nor an existing file"):
        options_from_args(build_parser().parse_args(["--topology=/no/such/file", "x.py"]))


def test_topology_path_is_checked_before_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from topomesh.launch.agent import TopologyMode, TopologyOptions
    from topomesh.launch.cli import build_parser, options_from_args
    from topomesh.topology.api import save_topology
    from topomesh.topology.build import single_host_topology

    save_topology(single_host_topology(discover_host(SYSFS / "dgx-h100-8gpu-8ib"), 2), tmp_path / "given.json")
    (tmp_path / "bad.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    opts = options_from_args(build_parser().parse_args(["--topology=given.json", "x.py"]))
    assert opts.mode is TopologyMode.FILE and opts.path == str(tmp_path / "given.json")  # absolute
    with pytest.raises(TopologyError, match="^bad.json: "):
        options_from_args(build_parser().parse_args(["--topology=bad.json", "x.py"]))
    with pytest.raises(LaunchError, match="exactly when the topology mode is 'file'"):
        TopologyOptions(path=opts.path)
    with pytest.raises(LaunchError, match="must be positive, got 0 s"):
        TopologyOptions(timeout_s=0)


@pytest.mark.parametrize(
    "argv",
    [
        ["--t=3", "x.py"], ["--te", "2", "x.py"], ["--max-r=2", "x.py"], ["--rdzv-e=h:1", "x.py"], ["--stand", "x.py"],
        ["--nn=2", "x.py"], ["--no-p", "x.py"],
        ["--nproc=2", "x.py"], ["--r=3", "x.py"], ["--mon=0.5", "x.py"],  # ambiguous for torchrun too
    ],
)
def test_torchrun_abbreviations_mean_what_they_mean_to_torchrun(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Our --topology* options must not make torchrun's prefixes ambiguous (--t is --tee)."""
    from torch.distributed.run import get_args_parser

    from topomesh.launch.cli import build_parser

    def parse(parser) -> dict | int:
        try:
            return vars(parser.parse_args(argv))
        except SystemExit as exc:
            return int(exc.code)

    theirs, ours = parse(get_args_parser()), parse(build_parser())
    if isinstance(theirs, int):
        assert ours == theirs == 2
        assert "ambiguous option" in capsys.readouterr().err
    else:
        assert isinstance(ours, dict)
        assert {k: v for k, v in ours.items() if not k.startswith("topology") and k not in ("socket_ifname", "plan")} == theirs


def test_topology_options_match_only_by_full_name() -> None:
    from topomesh.launch.cli import build_parser

    assert build_parser().parse_args(["--topology=off", "--topology-probe", "x.py"]).topology == "off"
    with pytest.raises(SystemExit, match="^2$"):
        build_parser().parse_args(["--topo=off", "x.py"])


def test_agent_is_installed_for_one_launch_and_whatever_was_there_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrapper someone installed (a test harness, a plugin) survives our launch and does
    not upset the hook check."""
    import torch.distributed.launcher.api as launcher_api

    from topomesh.launch import agent
    from topomesh.launch.cli import _agent_class

    class Wrapper(launcher_api.LocalElasticAgent):  # type: ignore[name-defined, misc]
        pass

    monkeypatch.setattr(launcher_api, "LocalElasticAgent", Wrapper)
    agent.check_hooks()  # no "torch lacks the torchrun internals" for a wrapped agent
    factory = agent.agent_factory(agent.TopologyOptions())
    with _agent_class(factory):
        assert launcher_api.LocalElasticAgent is factory
    assert launcher_api.LocalElasticAgent is Wrapper
    with pytest.raises(RuntimeError, match="^boom$"), _agent_class(factory):
        raise RuntimeError("boom")
    assert launcher_api.LocalElasticAgent is Wrapper
    monkeypatch.delattr(launcher_api, "LocalElasticAgent")
    with pytest.raises(LaunchError, match=r"lacks .*\(torch.distributed.launcher.api.LocalElasticAgent\)"):
        agent.check_hooks()


def test_topology_off_runs_whatever_agent_torchrun_would(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--topology off is plain torchrun: the agent launch_agent builds is the one installed
    (here a stand-in that stops the launch), not ours."""
    import torch.distributed.launcher.api as launcher_api

    from topomesh.launch import cli

    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE", raising=False)  # launch_agent sets it
    built: list[type] = []

    class Standin:
        def __init__(self, *args, **kwargs) -> None:
            built.append(type(self))
            raise LaunchError("stand-in agent built")

    monkeypatch.setattr(launcher_api, "LocalElasticAgent", Standin)
    for topology, expected in (("off", [Standin]), ("auto", [])):
        built.clear()
        argv = ["--log-dir", str(tmp_path / topology), "--rdzv-backend=static", "--master-addr=127.0.0.1",
                "--master-port=1", f"--topology={topology}", "x.py"]
        if topology == "off":
            with pytest.raises(LaunchError, match="^stand-in agent built$"):
                cli.main(argv)
        else:
            monkeypatch.setattr(cli, "_agent_class", _refuse_install)
            with pytest.raises(LaunchError, match="^would install TopologyAgent$"):
                cli.main(argv)
        assert built == expected
        assert launcher_api.LocalElasticAgent is Standin


@contextlib.contextmanager
def _refuse_install(factory):
    raise LaunchError("would install TopologyAgent")
    yield
