"""Preset shapes against published parameter totals, and the formula against real modules."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from topomesh.models.presets import MIXTRAL_ACTIVE_PARAMS, PRESETS, PUBLISHED_PARAMS, get_preset
from topomesh.models.transformer import Arch, ModelConfigError, Transformer, TransformerConfig


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_total_params_match_published(name: str) -> None:
    # Megatron's sizes are rounded names (22B, 175B, ...); Llama/Mixtral totals are exact
    # to 3 digits. Our counts include untied output embeddings and biases (GPT).
    published = PUBLISHED_PARAMS[name]
    assert PRESETS[name].total_params() == pytest.approx(published, rel=0.02)


def test_mixtral_active_params() -> None:
    assert get_preset("mixtral-8x7b").active_params() == pytest.approx(MIXTRAL_ACTIVE_PARAMS, rel=0.01)


def test_published_shapes() -> None:
    c = get_preset("gpt-530b")
    assert (c.n_layers, c.hidden, c.n_heads, c.seq_len, c.vocab_size) == (105, 20480, 128, 2048, 51200)
    c = get_preset("llama3-405b")
    assert (c.n_layers, c.hidden, c.n_heads, c.kv_heads, c.ffn_hidden, c.vocab_size) == (
        126, 16384, 128, 8, 53248, 128256,
    )
    c = get_preset("mixtral-8x7b")
    assert (c.n_experts, c.top_k, c.ffn_hidden, c.vocab_size) == (8, 2, 14336, 32000)


@pytest.mark.parametrize("name", ["llama3-70b", "gpt-175b", "mixtral-8x7b"])
def test_formula_matches_module_at_full_width(name: str) -> None:
    # One block of the real width, built on fake tensors: no memory is allocated.
    cfg = dataclasses.replace(get_preset(name), n_layers=1)
    with FakeTensorMode():
        model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.total_params()


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama", "tiny-moe"])
def test_tiny_presets_build_and_count(name: str) -> None:
    cfg = get_preset(name)
    model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.total_params()


def test_bad_configs_are_named() -> None:
    with pytest.raises(ModelConfigError, match="hidden 100 is not a multiple of n_heads 3"):
        TransformerConfig(name="x", arch=Arch.GPT, n_layers=1, hidden=100, n_heads=3,
                          ffn_hidden=4, vocab_size=4, seq_len=4)
    with pytest.raises(ModelConfigError, match="top_k"):
        TransformerConfig(name="x", arch=Arch.LLAMA, n_layers=1, hidden=8, n_heads=2,
                          ffn_hidden=4, vocab_size=4, seq_len=4, n_experts=4)
    with pytest.raises(ModelConfigError, match="known presets: .*llama3-70b"):
        get_preset("llama-9000")


def test_block_params_doctest_value() -> None:
    c = TransformerConfig(name="x", arch=Arch.GPT, n_layers=1, hidden=8, n_heads=2,
                          ffn_hidden=32, vocab_size=10, seq_len=4)
    block = Transformer(c).layers["0"]
    assert sum(p.numel() for p in block.parameters()) == c.block_params() == 872
    assert torch.get_default_dtype() == torch.float32
