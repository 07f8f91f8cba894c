"""The emulation MoE (through ``torch.ops.mxfx.moe(..., backend="emulation")``) against an
independent float64 reference: plain Python loops over tokens and slots, weights decoded by the
spec decoder of conftest.py, the activation written out from DESIGN.md.

Contract tested (DESIGN.md and issue 2): the intermediate activation is rounded to ``x.dtype``
before GEMM2 (as kernels feed their tensor cores); activation quantization is an MX
quantize-dequantize of each GEMM input, per 32-block along K, applied to ``x.dtype`` values.
"""
from __future__ import annotations

import zlib

import pytest
import torch

import mxfx  # noqa: F401  (registers torch.ops.mxfx)
from mxfx import formats
from mxfx.activation import PRESETS, GatedActivation

H, I = 64, 32


def _act64(h: torch.Tensor, act: GatedActivation) -> torch.Tensor:
    """DESIGN.md's gated activation on one float64 row ``[2I]``."""
    if act.layout == "interleaved":
        gate, up = h[0::2], h[1::2]
    else:
        gate, up = h[: h.numel() // 2], h[h.numel() // 2 :]
    if act.limit is not None:
        gate = gate.clamp(max=act.limit)
        up = up.clamp(-act.limit, act.limit)
    return gate * torch.sigmoid(act.alpha * gate) * (up + act.beta)


def _qdq(v: torch.Tensor, activation_quant: str) -> torch.Tensor:
    """One GEMM input row as the GEMM sees it (formats is tested on its own in test_formats)."""
    if activation_quant == "none":
        return v
    return formats.quantize_dequantize(v, activation_quant, "even")


def reference_moe(x, topk_weights, topk_ids, w13, b13, w2, b2, act, activation_quant):
    """float64 ``[T, H]``; ``w13``/``w2`` are float64 ``[E, 2I, H]`` / ``[E, H, I]``."""
    T = x.shape[0]
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for t in range(T):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0:
                continue
            xin = _qdq(x[t], activation_quant).double()
            h = w13[e] @ xin
            if b13 is not None:
                h = h + b13[e].double()
            a = _act64(h, act).to(x.dtype)  # GEMM2 reads x.dtype
            a = _qdq(a, activation_quant).double()
            y = w2[e] @ a
            if b2 is not None:
                y = y + b2[e].double()
            out[t] += float(topk_weights[t, j]) * y
    return out


def _routing(T: int, E: int, k: int, unrouted: bool, g: torch.Generator):
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k)
    ids = ids.to(torch.int32 if E == 8 else torch.int64)
    if unrouted:
        drop = torch.rand(T, k, generator=g) < 0.3
        drop[:, 0] = False  # every token keeps a slot...
        ids[drop] = -1
        if T > 1:
            ids[-1] = -1  # ...but the last, routed nowhere here
    weights = torch.softmax(torch.randn(T, k, generator=g), dim=-1)
    return weights, ids


def _weights(kind: str, E: int, dtype: torch.dtype, g: torch.Generator, mx_ref_dequantize):
    """Expert weights as the op takes them, and as float64 for the reference."""
    w13 = torch.randn(E, 2 * I, H, generator=g) * (5 / H**0.5)  # |h| often beyond limit 7
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    if kind == "mxfp4":
        q13, s13 = formats.quantize(w13, "mxfp4", "round_up")
        q2, s2 = formats.quantize(w2, "mxfp4", "round_up")
        ref = (mx_ref_dequantize(q13, s13, "mxfp4"), mx_ref_dequantize(q2, s2, "mxfp4"))
        return (q13, s13, q2, s2), ref
    wdtype = torch.bfloat16 if kind == "bf16" else dtype
    w13, w2 = w13.to(wdtype), w2.to(wdtype)
    if kind == "transposed":  # [E, K, N] parameters (HF gate_up_proj / down_proj), passed as views
        w13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
        w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
        assert not w13.is_contiguous() and not w2.is_contiguous()
    return (w13, None, w2, None), (w13.double(), w2.double())


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape and out.is_contiguous()
    assert not out.isnan().any()
    assert ref.numel() == 0 or ref.abs().max() > 0  # not a vacuous comparison
    if dtype == torch.float32:
        scale = ref.abs().max().item() if ref.numel() else 1.0
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * scale)
    else:
        err = (out.double() - ref).norm() / ref.norm().clamp(min=1e-30)
        assert err <= 1e-2, f"relative Frobenius error {err:.2e}"


# preset, bias, weights, dtype, T, E, k, unrouted slots, activation_quant. Every value of each
# axis appears, mostly in pairs with every value of the others (not the full product).
F32, BF16 = torch.float32, torch.bfloat16
CASES = [
    ("silu_and_mul", False, "float", F32, 7, 8, 2, False, "none"),
    ("gpt_oss", True, "mxfp4", BF16, 64, 8, 2, True, "none"),
    ("minimax_m3", True, "transposed", F32, 64, 8, 8, True, "none"),
    ("swiglu_limit", False, "bf16", BF16, 7, 8, 1, True, "none"),
    ("silu_and_mul", True, "mxfp4", F32, 1, 1, 1, False, "none"),
    ("gpt_oss", False, "float", F32, 0, 8, 2, False, "none"),
    ("minimax_m3", False, "mxfp4", F32, 7, 1, 1, True, "none"),
    ("swiglu_limit", True, "transposed", BF16, 64, 1, 1, False, "none"),
    ("gpt_oss", False, "transposed", F32, 1, 8, 1, False, "none"),
    ("silu_and_mul", True, "transposed", BF16, 7, 8, 8, True, "none"),
    ("gpt_oss", True, "mxfp4", F32, 64, 8, 2, True, "mxfp8"),
    ("silu_and_mul", False, "float", BF16, 7, 8, 8, False, "mxfp4"),
    ("minimax_m3", True, "mxfp4", F32, 7, 8, 1, False, "mxfp4"),
    ("swiglu_limit", True, "float", F32, 1, 8, 8, True, "mxfp8"),
    ("silu_and_mul", True, "bf16", F32, 64, 8, 2, True, "mxfp8"),
    ("minimax_m3", False, "mxfp4", BF16, 0, 1, 1, False, "mxfp4"),
    ("gpt_oss", True, "mxfp4", BF16, 7, 8, 8, False, "mxfp4"),
    ("swiglu_limit", False, "transposed", F32, 64, 8, 2, False, "mxfp4"),
    ("gpt_oss", True, "float", BF16, 1, 1, 1, True, "mxfp8"),
]


@pytest.mark.parametrize(
    "preset,bias,kind,dtype,T,E,k,unrouted,aq",
    CASES,
    ids=["-".join(str(v).replace("torch.", "") for v in c) for c in CASES],
)
def test_matches_float64_reference(preset, bias, kind, dtype, T, E, k, unrouted, aq, mx_ref_dequantize):
    g = torch.Generator().manual_seed(zlib.crc32(repr((preset, bias, kind, T, E, k, aq)).encode()))
    act = PRESETS[preset]
    x = torch.randn(T, H, generator=g).to(dtype)
    topk_weights, topk_ids = _routing(T, E, k, unrouted, g)
    (w13, s13, w2, s2), (r13, r2) = _weights(kind, E, dtype, g, mx_ref_dequantize)
    b13 = torch.randn(E, 2 * I, generator=g).to(dtype) if bias else None
    b2 = torch.randn(E, H, generator=g).to(dtype) if bias else None
    out = torch.ops.mxfx.moe(
        x, topk_weights, topk_ids, w13, s13, b13, w2, s2, b2,
        act.layout, act.alpha, act.beta, act.limit, activation_quant=aq, backend="emulation",
    )
    ref = reference_moe(x, topk_weights, topk_ids, r13, b13, r2, b2, act, aq)
    _check(out, ref, dtype)
    if unrouted and T > 1:
        assert (out[-1] == 0).all()  # routed nowhere here: adds nothing, not even biases


def test_non_contiguous_activations_and_routing(mx_ref_dequantize):
    g = torch.Generator().manual_seed(11)
    act = PRESETS["gpt_oss"]
    x = torch.randn(H, 9, generator=g).t()  # column-major x
    topk_weights, topk_ids = _routing(9, 8, 4, True, g)
    topk_weights, topk_ids = topk_weights.t().contiguous().t(), topk_ids.t().contiguous().t()
    (w13, s13, w2, s2), (r13, r2) = _weights("mxfp4", 8, torch.float32, g, mx_ref_dequantize)
    out = torch.ops.mxfx.moe(
        x, topk_weights, topk_ids, w13, s13, None, w2, s2, None,
        act.layout, act.alpha, act.beta, act.limit, backend="emulation",
    )
    _check(out, reference_moe(x, topk_weights, topk_ids, r13, None, r2, None, act, "none"), torch.float32)


def test_unrouted_slots_add_nothing():
    # The same tokens routed with extra -1 slots give the same output; all -1 gives zeros.
    g = torch.Generator().manual_seed(12)
    x = torch.randn(5, H, generator=g)
    w13 = torch.randn(4, 2 * I, H, generator=g)
    w2 = torch.randn(4, H, I, generator=g)
    b13, b2 = torch.randn(4, 2 * I, generator=g), torch.randn(4, H, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 3]])
    tw = torch.rand(5, 2, generator=g)
    base = torch.ops.mxfx.moe(x, tw, ids, w13, None, b13, w2, None, b2, backend="emulation")
    padded_ids = torch.cat((ids, torch.full((5, 2), -1)), dim=1)
    padded_w = torch.cat((tw, torch.rand(5, 2, generator=g) + 1), dim=1)
    padded = torch.ops.mxfx.moe(x, padded_w, padded_ids, w13, None, b13, w2, None, b2, backend="emulation")
    torch.testing.assert_close(padded, base, rtol=0, atol=0)
    none = torch.ops.mxfx.moe(x, tw, torch.full((5, 2), -1), w13, None, b13, w2, None, b2, backend="emulation")
    assert torch.equal(none, torch.zeros_like(x))


def test_activation_quant_changes_the_result():
    # The reference above applies QDQ to the GEMM inputs; this makes sure that is observable:
    # mxfp4 activations differ from unquantized ones by more than the test tolerances.
    g = torch.Generator().manual_seed(13)
    x = torch.randn(7, H, generator=g)
    w13, w2 = torch.randn(8, 2 * I, H, generator=g) / 8, torch.randn(8, H, I, generator=g) / 6
    tw, ids = _routing(7, 8, 2, False, g)
    outs = {
        aq: torch.ops.mxfx.moe(x, tw, ids, w13, None, None, w2, None, None, activation_quant=aq, backend="emulation")
        for aq in ("none", "mxfp8", "mxfp4")
    }
    for aq in ("mxfp8", "mxfp4"):
        rel = ((outs[aq] - outs["none"]).norm() / outs["none"].norm()).item()
        assert rel > 1e-3, aq


def test_expert_id_beyond_E_raises_in_the_backend():
    """The emulation checks the ids itself (on an accelerator the op leaves that to the backend)."""
    from mxfx.backends import emulation
    from mxfx.moe_call import ActivationQuant, MoEWeights

    E, H, I = 3, 32, 32
    w = MoEWeights(torch.zeros(E, 2 * I, H), None, None, torch.zeros(E, H, I), None, None)
    ids = torch.tensor([[0, 3]])
    with pytest.raises(ValueError, match="expert id 3 out of range"):
        emulation.moe(torch.ones(1, H), torch.ones(1, 2), ids, w, GatedActivation(), ActivationQuant())


def test_float64_input_is_computed_in_float64():
    """float64 calls are the reference: accumulated in float64, not float32."""
    g = torch.Generator().manual_seed(3)
    E, H, I, T = 2, 64, 32, 3
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    w13 = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) / H**0.5
    w2 = torch.randn(E, H, I, generator=g, dtype=torch.float64) / I**0.5
    ids = torch.tensor([[0], [1], [0]])
    tw = torch.ones(T, 1, dtype=torch.float64)
    out = torch.ops.mxfx.moe(x, tw, ids, w13, None, None, w2, None, None, backend="emulation")
    want = torch.stack([
        (torch.nn.functional.silu(g_) * u) @ w2[e].T
        for t, e in enumerate(ids[:, 0].tolist())
        for g_, u in [(x[t] @ w13[e].T).chunk(2)]
    ])
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
