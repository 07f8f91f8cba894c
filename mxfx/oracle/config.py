"""``MoEConfig``: what the oracle knows about one MoE layer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from mxfx import formats
from mxfx.activation import GatedActivation, check_activation
from mxfx.oracle.quant import ActivationQuantKey, WeightQuant

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_size(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: got {value!r}, expected an int >= 1")


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer, as a backend needs to know it. Frozen and hashable.

    Args:
        num_experts, hidden_size, intermediate_size, top_k: E, H, I (per expert) and k.
        layout, alpha, beta, limit: the gated activation (see :mod:`mxfx.activation`).
        has_bias: whether the expert projections have biases.
        dtype: the activations' dtype (the dtype of ``x``).
        weight_quant: ``"float"`` or ``"mxfp4"`` (coerced to :class:`WeightQuant`).
        activation_quant: ``"none"``, ``"mxfp8"`` or ``"mxfp4"``: how the input of each GEMM is
            quantized (dynamic, per 32-block along K; coerced to :class:`ActivationQuantKey`).
        activation_scale_rounding: the E8M0 scale rounding of that quantization.
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    layout: str = "halves"
    alpha: float = 1.0
    beta: float = 0.0
    limit: Optional[float] = None
    has_bias: bool = False
    dtype: torch.dtype = torch.bfloat16
    weight_quant: WeightQuant = WeightQuant.MXFP4
    activation_quant: ActivationQuantKey = ActivationQuantKey.NONE
    activation_scale_rounding: str = "even"

    def __post_init__(self) -> None:
        for name in ("num_experts", "hidden_size", "intermediate_size", "top_k"):
            _check_size(name, getattr(self, name))
        check_activation(self.layout, self.alpha, self.beta, self.limit)
        if not isinstance(self.has_bias, bool):
            raise TypeError(f"has_bias: got {self.has_bias!r}, expected a bool")
        if self.dtype not in DTYPES:
            raise TypeError(f"dtype: got {self.dtype!r}, expected one of {list(DTYPES)}")
        object.__setattr__(self, "weight_quant", WeightQuant.parse(self.weight_quant, "weight_quant"))
        object.__setattr__(
            self,
            "activation_quant",
            ActivationQuantKey.parse(self.activation_quant, "activation_quant"),
        )
        formats.check_scale_rounding(self.activation_scale_rounding)
        # A property of the layer, not of a backend: every GEMM input is quantized per block.
        if self.activation_quant != "none" and (
            self.hidden_size % formats.BLOCK or self.intermediate_size % formats.BLOCK
        ):
            raise ValueError(
                f"activation_quant: {self.activation_quant} quantizes each GEMM input per "
                f"{formats.BLOCK}-block, so hidden_size and intermediate_size must be multiples "
                f"of {formats.BLOCK}; got {self.hidden_size} and {self.intermediate_size}"
            )

    @property
    def activation(self) -> GatedActivation:
        return GatedActivation(self.layout, self.alpha, self.beta, self.limit)

    def __str__(self) -> str:
        act = f"{self.layout} alpha={self.alpha:g} beta={self.beta:g}"
        if self.limit is not None:
            act += f" limit={self.limit:g}"
        bias = " bias" if self.has_bias else ""
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"E={self.num_experts} H={self.hidden_size} I={self.intermediate_size} "
            f"top-{self.top_k} {act}{bias} {dtype} W={self.weight_quant} A={self.activation_quant}"
        )

    @classmethod
    def from_hf_config(
        cls,
        cfg,
        dtype: torch.dtype = torch.bfloat16,
        weight_quant: str = "mxfp4",
        activation_quant: str = "none",
    ) -> "MoEConfig":
        """The MoE layers of a transformers config (GptOss, Qwen3-MoE, Mixtral, MiniMax, ...).

        The quantization is not read from the config: pass the checkpoint's.
        """
        from mxfx.oracle.hf import moe_fields

        return cls(
            **moe_fields(cfg),
            dtype=dtype,
            weight_quant=weight_quant,
            activation_quant=activation_quant,
        )
