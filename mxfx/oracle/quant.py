"""Quantization keys: what a layer's weights are stored as, and how its activations are quantized.

Keys are string enums, so they compare (and hash) equal to their names: ``WeightQuant.MXFP4 ==
"mxfp4"`` and a backend may declare ``frozenset({"none", "mxfp8"})``.
"""
from __future__ import annotations

from enum import Enum


class _Key(str, Enum):
    def __str__(self) -> str:
        return self.value

    __hash__ = str.__hash__

    @classmethod
    def parse(cls, value, field: str):
        """``value`` (a key or its name) as a key; ``ValueError`` naming ``field`` otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"{field}: got {value!r}, expected one of {[k.value for k in cls]}"
            ) from None


class WeightQuant(_Key):
    """How the expert weights are stored: float (bf16/fp16/fp32) or OCP MXFP4 (32-blocks, E8M0)."""

    FLOAT = "float"
    MXFP4 = "mxfp4"


class ActivationQuantKey(_Key):
    """How the input of each expert GEMM is quantized: dynamically, per 32-block along K.

    ``NONE`` runs the GEMMs on the activations in the layer's dtype.
    """

    NONE = "none"
    MXFP8 = "mxfp8"
    MXFP4 = "mxfp4"

    def higher_precision(self) -> tuple["ActivationQuantKey", ...]:
        """The keys that keep more precision than this one, nearest first."""
        order = list(ActivationQuantKey)[::-1]  # mxfp4, mxfp8, none
        return tuple(order[order.index(self) + 1 :])
