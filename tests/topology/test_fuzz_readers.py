"""Every topology reader, fed thousands of damaged inputs, raises TopologyError or succeeds.

Inputs are mutations of the real dumps in shared/data, of the hand-written inputs under
``tests/fixtures/inputs`` and of v0.1 / compact documents written by ``api.dumps``: dropped
keys, values of the wrong type, random strings and numbers, truncation, byte flips and
token swaps. Whatever a reader accepts must be a usable :class:`Topology` (every pair has
a symmetric connection) that the ``topomesh show`` report can render.

Runs are deterministic (``derandomize``); ``TOPOMESH_FUZZ_EXAMPLES=5000`` explores more,
with fresh random inputs.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from topomesh.errors import TopologyError
from topomesh.report.topology import topology_report
from topomesh.topology import api
from topomesh.topology.build import build_topology, default_placement, single_host_topology
from topomesh.topology.formats import compact, rfc
from topomesh.topology.model import Connection, Host, Topology

from .helpers import cpu_host, dgx_host, pcie_host

TESTS = Path(__file__).resolve().parents[1]
REAL = TESTS.parent / "examples" / "data" / "real"  # the real dumps ship in the repo: a plain clone has them
INPUTS = TESTS / "fixtures" / "inputs"

_EXAMPLES = int(os.environ.get("TOPOMESH_FUZZ_EXAMPLES", "0"))


def _settings(n: int) -> settings:
    return settings(
        max_examples=_EXAMPLES or n,
        deadline=None,
        derandomize=not _EXAMPLES,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


def _worlds() -> list[Topology]:
    two = [dgx_host("a", gpus=2), dgx_host("b", gpus=2)]
    mixed = [pcie_host("p"), cpu_host("c", sockets=2)]
    return [
        single_host_topology(pcie_host("box")),
        build_topology(two, default_placement(two, [2, 2]), run_id="job-1", restart_count=0),
        build_topology(mixed, default_placement(mixed, [2, 1])),
    ]


WORLDS = _worlds()
DENSE_DOCS = [json.loads(api.dumps(t, "dense")) for t in WORLDS] + [
    json.loads((TESTS / "golden" / f"rfc_example_variant_{v}.json").read_text()) for v in "ab"
]
COMPACT_DOCS = [json.loads(api.dumps(t, "compact")) for t in WORLDS]
HOST_DOCS = [h.to_dict() for t in WORLDS for h in t.hosts]
TEXTS = (
    [p.read_text() for p in sorted(REAL.glob("*/*")) if p.suffix in (".xml", ".txt")]
    + [p.read_text() for p in sorted(INPUTS.glob("*.*"))]
    + [api.dumps(t, form) for t in WORLDS[:2] for form in ("dense", "compact")]
)



def test_real_dumps_are_among_the_seeds() -> None:
    """The seeds once came from a path outside the repo, and a plain clone fuzzed none of
    the real dumps without saying so: fail instead if they are missing."""
    names = sorted(p.name for p in REAL.glob("*/*") if p.suffix in (".xml", ".txt"))
    assert names == [
        "a100-sxm-8gpu-nvswitch-5nic.xml",
        "azure-ndv5-h100-pci-only.xml",
        "h100-sxm-8gpu-12nic.txt",
    ]
    assert all((REAL / sub / name).read_text() in TEXTS for sub in ("nccl-topo", "nvidia-smi-topo") for name in names
               if (REAL / sub / name).exists())


# values that broke readers elsewhere: wrong types, edge numbers, lookalike names
_ODD = st.sampled_from(
    ["", "-1", "0", "1e400", "NaN", "inf", "-0", "0x10", "GPU0", "GPU99", "NIC0", "X", "NV0", "NV18",
     "PCIe", "IB", "SYS", "LOC", "0.1", "1.5", "us", "GB/s", "ms", "Mb/s", "null", "host0", "a", "b",
     "9" * 25, "1" + "0" * 400, "[bold]", "[/]", "$\\frac{$",
     # the accepted-but-wrong values: a trailing newline, signs, leading zeros,
     # other scripts' digits, underscores, fractions, negatives, 5,000 digits
     "1\n", "0\n", "01", "+4", "٤", "4_0", "8.7", "-1", "Infinity", "9" * 5000]
)
_HOSTILE_NUMBERS = st.sampled_from([8.7, -1, -0.5, 10**400, 2**31, 2**63, float("inf"), float("nan"), 1e308])
_SCALARS = (
    st.none() | st.booleans() | st.integers(-3, 2**40) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6) | _ODD | _HOSTILE_NUMBERS
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5) | _ODD, inner, max_size=3),
    max_leaves=6,
)


def _slots(doc: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key) place in a JSON tree."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append((doc, k))
            _slots(v, out)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.append((doc, i))
            _slots(v, out)
    return out


def _retype(value: Any) -> Any:
    """The same value in another JSON type: "12" → 12, 12 → "12", [x] → x, ..."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return [value]
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, list):
        return value[0] if value else {}
    if isinstance(value, dict):
        return list(value.values())
    return 0


@st.composite
def mutated_doc(draw: st.DrawFn, seeds: list[Any]) -> Any:
    doc = copy.deepcopy(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 3))):
        slots = _slots(doc, [])
        if not slots:
            return draw(_JSON)
        container, key = draw(st.sampled_from(slots))
        op = draw(st.sampled_from(["drop", "replace", "retype", "rename", "copy"]))
        if op == "drop":
            del container[key]
        elif op == "replace":
            container[key] = draw(_JSON)
        elif op == "retype":
            container[key] = _retype(container[key])
        elif op == "rename" and isinstance(container, dict):
            container[draw(_ODD | st.text(max_size=4))] = container.pop(key)
        elif op == "copy":
            other_container, other_key = draw(st.sampled_from(slots))
            container[key] = copy.deepcopy(other_container[other_key])
    return doc


_TOKEN = re.compile(r"[A-Za-z_]+|\d+(?:\.\d+)?")


@st.composite
def mutated_text(draw: st.DrawFn, seeds: list[str]) -> str:
    text = draw(st.sampled_from(seeds))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["token", "token", "truncate", "flip", "insert", "delete", "splice"]))
        pos = draw(st.integers(0, len(text)))
        if op == "token":
            tokens = list(_TOKEN.finditer(text))
            if tokens:
                m = draw(st.sampled_from(tokens))
                text = text[: m.start()] + draw(_ODD | st.text(max_size=5)) + text[m.end() :]
        elif op == "truncate":
            text = text[:pos]
        elif op == "flip" and text:
            i = min(pos, len(text) - 1)
            text = text[:i] + chr(ord(text[i]) ^ (1 << draw(st.integers(0, 6)))) + text[i + 1 :]
        elif op == "insert":
            text = text[:pos] + draw(st.text(max_size=12) | _ODD) + text[pos:]
        elif op == "delete":
            end = draw(st.integers(pos, min(len(text), pos + 80)))
            text = text[:pos] + text[end:]
        elif op == "splice":
            other = draw(st.sampled_from(seeds))
            cut = draw(st.integers(0, len(other)))
            text = text[:pos] + other[cut:]
    return text


def _ill_typed(host: Host) -> str | None:
    """A field of ``host`` whose type the model does not allow, if any (a list as ``arch``
    once got through ``Host.from_dict`` and broke hashing later)."""
    types = {
        "id": str, "name": str, "index": int, "pci_bus_id": str | None, "numa_node": int | None,
        "arch": str | None, "memory_bytes": int | None, "speed_Gbps": int | float | None,
        "a": str, "b": str, "nvlink_count": int, "bandwidth_GBps": int | float | None,
    }
    for item in (*host.devices, *host.nics, *host.paths):
        for name, want in types.items():
            if hasattr(item, name):
                value = getattr(item, name)
                if isinstance(value, bool) or not isinstance(value, want):
                    return f"{type(item).__name__}.{name}={value!r}"
    return None


def _usable(result: Topology) -> None:
    """A topology a reader accepted works for every query the report makes."""
    assert isinstance(result, Topology)
    event("accepted")
    for host in result.hosts:
        assert _ill_typed(host) is None, f"{host.hostname}: {_ill_typed(host)}"
    n = result.world_size
    if n > 64:
        return
    for a in range(n):
        for b in range(n):
            c = result.connection(a, b)
            assert isinstance(c, Connection)
            assert c == result.connection(b, a), f"connection({a}, {b}) differs from connection({b}, {a})"
    topology_report(result)  # builds every table and the matrix (printing them adds only layout)


def _only_topology_errors(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except TopologyError as exc:
        assert str(exc), "a TopologyError must say what is wrong"
        event("TopologyError")
        return None


@pytest.fixture(scope="module", autouse=True)
def memory_guard() -> Any:
    """Cap this process's address space while fuzzing: a reader that allocates without
    bound must fail with MemoryError here, not OOM-kill the shared machine."""
    try:
        import resource

        vm_kb = next(
            int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmSize:")
        )
    except (ImportError, OSError, StopIteration):
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = vm_kb * 1024 + 3 * 2**30
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@_settings(700)
@given(mutated_text(TEXTS))
def test_parse_text_any_format(text: str) -> None:
    result = _only_topology_errors(lambda: api.parse_text(text, source="fuzz"))
    if result is not None:
        _usable(result)


@_settings(400)
@given(mutated_doc(DENSE_DOCS))
def test_rfc_from_dict(doc: Any) -> None:
    result = _only_topology_errors(lambda: rfc.from_dict(doc, source="fuzz"))
    if result is not None:
        _usable(result)


@_settings(500)
@given(mutated_doc(COMPACT_DOCS))
def test_compact_from_dict(doc: Any) -> None:
    result = _only_topology_errors(lambda: compact.from_dict(doc, source="fuzz"))
    if result is not None:
        _usable(result)


@_settings(500)
@given(mutated_doc(HOST_DOCS))
def test_host_from_dict(doc: Any) -> None:
    host = _only_topology_errors(lambda: Host.from_dict(doc, source="fuzz"))
    if host is not None:
        assert isinstance(host, Host)
        _usable(single_host_topology(host))


@pytest.fixture(scope="module")
def scratch() -> Any:
    with tempfile.TemporaryDirectory(prefix="topomesh-fuzz-") as d:
        yield Path(d)


@_settings(300)
@given(data=st.data())
def test_read_source_on_damaged_bytes(scratch: Path, data: st.DataObject) -> None:
    seed = data.draw(st.sampled_from(TEXTS)).encode()
    raw = bytearray(seed)
    for _ in range(data.draw(st.integers(1, 6))):
        if raw and data.draw(st.booleans()):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
        else:
            raw = bytearray(data.draw(st.binary(max_size=64))) + raw[data.draw(st.integers(0, len(raw))) :]
    path = scratch / "input"
    path.write_bytes(bytes(raw))
    result = _only_topology_errors(lambda: api.read_source(path))
    if result is not None:
        _usable(result)


def test_paths_that_are_not_files(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="no such file"):
        api.read_source(tmp_path / "missing.json")
    with pytest.raises(TopologyError, match="is a directory"):
        api.read_source(tmp_path)


DAMAGED_REASONS = {
    "a100-truncated.xml": "line 38 column 9: not well-formed XML",
    "billion-laughs.xml": "DOCTYPE/ENTITY declarations are not allowed",
    "compact-truncated.json": "not valid JSON",
    "empty.txt": "unrecognised content",
    "garbage.bin": "not UTF-8 text",
    "nccl-bad-attribute.xml": "<gpu> attribute dev='three' is not an integer",
    "smi-asymmetric.txt": "not symmetric: GPU0 to GPU1 is NV18 but GPU1 to GPU0 is SYS",
    "smi-short-row.txt": "row GPU3 has 5 cells",
    "smi-unknown-cell.txt": "unknown link 'NV?' between GPU2 and GPU4",
    "v01-malformed.json": "not valid JSON",
    "v01-missing-pair.json": "no connection between ranks 0 and 3",
    "v01-rank-gap.json": r"missing [3]",
    "v01-unknown-kind.json": "unknown connection type 'Carrier-Pigeon'",
    "v01-wrong-version.json": "unsupported version '0.2'",
}
"""What each damaged file is refused for (read off the files by hand)."""


@pytest.mark.parametrize("path", sorted((INPUTS / "damaged").iterdir()), ids=lambda p: p.name)
def test_damaged_inputs_raise_topology_error_with_file_name(path: Path) -> None:
    assert path.name in DAMAGED_REASONS, f"add the reason {path.name} must be refused for to DAMAGED_REASONS"
    with pytest.raises(TopologyError, match=f"^{re.escape(str(path))}: .*{re.escape(DAMAGED_REASONS[path.name])}") as info:
        api.read_source(path)
    assert info.value.source == str(path)


def test_host_from_dict_rejects_wrong_types() -> None:
    doc = pcie_host("box").to_dict()
    doc["devices"][0]["arch"] = ["sm86"]
    with pytest.raises(TopologyError, match=r"^fuzz: malformed host description \(Device\.arch must be str or None, got \['sm86'\]\)"):
        single_host_topology(Host.from_dict(doc, source="fuzz"))


def test_compact_rejects_asymmetric_local_matrix() -> None:
    doc = json.loads(api.dumps(WORLDS[1], "compact"))
    assert doc["local_classes"] == [[[0, 1], [1, 0]]]
    doc["local_classes"] = [[[0, 0], [1, 0]]]
    with pytest.raises(TopologyError, match=r"^fuzz: \$\.local_classes\[0\]: connections must be symmetric"):
        compact.from_dict(doc, source="fuzz")


@pytest.mark.parametrize("key", ["rank_rail", "local_classes"])
def test_compact_rejects_huge_integers(key: str) -> None:
    doc = json.loads(api.dumps(WORLDS[0], "compact"))
    if key == "rank_rail":
        doc["rank_rail"][0] = 10**25
    else:
        doc["local_classes"][0][0][0] = 10**25
    with pytest.raises(TopologyError, match=rf"^fuzz: \$\.{key}(\[0\])?: "):
        compact.from_dict(doc, source="fuzz")


_HUGE_RANK = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, resource.RLIM_INFINITY))
from topomesh.errors import TopologyError
from topomesh.topology.formats import rfc
try:
    rfc.from_dict({"version": "0.1", "ranks": {"0": {"peers": {}}, "9999999999": {"peers": {}}}}, source="x")
except TopologyError as exc:
    print("TopologyError", exc)
"""


def test_rfc_huge_rank_key_is_a_topology_error() -> None:
    proc = subprocess.run([sys.executable, "-c", _HUGE_RANK], capture_output=True, text=True, timeout=120, check=False)
    assert proc.stdout.startswith("TopologyError"), proc.stderr[-300:]


def _depth(value: Any) -> int:
    """Nesting of arrays and objects, counted on the Python value (not on the text)."""
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


def _numbers(value: Any) -> list[int | float]:
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    return [value] if isinstance(value, int | float) and not isinstance(value, bool) else []


def _breaks_a_rule(value: Any, wrap: int) -> bool:
    """Whether ``loads_bounded`` must refuse ``value`` inside ``wrap`` arrays, from the
    limits' definitions: depth > 64, an integer of more than 40 digits, NaN/Infinity, or a
    double whose shortest form (``repr``, what json.dumps writes) has a 3-digit exponent."""
    if _depth(value) + wrap > api.MAX_JSON_DEPTH:
        return True
    for n in _numbers(value):
        if isinstance(n, int) and len(str(abs(n))) > api.MAX_NUMBER_CHARS:
            return True
        if isinstance(n, float) and (n != n or n in (float("inf"), float("-inf"))):
            return True
        if isinstance(n, float) and "e" in repr(n) and len(repr(n).split("e")[1].lstrip("+-")) >= 3:
            return True
    return False


_BIG_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**45), 10**45) | st.floats() | st.text(alphabet="[]{}\\\"a0e", max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet="[]{}\"ab", max_size=4), inner, max_size=3),
    max_leaves=8,
)


@_settings(600)
@given(value=_BIG_JSON, wrap=st.integers(0, 80), numbers=st.lists(st.integers(0, 10**60) | st.sampled_from([10**40 - 1, 10**40, -(10**40)]), max_size=2))
def test_loads_bounded_agrees_with_json_or_refuses_by_rule(value: Any, wrap: int, numbers: list[int]) -> None:
    """Accepted text parses exactly as ``json.loads`` parses it; refused text broke one of
    the rules (checked on the value, independently of the scan over the text)."""
    value = [value, *numbers]
    text = "[" * wrap + json.dumps(value) + "]" * wrap
    must_refuse = _breaks_a_rule(value, wrap)
    try:
        got = api.loads_bounded(text, source="prop")
    except TopologyError as exc:
        assert must_refuse, f"refused a valid document: {exc}"
        return
    assert not must_refuse, "accepted a document that breaks a limit"
    assert json.dumps(got) == json.dumps(json.loads(text))
