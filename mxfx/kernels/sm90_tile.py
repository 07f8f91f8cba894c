"""The tile that both Hopper MoE kernels (:mod:`mxfx.kernels.moe_sm90`,
:mod:`mxfx.kernels.moe_sm90_ws`) build on, in Gluon: which weight rows a tile of 64 takes
(:func:`weight_rows`), how a warpgroup unpacks their MXFP4 words straight into MMA A fragments
(:func:`unpack_a`, by one of two PTX unpacks), and the epilogue that stores the accumulator
(:func:`epilogue`: bias, gated activation, routing weight, activation quantization).

- Each lane loads whole 16-byte, 32-K segments of its two fragment rows (one load and one
  scale byte per row and segment) and unpacks every packed byte into one bf16x2 register that
  *is* an A-fragment pair: no shared-memory round trip for the weights. That puts the dot's K
  in a permuted order inside each 128-wide K step (:func:`to_dot_order`), which the
  activations follow, so the sum is the same.
- Gated tiles interleave gate and up rows by 8 so that one thread holds both halves of a
  column (accumulator rows r and r+8).
- :func:`ordered_copy` writes activations in those orders (the dot's, or only the unpack's K
  pairs) for the kernels that read them so, quantize-dequantized on the way under activation
  quantization.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mxfx.kernels import mx
from mxfx.kernels.launch import Launcher, cdiv
from mxfx.moe_call import ActivationQuant


def _times_scale(v: str) -> str:
    """The PTX that ends both unpacks: registers ``v0``..``v3`` (bf16x2) times the scale of
    byte $12, into $0..$3. Scale: ((2s + [s == 255]) << 6 in both halves, the bracket from
    (513s + 1) >> 8), so 255 gives a NaN mantissa; max(., 1) turns s = 0 into 0x0040 = 2^-127."""
    return ("mad.lo.u32 x, $12, 513, 1;\nshr.u32 x, x, 8;\nmax.u32 x, x, 1;\nmul.lo.u32 x, x, 0x00400040;\n"
            + "".join(f"mul.rn.bf16x2 ${i}, {v}{i}, x;\n" for i in range(4)) + "}\n")


# One int32 word (8 E2M1 values, the K pairs of bytes 0..3) and its E8M0 scale byte s → four
# bf16x2 words, word j = (low nibble, high nibble) of byte j, times 2^(s-127). Two 8-entry byte
# tables are looked up by prmt: the bf16's low byte from the magnitude bits (e1 e0 m), its high
# byte from (sign, e1, e0|m), so the sign costs nothing extra. The tables' low words come in
# registers ($20, $28): ptxas would otherwise copy an immediate before every prmt. pack=8
# (elementwise asm has one output per input element): each input comes in 8 copies ($4..,
# $12.., $20.., $28..), of which only the first is read.
UNPACK = gl.constexpr("""
{
.reg .b32 a, b, t, ah, bh, l0, h0, l1, h1, r0, r1, r2, r3, x;
and.b32 a, $4, 0x77777777;
shr.u32 t, $4, 1;
lop3.b32 b, t, $4, 0x11111111, 0xF8;
and.b32 b, b, 0x77777777;
shr.u32 ah, a, 16;
shr.u32 bh, b, 16;
prmt.b32 l0, $20, 0xC0804000, a;
prmt.b32 h0, $28, 0xC0C0BF80, b;
prmt.b32 l1, $20, 0xC0804000, ah;
prmt.b32 h1, $28, 0xC0C0BF80, bh;
prmt.b32 r0, l0, h0, 0x5140;
prmt.b32 r1, l0, h0, 0x7362;
prmt.b32 r2, l1, h1, 0x5140;
prmt.b32 r3, l1, h1, 0x7362;
""" + _times_scale("r"))


_UNPACK_CONSTRAINTS = gl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 32))


# The same for the mma.sync path, with the work split between the ALU and FMA pipes rather than
# all of it on the ALU pipe (prmt, lop3, shifts): word r = (element r, element r + 4). Nibble r
# of each 16-bit half is masked in and multiplied by 2^a + 2^b, which places two copies of it,
# the magnitude bits (e1 e0 m) at bf16 bits 8:6 and the sign at bit 15, and a mask keeps only
# those. That reads as 2^(e-127)·(1+m/2), or the subnormal m·2^-127 for e = 0: the E2M1 value
# times 2^-126 either way, which a multiply by 2^126 ($20, in a register) makes exact; elements
# 2, 3, 6, 7 are the same nibbles of the word shifted by 8. One more bf16x2 multiply per output
# and the activations re-paired to match, but a fifth fewer ALU instructions in the mma.sync
# loop (H200, graph µs, T=1: gpt-oss-120b 32.4-32.6 -> 31.6, MiniMax-M3 54.7-54.9 -> 51.5-51.7,
# Mixtral-8x7B 76.6-77.9 -> 73.0-73.4; Qwen3-30B-A3B 17.8-17.9 -> 18.2). In the warp-specialized
# kernel, where the FMA pipe is busier, it was slower (gpt-oss-120b T=2048 1311 -> 1342).
_SPLIT_BITS = """
{
.reg .b32 h, a0, a1, a2, a3, x;
shr.u32 h, $4, 8;
and.b32 a0, $4, 0x000F000F;
and.b32 a1, $4, 0x00F000F0;
and.b32 a2, h, 0x000F000F;
and.b32 a3, h, 0x00F000F0;
mul.lo.u32 a0, a0, 0x1040;
mul.lo.u32 a1, a1, 0x104;
mul.lo.u32 a2, a2, 0x1040;
mul.lo.u32 a3, a3, 0x104;
and.b32 a0, a0, 0x81C081C0;
and.b32 a1, a1, 0x81C081C0;
and.b32 a2, a2, 0x81C081C0;
and.b32 a3, a3, 0x81C081C0;
"""
UNPACK_SPLIT = gl.constexpr(_SPLIT_BITS + "".join(f"mul.rn.bf16x2 a{i}, a{i}, $20;\n" for i in range(4))
                            + _times_scale("a"))

# UNPACK_SPLIT with 2^126 and the scale 2^(s-127) in one multiply by 2^(s-1): exact for s <= 128
# (bf16 has no 2^128), the scales of weights whose 32-blocks stay under 16 in magnitude; for larger
# scales the outputs are wrong and the caller must redo them by UNPACK_SPLIT (as
# moe_sm90_loops._k_loops_exact does). Half the mma.sync loop's bf16x2 multiplies (SASS per two
# K steps of 8-row blocks 474 -> 408 instructions); H200, graph µs, min-max of 2 alternating
# processes, with the check and the redo: gpt-oss-120b T=8 151.3-151.6 -> 142.5-143.1, T=64
# 539.4-540.5 -> 512.8-518.7; MiniMax-M3 T=8 313.3-313.4 -> 292.6-300.0; Mixtral-8x7B T=8
# 244.8-247.7 -> 232.8-233.3; Qwen3-30B-A3B T=32 118.9-120.1 -> 113.8.
UNPACK_SPLIT_SMALL = gl.constexpr(_SPLIT_BITS + "mad.lo.u32 x, $12, 0x00800080, 0x3F003F00;\n"
                                  + "".join(f"mul.rn.bf16x2 ${i}, a{i}, x;\n" for i in range(4)) + "}\n")
# The largest scale (E8M0 byte) UNPACK_SPLIT_SMALL is exact for.
SMALL_SCALES_MAX = gl.constexpr(128)


_UNPACK_SPLIT_CONSTRAINTS = gl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 24))
_UNPACK_SPLIT_SMALL_CONSTRAINTS = gl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 16))


@gluon.jit
def over_small_scales(smax):
    """Whether the largest of the scales ``smax`` (uint8, 3-D) is over :data:`SMALL_SCALES_MAX`,
    past which :data:`UNPACK_SPLIT_SMALL` is wrong: the caller computes those weights again the
    exact way."""
    return gl.max(gl.max(gl.max(smax.to(gl.int32), 2), 1), 0) > SMALL_SCALES_MAX


@gluon.constexpr_function
def tile_cols(gated):
    """Output columns of a warpgroup's 64 weight rows: 32 of a gated GEMM (a gate and an up row
    each, see :func:`weight_rows`), else 64."""
    return 32 if gated else 64


@gluon.constexpr_function
def log2(n):
    assert n & (n - 1) == 0, n
    return n.bit_length() - 1


@gluon.constexpr_function
def w_layout(NI, NW=4, J=4):
    """``[16 NW, NI, 4, J, 8]`` (tile row, segment group i, lane c = segment c + 4i, word in the
    segment, value in the word): a thread owns rows 16w + t/4 and +8 and its J words of a
    segment are contiguous (J = 4: all of them; fewer: the words of one part of a K step,
    see :func:`unpack_a`)."""
    reg = [[0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 0, 4]] + [[0, 0, 0, 1 << b, 0] for b in range(log2(J))]
    reg += [[8, 0, 0, 0, 0]] + [[0, 1 << b, 0, 0, 0] for b in range(log2(NI))]
    lane = [[0, 0, 1, 0, 0], [0, 0, 2, 0, 0], [1, 0, 0, 0, 0], [2, 0, 0, 0, 0], [4, 0, 0, 0, 0]]
    warp = [[16 << b, 0, 0, 0, 0] for b in range(log2(NW))]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [16 * NW, NI, 4, J, 8])


@gluon.jit
def to_dot_order(v, R: gl.constexpr, BK: gl.constexpr):
    """``[R, NI, 4, J, 8]`` in natural K order (k = 128i + 32c + 8j + 2b + e, byte 4j + b)
    → ``[R, BK]`` in the dot's order (k' = 128i + 32j + 16(b//2) + 8(b%2) + 2c + e). With
    J < 4 words per segment (BK = 32 J), the first J words of each segment in that order: the
    first 32 J columns of a 128-wide step."""
    J: gl.constexpr = 4 if BK >= 128 else BK // 32
    v = gl.reshape(v, [R, BK // (32 * J), 4, J, 2, 2, 2])
    v = gl.permute(v, DOT_PERM.value)
    return gl.reshape(v, [R, BK])


# to_dot_order's permutation of ``[R, NI, 4, J, 2, 2, 2]`` (row, step, segment c, word j, bits of
# the byte b and nibble e).
DOT_PERM = gl.constexpr([0, 1, 3, 4, 5, 2, 6])


# UNPACK_SPLIT's value 2r + h of a word is element 4h + r: with a word's 8 values split into
# bits [4, 5, 6] = (bit 2, bit 1, bit 0) of the index, its values are the natural ones permuted so.
SPLIT_PERM = gl.constexpr([0, 1, 2, 3, 5, 6, 4])


@gluon.jit
def split_order(x):
    """Activations ``[R, NI, 4, J, 8]`` in natural K order → the order of :data:`UNPACK_SPLIT`'s
    values within each word, so that :func:`to_dot_order` places them as it places those
    weights."""
    R: gl.constexpr = x.shape[0]
    NI: gl.constexpr = x.shape[1]
    J: gl.constexpr = x.shape[3]
    return gl.reshape(gl.permute(gl.reshape(x, [R, NI, 4, J, 2, 2, 2]), SPLIT_PERM.value), [R, NI, 4, J, 8])


def step_permutation(split: bool, dot: bool = True) -> tuple[int, ...]:
    """The dot's order of one 128-wide step of rows viewed as ``[R, 4, 4, 2, 2, 2]`` (natural
    K = 32c + 8j + 4b1 + 2b0 + e), as a permutation of those dims: :data:`DOT_PERM` without its
    step dim, after :data:`SPLIT_PERM` where ``split`` (for code that is not Gluon, such as
    :func:`ordered_copy`). ``dot`` False (``split`` only): :data:`SPLIT_PERM` alone, the
    paired order of :func:`paired_position`."""
    assert dot or split, "the paired order is the split unpack's"
    within = [p - 1 for p in SPLIT_PERM.value[1:]] if split else list(range(6))
    if not dot:
        return tuple(within)
    drop_step = [p - (p > 1) for p in DOT_PERM.value if p != 1]
    return tuple(within[p] for p in drop_step)


_STEP_PERM = tl.constexpr(step_permutation(False))
_STEP_PERM_SPLIT = tl.constexpr(step_permutation(True))
_PAIR_PERM = tl.constexpr(step_permutation(True, dot=False))


@triton.jit
def _dot_order_kernel(x_ptr, out_ptr, M, K, stride_xm, stride_om, BLOCK_R: tl.constexpr, FMT: tl.constexpr,
                      ROUNDING: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr):
    """Rows ``BLOCK_R * program_id(0) + [0, BLOCK_R)``, 128-wide step ``program_id(1)`` of
    :func:`ordered_copy`. ``PDL``: launched by PDL; the next launch may start at once."""
    if PDL:
        gdc_launch_dependents()
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.arange(0, 128)
    r_ok = (r < M)[:, None]
    v = tl.load(x_ptr + r.to(tl.int64)[:, None] * stride_xm + (tl.program_id(1) * 128 + k)[None, :],
                mask=r_ok & (tl.program_id(1) * 128 + k < K)[None, :], other=0.0)
    if FMT != 0:  # the 32-blocks are contiguous in natural order, not in the dot's
        v = mx.qdq(v, FMT, ROUNDING, BLOCK_R, 128)
    # Permuted in registers (step_permutation) so that the stores stay contiguous: the same
    # permutation as scattered 2-byte stores ran at 0.4 TB/s (H200, T=1024 28.4 µs).
    v = tl.reshape(v, (BLOCK_R, 4, 4, 2, 2, 2))
    if not DOT:
        v = tl.permute(v, _PAIR_PERM.value)
    elif SPLIT:
        v = tl.permute(v, _STEP_PERM_SPLIT.value)
    else:
        v = tl.permute(v, _STEP_PERM.value)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_om + (tl.program_id(1) * 128 + k)[None, :],
             tl.reshape(v, (BLOCK_R, 128)), mask=r_ok)
    if PDL:  # as every grid launched by PDL: its end implies the previous grid's
        gdc_wait()


_DOT_ORDER = Launcher(_dot_order_kernel)


def padded(k: int) -> int:
    """Columns of a dot-ordered buffer for K = ``k``: the next multiple of 128."""
    return -(-k // 128) * 128


def ordered_copy(x: torch.Tensor, aq: ActivationQuant, split: bool, dot: bool = True,
                 pdl: bool = False) -> torch.Tensor:
    """``x [M, K]`` (unit column stride) → ``[M, padded(K)]`` in the order of
    :func:`step_permutation` within each 128-wide step (``split``, ``dot`` as there), zeros past
    K: the activations the Hopper kernels read. Under activation quantization (``aq``; K a
    multiple of 32) each 32-block is quantize-dequantized on the way, as
    :func:`mxfx.kernels.mx.quantize_dequantize` does it. ``pdl``: launched by PDL, after a launch
    that lets it start at once; it copies, then waits for that launch."""
    M, K = x.shape
    out = torch.empty(M, padded(K), dtype=x.dtype, device=x.device)
    if M:
        _DOT_ORDER[(cdiv(M, 16), padded(K) // 128)](x, out, M, K, x.stride(0), out.stride(0), BLOCK_R=16,
                                                     FMT=mx.FMT_CODES[aq.fmt],
                                                     ROUNDING=mx.ROUNDING_CODES[aq.scale_rounding],
                                                     SPLIT=split, DOT=dot, PDL=pdl,
                                                     **({"launch_pdl": True} if pdl else {}), num_warps=4)
    return out


@gluon.jit
def paired_position(n):
    """Where natural K offset ``n`` sits in the paired order: within each 8 values, value
    ``4h + r`` at ``2r + h``, so that a register of two bf16 holds the K pair that
    :data:`UNPACK_SPLIT`'s words pair (:func:`split_order`'s order, read with no permute)."""
    return n - n % 8 + 2 * (n % 4) + (n % 8) // 4


@gluon.jit
def to_paired(v):
    """A row ``[N]`` (N a multiple of 8) in natural K order → the paired order
    (:func:`paired_position`)."""
    N: gl.constexpr = v.shape[0]
    return gl.reshape(gl.permute(gl.reshape(v, [N // 8, 2, 2, 2]), _row_split_perm().value), [N])


@gluon.constexpr_function
def _row_split_perm():
    """:data:`SPLIT_PERM`'s order of a word's values for a row viewed as ``[N / 8, 2, 2, 2]``."""
    return [0] + [p - 3 for p in SPLIT_PERM.value[4:]]


@gluon.jit
def x3(v):
    """``[R]`` → ``[R, 1, 1]``."""
    return gl.expand_dims(gl.expand_dims(v, 1), 2)


@gluon.jit
def unpack_a(w, s, tables, ROWS: gl.constexpr, BLOCK_K: gl.constexpr, WL: gl.constexpr, A_L: gl.constexpr,
              SPLIT: gl.constexpr = False, SMALL_SCALES: gl.constexpr = False):
    """One K step's weights (:func:`_load_w`) unpacked into the wgmma / mma.sync A fragment
    ``[ROWS, BLOCK_K]``, K in the dot's order (BLOCK_K < 128: words ``[ROWS, 1, 4, BLOCK_K / 32]``,
    a part of a step that :func:`to_dot_order` places). ``SPLIT``: by :data:`UNPACK_SPLIT`,
    whose K order the activations take through :func:`split_order`; ``SMALL_SCALES`` too: by
    :data:`UNPACK_SPLIT_SMALL`, wrong where a scale is over 128."""
    z = gl.full([ROWS, max(BLOCK_K // 128, 1), 4, min(BLOCK_K // 32, 4), 8], 0, gl.int32, layout=WL)
    sb, _ = gl.broadcast(gl.expand_dims(gl.expand_dims(s.to(gl.int32), 3), 4), z)
    wb, _ = gl.broadcast(gl.expand_dims(w, 4), z)
    if SMALL_SCALES:
        v = gl.inline_asm_elementwise(UNPACK_SPLIT_SMALL, _UNPACK_SPLIT_SMALL_CONSTRAINTS, [wb, sb],
                                      dtype=gl.bfloat16, is_pure=True, pack=8)
    elif SPLIT:
        v = gl.inline_asm_elementwise(UNPACK_SPLIT, _UNPACK_SPLIT_CONSTRAINTS,
                                      [wb, sb, z + (tables - 1107263872)],  # 0x7E807E80 = 2^126
                                      dtype=gl.bfloat16, is_pure=True, pack=8)
    else:
        tlo = z + tables
        thi = z + (tables + 2143305472)  # 0x40403F00
        v = gl.inline_asm_elementwise(UNPACK, _UNPACK_CONSTRAINTS, [wb, sb, tlo, thi],
                                      dtype=gl.bfloat16, is_pure=True, pack=8)
    # The unpacked registers are the fragment already: the conversion must move nothing.
    return gl.convert_layout(to_dot_order(v, ROWS, BLOCK_K), A_L, assert_trivial=True)


@gluon.jit
def tile_row(r, n0, N, up_offset, GATED: gl.constexpr, GATE_STRIDE: gl.constexpr):
    """The weight row of tile row ``r`` (see :func:`weight_rows`)."""
    if GATED:
        col = gl.minimum(n0 + 8 * (r // 16) + r % 8, N - 1)
        return col * GATE_STRIDE + ((r // 8) % 2) * up_offset
    else:
        return gl.minimum(n0 + r, N - 1)


@gluon.jit
def weight_rows(w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, e64, n0, N, up_offset,
                 GATED: gl.constexpr, GATE_STRIDE: gl.constexpr, ROWS: gl.constexpr, NI: gl.constexpr,
                 WL: gl.constexpr):
    """Addresses of the tile's ``ROWS`` weight rows (``w_rows`` as int32 words, ``s_rows``), the word
    and scale offsets of one K step (``wc``, ``sg``) and the prmt table word (:func:`tables_word`).

    Tile row r: gated, column n0 + 8(r//16) + r%8, gate for (r//8) even, else up; otherwise
    column n0 + r. Columns past N are clamped onto N-1: loaded, never stored."""
    W4: gl.constexpr = gl.SliceLayout(4, WL)  # words [ROWS, NI, 4, 4]
    W3: gl.constexpr = gl.SliceLayout(3, W4)  # scales [ROWS, NI, 4]
    W2: gl.constexpr = gl.SliceLayout(2, W3)
    W1: gl.constexpr = gl.SliceLayout(1, W2)  # rows
    wrow = tile_row(gl.arange(0, ROWS, layout=W1), n0, N, up_offset, GATED, GATE_STRIDE)
    s_rows = x3(s_ptr + e64 * stride_se + wrow.to(gl.int64) * stride_sn)
    w_rows = gl.expand_dims(x3(w_ptr + e64 * stride_we + wrow.to(gl.int64) * stride_wn), 3)
    w_rows = w_rows.to(gl.pointer_type(gl.int32), bitcast=True)
    wi = gl.arange(0, NI, layout=gl.SliceLayout(0, W2))
    wcc = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, W3)))
    sg = gl.expand_dims(gl.expand_dims(wi * 4, 0), 2) + gl.expand_dims(gl.expand_dims(wcc, 0), 1)  # [1, NI, 4]
    wj = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, W4))))
    wc = gl.expand_dims(sg * 4, 3) + gl.expand_dims(gl.expand_dims(gl.expand_dims(wj, 0), 1), 2)  # [1, NI, 4, 4]
    return w_rows, s_rows, wc, sg, tables_word(wrow)


@gluon.jit
def tables_word(wrow):
    """The prmt table word 0xC0800000 of :func:`unpack_a` (offset there into the other table
    word, or into 2^126 for :data:`UNPACK_SPLIT`), ``[ROWS, 1, 1, 1, 1]``, made opaque
    and per thread (``wrow`` >= 0, so the OR changes nothing) so that ptxas keeps it in a
    register rather than copying it from a uniform register before every prmt (~30
    instructions per K step)."""
    return gl.expand_dims(gl.expand_dims(x3(-1065353216 | (wrow >> 31)), 3), 4)


@gluon.jit
def dot_position(n, SPLIT: gl.constexpr = False):
    """Where natural K offset ``n`` sits in the dot's order of its 128-wide step (see
    :func:`to_dot_order`): k = 128i + 32c + 8j + 4b1 + 2b0 + e → 128i + 32j + 16b1 + 8b0 + 2c + e.
    ``SPLIT``: in the order of :data:`UNPACK_SPLIT`'s values, which places value v of a word
    (k = 128i + 32c + 8j + v) where the other unpack places value 2(v % 4) + v // 4 (see
    :func:`split_order`)."""
    k = n % 128
    if SPLIT:
        k = paired_position(k)
    return n - n % 128 + 32 * ((k // 8) % 4) + 16 * ((k // 4) % 2) + 8 * ((k // 2) % 2) + 2 * (k // 32) + k % 2


@gluon.jit
def epilogue(acc, blk, nrows, n0, ks, e64, sorted_ptr, bias_ptr, stride_be, stride_bn, rw_ptr,
              out_ptr, stride_os, stride_om, N, up_offset, alpha, beta, limit,
              GATED: gl.constexpr, GATE_STRIDE: gl.constexpr, HAS_LIMIT: gl.constexpr, HAS_BIAS: gl.constexpr,
              ROUTE_WEIGHT: gl.constexpr, BLOCK_M: gl.constexpr, ROWS: gl.constexpr, DOT_ORDER_OUT: gl.constexpr,
              PER_PAIR: gl.constexpr = False, AQ: gl.constexpr = 0, AQ_ROUNDING: gl.constexpr = 0,
              SPLIT: gl.constexpr = False, PAIRED_OUT: gl.constexpr = False):
    """Bias, gated activation, routing weight and the store of the ``[ROWS, BLOCK_M]``
    accumulator, in a plain layout: ``[BLOCK_N, BLOCK_M]``, a warp's lanes along N.
    ``DOT_ORDER_OUT``: columns stored at :func:`dot_position` (``SPLIT`` as there) and the
    row's padding up to a multiple of 128 zeroed, the layout
    :func:`mxfx.kernels.moe_sm90_ws._moe_gemm_sm90_ws` reads. ``PER_PAIR``: block ``blk`` is
    pair ``blk`` alone (``mxfx.kernels.routing.per_pair``). ``AQ``, ``AQ_ROUNDING``: the output,
    rounded to its dtype, quantize-dequantized as :func:`mxfx.kernels.mx.qdq` does it (a gated
    tile's 32 columns are one MX block of each row). ``PAIRED_OUT``: columns stored at
    :func:`paired_position` (N a multiple of 8), for the mma.sync loop that reads them paired."""
    BLOCK_N: gl.constexpr = ROWS // 2 if GATED else ROWS
    OL: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, ROWS // 16], [0, 1])
    n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, OL))
    n_ok = n < N
    mo = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, OL))
    m_ok = mo < nrows
    if PER_PAIR:
        pairs = blk + mo
    else:
        pairs = gl.load(sorted_ptr + blk * BLOCK_M + mo, mask=m_ok, other=0)
    b_base = bias_ptr + e64 * stride_be
    if GATED:
        # Accumulator row 16q + 8u + p is column 8q + p of the gate (u = 0) or up (u = 1).
        acc = gl.permute(gl.reshape(acc, [ROWS // 16, 2, 8, BLOCK_M]), [0, 2, 3, 1])
        gate, up = gl.split(acc)
        gate = gl.convert_layout(gl.reshape(gate, [BLOCK_N, BLOCK_M]), OL)
        up = gl.convert_layout(gl.reshape(up, [BLOCK_N, BLOCK_M]), OL)
        if HAS_BIAS:
            g_rows = n * GATE_STRIDE
            gate += gl.expand_dims(gl.load(b_base + g_rows * stride_bn, mask=n_ok, other=0.0).to(gl.float32), 1)
            up += gl.expand_dims(gl.load(b_base + (g_rows + up_offset) * stride_bn, mask=n_ok,
                                         other=0.0).to(gl.float32), 1)
        if HAS_LIMIT:
            gate = gl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
            up = gl.minimum(gl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                            propagate_nan=tl.PropagateNan.ALL)
        res = gate * (1.0 / (1.0 + gl.exp(-(alpha * gate)))) * (up + beta)
    else:
        res = gl.convert_layout(acc, OL)
        if HAS_BIAS:
            res += gl.expand_dims(gl.load(b_base + n * stride_bn, mask=n_ok & (ks == 0), other=0.0).to(gl.float32), 1)
    if ROUTE_WEIGHT:
        res = res * gl.expand_dims(gl.load(rw_ptr + pairs, mask=m_ok, other=0.0).to(gl.float32), 0)
    if AQ != 0:  # the next GEMM's input
        gl.static_assert(BLOCK_N == 32)
        q = mx.qdq(gl.permute(res.to(out_ptr.dtype.element_ty), [1, 0]), AQ, AQ_ROUNDING, BLOCK_M, BLOCK_N)
        res = gl.permute(q, [1, 0])
    rows = out_ptr + ks * stride_os + gl.expand_dims(pairs.to(gl.int64) * stride_om, 0)
    mask = gl.expand_dims(m_ok, 0) & gl.expand_dims(n_ok, 1)
    if DOT_ORDER_OUT:
        # Columns N up to the next multiple of 128 are zeros (the next GEMM's K padding): this
        # tile's own past N, and the last tile writes those after it.
        NP = (N + 127) // 128 * 128
        gl.store(rows + gl.expand_dims(dot_position(n, SPLIT), 1),
                 gl.where(gl.expand_dims(n_ok, 1), res, 0.0).to(out_ptr.dtype.element_ty),
                 mask=gl.expand_dims(m_ok, 0) & gl.expand_dims(n < NP, 1))
        if n0 + BLOCK_N >= N:
            for z0 in range(n0 + BLOCK_N, NP, BLOCK_N):
                z = z0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, OL))
                gl.store(rows + gl.expand_dims(dot_position(z, SPLIT), 1),
                         gl.zeros_like(res).to(out_ptr.dtype.element_ty), mask=gl.expand_dims(m_ok, 0))
    else:
        cols = paired_position(n) if PAIRED_OUT else n
        gl.store(rows + gl.expand_dims(cols, 1), res.to(out_ptr.dtype.element_ty), mask=mask)
