"""Timing ops for a GPU, on a machine without one: the arithmetic of the busy-queue timing
(a stand-in for ``torch.cuda``), where host-scalar work and a CPU trace's attention run, and
the host issue times stored beside the op table."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from topomesh.cost import ops
from topomesh.cost.opdb import OpProfileDB, OpTiming, host_fingerprint
from topomesh.cost.ops import CPU_ATTENTION, _gpu_attention, _host_scalar, profile_ops, time_op
from topomesh.trace.graph import OpRecord, TensorMeta

SCALAR = TensorMeta(shape=(), dtype="float32", stride=())
Q = TensorMeta(shape=(1, 2, 16, 8), dtype="float32", stride=(256, 8, 16, 1))  # (B, H, S, D) of a (B, S, H, D) tensor
LSE = TensorMeta(shape=(1, 2, 16), dtype="float32", stride=(32, 1, 2))
FWD = OpRecord(op="aten._scaled_dot_product_flash_attention_for_cpu.default", inputs=(Q, Q, Q), outputs=(Q, LSE),
               args=(0.0, True))
BWD = OpRecord(op="aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
               inputs=(Q, Q, Q, Q, Q, LSE), outputs=(Q, Q, Q), args=(0.0, True))


class _FakeCuda:
    """``torch.cuda`` for :func:`ops._cuda_times`: every event pair reads ``elapsed_ms``, the
    busy kernel and synchronize are recorded."""

    def __init__(self, elapsed_ms: float) -> None:
        self.elapsed_ms = elapsed_ms
        self.slept: list[int] = []
        outer = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing

            def record(self) -> None:
                pass

            def elapsed_time(self, end: object) -> float:
                return outer.elapsed_ms

        self.Event = Event

    def synchronize(self, device: object = None) -> None:
        pass

    def _sleep(self, cycles: int) -> None:
        self.slept.append(cycles)


def test_cuda_times_divide_each_groups_events_by_its_calls(monkeypatch):
    fake = _FakeCuda(elapsed_ms=2.0)
    monkeypatch.setattr(torch, "cuda", fake)
    calls = []
    device, host = ops._cuda_times(lambda: calls.append(1), "cuda", warmup=2, min_repeats=5, max_repeats=50,
                                   budget_s=1e-9)
    # budget spent at once: min_repeats=5 calls over 3 groups -> 2 a group; 2 + 1 + 3 * 2 calls in all
    assert len(calls) == 2 + 1 + ops.GROUPS * 2
    assert device == [pytest.approx(2.0e-3 / 2)] * ops.GROUPS  # 2 ms per group of 2 calls: 1 ms a call
    assert len(host) == ops.GROUPS and all(h > 0 for h in host)
    assert len(fake.slept) == 1 and fake.slept[0] >= 0


def test_cuda_times_floor_an_op_that_launches_nothing(monkeypatch):
    monkeypatch.setattr(torch, "cuda", _FakeCuda(elapsed_ms=0.0))
    device, _ = ops._cuda_times(lambda: None, "cuda", warmup=0, min_repeats=3, max_repeats=3, budget_s=1e-9)
    assert device == [ops.MIN_OP_S] * ops.GROUPS


def test_the_busy_kernel_outlasts_the_issuing_and_is_bounded(monkeypatch):
    fake = _FakeCuda(elapsed_ms=1.0)
    monkeypatch.setattr(torch, "cuda", fake)
    ops._cuda_times(lambda: sum(range(20_000)), "cuda", warmup=0, min_repeats=6, max_repeats=6, budget_s=1e-9)
    # six calls behind the kernel; each estimated at least as long as one call took here
    assert fake.slept[0] / ops.GPU_CLOCK_HZ <= ops.MAX_BUSY_S
    assert fake.slept[0] > 0


def test_work_on_0_dim_tensors_only_is_the_hosts():
    step_add = OpRecord(op="aten.add_.Tensor", inputs=(SCALAR, SCALAR), outputs=(SCALAR,))
    item = OpRecord(op="aten._local_scalar_dense.default", inputs=(SCALAR,), outputs=())
    grad_add = OpRecord(op="aten.add_.Tensor", inputs=(Q, SCALAR), outputs=(Q,))
    assert _host_scalar(step_add) and _host_scalar(item)
    assert not _host_scalar(grad_add)
    assert not _host_scalar(OpRecord(op="aten.empty.memory_format", inputs=(), outputs=()))


def test_host_scalar_work_asked_for_on_a_gpu_is_timed_on_the_cpu():
    item = OpRecord(op="aten._local_scalar_dense.default", inputs=(SCALAR,), outputs=())
    t = time_op(item, "cuda")  # no CUDA here: only the CPU path can have run it
    assert t.method.startswith("cpu ") and t.host_s is None and t.median_s > 0


def test_cpu_attention_records_run_as_the_gpu_step_calls_attention():
    assert set(CPU_ATTENTION) == {FWD.op, BWD.op}
    out = _gpu_attention(FWD, "cpu")()
    assert out.shape == (1, 2, 16, 8)
    grads = _gpu_attention(BWD, "cpu")()
    assert [tuple(g.shape) for g in grads] == [(1, 2, 16, 8)] * 3
    # the backward call is repeatable (its forward graph is kept) and gives autograd's gradients
    again = _gpu_attention(BWD, "cpu")
    first, second = again(), again()
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b)


def test_gpu_attention_backward_is_autograd_of_causal_sdpa(monkeypatch):
    made = []
    real = ops.make_tensor

    def keep(meta, device):  # noqa: ANN001
        t = real(meta, device)
        made.append(t)
        return t

    monkeypatch.setattr(ops, "make_tensor", keep)
    grads = _gpu_attention(BWD, "cpu")()
    q, k, v, grad = made  # q, k, v from inputs 1..3, then grad_out (input 0)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got, ref)


def test_profile_ops_stores_a_gpus_host_issue_times_beside_its_table(tmp_path, monkeypatch):
    a = TensorMeta(shape=(4, 4), dtype="float32", stride=(4, 1))
    rec = OpRecord(op="aten.mm.default", inputs=(a, a), outputs=(a,), flops=128)

    def fake_time_op(record, device, **_):  # noqa: ANN001
        return OpTiming(key=ops.profile_key(record), median_s=3e-6, repeats=3, warmup=2, method="cuda events",
                        host_s=7e-6)

    monkeypatch.setattr(ops, "time_op", fake_time_op)
    with OpProfileDB(tmp_path / "t.sqlite") as db:
        run = profile_ops([rec], db, device="cuda", fingerprint="NVIDIA H100 80GB HBM3")
        assert run.profiled == 1
        key = ops.profile_key(rec)
        assert db.table("NVIDIA H100 80GB HBM3") == {key: 3e-6}
        assert db.table(host_fingerprint("NVIDIA H100 80GB HBM3")) == {key: 7e-6}


def test_a_cpu_timing_stores_no_host_table(tmp_path):
    a = TensorMeta(shape=(8, 8), dtype="float32", stride=(8, 1))
    rec = OpRecord(op="aten.mm.default", inputs=(a, a), outputs=(a,), flops=1024)
    with OpProfileDB(tmp_path / "t.sqlite") as db:
        profile_ops([rec], db, device="cpu", fingerprint="cpu-test")
        assert len(db.table("cpu-test")) == 1 and db.table(host_fingerprint("cpu-test")) == {}


def test_op_timing_host_field_defaults_to_none():
    t = OpTiming(key=("a", "b", "c", "d", "e"), median_s=1.0, repeats=1, warmup=0, method="m")
    assert t.host_s is None and dataclasses.replace(t, host_s=2.0).host_s == 2.0
