"""The MoE GEMM for Hopper (sm_90) in Gluon, for MXFP4 weights and bfloat16 activations while
few rows share each weight (small T), where the portable kernel of :mod:`mxfx.kernels.moe` is
bound by its instruction count. Its tile (weight rows, MXFP4 unpack into A fragments,
epilogue) is :mod:`mxfx.kernels.sm90_tile`, which :mod:`mxfx.kernels.moe_sm90_ws`, the
warp-specialized kernel for many rows per block, shares.

:func:`_moe_gemm_sm90` takes the same runtime arguments as ``moe_portable._moe_gemm`` and
computes the same GEMM1 (gated or not) and GEMM2 epilogues, the intermediate's activation
quantization included. What differs is how the weights reach the tensor cores:

- One warpgroup (4 warps) owns 64 weight rows; the accumulator is ``[64, BLOCK_M]`` with the
  weights as the MMA's A operand, unpacked in registers (:func:`sm90_tile.unpack_a`).
- The activations are the B operand, in one of two ways. ``SYNC_MMA`` (blocks of 8 rows,
  while the weights dominate): each lane loads the same 32-K segment of the block's rows
  straight into mma.sync B fragments, every warp on its own, with no shared memory, barrier
  or proxy fence in the loop; on grouped blocks the rows are in the paired order
  (:func:`paired`: x copied so, the intermediate stored so by GEMM1), so that the loads are the
  B registers, with no permute. Otherwise (16 to 32 rows): the block's rows are staged to
  shared memory once for the four warps and multiplied by wgmma.

The K loops are :mod:`mxfx.kernels.moe_sm90_loops`. Where GEMM1's grid is small (a token or
two), two warpgroups share each of its per-pair tiles, half the K steps each (``HALVES``):
twice the warps per SM to wait on the weights.

Launched by PDL (programmatic dependent launch, ``PDL``), GEMM2's programs start while GEMM1
runs and wait for it by ``griddepcontrol.wait`` once their first weight loads are issued; on
grouped blocks GEMM1 is launched by PDL too, after the routing kernels, and waits for them
before it reads the routing.

:func:`_moe_per_pair_sm90` runs a per-pair call's two GEMMs (and its k-sum) as one launch, the
second GEMM's programs waiting on counters for the first's: one launch's host time in an eager
call instead of two.
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from mxfx.kernels import sm90_tile as tile, wgmma_guard
from mxfx.kernels.launch import Launcher
from mxfx.kernels.moe_sm90_loops import (BLOCK_K, ORDER_NATURAL, PREVIOUS_GRID, grid_control, k_loops_checked,
                                         x_layout, xb_layout)
from mxfx.moe_call import ActivationQuant


# The K step as a constexpr, and the output columns per program without a gated epilogue (GEMM2).
_BLOCK_K = gl.constexpr(BLOCK_K)
_BLOCK_N2 = gl.constexpr(64)
BLOCK_N2 = _BLOCK_N2.value


# A launch's part in PDL, the bits of _moe_gemm_sm90's PDL (moe._gemm passes their values).
# Every program of a grid launched by PDL waits, so that its end implies the previous grid's,
# and so on up the chain.
PDL_TRIGGER = gl.constexpr(1)  # the grid launched after this one by PDL may start at once
PDL_WAIT_FIRST = gl.constexpr(2)  # launched by PDL: waits for the previous grid before it reads anything
PDL_WAIT_LOADS = gl.constexpr(4)  # launched by PDL: reads the routing, issues its first weight loads, waits


@gluon.jit
def _sum_when_last(cnt_ptr, ids_ptr, y_ptr, stride_ys, stride_ym, sum_ptr, stride_sum, t, j, N,
                   E: gl.constexpr, TOPK: gl.constexpr, SPLIT_K: gl.constexpr, BLOCK_N: gl.constexpr):
    """GEMM2 on per-pair blocks: after this program's partial of token ``t``'s column tile ``j``
    is stored (or skipped, for an unrouted slot), counts it at ``cnt_ptr[t, j]``; the last of the
    tile's ``TOPK * SPLIT_K`` programs sums their partials into ``sum_ptr`` in the order
    ``moe_portable._sum_slots`` does (slots, then splits; unrouted slots skipped), so the result
    is the same to the bit, one launch fewer."""
    # The barrier orders every thread's stores before the one thread's release (and, after
    # the atomic, its acquire before every thread's loads).
    gl.thread_barrier()
    arrived = gl.atomic_add(cnt_ptr + t * gl.cdiv(N, BLOCK_N) + j, 1, sem="acq_rel", scope="gpu")
    if arrived == TOPK * SPLIT_K - 1:
        L: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=L)
        acc = gl.zeros([BLOCK_N], gl.float32, layout=L)
        for slot in gl.static_range(TOPK):
            pair = t * TOPK + slot
            e = gl.load(ids_ptr + pair)
            routed = (e >= 0) & (e < E)
            for ks in gl.static_range(SPLIT_K):
                # .cg: the partials were written by other SMs, read them from L2.
                acc += gl.load(y_ptr + ks * stride_ys + pair * stride_ym + n, mask=(n < N) & routed, other=0.0,
                               cache_modifier=".cg")
        gl.store(sum_ptr + t * stride_sum + n, acc.to(sum_ptr.dtype.element_ty), mask=n < N)
        # Left at zero for the next call where the counters persist (_moe_per_pair_sm90).
        gl.store(cnt_ptr + t * gl.cdiv(N, BLOCK_N) + j, 0)


# Registers per thread of a program whose K loop runs in two warpgroups (``HALVES``), and its
# weights' steps ahead: at 80, three such programs of 8 warps fit an SM (24 warps), and 3 steps
# ahead compile without spills (sm_90a; 4 steps ahead were slower at T=1 on gpt-oss-120b).
HALF_REGS = gl.constexpr(80)
HALF_STAGES = gl.constexpr(3)


@gluon.jit
def _half(hargs, k_lo, k_end, GATED: gl.constexpr, GATE_STRIDE: gl.constexpr, NFULL: gl.constexpr,
          NS: gl.constexpr, A_ROW_DIV: gl.constexpr, WAIT: gl.constexpr, XROW: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_K: gl.constexpr, NI: gl.constexpr, WL: gl.constexpr, XL: gl.constexpr, A_L: gl.constexpr,
          B_L: gl.constexpr, MMA: gl.constexpr, STORE: gl.constexpr, XQ: gl.constexpr, XQ_ROUNDING: gl.constexpr):
    """One warpgroup's part of a ``HALVES`` program (``hargs``: the tile's runtime values and
    ``part``, a ``[64, BLOCK_M]`` float32 buffer in shared memory): the per-pair K loop over
    ``[k_lo, k_end)`` (``NFULL`` unmasked steps of ``NS``; :func:`k_loops_checked`; ``XQ`` as
    :func:`moe_sm90_loops._x_row_to_smem`'s, on its half of the row). Returns ``(acc,)``;
    ``STORE`` (the second warpgroup) leaves it in ``part``."""
    (w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, e64, n0, N, up_offset, a_ptr, stride_am,
     sorted_ptr, blk, nrows, ready_ptr, part) = hargs
    acc = k_loops_checked(w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, e64, n0, N, up_offset, a_ptr,
                          stride_am, sorted_ptr, blk, nrows, ready_ptr, k_lo, k_end, GATED, GATE_STRIDE, NFULL, NS,
                          A_ROW_DIV, True, WAIT, XROW, BLOCK_M, BLOCK_K, NI, WL, XL, A_L, B_L, MMA, True,
                          ORDER_NATURAL, XQ, XQ_ROUNDING)
    if STORE:
        part.store(acc)
    return (acc,)


@gluon.jit
def _program(
    pid,
    a_ptr, stride_am,
    w_ptr, stride_we, stride_wn,
    s_ptr, stride_se, stride_sn,
    bias_ptr, stride_be, stride_bn,
    rw_ptr,
    sorted_ptr, block_expert_ptr, block_rows_ptr,
    out_ptr, stride_os, stride_om,
    N, up_offset,
    alpha, beta, limit,
    cnt_ptr, num_cnt, sum_ptr, stride_sum,
    ready_ptr,
    K: gl.constexpr,
    A_ROW_DIV: gl.constexpr,
    GATED: gl.constexpr,
    GATE_STRIDE: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    ROUTE_WEIGHT: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_K: gl.constexpr,
    SPLIT_K: gl.constexpr,
    SYNC_MMA: gl.constexpr,
    PER_PAIR_E: gl.constexpr,
    COUNTERS: gl.constexpr,
    TOPK: gl.constexpr,
    AQ: gl.constexpr,
    AQ_ROUNDING: gl.constexpr,
    WAIT: gl.constexpr = 0,
    XROW: gl.constexpr = 0,
    HALVES: gl.constexpr = False,
    X_ORDER: gl.constexpr = 0,
    PAIRED_OUT: gl.constexpr = False,
    X_QDQ: gl.constexpr = False,
):
    """Program ``pid`` of the GEMM (the kernels' arguments are documented at
    :func:`_moe_gemm_sm90`). ``WAIT``: before reading its activations, wait until
    ``ready_ptr[block]`` has reached this count, or with ``PREVIOUS_GRID`` until the grid
    launched before this one has finished (its weights' first loads issued meanwhile).
    ``XROW``: on per-pair blocks, the K loop of :func:`moe_sm90_loops._k_loop_x_row` with the
    weights this many steps ahead; 0: :func:`moe_sm90_loops._k_loop`'s. ``HALVES``: that loop in
    two warpgroups, half the K steps each (:func:`_half`; launched with ``HALF_REGS``).
    ``X_ORDER``: the activations' order along K (``moe_sm90_loops.ORDER_*``, as its
    ``_k_loop``); ``PAIRED_OUT``: the output stored in the paired order (:func:`paired`), for a
    GEMM2 that reads it so. ``X_QDQ`` (``XROW``): the activation row quantize-dequantized as
    ``AQ``, ``AQ_ROUNDING`` say as it is read (:func:`moe_sm90_loops._x_row_to_smem`; under
    ``HALVES`` each warpgroup its half), not before the launch."""
    gl.static_assert(K % 32 == 0)
    gl.static_assert(BLOCK_K % 128 == 0, "each lane owns whole 32-K segments")
    gl.static_assert(XROW == 0 or (SYNC_MMA and PER_PAIR_E != 0), "activation row in shared memory: per-pair mma.sync")
    gl.static_assert(WAIT <= 0 or XROW != 0, "a program waiting on a counter reads its row into shared memory")
    gl.static_assert(not X_QDQ or (XROW != 0 and AQ != 0), "the row quantized as read: in shared memory, AQ given")
    XQ: gl.constexpr = AQ if X_QDQ else 0
    BLOCK_N: gl.constexpr = tile.tile_cols(GATED)
    NI: gl.constexpr = BLOCK_K // 128
    WL: gl.constexpr = tile.w_layout(NI)
    if SYNC_MMA:
        XL: gl.constexpr = xb_layout(BLOCK_M, NI)
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    else:
        XL: gl.constexpr = x_layout(BLOCK_M, NI)
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_M, 16])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # Split K: program ks sums K_SPLIT of the K range into its own partial output.
    K_SPLIT: gl.constexpr = ((K + BLOCK_K - 1) // BLOCK_K + SPLIT_K - 1) // SPLIT_K * BLOCK_K

    if COUNTERS == 1:  # GEMM1 zeroes the k-sum's counters for GEMM2 (see _sum_when_last)
        for i in range(pid, num_cnt, gl.num_programs(0)):
            gl.store(cnt_ptr + i, 0)
    ks = pid % SPLIT_K
    pid = pid // SPLIT_K
    num_n = gl.cdiv(N, BLOCK_N)
    blk = pid // num_n
    expert = gl.load(block_expert_ptr + blk)
    if PER_PAIR_E:  # routing.per_pair: block blk is pair blk, its id (any integer dtype) unchecked
        gl.device_assert(expert < PER_PAIR_E, "topk_ids: expert id >= E")
    if expert < 0:
        if WAIT == PREVIOUS_GRID:  # (as every program launched by PDL; per pair, GEMM1 zeroes the counters)
            grid_control("wait")
        if COUNTERS == 2:
            _sum_when_last(cnt_ptr, sorted_ptr, out_ptr, stride_os, stride_om, sum_ptr, stride_sum, blk // TOPK,
                           pid % num_n, N, PER_PAIR_E, TOPK, SPLIT_K, BLOCK_N)
        return
    nrows = 1 if PER_PAIR_E else gl.load(block_rows_ptr + blk)
    n0 = (pid % num_n) * BLOCK_N
    e64 = expert.to(gl.int64)
    if SPLIT_K == 1:
        k_lo = 0
        k_end = K
        NFULL: gl.constexpr = K // BLOCK_K  # unmasked steps; the last one is masked if K % BLOCK_K
        NS: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    else:
        k_lo = ks * K_SPLIT
        k_end = gl.minimum(k_lo + K_SPLIT, K)
        # Steps every split has whole (the last split is the shortest, and may be empty): the
        # loop runs on those, unmasked, and fully unrolling a long K range costs i-cache.
        NFULL: gl.constexpr = max(K - (SPLIT_K - 1) * K_SPLIT, 0) // BLOCK_K
        NS: gl.constexpr = K_SPLIT // BLOCK_K
    if HALVES:
        # Two warpgroups take the first and second half of the K steps, each with its own copy of
        # the row in shared memory; the first adds the second's accumulator after the join.
        gl.static_assert(SPLIT_K == 1 and XROW != 0 and K > BLOCK_K, "halves: per-pair blocks, two K steps or more")
        KH: gl.constexpr = ((K + BLOCK_K - 1) // BLOCK_K + 1) // 2 * BLOCK_K
        part = gl.allocate_shared_memory(gl.float32, [64, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        hargs = (w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, e64, n0, N, up_offset, a_ptr, stride_am,
                 sorted_ptr, blk, nrows, ready_ptr, part)
        res = gl.warp_specialize([
            (_half, (hargs, 0, KH, GATED, GATE_STRIDE, KH // BLOCK_K, KH // BLOCK_K, A_ROW_DIV, WAIT, XROW, BLOCK_M,
                     BLOCK_K, NI, WL, XL, A_L, B_L, MMA, False, XQ, AQ_ROUNDING)),
            (_half, (hargs, KH, K, GATED, GATE_STRIDE, (K - KH) // BLOCK_K, (K - KH + BLOCK_K - 1) // BLOCK_K,
                     A_ROW_DIV, WAIT, XROW, BLOCK_M, BLOCK_K, NI, WL, XL, A_L, B_L, MMA, True, XQ, AQ_ROUNDING)),
        ], [4], [HALF_REGS])
        acc = res[0] + part.load(MMA)
    else:
        acc = k_loops_checked(w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, e64, n0, N, up_offset,
                              a_ptr, stride_am, sorted_ptr, blk, nrows, ready_ptr, k_lo, k_end, GATED, GATE_STRIDE,
                              NFULL, NS, A_ROW_DIV, PER_PAIR_E != 0, WAIT, XROW, BLOCK_M, BLOCK_K, NI, WL, XL, A_L,
                              B_L, MMA, SYNC_MMA, X_ORDER, XQ, AQ_ROUNDING)
    tile.epilogue(acc, blk, nrows, n0, ks, e64, sorted_ptr, bias_ptr, stride_be, stride_bn, rw_ptr, out_ptr,
                  stride_os, stride_om, N, up_offset, alpha, beta, limit, GATED, GATE_STRIDE, HAS_LIMIT, HAS_BIAS,
                  ROUTE_WEIGHT, BLOCK_M, 64, False, PER_PAIR_E != 0, AQ, AQ_ROUNDING, PAIRED_OUT=PAIRED_OUT)
    if COUNTERS == 2:
        _sum_when_last(cnt_ptr, sorted_ptr, out_ptr, stride_os, stride_om, sum_ptr, stride_sum, blk // TOPK,
                       n0 // BLOCK_N, N, PER_PAIR_E, TOPK, SPLIT_K, BLOCK_N)


@gluon.jit
def _moe_gemm_sm90(
    a_ptr, stride_am, stride_ak,
    w_ptr, stride_we, stride_wn, stride_wk,
    s_ptr, stride_se, stride_sn, stride_sk,
    bias_ptr, stride_be, stride_bn,
    rw_ptr,
    sorted_ptr, block_expert_ptr, block_rows_ptr,
    out_ptr, stride_os, stride_om, stride_on,
    N, up_offset,
    alpha, beta, limit,
    cnt_ptr, num_cnt, sum_ptr, stride_sum,
    K: gl.constexpr,
    A_ROW_DIV: gl.constexpr,
    GATED: gl.constexpr,
    GATE_STRIDE: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    ROUTE_WEIGHT: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_K: gl.constexpr,
    SPLIT_K: gl.constexpr,
    SYNC_MMA: gl.constexpr = False,
    PER_PAIR_E: gl.constexpr = 0,
    COUNTERS: gl.constexpr = 0,
    TOPK: gl.constexpr = 1,
    AQ: gl.constexpr = 0,
    AQ_ROUNDING: gl.constexpr = 0,
    XROW: gl.constexpr = 0,
    PDL: gl.constexpr = 0,
    HALVES: gl.constexpr = False,
    X_ORDER: gl.constexpr = 0,
    PAIRED_OUT: gl.constexpr = False,
    X_QDQ: gl.constexpr = False,
):
    """One grouped GEMM launch (``moe._gemm``). ``PDL``: its part in programmatic dependent
    launch, bits ``PDL_TRIGGER`` (the next launch may start at once), ``PDL_WAIT_FIRST`` (GEMM1
    after the routing kernels) or ``PDL_WAIT_LOADS`` (GEMM2, whose first weight loads are issued
    while GEMM1 runs). ``HALVES``, ``X_ORDER``, ``PAIRED_OUT``, ``X_QDQ``: see :func:`_program`."""
    # Unit strides along K (x, weights, scales) and along N (out) are checked by the caller.
    gl.static_assert((PDL & PDL_WAIT_FIRST == 0) or (PDL & PDL_WAIT_LOADS == 0), "PDL: one wait")
    if PDL & PDL_WAIT_FIRST:
        grid_control("wait")
    if PDL & PDL_TRIGGER:
        grid_control("launch_dependents")
    _program(gl.program_id(0), a_ptr, stride_am, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn,
             bias_ptr, stride_be, stride_bn, rw_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr,
             out_ptr, stride_os, stride_om, N, up_offset, alpha, beta, limit, cnt_ptr, num_cnt, sum_ptr, stride_sum,
             cnt_ptr, K, A_ROW_DIV, GATED, GATE_STRIDE, HAS_LIMIT, HAS_BIAS, ROUTE_WEIGHT, BLOCK_M, BLOCK_K,
             SPLIT_K, SYNC_MMA, PER_PAIR_E, COUNTERS, TOPK, AQ, AQ_ROUNDING,
             PREVIOUS_GRID if PDL & PDL_WAIT_LOADS else 0, XROW, HALVES, X_ORDER, PAIRED_OUT, X_QDQ)


@gluon.jit
def _moe_per_pair_sm90(
    x_ptr, stride_xm,
    w1_ptr, stride_w1e, stride_w1n, s1_ptr, stride_s1e, stride_s1n, b1_ptr, stride_b1e, stride_b1n,
    inter_ptr, stride_im,
    w2_ptr, stride_w2e, stride_w2n, s2_ptr, stride_s2e, stride_s2n, b2_ptr, stride_b2e, stride_b2n,
    rw_ptr, ids_ptr, y_ptr, stride_ys, stride_ym, out_ptr, stride_out,
    sync_ptr, num_pairs, up_offset, alpha, beta, limit,
    H: gl.constexpr,
    I: gl.constexpr,
    E: gl.constexpr,
    TOPK: gl.constexpr,
    GATE_STRIDE: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    HAS_BIAS1: gl.constexpr,
    HAS_BIAS2: gl.constexpr,
    SPLIT_K: gl.constexpr,
    AQ: gl.constexpr = 0,
    AQ_ROUNDING: gl.constexpr = 0,
    XROW: gl.constexpr = 0,
    X_QDQ: gl.constexpr = False,
):
    """Both GEMMs of a call on per-pair blocks (``routing.per_pair``; mma.sync on 8-row
    blocks), with their epilogues and the k-sum, in one launch: GEMM1's programs, then GEMM2's,
    each taking the next role from a ticket counter (``sync_ptr[0]``), so that a GEMM2 program
    only ever waits for programs that have started and never wait themselves (whatever the
    order the hardware starts programs in, and however few fit at once). GEMM1's programs of
    pair p count themselves in ``sync_ptr[1 + p]`` once their intermediate is stored; GEMM2's
    programs of p issue their first weight loads, wait for all of them, and count themselves
    after. ``sync_ptr[1 + num_pairs:]`` holds the k-sum's counters (:func:`_sum_when_last`).
    Every counter is zero at the start and left at zero by the last program that uses it, so
    ``sync_ptr`` must not be shared by two calls at once. ``X_QDQ``: GEMM1's programs
    quantize-dequantize x's row as they read it (:func:`_program`)."""
    N1: gl.constexpr = (I + 31) // 32  # GEMM1 programs per pair (gated: 32 columns each)
    N2: gl.constexpr = (H + _BLOCK_N2 - 1) // _BLOCK_N2 * SPLIT_K  # GEMM2 programs per pair
    ticket = gl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    g1 = num_pairs * N1
    if ticket == g1 + num_pairs * N2 - 1:  # the last ticket: nothing reads the counter after it
        gl.store(sync_ptr, 0)
    ready = sync_ptr + 1
    if ticket < g1:
        _program(ticket, x_ptr, stride_xm, w1_ptr, stride_w1e, stride_w1n, s1_ptr, stride_s1e, stride_s1n,
                 b1_ptr, stride_b1e, stride_b1n, rw_ptr, ids_ptr, ids_ptr, ids_ptr, inter_ptr, 0, stride_im,
                 I, up_offset, alpha, beta, limit, ready, 0, inter_ptr, 0, ready,
                 H, TOPK, True, GATE_STRIDE, HAS_LIMIT, HAS_BIAS1, False, 8, _BLOCK_K, 1, True, E, 0, 1,
                 AQ, AQ_ROUNDING, 0, XROW, X_QDQ=X_QDQ)
        gl.thread_barrier()  # every thread's stores, then the release
        # An unrouted pair's GEMM2 programs do not wait for its GEMM1 programs, which may then
        # count last: whichever program counts last resets the counter.
        if gl.atomic_add(ready + ticket // N1, 1, sem="release", scope="gpu") == N1 + N2 - 1:
            gl.store(ready + ticket // N1, 0)
    else:
        pid = ticket - g1
        _program(pid, inter_ptr, stride_im, w2_ptr, stride_w2e, stride_w2n, s2_ptr, stride_s2e, stride_s2n,
                 b2_ptr, stride_b2e, stride_b2n, rw_ptr, ids_ptr, ids_ptr, ids_ptr, y_ptr, stride_ys, stride_ym,
                 H, 0, 1.0, 0.0, 0.0, ready + num_pairs, 0, out_ptr, stride_out, ready,
                 I, 1, False, 1, False, HAS_BIAS2, True, 8, _BLOCK_K, SPLIT_K, True, E, 2, TOPK, 0, 0, N1, XROW)
        # After the pair's N1 GEMM1 programs (waited for, or, unrouted, not): the last of its
        # N1 + N2 programs to count sees N1 + N2 - 1 and resets the counter.
        pair = pid // N2
        if gl.atomic_add(ready + pair, 1, sem="relaxed", scope="gpu") == N1 + N2 - 1:
            gl.store(ready + pair, 0)


GEMM_SM90 = Launcher(_moe_gemm_sm90)
PER_PAIR_SM90 = Launcher(_moe_per_pair_sm90)
wgmma_guard.guard("_moe_gemm_sm90")


def paired(x: torch.Tensor, aq: ActivationQuant = ActivationQuant(), pdl: bool = False) -> torch.Tensor:
    """``x [M, K]`` (unit column stride, K a multiple of 8) → ``[M, K]`` in the paired order of
    :func:`sm90_tile.paired_position` (value ``4h + r`` of every 8 at ``2r + h``; a view of rows
    padded to a multiple of 128 columns), the activations that grouped mma.sync blocks read with
    ``X_ORDER = moe_sm90_loops.ORDER_PAIRED``. Under activation quantization (``aq``; K a multiple of 32)
    quantize-dequantized on the way;
    ``pdl``: launched by PDL after the routing kernels (:func:`mxfx.kernels.routing.align`), the
    GEMM after it by PDL too, which then waits for both (:func:`sm90_tile.ordered_copy`)."""
    M, K = x.shape
    if x.stride(1) != 1 or K % (32 if aq.fmt != "none" else 8):
        raise ValueError(f"paired: x must have unit column stride and K a multiple of "
                         f"{32 if aq.fmt != 'none' else 8}; got strides {tuple(x.stride())}, K = {K}")
    return tile.ordered_copy(x, aq, split=True, dot=False, pdl=pdl)[:, :K]


@functools.lru_cache(maxsize=None)
def runs_on(device: torch.device) -> bool:
    """Whether ``device`` is a Hopper GPU (wgmma, CUDA sm_90)."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] == 9
