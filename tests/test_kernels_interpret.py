"""The MoE kernels (routing, MX helpers, fused and unfused MoE, the Hopper kernels' input orders)
against the references; which kernels a call launches is in ``test_launch_code.py``.

Runs on the device of the ``kernel_device`` fixture: CPU through ``TRITON_INTERPRET=1`` in CI
(float16/float32, tiny shapes), CUDA on the GPU box. Weights and activations are views into
NaN-poisoned buffers, so any read outside a tensor's bounds shows up as NaN in the output.
"""
from __future__ import annotations

import pytest
import torch

from mxfx import formats
from mxfx.activation import GPT_OSS, SILU_AND_MUL, GatedActivation
from mxfx.backends import emulation
from mxfx.moe_call import ActivationQuant, MoEWeights

pytest.importorskip("triton")

from mxfx.kernels import mx, routing  # noqa: E402
from mxfx.kernels.moe import fused_moe, unfused_moe  # noqa: E402


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _poisoned(t: torch.Tensor, device, pad: int = 3) -> torch.Tensor:
    """``t`` on ``device`` as a view into a larger buffer whose extra entries along every
    dimension are NaN (0xFF for uint8): the view has the strides of the big buffer."""
    big = torch.empty(*(s + pad for s in t.shape), dtype=t.dtype, device=device)
    big.fill_(255 if t.dtype == torch.uint8 else float("nan"))
    view = big[tuple(slice(0, s) for s in t.shape)]
    view.copy_(t)
    return view


def _weights(E, H, I, dtype, quantized, bias, seed, device) -> MoEWeights:
    g = _gen(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    b13 = (torch.randn(E, 2 * I, generator=g) * 0.5).to(dtype) if bias else None
    b2 = (torch.randn(E, H, generator=g) * 0.5).to(dtype) if bias else None
    if quantized:
        p13, s13 = formats.quantize(w13, "mxfp4", "round_up")
        p2, s2 = formats.quantize(w2, "mxfp4", "round_up")
        parts = (p13, s13, b13, p2, s2, b2)
    else:
        parts = (w13.to(dtype), None, b13, w2.to(dtype), None, b2)
    return MoEWeights(*(None if p is None else _poisoned(p, device) for p in parts))


def _routing_case(T, E, k, seed, unrouted=True):
    g = _gen(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.empty(0, k)
    ids = ids.to(torch.int32)
    if unrouted and T:
        ids[0, 0] = -1
    tw = torch.rand(T, k, generator=g)
    return ids, tw


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- MX helpers, bit for bit


def test_mxfp4_dequant_every_code_and_scale(kernel_device):
    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16).repeat(1, 2)
    scales = torch.tensor([0, 1, 2, 100, 127, 128, 200, 254, 255, 126, 3, 130, 129, 250, 253, 120],
                          dtype=torch.uint8)[:, None].repeat(1, 2)
    for dtype in (torch.float32, torch.float16):
        out = mx.dequantize_mxfp4(packed.to(kernel_device), scales.to(kernel_device), dtype).cpu()
        ref = formats.dequantize(packed, scales, "mxfp4", dtype)
        assert torch.equal(out.isnan(), ref.isnan())
        assert torch.equal(out.nan_to_num(0.0), ref.nan_to_num(0.0))


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("rounding", ["floor", "round_up", "even"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qdq_bit_exact(kernel_device, fmt, rounding, dtype):
    g = _gen(7)
    # Magnitudes from far below to far above every format's range, plus the special blocks.
    x = torch.randn(24, 96, generator=g) * torch.logspace(-42, 36, 24)[:, None]
    x[1, 5] = float("nan")
    x[2, 40] = float("inf")
    x[3, :32] = 0.0
    x[4, 64:] = -0.0
    x[5, :] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5]).repeat(12)  # E2M1 ties
    x = x.to(dtype)
    out = mx.quantize_dequantize(x.to(kernel_device), fmt, rounding).cpu()
    ref = formats.quantize_dequantize(x, fmt, rounding)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(bits), ref.view(bits))
    # rows padded apart (as a view into a wider buffer), read and written in place, uncopied
    wide = torch.full((24, 100), 3.0, dtype=dtype, device=kernel_device)
    strided = wide[:, :96]
    strided.copy_(x)
    assert torch.equal(mx.quantize_dequantize(strided, fmt, rounding).cpu().view(bits), ref.view(bits))
    assert mx.quantize_dequantize(strided, fmt, rounding, out=strided) is strided
    assert torch.equal(strided.cpu().view(bits), ref.view(bits)) and (wide[:, 96:] == 3.0).all()


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("rounding", ["floor", "round_up", "even"])
def test_quantize_bit_exact(kernel_device, fmt, rounding):
    """The MX elements and scales the native scaled-MMA path feeds ``tl.dot_scaled``."""
    g = _gen(11)
    x = torch.randn(20, 160, generator=g) * torch.logspace(-42, 36, 20)[:, None]
    x[1, 5] = float("nan")
    x[2, 40] = float("-inf")
    x[3, :32] = 0.0
    x[4, 64:96] = -0.0
    x[5, :] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5]).repeat(20)  # E2M1 ties
    x[6, :] = torch.linspace(-448, 448, 160)
    wide = torch.zeros(20, 200)
    wide[:, :160] = x
    q, s = mx.quantize(wide[:, :160].to(kernel_device), fmt, rounding)
    ref_q, ref_s = formats.quantize(x, fmt, rounding)
    assert torch.equal(s.cpu(), ref_s)
    assert torch.equal(q.cpu(), ref_q.view(torch.uint8))


# ---------------------------------------------------------------- routing


@pytest.mark.parametrize(
    "T,E,k,block_m",
    [(1, 4, 2, 16), (9, 4, 4, 16), (7, 1, 1, 16), (9, 3, 2, 4), (40, 5, 3, 8), (2, 130, 3, 16),
     (60, 130, 3, 16), (300, 200, 2, 4),
     (250, 3, 2, 160)],  # the warp-specialized kernel's blocks: not a power of two, experts past one block
)
@pytest.mark.parametrize("chunk", [256, 16])  # one program; many chunks placed in parallel
def test_routing_groups_pairs_by_expert(kernel_device, T, E, k, block_m, chunk):
    ids, _ = _routing_case(T, E, k, seed=T * 31 + E)
    r = routing.align(ids.to(kernel_device), E, block_m, chunk)
    again = routing.align(ids.to(kernel_device), E, block_m, chunk)
    nb = routing.max_blocks(T * k, E, block_m)
    assert r.block_expert.numel() == nb == r.block_rows.numel()
    assert torch.equal(r.block_expert, again.block_expert)
    assert torch.equal(r.block_rows, again.block_rows)
    sorted_pairs, block_expert = r.sorted_pairs.cpu(), r.block_expert.cpu()
    block_rows = r.block_rows.cpu()
    flat = ids.reshape(-1)
    b = 0
    for e in range(E):
        pairs = (flat == e).nonzero().squeeze(1).tolist()
        while pairs:
            n = min(block_m, len(pairs))
            assert block_expert[b] == e and block_rows[b] == n
            assert sorted_pairs[b * block_m: b * block_m + n].tolist() == pairs[:n]
            assert torch.equal(again.sorted_pairs.cpu()[b * block_m: b * block_m + n],
                               sorted_pairs[b * block_m: b * block_m + n])
            pairs = pairs[n:]
            b += 1
    assert (block_expert[b:] == -1).all() and (block_rows[b:] == 0).all()


def test_routing_all_unrouted_and_one_expert(kernel_device):
    ids = torch.full((5, 2), -1, dtype=torch.int32)
    r = routing.align(ids.to(kernel_device), 3, 16)
    assert (r.block_expert.cpu() == -1).all() and (r.block_rows.cpu() == 0).all()
    ids = torch.full((20, 1), 2, dtype=torch.int64)
    r = routing.align(ids.to(kernel_device), 3, 16)
    assert r.block_expert.cpu()[:2].tolist() == [2, 2] and (r.block_expert.cpu()[2:] == -1).all()
    assert r.block_rows.cpu()[:2].tolist() == [16, 4]
    assert r.sorted_pairs.cpu()[:20].tolist() == list(range(20))


# ---------------------------------------------------------------- the MoE


CASES = [
    # T, E, H, I, k, quantized, act, bias, dtype
    (5, 4, 64, 96, 2, True, GPT_OSS, True, torch.float32),
    (9, 3, 96, 32, 3, True, SILU_AND_MUL, False, torch.float16),
    (1, 1, 32, 64, 1, True, GatedActivation("halves", 1.3, 0.5, 2.0), True, torch.float32),
    (7, 4, 40, 24, 4, False, GPT_OSS, True, torch.float32),  # k = E, H and I not multiples of 32
    (6, 2, 72, 36, 2, False, GatedActivation("interleaved", 0.8, -0.5, 1.5), False, torch.float16),
    (0, 4, 64, 32, 2, True, GPT_OSS, True, torch.float32),
]


def _run_case(fn, case, device, aq=ActivationQuant(), seed=0):
    T, E, H, I, k, quantized, act, bias, dtype = case
    W = _weights(E, H, I, dtype, quantized, bias, seed, device)
    ids, tw = _routing_case(T, E, k, seed + 1)
    x = (torch.randn(T, H, generator=_gen(seed + 2))).to(dtype)
    out = fn(_poisoned(x, device), tw.to(dtype).to(device), ids.to(device), W, act, aq)
    cpu_w = MoEWeights(*(None if t is None else t.cpu() for t in W.__dict__.values()))
    ref_x = x.double() if dtype == torch.float32 else x
    ref = emulation.moe(ref_x, tw.to(dtype), ids, cpu_w, act, aq)
    assert out.shape == (T, H) and out.dtype == dtype
    return out.cpu(), ref


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}E{c[1]}H{c[2]}I{c[3]}k{c[4]}")
def test_fused_matches_emulation(kernel_device, case):
    out, ref = _run_case(fused_moe, case, kernel_device)
    assert not out.isnan().any()
    if case[0]:
        tol = 1e-5 if case[-1] == torch.float32 else 3e-3
        assert _rel_err(out, ref) <= tol


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[4]], ids=["mxfp4", "fp16", "float"])
def test_unfused_matches_emulation(kernel_device, case):
    pytest.importorskip("mxfx.kernels.activation")
    from mxfx.kernels.activation import gated_activation

    out, ref = _run_case(lambda *a: unfused_moe(*a[:5], gated_activation), case, kernel_device)
    assert not out.isnan().any()
    tol = 1e-5 if case[-1] == torch.float32 else 3e-3
    assert _rel_err(out, ref) <= tol


@pytest.mark.parametrize("fmt,rounding", [("mxfp8", "even"), ("mxfp4", "even"), ("mxfp4", "floor"),
                                          ("mxfp4", "round_up")])
def test_fused_executes_activation_quant(kernel_device, fmt, rounding):
    """The fused backend's ``run`` quantizes both GEMM inputs (x, and the intermediate in GEMM1's
    epilogue) with the call's format and shared-exponent rounding, as the emulation does."""
    from mxfx.backends.triton import BACKEND as fused

    case = (9, 4, 64, 96, 2, True, GPT_OSS, True, torch.float32)
    aq = ActivationQuant(fmt, rounding)
    out, ref = _run_case(fused.run, case, kernel_device, aq=aq, seed=3)
    _, ref_a16 = _run_case(fused_moe, case, kernel_device, seed=3)
    # Equal to the emulation of this quantization up to accumulation order, and far from
    # what unquantized activations would give.
    assert _rel_err(out, ref) <= 1e-5
    assert _rel_err(ref_a16, ref) > 1e-3


def test_fused_rejects_act_quant_on_unaligned_sizes(kernel_device):
    W = _weights(2, 40, 24, torch.float32, False, False, 0, kernel_device)
    x = torch.randn(3, 40, device=kernel_device)
    ids = torch.zeros(3, 1, dtype=torch.int32, device=kernel_device)
    # The op refuses it up front (check_moe), naming the argument; the kernel entry point
    # itself still fails loudly rather than quantizing a partial block.
    with pytest.raises(ValueError, match="activation_quant"):
        torch.ops.mxfx.moe(x, torch.ones(3, 1, device=kernel_device), ids, W.w13, None, None,
                           W.w2, None, None, "interleaved", 1.702, 1.0, 7.0, "mxfp8", "triton")
    with pytest.raises(ValueError, match="multiple of 32"):
        fused_moe(x, torch.ones(3, 1, device=kernel_device), ids, W, GPT_OSS, ActivationQuant("mxfp8"))


def test_backends_declare_and_run(kernel_device):
    from mxfx.backends.triton import BACKEND as fused
    from mxfx.backends.triton_unfused import BACKEND as unfused

    assert fused.name == "triton" and unfused.name == "triton_unfused"
    assert {"mxfp8", "mxfp4"} <= fused.capabilities.activation_quant
    assert torch.float32 in fused.capabilities.dtypes
    assert unfused.capabilities.activation_quant == frozenset({"none"})
    for b in (fused, unfused):
        assert b.capabilities.platforms == frozenset({"cuda", "rocm"})
        assert b.capabilities.weight_quant == frozenset({"float", "mxfp4"})
    case = CASES[0]
    for b in (fused, unfused):
        out, ref = _run_case(b.run, case, kernel_device)
        assert _rel_err(out, ref) <= 1e-5
    W = _weights(2, 32, 32, torch.float32, True, False, 0, kernel_device)
    x = torch.randn(2, 32, device=kernel_device)
    ids = torch.zeros(2, 1, dtype=torch.int32, device=kernel_device)
    for fmt in ("mxfp8", "mxfp4"):  # runs neither at higher precision
        with pytest.raises(ValueError, match=f"activation_quant: got '{fmt}'"):
            unfused.run(x, torch.ones(2, 1, device=kernel_device), ids, W, GPT_OSS, ActivationQuant(fmt))


@pytest.mark.parametrize("block_m,swap,split", [(16, False, False), (16, True, True), (64, True, False),
                                               (64, False, True)])
def test_fused_other_tiles(kernel_device, monkeypatch, block_m, swap, split):
    from mxfx.kernels import moe

    cfg = moe.GemmConfig(block_m, 32, 32, 64, 4, swap, split)
    monkeypatch.setattr(moe, "pick_config", lambda *a: cfg)
    for case in (CASES[0], CASES[4]):
        out, ref = _run_case(fused_moe, case, kernel_device, seed=11)
        assert _rel_err(out, ref) <= (1e-5 if case[-1] == torch.float32 else 3e-3)


@pytest.mark.parametrize("split_k2", [2, 3])
def test_fused_split_k(kernel_device, monkeypatch, split_k2):
    """GEMM2's K range over 2 or 3 programs (with BLOCK_K 32 the float case's K=24 leaves
    later splits empty, I=96 gives each split its own steps)."""
    from mxfx.kernels import moe
    from mxfx.kernels.activation import gated_activation

    cfg = moe.GemmConfig(16, 32, 32, 32, 4, True, True, split_k2=split_k2)
    monkeypatch.setattr(moe, "pick_config", lambda *a: cfg)
    for case in (CASES[0], CASES[3], CASES[4]):
        for fn in (fused_moe, lambda *a: unfused_moe(*a[:5], gated_activation)):
            out, ref = _run_case(fn, case, kernel_device, seed=12)
            assert _rel_err(out, ref) <= (1e-5 if case[-1] == torch.float32 else 3e-3)


def test_act_quant_on_unaligned_layer_is_refused_before_any_backend():
    from mxfx.backends.triton import BACKEND as fused
    from mxfx.oracle import MoEConfig, Platform, supports

    cuda = Platform(kind="cuda", arch="sm90", packages=frozenset({"triton"}))
    ok = MoEConfig(num_experts=4, hidden_size=2880, intermediate_size=2880, top_k=2,
                   activation_quant="mxfp8")
    assert supports(fused, ok, cuda) == (True, "")
    with pytest.raises(ValueError, match="multiples of 32"):
        MoEConfig(num_experts=4, hidden_size=2880, intermediate_size=360, top_k=2,
                  activation_quant="mxfp4")
    a16 = MoEConfig(num_experts=4, hidden_size=2880, intermediate_size=360, top_k=2,
                    weight_quant="float")
    assert supports(fused, a16, cuda) == (True, "")


def test_fused_activation_quant_rounds_to_x_dtype_before_quantizing(kernel_device):
    """The fused epilogue rounds the activation to x.dtype (float16) before the MX
    quantization: an activation of 0.25 + 2^-14 rounds to the float16 0.25, an E2M1 tie
    (scale 1 next to a 6 in its block) that goes to 0, where unrounded it would go to 0.5."""
    E, H, I = 1, 32, 32
    dt = torch.float16
    # x = 0 and zero w13: GEMM1's output is its bias. Halves layout: gate = b[:I], up = b[I:].
    b13 = torch.zeros(E, 2 * I)
    b13[0, 0], b13[0, 1] = 6.0, 0.25  # gate: the block's max (scale 2^0) and the tie
    b13[0, I:] = 1.0  # up
    # alpha = 1000: sigmoid(alpha * gate) is exactly 1 for gate >= 0.25 and 1/2 at 0, so the
    # activation is gate * (1 + 2^-12): 6 + 6*2^-12 (float16: 6) and 0.25 + 2^-14 (float16: 0.25).
    act = GatedActivation("halves", 1000.0, 2.0**-12, None)
    w2 = torch.randn(E, H, I, generator=torch.Generator().manual_seed(0)).to(dt)
    parts = (torch.zeros(E, 2 * I, H, dtype=dt), None, b13.to(dt), w2, None, None)
    W = MoEWeights(*(None if p is None else _poisoned(p, kernel_device) for p in parts))
    x = torch.zeros(1, H, dtype=dt)
    ids = torch.zeros(1, 1, dtype=torch.int32)
    tw = torch.ones(1, 1, dtype=dt)
    aq = ActivationQuant("mxfp4", "even")
    out = fused_moe(_poisoned(x, kernel_device), tw.to(kernel_device), ids.to(kernel_device), W, act, aq).cpu()
    cpu_w = MoEWeights(*(None if t is None else t.cpu() for t in W.__dict__.values()))
    ref = emulation.moe(x, tw, ids, cpu_w, act, aq)
    # The intermediate is [6, 0, 0, ...]: out = 6 * w2[:, 0] (the tie's 0.5 would add w2[:, 1] / 2).
    torch.testing.assert_close(ref, (6.0 * w2[0, :, 0].float()).to(dt)[None], rtol=0, atol=0)
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)


def test_k_sum_rounds_to_x_dtype_once(kernel_device):
    """The k-sum adds each token's slots in float32 and rounds to x.dtype once, as the
    emulation does: with x = 0 each slot's output is exactly ``b2[e] * routing weight`` (float16
    products, exact in float32), so the float16 result must equal the emulation's bit for bit;
    rounding after each slot differs in about one column in five."""
    E, H, I, dt = 2, 32, 32, torch.float16
    g = torch.Generator().manual_seed(0)
    b2 = torch.randn(E, H, generator=g).to(dt)
    parts = (torch.zeros(E, 2 * I, H, dtype=dt), None, None, torch.zeros(E, H, I, dtype=dt), None, b2)
    W = MoEWeights(*(None if p is None else _poisoned(p, kernel_device) for p in parts))
    x = torch.zeros(2, H, dtype=dt)
    ids = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    tw = torch.tensor([[0.7, 0.3], [0.45, 0.55]]).to(dt)
    out = fused_moe(_poisoned(x, kernel_device), tw.to(kernel_device), ids.to(kernel_device), W, GPT_OSS,
                    ActivationQuant()).cpu()
    ref = emulation.moe(x, tw, ids, MoEWeights(*(None if p is None else p for p in parts)), GPT_OSS,
                        ActivationQuant())
    assert torch.equal(out, ref)


# ---------------------------------------------------------------- Hopper input orders


@pytest.mark.parametrize("fmt, rounding, dtype", [("none", "even", torch.float32), ("mxfp8", "even", torch.float16),
                                                   ("mxfp4", "round_up", torch.float16)])
@pytest.mark.parametrize("M, K", [(0, 64), (1, 32), (37, 224), (5, 544)])
def test_paired_puts_each_value_where_the_unpack_pairs_its_weight(kernel_device, M, K, fmt, rounding, dtype):
    """moe_sm90.paired: within every 8 columns, value 4h + r lands at 2r + h (the K pairs of
    sm90_tile.UNPACK_SPLIT's words), rows keep their strides, and under activation quantization
    each 32-block is quantize-dequantized first, bit-exact against mxfx.formats (a block holding
    an Inf included). K not a multiple of 8 (32 under quantization) is refused, naming it."""
    from mxfx.kernels import moe_sm90

    x = (torch.randn(M, K + 3) * 4).to(kernel_device)[:, :K].to(dtype)
    if M > 1:
        x[1, 30] = float("inf")
    out = moe_sm90.paired(x, ActivationQuant(fmt, rounding)).cpu()
    x = x.cpu()
    if fmt != "none":
        x = formats.quantize_dequantize(x, fmt, rounding)
    k = torch.arange(K)
    ref = torch.empty_like(x)
    ref[:, k - k % 8 + 2 * (k % 4) + (k % 8) // 4] = x
    assert out.shape == (M, K) and torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.nan_to_num(), ref.nan_to_num())
    with pytest.raises(ValueError, match="K a multiple of 32; got .*K = 40"):
        moe_sm90.paired(torch.zeros(2, 40, dtype=dtype, device=kernel_device), ActivationQuant("mxfp8"))
    with pytest.raises(ValueError, match="K a multiple of 8; got .*K = 36"):
        moe_sm90.paired(torch.zeros(2, 36, dtype=dtype, device=kernel_device))


@pytest.mark.parametrize("fmt, rounding, dtype", [("none", "even", torch.float32), ("mxfp8", "even", torch.float32),
                                                   ("mxfp4", "round_up", torch.float16), ("mxfp4", "floor", torch.float32)])
@pytest.mark.parametrize("M, K", [(0, 64), (1, 32), (37, 224), (5, 256)])
@pytest.mark.parametrize("block_m", [32, 160])
def test_dot_order_puts_each_column_where_the_unpack_puts_its_weight(kernel_device, M, K, fmt, rounding, dtype,
                                                                   block_m):
    """moe_sm90_ws.dot_order: natural K offset 128i + 32c + 8j + 4b1 + 2b0 + e (lane c's byte
    4j + 2b1 + b0, nibble e) lands at 128i + 32j + 16b1 + 8b0 + 2c + e, the order in which the
    Hopper kernels' prmt unpack lays the weights into A fragments (160-row blocks); for blocks
    of up to 64 rows, whose unpack by one multiply puts value v = 4b1 + 2b0 + e of a word where
    the other puts value 2(v % 4) + v // 4, at that value's place. The padding up to a multiple
    of 128 columns is zero, and rows keep their strides. Under activation quantization each
    natural 32-block is quantize-dequantized first, bit-exact against mxfx.formats (a block
    holding an Inf included)."""
    from mxfx.kernels import moe_sm90_ws

    x = (torch.randn(M, K + 3) * 4).to(kernel_device)[:, :K].to(dtype)
    if M > 1:
        x[1, 40] = float("inf")
    out = moe_sm90_ws.dot_order(x, block_m, ActivationQuant(fmt, rounding)).cpu()
    x = x.cpu()
    if fmt != "none":
        x = formats.quantize_dequantize(x, fmt, rounding)
        assert x.isnan().any() == (M > 1)
    KP = -(-K // 128) * 128
    k = torch.arange(K)
    r = k % 128
    if block_m <= 64:
        r = r - r % 8 + 2 * (r % 4) + (r % 8) // 4
    pos = k - k % 128 + 32 * ((r // 8) % 4) + 16 * ((r // 4) % 2) + 8 * ((r // 2) % 2) + 2 * (r // 32) + r % 2
    ref = torch.zeros(M, KP, dtype=dtype)
    ref[:, pos] = x
    assert out.shape == (M, KP) and torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.nan_to_num(), ref.nan_to_num())
