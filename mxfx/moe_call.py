"""What one MoE call carries below the op, from the backends down to the kernels: its expert
weights (:class:`MoEWeights`), how its activations are quantized (:class:`ActivationQuant`), and
the :func:`signature` its tensors are cached on. Plain data, so that every layer may import it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


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


def signature(tensors: Sequence[Optional[torch.Tensor]]) -> tuple:
    """What a call's tensors are cached on: each one's dtype, shape, strides, device and address
    modulo 16 (what kernels specialize pointers on), or None. Raises ``RuntimeError`` on a
    tensor without strides (a sparse one)."""
    parts: list = []
    for t in tensors:
        if t is None:
            parts.append(None)
        else:
            parts += (t.dtype, t.shape, t.stride(), t.device, t.data_ptr() % 16)
    return tuple(parts)
