"""Class digests stored next to the traces: exact, keyed by everything that prices them, and
read as warily as the traces."""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import re
from pathlib import Path

import pytest

from topomesh.cost.cluster import load_cluster
from topomesh.cost.ops import profile_key
from topomesh.layout.dims import Layout
from topomesh.models.presets import get_preset
from topomesh.sim.digest import DIGEST_FORMAT, digest_from_json, digest_to_json
from topomesh.sim.simulate import Simulator, Training, builtin_model, simulate
from topomesh.trace.cache import TraceCache
from topomesh.trace.graph import OpRecord

CASES = [
    (Layout(tp=2, dp_shard=4), Training(global_batch=8)),
    (Layout(dp_replicate=2, tp=2, dp_shard=2, order="tp-dp_shard-dp_replicate"), Training(global_batch=8, recompute="full")),
    (Layout(pp=2, tp=2, dp_replicate=2), Training(global_batch=16, micro_batch=2, schedule="interleaved-1f1b",
                                                  interleave=2)),
    (Layout(dp_replicate=2, dp_shard=4), Training(global_batch=16, micro_batch=2)),
]


@pytest.fixture(scope="module")
def model():
    return builtin_model(dataclasses.replace(get_preset("tiny-llama"), name="tiny-llama-4", n_layers=4))


@pytest.fixture(scope="module")
def cluster():
    return load_cluster("dgx-h100", gpus=8)


def _files(d: Path) -> list[Path]:
    return sorted(d.glob("*.digest.json.gz"))


def test_results_from_stored_digests_equal_results_from_the_traces(model, cluster, tmp_path) -> None:  # noqa: ANN001
    direct = [simulate(model, cluster, lay, t).to_dict() for lay, t in CASES]  # traced, digested in memory
    first = Simulator(model=model, cluster=cluster, cache=TraceCache(tmp_path))
    assert [first.simulate(lay, t).to_dict() for lay, t in CASES] == direct
    assert len(_files(tmp_path)) == len(CASES)
    warm = Simulator(model=model, cluster=cluster, cache=TraceCache(tmp_path))
    assert [warm.simulate(lay, t).to_dict() for lay, t in CASES] == direct
    assert warm.cache.hits + warm.cache.misses == 0  # no trace read: the digests stood for them
    assert warm._digests.hits == len(CASES)
    # the timeline path prices the same digest on the links (the Python engine, which sums
    # the pieces in its own order: the two engines agree to 1e-9, tests/sim/test_kernel.py)
    lay, t = CASES[2]
    assert warm.simulate(lay, t, record=True).step_time_s == pytest.approx(direct[2]["step_time_s"], rel=1e-9)


def test_a_digest_round_trips_exactly(model, cluster) -> None:  # noqa: ANN001
    sim = Simulator(model=model, cluster=cluster)
    for lay, t in CASES:
        d = sim.digest(lay, t)
        assert d.axes and d.fwd_block.compute_s > 0
        assert digest_from_json(json.loads(json.dumps(digest_to_json(d)))) == d


def test_a_changed_op_table_or_device_digests_again(model, cluster, tmp_path) -> None:  # noqa: ANN001
    lay, t = CASES[0]
    base = Simulator(model=model, cluster=cluster, cache=TraceCache(tmp_path)).simulate(lay, t)
    trace = Simulator(model=model, cluster=cluster).trace(lay, t)
    op = next(e for s in trace.segments for e in s.events if isinstance(e, OpRecord) and e.flops)
    table = {profile_key(op): 1.0}  # one measured op: a second per call
    timed = Simulator(model=model, cluster=cluster, cache=TraceCache(tmp_path), table=table).simulate(lay, t)
    assert timed.step_time_s > base.step_time_s + 1.0 and timed.measured_ops > 0 == base.measured_ops
    other = Simulator(model=model, cluster=load_cluster("dgx-a100-80gb", gpus=8), cache=TraceCache(tmp_path)).simulate(lay, t)
    assert other.step_time_s > base.step_time_s
    assert len(_files(tmp_path)) == 3


def _tamper(path: Path, edit) -> None:  # noqa: ANN001
    doc = json.loads(gzip.decompress(path.read_bytes()))
    edit(doc)
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))


@pytest.mark.parametrize(
    "edit, reason",
    [
        (lambda doc: doc["digest"]["pieces"]["fwd_block"].update(compute_s=-1.0), "compute_s: expected a finite non-negative"),
        (lambda doc: doc["digest"]["pieces"]["fwd_block"].update(flops=2**70), "flops: expected an integer"),
        (lambda doc: doc["digest"]["pieces"]["fwd_block"]["blocking"].append(10**6), "blocking: expected a list of record indices"),
        (lambda doc: doc["digest"]["pieces"]["bwd_block"].update(evil=1), "unknown keys \\['evil'\\]"),
        (lambda doc: doc["digest"]["pieces"].pop("opt_rest"), "pieces: expected an object with exactly"),
        (lambda doc: doc["digest"]["records"][0].update(group_size=0), "group_size 0 is not in"),
        (lambda doc: doc["digest"]["digest"].update(traced_layers=0), "traced_layers: must be at least 1"),
        (lambda doc: doc.update(key="someone else's key"), "stored for a different key"),
        (lambda doc: doc.update(version=0), f"not a topomesh-digest file of version {DIGEST_FORMAT}"),
        (lambda doc: doc["digest"]["pieces"]["fwd_block"].update(  # one time too many
            blocking_gaps=[*doc["digest"]["pieces"]["fwd_block"].get("blocking_gaps", []), 0.5]),
         "blocking_gaps: expected a time per blocking record"),
    ],
)
def test_a_tampered_digest_is_ignored_and_replaced(model, cluster, tmp_path, caplog, edit, reason) -> None:  # noqa: ANN001
    lay, t = CASES[0]
    first = Simulator(model=model, cluster=cluster, cache=TraceCache(tmp_path)).simulate(lay, t).to_dict()
    (path,) = _files(tmp_path)
    _tamper(path, edit)
    with caplog.at_level(logging.WARNING, logger="topomesh"):
        again = Simulator(model=model, cluster=cluster, cache=TraceCache(tmp_path))
        assert again.simulate(lay, t).to_dict() == first
    assert re.search(f"ignoring the digest cache file .*{reason}", caplog.text), caplog.text
    assert again.cache.hits == 1  # digested again from the stored trace, not traced
    fresh = Simulator(model=model, cluster=cluster, cache=TraceCache(tmp_path))
    fresh.simulate(lay, t)
    assert fresh._digests.hits == 1 and fresh.cache.hits == 0  # overwritten with a good file


def test_a_digest_file_that_is_a_symlink_is_not_followed(model, cluster, tmp_path, caplog) -> None:  # noqa: ANN001
    lay, t = CASES[0]
    first = Simulator(model=model, cluster=cluster, cache=TraceCache(tmp_path)).simulate(lay, t).to_dict()
    (path,) = _files(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    path.rename(elsewhere)
    path.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="topomesh"):
        again = Simulator(model=model, cluster=cluster, cache=TraceCache(tmp_path))
        assert again.simulate(lay, t).to_dict() == first
    assert "ignoring the digest cache file" in caplog.text and again._digests.hits == 0


def test_the_pricing_fingerprint_names_every_host_cost(cluster) -> None:  # noqa: ANN001
    """A digest priced with other DTensor host costs or core sharing is not reused."""
    import dataclasses

    from topomesh.sim.digest import pricing_fingerprint

    base = pricing_fingerprint(cluster, {})
    for change in (dict(dtensor_dispatch_s=1e-5), dict(dtensor_collective_s=1e-4), dict(collectives_share_compute=True),
                   dict(dtensor_block_dispatch_s=2e-5), dict(dtensor_rest_dispatch_s=3e-5)):
        assert pricing_fingerprint(dataclasses.replace(cluster, **change), {}) != base, change
