"""Transient memory of a segment: its temporaries' live peak in graph order, by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from topomesh.trace.graph import Phase
from topomesh.trace.tracer import _liveness

N = 1024  # float32 elements: 4,096 bytes a tensor


FAKE = FakeTensorMode(allow_non_fake_inputs=True)


def _peak(fn, *args) -> int:  # noqa: ANN001
    """Traced as the tracer traces (inside a fake mode, so a view's value shares its base's storage)."""
    with FAKE:
        gm = make_fx(fn)(*args)
    where = {n: 0 for n in gm.graph.nodes}
    saved, peak, _ = _liveness(gm, where, [(Phase.BACKWARD, None)])
    assert saved == {}
    return peak.get(0, 0)


def _x() -> torch.Tensor:
    with FAKE:
        return torch.randn(N)


def test_inputs_and_outputs_of_a_node_are_live_together():
    def step(x):
        a = x * 2  # a: until c
        b = a + 1  # b: until d
        c = a * b  # a, b, c live: 3 tensors
        d = b + c  # b, c, d live: 3 tensors
        return d.sum()  # d read here; the sum leaves the segment (the graph's output)

    assert _peak(step, _x()) == 3 * 4 * N  # the largest single tensor is 4 * N


def test_a_view_keeps_its_base_alive_and_counts_once():
    def step(x):
        a = x * 2
        v = a.view(32, 32)  # same storage as a
        s = v.sum()  # the view's last reader; a is read again below
        b = x + 1
        c = a * b  # a, b, c live, and s (4 bytes) until the end
        return (s + c.sum()).reshape(1)

    assert _peak(step, _x()) == 3 * 4 * N + 4


def test_parameters_their_derivatives_and_what_leaves_are_not_temporaries():
    with FAKE:
        w = torch.randn(N)

    def step(x):
        wt = w * 3  # from the parameter alone (FSDP2's gathered parameters are such): not counted
        a = x * 2  # a temporary
        out = a + wt  # leaves as the graph's output
        return out

    assert _peak(step, _x()) == 4 * N  # a alone: out leaves, wt is parameter-made


def test_what_a_segment_makes_from_parameters_alone():
    """FSDP2's replicate-only units cast their parameters to the compute dtype without an
    all-gather; the trace counts what a segment makes from parameters alone, by storage: a
    float32 product of the parameter (4 N bytes) and its bfloat16 cast (2 N), not a view of it
    (its storage), not a factory (made from nothing) and not what comes from the input."""
    with FAKE:
        w = torch.randn(N)

    def step(x):
        wt = w * 3  # 4 N, made from the parameter alone
        half = w.to(torch.bfloat16)  # 2 N
        v = w.view(32, 32)  # the parameter's own storage
        z = torch.zeros(N)  # from nothing
        a = x * 2  # from the input
        return (a + wt + half + v.reshape(N) + z).sum()  # every sum made from the input

    with FAKE:
        gm = make_fx(step)(_x())
    where = {n: 0 for n in gm.graph.nodes}
    _, _, made = _liveness(gm, where, [(Phase.FORWARD, None)])
    assert made == {0: 4 * N + 2 * N}


@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
@pytest.mark.parametrize("gpu_kernels", [False, True])
def test_kept_bytes_compose_from_one_block_as_from_three(checkpointing, gpu_kernels):
    """A kept tensor is charged to the segment whose backward reads it, so a one-block trace
    composed to six blocks keeps what a three-block trace composed to six keeps. Charged to the
    block that made it, the fused final norm's input (the last block's output) was counted once
    per composed block under checkpointing, where each block also keeps its own input."""
    from topomesh.models.parallelize import Checkpointing, ParallelOptions, make_parallelize
    from topomesh.models.presets import get_preset
    from topomesh.trace.tracer import trace_step, transformer_spec

    cfg = dataclasses.replace(get_preset("tiny-llama"), n_layers=3)
    spec = transformer_spec(cfg)
    par = make_parallelize(ParallelOptions(checkpointing=Checkpointing(checkpointing)))

    def kept(traced: int) -> int:
        t = trace_step(spec, par, {"dp_shard": 1}, n_layers=traced, gpu_kernels=gpu_kernels).compose(6)
        return sum(s.saved_bytes * m for s, m in zip(t.segments, t.multiplicities(), strict=True))

    assert kept(1) == kept(3) > 0


def test_the_head_keeps_the_last_blocks_output_for_the_final_norm():
    from topomesh.models.parallelize import make_parallelize
    from topomesh.models.presets import get_preset
    from topomesh.trace.result import Part
    from topomesh.trace.tracer import trace_step, transformer_spec

    cfg = get_preset("tiny-llama")
    t = trace_step(transformer_spec(cfg), make_parallelize(), {"dp_shard": 1}, n_layers=1, gpu_kernels=True)
    fwd = {s.part: s.saved_bytes for s in t.segments if s.phase is Phase.FORWARD}
    hidden = cfg.seq_len * cfg.hidden * 2  # one bf16 hidden state of the micro-batch
    # the embedding's output is the block's input, kept by the block's first norm: the block's;
    # the pre-block part keeps nothing
    assert Part.REST in fwd and min(fwd[Part.BLOCK], fwd[Part.REST]) >= hidden
    pre = next(s for s in t.segments if s.phase is Phase.FORWARD)
    assert pre.part is Part.REST and pre.saved_bytes == 0
