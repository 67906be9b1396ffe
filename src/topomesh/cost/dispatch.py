"""Host time DTensor's dispatch adds to an op, and to each collective it issues, measured on this CPU.

An op on a :class:`~torch.distributed.tensor.DTensor` (tensor-parallel modules, FSDP2's
sharded parameters in the optimizer) runs through DTensor's Python dispatcher — sharding
propagation, unwrapping, rewrapping — before the local op. On a GPU the host issues
kernels ahead of the device and this time hides behind them while the kernels are larger
than it; on a CPU the host thread is the computing thread, so it adds to every such op.

:func:`measure_dtensor_dispatch_s` times a chain of small elementwise ops with autograd
(forward and backward) on plain tensors and on DTensors of a one-rank mesh (a fake process
group, so nothing is sent) on the thread's CPU clock; the difference per op is the
dispatch cost. :func:`dtensor_dispatch_s` caches it per CPU fingerprint (with the torch
thread count) and torch version. Measured here (AMD EPYC, 1 thread, torch 2.13): 29–32 µs per
op (a DTensor multiply alone: 49 µs against 5 µs for the plain one).

A collective DTensor issues (tensor parallel's all-gathers, reduce-scatters and all-reduces:
``_c10d_functional`` ops in a trace) costs host time besides the transfer the gloo calibration
measures with plain c10d calls: the redistribution plan, its autograd Function, the functional
collective's wrapper tensors and wait. :func:`measure_dtensor_collective_s` times
``redistribute`` of a tiny DTensor with autograd on a two-rank fake group (nothing is sent, so
all that is left is that host work), all-gather, reduce-scatter and all-reduce, and takes the
median of the three: 90–117 µs here, against 7–13 µs for a plain c10d call on the same group.

FSDP2 (``fully_shard``) runs Python around every unit in every forward and backward — its
pre-/post-forward and pre-/post-backward hooks, the all-gather's copy-in and copy-out
bookkeeping, ``foreach_reduce`` — on the computing thread, besides the collectives (priced by
the gloo calibration) and the copy ops (in the op table). :func:`measure_fsdp_host_s` times
forward and backward of the built-in transformer with ``units`` blocks at a tiny width (hidden
64, 16 tokens: kernels cost next to nothing), each block and the root a ``fully_shard`` unit
with the built-in mixed precision (bf16 compute, float32 reduction), on a two-rank fake group,
minus the same model unsharded in bf16; once on a replicate-only mesh (``dp_replicate=2``: no
all-gathers, one all-reduce per unit) and once sharded (``dp_shard=2``: all-gathers as well),
counting the c10d collectives each issues. The replicate-only difference per reduction is what
a unit costs (paid per FSDP2 reduction of a trace); the extra of the sharded run per
all-gather is what an all-gather adds (both kept by :func:`fsdp_host_s`). Measured here:
0.9–1.3 ms a unit, 0.1–0.4 ms an all-gather (five measurements). Units of a bare ``Linear(16, 16)`` gave 0.5 ms
and 0.15 ms: the hooks' work grows with what a unit holds (parameters, submodules, the
arguments whose dtype FSDP2 casts), so the unit measured is the one the built-in parallelize
wraps.
"""

from __future__ import annotations

import functools
import hashlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from topomesh.cost.devices import cpu_fingerprint, private_cache_dir, write_json_atomic
from topomesh.errors import CalibrationError
from topomesh.topology.api import read_json

METHOD_VERSION = 2


def _median_thread_s(fn: Callable[[], None], *, repeats: int, warmup: int = 1) -> float:
    """Median thread CPU seconds of ``fn()`` over ``repeats`` calls after ``warmup`` (lazy
    caches of the dispatcher, of autograd, of FSDP2's first call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        c0 = time.thread_time()
        fn()
        times.append(time.thread_time() - c0)
    return statistics.median(times)


def _chain_s(x: object, n: int, repeats: int) -> float:
    """Median thread CPU seconds of ``n`` multiplies on ``x`` forward and their backward."""

    def run() -> None:
        t = x
        for _ in range(n):
            t = t * 1.0001
        t.sum().backward()

    return _median_thread_s(run, repeats=repeats)


def measure_dtensor_dispatch_s(*, n: int = 200, repeats: int = 5) -> float:
    """Seconds DTensor dispatch adds per op (forward and backward ops averaged), >= 0."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from topomesh.layout import groups
    from topomesh.trace.tracer import fake_process_group

    plain = torch.randn(16, 16, dtype=torch.float32).requires_grad_()
    if dist.is_initialized():
        raise CalibrationError("measuring DTensor dispatch needs a process without a process group "
                               "(it builds a one-rank fake group).")
    with fake_process_group(1):
        mesh = groups.init_mesh("cpu", [1], ["x"])
        shard = distribute_tensor(plain.detach(), mesh, [Shard(0)]).requires_grad_()
        base = _chain_s(plain, n, repeats)
        wrapped = _chain_s(shard, n, repeats)
    # n forward multiplies and as many backward ones, plus the sum and its backward
    return max(0.0, (wrapped - base) / (2 * n))


def measure_dtensor_collective_s(*, repeats: int = 50) -> float:
    """Host seconds of one collective DTensor issues, beyond the transfer (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from topomesh.layout import groups
    from topomesh.trace.tracer import fake_process_group

    if dist.is_initialized():
        raise CalibrationError("measuring DTensor's collectives needs a process without a process group "
                               "(it builds a two-rank fake group).")
    with fake_process_group(2):
        mesh = groups.init_mesh("cpu", [2], ["x"])
        leaf = torch.randn(4, 8, requires_grad=True)
        cases = [(DTensor.from_local(leaf, mesh, [Shard(0)]), [Replicate()]),  # all-gather
                 (DTensor.from_local(leaf, mesh, [Partial()]), [Shard(0)]),  # reduce-scatter
                 (DTensor.from_local(leaf, mesh, [Partial()]), [Replicate()])]  # all-reduce
        # the first call of each fills the redistribution planner's caches
        medians = [_median_thread_s(functools.partial(source.redistribute, mesh, target), repeats=repeats)
                   for source, target in cases]
    return statistics.median(medians)


def measure_fsdp_host_s(*, units: int = 8, repeats: int = 30) -> tuple[float, float]:
    """(seconds per FSDP2 reduction, seconds per FSDP2 all-gather) of host work, >= 0 (see the
    module docstring)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.utils._python_dispatch import TorchDispatchMode

    from topomesh.layout import groups
    from topomesh.models.transformer import Arch, Transformer, TransformerConfig
    from topomesh.trace.tracer import fake_process_group

    if dist.is_initialized():
        raise CalibrationError("measuring FSDP2's host work needs a process without a process group "
                               "(it builds a two-rank fake group).")

    class Collectives(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.gathers = self.reductions = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            name = str(func)
            self.gathers += name.startswith("c10d._allgather_base_")
            self.reductions += name.startswith(("c10d._reduce_scatter_base_", "c10d.allreduce_"))
            return func(*args, **(kwargs or {}))

    # the unit the built-in parallelize wraps, a transformer block, at a width where kernels
    # cost next to nothing: what is left of FSDP2 minus the plain model is host work
    cfg = TransformerConfig(name="fsdp-host", arch=Arch.LLAMA, n_layers=units, hidden=64, n_heads=4, n_kv_heads=2,
                            ffn_hidden=128, vocab_size=64, seq_len=16)

    def model() -> nn.Module:
        torch.manual_seed(0)
        return Transformer(cfg)

    x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))

    def step(m: nn.Module) -> Callable[[], None]:
        return lambda: m(x).float().sum().backward()

    # the plain model computes in bfloat16 as FSDP2's mixed precision does
    plain = _median_thread_s(step(model().to(torch.bfloat16)), repeats=repeats, warmup=3)
    runs = {}
    for label, dims, names in (("replicate", [2, 1], ["dp_replicate", "dp_shard"]), ("sharded", [2], ["dp_shard"])):
        with fake_process_group(2):
            mesh = groups.init_mesh("cpu", dims, names)
            m = model()
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in m.layers.values():
                fully_shard(block, mesh=mesh, mp_policy=mp)
            fully_shard(m, mesh=mesh, mp_policy=mp)
            took = _median_thread_s(step(m), repeats=repeats, warmup=3)  # lazy init, first backward
            count = Collectives()
            with count:
                step(m)()
            runs[label] = (took - plain, count.gathers, count.reductions)
    extra, _, reductions = runs["replicate"]
    per_unit = max(0.0, extra / max(reductions, 1))
    sharded, gathers, reductions = runs["sharded"]
    per_gather = max(0.0, (sharded - per_unit * reductions) / max(gathers, 1))
    return per_unit, per_gather


def measure_tp_host_s(*, collective_s: float, blocks: tuple[int, int] = (1, 3), repeats: int = 20) -> tuple[float, float]:
    """(seconds per forward/backward op on DTensors inside the blocks, outside them) that tensor
    parallel costs the computing thread beyond the ops themselves (see the module docstring).

    The built-in transformer at a tiny width (hidden 64, 16 tokens: kernels cost next to
    nothing) under the built-in parallelize's tensor parallel (sequence parallel, the default;
    bfloat16) on a two-rank fake group, one forward and backward through the causal LM loss
    under ``loss_parallel`` as the real runs take it, minus the same model unsharded; less
    ``collective_s`` (:func:`measure_dtensor_collective_s`) for each collective the step
    issues. Taken at ``blocks`` depths: the difference per traced block op is the blocks'
    figure, what is left at the shallower depth per op outside the blocks (embedding, final
    norm, head and the vocabulary-parallel loss) is the rest's. Ops are counted as
    :func:`topomesh.sim.price.Pricer.digest` counts them: the trace's profilable records."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from topomesh.cost.ops import profilable
    from topomesh.layout import groups
    from topomesh.models.parallelize import ParallelOptions, make_parallelize
    from topomesh.models.transformer import Arch, TransformerConfig
    from topomesh.trace.graph import CollectiveRecord, OpRecord, Phase
    from topomesh.trace.result import Part
    from topomesh.trace.tracer import (
        build_model,
        causal_lm_loss,
        fake_process_group,
        loss_context,
        trace_step,
        transformer_spec,
    )

    if dist.is_initialized():
        raise CalibrationError("measuring tensor parallel's host work needs a process without a process group "
                               "(it builds a two-rank fake group).")
    dtype = torch.bfloat16
    parallelize = make_parallelize(ParallelOptions(sequence_parallel=True))

    def config(n: int) -> TransformerConfig:
        return TransformerConfig(name="tp-host", arch=Arch.LLAMA, n_layers=n, hidden=64, n_heads=4, n_kv_heads=2,
                                 ffn_hidden=128, vocab_size=64, seq_len=16)

    def model(n: int) -> nn.Module:
        torch.manual_seed(0)
        return build_model(transformer_spec(config(n)), n, dtype)

    x = torch.randint(0, 64, (1, 16))

    def step(m: nn.Module) -> Callable[[], None]:
        def run() -> None:
            out = m(x)
            with loss_context(out):
                causal_lm_loss(out, x).backward()
        return run

    def counts(n: int) -> tuple[int, int, int]:
        """(block ops, other ops, collectives) of one forward and backward, as traced."""
        trace = trace_step(transformer_spec(config(n)), parallelize, {"tp": 2}, n_layers=n, batch_size=1, dtype=dtype)
        block = rest = colls = 0
        for seg in trace.segments:
            if seg.phase not in (Phase.FORWARD, Phase.BACKWARD):
                continue
            for e in seg.events:
                if isinstance(e, OpRecord) and profilable(e):
                    block += seg.part is Part.BLOCK
                    rest += seg.part is not Part.BLOCK
                elif isinstance(e, CollectiveRecord) and e.group_size > 1:
                    colls += 1
        return block, rest, colls

    host = {}
    for n in blocks:
        plain = _median_thread_s(step(model(n)), repeats=repeats, warmup=3)
        with fake_process_group(2):
            mesh = groups.init_mesh("cpu", [2], ["tp"])
            tp = _median_thread_s(step(parallelize(model(n), mesh)), repeats=repeats, warmup=3)
        host[n] = tp - plain
    (lo, hi), got = blocks, {n: counts(n) for n in blocks}
    (b_lo, r_lo, c_lo), (b_hi, _, c_hi) = got[lo], got[hi]
    per_block_op = max(0.0, (host[hi] - host[lo] - collective_s * (c_hi - c_lo)) / max(b_hi - b_lo, 1))
    per_rest_op = max(0.0, (host[lo] - per_block_op * b_lo - collective_s * c_lo) / max(r_lo, 1))
    return per_block_op, per_rest_op


def tp_host_s(*, directory: Path | None = None, refresh: bool = False) -> tuple[float, float]:
    """(per block op, per other op): :func:`measure_tp_host_s`, kept as :func:`dtensor_dispatch_s`
    keeps its own (``devices/tp-host-<hash>.json``), with :func:`dtensor_collective_s`'s figure."""
    coll = dtensor_collective_s(directory=directory, refresh=refresh)
    got = _cached("tp-host", ("dtensor_block_dispatch_s", "dtensor_rest_dispatch_s"),
                  lambda: measure_tp_host_s(collective_s=coll),
                  "thread CPU time, the built-in model under TP (SP, bf16) minus plain on a 2-rank fake group, "
                  "less its collectives' host work, per traced forward/backward op, 1 and 3 blocks",
                  directory, refresh)
    return got[0], got[1]


def measure_split_shares(*, hidden: int = 256, seq_len: int = 256, repeats: int = 15) -> tuple[float, float]:
    """(I, W) of PyTorch's zero-bubble split as shares of a full backward, on this CPU: one block
    of the built-in transformer (Llama, bfloat16, ``hidden`` wide, ``seq_len`` tokens, its
    input a leaf as a later stage's is), backward of a random output gradient by
    ``torch.distributed.pipelining``'s own ``stage_backward`` (B) against ``stage_backward_input``
    (I: input gradients, the graph retained) then ``stage_backward_weight`` (W), median thread
    CPU seconds of each after a warm-up.

    The simulator's default split (W: half the backward matmuls, I: the rest) sums to B. Here
    I alone took about what B took and W a fifth to a third more: one block of
    ``validate_llama.json`` at 128, 256 and 512 tokens, B 5.2 / 7.4 / 14.1 ms, I 4.7 / 7.3 /
    15.0, W 1.5 / 2.2 / 3.0 (2-vCPU Xeon, one thread), I + W = 1.21-1.28 B."""
    import torch
    from torch.distributed.pipelining._backward import (
        stage_backward,
        stage_backward_input,
        stage_backward_weight,
    )

    from topomesh.models.transformer import Arch, Transformer, TransformerConfig

    cfg = TransformerConfig(name="zb-split", arch=Arch.LLAMA, n_layers=1, hidden=hidden, n_heads=8, n_kv_heads=4,
                            ffn_hidden=hidden * 11 // 4, vocab_size=256, seq_len=seq_len)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        torch.manual_seed(0)
        model = Transformer(cfg)
    finally:
        torch.set_default_dtype(before)
    block, rope = model.layers["0"], model.rope()
    params = list(block.parameters())
    x0 = torch.randn(1, seq_len, hidden, dtype=torch.bfloat16)
    grad = torch.randn_like(x0)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        x = x0.clone().requires_grad_(True)
        return x, block(x, rope)

    def full() -> None:
        x, y = forward()
        stage_backward(y, grad, [x])
        block.zero_grad(set_to_none=True)

    i_times: list[float] = []
    w_times: list[float] = []
    for _ in range(repeats + 1):  # the first round warms autograd's caches
        x, y = forward()
        c0 = time.thread_time()
        _, groups = stage_backward_input([y], [grad], [x], iter(params))
        c1 = time.thread_time()
        stage_backward_weight(iter(params), groups)
        w_times.append(time.thread_time() - c1)
        i_times.append(c1 - c0)
        block.zero_grad(set_to_none=True)
    b_s = max(_median_thread_s(full, repeats=repeats) - _median_thread_s(forward, repeats=repeats), 1e-9)
    return statistics.median(i_times[1:]) / b_s, statistics.median(w_times[1:]) / b_s


def split_shares(*, directory: Path | None = None, refresh: bool = False) -> tuple[float, float]:
    """(I, W) shares of a full backward: :func:`measure_split_shares`, kept as
    :func:`dtensor_dispatch_s` keeps its own (``devices/zb-split-<hash>.json``)."""
    got = _cached("zb-split", ("backward_input_share", "backward_weight_share"), measure_split_shares,
                  "thread CPU time, one bf16 Llama block (hidden 256, 256 tokens): stage_backward_input and "
                  "stage_backward_weight over stage_backward", directory, refresh)
    return got[0], got[1]


def fsdp_host_s(*, directory: Path | None = None, refresh: bool = False) -> tuple[float, float]:
    """(seconds per FSDP2 reduction, seconds per FSDP2 all-gather): :func:`measure_fsdp_host_s`,
    one measurement kept as :func:`dtensor_dispatch_s` keeps its own (``devices/fsdp-host-<hash>.json``)."""
    got = _cached("fsdp-host", ("fsdp_reduce_s", "fsdp_gather_s"), measure_fsdp_host_s,
                  "thread CPU time, FSDP2 minus plain on 2-rank fake groups: dp_replicate=2 per all-reduce, "
                  "dp_shard=2 beyond that per all-gather", directory, refresh)
    return got[0], got[1]


def dtensor_dispatch_s(*, directory: Path | None = None, refresh: bool = False) -> float:
    """:func:`measure_dtensor_dispatch_s`, cached per CPU fingerprint and torch version in the
    private cache directory (``devices/dispatch-<hash>.json``)."""
    return _cached("dispatch", ("dtensor_dispatch_s",), lambda: (measure_dtensor_dispatch_s(),),
                   "thread CPU time, DTensor minus plain, per op (fwd+bwd chain)", directory, refresh)[0]


def dtensor_collective_s(*, directory: Path | None = None, refresh: bool = False) -> float:
    """:func:`measure_dtensor_collective_s`, cached as :func:`dtensor_dispatch_s` is
    (``devices/collective-host-<hash>.json``)."""
    return _cached("collective-host", ("dtensor_collective_s",), lambda: (measure_dtensor_collective_s(),),
                   "thread CPU time of a redistribute with autograd on a 2-rank fake group, median of "
                   "all-gather, reduce-scatter, all-reduce", directory, refresh)[0]


def _cached(stem: str, names: tuple[str, ...], measure: Callable[[], tuple[float, ...]], method: str,
            directory: Path | None, refresh: bool) -> tuple[float, ...]:
    """``measure()`` (one figure per name) kept in ``devices/<stem>-<hash>.json`` per CPU
    fingerprint, torch version and method version; measured again when missing, unreadable or
    ``refresh``."""
    import torch

    key = f"{cpu_fingerprint()} torch {torch.__version__} v{METHOD_VERSION}"
    try:
        path: Path | None = private_cache_dir("devices", root=directory) / (
            f"{stem}-" + hashlib.sha1(key.encode()).hexdigest()[:12] + ".json")
    except CalibrationError:
        path = None
    if path is not None and path.is_file() and not refresh:
        try:
            raw = read_json(path, what="host-cost cache", error=CalibrationError)
            if raw.get("key") == key and all(isinstance(raw.get(n), float) for n in names):
                return tuple(float(raw[n]) for n in names)
        except (CalibrationError, AttributeError):
            pass  # unreadable, oversized or not an object: measure again and overwrite
    seconds = tuple(measure())
    if path is not None:
        write_json_atomic(path, {"key": key, **dict(zip(names, seconds, strict=True)), "method": method})
    return seconds
