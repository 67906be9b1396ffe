"""topomesh plan's search: the fast path (orders sharing one simulation per link signature)
against the plain simulator on every layout, the counts, the ranking and the plan file."""

from __future__ import annotations

import itertools
import os

import pytest

from topomesh.layout.dims import Axis, Layout
from topomesh.layout.place import place
from topomesh.search.evaluate import Context, PlanInputs
from topomesh.search.rank import mesh_of, plan_dict
from topomesh.search.run import search
from topomesh.search.space import KnobTable
from topomesh.sim.simulate import SimMemo, simulate

STRATEGIES = ["tp", "pp", "dp_shard"]
KNOBS = KnobTable.product(micro_batch=(1,), schedule=("1f1b",))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> PlanInputs:
    cache = tmp_path_factory.mktemp("traces")
    os.chmod(cache, 0o700)
    return PlanInputs(model="tiny-llama", cluster="dgx-h100", gpus=16, global_batch=16, cache_dir=str(cache))


@pytest.fixture(scope="module")
def fast(inputs: PlanInputs):
    return search(inputs, strategies=STRATEGIES, knobs=KNOBS)


def test_fast_path_equals_exhaustive_and_independent_simulations(inputs: PlanInputs, fast) -> None:
    exhaustive = search(inputs, strategies=STRATEGIES, knobs=KNOBS, exhaustive=True)
    got = {(e.index, e.knob): e.result.to_dict() for e in fast.entries}
    want = {(e.index, e.knob): e.result.to_dict() for e in exhaustive.entries}
    assert got == want
    assert [(e.index, e.knob) for e in fast.entries] == [(e.index, e.knob) for e in exhaustive.entries]
    # Sharing happened: fewer simulations than layouts (tp=2 pp=2 dp_shard=4 has 6 orders,
    # and orders that keep tp inside a node and pp, dp_shard across nodes give the same links).
    assert fast.simulated < exhaustive.simulated == exhaustive.evaluated
    # Independently of every memo: each layout simulated on its own, with a fresh SimMemo.
    ctx = Context.build(inputs)
    for e in fast.entries:
        training = ctx.training(e.knobs)
        alone = simulate(ctx.model, ctx.cluster, e.layout, training, trace=ctx.sim.trace(e.layout, training),
                         memo=SimMemo())
        assert alone.to_dict() == got[(e.index, e.knob)], e.layout.describe()


def test_counts_add_up_to_the_space(fast) -> None:
    # 16 = 2^4 over 3 strategies: sum_t C(3,t) t! C(3,t-1) = 3·1 + 6·3 + 6·3 = 39 layouts.
    assert fast.space.n_layouts == 39 and fast.space.size == 39
    assert fast.pruning.n_pruned + fast.evaluated + sum(fast.failed.values()) == 39
    # tiny-llama: 4 kv heads (tp <= 4), 2 layers (pp <= 2).
    assert all(e.layout.tp <= 4 and e.layout.pp <= 2 for e in fast.entries)


def test_ranked_best_first(fast) -> None:
    r = [e.result for e in fast.entries]
    feasible = [x for x in r if x.feasible]
    assert feasible and r[: len(feasible)] == feasible
    assert all(a.step_time_s <= b.step_time_s for a, b in itertools.pairwise(feasible))
    assert fast.best is fast.entries[0]


def test_plan_file_keys_and_mesh(fast) -> None:
    data = plan_dict(fast, top=3)
    assert data["format"] == "topomesh-plan" and data["version"] == 1
    for key in ("space_size", "pruned", "traced_classes", "evaluated", "feasible", "elapsed_s", "best", "layouts"):
        assert key in data
    assert data["space_size"] == 39 and len(data["layouts"]) == 3 and data["best"] == data["layouts"][0]
    ctx = Context.build(fast.inputs)
    for entry, lay in zip(fast.entries[:3], data["layouts"], strict=True):
        # the mesh is what place() gives on the cluster's topology, dims slowest first
        assert lay["mesh"] == place(ctx.cluster.topology, entry.layout).mesh().tolist()
        assert lay["mesh_dim_names"] == [a.value for a in entry.layout.mesh_axes]
        assert lay["step_time_s"] == entry.result.step_time_s


def test_mesh_of_by_hand() -> None:
    # tp=2 fastest, then pp=2: logical rank = tp + 2·pp; placed = (3, 2, 1, 0) reverses them.
    lay = Layout(tp=2, pp=2, order=(Axis.TP, Axis.PP))
    assert mesh_of(lay, (0, 1, 2, 3)).tolist() == [[0, 1], [2, 3]]
    assert mesh_of(lay, (3, 2, 1, 0)).tolist() == [[3, 2], [1, 0]]


def _batch_sum(inputs: object, batch: list) -> list:
    """A task for :func:`topomesh.search.run._run` (module level: spawned workers import it)."""
    return [(inputs, sum(batch), os.getpid())]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_run_gives_every_batch_once_and_this_process_takes_a_share(workers: int) -> None:
    from topomesh.search.run import _run

    batches = [[i, i + 1] for i in range(0, 40, 2)]
    got = list(_run(_batch_sum, "in", batches, workers, None, here=True))
    assert sorted(sum(b) for b, _ in got) == sorted(sum(b) for b in batches)
    assert all(r == [("in", sum(b), r[0][2])] for b, r in got)
    pids = {r[0][2] for _, r in got}
    assert os.getpid() in pids and len(pids) <= workers  # this process is one of the workers
    if workers == 1:
        assert pids == {os.getpid()}


def test_a_trace_class_drops_pp_and_shares_replicate_degrees_by_hand() -> None:
    from topomesh.search.run import _class_knobs, _trace_class, _without_pp
    from topomesh.search.space import Knobs, Recompute
    from topomesh.sim.schedules import Schedule

    knobs = Knobs(micro_batch=2, recompute=Recompute.FULL, schedule=Schedule.GPIPE, interleave=1)
    # AXES order: dp_replicate, dp_shard, cp, tp, pp, ep
    assert _without_pp((4, 2, 1, 2, 4, 1)) == (4, 2, 1, 2, 1, 1)
    assert _trace_class((4, 2, 1, 2, 4, 1), knobs) == ((2, 2, 1, 2, 1, 1), _class_knobs(knobs))
    assert _trace_class((1, 8, 1, 2, 1, 1), knobs)[0] == (1, 8, 1, 2, 1, 1)
    assert _class_knobs(knobs).micro_batch == 2 and _class_knobs(knobs).schedule is Schedule.ONE_F_ONE_B


def test_a_class_that_failed_to_trace_is_reported_again_without_tracing(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    import topomesh.trace.cache as cache_mod
    from topomesh.errors import TraceError

    real, calls = cache_mod.trace_step, []

    def tp4_fails(spec, parallelize, layout, **kw):  # noqa: ANN001, ANN003, ANN202
        calls.append(dict(layout))
        if layout.get("tp") == 4:
            raise TraceError("Model 'tiny-llama' could not be traced: NotImplementedError: no.") from NotImplementedError()
        return real(spec, parallelize, layout, **kw)

    monkeypatch.setattr(cache_mod, "trace_step", tp4_fails)
    cache = tmp_path / "traces"
    cache.mkdir(mode=0o700)
    inputs = PlanInputs(model="tiny-llama", cluster="dgx-h100", gpus=16, global_batch=16, cache_dir=str(cache))
    first = search(inputs, strategies=STRATEGIES, knobs=KNOBS)
    assert first.extra["trace_errors"] == 2 and sum(first.failed.values()) > 0  # tp=4 with dp_shard=4 and 2
    calls.clear()
    import topomesh.search.run as run_mod

    tasks: list[str] = []

    def in_process(fn, inputs, batches, workers, ray_address, here=False):  # noqa: ANN001, ANN202
        tasks.extend(fn.__name__ for b in batches for _ in b)
        return ((b, fn(inputs, b)) for b in batches)

    monkeypatch.setattr(run_mod, "_run", in_process)  # --workers 2 without processes
    again = search(inputs, strategies=STRATEGIES, knobs=KNOBS, workers=2)
    assert calls == [] and "trace_and_digest" not in tasks  # no tracing task: every class stored or failed
    assert again.failed == first.failed and again.extra["trace_errors"] == 2
    assert [e.result.to_dict() for e in again.entries] == [e.result.to_dict() for e in first.entries]


@pytest.mark.parametrize("where", [
    {"cluster": "dgx-h100", "gpus": 8},
    {"cluster": "local", "gpus": 2},
    {"topology": "examples/data/real/nvidia-smi-topo/h100-sxm-8gpu-12nic.txt", "device": "H100-SXM5-80GB"},
    {"topology": "examples/data/real/nvidia-smi-topo/h100-sxm-8gpu-12nic.txt", "device": "cpu"},
])
def test_the_search_traces_as_the_simulator_of_its_cluster_does(where):
    """The tracing stage decides GPU kernels without building the cluster; scoring decides on the
    cluster. Apart, one would trace every class again."""
    from topomesh.search.evaluate import build_cluster
    from topomesh.sim.simulate import gpu_kernels

    inputs = PlanInputs(model="tiny-llama", global_batch=8, **where)
    assert inputs.gpu == gpu_kernels(build_cluster(inputs))
