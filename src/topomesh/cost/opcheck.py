"""Which op records may be run for real: an allow-list of op families and size bounds.

``topomesh profile`` runs every distinct op of a records file with real tensors. A file is
user input, and ``torch.ops`` holds ops that touch the file system (``aten.from_file``),
write into caller-given buffers (``out=`` overloads) or allocate what their arguments say
(``aten.empty``). So only the op families a traced training step produces are run
(:data:`OP_FAMILIES`, gathered from ``topomesh trace`` of the tiny-gpt, tiny-llama and
tiny-moe presets under tp/dp_shard/cp/ep layouts, activation checkpointing and FSDP mixed
precision, plus the attention, norm and fused-optimizer variants GPUs trace to), never an
``out`` overload, and every tensor is bounded:

* at most :data:`MAX_TENSOR_DIMS` dimensions, sizes and strides non-negative integers;
* at most :data:`MAX_TENSOR_NUMEL` elements in the storage the strides span
  (``1 + Σ (size−1)·stride``), so the buffer :func:`topomesh.cost.ops.make_tensor` allocates
  is bounded too;
* inputs plus outputs at most :data:`MAX_RECORD_BYTES`, checked on the declared tensors
  and again on the outputs the op really produces (:func:`check_outputs`, a run under
  ``FakeTensorMode`` before the real one, so a size taken from an argument cannot
  allocate more).

:func:`record_problem` is the one check; :func:`topomesh.cost.ops.records_from_json`
refuses a file with it and :func:`topomesh.cost.ops.time_op` calls it again before running.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from topomesh.trace.graph import OpRecord, TensorMeta

MAX_TENSOR_DIMS = 16
"""Dimensions of one tensor (traced steps have at most 5: attention's batch × heads × seq × dim
plus one)."""
MAX_TENSOR_NUMEL = 2**32
"""Elements one tensor's storage may span: a 405B-parameter model's largest traced tensors
(logits, 8,192 tokens × 128,256 vocabulary ≈ 1.05 × 2**30 per micro-batch) fit four times."""
MAX_RECORD_BYTES = 64 * 2**30
"""Bytes of all input and output tensors of one op together (64 GiB)."""
MAX_FLOPS = 10**18
"""FLOPs of one op: the largest matmul of a 405B-parameter step is about 1.4 × 10**13
(2 · 8,192 · 16,384 · 53,248), five orders of magnitude below."""
MAX_BYTES_MOVED = 2**50
"""Bytes one op may report as moved (1 PiB)."""
MAX_ARG_DEPTH = 4
"""Nesting of the non-tensor arguments (traces nest at most 2 deep: a list of sizes)."""
MAX_ARG_ITEMS = 4096
"""Scalars and lists in one record's arguments together."""
MAX_ARG_STR = 64
"""Characters of one string argument (traces record dtypes such as ``torch.bfloat16``)."""
INT64 = 2**63
"""Integer arguments must lie in [-INT64, INT64), the range of a C++ ``int64_t``."""

DTYPES = frozenset({
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "complex64",
    "complex128", "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
})
"""Tensor dtypes a record may name (torch names without ``torch.``)."""

OP_FAMILIES: Mapping[str, frozenset[str]] = MappingProxyType({
    "matmul": frozenset({
        "aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten.addbmm", "aten.matmul", "aten.linear",
        "aten.dot", "aten.mv", "aten._scaled_mm",
    }),
    "attention": frozenset({
        "aten.scaled_dot_product_attention",
        "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_backward",
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward",
        "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_efficient_attention_backward",
        "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_cudnn_attention_backward",
        "aten._flash_attention_forward", "aten._flash_attention_backward",
        "aten._efficient_attention_forward", "aten._efficient_attention_backward",
    }),
    "elementwise": frozenset({
        "aten.add", "aten.add_", "aten.sub", "aten.sub_", "aten.rsub", "aten.mul", "aten.mul_", "aten.div",
        "aten.div_", "aten.neg", "aten.exp", "aten.log", "aten.sqrt", "aten.rsqrt", "aten.pow", "aten.square",
        "aten.abs", "aten.reciprocal", "aten.sigmoid", "aten.sigmoid_backward", "aten.tanh", "aten.tanh_backward",
        "aten.silu", "aten.silu_backward", "aten.gelu", "aten.gelu_backward", "aten.relu", "aten.threshold_backward",
        "aten.log_sigmoid_forward", "aten.log_sigmoid_backward", "aten.erf", "aten.sin", "aten.cos",
        "aten.clamp", "aten.clamp_min", "aten.clamp_max", "aten.maximum", "aten.minimum", "aten.where",
        "aten.masked_fill", "aten.masked_fill_", "aten.eq", "aten.ne", "aten.lt", "aten.le", "aten.gt", "aten.ge",
        "aten.bitwise_or", "aten.bitwise_and", "aten.bitwise_not", "aten.logical_and", "aten.logical_or",
        "aten.logical_not", "aten.fill", "aten.fill_", "aten.zero_", "aten.tril", "aten.triu",
    }),
    "reduction": frozenset({
        "aten.sum", "aten.mean", "aten.amax", "aten.amin", "aten.max", "aten.min", "aten.var", "aten.std",
        "aten.var_mean", "aten.norm", "aten.linalg_vector_norm", "aten.cumsum", "aten.argmax", "aten.argmin",
        "aten.prod", "aten.logsumexp", "aten.topk", "aten.sort", "aten.any", "aten.all",
    }),
    "softmax": frozenset({
        "aten._softmax", "aten._softmax_backward_data", "aten._log_softmax", "aten._log_softmax_backward_data",
        "aten.softmax", "aten.log_softmax",
    }),
    "norm": frozenset({
        "aten.native_layer_norm", "aten.native_layer_norm_backward", "aten.layer_norm", "aten.rms_norm",
        "aten._fused_rms_norm", "aten._fused_rms_norm_backward",
    }),
    "embedding": frozenset({
        "aten.embedding", "aten.embedding_dense_backward", "aten.embedding_backward", "aten.index_select",
        "aten.gather", "aten.scatter", "aten.scatter_add", "aten.index", "aten.index_put", "aten.index_put_",
        "aten.index_add", "aten.index_copy",
    }),
    "view_copy": frozenset({
        "aten.view", "aten._unsafe_view", "aten.reshape", "aten.t", "aten.transpose", "aten.permute",
        "aten.expand", "aten.squeeze", "aten.unsqueeze", "aten.slice", "aten.slice_backward", "aten.select",
        "aten.select_backward", "aten.split", "aten.split_with_sizes", "aten.chunk", "aten.unbind", "aten.cat",
        "aten.stack", "aten.clone", "aten._to_copy", "aten.copy", "aten.copy_", "aten.detach", "aten.alias",
        "aten.as_strided", "aten.contiguous", "aten.lift_fresh_copy", "aten._local_scalar_dense", "aten.empty",
        "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_zeros", "aten.new_ones",
        "aten.zeros", "aten.ones", "aten.zeros_like", "aten.ones_like", "aten.full", "aten.full_like",
        "aten.arange", "aten.scalar_tensor", "aten.repeat", "aten.constant_pad_nd",
        "fsdp.all_gather_copy_in", "fsdp.chunk_cat", "fsdp.split_with_sizes_copy",
    }),
    "loss": frozenset({
        "aten.nll_loss_forward", "aten.nll_loss_backward", "aten.nll_loss", "aten.nll_loss_nd",
        "aten.cross_entropy_loss", "aten.mse_loss", "aten.mse_loss_backward",
    }),
    "optimizer": frozenset({
        "aten.lerp", "aten.lerp_", "aten.addcdiv", "aten.addcdiv_", "aten.addcmul", "aten.addcmul_",
        "aten._foreach_add", "aten._foreach_add_", "aten._foreach_sub", "aten._foreach_sub_",
        "aten._foreach_mul", "aten._foreach_mul_", "aten._foreach_div", "aten._foreach_div_",
        "aten._foreach_lerp", "aten._foreach_lerp_", "aten._foreach_addcdiv", "aten._foreach_addcdiv_",
        "aten._foreach_addcmul", "aten._foreach_addcmul_", "aten._foreach_sqrt", "aten._foreach_sqrt_",
        "aten._foreach_neg", "aten._foreach_neg_", "aten._foreach_copy", "aten._foreach_copy_",
        "aten._foreach_norm", "aten._foreach_maximum", "aten._foreach_maximum_", "aten._fused_adam",
        "aten._fused_adam_", "aten._fused_adamw", "aten._fused_adamw_",
    }),
})
"""Op family → ``namespace.name`` of the ops a traced training step produces; any overload
of them may run except an ``out`` one."""

_ALLOWED = frozenset().union(*OP_FAMILIES.values())


def op_family(op: str) -> str | None:
    """The family of ``namespace.name[.overload]`` in :data:`OP_FAMILIES`, None when the op
    is not one a trace produces or its overload writes into a given buffer (``out``).

    >>> op_family("aten.mm.default"), op_family("aten.add_.Tensor"), op_family("aten.mm.out")
    ('matmul', 'elementwise', None)
    >>> op_family("aten.from_file.default"), op_family("aten.sum.IntList_out"), op_family("aten.mm")
    (None, None, 'matmul')
    """
    parts = op.split(".")
    if len(parts) not in (2, 3) or (len(parts) == 3 and (parts[2] == "out" or parts[2].endswith("_out"))):
        return None
    base = ".".join(parts[:2])
    return next((family for family, names in OP_FAMILIES.items() if base in names), None)


def op_problem(op: str) -> str | None:
    """Why ``op`` may not be run (not in :data:`OP_FAMILIES`, or an ``out`` overload), or None."""
    if op_family(op) is None:
        return (f"op {op[:80]!r} is not one a traced training step produces (allowed: the "
                f"{', '.join(OP_FAMILIES)} families, no out= overloads)")
    return None


def storage_numel(meta: TensorMeta) -> int:
    """Elements the storage of ``meta`` spans: ``1 + Σ (size−1)·stride``, 0 when a size is 0.

    >>> storage_numel(TensorMeta(shape=(3, 4), dtype="float32", stride=(4, 1)))  # 1 + 2·4 + 3·1
    12
    >>> storage_numel(TensorMeta(shape=(5, 2), dtype="float32", stride=(0, 1)))  # expanded rows
    2
    """
    if 0 in meta.shape:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(meta.shape, meta.stride, strict=True))


_ITEMSIZE = MappingProxyType({
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "complex64": 8, "complex128": 16, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4,
    "uint16": 2, "uint8": 1, "bool": 1,
})


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def tensor_problem(meta: TensorMeta) -> str | None:
    """Why ``meta`` may not be built as a real tensor, or None."""
    if meta.dtype not in DTYPES:
        return f"dtype {str(meta.dtype)[:40]!r} is not one of {', '.join(sorted(DTYPES))}"
    if len(meta.shape) > MAX_TENSOR_DIMS:
        return f"{len(meta.shape)} dimensions, more than the {MAX_TENSOR_DIMS} allowed"
    if len(meta.stride) != len(meta.shape):
        return f"{len(meta.stride)} strides for {len(meta.shape)} dimensions"
    for what, values in (("size", meta.shape), ("stride", meta.stride)):
        for v in values:
            if not _is_int(v) or not 0 <= v <= MAX_TENSOR_NUMEL:
                return f"{what} {str(v)[:40]} is not a whole number from 0 to {MAX_TENSOR_NUMEL}"
    if math.prod(meta.shape) > MAX_TENSOR_NUMEL or storage_numel(meta) > MAX_TENSOR_NUMEL:
        return (f"shape {list(meta.shape)} with strides {list(meta.stride)} spans more than "
                f"{MAX_TENSOR_NUMEL} elements")
    return None


def tensor_bytes(meta: TensorMeta) -> int:
    """Bytes of the storage :func:`topomesh.cost.ops.make_tensor` allocates for ``meta``."""
    return storage_numel(meta) * _ITEMSIZE[meta.dtype]


def args_problem(args: Any) -> str | None:
    """Why non-tensor arguments may not be passed to an op (type, depth, size, range), or None."""
    items = 0

    def walk(a: Any, depth: int) -> str | None:
        nonlocal items
        items += 1
        if items > MAX_ARG_ITEMS:
            return f"more than {MAX_ARG_ITEMS} argument values"
        if isinstance(a, (tuple, list)):
            if depth >= MAX_ARG_DEPTH:
                return f"arguments nested more than {MAX_ARG_DEPTH} deep"
            return next((p for x in a if (p := walk(x, depth + 1))), None)
        if _is_int(a):
            return None if -INT64 <= a < INT64 else f"integer argument {str(a)[:20]}… outside the int64 range"
        if isinstance(a, str):
            return None if len(a) <= MAX_ARG_STR else f"a string argument longer than {MAX_ARG_STR} characters"
        if a is None or isinstance(a, (bool, float)):
            return None
        return f"an argument of type {type(a).__name__} (only null, booleans, numbers, strings and lists)"

    return walk(args, 0)


def record_problem(record: OpRecord) -> str | None:
    """Why ``record`` may not be run for real (op not allowed, a tensor or number out of
    bounds), or None when it may."""
    if problem := op_problem(record.op):
        return problem
    for what, value, limit in (("flops", record.flops, MAX_FLOPS), ("bytes_moved", record.bytes_moved, MAX_BYTES_MOVED)):
        if value is None and what == "bytes_moved":
            continue
        if not _is_int(value) or not 0 <= value <= limit:
            shown = str(value) if len(str(value)) <= 24 else f"a {len(str(value))}-character number"
            return f"{what} {shown} is not a whole number from 0 to {limit}"
    total = 0
    for side, metas in (("input", record.inputs), ("output", record.outputs)):
        for i, meta in enumerate(metas):
            if problem := tensor_problem(meta):
                return f"{side} {i}: {problem}"
            total += tensor_bytes(meta)
    if total > MAX_RECORD_BYTES:
        return f"its tensors take {total} bytes, more than the {MAX_RECORD_BYTES} allowed for one op"
    return args_problem(record.args)


def check_outputs(op: Any, record: OpRecord, call: Callable[[list[Any]], tuple[list[Any], dict[str, Any]]]) -> None:
    """Run ``op`` under ``FakeTensorMode`` (no memory, no data) and raise ``ValueError`` when
    the tensors it returns would take inputs + outputs over :data:`MAX_RECORD_BYTES`.

    ``call(tensors)`` places the input tensors and the record's arguments (positional, keyword).
    Ops whose output shape depends on the data are bounded by their inputs and pass.
    """
    import torch
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorMode,
    )
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._pytree import tree_leaves

    total = sum(tensor_bytes(m) for m in record.inputs)
    with FakeTensorMode():
        fakes = [torch.empty_strided(m.shape, m.stride, dtype=getattr(torch, m.dtype)) for m in record.inputs]
        args, kwargs = call(fakes)
        try:
            out = op(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            return
    seen = {StorageWeakRef(f.untyped_storage()) for f in fakes}  # views and in-place results add nothing
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and (ref := StorageWeakRef(t.untyped_storage())) not in seen:
            seen.add(ref)
            total += t.untyped_storage().nbytes()
    if total > MAX_RECORD_BYTES:
        raise ValueError(f"{record.op} would take {total} bytes of inputs and outputs, more than the "
                         f"{MAX_RECORD_BYTES} allowed for one op")
