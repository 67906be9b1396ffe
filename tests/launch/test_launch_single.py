"""`topomesh launch` on one node: --standalone, isolation of jobs, bad run ids, file mode."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch.conftest import Agents, free_port
from topomesh.topology.api import read_source

pytestmark = pytest.mark.slow


def test_standalone_two_jobs_at_once_never_share_files(agents: Agents) -> None:
    """Two standalone jobs on one host, same topology base directory, same time."""
    base = agents.tmp / "topo"
    out_a, out_b = agents.tmp / "out-a", agents.tmp / "out-b"
    out_a.mkdir()
    out_b.mkdir()
    expect = json.dumps({"same": {"nvlink-bridge-2gpu": "NVLink"}, "cross": "NIC"})
    args = ["--standalone", "--nproc-per-node=2", f"--topology-dir={base}"]
    a = agents.start("a", args, sysfs="nvlink-bridge-2gpu", env={"CHECK_OUT": str(out_a), "CHECK_EXPECT": expect})
    b = agents.start("b", args, sysfs="nvlink-bridge-2gpu", env={"CHECK_OUT": str(out_b), "CHECK_EXPECT": expect})
    assert agents.wait(a) == 0, agents.log(a)[-3000:]
    assert agents.wait(b) == 0, agents.log(b)[-3000:]
    ra = [json.loads(f.read_text()) for f in sorted(out_a.glob("rank*.json"))]
    rb = [json.loads(f.read_text()) for f in sorted(out_b.glob("rank*.json"))]
    assert len(ra) == len(rb) == 2
    files_a, files_b = {r["file"] for r in ra}, {r["file"] for r in rb}
    assert len(files_a) == len(files_b) == 1 and files_a.isdisjoint(files_b)
    run_a, run_b = ra[0]["run_id"], rb[0]["run_id"]
    assert run_a != run_b  # each standalone job has its own uuid run id...
    assert Path(files_a.pop()).parent == base / run_a  # ...and its own directory
    assert Path(files_b.pop()).parent == base / run_b
    assert sorted(p.name for p in base.iterdir()) == sorted([run_a, run_b])
    for run in (run_a, run_b):
        assert stat.S_IMODE((base / run).stat().st_mode) == 0o700
    assert ra[0]["kinds"]["0,1"] == "NVLink"


def _launch(tmp: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    e.update(TMPDIR=str(tmp), OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "topomesh.launch", "--log-dir", str(tmp / "logs"), *args],
        env=e, capture_output=True, text=True, timeout=60,
    )


def test_run_ids_torchrun_accepts_work_and_stay_inside_the_directory(tmp_path: Path) -> None:
    """A path-like id is hashed into a name inside --topology-dir, not refused (torchrun runs it)."""
    port = free_port()
    evil = "../../escaped"
    res = _launch(
        tmp_path, "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={evil}", f"--topology-dir={tmp_path / 'topo'}",
        "-m", "json.tool", "--help",
    )
    assert res.returncode == 0, res.stderr[-2000:]
    name = "_._.._escaped-" + hashlib.sha256(evil.encode()).hexdigest()[:16]
    assert [p.name for p in (tmp_path / "topo").iterdir()] == [name]
    assert len(list((tmp_path / "topo" / name).glob("topology-r0-*.json"))) == 1
    assert not (tmp_path / "escaped").exists() and not (tmp_path.parent / "escaped").exists()


def test_topology_dir_that_is_a_file_is_one_line_before_launch(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("x")
    res = _launch(tmp_path, "--standalone", "--nproc-per-node=1", f"--topology-dir={tmp_path / 'plain'}", "-m", "json.tool", "--help")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"topomesh: error: --topology-dir {str(tmp_path / 'plain')!r} is not a directory (a file of that name exists)"
    ]


def _failing_script(tmp: Path) -> Path:
    script = tmp / "fail.py"
    script.write_text("import sys, time\nprint('first line', flush=True)\ntime.sleep(1)\nsys.exit(3)\n")
    return script


def test_failure_prints_what_torchrun_prints_and_never_exits_0(tmp_path: Path) -> None:
    """Side by side with torchrun: exit code 1, and the same last lines naming
    ChildFailedError (log alerts match on them), without the traceback."""
    script = _failing_script(tmp_path)
    ours = _launch(tmp_path, "--standalone", "--nproc-per-node=1", str(script))
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    e.update(TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    theirs = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--log-dir", str(tmp_path / "logs-t"), "--standalone",
         "--nproc-per-node=1", str(script)], env=e, capture_output=True, text=True, timeout=60,
    )
    assert ours.returncode == theirs.returncode == 1

    def summary(stderr: str) -> list[str]:
        lines = stderr.splitlines()
        start = lines.index("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ")
        return [ln for ln in lines[start:] if not ln.lstrip().startswith(("time ", "exitcode", "host "))]

    assert summary(ours.stderr) == summary(theirs.stderr)
    assert "exitcode  : 3" in ours.stderr and "Traceback" not in ours.stderr
    # stderr a closed pipe (`... 2>&1 | head -1` under pipefail, as in CI): still exit 1
    cmd = f"set -o pipefail; {sys.executable} -m topomesh.launch --log-dir {tmp_path / 'logs-p'} --standalone " \
          f"--nproc-per-node=1 {script} 2>&1 | head -1"
    piped = subprocess.run(["bash", "-c", cmd], env=e, capture_output=True, text=True, timeout=60)
    assert piped.stdout.strip() == "first line"
    assert piped.returncode == 1


def test_main_raises_child_failed_error_like_torchruns_main(tmp_path: Path) -> None:
    script = _failing_script(tmp_path)
    code = (
        "import sys\n"
        "from torch.distributed.elastic.multiprocessing.errors import ChildFailedError\n"
        "from topomesh.launch.cli import main\n"
        "try:\n"
        f"    main(['--log-dir', {str(tmp_path / 'logs-m')!r}, '--standalone', '--nproc-per-node=1', {str(script)!r}])\n"
        "except ChildFailedError as exc:\n"
        "    print('RAISED', exc.get_first_failure()[1].exitcode)\n"
    )
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    e.update(TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=60)
    assert "RAISED 3" in res.stdout, res.stderr[-2000:]


def test_topology_file_is_passed_through_and_world_size_checked(tmp_path: Path) -> None:
    from tests.launch.conftest import SYSFS
    from topomesh.topology.api import save_topology
    from topomesh.topology.build import single_host_topology
    from topomesh.topology.discover import discover_host

    host = discover_host(SYSFS / "dgx-h100-8gpu-8ib")
    given = tmp_path / "given.json"
    save_topology(single_host_topology(host, 2), given)
    script = tmp_path / "show.py"
    script.write_text("import os; print('FILE=' + os.environ['WORLD_TOPOLOGY_FILE'])\n")
    ok = _launch(tmp_path, "--standalone", "--nproc-per-node=2", f"--topology={given}", str(script))
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.count(f"FILE={given}") == 2
    bad = _launch(tmp_path, "--standalone", "--nproc-per-node=1", f"--topology={given}", str(script))
    assert bad.returncode == 2
    assert "describes 2 ranks, but this round has WORLD_SIZE=1" in bad.stderr.strip().splitlines()[-1]


def test_topology_off_is_plain_torchrun_and_failures_keep_torchrun_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("import os, sys; print('ENV=' + str('WORLD_TOPOLOGY_FILE' in os.environ)); sys.exit(int(os.environ['RANK']) * 7)\n")
    res = _launch(tmp_path, "--standalone", "--nproc-per-node=2", "--topology=off", str(script))
    assert res.stdout.count("ENV=False") == 2
    assert res.returncode == 1  # torchrun's exit code for a failed worker
    assert "Root Cause (first observed failure)" in res.stderr and "exitcode  : 7" in res.stderr


def test_probe_marks_cross_node_links_measured(agents: Agents) -> None:
    port = free_port()
    common = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
              "--rdzv-id=probe", "--topology-probe", "--topology-probe-budget=1", f"--topology-dir={agents.tmp / 't'}"]
    a = agents.start("a", common, sysfs="nvlink-bridge-2gpu")
    b = agents.start("b", common, sysfs="cpu-only")
    assert agents.wait(a) == 0, agents.log(a)[-3000:]
    assert agents.wait(b) == 0, agents.log(b)[-3000:]
    _assert_pair_measured(agents, "NIC")  # loopback TCP


def _assert_pair_measured(agents: Agents, kind: str) -> None:
    """Both ranks saw one file in which the link between ranks 0 and 1 is measured and keeps
    ``kind``; the bounds are sanity checks only, since CI machines may be loaded."""
    reports = agents.reports()
    assert len(reports) == 2 and len({r["bytes"] for r in reports}) == 1
    topo = read_source(reports[0]["file"])
    c = topo.connection(0, 1)
    assert c.measured and c.kind.value == kind
    assert 0 < c.latency_us < 100_000 and c.bandwidth_GBps > 0.001
    assert not topo.connection(0, 0).measured


def test_probe_measures_shared_memory_inside_a_node(agents: Agents) -> None:
    """Two CPU workers on one socket: the local probe measures their SHM link (one node,
    so there is no peer to probe; the local measurement still happens)."""
    a = agents.start("a", ["--standalone", "--nproc-per-node=2", "--topology-probe", "--topology-probe-budget=1",
                           f"--topology-dir={agents.tmp / 't'}"], sysfs="cpu-only")
    assert agents.wait(a) == 0, agents.log(a)[-3000:]
    _assert_pair_measured(agents, "SHM")
