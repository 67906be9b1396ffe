"""Parallelize the reference transformer with PyTorch's own APIs, the way torchtitan does.

:func:`parallelize_transformer` takes a model and a :class:`~torch.distributed.device_mesh.DeviceMesh`
whose dimensions are named after :class:`~topomesh.layout.dims.Axis` (an absent axis has size 1)
and applies, in torchtitan's order:

1. tensor parallel (+ sequence parallel) on the ``tp`` axis — ``ColwiseParallel``,
   ``RowwiseParallel``, ``SequenceParallel`` and ``PrepareModuleInput`` from
   :mod:`torch.distributed.tensor.parallel` (the Megatron-LM pattern: two all-reduces per
   block forward without SP; all-gather + reduce-scatter around attention and MLP with SP);
2. expert parallel on the ``ep`` axis for MoE blocks: expert weights ``Shard(0)`` and an
   all-to-all before and after the experts (:class:`ExpertParallel`);
3. context parallel on the ``cp`` axis (:func:`apply_cp`): PyTorch's module-wrapper form,
   ``_ContextParallel`` on each block's ``attention.sdpa``, so attention runs as ring
   attention over the sequence shards (key/value all-gather forward, all-to-all of their
   gradients backward); the per-position tables are sharded like the tokens, in the
   head-tail order of PyTorch's load balancer (:func:`cp_shard`), so causal work is even;
4. activation checkpointing, full (``checkpoint_wrapper`` per block) or selective
   (``create_selective_checkpoint_contexts``: matmuls and attention saved, the rest recomputed);
5. FSDP2 (``fully_shard``) per block and at the root over ``dp_shard`` and ``cp`` together
   (context-parallel ranks hold the same weights, so their gradients are reduced with the
   data-parallel ones: torchtitan's ``dp_shard_cp``); with a ``dp_replicate`` axis of size > 1
   it is HSDP over the 2-D (replicate, shard) mesh; ``param_dtype``/``reduce_dtype`` give
   FSDP2's ``MixedPrecisionPolicy`` (e.g. fp32 master weights, bf16 compute, fp32 reduction).

The training loop shards its inputs and labels with :func:`cp_shard` (the tracer does this for
a :class:`~topomesh.trace.tracer.ModelSpec` that names its sequence dims). PyTorch's context
parallel only has rules for the CUDA attention kernels
(``_scaled_dot_product_flash/efficient/cudnn_attention``); on CPU the tracer records the CUDA
flash kernel in place of the CPU one (:mod:`topomesh.trace.tracer`). Pipeline parallel
(``pp``) splits layers into stages outside this function (each stage is a ``Transformer`` of
fewer layers), so a ``pp`` axis is accepted and left alone.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from topomesh.errors import LayoutError
from topomesh.layout import groups
from topomesh.layout.dims import Axis
from topomesh.models.transformer import Arch, MoE, Transformer


class Checkpointing(StrEnum):
    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelOptions:
    """How :func:`parallelize_transformer` parallelizes; degrees come from the mesh."""

    sequence_parallel: bool = True
    """Shard norms/residuals on the sequence dim between TP regions (Megatron SP)."""
    loss_parallel: bool = True
    """Keep logits vocab-sharded and compute the loss under ``loss_parallel()``."""
    checkpointing: Checkpointing = Checkpointing.NONE
    reshard_after_forward: bool = True
    """FSDP2: free unsharded block parameters after forward (ZeRO-3) or keep them (ZeRO-2).
    Under a pipeline the simulator keeps them from a stage's first forward to its last backward,
    as torchtitan does there; a stage module is set so with
    ``FSDPModule.set_reshard_after_forward(False)`` (``topomesh validate``'s worker does)."""
    param_dtype: torch.dtype | None = None
    """FSDP2 mixed precision: parameters are gathered and used in this dtype while the sharded
    master copy (and the optimizer) keep the model's dtype, e.g. bf16 over fp32 masters."""
    reduce_dtype: torch.dtype | None = None
    """FSDP2 mixed precision: the dtype gradients are reduce-scattered / all-reduced in."""


def _axis_size(mesh: DeviceMesh, axis: Axis) -> int:
    names = mesh.mesh_dim_names or ()
    return mesh[axis.value].size() if axis.value in names else 1


def parallelize_transformer(
    model: nn.Module, mesh: DeviceMesh, options: ParallelOptions | None = None
) -> nn.Module:
    """Apply TP/SP, EP, activation checkpointing and FSDP2 to ``model`` in place; returns it.

    ``model`` is a :class:`~topomesh.models.transformer.Transformer` or a single
    ``TransformerBlock`` (what the tracer's block-at-a-time mode hands over).
    """
    options = options or ParallelOptions()
    blocks = _blocks(model)
    tp = _axis_size(mesh, Axis.TP)
    if tp > 1 and isinstance(model, Transformer):
        cfg = model.config
        for what, n in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.kv_heads), ("ffn_hidden", cfg.ffn_hidden)):
            if n % tp:
                raise LayoutError(f"Tensor parallel degree {tp} does not divide {what}={n} of {cfg.name}.")
    if tp > 1:
        apply_tp(model, blocks, mesh[Axis.TP.value], options)
    if _axis_size(mesh, Axis.EP) > 1:
        for block in blocks.values():
            if isinstance(block.feed_forward, MoE):
                parallelize_module(block.feed_forward.experts, mesh[Axis.EP.value], ExpertParallel())
    if _axis_size(mesh, Axis.CP) > 1:
        apply_cp(model, blocks, mesh[Axis.CP.value])
    if options.checkpointing is not Checkpointing.NONE:
        apply_checkpointing(model, blocks, options.checkpointing)
        blocks = _blocks(model)
    dp_mesh = fsdp_mesh(mesh)
    mixed = options.param_dtype is not None or options.reduce_dtype is not None
    if mixed and dp_mesh is None:
        raise LayoutError(
            "Mixed precision (param_dtype/reduce_dtype) is applied by FSDP2, but the mesh has no "
            "dp_shard, dp_replicate or cp axis > 1; build the model in the compute dtype instead."
        )
    if dp_mesh is not None:
        mp = MixedPrecisionPolicy(param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype)
        shards = _axis_size(mesh, Axis.DP_SHARD) * _axis_size(mesh, Axis.CP)
        placement = partial(_fsdp_placement, shards=shards)
        for block in blocks.values():
            fully_shard(
                block, mesh=dp_mesh, reshard_after_forward=options.reshard_after_forward,
                shard_placement_fn=placement, mp_policy=mp,
            )
        if isinstance(model, Transformer):
            fully_shard(model, mesh=dp_mesh, reshard_after_forward=options.reshard_after_forward, mp_policy=mp)
    return model


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh FSDP2 shards over: ``dp_shard`` and ``cp`` flattened into ``dp_shard_cp``
    when both are > 1, under ``dp_replicate`` (HSDP) when that is > 1; ``dp_replicate`` alone
    is HSDP with shards of one (DDP's traffic); None when all are 1."""
    names = list(mesh.mesh_dim_names or ())
    shard = sorted((a.value for a in (Axis.DP_SHARD, Axis.CP) if _axis_size(mesh, a) > 1), key=names.index)
    flat = groups.flatten(mesh, shard, "dp_shard_cp") if len(shard) > 1 else None
    if _axis_size(mesh, Axis.DP_REPLICATE) > 1 and not shard:
        # replication alone: HSDP with shards of one (a 2-D mesh whose shard dim has size 1),
        # which is DDP's traffic: gradients all-reduced over dp_replicate, nothing gathered
        rep = mesh[Axis.DP_REPLICATE.value]
        return rep._unflatten(0, (rep.size(), 1), (Axis.DP_REPLICATE.value, Axis.DP_SHARD.value))
    if _axis_size(mesh, Axis.DP_REPLICATE) > 1:
        dims = (Axis.DP_REPLICATE.value, *(flat.mesh_dim_names if flat is not None else shard))
        with warnings.catch_warnings():
            # torch 2.13 warns that slicing a flattened dim from the root mesh will change,
            # and has no other way to build this 2-D HSDP mesh (torchtitan slices it too)
            warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
            return mesh[dims]
    if flat is not None:
        return flat
    return mesh[shard[0]] if shard else None


def cp_shard(cp_mesh: DeviceMesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int]) -> list[torch.Tensor]:
    """This rank's part of each buffer's sequence dim ``seq_dims[i]`` under context parallel.

    The sequence is cut into ``2·cp`` chunks and rank ``r`` keeps chunks ``r`` and
    ``2·cp-1-r`` (PyTorch's ``_HeadTailLoadBalancer``), so every rank has the same share of
    causal attention. Inputs, labels and per-position tables must all be cut this way.
    """
    from torch.distributed.tensor.experimental._attention import _context_parallel_shard
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _HeadTailLoadBalancer,
    )

    if len(buffers) != len(seq_dims) or not buffers:
        raise LayoutError(f"cp_shard needs one sequence dim per buffer: {len(buffers)} buffers, {len(seq_dims)} dims")
    lengths = {b.shape[d] for b, d in zip(buffers, seq_dims, strict=True)}
    cp = cp_mesh.size()
    if len(lengths) != 1:
        raise LayoutError(f"Context parallel buffers have different sequence lengths {sorted(lengths)}.")
    (seq,) = lengths
    if seq % (2 * cp):
        raise LayoutError(
            f"Context parallel degree {cp} needs a sequence length divisible by 2·{cp} = {2 * cp} "
            f"(head-tail load balancing); it is {seq}."
        )
    balancer = _HeadTailLoadBalancer(seq, cp, buffers[0].device)
    return list(_context_parallel_shard(cp_mesh, list(buffers), list(seq_dims), load_balancer=balancer))


def apply_cp(model: nn.Module, blocks: dict[str, nn.Module], cp_mesh: DeviceMesh) -> None:
    """Ring attention on ``cp_mesh`` for every block; per-position tables cut like the tokens.

    Turns on PyTorch's context-parallel DTensor dispatcher for the process, as torchtitan does;
    it only acts on attention ops whose inputs are DTensors sharded on the sequence."""
    from torch.distributed.tensor.experimental._attention import (
        _ContextParallel,
        _enable_context_parallel_dispatcher,
    )

    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)
    for block in blocks.values():
        parallelize_module(block.attention.sdpa, cp_mesh, style)
    if isinstance(model, Transformer):
        names = [n for n in ("rope_cos", "rope_sin", "positions") if getattr(model, n) is not None]
        for name, part in zip(names, cp_shard(cp_mesh, [getattr(model, n) for n in names], [0] * len(names)),
                              strict=True):
            model.register_buffer(name, part, persistent=False)
    _enable_context_parallel_dispatcher()


def _fsdp_placement(param: nn.Parameter, *, shards: int) -> Shard | None:
    """FSDP shards dim 0, except where it has fewer rows than shards: expert weights under
    expert parallelism (e.g. 1 local expert) would be padded ``shards``-fold, so they are
    sharded on dim 1, as torchtitan does."""
    local = param.to_local() if isinstance(param, DTensor) else param
    return Shard(1) if local.ndim > 1 and local.shape[0] < shards else None


def make_parallelize(options: ParallelOptions | None = None) -> Callable[[nn.Module, DeviceMesh], nn.Module]:
    """``parallelize_transformer`` with ``options`` bound: the ``(model, mesh)`` form the tracer takes."""
    return partial(parallelize_transformer, options=options)


def _blocks(model: nn.Module) -> dict[str, nn.Module]:
    if isinstance(model, Transformer):
        return dict(model.layers.items())
    return {"": model}


def apply_tp(model: nn.Module, blocks: dict[str, nn.Module], tp_mesh: DeviceMesh, options: ParallelOptions) -> None:
    """Megatron-style tensor parallel, with sequence parallel when ``options`` asks for it."""
    sp = options.sequence_parallel
    seq = Shard(1) if sp else Replicate()
    if isinstance(model, Transformer):
        top: dict[str, ParallelStyle] = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "output": ColwiseParallel(
                input_layouts=seq,
                output_layouts=Shard(-1) if options.loss_parallel else Replicate(),
                use_local_output=not options.loss_parallel,
            ),
        }
        if model.config.arch is Arch.GPT:
            # Position table rows split like the token table; positions are the sequence.
            top["pos_embeddings"] = RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(0) if sp else Replicate()
            )
        if sp:
            top["norm"] = SequenceParallel()
        parallelize_module(model, tp_mesh, top)
    for block in blocks.values():
        plan: dict[str, ParallelStyle] = {
            "attention": PrepareModuleInput(
                input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        if isinstance(block.feed_forward, MoE):
            # Experts are replicated over TP (EP shards them): gather the sequence in, and
            # hand the residual stream back in its own layout (a local slice, no comm).
            plan["feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=True,
            )
        else:
            plan["feed_forward"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
            plan["feed_forward.w1"] = ColwiseParallel()
            plan["feed_forward.w2"] = RowwiseParallel(output_layouts=seq)
            if block.feed_forward.w3 is not None:
                plan["feed_forward.w3"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, plan)


class ExpertParallel(ParallelStyle):
    """Shard ``GroupedExperts`` weights on the expert dim; all-to-all tokens in and out.

    The experts module takes buffers of shape (experts, capacity, hidden). With ``ep`` ranks
    each rank owns ``experts/ep`` experts: the input all-to-all sends rank ``j`` the slices of
    its experts from every rank, giving (experts/ep, ep·capacity, hidden); the output
    all-to-all sends results back.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed._functional_collectives import all_to_all_single

        ep = device_mesh.size()
        n_experts = module.w1.shape[0]
        if n_experts % ep:
            raise LayoutError(f"Expert parallel degree {ep} does not divide {n_experts} experts.")
        for name, param in list(module.named_parameters(recurse=False)):
            dist = nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)]))
            module.register_parameter(name, dist)
        group = device_mesh.get_group()

        def dispatch(_mod: nn.Module, args: tuple) -> tuple:
            (x,) = args
            e, cap, h = x.shape
            y = all_to_all_single(x.contiguous(), None, None, group)
            # (ep source ranks, local experts, cap, h) -> (local experts, ep * cap, h)
            y = y.view(ep, e // ep, cap, h).transpose(0, 1).reshape(e // ep, ep * cap, h)
            return (y,)

        def combine(_mod: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
            le, ep_cap, h = out.shape
            cap = ep_cap // ep
            y = out.view(le, ep, cap, h).transpose(0, 1).reshape(le * ep, cap, h)
            return all_to_all_single(y.contiguous(), None, None, group)

        module.register_forward_pre_hook(dispatch)
        module.register_forward_hook(combine)
        return module


# Ops whose outputs selective checkpointing keeps (torchtitan's default save list, CPU names).
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple:
    """Selective checkpointing's contexts. Under ``make_fx`` (a trace, fake tensors) the
    fused RMSNorm's kernels bump the version counter of its float32 statistics between
    forward and recomputation, which SAC's mutation check takes for a changed cached tensor;
    a trace carries no values, so the check is off there and stays on in real runs (which
    pass it: ``tests/trace/test_tracer.py``)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return create_selective_checkpoint_contexts(_selective_policy, allow_cache_entry_mutation=get_proxy_mode() is not None)


def apply_checkpointing(model: nn.Module, blocks: dict[str, nn.Module], mode: Checkpointing) -> None:
    """Wrap every block with ``checkpoint_wrapper`` (non-reentrant), fully or selectively."""
    kwargs = {"preserve_rng_state": False}
    if mode is Checkpointing.SELECTIVE:
        kwargs["context_fn"] = _selective_contexts
    if isinstance(model, Transformer):
        for name, block in blocks.items():
            model.layers.register_module(name, checkpoint_wrapper(block, **kwargs))
    else:
        raise LayoutError(
            "Activation checkpointing wraps blocks inside a Transformer; trace the block "
            "through a one-layer Transformer instead."
        )
