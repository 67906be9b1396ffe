"""Device specs: shipped datasheet figures with sources, and the measured, cached CPU spec."""

from __future__ import annotations

import json

import pytest

from topomesh.cost import devices
from topomesh.cost.devices import (
    DeviceSpec,
    builtin_specs,
    cpu_spec,
    device_by_fingerprint,
    device_spec,
    mem_total_bytes,
)
from topomesh.errors import CalibrationError
from topomesh.topology.model import DeviceKind

SHIPPED = {"A100-SXM4-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "H200-SXM-141GB"}


def test_every_shipped_gpu_is_present_with_sources_for_every_number():
    specs = {s.name: s for s in builtin_specs()}
    assert set(specs) >= SHIPPED
    for spec in specs.values():
        assert spec.kind is DeviceKind.GPU and not spec.measured
        for key in ("peak_dense_tflops", "memory_bandwidth_GBps", "memory_GB"):
            assert "datasheet" in spec.sources[key].lower(), (spec.name, key)
        assert {"float32", "tfloat32", "bfloat16", "float16"} <= set(spec.peak_flops)


def test_datasheet_figures_are_dense_not_sparse():
    # H100 SXM datasheet: BF16 1,979 TFLOPS *with sparsity* -> 989.5 dense; FP8 3,958 -> 1,979.
    h100 = device_spec("H100-SXM5-80GB")
    assert h100.peak_flops_per_s("bfloat16") == pytest.approx(989.5e12)
    assert h100.peak_flops_per_s("float8_e4m3fn") == pytest.approx(1979e12)
    assert h100.memory_bandwidth_GBps == 3350.0
    a100 = device_spec("A100-SXM4-40GB")
    assert a100.peak_flops_per_s("bfloat16") == pytest.approx(312e12)
    assert "float8_e4m3fn" not in a100.peak_flops  # no FP8 on Ampere
    assert device_spec("A100-SXM4-80GB").memory_bandwidth_GBps == 2039.0
    h200 = device_spec("H200-SXM-141GB")
    assert h200.memory_bytes == 141 * 10**9 and h200.memory_bandwidth_GBps == 4800.0


def test_lookup_by_name_and_by_reported_device_name():
    assert device_spec("h100-sxm5-80gb").name == "H100-SXM5-80GB"
    assert device_by_fingerprint("NVIDIA H100 80GB HBM3").name == "H100-SXM5-80GB"
    assert device_by_fingerprint("NVIDIA A100-SXM4-40GB").name == "A100-SXM4-40GB"
    assert device_by_fingerprint("NVIDIA H200").name == "H200-SXM-141GB"
    assert device_by_fingerprint("NVIDIA GeForce GTX 1080") is None
    with pytest.raises(CalibrationError, match="no device spec named 'B300'"):
        device_spec("B300")


def test_tf32_is_used_only_when_asked():
    a100 = device_spec("A100-SXM4-80GB")
    assert a100.peak_flops_per_s("float32") == pytest.approx(19.5e12)
    assert a100.peak_flops_per_s("float32", tf32=True) == pytest.approx(156e12)


def test_spec_validation_names_the_bad_value():
    with pytest.raises(CalibrationError, match="float32 must be > 0"):
        DeviceSpec(name="x", kind=DeviceKind.CPU, peak_flops={"float32": 0.0}, memory_bandwidth_GBps=1.0,
                   memory_bytes=1)


def test_meminfo_parsing():
    assert mem_total_bytes("MemTotal:  1000 kB\n") == 1024000


def test_cpu_spec_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    small = {"matmul_n": 128, "copy_bytes": 4 * 2**20, "budget_s": 0.02}
    spec = cpu_spec(directory=tmp_path, **small)
    assert spec.measured and spec.kind is DeviceKind.CPU
    assert all(v > 0 for v in spec.peak_flops.values())
    assert spec.memory_bandwidth_GBps > 0 and spec.memory_bytes == mem_total_bytes()
    assert "torch.mm" in spec.sources["peak_dense_tflops"] and "copy_" in spec.sources["memory_bandwidth_GBps"]
    files = list((tmp_path / "devices").glob("cpu-*.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text())["measured"] is True

    def no_measuring(**_):
        raise AssertionError("measured again although a cached spec exists")

    monkeypatch.setattr(devices, "measure_cpu", no_measuring)
    again = cpu_spec(directory=tmp_path)
    assert again.name == spec.name
    assert again.memory_bandwidth_GBps == pytest.approx(spec.memory_bandwidth_GBps)
    assert again.peak_flops_per_s("float32") == pytest.approx(spec.peak_flops_per_s("float32"))


def test_cpu_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(tmp_path / "c"))
    assert devices.cache_dir() == tmp_path / "c"
