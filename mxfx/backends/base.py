"""What every MoE backend is: a name, declared capabilities, and ``run``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from mxfx.activation import GatedActivation


@dataclass(frozen=True)
class MoEWeights:
    """One MoE layer's expert weights in canonical layout.

    Float: ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` (any strides), scales None.
    MXFP4: ``w13 uint8 [E, 2I, H/2]`` + ``w13_scale uint8 [E, 2I, H/32]``, likewise ``w2``.
    Biases ``w13_bias [E, 2I]``, ``w2_bias [E, H]`` or None.
    """

    w13: torch.Tensor
    w13_scale: Optional[torch.Tensor]
    w13_bias: Optional[torch.Tensor]
    w2: torch.Tensor
    w2_scale: Optional[torch.Tensor]
    w2_bias: Optional[torch.Tensor]

    @property
    def quantized(self) -> bool:
        return self.w13_scale is not None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]


@dataclass(frozen=True)
class ActivationQuant:
    """How the activations entering each GEMM are quantized (per 32-block along K)."""

    fmt: str = "none"  # "none" | "mxfp8" | "mxfp4"
    scale_rounding: str = "even"
