"""Bad input: unknown ops are listed with counts, untraceable models name the op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from topomesh.errors import LayoutError, TraceError
from topomesh.trace.tracer import ModelSpec, fake_process_group, normalize_layout, trace_step


@torch.library.custom_op("topomesh_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@mystery.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _Block(nn.Module):
    def __init__(self, dim: int, untraceable: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.untraceable = untraceable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.untraceable:
            return h + h[h > 0].sum()  # boolean mask: output size depends on values
        return h + mystery(h.detach())


class _Model(nn.Module):
    def __init__(self, n: int, untraceable: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(8, untraceable) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _spec(untraceable: bool = False) -> ModelSpec:
    return ModelSpec(
        name="toy", key="toy", n_layers=4,
        build=lambda n: _Model(n, untraceable),
        make_inputs=lambda b: ((torch.randn(b, 8),), torch.randn(b, 8)),
        loss=F.mse_loss,
    )


def test_unknown_op_listed_with_counts() -> None:
    t = trace_step(_spec(), None, {"dp_shard": 1}, n_layers=1).compose(4)
    s = t.summary()
    assert s.unknown_ops == {"topomesh_test.mystery.default": 4}
    assert s.op_counts["aten.addmm.default"] == 4
    assert s.flops_by_phase["forward"] == 4 * 2 * 1 * 8 * 8


def test_untraceable_model_names_op_and_reason() -> None:
    with pytest.raises(TraceError, match=r"'toy' could not be traced .*aten\.nonzero.*depends on tensor values"):
        trace_step(_spec(untraceable=True), None, {}, n_layers=1)


def test_parallelize_failure_is_a_trace_error() -> None:
    def bad(model: nn.Module, mesh: object) -> nn.Module:
        raise RuntimeError("no plan for this module")

    with pytest.raises(TraceError, match="building and parallelizing.*no plan for this module"):
        trace_step(_spec(), bad, {"tp": 2}, n_layers=1)


def test_existing_process_group_is_not_clobbered() -> None:
    with fake_process_group(2), pytest.raises(TraceError, match="already exists"):
        trace_step(_spec(), None, {"dp_shard": 2}, n_layers=1)


def test_bad_degree() -> None:
    with pytest.raises(LayoutError, match="'tp' must be a positive integer, got 0"):
        trace_step(_spec(), None, {"tp": 0}, n_layers=1)


def test_pipeline_axis_is_left_out_of_the_traced_mesh() -> None:
    # a stage traces the same step on fewer layers: pp is no mesh dim; order is kept
    assert normalize_layout({"pp": 4, "tp": 8, "dp_shard": 2}) == (("tp", 8), ("dp_shard", 2))
    assert normalize_layout({"pp": 4}) == normalize_layout({}) == (("dp_shard", 1),)
    with pytest.raises(LayoutError, match="'pp' must be a positive integer"):
        normalize_layout({"pp": 0})


def test_no_parameter_memory_is_allocated() -> None:
    # 40k x 40k bf16 weights: 3.2 GB each if they were real; the trace must not care.
    seen: list[nn.Module] = []

    class Huge(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.out = nn.Linear(8, 40_000), nn.Linear(40_000, 8)
            self.layers = nn.ModuleList([nn.Linear(40_000, 40_000)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.layers[0](self.inp(x)))

    def build(n: int) -> nn.Module:
        seen.append(Huge())
        return seen[-1]

    spec = ModelSpec(name="huge", key="huge", n_layers=1, build=build,
                     make_inputs=lambda b: ((torch.randn(b, 8),), torch.randn(b, 8)), loss=F.mse_loss)
    from torch._subclasses.fake_tensor import FakeTensor

    t = trace_step(spec, None, {}, n_layers=1)
    assert all(isinstance(p, FakeTensor) for p in seen[0].parameters())
    assert t.summary().flops_by_phase["forward"] == 2 * (8 * 40_000 + 40_000**2 + 40_000 * 8)


def test_flattened_group_is_placed_by_its_ranks() -> None:
    # A parallelize function that all-reduces over a flattened (dp_shard, tp) group and over
    # dp_replicate: the first has no mesh dim of its own, the second does.
    from torch.distributed._functional_collectives import all_reduce

    from topomesh.trace.graph import CollectiveRecord

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8)])
            self.groups: list = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.layers[0](x)
            for g in self.groups:
                x = all_reduce(x, "sum", g)
            return x

    def parallelize(model: Net, mesh) -> Net:  # noqa: ANN001
        model.groups = [mesh["dp_shard", "tp"]._flatten("dp_shard_tp").get_group(), mesh.get_group("dp_replicate")]
        return model

    spec = ModelSpec(name="flat", key="flat", n_layers=1, build=lambda n: Net(),
                     make_inputs=lambda b: ((torch.randn(b, 8),), torch.randn(b, 8)), loss=F.mse_loss)
    t = trace_step(spec, parallelize, {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, n_layers=1, optimizer=None)
    fwd = [(e.mesh_axis, e.group_size) for e in t.events() if isinstance(e, CollectiveRecord) and e.phase == "forward"]
    assert fwd == [("dp_shard+tp", 4), ("dp_replicate", 2)]
