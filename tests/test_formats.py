"""mxfx.formats against the OCP MX v1.0 spec, an exact Fraction reference, and torchao.

The references here are written from the spec with Python's ``fractions``; they share no code
with :mod:`mxfx.formats`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxfx import formats

FMTS = ("mxfp4", "mxfp8", "mxfp8_e5m2")
ROUNDINGS = ("floor", "round_up", "even")


@dataclass(frozen=True)
class Spec:
    """An element format as the OCP MX spec tables give it."""

    emax: int  # exponent of the largest normal
    emin: int  # exponent of the smallest normal
    mbits: int
    max: float
    dtype: torch.dtype  # the packed dtype


SPECS = {
    "mxfp4": Spec(emax=2, emin=0, mbits=1, max=6.0, dtype=torch.uint8),
    "mxfp8": Spec(emax=8, emin=-6, mbits=3, max=448.0, dtype=torch.float8_e4m3fn),
    "mxfp8_e5m2": Spec(emax=15, emin=-14, mbits=2, max=57344.0, dtype=torch.float8_e5m2),
}



def _f32(v: float) -> float:
    """``v`` rounded to the nearest float32 (as a Python float)."""
    return torch.tensor(v, dtype=torch.float32).item()


def _floor_log2(q: Fraction) -> int:
    e = q.numerator.bit_length() - q.denominator.bit_length()
    return e - 1 if Fraction(2) ** e > q else e


def ref_exponent(amax: float, fmt: str, rounding: str) -> int:
    """The block's unbiased scale exponent, from the definitions in DESIGN.md, exactly."""
    s = SPECS[fmt]
    if amax == 0:
        return -127
    a = Fraction(amax)
    if rounding == "floor":
        e = _floor_log2(a) - s.emax
    elif rounding == "round_up":  # ceil(log2(amax / max))
        ratio = a / Fraction(s.max)
        e = _floor_log2(ratio)
        e += Fraction(2) ** e < ratio
    else:  # "even": amax to mbits mantissa bits, ties to even, then floor
        p = _floor_log2(a)
        ulp = Fraction(2) ** (p - s.mbits)
        e = _floor_log2(round(a / ulp) * ulp) - s.emax  # round(Fraction): half to even
    return max(-127, min(127, e))


def ref_element(q: Fraction, fmt: str) -> Fraction:
    """``q`` (already divided by the scale) rounded to the element grid: RNE, saturating."""
    s = SPECS[fmt]
    if q == 0:
        return Fraction(0)
    p = max(_floor_log2(abs(q)), s.emin)
    ulp = Fraction(2) ** (p - s.mbits)
    v = round(q / ulp) * ulp  # an even multiple of ulp is an even mantissa
    return max(-Fraction(s.max), min(Fraction(s.max), v))


def ref_qdq(x: torch.Tensor, fmt: str, rounding: str) -> tuple[list[int], list[float]]:
    """Exact reference for finite float32 ``x [K]``: (scale bytes, dequantized values as
    float32, where a value above the float32 range is inf)."""
    vals = [Fraction(v) for v in x.tolist()]
    bytes_, out = [], []
    for i in range(0, len(vals), 32):
        block = vals[i : i + 32]
        e = ref_exponent(float(max(abs(v) for v in block)), fmt, rounding)
        bytes_.append(e + 127)
        out += [_f32(float(ref_element(v / Fraction(2) ** e, fmt) * Fraction(2) ** e)) for v in block]
    return bytes_, out


def _qdq(x: torch.Tensor, fmt: str, rounding: str) -> torch.Tensor:
    packed, scales = formats.quantize(x, fmt, rounding)
    return formats.dequantize(packed, scales, fmt, torch.float64)


def _amax_cases() -> list[float]:
    """Block maxima that exercise every rounding: powers of two, the format maxima, ties of
    the mantissa rounding, neighbours of all those, float32 subnormals and extremes."""
    vals = [0.0, 1.0, 0.75, 1.25, 1.5, 1.75, 1.875, 1.9375, 3.5, 5.0, 5.99, 6.0, 6.5, 7.0, 7.5, 8.0]
    vals += [448.0, 449.0, 464.0, 480.0, 500.0, 57344.0, 61440.0, 65536.0, 1e5]
    vals += [2.0**-126, 1.5 * 2.0**-126, 2.0**-130, 2.0**-149, 2.0**-125, 2.0**-120, 3.0e38]
    vals += [float(torch.finfo(torch.float32).max), 2.0**127]
    for k in (-100, -20, -3, 0, 5, 30, 100):
        for m in (1.0, 6.0, 448.0, 57344.0, 1.75, 1.875):
            vals.append(m * 2.0**k)
    cases = []
    for v in vals:
        v = _f32(v)
        t = torch.tensor(v, dtype=torch.float32)
        up, down = (torch.nextafter(t, torch.tensor(d)).item() for d in (math.inf, 0.0))
        cases += [v, up, down]
    g = torch.Generator().manual_seed(0)
    rand = torch.rand(200, generator=g) * torch.exp2(torch.randint(-140, 127, (200,), generator=g).float())
    cases += rand.tolist()
    return sorted({c for c in cases if math.isfinite(c)})


AMAX_CASES = _amax_cases()


# ---------------------------------------------------------------------------- E2M1 codes


@pytest.mark.parametrize("exp", [-127, -126, -100, -30, -1, 0, 1, 17, 100, 125])
def test_all_e2m1_codes_decode_and_reencode(exp, mx_ref_dequantize):
    codes = list(range(16)) * 2  # every code twice: one 32-element block
    packed = torch.tensor([codes[i] | (codes[i + 1] << 4) for i in range(0, 32, 2)], dtype=torch.uint8)
    scales = torch.tensor([exp + 127], dtype=torch.uint8)
    out = formats.dequantize(packed, scales, "mxfp4", torch.float32)
    assert torch.equal(out.double(), mx_ref_dequantize(packed, scales, "mxfp4"))
    assert torch.signbit(out).tolist() == [bool(c & 8) for c in codes]  # code 8 is -0
    # The block holds ±6 · 2^exp, so every rounding gives the scale 2^exp back.
    for rounding in ROUNDINGS:
        p, s = formats.quantize(out, "mxfp4", rounding)
        assert torch.equal(p, packed) and torch.equal(s, scales), rounding


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_makes_no_tensor_from_host_data(fmt, monkeypatch):
    """A compiled model's dequantizing weights run inside CUDA graph captures, which refuse the
    host-to-device copy of a tensor built from Python data (a lookup table, say)."""
    packed, scales = formats.quantize(torch.randn(4, 64, generator=torch.Generator().manual_seed(3)), fmt)
    want = formats.dequantize(packed, scales, fmt)

    def host_data(*args, **kwargs):
        raise AssertionError("a tensor built from host data")

    monkeypatch.setattr(torch, "tensor", host_data)
    monkeypatch.setattr(torch, "as_tensor", host_data)
    assert torch.equal(formats.dequantize(packed, scales, fmt), want)


def test_every_scale_byte_decodes(mx_ref_dequantize):
    for fmt in FMTS:
        g = torch.Generator().manual_seed(1)
        if fmt == "mxfp4":
            packed = torch.randint(0, 256, (256, 16), dtype=torch.uint8, generator=g)
        else:
            packed = _finite_fp8(torch.randint(0, 256, (256, 32), dtype=torch.uint8, generator=g), fmt)
        scales = torch.arange(256, dtype=torch.uint8).unsqueeze(1)  # 2^-127 ... 2^127, NaN
        out = formats.dequantize(packed, scales, fmt, torch.float32)
        ref = mx_ref_dequantize(packed, scales, fmt).to(torch.float32)  # overflow → inf, like float32
        torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)
        assert out[255].isnan().all() and not out[:255].isnan().any()


def _finite_fp8(bytes_: torch.Tensor, fmt: str) -> torch.Tensor:
    """Random fp8 bytes with NaN/Inf encodings replaced by zero."""
    v = bytes_.view(SPECS[fmt].dtype)
    return torch.where(v.float().isfinite(), bytes_, 0).view(SPECS[fmt].dtype)


# ---------------------------------------------------------------------------- rounding


def _one_block(values: list[float], scale_exp: int) -> torch.Tensor:
    """A float32 block of ``values · 2^scale_exp``, padded with a 6 · 2^scale_exp element
    that fixes the floor scale to 2^scale_exp."""
    vals = values + [6.0] + [0.0] * (31 - len(values))
    return torch.tensor([math.ldexp(v, scale_exp) for v in vals], dtype=torch.float32)


# A tie between two neighbours of the E2M1 grid goes to the one with the even code.
# (tie, lower neighbour, upper neighbour, the even one)
E2M1_TIES = [
    (0.25, 0.0, 0.5, 0.0), (0.75, 0.5, 1.0, 1.0), (1.25, 1.0, 1.5, 1.0), (1.75, 1.5, 2.0, 2.0),
    (2.5, 2.0, 3.0, 2.0), (3.5, 3.0, 4.0, 4.0), (5.0, 4.0, 6.0, 4.0),
]


@pytest.mark.parametrize("exp", [-120, -7, 0, 3, 100])
def test_e2m1_ties_round_to_even(exp):
    def qdq(vals):
        return _qdq(_one_block(vals, exp), "mxfp4", "floor")[: len(vals)].tolist()

    def scaled(vals):
        return [math.ldexp(v, exp) for v in vals]

    ties = [t for t, _, _, _ in E2M1_TIES]
    assert qdq(ties) == scaled([even for _, _, _, even in E2M1_TIES])
    assert qdq([-t for t in ties]) == scaled([-even for _, _, _, even in E2M1_TIES])
    # One float32 ulp away from a tie goes to the nearer neighbour.
    above = [torch.nextafter(torch.tensor(t), torch.tensor(9.0)).item() for t in ties]
    below = [torch.nextafter(torch.tensor(t), torch.tensor(0.0)).item() for t in ties]
    assert qdq(above) == scaled([hi for _, _, hi, _ in E2M1_TIES])
    assert qdq(below) == scaled([lo for _, lo, _, _ in E2M1_TIES])


@pytest.mark.parametrize("exp", [-100, 0, 50])
def test_saturation_above_max(exp):
    # floor keeps the scale 2^exp for a block maximum in [4, 8) · 2^exp: values above 6 saturate.
    vals = [6.0, 6.25, 6.5, 7.0, 7.5, 7.99, -7.99, -6.5]
    out = _qdq(_one_block(vals, exp), "mxfp4", "floor")
    assert out[: len(vals)].tolist() == [math.ldexp(math.copysign(6.0, v), exp) for v in vals]
    # FP8 saturates to ±max instead of producing NaN (e4m3fn) or Inf (e5m2).
    for fmt, over in (("mxfp8", [449.0, 470.0, 511.0, -500.0]), ("mxfp8_e5m2", [61000.0, -65000.0])):
        m = SPECS[fmt].max
        x = torch.tensor([math.ldexp(v, exp) for v in over + [0.0] * (32 - len(over))])
        packed, scales = formats.quantize(x, fmt, "floor")
        assert scales.item() == exp + 127
        out = formats.dequantize(packed, scales, fmt, torch.float64)
        assert out[: len(over)].tolist() == [math.ldexp(math.copysign(m, v), exp) for v in over]


@pytest.mark.parametrize("fmt", FMTS)
def test_scale_roundings_match_definitions(fmt):
    """Each rounding's scale byte (and the block maximum's element) equals the definition,
    computed exactly with fractions, for a few hundred block maxima."""
    amax = torch.tensor(AMAX_CASES, dtype=torch.float32)
    sign = torch.where(torch.arange(len(AMAX_CASES)) % 2 == 0, 1.0, -1.0)
    x = torch.zeros(len(AMAX_CASES), 32)
    x[:, 5] = amax * sign  # the maximum, with alternating sign
    x[:, 0] = amax * 0.375
    x[:, 31] = -amax / 7
    for rounding in ROUNDINGS:
        packed, scales = formats.quantize(x, fmt, rounding)
        out = formats.dequantize(packed, scales, fmt, torch.float32)
        for i, a in enumerate(AMAX_CASES):
            e = ref_exponent(a, fmt, rounding)
            assert scales[i, 0].item() == e + 127, (rounding, a)
            v = ref_element(Fraction(x[i, 5].item()) / Fraction(2) ** e, fmt) * Fraction(2) ** e
            assert out[i, 5].item() == _f32(float(v)), (rounding, a)


def test_scale_roundings_differ_as_defined():
    # amax = 7: floor keeps 2^0 (7 saturates to 6), round_up and even both take 2^1.
    # amax = 6.5: even rounds 6.5 to 6 first (2^0) while round_up needs 2^1.
    for amax, want in ((7.0, (127, 128, 128)), (6.5, (127, 128, 127)), (6.0, (127, 127, 127))):
        x = torch.zeros(32)
        x[0] = amax
        got = tuple(formats.quantize(x, "mxfp4", r)[1].item() for r in ROUNDINGS)
        assert got == want, amax


def test_zero_blocks():
    x = torch.zeros(3, 96)
    x[1, 40] = 1.0  # block 1 of row 1 is not zero
    x[2, :32] = -0.0
    for fmt in FMTS:
        for rounding in ROUNDINGS:
            packed, scales = formats.quantize(x, fmt, rounding)
            zero = torch.ones_like(scales, dtype=torch.bool)
            zero[1, 1] = False
            assert (scales[zero] == 0).all()
            out = formats.dequantize(packed, scales, fmt, torch.float32)
            assert torch.equal(out, x)
            assert torch.signbit(out[2, :32]).all()  # -0 keeps its sign


def test_tiny_scales_down_to_2_pow_minus_127():
    for fmt in FMTS:
        s = SPECS[fmt]
        # amax = max · 2^-127: every rounding picks scale byte 0 and the block is exact.
        x = torch.zeros(32, dtype=torch.float32)
        x[0] = math.ldexp(s.max, -127)
        x[1] = -math.ldexp(1.0, -127)
        x[2] = math.ldexp(1.5, -127 + s.emin)  # a float32 subnormal the element keeps
        for rounding in ROUNDINGS:
            packed, scales = formats.quantize(x, fmt, rounding)
            assert scales.item() == 0, (fmt, rounding)
            assert torch.equal(formats.dequantize(packed, scales, fmt, torch.float32), x)
        # A float32-subnormal maximum clamps to scale byte 0 too.
        tiny = torch.zeros(32)
        tiny[3] = 2.0**-140
        for rounding in ROUNDINGS:
            assert formats.quantize(tiny, fmt, rounding)[1].item() == 0


def test_largest_scales():
    fmax = torch.finfo(torch.float32).max
    x = torch.zeros(2, 32)
    x[0, 0], x[1, 0] = fmax, -fmax
    for fmt in FMTS:
        for rounding in ROUNDINGS:
            packed, scales = formats.quantize(x, fmt, rounding)
            e = ref_exponent(fmax, fmt, rounding)
            assert scales.flatten().tolist() == [e + 127, e + 127]
            out = formats.dequantize(packed, scales, fmt, torch.float64)
            assert out[0, 0].item() == -out[1, 0].item() > 2.0**127


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_blocks(bad):
    x = torch.randn(2, 96)
    x[0, 33] = bad
    x[1, 95] = bad
    for fmt in FMTS:
        for rounding in ROUNDINGS:
            packed, scales = formats.quantize(x, fmt, rounding)
            bad_blocks = torch.tensor([[False, True, False], [False, False, True]])
            assert (scales[bad_blocks] == 0xFF).all() and (scales[~bad_blocks] != 0xFF).all()
            out = formats.dequantize(packed, scales, fmt, torch.float32).unflatten(-1, (3, 32))
            assert out[bad_blocks].isnan().all()
            assert out[~bad_blocks].isfinite().all()
            # The other blocks are quantized as if the bad one were not there.
            clean = x.clone().unflatten(-1, (3, 32))
            clean[bad_blocks] = 0.0
            want = _qdq(clean.flatten(-2), fmt, rounding).unflatten(-1, (3, 32))
            assert torch.equal(out[~bad_blocks].double(), want[~bad_blocks])


# ---------------------------------------------------------------------------- layout


def test_nibble_order_low_nibble_is_even_element():
    x = torch.zeros(32)
    x[0], x[1], x[2], x[3], x[31] = 0.5, 6.0, -1.0, 3.0, 6.0  # codes 1, 7, 10, 5
    packed, scales = formats.quantize(x, "mxfp4", "floor")
    assert scales.item() == 127
    assert packed[0].item() == 0x71 and packed[1].item() == 0x5A and packed[15].item() == 0x70
    back = formats.dequantize(torch.tensor([0x71] + [0] * 15, dtype=torch.uint8), scales, "mxfp4")
    assert back[:2].tolist() == [0.5, 6.0]
    codes = torch.tensor([1, 7, 10, 5], dtype=torch.uint8)
    assert formats.pack_fp4(codes).tolist() == [0x71, 0x5A]
    assert formats.unpack_fp4(torch.tensor([0x71, 0x5A], dtype=torch.uint8)).tolist() == [1, 7, 10, 5]


@pytest.mark.parametrize("fmt", FMTS)
def test_shapes_dtypes_and_strides(fmt):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 128, generator=g)
    packed, scales = formats.quantize(x, fmt)
    per_byte = 2 if fmt == "mxfp4" else 1
    assert packed.shape == (2, 3, 128 // per_byte) and packed.dtype == SPECS[fmt].dtype
    assert scales.shape == (2, 3, 4) and scales.dtype == torch.uint8
    assert packed.is_contiguous() and scales.is_contiguous()
    # A non-contiguous view quantizes like its contiguous copy; bf16/fp16 like their float32 value.
    xt = torch.randn(128, 6, generator=g).t()
    for a, b in ((xt, xt.contiguous()), (x.bfloat16(), x.bfloat16().float()), (x.half(), x.half().float())):
        pa, sa = formats.quantize(a, fmt)
        pb, sb = formats.quantize(b, fmt)
        assert torch.equal(pa.view(torch.uint8), pb.view(torch.uint8)) and torch.equal(sa, sb)
    out = formats.dequantize(packed, scales, fmt, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape


@pytest.mark.parametrize("shape", [(31,), (4, 48), (2, 33), (16,), ()])
def test_k_not_multiple_of_32_is_an_error(shape):
    with pytest.raises(ValueError, match=r"^x: .*multiple of 32"):
        formats.quantize(torch.ones(shape), "mxfp4")


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"^fmt: got 'mxfp6'"):
        formats.quantize(torch.ones(32), "mxfp6")
    with pytest.raises(ValueError, match=r"^scale_rounding: got 'ceil'"):
        formats.quantize(torch.ones(32), "mxfp4", "ceil")
    with pytest.raises(TypeError, match=r"^x: got dtype torch.int32"):
        formats.quantize(torch.ones(32, dtype=torch.int32), "mxfp4")


# ---------------------------------------------------------------------------- round trips


def _canonical(fmt: str, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MX data whose every block holds ±max · 2^e, so all roundings agree on 2^e."""
    g = torch.Generator().manual_seed(seed)
    s = SPECS[fmt]
    top = 127 - math.ceil(math.log2(s.max))  # max · 2^e must stay finite in float32
    scales = torch.randint(0, top + 128, (rows, 4), dtype=torch.uint8, generator=g)
    if fmt == "mxfp4":
        codes = torch.randint(0, 16, (rows, 128), dtype=torch.uint8, generator=g)
        codes[:, 7::32] = torch.randint(0, 2, (rows, 4), dtype=torch.uint8, generator=g) * 8 + 7
        return formats.pack_fp4(codes), scales
    data = _finite_fp8(torch.randint(0, 256, (rows, 128), dtype=torch.uint8, generator=g), fmt)
    maxv = torch.tensor([s.max, -s.max]).to(s.dtype)
    data[:, 7::32] = maxv[torch.randint(0, 2, (rows, 4), generator=g)]
    return data, scales


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_quantize_of_dequantize_is_identity(fmt, rounding):
    packed, scales = _canonical(fmt, 64, seed=len(fmt) * 7 + len(rounding))
    p, s = formats.quantize(formats.dequantize(packed, scales, fmt, torch.float32), fmt, rounding)
    assert torch.equal(s, scales)
    assert torch.equal(p.view(torch.uint8), packed.view(torch.uint8))


@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_matches_exact_reference(fmt):
    g = torch.Generator().manual_seed(3)
    exps = torch.randint(-135, 120, (24, 1), generator=g).float().repeat_interleave(32, 1)
    x = (torch.randn(24, 32, generator=g) * torch.exp2(exps)).flatten()
    for rounding in ROUNDINGS:
        packed, scales = formats.quantize(x, fmt, rounding)
        want_scales, want = ref_qdq(x, fmt, rounding)
        assert scales.tolist() == want_scales
        assert formats.dequantize(packed, scales, fmt, torch.float32).tolist() == want


# ---------------------------------------------------------------------------- properties



@st.composite
def blocks(draw, min_exp=-149, max_exp=127):
    """float32 [n·32] values: per block, random values times a random power of two.

    With max_exp=120 no value lies near the float32 maximum, where round_up/even may round
    an element up past it (dequantizing to inf, which test_largest_scales covers)."""
    n = draw(st.integers(1, 3))
    vals = []
    for _ in range(n):
        e = draw(st.integers(min_exp, max_exp))
        block = draw(st.lists(st.floats(-8, 8, width=32), min_size=32, max_size=32))
        vals += [_f32(math.ldexp(v, e)) if abs(math.ldexp(v, e)) < 3.4e38 else 0.0 for v in block]
    return torch.tensor(vals, dtype=torch.float32)


@settings(max_examples=100, deadline=None)
@given(x=blocks(), fmt=st.sampled_from(FMTS), rounding=st.sampled_from(ROUNDINGS))
def test_property_matches_exact_reference(x, fmt, rounding):
    packed, scales = formats.quantize(x, fmt, rounding)
    want_scales, want = ref_qdq(x, fmt, rounding)
    assert scales.tolist() == want_scales
    assert formats.dequantize(packed, scales, fmt, torch.float32).tolist() == want


@settings(max_examples=100, deadline=None)
@given(x=blocks(max_exp=120), fmt=st.sampled_from(FMTS), rounding=st.sampled_from(ROUNDINGS))
def test_property_error_within_half_ulp(x, fmt, rounding):
    s = SPECS[fmt]
    packed, scales = formats.quantize(x, fmt, rounding)
    out = formats.dequantize(packed, scales, fmt, torch.float64)
    scale = torch.exp2(scales.double() - 127).repeat_interleave(32)
    q = x.double() / scale  # the value the element grid has to hold
    ok = q.abs() <= s.max  # not saturated
    exp = torch.floor(torch.log2(q.abs())).clamp(min=s.emin)
    half_ulp = torch.exp2(exp - s.mbits - 1) * scale
    err = (out - x.double()).abs()
    assert (err[ok] <= half_ulp[ok]).all()
    # Saturated elements land on ±max · scale.
    assert torch.equal(out[~ok], torch.copysign(s.max * scale[~ok], x[~ok].double()))


@settings(max_examples=100, deadline=None)
@given(x=blocks(max_exp=120), fmt=st.sampled_from(FMTS), rounding=st.sampled_from(ROUNDINGS))
def test_property_idempotent_and_sign_symmetric(x, fmt, rounding):
    once = _qdq(x, fmt, rounding)
    assert torch.equal(_qdq(once.float(), fmt, rounding), once)
    packed, scales = formats.quantize(x, fmt, rounding)
    neg_packed, neg_scales = formats.quantize(-x, fmt, rounding)
    assert torch.equal(neg_scales, scales)
    flip = 0x88 if fmt == "mxfp4" else 0x80  # the sign bit of every element
    assert torch.equal(neg_packed.view(torch.uint8), packed.view(torch.uint8) ^ flip)


@settings(max_examples=100, deadline=None)
@given(
    x=blocks(min_exp=-20, max_exp=20),
    k=st.integers(-60, 60),
    fmt=st.sampled_from(FMTS),
    rounding=st.sampled_from(ROUNDINGS),
)
def test_property_power_of_two_scaling_commutes(x, k, fmt, rounding):
    x = torch.where(x.abs() < 2.0**-60, 0.0, x)  # x · 2^k must stay a float32 normal
    packed, scales = formats.quantize(x, fmt, rounding)
    p2, s2 = formats.quantize(torch.ldexp(x, torch.tensor(float(k))), fmt, rounding)
    assert torch.equal(p2.view(torch.uint8), packed.view(torch.uint8))
    zero = x.view(-1, 32).abs().amax(-1) == 0  # a zero block keeps scale byte 0
    assert torch.equal(s2.long(), torch.where(zero, 0, scales.long() + k))


# ---------------------------------------------------------------------------- torchao

def _torchao_input(dtype: torch.dtype) -> torch.Tensor:
    """[48, 256]: blocks over a wide exponent range, blocks of E2M1/FP8 ties, blocks with a
    power-of-two or a format-maximum amax, zero, NaN, Inf and float32-subnormal blocks."""
    g = torch.Generator().manual_seed(4)
    exps = torch.randint(-40, 40, (48, 8), generator=g).float().repeat_interleave(32, 1)
    x = torch.randn(48, 256, generator=g) * torch.exp2(exps)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[0, :32] = mids.repeat(4) * torch.tensor([1.0, -1.0]).repeat(16)
    x[1, :32] = (torch.arange(32) / 4 + 440).float()  # around e4m3's 448 (ties every 16)
    x[2, :32] = torch.arange(32) * 1.0625
    x[3, :32] = 0.0
    x[3, 32:64] = 1.75 * 2.0**5  # a mantissa tie of the "even" rounding
    x[3, 64:96] = 448.0 * 2.0**-3
    x[4, 0] = math.nan
    x[5, 40] = math.inf
    x[6, 70] = -math.inf
    x[7, 100:132] = torch.randn(32, generator=g) * 2.0**-130
    return x.to(dtype)


def _rceil_log2_inexact(x: torch.Tensor, max_pos: float) -> torch.Tensor:
    """Blocks where torchao's eager RCEIL (ceil of a float32 log2 of amax / max_pos) is not
    exact: the quotient lies above a power of two but float32 log2 returns an integer."""
    descale = x.float().unflatten(-1, (-1, 32)).abs().amax(-1) / max_pos
    lg = torch.log2(descale)
    return (lg == torch.round(lg)) & (torch.exp2(lg) != descale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_bit_exact_against_torchao(dtype, fmt, rounding):
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    # torchao's RCEIL is 2^ceil(log2(amax / max_pos)): our round_up. FLOOR and EVEN match by name.
    mode = {"floor": ScaleCalculationMode.FLOOR, "round_up": ScaleCalculationMode.RCEIL,
            "even": ScaleCalculationMode.EVEN}[rounding]
    elem = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8": torch.float8_e4m3fn,
            "mxfp8_e5m2": torch.float8_e5m2}[fmt]
    x = _torchao_input(dtype)
    ao_scales, ao_data = to_mx(x, elem, 32, mode)
    ao_scales = ao_scales.view(torch.uint8)
    packed, scales = formats.quantize(x, fmt, rounding)
    ao_data, packed = ao_data.view(torch.uint8), packed.view(torch.uint8)
    assert ao_scales.shape == scales.shape and ao_data.shape == packed.shape

    blk = x.float().unflatten(-1, (-1, 32))
    # Intentional difference: DESIGN.md (and the OCP spec) give a block holding Inf scale
    # 0xFF; torchao derives a finite scale from the infinite amax. Those blocks are left out.
    inf_block = blk.isinf().any(-1)
    compare_scale = ~inf_block
    if rounding == "round_up":
        # torchao's eager RCEIL rounds log2 in float32, so for a quotient a few ulps above a
        # power of two it gets that power of two and saturates; mxfx (like triton_kernels and
        # the cvt.rp.ue8m0 instruction) rounds up exactly. test_scale_roundings_match_definitions
        # checks mxfx there; here those blocks are left out.
        compare_scale &= ~_rceil_log2_inexact(x, SPECS[fmt].max)
    assert torch.equal(scales[compare_scale], ao_scales[compare_scale])
    # Element bytes are compared where the scale is a finite, normal E8M0 value. Left out:
    # NaN/Inf blocks (their elements mean nothing) and scale byte 0, for which torchao divides
    # by 2^-126 (FLOOR/EVEN, avoiding float32 subnormals) or by 1 (RCEIL) instead of 2^-127.
    compare_data = compare_scale & (scales != 0) & (scales != 0xFF)
    per_byte = 2 if fmt == "mxfp4" else 1
    mask = compare_data.repeat_interleave(32 // per_byte, dim=-1)
    assert torch.equal(packed[mask], ao_data[mask])
    # The comparison covers almost everything: only the planted special blocks are left out.
    assert compare_data.sum() >= compare_data.numel() - 6


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8", "mxfp8_e5m2"])
def test_bad_block_elements_are_zero(bad, fmt):
    """A block holding NaN or Inf gets the NaN scale 0xFF and zero elements, as the kernels'
    quantizer writes it (its elements mean nothing under that scale)."""
    x = torch.randn(2, 64)
    x[0, 40] = bad
    packed, scales = formats.quantize(x, fmt, "floor")
    assert scales[0, 1] == 0xFF
    per_block = 32 // formats.element_format(fmt).per_byte
    block = packed[0, per_block:].view(torch.uint8)
    assert (block == 0).all(), block
