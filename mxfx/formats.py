"""OCP Microscaling (MX v1.0) formats in plain torch: the bit-exact reference.

A tensor is quantized along its last dimension in blocks of 32 elements. Each block
shares one E8M0 scale byte (a power of two, bias 127, 0xFF = NaN); its elements are
E2M1 (``"mxfp4"``, two per byte, element 2i in the low nibble) or FP8
(``"mxfp8"`` = float8_e4m3fn, ``"mxfp8_e5m2"``).

Scale rounding (``scale_rounding``), with ``emax`` the element format's largest
exponent and ``max_elem`` its largest value:

- ``"floor"``: 2^(floor(log2 amax) - emax), the spec's choice. Values above
  ``max_elem`` after scaling saturate.
- ``"round_up"``: 2^ceil(log2(amax / max_elem)); nothing saturates.
- ``"even"``: amax is first rounded to the element's mantissa width (round to nearest
  even), then ``floor``; what AMD Quark calibrates with.

Elements round to nearest even and saturate at ±max_elem. A block holding NaN or Inf
gets scale 0xFF and dequantizes to NaN whole. An all-zero block gets scale 0 (2^-127).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF
SCALE_ROUNDINGS = ("floor", "round_up", "even")


@dataclass(frozen=True)
class ElementFormat:
    name: str
    emax: int  # exponent of the largest normal value
    mbits: int  # explicit mantissa bits
    max_value: float
    storage: torch.dtype  # dtype of the packed tensor

    @property
    def per_byte(self) -> int:
        return 2 if self.name == "mxfp4" else 1


FORMATS: dict[str, ElementFormat] = {
    "mxfp4": ElementFormat("mxfp4", emax=2, mbits=1, max_value=6.0, storage=torch.uint8),
    "mxfp8": ElementFormat("mxfp8", emax=8, mbits=3, max_value=448.0, storage=torch.float8_e4m3fn),
    "mxfp8_e5m2": ElementFormat(
        "mxfp8_e5m2", emax=15, mbits=2, max_value=57344.0, storage=torch.float8_e5m2
    ),
}

# E2M1 magnitudes by code 0..7; codes 8..15 are the same with the sign bit set.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes. A tie rounds up only when the upper code is
# even (round half to even on the code), i.e. at the midpoints with odd index.
_E2M1_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_VALUES, E2M1_VALUES[1:]))


def element_format(fmt: str) -> ElementFormat:
    """The element format called ``fmt``; ``ValueError`` naming the valid ones otherwise."""
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"fmt: got {fmt!r}, expected one of {sorted(FORMATS)}") from None


def check_scale_rounding(scale_rounding: str, argument: str = "scale_rounding") -> None:
    if scale_rounding not in SCALE_ROUNDINGS:
        raise ValueError(
            f"{argument}: got {scale_rounding!r}, expected one of {list(SCALE_ROUNDINGS)}"
        )


def _float_exponent(x: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent field of non-negative float32 ``x`` (subnormals and 0 give -127)."""
    return ((x.view(torch.int32) >> 23) & 0xFF) - 127


def _round_mantissa_even(x: torch.Tensor, mbits: int) -> torch.Tensor:
    """Non-negative finite float32 ``x`` rounded to ``mbits`` mantissa bits, ties to even."""
    drop = 23 - mbits
    bits = x.view(torch.int32)
    lsb = (bits >> drop) & 1
    bits = (bits + ((1 << (drop - 1)) - 1) + lsb) & ~((1 << drop) - 1)
    return bits.view(torch.float32)


def shared_exponent(amax: torch.Tensor, fmt: str, scale_rounding: str) -> torch.Tensor:
    """Unbiased int32 block exponent in [-127, 127] for float32 block maxima ``amax``.

    Non-finite maxima are not handled here (the caller marks those blocks 0xFF).
    """
    ef = element_format(fmt)
    check_scale_rounding(scale_rounding)
    amax = amax.to(torch.float32)
    if scale_rounding == "even":
        amax = _round_mantissa_even(amax, ef.mbits)
    e = _float_exponent(amax) - ef.emax
    if scale_rounding == "round_up":
        # Smallest e with amax <= max_elem * 2^e: the floor estimate, or one more.
        bound = torch.ldexp(torch.full_like(amax, ef.max_value), e.to(torch.float32))
        e = e + (amax > bound).to(torch.int32)
    return e.clamp(-E8M0_BIAS, E8M0_BIAS)


def _encode_e2m1(v: torch.Tensor) -> torch.Tensor:
    """float32 ``v`` (already scaled) → uint8 E2M1 codes 0..15, RNE with saturation."""
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        up = mag > mid
        if i % 2 == 1:
            up = up | (mag == mid)
        code += up.to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def _decode_e2m1(code: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes → float32 values, from the bits: a lookup table would be a host-to-device
    copy, which a CUDA graph capture (a compiled model's dequantizing weights) refuses."""
    e = ((code >> 1) & 3).to(torch.float32)
    m = (code & 1).to(torch.float32)
    mag = torch.where(e > 0, 2 + m, 2 * m) * torch.exp2(e - 2)  # subnormal at e = 0: m / 2
    return torch.where((code & 8) != 0, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] → packed uint8 [..., K/2], element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., K/2] → uint8 codes [..., K]."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def scale_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes → float32 powers of two (0xFF → NaN, 0 → 2^-127)."""
    e = scales.to(torch.int32) - E8M0_BIAS
    s = torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device), e.to(torch.float32))
    return torch.where(scales == E8M0_NAN, torch.nan, s)


def quantize(
    x: torch.Tensor, fmt: str = "mxfp4", scale_rounding: str = "floor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float ``x [..., K]`` to MX along the last dimension.

    Returns ``(packed, scales)``: for ``"mxfp4"`` packed is uint8 ``[..., K/2]``; for the FP8
    formats it is the float8 dtype ``[..., K]``. Scales are uint8 ``[..., K/32]`` (E8M0).
    Both are contiguous. ``K`` must be a multiple of 32. float64 input is rounded to float32
    first (as torch's own float64 → float8 casts do), so it is exact only for float32 values.
    """
    ef = element_format(fmt)
    check_scale_rounding(scale_rounding)
    if not x.is_floating_point():
        raise TypeError(f"x: got dtype {x.dtype}, expected a floating-point tensor")
    if x.dim() == 0 or x.shape[-1] % BLOCK != 0:
        raise ValueError(
            f"x: last dimension must be a multiple of {BLOCK}, got shape {tuple(x.shape)}"
        )
    shape = x.shape
    blocks = x.to(torch.float32).reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    bad = ~torch.isfinite(amax)
    exp = shared_exponent(torch.where(bad, 0.0, amax), fmt, scale_rounding)
    scales = torch.where(bad, E8M0_NAN, exp + E8M0_BIAS).to(torch.uint8)
    # Multiply by 2^-e: exact, and 2^127 and 2^-127 are both representable in float32.
    inv = torch.ldexp(torch.ones_like(amax), (-exp).to(torch.float32))
    scaled = torch.where(bad.unsqueeze(-1), 0.0, blocks * inv.unsqueeze(-1))
    scaled = scaled.reshape(shape)
    if ef.name == "mxfp4":
        packed = pack_fp4(_encode_e2m1(scaled))
    else:
        packed = scaled.clamp(-ef.max_value, ef.max_value).to(ef.storage)
    return packed.contiguous(), scales.contiguous()


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    fmt: str = "mxfp4",
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``[..., K]`` in ``out_dtype`` (computed in float32)."""
    ef = element_format(fmt)
    if ef.name == "mxfp4":
        values = _decode_e2m1(unpack_fp4(packed))
    else:
        values = packed.to(torch.float32)
    k = values.shape[-1]
    s = scale_to_float(scales)
    values = values.reshape(*values.shape[:-1], k // BLOCK, BLOCK) * s.unsqueeze(-1)
    return values.reshape(*values.shape[:-2], k).to(out_dtype)


def quantize_dequantize(
    x: torch.Tensor, fmt: str, scale_rounding: str = "even"
) -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x.dtype``: what an MX-quantized activation holds."""
    packed, scales = quantize(x, fmt, scale_rounding)
    return dequantize(packed, scales, fmt, x.dtype)
