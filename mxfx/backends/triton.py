"""The fused Triton MoE backend: mxfx's own kernels on CUDA and ROCm.

GEMM1 over ``w13`` (MXFP4 dequantized in registers, or float) with bias and the gated
activation in its epilogue, then GEMM2 over ``w2`` with bias and routing weight, then a
deterministic sum over the k slots (no atomics). Activation quantization is executed exactly
as :mod:`mxfx.backends.emulation` does it: quantize-dequantized in registers, or, on GPUs with
MX matrix instructions and MXFP4 weights, quantized into MX elements for ``tl.dot_scaled``.
"""
from __future__ import annotations

from typing import Hashable, Optional

import torch

from mxfx.activation import GatedActivation
from mxfx.backends.base import Backend, Capabilities
from mxfx.moe_call import ActivationQuant, MoEWeights


class TritonBackend(Backend):
    """Fused grouped-GEMM MoE in Triton (routing prep, GEMM1+activation, GEMM2, k-sum)."""

    name = "triton"
    capabilities = Capabilities(
        platforms=frozenset({"cuda", "rocm"}),
        weight_quant=frozenset({"float", "mxfp4"}),
        # A8/A4 executed as the emulation does it (x quantize-dequantized once, the
        # intermediate in GEMM1's epilogue); tests check equality with emulation.
        activation_quant=frozenset({"none", "mxfp8", "mxfp4"}),
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        layouts=frozenset({"interleaved", "halves"}),
        bias=True,
        packages=frozenset({"triton"}),
        note="MXFP4 unpacked in registers: a Gluon wgmma kernel on Hopper at small T, else "
        "Triton tl.dot (PTX bf16x2 unpack on CUDA sm90+, portable float32 elsewhere); A8/A4 "
        "through tl.dot_scaled on GPUs with MX matrix instructions (sm100+, gfx950: compiled "
        "in CI, run on the H200 only with Triton's emulated scaled MMA); verified on H200 (sm90)",
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
        from mxfx.kernels.moe import fused_moe

        return fused_moe(x, topk_weights, topk_ids, weights, act, aq, key)


BACKEND = TritonBackend()
