"""The MoE's launch code: tile configs, routing, the GEMM launches and the k-sum, for the
portable Triton kernel (:mod:`mxfx.kernels.moe_portable`) and, on a Hopper GPU, MXFP4 weights
with bfloat16 activations, at small and mid T :mod:`mxfx.kernels.moe_sm90` (same arguments
and epilogues, the intermediate's activation quantization included) and without activation
quantization at large T :mod:`mxfx.kernels.moe_sm90_ws`.

The k slots are summed by ``moe_portable._sum_slots`` or, on per-pair blocks (few pairs,
Hopper; see :func:`_route`), by the last GEMM2 program of each token and column tile, in the
same order; there GEMM2 may start while GEMM1 runs (PDL, :func:`_pdl_gemm2`). On grouped
mma.sync blocks the routing kernels, x's copy in the paired order (:func:`moe_sm90.paired`),
both GEMMs and the k-sum are a chain of launches by PDL (:func:`_pdl_chain`).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Hashable, NamedTuple, Optional

import torch

from mxfx.activation import GatedActivation
from mxfx.kernels import moe_portable, moe_sm90, moe_sm90_loops, moe_sm90_ws, mx, sm90_tile
from mxfx.kernels.launch import cdiv, next_power_of_2, num_sms
from mxfx.kernels.replay import Replayer
from mxfx.kernels.routing import Routing, align, blocks_pmf, per_pair
from mxfx.moe_call import ActivationQuant, MoEWeights


class GemmConfig(NamedTuple):
    block_m: int
    block_n1: int  # GEMM1 output columns per program (per accumulator); a multiple of 32
    block_n2: int  # GEMM2 output columns per program
    block_k: int
    num_warps: int
    swap: bool  # weights as the MMA's left operand (see _dot)
    split: bool  # MXFP4 halves kept apart, two MMAs per K step (see _mma)
    split_k2: int = 1  # GEMM2's K range split over this many programs (partials, fixed-order sum)
    sm90: bool = False  # the Hopper kernel (mxfx.kernels.moe_sm90), for MXFP4 weights
    sync_mma: bool = False  # there, mma.sync with the activations in registers, not wgmma
    x_row_stages: int = 0  # and on per-pair blocks the row in shared memory, weights this many K steps ahead
    ws: bool = False  # the warp-specialized Hopper kernel (mxfx.kernels.moe_sm90_ws), dot-ordered inputs


# Mean rows per expert up to which moe_sm90 runs mma.sync on 8-row blocks, past which the
# warp-specialized kernel is taken, and up to which its blocks are 64 rows (see pick_config;
# 56 rows: about 1 expert in 7 needs a second block). WS_SMALL_ROWS was tuned on gpt-oss-120b;
# on gpt-oss-20b, Qwen3-30B-A3B and Mixtral-8x7B the pick was also the fastest of the three
# kernels at 8 to 64 rows, or within 0.6 % (tools/PERF_LOG.md, sessions 11 and 13).
# SYNC_MAX_ROWS: H200, graph µs, min-max of 2 rounds, warp-specialized / mma.sync, at 5 / 6 / 7
# / 8 rows per expert: gpt-oss-120b T=160 740-742 / 665-667, T=192 749-751 / 724-726, T=224
# 757-759 / 777-799, T=256 761-778 / 879-953; MiniMax-M3 (same T) 1567-1595 / 1404-1439,
# 1583-1597 / 1528-1533, 1605-1701 / 1713-1827, 1623-1681 / 1863-1901; Qwen3-30B-A3B T=80 170-172
# / 138, T=96 171-172 / 151, T=112 172-173 / 166, T=128 174 / 179; Mixtral-8x7B T=20 375-377 /
# 285-292, T=24 374-376 / 316, T=28 374-375 / 369-378, T=32 375-376 / 408-425; gpt-oss-20b T=40
# 221 / 173-179, T=48 220 / 191-196, T=56 220-221 / 207-211, T=64 221-223 / 226-228.
SYNC_MAX_ROWS = 6
WS_SMALL_ROWS = 56
# Up to WS_TINY_ROWS rows per expert the warp-specialized kernel's blocks are 32 rows, whose ring
# has 9-10 slots rather than 6 (moe_sm90_ws.TINY_BLOCK_M). H200, graph µs, min-max of 2
# alternating processes, 32- / 64-row blocks (both unpacking by one multiply, before the check
# for scales over 128 was added): gpt-oss-120b T=224 672-673 / 688-689, T=256 680-684 / 700,
# T=512 748-762 / 767-768, T=640 (20 rows) 789-790 / 803-806, T=768 (24) 844-875 / 889-891,
# T=1024 (32) 1084-1108 / 957-958; MiniMax-M3 T=256 1450-1451 / 1461-1465; Qwen3-30B-A3B T=256
# 175-176 / 179; Mixtral-8x7B T=64 349-350 / 354-355; gpt-oss-20b T=160 222-223 / 229-230.
WS_TINY_ROWS = 24


def pick_config(num_pairs: int, num_experts: int, hidden: int, hopper: bool = False,
                warp_specialized: bool = False, intermediate: Optional[int] = None) -> GemmConfig:
    """Tile shapes from the mean rows per expert, measured on the H200 (tools/PERF_LOG.md):
    while the weights dominate (few rows), small blocks with the weights as the MMA's left
    operand, on Hopper (``hopper``: :func:`hopper_fits`) in :mod:`mxfx.kernels.moe_sm90`,
    where up to ``SYNC_MAX_ROWS`` rows per expert take 8-row blocks and mma.sync (no shared
    memory, no barriers: T=64 629 -> 558 µs against wgmma on 16-row blocks). Past it, on
    Hopper where the call allows it (``warp_specialized``: bf16, weight rows 16 bytes apart,
    both K over 128: :func:`mxfx.kernels.moe_sm90_ws.fits`), the warp-specialized kernel: up
    to ``WS_TINY_ROWS`` rows in 32-row blocks, up to ``WS_SMALL_ROWS`` in 64-row blocks
    (gpt-oss-120b, session 13, against 32-row blocks in
    moe_sm90, alternating runs: T=192 907-908 -> 814-815 µs, T=256 911-917 -> 818-832, T=512
    944-1009 -> 867-890, T=1024 1355-1411 -> 1057-1069; against 160-row blocks, T=1792
    1451-1554 -> 1379-1418, T=2048 1463-1468 -> 1618-1706), past that in 160-row blocks
    (T=4096 ~2950 -> 2049 against 128-row blocks in the portable kernel). Elsewhere, 32-row
    blocks, then 128-row blocks with one MMA per K step. ``hidden``: H, which sets GEMM2's grid;
    ``intermediate``: I (default H), which sets GEMM1's grid and GEMM2's K range."""
    rows = num_pairs / num_experts
    # On per-pair blocks (see _route) the activation row waits in shared memory, not in
    # registers (96 registers at 4 steps ahead, 80 at 3, against 124 with 2 steps and the
    # activations in registers): 4 steps while GEMM1's grid fits one wave of 4 programs per SM,
    # else 3, which leaves room for 6. H200, graph µs, min-max of 2 alternating processes,
    # registers / 3 / 4 steps: gpt-oss-120b T=1 31.6-32.3 / 30.7-30.9 / 30.5-30.6, T=2 51.6-51.7 /
    # 47.8-47.9 / 48.6-49.6, T=4 88.0-88.7 / 80.2-80.5 / 82.7-84.0; MiniMax-M3 T=1 51.3-51.8 /
    # 53.8-54.6 / 48.6-48.8, T=2 94.1-94.3 / 85.0-85.7 / 86.5-86.6; Qwen3-30B-A3B T=1 17.5-17.9 /
    # 18.4-18.5 / 17.3-17.7. (A GEMM1 whose K loop runs in two warpgroups takes 3: _halves.)
    inter = hidden if intermediate is None else intermediate
    x_row_stages = 4 if num_pairs * cdiv(inter, 32) <= 512 else 3
    if hopper and warp_specialized and rows > SYNC_MAX_ROWS:
        block_m = (moe_sm90_ws.TINY_BLOCK_M.value if rows <= WS_TINY_ROWS else
                   moe_sm90_ws.SMALL_BLOCK_M if rows <= WS_SMALL_ROWS else moe_sm90_ws.BLOCK_M)
        return GemmConfig(block_m, 64, 128, 64, 4, swap=True, split=True, sm90=True, ws=True)
    if num_pairs <= 16:
        # A few experts: GEMM2's grid (a few experts × H/64 columns) is small, so its K range
        # is split (portable kernel, T=1: 45.3 -> 42.7 µs in two). On Hopper, in four where the
        # grid is at most 192 programs, about 1.5 per SM, or, where each part of the K range
        # still has five 128-wide steps (I ≥ 2560), at most 400, else not at all. Graph µs,
        # split 1 / 2 / 4 (programs: experts expected among the pairs × H/64), H200, session 56
        # (tools/PERF_LOG.md; session 15's losses were an older kernel's): gpt-oss-120b T=1 (178)
        # 30.2 / 27.1 / 24.5, T=2 (350) 44.3 / 45.4 / 43.0, T=4 (680) 77.1 / 77.5 / 75.7;
        # gpt-oss-20b T=2 (323) 44.0 / 45.4 / 42.8, T=4 (574) 75.0 / 76.2 / 77.8; MiniMax-M3 T=1
        # (380) 43.5 / 41.1 / 43.2, T=2 (747) 75.0 / 77.8 / 79.1; Qwen3-30B-A3B (I=768) T=1 (249)
        # 14.0 / 14.4 / 14.7, T=2 (483) 19.8 / 19.2 / 21.6; Mixtral-8x7B (I=14336) T=1 (120)
        # 86.2 / 72.4 / 68.0, T=2 (212) 130.6 / 114.9 / 113.9, T=5 (377) 212.4 / 205.5 / 208.9,
        # T=6 (409) 216.7 / 217.0 / 217.2. The H100 (sessions 50 and 55) agrees: gpt-oss-120b
        # T=2 51.1 / 53.4 / 50.3, MiniMax-M3 T=1 53.7 / 51.1 / 53.0.
        if hopper:
            grid2 = (num_pairs - expected_repeats(num_pairs, num_experts)) * cdiv(hidden, moe_sm90.BLOCK_N2)
            split_k2 = 4 if grid2 <= 192 or (inter >= 2560 and grid2 <= 400) else 1
            return GemmConfig(8, 32, 64, 128, 4, swap=True, split=True, split_k2=split_k2, sm90=True,
                              sync_mma=True, x_row_stages=x_row_stages)
        return GemmConfig(16, 32, 64, 128, 4, swap=True, split=True, split_k2=2)
    if rows <= SYNC_MAX_ROWS:
        if hopper:
            return GemmConfig(8, 32, 64, 64, 4, swap=True, split=True, sm90=True, sync_mma=True,
                              x_row_stages=x_row_stages)
        return GemmConfig(16, 32, 64, 64, 4, swap=True, split=True)
    if rows <= 32:
        return GemmConfig(32, 64, 128, 64, 4, swap=True, split=True, sm90=hopper)
    return GemmConfig(128, 64, 128, 64, 4, swap=False, split=False)


def _gemm(
    a: torch.Tensor,
    a_row_div: int,
    w: torch.Tensor,
    w_scale: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    routing: Routing,
    out: torch.Tensor,
    out_split_stride: int,
    n_out: int,
    k_in: int,
    cfg: GemmConfig,
    *,
    block_n: int,
    split_k: int = 1,
    act: Optional[GatedActivation] = None,
    route_weights: Optional[torch.Tensor] = None,
    aq: ActivationQuant = ActivationQuant(),
    a_mx: Optional[tuple[str, torch.Tensor]] = None,
    counters: Optional[torch.Tensor] = None,
    k_sum: Optional[tuple[torch.Tensor, torch.Tensor, int]] = None,
    pdl_chain: bool = False,
    paired: bool = False,
    after_pdl: bool = False,
    x_qdq: bool = False,
) -> None:
    """One grouped GEMM launch. ``a_mx``: ``a`` holds MX elements (:func:`mx.quantize`) in
    this format, with these scales, for ``tl.dot_scaled`` (MXFP4 weights only). The
    warp-specialized GEMM1 stores the intermediate in dot order, padded, for GEMM2; under ``aq``
    in natural order, for the caller to quantize-dequantize into dot order. On per-pair blocks
    (:func:`_k_sum_counters`): GEMM1 zeroes ``counters``; GEMM2, given ``k_sum`` (the counters,
    ``[T, H]`` output, k), also sums the slots into that output. ``pdl_chain`` (moe_sm90 on
    grouped blocks): launched by PDL (:func:`_pdl_chain`), GEMM1 (no ``route_weights``) after
    the routing kernels, GEMM2 after GEMM1. ``paired`` (moe_sm90 on grouped mma.sync blocks):
    ``a`` is in the paired order (:func:`moe_sm90.paired`), and GEMM1 stores the intermediate so.
    ``after_pdl``: ``a`` is written by the launch just before, which lets the next one start at
    once (``dependents`` of :func:`mx.quantize_dequantize`): per-pair GEMM1 is then launched by
    PDL, and issues its first weight loads before it waits for that launch. ``x_qdq`` (per-pair
    GEMM1): ``a`` is x as given, which GEMM1 quantize-dequantizes under ``aq`` as it reads it."""
    quantized = w_scale is not None
    s = w_scale if quantized else w  # unused pointer when float
    b = bias if bias is not None else w
    rw = route_weights if route_weights is not None else w
    gated = act is not None
    interleaved = gated and act.layout == "interleaved"
    limit = act.limit if gated and act.limit is not None else 0.0
    num_blocks = routing.block_expert.numel()
    b_strides = b.stride()
    args = (
        a, *a.stride(),
        w, *w.stride(),
        s, *s.stride(),
        b, b_strides[0], b_strides[-1],
        rw,
        routing.sorted_pairs, routing.block_expert, routing.block_rows,
        out, out_split_stride, *out.stride()[-2:],
        n_out, (1 if interleaved else n_out) if gated else 0,
        float(act.alpha) if gated else 1.0, float(act.beta) if gated else 0.0, float(limit),
    )
    common = dict(
        K=k_in,
        A_ROW_DIV=a_row_div,
        GATED=gated,
        GATE_STRIDE=2 if interleaved else 1,
        HAS_LIMIT=gated and act.limit is not None,
        HAS_BIAS=bias is not None,
        ROUTE_WEIGHT=route_weights is not None,
    )
    if cfg.ws:
        blocks = blocks_pmf(routing.num_pairs, w.shape[0], cfg.block_m)
        moe_sm90_ws.launch(args, common, num_blocks, blocks, n_out, cfg.block_m,
                           dot_order_out=gated and aq.fmt == "none")
        return
    if cfg.sm90 and quantized:
        block_n = sm90_tile.tile_cols(gated)
        # Per-pair blocks (routing.per_pair): the GEMM checks the ids, with its asserts on (and
        # no overflow checks).
        per_pair = dict(PER_PAIR_E=routing.per_pair_experts, COUNTERS=0, TOPK=1, XROW=0, HALVES=False,
                        X_ORDER=(moe_sm90_loops.ORDER_PAIRED if paired else moe_sm90_loops.ORDER_NATURAL).value,
                        PAIRED_OUT=paired and gated, X_QDQ=x_qdq)
        if routing.per_pair_experts:
            per_pair.update(debug=True, sanitize_overflow=False, XROW=cfg.x_row_stages)
            if split_k > 1 and cfg.x_row_stages == 4:
                # ptxas gives GEMM2 88 registers (the exact unpack's loop beside the fast one) where
                # 80 hold it without spills: 6 programs per SM, not 5, so T=1's 720 programs fit
                # one wave (H200, gpt-oss-120b T=1 graph µs 30.9 -> 29.3). With 3 steps ahead it
                # takes 96 and would spill at 80 (Mixtral-8x7B T=1: K = 14336).
                per_pair.update(maxnreg=80)
        count = (w, 0, w, 0)  # unused placeholders unless counting
        if counters is not None:
            count = (counters, counters.numel(), w, 0)
            per_pair.update(COUNTERS=1)
            if _halves(num_blocks * cdiv(n_out, block_n), k_in, a.device):
                per_pair.update(HALVES=True, XROW=moe_sm90.HALF_STAGES.value, maxnreg=moe_sm90.HALF_REGS.value)
        if k_sum is not None:
            cnt, summed, topk = k_sum
            count = (cnt, cnt.numel(), summed, summed.stride(0))
            per_pair.update(COUNTERS=2, TOPK=topk)
        programs = num_blocks * cdiv(n_out, block_n) * split_k
        pdl = 0
        if per_pair["XROW"] and per_pair["COUNTERS"]:
            # GEMM1 lets GEMM2 start at once, where GEMM2 is launched by PDL (_pdl_gemm2).
            if k_sum is None:
                pdl = moe_sm90.PDL_TRIGGER.value | (moe_sm90.PDL_WAIT_LOADS.value if after_pdl else 0)
            elif _pdl_gemm2(programs, cdiv(cdiv(k_in, moe_sm90.BLOCK_K), split_k), a.device):
                pdl = moe_sm90.PDL_WAIT_LOADS.value
        elif pdl_chain:
            wait = moe_sm90.PDL_WAIT_FIRST if route_weights is None else moe_sm90.PDL_WAIT_LOADS
            pdl = wait.value | moe_sm90.PDL_TRIGGER.value
        launch_pdl = pdl & (moe_sm90.PDL_WAIT_FIRST.value | moe_sm90.PDL_WAIT_LOADS.value) != 0
        per_pair.update(PDL=pdl, launch_pdl=launch_pdl)
        moe_sm90.GEMM_SM90[(programs,)](
            *args, *count, **common, **per_pair, BLOCK_M=cfg.block_m, BLOCK_K=moe_sm90.BLOCK_K, SPLIT_K=split_k,
            SYNC_MMA=cfg.sync_mma, AQ=mx.FMT_CODES[aq.fmt], AQ_ROUNDING=mx.ROUNDING_CODES[aq.scale_rounding],
            num_warps=4, num_stages=1)
        return
    assert not paired, "the paired order: moe_sm90 only"
    a_fmt, a_scale = a_mx if a_mx is not None else ("none", w)
    moe_portable.GEMM[(num_blocks * cdiv(n_out, block_n) * split_k,)](
        *args, a_scale, a_scale.stride(0), **common,
        W_MXFP4=quantized,
        AQ=mx.FMT_CODES[aq.fmt],
        AQ_ROUNDING=mx.ROUNDING_CODES[aq.scale_rounding],
        IEEE=a.dtype == torch.float32,
        PTX_UNPACK=quantized and mx.ptx_unpack(a.dtype, a.device) and mx.word_loadable(w),
        SWAP=cfg.swap,
        SPLIT=cfg.split,
        BLOCK_M=cfg.block_m,
        BLOCK_N=block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split_k,
        A_FMT=mx.FMT_CODES[a_fmt],
        num_warps=cfg.num_warps,
        # The K loop double-buffers its loads by hand: Triton's pipeliner does not take
        # loads that are unpacked in registers before the MMA (2-3 stages measured no
        # faster). The tl.dot_scaled loop leaves its loads to the pipeliner.
        num_stages=1 if a_mx is None else 3,
    )


def _halves(programs: int, k_in: int, device: torch.device) -> bool:
    """Whether a per-pair GEMM1 of ``programs`` programs over K = ``k_in`` runs each program's
    K loop in two warpgroups, half the steps each (``moe_sm90._program``'s ``HALVES``): where
    its programs of 8 warps at 80 registers (3 per SM) take at most two waves. Its K loop waits
    on the weights: more warps per SM, not fewer instructions, are what it needs. H200, graph
    µs, min-max of 2 alternating processes, one warpgroup / halves: gpt-oss-120b T=1 (360
    programs) 26.4-27.3 / 24.7-24.8, T=2 (720) 47.2-48.1 / 45.0; gpt-oss-20b T=1 27.5-27.6 /
    24.9-25.0; MiniMax-M3 T=1 (384) 46.1-46.6 / 44.2-44.3; Qwen3-30B-A3B T=1 (192) 15.9-16.3 /
    14.9; Mixtral-8x7B T=1 (896) 68.2-69.3 / 69.8."""
    return k_in > moe_sm90.BLOCK_K and programs <= 6 * num_sms(device)


def _gemm1_quantizes_x(programs: int, hidden: int, device: torch.device) -> bool:
    """Whether a per-pair GEMM1 of ``programs`` programs (in a CUDA graph: two launches) quantize-
    dequantizes x's row as it reads it, under activation quantization, instead of waiting for a
    quantize pass (launched before it, GEMM1 by PDL: it issues its first weight loads while the
    pass runs). Every program quantizes the whole row again (in two warpgroups, each its half),
    before its first MMA: taken while that is at most ``6144`` values per SM. H200, graph µs,
    min-max of 2 alternating processes, pass / in GEMM1 (in two warpgroups), W4A8, W4A4 (same
    outputs to the bit): Qwen3-30B-A3B (H = 2048) T=1 (192 programs) 14.6-14.8 / 14.3, 14.6 /
    14.5-14.6, T=2 (384) 21.4-21.7 / 20.5-20.7, 20.9-21.1 / 20.1-20.4; gpt-oss-120b (2880) T=1
    (360) 25.9-26.2 / 25.7-26.3, 26.2-27.0 / 26.9-27.3, T=2 (720) 46.9-47.0 / 47.9-48.1, 46.3-46.9
    / 49.0-49.8; gpt-oss-20b T=1 (360) 26.6-26.7 / 26.6, 26.2-26.9 / 27.0-27.2; MiniMax-M3
    (6144) T=1 (384) 46.0-46.1 / 46.1-46.8, 45.6-46.2 / 47.7-47.8."""
    return programs * hidden <= 6144 * num_sms(device)


def _pdl_gemm2(programs: int, steps: int, device: torch.device) -> bool:
    """Whether a per-pair GEMM2 of ``programs`` programs of ``steps`` K steps each is launched by
    PDL (programmatic dependent launch): its programs then start while GEMM1 runs, issue their
    first weight loads and wait for GEMM1 (``moe_sm90_loops.PREVIOUS_GRID``). Taken where the
    programs are short (at most 8 steps) or more than 4 per SM: the programs that start early
    take the SMs GEMM1 leaves room on, and a few long programs per SM then end unevenly. H200,
    graph µs, min-max of 2 alternating processes (two runs), two launches / PDL for
    every GEMM2: gpt-oss-120b T=1 (720 programs of 6 steps) 29.0-29.4 / 27.2-28.1, T=2 (360 of
    23) 46.5-47.1 / 47.9-48.5, T=3 (540 of 23) 62.8-63.6 / 60.2-61.1, T=4 (720 of 23) 78.5-79.0 /
    75.9-77.0, T=6 (1080 of 23) 106.5 / 104.8-105.0; gpt-oss-20b T=1 (720 of 6) 29.1-29.6 /
    27.1-27.5, T=2 (360 of 23) 46.4-46.9 / 47.5-48.0; Qwen3-30B-A3B T=1 (256 of 6) 16.8-17.2 /
    15.2-15.4, T=2 (512 of 6) 22.0-22.1 / 21.2-21.3, T=4 (1024 of 6) 37.1-37.2 / 34.2-34.4;
    MiniMax-M3 T=1 (384 of 24) 47.3-47.5 / 51.2-52.0, T=2 (768 of 24) 82.0-82.2 / 79.8-80.8;
    Mixtral-8x7B T=1 (512 of 28, 3.9 per SM) 68.3-69.0 / 70.0-70.7."""
    return steps <= 8 or programs > 4 * num_sms(device)


def hopper_fits(x: torch.Tensor, weights: MoEWeights) -> bool:
    """Whether :mod:`mxfx.kernels.moe_sm90` can run both GEMMs of this call: bf16 activations
    on a Hopper GPU, MXFP4 weights readable as words, unit strides along K (x, scales)."""
    return (weights.quantized and x.dtype == torch.bfloat16 and moe_sm90.runs_on(x.device)
            and x.stride(-1) == 1 and x.shape[1] % 32 == 0
            and all(mx.word_loadable(w) and s.stride(-1) == 1
                    for w, s in ((weights.w13, weights.w13_scale), (weights.w2, weights.w2_scale))))


def _sizes(x: torch.Tensor, topk_ids: torch.Tensor, weights: MoEWeights) -> tuple[int, int, int, int]:
    T, H = x.shape
    inter = weights.w2.shape[2] * (2 if weights.quantized else 1)
    return T, H, topk_ids.shape[1], inter


# Per-pair blocks read a repeated expert's weights once per pair: they are taken while the
# repeats expected of uniformly routed pairs cost at most this many bytes (see _route).
PER_PAIR_REPEAT_BYTES = 32e6


def expected_repeats(num_pairs: int, num_experts: int) -> float:
    """Pairs expected to land on an expert an earlier pair took, for uniformly random ids:
    the pairs less the distinct experts expected among them."""
    return num_pairs - num_experts * (1 - (1 - 1 / num_experts) ** num_pairs)


def _expert_bytes(weights: MoEWeights) -> int:
    """Bytes of one expert's weights, scales and biases."""
    parts = (weights.w13, weights.w13_scale, weights.w13_bias, weights.w2, weights.w2_scale, weights.w2_bias)
    return sum(t[0].numel() * t.element_size() for t in parts if t is not None)


def _route(topk_ids: torch.Tensor, weights: MoEWeights, cfg: GemmConfig) -> Routing:
    """The pairs grouped by expert (:mod:`mxfx.kernels.routing`); each pair in its own block,
    without a routing kernel or a k-sum launch, where the GEMMs run mma.sync (elsewhere the
    ids' device-side check would be a call inside the kernel, which serializes wgmma) and
    either there is one token (whose experts are distinct) or the repeated experts' weights,
    read once per pair, are expected to cost at most ``PER_PAIR_REPEAT_BYTES``. H200, graph
    µs, min of 2 alternating rounds, grouped / per pair (expected repeat bytes):
    gpt-oss-120b T=4 91.9 / 79.9 (10 MB), T=5 105.7 / 97.4 (19), T=6 119.6 / 112.8 (27), T=7
    139.0 / 140.4 (37), T=8 151.0 / 149.6 (49); gpt-oss-20b T=2 53.9 / 47.1 (11), T=3 66.9 /
    64.8 (25), T=4 83.7 / 79.1 (43); MiniMax-M3 T=3 137.8 / 127.8 (16), T=4 170.8 / 168.9
    (24), T=5 208.0 / 212.3 (43); Qwen3-30B-A3B T=3 35.6 / 29.7 (5), T=4 42.3 / 35.9 (9), T=8
    63.3 / 59.3 (34), T=12 79.0 / 83.0 (71), T=16 94.2 / 108.7 (117); Mixtral-8x7B T=2 137.2 /
    146.3 (65)."""
    E = weights.num_experts
    if cfg.sync_mma and (topk_ids.shape[0] == 1 or expected_repeats(topk_ids.numel(), E) * _expert_bytes(weights)
                         <= PER_PAIR_REPEAT_BYTES):
        return per_pair(topk_ids, E, cfg.block_m)
    return align(topk_ids, E, cfg.block_m, pdl=cfg.sync_mma)


def _pdl_chain(cfg: GemmConfig, routing: Routing) -> bool:
    """Whether a fused call's launches after the routing kernels, x's paired copy, GEMM1, GEMM2
    and the k-sum, are each launched by PDL (programmatic dependent launch): grouped blocks on
    mma.sync, where the routing kernels let the next launch start at once
    (:func:`mxfx.kernels.routing.align`). Each launch then starts while the one before it ends:
    the copy's programs wait for the routing once they have copied, GEMM1's wait for the copy,
    GEMM2's issue their first weight loads and wait for GEMM1, the k-sum's wait for GEMM2."""
    return cfg.sync_mma and not routing.per_pair_experts


def _k_sum_counters(routing: Routing, T: int, H: int, device: torch.device) -> Optional[torch.Tensor]:
    """On per-pair blocks the last GEMM2 program of each token and column tile sums the token's
    slots (``moe_sm90._sum_when_last``) instead of a ``_sum_slots`` launch, counting arrivals
    here; GEMM1 zeroes the counters. None elsewhere."""
    if not routing.per_pair_experts:
        return None
    return torch.empty(T * cdiv(H, moe_sm90.BLOCK_N2), dtype=torch.int32, device=device)


def _gemm2_and_sum(inter, x, topk_weights, topk_ids, weights, routing, cfg, a_mx=None,
                   counters=None, pdl_chain=False, paired=False) -> torch.Tensor:
    T, H, k, inter_size = _sizes(x, topk_ids, weights)
    num_pairs = routing.num_pairs
    y = torch.empty(cfg.split_k2, num_pairs, H, dtype=torch.float32, device=x.device)
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    _gemm(inter, 1, weights.w2, weights.w2_scale, weights.w2_bias, routing, y, y.stride(0), H,
          inter_size, cfg, block_n=cfg.block_n2, split_k=cfg.split_k2,
          route_weights=topk_weights.reshape(-1), a_mx=a_mx,
          k_sum=(counters, out, k) if counters is not None else None, pdl_chain=pdl_chain, paired=paired)
    if counters is not None:
        return out
    block_h = min(1024, next_power_of_2(H))
    moe_portable.SUM_SLOTS[(T, cdiv(H, block_h))](
        y, topk_ids.reshape(-1), out, H, weights.num_experts, y.stride(0), out.stride(0),
        TOPK=topk_ids.shape[1], SPLIT_K=cfg.split_k2, BLOCK_H=block_h, PDL=pdl_chain,
        **({"launch_pdl": True} if pdl_chain else {}),  # (an option of the CUDA backend only)
    )
    return out


def fused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weights: MoEWeights,
    act: GatedActivation,
    aq: ActivationQuant,
    key: Optional[Hashable] = None,
) -> torch.Tensor:
    """``mxfx.moe`` on validated arguments: routing prep, GEMM1+activation, GEMM2, k-sum.

    Shapes as :func:`mxfx.backends.emulation.moe`; returns ``[T, H]`` in ``x.dtype``.
    Temporaries: the intermediate ``[T*k, I]`` in x.dtype, ``[S, T*k, H]`` float32 (S =
    ``split_k2`` of :func:`pick_config`), on per-pair blocks ``T * H/64`` int32 counters (in
    eager calls, where both GEMMs are one launch, persistent ones: :func:`_sync_buffer`), and
    under activation quantization the quantize-dequantized ``x`` (not where per-pair GEMM1
    quantizes x's rows as it reads them: in that one launch, and see :func:`_gemm1_quantizes_x`),
    on grouped mma.sync blocks ``x`` in the paired order (quantize-dequantized on the way, if so);
    in the warp-specialized kernel ``x`` dot-ordered and both it and the intermediate padded to
    a multiple of 128 columns (under activation quantization
    the intermediate twice: as GEMM1 stores it, and dot-ordered), and in its blocks of up to 64
    rows 3 int32 words per tile of each GEMM (whether it met a scale over 128). Replayed from a
    launch plan (:mod:`mxfx.kernels.replay`) after the first call with the same signature
    (``key``, where the caller has one, equal exactly for calls of equal
    :func:`mxfx.moe_call.signature` and equal other arguments).
    """
    w = weights
    sync = _sync_buffer(x) if moe_sm90.runs_on(x.device) else None
    return _FUSED((x, topk_weights, topk_ids, w.w13, w.w13_scale, w.w13_bias, w.w2, w.w2_scale, w.w2_bias, sync),
                  (act, aq), None if key is None else (key, sync is None))


# The counters of moe_sm90._moe_per_pair_sm90, per device and stream: zero between calls, so
# one buffer serves every call on its stream, in stream order.
_SYNC_WORDS = 4096
_sync: dict[tuple[int, int], torch.Tensor] = {}  # (device index, stream) -> counters


def _sync_buffer(x: torch.Tensor) -> Optional[torch.Tensor]:
    """The counters for ``x``'s device and the current stream (allocated zeroed there on first
    use), where the per-pair GEMMs run as one launch: in eager calls only. A CUDA graph being
    captured gets None, so two launches: there the host's launch time is paid once, at capture,
    and the pair is faster on the GPU (gpt-oss-120b T=1: 30.4 against 38.3 µs; in one launch
    GEMM2's programs take GEMM1's 96 registers, not their own 80, and wait on GEMM1's)."""
    if not x.is_cuda:  # launches recorded or compiled, not run
        return torch.zeros(_SYNC_WORDS, dtype=torch.int32)
    if torch._C._cuda_isCurrentStreamCapturing():
        return None
    device = x.get_device()
    key = (device, torch._C._cuda_getCurrentRawStream(device))
    buf = _sync.get(key)
    if buf is None:
        buf = _sync[key] = _allocated_outside_pools(_SYNC_WORDS, torch.int32, x.device).zero_()
    return buf


def _allocated_outside_pools(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor from the caching allocator's ordinary pool, even where this
    thread's allocations go to a private one: Inductor's CUDA graph trees warm up (run eagerly,
    not capturing) with every allocation of their thread sent to their graphs' pool, then raise
    if a live block of that pool is not an output they track, and when they restore the pool to
    a checkpoint they free the blocks it does not list. A buffer kept across calls cannot live
    there. Allocated by another thread for that (the pools are chosen per thread); nothing is
    launched there, so the caller's stream orders whatever it then does with the tensor."""
    with ThreadPoolExecutor(1) as thread:
        return thread.submit(torch.empty, numel, dtype=dtype, device=device).result()


def _per_pair_in_one(x, topk_weights, topk_ids, weights, act, aq, cfg, inter, sync) -> torch.Tensor:
    """Both GEMMs and the k-sum on per-pair blocks in one launch
    (:func:`moe_sm90._moe_per_pair_sm90`), x quantize-dequantized under ``aq`` by GEMM1's
    programs as they read it: same results as the two launches, to the bit."""
    T, H = x.shape
    k = topk_ids.shape[1]
    inter_size = inter.shape[1]
    y = torch.empty(cfg.split_k2, T * k, H, dtype=torch.float32, device=x.device)
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    w13, s13, w2, s2 = weights.w13, weights.w13_scale, weights.w2, weights.w2_scale
    b13 = weights.w13_bias if weights.w13_bias is not None else w13
    b2 = weights.w2_bias if weights.w2_bias is not None else w2
    interleaved = act.layout == "interleaved"
    moe_sm90.PER_PAIR_SM90[(T * k * (cdiv(inter_size, 32) + cdiv(H, moe_sm90.BLOCK_N2) * cfg.split_k2),)](
        x, x.stride(0),
        w13, w13.stride(0), w13.stride(1), s13, s13.stride(0), s13.stride(1), b13, b13.stride(0), b13.stride(-1),
        inter, inter.stride(0),
        w2, w2.stride(0), w2.stride(1), s2, s2.stride(0), s2.stride(1), b2, b2.stride(0), b2.stride(-1),
        topk_weights.reshape(-1), topk_ids.reshape(-1), y, y.stride(0), y.stride(1), out, out.stride(0),
        sync, T * k, 1 if interleaved else inter_size, float(act.alpha), float(act.beta),
        float(act.limit) if act.limit is not None else 0.0,
        H=H, I=inter_size, E=weights.num_experts, TOPK=k, GATE_STRIDE=2 if interleaved else 1,
        HAS_LIMIT=act.limit is not None, HAS_BIAS1=weights.w13_bias is not None,
        HAS_BIAS2=weights.w2_bias is not None, SPLIT_K=cfg.split_k2, AQ=mx.FMT_CODES[aq.fmt],
        AQ_ROUNDING=mx.ROUNDING_CODES[aq.scale_rounding], XROW=cfg.x_row_stages, X_QDQ=aq.fmt != "none",
        # The ids' device-side check (as the per-pair GEMMs), without overflow checks.
        debug=True, sanitize_overflow=False, num_warps=4, num_stages=1)
    return out


def _fused_moe(x, topk_weights, topk_ids, w13, w13_scale, w13_bias, w2, w2_scale, w2_bias, sync, act, aq):
    weights = MoEWeights(w13, w13_scale, w13_bias, w2, w2_scale, w2_bias)
    T, H, k, inter_size = _sizes(x, topk_ids, weights)
    if T == 0:
        return torch.empty(0, H, dtype=x.dtype, device=x.device)
    native = aq.fmt != "none" and weights.quantized and mx.native_scaled_mma(x.device)
    hopper = hopper_fits(x, weights) and not native
    cfg = pick_config(T * k, weights.num_experts, H, hopper,
                      hopper and moe_sm90_ws.fits(weights, T * k, H, inter_size), inter_size)
    routing = _route(topk_ids, weights, cfg)
    if cfg.ws:
        # Both GEMM inputs in the dot's K order (quantize-dequantized on the way under
        # activation quantization): x here, the intermediate as GEMM1 stores it or, under
        # activation quantization, here after GEMM1.
        act_quant = aq.fmt != "none"
        inter = torch.empty(T * k, inter_size if act_quant else moe_sm90_ws.padded(inter_size), dtype=x.dtype,
                            device=x.device)
        _gemm(moe_sm90_ws.dot_order(x, cfg.block_m, aq), k, weights.w13, weights.w13_scale, weights.w13_bias, routing,
              inter, 0, inter_size, H, cfg, block_n=cfg.block_n1, act=act, aq=aq)
        if act_quant:
            inter = moe_sm90_ws.dot_order(inter, cfg.block_m, aq)
        return _gemm2_and_sum(inter, x, topk_weights, topk_ids, weights, routing, cfg)
    inter = torch.empty(T * k, inter_size, dtype=x.dtype, device=x.device)
    if native:
        # Each GEMM's input quantized as the emulation does it, kept as MX elements and
        # scales for the scaled MMA: x here, the intermediate once GEMM1 has written it.
        xq, xs = mx.quantize(x if x.stride(1) == 1 else x.contiguous(), aq.fmt, aq.scale_rounding)
        _gemm(xq, k, weights.w13, weights.w13_scale, weights.w13_bias, routing, inter, 0, inter_size,
              H, cfg, block_n=cfg.block_n1, act=act, a_mx=(aq.fmt, xs))
        iq, iscale = mx.quantize(inter, aq.fmt, aq.scale_rounding)
        return _gemm2_and_sum(iq, x, topk_weights, topk_ids, weights, routing, cfg, a_mx=(aq.fmt, iscale))
    # Activation quantization, as the emulation does it: x once here (a [T, H] temporary),
    # the intermediate in GEMM1's epilogue. On grouped mma.sync blocks both GEMMs read their
    # activations in the paired order, so that each lane's 16-byte loads are its B registers,
    # with no permute in the K loop (406 -> 384 SASS per two steps): x by a copy (a [T, H]
    # temporary, which replaces the quantize pass's), the intermediate as GEMM1 stores it.
    # Same outputs to the bit; H200, graph µs, min-max of 2 alternating processes, natural /
    # paired: gpt-oss-120b T=8 141.6-142.6 / 137.8-138.3, T=32 380.4-388.1 / 370.5-375.3, T=64
    # 511.1-519.1 / 496.5-501.1, T=128 624.1-631.8 / 602.5-603.4; gpt-oss-20b T=32 163.9-164.3 /
    # 158.5-158.6; MiniMax-M3 T=8 290.9-293.7 / 280.9-284.4, T=64 1064.0-1076.6 / 1041.7-1049.9;
    # Mixtral-8x7B T=16 259.6-263.9 / 244.2-258.2; Qwen3-30B-A3B T=64 130.3-130.9 / 126.9-127.3.
    chain = _pdl_chain(cfg, routing)
    row_in_smem = cfg.sm90 and bool(routing.per_pair_experts) and bool(cfg.x_row_stages)
    # In an eager call the per-pair GEMMs run as one launch, whose GEMM1 programs quantize-
    # dequantize x's row as they read it: no quantize pass, one launch fewer on a host-bound
    # call. Same outputs to the bit; H200, gpt-oss-120b T=1, pass / in GEMM1: host µs per call
    # 5.5-6.6 over A16's in the same process / level with it; the call's GPU µs W4A8 39.9-40.2 /
    # 38.2-38.4, W4A4 40.2-40.4 / 39.5-39.7 (A16 37.2-37.5). (The one launch's waiting programs
    # read their activation row into shared memory: tiles forced without x_row_stages, as
    # tools/moe_kernel_timing.py's, take the two.)
    if row_in_smem and sync is not None and 1 + T * k + T * cdiv(H, moe_sm90.BLOCK_N2) <= sync.numel():
        return _per_pair_in_one(x, topk_weights, topk_ids, weights, act, aq, cfg, inter, sync)
    # In two launches (a CUDA graph) per-pair GEMM1 quantizes x's row itself only where that is
    # little work per SM (_gemm1_quantizes_x); otherwise it is launched by PDL after x's quantize
    # pass, so it issues its first weight loads while the pass runs. GEMM1 launched by PDL against
    # after the pass (same outputs to the bit), W4A8 before / after, W4A4 before / after:
    # Qwen3-30B-A3B T=1 17.0-17.2 / 16.2-16.4, 17.2-17.5 / 16.2-16.4; gpt-oss-20b T=1 26.7-27.1 /
    # 26.1-26.4, 27.5-27.6 / 26.2-26.3; Mixtral-8x7B T=1 69.3-70.3 / 69.5-69.7, 71.1 / 69.0;
    # gpt-oss-120b T=1 26.4-26.6 / 25.7-26.7, 26.3-26.5 / 25.8-26.4, T=4 79.1-80.5 / 78.3-78.8,
    # 79.2 / 78.0-78.5.
    row_quantized = aq.fmt != "none" and row_in_smem
    x_qdq = row_quantized and _gemm1_quantizes_x(T * k * cdiv(inter_size, sm90_tile.tile_cols(True)), H, x.device)
    after_pdl = row_quantized and not x_qdq
    if chain:
        x_in = moe_sm90.paired(x, aq, pdl=True)
    elif aq.fmt == "none" or x_qdq:
        x_in = x
    else:
        x_in = mx.quantize_dequantize(x, aq.fmt, aq.scale_rounding, dependents=after_pdl)
    counters = _k_sum_counters(routing, T, H, x.device)
    _gemm(x_in, k, weights.w13, weights.w13_scale, weights.w13_bias, routing, inter, 0, inter_size,
          H, cfg, block_n=cfg.block_n1, act=act, aq=aq, counters=counters, pdl_chain=chain, paired=chain,
          after_pdl=after_pdl, x_qdq=x_qdq)
    return _gemm2_and_sum(inter, x, topk_weights, topk_ids, weights, routing, cfg, counters=counters,
                          pdl_chain=chain, paired=chain)


_FUSED = Replayer(_fused_moe)


def unfused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weights: MoEWeights,
    act: GatedActivation,
    gated_activation: Callable[[torch.Tensor, GatedActivation], torch.Tensor],
    key: Optional[Hashable] = None,
) -> torch.Tensor:
    """Grouped GEMM1 (+bias, ``[T*k, 2I]`` in x.dtype) → ``gated_activation`` → GEMM2 → k-sum.

    No activation quantization. Rows of unrouted slots are left unwritten, and nothing computed
    from them reaches the output. For the warp-specialized kernel x and the activation's output
    are also copied in the dot's K order (:func:`mxfx.kernels.moe_sm90_ws.dot_order`).
    Replayed from a launch plan (:mod:`mxfx.kernels.replay`) after the first call with the same
    signature (``key``, as :func:`fused_moe`'s), when ``gated_activation`` only allocates and
    launches through :class:`~mxfx.kernels.launch.Launcher` (as
    :func:`mxfx.kernels.activation.gated_activation`).
    """
    w = weights
    return _UNFUSED((x, topk_weights, topk_ids, w.w13, w.w13_scale, w.w13_bias, w.w2, w.w2_scale, w.w2_bias),
                    (act, gated_activation), None if key is None else (key, gated_activation))


def _unfused_moe(x, topk_weights, topk_ids, w13, w13_scale, w13_bias, w2, w2_scale, w2_bias, act, gated_activation):
    weights = MoEWeights(w13, w13_scale, w13_bias, w2, w2_scale, w2_bias)
    T, H, k, inter_size = _sizes(x, topk_ids, weights)
    if T == 0:
        return torch.empty(0, H, dtype=x.dtype, device=x.device)
    hopper = hopper_fits(x, weights)
    cfg = pick_config(T * k, weights.num_experts, H, hopper,
                      hopper and moe_sm90_ws.fits(weights, T * k, H, inter_size), inter_size)
    routing = _route(topk_ids, weights, cfg)
    pre = torch.empty(T * k, 2 * inter_size, dtype=x.dtype, device=x.device)
    counters = _k_sum_counters(routing, T, H, x.device)
    # The warp-specialized kernel reads both GEMM inputs in the dot's K order.
    _gemm(moe_sm90_ws.dot_order(x, cfg.block_m) if cfg.ws else x, k, weights.w13, weights.w13_scale,
          weights.w13_bias, routing, pre, 0, 2 * inter_size, H, cfg, block_n=2 * cfg.block_n1, counters=counters)
    inter = gated_activation(pre, act)
    if cfg.ws:
        inter = moe_sm90_ws.dot_order(inter, cfg.block_m)
    return _gemm2_and_sum(inter, x, topk_weights, topk_ids, weights, routing, cfg, counters=counters)


_UNFUSED = Replayer(_unfused_moe)
