"""The unfused Triton MoE backend: grouped GEMM → gated-activation kernel → grouped GEMM.

No activation quantization: it declares ``activation_quant={"none"}`` so the oracle never
picks it for an A8/A4 layer, and ``run`` refuses such a request rather than ignore it.
"""
from __future__ import annotations

from typing import Hashable, Optional

import torch

from mxfx.activation import GatedActivation
from mxfx.backends.base import Backend, Capabilities
from mxfx.moe_call import ActivationQuant, MoEWeights


class TritonUnfusedBackend(Backend):
    """Grouped GEMM1 (+bias) → ``mxfx.kernels.activation`` → grouped GEMM2 → k-sum."""

    name = "triton_unfused"
    capabilities = Capabilities(
        platforms=frozenset({"cuda", "rocm"}),
        weight_quant=frozenset({"float", "mxfp4"}),
        activation_quant=frozenset({"none"}),
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        layouts=frozenset({"interleaved", "halves"}),
        bias=True,
        packages=frozenset({"triton"}),
        note="A16 only; the pre-activation makes one round trip through memory",
    )

    def run(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        weights: MoEWeights,
        act: GatedActivation,
        aq: ActivationQuant,
        key: Optional[Hashable] = None,
    ) -> torch.Tensor:
        if aq.fmt != "none":
            raise ValueError(
                f"activation_quant: got {aq.fmt!r}, but triton_unfused executes only 'none'"
            )
        from mxfx.kernels.activation import gated_activation
        from mxfx.kernels.moe import unfused_moe

        return unfused_moe(x, topk_weights, topk_ids, weights, act, gated_activation, key)


BACKEND = TritonUnfusedBackend()
