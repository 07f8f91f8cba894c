"""The MoE GEMM for Hopper (sm_90) in Gluon when many rows share each weight (large T):
warp-specialized, for MXFP4 weights and bfloat16 activations.

:func:`_moe_gemm_sm90_ws` takes the runtime arguments of ``moe_portable._moe_gemm`` and computes
the same GEMM1 (gated) and GEMM2 epilogues as :mod:`mxfx.kernels.moe_sm90`, whose weight fragments
it shares: a warpgroup unpacks 64 weight rows straight into wgmma A fragments, with the dot's
K permuted inside each 128-wide step. What differs is the data flow. A tile is 64 weight rows
per consumer warpgroup (32 outputs of a gated GEMM), 192 rows with three consumers, 256 with
four (:func:`consumers`), over blocks of up to :data:`BLOCK_M` activation rows (or
:data:`SMALL_BLOCK_M`, :data:`TINY_BLOCK_M`). The kernel is persistent: one program per SM
takes tiles ``pid, pid + grid, ...`` and its ring runs on from tile to tile, so the producer
copies the next tile's first steps while the consumers finish the last ones and run the
epilogue (one program per tile, with the ring filled afresh each time: T=1024 1216 -> 1180 µs,
T=2048 ~1560 -> 1535, T=4096 2355-2549 -> 2351-2397). The partitions:

- A producer (4 warps) copies each K step's packed weight words and the block's activation
  rows into a ``STAGES``-slot shared-memory ring with cp.async, signalling a per-slot mbarrier
  as the copies land; it does nothing else, so the copies run several steps ahead. It keeps
  int32 offsets rather than pointers, for registers (:func:`fits` bounds the inputs).
- The copies carry ``.L2::128B`` (:mod:`mxfx.kernels.ptx_hints`): a step copies 64 bytes of
  each weight row, half an L2 line, and with the hint the miss fetches the whole line, so the
  next step's half is an L2 hit (H200, graph µs, gpt-oss-120b, two A/B runs: T=512 871-875 ->
  837-844 and 874-875 -> 848-851; T=2048 1330-1332 -> 1306-1307 and 1323-1334 -> 1321-1322).
  So do the consumers' loads of the scales (4 bytes of each row a step, the rows K/32 bytes
  apart): T=256 778-779 -> 761-762, T=512 836-840 -> 826-830, T=1024 1017-1020 -> 1010-1012.
- Consumers (a warpgroup each, 64 of the weight rows) read their words from the ring,
  unpack them and multiply by wgmma against the activation slot, each freeing the slot once
  its MMAs have retired. A consumer unpacks the second half of a step while the MMA of the
  first half runs (T=4096 2490 -> 2390 µs), and they run apart, so that one's MMAs overlap
  the others' unpack (one consumer of 128 rows in lockstep: 2879). A consumer's step is
  latency-bound, not issue-bound (ncu at T=4096 with two consumers: 2130 cycles per step for
  1280 of MMA, 37 % of issue slots busy, the producer waiting on free slots), so more
  consumers keep the tensor cores busier: three rather than two in 160-row blocks, T=2048
  1453-1459 -> 1313-1314 µs, T=4096 2035-2039 -> 1902-1904. (Two 64-row sub-tiles per
  consumer instead, halving the activation traffic per MMA, changed nothing: 2073 -> 2098-2110.)
  Steps run in pairs, the second's unpack under the first's MMAs, and every MMA retires
  within its pair: ptxas does not order the next step's writes of the fragment registers after
  an MMA still in flight across the loop's back edge, which gave NaNs on the H200, and once
  the fragments are named in the waits it serializes every wgmma instead (C7512).
- The activations arrive by cp.async in 16-byte pieces, which cannot permute K, so both GEMM
  inputs are kept in the dot's K order: x by :func:`dot_order` (a ``[T, padded(H)]``
  temporary), the intermediate by GEMM1's epilogue (``DOT_ORDER_OUT``), each padded with
  zeros to a multiple of 128 columns.
- A block's MMAs are only as wide as its rows need: 16 (in 32- and 64-row blocks), 32, 64,
  64 + 32, 128 or 128 + 32 (the 32-wide MMA reuses the fragments, so up to 160 rows unpack the
  weights once).
- In blocks of up to 64 rows (:func:`splits`) the consumers unpack by one multiply per output
  (``sm90_tile.UNPACK_SPLIT_SMALL``: fewer ALU instructions, which those steps are bound by;
  ncu at T=256, prmt unpack: 60 % of issue slots busy, the producer waiting on free slots),
  exact while a scale is at most 128. Each consumer flags its tiles that met a larger one
  (weights whose 32-blocks reach 12 to 16 in magnitude; none in the bench's), and after the
  partitions join each program computes those again (:func:`_redo`) by mma.sync and the exact
  unpack. Kept out of the consumers, the exact path costs their loop nothing (inside it, it
  added register spills and made the kernel 6-11 % slower; a launch of its own after each
  GEMM timed the same as after the join: tools/PERF_LOG.md, sessions 29-30). The activations
  follow that unpack's K order (``sm90_tile.dot_position``'s ``SPLIT``).

No split K, and no activation quantization inside: under it the caller quantize-dequantizes
each GEMM's input while putting it in dot order (:func:`dot_order`), so GEMM1 then stores the
intermediate in natural order.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from mxfx.kernels import moe_sm90_loops, ptx_hints, wgmma_guard
from mxfx.kernels.launch import Launcher, cdiv, num_sms
from mxfx.kernels.sm90_tile import (SMALL_SCALES_MAX, epilogue, log2, ordered_copy, padded, tables_word, tile_cols,
                                    tile_row, unpack_a, w_layout, weight_rows)
from mxfx.moe_call import ActivationQuant, MoEWeights

# Rows per block: a 128-wide and a 32-wide MMA share each step's unpacked weights, so an
# expert with up to 160 rows unpacks its weights once. (gpt-oss-120b, H200, 128-row blocks:
# exactly 128 rows per expert 1913 µs, 129 rows 2709: the one-row block cost as much as the
# full one. Random top-4 at T=4096 gives 128 ± 11 rows.)
BLOCK_M = 160
# Experts with few rows take blocks of at most this many (a narrower accumulator, fewer rows
# copied for nothing), the fewest of 32 (TINY_BLOCK_M): their ring slots hold 32 activation rows,
# not 64, so it has 9-10 slots rather than 6 (moe.WS_TINY_ROWS).
SMALL_BLOCK_M = 64
TINY_BLOCK_M = gl.constexpr(32)
# One program per SM of four warpgroups, whatever the block: three consumers and the producer.
# Registers at launch, the consumers', the producer's: 4 x 128 = 512 per thread across them,
# so the default partition (the first consumer) gets what the others leave, 512 - 2 x 160 - 40
# = 152 (no spills in the K loops, sm_90a SASS). Against two programs per SM of two consumers
# each in 64-row blocks (and 80 registers at launch), alternating runs: T=1024 1051-1055 ->
# 1027-1028 µs, T=1536 1197-1198 -> 1148-1152, T=512 874-880 -> 860-862.
CONSUMERS, _MAXNREG, _CONSUMER_REGS, _PRODUCER_REGS = 3, 128, 160, 40
# Four consumers (256-row tiles) where a GEMM's outputs fill whole tiles of 256 weight rows:
# 5 warpgroups at 96 registers, consumers 112, producer 32. H200, graph µs, min-max of 2
# alternating processes, three / four consumers. 32-row blocks: Mixtral-8x7B T=32 335-338 /
# 291-293, T=64 354-356 / 322-323; Qwen3-30B-A3B T=128 164 / 163-165, T=256 181 / 174; MiniMax-M3
# T=256 1435-1438 / 1436-1437. 64-row blocks: a four-consumer program goes through fewer weight
# rows a second than a three-consumer one (fewer registers and ring slots), and wins only where
# it takes fewer rounds of tiles: Mixtral-8x7B T=128 445-448 / 411-419, T=192 516-518 / 466-471
# (8 blocks: GEMM2 176 tiles of 192 rows on 132 SMs, two rounds, against 128 of 256, one), T=208
# 532-536 / 480-482 (one routing in five takes a ninth block), T=216 542-548 / 511-515, but
# T=224 542-544 / 558-559 (9 blocks or more three times in five, two rounds either way: hence
# the expected rounds over routing.blocks_pmf, not the rounds of the mean); Qwen3-30B-A3B T=512
# 229-231 / 238, T=896 288-289 / 299-304, MiniMax-M3 T=1024 2010-2015 / 2042-2085 (as many
# rounds either way; _FOUR_SLOWER). Where 192-row tiles fit and 256-row ones do not
# (gpt-oss: 5760 and 2880 outputs), four lose (session 32: gpt-oss-120b T=256 683-687 / 720-721).
_REGS4 = (96, 112, 32)
# A four-consumer tile's time in 64-row blocks over 4/3 of a three-consumer one's: 2-4 % where
# the rounds are as many (Qwen3-30B-A3B T=512, MiniMax-M3 T=1024, above), with a margin.
_FOUR_SLOWER = 1.05


def consumers(block_m: int, n_out: int, gated: bool, blocks: Sequence[tuple[int, float]], sms: int) -> int:
    """Consumer warpgroups (64 weight rows each) per program for a GEMM of ``n_out`` outputs
    (columns) in blocks of ``block_m`` rows (see _REGS4): four where the outputs fill whole
    256-row tiles, in 32-row blocks always, in 64-row blocks where they take enough fewer rounds
    of tiles over ``sms`` programs at once, in expectation over ``blocks``: (blocks holding
    rows, probability) pairs (:func:`mxfx.kernels.routing.blocks_pmf`)."""
    cols = tile_cols(gated)
    if n_out % (cols * 4) or block_m > SMALL_BLOCK_M:
        return CONSUMERS
    if block_m <= TINY_BLOCK_M:
        return 4

    def rounds(nc: int) -> float:
        return sum(p * math.ceil(b * cdiv(n_out, cols * nc) / sms) for b, p in blocks)

    return 4 if rounds(4) * 4 * _FOUR_SLOWER < rounds(CONSUMERS) * CONSUMERS else CONSUMERS


# A consumer's K steps per wait for all its MMAs (_consume's STEPS_PER_WAIT; the steps of a
# group overlap one another's MMAs, the last one's are drained): pairs in 64-row blocks, single
# steps in 160-row ones. gpt-oss-120b, alternating runs, steps of one / two / three: T=256 805 /
# 776 / 785 µs, T=512 848-852 / 829-838 / 883-886, T=1024 1019-1020 / 1008-1012 / 1046; in
# 160-row blocks T=2048 1319 / 1350-1356 / 1398-1399, T=4096 1913 / 1992-1994 / 2025-2028.
# As landed (pairs where K > 384), one / two: T=256 797-798 / 771-773, T=512 840-844 / 820-824.


def _stages(block_m: int, gated: bool, nc: int) -> int:
    """Ring slots: as many as shared memory holds, 227 KiB a block on the H100/H200. 160-row
    blocks: GEMM1 (gated) 4 slots, 225 KB (T=4096 1914-1915 -> 1899-1904 µs against 3); GEMM2 3,
    with four it would need 232 KiB with its epilogue's scratch. 64-row blocks: 6, 189-205 KB
    (T=256 831-834 -> 821-823 µs against 4; T=4096 earlier: 3 slots 2840 against 4 2786, 5 2544
    against 4 2526). 32-row blocks: 10 (221 KB), GEMM2 9 (217 KB). With four consumers (``nc``),
    whose slots hold 16 KiB of weights, not 12: 32-row blocks 8 (219 KB) and 7 (217 KB), 64-row
    ones 5 (186 / 209 KB)."""
    if block_m <= TINY_BLOCK_M:
        return (10 if gated else 9) if nc == 3 else (8 if gated else 7)
    if block_m <= SMALL_BLOCK_M:
        return 6 if nc == 3 else 5
    return 4 if gated else 3


@gluon.constexpr_function
def _ring_words_layout(ROWS):
    """One slot's words ``[ROWS, 16]`` as the consumer reads them: the thread that owns weight
    rows 16w + t/4 and +8 gets the 4 contiguous words of segment t%4 (the unpack's input)."""
    reg = [[0, 1], [0, 2], [8, 0]]
    lane = [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]]
    warp = [[16 << b, 0] for b in range(log2(ROWS // 16))]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [ROWS, 16])


@gluon.jit
def _tile(t, N, block_expert_ptr, block_rows_ptr, BLOCK_N: gl.constexpr):
    """Tile ``t``'s block, the block's expert (< 0: a padding block, nothing to do) and rows,
    and the tile's first output column."""
    num_n = gl.cdiv(N, BLOCK_N)
    blk = t // num_n
    return blk, gl.load(block_expert_ptr + blk), gl.load(block_rows_ptr + blk), (t % num_n) * BLOCK_N


@gluon.jit
def _x_rows(stride_am, pairs_ptr, nrows, A_ROW_DIV: gl.constexpr, MR: gl.constexpr):
    """The first step's element offsets (int32: fewer registers than pointers for the producer)
    of the activation rows of pairs ``pairs_ptr[:MR]``, and their mask (rows past ``nrows``
    are not read)."""
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # 16 bytes per copy
    m = gl.arange(0, MR, layout=gl.SliceLayout(1, XL))
    pairs = gl.load(pairs_ptr + m, mask=m < nrows, other=0)
    kx = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, XL)), 0)
    return gl.expand_dims((pairs // A_ROW_DIV) * stride_am, 1) + kx, gl.expand_dims(m < nrows, 1) & (kx < 128)


@gluon.jit
def _w_rows(stride_wn, n0, N, up_offset, r0, GATED: gl.constexpr, GATE_STRIDE: gl.constexpr, R: gl.constexpr):
    """The first step's word offsets ``[R, 16]`` (int32) of tile rows ``r0 + [0, R)`` in the
    expert's weights, and each offset's word column."""
    WL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    r = r0 + gl.arange(0, R, layout=gl.SliceLayout(1, WL))
    wk = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, WL)), 0) + gl.expand_dims(r * 0, 1)
    # Rows are 16-byte aligned (fits()).
    return gl.expand_dims(tile_row(r, n0, N, up_offset, GATED, GATE_STRIDE) * (stride_wn // 4), 1) + wk, wk


@gluon.jit
def _produce(a_ptr, stride_am, w_ptr, stride_we, stride_wn, pairs_ptr, nrows, e64, n0, N, up_offset,
             x_smem, x2_smem, w_smem, w2_smem, ready, empty, g,
             K: gl.constexpr, A_ROW_DIV: gl.constexpr, GATED: gl.constexpr, GATE_STRIDE: gl.constexpr,
             MR: gl.constexpr, MR2: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr):
    """Copies every K step of the block whose pairs start at ``pairs_ptr`` (``MR`` rows, and
    ``MR2`` more into ``x2_smem``) into the ring, each slot once the consumer has freed it; rows
    past ``nrows`` and words past K are zero-filled, not read. ``g``: the steps this program has
    copied before (the ring runs on across its tiles)."""
    NS: gl.constexpr = (K + 127) // 128
    x_off, x_ok = _x_rows(stride_am, pairs_ptr, nrows, A_ROW_DIV, MR)
    if MR2 > 0:
        x2_off, x2_ok = _x_rows(stride_am, pairs_ptr + MR, nrows - MR, A_ROW_DIV, MR2)
    w_base = (w_ptr + e64 * stride_we).to(gl.pointer_type(gl.int32), bitcast=True)
    w_off, wk = _w_rows(stride_wn, n0, N, up_offset, 0, GATED, GATE_STRIDE, 128)
    w2_off, wk2 = _w_rows(stride_wn, n0, N, up_offset, 128, GATED, GATE_STRIDE, ROWS - 128)
    for i in range(NS):
        s = (g + i) % STAGES
        mbarrier.wait(empty.index(s), (((g + i) // STAGES) & 1) ^ 1)
        async_copy.async_copy_global_to_shared(x_smem.index(s).slice(0, MR), a_ptr + (x_off + i * 128), mask=x_ok)
        if MR2 > 0:
            async_copy.async_copy_global_to_shared(x2_smem.index(s), a_ptr + (x2_off + i * 128), mask=x2_ok)
        async_copy.async_copy_global_to_shared(w_smem.index(s), w_base + (w_off + i * 16), mask=i * 16 + wk < K // 8)
        async_copy.async_copy_global_to_shared(w2_smem.index(s), w_base + (w2_off + i * 16),
                                               mask=i * 16 + wk2 < K // 8)
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)


@gluon.jit
def _steps(i0, n: gl.constexpr, g, s_rows, sg, sc, smax, w_smem, w2_smem, x_smem, x2_smem, ready, empty, acc, acc2,
           tables, K: gl.constexpr, G: gl.constexpr, MR: gl.constexpr, STAGES: gl.constexpr, WH: gl.constexpr,
           A_L: gl.constexpr, TWO: gl.constexpr, SPLIT: gl.constexpr):
    """K steps ``i0`` to ``i0 + n - 1`` (:func:`_step`), each issued while the one before's
    MMAs run; then every MMA waited for and the last step's slot freed. Returns the
    accumulators, the next step's scales and, where ``SPLIT``, ``smax`` raised to the largest
    scale the steps took."""
    # (smax takes a step's scales after the step has waited for them: taken before the step's
    # barrier wait, the tile's first scales stalled every tile's start on their load)
    s = sc
    acc, acc2, f0, f1, sc = _step(i0, g, s_rows, sg, sc, w_smem, w2_smem, x_smem, x2_smem, ready, acc, acc2, tables,
                                  K, G, MR, STAGES, WH, A_L, TWO, SPLIT)
    if SPLIT:
        smax = gl.maximum(smax, s)
    for j in gl.static_range(1, n):
        s = sc
        acc, acc2, f0, f1, sc = _step(i0 + j, g, s_rows, sg, sc, w_smem, w2_smem, x_smem, x2_smem, ready, acc, acc2,
                                      tables, K, G, MR, STAGES, WH, A_L, TWO, SPLIT, f0, f1, empty)
        if SPLIT:
            smax = gl.maximum(smax, s)
    if TWO:
        acc, acc2, f0, f1 = warpgroup_mma_wait(0, deps=[acc, acc2, f0, f1])
    else:
        acc, f0, f1 = warpgroup_mma_wait(0, deps=[acc, f0, f1])
    gl.thread_barrier()
    mbarrier.arrive(empty.index((g + i0 + n - 1) % STAGES))
    return acc, acc2, sc, smax


@gluon.jit
def _step(i, g, s_rows, sg, sc, w_smem, w2_smem, x_smem, x2_smem, ready, acc, acc2, tables, K: gl.constexpr,
          G: gl.constexpr, MR: gl.constexpr, STAGES: gl.constexpr, WH: gl.constexpr, A_L: gl.constexpr,
          TWO: gl.constexpr, SPLIT: gl.constexpr, p0=None, p1=None, empty=None):
    """K step ``i`` of the ring (``g`` as in :func:`_produce`): its two halves unpacked (by
    ``sm90_tile.UNPACK_SPLIT_SMALL`` where ``SPLIT``) and their MMAs issued (``acc``, and
    ``acc2`` where ``TWO``), left in flight; returns the halves' fragments and the next step's
    scales. ``p0``, ``p1``: the step before's fragments, whose MMAs are still in flight: each is
    waited for just before this step's MMA of the same half is issued (so that the step's unpack
    runs while they do), then ``empty`` frees the step before's slot."""
    s = (g + i) % STAGES
    mbarrier.wait(ready.index(s), ((g + i) // STAGES) & 1)
    fence_async_shared()
    sc_next = gl.load(s_rows + ((i + 1) * 4 + sg), mask=(i + 1) * 4 + sg < K // 32, other=127)
    if G < 2:
        w = w_smem.index(s).slice(64 * G, 64).load(_ring_words_layout(64))
    else:
        w = w2_smem.index(s).slice(64 * G - 128, 64).load(_ring_words_layout(64))
    w = gl.reshape(w, [64, 1, 4, 2, 2])
    w0, w1 = gl.split(gl.permute(w, [0, 1, 2, 4, 3]))
    x = x_smem.index(s).slice(0, MR)
    x2 = x2_smem.index(s)
    f0 = unpack_a(gl.convert_layout(w0, gl.SliceLayout(4, WH), assert_trivial=True), sc, tables, 64, 64, WH, A_L, SPLIT,
                  SPLIT)
    if p0 is not None:  # the step before's first half retires, its second stays in flight
        if TWO:
            acc, acc2, p0 = warpgroup_mma_wait(2, deps=[acc, acc2, p0])
        else:
            acc, p0 = warpgroup_mma_wait(1, deps=[acc, p0])
    acc = warpgroup_mma(f0, x.slice(0, 64, dim=1).permute((1, 0)), acc, is_async=True)
    if TWO:
        acc2 = warpgroup_mma(f0, x2.slice(0, 64, dim=1).permute((1, 0)), acc2, is_async=True)
    f1 = unpack_a(gl.convert_layout(w1, gl.SliceLayout(4, WH), assert_trivial=True), sc, tables, 64, 64, WH, A_L, SPLIT,
                  SPLIT)
    if p0 is not None:  # then its second: once every warp is past the wait, its slot is free
        if TWO:
            acc, acc2, p1 = warpgroup_mma_wait(2, deps=[acc, acc2, p1])
        else:
            acc, p1 = warpgroup_mma_wait(1, deps=[acc, p1])
        gl.thread_barrier()
        mbarrier.arrive(empty.index((g + i - 1) % STAGES))
    acc = warpgroup_mma(f1, x.slice(64, 64, dim=1).permute((1, 0)), acc, is_async=True)
    if TWO:
        acc2 = warpgroup_mma(f1, x2.slice(64, 64, dim=1).permute((1, 0)), acc2, is_async=True)
    return acc, acc2, f0, f1, sc_next


@gluon.jit
def _consume(tile, K: gl.constexpr, G: gl.constexpr, MR: gl.constexpr, MR2: gl.constexpr, STAGES: gl.constexpr,
             GATED: gl.constexpr, GATE_STRIDE: gl.constexpr, HAS_LIMIT: gl.constexpr, HAS_BIAS: gl.constexpr,
             ROUTE_WEIGHT: gl.constexpr, DOT_ORDER_OUT: gl.constexpr, STEPS_PER_WAIT: gl.constexpr,
             SPLIT: gl.constexpr):
    """Warpgroup ``G``'s K loop over the ring (its 64 of the slot's weight rows) and the
    epilogue of its tile (``tile``: the runtime values :func:`_consumer` gathers) of the block
    whose pairs start at ``pairs_ptr`` (``MR`` rows, and ``MR2`` more from ``x2_smem`` by a
    second MMA on the same fragments); ``g`` as in :func:`_produce`. ``SPLIT``: unpacked by the
    multiply exact for scales up to 128; ``flags_ptr[G]`` is left over 128 where the tile met a
    larger scale (for :func:`_redo`), 0 elsewhere."""
    (x_smem, x2_smem, w_smem, w2_smem, ready, empty, g, flags_ptr, w_ptr, stride_we, stride_wn, s_ptr, stride_se,
     stride_sn, nrows, n0, e64, pairs_ptr, bias_ptr, stride_be, stride_bn, rw_ptr, out_ptr, stride_os, stride_om, N,
     up_offset, alpha, beta, limit) = tile
    NS: gl.constexpr = (K + 127) // 128
    WL: gl.constexpr = w_layout(1, 4)
    WH: gl.constexpr = w_layout(1, 4, 2)  # the words of half a step
    # Tile rows 64 G + r are the rows r of the tile 32 G (gated) or 64 G columns further.
    n0 = n0 + G * tile_cols(GATED)
    _, s_rows, _, sg, _ = weight_rows(w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, e64, n0, N,
                                      up_offset, GATED, GATE_STRIDE, 64, 1, WL)
    # The scales [64, 1, 4] and prmt tables in the half-step unpack's layout (a relabelling).
    S3: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, WH))
    s_rows = gl.convert_layout(s_rows, S3, assert_trivial=True)
    sg = gl.convert_layout(sg, S3, assert_trivial=True)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, S3)))
    tables = tables_word(tile_row(rows, n0, N, up_offset, GATED, GATE_STRIDE))
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, MR, 16])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    acc = gl.zeros([64, MR], gl.float32, layout=MMA)
    if MR2 > 0:
        acc2 = gl.zeros([64, MR2], gl.float32,
                        layout=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, MR2, 16]))
    # The scales (a byte per row and segment) come from global memory, one step ahead.
    sc = gl.load(s_rows + sg, mask=sg < K // 32, other=127)
    smax = gl.zeros_like(sc)  # the largest scale the loop met (where SPLIT)
    if SPLIT:
        # (ordered before the threads' stores below by the steps' barriers)
        gl.store(flags_ptr + G, 0)
    TWO: gl.constexpr = MR2 > 0  # a second MMA on each fragment
    if not TWO:
        acc2 = acc  # (a placeholder, never multiplied into)
    # Steps in groups of STEPS_PER_WAIT: each one's unpack runs while the step before's MMAs
    # do, and the group ends waiting for all of them. (Fragments left in flight across the
    # loop's back edge: ptxas serializes every wgmma, C7512, even at 232 registers; a group
    # per iteration keeps them inside.)
    for ig in range(NS // STEPS_PER_WAIT):
        acc, acc2, sc, smax = _steps(STEPS_PER_WAIT * ig, STEPS_PER_WAIT, g, s_rows, sg, sc, smax, w_smem, w2_smem,
                                     x_smem, x2_smem, ready, empty, acc, acc2, tables, K, G, MR, STAGES, WH, A_L, TWO,
                                     SPLIT)
    if NS % STEPS_PER_WAIT:
        acc, acc2, sc, smax = _steps(NS - NS % STEPS_PER_WAIT, NS % STEPS_PER_WAIT, g, s_rows, sg, sc, smax, w_smem,
                                     w2_smem, x_smem, x2_smem, ready, empty, acc, acc2, tables, K, G, MR, STAGES, WH,
                                     A_L, TWO, SPLIT)
    if SPLIT:
        # Each thread whose scales went past 128, without a reduction: the flag is any of them.
        gl.store(flags_ptr + G + gl.zeros_like(smax.to(gl.int32)), smax.to(gl.int32), mask=smax > SMALL_SCALES_MAX)
    epilogue(acc, 0, nrows, n0, 0, e64, pairs_ptr, bias_ptr, stride_be, stride_bn, rw_ptr, out_ptr,
             stride_os, stride_om, N, up_offset, alpha, beta, limit, GATED, GATE_STRIDE, HAS_LIMIT, HAS_BIAS,
             ROUTE_WEIGHT, MR, 64, DOT_ORDER_OUT, SPLIT=SPLIT)
    if MR2 > 0:
        epilogue(acc2, 0, nrows - MR, n0, 0, e64, pairs_ptr + MR, bias_ptr, stride_be, stride_bn, rw_ptr, out_ptr,
                 stride_os, stride_om, N, up_offset, alpha, beta, limit, GATED, GATE_STRIDE, HAS_LIMIT, HAS_BIAS,
                 ROUTE_WEIGHT, MR2, 64, DOT_ORDER_OUT, SPLIT=SPLIT)


@gluon.jit
def _producer(a_ptr, stride_am, w_ptr, stride_we, stride_wn, sorted_ptr, block_expert_ptr, block_rows_ptr,
              num_tiles, N, up_offset, x_smem, x2_smem, w_smem, w2_smem, ready, empty,
              K: gl.constexpr, A_ROW_DIV: gl.constexpr, GATED: gl.constexpr, GATE_STRIDE: gl.constexpr,
              BLOCK_M: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr):
    NS: gl.constexpr = (K + 127) // 128
    EXTRA: gl.constexpr = BLOCK_M - 128
    g = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        blk, expert, nrows, n0 = _tile(t, N, block_expert_ptr, block_rows_ptr, ROWS // 2 if GATED else ROWS)
        if expert >= 0:
            e64 = expert.to(gl.int64)
            pairs_ptr = sorted_ptr + blk * BLOCK_M
            # As many rows as the consumers' MMAs take (see _consumer).
            if BLOCK_M <= 64 and nrows <= 16:
                _produce(a_ptr, stride_am, w_ptr, stride_we, stride_wn, pairs_ptr, nrows, e64, n0, N, up_offset,
                         x_smem, x2_smem, w_smem, w2_smem, ready, empty, g, K, A_ROW_DIV, GATED, GATE_STRIDE, 16, 0,
                         ROWS, STAGES)
            elif BLOCK_M <= TINY_BLOCK_M or nrows <= 32:  # (static for 32-row blocks)
                _produce(a_ptr, stride_am, w_ptr, stride_we, stride_wn, pairs_ptr, nrows, e64, n0, N, up_offset,
                         x_smem, x2_smem, w_smem, w2_smem, ready, empty, g, K, A_ROW_DIV, GATED, GATE_STRIDE, 32, 0,
                         ROWS, STAGES)
            elif BLOCK_M <= 64 or nrows <= 64:  # 64-row blocks (SMALL_BLOCK_M) take no wider MMA
                _produce(a_ptr, stride_am, w_ptr, stride_we, stride_wn, pairs_ptr, nrows, e64, n0, N, up_offset,
                         x_smem, x2_smem, w_smem, w2_smem, ready, empty, g, K, A_ROW_DIV, GATED, GATE_STRIDE, 64, 0,
                         ROWS, STAGES)
            elif nrows <= 96:
                _produce(a_ptr, stride_am, w_ptr, stride_we, stride_wn, pairs_ptr, nrows, e64, n0, N, up_offset,
                         x_smem, x2_smem, w_smem, w2_smem, ready, empty, g, K, A_ROW_DIV, GATED, GATE_STRIDE, 64, EXTRA,
                         ROWS, STAGES)
            elif nrows <= 128:
                _produce(a_ptr, stride_am, w_ptr, stride_we, stride_wn, pairs_ptr, nrows, e64, n0, N, up_offset,
                         x_smem, x2_smem, w_smem, w2_smem, ready, empty, g, K, A_ROW_DIV, GATED, GATE_STRIDE, 128, 0,
                         ROWS, STAGES)
            else:
                _produce(a_ptr, stride_am, w_ptr, stride_we, stride_wn, pairs_ptr, nrows, e64, n0, N, up_offset, x_smem,
                         x2_smem, w_smem, w2_smem, ready, empty, g, K, A_ROW_DIV, GATED, GATE_STRIDE, 128, EXTRA, ROWS,
                         STAGES)
            g += NS


@gluon.jit
def _consumer(tile_args, K: gl.constexpr, NC: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
              GATED: gl.constexpr, GATE_STRIDE: gl.constexpr, HAS_LIMIT: gl.constexpr, HAS_BIAS: gl.constexpr,
              ROUTE_WEIGHT: gl.constexpr, DOT_ORDER_OUT: gl.constexpr, SPLIT: gl.constexpr, G: gl.constexpr):
    (x_smem, x2_smem, w_smem, w2_smem, ready, empty, flags_ptr, w_ptr, stride_we, stride_wn, s_ptr, stride_se,
     stride_sn, block_expert_ptr, block_rows_ptr, num_tiles, sorted_ptr, bias_ptr, stride_be, stride_bn, rw_ptr,
     out_ptr, stride_os, stride_om, N, up_offset, alpha, beta, limit) = tile_args
    NS: gl.constexpr = (K + 127) // 128
    EXTRA: gl.constexpr = BLOCK_M - 128
    # Pairs (see CONSUMERS) only where the K loop runs more than once: with one iteration of a
    # pair, ptxas left a wgmma's descriptor registers unwritten on one path (K = 160, 224, 352).
    STEPS: gl.constexpr = 2 if BLOCK_M <= 64 and (K + 127) // 128 >= 4 else 1
    g = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        blk, expert, nrows, n0 = _tile(t, N, block_expert_ptr, block_rows_ptr, tile_cols(GATED) * NC)
        if expert >= 0:
            e64 = expert.to(gl.int64)
            # MMAs only as wide as the block's rows (often an expert's last block holds a few):
            # T=4096 2786 -> 2575 µs with halves, 2557 -> 2490 with quarters too; T=2048 1537 ->
            # 1481 with 64 + 32 rather than 128; T=512 914-917 -> 878-881 with 16 in 64-row
            # blocks (in 160-row ones it would change the code of the wider MMAs, unmeasured).
            tile = (x_smem, x2_smem, w_smem, w2_smem, ready, empty, g, flags_ptr + t * NC, w_ptr, stride_we,
                    stride_wn, s_ptr, stride_se, stride_sn, nrows, n0, e64, sorted_ptr + blk * BLOCK_M, bias_ptr,
                    stride_be, stride_bn, rw_ptr, out_ptr, stride_os, stride_om, N, up_offset, alpha, beta, limit)
            if BLOCK_M <= 64 and nrows <= 16:
                _consume(tile, K, G, 16, 0, STAGES, GATED, GATE_STRIDE, HAS_LIMIT, HAS_BIAS, ROUTE_WEIGHT,
                         DOT_ORDER_OUT, STEPS, SPLIT)
            elif BLOCK_M <= TINY_BLOCK_M or nrows <= 32:  # (static for 32-row blocks)
                _consume(tile, K, G, 32, 0, STAGES, GATED, GATE_STRIDE, HAS_LIMIT, HAS_BIAS, ROUTE_WEIGHT,
                         DOT_ORDER_OUT, STEPS, SPLIT)
            elif BLOCK_M <= 64 or nrows <= 64:  # 64-row blocks (SMALL_BLOCK_M) take no wider MMA
                _consume(tile, K, G, 64, 0, STAGES, GATED, GATE_STRIDE, HAS_LIMIT, HAS_BIAS, ROUTE_WEIGHT,
                         DOT_ORDER_OUT, STEPS, SPLIT)
            elif nrows <= 96:
                _consume(tile, K, G, 64, EXTRA, STAGES, GATED, GATE_STRIDE, HAS_LIMIT, HAS_BIAS,
                         ROUTE_WEIGHT, DOT_ORDER_OUT, STEPS, SPLIT)
            elif nrows <= 128:
                _consume(tile, K, G, 128, 0, STAGES, GATED, GATE_STRIDE, HAS_LIMIT, HAS_BIAS, ROUTE_WEIGHT,
                         DOT_ORDER_OUT, STEPS, SPLIT)
            else:
                _consume(tile, K, G, 128, EXTRA, STAGES, GATED, GATE_STRIDE, HAS_LIMIT, HAS_BIAS,
                         ROUTE_WEIGHT, DOT_ORDER_OUT, STEPS, SPLIT)
            g += NS


@gluon.jit
def _moe_gemm_sm90_ws(
    a_ptr, stride_am, stride_ak,
    w_ptr, stride_we, stride_wn, stride_wk,
    s_ptr, stride_se, stride_sn, stride_sk,
    bias_ptr, stride_be, stride_bn,
    rw_ptr,
    sorted_ptr, block_expert_ptr, block_rows_ptr,
    out_ptr, stride_os, stride_om, stride_on,
    N, up_offset,
    alpha, beta, limit,
    num_tiles,
    flags_ptr,
    K: gl.constexpr,
    A_ROW_DIV: gl.constexpr,
    GATED: gl.constexpr,
    GATE_STRIDE: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    ROUTE_WEIGHT: gl.constexpr,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    DOT_ORDER_OUT: gl.constexpr,
    SPLIT: gl.constexpr,
    NC: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    L2_PREFETCH_BYTES: gl.constexpr,
):
    """One GEMM (``moe._gemm``); with ``SPLIT``, each program then computes again exactly its
    tiles whose weights have a scale over 128 (:func:`_redo`)."""
    # x (dot-ordered, padded), the words (16-byte aligned rows) and out (along N) have unit
    # strides, checked by the caller.
    gl.static_assert(K % 32 == 0)
    gl.static_assert(gl.num_warps() == 4)  # the first consumer warpgroup
    # The rows the MMA widths cover (TINY_BLOCK_M, SMALL_BLOCK_M, BLOCK_M).
    gl.static_assert((BLOCK_M == TINY_BLOCK_M) | (BLOCK_M == 64) | (BLOCK_M == 160))
    gl.static_assert((NC == 3) | ((NC == 4) & (BLOCK_M <= 64)))  # consumers(), the partition lists
    # ptx_hints adds the qualifier to copies and loads after compilation; as a parameter it keys
    # the binary caches.
    gl.static_assert(L2_PREFETCH_BYTES == 128)
    # A block's first 128 rows and the rest (see BLOCK_M).
    X_ROWS: gl.constexpr = min(BLOCK_M, 128)
    ROWS: gl.constexpr = 64 * NC  # a tile's weight rows
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, X_ROWS, 128],
                                       gl.NVMMASharedLayout.get_default_for([X_ROWS, 128], gl.bfloat16))
    if BLOCK_M > 128:
        x2_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M - 128, 128],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_M - 128, 128], gl.bfloat16))
    else:
        x2_smem = x_smem  # never read: no block takes a second MMA
    # A tile's first 128 weight rows and the other 64 (powers of two).
    WS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 16], WS)
    w2_smem = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS - 128, 16], WS)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=128)  # every producer thread's copies
        mbarrier.init(empty.index(i), count=NC)  # each consumer warpgroup's MMA
    # The consumers' runtime arguments travel as one tuple (constexprs and functions cannot: they
    # must stay parameters, and list entries); the partition list is literal syntax, so there is
    # one list per consumer count.
    tile_args = (x_smem, x2_smem, w_smem, w2_smem, ready, empty, flags_ptr, w_ptr, stride_we, stride_wn, s_ptr,
                 stride_se, stride_sn, block_expert_ptr, block_rows_ptr, num_tiles, sorted_ptr, bias_ptr, stride_be,
                 stride_bn, rw_ptr, out_ptr, stride_os, stride_om, N, up_offset, alpha, beta, limit)
    if NC == 3:
        gl.warp_specialize([
            (_consumer, (tile_args, K, NC, BLOCK_M, STAGES, GATED, GATE_STRIDE, HAS_LIMIT, HAS_BIAS, ROUTE_WEIGHT,
                         DOT_ORDER_OUT, SPLIT, 0)),
            (_consumer, (tile_args, K, NC, BLOCK_M, STAGES, GATED, GATE_STRIDE, HAS_LIMIT, HAS_BIAS, ROUTE_WEIGHT,
                         DOT_ORDER_OUT, SPLIT, 1)),
            (_consumer, (tile_args, K, NC, BLOCK_M, STAGES, GATED, GATE_STRIDE, HAS_LIMIT, HAS_BIAS, ROUTE_WEIGHT,
                         DOT_ORDER_OUT, SPLIT, 2)),
            (_producer, (a_ptr, stride_am, w_ptr, stride_we, stride_wn, sorted_ptr, block_expert_ptr, block_rows_ptr,
                         num_tiles, N, up_offset, x_smem, x2_smem, w_smem, w2_smem, ready, empty, K, A_ROW_DIV, GATED,
                         GATE_STRIDE, BLOCK_M, ROWS, STAGES)),
        ], [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (tile_args, K, NC, BLOCK_M, STAGES, GATED, GATE_STRIDE, HAS_LIMIT, HAS_BIAS, ROUTE_WEIGHT,
                         DOT_ORDER_OUT, SPLIT, 0)),
            (_consumer, (tile_args, K, NC, BLOCK_M, STAGES, GATED, GATE_STRIDE, HAS_LIMIT, HAS_BIAS, ROUTE_WEIGHT,
                         DOT_ORDER_OUT, SPLIT, 1)),
            (_consumer, (tile_args, K, NC, BLOCK_M, STAGES, GATED, GATE_STRIDE, HAS_LIMIT, HAS_BIAS, ROUTE_WEIGHT,
                         DOT_ORDER_OUT, SPLIT, 2)),
            (_consumer, (tile_args, K, NC, BLOCK_M, STAGES, GATED, GATE_STRIDE, HAS_LIMIT, HAS_BIAS, ROUTE_WEIGHT,
                         DOT_ORDER_OUT, SPLIT, 3)),
            (_producer, (a_ptr, stride_am, w_ptr, stride_we, stride_wn, sorted_ptr, block_expert_ptr, block_rows_ptr,
                         num_tiles, N, up_offset, x_smem, x2_smem, w_smem, w2_smem, ready, empty, K, A_ROW_DIV, GATED,
                         GATE_STRIDE, BLOCK_M, ROWS, STAGES)),
        ], [4, 4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    if SPLIT:
        # After the join, whose barrier orders the consumers' flag stores before these loads.
        _redo((a_ptr, stride_am, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, bias_ptr, stride_be,
               stride_bn, rw_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, out_ptr, stride_os, stride_om, N,
               up_offset, alpha, beta, limit), num_tiles, flags_ptr, K, A_ROW_DIV, GATED, GATE_STRIDE, HAS_LIMIT,
              HAS_BIAS, ROUTE_WEIGHT, BLOCK_M, DOT_ORDER_OUT, NC)


@gluon.jit
def _redo(gemm, num_tiles, flags_ptr, K: gl.constexpr, A_ROW_DIV: gl.constexpr, GATED: gl.constexpr,
          GATE_STRIDE: gl.constexpr, HAS_LIMIT: gl.constexpr, HAS_BIAS: gl.constexpr, ROUTE_WEIGHT: gl.constexpr,
          BLOCK_M: gl.constexpr, DOT_ORDER_OUT: gl.constexpr, NC: gl.constexpr):
    """The end of a ``SPLIT`` GEMM (``gemm``: its runtime arguments): each of this program's
    tile-consumer pairs whose weights met a scale over 128 (``flags_ptr``: a word per tile and
    consumer, written for every tile with rows) is computed again, 64 weight rows by 8
    activation rows at a time, by mma.sync and the unpack exact for every scale
    (``moe_sm90_loops.exact_rows``), from the dot-ordered activations, and stored over the first
    result. The pairs are checked ``CH`` at a time by one load of their words (usually there is
    nothing to do) and walked one by one only where one needs it."""
    (a_ptr, stride_am, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, bias_ptr, stride_be, stride_bn,
     rw_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, out_ptr, stride_os, stride_om, N, up_offset, alpha, beta,
     limit) = gemm
    CH: gl.constexpr = 32 * gl.num_warps()
    FL: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    BLOCK_N: gl.constexpr = tile_cols(GATED) * NC
    num_n = gl.cdiv(N, BLOCK_N)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    # Pair q of this program: consumer q % NC of tile pid + (q // NC) nprog (the consumers' loop).
    mine = (num_tiles - pid + nprog - 1) // nprog * NC
    for q0 in range(0, mine, CH):
        q = q0 + gl.arange(0, CH, layout=FL)
        t = pid + q // NC * nprog
        # A padding block's flags are never written: its expert (< 0) rules it out.
        expert = gl.load(block_expert_ptr + t // num_n, mask=q < mine, other=-1)
        if gl.max(gl.load(flags_ptr + t * NC + q % NC, mask=expert >= 0, other=0), 0) > SMALL_SCALES_MAX:
            for qi in range(q0, gl.minimum(q0 + CH, mine)):
                ti = pid + qi // NC * nprog
                blk, e, nrows, n0 = _tile(ti, N, block_expert_ptr, block_rows_ptr, BLOCK_N)
                if e >= 0:
                    if gl.load(flags_ptr + ti * NC + qi % NC) > SMALL_SCALES_MAX:
                        n1 = n0 + (qi % NC) * tile_cols(GATED)
                        e64 = e.to(gl.int64)
                        pairs_ptr = sorted_ptr + blk * BLOCK_M
                        for r0 in range(0, nrows, 8):
                            acc = moe_sm90_loops.exact_rows(w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn,
                                                            e64, n1, N, up_offset, a_ptr, stride_am, pairs_ptr + r0,
                                                            nrows - r0, K, GATED, GATE_STRIDE, A_ROW_DIV)
                            epilogue(acc, 0, nrows - r0, n1, 0, e64, pairs_ptr + r0, bias_ptr, stride_be, stride_bn,
                                     rw_ptr, out_ptr, stride_os, stride_om, N, up_offset, alpha, beta, limit, GATED,
                                     GATE_STRIDE, HAS_LIMIT, HAS_BIAS, ROUTE_WEIGHT, 8, 64, DOT_ORDER_OUT, SPLIT=True)


GEMM_SM90_WS = Launcher(_moe_gemm_sm90_ws)
ptx_hints.l2_prefetch_128b("_moe_gemm_sm90_ws")
wgmma_guard.guard("_moe_gemm_sm90_ws")


def splits(block_m: int) -> bool:
    """Whether the kernel's blocks of ``block_m`` rows unpack the weights by one multiply per
    output (``sm90_tile.UNPACK_SPLIT_SMALL``, the activations in its order): in blocks of up to
    64 rows, where the unpack's instructions are most of a step's (H200, graph µs, gpt-oss-120b, min-max of 2 alternating processes, by prmt / split:
    T=256 760.8-761.1 / 699.7-700.0, T=512 818.1-838.8 / 767.2-768.2, T=1024 999.7-1010.1 /
    957.3-958.1; MiniMax-M3 T=256 1578.5-1609.6 / 1461.3-1465.4; Qwen3-30B-A3B T=256 188.0-190.3 /
    178.6-178.8; Mixtral-8x7B T=64 393.1-395.7 / 354.3-355.1), not in 160-row blocks, where the
    MMAs are (T=4096 1920.2-1935.0 / 1949.5-1961.3)."""
    return block_m <= SMALL_BLOCK_M


def dot_order(x: torch.Tensor, block_m: int, aq: ActivationQuant = ActivationQuant()) -> torch.Tensor:
    """``x [M, K]`` (unit column stride) → ``[M, padded(K)]`` in the dot's K order of each
    128-wide step, zeros past K: the activations :func:`_moe_gemm_sm90_ws` reads in blocks of
    ``block_m`` rows (the order of its unpack there, :func:`splits`). Under
    activation quantization (``aq``; K a multiple of 32) each 32-block is quantize-dequantized
    on the way, as :func:`mxfx.kernels.mx.quantize_dequantize` does it
    (:func:`sm90_tile.ordered_copy`)."""
    return ordered_copy(x, aq, splits(block_m))


def fits(weights: MoEWeights, pairs: int, hidden: int, inter: int) -> bool:
    """Whether the weights' packed rows can be copied in 16-byte pieces (aligned, unit stride
    along K), the dot-ordered inputs of ``pairs`` rows (x and the intermediate) have fewer
    than 2^31 elements (the producer's offsets are int32), and both GEMMs' K loops take more
    than one step (K > 128): with one, ptxas left a wgmma's descriptor registers unwritten on
    the path of blocks over 32 rows (K = 64, 96; :mod:`mxfx.kernels.wgmma_guard` refuses such
    binaries). The kernel's other conditions are :func:`mxfx.kernels.moe.hopper_fits`'."""
    return (min(hidden, inter) > 128 and pairs * padded(max(hidden, inter)) < 2**31
            and all(w.stride(-1) == 1 and w.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in w.stride()[:-1])
                    for w in (weights.w13, weights.w2)))


def launch(args: tuple, common: dict, num_blocks: int, blocks: Sequence[tuple[int, float]], n_out: int,
           block_m: int, dot_order_out: bool) -> None:
    """One GEMM on dot-ordered activations; ``args`` and ``common`` as ``moe._gemm`` builds
    them; ``num_blocks`` the routing's blocks, ``blocks`` how many of them a random routing
    fills, as (blocks, probability) pairs (:func:`mxfx.kernels.routing.blocks_pmf`).
    ``dot_order_out``: store the output in dot order, padded (GEMM1's intermediate, when GEMM2
    reads it as it is)."""
    device = args[0].device
    sms = num_sms(device)
    nc = consumers(block_m, n_out, common["GATED"], blocks, sms)
    maxnreg, consumer_regs, producer_regs = (_MAXNREG, _CONSUMER_REGS, _PRODUCER_REGS) if nc == 3 else _REGS4
    num_tiles = num_blocks * cdiv(n_out, tile_cols(common["GATED"]) * nc)
    split = splits(block_m)
    # Per tile and consumer, over 128 where its weights have a larger scale (SPLIT), for the redo.
    flags = torch.empty(num_tiles * nc, dtype=torch.int32, device=device) if split else args[0]
    GEMM_SM90_WS[(min(num_tiles, sms),)](
        *args, num_tiles, flags, **common, BLOCK_M=block_m, STAGES=_stages(block_m, common["GATED"], nc),
        DOT_ORDER_OUT=dot_order_out, SPLIT=split, NC=nc, CONSUMER_REGS=consumer_regs,
        PRODUCER_REGS=producer_regs, L2_PREFETCH_BYTES=128, num_warps=4, num_stages=1, maxnreg=maxnreg)
