"""The MoE shape and activation of transformers configs, by ``model_type``."""
from __future__ import annotations

from mxfx.activation import GPT_OSS


def _silu_halves(cfg, experts: str, intermediate: str) -> dict:
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(
            f"cfg: {cfg.model_type} with hidden_act={act!r}; mxfx runs gated SiLU ('silu') experts"
        )
    return dict(
        num_experts=getattr(cfg, experts),
        intermediate_size=getattr(cfg, intermediate),
        layout="halves",
    )


def _gpt_oss(cfg) -> dict:
    # transformers hard-codes alpha and limit in GptOssExperts; beta is the "+ 1" on up.
    return dict(
        num_experts=cfg.num_local_experts,
        intermediate_size=cfg.intermediate_size,
        layout=GPT_OSS.layout,
        alpha=GPT_OSS.alpha,
        beta=GPT_OSS.beta,
        limit=getattr(cfg, "swiglu_limit", GPT_OSS.limit),
        has_bias=True,
    )


def _minimax_m3(cfg) -> dict:
    # MiniMaxM3VLExperts: gate/up as halves, gate*sigmoid(alpha*gate)*(up + 1), both clamped.
    return dict(
        num_experts=cfg.num_local_experts,
        intermediate_size=cfg.intermediate_size,
        layout="halves",
        alpha=cfg.swiglu_alpha,
        beta=1.0,
        limit=cfg.swiglu_limit,
    )


_MODELS = {
    "gpt_oss": _gpt_oss,
    "qwen3_moe": lambda c: _silu_halves(c, "num_experts", "moe_intermediate_size"),
    "qwen3_next": lambda c: _silu_halves(c, "num_experts", "moe_intermediate_size"),
    "qwen3_5_moe_text": lambda c: _silu_halves(c, "num_experts", "moe_intermediate_size"),
    "mixtral": lambda c: _silu_halves(c, "num_local_experts", "intermediate_size"),
    "minimax": lambda c: _silu_halves(c, "num_local_experts", "intermediate_size"),
    "minimax_m2": lambda c: _silu_halves(c, "num_local_experts", "intermediate_size"),
    "minimax_m3_vl_text": _minimax_m3,
}


def moe_fields(cfg) -> dict:
    """``MoEConfig`` fields (all but dtype and quantization) of a transformers config."""
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    model_type = getattr(cfg, "model_type", None)
    if model_type not in _MODELS:
        raise ValueError(
            f"cfg: got model_type {model_type!r}, expected one of {sorted(_MODELS)}"
        )
    return dict(
        hidden_size=cfg.hidden_size, top_k=cfg.num_experts_per_tok, **_MODELS[model_type](cfg)
    )
