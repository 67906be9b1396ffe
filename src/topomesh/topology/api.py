"""Reading and writing topologies: the API trainers and every CLI command use.

``load_topology()`` is what a training script calls: it reads ``WORLD_TOPOLOGY_FILE``
(set by ``topomesh launch`` and the Ray integration) or an explicit path, in the dense
v0.1 form or the compact form. ``read_source()`` also takes NCCL topology XML and
``nvidia-smi topo -m`` text, detected by content.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from topomesh.errors import OutputError, TopologyError, TopomeshError
from topomesh.topology.formats import compact, rfc
from topomesh.topology.model import Host, Topology

ENV_VAR = "WORLD_TOPOLOGY_FILE"
DENSE_MAX_RANKS = 128
"""Worlds larger than this are written in the compact form unless dense is asked for.

A dense file holds ranks² connection objects (~200 bytes each): 128 ranks is ~3 MB."""
MAX_FILE_BYTES = 64 * 1024 * 1024
"""Most bytes read from one input file (topology, profile, records): 64 MiB. The largest
files topomesh writes are a few MB (a probed 2,048-node compact world: 3.1 MB; a dense
128-rank world: ~3 MB). Bytes actually read are counted; a ``stat`` size is not trusted."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of JSON arrays and objects accepted; topomesh's own documents nest at
most 7 deep (``ranks.0.peers.1.connection.latency.value``)."""
MAX_JSON_CONTAINERS = 2_000_000
"""Most arrays and objects in one JSON document: a dense 512-rank world has 1.3 million;
each costs ~100-250 bytes once parsed, so this bounds a parse to a few hundred MB."""
MAX_NUMBER_CHARS = 40
"""Most digits in a row in a JSON number literal: a double needs at most 17 significant
digits (``2.2250738585072014e-308``); longer runs are damage, and Python refuses to parse
integers of more than 4,300 digits anyway."""


class FileForm(StrEnum):
    AUTO = "auto"
    DENSE = "dense"  # RFC v0.1, every pair
    COMPACT = "compact"


class SourceKind(StrEnum):
    RFC = "rfc-v0.1"
    COMPACT = "compact"
    NCCL_XML = "nccl-xml"
    SMI = "nvidia-smi"


def _fail(error: type[TopomeshError], message: str, source: str, where: str | None = None) -> TopomeshError:
    """``error`` naming ``source`` and ``where``: TopologyError keeps them as fields."""
    if issubclass(error, TopologyError):
        return error(message, source=source, where=where)
    return error(": ".join(p for p in (source, where, message) if p))


def read_bytes(
    path: str | os.PathLike[str],
    *,
    limit: int = MAX_FILE_BYTES,
    error: type[TopomeshError] = TopologyError,
    what: str = "file",
) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    FIFOs, devices (``/dev/zero``, ``/dev/urandom``), sockets and directories are refused
    before they are opened for reading (and checked again on the open descriptor), so a
    reader never blocks or reads without end. ``error`` is raised naming the file and
    ``what`` it should be.
    """
    name = str(path)
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise _fail(error, f"is {_file_kind(mode)}, not a regular file", name)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):  # replaced between stat and open
                raise _fail(error, f"is {_file_kind(mode)}, not a regular file", name)
            data = f.read(limit + 1)
    except TopomeshError:
        raise
    except FileNotFoundError:
        raise _fail(error, f"no such {what}", name) from None
    except ValueError:
        raise _fail(error, "the path contains a NUL character", name) from None
    except OSError as exc:
        raise _fail(error, f"cannot read ({exc.strerror or exc})", name) from None
    if len(data) > limit:
        raise _fail(error, f"is larger than the {limit} bytes ({limit / 2**20:g} MiB) this reader accepts", name)
    return data


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def _read_text(path: str | os.PathLike[str]) -> str:
    data = read_bytes(path)
    try:
        return data.decode("utf-8-sig")  # tolerate a byte-order mark
    except UnicodeDecodeError as exc:
        raise TopologyError(f"not UTF-8 text (byte {exc.start})", source=str(path)) from None


# a JSON string literal, escapes included; linear time (no nested repetition can backtrack)
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_SCAN_CHUNK = 1 << 20


def _shape_error(bare: str, max_depth: int) -> tuple[str, str | None] | None:
    """Why the JSON text ``bare`` (its string literals emptied) is refused, and where;
    None when it is not.

    Refused: more than :data:`MAX_JSON_CONTAINERS` arrays and objects, nesting deeper than
    ``max_depth``, a run of more than :data:`MAX_NUMBER_CHARS` digits, an exponent of three
    or more digits (doubles beyond 1e±99: none of topomesh's quantities, and the only way
    to overflow to ``inf`` with a bounded mantissa). The scan is vectorized over 1 MiB
    chunks (overlapping by a few bytes for runs that cross them): linear time, no Python
    call per character or number. JSON strings hold no raw newlines, so lines survive.
    """
    containers = bare.count("[") + bare.count("{")
    if containers > MAX_JSON_CONTAINERS:
        return f"JSON holds {containers} arrays and objects, more than the limit of {MAX_JSON_CONTAINERS}", None
    raw = np.frombuffer(bare.encode("ascii", "replace"), dtype=np.uint8)  # one byte per character
    run = MAX_NUMBER_CHARS + 1
    depth = 0
    for start in range(0, raw.size, _SCAN_CHUNK):
        chunk = raw[start : start + _SCAN_CHUNK]
        step = (chunk == ord("[")).astype(np.int32) + (chunk == ord("{"))
        step -= (chunk == ord("]")).astype(np.int32) + (chunk == ord("}"))
        running = np.cumsum(step, dtype=np.int64) + depth
        depth = int(running[-1])
        problems: list[tuple[int, str]] = []
        over = np.flatnonzero(running > max_depth)
        if over.size:
            problems.append((int(over[0]), f"JSON nested deeper than the limit of {max_depth} levels"))
        # digits and exponents, looking a little past the chunk's end for runs that cross it
        wide = raw[start : start + _SCAN_CHUNK + run + 4]
        digit = (wide >= ord("0")) & (wide <= ord("9"))
        count = np.concatenate(([0], np.cumsum(digit, dtype=np.int32)))
        long = np.flatnonzero(count[run:] - count[:-run] == run)
        if long.size:
            problems.append((int(long[0]), f"a number has more than the {MAX_NUMBER_CHARS} digits allowed"))
        e = (wide == ord("e")) | (wide == ord("E"))
        sign = (wide == ord("+")) | (wide == ord("-"))
        plain = e[:-3] & digit[1:-2] & digit[2:-1] & digit[3:]
        signed = e[:-4] & sign[1:-3] & digit[2:-2] & digit[3:-1] & digit[4:]
        for big in (np.flatnonzero(plain), np.flatnonzero(signed)):
            if big.size:
                problems.append((int(big[0]), "a number has an exponent of 3 or more digits (numbers must be within 1e±99)"))
        problems = [(pos, why) for pos, why in problems if pos < chunk.size]
        if problems:
            pos, why = min(problems)
            return why, f"line {bare.count(chr(10), 0, start + pos) + 1}"
    return None


class _Refused(Exception):
    """``NaN``/``Infinity`` met while parsing (turned into the caller's error)."""

    def __init__(self, literal: str):
        super().__init__(literal)
        self.literal = literal


def _parse_constant(s: str) -> float:
    raise _Refused(s)


def loads_bounded(
    text: str,
    *,
    source: str,
    error: type[TopomeshError] = TopologyError,
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """``json.loads`` for text someone else wrote (files, peers' store entries).

    Bounded in time and memory, and raising only ``error`` naming ``source`` and the
    line: nesting deeper than ``max_depth`` is refused before parsing (no RecursionError),
    as are more than :data:`MAX_JSON_CONTAINERS` arrays and objects (memory),
    number literals with more than :data:`MAX_NUMBER_CHARS` digits (no 5,000-digit
    integers) and exponents of 3 or more digits (``1e400`` would be ``inf``) are refused
    before parsing (see :func:`_shape_error`), and ``NaN``/``Infinity`` while parsing.
    Callers bound the text's size (:func:`read_bytes`).
    """
    bare = _JSON_STRING.sub('""', text)
    problem = _shape_error(bare, max_depth)
    if problem is not None:
        raise _fail(error, problem[0], source, problem[1])
    try:
        return json.loads(text, parse_constant=_parse_constant)
    except json.JSONDecodeError as exc:
        raise _fail(error, f"not valid JSON ({exc.msg})", source, f"line {exc.lineno} column {exc.colno}") from None
    except _Refused as exc:
        pos = bare.find(exc.literal)
        where = f"line {bare.count(chr(10), 0, pos) + 1}" if pos >= 0 else None
        raise _fail(error, f"{exc.literal} is not a number JSON allows (no NaN or Infinity)", source, where) from None
    except RecursionError:  # only if the caller passed a max_depth beyond the interpreter's stack
        raise _fail(error, "JSON nested too deeply for this interpreter", source) from None


def detect(text: str) -> SourceKind:
    """Which reader a text is for, from its first non-blank characters."""
    head = text.lstrip()[:4096]
    if head.startswith("{"):
        return SourceKind.COMPACT if '"topomesh-compact"' in head else SourceKind.RFC
    if head.startswith("<"):
        return SourceKind.NCCL_XML
    if "GPU0" in head or "Legend" in text or "NIC0" in head or "CPU Affinity" in head:
        return SourceKind.SMI
    raise TopologyError(
        "unrecognised content: expected a v0.1 or compact JSON file, NCCL topology XML or `nvidia-smi topo -m` text"
    )


def parse_text(text: str, *, source: str = "<text>") -> Topology:
    """Parse any supported format; host-level formats give one rank per GPU."""
    try:
        kind = detect(text)
    except TopologyError as exc:
        raise TopologyError(exc.reason, source=source) from None
    if kind in (SourceKind.RFC, SourceKind.COMPACT):
        doc = loads_bounded(text, source=source)
        if isinstance(doc, dict) and doc.get("format") == compact.FORMAT:
            return compact.from_dict(doc, source=source)
        return rfc.from_dict(doc, source=source)
    host = parse_host_text(text, source=source, kind=kind)
    from topomesh.topology.build import single_host_topology

    return single_host_topology(host, source=source)


def parse_host_text(text: str, *, source: str, kind: SourceKind | None = None) -> Host:
    """Parse a host-level format (NCCL XML or smi text) into one :class:`Host`."""
    kind = kind or detect(text)
    if kind is SourceKind.NCCL_XML:
        from topomesh.topology.formats.nccl_xml import parse_nccl_xml

        return parse_nccl_xml(text, source=source)
    if kind is SourceKind.SMI:
        from topomesh.topology.formats.smi import parse_smi_topo

        return parse_smi_topo(text, source=source)
    raise TopologyError(f"{kind.value} describes a world, not one host", source=source)


def read_source(path: str | os.PathLike[str]) -> Topology:
    """Read any supported file, detected by content."""
    return parse_text(_read_text(path), source=str(path))


def load_topology(path: str | os.PathLike[str] | None = None) -> Topology:
    """The topology of this job: ``path``, else the file ``WORLD_TOPOLOGY_FILE`` names.

    Raises :class:`TopologyError` when neither is given or the file is unusable.
    """
    if path is None:
        path = os.environ.get(ENV_VAR)
        if not path:
            raise TopologyError(
                f"{ENV_VAR} is not set: start the job with `topomesh launch` (or the Ray "
                "integration), or pass a path to load_topology()"
            )
    return read_source(path)


def dumps(topo: Topology, form: FileForm | str = FileForm.AUTO, *, dense_max_ranks: int = DENSE_MAX_RANKS) -> str:
    form = FileForm(form)
    if form is FileForm.AUTO:
        form = FileForm.DENSE if topo.world_size <= dense_max_ranks else FileForm.COMPACT
    return rfc.dumps(topo) if form is FileForm.DENSE else compact.dumps(topo)


def read_json(path: str | os.PathLike[str], *, what: str, error: type[TopomeshError]) -> Any:
    """The JSON document in ``path``; a missing, unreadable, oversized or hostile file
    (see :func:`read_bytes`, :func:`loads_bounded`) raises ``error`` as one line naming the
    file and ``what`` it should be (e.g. ``"collective profile"``)."""
    p = Path(path)
    data = read_bytes(p, error=error, what=what)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(f"{p}: cannot read {what} (not UTF-8 text, byte {exc.start})") from None
    return loads_bounded(text, source=f"{p} ({what})", error=error)


_NOT_REGULAR = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def check_writable(path: str | os.PathLike[str]) -> Path:
    """The file :func:`write_atomic` would write for ``path`` (links followed), or
    :class:`~topomesh.errors.OutputError` when it could not: something other than a regular
    file is there, or its directory is missing or not writable. Commands that run for minutes
    call it on their output flags first, so a typo fails before the work, not after it."""
    target = _regular_target(path)
    p = Path(path)
    if not target.parent.is_dir():
        raise OutputError(f"{p}: the directory {target.parent} does not exist")
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise OutputError(f"{p}: the directory {target.parent} is not writable")
    return target


def _regular_target(path: str | os.PathLike[str]) -> Path:
    """The file ``path`` names (links followed), refused when something other than a regular
    file is there (see :func:`write_atomic`)."""
    p = Path(path)
    target = Path(os.path.realpath(p))
    try:
        st = os.stat(target)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode):
            what = next((name for test, name in _NOT_REGULAR if test(st.st_mode)), "not a regular file")
            via = f" (a link to {target})" if p.is_symlink() else ""
            raise OutputError(f"{p}{via} is {what}, not a regular file: refusing to replace it; "
                              "name a regular file or a new path")
    return target


def write_atomic(path: str | os.PathLike[str], data: str | bytes, mode: int = 0o644) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) so readers see the old file or the new one,
    never a partial one: a temporary file in the same directory, renamed over the target.

    Every file a user names (``discover -o``, ``--png``, profiles, caches) is written here.
    ``path`` may be a new file, an existing regular file (replaced, ``mode`` set), or a
    symbolic link to either (followed: the file it names is written, the link stays, as a
    shell's ``>`` does). Anything else already there — a device such as ``/dev/null``, a
    FIFO, a socket, a directory — raises :class:`~topomesh.errors.OutputError` before
    anything is written: the rename would replace the special file itself (``discover -o
    /dev/null`` as root would delete the null device), and a FIFO would block.
    """
    target = _regular_target(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(path)


def save_topology(
    topo: Topology,
    path: str | os.PathLike[str],
    form: FileForm | str = FileForm.AUTO,
    *,
    dense_max_ranks: int = DENSE_MAX_RANKS,
) -> Path:
    """Write ``topo`` atomically in the dense v0.1 form or the compact form."""
    text = dumps(topo, form, dense_max_ranks=dense_max_ranks)
    try:
        return write_atomic(path, text)
    except OutputError:
        raise
    except OSError as exc:
        raise TopologyError(f"cannot write the topology file ({exc.strerror or exc})", source=str(path)) from None
