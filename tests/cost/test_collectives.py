"""Collective models: fits on synthetic data, default profiles, the pure cost function."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from topomesh.cost.collectives import (
    CollectiveModel,
    Sample,
    Select,
    Term,
    builtin_profile,
    builtin_profile_names,
    bus_factor,
    collective_time_s,
    fit_collective,
    fit_term,
    load_profile,
    profile_from_dict,
    ring_steps,
)
from topomesh.errors import CalibrationError
from topomesh.topology.model import Connection, LinkKind
from topomesh.trace.graph import CollectiveKind, CollectiveRecord

AR = CollectiveKind.ALL_REDUCE
SIZES = [2**k for k in range(10, 27)]  # 1 KiB .. 64 MiB


def _synthetic(kind, sizes, groups, alpha_us, hop_us, busbw_GBps, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n in groups:
        for b in sizes:
            t = (alpha_us + hop_us * ring_steps(kind, n)) * 1e-6 + bus_factor(kind, n) * b / (busbw_GBps * 1e9)
            out.append(Sample(collective=kind, link=LinkKind.SHM, group_size=n, nbytes=b,
                              seconds=t * (1 + noise * rng.standard_normal())))
    return out


def test_alpha_beta_fit_recovers_the_parameters():
    term = fit_term(_synthetic(AR, SIZES, [2], alpha_us=50.0, hop_us=0.0, busbw_GBps=3.0))
    assert term.alpha_us == pytest.approx(50.0, rel=1e-6)
    assert term.busbw_GBps == pytest.approx(3.0, rel=1e-6)


@settings(max_examples=50, deadline=None)
@given(alpha_us=st.floats(1.0, 1e4), busbw=st.floats(0.05, 2000.0), hop_us=st.floats(0.0, 50.0),
       kind=st.sampled_from([k for k in CollectiveKind if k is not CollectiveKind.SEND_RECV]))
def test_alpha_beta_fit_recovers_any_exact_parameters(alpha_us, busbw, hop_us, kind):
    # identifiable only when the size term is visible at the largest size (fit_term refuses < 1%)
    latency_s = (alpha_us + hop_us * ring_steps(kind, 2)) * 1e-6
    assume(bus_factor(kind, 2) * SIZES[-1] / (busbw * 1e9) > 0.05 * latency_s)
    term = fit_term(_synthetic(kind, SIZES, [2, 4, 8], alpha_us=alpha_us, hop_us=hop_us, busbw_GBps=busbw))
    assert term.busbw_GBps == pytest.approx(busbw, rel=1e-4)
    # latency terms are recovered up to what the sizes can resolve: compare predicted times
    for n in (2, 4, 8):
        want = (alpha_us + hop_us * ring_steps(kind, n)) * 1e-6
        got = (term.alpha_us + term.hop_us * ring_steps(kind, n)) * 1e-6
        assert got == pytest.approx(want, rel=1e-3, abs=1e-9 + 1e-4 * SIZES[-1] / (busbw * 1e9))


def test_fit_with_several_group_sizes_recovers_the_per_step_latency():
    samples = _synthetic(AR, SIZES, [2, 4, 8], alpha_us=8.4, hop_us=3.4, busbw_GBps=200.0)
    term = fit_term(samples)
    assert (term.alpha_us, term.hop_us, term.busbw_GBps) == pytest.approx((8.4, 3.4, 200.0), rel=1e-6)


def test_noisy_fit_reports_held_out_error_close_to_the_noise():
    samples = _synthetic(AR, SIZES, [2], alpha_us=100.0, hop_us=0.0, busbw_GBps=2.0, noise=0.05)
    model = fit_collective(samples)
    assert model.fit is not None
    assert model.fit.heldout_points == len(SIZES) // 2 and model.fit.train_points == len(SIZES) - len(SIZES) // 2
    assert 0.0 < model.fit.mean_rel < 0.15
    assert model.terms[0].busbw_GBps == pytest.approx(2.0, rel=0.15)


def test_piecewise_wins_when_the_protocol_changes_with_size():
    small = [b for b in SIZES if b <= 2**18]
    large = [b for b in SIZES if b > 2**18]
    samples = (_synthetic(AR, small, [2], alpha_us=20.0, hop_us=0.0, busbw_GBps=0.5)
               + _synthetic(AR, large, [2], alpha_us=2000.0, hop_us=0.0, busbw_GBps=5.0))
    model = fit_collective(samples)
    assert model.name == "piecewise" and model.select is Select.PIECEWISE
    assert model.fit.mean_rel < model.fit.alternatives["alpha_beta"]
    assert model.fit.mean_rel < 0.05


def test_each_group_size_gets_its_own_fit_where_one_form_cannot_follow_them():
    # pairs: 100 us + 128 KiB at 1 GB/s; four ranks: 1000 us flat latency (no growth per ring step)
    # and 4 GB/s. One alpha + hop form cannot hold both; each alone is exact.
    two = _synthetic(AR, SIZES, [2], alpha_us=100.0, hop_us=0.0, busbw_GBps=1.0)
    four = _synthetic(AR, SIZES, [4], alpha_us=1000.0, hop_us=0.0, busbw_GBps=4.0)
    model = fit_collective(two + four)
    assert sorted(model.by_group) == [2, 4]
    for n, gbps, alpha in ((2, 1.0, 100e-6), (4, 4.0, 1000e-6)):
        for b in (4096, 131072, 2**24):
            want = alpha + bus_factor(AR, n) * b / (gbps * 1e9)  # the law itself, by hand
            assert model.time_s(n, b, 0.0) == pytest.approx(want, rel=1e-6)
    # a size not measured is priced by the joint form, not by either group's own fit
    joint = CollectiveModel(collective=AR, link=LinkKind.SHM, terms=model.terms, select=model.select)
    assert model.time_s(8, 2**20, 0.0) == joint.time_s(8, 2**20, 0.0)
    # sizes one form already follows keep the joint model alone
    same = _synthetic(AR, SIZES, [2, 4, 8], alpha_us=8.4, hop_us=3.4, busbw_GBps=200.0)
    assert dict(fit_collective(same).by_group) == {}


def test_fits_refuse_too_few_sizes_and_flat_times():
    with pytest.raises(CalibrationError, match=">= 4"):
        fit_collective(_synthetic(AR, SIZES[:3], [2], 10.0, 0.0, 1.0))
    flat = [Sample(collective=AR, link=LinkKind.SHM, group_size=2, nbytes=b, seconds=1e-3) for b in SIZES]
    with pytest.raises(CalibrationError, match="do not grow with size"):
        fit_term(flat)


@pytest.mark.parametrize("name", ["nccl-default", "nccl-dgx-a100", "nccl-dgx-h100"])
def test_default_profiles_load_and_give_monotonic_times(name):
    assert name in builtin_profile_names()
    prof = builtin_profile(name)
    for kind in CollectiveKind:
        for link in (LinkKind.NVSWITCH, LinkKind.PHB, LinkKind.IB):
            groups = [2] if kind is CollectiveKind.SEND_RECV else [2, 4, 8]
            for n in groups:
                times = [collective_time_s(CollectiveRecord(kind=kind, bytes=b, group_size=n), link, prof)
                         for b in SIZES]
                assert all(t > 0 for t in times)
                assert all(b >= a for a, b in zip(times, times[1:], strict=False)), (kind, link, n)
            if kind is not CollectiveKind.SEND_RECV:
                # more ranks, more latency steps: never faster
                t2, t8 = (collective_time_s(CollectiveRecord(kind=kind, bytes=1024, group_size=n), link, prof)
                          for n in (2, 8))
                assert t8 >= t2


def test_default_profiles_cite_sources_and_rank_the_hardware():
    for name in builtin_profile_names():
        prof = builtin_profile(name)
        assert prof.source and all(m.source for m in prof.models.values())
        assert "never fitted" in prof.source.lower()
    big = CollectiveRecord(kind=AR, bytes=2**30, group_size=8)
    h100 = collective_time_s(big, LinkKind.NVSWITCH, builtin_profile("nccl-dgx-h100"))
    a100 = collective_time_s(big, LinkKind.NVSWITCH, builtin_profile("nccl-dgx-a100"))
    # 1 GiB all-reduce on 8 GPUs: 1.75 GiB at the published bus bandwidths (480 NVLS, 235 A100)
    assert h100 == pytest.approx(23e-6 + 1.75 * 2**30 / 480e9, rel=1e-6)
    assert a100 == pytest.approx(8.4e-6 + 14 * 3.4e-6 + 1.75 * 2**30 / 235e9, rel=1e-6)
    # IB in the DGX H100 profile: NCCL's NET ring constants at 0.95 of the link (NDR measured busbw);
    # 1 MiB over the 12 GB/s default IB link, 2 ranks: Simple 8.4 + 2 x 14.0 us + 2^20 / (12 x 0.95 GB/s)
    ib = CollectiveRecord(kind=AR, bytes=2**20, group_size=2)
    assert collective_time_s(ib, LinkKind.IB, builtin_profile("nccl-dgx-h100")) == pytest.approx(
        36.4e-6 + 2**20 / (12 * 0.95 * 1e9), rel=1e-9)
    # PCIe is not in the DGX profiles: it falls back to nccl-default
    assert collective_time_s(ib, LinkKind.PIX, builtin_profile("nccl-dgx-h100")) == pytest.approx(
        collective_time_s(ib, LinkKind.PIX, builtin_profile("nccl-default")))


def test_connection_bandwidth_is_used_when_the_profile_has_none():
    prof = builtin_profile("nccl-default")
    rec = CollectiveRecord(kind=AR, bytes=2**28, group_size=2)
    slow = Connection(kind=LinkKind.IB, latency_us=2.7, bandwidth_GBps=12.5)
    fast = Connection(kind=LinkKind.IB, latency_us=2.7, bandwidth_GBps=50.0)
    ratio = collective_time_s(rec, slow, prof) / collective_time_s(rec, fast, prof)
    assert ratio == pytest.approx(4.0, rel=0.01)
    assert collective_time_s(CollectiveRecord(kind=AR, bytes=2**20, group_size=1), slow, prof) == 0.0


def test_profile_round_trip_and_malformed_input(tmp_path):
    model = CollectiveModel(collective=AR, link=LinkKind.SHM, terms=(Term(alpha_us=5.0, busbw_GBps=1.0),))
    from topomesh.cost.collectives import CollectiveProfile

    prof = CollectiveProfile(name="t", backend="gloo", source="test", models={(AR, LinkKind.SHM): model})
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof.to_dict()))
    back = load_profile(path)
    assert back.model(AR, LinkKind.SHM) == model
    # per group size models survive the round trip and price their size
    own = CollectiveModel(collective=AR, link=LinkKind.SHM, terms=(Term(alpha_us=500.0, busbw_GBps=2.0),))
    split = CollectiveProfile(name="t", backend="gloo", source="test",
                              models={(AR, LinkKind.SHM): CollectiveModel(collective=AR, link=LinkKind.SHM,
                                                                          terms=model.terms, by_group={4: own})})
    path.write_text(json.dumps(split.to_dict()))
    again = load_profile(path).model(AR, LinkKind.SHM)
    assert again.by_group[4] == own and again.time_s(4, 1e6, 0.0) == pytest.approx(500e-6 + 1.5 * 1e6 / 2e9)
    assert again.time_s(2, 1e6, 0.0) == pytest.approx(5e-6 + 1e6 / 1e9)
    bad = split.to_dict()
    bad["models"][0]["by_group"][0]["group_size"] = 1
    with pytest.raises(CalibrationError, match="group_size 1"):
        profile_from_dict(bad)
    with pytest.raises(CalibrationError, match="no model for all_gather over SHM"):
        back.model(CollectiveKind.ALL_GATHER, LinkKind.SHM)
    with pytest.raises(CalibrationError, match="malformed collective profile"):
        profile_from_dict({"version": 1, "name": "x", "backend": "nccl", "models": [{"collective": "nope"}]})
    with pytest.raises(CalibrationError, match="no such collective profile"):
        load_profile(tmp_path / "missing.json")


def test_show_lists_each_group_sizes_own_fit(tmp_path, capsys, monkeypatch):
    from topomesh.cli.main import main
    from topomesh.cost.collectives import CollectiveProfile

    two = _synthetic(AR, SIZES, [2], alpha_us=100.0, hop_us=0.0, busbw_GBps=1.0)
    four = _synthetic(AR, SIZES, [4], alpha_us=1000.0, hop_us=0.0, busbw_GBps=4.0)
    prof = CollectiveProfile(name="t", backend="gloo", source="test",
                             models={(AR, LinkKind.SHM): fit_collective(two + four)})
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof.to_dict()))
    monkeypatch.setenv("COLUMNS", "200")  # rich's table, one line a row
    assert main(["calibrate", "--show", str(path)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "all_reduce" in line]
    assert len(rows) == 3 and "n=2" in rows[1] and "n=4" in rows[2]
    assert "1000.0" in rows[2]  # four ranks' own latency, in us
