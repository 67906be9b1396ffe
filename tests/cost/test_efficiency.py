"""Kernel efficiency: GEMM tile/wave quantization under the MAMF ceiling, attention, memory.

Expected values by hand from the cited figures in the device data files.
"""

from __future__ import annotations

import pytest

from topomesh.cost.devices import DeviceSpec, device_spec
from topomesh.cost.efficiency import gemm_efficiency, kernel_efficiency, op_efficiency
from topomesh.cost.ops import roofline_time_s
from topomesh.topology.model import DeviceKind
from topomesh.trace.graph import OpRecord, TensorMeta

A100 = device_spec("A100-SXM4-80GB")
H100 = device_spec("H100-SXM5-80GB")


def _t(*shape: int, dtype: str = "bfloat16") -> TensorMeta:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.insert(0, acc)
        acc *= d
    return TensorMeta(shape=shape, dtype=dtype, stride=tuple(stride))


def test_well_quantized_gemm_reaches_the_ceiling():
    # 128 x 108 = 13824 rows, 256 columns: exactly 108 tiles, one full wave on 108 SMs
    assert gemm_efficiency(A100, "bfloat16", m=128 * 108, n=256) == pytest.approx(0.8692)


def test_badly_quantized_gemms_lose_to_tiles_and_waves():
    # wave: 109 tiles need 2 waves of 108: 0.8692 x 109 / 216
    assert gemm_efficiency(A100, "bfloat16", m=128 * 109, n=256) == pytest.approx(0.8692 * 109 / 216)
    # tile: a 129 x 256 output pads to 2 tiles of 128 x 256 (one wave): 0.8692 x 129*256 / (108*128*256)
    assert gemm_efficiency(A100, "bfloat16", m=129, n=256) == pytest.approx(0.8692 * 129 / (108 * 128))
    # tile rounding decides the waves: 129 rows are 2 tile rows, x 60 tile columns = 120 tiles = 2 waves
    # (129/128 x 60 = 60.5 tiles of work would fit one): 0.8692 x 129*15360 / (2*108*128*256)
    assert gemm_efficiency(A100, "bfloat16", m=129, n=256 * 60) == pytest.approx(
        0.8692 * 129 * 15360 / (2 * 108 * 128 * 256))
    # the classic square case: 4096^2 = 512 tiles, 5 waves on 108 SMs (540 slots)
    assert gemm_efficiency(A100, "bfloat16", m=4096, n=4096) == pytest.approx(0.8692 * 512 / 540)
    # batch multiplies tiles: 8 x (2048 x 2048) = 8 x 128 = 1024 tiles on 132 SMs = 8 waves (1056)
    assert gemm_efficiency(H100, "bfloat16", m=2048, n=2048, batch=8) == pytest.approx(0.8033 * 1024 / 1056)


def test_ceiling_per_dtype():
    # fp8 on H100: MAMF 1402.6 / 1979 = 0.7087; float32 has no figure: quantization only
    assert gemm_efficiency(H100, "float8_e4m3fn", m=128 * 132, n=256) == pytest.approx(0.7087)
    assert gemm_efficiency(H100, "torch.float32", m=128 * 132, n=256) == pytest.approx(1.0)


def test_attention_and_memory_fractions():
    # FlashAttention-2 on A100: 73 % both passes; FA3 on H100: 75 % forward, 0.35 x 1.625 = 0.57 backward
    assert op_efficiency(A100, "attention", "aten._scaled_dot_product_flash_attention.default", "bfloat16",
                         None) == pytest.approx((0.73, 0.88))
    assert op_efficiency(H100, "attention", "aten._scaled_dot_product_flash_attention_backward.default",
                         "bfloat16", None) == pytest.approx((0.57, 0.9))
    assert op_efficiency(H100, "elementwise", "aten.mul.Tensor", "bfloat16", (4, 4)) == (1.0, 0.9)


def test_measured_cpu_is_a_pure_roofline():
    cpu = DeviceSpec(name="CPU test", kind=DeviceKind.CPU, peak_flops={"float32": 1e11},
                     memory_bandwidth_GBps=10.0, memory_bytes=2**30, measured=True)
    assert kernel_efficiency(cpu) is None
    # a measured spec is never priced with a datasheet device's kernel figures, whatever its name
    measured_a100 = DeviceSpec(name="A100-SXM4-80GB", kind=DeviceKind.GPU, peak_flops={"float32": 1e13},
                               memory_bandwidth_GBps=1000.0, memory_bytes=2**30, measured=True)
    assert kernel_efficiency(measured_a100) is None
    assert gemm_efficiency(cpu, "float32", m=3, n=5) == 1.0
    mm = OpRecord(op="aten.mm.default", inputs=(_t(3, 7, dtype="float32"), _t(7, 5, dtype="float32")),
                  outputs=(_t(3, 5, dtype="float32"),), flops=2 * 3 * 5 * 7, bytes_moved=0)
    assert roofline_time_s(mm, cpu) == pytest.approx(210 / 1e11)


def test_roofline_prices_bmm_by_its_output_shape():
    # bmm 8 x (2048x1024 @ 1024x2048) bf16 on H100: 2*8*2048*2048*1024 FLOPs at 989.5e12 x 0.8033 x 1024/1056
    flops = 2 * 8 * 2048 * 2048 * 1024
    bmm = OpRecord(op="aten.bmm.default", inputs=(_t(8, 2048, 1024), _t(8, 1024, 2048)),
                   outputs=(_t(8, 2048, 2048),), flops=flops, bytes_moved=0)
    assert roofline_time_s(bmm, H100) == pytest.approx(flops / (989.5e12 * 0.8033 * 1024 / 1056))


def test_causal_attention_costs_half_the_counted_flops():
    # Llama-8B-like attention, one sample: q, k, v of (1, 32 heads, 8192, 128) in bf16.
    # PyTorch counts 4·s²·d·heads = 4 · 8192² · 128 · 32 = 1.0995e12 FLOPs either way; the
    # H100 FlashAttention forward figure is 0.75 of 989.5 TFLOP/s, so a full mask takes
    # 1.0995e12 / (0.75 · 989.5e12) = 1.4815 ms and a causal one, which skips half, 0.7408 ms
    # (the memory term, 4 tensors · 64 MiB / (0.9 · 3350 GB/s) = 0.089 ms, does not bind).
    from topomesh.cost.devices import device_spec
    from topomesh.cost.ops import roofline_time_s
    from topomesh.trace.graph import OpRecord, TensorMeta

    t = TensorMeta(shape=(1, 32, 8192, 128), dtype="bfloat16", stride=(32 * 8192 * 128, 8192 * 128, 128, 1))
    flops = 4 * 8192**2 * 128 * 32

    def rec(causal: bool) -> OpRecord:
        return OpRecord(op="aten._scaled_dot_product_flash_attention.default", inputs=(t, t, t), outputs=(t,),
                        flops=flops, args=(0.0, causal, False))

    h100 = device_spec("H100-SXM5-80GB")
    assert roofline_time_s(rec(False), h100) * 1e3 == pytest.approx(1.4815, rel=1e-3)
    assert roofline_time_s(rec(True), h100) * 1e3 == pytest.approx(0.7408, rel=1e-3)
