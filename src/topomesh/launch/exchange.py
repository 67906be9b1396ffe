"""Exchange node descriptions through the rendezvous store and agree on one world.

After a rendezvous round every agent publishes a :class:`NodeEntry` (its host as
:meth:`Host.to_dict`, the global rank / local rank / device of each of its workers, its
restart count and, with ``--topology-probe``, the address of its probe server) under
``<ns>/node/<group_rank>``. The node with group rank 0 (the leader) gathers every entry,
validates it (size limit, JSON, schema: an error names the node), folds hosts that look
alike into one *class* and publishes one zlib-compressed :class:`World` document under
``<ns>/world``. Every agent, the leader included, builds its file from that one document,
which is why the files of one round are byte-identical on all nodes. Store traffic is
O(nodes) at the leader, plus one compressed document per node.

A leader that finds a bad entry publishes the error instead of a world, so every agent
fails with the same sentence naming the bad node.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from topomesh.errors import LaunchError, TopologyError
from topomesh.topology import api
from topomesh.topology.model import Host, RankInfo

NODE_FORMAT = "topomesh-node/1"
WORLD_FORMAT = "topomesh-world/1"
log = logging.getLogger("topomesh.launch")

MAX_NODE_BYTES = 1 << 20
"""Largest node entry or host description accepted from a peer (1 MiB). The fixture DGX
H100 host (8 GPUs, 2 sockets, 8 IB NICs, 108 paths) is about 10 KB."""
MAX_WORLD_BYTES = 256 << 20
"""Largest world document, decompressed (256 MiB); 2,048 8-GPU nodes are a few MB."""
MAX_INT = 2**31 - 1
"""Largest rank, local rank, node index or restart count accepted from a peer: torch's
ranks are 32-bit, and a restart count goes into a file name."""
MAX_SHOWN = 120
"""Longest excerpt of a peer's value quoted in an error message (characters)."""


class PeerMissingError(LaunchError):
    """A node of this rendezvous round published nothing in time (it died or hangs right
    after the rendezvous). The agent answers with a new rendezvous round, as torchrun
    does for a membership change, instead of failing the job."""


class KeyValueStore(Protocol):
    """The part of ``torch.distributed.Store`` the exchange uses."""

    def set(self, key: str, value: bytes | str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def wait(self, keys: list[str], timeout: timedelta) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSlot:
    """One worker of a node as torchrun assigned it."""

    global_rank: int
    local_rank: int
    device: str | None = None
    """Device id on the node's host (``GPU3``, ``CPU0``), None when it has none."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeEntry:
    """What one agent publishes after a rendezvous round."""

    group_rank: int
    host: Host
    workers: tuple[WorkerSlot, ...]
    restart_count: int = 0
    """This agent's restart count (torchrun's ``TORCHELASTIC_RESTART_COUNT``)."""
    probe_addr: str | None = None
    """``host:port`` of this node's probe server, when probing."""
    local_measured: tuple[tuple[str, str, float, float], ...] = ()
    """Measured links between this node's devices, when probing: rows ``(device_a,
    device_b, latency_us, bandwidth_GBps)`` (:mod:`topomesh.launch.localprobe`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class World:
    """Everything a round's topology file is built from, identical on every node."""

    hosts: tuple[Host, ...]
    """One per node, in group-rank order."""
    ranks: tuple[RankInfo, ...]
    """Every worker in global-rank order (torchrun's assignment)."""
    restart_count: int
    """Largest restart count of any node: nodes that restart because a peer failed do
    not count a restart themselves, so their own counts can differ."""
    measured: Mapping[tuple[int, int], tuple[float, float]] = dataclasses.field(default_factory=dict)
    """Probe results by node pair ``(a, b)``, ``a < b``: ``(latency_us, bandwidth_GBps)``
    (see :mod:`topomesh.launch.probe`)."""
    local_measured: Mapping[int, tuple[tuple[str, str, float, float], ...]] = dataclasses.field(default_factory=dict)
    """Measured links between the devices of one node, by node (see ``NodeEntry``)."""


def node_key(ns: str, group_rank: int) -> str:
    return f"{ns}/node/{group_rank}"


def world_key(ns: str) -> str:
    return f"{ns}/world"


def class_key(ns: str, digest_: str) -> str:
    return f"{ns}/hostclass/{digest_}"


def host_class(host: Host) -> tuple[str, bytes]:
    """A host's description without its name, and the digest that names it.

    Nodes that look alike publish the same bytes under the same key, so the leader
    fetches and validates each kind of node once, however many nodes there are.
    """
    body = json.dumps(_host_class(host), separators=(",", ":"), sort_keys=True).encode()
    return hashlib.sha256(body).hexdigest()[:32], body


def encode_node(entry: NodeEntry) -> bytes:
    """The small per-node document; the host itself travels as :func:`host_class`.

    >>> from topomesh.topology.model import Host
    >>> e = NodeEntry(group_rank=1, host=Host(hostname="n1"),
    ...               workers=(WorkerSlot(global_rank=2, local_rank=0),))
    >>> classes = HostClasses()
    >>> _ = classes.add(*host_class(e.host), group_rank=1)
    >>> decode_node(encode_node(e), group_rank=1, classes=classes) == e
    True
    """
    doc = {
        "format": NODE_FORMAT,
        "group_rank": entry.group_rank,
        "hostname": entry.host.hostname,
        "host_class": host_class(entry.host)[0],
        "workers": [[w.global_rank, w.local_rank, w.device] for w in entry.workers],
        "restart_count": entry.restart_count,
        "probe_addr": entry.probe_addr,
    }
    if entry.local_measured:
        doc["local_measured"] = [list(r) for r in entry.local_measured]
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def publish_node(store: KeyValueStore, ns: str, entry: NodeEntry) -> None:
    """Publish this node's host class (idempotent) and then its entry."""
    digest_, body = host_class(entry.host)
    store.set(class_key(ns, digest_), body)
    store.set(node_key(ns, entry.group_rank), encode_node(entry))


def _node_error(group_rank: int, why: str) -> LaunchError:
    return LaunchError(f"node {group_rank} published a topology entry that was rejected: {why}")


def _show(value: Any) -> str:
    """``repr(value)`` cut to :data:`MAX_SHOWN` characters, for error messages (a peer's
    value can be a megabyte long; repr escapes control characters)."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"<{type(value).__name__} nested too deep>"
    return text if len(text) <= MAX_SHOWN else f"{text[: MAX_SHOWN - 3]}..."


def _int(value: Any, what: str, *, low: int = 0, high: int = MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} must be an integer from {low} to {high}, got {_show(value)}")
    return value


def _number(value: Any, what: str) -> float:
    """A JSON number (not a bool, not a string) as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} must be a number, got {_show(value)}")
    return float(value)


def loads_peer(blob: bytes) -> Any:
    """Parse JSON that another node wrote, with bounded cost and only finite numbers.

    The caller has already checked the size. The parse is
    :func:`topomesh.topology.api.loads_bounded`, the one used for files: nesting deeper
    than 64 levels, number literals of more than 40 digits, exponents of 3 or more digits
    and ``NaN``/``Infinity`` are refused before they cost anything. Every refusal is a
    ``ValueError`` with the reason and the line.

    >>> loads_peer(b'{"a": [1, 2.5]}')
    {'a': [1, 2.5]}
    >>> loads_peer(b"[" * 100_000)
    Traceback (most recent call last):
    ...
    ValueError: JSON nested deeper than the limit of 64 levels (line 1)
    """
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 (byte {exc.start})") from None
    try:
        return api.loads_bounded(text, source="entry", error=TopologyError)
    except TopologyError as exc:
        raise ValueError(f"{exc.reason} ({exc.where})" if exc.where else exc.reason) from None


class HostClasses:
    """Validated host classes by digest; fetches unknown ones with ``fetch(digest, group_rank)``."""

    def __init__(self, fetch: Callable[[str, int], bytes] | None = None, *, max_bytes: int = MAX_NODE_BYTES) -> None:
        self._fetch = fetch
        self._max_bytes = max_bytes
        self._hosts: dict[str, Host] = {}

    def add(self, digest_: str, body: bytes, *, group_rank: int) -> Host:
        """Validate the class ``body`` that node ``group_rank`` published as ``digest_``."""
        if len(body) > self._max_bytes:
            raise _node_error(group_rank, f"its host description is {len(body)} bytes, more than the limit of {self._max_bytes}")
        if hashlib.sha256(body).hexdigest()[:32] != digest_:
            raise _node_error(group_rank, f"its host description does not match its digest {digest_!r}")
        try:
            raw = loads_peer(body)
            if not isinstance(raw, dict):
                raise ValueError("the host description is not a JSON object")
            # from_dict checks every field's JSON type, so a peer cannot smuggle in a
            # string index or a NaN speed
            host = Host.from_dict({**raw, "hostname": "class"}, source=f"node {group_rank}")
        except TopologyError as exc:
            raise _node_error(group_rank, exc.reason) from None
        except (ValueError, TypeError, RecursionError) as exc:
            raise _node_error(group_rank, f"malformed host description ({exc})") from None
        self._hosts[digest_] = host
        return host

    def get(self, digest_: str, *, group_rank: int) -> Host:
        host = self._hosts.get(digest_)
        if host is not None:
            return host
        if self._fetch is None:
            raise _node_error(group_rank, f"it names host class {digest_!r}, which nobody published")
        return self.add(digest_, self._fetch(digest_, group_rank), group_rank=group_rank)


def decode_node(
    blob: bytes, *, group_rank: int, classes: HostClasses, max_bytes: int = MAX_NODE_BYTES
) -> NodeEntry:
    """Parse and validate the entry published by node ``group_rank``.

    Raises :class:`LaunchError` naming the node when the entry (or its host class) is too
    large, not JSON, of another format, or places workers on devices its host lacks.
    """
    if len(blob) > max_bytes:
        raise _node_error(group_rank, f"it is {len(blob)} bytes, more than the limit of {max_bytes}")
    try:
        doc = loads_peer(blob)
        if not isinstance(doc, dict):
            raise ValueError("expected a JSON object")
        if doc.get("format") != NODE_FORMAT:
            raise ValueError(f"format is {_show(doc.get('format'))}, expected {NODE_FORMAT!r}")
        if doc.get("group_rank") != group_rank:
            raise ValueError(f"it claims group rank {_show(doc.get('group_rank'))}")
        name, digest_ = doc.get("hostname"), doc.get("host_class")
        if not isinstance(name, str) or not name or len(name) > 255 or not name.isprintable():
            raise ValueError(f"hostname must be a non-empty printable string of at most 255 characters, got {_show(name)}")
        if not isinstance(digest_, str):
            raise ValueError(f"host_class must be a string, got {_show(digest_)}")
        host = classes.get(digest_, group_rank=group_rank).renamed(name)
        raw_workers = doc.get("workers")
        if not isinstance(raw_workers, list) or not raw_workers:
            raise ValueError("workers must be a non-empty list")
        workers = []
        for w in raw_workers:
            if not isinstance(w, list) or len(w) != 3:
                raise ValueError(f"worker {_show(w)} is not [global_rank, local_rank, device]")
            dev = w[2]
            if dev is not None:
                if not isinstance(dev, str):
                    raise ValueError(f"device {_show(dev)} is not a string")
                host.device(dev)
            workers.append(
                WorkerSlot(
                    global_rank=_int(w[0], "global rank"), local_rank=_int(w[1], "local rank"), device=dev
                )
            )
        # torchrun numbers a node's workers 0..n-1; the file's reader refuses anything else
        local = sorted(w.local_rank for w in workers)
        if local != list(range(len(workers))):
            raise ValueError(f"its {len(workers)} workers have local ranks {_show(local)}, not 0..{len(workers) - 1}")
        if len({w.global_rank for w in workers}) != len(workers):
            raise ValueError("two of its workers have the same global rank")
        return NodeEntry(
            group_rank=group_rank,
            host=host,
            workers=tuple(workers),
            restart_count=_int(doc.get("restart_count"), "restart_count"),
            probe_addr=_probe_addr(doc.get("probe_addr")),
            local_measured=_local_rows(doc.get("local_measured", []), host),
        )
    except TopologyError as exc:
        raise _node_error(group_rank, exc.reason) from None
    except (ValueError, TypeError, RecursionError) as exc:
        raise _node_error(group_rank, str(exc)) from None


def _probe_addr(raw: Any) -> str | None:
    """``host:port`` of a peer's probe server, checked so that connecting cannot fail oddly."""
    if raw is None:
        return None
    if not isinstance(raw, str) or len(raw) > 300:
        raise ValueError(f"probe_addr {_show(raw)} is not a host:port string")
    host, _, port = raw.rpartition(":")
    if not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"probe_addr {_show(raw)} is not host:port with a port from 1 to 65535")
    return raw


def _local_rows(raw: Any, host: Host) -> tuple[tuple[str, str, float, float], ...]:
    """Validated local probe rows: devices of ``host``, finite positive figures."""
    if not isinstance(raw, list):
        raise ValueError("local_measured must be a list")
    rows = []
    for row in raw:
        if not isinstance(row, list) or len(row) != 4 or not all(isinstance(d, str) for d in row[:2]):
            raise ValueError(f"local_measured row {_show(row)} is not [device_a, device_b, latency_us, bandwidth_GBps]")
        a, b = row[0], row[1]
        host.device(a), host.device(b)
        lat, bw = _number(row[2], "latency_us"), _number(row[3], "bandwidth_GBps")
        if not (0 < lat < 1e9 and 0 < bw < 1e6):
            raise ValueError(f"impossible local_measured row {_show(row)}")
        rows.append((a, b, lat, bw))
    return tuple(rows)


def _host_class(host: Host) -> dict[str, Any]:
    d = host.to_dict()
    d.pop("hostname")
    return d


def assemble_world(entries: Sequence[NodeEntry], measured: Sequence[Sequence[Any]] = ()) -> bytes:
    """The leader's world document: host classes, nodes, workers and probe results.

    Checks what no single entry can: the global ranks are exactly ``0..world_size-1``.
    A host name reported by several nodes gets ``~<group_rank>`` appended after its first
    use, so each node is its own host. ``measured`` rows are
    ``[node_a, node_b, latency_us, bandwidth_GBps]`` with ``node_a < node_b``.
    """
    seen: set[str] = set()
    hostnames = []
    for e in entries:
        name = e.host.hostname
        if name in seen:
            # several agents on one host (tests, or one agent per socket): torchrun treats
            # them as separate nodes, so they are separate hosts here, told apart by rank
            name = f"{name}~{e.group_rank}"
            log.warning("topomesh: node %d reports a host name already taken; calling it %r", e.group_rank, name)
        seen.add(name)
        hostnames.append(name)
    ranks = sorted(w.global_rank for e in entries for w in e.workers)
    if ranks != list(range(len(ranks))):
        raise LaunchError(f"the nodes' global ranks are {ranks[:16]}..., not 0..{len(ranks) - 1}")
    classes: list[dict[str, Any]] = []
    index: dict[tuple[Any, ...], int] = {}
    nodes = []
    for e, name in zip(entries, hostnames, strict=True):
        key = (e.host.devices, e.host.nics, e.host.paths)
        if key not in index:
            index[key] = len(classes)
            classes.append(_host_class(e.host))
        node: dict[str, Any] = {
            "hostname": name,
            "class": index[key],
            "workers": [[w.global_rank, w.local_rank, w.device] for w in e.workers],
        }
        if e.local_measured:
            node["local_measured"] = [list(r) for r in e.local_measured]
        nodes.append(node)
    doc = {
        "format": WORLD_FORMAT,
        "restart_count": max((e.restart_count for e in entries), default=0),
        "classes": classes,
        "nodes": nodes,
        "measured": [list(m) for m in measured],
    }
    return zlib.compress(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode(), 6)


MAX_ERROR_CHARS = 2000
"""Longest error sentence the leader publishes or a node repeats from it."""


def error_document(message: str, *, missing: bool = False) -> bytes:
    """What the leader publishes instead of a world when an entry was rejected, or (with
    ``missing``) when a node published nothing, which the others answer with a new round."""
    key = "missing" if missing else "error"
    return zlib.compress(json.dumps({"format": WORLD_FORMAT, key: message[:MAX_ERROR_CHARS]}).encode())


def decode_world(blob: bytes, *, max_bytes: int = MAX_WORLD_BYTES) -> World:
    """Parse the leader's document; raises :class:`LaunchError` with the leader's error."""
    try:
        d = zlib.decompressobj()
        raw = d.decompress(blob, max_bytes)
        if d.unconsumed_tail:
            raise LaunchError(f"the world document from node 0 is larger than {max_bytes} bytes")
        doc = loads_peer(raw)
    except (zlib.error, ValueError) as exc:
        raise LaunchError(f"the world document from node 0 is unreadable ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != WORLD_FORMAT:
        raise LaunchError("the world document from node 0 has an unknown format")
    if "error" in doc:
        raise LaunchError(str(doc["error"])[:MAX_ERROR_CHARS])
    if "missing" in doc:
        raise PeerMissingError(str(doc["missing"])[:MAX_ERROR_CHARS])
    try:
        classes = [Host.from_dict({**c, "hostname": "class"}, source="world") for c in doc["classes"]]
        hosts: list[Host] = []
        slots: list[tuple[int, int, int, str | None]] = []
        local_rows: dict[int, tuple[tuple[str, str, float, float], ...]] = {}
        for h, node in enumerate(doc["nodes"]):
            base = classes[_int(node["class"], "class")]
            hosts.append(base.renamed(str(node["hostname"])))
            if node.get("local_measured"):
                local_rows[h] = _local_rows(node["local_measured"], base)
            for g, local, dev in node["workers"]:
                slots.append((_int(g, "global rank"), h, _int(local, "local rank"), dev))
        slots.sort()
        if [s[0] for s in slots] != list(range(len(slots))):
            raise ValueError("global ranks have gaps")
        ranks = [RankInfo(rank=g, host=h, local_rank=local, device=dev) for g, h, local, dev in slots]
        measured = {
            (_int(a, "node"), _int(b, "node")): (_number(lat, "latency_us"), _number(bw, "bandwidth_GBps"))
            for a, b, lat, bw in doc["measured"]
        }
        for a, b in measured:
            if not 0 <= a < b < len(hosts):
                raise ValueError(f"measured node pair ({a}, {b}) is not two nodes in order")
        return World(
            hosts=tuple(hosts),
            ranks=tuple(ranks),
            restart_count=_int(doc["restart_count"], "restart_count"),
            measured=measured,
            local_measured=local_rows,
        )
    except (KeyError, TypeError, ValueError, IndexError, TopologyError) as exc:
        raise LaunchError(f"the world document from node 0 is malformed ({exc})") from None


def wait_for(store: KeyValueStore, key: str, timeout_s: float, *, what: str) -> bytes:
    """``store.get(key)`` that gives up after ``timeout_s`` with a sentence naming ``what``."""
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except Exception as exc:  # the store raises DistStoreError / RuntimeError on timeout
        raise PeerMissingError(
            f"{what} did not publish its topology within {timeout_s:g} s ({type(exc).__name__}); "
            "is every node running `topomesh launch` with the same topology options?"
        ) from None
    return store.get(key)


def digest(text: str) -> str:
    """Short content hash used in file names: equal files get equal names."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def probe_key(ns: str, group_rank: int) -> str:
    return f"{ns}/probe/{group_rank}"


def lead(
    store: KeyValueStore,
    ns: str,
    world_size: int,
    timeout_s: float,
    *,
    probe_timeout_s: float | None = None,
) -> None:
    """The leader's part: gather and validate every node entry, publish the world.

    With ``probe_timeout_s`` it also gathers each node's probe result. On a rejected entry
    it publishes the error for the other nodes and raises it; on a node that published
    nothing in time it publishes that too and raises :class:`PeerMissingError`.
    """
    try:
        classes = HostClasses(lambda d, g: wait_for(store, class_key(ns, d), timeout_s, what=f"node {g}"))
        entries = [
            decode_node(wait_for(store, node_key(ns, g), timeout_s, what=f"node {g}"), group_rank=g, classes=classes)
            for g in range(world_size)
        ]
        rows = gather_probes(store, ns, world_size, probe_timeout_s) if probe_timeout_s is not None else []
        doc = assemble_world(entries, rows)
    except LaunchError as exc:
        store.set(world_key(ns), error_document(str(exc), missing=isinstance(exc, PeerMissingError)))
        raise
    store.set(world_key(ns), doc)


def fetch_world(store: KeyValueStore, ns: str, timeout_s: float) -> World:
    """Every node's part: wait for the leader's document and parse it."""
    return decode_world(wait_for(store, world_key(ns), timeout_s, what="node 0 (the leader)"))


def gather_probes(store: KeyValueStore, ns: str, world_size: int, timeout_s: float) -> list[list[Any]]:
    """Node-pair rows ``[a, b, latency_us, bandwidth_GBps]`` from every node's probe result.

    A node that could not measure its peer publishes ``{"peer": p}`` only: that pair keeps
    its defaults. Of two measurements of one pair (two-node rings) the first is kept.
    """
    rows: dict[tuple[int, int], list[Any]] = {}
    for g in range(world_size):
        raw = wait_for(store, probe_key(ns, g), timeout_s, what=f"node {g}")
        if len(raw) > 4096:
            raise _node_error(g, f"its probe result is {len(raw)} bytes, more than 4096")
        try:
            res = loads_peer(raw)
            if not isinstance(res, dict):
                raise ValueError("not a JSON object")
            peer = _int(res.get("peer"), "peer")
            if "latency_us" not in res:
                continue
            lat, bw = _number(res["latency_us"], "latency_us"), _number(res.get("bandwidth_GBps"), "bandwidth_GBps")
        except (ValueError, TypeError) as exc:
            raise _node_error(g, f"malformed probe result ({exc})") from None
        if peer >= world_size or peer == g or not (0 < lat < 1e9 and 0 < bw < 1e6):
            raise _node_error(g, f"impossible probe result {_show(res)}")
        key = (min(g, peer), max(g, peer))
        rows.setdefault(key, [key[0], key[1], round(lat, 3), round(bw, 3)])
    return [rows[k] for k in sorted(rows)]
