"""Op costs: measured op profiles (SQLite, :mod:`topomesh.cost.opdb`) with a roofline fallback.

:func:`profile_ops` times every distinct op signature of a trace for real on the current
device — tensors built from each :class:`~topomesh.trace.graph.TensorMeta` with
``torch.empty_strided``-equivalent strides, warm-up runs, then the median of several
repeats (``perf_counter`` on CPU; CUDA events around each run, synchronized, on a GPU) —
and stores the medians in the shared table. Pricing is pure: :func:`op_time_s` looks a
record up in a table loaded once (:meth:`OpProfileDB.table`) and falls back to
:func:`roofline_time_s`:

    time = max(flops / (peak_flops[dtype] × eff_compute[class]),
               bytes / (memory_bandwidth × eff_memory[class]))

with efficiencies per op class and shape from the device's data file
(:mod:`topomesh.cost.efficiency`: GEMM tile/wave quantization under a measured ceiling,
FlashAttention fractions, achievable memory bandwidth; 1.0 for the measured CPU), or from
an explicit :class:`Efficiency` table (``data/op_efficiency.json``, all 1.0: a pure roofline).

>>> from topomesh.trace.graph import OpRecord, TensorMeta
>>> from topomesh.cost.devices import device_spec
>>> a = TensorMeta(shape=(4096, 4096), dtype="bfloat16", stride=(4096, 1))
>>> mm = OpRecord(op="aten.mm.default", inputs=(a, a), outputs=(a,), flops=2 * 4096**3,
...               bytes_moved=3 * 4096 * 4096 * 2)
>>> round(roofline_time_s(mm, device_spec("H100-SXM5-80GB")) * 1e6, 1)  # us: 138.9 at 100 % / 0.779
178.3
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache
from importlib import resources
from typing import Any

from topomesh.cost import opcheck as _opcheck
from topomesh.cost.devices import DeviceSpec
from topomesh.cost.efficiency import is_causal, op_efficiency
from topomesh.cost.opdb import Key, OpProfileDB, OpTiming, host_fingerprint
from topomesh.errors import TraceError
from topomesh.trace.graph import OpRecord, Phase, TensorMeta

# Ops that move no data worth timing on their own (views, metadata) or are not compute.
_SKIP_PREFIXES = ("_c10d_functional.", "c10d.", "_c10d_functional_autograd.", "_dtensor.")


class OpClass(StrEnum):
    MATMUL = "matmul"
    ATTENTION = "attention"
    CONVOLUTION = "convolution"
    REDUCTION = "reduction"
    ELEMENTWISE = "elementwise"
    OTHER = "other"


_MATMUL = ("mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "addbmm", "_scaled_mm", "dot", "mv")
_REDUCTION = ("sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm", "softmax", "_softmax",
              "log_softmax", "_log_softmax", "cumsum", "argmax", "argmin", "prod", "logsumexp")


def op_class(op: str) -> OpClass:
    """The roofline class of an ATen op name.

    >>> op_class("aten.addmm.default"), op_class("aten._scaled_dot_product_flash_attention.default")
    (<OpClass.MATMUL: 'matmul'>, <OpClass.ATTENTION: 'attention'>)
    >>> op_class("aten.mul.Tensor"), op_class("aten._softmax.default")
    (<OpClass.ELEMENTWISE: 'elementwise'>, <OpClass.REDUCTION: 'reduction'>)
    """
    parts = op.split(".")
    name = parts[1] if len(parts) >= 2 else op
    if "attention" in name:
        return OpClass.ATTENTION
    if name.startswith("convolution") or name.startswith("conv"):
        return OpClass.CONVOLUTION
    if name in _MATMUL:
        return OpClass.MATMUL
    base = name.removesuffix("_backward").removesuffix("_data")
    if base in _REDUCTION:
        return OpClass.REDUCTION
    if parts[0] == "aten":
        return OpClass.ELEMENTWISE
    return OpClass.OTHER


@dataclass(frozen=True, slots=True, kw_only=True)
class Efficiency:
    """Fraction of peak compute and memory bandwidth each op class reaches (roofline only)."""

    compute: Mapping[OpClass, float]
    memory: Mapping[OpClass, float]


@cache
def default_efficiency() -> Efficiency:
    raw = json.loads(resources.files("topomesh.cost").joinpath("data/op_efficiency.json").read_text())
    return Efficiency(
        compute={OpClass(k): float(v) for k, v in raw["compute"].items()},
        memory={OpClass(k): float(v) for k, v in raw["memory"].items()},
    )


def _canon(obj: Any) -> Any:
    if isinstance(obj, (tuple, list)):
        return [_canon(o) for o in obj]
    if isinstance(obj, (bool, int, float, str)) or obj is None:
        return obj
    return str(obj)


def _dumps(obj: Any) -> str:
    return json.dumps(_canon(obj), separators=(",", ":"))


def profile_key(record: OpRecord) -> Key:
    """(op, shapes, dtypes, strides, args) as canonical JSON strings: the table's key.

    >>> t = TensorMeta(shape=(2, 3), dtype="float32", stride=(3, 1))
    >>> profile_key(OpRecord(op="aten.mm.default", inputs=(t, t), outputs=()))
    ('aten.mm.default', '[[2,3],[2,3]]', '["float32","float32"]', '[[3,1],[3,1]]', '[]')
    """
    return (
        record.op,
        _dumps([t.shape for t in record.inputs]),
        _dumps([t.dtype for t in record.inputs]),
        _dumps([t.stride for t in record.inputs]),
        _dumps(record.args),
    )


def op_dtype(record: OpRecord) -> str:
    """The dtype an op computes in: its first floating input (or output), else float32."""
    for t in (*record.inputs, *record.outputs):
        if t.dtype.startswith(("float", "bfloat", "complex")):
            return t.dtype
    return "float32"


def itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype name (``bfloat16`` -> 2)."""
    import torch

    return getattr(torch, dtype).itemsize


def record_bytes(record: OpRecord) -> int:
    """Bytes the op moves: ``bytes_moved`` when the tracer set it, else inputs + outputs."""
    if record.bytes_moved is not None:
        return record.bytes_moved
    return sum(t.numel * itemsize(t.dtype) for t in (*record.inputs, *record.outputs))


def roofline_time_s(
    record: OpRecord, spec: DeviceSpec, efficiency: Efficiency | None = None, *, tf32: bool = False
) -> float:
    """Roofline time of one op on ``spec``: the larger of compute and memory time, seconds.

    Fractions of peak from ``efficiency`` when given (per class), else from the device's
    kernel model (:func:`topomesh.cost.efficiency.op_efficiency`, per class and shape).
    """
    cls = op_class(record.op)
    dtype = op_dtype(record)
    if efficiency is None:
        shape = record.outputs[0].shape if record.outputs else None
        eff_compute, eff_memory = op_efficiency(spec, cls.value, record.op, dtype, shape)
    else:
        eff_compute, eff_memory = efficiency.compute[cls], efficiency.memory[cls]
    flops = record.flops
    if cls is OpClass.ATTENTION and is_causal(record.op, record.args):
        # FlashAttention kernels skip the masked half of the score matrix; the FLOP count
        # (PyTorch's formula) is the full one, and the kernels' published throughput counts
        # causal work as half (FlashAttention-2, arXiv:2307.08691 §4.1)
        flops //= 2
    compute_s = flops / (spec.peak_flops_per_s(dtype, tf32=tf32) * eff_compute)
    memory_s = record_bytes(record) / (spec.memory_bandwidth_GBps * 1e9 * eff_memory)
    return max(compute_s, memory_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class OpCost:
    seconds: float
    measured: bool
    """True when the time comes from the profile table, False for the roofline."""


def op_time_s(record: OpRecord, spec: DeviceSpec, table: Mapping[Key, float],
              efficiency: Efficiency | None = None) -> OpCost:
    """Measured median from ``table`` when present, else the roofline (pure)."""
    hit = table.get(profile_key(record))
    if hit is not None:
        return OpCost(seconds=hit, measured=True)
    return OpCost(seconds=roofline_time_s(record, spec, efficiency), measured=False)


# ---------------------------------------------------------------- real timing


def resolve_op(name: str) -> Any:
    """``aten.mm.default`` → ``torch.ops.aten.mm.default``; raises LookupError if absent."""
    import torch

    parts = name.split(".")
    if len(parts) == 2:
        parts.append("default")
    if len(parts) != 3:
        raise LookupError(f"op name {name!r} is not namespace.name.overload")
    try:
        return getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError) as exc:
        raise LookupError(f"no op {name!r} in torch.ops ({exc})") from None


def make_tensor(meta: TensorMeta, device: str) -> Any:
    """A real tensor with ``meta``'s shape, dtype and strides (values random, or 0 for ints)."""
    import torch

    dtype = getattr(torch, meta.dtype)
    numel = 0 if 0 in meta.shape else 1 + sum((s - 1) * abs(st) for s, st in zip(meta.shape, meta.stride, strict=True))
    if dtype.is_floating_point or dtype.is_complex:
        flat = torch.randn(numel, device=device, dtype=torch.float32).to(dtype)
    else:
        flat = torch.zeros(numel, device=device, dtype=dtype)  # valid indices for gather/embedding
    return torch.as_strided(flat, meta.shape, meta.stride)


def _decode(value: Any) -> Any:
    """A recorded argument back as torch takes it: the tracer records dtypes, layouts and
    memory formats as strings (``"torch.float32"``)."""
    import torch

    if isinstance(value, str) and value.startswith("torch."):
        obj = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
    return value


def _required_tensors(arguments: Sequence[Any]) -> int:
    """How many input tensors the positional, non-optional tensor parameters of ``arguments`` take."""
    import torch

    return sum(
        1 for a in arguments
        if not a.kwarg_only and isinstance(a.type, torch._C.TensorType)
    )


def _call_arguments(op: Any, tensors: Sequence[Any], args: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
    """Positional and keyword arguments in schema order: tensors where the schema takes
    tensors, ``args`` elsewhere; tensors left over fill keyword-only tensor parameters
    (``out=``) in order.

    ``args`` are the node's non-tensor positional arguments in order, as the tracer records
    them (a tensor list shows up there as a tuple of ``None`` placeholders, one per tensor).
    An optional tensor recorded as None before later tensor parameters (``nll_loss_backward``'s
    ``weight`` before ``total_weight``) is told apart by counting the tensors those later
    parameters need; dtypes come back from their recorded strings. A schema this still fills
    wrongly makes the op fail, and it is priced by the roofline.
    """
    import torch

    def elem(t: Any) -> Any:
        return t.getElementType() if isinstance(t, torch._C.OptionalType) else t

    def tensor_list(t: Any) -> bool:
        return isinstance(t, torch._C.ListType) and isinstance(elem(t.getElementType()), torch._C.TensorType)

    out: list[Any] = []
    kwargs: dict[str, Any] = {}
    tensors, args = list(tensors), [_decode(a) for a in args]
    positional = True
    schema = list(op._schema.arguments)
    for i, arg in enumerate(schema):
        typ = elem(arg.type)
        if arg.kwarg_only:
            positional = False
            if tensor_list(typ) and tensors:
                kwargs[arg.name], tensors = tensors, []
            elif isinstance(typ, torch._C.TensorType) and tensors:
                kwargs[arg.name] = tensors.pop(0)
            continue
        if not positional:
            break
        if tensor_list(typ):
            take = len(tensors)
            if args and isinstance(args[0], (tuple, list)) and all(x is None for x in args[0]):
                take = len(args.pop(0))
            out.append(tensors[:take])
            tensors = tensors[take:]
        elif isinstance(typ, torch._C.TensorType) and tensors:
            optional = isinstance(arg.type, torch._C.OptionalType)
            if optional and args and args[0] is None and len(tensors) <= _required_tensors(schema[i + 1:]):
                out.append(args.pop(0))  # given as None: the tensors left belong to later parameters
            else:
                out.append(tensors.pop(0))
        elif args:
            out.append(args.pop(0))
        elif isinstance(typ, torch._C.TensorType) and isinstance(arg.type, torch._C.OptionalType):
            out.append(None)
        else:
            positional = False
    if tensors:
        raise TypeError(f"{len(tensors)} input tensors left over after filling the schema {op._schema}")
    return out, kwargs


CPU_ATTENTION = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": 0,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": 1,
}
"""A CPU trace's attention ops (``F.scaled_dot_product_attention`` on CPU tensors) and where
their query, key and value start among the inputs (after ``grad_out`` in the backward). A
GPU cannot run them: there they are timed as the GPU step runs attention
(:func:`_gpu_attention`)."""

GPU_CLOCK_HZ = 2.0e9
"""Cycles a second assumed when sizing ``torch.cuda._sleep``: at or above the top SM clock
of the GPUs we ship specs for (H100/H200 SXM 1,980 MHz, A100 SXM 1,410 MHz, NVIDIA's
datasheets), so the busy kernel lasts at least as long as asked."""
MAX_BUSY_S = 0.05
"""Longest busy kernel :func:`time_op` queues ahead of an op's repeats on a GPU."""
GROUPS = 3
"""Groups of back-to-back calls an op is timed in on a GPU (the median of their per-call times)."""
MIN_OP_S = 1e-7
"""What an op that launches no GPU work (a view) is stored as on a GPU: the table holds
positive times, and CUDA events resolve about 0.5 us (CUDA Runtime API,
``cudaEventElapsedTime``)."""


def _gpu_attention(record: OpRecord, device: str) -> Callable[[], Any]:
    """The GPU work of a CPU trace's attention op: ``F.scaled_dot_product_attention`` on the
    record's query, key and value, as the real step on the GPU calls it — the kernel PyTorch
    picks there (cuDNN or flash on Hopper) —, its forward, or for the backward record the
    backward of one forward made here (``retain_graph``, so it can be run again)."""
    import torch
    import torch.nn.functional as F

    first = CPU_ATTENTION[record.op]
    q, k, v = (make_tensor(t, device) for t in record.inputs[first:first + 3])
    dropout_p, is_causal_ = (list(record.args) + [0.0, False])[:2]
    kw = {"dropout_p": float(dropout_p), "is_causal": bool(is_causal_)}
    if not first:
        return lambda: F.scaled_dot_product_attention(q, k, v, **kw)
    grad = make_tensor(record.inputs[0], device)
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, **kw)

    def backward() -> Any:
        with torch.enable_grad():
            return torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

    return backward


def _host_scalar(record: OpRecord) -> bool:
    """Whether every tensor of ``record`` is 0-dim: on a GPU such work is the host's —
    PyTorch's optimizers keep their step count on the CPU unless ``capturable`` or ``fused``
    (``torch.optim.AdamW``), so its ``+= 1`` and ``.item()`` launch nothing on the GPU."""
    tensors = (*record.inputs, *record.outputs)
    return bool(tensors) and all(not t.shape for t in tensors)


def _cuda_times(run: Callable[[], Any], device: str, *, warmup: int, min_repeats: int, max_repeats: int,
                budget_s: float) -> tuple[list[float], list[float]]:
    """Device seconds a call of ``run`` takes, one figure per group of :data:`GROUPS`: a pair of
    CUDA events around each group's calls, back to back, all queued behind a busy kernel
    (``torch.cuda._sleep``) long enough for the host to issue them first. So the events time
    the GPU's work as a step the host runs ahead of has it — not the host's issuing, which for
    a kernel of a few microseconds takes longer than the kernel, and without an event pair's
    own time per call. On an H100, with events around each call issued one call at a time,
    AdamW's elementwise ops timed 2.6-2.8x their in-step kernel time; with events around each call
    behind the busy kernel, a view (which launches nothing) still timed 1.9 us.

    Also returns the host's seconds to issue one call, per group (``perf_counter`` around the
    group's calls, which return before the GPU reaches them)."""
    import torch

    for _ in range(warmup):
        run()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize(device)
    est = max(time.perf_counter() - t0, 1e-6)  # the host's issuing plus the work: at least the issuing
    per_group = math.ceil(min(max_repeats, max(min_repeats, budget_s / est)) / GROUPS)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(GROUPS)]
    torch.cuda._sleep(int(min(MAX_BUSY_S, GROUPS * per_group * est) * GPU_CLOCK_HZ))
    host = []
    for start, end in events:
        start.record()
        t0 = time.perf_counter()
        for _ in range(per_group):
            run()
        host.append(max(MIN_OP_S, (time.perf_counter() - t0) / per_group))
        end.record()
    torch.cuda.synchronize(device)
    return [max(MIN_OP_S, start.elapsed_time(end) / 1e3 / per_group) for start, end in events], host


def time_op(record: OpRecord, device: str = "cpu", *, warmup: int = 2, min_repeats: int = 5,
            max_repeats: int = 50, budget_s: float = 0.2) -> OpTiming:
    """Run ``record``'s op for real and return its median time.

    CPU: ``time.thread_time`` (the thread's CPU clock) around each call with one torch
    thread, ``perf_counter`` with more. CUDA: the GPU's time, CUDA events around groups of
    calls queued behind a busy kernel (:func:`_cuda_times`); a CPU trace's attention is timed as
    the GPU runs it (:data:`CPU_ATTENTION`), and work on 0-dim tensors only on the host
    thread (:func:`_host_scalar`). Repeats stop at ``max_repeats`` or once ``min_repeats``
    ran and ``budget_s`` is spent.
    Raises any error the op raises (the caller records it as unprofilable), and
    ``ValueError`` for a record :mod:`topomesh.cost.opcheck` refuses (an op outside the
    allow-list, tensors over the bounds, outputs that would be too large) before running it.
    """
    import torch

    if problem := _opcheck.record_problem(record):  # records_from_json checked files; this checks every caller
        raise ValueError(f"{record.op[:80]} is not run: {problem}")
    op = resolve_op(record.op)
    _opcheck.check_outputs(op, record, lambda tensors: _call_arguments(op, tensors, record.args))
    cuda = device.startswith("cuda")
    if cuda and _host_scalar(record):
        device, cuda = "cpu", False
    if cuda and record.op in CPU_ATTENTION:
        run = _gpu_attention(record, device)
    else:
        inputs = [make_tensor(t, device) for t in record.inputs]
        call_args, call_kwargs = _call_arguments(op, inputs, record.args)

        def run() -> None:
            op(*call_args, **call_kwargs)

    host: list[float] = []
    with torch.no_grad():
        if cuda:
            times, host = _cuda_times(run, device, warmup=warmup, min_repeats=min_repeats, max_repeats=max_repeats,
                                      budget_s=budget_s)
            method = f"cuda events behind a busy kernel, torch {torch.__version__}"
        else:
            # One thread: the calling thread's CPU clock, so time spent waiting for a core on
            # a machine others load is not counted as the op's; more threads: wall clock.
            threads = torch.get_num_threads()
            clock = time.thread_time if threads == 1 else time.perf_counter
            for _ in range(warmup):
                run()
            times = []
            begin = time.perf_counter()
            while len(times) < max_repeats and (len(times) < min_repeats or time.perf_counter() - begin < budget_s):
                t0 = clock()
                run()
                times.append(clock() - t0)
            method = (f"cpu {'thread_time' if threads == 1 else 'perf_counter'}, {threads} threads, "
                      f"torch {torch.__version__}")
    return OpTiming(key=profile_key(record), median_s=statistics.median(times), repeats=len(times),
                    warmup=warmup, method=method, host_s=statistics.median(host) if host else None)


def profilable(record: OpRecord) -> bool:
    """False for collectives and non-ATen bookkeeping ops, which are priced elsewhere or not at all."""
    return not record.op.startswith(_SKIP_PREFIXES)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileRun:
    """What one :func:`profile_ops` call did."""

    device: str
    distinct: int
    """Distinct profilable signatures in the records."""
    cached: int
    """Signatures already in the table (not timed again)."""
    profiled: int
    """Signatures timed now."""
    failed: Mapping[str, str] = field(default_factory=dict)
    """Op name → reason, for signatures that could not be run (priced by the roofline)."""
    seconds: float = 0.0
    left: int = 0
    """Signatures not timed because ``max_seconds`` ran out (priced by the roofline)."""


def profile_ops(records: Iterable[OpRecord], db: OpProfileDB, *, device: str = "cpu", fingerprint: str,
                progress: Callable[[int, int, str], None] | None = None, max_seconds: float | None = None,
                **timing: Any) -> ProfileRun:
    """Time every distinct signature of ``records`` not yet in ``db`` for ``fingerprint``.

    ``progress(done, total, op)`` is called after each signature. Failures are stored too,
    so a later run does not retry them. With ``max_seconds``, no new signature starts once
    that much time has passed (the first always runs, so every run makes progress); the
    rest is left for a later run (``ProfileRun.left``).
    """
    start = time.perf_counter()
    unique: dict[Key, OpRecord] = {}
    for r in records:
        if profilable(r):
            unique.setdefault(profile_key(r), r)
    known = set(db.table(fingerprint)) | set(db.failures(fingerprint))
    todo = [(k, r) for k, r in unique.items() if k not in known]
    failed: dict[str, str] = {}
    profiled = 0
    left = 0
    for i, (key, rec) in enumerate(todo):
        if i and max_seconds is not None and time.perf_counter() - start > max_seconds:
            left = len(todo) - i
            break
        try:
            timing_ = time_op(rec, device, **timing)
        except Exception as exc:  # any op error means "cannot profile here"; priced by roofline
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            db.put_failure(fingerprint, key, reason)
            failed[rec.op] = reason
        else:
            profiled += db.put(fingerprint, [timing_])
            if timing_.host_s is not None:  # a GPU's: the host's issue time beside it
                db.put(host_fingerprint(fingerprint), [dataclasses.replace(
                    timing_, median_s=timing_.host_s, method=f"host perf_counter, {timing_.method}", host_s=None)])
        if progress:
            progress(i + 1, len(todo), rec.op)
    return ProfileRun(device=device, distinct=len(unique), cached=len(unique) - len(todo), profiled=profiled,
                      failed=failed, seconds=time.perf_counter() - start, left=left)


@dataclass(frozen=True, slots=True, kw_only=True)
class UnknownOp:
    """Ops with no measured time, priced by the roofline."""

    op: str
    count: int
    roofline_s: float
    """Total roofline seconds of all ``count`` occurrences."""
    reason: str = "not profiled"


@dataclass(frozen=True, slots=True, kw_only=True)
class CostSummary:
    ops: int
    measured_s: float
    roofline_s: float
    unknown: tuple[UnknownOp, ...]

    @property
    def total_s(self) -> float:
        return self.measured_s + self.roofline_s


def cost_summary(records: Iterable[OpRecord], spec: DeviceSpec, table: Mapping[Key, float],
                 failures: Mapping[Key, str] | None = None) -> CostSummary:
    """Total op time of ``records``, split into measured and roofline, with unknown ops listed."""
    measured = roofline = 0.0
    counts: Counter[str] = Counter()
    per_op_s: dict[str, float] = {}
    reasons: dict[str, str] = {}
    n = 0
    for r in records:
        if not profilable(r):
            continue
        n += 1
        cost = op_time_s(r, spec, table)
        if cost.measured:
            measured += cost.seconds
        else:
            roofline += cost.seconds
            counts[r.op] += 1
            per_op_s[r.op] = per_op_s.get(r.op, 0.0) + cost.seconds
            if failures and (why := failures.get(profile_key(r))):
                reasons[r.op] = why
    unknown = tuple(
        UnknownOp(op=op, count=c, roofline_s=per_op_s[op], reason=reasons.get(op, "not profiled"))
        for op, c in counts.most_common()
    )
    return CostSummary(ops=n, measured_s=measured, roofline_s=roofline, unknown=unknown)


# ------------------------------------------------------------ JSON records


def records_from_json(data: Any, *, source: str = "op records") -> list[OpRecord]:
    """Op records from the JSON form :func:`records_to_json` writes (a list of objects).

    Every record is checked here, once, before anything runs: types, the op allow-list and
    the bounds on tensors and numbers of :mod:`topomesh.cost.opcheck`. A bad record raises
    :class:`TraceError` naming ``source``, the record's index and its op.
    """
    if isinstance(data, dict):
        data = data.get("ops", data.get("records"))
    if not isinstance(data, list):
        raise TraceError(f"{source}: op records JSON must be a list of records (or an object with an 'ops' list)")

    def meta(t: Any) -> TensorMeta:
        if not isinstance(t, dict):
            raise TypeError(f"a tensor is {type(t).__name__}, not an object with shape, dtype and stride")
        shape, stride, dtype = t["shape"], t["stride"], t["dtype"]
        if not isinstance(shape, list) or not isinstance(stride, list) or not isinstance(dtype, str):
            raise TypeError("a tensor's shape and stride must be lists and its dtype a string")
        return TensorMeta(shape=tuple(shape), dtype=dtype, stride=tuple(stride))

    def tup(a: Any) -> Any:
        return tuple(tup(x) for x in a) if isinstance(a, list) else a

    out = []
    for i, r in enumerate(data):
        op = r.get("op") if isinstance(r, dict) else None
        where = f"{source}: op record {i}" + (f" ({op[:80]})" if isinstance(op, str) else "")
        try:
            if not isinstance(r, dict):
                raise TypeError(f"the record is {type(r).__name__}, not an object")
            if not isinstance(op, str):
                raise KeyError("op")
            if not isinstance(r.get("inputs", []), list) or not isinstance(r.get("outputs", []), list):
                raise TypeError("inputs and outputs must be lists of tensors")
            if problem := _opcheck.op_problem(op):  # the op first: nothing else of a refused op is read
                raise TraceError(f"{where} is refused: {problem}")
            args = r.get("args", [])
            if not isinstance(args, list) or (problem := _opcheck.args_problem(args)):
                raise ValueError(problem or "args must be a list")
            record = OpRecord(
                op=op,
                inputs=tuple(meta(t) for t in r.get("inputs", [])),
                outputs=tuple(meta(t) for t in r.get("outputs", [])),
                flops=r.get("flops", 0),
                bytes_moved=r.get("bytes_moved"),
                phase=Phase(r.get("phase", "forward")),
                args=tup(args),
            )
        except KeyError as exc:
            raise TraceError(f"{where} is malformed (no {exc.args[0]!r} field)") from None
        except (TypeError, ValueError) as exc:
            raise TraceError(f"{where} is malformed ({exc})") from None
        if problem := _opcheck.record_problem(record):
            raise TraceError(f"{where} is refused: {problem}")
        out.append(record)
    return out


def records_to_json(records: Iterable[OpRecord]) -> list[dict[str, Any]]:
    def meta(t: TensorMeta) -> dict[str, Any]:
        return {"shape": list(t.shape), "dtype": t.dtype, "stride": list(t.stride)}

    return [
        {"op": r.op, "inputs": [meta(t) for t in r.inputs], "outputs": [meta(t) for t in r.outputs],
         "flops": r.flops, "bytes_moved": r.bytes_moved, "phase": r.phase.value, "args": _canon(r.args)}
        for r in records
    ]
