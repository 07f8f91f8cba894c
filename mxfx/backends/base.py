"""What every MoE backend is: a name, declared capabilities, and ``run``."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from mxfx.activation import GatedActivation
from mxfx.moe_call import ActivationQuant, MoEWeights


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
        tensors have equal :func:`mxfx.moe_call.signature` and whose other arguments are equal,
        and only for those, so that the backend need not build its own."""


def expert_id_error(top: int, num_experts: int) -> str:
    """The message for an expert id ``top`` >= E, wherever it is caught."""
    return f"topk_ids: expert id {top} out of range, expected ids < E={num_experts}"
