"""The MoE kernels (routing, MX helpers, fused and unfused MoE) against the references.

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
import triton.language as tl  # noqa: E402

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


# ---------------------------------------------------------------- fast launches


def _kernel_with_constexpr_first(x_ptr, N: tl.constexpr, y):
    pass


def test_launcher_key_separates_what_triton_specializes_on():
    from triton.runtime import JITFunction

    from mxfx.kernels.launch import Launcher, key_and_call

    with pytest.raises(ValueError, match="constexpr parameters must come last"):
        Launcher(JITFunction(_kernel_with_constexpr_first))

    def key(*args, **meta):
        return key_and_call(0, args, meta)[0]

    assert len({key(1), key(16), key(17), key(2**31), key(2**40 + 1)}) == 5
    assert key(True) != key(False) and key(True) != key(1)
    buf = torch.zeros(64, dtype=torch.float16)
    assert key(buf) != key(buf[1:]) and key(buf) != key(buf.float()) and key(buf) == key(buf[8:])
    assert key(0.5) == key(2.0) != key(None)
    assert key(buf, 1, BLOCK=16) != key(buf, 1, BLOCK=32) and key(1) != key_and_call(1, (1,), {})[0]
    _, call = key_and_call(0, (buf, 3, 0.5, True), {"BLOCK": 16})
    assert call == [buf.data_ptr(), 3, 0.5, True]


def test_launcher_passes_the_arguments_as_triton_does():
    """The direct launch hands the compiled kernel the list Triton's binder makes."""
    import inspect

    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime import JITFunction
    from triton.runtime.jit import create_function_from_signature

    from mxfx.kernels import moe_portable, moe_sm90
    from mxfx.kernels.launch import Launcher

    for kernel in (moe_portable._moe_gemm, moe_portable._sum_slots, routing._place_kernel, routing._count_kernel,
                   moe_sm90._moe_gemm_sm90, moe_sm90._moe_per_pair_sm90):
        jit = JITFunction(kernel.fn)
        launcher = Launcher(jit)
        binder = create_function_from_signature(jit.signature, jit.params, CUDABackend)
        params = list(inspect.signature(kernel.fn).parameters)
        constexprs = [p for p in params if p in launcher._constexprs]
        args = tuple(range(100, 100 + len(params) - len(constexprs)))
        meta = {name: 1000 + i for i, name in enumerate(reversed(constexprs))}
        meta.update(num_warps=4, num_stages=1)
        bound, _, _ = binder(*args, **meta)
        assert list(bound.values()) == [*args, *launcher.constexpr_values(meta)]


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_launch_code_feeds_mx_activations_to_the_scaled_mma_where_native(monkeypatch, fmt):
    """On GPUs with MX matrix instructions, A8/A4 with MXFP4 weights quantize each GEMM's
    input into MX elements and scales for tl.dot_scaled; elsewhere, and for float weights,
    they are quantize-dequantized in bf16 (launches recorded)."""
    from mxfx.kernels import launch

    launched = []
    monkeypatch.setattr(launch.Launcher, "_launch",
                        lambda self, grid, a, meta: launched.append((self._kernel.__name__, meta, a)))
    E, H, I, k, T = 4, 64, 96, 2, 5
    ids, tw = _routing_case(T, E, k, 1)

    def run(native, quantized=True):
        monkeypatch.setattr(mx, "native_scaled_mma", lambda device: native)
        W = _weights(E, H, I, torch.bfloat16, quantized, True, 0, "cpu")
        launched.clear()
        fused_moe(torch.zeros(T, H, dtype=torch.bfloat16), tw.bfloat16(), ids, W, GPT_OSS, ActivationQuant(fmt))
        return [(name, meta.get("A_FMT"), meta.get("AQ")) for name, meta, _ in launched if name != "_place_kernel"]

    code = mx.FMT_CODES[fmt]
    assert run(True) == [("_quantize_kernel", None, None), ("_moe_gemm", code, 0), ("_quantize_kernel", None, None),
                         ("_moe_gemm", code, 0), ("_sum_slots", None, None)]
    gemm1 = next(a for name, _, a in launched if name == "_moe_gemm")
    assert gemm1[0].dtype == torch.uint8 and gemm1[0].shape[1] == (H // 2 if fmt == "mxfp4" else H)
    assert run(False) == [("_qdq_kernel", None, None), ("_moe_gemm", 0, code), ("_moe_gemm", 0, 0),
                          ("_sum_slots", None, None)]
    assert run(True, quantized=False) == run(False, quantized=False)


def test_launch_code_picks_the_hopper_kernel_only_where_it_fits(monkeypatch):
    """The launch code sends bf16 MXFP4 GEMMs with word-readable weights on sm_90 to the Hopper
    kernel at small T and, with 16-byte aligned weight rows, to the warp-specialized one at
    large T (x dot-ordered first, quantize-dequantized on the way under activation
    quantization); everything else to the portable kernel (launches recorded)."""
    import dataclasses

    from mxfx.kernels import launch, moe, moe_sm90, moe_sm90_ws
    from mxfx.kernels.activation import gated_activation

    launched = []
    monkeypatch.setattr(launch.Launcher, "_launch", lambda self, grid, a, meta: launched.append((self._kernel.__name__, meta)))
    monkeypatch.setattr(moe_sm90, "runs_on", lambda device: True)
    monkeypatch.setattr(moe, "PER_PAIR_REPEAT_BYTES", 0)  # T=3 on grouped 8-row blocks, not per pair
    E, H, I, k = 4, 160, 224, 2  # K loops of two steps (one-step ones are not warp-specialized)

    def kernels(T, dtype=torch.bfloat16, quantized=True, w13=None, aq=ActivationQuant()):
        W = _weights(E, H, I, dtype, quantized, True, 0, "cpu")
        W = dataclasses.replace(W, **{f.name: getattr(W, f.name).contiguous() for f in dataclasses.fields(W)
                                       if getattr(W, f.name) is not None})
        if w13 is not None:
            W = dataclasses.replace(W, w13=w13(W.w13))
        ids, tw = _routing_case(T, E, k, 1)
        launched.clear()
        fused_moe(torch.zeros(T, H, dtype=dtype), tw.to(dtype), ids, W, GPT_OSS, aq)
        return [name for name, _ in launched if "gemm" in name]

    def gemm_meta(*keys):
        return [tuple(meta.get(key) for key in keys) for name, meta in launched if "gemm" in name]

    assert kernels(3) == ["_moe_gemm_sm90"] * 2
    assert gemm_meta("SYNC_MMA", "BLOCK_M") == [(True, 8)] * 2  # mma.sync
    # Above 6 rows per expert: the warp-specialized kernel, or where the weight rows are not 16
    # bytes apart (but 4: words), wgmma on 32-row blocks.
    assert kernels(14) == ["_moe_gemm_sm90_ws"] * 2
    # Up to 24 rows per expert 32-row blocks, 10 ring slots for GEMM1, 9 for GEMM2; the unpack by
    # one multiply there and in 64-row blocks (SPLIT), not in 160-row ones.
    assert gemm_meta("BLOCK_M", "STAGES", "SPLIT") == [(32, 10, True), (32, 9, True)]
    shifted = lambda w: torch.zeros(w.shape[0], w.shape[1], w.shape[2] + 4, dtype=w.dtype)[..., :-4].copy_(w)  # noqa: E731
    assert kernels(14, w13=shifted) == ["_moe_gemm_sm90"] * 2
    assert gemm_meta("SYNC_MMA", "BLOCK_M") == [(False, 32)] * 2
    assert kernels(200) == ["_moe_gemm_sm90_ws"] * 2  # large T: warp-specialized, on dot-ordered x
    names = [name for name, _ in launched]
    assert names.index("_dot_order_kernel") < names.index("_moe_gemm_sm90_ws")
    assert gemm_meta("BLOCK_M", "DOT_ORDER_OUT", "SPLIT") == [(160, True, False), (160, False, False)]
    # Three consumers (192-row tiles) and the producer; ring slots as shared memory allows:
    # GEMM1's narrower epilogue leaves room for 4, GEMM2 3.
    assert gemm_meta("NC", "maxnreg", "CONSUMER_REGS", "PRODUCER_REGS", "STAGES") == [(3, 128, 160, 40, 4),
                                                                                      (3, 128, 160, 40, 3)]
    # 40 rows per expert: 64-row blocks, the same warpgroups, 6 ring slots.
    assert kernels(80) == ["_moe_gemm_sm90_ws"] * 2
    assert gemm_meta("BLOCK_M", "NC", "maxnreg", "CONSUMER_REGS", "PRODUCER_REGS", "STAGES", "SPLIT") == [
        (64, 3, 128, 160, 40, 6, True)] * 2
    # Activation quantization: x and the intermediate quantize-dequantized into dot order,
    # around GEMM1, which then stores the intermediate in natural order.
    assert kernels(200, aq=ActivationQuant("mxfp4", "round_up")) == ["_moe_gemm_sm90_ws"] * 2
    assert gemm_meta("DOT_ORDER_OUT") == [(False,), (False,)]
    assert [(name, meta.get("FMT"), meta.get("ROUNDING")) for name, meta in launched if name != "_count_kernel"
            and name != "_place_kernel"] == [("_dot_order_kernel", mx.FMT_MXFP4, 1), ("_moe_gemm_sm90_ws", None, None),
                                             ("_dot_order_kernel", mx.FMT_MXFP4, 1), ("_moe_gemm_sm90_ws", None, None),
                                             ("_sum_slots", None, None)]
    # The unfused backend too: GEMM1 stores [T*k, 2I] in natural order for the activation
    # kernel, whose output is dot-ordered for GEMM2.
    W = _weights(E, H, I, torch.bfloat16, True, True, 0, "cpu")
    W = dataclasses.replace(W, **{f.name: getattr(W, f.name).contiguous() for f in dataclasses.fields(W)})
    ids, tw = _routing_case(200, E, k, 1)
    launched.clear()
    unfused_moe(torch.zeros(200, H, dtype=torch.bfloat16), tw.to(torch.bfloat16), ids, W, GPT_OSS, gated_activation)
    assert [name for name, _ in launched if name not in ("_count_kernel", "_place_kernel")] == [
        "_dot_order_kernel", "_moe_gemm_sm90_ws", "_gated_activation_kernel", "_dot_order_kernel",
        "_moe_gemm_sm90_ws", "_sum_slots"]
    assert gemm_meta("GATED", "DOT_ORDER_OUT") == [(False, False), (False, False)]
    # Rows 4 but not 16 bytes apart: words, but no 16-byte copies.
    assert kernels(200, w13=shifted) == ["_moe_gemm"] * 2
    assert kernels(40, w13=shifted) == ["_moe_gemm_sm90"] * 2
    # Dot-ordered inputs of 2^31 elements or more (the producer's offsets are int32): not
    # warp-specialized.
    assert moe_sm90_ws.fits(W, 2**23 - 1, 200, 136) and not moe_sm90_ws.fits(W, 2**23, 200, 136)
    # K loops of one step (K <= 128), GEMM1's or GEMM2's: not warp-specialized (wgmma_guard).
    assert not moe_sm90_ws.fits(W, 100, 128, 136) and not moe_sm90_ws.fits(W, 100, 200, 128)
    assert kernels(3, torch.float16) == ["_moe_gemm"] * 2  # the unpack makes bf16
    assert kernels(3, quantized=False) == ["_moe_gemm"] * 2
    # Rows of the packed weights not a multiple of 4 bytes apart: not readable as words, and
    # both GEMMs of the call then take the portable kernel (with its 16-row blocks).
    padded = lambda w: torch.zeros(w.shape[0], w.shape[1], w.shape[2] + 1, dtype=w.dtype)[..., :-1].copy_(w)  # noqa: E731
    assert kernels(3, w13=padded) == ["_moe_gemm"] * 2
    assert gemm_meta("BLOCK_M") == [(16,)] * 2
    monkeypatch.setattr(moe_sm90, "runs_on", lambda device: False)
    assert kernels(3) == ["_moe_gemm"] * 2


@pytest.mark.parametrize("rounding", ["floor", "round_up"])
def test_hopper_launches_quantize_with_the_calls_scale_rounding(monkeypatch, rounding):
    """Under W4A8, every Hopper launch that quantizes (x in the per-pair GEMM1, in the quantize
    pass or in its paired / dot-ordered copy, the intermediate in GEMM1's epilogue) is given the
    call's scale rounding, not a default (launches recorded; per pair, grouped 8-row blocks,
    wgmma blocks, warp-specialized)."""
    import dataclasses

    from mxfx.kernels import launch, moe, moe_sm90

    launched = []
    monkeypatch.setattr(launch.Launcher, "_launch",
                        lambda self, grid, a, meta: launched.append((self._kernel.__name__, meta)))
    monkeypatch.setattr(moe_sm90, "runs_on", lambda device: True)
    E, H, I, k = 4, 160, 224, 2
    code, aq = mx.ROUNDING_CODES[rounding], ActivationQuant("mxfp8", rounding)
    W = _weights(E, H, I, torch.bfloat16, True, True, 0, "cpu")
    W = dataclasses.replace(W, **{f.name: getattr(W, f.name).contiguous() for f in dataclasses.fields(W)})
    shifted = torch.zeros(E, 2 * I, H // 2 + 4, dtype=torch.uint8)[..., :-4].copy_(W.w13)  # words, not ws

    def quantizing(T, w=W, per_pair=True):
        if not per_pair:
            monkeypatch.setattr(moe, "PER_PAIR_REPEAT_BYTES", 0)
        ids, tw = _routing_case(T, E, k, 1)
        launched.clear()
        fused_moe(torch.zeros(T, H, dtype=torch.bfloat16), tw.bfloat16(), ids, w, GPT_OSS, aq)
        return [(name, meta.get("AQ_ROUNDING", meta.get("ROUNDING"))) for name, meta in launched
                if meta.get("AQ") or meta.get("X_QDQ") or meta.get("FMT")]

    assert quantizing(1) == [("_moe_per_pair_sm90", code)]
    assert quantizing(3, per_pair=False) == [("_dot_order_kernel", code), ("_moe_gemm_sm90", code)]
    assert quantizing(14, dataclasses.replace(W, w13=shifted)) == [("_qdq_kernel", code), ("_moe_gemm_sm90", code)]
    assert quantizing(200) == [("_dot_order_kernel", code), ("_dot_order_kernel", code)]


def test_grouped_mma_sync_blocks_read_their_activations_paired(monkeypatch):
    """On grouped 8-row mma.sync blocks (Hopper) x is copied in the paired order after the
    routing kernels, by PDL, and quantize-dequantized on the way under activation quantization
    (no pass of its own); GEMM1 reads it so and stores the intermediate so for GEMM2. Per-pair
    blocks, the unfused backend and the warp-specialized kernel keep their own orders
    (launches recorded)."""
    import dataclasses

    from mxfx.kernels import launch, moe, moe_sm90, moe_sm90_loops
    from mxfx.kernels.activation import gated_activation

    launched = []
    monkeypatch.setattr(launch.Launcher, "_launch", lambda self, grid, a, meta: launched.append((self._kernel.__name__, meta)))
    monkeypatch.setattr(moe_sm90, "runs_on", lambda device: True)
    E, H, I, k = 4, 160, 224, 2
    W = _weights(E, H, I, torch.bfloat16, True, True, 0, "cpu")
    W = dataclasses.replace(W, **{f.name: getattr(W, f.name).contiguous() for f in dataclasses.fields(W)})

    def run(T, aq=ActivationQuant(), fn=fused_moe):
        ids, tw = _routing_case(T, E, k, 1)
        launched.clear()
        x = torch.zeros(T, H, dtype=torch.bfloat16)
        if fn is fused_moe:
            fused_moe(x, tw.to(torch.bfloat16), ids, W, GPT_OSS, aq)
        else:
            unfused_moe(x, tw.to(torch.bfloat16), ids, W, GPT_OSS, gated_activation)
        return [(name, meta.get("X_ORDER"), meta.get("PAIRED_OUT"), meta.get("FMT"), meta.get("PDL"))
                for name, meta in launched if name not in ("_count_kernel", "_place_kernel")]

    paired, natural = moe_sm90_loops.ORDER_PAIRED.value, moe_sm90_loops.ORDER_NATURAL.value
    chain1 = moe_sm90.PDL_WAIT_FIRST.value | moe_sm90.PDL_TRIGGER.value
    chain2 = moe_sm90.PDL_WAIT_LOADS.value | moe_sm90.PDL_TRIGGER.value
    monkeypatch.setattr(moe, "PER_PAIR_REPEAT_BYTES", 0)  # T=3 on grouped 8-row blocks, not per pair

    def copies():  # x's copies: (split, dot) orders
        return [(m["SPLIT"], m["DOT"]) for name, m in launched if name == "_dot_order_kernel"]

    assert run(3) == [("_dot_order_kernel", None, None, 0, True), ("_moe_gemm_sm90", paired, True, None, chain1),
                      ("_moe_gemm_sm90", paired, False, None, chain2), ("_sum_slots", None, None, None, True)]
    assert copies() == [(True, False)]  # the paired order
    assert [meta.get("launch_pdl") for name, meta in launched if name == "_dot_order_kernel"] == [True]
    assert run(3, ActivationQuant("mxfp4", "round_up"))[:2] == [
        ("_dot_order_kernel", None, None, mx.FMT_MXFP4, True), ("_moe_gemm_sm90", paired, True, None, chain1)]
    assert [m["ROUNDING"] for name, m in launched if name == "_dot_order_kernel"] == [mx.ROUNDING_CODES["round_up"]]
    assert [name for name, _, _, _, _ in run(3, fn=unfused_moe) if "gemm" in name or "order" in name] == [
        "_moe_gemm_sm90", "_moe_gemm_sm90"]
    assert {(o, p) for name, o, p, _, _ in run(3, fn=unfused_moe) if "gemm" in name} == {(natural, False)}
    assert "_dot_order_kernel" in [name for name, *_ in run(200)] and copies() == [(False, True)]  # ws: dot order
    monkeypatch.setattr(moe, "PER_PAIR_REPEAT_BYTES", float("inf"))  # per pair: the row paired in shared memory
    assert "_dot_order_kernel" not in [name for name, *_ in run(3)]


@pytest.mark.parametrize("fmt, rounding, dtype", [("none", "even", torch.float32), ("mxfp8", "even", torch.float16),
                                                   ("mxfp4", "round_up", torch.float16)])
@pytest.mark.parametrize("M, K", [(0, 64), (1, 32), (37, 224), (5, 544)])
def test_paired_puts_each_value_where_the_unpack_pairs_its_weight(M, K, fmt, rounding, dtype):
    """moe_sm90.paired: within every 8 columns, value 4h + r lands at 2r + h (the K pairs of
    sm90_tile.UNPACK_SPLIT's words), rows keep their strides, and under activation quantization
    each 32-block is quantize-dequantized first, bit-exact against mxfx.formats (a block holding
    an Inf included). K not a multiple of 8 (32 under quantization) is refused, naming it."""
    from mxfx.kernels import moe_sm90

    x = (torch.randn(M, K + 3) * 4)[:, :K].to(dtype)
    if M > 1:
        x[1, 30] = float("inf")
    out = moe_sm90.paired(x, ActivationQuant(fmt, rounding))
    if fmt != "none":
        x = formats.quantize_dequantize(x, fmt, rounding)
    k = torch.arange(K)
    ref = torch.empty_like(x)
    ref[:, k - k % 8 + 2 * (k % 4) + (k % 8) // 4] = x
    assert out.shape == (M, K) and torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.nan_to_num(), ref.nan_to_num())
    with pytest.raises(ValueError, match="K a multiple of 32; got .*K = 40"):
        moe_sm90.paired(torch.zeros(2, 40, dtype=dtype), ActivationQuant("mxfp8"))
    with pytest.raises(ValueError, match="K a multiple of 8; got .*K = 36"):
        moe_sm90.paired(torch.zeros(2, 36, dtype=dtype))


@pytest.mark.parametrize("fmt, rounding, dtype", [("none", "even", torch.float32), ("mxfp8", "even", torch.float32),
                                                   ("mxfp4", "round_up", torch.float16), ("mxfp4", "floor", torch.float32)])
@pytest.mark.parametrize("M, K", [(0, 64), (1, 32), (37, 224), (5, 256)])
@pytest.mark.parametrize("block_m", [32, 160])
def test_dot_order_puts_each_column_where_the_unpack_puts_its_weight(M, K, fmt, rounding, dtype, block_m):
    """moe_sm90_ws.dot_order: natural K offset 128i + 32c + 8j + 4b1 + 2b0 + e (lane c's byte
    4j + 2b1 + b0, nibble e) lands at 128i + 32j + 16b1 + 8b0 + 2c + e, the order in which the
    Hopper kernels' prmt unpack lays the weights into A fragments (160-row blocks); for blocks
    of up to 64 rows, whose unpack by one multiply puts value v = 4b1 + 2b0 + e of a word where
    the other puts value 2(v % 4) + v // 4, at that value's place. The padding up to a multiple
    of 128 columns is zero, and rows keep their strides. Under activation quantization each
    natural 32-block is quantize-dequantized first, bit-exact against mxfx.formats (a block
    holding an Inf included)."""
    from mxfx.kernels import moe_sm90_ws

    x = (torch.randn(M, K + 3) * 4)[:, :K].to(dtype)
    if M > 1:
        x[1, 40] = float("inf")
    out = moe_sm90_ws.dot_order(x, block_m, ActivationQuant(fmt, rounding))
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


@pytest.mark.parametrize("block_m,n_out,gated,blocks,want", [
    (32, 768, True, 128, 4), (32, 2048, False, 128, 4),  # Qwen3-30B-A3B: 256-row tiles fit
    (32, 14336, True, 8, 4), (32, 4096, False, 8, 4),  # Mixtral-8x7B
    (32, 2880, True, 128, 3), (32, 2880, False, 128, 3),  # gpt-oss: 192-row tiles fit, 256-row ones do not
    (32, 352, True, 4, 3), (32, 512, False, 4, 4),  # a tensor-parallel shard
    # 64-row blocks, 132 SMs: rounds of tiles of 192 / 256 rows.
    (64, 14336, True, 8, 4),  # Mixtral-8x7B GEMM1: 10 / 7
    (64, 4096, False, 8, 4),  # GEMM2: 2 / 1
    (64, 4096, False, 9, 3),  # 2 / 2
    (64, 4096, False, ((8, 0.8), (9, 0.2)), 4),  # 2 / 1.2
    (64, 4096, False, "Mixtral-8x7B T=208", 4),  # 52 rows per expert: 9 blocks one time in five
    (64, 4096, False, "Mixtral-8x7B T=224", 3),  # 56 rows: 9 or more blocks three times in five
    (64, 768, True, 128, 3),  # Qwen3-30B-A3B GEMM1: 8 / 6
    (64, 2048, False, 128, 3),  # GEMM2: 11 / 8 (32 x 1.05 > 33)
    (64, 2048, False, "Qwen3-30B-A3B T=896", 3),  # 12.5 / 9.1 (where the mean, 144.3 blocks, gives 13 / 9)
    (64, 6144, False, 128, 3),  # MiniMax-M3 GEMM2: 63 / 47
    (64, 512, False, 8, 3),  # one round either way
    (160, 4096, False, 8, 3),  # 160-row blocks: three (their accumulators take the registers)
])
def test_warp_specialized_consumers_by_tile_fit(block_m, n_out, gated, blocks, want):
    """Four consumer warpgroups (256-row tiles) only where a GEMM's outputs fill whole tiles of
    them: in 32-row blocks always, in 64-row ones where they take enough fewer rounds of tiles,
    in expectation over the routings (tools/PERF_LOG.md, sessions 32-34). ``blocks``: a count,
    (blocks, probability) pairs, or a model and T whose random routings give them."""
    from mxfx.kernels import moe_sm90_ws, routing
    from mxfx.oracle.shapes import SHAPES
    if isinstance(blocks, int):
        blocks = ((blocks, 1.0),)
    elif isinstance(blocks, str):
        model, T = blocks.split(" T=")
        shape = SHAPES[model]
        blocks = routing.blocks_pmf(int(T) * shape.top_k, shape.num_experts, block_m)
    assert moe_sm90_ws.consumers(block_m, n_out, gated, blocks, 132) == want


@pytest.mark.parametrize("pairs,experts,block_m", [(256, 8, 64), (448, 8, 64), (416, 8, 64), (4096, 128, 64),
                                                  (3584, 128, 64), (1024, 128, 32), (40, 8, 32), (100, 1, 64),
                                                  (1, 128, 32)])
def test_blocks_pmf_matches_random_routings(pairs, experts, block_m):
    """routing.blocks_pmf against the blocks that 2000 uniformly random routings take: its mean
    within 1 %, its distribution within 0.15 in total variation (the experts taken as independent
    spread it a little: 0.11 at 448 pairs over 8 experts)."""
    from mxfx.kernels import routing
    g = torch.Generator().manual_seed(0)
    n = 2000
    counts = torch.stack([torch.bincount(torch.randint(0, experts, (pairs,), generator=g), minlength=experts)
                          for _ in range(n)])
    taken = ((counts + block_m - 1) // block_m).sum(1)
    pmf = routing.blocks_pmf(pairs, experts, block_m)
    assert [b for b, _ in pmf] == sorted(b for b, _ in pmf) and abs(sum(p for _, p in pmf) - 1) < 1e-6
    mean = sum(b * p for b, p in pmf)
    assert abs(mean - taken.double().mean().item()) <= 0.01 * mean
    seen = torch.bincount(taken).double() / n
    model = dict(pmf)
    tv = 0.5 * sum(abs(seen[b].item() - model.get(b, 0.0)) for b in range(len(seen)))
    tv += 0.5 * sum(p for b, p in pmf if b >= len(seen))
    assert tv <= 0.15, (tv, pmf, seen.nonzero().flatten().tolist())
    assert -(-pairs // block_m) <= pmf[0][0] and pmf[-1][0] <= routing.max_blocks(pairs, experts, block_m)
    assert routing.blocks_pmf(0, experts, block_m) == ((0, 1.0),)


def test_launcher_key_separates_8_from_16_byte_alignment():
    """A tensor 8 bytes off a 16-byte boundary is keyed apart from an aligned one: Triton
    specializes pointers on 16-byte alignment, so they need different compiled kernels."""
    from mxfx.kernels.launch import key_and_call

    buf = torch.zeros(64, dtype=torch.float16)
    assert buf.data_ptr() % 16 == 0
    assert key_and_call(0, (buf,), {})[0] != key_and_call(0, (buf[4:],), {})[0]


def test_next_power_of_2_matches_triton():
    """``next_power_of_2`` is the least power of two >= n (a power of two is its own), as
    Triton's, and 0 for 0: block sizes sized by it are not doubled."""
    import triton

    from mxfx.kernels.launch import next_power_of_2

    for n in [0, 1, 2, 3, 4, 5, 63, 64, 65, 1024, 1025]:
        assert next_power_of_2(n) == (triton.next_power_of_2(n) if n else 0)
