"""Hostile inputs too big to commit, written to a temporary directory at test time.

Each generator returns the path it wrote (or a special path such as ``/dev/zero``) and a
regular expression the refusal must match. Sizes and counts sit just past the readers'
named limits (``topomesh.topology.api``, ``formats``), or far past them where the issue
reported a hang or an allocation (2,000-deep JSON, 10,000 smi columns, /dev/zero).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

Generator = Callable[[Path], tuple[Path, str]]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def deep_json(d: Path) -> tuple[Path, str]:
    return _write(d / "deep.json", '{"version": "0.1", "ranks": ' + "[" * 2000 + "]" * 2000 + "}"), (
        r"line 1: JSON nested deeper than the limit of 64 levels"
    )


def long_number(d: Path) -> tuple[Path, str]:
    doc = '{"format": "topomesh-compact", "format_version": "1",\n"world_size": ' + "7" * 5000 + "}"
    return _write(d / "digits.json", doc), r"line 2: a number has more than the 40 digits allowed"


def big_exponent(d: Path) -> tuple[Path, str]:
    doc = '{"version": "0.1", "ranks": {}, "world_size": 1e400}'
    return _write(d / "exponent.json", doc), r"line 1: a number has an exponent of 3 or more digits"


def many_containers(d: Path) -> tuple[Path, str]:
    # 2,000,001 empty connection objects: the compact palette as the "millions"
    doc = '{"format": "topomesh-compact", "connections": [' + ",".join(["{}"] * 2_000_000) + "]}"
    return _write(d / "million-connections.json", doc), r"JSON holds 2000002 arrays and objects, more than the limit of 2000000"


def many_connections(d: Path) -> tuple[Path, str]:
    # under the container limit, over the palette limit: refused before any is parsed
    doc = (
        '{"format": "topomesh-compact", "format_version": "1", "world_size": "2", "connections": ['
        + ",".join(["{}"] * 70_000)
        + "]}"
    )
    return _write(d / "many-connections.json", doc), r"\$\.connections: 70000 entries, more than the limit of 65536"


def oversized(d: Path) -> tuple[Path, str]:
    path = d / "oversized.json"
    with path.open("wb") as f:
        f.truncate(64 * 2**20 + 1)  # sparse: one byte over 64 MiB, written in no time
    return path, r"is larger than the 67108864 bytes \(64 MiB\) this reader accepts"


def smi_columns(d: Path) -> tuple[Path, str]:
    header = "\t" + "\t".join(f"GPU{i}" for i in range(10_000))
    row = "GPU0\t X \t" + "\t".join(["SYS"] * 9_999)
    return _write(d / "wide.txt", f"{header}\n{row}\n"), r"line 1: the header names 10000 columns, more than the limit of 256"


def deep_pci(d: Path) -> tuple[Path, str]:
    text = "<system><cpu numaid='0'>" + "".join(f"<pci busid='{i:04x}:00:00.0'>" for i in range(20_000))
    text += "<gpu dev='0'/>" + "</pci>" * 20_000 + "</cpu></system>"
    return _write(d / "deep.xml", text), r"elements nested deeper than the limit of 64 \(at <pci>, element 65\)"


def many_gpus(d: Path) -> tuple[Path, str]:
    gpus = "".join(f"<gpu dev='{i}'/>" for i in range(5_000))
    return _write(d / "gpus.xml", f"<system><cpu numaid='0'><pci busid='0:1:0.0'>{gpus}</pci></cpu></system>"), (
        r"lists 5000 GPUs and NICs, more than the limit of 256 devices per host"
    )


def fifo(d: Path) -> tuple[Path, str]:
    path = d / "pipe"
    os.mkfifo(path)  # nobody writes: opening it for reading would block forever
    return path, r"is a FIFO \(named pipe\), not a regular file"


def directory(d: Path) -> tuple[Path, str]:
    (d / "dir.json").mkdir()
    return d / "dir.json", r"is a directory, not a regular file"


def dev_zero(_: Path) -> tuple[Path, str]:
    return Path("/dev/zero"), r"is a character device, not a regular file"


def dev_urandom(_: Path) -> tuple[Path, str]:
    return Path("/dev/urandom"), r"is a character device, not a regular file"


GENERATED: dict[str, Generator] = {
    f.__name__: f
    for f in (deep_json, long_number, big_exponent, many_containers, many_connections, oversized, smi_columns,
              deep_pci, many_gpus, fifo, directory, dev_zero, dev_urandom)
}


@pytest.fixture(params=sorted(GENERATED), ids=str)
def generated(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, str]:
    return GENERATED[request.param](tmp_path)
