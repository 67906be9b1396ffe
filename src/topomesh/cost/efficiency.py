"""Kernel efficiency: the fraction of a device's peak an op reaches, by op class and shape.

Used by the roofline (:func:`topomesh.cost.ops.roofline_time_s`) for ops with no measured
time — a measured op table always takes precedence. The figures live in the device data
files (``data/devices/*.json``, key ``kernel_efficiency``, each cited in ``sources``);
nothing here is fitted to training step times.

* **matmul**: a measured large-GEMM ceiling (MAMF) times tile and wave quantization —
  cuBLAS computes the output in ``tile_M × tile_N`` tiles, one per SM at a time, so

      efficiency = ceiling × (M·N·batch) / (waves × SMs × tile_M × tile_N),
      tiles = ⌈M/tile_M⌉·⌈N/tile_N⌉·batch,  waves = ⌈tiles / SMs⌉

  (a model from quantization, not a fit). M, N and the batch come from the output shape.
* **attention**: the FlashAttention forward / backward fraction of peak.
* **memory-bound terms** of every op: the fraction of datasheet bandwidth kernels reach.

A device without a ``kernel_efficiency`` section (the measured CPU, whose peaks are
themselves achieved figures) gets 1.0 everywhere: a pure roofline.

>>> from topomesh.cost.devices import device_spec
>>> h100 = device_spec("H100-SXM5-80GB")
>>> round(gemm_efficiency(h100, "bfloat16", m=4096, n=4096), 4)  # 0.8033 x 512 tiles / (4 waves x 132)
0.779
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from types import MappingProxyType

from topomesh.cost.devices import DeviceSpec
from topomesh.errors import CalibrationError


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelEfficiency:
    """A device's ``kernel_efficiency`` section."""

    sms: int
    """Streaming multiprocessors (one GEMM tile each at a time)."""
    tile_m: int
    tile_n: int
    matmul_ceiling: Mapping[str, float]
    """Large-GEMM fraction of peak per torch dtype name; dtypes not listed get 1.0."""
    attention_forward: float
    attention_backward: float
    memory: float
    """Fraction of the datasheet memory bandwidth memory-bound kernels reach."""

    def __post_init__(self) -> None:
        fractions = [*self.matmul_ceiling.values(), self.attention_forward, self.attention_backward, self.memory]
        if self.sms < 1 or self.tile_m < 1 or self.tile_n < 1 or not all(0 < f <= 1 for f in fractions):
            raise CalibrationError(f"kernel efficiency {self!r}: SMs and tiles must be >= 1, fractions in (0, 1]")
        object.__setattr__(self, "matmul_ceiling", MappingProxyType(dict(self.matmul_ceiling)))


@cache
def _sections() -> Mapping[str, KernelEfficiency]:
    out: dict[str, KernelEfficiency] = {}
    root = resources.files("topomesh.cost").joinpath("data/devices")
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".json"):
            continue
        raw = json.loads(entry.read_text())
        sec = raw.get("kernel_efficiency")
        if sec is None:
            continue
        try:
            out[str(raw["name"])] = KernelEfficiency(
                sms=int(sec["sms"]), tile_m=int(sec["gemm_tile_MxN"][0]), tile_n=int(sec["gemm_tile_MxN"][1]),
                matmul_ceiling={k: float(v) for k, v in sec["matmul_ceiling"].items()},
                attention_forward=float(sec["attention"]["forward"]),
                attention_backward=float(sec["attention"]["backward"]), memory=float(sec["memory"]),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise CalibrationError(f"data/devices/{entry.name}: malformed kernel_efficiency ({exc!r})") from None
    return MappingProxyType(out)


def kernel_efficiency(spec: DeviceSpec) -> KernelEfficiency | None:
    """The shipped section for ``spec`` (by name), or None (measured CPU, unknown device)."""
    return None if spec.measured else _sections().get(spec.name)


def gemm_efficiency(spec: DeviceSpec, dtype: str, *, m: int, n: int, batch: int = 1) -> float:
    """Fraction of peak a GEMM with an ``m × n`` output (``batch`` of them) reaches on ``spec``.

    A100 (108 SMs), bf16, 128×256 tiles: a 4096×4096 output is 32·16 = 512 tiles, 5 waves
    (540 slots): 0.8692 × 512/540 = 0.8241; a 4224×4096 one is 33·16 = 528 tiles, 5 waves:
    0.8692 × 4224·4096 / (540·128·256) = 0.8499 — padding the 33rd tile row costs less than
    the wave it fills.
    """
    eff = kernel_efficiency(spec)
    if eff is None:
        return 1.0
    ceiling = eff.matmul_ceiling.get(dtype.removeprefix("torch."), 1.0)
    m, n, batch = max(1, m), max(1, n), max(1, batch)
    tiles = math.ceil(m / eff.tile_m) * math.ceil(n / eff.tile_n) * batch
    waves = math.ceil(tiles / eff.sms)
    return ceiling * (m * n * batch) / (waves * eff.sms * eff.tile_m * eff.tile_n)


def output_mn(shape: Sequence[int]) -> tuple[int, int, int]:
    """(M, N, batch) of a matmul output shape: the last two dims, the product of the rest.

    >>> output_mn((8, 2048, 4096)), output_mn((4096,)), output_mn(())
    ((2048, 4096, 8), (1, 4096, 1), (1, 1, 1))
    """
    dims = [int(d) for d in shape]
    if not dims:
        return 1, 1, 1
    if len(dims) == 1:
        return 1, dims[0], 1
    return dims[-2], dims[-1], math.prod(dims[:-2])


def is_causal(op: str, args: Sequence[object]) -> bool:
    """Whether a recorded attention op runs with a causal mask, from its ``is_causal`` argument.

    The tracer records an op's non-tensor positional arguments in schema order (optional
    tensors given as None included); ``is_causal`` is found by name in the op's schema.

    >>> is_causal("aten._scaled_dot_product_flash_attention_for_cpu.default", (0.0, True))
    True
    >>> is_causal("aten._scaled_dot_product_flash_attention.default", (0.0, False, False))
    False
    """
    from topomesh.cost.ops import resolve_op

    try:
        schema = resolve_op(op)._schema
    except LookupError:
        return False
    import torch

    def plain_tensor(a: object) -> bool:
        return isinstance(a.type, torch._C.TensorType)  # type: ignore[attr-defined]

    def optional_tensor(a: object) -> bool:
        t = a.type  # type: ignore[attr-defined]
        return isinstance(t, torch._C.OptionalType) and isinstance(t.getElementType(), torch._C.TensorType)

    positional = [a for a in schema.arguments if not a.kwarg_only and not plain_tensor(a)]
    for names in ([a.name for a in positional], [a.name for a in positional if not optional_tensor(a)]):
        if "is_causal" in names and names.index("is_causal") < len(args):
            value = args[names.index("is_causal")]
            if isinstance(value, bool):
                return value
    return False


def op_efficiency(spec: DeviceSpec, op_class: str, op: str, dtype: str,
                  output_shape: Sequence[int] | None) -> tuple[float, float]:
    """(compute, memory) fraction of peak for one op of class ``op_class`` (an ``OpClass`` value).

    Matmul: :func:`gemm_efficiency` on the output shape; attention: the forward or backward
    figure by the op name; other classes: 1.0 of compute (their compute term rarely binds).
    The memory fraction is the device's for every class.
    """
    eff = kernel_efficiency(spec)
    if eff is None:
        return 1.0, 1.0
    if op_class == "matmul" and output_shape is not None:
        m, n, b = output_mn(output_shape)
        compute = gemm_efficiency(spec, dtype, m=m, n=n, batch=b)
    elif op_class == "attention":
        compute = eff.attention_backward if "backward" in op else eff.attention_forward
    else:
        compute = 1.0
    return compute, eff.memory
