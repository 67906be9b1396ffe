"""Collective times against literal values worked out by hand from NCCL's published formulas.

The fit tests in test_collectives.py generate their data with the module's own step and
bus-factor functions; these tests do not: every expected time below is computed in the
comment next to it from

* nccl-tests doc/PERFORMANCE.md: busbw = algbw × 2(n-1)/n for all-reduce, × (n-1)/n for
  all-gather, reduce-scatter and all-to-all, × 1 for broadcast and send/recv, so the time of
  the bandwidth part is factor × B / busbw;
* NCCL src/graph/tuning.cc: latency = baseLat + nsteps × hwLat, nsteps = 2(n-1) for a ring
  all-reduce and n-1 for the other ring collectives (one step for a point-to-point send).
"""

from __future__ import annotations

import pytest

from topomesh.cost.collectives import (
    CollectiveModel,
    CollectiveProfile,
    Select,
    Term,
    builtin_profile,
    collective_time_s,
)
from topomesh.errors import CalibrationError
from topomesh.topology.model import Connection, LinkKind
from topomesh.trace.graph import CollectiveKind, CollectiveRecord

AR = CollectiveKind.ALL_REDUCE
AG = CollectiveKind.ALL_GATHER
RS = CollectiveKind.REDUCE_SCATTER
A2A = CollectiveKind.ALL_TO_ALL
BC = CollectiveKind.BROADCAST
P2P = CollectiveKind.SEND_RECV

# One term, alpha 8.4 us, hop 3.4 us (NCCL ring Simple over NVLink), bus bandwidth 100 GB/s,
# buffer 1e9 bytes: B / busbw = 10 ms.
TERM = Term(alpha_us=8.4, hop_us=3.4, busbw_GBps=100.0)
GB = 1_000_000_000


@pytest.mark.parametrize(
    ("kind", "n", "want_s"),
    [
        # all-reduce n=2: 2 steps -> 8.4 + 2*3.4 = 15.2 us; factor 2*1/2 = 1 -> 10 ms
        (AR, 2, 0.0100152),
        # all-reduce n=4: 6 steps -> 8.4 + 20.4 = 28.8 us; factor 2*3/4 = 1.5 -> 15 ms
        (AR, 4, 0.0150288),
        # all-reduce n=8: 14 steps -> 8.4 + 47.6 = 56.0 us; factor 2*7/8 = 1.75 -> 17.5 ms
        (AR, 8, 0.017556),
        # all-gather n=4: 3 steps -> 8.4 + 10.2 = 18.6 us; factor 3/4 -> 7.5 ms
        (AG, 4, 0.0075186),
        # all-gather n=8: 7 steps -> 8.4 + 23.8 = 32.2 us; factor 7/8 -> 8.75 ms
        (AG, 8, 0.0087822),
        # reduce-scatter n=3: 2 steps -> 15.2 us; factor 2/3 -> 6.666667 ms
        (RS, 3, 0.0066818666667),
        # reduce-scatter n=8: as all-gather n=8
        (RS, 8, 0.0087822),
        # all-to-all n=8: 7 steps, factor 7/8, as all-gather
        (A2A, 8, 0.0087822),
        # broadcast n=8: 7 steps -> 32.2 us; factor 1 -> 10 ms
        (BC, 8, 0.0100322),
        # broadcast n=2: 1 step -> 11.8 us; factor 1 -> 10 ms
        (BC, 2, 0.0100118),
        # send/recv: 1 step -> 11.8 us; factor 1 -> 10 ms (any group size)
        (P2P, 2, 0.0100118),
        (P2P, 8, 0.0100118),
    ],
)
def test_one_term_time_per_collective_and_group_size(kind, n, want_s):
    model = CollectiveModel(collective=kind, link=LinkKind.NVLINK, terms=(TERM,))
    assert model.time_s(n, GB, link_GBps=1.0) == pytest.approx(want_s, rel=1e-9)
    # and through the public entry point, with a profile holding only this model
    prof = CollectiveProfile(name="t", backend="nccl", source="hand", models={(kind, LinkKind.NVLINK): model})
    rec = CollectiveRecord(kind=kind, bytes=GB, group_size=n)
    assert collective_time_s(rec, LinkKind.NVLINK, prof) == pytest.approx(want_s, rel=1e-9)


@pytest.mark.parametrize("kind", list(CollectiveKind))
def test_a_group_of_one_costs_nothing(kind):
    model = CollectiveModel(collective=kind, link=LinkKind.NVLINK, terms=(TERM,))
    assert model.time_s(1, GB, link_GBps=1.0) == 0.0


def test_link_bandwidth_and_scale_when_the_term_has_no_bus_bandwidth():
    # all-reduce n=4 on a 50 GB/s link at scale 0.25 (NCCL's LL): 12.5 GB/s
    # latency 6.6 + 6*0.6 = 10.2 us; 1.5 * 1e9 / 12.5e9 = 0.12 s
    term = Term(alpha_us=6.6, hop_us=0.6, bw_scale=0.25)
    assert term.time_s(AR, 4, GB, 50.0) == pytest.approx(0.1200102, rel=1e-9)
    # a given bus bandwidth is scaled too: 100 * 0.5 = 50 GB/s; all-gather n=2: 1 step,
    # factor 1/2 -> 0.5e9 / 50e9 = 10 ms + (0 + 1*0) us
    assert Term(alpha_us=0.0, busbw_GBps=100.0, bw_scale=0.5).time_s(AG, 2, GB, 1.0) == pytest.approx(0.01)


def test_nccl_default_picks_ll_for_small_and_simple_for_large_buffers():
    """nccl-default: min(ring LL, ring Simple) with NVLink constants on a 20 GB/s link.

    all-reduce, n=8 (14 steps, factor 1.75):
      LL     = 6.6 + 14*0.6 = 15.0 us, bandwidth 20 * 1/4 = 5 GB/s
      Simple = 8.4 + 14*3.4 = 56.0 us, bandwidth 20 GB/s
    crossover: 41 us / (1.75 * (1/5e9 - 1/20e9)) = 156,190 bytes.
    """
    prof = builtin_profile("nccl-default")
    link = Connection(kind=LinkKind.NVSWITCH, latency_us=0.6, bandwidth_GBps=20.0)

    def t(nbytes):
        return collective_time_s(CollectiveRecord(kind=AR, bytes=nbytes, group_size=8), link, prof)

    # 8 B: LL 15.0 us + 14 B / 5e9 = 15.0028 us (Simple would be 56.0007 us)
    assert t(8) == pytest.approx(15.0028e-6, rel=1e-9)
    # 100,000 B: LL 15.0 + 175,000 / 5e9 s = 15.0 + 35.0 = 50.0 us (Simple 56.0 + 8.75 = 64.75)
    assert t(100_000) == pytest.approx(50.0e-6, rel=1e-9)
    # 200,000 B: Simple 56.0 + 350,000 / 20e9 s = 56.0 + 17.5 = 73.5 us (LL 15 + 70 = 85)
    assert t(200_000) == pytest.approx(73.5e-6, rel=1e-9)
    # 1 GiB: Simple 56.0 us + 1.75 * 1,073,741,824 / 20e9 s = 0.056 + 93.9524096 = 94.0084096 ms
    assert t(2**30) == pytest.approx(0.0940084096, rel=1e-9)


def test_nccl_default_over_ib_uses_the_net_constants():
    """all-gather over IB, n=4 (3 steps, factor 3/4), a 25 GB/s NIC; NET hwLat LL 2.7, Simple 14.0 us.

    LL: 6.6 + 3*2.7 = 14.7 us, bandwidth 25/4 = 6.25 GB/s; Simple: 8.4 + 3*14 = 50.4 us, 25 GB/s.
    """
    prof = builtin_profile("nccl-default")
    link = Connection(kind=LinkKind.IB, latency_us=2.7, bandwidth_GBps=25.0)
    small = CollectiveRecord(kind=AG, bytes=1024, group_size=4)
    big = CollectiveRecord(kind=AG, bytes=2**20, group_size=4)
    # 1 KiB: LL 14.7 + 768 / 6.25e9 s = 14.7 + 0.12288 = 14.82288 us
    assert collective_time_s(small, link, prof) == pytest.approx(14.82288e-6, rel=1e-9)
    # 1 MiB: Simple 50.4 + 786,432 / 25e9 s = 50.4 + 31.45728 = 81.85728 us (LL 140.53)
    assert collective_time_s(big, link, prof) == pytest.approx(81.85728e-6, rel=1e-9)


def test_piecewise_term_covers_its_upto_size_inclusive():
    small = Term(alpha_us=10.0, busbw_GBps=1.0, upto_bytes=1000)
    large = Term(alpha_us=100.0, busbw_GBps=10.0)
    model = CollectiveModel(collective=AR, link=LinkKind.SHM, terms=(small, large), select=Select.PIECEWISE)
    # n=2 all-reduce: factor 1, hop 0. 1000 B: 10 us + 1000 / 1e9 s = 11 us (the small term)
    assert model.time_s(2, 1000, 0.0) == pytest.approx(11e-6, rel=1e-12)
    # 1001 B: 100 us + 1001 / 10e9 s = 100.1001 us (the large term, although the small one is cheaper)
    assert model.time_s(2, 1001, 0.0) == pytest.approx(100.1001e-6, rel=1e-12)
    # MIN would take the cheaper one: 10 + 1.001 = 11.001 us
    assert CollectiveModel(collective=AR, link=LinkKind.SHM, terms=(small, large)).time_s(2, 1001, 0.0) == (
        pytest.approx(11.001e-6, rel=1e-12))


def _prof(name, pairs, fallback=None, alpha=1.0):
    models = {(k, lk): CollectiveModel(collective=k, link=lk, terms=(Term(alpha_us=alpha, busbw_GBps=1.0),),
                                       source=f"{name}:{k.value}/{lk.value}") for k, lk in pairs}
    return CollectiveProfile(name=name, backend="nccl", source="hand", models=models, fallback=fallback)


def test_profile_model_same_tier_then_fallback():
    base = _prof("base", [(AR, LinkKind.PXB), (AR, LinkKind.NVSWITCH), (AG, LinkKind.SHM)])
    own = _prof("own", [(AR, LinkKind.NVLINK), (AR, LinkKind.PIX), (AG, LinkKind.NVLINK)], fallback=base)
    # exact hit
    assert own.model(AR, LinkKind.NVLINK).source == "own:all_reduce/NVLink"
    # NVSwitch and NVLink share tier 1: the profile's own NVLink fit serves NVSwitch
    assert own.model(AR, LinkKind.NVSWITCH).source == "own:all_reduce/NVLink"
    # PIX (tier 2) does not serve PXB (tier 3): the fallback's exact PXB model does
    assert own.model(AR, LinkKind.PXB).source == "base:all_reduce/PXB"
    # SYS and SHM share tier 6: the fallback's SHM all-gather serves SYS; the own profile's
    # all-gather models (NVLink only) are of another tier and must not be used
    assert own.model(AG, LinkKind.SYS).source == "base:all_gather/SHM"
    # same tier but another collective is no match
    assert own.model(AG, LinkKind.NVSWITCH).source == "own:all_gather/NVLink"
    with pytest.raises(CalibrationError, match="no model for reduce_scatter over NVLink"):
        own.model(RS, LinkKind.NVLINK)
    with pytest.raises(CalibrationError, match=r"no model for all_reduce over IB links \(it covers NVLink, PIX\)"):
        _prof("alone", [(AR, LinkKind.NVLINK), (AR, LinkKind.PIX)]).model(AR, LinkKind.IB)
