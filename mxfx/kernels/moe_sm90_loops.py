"""The K loops of :mod:`mxfx.kernels.moe_sm90`'s programs: a tile of 64 weight rows of one
expert (MXFP4, unpacked into A fragments by :func:`sm90_tile.unpack_a`) times a block's
activation rows, summed over a K range into a float32 accumulator, by mma.sync (blocks of 8
rows, the activations loaded into B fragments) or wgmma (16 to 32 rows, staged in shared memory).
:func:`k_loops_checked` is the entry.

Loads are issued one K step ahead (register double buffering, unrolled by two so that the
buffers rotate without copies); rows past N are clamped and never stored, so only the K tail
(with split K, the steps past those the shortest split has whole) is masked. A per-pair block
(one activation row) keeps its row in shared memory instead, where every lane reads its
fragments each step, so the registers hold the weights of 3 or 4 steps ahead
(:func:`_k_loop_x_row`). The mma.sync loops unpack by one multiply per output
(:data:`sm90_tile.UNPACK_SPLIT_SMALL`), exact while the weights' scales are at most 128; a
program that met a larger scale runs its loop again by the unpack exact for every scale
(:func:`_k_loops_exact`).

:func:`exact_rows` is the exact unpack's K loop over 8 rows, with which
``moe_sm90_ws._redo`` computes again the warp-specialized kernel's tiles whose weights
have a scale over 128.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from mxfx.kernels import mx, sm90_tile as tile
from mxfx.kernels.launch import next_power_of_2

# The K step.
_BLOCK_K = gl.constexpr(128)
BLOCK_K = _BLOCK_K.value


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
PREVIOUS_GRID = gl.constexpr(-1)

# How a grouped mma.sync block's activations are laid out along K (X_ORDER), and so how its
# lanes load them: natural; as the warp-specialized kernel reads them (moe_sm90_ws.dot_order,
# read back in natural order); or paired (:func:`moe_sm90.paired`), each 16-byte load holding its four
# B registers ready, with no permute in the loop.
ORDER_NATURAL = gl.constexpr(0)
ORDER_DOT = gl.constexpr(1)
ORDER_PAIRED = gl.constexpr(2)


@gluon.jit
def grid_control(op: gl.constexpr):
    """``griddepcontrol.wait`` (until the grid launched before this one has finished and its
    writes are visible) or ``griddepcontrol.launch_dependents`` (the grid launched after this
    one by PDL may start); either is a no-op without PDL."""
    gl.inline_asm_elementwise("griddepcontrol." + op.value + "; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.constexpr_function
def x_layout(BM, NI):
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
def xb_layout(BM, NI):
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
    step ahead (``NFULL`` unmasked steps of ``NS``). ``WAIT`` 0, or ``PREVIOUS_GRID``: the
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
    if WAIT == PREVIOUS_GRID:
        grid_control("wait")
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
    if WAIT == PREVIOUS_GRID:
        grid_control("wait")
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
                          (K + _BLOCK_K - 1) // _BLOCK_K, A_ROW_DIV, False, 0, 0, 8, _BLOCK_K, 1, WL, xb_layout(8, 1),
                          A_L, B_L, MMA, ORDER_DOT)


@gluon.jit
def k_loops_checked(w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, e64, n0, N, up_offset, a_ptr,
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
