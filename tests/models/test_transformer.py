"""Numerical properties of the reference transformer (real tensors, tiny shapes)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from topomesh.models.presets import get_preset
from topomesh.models.transformer import MoE, Transformer


def test_causal_future_tokens_do_not_change_past_logits() -> None:
    for name in ("tiny-gpt", "tiny-llama", "tiny-moe"):
        torch.manual_seed(0)
        cfg = get_preset(name)
        # capacity large enough that no token is dropped, so routing is per-token
        cfg = dataclasses.replace(cfg, capacity_factor=float(max(cfg.n_experts, 1)))
        model = Transformer(cfg).eval()
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
        y = x.clone()
        y[:, -4:] = (y[:, -4:] + 1) % cfg.vocab_size
        with torch.no_grad():
            a, b = model(x), model(y)
        assert a.shape == (2, cfg.seq_len, cfg.vocab_size)
        torch.testing.assert_close(a[:, :-4], b[:, :-4])
        assert not torch.allclose(a[:, -1], b[:, -1])


def test_moe_dispatch_equals_per_token_experts() -> None:
    torch.manual_seed(0)
    cfg = dataclasses.replace(get_preset("tiny-moe"), capacity_factor=4.0)
    moe = MoE(cfg)
    x = torch.randn(2, 8, cfg.hidden)
    out = moe(x)
    tokens = x.reshape(-1, cfg.hidden)
    w, idx = torch.topk(F.softmax(moe.gate(tokens), -1), cfg.top_k, -1)
    w = w / w.sum(-1, keepdim=True)
    ref = torch.zeros_like(tokens)
    e = moe.experts
    for t in range(tokens.shape[0]):
        for j in range(cfg.top_k):
            k = idx[t, j]
            h = F.silu(tokens[t] @ e.w1[k]) * (tokens[t] @ e.w3[k])
            ref[t] += w[t, j] * (h @ e.w2[k])
    torch.testing.assert_close(out.reshape(-1, cfg.hidden), ref, rtol=1e-4, atol=1e-5)


def test_moe_drops_tokens_over_capacity() -> None:
    cfg = dataclasses.replace(get_preset("tiny-moe"), capacity_factor=0.25)
    moe = MoE(cfg)
    with torch.no_grad():
        moe.gate.weight.zero_()  # every token ties: topk picks the same experts for all
    x = torch.randn(1, 16, cfg.hidden)
    out = moe(x).reshape(16, -1)
    cap = moe.capacity(16)
    assert cap == 2
    # only the first `cap` tokens fit into their experts; the rest get zero output
    assert out[:cap].abs().sum() > 0
    assert out[cap:].abs().sum() == 0
