"""The MoE layers of well-known models (bf16 activations, MXFP4 weights, no activation
quantization; use ``dataclasses.replace`` for others). Shared by ``doctor``, benchmarks, demo.

Sources: the transformers 5.17 config defaults (GptOssConfig = gpt-oss-120b,
Qwen3MoeConfig = Qwen3-30B-A3B, MixtralConfig = Mixtral-8x7B, MiniMaxM3VLTextConfig =
MiniMax-M3) and gpt-oss-20b's published config (32 experts, 24 layers).
"""
from __future__ import annotations

from mxfx.activation import GPT_OSS
from mxfx.oracle.config import MoEConfig

_GPT_OSS = dict(layout=GPT_OSS.layout, alpha=GPT_OSS.alpha, beta=GPT_OSS.beta, limit=GPT_OSS.limit, has_bias=True)

SHAPES: dict[str, MoEConfig] = {
    "gpt-oss-20b": MoEConfig(32, 2880, 2880, 4, **_GPT_OSS),
    "gpt-oss-120b": MoEConfig(128, 2880, 2880, 4, **_GPT_OSS),
    # SWIGLUOAI_UNINTERLEAVE: the gpt-oss formula on halves, alpha/limit from the config.
    "MiniMax-M3": MoEConfig(128, 6144, 3072, 4, "halves", 1.702, 1.0, 7.0),
    "Qwen3-30B-A3B": MoEConfig(128, 2048, 768, 8),
    "Mixtral-8x7B": MoEConfig(8, 4096, 14336, 2),
}
