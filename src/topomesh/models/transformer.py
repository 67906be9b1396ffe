"""A reference GPT / Llama-style decoder transformer, written like torchtitan's Llama.

One module covers three block kinds, chosen by :class:`TransformerConfig`:

* ``Arch.GPT`` — Megatron-LM GPT: learned position embeddings, LayerNorm with bias,
  biased linears, GELU MLP (``w1`` → GELU → ``w2``), multi-head attention.
* ``Arch.LLAMA`` — Llama-3: rotary position embeddings, RMSNorm, bias-free linears,
  SwiGLU MLP (``w2(silu(w1 x) * w3 x)``), grouped-query attention (``n_kv_heads``).
* ``n_experts > 0`` — a Mixtral-style mixture of experts replaces the MLP: a router
  (``gate``) picks ``top_k`` experts per token; tokens are dispatched to fixed-capacity
  per-expert buffers (GShard/Switch style, capacity factor in the config) so every shape
  is static and the block traces under ``FakeTensorMode``; tokens over capacity are dropped.

Submodule names follow torchtitan (``tok_embeddings``, ``layers.<i>.attention.wq`` …,
``norm``, ``output``) so that torchtitan-style parallelize plans apply unchanged. Heads
are inferred from the local tensor width (``view(..., -1, head_dim)``), so the same code
runs on tensor-parallel shards. Output embeddings are not tied to the input embeddings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.nn.functional as F
from torch import nn

from topomesh.errors import ModelConfigError


class Arch(StrEnum):
    GPT = "gpt"
    LLAMA = "llama"


@dataclass(frozen=True, slots=True, kw_only=True)
class TransformerConfig:
    """Shape of a decoder-only transformer; every field is a count unless noted."""

    name: str
    """Preset name, e.g. ``llama3-70b``; used in cache keys and reports."""
    arch: Arch
    n_layers: int
    hidden: int
    """Model width (``d_model``)."""
    n_heads: int
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; ``None`` means ``n_heads`` (MHA)."""
    ffn_hidden: int
    """Inner width of the MLP (of each expert for MoE)."""
    vocab_size: int
    seq_len: int
    """Training sequence length in tokens."""
    n_experts: int = 0
    """Experts per MoE layer; 0 means a dense MLP."""
    top_k: int = 0
    """Experts each token is routed to (MoE only)."""
    capacity_factor: float = 1.0
    """Expert buffer size as a multiple of ``tokens * top_k / n_experts`` (MoE only)."""
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    """Rotary base (Llama only)."""

    def __post_init__(self) -> None:
        for f in ("n_layers", "hidden", "n_heads", "ffn_hidden", "vocab_size", "seq_len"):
            if getattr(self, f) <= 0:
                raise ModelConfigError(f"{self.name}: {f} must be positive, got {getattr(self, f)}.")
        if self.hidden % self.n_heads:
            raise ModelConfigError(
                f"{self.name}: hidden {self.hidden} is not a multiple of n_heads {self.n_heads}."
            )
        if self.n_heads % self.kv_heads:
            raise ModelConfigError(
                f"{self.name}: n_heads {self.n_heads} is not a multiple of n_kv_heads {self.kv_heads}."
            )
        if self.n_experts < 0 or (self.n_experts > 0) != (self.top_k > 0):
            raise ModelConfigError(
                f"{self.name}: n_experts={self.n_experts} and top_k={self.top_k} must both be "
                "positive (MoE) or both zero (dense)."
            )
        if self.top_k > self.n_experts:
            raise ModelConfigError(f"{self.name}: top_k {self.top_k} exceeds n_experts {self.n_experts}.")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def block_params(self) -> int:
        """Parameters of one transformer block (all experts counted).

        >>> c = TransformerConfig(name="x", arch=Arch.GPT, n_layers=1, hidden=8, n_heads=2,
        ...                       ffn_hidden=32, vocab_size=10, seq_len=4)
        >>> c.block_params()  # 4*8*8+4*8 (attn) + 2*8*32+32+8 (mlp) + 2*2*8 (norms)
        872
        """
        h, kv = self.hidden, self.kv_heads * self.head_dim
        bias = self.arch is Arch.GPT
        attn = h * h + 2 * h * kv + h * h + (h + 2 * kv + h if bias else 0)
        n_mats = 2 if self.arch is Arch.GPT else 3
        mlp = n_mats * h * self.ffn_hidden + (self.ffn_hidden + h if bias else 0)
        if self.is_moe:
            mlp = self.n_experts * mlp + h * self.n_experts
        norms = 2 * h * (2 if bias else 1)
        return attn + mlp + norms

    def total_params(self) -> int:
        """All parameters: embeddings, blocks, final norm and output head."""
        h = self.hidden
        emb = self.vocab_size * h + (self.seq_len * h if self.arch is Arch.GPT else 0)
        final_norm = h * (2 if self.arch is Arch.GPT else 1)
        return emb + self.n_layers * self.block_params() + final_norm + self.vocab_size * h

    def active_params(self) -> int:
        """Parameters one token touches (``top_k`` of ``n_experts`` experts for MoE)."""
        if not self.is_moe:
            return self.total_params()
        per_expert = 3 * self.hidden * self.ffn_hidden
        return self.total_params() - self.n_layers * (self.n_experts - self.top_k) * per_expert


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _norm(cfg: TransformerConfig) -> nn.Module:
    if cfg.arch is Arch.GPT:
        return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
    return RMSNorm(cfg.hidden, cfg.norm_eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on ``x`` of shape (batch, seq, heads, head_dim)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class ScaledDotProductAttention(nn.Module):
    """Causal ``F.scaled_dot_product_attention`` on (batch, heads, seq, head_dim) as a module
    of its own, so context parallel (``_ContextParallel``) can wrap exactly this call."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        bias = cfg.arch is Arch.GPT
        self.head_dim = cfg.head_dim
        self.n_rep = cfg.n_heads // cfg.kv_heads
        kv = cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.hidden, cfg.hidden, bias=bias)
        self.wk = nn.Linear(cfg.hidden, kv, bias=bias)
        self.wv = nn.Linear(cfg.hidden, kv, bias=bias)
        self.wo = nn.Linear(cfg.hidden, cfg.hidden, bias=bias)
        self.sdpa = ScaledDotProductAttention()

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        bs, seq, _ = x.shape
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        if rope is not None:
            cos, sin = (t[:seq].view(1, seq, 1, self.head_dim) for t in rope)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.n_rep > 1:  # grouped-query attention: repeat each kv head n_rep times
            k = k.repeat_interleave(self.n_rep, dim=2)
            v = v.repeat_interleave(self.n_rep, dim=2)
        out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    """GELU MLP (GPT, ``w3`` is None) or SwiGLU (Llama)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        bias = cfg.arch is Arch.GPT
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=bias)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=bias)
        self.w3 = None if cfg.arch is Arch.GPT else nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU MLPs applied to per-expert buffers of shape (experts, tokens, hidden).

    Under expert parallelism the weights are sharded on dim 0 and the buffers arrive
    already exchanged (all-to-all), so the local expert count is read from the weights.
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        e, h, f = cfg.n_experts, cfg.hidden, cfg.ffn_hidden
        self.w1 = nn.Parameter(torch.empty(e, h, f))
        self.w2 = nn.Parameter(torch.empty(e, f, h))
        self.w3 = nn.Parameter(torch.empty(e, h, f))
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        return torch.bmm(F.silu(torch.bmm(x, w1)) * torch.bmm(x, w3), w2)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


class MoE(nn.Module):
    """Top-k routed experts with fixed-capacity dispatch (static shapes, drops overflow)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.gate = nn.Linear(cfg.hidden, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg)

    def capacity(self, tokens: int) -> int:
        """Slots per expert: ``ceil(capacity_factor * tokens * top_k / n_experts)``."""
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, h = x.shape
        tokens = x.reshape(-1, h)
        n, e, cap = tokens.shape[0], self.n_experts, self.capacity(bs * seq)
        weights, experts = torch.topk(F.softmax(self.gate(tokens), dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        # Position of each (token, choice) inside its expert's buffer, in token order.
        onehot = F.one_hot(experts.reshape(-1), e)
        position = (torch.cumsum(onehot, dim=0) - 1).gather(1, experts.reshape(-1, 1)).squeeze(1)
        keep = position < cap
        dropped_slot = e * cap  # one spare row collects every dropped token
        slot = torch.where(keep, experts.reshape(-1) * cap + position, dropped_slot)
        src = tokens.repeat_interleave(self.top_k, dim=0)
        buf = tokens.new_zeros(e * cap + 1, h).index_add(0, slot, src)
        out = self.experts(buf[:-1].view(e, cap, h)).reshape(e * cap, h)
        out = torch.cat([out, out.new_zeros(1, h)])
        combined = (out[slot] * (weights.reshape(-1, 1) * keep.unsqueeze(1))).view(n, self.top_k, h)
        return combined.sum(dim=1).view(bs, seq, h)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.attention_norm = _norm(cfg)
        self.attention = Attention(cfg)
        self.ffn_norm = _norm(cfg)
        self.feed_forward = MoE(cfg) if cfg.is_moe else FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder-only transformer; ``forward(tokens)`` returns logits (batch, seq, vocab)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos_embeddings = nn.Embedding(cfg.seq_len, cfg.hidden) if cfg.arch is Arch.GPT else None
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = _norm(cfg)
        self.output = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        # Per-position tables, indexed by the position of each row of the local sequence:
        # context parallel shards them like the tokens (topomesh.models.parallelize.apply_cp).
        cos, sin = rope_tables(cfg) if cfg.arch is Arch.LLAMA else (None, None)
        positions = torch.arange(cfg.seq_len) if cfg.arch is Arch.GPT else None
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("positions", positions, persistent=False)

    def rope(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.rope_cos is None else (self.rope_cos, self.rope_sin)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(self.positions[: tokens.shape[1]])
        rope = self.rope()
        for layer in self.layers.values():
            h = layer(h, rope)
        return self.output(self.norm(h))


def rope_tables(cfg: TransformerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables of shape (seq_len, head_dim) for rotary embeddings."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(torch.get_default_dtype()), angles.sin().to(torch.get_default_dtype())
