"""Helpers for launching real ``topomesh launch`` agents on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SYSFS = HERE.parent / "fixtures" / "sysfs"
WORKER = HERE / "worker_check.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agents:
    """Starts agents in their own sessions; kills what is left of them at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.out = tmp / "out"
        self.out.mkdir()

    def start(self, name: str, args: list[str], *, sysfs: str | None = None, env: dict[str, str] | None = None,
              script: list[str] | None = None) -> subprocess.Popen[bytes]:
        e = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "WORLD_TOPOLOGY"))}
        e.update(
            TMPDIR=str(self.tmp),  # torchrun error files and the default topology dir land here
            CHECK_OUT=str(self.out),
            OMP_NUM_THREADS="1",
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # see docs/launch.md: stale gloo keys otherwise
        )
        if sysfs:
            e["TOPOMESH_SYSFS_ROOT"] = str(SYSFS / sysfs) if not os.path.isabs(sysfs) else sysfs
        e.update(env or {})
        cmd = [sys.executable, "-m", "topomesh.launch", "--log-dir", str(self.tmp / f"logs-{name}"), "--monitor-interval", "0.2",
               *args, *(script or [str(WORKER)])]
        log = open(self.tmp / f"agent-{name}.log", "wb")  # noqa: SIM115 - closed at teardown
        p = subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        p.log_file = log  # type: ignore[attr-defined]
        p.log_path = self.tmp / f"agent-{name}.log"  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def wait(self, p: subprocess.Popen[bytes], timeout: float = 90) -> int:
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"agent did not finish in {timeout} s:\n{self.log(p)[-4000:]}")

    def log(self, p: subprocess.Popen[bytes]) -> str:
        return Path(p.log_path).read_text(errors="replace")  # type: ignore[attr-defined]

    def reports(self) -> list[dict]:
        return [json.loads(f.read_text()) for f in sorted(self.out.glob("rank*.json"))]

    def kill(self, p: subprocess.Popen[bytes]) -> None:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # the agent's own session (workers have their own)
            p.wait(10)

    def worker_pids(self, agent_pid: int | None = None) -> list[int]:
        """Live worker processes (they run in sessions of their own, not the agent's)."""
        out = []
        for f in (self.out / "pids").glob("*-*") if (self.out / "pids").is_dir() else ():
            pid, parent = (int(x) for x in f.name.split("-"))
            if agent_pid is not None and parent != agent_pid:
                continue
            try:
                if "worker_check" in Path(f"/proc/{pid}/cmdline").read_text():
                    out.append(pid)
            except OSError:
                pass
        return out

    def close(self) -> None:
        for p in self.procs:
            self.kill(p)
            p.log_file.close()  # type: ignore[attr-defined]
        for pid in self.worker_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Agents]:
    a = Agents(tmp_path)
    try:
        yield a
    finally:
        a.close()


def wait_listening(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")
