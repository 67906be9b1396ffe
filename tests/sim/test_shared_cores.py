"""Clusters whose ranks share CPU cores and whose collectives run on them (the ``local``
cluster: gloo processes): work is stretched by the core share and nothing overlaps."""

from __future__ import annotations

import dataclasses

import pytest

from topomesh.cost.cluster import axis_link, group_collective_time_s, load_cluster
from topomesh.layout.dims import Layout
from topomesh.layout.place import place
from topomesh.models.presets import get_preset
from topomesh.sim.simulate import Simulator, Training, builtin_model
from topomesh.trace.graph import CollectiveRecord


@pytest.fixture(scope="module")
def model():
    return builtin_model(get_preset("tiny-llama"))


def test_core_share_is_threads_over_cores():
    c = load_cluster("dgx-h100", gpus=4)
    assert c.core_share == 1.0  # GPUs: no shared cores
    assert dataclasses.replace(c, cores=2, threads_per_rank=1).core_share == 2.0  # 4 x 1 / 2
    assert dataclasses.replace(c, cores=2, threads_per_rank=3).core_share == 6.0  # 4 x 3 / 2
    assert dataclasses.replace(c, cores=16, threads_per_rank=2).core_share == 1.0  # 8 of 16 cores: never faster


def test_shared_cores_stretch_compute(model):
    gpu = load_cluster("dgx-h100", gpus=2)
    shared = dataclasses.replace(gpu, cores=1, threads_per_rank=1)  # 2 ranks on 1 core: share 2
    layout, training = Layout(tp=2), Training(global_batch=2)
    a = Simulator(model=model, cluster=gpu).simulate(layout, training)
    b = Simulator(model=model, cluster=shared).simulate(layout, training)
    assert b.breakdown.compute_s == pytest.approx(2 * a.breakdown.compute_s, rel=1e-9)
    assert b.breakdown.optimizer_s == pytest.approx(2 * a.breakdown.optimizer_s, rel=1e-9)
    # the collectives run on the NVLink engines here: not stretched
    assert b.breakdown.exposed_comm_s == pytest.approx(a.breakdown.exposed_comm_s, rel=1e-9)


def test_collectives_on_the_compute_cores_never_overlap(model):
    gpu = load_cluster("dgx-h100", gpus=2)
    cpu_like = dataclasses.replace(gpu, collectives_share_compute=True)
    layout, training = Layout(dp_shard=2), Training(global_batch=2)
    sim = Simulator(model=model, cluster=cpu_like)
    r = sim.simulate(layout, training)
    overlapped = Simulator(model=model, cluster=gpu).simulate(layout, training)
    # every second of every collective of the step is exposed: the sum over the trace's records
    trace = sim.trace(layout, training)
    full = trace.compose(model.spec.n_layers) if model.spec.n_layers > trace.traced_layers else trace
    link = axis_link(cpu_like, place(cpu_like.topology, layout), ["dp_shard"])
    expected = sum(group_collective_time_s(e, link, cpu_like.profile) for e in full.events()
                   if isinstance(e, CollectiveRecord) and e.group_size > 1)
    assert expected > 0
    assert sum(r.breakdown.exposed_comm_s.values()) == pytest.approx(expected, rel=1e-9)
    assert r.step_time_s == pytest.approx(r.breakdown.compute_s + r.breakdown.optimizer_s + expected, rel=1e-9)
    assert sum(overlapped.breakdown.exposed_comm_s.values()) < expected  # FSDP prefetch hides some on GPUs
