"""What every MoE backend is: a name, declared capabilities, and ``run``."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Sequence

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


@dataclass(frozen=True)
class Capabilities:
    """What a backend executes, as data. The oracle's generic ``supports`` reads this.

    ``activation_quant`` lists the activation quantizations the backend *executes*
    (quantizes each GEMM's input exactly as the emulation backend does); a backend that
    would run an A8/A4 layer with higher-precision activations must not list them.
    """

    platforms: frozenset  # platform kinds: "cuda", "rocm", "xpu", "cpu"
    weight_quant: frozenset  # "float", "mxfp4"
    activation_quant: frozenset  # "none", "mxfp8", "mxfp4"
    dtypes: frozenset  # activation dtypes, torch.dtype
    layouts: frozenset = frozenset({"interleaved", "halves"})
    archs: Optional[frozenset] = None  # None: every arch of those platforms
    bias: bool = True
    hidden_align: int = 1  # hidden size must be a multiple of this
    intermediate_align: int = 1  # intermediate size must be a multiple of this
    packages: frozenset = frozenset()  # optional packages that must import
    note: str = ""  # e.g. "not verified on hardware by mxfx"


class Backend(ABC):
    """A MoE backend: a name, its :class:`Capabilities`, and ``run``.

    Subclasses set ``name`` and ``capabilities`` and implement :meth:`run`. ``extra_check``
    may refuse configurations the data cannot express; it returns a reason or None.
    """

    name: str = ""
    capabilities: Capabilities

    def extra_check(self, config, platform) -> Optional[str]:
        return None

    @abstractmethod
    def run(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        weights: MoEWeights,
        act: GatedActivation,
        aq: ActivationQuant,
    ) -> torch.Tensor:
        """``mxfx.moe`` on already-validated arguments → ``[T, H]`` in ``x.dtype``.

        A backend that caches per call signature may take one more argument, ``key`` (a
        hashable, or None): :func:`mxfx.ops.moe` then passes one that is equal for calls whose
        tensors have equal :func:`signature` and whose other arguments are equal, and only for
        those, so that the backend need not build its own."""


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


def expert_id_error(top: int, num_experts: int) -> str:
    """The message for an expert id ``top`` >= E, wherever it is caught."""
    return f"topk_ids: expert id {top} out of range, expected ids < E={num_experts}"
