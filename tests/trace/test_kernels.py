"""Traces for GPU clusters: RMSNorm recorded as the fused kernels a CUDA build runs."""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

from topomesh.cost.cluster import load_cluster
from topomesh.layout.dims import Layout
from topomesh.models.parallelize import make_parallelize
from topomesh.models.presets import get_preset
from topomesh.sim.inputs import load_model
from topomesh.sim.simulate import Simulator, Training
from topomesh.trace.cache import TraceCache
from topomesh.trace.graph import OpRecord
from topomesh.trace.kernels import ATEN_NAMES, GpuKernels
from topomesh.trace.tracer import default_optimizer, trace_step, transformer_spec

FUSED, FUSED_BWD = "aten._fused_rms_norm.default", "aten._fused_rms_norm_backward.default"


def _ops(trace) -> Counter:  # noqa: ANN001
    return Counter(e.op for e in trace.events() if isinstance(e, OpRecord))


def test_a_gpu_trace_has_one_fused_kernel_per_norm_each_way():
    spec = transformer_spec(get_preset("tiny-llama"))  # 2 blocks of 2 norms, and the final norm
    gpu = _ops(trace_step(spec, make_parallelize(), {"dp_shard": 1}, n_layers=2, gpu_kernels=True))
    cpu = _ops(trace_step(spec, make_parallelize(), {"dp_shard": 1}, n_layers=2))
    assert gpu[FUSED] == gpu[FUSED_BWD] == 5
    assert cpu[FUSED] == 0 and cpu["aten.rsqrt.default"] == 5  # the CPU build's composite
    assert gpu["aten.rsqrt.default"] == 0 and gpu["aten.pow.Tensor_Scalar"] == 0


def test_the_fused_records_carry_the_aten_ops_shapes():
    cfg = get_preset("tiny-llama")
    spec = transformer_spec(cfg)
    trace = trace_step(spec, make_parallelize(), {"dp_shard": 1}, n_layers=2, batch_size=3, gpu_kernels=True)
    fwd = next(e for e in trace.events() if isinstance(e, OpRecord) and e.op == FUSED)
    bwd = next(e for e in trace.events() if isinstance(e, OpRecord) and e.op == FUSED_BWD)
    seq, hidden = cfg.seq_len, cfg.hidden
    assert [m.shape for m in fwd.inputs] == [(3, seq, hidden), (hidden,)]
    assert [m.shape for m in fwd.outputs] == [(3, seq, hidden), (3, seq, 1)] and fwd.outputs[1].dtype == "float32"
    assert list(fwd.args) == [(hidden,), cfg.norm_eps]  # int[] arguments are recorded as tuples
    # grad_out, input, rstd, weight; normalized_shape and the output mask as arguments
    assert [m.shape for m in bwd.inputs] == [(3, seq, hidden), (3, seq, hidden), (3, seq, 1), (hidden,)]
    assert [m.shape for m in bwd.outputs] == [(3, seq, hidden), (hidden,)]
    assert list(bwd.args)[0] == (hidden,) and list(bwd.args)[-1] == (True, True)
    assert fwd.bytes_moved > 0 and set(ATEN_NAMES.values()) == {FUSED, FUSED_BWD}


def test_sequence_parallel_norms_stay_as_dtensor_runs_them():
    spec = transformer_spec(get_preset("tiny-llama"))
    ops = _ops(trace_step(spec, make_parallelize(), {"tp": 2}, n_layers=2, gpu_kernels=True))
    assert ops[FUSED] == 0 and ops["aten.rsqrt.default"] > 0


def test_the_custom_ops_compute_rms_norm_and_its_gradients():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    out = torch.ops.topomesh.fused_rms_norm(x, [8], w, 1e-6)[0]
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w  # the RMSNorm formula
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, w), g)
    want = torch.autograd.grad(ref, (x, w), g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_the_mode_restores_rms_norm_and_passes_other_calls():
    before = F.rms_norm
    x = torch.randn(2, 4)
    with GpuKernels():
        assert F.rms_norm is not before
        assert torch.equal(F.rms_norm(x, (4,)), before(x, (4,)))  # no weight: the composite
        assert torch.equal(x + 1, x + 1)
    assert F.rms_norm is before


def test_gpu_clusters_trace_with_gpu_kernels_and_local_does_not(tmp_path):
    model = load_model("tiny-llama")
    training = Training(global_batch=2, micro_batch=1, seq_len=model.seq_len)
    lay = Layout.from_degrees({"dp_shard": 2})
    cache = TraceCache(tmp_path)
    gpu = _ops(Simulator(model=model, cluster=load_cluster("dgx-h100", gpus=2), cache=cache).trace(lay, training))
    cpu = _ops(Simulator(model=model, cluster=load_cluster("local", gpus=2), cache=cache).trace(lay, training))
    assert gpu[FUSED] > 0 and cpu[FUSED] == 0
    keys = {cache.key(model.spec, model.parallelize(training, True), {"dp_shard": 2}, batch_size=1,
                      dtype=torch.float32, optimizer=default_optimizer, gpu_kernels=g) for g in (False, True)}
    assert len(keys) == 2  # stored apart
