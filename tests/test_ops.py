"""torch.ops.mxfx.*: opcheck, fake-impl strides, gated_activation autograd, input validation
in eager mode and under torch.compile(fullgraph=True)."""
from __future__ import annotations

import re
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mxfx  # noqa: F401  (registers torch.ops.mxfx)
from mxfx import formats
from mxfx.activation import PRESETS
from mxfx.backends import emulation
from mxfx.moe_call import ActivationQuant

ops = torch.ops.mxfx
_ALL_BUT_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _moe_args(
    T=7, H=64, I=32, E=4, k=2, dtype=torch.float32, mxfp4=False, bias=False, transposed=False, seed=0
) -> dict:
    """Valid keyword arguments of ``mxfx.moe`` (weights as the op takes them)."""
    g = _gen(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k)
    ids = ids.to(torch.int64)
    if T:
        ids[0, -1] = -1  # a slot routed elsewhere
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    args = dict(
        x=x, topk_weights=torch.rand(T, k, generator=g).to(dtype), topk_ids=ids,
        w13=w13.to(dtype), w13_scale=None, w13_bias=None, w2=w2.to(dtype), w2_scale=None, w2_bias=None,
    )
    if transposed:  # stored as [E, K, N] parameters, passed as [E, N, K] views
        args["w13"] = w13.transpose(1, 2).contiguous().transpose(1, 2).to(dtype)
        args["w2"] = w2.transpose(1, 2).contiguous().transpose(1, 2).to(dtype)
    if mxfp4:
        args["w13"], args["w13_scale"] = formats.quantize(w13, "mxfp4", "round_up")
        args["w2"], args["w2_scale"] = formats.quantize(w2, "mxfp4", "round_up")
    if bias:
        args["w13_bias"] = torch.randn(E, 2 * I, generator=g).to(dtype)
        args["w2_bias"] = torch.randn(E, H, generator=g).to(dtype)
    return args


_MOE_ORDER = ("x", "topk_weights", "topk_ids", "w13", "w13_scale", "w13_bias", "w2", "w2_scale", "w2_bias")


def _split(args: dict) -> tuple[tuple, dict]:
    pos = tuple(args[n] for n in _MOE_ORDER)
    return pos, {n: v for n, v in args.items() if n not in _MOE_ORDER}


# ---------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize(
    "fmt,rounding,shape,dtype,transpose",
    [
        ("mxfp4", "floor", (3, 64), torch.float32, False),
        ("mxfp4", "round_up", (2, 3, 96), torch.bfloat16, False),
        ("mxfp4", "even", (64, 5), torch.float16, True),
        ("mxfp8", "floor", (4, 32), torch.float32, False),
        ("mxfp8", "even", (64, 3), torch.bfloat16, True),
        ("mxfp8_e5m2", "round_up", (0, 64), torch.float32, False),
    ],
)
def test_opcheck_quantize_mx(fmt, rounding, shape, dtype, transpose):
    x = torch.randn(shape, generator=_gen(1)).to(dtype)
    x = x.t() if transpose else x
    torch.library.opcheck(ops.quantize_mx.default, (x, fmt, rounding))
    packed, scales = ops.quantize_mx(x, fmt, rounding)
    want_p, want_s = formats.quantize(x, fmt, rounding)
    assert torch.equal(packed.view(torch.uint8), want_p.view(torch.uint8)) and torch.equal(scales, want_s)


@pytest.mark.parametrize(
    "fmt,out_dtype,shape,strided",
    [
        ("mxfp4", torch.float32, (3, 64), False),
        ("mxfp4", torch.bfloat16, (2, 4, 128), True),
        ("mxfp8", torch.float16, (5, 64), False),
        ("mxfp8_e5m2", torch.float32, (2, 96), True),
        ("mxfp8", torch.bfloat16, (0, 32), False),
    ],
)
def test_opcheck_dequantize_mx(fmt, out_dtype, shape, strided):
    x = torch.randn(*shape[:-1], shape[-1] * (2 if strided else 1), generator=_gen(2))
    packed, scales = formats.quantize(x, fmt, "floor")
    if strided:  # every other block: non-contiguous packed and scales
        per_byte = 2 if fmt == "mxfp4" else 1
        packed = packed.unflatten(-1, (-1, 32 // per_byte))[..., ::2, :].flatten(-2)
        scales = scales[..., ::2]
    args = (packed, scales, fmt, out_dtype)
    if fmt == "mxfp8" or fmt == "mxfp8_e5m2":
        # opcheck's test_schema compares inputs before/after with torch.allclose, which has no
        # CPU float8 kernel; the same checks (no input mutated, output aliases no input) by hand.
        torch.library.opcheck(ops.dequantize_mx.default, args, test_utils=_ALL_BUT_SCHEMA)
        before = (packed.view(torch.uint8).clone(), scales.clone())
        out = ops.dequantize_mx(*args)
        assert torch.equal(packed.view(torch.uint8), before[0]) and torch.equal(scales, before[1])
        if out.numel():
            assert out.untyped_storage().data_ptr() not in (
                packed.untyped_storage().data_ptr(), scales.untyped_storage().data_ptr()
            )
    else:
        torch.library.opcheck(ops.dequantize_mx.default, args)
    out = ops.dequantize_mx(packed, scales, fmt, out_dtype)
    assert torch.equal(out, formats.dequantize(packed, scales, fmt, out_dtype))


@pytest.mark.parametrize("layout", ["interleaved", "halves"])
@pytest.mark.parametrize("limit", [None, 7.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_gated_activation(layout, limit, dtype):
    x = (torch.randn(5, 3, 64, generator=_gen(3)) * 5).to(dtype).requires_grad_()
    torch.library.opcheck(ops.gated_activation.default, (x, layout, 1.702, 1.0, limit))
    torch.library.opcheck(ops.gated_activation.default, (x.detach()[:, 1], layout, 1.0, 0.0, limit))


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(layout="interleaved", alpha=1.702, beta=1.0, limit=7.0, bias=True),
        dict(mxfp4=True, activation_quant="mxfp4", layout="interleaved", limit=7.0),
        dict(mxfp4=True, bias=True, activation_quant="mxfp8", dtype=torch.bfloat16),
        dict(transposed=True, activation_quant="mxfp8", limit=3.0),
        dict(transposed=True, bias=True, activation_quant="mxfp4", dtype=torch.bfloat16, layout="interleaved"),
        dict(T=0, mxfp4=True),
        dict(T=1, E=1, k=1, bias=True, activation_quant="mxfp4", activation_scale_rounding="floor"),
    ],
)
def test_opcheck_moe(kw):
    build = {n: kw.pop(n) for n in list(kw) if n in ("T", "E", "k", "dtype", "mxfp4", "bias", "transposed")}
    pos, op_kw = _split(_moe_args(**build))
    op_kw.update(kw, backend="emulation")
    torch.library.opcheck(ops.moe.default, pos, op_kw)


# ---------------------------------------------------------------------------- fake strides


def _fake_matches_real(op, args: tuple, kwargs: dict) -> None:
    real = op(*args, **kwargs)
    with FakeTensorMode() as mode:
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        fake = op(*fake_args, **kwargs)
    for r, f in zip(*(o if isinstance(o, tuple) else (o,) for o in (real, fake))):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)


def test_fake_strides_equal_real_for_strided_inputs():
    g = _gen(4)
    args = _moe_args(T=9, mxfp4=True, bias=True)
    args["x"] = torch.randn(64, 9, generator=g).t()  # column-major x
    pos, kw = _split(args)
    _fake_matches_real(ops.moe, pos, dict(kw, backend="emulation"))
    args["x"] = torch.randn(9, 128, generator=g)[:, ::2]  # last-dim stride 2
    pos, kw = _split(args)
    _fake_matches_real(ops.moe, pos, dict(kw, backend="emulation"))
    xt = torch.randn(64, 6, generator=g).t()
    _fake_matches_real(ops.quantize_mx, (xt, "mxfp8", "even"), {})
    _fake_matches_real(ops.gated_activation, (xt, "interleaved", 1.0, 0.0, None), {})
    packed, scales = formats.quantize(torch.randn(64, 6, generator=g).t(), "mxfp4")
    _fake_matches_real(ops.dequantize_mx, (packed.t().contiguous().t(), scales, "mxfp4", torch.bfloat16), {})


# ---------------------------------------------------------------------------- autograd


def _away_from_kinks(x: torch.Tensor, limit) -> torch.Tensor:
    """Push values within 0.01 of ±limit away, so finite differences never straddle a clamp."""
    if limit is None:
        return x
    for edge in (limit, -limit):
        near = (x - edge).abs() < 0.01
        x = torch.where(near, x + 0.05 * torch.sign(x - edge + 1e-9), x)
    return x


@pytest.mark.parametrize("layout", ["interleaved", "halves"])
@pytest.mark.parametrize("limit", [None, 2.0, 7.0])
def test_gradcheck_gated_activation(layout, limit):
    x = torch.randn(4, 3, 24, generator=_gen(5), dtype=torch.float64) * 5  # many beyond ±limit
    x = _away_from_kinks(x, limit).requires_grad_()
    for alpha, beta in ((1.702, 1.0), (1.0, 0.0), (0.5, -0.25)):
        assert torch.autograd.gradcheck(
            lambda t: ops.gated_activation(t, layout, alpha, beta, limit), (x,)
        )
    # A non-contiguous input: the gradient comes back in the input's layout.
    xt = _away_from_kinks(torch.randn(24, 5, generator=_gen(6), dtype=torch.float64) * 5, limit)
    xt = xt.t().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: ops.gated_activation(t, layout, 1.702, 1.0, limit), (xt,))


@pytest.mark.parametrize("name", ["x", "topk_weights", "w13", "w13_bias", "w2", "w2_bias"])
def test_moe_forward_with_grad_inputs_but_backward_raises(name):
    """An inference op: with inputs that require grad (any of the float ones) the forward runs
    (as in a model not under no_grad), and asking for its backward is an error, never a silent
    zero gradient."""
    args = _moe_args(bias=True)
    args[name].requires_grad_(True)
    pos, kw = _split(args)
    out = ops.moe(*pos, **kw, backend="emulation")
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="mxfx.moe has no backward"):
        out.sum().backward()
    with torch.no_grad():
        assert not ops.moe(*pos, **kw, backend="emulation").requires_grad
    args[name].requires_grad_(False)
    assert not ops.moe(*_split(args)[0], backend="emulation").requires_grad


def test_moe_plain_call_runs_its_body_without_a_second_dispatch(monkeypatch):
    """Plain tensors without grad: the op's Autograd kernel runs its body itself (host time at
    small T). With grad, or under a dispatch mode (fake tensors), it redispatches, so the
    backward guard and the fake implementation still apply."""
    import mxfx.ops

    redispatched, real = [], mxfx.ops._MOE_OP

    class Spy:
        def redispatch(self, keyset, *args):
            redispatched.append(keyset)
            return real.redispatch(keyset, *args)

    monkeypatch.setattr(mxfx.ops, "_MOE_OP", Spy())
    args = _moe_args(bias=True)
    pos, kw = _split(args)
    ref = ops.moe(*pos, **kw, backend="emulation")
    assert not redispatched
    args["w13"].requires_grad_(True)
    out = ops.moe(*pos, **kw, backend="emulation")
    assert len(redispatched) == 1 and out.requires_grad
    torch.testing.assert_close(out.detach(), ref, rtol=0, atol=0)
    args["w13"].requires_grad_(False)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in pos]
        out = ops.moe(*fake, **kw, backend="emulation")
    assert len(redispatched) == 2 and out.shape == ref.shape


def test_gated_activation_matches_formula():
    x = torch.randn(6, 40, generator=_gen(7), dtype=torch.float64) * 6
    for name, act in PRESETS.items():
        if act.layout == "interleaved":
            gate, up = x[:, 0::2], x[:, 1::2]
        else:
            gate, up = x[:, :20], x[:, 20:]
        if act.limit is not None:
            gate, up = gate.clamp(max=act.limit), up.clamp(-act.limit, act.limit)
        want = gate * torch.sigmoid(act.alpha * gate) * (up + act.beta)
        got = ops.gated_activation(x, act.layout, act.alpha, act.beta, act.limit)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=name)
        got32 = ops.gated_activation(x.float(), act.layout, act.alpha, act.beta, act.limit)
        torch.testing.assert_close(got32, want.float(), msg=name)


# ---------------------------------------------------------------------------- validation


def _bad_moe(**change) -> dict:
    """Valid float ``moe`` arguments (E=4, T=3, H=64, I=32, k=2) with ``change`` applied."""
    return dict(_moe_args(T=3), **change)


def _with_scale(**change) -> dict:
    """Valid MXFP4 ``moe`` arguments (same sizes) with ``change`` applied."""
    return dict(_moe_args(T=3, mxfp4=True), **change)


def _mxfp4_h48() -> dict:
    """MXFP4 weights with H = 48 (not a multiple of 32), shapes otherwise consistent."""
    args = _bad_moe()
    args["x"] = torch.randn(3, 48)
    args["w13"] = torch.zeros(4, 64, 24, dtype=torch.uint8)
    args["w13_scale"] = torch.zeros(4, 64, 1, dtype=torch.uint8)
    w2, w2s = formats.quantize(torch.randn(4, 48, 32), "mxfp4")
    args["w2"], args["w2_scale"] = w2, w2s
    return args


def _float_h48() -> dict:
    args = _bad_moe()
    args["x"] = torch.randn(3, 48)
    args["w13"] = torch.randn(4, 64, 48)
    args["w2"] = torch.randn(4, 48, 32)
    return args


def _float_i40() -> dict:
    args = _bad_moe()
    args["w13"] = torch.randn(4, 80, 64)
    args["w2"] = torch.randn(4, 64, 40)
    return args


def _w13_float_w2_mxfp4() -> dict:
    args = _bad_moe()
    args["w2"], args["w2_scale"] = formats.quantize(torch.randn(4, 64, 32), "mxfp4")
    return args


# (case id, moe arguments, exception type, the argument its message must name)
MOE_ERRORS = [
    ("x_int_dtype", lambda: _bad_moe(x=torch.ones(3, 64, dtype=torch.int32)), TypeError, "x"),
    ("x_rank3", lambda: _bad_moe(x=torch.randn(1, 3, 64)), ValueError, "x"),
    ("w13_rank2", lambda: _bad_moe(w13=torch.randn(64, 64)), ValueError, "w13"),
    ("w13_int_dtype", lambda: _bad_moe(w13=torch.ones(4, 64, 64, dtype=torch.int32)), TypeError, "w13"),
    ("w13_hidden_mismatch", lambda: _bad_moe(w13=torch.randn(4, 64, 96)), ValueError, "w13"),
    ("w2_hidden_mismatch", lambda: _bad_moe(w2=torch.randn(4, 96, 32)), ValueError, "w2"),
    ("w2_intermediate_mismatch", lambda: _bad_moe(w2=torch.randn(4, 64, 16)), ValueError, "w2"),
    ("w2_float_w13_mxfp4", lambda: _with_scale(w2=torch.randn(4, 64, 32), w2_scale=None), TypeError, "w2"),
    ("w13_bias_int_dtype", lambda: _bad_moe(w13_bias=torch.ones(4, 64, dtype=torch.int64)), TypeError, "w13_bias"),
    ("w2_bias_int_dtype", lambda: _bad_moe(w2_bias=torch.ones(4, 64, dtype=torch.int32)), TypeError, "w2_bias"),
    ("w13_odd_rows", lambda: _bad_moe(w13=torch.randn(4, 63, 64), w2=torch.randn(4, 64, 31)), ValueError, "w13"),
    ("w13_no_experts", lambda: _bad_moe(w13=torch.randn(0, 64, 64), w2=torch.randn(0, 64, 32)), ValueError, "w13"),
    ("w13_float_w2_mxfp4", _w13_float_w2_mxfp4, TypeError, "w2"),
    ("topk_ids_bool", lambda: _bad_moe(topk_ids=torch.zeros(3, 2, dtype=torch.bool)), TypeError, "topk_ids"),
    ("act_quant_intermediate_48",
     lambda: dict(_bad_moe(w13=torch.randn(4, 96, 64), w2=torch.randn(4, 64, 48)), activation_quant="mxfp8"),
     ValueError, "activation_quant"),
    ("mxfp4_hidden_not_multiple_of_32", _mxfp4_h48, ValueError, "w13"),
    ("act_quant_hidden_not_multiple_of_32",
     lambda: dict(_float_h48(), activation_quant="mxfp8"), ValueError, "activation_quant"),
    ("act_quant_intermediate_not_multiple_of_32",
     lambda: dict(_float_i40(), activation_quant="mxfp4"), ValueError, "activation_quant"),
    ("topk_weights_shape", lambda: _bad_moe(topk_weights=torch.rand(3, 3)), ValueError, "topk_weights"),
    ("topk_ids_rows", lambda: _bad_moe(topk_ids=torch.zeros(4, 2, dtype=torch.int64)), ValueError, "topk_ids"),
    ("topk_ids_float", lambda: _bad_moe(topk_ids=torch.zeros(3, 2)), TypeError, "topk_ids"),
    ("topk_weights_int", lambda: _bad_moe(topk_weights=torch.ones(3, 2, dtype=torch.int64)), TypeError, "topk_weights"),
    ("w13_scale_shape", lambda: _with_scale(w13_scale=torch.zeros(4, 64, 3, dtype=torch.uint8)), ValueError, "w13_scale"),
    ("w2_scale_shape", lambda: _with_scale(w2_scale=torch.zeros(4, 64, 2, dtype=torch.uint8)), ValueError, "w2_scale"),
    ("w13_scale_dtype", lambda: _with_scale(w13_scale=torch.zeros(4, 64, 2)), TypeError, "w13_scale"),
    ("w13_scale_missing", lambda: _with_scale(w13_scale=None), ValueError, "w13_scale"),
    ("w2_scale_for_float_weight", lambda: _bad_moe(w2_scale=torch.zeros(4, 64, 1, dtype=torch.uint8)), ValueError, "w2_scale"),
    ("w13_packed_shape", lambda: _with_scale(w13=torch.zeros(4, 64, 16, dtype=torch.uint8)), ValueError, "w13"),
    ("w13_bias_shape", lambda: _bad_moe(w13_bias=torch.randn(4, 32)), ValueError, "w13_bias"),
    ("w2_bias_shape", lambda: _bad_moe(w2_bias=torch.randn(4, 32)), ValueError, "w2_bias"),
    ("unknown_layout", lambda: dict(_bad_moe(), layout="gate_up"), ValueError, "layout"),
    ("limit_negative", lambda: dict(_bad_moe(), limit=-1.0), ValueError, "limit"),
    ("unknown_activation_quant", lambda: dict(_bad_moe(), activation_quant="int4"), ValueError, "activation_quant"),
    ("unknown_scale_rounding", lambda: dict(_bad_moe(), activation_scale_rounding="ceil"),
     ValueError, "activation_scale_rounding"),
    ("unknown_backend", lambda: dict(_bad_moe(), backend="cutlass9000"), ValueError, "backend"),
]

OTHER_ERRORS = [
    ("quantize_k48", ops.quantize_mx, lambda: (torch.randn(2, 48), "mxfp4", "floor"), ValueError, "x"),
    ("quantize_int", ops.quantize_mx, lambda: (torch.ones(2, 32, dtype=torch.int32), "mxfp4", "floor"), TypeError, "x"),
    ("quantize_fmt", ops.quantize_mx, lambda: (torch.randn(2, 32), "nvfp4", "floor"), ValueError, "fmt"),
    ("quantize_rounding", ops.quantize_mx, lambda: (torch.randn(2, 32), "mxfp8", "rceil"), ValueError, "scale_rounding"),
    ("dequantize_packed_dtype", ops.dequantize_mx,
     lambda: (torch.zeros(2, 32), torch.zeros(2, 1, dtype=torch.uint8), "mxfp8", torch.float32), TypeError, "packed"),
    ("dequantize_scales_shape", ops.dequantize_mx,
     lambda: (torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8), "mxfp4", torch.float32),
     ValueError, "scales"),
    ("dequantize_scales_dtype", ops.dequantize_mx,
     lambda: (torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1), "mxfp4", torch.float32), TypeError, "scales"),
    ("dequantize_k_not_multiple_of_32", ops.dequantize_mx,
     lambda: (torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 0, dtype=torch.uint8), "mxfp4", torch.float32),
     ValueError, "scales"),
    ("dequantize_out_dtype", ops.dequantize_mx,
     lambda: (torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), "mxfp4", torch.int32),
     TypeError, "out_dtype"),
    ("activation_odd", ops.gated_activation, lambda: (torch.randn(3, 7), "halves", 1.0, 0.0, None), ValueError, "x"),
    ("activation_int", ops.gated_activation, lambda: (torch.ones(3, 8, dtype=torch.int64), "halves", 1.0, 0.0, None),
     TypeError, "x"),
    ("activation_layout", ops.gated_activation, lambda: (torch.randn(3, 8), "split", 1.0, 0.0, None), ValueError, "layout"),
    ("activation_limit", ops.gated_activation, lambda: (torch.randn(3, 8), "halves", 1.0, 0.0, 0.0), ValueError, "limit"),
    ("activation_alpha", ops.gated_activation,
     lambda: (torch.randn(3, 8), "halves", float("inf"), 0.0, None), ValueError, "alpha"),
]


def _assert_names(exc: BaseException, exc_type: type, arg: str) -> None:
    """``exc`` is ``exc_type`` (or, under Dynamo, the TorchRuntimeError that reports one raised
    by a fake implementation as "got ValueError('...')"), and its message starts with ``arg:``."""
    msg = str(exc)
    if isinstance(exc, exc_type):
        assert msg.startswith(f"{arg}: "), msg
        return
    # Dynamo re-raises errors from fake implementations as TorchRuntimeError and keeps the
    # original type and message only in the text.
    assert isinstance(exc, torch._dynamo.exc.TorchRuntimeError), repr(exc)
    assert re.search(rf"got {exc_type.__name__}\(['\"]{re.escape(arg)}: ", msg), msg


def _eager_and_compiled(fn, tensors: list, exc_type: type, arg: str, fake_detects: bool = True) -> None:
    with pytest.raises(exc_type) as info:
        fn(*tensors)
    _assert_names(info.value, exc_type, arg)
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(fn, fullgraph=True)(*tensors)
    if fake_detects:  # raised while tracing, from the fake implementation's check
        assert isinstance(info.value, torch._dynamo.exc.TorchRuntimeError), repr(info.value)
    _assert_names(info.value, exc_type, arg)


@pytest.mark.parametrize("case,make,exc_type,arg", MOE_ERRORS, ids=[c[0] for c in MOE_ERRORS])
def test_moe_rejects(case, make, exc_type, arg):
    args = make()
    pos, kw = _split(args)
    names = [n for n, a in zip(_MOE_ORDER, pos) if isinstance(a, torch.Tensor)]
    tensors = [args[n] for n in names]

    def fn(*ts):
        full = dict(zip(_MOE_ORDER, pos), **dict(zip(names, ts)))
        return ops.moe(*(full[n] for n in _MOE_ORDER), **kw)

    _eager_and_compiled(fn, tensors, exc_type, arg)


@pytest.mark.parametrize("case,op,make,exc_type,arg", OTHER_ERRORS, ids=[c[0] for c in OTHER_ERRORS])
def test_op_rejects(case, op, make, exc_type, arg):
    args = make()
    idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def fn(*ts):
        full = list(args)
        for i, t in zip(idx, ts):
            full[i] = t
        return op(*full)

    _eager_and_compiled(fn, [args[i] for i in idx], exc_type, arg)


@pytest.mark.parametrize("bad_id", [4, 100])
def test_moe_rejects_expert_id_out_of_range(bad_id):
    args = _bad_moe()
    args["topk_ids"][1, 0] = bad_id
    pos, kw = _split(args)
    tensors = [a for a in pos if a is not None]

    def fn(x, tw, ids, w13, w2):
        return ops.moe(x, tw, ids, w13, None, None, w2, None, None, **kw)

    # Values are unknown while tracing: the compiled graph raises when it runs the op.
    _eager_and_compiled(fn, tensors, ValueError, "topk_ids", fake_detects=False)


@pytest.mark.parametrize("name", ["x", "topk_weights", "topk_ids", "w13", "w13_scale", "w2_bias"])
def test_moe_rejects_sparse_tensors(name):
    # Eager only: the compiled path does not take sparse inputs. A sparse w13 used to run.
    args = _moe_args(T=3, mxfp4=name == "w13_scale", bias=True)
    args[name] = args[name].to_sparse()
    pos, kw = _split(args)
    for fn in (ops.moe, mxfx.ops.moe):
        with pytest.raises(ValueError) as info:
            fn(*pos, **kw)
        _assert_names(info.value, ValueError, name)


def test_valid_arguments_pass_the_checks():
    # Every error case above differs from these in exactly the argument it names.
    for args in (_bad_moe(), _with_scale(), _moe_args(T=3, bias=True, transposed=True)):
        pos, kw = _split(args)
        assert ops.moe(*pos, **kw).shape == (3, 64)
    for args in (_float_h48(), _float_i40()):
        pos, kw = _split(args)
        assert ops.moe(*pos, **kw).shape == args["x"].shape  # no activation_quant: any H, I


def test_moe_more_slots_than_local_experts():
    # Expert parallelism: k=3 slots, 2 local experts, the other slots marked -1.
    torch.manual_seed(0)
    E, H, I = 2, 32, 32
    x = torch.randn(4, H)
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    ids = torch.tensor([[0, -1, 1], [-1, -1, 1], [0, -1, -1], [-1, -1, -1]])
    tw = torch.rand(4, 3)
    out = torch.ops.mxfx.moe(x, tw, ids, w13, None, None, w2, None, None)
    keep = ids >= 0
    one = torch.ops.mxfx.moe(
        x, tw * keep, ids.clamp(min=0), w13, None, None, w2, None, None
    )
    # The zero-weight slots add rows to expert 0's matmuls, and the CPU's BLAS may then block
    # the sums differently (seen on AMD EPYC: 1.7e-6 relative); a dropped or extra slot
    # would be off by the size of the output itself.
    torch.testing.assert_close(out, one, rtol=1e-5, atol=1e-4)
    assert out[3].abs().max() == 0


@pytest.mark.parametrize("name", ["w13", "w2", "topk_ids"])
def test_moe_rejects_tensors_on_another_device(name):
    args = _bad_moe()
    args[name] = args[name].to("meta")
    pos, kw = _split(args)
    with pytest.raises(ValueError, match=f"^{name}: on meta, expected x's device cpu"):
        ops.moe(*pos, **kw)


@pytest.mark.parametrize("case,change,exc_type,arg", [
    ("dtype", lambda a: dict(a, x=a["x"].to(torch.int32)), TypeError, "x"),
    ("shape", lambda a: dict(a, x=torch.randn(5, 64)), ValueError, "topk_ids"),
    ("none_slot", lambda a: dict(a, w13_scale=a["w13_bias"], w13_bias=None), ValueError, "w13_scale"),
], ids=["dtype", "shape", "none_slot"])
def test_moe_cached_check_is_keyed_on_every_tensor_property(case, change, exc_type, arg):
    args = _bad_moe(w13_bias=torch.randn(4, 64))  # [E, 2I] == [E, H] here: same shape as w2_bias
    pos, kw = _split(args)
    assert ops.moe(*pos, **kw).shape == (3, 64)  # cached
    pos, kw = _split(change(args))
    with pytest.raises(exc_type, match=f"^{arg}: "):
        ops.moe(*pos, **kw)


@pytest.mark.parametrize("layout", ["interleaved", "halves"])
def test_gated_activation_grad_at_the_limit(layout):
    from mxfx.activation import join_gate_up

    limit = 7.0
    gate = torch.tensor([[limit, -limit, 1.0]], dtype=torch.float64)
    up = torch.tensor([[limit, -limit, 0.5]], dtype=torch.float64)
    x = join_gate_up(gate, up, layout)
    got_x = x.clone().requires_grad_()
    ops.gated_activation(got_x, layout, 1.702, 1.0, limit).sum().backward()
    want_x = x.clone().requires_grad_()
    act = mxfx.GatedActivation(layout, 1.702, 1.0, limit)
    emulation.gated_activation(want_x, act).sum().backward()
    torch.testing.assert_close(got_x.grad, want_x.grad, rtol=1e-12, atol=1e-15)
    assert (got_x.grad != 0).all()


def test_uncached_resolution_is_not_a_key():
    triton_like = types.SimpleNamespace(run=lambda x, tw, ids, w, act, aq, key=None: None)
    act, aq = mxfx.GatedActivation(), ActivationQuant()
    assert mxfx.ops._Resolved(triton_like, act, aq, cached=True).keyed
    assert not mxfx.ops._Resolved(triton_like, act, aq, cached=False).keyed
