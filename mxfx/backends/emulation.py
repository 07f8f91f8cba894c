"""The reference MoE: dequantize, torch math in float32, activation quantize-dequantize.

Runs on any device. It is the accuracy reference for every other backend and the
production path on CPU. Per expert it gathers the (token, slot) pairs routed there, so it
synchronises with the host (fine for a reference; the GPU backends do not).
"""
from __future__ import annotations

import torch

from mxfx import formats
from mxfx.activation import GatedActivation, split_gate_up
from mxfx.backends.base import Backend, Capabilities, expert_id_error
from mxfx.moe_call import ActivationQuant, MoEWeights


def gated_activation(x: torch.Tensor, act: GatedActivation) -> torch.Tensor:
    """``act`` on ``x [..., 2d]`` → ``[..., d]`` in ``x.dtype``, computed in float32."""
    xf = x.to(torch.float32) if x.dtype != torch.float64 else x
    gate, up = split_gate_up(xf, act.layout)
    if act.limit is not None:
        gate = gate.clamp(max=act.limit)
        up = up.clamp(-act.limit, act.limit)
    return (gate * torch.sigmoid(act.alpha * gate) * (up + act.beta)).to(x.dtype)


def quantize_activation(x: torch.Tensor, aq: ActivationQuant) -> torch.Tensor:
    """``x`` as the GEMM sees it under ``aq``: itself, or MX quantize-dequantize per 32-block."""
    if aq.fmt == "none":
        return x
    return formats.quantize_dequantize(x, aq.fmt, aq.scale_rounding)


def _expert_weight(w: torch.Tensor, scale, e: int, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return w[e].to(dtype)
    return formats.dequantize(w[e], scale[e], "mxfp4", dtype)


def moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weights: MoEWeights,
    act: GatedActivation,
    aq: ActivationQuant,
) -> torch.Tensor:
    """Σ_k topk_weights[t,k] · (act(x[t] @ w13[e]ᵀ + b13[e]) @ w2[e]ᵀ + b2[e]), e = topk_ids[t,k].

    The GEMM inputs are in ``x.dtype`` (the intermediate is rounded to it, as a kernel
    that feeds its tensor cores would), then quantize-dequantized under ``aq``; the
    products and sums are float32 (float64 for float64 input). Slots with id < 0 add nothing.
    """
    T, H = x.shape
    k = topk_ids.shape[1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros(T, H, dtype=acc, device=x.device)
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    flat_w = topk_weights.reshape(-1).to(acc)
    token = torch.arange(T, device=x.device).repeat_interleave(k)
    experts = torch.unique(flat_ids[flat_ids >= 0]).tolist()
    if experts and experts[-1] >= weights.num_experts:
        raise ValueError(expert_id_error(experts[-1], weights.num_experts))
    for e in experts:
        pick = (flat_ids == e).nonzero().squeeze(1)
        t = token[pick]
        xe = quantize_activation(x[t], aq).to(acc)
        h = xe @ _expert_weight(weights.w13, weights.w13_scale, e, acc).T
        if weights.w13_bias is not None:
            h = h + weights.w13_bias[e].to(acc)
        a = quantize_activation(gated_activation(h, act).to(x.dtype), aq).to(acc)
        y = a @ _expert_weight(weights.w2, weights.w2_scale, e, acc).T
        if weights.w2_bias is not None:
            y = y + weights.w2_bias[e].to(acc)
        out.index_add_(0, t, y * flat_w[pick].unsqueeze(1))
    return out.to(x.dtype)


class EmulationBackend(Backend):
    """:func:`moe` as a backend: every platform, weight and activation quantization."""

    name = "emulation"
    capabilities = Capabilities(
        platforms=frozenset({"cuda", "rocm", "xpu", "cpu"}),
        weight_quant=frozenset({"float", "mxfp4"}),
        activation_quant=frozenset({"none", "mxfp8", "mxfp4"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        note="the reference: dequantizes the weights and synchronises with the host",
    )

    def run(self, x, topk_weights, topk_ids, weights, act, aq):
        return moe(x, topk_weights, topk_ids, weights, act, aq)


BACKEND = EmulationBackend()
