"""Reading and writing topologies: the API trainers and every CLI command use.

``load_topology()`` is what a training script calls: it reads ``WORLD_TOPOLOGY_FILE``
(set by ``topomesh launch`` and the Ray integration) or an explicit path, in the dense
v0.1 form or the compact form. ``read_source()`` also takes NCCL topology XML and
``nvidia-smi topo -m`` text, detected by content.
"""

from __future__ import annotations

import json
import os
import tempfile
from enum import StrEnum
from pathlib import Path
from typing import Any

from topomesh.errors import TopologyError, TopomeshError
from topomesh.topology.formats import compact, rfc
from topomesh.topology.model import Host, Topology

ENV_VAR = "WORLD_TOPOLOGY_FILE"
DENSE_MAX_RANKS = 128
"""Worlds larger than this are written in the compact form unless dense is asked for.

A dense file holds ranks² connection objects (~200 bytes each): 128 ranks is ~3 MB."""
MAX_FILE_BYTES = 512 * 1024 * 1024


class FileForm(StrEnum):
    AUTO = "auto"
    DENSE = "dense"  # RFC v0.1, every pair
    COMPACT = "compact"


class SourceKind(StrEnum):
    RFC = "rfc-v0.1"
    COMPACT = "compact"
    NCCL_XML = "nccl-xml"
    SMI = "nvidia-smi"


def _read_text(path: str | os.PathLike[str]) -> str:
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise TopologyError(f"file is {size} bytes, more than the {MAX_FILE_BYTES} this reader accepts", source=str(p))
        return p.read_text(encoding="utf-8-sig")  # tolerate a byte-order mark
    except FileNotFoundError:
        raise TopologyError("no such file", source=str(p)) from None
    except IsADirectoryError:
        raise TopologyError("is a directory, not a topology file", source=str(p)) from None
    except UnicodeDecodeError as exc:
        raise TopologyError(f"not UTF-8 text (byte {exc.start})", source=str(p)) from None
    except OSError as exc:
        raise TopologyError(f"cannot read ({exc.strerror})", source=str(p)) from None


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
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TopologyError(f"not valid JSON ({exc.msg})", source=source, where=f"line {exc.lineno} column {exc.colno}") from None
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
    """The JSON document in ``path``; a missing or unreadable file raises ``error`` as one
    line naming the file and ``what`` it should be (e.g. ``"collective profile"``)."""
    p = Path(path)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise error(f"{p}: no such {what}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{p}: cannot read {what} ({exc})") from None


def write_atomic(path: str | os.PathLike[str], data: str | bytes, mode: int = 0o644) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) so readers see the old file or the new one,
    never a partial one."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


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
    except OSError as exc:
        raise TopologyError(f"cannot write the topology file ({exc.strerror or exc})", source=str(path)) from None
