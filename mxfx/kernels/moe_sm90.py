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

Loads are issued one K step ahead (register double buffering, unrolled by two so that the
buffers rotate without copies); rows past N are clamped and never stored, so only the K tail
(with split K, the steps past those the shortest split has whole) is masked. A per-pair block
(one activation row) keeps its row in shared memory instead, where every lane reads its
fragments each step, so the registers hold the weights of 3 or 4 steps ahead
(:func:`_k_loop_x_row`). Where GEMM1's grid is small (a token or two), two warpgroups share
each of its per-pair tiles, half the K steps each (``HALVES``): twice the warps per SM to wait
on the weights. The mma.sync loops unpack by one multiply per output
(:data:`sm90_tile.UNPACK_SPLIT_SMALL`), exact while the weights' scales are at most 128; a
program that met a larger scale runs its loop again by the unpack exact for every scale
(:func:`_k_loops_exact`).

Launched by PDL (programmatic dependent launch, ``PDL``), GEMM2's programs start while GEMM1
runs and wait for it by ``griddepcontrol.wait`` once their first weight loads are issued; on
grouped blocks GEMM1 is launched by PDL too, after the routing kernels, and waits for them
before it reads the routing.

:func:`exact_rows` is the exact unpack's K loop over 8 rows, with which
``moe_sm90_ws._redo`` computes again the warp-specialized kernel's tiles whose weights
have a scale over 128.

:func:`_moe_per_pair_sm90` runs a per-pair call's two GEMMs (and its k-sum) as one launch, the
second GEMM's programs waiting on counters for the first's: one launch's host time in an eager
call instead of two.
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from mxfx.kernels import mx, sm90_tile as tile, wgmma_guard
from mxfx.kernels.launch import Launcher, next_power_of_2
from mxfx.moe_call import ActivationQuant


# The K step, and the output columns per program without a gated epilogue (GEMM2).
_BLOCK_K = gl.constexpr(128)
_BLOCK_N2 = gl.constexpr(64)
BLOCK_K = _BLOCK_K.value
BLOCK_N2 = _BLOCK_N2.value


# Until the counter at $1 reaches $2: relaxed reads a quarter µs apart, then one acquire, whose
# value is the result (a caller that drops it would let ptxas drop the acquire). Every thread
# waits on its own: no barrier. Waiting programs share SMs with the ones they wait for, so
# they must cost those little: polling by acquires (each invalidates the SM's L1, where the
# others keep their activations) took gpt-oss-120b T=1 from 32.0 to 36.5 µs, by volatile loads
# without a pause to 40.3.
_WAIT = gl.constexpr("""
{
.reg .pred p;
.reg .b32 v;
POLL:
ld.relaxed.gpu.global.b32 v, [$1];
setp.lt.s32 p, v, $2;
@!p bra.uni DONE;
nanosleep.u32 256;
bra.uni POLL;
DONE:
ld.acquire.gpu.global.b32 $0, [$1];
}
""")


# The WAIT of a program launched by PDL (programmatic dependent launch) after the grid whose
# output it reads: it waits for that grid by griddepcontrol.wait, not on a counter.
_PREVIOUS_GRID = gl.constexpr(-1)

# A launch's part in PDL, the bits of _moe_gemm_sm90's PDL (moe._gemm passes their values).
# Every program of a grid launched by PDL waits, so that its end implies the previous grid's,
# and so on up the chain.
PDL_TRIGGER = gl.constexpr(1)  # the grid launched after this one by PDL may start at once
PDL_WAIT_FIRST = gl.constexpr(2)  # launched by PDL: waits for the previous grid before it reads anything
PDL_WAIT_LOADS = gl.constexpr(4)  # launched by PDL: reads the routing, issues its first weight loads, waits

# How a grouped mma.sync block's activations are laid out along K (X_ORDER), and so how its
# lanes load them: natural; as the warp-specialized kernel reads them (moe_sm90_ws.dot_order,
# read back in natural order); or paired (:func:`paired`), each 16-byte load holding its four
# B registers ready, with no permute in the loop.
ORDER_NATURAL = gl.constexpr(0)
ORDER_DOT = gl.constexpr(1)
ORDER_PAIRED = gl.constexpr(2)


@gluon.jit
def _grid_control(op: gl.constexpr):
    """``griddepcontrol.wait`` (until the grid launched before this one has finished and its
    writes are visible) or ``griddepcontrol.launch_dependents`` (the grid launched after this
    one by PDL may start); either is a no-op without PDL."""
    gl.inline_asm_elementwise("griddepcontrol." + op.value + "; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.constexpr_function
def _x_layout(BM, NI):
    """``[BM, NI, 4, 4, 8]`` activations in natural K order (k = 128i + 32c + 8j + e), 8
    contiguous bf16 (16 bytes) per thread."""
    free = [[0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [0, 0, 1, 0, 0], [0, 0, 2, 0, 0]]
    free += [[0, 1 << b, 0, 0, 0] for b in range(tile.log2(NI))] + [[1 << b, 0, 0, 0, 0] for b in range(tile.log2(BM))]
    lane, rest = free[:5], free[5:]
    warp, reg = rest[:2], rest[2:]
    while len(warp) < 2:
        warp.append([0, 0, 0, 0, 0])
    return gl.DistributedLinearLayout([[0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 0, 4]] + reg, lane, warp, [],
                                      [BM, NI, 4, 4, 8])


@gluon.constexpr_function
def _xb_layout(BM, NI):
    """``[BM, NI, 4, 4, 8]`` activations in natural K order, as the mma.sync B fragments need
    them: lane 4g + c holds segment c of tokens g, g + 8, ... (all 32 values), every warp the
    same (each warp multiplies the whole block of tokens by its 16 weight rows)."""
    reg = [[0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 0, 4], [0, 0, 0, 1, 0], [0, 0, 0, 2, 0]]
    reg += [[0, 1 << b, 0, 0, 0] for b in range(tile.log2(NI))]
    reg += [[8 << b, 0, 0, 0, 0] for b in range(tile.log2(BM) - 3)]
    lane = [[0, 0, 1, 0, 0], [0, 0, 2, 0, 0], [1, 0, 0, 0, 0], [2, 0, 0, 0, 0], [4, 0, 0, 0, 0]]
    warp = [[0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [BM, NI, 4, 4, 8])


@gluon.jit
def _load_w(w_rows, s_rows, wc, sg, k0, k_end, MASKED: gl.constexpr):
    """Weight words ``[64, NI, 4, 4]`` int32 and scales ``[64, NI, 4]`` uint8 of the K step at
    ``k0``; ``MASKED``: zeros (scale 1) from ``k_end`` on."""
    if MASKED:
        w = gl.load(w_rows + (k0 // 8 + wc), mask=k0 // 8 + wc < k_end // 8, other=0)
        s = gl.load(s_rows + (k0 // 32 + sg), mask=k0 // 32 + sg < k_end // 32, other=127)
    else:
        w = gl.load(w_rows + (k0 // 8 + wc))
        s = gl.load(s_rows + (k0 // 32 + sg))
    return w, s


@gluon.jit
def _load_x(x_rows, x_ok, xk, xo, k0, k_end, MASKED: gl.constexpr):
    """The activations ``[BM, NI, 4, 4, 8]`` at natural K offsets ``k0 + xk``, stored at ``k0 + xo``
    (zeros for the rows where ``x_ok`` is false)."""
    if MASKED:
        return gl.load(x_rows + (k0 + xo), mask=x_ok & (k0 + xk < k_end), other=0.0)
    return gl.load(x_rows + (k0 + xo), mask=x_ok, other=0.0)


@gluon.jit
def _load_step(w_rows, s_rows, x_rows, x_ok, wc, sg, xk, xo, k0, k_end, MASKED: gl.constexpr):
    """:func:`_load_w` and :func:`_load_x` of the K step at ``k0``."""
    w, s = _load_w(w_rows, s_rows, wc, sg, k0, k_end, MASKED)
    return w, s, _load_x(x_rows, x_ok, xk, xo, k0, k_end, MASKED)


@gluon.jit
def _mma_step(acc, smax, w, s, x, x_smem, tables, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, WL: gl.constexpr,
              A_L: gl.constexpr, B_L: gl.constexpr, SYNC_MMA: gl.constexpr, SMALL_SCALES: gl.constexpr,
              X_PAIRED: gl.constexpr = False):
    """Unpack one K step's weights into the A fragment, bring its activations in the same K
    order (B fragments in registers, or staged in ``x_smem``), ``acc += W @ X^T``.
    ``SMALL_SCALES`` (mma.sync only): by the unpack that is exact for scales up to 128, and
    ``smax`` keeps the largest scale it took, for the caller to check. ``X_PAIRED`` (mma.sync
    only): ``x`` is in the paired order already (:func:`sm90_tile.paired_position`), else it is
    paired here, a register permute per B register."""
    a = tile.unpack_a(w, s, tables, 64, BLOCK_K, WL, A_L, SYNC_MMA, SMALL_SCALES)
    if SMALL_SCALES:
        smax = gl.maximum(smax, s)
    if SYNC_MMA:  # each lane loaded its B fragments: they move only within its registers
        xs = x if X_PAIRED else tile.split_order(x)
        b = gl.convert_layout(gl.permute(tile.to_dot_order(xs, BLOCK_M, BLOCK_K), [1, 0]), B_L,
                              assert_trivial=True)
        return mma_v2(a, b, acc), smax
    else:
        x_smem.store(tile.to_dot_order(x, BLOCK_M, BLOCK_K))
        fence_async_shared()
        gl.thread_barrier()
        return warpgroup_mma(a, x_smem.permute((1, 0)), acc), smax


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


_pow2_at_least = gluon.constexpr_function(next_power_of_2)


@gluon.constexpr_function
def _x_row_layout(NI):
    """``[128 NI]``, one K step of an activation row in natural order, as :func:`_xb_layout`
    holds one token: lane 4g + c the 32 values of segment c, whatever g (every lane of a
    quad column the same), every warp the same."""
    reg = [[1 << b] for b in range(5)] + [[128 << b] for b in range(tile.log2(NI))]
    return gl.DistributedLinearLayout(reg, [[32], [64], [0], [0], [0]], [[0], [0]], [], [128 * NI])


@gluon.jit
def _x_row_to_smem(a_ptr, row, k_lo, k_end, NS: gl.constexpr, NI: gl.constexpr, XQ: gl.constexpr,
                   XQ_ROUNDING: gl.constexpr):
    """A per-pair block's one activation row, K from ``k_lo`` (zeros from ``k_end`` on), in
    shared memory as ``[NS', 128 NI]`` (NS' >= NS steps), for every lane to read in the K
    loop: no activation registers carried from one step to the next. In the paired order
    (:func:`sm90_tile.paired_position`): paired here once, not in every step by every lane
    (a tenth of the per-pair K loop's instructions). ``XQ`` (a format code of
    :data:`mx.FMT_CODES`, 0 none): quantize-dequantized on the way as :func:`mx.qdq` does it,
    with ``XQ_ROUNDING`` (``k_lo`` and ``k_end`` are multiples of 32, so the zeros past
    ``k_end`` fill whole 32-blocks)."""
    NSP: gl.constexpr = _pow2_at_least(NS)
    XR: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
    kk = gl.arange(0, NSP * 128 * NI, layout=XR)
    XS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    x_all = gl.allocate_shared_memory(a_ptr.dtype.element_ty, [NSP * 128 * NI], XS)
    xr = gl.load(a_ptr + row + (k_lo + kk), mask=k_lo + kk < k_end, other=0.0)
    if XQ != 0:
        xr = gl.reshape(mx.qdq(gl.reshape(xr, [1, NSP * 128 * NI]), XQ, XQ_ROUNDING, 1, NSP * 128 * NI),
                        [NSP * 128 * NI])
    x_all.store(gl.convert_layout(tile.to_paired(xr), XR))
    return x_all._reinterpret(a_ptr.dtype.element_ty, [NSP, 128 * NI], XS)


@gluon.jit
def _x_row_step(x_all, step, BLOCK_M: gl.constexpr, NI: gl.constexpr, XL: gl.constexpr):
    """Step ``step``'s activations from :func:`_x_row_to_smem`, ``[BLOCK_M, NI, 4, 4, 8]`` in
    ``XL``: every row of the block the same (only the first is stored by the epilogue)."""
    xs = gl.reshape(x_all.index(step).load(_x_row_layout(NI)), [NI, 4, 4, 8])
    xs = gl.expand_dims(gl.convert_layout(xs, gl.SliceLayout(0, XL), assert_trivial=True), 0)
    rows = gl.full([BLOCK_M, 1, 1, 1, 1], 0, gl.int32, layout=XL)
    x, _ = gl.broadcast(xs, rows)
    return x


@gluon.jit
def _k_loop(acc, smax, w_rows, s_rows, wc, sg, tables, a_ptr, stride_am, sorted_ptr, blk, nrows, k_lo, k_end,
            NFULL: gl.constexpr, NS: gl.constexpr, A_ROW_DIV: gl.constexpr, PER_PAIR: gl.constexpr,
            WAIT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, NI: gl.constexpr, WL: gl.constexpr,
            XL: gl.constexpr, A_L: gl.constexpr, B_L: gl.constexpr, SYNC_MMA: gl.constexpr,
            SMALL_SCALES: gl.constexpr, X_ORDER: gl.constexpr):
    """The K loop with the block's activations loaded into registers with its weights, one
    step ahead (``NFULL`` unmasked steps of ``NS``). ``WAIT`` 0, or ``_PREVIOUS_GRID``: the
    first two steps' weight loads are issued before the wait, their activations after.
    ``X_ORDER``: how the activations are stored along K (``ORDER_*``; paired: mma.sync only)."""
    X4: gl.constexpr = gl.SliceLayout(4, XL)
    X3: gl.constexpr = gl.SliceLayout(3, X4)
    X2: gl.constexpr = gl.SliceLayout(2, X3)
    X1: gl.constexpr = gl.SliceLayout(1, X2)
    X_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
    # The block's activation rows (rows past block_rows are never stored).
    m = gl.arange(0, BLOCK_M, layout=X1)
    if PER_PAIR:
        pairs_x = blk + m
    else:
        pairs_x = gl.load(sorted_ptr + blk * BLOCK_M + m, mask=m < nrows, other=0)
    x_rows = gl.expand_dims(tile.x3(a_ptr + (pairs_x // A_ROW_DIV).to(gl.int64) * stride_am), 3)
    x_rows = gl.expand_dims(x_rows, 4)
    xi = gl.arange(0, NI, layout=gl.SliceLayout(0, X2))
    xc = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, X3)))
    xj = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, X4))))
    xe = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, XL)))))
    xk = (gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(xi * 128, 0), 2), 3), 4)
          + gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(xc * 32, 0), 1), 3), 4)
          + gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(xj * 8, 0), 1), 2), 4)
          + gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(xe, 0), 1), 2), 3))
    # The block's padding rows are not read: a block of few rows would otherwise spend most
    # of its activation traffic on copies of row 0 (T=512: 981 -> 957 µs).
    x_ok = gl.expand_dims(gl.expand_dims(tile.x3(m < nrows), 3), 4) & (xk >= 0)  # (& broadcasts to [BM, NI, 4, 4, 8])
    xo = tile.dot_position(xk, True) if X_ORDER == ORDER_DOT else xk  # (each 128-wide step is padded with zeros)
    gl.static_assert(X_ORDER != ORDER_PAIRED or SYNC_MMA)
    X_PAIRED: gl.constexpr = X_ORDER == ORDER_PAIRED

    if SYNC_MMA:
        x_smem0 = 0  # unused placeholders: the activations stay in registers
        x_smem1 = 0
    else:
        x_smem0 = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_K], X_SMEM)
        x_smem1 = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_K], X_SMEM)
    # Steps 2i and 2i+1 of the loop use x_smem0 and x_smem1; its loads need no K mask.
    ITER: gl.constexpr = (NFULL - 2) // 2 if NFULL > 1 else 0
    w0, s0 = _load_w(w_rows, s_rows, wc, sg, k_lo, k_end, NFULL == 0)
    if NS > 1:
        w1, s1 = _load_w(w_rows, s_rows, wc, sg, k_lo + BLOCK_K, k_end, NFULL <= 1)
    if WAIT == _PREVIOUS_GRID:
        _grid_control("wait")
    x0 = _load_x(x_rows, x_ok, xk, xo, k_lo, k_end, NFULL == 0)
    if NS > 1:
        x1 = _load_x(x_rows, x_ok, xk, xo, k_lo + BLOCK_K, k_end, NFULL <= 1)
    if ITER > 0:  # (a range loop's body is compiled even for 0 trips)
        for it in range(ITER):
            k0 = k_lo + it * (2 * BLOCK_K)
            acc, smax = _mma_step(acc, smax, w0, s0, x0, x_smem0, tables, BLOCK_M, BLOCK_K, WL, A_L, B_L, SYNC_MMA,
                                  SMALL_SCALES, X_PAIRED)
            w0, s0, x0 = _load_step(w_rows, s_rows, x_rows, x_ok, wc, sg, xk, xo, k0 + 2 * BLOCK_K, k_end, False)
            acc, smax = _mma_step(acc, smax, w1, s1, x1, x_smem1, tables, BLOCK_M, BLOCK_K, WL, A_L, B_L, SYNC_MMA,
                                  SMALL_SCALES, X_PAIRED)
            w1, s1, x1 = _load_step(w_rows, s_rows, x_rows, x_ok, wc, sg, xk, xo, k0 + 3 * BLOCK_K, k_end, False)
    for j in gl.static_range(2 * ITER, NS):
        if j % 2 == 0:
            acc, smax = _mma_step(acc, smax, w0, s0, x0, x_smem0, tables, BLOCK_M, BLOCK_K, WL, A_L, B_L, SYNC_MMA,
                                  SMALL_SCALES, X_PAIRED)
        else:
            acc, smax = _mma_step(acc, smax, w0, s0, x0, x_smem1, tables, BLOCK_M, BLOCK_K, WL, A_L, B_L, SYNC_MMA,
                                  SMALL_SCALES, X_PAIRED)
        if j + 1 < NS:
            w0 = w1
            s0 = s1
            x0 = x1
        if j + 2 < NS:
            w1, s1, x1 = _load_step(w_rows, s_rows, x_rows, x_ok, wc, sg, xk, xo, k_lo + (j + 2) * BLOCK_K, k_end,
                                    j + 2 >= NFULL)
    return acc, smax


@gluon.jit
def _k_loop_x_row(acc, smax, w_rows, s_rows, wc, sg, tables, a_ptr, row, ready, k_lo, k_end, NFULL: gl.constexpr,
                  NS: gl.constexpr, STAGES: gl.constexpr, WAIT: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_K: gl.constexpr, NI: gl.constexpr, WL: gl.constexpr, XL: gl.constexpr,
                  A_L: gl.constexpr, B_L: gl.constexpr, SMALL_SCALES: gl.constexpr, XQ: gl.constexpr,
                  XQ_ROUNDING: gl.constexpr):
    """The K loop of a per-pair block on mma.sync with its activation row in shared memory
    (:func:`_x_row_to_smem`, ``XQ`` as there) and the weights loaded ``STAGES`` steps ahead."""
    bufs = ()
    for j in gl.static_range(STAGES):
        if j < NS:
            bufs = bufs + (_load_w(w_rows, s_rows, wc, sg, k_lo + j * BLOCK_K, k_end, j >= NFULL),)
    x_end = k_end
    if WAIT == _PREVIOUS_GRID:
        _grid_control("wait")
    elif WAIT:  # (the acquire's value must be used, or ptxas drops the acquire)
        ok = gl.inline_asm_elementwise(_WAIT, "=r,l,r", [ready.to(gl.int64, bitcast=True), WAIT],
                                       dtype=gl.int32, is_pure=False, pack=1) >= WAIT
        x_end = gl.where(ok, k_end, k_lo)
    x_all = _x_row_to_smem(a_ptr, row, k_lo, x_end, NS, NI, XQ, XQ_ROUNDING)
    ITER: gl.constexpr = (NFULL - STAGES) // STAGES if NFULL >= STAGES else 0
    if ITER > 0:
        for it in range(ITER):
            for j in gl.static_range(STAGES):
                w, s = bufs[0]
                acc, smax = _mma_step(acc, smax, w, s, _x_row_step(x_all, it * STAGES + j, BLOCK_M, NI, XL), 0, tables,
                                      BLOCK_M, BLOCK_K, WL, A_L, B_L, True, SMALL_SCALES, True)
                bufs = bufs[1:] + (_load_w(w_rows, s_rows, wc, sg, k_lo + (it * STAGES + j + STAGES) * BLOCK_K,
                                           k_end, False),)
    for j in gl.static_range(STAGES * ITER, NS):
        w, s = bufs[0]
        acc, smax = _mma_step(acc, smax, w, s, _x_row_step(x_all, j, BLOCK_M, NI, XL), 0, tables, BLOCK_M, BLOCK_K, WL,
                              A_L, B_L, True, SMALL_SCALES, True)
        bufs = bufs[1:]
        if j + STAGES < NS:
            bufs = bufs + (_load_w(w_rows, s_rows, wc, sg, k_lo + (j + STAGES) * BLOCK_K, k_end,
                                   j + STAGES >= NFULL),)
    return acc, smax


@gluon.jit
def _k_loops(acc, smax, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, e64, n0, N, up_offset, a_ptr,
             stride_am, sorted_ptr, blk, nrows, ready_ptr, k_lo, k_end, GATED: gl.constexpr,
             GATE_STRIDE: gl.constexpr, NFULL: gl.constexpr, NS: gl.constexpr, A_ROW_DIV: gl.constexpr,
             PER_PAIR: gl.constexpr, WAIT: gl.constexpr, XROW: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_K: gl.constexpr, NI: gl.constexpr, WL: gl.constexpr, XL: gl.constexpr, A_L: gl.constexpr,
             B_L: gl.constexpr, SYNC_MMA: gl.constexpr, SMALL_SCALES: gl.constexpr, X_ORDER: gl.constexpr = 0,
             XQ: gl.constexpr = 0, XQ_ROUNDING: gl.constexpr = 0):
    """The program's K loop over expert ``e64``'s weight rows from ``n0``: :func:`_k_loop_x_row`
    where ``XROW`` (per-pair blocks; ``XQ`` as there), else :func:`_k_loop` (``X_ORDER`` as there)."""
    w_rows, s_rows, wc, sg, tables = tile.weight_rows(w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, e64,
                                                      n0, N, up_offset, GATED, GATE_STRIDE, 64, NI, WL)
    if XROW:
        row = (blk // A_ROW_DIV).to(gl.int64) * stride_am
        return _k_loop_x_row(acc, smax, w_rows, s_rows, wc, sg, tables, a_ptr, row, ready_ptr + blk, k_lo, k_end,
                             NFULL, NS, XROW, WAIT, BLOCK_M, BLOCK_K, NI, WL, XL, A_L, B_L, SMALL_SCALES, XQ,
                             XQ_ROUNDING)
    else:
        return _k_loop(acc, smax, w_rows, s_rows, wc, sg, tables, a_ptr, stride_am, sorted_ptr, blk, nrows, k_lo,
                       k_end, NFULL, NS, A_ROW_DIV, PER_PAIR, WAIT, BLOCK_M, BLOCK_K, NI, WL, XL, A_L, B_L,
                       SYNC_MMA, SMALL_SCALES, X_ORDER)


@gluon.jit(noinline=True)
def _k_loops_exact(w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, e64, n0, N, up_offset, a_ptr,
                   stride_am, sorted_ptr, blk, nrows, ready_ptr, k_lo, k_end, GATED: gl.constexpr,
                   GATE_STRIDE: gl.constexpr, NFULL: gl.constexpr, NS: gl.constexpr, A_ROW_DIV: gl.constexpr,
                   PER_PAIR: gl.constexpr, WAIT: gl.constexpr, XROW: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_K: gl.constexpr, NI: gl.constexpr, WL: gl.constexpr, XL: gl.constexpr, A_L: gl.constexpr,
                   B_L: gl.constexpr, MMA: gl.constexpr, X_ORDER: gl.constexpr = 0, XQ: gl.constexpr = 0,
                   XQ_ROUNDING: gl.constexpr = 0):
    """:func:`_k_loops` on mma.sync by the unpack exact for every scale, from a zero accumulator. A
    call, not inlined: inlined, the second loop kept addresses of the first alive (per-pair GEMM2
    at T=1, K split in 4: 80 -> 117 registers, 6 -> 4 programs per SM; called, 88)."""
    smax = gl.zeros([64, NI, 4], gl.uint8, layout=gl.SliceLayout(3, gl.SliceLayout(4, WL)))
    acc, _ = _k_loops(gl.zeros([64, BLOCK_M], gl.float32, layout=MMA), smax, w_ptr, stride_we, stride_wn, s_ptr,
                      stride_se, stride_sn, e64, n0, N, up_offset, a_ptr, stride_am, sorted_ptr, blk, nrows, ready_ptr,
                      k_lo, k_end, GATED, GATE_STRIDE, NFULL, NS, A_ROW_DIV, PER_PAIR, WAIT, XROW, BLOCK_M,
                      BLOCK_K, NI, WL, XL, A_L, B_L, True, False, X_ORDER, XQ, XQ_ROUNDING)
    return acc


@gluon.jit
def exact_rows(w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, e64, n0, N, up_offset, a_ptr, stride_am,
               pairs_ptr, nrows, K: gl.constexpr, GATED: gl.constexpr, GATE_STRIDE: gl.constexpr,
               A_ROW_DIV: gl.constexpr):
    """The ``[64, 8]`` float32 accumulator (mma.sync layout) of the 64 weight rows from ``n0``
    (:func:`sm90_tile.weight_rows`) times the first 8 of the ``nrows`` activation rows of pairs
    ``pairs_ptr[:8]``, stored as the warp-specialized kernel reads them (``ORDER_DOT``), by the
    unpack exact for every scale (``moe_sm90_ws._redo``)."""
    WL: gl.constexpr = tile.w_layout(1)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    return _k_loops_exact(w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, e64, n0, N, up_offset, a_ptr,
                          stride_am, pairs_ptr, 0, nrows, pairs_ptr, 0, K, GATED, GATE_STRIDE, K // _BLOCK_K,
                          (K + _BLOCK_K - 1) // _BLOCK_K, A_ROW_DIV, False, 0, 0, 8, _BLOCK_K, 1, WL, _xb_layout(8, 1),
                          A_L, B_L, MMA, ORDER_DOT)


# Registers per thread of a program whose K loop runs in two warpgroups (``HALVES``), and its
# weights' steps ahead: at 80, three such programs of 8 warps fit an SM (24 warps), and 3 steps
# ahead compile without spills (sm_90a; 4 steps ahead were slower at T=1 on gpt-oss-120b).
HALF_REGS = gl.constexpr(80)
HALF_STAGES = gl.constexpr(3)


@gluon.jit
def _k_loops_checked(w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, e64, n0, N, up_offset, a_ptr,
                     stride_am, sorted_ptr, blk, nrows, ready_ptr, k_lo, k_end, GATED: gl.constexpr,
                     GATE_STRIDE: gl.constexpr, NFULL: gl.constexpr, NS: gl.constexpr, A_ROW_DIV: gl.constexpr,
                     PER_PAIR: gl.constexpr, WAIT: gl.constexpr, XROW: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_K: gl.constexpr, NI: gl.constexpr, WL: gl.constexpr, XL: gl.constexpr, A_L: gl.constexpr,
                     B_L: gl.constexpr, MMA: gl.constexpr, SYNC_MMA: gl.constexpr, X_ORDER: gl.constexpr = 0,
                     XQ: gl.constexpr = 0, XQ_ROUNDING: gl.constexpr = 0):
    """:func:`_k_loops` from a zero accumulator (``X_ORDER`` as :func:`_k_loop`'s, ``XQ`` as
    :func:`_x_row_to_smem`'s). The mma.sync
    loops unpack by one multiply that is exact for scales up to 128 (32-blocks whose largest
    weight is under 16, or 12 with round-up scales); where the loop met a larger scale it runs
    again by the unpack exact for every scale (:func:`_k_loops_exact`): such weights cost it
    twice the time, never accuracy."""
    smax = gl.zeros([64, NI, 4], gl.uint8, layout=gl.SliceLayout(3, gl.SliceLayout(4, WL)))
    acc, smax = _k_loops(gl.zeros([64, BLOCK_M], gl.float32, layout=MMA), smax, w_ptr, stride_we, stride_wn, s_ptr,
                         stride_se, stride_sn, e64, n0, N, up_offset, a_ptr, stride_am, sorted_ptr, blk, nrows,
                         ready_ptr, k_lo, k_end, GATED, GATE_STRIDE, NFULL, NS, A_ROW_DIV, PER_PAIR, WAIT, XROW,
                         BLOCK_M, BLOCK_K, NI, WL, XL, A_L, B_L, SYNC_MMA, SYNC_MMA, X_ORDER, XQ, XQ_ROUNDING)
    if SYNC_MMA:
        if tile.over_small_scales(smax):
            acc = _k_loops_exact(w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, e64, n0, N, up_offset,
                                 a_ptr, stride_am, sorted_ptr, blk, nrows, ready_ptr, k_lo, k_end, GATED, GATE_STRIDE,
                                 NFULL, NS, A_ROW_DIV, PER_PAIR, WAIT, XROW, BLOCK_M, BLOCK_K, NI, WL, XL, A_L,
                                 B_L, MMA, X_ORDER, XQ, XQ_ROUNDING)
    return acc


@gluon.jit
def _half(hargs, k_lo, k_end, GATED: gl.constexpr, GATE_STRIDE: gl.constexpr, NFULL: gl.constexpr,
          NS: gl.constexpr, A_ROW_DIV: gl.constexpr, WAIT: gl.constexpr, XROW: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_K: gl.constexpr, NI: gl.constexpr, WL: gl.constexpr, XL: gl.constexpr, A_L: gl.constexpr,
          B_L: gl.constexpr, MMA: gl.constexpr, STORE: gl.constexpr, XQ: gl.constexpr, XQ_ROUNDING: gl.constexpr):
    """One warpgroup's part of a ``HALVES`` program (``hargs``: the tile's runtime values and
    ``part``, a ``[64, BLOCK_M]`` float32 buffer in shared memory): the per-pair K loop over
    ``[k_lo, k_end)`` (``NFULL`` unmasked steps of ``NS``; :func:`_k_loops_checked`; ``XQ`` as
    :func:`_x_row_to_smem`'s, on its half of the row). Returns ``(acc,)``; ``STORE`` (the
    second warpgroup) leaves it in ``part``."""
    (w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, e64, n0, N, up_offset, a_ptr, stride_am,
     sorted_ptr, blk, nrows, ready_ptr, part) = hargs
    acc = _k_loops_checked(w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, e64, n0, N, up_offset, a_ptr,
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
    ``ready_ptr[block]`` has reached this count, or with ``_PREVIOUS_GRID`` until the grid
    launched before this one has finished (its weights' first loads issued meanwhile).
    ``XROW``: on per-pair blocks, the K loop of :func:`_k_loop_x_row` with the weights this
    many steps ahead; 0: :func:`_k_loop`'s. ``HALVES``: that loop in two warpgroups, half the K
    steps each (:func:`_half`; launched with ``HALF_REGS``). ``X_ORDER``: the activations' order
    along K (``ORDER_*``, as :func:`_k_loop`); ``PAIRED_OUT``: the output stored in the paired order
    (:func:`paired`), for a GEMM2 that reads it so. ``X_QDQ`` (``XROW``): the activation row
    quantize-dequantized as ``AQ``, ``AQ_ROUNDING`` say as it is read (:func:`_x_row_to_smem`;
    under ``HALVES`` each warpgroup its half), not before the launch."""
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
        XL: gl.constexpr = _xb_layout(BLOCK_M, NI)
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    else:
        XL: gl.constexpr = _x_layout(BLOCK_M, NI)
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
        if WAIT == _PREVIOUS_GRID:  # (as every program launched by PDL; per pair, GEMM1 zeroes the counters)
            _grid_control("wait")
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
        acc = _k_loops_checked(w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, e64, n0, N, up_offset,
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
        _grid_control("wait")
    if PDL & PDL_TRIGGER:
        _grid_control("launch_dependents")
    _program(gl.program_id(0), a_ptr, stride_am, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn,
             bias_ptr, stride_be, stride_bn, rw_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr,
             out_ptr, stride_os, stride_om, N, up_offset, alpha, beta, limit, cnt_ptr, num_cnt, sum_ptr, stride_sum,
             cnt_ptr, K, A_ROW_DIV, GATED, GATE_STRIDE, HAS_LIMIT, HAS_BIAS, ROUTE_WEIGHT, BLOCK_M, BLOCK_K,
             SPLIT_K, SYNC_MMA, PER_PAIR_E, COUNTERS, TOPK, AQ, AQ_ROUNDING,
             _PREVIOUS_GRID if PDL & PDL_WAIT_LOADS else 0, XROW, HALVES, X_ORDER, PAIRED_OUT, X_QDQ)


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
    ``X_ORDER = ORDER_PAIRED``. Under activation quantization (``aq``; K a multiple of 32)
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
