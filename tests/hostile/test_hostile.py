"""A corpus of hostile topology inputs against every reader entry point and the CLI.

Small files are committed under ``files/``; big ones are generated (``conftest.py``). Each
must be refused with a :class:`TopologyError` naming the file and saying which limit or
rule it broke (the expected text is written here by hand, from the limits' definitions),
within seconds and under a memory cap; through ``topomesh show`` and ``topomesh layout``
it must be one line on stderr, ``topomesh: error: ...``, exit 2, no traceback.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from topomesh.cli.main import main
from topomesh.errors import TopologyError
from topomesh.topology import api

FILES = Path(__file__).resolve().parent / "files"
SECONDS = 10.0  # every refusal here takes well under a second on an idle core

COMMITTED = {
    "v01-key-trailing-newline.json": r"\$\.ranks: rank key '1\\n' is not a rank id",
    "v01-asymmetric-pair.json": (
        r"\$\.ranks\.1\.peers\.0\.connection: ranks 1 and 0 disagree about their connection "
        r"\(NVLink 0\.6 us 300 GB/s x12 at \$\.ranks\.0\.peers\.1\.connection, NVLink 7\.5 us 300 GB/s x12 here\)"
    ),
    "v01-world-size-disagrees.json": r"\$\.world_size: world_size is '3' but the file lists 2 ranks",
    "v01-fractional-local-rank.json": r"\$\.ranks\.1\.local_rank: expected a whole number, got '0\.5'",
    "v01-huge-local-rank.json": r"\$\.ranks\.1\.local_rank: expected a whole number in 0\.\.1, got '4294967296'",
    "v01-negative-restart-count.json": r"\$\.restart_count: expected a whole number in 0\.\.2147483647, got '-3'",
    # 1e303 s = 1e309 us, past the largest double (1.8e308): says which pair and field
    "v01-latency-overflows-in-us.json": r"\$\.ranks\.0\.peers\.1\.connection\.latency: '1e303' s is too large once converted",
    "v01-infinity-latency.json": r"line \d+: Infinity is not a number JSON allows",
    "v01-number-key-5000-digits.json": r"\$\.ranks: rank key '9{39}\.\.\. \(5002 characters\) is not a rank id",
    "compact-world-size-fraction.json": r"\$\.world_size: expected a whole number, got 8\.7",
    "compact-negative-restart-count.json": r"\$\.restart_count: expected a whole number in 0\.\.2147483647, got -1",
    "compact-infinity-restart-count.json": r"line 1: Infinity is not a number JSON allows",
    "smi-gpu1-and-gpu01.txt": r"line 1: columns GPU1 and GPU01 both name GPU index 1",
    "smi-nv-5000-digits.txt": r"line 2: NV# between GPU0 and GPU1 has 5000 digits: out of range",
}


def test_every_committed_file_has_an_expected_refusal() -> None:
    assert sorted(p.name for p in FILES.iterdir()) == sorted(COMMITTED)


@pytest.fixture(scope="module", autouse=True)
def memory_cap() -> Iterator[None]:
    """At most 2 GiB more address space than the process has now: a reader that
    allocates without bound fails here instead of taking the shared machine down."""
    import resource

    vm_kb = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = vm_kb * 1024 + 2 * 2**30
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _cases() -> list[tuple[Path, str]]:
    return [(FILES / name, pattern) for name, pattern in sorted(COMMITTED.items())]


def _refused(read, path: Path, pattern: str) -> None:
    start = time.monotonic()
    with pytest.raises(TopologyError, match=pattern) as info:
        read(path)
    assert time.monotonic() - start < SECONDS
    assert info.value.source == str(path)
    assert str(info.value).startswith(f"{path}: ")


def _cli_refuses(argv: list[str], path: Path, pattern: str, capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    code = main(argv)
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    assert code == 2, err
    assert elapsed < SECONDS
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"topomesh: error: {path}: ")
    assert re.search(pattern, lines[0])
    assert "Traceback" not in out + err


@pytest.mark.parametrize(("path", "pattern"), _cases(), ids=lambda x: x.name if isinstance(x, Path) else "")
def test_committed_file_is_refused_by_every_reader(path: Path, pattern: str, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(api.read_source, path, pattern)
    _refused(api.load_topology, path, pattern)
    _cli_refuses(["show", str(path)], path, pattern, capsys)
    _cli_refuses(["layout", str(path), "--tp", "1"], path, pattern, capsys)


def test_generated_input_is_refused_by_every_reader(generated: tuple[Path, str], capsys: pytest.CaptureFixture[str]) -> None:
    path, pattern = generated
    _refused(api.read_source, path, pattern)
    _refused(api.load_topology, path, pattern)
    _cli_refuses(["show", str(path)], path, pattern, capsys)


def test_generated_input_is_refused_through_the_environment(
    generated: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a training script sees: ``load_topology()`` reading ``WORLD_TOPOLOGY_FILE``."""
    path, pattern = generated
    monkeypatch.setenv(api.ENV_VAR, str(path))
    with pytest.raises(TopologyError, match=pattern):
        api.load_topology()


def test_limits_are_exact(tmp_path: Path) -> None:
    """The limits are not off by one: 64 levels, 40 digits, 1e99 and 64 MiB pass; one
    more level, digit, exponent digit or byte is refused."""
    assert api.loads_bounded("[" * 64 + "]" * 64, source="x") == json.loads("[" * 64 + "]" * 64)
    assert api.loads_bounded("9" * 40, source="x") == int("9" * 40)
    assert api.loads_bounded("[1e99, 1E-99, 1e+99]", source="x") == [1e99, 1e-99, 1e99]
    for text, why in [
        ("[" * 65 + "]" * 65, "nested deeper than the limit of 64"),
        ("9" * 41, "more than the 40 digits allowed"),
        ("[1e100]", "exponent of 3 or more digits"),
        ("[1E+100]", "exponent of 3 or more digits"),
        ('{"a": NaN}', "NaN is not a number JSON allows"),
    ]:
        with pytest.raises(TopologyError, match=why):
            api.loads_bounded(text, source="x")
    exact = tmp_path / "exact"
    exact.write_bytes(b" " * (64 * 2**20))
    assert len(api.read_bytes(exact)) == 64 * 2**20
    with exact.open("ab") as f:
        f.write(b" ")
    with pytest.raises(TopologyError, match=r"exact: is larger than the 67108864 bytes"):
        api.read_bytes(exact)


def test_brackets_inside_strings_do_not_count() -> None:
    text = '{"name": "' + "[" * 500 + '\\"' + "{" * 500 + '"}'  # an escaped quote does not end it
    assert api.loads_bounded(text, source="x") == {"name": "[" * 500 + '"' + "{" * 500}
