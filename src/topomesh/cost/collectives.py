"""Collective costs: alpha-beta models per collective × link kind, fitted or from NCCL.

Every model prices a collective of ``n`` ranks on a buffer of ``B`` bytes (the per-rank
buffer of :class:`~topomesh.trace.graph.CollectiveRecord`) as the cheapest (``min``) or
the size-selected (``piecewise``) of its terms, each

    t = alpha + hop × steps(kind, n) + factor(kind, n) × B / busbw

``factor`` is nccl-tests' bus-bandwidth factor (doc/PERFORMANCE.md): 2(n-1)/n for
all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for broadcast and
send/recv; ``steps`` is the ring's step count NCCL's tuning model charges per-hop latency
for (2(n-1) for all-reduce, n-1 for the others, 1 for send/recv). So ``busbw`` is directly
the bus bandwidth nccl-tests reports, and a term with ``busbw_GBps = None`` takes the
bandwidth of the link it runs on (:class:`~topomesh.topology.model.Connection`, whose
defaults are NCCL's topo.h figures).

Profiles: ``data/collectives/*.json`` ship defaults from published figures (NCCL
constants, nccl-tests bus bandwidths quoted by NVIDIA engineers); ``topomesh calibrate``
writes measured ones (:mod:`topomesh.cost.calibrate`).

>>> from topomesh.trace.graph import CollectiveKind, CollectiveRecord
>>> p = builtin_profile("nccl-default")
>>> ar = CollectiveRecord(kind=CollectiveKind.ALL_REDUCE, bytes=2**30, group_size=8)
>>> round(collective_time_s(ar, LinkKind.NVSWITCH, p) * 1e3, 2)  # ms, 1 GiB over 20 GB/s NVLink defaults
94.01
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import cache
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from topomesh.errors import CalibrationError
from topomesh.topology.api import read_json
from topomesh.topology.defaults import default_connection
from topomesh.topology.model import Connection, LinkKind
from topomesh.trace.graph import CollectiveKind, CollectiveRecord

PROFILE_VERSION = 1
PIECEWISE_MARGIN = 0.9
"""The piecewise model replaces alpha-beta only when its held-out error is below 90% of alpha-beta's."""

JOINT_GOOD_ENOUGH = 0.01
"""A joint fit within 1 % of a group size's held-out points keeps that size (no model of its
own, :func:`fit_collective`): below that, the two errors differ by rounding, not by form."""


def bus_factor(kind: CollectiveKind, n: int) -> float:
    """nccl-tests' busbw / algbw factor for ``kind`` on ``n`` ranks.

    >>> bus_factor(CollectiveKind.ALL_REDUCE, 8), bus_factor(CollectiveKind.ALL_GATHER, 4)
    (1.75, 0.75)
    """
    if n <= 1:
        return 0.0
    if kind is CollectiveKind.ALL_REDUCE:
        return 2.0 * (n - 1) / n
    if kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_TO_ALL):
        return (n - 1) / n
    return 1.0


def ring_steps(kind: CollectiveKind, n: int) -> int:
    """Latency steps of a ring of ``n`` ranks (NCCL tuning.cc ``nsteps``; 1 for send/recv).

    >>> ring_steps(CollectiveKind.ALL_REDUCE, 8), ring_steps(CollectiveKind.SEND_RECV, 2)
    (14, 1)
    """
    if n <= 1:
        return 0
    if kind is CollectiveKind.ALL_REDUCE:
        return 2 * (n - 1)
    if kind is CollectiveKind.SEND_RECV:
        return 1
    return n - 1


class Select(StrEnum):
    MIN = "min"
    """The fastest term (NCCL picks the fastest protocol per size)."""
    PIECEWISE = "piecewise"
    """The first term whose ``upto_bytes`` covers the size."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Term:
    alpha_us: float
    hop_us: float = 0.0
    busbw_GBps: float | None = None
    """Bus bandwidth; None = the link's bandwidth times ``bw_scale``."""
    bw_scale: float = 1.0
    upto_bytes: int | None = None
    """Largest size this term covers (piecewise models); None = no limit."""

    def time_s(self, kind: CollectiveKind, n: int, nbytes: float, link_GBps: float) -> float:
        bw = (self.busbw_GBps if self.busbw_GBps is not None else link_GBps) * self.bw_scale
        return (self.alpha_us + self.hop_us * ring_steps(kind, n)) * 1e-6 + bus_factor(kind, n) * nbytes / (bw * 1e9)


@dataclass(frozen=True, slots=True, kw_only=True)
class FitError:
    """Relative error |predicted - measured| / measured on sizes held out from the fit."""

    mean_rel: float
    max_rel: float
    train_points: int
    heldout_points: int
    alternatives: Mapping[str, float] = field(default_factory=dict)
    """Held-out mean relative error of every candidate model, by model name."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveModel:
    collective: CollectiveKind
    link: LinkKind
    terms: tuple[Term, ...]
    select: Select = Select.MIN
    name: str = "alpha_beta"
    source: str = ""
    fit: FitError | None = None
    by_group: Mapping[int, CollectiveModel] = field(default_factory=dict)
    """Models fitted on one group size's points alone, used for that size instead of
    ``terms`` (:func:`fit_collective`); ``terms`` price the sizes not measured."""

    def __post_init__(self) -> None:
        if not self.terms:
            raise CalibrationError(f"collective model {self.collective}/{self.link} has no terms")
        object.__setattr__(self, "by_group", MappingProxyType(dict(self.by_group)))

    def time_s(self, n: int, nbytes: float, link_GBps: float) -> float:
        if n <= 1:
            return 0.0
        own = self.by_group.get(n)
        if own is not None:
            return own.time_s(n, nbytes, link_GBps)
        if self.select is Select.PIECEWISE:
            for t in self.terms:
                if t.upto_bytes is None or nbytes <= t.upto_bytes:
                    return t.time_s(self.collective, n, nbytes, link_GBps)
            return self.terms[-1].time_s(self.collective, n, nbytes, link_GBps)
        return min(t.time_s(self.collective, n, nbytes, link_GBps) for t in self.terms)


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveProfile:
    name: str
    backend: str
    source: str
    models: Mapping[tuple[CollectiveKind, LinkKind], CollectiveModel]
    cluster_fingerprint: str | None = None
    fallback: CollectiveProfile | None = None
    """Consulted for (collective, link) pairs this profile has no model for."""
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))

    def model(self, kind: CollectiveKind, link: LinkKind) -> CollectiveModel:
        got = self.models.get((kind, link))
        if got is None:
            # Same speed class (e.g. NVLink for NVSwitch, PIX for PXB is not: tiers differ).
            got = next((m for (k, lk), m in self.models.items() if k is kind and lk.tier == link.tier), None)
        if got is None and self.fallback is not None:
            return self.fallback.model(kind, link)
        if got is None:
            have = sorted({lk.value for (_, lk) in self.models})
            raise CalibrationError(
                f"collective profile {self.name!r} has no model for {kind.value} over {link.value} links "
                f"(it covers {', '.join(have) or 'nothing'}); calibrate on such links or add a fallback profile"
            )
        return got

    def with_fallback(self, fallback: CollectiveProfile) -> CollectiveProfile:
        return replace(self, fallback=fallback)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION,
            "name": self.name,
            "backend": self.backend,
            "source": self.source,
            "cluster_fingerprint": self.cluster_fingerprint,
            "meta": dict(self.meta),
            "models": [_model_to_dict(m) for m in self.models.values()],
        }


def _model_to_dict(m: CollectiveModel) -> dict[str, Any]:
    out: dict[str, Any] = {
        "collective": m.collective.value,
        "link": m.link.value,
        "model": m.name,
        "select": m.select.value,
        "terms": [{k: getattr(t, k) for k in ("alpha_us", "hop_us", "busbw_GBps", "bw_scale", "upto_bytes")}
                  for t in m.terms],
        "source": m.source,
    }
    if m.fit is not None:
        out["fit_error"] = {
            "mean_rel": m.fit.mean_rel, "max_rel": m.fit.max_rel, "train_points": m.fit.train_points,
            "heldout_points": m.fit.heldout_points, "alternatives": dict(m.fit.alternatives),
        }
    if m.by_group:
        out["by_group"] = [{"group_size": n, **_model_to_dict(g)} for n, g in sorted(m.by_group.items())]
    return out


def _model_from_dict(m: Any) -> CollectiveModel:
    fe = m.get("fit_error")
    by_group: dict[int, CollectiveModel] = {}
    for g in m.get("by_group", ()):
        n = g["group_size"]
        if type(n) is not int or n < 2 or n in by_group:
            raise ValueError(f"by_group has group_size {n!r} (an integer >= 2, once)")
        by_group[n] = _model_from_dict(g)
    return CollectiveModel(
        collective=CollectiveKind(m["collective"]),
        link=LinkKind.parse(m["link"]),
        terms=tuple(Term(**t) for t in m["terms"]),
        select=Select(m.get("select", "min")),
        name=str(m.get("model", "alpha_beta")),
        source=str(m.get("source", "")),
        fit=FitError(**fe) if fe else None,
        by_group=by_group,
    )


def profile_from_dict(raw: Any, *, source: str = "profile") -> CollectiveProfile:
    """Parse a profile JSON object; raises :class:`CalibrationError` naming the bad field."""
    try:
        if raw.get("version") != PROFILE_VERSION:
            raise ValueError(f"version {raw.get('version')!r}, expected {PROFILE_VERSION}")
        models: dict[tuple[CollectiveKind, LinkKind], CollectiveModel] = {}
        for i, m in enumerate(raw["models"]):
            model = _model_from_dict(m)
            key = (model.collective, model.link)
            if key in models:
                raise ValueError(f"models[{i}] repeats {key[0].value}/{key[1].value}")
            models[key] = model
        return CollectiveProfile(
            name=str(raw["name"]), backend=str(raw["backend"]), source=str(raw.get("source", "")),
            models=models, cluster_fingerprint=raw.get("cluster_fingerprint"), meta=dict(raw.get("meta", {})),
        )
    except CalibrationError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CalibrationError(f"{source}: malformed collective profile ({exc})") from None


def load_profile(path: str | Path) -> CollectiveProfile:
    raw = read_json(path, what="collective profile", error=CalibrationError)
    return profile_from_dict(raw, source=str(path))


def builtin_profile_names() -> list[str]:
    root = resources.files("topomesh.cost").joinpath("data/collectives")
    return sorted(e.name.removesuffix(".json") for e in root.iterdir() if e.name.endswith(".json"))


@cache
def builtin_profile(name: str) -> CollectiveProfile:
    """A shipped default profile (``nccl-default``, ``nccl-dgx-a100``, ``nccl-dgx-h100``, ...).

    Every profile but ``nccl-default`` falls back to ``nccl-default`` for links it does
    not cover.
    """
    names = builtin_profile_names()
    if name not in names:
        raise CalibrationError(f"no built-in collective profile {name!r}; available: {', '.join(names)}")
    text = resources.files("topomesh.cost").joinpath(f"data/collectives/{name}.json").read_text()
    prof = profile_from_dict(json.loads(text), source=f"built-in {name}")
    return prof if name == "nccl-default" else prof.with_fallback(builtin_profile("nccl-default"))


def collective_time_s(record: CollectiveRecord, link: Connection | LinkKind, profile: CollectiveProfile) -> float:
    """Seconds one collective takes over ``link`` (the slowest link of its group), pure.

    A :class:`LinkKind` alone takes that kind's default bandwidth (NCCL topo.h figures).
    """
    conn = default_connection(link) if isinstance(link, LinkKind) else link
    model = profile.model(record.kind, conn.kind)
    return model.time_s(record.group_size, float(record.bytes), conn.bandwidth_GBps)


def inter_steps(kind: CollectiveKind, nodes: int) -> int:
    """Ring steps NCCL charges at the network latency when a group spans ``nodes`` nodes
    (tuning.cc ``nInterSteps``; 1 for send/recv, which crosses the network once).

    >>> inter_steps(CollectiveKind.ALL_REDUCE, 4), inter_steps(CollectiveKind.ALL_GATHER, 4)
    (8, 3)
    """
    if nodes <= 1:
        return 0
    if kind is CollectiveKind.ALL_REDUCE:
        return 2 * nodes
    if kind is CollectiveKind.SEND_RECV:
        return 1
    if kind is CollectiveKind.BROADCAST:
        return nodes
    return nodes - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class TreeConstants:
    """NCCL's tree all-reduce constants (``data/nccl_hierarchy.json``), per protocol."""

    base_us: Mapping[str, float]
    intra_hop_us: Mapping[str, Mapping[str, float]]
    """Per intra-node hardware class (``NVLink``, ``PCI``), per protocol."""
    inter_hop_us: Mapping[str, float]
    busbw_scale: Mapping[str, float]
    algbw_ratio: float


@cache
def tree_constants() -> TreeConstants:
    raw = json.loads(resources.files("topomesh.cost").joinpath("data/nccl_hierarchy.json").read_text())
    return TreeConstants(base_us=raw["tree_base_us"], intra_hop_us=raw["tree_intra_hop_us"],
                         inter_hop_us=raw["tree_inter_hop_us"], busbw_scale=raw["tree_busbw_scale"],
                         algbw_ratio=float(raw["tree_algbw_ratio"]))


def hierarchical_time_s(record: CollectiveRecord, *, inter_kind: LinkKind, intra_kind: LinkKind, nodes: int,
                        ranks_per_node: int, network_GBps: float, profile: CollectiveProfile) -> float:
    """Seconds one collective takes on a group spanning ``nodes`` nodes, NCCL-like; pure.

    ``network_GBps`` is the bus bandwidth the group gets from the network (a rail share,
    :class:`topomesh.cost.cluster.AxisLink`). The fastest of:

    * a ring per term (protocol) of the profile's ``inter_kind`` model: the term's base
      latency, :func:`inter_steps` hops at its (network) hop latency and the remaining
      :func:`ring_steps` at the hop latency of the ``intra_kind`` model's term of the same
      index (protocols pair up by position, LL then Simple in the shipped profiles), plus
      ``bus_factor × bytes / (busbw × bw_scale)`` with busbw = the term's own, else ``network_GBps``;
    * for all-reduce, NCCL's tree (LL and Simple, :func:`tree_constants`): latency
      ``base + 2·((ranks_per_node − 1)·intra_hop + ⌊log2 nodes⌋·inter_hop)``, bandwidth
      ``bytes / (ratio · scale · busbw)`` with busbw the best ring term's.

    DGX A100, all-reduce of 1 GiB over 4 nodes, 1 rank per node, one 25 GB/s HDR rail
    each, ``nccl-dgx-a100`` (IB Simple term: 8.4 µs + 14 µs per step, 0.96 of the rail):
    ring 8.4 + 6 × 14 = 92.4 µs + 1.5 × 2³⁰ B / 24 GB/s = 67.2013 ms.
    """
    n = record.group_size
    if n <= 1:
        return 0.0
    if nodes <= 1:
        raise CalibrationError(f"hierarchical_time_s prices groups spanning nodes; got {nodes} node(s)")
    inter = profile.model(record.kind, inter_kind)
    intra = profile.model(record.kind, intra_kind) if ranks_per_node > 1 else None
    nbytes = float(record.bytes)
    steps = ring_steps(record.kind, n)
    net_steps = min(inter_steps(record.kind, nodes), steps)
    factor = bus_factor(record.kind, n)
    best = float("inf")
    best_bw = 0.0
    for i, term in enumerate(inter.terms):
        bw = (term.busbw_GBps if term.busbw_GBps is not None else network_GBps) * term.bw_scale
        intra_hop = intra.terms[min(i, len(intra.terms) - 1)].hop_us if intra is not None else 0.0
        lat_us = term.alpha_us + net_steps * term.hop_us + (steps - net_steps) * intra_hop
        best = min(best, lat_us * 1e-6 + factor * nbytes / (bw * 1e9))
        best_bw = max(best_bw, bw)
    if record.kind is CollectiveKind.ALL_REDUCE:
        tc = tree_constants()
        hw = "NVLink" if intra_kind.is_nvlink or intra_kind is LinkKind.LOC else "PCI"
        for proto, base in tc.base_us.items():
            lat_us = base + 2 * ((ranks_per_node - 1) * tc.intra_hop_us[hw][proto]
                                 + (nodes.bit_length() - 1) * tc.inter_hop_us[proto])
            algbw = best_bw * tc.busbw_scale[proto] * tc.algbw_ratio
            best = min(best, lat_us * 1e-6 + nbytes / (algbw * 1e9))
    return best


# ------------------------------------------------------------------ fitting


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One measured point: a collective of ``group_size`` ranks on ``nbytes`` took ``seconds``."""

    collective: CollectiveKind
    link: LinkKind
    group_size: int
    nbytes: int
    seconds: float


def _features(samples: Sequence[Sample]) -> tuple[np.ndarray, np.ndarray]:
    a = np.array([[1.0, ring_steps(s.collective, s.group_size), bus_factor(s.collective, s.group_size) * s.nbytes]
                  for s in samples])
    t = np.array([s.seconds for s in samples])
    return a, t


def fit_term(samples: Sequence[Sample], upto_bytes: int | None = None) -> Term:
    """Least-squares alpha-beta term minimizing *relative* error over ``samples``.

    Columns: 1 (alpha), ring steps (hop; only when several group sizes are present) and
    bus factor × bytes (1/busbw). Negative latency coefficients are dropped and refit.
    """
    if len(samples) < 2:
        raise CalibrationError(f"an alpha-beta fit needs at least 2 points, got {len(samples)}")
    a, t = _features(samples)
    cols = [0, 2] + ([1] if len(set(a[:, 1])) > 1 else [])
    w = 1.0 / t
    while True:
        coef, *_ = np.linalg.lstsq(a[:, cols] * w[:, None], np.ones_like(t), rcond=None)
        full = dict(zip(cols, coef, strict=True))
        neg = [c for c in cols if c != 2 and full[c] < 0]
        if not neg:
            break
        cols = [c for c in cols if c not in neg]
    beta = full.get(2, 0.0)
    largest = int(np.argmax(a[:, 2]))
    if not beta * a[largest, 2] > 0.01 * t[largest]:  # the size term explains < 1% at the largest size
        raise CalibrationError(
            f"{samples[0].collective.value}/{samples[0].link.value}: measured times do not grow with size "
            f"(fitted s/byte = {beta:.3g}); widen the size sweep"
        )
    return Term(alpha_us=full.get(0, 0.0) * 1e6, hop_us=full.get(1, 0.0) * 1e6, busbw_GBps=1.0 / beta / 1e9,
                upto_bytes=upto_bytes)


def _rel_errors(model: CollectiveModel, samples: Sequence[Sample]) -> np.ndarray:
    return np.array([abs(model.time_s(s.group_size, s.nbytes, 0.0) - s.seconds) / s.seconds for s in samples])


def fit_piecewise(samples: Sequence[Sample], *, min_points: int = 3) -> CollectiveModel:
    """Two alpha-beta terms split at the size that minimizes the mean relative training error.

    Each side needs ``min_points`` distinct sizes, so neither term merely interpolates two points.
    """
    s0 = samples[0]
    sizes = sorted({s.nbytes for s in samples})
    best: tuple[float, CollectiveModel] | None = None
    for split in sizes[min_points - 1 : len(sizes) - min_points]:
        lo = [s for s in samples if s.nbytes <= split]
        hi = [s for s in samples if s.nbytes > split]
        try:
            terms = (fit_term(lo, upto_bytes=split), fit_term(hi))
        except CalibrationError:
            continue
        m = CollectiveModel(collective=s0.collective, link=s0.link, terms=terms, select=Select.PIECEWISE,
                            name="piecewise")
        err = float(_rel_errors(m, samples).mean())
        if best is None or err < best[0]:
            best = (err, m)
    if best is None:
        raise CalibrationError(f"{s0.collective.value}/{s0.link.value}: too few sizes for a piecewise fit")
    return best[1]


def fit_collective(samples: Sequence[Sample], *, source: str = "") -> CollectiveModel:
    """Fit alpha-beta and piecewise models on every other size; keep alpha-beta unless the
    piecewise model's error on the held-out sizes (the others) is clearly lower
    (:data:`PIECEWISE_MARGIN`), and report the kept model's held-out error.

    The saved parameters are those fitted on the training sizes only, so the reported
    held-out error is the error of the saved model.

    Where several group sizes were measured, each one with enough sizes is fitted alone too
    and kept in :attr:`CollectiveModel.by_group` when its held-out error is clearly lower
    (:data:`PIECEWISE_MARGIN`) than the joint model's on the same held-out points, and the
    joint model misses them by more than :data:`JOINT_GOOD_ENOUGH`. One alpha-beta form over all group sizes
    cannot follow where latency stops growing with ring steps: gloo's reduce-scatter of
    16-256 KiB took 0.55-1.3 ms in pairs and 4.9-5.3 ms across four processes on this
    2-core VM, which the joint fit priced at 1.9-2.4 ms.
    """
    joint = _fit_one(samples, source=source)
    by_size: dict[int, list[Sample]] = {}
    for s in samples:
        by_size.setdefault(s.group_size, []).append(s)
    if len(by_size) < 2:
        return joint
    own: dict[int, CollectiveModel] = {}
    for n, ss in sorted(by_size.items()):
        sizes = sorted({s.nbytes for s in ss})
        if len(sizes) < 4:
            continue
        try:
            alone = _fit_one(ss, source=f"{source}; group size {n} alone")
        except CalibrationError:
            continue
        held = set(sizes[1::2])
        test = [s for s in ss if s.nbytes in held]
        shared = float(_rel_errors(joint, test).mean())
        if shared > JOINT_GOOD_ENOUGH and alone.fit is not None and alone.fit.mean_rel < PIECEWISE_MARGIN * shared:
            own[n] = alone
    return replace(joint, by_group=own)


def _fit_one(samples: Sequence[Sample], *, source: str) -> CollectiveModel:
    """:func:`fit_collective` over all of ``samples`` as one model."""
    if not samples:
        raise CalibrationError("no samples to fit")
    s0 = samples[0]
    sizes = sorted({s.nbytes for s in samples})
    if len(sizes) < 4:
        raise CalibrationError(
            f"{s0.collective.value}/{s0.link.value}: {len(sizes)} sizes measured; held-out fitting needs >= 4"
        )
    held = set(sizes[1::2])
    train = [s for s in samples if s.nbytes not in held]
    test = [s for s in samples if s.nbytes in held]
    candidates = [CollectiveModel(collective=s0.collective, link=s0.link, terms=(fit_term(train),))]
    if len({s.nbytes for s in train}) >= 6:
        with suppress(CalibrationError):  # too few sizes on one side of every split
            candidates.append(fit_piecewise(train))
    errors = {m.name: _rel_errors(m, test) for m in candidates}
    best = candidates[0]
    for m in candidates[1:]:  # a model with more parameters must win clearly
        if errors[m.name].mean() < PIECEWISE_MARGIN * errors[best.name].mean():
            best = m
    fit = FitError(
        mean_rel=float(errors[best.name].mean()), max_rel=float(errors[best.name].max()),
        train_points=len(train), heldout_points=len(test),
        alternatives={k: float(v.mean()) for k, v in errors.items()},
    )
    return replace(best, fit=fit, source=source)
