"""The one gated-activation formula (clamped SwiGLU family) and its presets.

    gate = x_g.clamp(max=limit); up = x_u.clamp(-limit, limit)    # limit=None: no clamp
    out  = gate * sigmoid(alpha * gate) * (up + beta)             # computed in fp32

``layout="interleaved"``: x_g = x[..., 0::2], x_u = x[..., 1::2] (gpt-oss).
``layout="halves"``: x_g = x[..., :d], x_u = x[..., d:] (Mixtral, Qwen, DeepSeek, MiniMax).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

LAYOUTS = ("interleaved", "halves")


@dataclass(frozen=True)
class GatedActivation:
    """A gated activation: ``layout``, ``alpha``, ``beta`` and ``limit`` (None: no clamp)."""

    layout: str = "halves"
    alpha: float = 1.0
    beta: float = 0.0
    limit: Optional[float] = None

    def __post_init__(self) -> None:
        check_activation(self.layout, self.alpha, self.beta, self.limit)


def check_activation(layout: str, alpha: float, beta: float, limit: Optional[float]) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: got {layout!r}, expected one of {list(LAYOUTS)}")
    for name, v in (("alpha", alpha), ("beta", beta)):
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name}: got {v!r}, expected a finite number")
    if limit is not None and (not isinstance(limit, (int, float)) or not limit > 0 or not math.isfinite(limit)):
        raise ValueError(f"limit: got {limit!r}, expected None or a finite number > 0")


def split_gate_up(x: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate, up)`` halves of ``x [..., 2d]`` for ``layout``, as views."""
    if layout == "interleaved":
        return x[..., 0::2], x[..., 1::2]
    return x.chunk(2, dim=-1)


def join_gate_up(gate: torch.Tensor, up: torch.Tensor, layout: str) -> torch.Tensor:
    """Inverse of :func:`split_gate_up`: ``[..., d]`` twice → ``[..., 2d]``."""
    if layout == "interleaved":
        return torch.stack((gate, up), dim=-1).flatten(-2)
    return torch.cat((gate, up), dim=-1)


SILU_AND_MUL = GatedActivation("halves", 1.0, 0.0, None)
GPT_OSS = GatedActivation("interleaved", 1.702, 1.0, 7.0)


def swiglu_limit(limit: float) -> GatedActivation:
    """SiLU-and-mul with both inputs clamped at ``limit`` (halves layout)."""
    return GatedActivation("halves", 1.0, 0.0, limit)


def minimax_m3(alpha: float, beta: float, limit: float) -> GatedActivation:
    """MiniMax-M3 ``SWIGLUOAI_UNINTERLEAVE``: the gpt-oss formula on the halves layout."""
    return GatedActivation("halves", alpha, beta, limit)


PRESETS: dict[str, GatedActivation] = {
    "silu_and_mul": SILU_AND_MUL,
    "gpt_oss": GPT_OSS,
    "minimax_m3": minimax_m3(1.702, 1.0, 7.0),
    "swiglu_limit": swiglu_limit(7.0),
}
