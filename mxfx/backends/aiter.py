"""Adapter for AMD aiter's fused MoE on ROCm gfx950 — NOT verified by mxfx; it never runs.

aiter's public entry point is ``aiter.fused_moe.fused_moe(hidden_states, w1, w2, topk_weight,
topk_ids, activation=ActivationType.Silu, quant_type=QuantType.per_1x32, w1_scale=, w2_scale=)``.
With ``per_1x32`` it quantizes the activations to MXFP4 itself (W4A4) and runs SiLU-and-mul
experts without biases. Its kernels read weights pre-shuffled by
``aiter.ops.shuffle.shuffle_weight`` and scales by ``aiter.utility.fp4_utils.e8m0_shuffle``, a
one-time transform at load time that mxfx's canonical MXFP4 storage does not hold; shuffling on
every call would copy all the layer's weights per call. mxfx has no gfx950 to verify the
numerics (including aiter's activation scale rounding) against the emulation reference.

So the adapter declares what aiter executes (it is considered only where ``aiter`` imports,
on gfx950) and then refuses with that reason, so the oracle goes on to the next backend.
"""
from __future__ import annotations

import torch

from mxfx.backends.base import Backend, Capabilities

_UNVERIFIED = (
    "not verified by mxfx: aiter.fused_moe.fused_moe needs weights pre-shuffled by "
    "aiter.ops.shuffle.shuffle_weight and scales by fp4_utils.e8m0_shuffle, which mxfx's "
    "canonical MXFP4 storage does not hold, and mxfx has no gfx950 to check it against emulation"
)


class AiterBackend(Backend):
    """aiter's fused MoE (W4A4 MXFP4, SiLU-and-mul, no biases) — declared, refused, unverified."""

    name = "aiter"
    capabilities = Capabilities(
        platforms=frozenset({"rocm"}),
        archs=frozenset({"gfx950"}),
        packages=frozenset({"aiter"}),
        weight_quant=frozenset({"mxfp4"}),
        activation_quant=frozenset({"mxfp4"}),
        dtypes=frozenset({torch.bfloat16}),
        layouts=frozenset({"halves"}),
        bias=False,
        note="not verified by mxfx",
    )

    def extra_check(self, config, platform):
        return _UNVERIFIED

    def run(self, x, topk_weights, topk_ids, weights, act, aq):
        raise RuntimeError(f"backend 'aiter': {_UNVERIFIED}")


BACKEND = AiterBackend()
