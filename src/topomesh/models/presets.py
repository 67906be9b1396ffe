"""Named model shapes: published configurations and tiny ones that run on a laptop CPU.

Sources (hidden / layers / heads / kv heads / ffn / vocab):

* Megatron-LM GPT family — Korthikanti et al., "Reducing Activation Recomputation in
  Large Transformer Models" (arXiv:2205.05198), Table 3: 22B (48 layers, hidden 6144,
  64 heads), 175B (96, 12288, 96), 530B (105, 20480, 128), 1T (128, 25600, 160);
  sequence 2048, vocabulary 51,200, MLP width 4·hidden.
* Llama-3 — Meta's ``params.json`` / Hugging Face ``config.json`` of Meta-Llama-3-8B,
  -70B and Llama-3.1-405B: 8B (32 layers, 4096, 32 heads, 8 kv, ffn 14336), 70B (80, 8192,
  64, 8, 28672), 405B (126, 16384, 128, 8, 53248); vocabulary 128,256; rope θ 500,000;
  training sequence 8192.
* Mixtral-8x7B — Mistral AI's ``config.json``: 32 layers, hidden 4096, 32 heads, 8 kv
  heads, 8 experts top-2, expert ffn 14336, vocabulary 32,000, rope θ 1e6. The model
  allows 32k context; the preset uses 4096 tokens.

Published parameter totals (checked in ``tests/models/test_presets.py``) are in
:data:`PUBLISHED_PARAMS`.
"""

from __future__ import annotations

from topomesh.errors import ModelConfigError
from topomesh.models.transformer import Arch, TransformerConfig


def _gpt(name: str, layers: int, hidden: int, heads: int) -> TransformerConfig:
    return TransformerConfig(
        name=name, arch=Arch.GPT, n_layers=layers, hidden=hidden, n_heads=heads,
        ffn_hidden=4 * hidden, vocab_size=51_200, seq_len=2048,
    )


def _llama3(name: str, layers: int, hidden: int, heads: int, ffn: int) -> TransformerConfig:
    return TransformerConfig(
        name=name, arch=Arch.LLAMA, n_layers=layers, hidden=hidden, n_heads=heads,
        n_kv_heads=8, ffn_hidden=ffn, vocab_size=128_256, seq_len=8192,
    )


PRESETS: dict[str, TransformerConfig] = {
    c.name: c
    for c in (
        _gpt("gpt-22b", 48, 6144, 64),
        _gpt("gpt-175b", 96, 12288, 96),
        _gpt("gpt-530b", 105, 20480, 128),
        _gpt("gpt-1t", 128, 25600, 160),
        _llama3("llama3-8b", 32, 4096, 32, 14336),
        _llama3("llama3-70b", 80, 8192, 64, 28672),
        _llama3("llama3-405b", 126, 16384, 128, 53248),
        TransformerConfig(
            name="mixtral-8x7b", arch=Arch.LLAMA, n_layers=32, hidden=4096, n_heads=32,
            n_kv_heads=8, ffn_hidden=14336, vocab_size=32_000, seq_len=4096,
            n_experts=8, top_k=2, rope_theta=1e6,
        ),
        # Tiny shapes for tests and CPU runs (same code paths, seconds to trace).
        TransformerConfig(
            name="tiny-gpt", arch=Arch.GPT, n_layers=2, hidden=64, n_heads=4,
            ffn_hidden=256, vocab_size=256, seq_len=32,
        ),
        TransformerConfig(
            name="tiny-llama", arch=Arch.LLAMA, n_layers=2, hidden=64, n_heads=8,
            n_kv_heads=4, ffn_hidden=160, vocab_size=256, seq_len=32,
        ),
        TransformerConfig(
            name="tiny-moe", arch=Arch.LLAMA, n_layers=2, hidden=64, n_heads=8,
            n_kv_heads=4, ffn_hidden=96, vocab_size=256, seq_len=32, n_experts=4, top_k=2,
        ),
    )
}
"""Every preset by name."""

PUBLISHED_PARAMS: dict[str, float] = {
    "gpt-22b": 22e9,  # arXiv:2205.05198 Table 3
    "gpt-175b": 175e9,
    "gpt-530b": 530e9,
    "gpt-1t": 1000e9,
    "llama3-8b": 8.03e9,  # Hugging Face model card / safetensors totals
    "llama3-70b": 70.6e9,
    "llama3-405b": 405.9e9,
    "mixtral-8x7b": 46.7e9,  # Mistral AI, "Mixtral of experts" (arXiv:2401.04088)
}
"""Published total parameter counts of the full-size presets."""

MIXTRAL_ACTIVE_PARAMS = 12.9e9
"""Active parameters per token of Mixtral-8x7B (arXiv:2401.04088: "13B active")."""


def get_preset(name: str) -> TransformerConfig:
    """The preset called ``name``; a :class:`ModelConfigError` lists the known ones otherwise.

    >>> get_preset("llama3-70b").hidden
    8192
    """
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ModelConfigError(f"Unknown model preset {name!r}; known presets: {known}.") from None
