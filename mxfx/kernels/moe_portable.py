"""The portable grouped MoE GEMM in Triton, with fused epilogues, and the k-sum pass; launched by
:mod:`mxfx.kernels.moe`.

One kernel, :func:`_moe_gemm`, serves every GEMM of the MoE. A program owns one block of
``BLOCK_M`` (token, slot) pairs of a single expert (from :mod:`mxfx.kernels.routing`) and
``BLOCK_N`` output columns; it gathers its activation rows, streams the expert's weight
tile along K (MXFP4 unpacked and scaled in registers, or float; the next step's loads issued
before this step's arithmetic), accumulates in float32 with ``tl.dot`` on x.dtype operands
(the weights as the left operand when few rows share them, see ``moe.pick_config``), and
finishes with one of the epilogues:

- GEMM1, fused: + bias, gated activation (the tile's weight rows alternate gate and up, in
  either layout, and the accumulator's columns are split back, so any alpha, beta, limit
  work), rounded to x.dtype, MX quantize-dequantized
  per 32 columns under activation quantization, stored per pair: ``[T*k, I]``;
- GEMM1, unfused: + bias, stored in x.dtype: ``[T*k, 2I]``;
- GEMM2: + bias, × routing weight, stored in float32 per pair: ``[T*k, H]``, or with its K
  range split over S programs (small T, where the grid is too small to keep the memory
  system busy) S partial sums ``[S, T*k, H]``.

The k-sum, :func:`_sum_slots`, adds each token's slots (and the S partials) in slot order:
deterministic (no atomics on values) and one rounding to x.dtype at the end, like the
emulation backend.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from mxfx.kernels import mx
from mxfx.kernels.launch import Launcher


@triton.jit
def _load_weights(w_base, s_base, rows, row_ok, k0, k_hi, stride_wn, stride_wk, stride_sn, stride_sk,
                  W_MXFP4: tl.constexpr, WORDS: tl.constexpr, BK: tl.constexpr):
    """Raw weight tile of ``rows`` at K offsets ``k0 + [0, BK)`` below ``k_hi``: MXFP4 packed
    bytes ``[R, BK/2]`` (``WORDS``: as int32 words ``[R, BK/8]``, strides in bytes) and
    scales ``[R, BK/32]`` (``k_hi`` a multiple of 32), or the float tile ``[R, BK]`` and a
    placeholder."""
    if W_MXFP4:
        kg = k0 // 32 + tl.arange(0, BK // 32)
        if WORDS:
            kw = k0 // 8 + tl.arange(0, BK // 8)
            p = tl.load(w_base.to(tl.pointer_type(tl.int32)) + rows[:, None] * (stride_wn // 4) + kw[None, :],
                        mask=row_ok[:, None] & (kw < k_hi // 8)[None, :], other=0)
        else:
            kp = k0 // 2 + tl.arange(0, BK // 2)
            p = tl.load(w_base + rows[:, None] * stride_wn + kp[None, :] * stride_wk,
                        mask=row_ok[:, None] & (kp < k_hi // 2)[None, :], other=0)
        s = tl.load(s_base + rows[:, None] * stride_sn + kg[None, :] * stride_sk,
                    mask=row_ok[:, None] & (kg < k_hi // 32)[None, :], other=127)
    else:
        kk = k0 + tl.arange(0, BK)
        p = tl.load(w_base + rows[:, None] * stride_wn + kk[None, :] * stride_wk,
                    mask=row_ok[:, None] & (kk < k_hi)[None, :], other=0.0)
        s = 0
    return p, s


@triton.jit
def _dot(acc, a, w, SWAP: tl.constexpr, IEEE: tl.constexpr):
    """``acc + a @ w.T``; with ``SWAP`` its transpose ``acc + w @ a.T``, the weights being the
    MMA's left operand (IEEE float32 products for float32 input)."""
    if SWAP:
        if IEEE:
            return tl.dot(w, tl.trans(a), acc, input_precision="ieee")
        else:
            return tl.dot(w, tl.trans(a), acc)
    else:
        if IEEE:
            return tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            return tl.dot(a, tl.trans(w), acc)


@triton.jit
def _load_mx_activations(a_rows, as_rows, valid, k0, k_hi, stride_ak, A_FMT: tl.constexpr, BK: tl.constexpr):
    """The MX activation tile at K offsets ``k0 + [0, BK)`` below ``k_hi``: elements
    ``[R, BK]`` float8_e4m3fn (``A_FMT`` 1) or packed E2M1 bytes ``[R, BK/2]`` (2), and their
    E8M0 scales ``[R, BK/32]``."""
    if A_FMT == 2:
        kq = k0 // 2 + tl.arange(0, BK // 2)
        a = tl.load(a_rows + kq[None, :] * stride_ak, mask=valid[:, None] & (kq < k_hi // 2)[None, :], other=0)
    else:
        kq = k0 + tl.arange(0, BK)
        a = tl.load(a_rows + kq[None, :] * stride_ak, mask=valid[:, None] & (kq < k_hi)[None, :], other=0)
        a = a.to(tl.float8e4nv, bitcast=True)
    kg = k0 // 32 + tl.arange(0, BK // 32)
    a_s = tl.load(as_rows + kg[None, :], mask=valid[:, None] & (kg < k_hi // 32)[None, :], other=127)
    return a, a_s


@triton.jit
def _dot_scaled(acc, a, a_s, p, s, A_FMT: tl.constexpr, SWAP: tl.constexpr):
    """``acc + A @ W.T`` for MX activations ``a``, ``a_s`` (:func:`_load_mx_activations`) and
    MXFP4 weight bytes ``p [R, BK/2]`` with scales ``s [R, BK/32]``; ``SWAP``: the transpose,
    the weights as the left operand."""
    if A_FMT == 2:
        if SWAP:
            return tl.dot_scaled(p, s, "e2m1", tl.trans(a), a_s, "e2m1", acc)
        else:
            return tl.dot_scaled(a, a_s, "e2m1", tl.trans(p), s, "e2m1", acc)
    else:
        if SWAP:
            return tl.dot_scaled(p, s, "e2m1", tl.trans(a), a_s, "e4m3", acc)
        else:
            return tl.dot_scaled(a, a_s, "e4m3", tl.trans(p), s, "e2m1", acc)


@triton.jit
def _mma(acc, a, p, s, W_MXFP4: tl.constexpr, PTX_UNPACK: tl.constexpr, IEEE: tl.constexpr,
         SWAP: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BW: tl.constexpr,
         BK: tl.constexpr):
    """One K step: ``acc += a [BM, BK] @ W.T`` for a weight tile from :func:`_load_weights`
    (``PTX_UNPACK``: loaded as words).

    ``SPLIT`` unpacks MXFP4 into the elements at even and odd K offsets, kept apart, and
    splits the activations to match (two MMAs, no interleave: cheaper when few rows share
    the weights); otherwise one MMA over the whole tile.
    """
    if W_MXFP4:
        if SPLIT:
            if PTX_UNPACK:
                even, odd = mx.mxfp4_words_bf16_halves(p, s, BW, BK)
            else:
                even, odd = mx.mxfp4_dequant_halves(p, s, BW, BK)
            a_even, a_odd = tl.split(tl.reshape(a, (BM, BK // 2, 2)))
            acc = _dot(acc, a_even, even.to(a.dtype), SWAP, IEEE)
            acc = _dot(acc, a_odd, odd.to(a.dtype), SWAP, IEEE)
        else:
            if PTX_UNPACK:
                w = mx.mxfp4_words_bf16(p, s, BW, BK)
            else:
                even, odd = mx.mxfp4_dequant_halves(p, s, BW, BK)
                w = tl.reshape(tl.join(even, odd), (BW, BK))
            acc = _dot(acc, a, w.to(a.dtype), SWAP, IEEE)
    else:
        acc = _dot(acc, a, p.to(a.dtype), SWAP, IEEE)
    return acc


@triton.jit
def _moe_gemm(
    a_ptr, stride_am, stride_ak,
    w_ptr, stride_we, stride_wn, stride_wk,
    s_ptr, stride_se, stride_sn, stride_sk,
    bias_ptr, stride_be, stride_bn,
    rw_ptr,
    sorted_ptr, block_expert_ptr, block_rows_ptr,
    out_ptr, stride_os, stride_om, stride_on,
    N, up_offset,
    alpha, beta, limit,
    as_ptr, stride_asm,
    K: tl.constexpr,
    A_ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    GATE_STRIDE: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    W_MXFP4: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUTE_WEIGHT: tl.constexpr,
    AQ: tl.constexpr,
    AQ_ROUNDING: tl.constexpr,
    IEEE: tl.constexpr,
    PTX_UNPACK: tl.constexpr,
    SWAP: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    A_FMT: tl.constexpr,
):
    # Gated: the tile's weight rows alternate gate, up (BW = 2*BLOCK_N rows, one MMA), in
    # either layout; the epilogue splits the accumulator's columns back into the two.
    BW: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    # Split K: program ks sums K_SPLIT of the K range into its own partial output
    # (out + ks * stride_os); the consumer adds the partials in a fixed order.
    K_SPLIT: tl.constexpr = ((K + BLOCK_K - 1) // BLOCK_K + SPLIT_K - 1) // SPLIT_K * BLOCK_K
    pid = tl.program_id(0)
    ks = pid % SPLIT_K
    pid = pid // SPLIT_K
    num_n = tl.cdiv(N, BLOCK_N)
    blk = pid // num_n
    expert = tl.load(block_expert_ptr + blk)
    if expert < 0:
        return
    valid = tl.arange(0, BLOCK_M) < tl.load(block_rows_ptr + blk)
    pairs = tl.load(sorted_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M), mask=valid, other=0)
    a_rows = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * stride_am
    n0 = (pid % num_n) * BLOCK_N
    j = tl.arange(0, BW)
    if GATED:
        rows = (n0 + j // 2) * GATE_STRIDE + (j % 2) * up_offset
        row_ok = n0 + j // 2 < N
    else:
        rows = n0 + j
        row_ok = rows < N
    e64 = expert.to(tl.int64)
    w_base = w_ptr + e64 * stride_we
    s_base = s_ptr + e64 * stride_se

    if SWAP:
        acc = tl.zeros((BW, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BW), dtype=tl.float32)
    k_lo = ks * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    kk = tl.arange(0, BLOCK_K)
    if A_FMT != 0:
        # MX activations (elements and scales) times MXFP4 weights by tl.dot_scaled: the
        # GPU's scaled MMA where it has one. Plain loads, for Triton to pipeline.
        as_rows = as_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * stride_asm
        for i in range(0, K_SPLIT // BLOCK_K):
            k0 = k_lo + i * BLOCK_K
            a, a_s = _load_mx_activations(a_rows, as_rows, valid, k0, k_hi, stride_ak, A_FMT, BLOCK_K)
            p, s = _load_weights(w_base, s_base, rows, row_ok, k0, k_hi, stride_wn, stride_wk, stride_sn,
                                 stride_sk, W_MXFP4, False, BLOCK_K)
            acc = _dot_scaled(acc, a, a_s, p, s, A_FMT, SWAP)
    else:
        # The next K step's loads are issued before this step's unpack and MMA, so that
        # their latency hides behind the arithmetic (register double buffering).
        a = tl.load(a_rows + (k_lo + kk)[None, :] * stride_ak,
                    mask=valid[:, None] & (k_lo + kk < k_hi)[None, :], other=0.0)
        p, s = _load_weights(w_base, s_base, rows, row_ok, k_lo, k_hi, stride_wn, stride_wk, stride_sn,
                             stride_sk, W_MXFP4, PTX_UNPACK, BLOCK_K)
        for i in range(0, K_SPLIT // BLOCK_K):
            k0 = k_lo + i * BLOCK_K
            kn = k0 + BLOCK_K + kk
            a_next = tl.load(a_rows + kn[None, :] * stride_ak, mask=valid[:, None] & (kn < k_hi)[None, :],
                             other=0.0)
            p_next, s_next = _load_weights(w_base, s_base, rows, row_ok, k0 + BLOCK_K, k_hi, stride_wn,
                                           stride_wk, stride_sn, stride_sk, W_MXFP4, PTX_UNPACK, BLOCK_K)
            acc = _mma(acc, a, p, s, W_MXFP4, PTX_UNPACK, IEEE, SWAP, SPLIT, BLOCK_M, BW, BLOCK_K)
            a = a_next
            p = p_next
            s = s_next

    if HAS_BIAS:
        bias = tl.load(bias_ptr + e64 * stride_be + rows * stride_bn, mask=row_ok & (ks == 0), other=0.0)
        if SWAP:
            acc += bias.to(tl.float32)[:, None]
        else:
            acc += bias.to(tl.float32)[None, :]
    if SWAP:
        acc = tl.trans(acc)
    if GATED:
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        if HAS_LIMIT:
            gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
            up = tl.clamp(up, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
        res = gate * tl.sigmoid(alpha * gate) * (up + beta)
    else:
        res = acc
    if ROUTE_WEIGHT:
        res = res * tl.load(rw_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    res = res.to(out_ptr.dtype.element_ty)
    if AQ != 0:
        # The next GEMM's input, quantized once here rather than in each of its programs.
        res = mx.qdq(res, AQ, AQ_ROUNDING, BLOCK_M, BLOCK_N)
    n = n0 + tl.arange(0, BLOCK_N)
    out = out_ptr + ks * stride_os + pairs.to(tl.int64)[:, None] * stride_om + n[None, :] * stride_on
    tl.store(out, res, mask=valid[:, None] & (n < N)[None, :])


@triton.jit
def _sum_slots(y_ptr, ids_ptr, out_ptr, H, num_experts, stride_ys, stride_ot, TOPK: tl.constexpr,
               SPLIT_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    # PDL: launched by PDL after GEMM2, whose partials it reads.
    if PDL:
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(TOPK):
        pair = t * TOPK + j
        e = tl.load(ids_ptr + pair)
        routed = (e >= 0) & (e < num_experts)
        for ks in range(SPLIT_K):
            acc += tl.load(y_ptr + ks * stride_ys + pair * H + h, mask=h_ok & routed, other=0.0)
    tl.store(out_ptr + t * stride_ot + h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


GEMM = Launcher(_moe_gemm)
SUM_SLOTS = Launcher(_sum_slots)
