"""Prune the layout space before any trace: divisibility and a memory lower bound.

Neither test depends on the order of the axes, so both run on the ``D × K`` table of degree
rows × knob rows of a :class:`~topomesh.search.space.Space` (numpy, no Python loop over
layouts) and a pruned cell counts once per order of its row. Every pruned layout is counted
under the *first* reason it fails, in :class:`PruneReason` order, so the counts add up to the
number pruned.

Divisibility (what :meth:`Layout.check_model` and the parallelize functions require):
``tp`` divides the attention heads, the KV heads and the MLP width; ``pp`` divides the layers
(``pp × interleave`` stages with a multi-stage schedule, 2 per rank for V-shaped ones); ``2·cp`` divides the sequence (the
head–tail load balancing of causal context parallel); ``ep`` divides the experts and needs an
MoE model; ``dp × micro_batch`` divides the global batch (``dp = dp_replicate × dp_shard``).
With ``pp = 1`` the schedule makes no difference, so only the first schedule row of each
(micro-batch, recompute) pair is kept.

Memory (:func:`memory_lower_bound_bytes`): parameters, gradients and optimizer state under
the sharding, plus one micro-batch of block inputs, must fit in the device memory.

>>> from topomesh.models.presets import get_preset
>>> from topomesh.search.space import enumerate_space
>>> res = prune(enumerate_space(8, strategies=["tp", "pp"]),
...             PruneSetup(model=get_preset("tiny-llama"), global_batch=8, device_memory_bytes=2**30))
>>> res.kept, {r: n for r, n in res.pruned.items() if n}
(2, {'tp_kv_heads': 1, 'pp_layers': 3})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from topomesh.errors import LayoutError
from topomesh.layout.dims import Axis
from topomesh.models.transformer import Arch, TransformerConfig
from topomesh.search.space import COLUMN, Space, data_parallel_degree


class PruneReason(StrEnum):
    """Why a layout was removed before tracing (checked in this order)."""

    HEADS = "tp_heads"
    """``tp`` does not divide the attention heads."""
    KV_HEADS = "tp_kv_heads"
    """``tp`` does not divide the key/value heads."""
    FFN = "tp_ffn"
    """``tp`` does not divide the MLP width (``ffn_hidden``)."""
    LAYERS = "pp_layers"
    """``pp`` does not divide the layers."""
    INTERLEAVE = "pp_interleave_layers"
    """``pp × interleave`` does not divide the layers (interleaved schedule)."""
    SEQUENCE = "cp_sequence"
    """``2·cp`` does not divide the sequence length."""
    DENSE_EP = "ep_dense_model"
    """``ep > 1`` on a model without experts."""
    EXPERTS = "ep_experts"
    """``ep`` does not divide the experts."""
    BATCH = "dp_batch"
    """``dp_replicate × dp_shard × micro_batch`` does not divide the global batch."""
    SCHEDULE = "schedule_without_pp"
    """``pp = 1``: another schedule row with the same micro-batch and recompute is kept."""
    MEMORY = "memory"
    """The memory lower bound exceeds the device memory."""


_REASONS: tuple[PruneReason, ...] = tuple(PruneReason)


@dataclass(frozen=True, slots=True, kw_only=True)
class StateBytes:
    """Bytes of training state per parameter. Defaults: mixed-precision Adam, 2 (bf16
    weights) + 2 (bf16 gradients) + 12 (fp32 master copy and two moments) = 16 bytes
    (ZeRO, arXiv:1910.02054 §3.1). fp32 training is 4 + 4 + 8, also 16."""

    weight: int = 2
    grad: int = 2
    optimizer: int = 12

    @property
    def per_param(self) -> int:
        return self.weight + self.grad + self.optimizer


@dataclass(frozen=True, slots=True, kw_only=True)
class PruneSetup:
    """The model and training inputs pruning needs (micro-batch sizes come from the knobs)."""

    model: TransformerConfig
    global_batch: int
    """Samples per optimizer step, over all data-parallel replicas."""
    device_memory_bytes: int
    """Memory of one device, bytes."""
    seq_len: int | None = None
    """Training sequence length in tokens; ``None`` means the model's ``seq_len``."""
    sequence_parallel: bool = True
    """Block inputs sharded over ``tp`` on the sequence dim (Megatron SP)."""
    state: StateBytes = field(default_factory=StateBytes)
    activation_bytes: int = 2
    """Bytes per activation element (bf16)."""

    def __post_init__(self) -> None:
        for name in ("global_batch", "device_memory_bytes", "activation_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise LayoutError(f"pruning needs a positive integer {name}, got {v!r}")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise LayoutError(f"pruning needs a positive integer seq_len, got {self.seq_len!r}")

    @property
    def tokens(self) -> int:
        return self.seq_len or self.model.seq_len


def expert_params_per_block(cfg: TransformerConfig) -> int:
    """Expert weights of one MoE block: ``n_experts × 3·hidden·ffn_hidden`` (``GroupedExperts``'
    w1, w2, w3); 0 for a dense model. The router is counted with the dense weights."""
    return cfg.n_experts * 3 * cfg.hidden * cfg.ffn_hidden if cfg.is_moe else 0


def memory_lower_bound_bytes(
    cfg: TransformerConfig,
    *,
    tp: np.ndarray | int = 1,
    pp: np.ndarray | int = 1,
    ep: np.ndarray | int = 1,
    dp_shard: np.ndarray | int = 1,
    cp: np.ndarray | int = 1,
    micro_batch: np.ndarray | int = 1,
    seq_len: int | None = None,
    sequence_parallel: bool = True,
    state: StateBytes | None = None,
    activation_bytes: int = 2,
) -> np.ndarray:
    """Bytes the first pipeline stage needs at least, per rank (arrays broadcast; float64).

    The first stage holds the embeddings (and, with ``pp = 1``, the final norm and output
    head) and ``n_layers / pp`` blocks. Dense weights are split over ``tp``, expert weights
    over ``ep`` (they are replicated over ``tp``); FSDP shards weights, gradients and optimizer
    state over ``dp_shard × cp``, at ``state.per_param`` bytes per parameter. Activations: one
    micro-batch of block inputs, ``activation_bytes × micro_batch × (seq/cp) × hidden`` per
    block (``/ tp`` with sequence parallel) — what full recomputation keeps (Korthikanti et
    al., arXiv:2205.05198: ``2·s·b·h`` per layer), so a lower bound for every recompute mode.
    Under a pipeline the gradients and the block inputs count as the larger of the two, not
    their sum: a rank's gradients appear at its first backward as it frees that micro-batch's
    activations, so with one micro-batch in flight they need not be live together
    (:func:`topomesh.sim.simulate._memory`). Not counted: gathered FSDP blocks, recomputed
    activations, logits, buffers, fragmentation. It is a lower bound of the peak over stages,
    never an estimate of it.

    >>> from topomesh.models.presets import get_preset
    >>> round(float(memory_lower_bound_bytes(get_preset("llama3-70b"), tp=8, pp=8, dp_shard=32)) / 2**30, 3)
    0.646
    """
    state = state or StateBytes()
    h = cfg.hidden
    tp, pp, ep, dp_shard, cp, micro_batch = (
        np.asarray(x, dtype=np.float64) for x in (tp, pp, ep, dp_shard, cp, micro_batch)
    )
    embeddings = cfg.vocab_size * h + (cfg.seq_len * h if cfg.arch is Arch.GPT else 0)
    head = cfg.vocab_size * h + h * (2 if cfg.arch is Arch.GPT else 1)
    expert = expert_params_per_block(cfg)
    dense_block = cfg.block_params() - expert
    layers = cfg.n_layers / pp
    dense = (embeddings + np.where(pp == 1, head, 0) + layers * dense_block) / tp
    params = (dense + layers * expert / ep) / (dp_shard * cp)
    tokens = (seq_len or cfg.seq_len) / cp
    block_input = activation_bytes * micro_batch * tokens * h / (tp if sequence_parallel else 1)
    grads, inputs = state.grad * params, layers * block_input
    return (state.weight + state.optimizer) * params + np.where(pp > 1, np.maximum(grads, inputs), grads + inputs)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)  # arrays: compared by identity
class PruneResult:
    """Which (degree row, knob row) cells survive, and why the others do not."""

    reason: np.ndarray
    """int8 ``(D, K)``: index into :class:`PruneReason` order of the first failed check, -1 if kept."""
    memory_lower_bound_bytes: np.ndarray
    """float64 ``(D, K)``: :func:`memory_lower_bound_bytes` of each cell."""
    pruned: Mapping[str, int]
    """Layouts (orders and knob rows counted) pruned under each reason; every reason listed."""
    kept: int
    """Layouts (orders and knob rows counted) left for tracing and evaluation."""

    @property
    def keep(self) -> np.ndarray:
        return self.reason < 0

    @property
    def n_pruned(self) -> int:
        return sum(self.pruned.values())


def prune(space: Space, setup: PruneSetup) -> PruneResult:
    """Run every check over ``space`` (see the module docstring) and count the pruned layouts."""
    cfg = setup.model
    deg = space.degrees
    col = {a: deg[:, COLUMN[a], None] for a in Axis}  # (D, 1) each
    tp, pp, cp, ep = col[Axis.TP], col[Axis.PP], col[Axis.CP], col[Axis.EP]
    dp = data_parallel_degree(deg)[:, None]
    knobs = space.knobs
    mb, v = knobs.micro_batch[None, :], knobs.interleave[None, :]  # (1, K)

    shape = (len(deg), len(knobs))
    reason = np.full(shape, -1, dtype=np.int8)

    def mark(failed: np.ndarray, why: PruneReason) -> None:
        np.putmask(reason, (reason < 0) & np.broadcast_to(failed, shape), _REASONS.index(why))

    mark(cfg.n_heads % tp != 0, PruneReason.HEADS)
    mark(cfg.kv_heads % tp != 0, PruneReason.KV_HEADS)
    mark(cfg.ffn_hidden % tp != 0, PruneReason.FFN)
    mark(cfg.n_layers % pp != 0, PruneReason.LAYERS)
    mark((pp > 1) & (v > 1) & (cfg.n_layers % (pp * v) != 0), PruneReason.INTERLEAVE)
    mark((cp > 1) & (setup.tokens % (2 * cp) != 0), PruneReason.SEQUENCE)
    if cfg.is_moe:
        mark(cfg.n_experts % ep != 0, PruneReason.EXPERTS)
    else:
        mark(ep > 1, PruneReason.DENSE_EP)
    mark(setup.global_batch % (dp * mb) != 0, PruneReason.BATCH)
    mark((pp == 1) & _repeats_schedule(space)[None, :], PruneReason.SCHEDULE)
    bound = memory_lower_bound_bytes(
        cfg, tp=tp, pp=pp, ep=ep, dp_shard=col[Axis.DP_SHARD], cp=cp, micro_batch=mb,
        seq_len=setup.tokens, sequence_parallel=setup.sequence_parallel, state=setup.state,
        activation_bytes=setup.activation_bytes,
    )
    bound = np.broadcast_to(bound, shape)
    mark(bound > setup.device_memory_bytes, PruneReason.MEMORY)

    orders = np.broadcast_to(space.n_orders[:, None], shape)
    counts = np.bincount((reason + 1).ravel(), weights=orders.ravel(), minlength=len(_REASONS) + 1)
    counts = np.rint(counts).astype(np.int64)
    return PruneResult(
        reason=reason,
        memory_lower_bound_bytes=bound,
        pruned={r.value: int(counts[i + 1]) for i, r in enumerate(_REASONS)},
        kept=int(counts[0]),
    )


def _repeats_schedule(space: Space) -> np.ndarray:
    """bool ``(K,)``: an earlier knob row has the same micro-batch and recompute."""
    seen: set[tuple[int, int]] = set()
    out = np.zeros(len(space.knobs), dtype=bool)
    for k, key in enumerate(zip(space.knobs.micro_batch.tolist(), space.knobs.recompute.tolist(), strict=True)):
        out[k] = key in seen
        seen.add(key)
    return out
