"""MX arithmetic inside Triton kernels, mirroring :mod:`mxfx.formats` bit for bit.

- :func:`mxfp4_dequant_halves` (portable, float32 halves of bytes) and
  :func:`mxfp4_words_bf16` / :func:`mxfp4_words_bf16_halves` (PTX on int32 words, CUDA
  sm_90+; :func:`ptx_unpack` and :func:`word_loadable` choose): MXFP4 weight unpack and
  scale in registers.
- :func:`qdq`: quantize-dequantize an activation tile per 32-block along K, with the same
  shared-exponent rule (``floor`` / ``round_up`` / ``even``) and element rounding (E2M1 or
  E4M3, nearest even, saturating) as :func:`mxfx.formats.quantize_dequantize`.
- :func:`quantize_parts`: the same quantization kept as MX elements and E8M0 scales (what
  ``tl.dot_scaled`` takes), bit for bit as :func:`mxfx.formats.quantize`.
- :func:`quantize_dequantize`, :func:`quantize`, :func:`dequantize_mxfp4`: those helpers as
  standalone kernels (the MoE quantizes its GEMM inputs with the first, or with the second
  where :func:`native_scaled_mma`; tests check all three bit for bit against
  :mod:`mxfx.formats`).

The bit tricks below rely on subnormals being kept (no flush to zero), which is what
Triton emits for plain float32 multiplies and what PTX bf16x2 multiplies do.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from mxfx import formats
from mxfx.kernels.launch import Launcher, cdiv

# Codes for the constexpr arguments of the kernels.
FMT_NONE, FMT_MXFP8, FMT_MXFP4 = 0, 1, 2
FMT_CODES = {"none": FMT_NONE, "mxfp8": FMT_MXFP8, "mxfp4": FMT_MXFP4}
ROUNDING_CODES = {"floor": 0, "round_up": 1, "even": 2}


@triton.jit
def pow2(e):
    """2.0**e in float32 for int32 ``e`` in [-127, 127] (2^-127 is the one subnormal)."""
    bits = tl.where(e == -127, 1 << 22, (e + 127) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_float(s):
    """E8M0 scale bytes → float32 (0xFF → NaN, 0 → 2^-127), as ``formats.scale_to_float``."""
    si = s.to(tl.int32)
    f = pow2(si - 127)
    return tl.where(si == 255, float("nan"), f)


@triton.jit
def mxfp4_dequant_halves(packed, scales, BN: tl.constexpr, BK: tl.constexpr):
    """Packed E2M1 ``uint8 [BN, BK/2]`` (element 2i in the low nibble) and E8M0 scales
    ``uint8 [BN, BK/32]`` → float32 ``(even, odd)``, each ``[BN, BK/2]``: the elements at
    K offsets 2i and 2i+1. A GEMM pairs them with the activations' even and odd columns,
    so the two halves are never interleaved in registers."""
    c = packed.to(tl.int32)
    # Nibble bits s.e.e.m placed as float32 sign, exponent LSBs and mantissa MSB give
    # 2^(e-127)·(1+m/2), a subnormal m·2^-127 for e = 0; times 2^126 that is the E2M1 value.
    # (2^126 cannot be folded into the scale: 2^126 * 2^(s-127) overflows float32 for s > 128.)
    lo = (((c & 0x7) << 22) | ((c & 0x8) << 28)).to(tl.float32, bitcast=True) * 8.507059173023462e37
    hi = (((c & 0x70) << 18) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True) * 8.507059173023462e37
    scale = e8m0_to_float(scales)[:, :, None]
    lo = tl.reshape(tl.reshape(lo, (BN, BK // 32, 16)) * scale, (BN, BK // 2))
    hi = tl.reshape(tl.reshape(hi, (BN, BK // 32, 16)) * scale, (BN, BK // 2))
    return lo, hi


def _ptx_unpack_word(outputs: tuple[tuple[int, int, int], ...]) -> tl.constexpr:
    """PTX for one int32 word ($4: 4 packed bytes, 8 E2M1 values) times a bf16x2 scale
    ($5, the same scale in both halves) → four bf16x2 words $0..$3.

    prmt looks the high and the low byte of each value's bf16 magnitude up from 8-entry
    tables indexed by its 3 magnitude bits (bytes 0-1 of the word, then bytes 2-3), a second
    prmt pairs two of those values into one output, a third gathers the two sign bits, which
    lop3 moves in; one bf16x2 multiply scales (exact: at most 2 mantissa bits times a power
    of two). ``outputs[i] = (bytes, pair, signs)``: ``bytes`` 0 or 1 for bytes 0-1 or 2-3,
    ``pair`` the prmt selector over (low-byte table, high-byte table) results, ``signs``
    the prmt selector over (word << 4, word) putting the two sign bits at bits 15 and 31.
    bf16x2 multiplies need sm_90.
    """
    lines = [
        "{",
        ".reg .b32 c0, c1, r4, hb0, lb0, hb1, lb1, v, s, th0, tl0, tl1, sm;",
        "mov.b32 th0, 0x3F3F3F00;", "mov.b32 tl0, 0xC0800000;", "mov.b32 tl1, 0xC0804000;",
        "mov.b32 sm, 0x80008000;",
        "and.b32 c0, $4, 0x7777;", "shr.b32 c1, $4, 16;", "and.b32 c1, c1, 0x7777;", "shl.b32 r4, $4, 4;",
        "prmt.b32 hb0, th0, 0x40404040, c0;", "prmt.b32 lb0, tl0, tl1, c0;",
        "prmt.b32 hb1, th0, 0x40404040, c1;", "prmt.b32 lb1, tl0, tl1, c1;",
    ]
    for i, (half, pair, signs) in enumerate(outputs):
        lines += [f"prmt.b32 v, lb{half}, hb{half}, {pair:#06x};", f"prmt.b32 s, r4, $4, {signs:#06x};",
                  "lop3.b32 v, v, s, sm, 0xF8;", f"mul.rn.bf16x2 ${i}, v, $5;"]
    return tl.constexpr("\n".join(lines + ["}"]))


# Values in K order: out i = elements 2i, 2i+1 (the two nibbles of byte i).
_PTX_PAIRS = _ptx_unpack_word(((0, 0x5140, 0x4000), (0, 0x7362, 0x5010), (1, 0x5140, 0x6020),
                               (1, 0x7362, 0x7030)))
# Halves: $0, $1 = the even elements (low nibbles) of bytes 0-1, 2-3; $2, $3 = the odd ones.
_PTX_HALVES = _ptx_unpack_word(((0, 0x6240, 0x1000), (1, 0x6240, 0x3020), (0, 0x7351, 0x5040),
                                (1, 0x7351, 0x7060)))


@triton.jit
def _scale_words(scales, BN: tl.constexpr, BK: tl.constexpr):
    """E8M0 ``uint8 [BN, BK/32]`` → int32 ``[BN, BK/8]``: each word's scale as bf16x2 bits
    ``2^(s-127)`` in both halves (s = 0 is the bf16 subnormal 2^-127, 0xFF → NaN)."""
    si = scales.to(tl.int32)
    sb = tl.where(si == 0, 0x40, tl.where(si == 255, 0x7FC0, si << 7))
    sb = sb | (sb << 16)
    return tl.reshape(tl.broadcast_to(sb[:, :, None], (BN, BK // 32, 4)), (BN, BK // 8))


@triton.jit
def _bf16x2(w):
    """int32 bf16x2 bits → (low, high) bfloat16."""
    return w.to(tl.int16).to(tl.bfloat16, bitcast=True), (w >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _join4(a, b, c, d, BN: tl.constexpr, N: tl.constexpr):
    """``[BN, N/4]`` ×4 → ``[BN, N]`` with a, b, c, d at offsets 4i, 4i+1, 4i+2, 4i+3."""
    return tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), (BN, N))


@triton.jit
def _unpack_words(asm: tl.constexpr, words, scales, BN: tl.constexpr, BK: tl.constexpr):
    """The four bf16x2 outputs of ``asm`` on each word, as (low, high) bfloat16 halves."""
    w0, w1, w2, w3 = tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r", [words, _scale_words(scales, BN, BK)],
                                               dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                               is_pure=True, pack=1)
    a0, b0 = _bf16x2(w0)
    a1, b1 = _bf16x2(w1)
    a2, b2 = _bf16x2(w2)
    a3, b3 = _bf16x2(w3)
    return a0, b0, a1, b1, a2, b2, a3, b3


@triton.jit
def mxfp4_words_bf16(words, scales, BN: tl.constexpr, BK: tl.constexpr):
    """MXFP4 as int32 ``words [BN, BK/8]`` (4 packed bytes each, element 2i in byte i's low
    nibble) with scales ``uint8 [BN, BK/32]`` → the bfloat16 tile ``[BN, BK]`` (CUDA sm_90+,
    PTX): about 3 instructions per weight, bit-identical to :func:`mxfp4_dequant_halves`
    rounded to bf16. Loading words rather than bytes spares repacking bytes into registers."""
    a0, b0, a1, b1, a2, b2, a3, b3 = _unpack_words(_PTX_PAIRS, words, scales, BN, BK)
    even = _join4(a0, a1, a2, a3, BN, BK // 2)
    odd = _join4(b0, b1, b2, b3, BN, BK // 2)
    return tl.reshape(tl.join(even, odd), (BN, BK))


@triton.jit
def mxfp4_words_bf16_halves(words, scales, BN: tl.constexpr, BK: tl.constexpr):
    """:func:`mxfp4_words_bf16` as the halves of :func:`mxfp4_dequant_halves`: ``(even, odd)``
    bfloat16 ``[BN, BK/2]``, the elements at K offsets 2i and 2i+1."""
    e0, e1, e2, e3, o0, o1, o2, o3 = _unpack_words(_PTX_HALVES, words, scales, BN, BK)
    return _join4(e0, e1, e2, e3, BN, BK // 2), _join4(o0, o1, o2, o3, BN, BK // 2)


@functools.lru_cache(maxsize=None)
def _has_bf16x2_ptx(device: torch.device) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= (9, 0)


def ptx_unpack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether MXFP4 weights for ``dtype`` operands on ``device`` can be unpacked by
    :func:`mxfp4_words_bf16` (bf16 on CUDA sm_90+) rather than the portable
    :func:`mxfp4_dequant_halves`; the packed bytes must also load as words
    (:func:`word_loadable`)."""
    return dtype == torch.bfloat16 and device.type == "cuda" and _has_bf16x2_ptx(device)


@functools.lru_cache(maxsize=None)
def _native_scaled_mma(device: torch.device) -> bool:
    if torch.version.hip:
        return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0] == "gfx950"
    return torch.cuda.get_device_capability(device)[0] >= 10


def native_scaled_mma(device: torch.device) -> bool:
    """Whether ``device`` has MX matrix instructions (NVIDIA sm_100 and later, AMD gfx950),
    which ``tl.dot_scaled`` uses for MX activations times MXFP4 weights."""
    return device.type == "cuda" and _native_scaled_mma(device)


def word_loadable(packed: torch.Tensor) -> bool:
    """Whether packed MXFP4 bytes (K last, contiguous) can be read as aligned int32 words:
    4-byte aligned start and every other stride a multiple of 4 bytes."""
    return (packed.stride(-1) == 1 and packed.data_ptr() % 4 == 0
            and all(st % 4 == 0 for st in packed.stride()[:-1]))


@triton.jit
def _round_mantissa_even(x, MBITS: tl.constexpr):
    """Non-negative finite float32 ``x`` to ``MBITS`` mantissa bits, ties to even."""
    DROP: tl.constexpr = 23 - MBITS
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> DROP) & 1
    bits = (bits + ((1 << (DROP - 1)) - 1) + lsb) & ~((1 << DROP) - 1)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_e2m1(mag):
    """Non-negative float32 ``mag`` to the nearest E2M1 magnitude, ties to the even code,
    saturating at 6: the same midpoint rule as ``formats._encode_e2m1``."""
    r = tl.where(mag > 0.25, 0.5, 0.0)
    r += tl.where(mag >= 0.75, 0.5, 0.0)
    r += tl.where(mag > 1.25, 0.5, 0.0)
    r += tl.where(mag >= 1.75, 0.5, 0.0)
    r += tl.where(mag > 2.5, 1.0, 0.0)
    r += tl.where(mag >= 3.5, 1.0, 0.0)
    r += tl.where(mag > 5.0, 2.0, 0.0)
    return r


@triton.jit
def _round_e4m3(mag):
    """Non-negative float32 ``mag`` <= 448 to the nearest float8_e4m3fn value, ties to even."""
    # Below 2^-6 the grid is the subnormal step 2^-9: adding 2^14 makes float32's own
    # rounding land on that grid.
    sub = (mag + 16384.0) - 16384.0
    return tl.where(mag < 0.015625, sub, _round_mantissa_even(mag, 3))


@triton.jit
def _mx_blocks(x, FMT: tl.constexpr, ROUNDING: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """The MX quantization of ``x [BM, BK]`` per 32-block along K: the elements' rounded
    magnitudes (float32, in units of the scale) and sign bits ``[BM, BK/32, 32]``, the
    shared exponents and whether each block holds NaN or Inf ``[BM, BK/32]``."""
    if FMT == 2:
        EMAX: tl.constexpr = 2
        MBITS: tl.constexpr = 1
        MAXV: tl.constexpr = 6.0
    else:
        EMAX: tl.constexpr = 8
        MBITS: tl.constexpr = 3
        MAXV: tl.constexpr = 448.0
    xb = tl.reshape(x.to(tl.float32), (BM, BK // 32, 32))
    mag = tl.abs(xb)
    finite = mag < float("inf")
    bad = tl.max(tl.where(finite, 0, 1), axis=2) > 0
    amax = tl.max(tl.where(finite, mag, 0.0), axis=2)
    if ROUNDING == 2:
        amax = _round_mantissa_even(amax, MBITS)
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - EMAX
    if ROUNDING == 1:
        e += (amax > MAXV * pow2(e)).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -127), 127)
    v = tl.where(finite, xb, 0.0) * pow2(-e)[:, :, None]
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    if FMT == 2:
        r = _round_e2m1(tl.abs(v))
    else:
        r = _round_e4m3(tl.minimum(tl.abs(v), MAXV))
    return r, sign, e, bad


@triton.jit
def qdq(x, FMT: tl.constexpr, ROUNDING: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """MX quantize-dequantize of ``x [BM, BK]`` per 32-block along K → ``x.dtype``.

    ``FMT``: 1 mxfp8 (E4M3), 2 mxfp4 (E2M1). ``ROUNDING``: 0 floor, 1 round_up, 2 even.
    A block holding NaN or Inf comes back all NaN.
    """
    r, sign, e, bad = _mx_blocks(x, FMT, ROUNDING, BM, BK)
    q = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    y = q * pow2(e)[:, :, None]
    y = tl.where(bad[:, :, None], float("nan"), y)
    return tl.reshape(y, (BM, BK)).to(x.dtype)


@triton.jit
def quantize_parts(x, FMT: tl.constexpr, ROUNDING: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """MX quantization of ``x [BM, BK]`` per 32-block along K, as :func:`mxfx.formats.quantize`
    → ``(elements, scales)``: uint8 ``[BM, BK]`` float8_e4m3fn bits (``FMT`` 1) or
    ``[BM, BK/2]`` E2M1 codes, element 2i in the low nibble (``FMT`` 2); uint8 E8M0 scales
    ``[BM, BK/32]``, 0xFF for a block holding NaN or Inf (whose elements are then 0)."""
    r, sign, e, bad = _mx_blocks(x, FMT, ROUNDING, BM, BK)
    r = tl.where(bad[:, :, None], 0.0, r)
    neg = (sign != 0) & ~bad[:, :, None]
    if FMT == 2:
        r2 = (r * 2.0).to(tl.int32)  # the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 doubled
        code = tl.where(r2 <= 4, r2, tl.where(r2 == 6, 5, tl.where(r2 == 8, 6, 7)))
        code = tl.reshape(code | (neg.to(tl.int32) << 3), (BM, BK // 2, 2))
        lo, hi = tl.split(code)
        elements = (lo | (hi << 4)).to(tl.uint8)
    else:
        # E4M3: exponent bias 7, three mantissa bits; below 2^-6 the subnormal steps of 2^-9.
        bits = r.to(tl.int32, bitcast=True)
        normal = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)
        code = tl.where(r >= 0.015625, normal, (r * 512.0).to(tl.int32))
        elements = tl.reshape(code | (neg.to(tl.int32) << 7), (BM, BK)).to(tl.uint8)
    scales = tl.where(bad, 255, e + 127).to(tl.uint8)
    return elements, scales


@triton.jit
def _qdq_kernel(x_ptr, out_ptr, M, K, stride_xm, stride_om, FMT: tl.constexpr, ROUNDING: tl.constexpr,
                BM: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], qdq(x, FMT, ROUNDING, BM, BK),
             mask=mask)


_QDQ = Launcher(_qdq_kernel)


def quantize_dequantize(x: torch.Tensor, fmt: str, scale_rounding: str = "even",
                        out: Optional[torch.Tensor] = None, dependents: bool = False) -> torch.Tensor:
    """:func:`mxfx.formats.quantize_dequantize` of a 2-D ``x [M, K]`` (K a multiple of 32)
    computed by :func:`qdq` in a Triton kernel; ``fmt`` is ``"mxfp8"`` or ``"mxfp4"``.
    ``out``: where to write (``x`` itself for in place; x's shape and dtype, unit stride along K;
    by default a new contiguous tensor). ``dependents`` (CUDA): a launch after it by PDL
    (programmatic dependent launch) may start at once, and must wait for it before reading
    ``out``."""
    if fmt not in ("mxfp8", "mxfp4"):
        raise ValueError(f"fmt: got {fmt!r}, expected 'mxfp8' or 'mxfp4'")
    formats.check_scale_rounding(scale_rounding)
    if x.dim() != 2 or x.shape[1] % formats.BLOCK != 0:
        raise ValueError(f"x: expected [M, K] with K a multiple of 32, got shape {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    M, K = x.shape
    bm, bk = 16, 64
    grid = (cdiv(M, bm), cdiv(K, bk))
    if M and K:
        _QDQ[grid](x, out, M, K, x.stride(0), out.stride(0), FMT=FMT_CODES[fmt],
                   ROUNDING=ROUNDING_CODES[scale_rounding], BM=bm, BK=bk, PDL=dependents)
    return out


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, FMT: tl.constexpr,
                     ROUNDING: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    row_ok = (rows < M)[:, None]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :],
                mask=row_ok & (cols < K)[None, :], other=0.0)
    elements, scales = quantize_parts(x, FMT, ROUNDING, BM, BK)
    QK: tl.constexpr = BK // 2 if FMT == 2 else BK
    qc = tl.program_id(1) * QK + tl.arange(0, QK)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_qm + qc[None, :], elements,
             mask=row_ok & (qc < K // (BK // QK))[None, :])
    sc = tl.program_id(1) * (BK // 32) + tl.arange(0, BK // 32)
    tl.store(s_ptr + rows.to(tl.int64)[:, None] * stride_sm + sc[None, :], scales,
             mask=row_ok & (sc < K // 32)[None, :])


_QUANTIZE = Launcher(_quantize_kernel)


def quantize(x: torch.Tensor, fmt: str, scale_rounding: str = "even") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mxfx.formats.quantize` of a 2-D ``x [M, K]`` (K a multiple of 32, unit stride
    along K) in a Triton kernel → ``(elements, scales)``, both uint8: ``[M, K]`` float8_e4m3fn
    bits (``"mxfp8"``) or ``[M, K/2]`` packed E2M1 codes (``"mxfp4"``), and ``[M, K/32]`` E8M0."""
    if fmt not in ("mxfp8", "mxfp4"):
        raise ValueError(f"fmt: got {fmt!r}, expected 'mxfp8' or 'mxfp4'")
    formats.check_scale_rounding(scale_rounding)
    if x.dim() != 2 or x.shape[1] % formats.BLOCK != 0 or x.stride(1) != 1:
        raise ValueError(f"x: expected [M, K] with K a multiple of 32 and unit stride along K, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    M, K = x.shape
    q = torch.empty(M, K // 2 if fmt == "mxfp4" else K, dtype=torch.uint8, device=x.device)
    s = torch.empty(M, K // formats.BLOCK, dtype=torch.uint8, device=x.device)
    bm, bk = 16, 64
    if M and K:
        _QUANTIZE[(cdiv(M, bm), cdiv(K, bk))](x, q, s, M, K, x.stride(0), q.stride(0), s.stride(0),
                                              FMT=FMT_CODES[fmt], ROUNDING=ROUNDING_CODES[scale_rounding],
                                              BM=bm, BK=bk)
    return q, s


@triton.jit
def _dequant_kernel(p_ptr, s_ptr, out_ptr, M, K, PTX: tl.constexpr, BM: tl.constexpr,
                    BK: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    kg = tl.program_id(1) * (BK // 32) + tl.arange(0, BK // 32)
    r_ok = (rows < M)[:, None]
    s = tl.load(s_ptr + rows[:, None] * (K // 32) + kg[None, :], mask=r_ok & (kg < K // 32)[None, :], other=127)
    if PTX:
        kw = tl.program_id(1) * (BK // 8) + tl.arange(0, BK // 8)
        words = tl.load(p_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (K // 8) + kw[None, :],
                        mask=r_ok & (kw < K // 8)[None, :], other=0)
        v = mxfp4_words_bf16(words, s, BM, BK)
    else:
        kp = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)
        p = tl.load(p_ptr + rows[:, None] * (K // 2) + kp[None, :], mask=r_ok & (kp < K // 2)[None, :], other=0)
        even, odd = mxfp4_dequant_halves(p, s, BM, BK)
        v = tl.reshape(tl.join(even, odd), (BM, BK))
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    tl.store(out_ptr + rows[:, None] * K + k[None, :], v.to(out_ptr.dtype.element_ty),
             mask=r_ok & (k < K)[None, :])


_DEQUANT = Launcher(_dequant_kernel)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`mxfx.formats.dequantize` of MXFP4 ``packed uint8 [M, K/2]`` with ``scales uint8
    [M, K/32]``, unpacked by the same in-register code as the MoE kernels → ``[M, K]``."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"packed, scales: got {packed.dtype}, {scales.dtype}, expected uint8")
    M, half = packed.shape
    if tuple(scales.shape) != (M, half // 16) or half % 16:
        raise ValueError(
            f"scales: got shape {tuple(scales.shape)} for packed {tuple(packed.shape)}, "
            f"expected [M, K/32] with K a multiple of 32"
        )
    K = half * 2
    out = torch.empty(M, K, dtype=out_dtype, device=packed.device)
    bm, bk = 16, 64
    packed = packed.contiguous()
    if M and K:
        _DEQUANT[(cdiv(M, bm), cdiv(K, bk))](
            packed, scales.contiguous(), out, M, K,
            PTX=ptx_unpack(out_dtype, packed.device) and word_loadable(packed), BM=bm, BK=bk)
    return out
