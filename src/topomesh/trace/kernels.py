"""The kernels a CUDA build runs where a CPU build decomposes: traces for GPU clusters.

A CPU build of PyTorch has no fused RMSNorm: ``F.rms_norm`` is a composite there, and a
trace on CPU fake tensors records its pieces — per norm a ``pow``, ``mean``, ``add``,
``rsqrt``, two ``mul`` and the float32 round trip forward, a dozen more ops backward. A
CUDA build runs one kernel each way, ``aten._fused_rms_norm`` and
``aten._fused_rms_norm_backward`` (PyTorch's profiler shows them in a training step on an
H100). Priced one by one on a GPU the pieces cost several times the fused kernels: in
``topomesh validate --device cuda`` on an H100 (``benchmarks/validate_gpu_llama.json``) the
17 norms of a micro-batch took 0.93 ms fused, while their pieces, timed on that GPU, came
to about 9 ms.

:class:`GpuKernels`, on while a step is traced for a GPU cluster
(``trace_step(..., gpu_kernels=True)``), issues ``F.rms_norm`` on plain tensors as the
custom op ``topomesh::fused_rms_norm``, whose backward is ``topomesh::fused_rms_norm_backward``;
their fake kernels give the shapes and :mod:`topomesh.trace.convert` records them under the
names of the aten ops a GPU runs (:data:`ATEN_NAMES`), with the aten ops' arguments, so the
op table on a GPU times the real kernels. On DTensors (sequence parallel) the call is left
as it is: the custom op has no sharding rule, and DTensor decomposes the norm as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

ATEN_NAMES = {
    "topomesh.fused_rms_norm.default": "aten._fused_rms_norm.default",
    "topomesh.fused_rms_norm_backward.default": "aten._fused_rms_norm_backward.default",
}
"""Recorded op name of each custom op: the aten op a CUDA build runs, same arguments."""


def _rstd_shape(x: torch.Tensor, normalized_shape: Sequence[int]) -> list[int]:
    return [*x.shape[: x.dim() - len(normalized_shape)], *([1] * len(normalized_shape))]


@torch.library.custom_op("topomesh::fused_rms_norm", mutates_args=())
def fused_rms_norm(input: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor,  # noqa: A002
                   eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten._fused_rms_norm`` (output, float32 rstd); on CPU its composite."""
    out, rstd = torch.ops.aten._fused_rms_norm(input, normalized_shape, weight, eps)
    return out.clone(), rstd.clone()  # a custom op may not return views of its inputs


@fused_rms_norm.register_fake
def _(input: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor,  # noqa: A002
      eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(input), input.new_empty(_rstd_shape(input, normalized_shape), dtype=torch.float32)


@torch.library.custom_op("topomesh::fused_rms_norm_backward", mutates_args=())
def fused_rms_norm_backward(grad_out: torch.Tensor, input: torch.Tensor, normalized_shape: list[int],  # noqa: A002
                            rstd: torch.Tensor, weight: torch.Tensor, output_mask: list[bool]
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten._fused_rms_norm_backward`` (grad of input, grad of weight); on CPU, which has no
    kernel for it, the same from the formula: with ``r = rstd`` and ``u = grad_out * weight``,
    ``grad_input = r * u - input * r**3 * mean(u * input)`` over the normalized dims and
    ``grad_weight`` the sum of ``grad_out * input * r`` over the others."""
    if input.device.type != "cpu":
        gi, gw = torch.ops.aten._fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask)
        return gi, gw
    dims = tuple(range(input.dim() - len(normalized_shape), input.dim()))
    x, g, r = input.float(), grad_out.float(), rstd.float()
    u = g * weight.float()
    gi = r * u - x * r.pow(3) * (u * x).mean(dim=dims, keepdim=True)
    gw = (g * x * r).sum(dim=tuple(range(input.dim() - len(normalized_shape))))
    return gi.to(input.dtype), gw.to(weight.dtype)


@fused_rms_norm_backward.register_fake
def _(grad_out: torch.Tensor, input: torch.Tensor, normalized_shape: list[int], rstd: torch.Tensor,  # noqa: A002
      weight: torch.Tensor, output_mask: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(input), torch.empty_like(weight)


def _setup(ctx: object, inputs: tuple, output: tuple) -> None:
    x, normalized_shape, weight, _ = inputs
    ctx.normalized_shape = normalized_shape  # type: ignore[attr-defined]
    ctx.save_for_backward(x, weight, output[1])  # type: ignore[attr-defined]


def _backward(ctx: object, grad_out: torch.Tensor, _grad_rstd: torch.Tensor) -> tuple:
    x, weight, rstd = ctx.saved_tensors  # type: ignore[attr-defined]
    gi, gw = torch.ops.topomesh.fused_rms_norm_backward(grad_out, x, ctx.normalized_shape, rstd, weight,  # type: ignore[attr-defined]
                                                        [True, True])
    return gi, None, gw, None


fused_rms_norm.register_autograd(_backward, setup_context=_setup)

_RMS_NORM = F.rms_norm


def _gpu_rms_norm(input: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None = None,  # noqa: A002
                  eps: float | None = None) -> torch.Tensor:
    """``F.rms_norm`` as a CUDA build runs it: the fused op on plain tensors with a weight."""
    from torch.distributed.tensor import DTensor

    if weight is None or isinstance(input, DTensor) or isinstance(weight, DTensor):
        return _RMS_NORM(input, normalized_shape, weight, eps)
    return torch.ops.topomesh.fused_rms_norm(input, list(normalized_shape), weight, eps)[0]


class Replaced(torch.overrides.TorchFunctionMode):
    """While on, ``module.name`` is ``replacement`` instead of ``original``: calls that look the
    function up in the module get it through the attribute, and calls of ``original`` looked
    up before reach the mode, which hands them over. Both are needed: a mode is off while its
    own handler runs a call, so inside ``backward`` (where activation checkpointing recomputes
    the forward) only the module attribute still answers."""

    def __init__(self, module: object, name: str, original: object, replacement: object) -> None:
        super().__init__()
        self.module, self.name, self.original, self.replacement = module, name, original, replacement

    def __enter__(self) -> Replaced:
        setattr(self.module, self.name, self.replacement)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        setattr(self.module, self.name, self.original)
        super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is self.original:
            return self.replacement(*args, **kwargs)
        return func(*args, **kwargs)


class GpuKernels(Replaced):
    """While on, ``F.rms_norm`` is issued as a GPU runs it (:func:`_gpu_rms_norm`)."""

    def __init__(self) -> None:
        super().__init__(F, "rms_norm", _RMS_NORM, _gpu_rms_norm)
