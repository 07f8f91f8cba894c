"""Routing preparation on the GPU: group the (token, slot) pairs by expert.

For ``topk_ids [T, k]`` and a kernel block of ``block_m`` rows, one kernel (two past one
chunk of pairs: per-chunk counts, then placement) computes

- ``sorted_pairs [max_blocks * block_m] int32``: the flat pair indices ``t*k + j``, grouped by
  expert (experts in increasing order, pairs in increasing order inside an expert: the
  result is deterministic), each expert's run starting at a multiple of ``block_m``; slots
  with id < 0 appear nowhere; the padding after a run is left unwritten;
- ``block_expert [max_blocks] int32``: the expert of each block of ``block_m`` rows, -1 for
  blocks past the last expert's run;
- ``block_rows [max_blocks] int32``: how many leading rows of each block are pairs (0 past
  the last run). Kernels read only those rows of ``sorted_pairs``.

``max_blocks`` depends only on ``T``, ``k``, ``E`` and ``block_m``, so the GEMMs' grids are known
on the host without reading the ids back: no host synchronisation, CUDA-graph capturable.
An id >= E fails a device-side assert (the placement kernel is launched in Triton's debug
mode for it); the kernels use no scan, only reductions, gathers and histograms, which keeps
them at a few µs on the H200 for any T.

For a single token, or few pairs against many experts, :func:`per_pair` makes each pair its
own block with no kernel at all: the GEMMs then read the ids themselves.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mxfx.kernels.launch import Launcher, cdiv, next_power_of_2


class Routing(NamedTuple):
    sorted_pairs: torch.Tensor  # int32 [max_blocks * block_m]
    block_expert: torch.Tensor  # int32 [max_blocks]
    block_rows: torch.Tensor  # int32 [max_blocks]
    block_m: int
    num_pairs: int  # T*k
    # Each pair its own block (see per_pair): the three tensors are the flat ids, and E is
    # what the GEMMs check them against.
    per_pair_experts: int = 0


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the blocks of ``block_m`` rows any routing of ``num_pairs`` pairs needs."""
    # Each non-empty expert pads by at most block_m - 1 rows.
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


@functools.lru_cache(maxsize=256)
def blocks_pmf(num_pairs: int, num_experts: int, block_m: int) -> tuple[tuple[int, float], ...]:
    """The distribution of the blocks of ``block_m`` rows that the pairs take when each goes to
    an expert drawn uniformly: ``(blocks, probability)`` in increasing order of blocks, within
    the bounds any routing keeps (:func:`max_blocks`), the probabilities summing to 1 (less what
    falls under 1e-12). A host-side estimate for grid choices at several rows per expert. An
    expert's rows are Binomial(num_pairs, 1/num_experts) (normal approximation past the first
    block) and the experts are taken as independent, which spreads the distribution a little
    (at 56 rows per expert over 8 experts, 0.11 in total variation against random routings;
    the mean within 1 %). The distribution rather than its mean, since a GEMM's rounds of tiles
    over the SMs jump where the blocks cross a multiple: when one routing in four takes a ninth
    block, three in four still take one round less."""
    if not num_pairs or not num_experts:
        return ((0, 1.0),)
    p = 1 / num_experts
    mean, sd = num_pairs * p, math.sqrt(num_pairs * p * (1 - p))
    at_least = [1.0, 1 - (1 - p) ** num_pairs]  # P(an expert takes >= j blocks)
    while (len(at_least) - 1) * block_m < mean + 8 * sd:
        edge = (len(at_least) - 1) * block_m + 0.5 - mean  # rows over j blocks' worth, with continuity
        at_least.append(0.5 * math.erfc(edge / (sd * math.sqrt(2))) if sd else float(edge < 0))
    at_least.append(0.0)
    one = {j: at_least[j] - at_least[j + 1] for j in range(len(at_least) - 1)}
    total: dict[int, float] = {0: 1.0}
    e = num_experts
    while e:  # the sum over the experts, by doubling
        if e & 1:
            total = _convolve(total, one)
        one, e = _convolve(one, one), e >> 1
    # Independent experts spread the sum wider than a routing can: fold it into its bounds.
    least, most = cdiv(num_pairs, block_m), max_blocks(num_pairs, num_experts, block_m)
    clamped: dict[int, float] = {}
    for b, q in total.items():
        b = min(max(b, least), most)
        clamped[b] = clamped.get(b, 0.0) + q
    return tuple(sorted(clamped.items()))


def _convolve(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    out: dict[int, float] = {}
    for i, p in a.items():
        for j, q in b.items():
            if p * q > 1e-12:
                out[i + j] = out.get(i + j, 0.0) + p * q
    return out


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, E_POW2: tl.constexpr,
                  CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """counts[c, e]: how many of chunk c's pairs go to expert e. ``PDL``: the placement
    kernel, launched by PDL, may start at once (see :func:`align`)."""
    if PDL:
        gdc_launch_dependents()
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    routed = (ids >= 0) & (ids < num_experts)
    counts = tl.histogram(tl.where(routed, ids, 0).to(tl.int32), E_POW2, mask=routed)
    tl.store(counts_ptr + c * E_POW2 + tl.arange(0, E_POW2), counts)


@triton.jit
def _place_kernel(
    ids_ptr,
    counts_ptr,
    sorted_ptr,
    block_expert_ptr,
    block_rows_ptr,
    num_pairs,
    num_experts,
    num_chunks,
    num_blocks,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    NC_POW2: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program c places chunk c's pairs and describes its share of the blocks. Every
    program derives the same expert offsets from all chunks' counts (with ``ONE_CHUNK``
    it counts its own pairs, and ``_count_kernel`` is not launched). ``PDL``: launched by PDL
    after ``_count_kernel`` (unless ``ONE_CHUNK``), and the launch after it by PDL may start
    once this one has read the counts."""
    if PDL:
        if ONE_CHUNK:
            gdc_launch_dependents()
        else:
            gdc_wait()
    c = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    if ONE_CHUNK:
        everything = tl.arange(0, CHUNK)
        all_ids = tl.load(ids_ptr + everything, mask=everything < num_pairs, other=-1)
        all_routed = (all_ids >= 0) & (all_ids < num_experts)
        counts = tl.histogram(tl.where(all_routed, all_ids, 0).to(tl.int32), E_POW2, mask=all_routed)
        base = tl.zeros_like(counts)
    else:
        chunks = tl.arange(0, NC_POW2)
        all_counts = tl.load(counts_ptr + chunks[:, None] * E_POW2 + experts[None, :],
                             mask=(chunks < num_chunks)[:, None], other=0)
        counts = tl.sum(all_counts, axis=0)
        base = tl.sum(tl.where((chunks < c)[:, None], all_counts, 0), axis=0)
        if PDL:
            # Only once the counts are in registers (the instruction takes their sum): the launch
            # after this one may write before it waits (x's paired copy, sm90_tile.ordered_copy),
            # into bytes that held the counts, a temporary freed once read.
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $1", "=r,r", [tl.sum(counts)],
                                      dtype=tl.int32, is_pure=False, pack=1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    base += starts

    # SUB pairs at a time, in order: a pair's slot is its expert's next free one, after
    # those taken by the same expert's earlier pairs of this step (no scans: a [SUB, SUB]
    # comparison and gathers).
    # `while`, not `range`: the Triton 3.6 interpreter cannot take a run-time scalar as a
    # `range` bound under numpy 2.
    i = tl.arange(0, SUB)
    p0 = c * CHUNK
    p_end = tl.minimum(p0 + CHUNK, num_pairs)
    while p0 < p_end:
        offs = p0 + i
        ids = tl.load(ids_ptr + offs, mask=offs < p_end, other=-1)
        tl.device_assert(ids < num_experts, "topk_ids: expert id >= E")
        routed = (ids >= 0) & (ids < num_experts)
        e = tl.where(routed, ids, 0).to(tl.int32)
        earlier = (e[:, None] == e[None, :]) & routed[None, :] & (i[None, :] < i[:, None])
        pos = tl.gather(base, e, 0) + tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(sorted_ptr + pos, offs, mask=routed)
        base += tl.histogram(e, E_POW2, mask=routed)
        p0 += SUB

    per_program = tl.cdiv(num_blocks, num_chunks)
    b0 = c * per_program
    b_end = tl.minimum(b0 + per_program, num_blocks)
    while b0 < b_end:
        blk = b0 + i
        row = blk * BLOCK_M
        # The block's expert is the first whose padded run ends after its first row; past
        # the last run that is E_POW2 (experts >= E have empty runs).
        expert = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
        found = expert < num_experts
        e = tl.minimum(expert, E_POW2 - 1)
        rows = tl.minimum(tl.gather(counts, e, 0) - (row - tl.gather(starts, e, 0)), BLOCK_M)
        ok = blk < b_end
        tl.store(block_expert_ptr + blk, tl.where(found, expert, -1), mask=ok)
        tl.store(block_rows_ptr + blk, tl.where(found, rows, 0), mask=ok)
        b0 += SUB


_COUNT = Launcher(_count_kernel)
_PLACE = Launcher(_place_kernel)


def per_pair(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """Block ``b`` is pair ``b`` alone, of expert ``topk_ids.flatten()[b]`` (none if < 0), with
    no kernel of its own: the GEMMs read the ids (and assert each is < E on the device). For a
    single token, whose k experts are distinct, that is the grouping :func:`align` computes,
    minus its launch (H200, gpt-oss-120b T=1 in a CUDA graph: 39.1 -> 36.4 µs); for more
    tokens an expert that two pairs share is read once per pair."""
    ids = topk_ids.reshape(-1)
    return Routing(ids, ids, ids, block_m, ids.numel(), num_experts)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int, chunk: Optional[int] = None,
          pdl: bool = False) -> Routing:
    """Group the pairs of ``topk_ids [T, k]`` (any integer dtype) by expert; see the module doc.

    ``chunk`` (a power of two) pairs per program: per-chunk expert counts, then each chunk
    places its pairs at its offset (one launch when the pairs fit one chunk). By default at
    least 64, and large enough for at most 128 chunks, since every program reads all chunks'
    counts (H200, top-4 of 128 experts, against 256: T=64 11.2 -> 6.9 µs, T=512 10.4 -> 6.9,
    T=4096 10.9 -> 9.0 with 128).

    ``pdl`` (CUDA, sm_90 and later): the kernels are the head of a chain of launches by PDL
    (programmatic dependent launch): each lets the next launch start at once (the placement
    kernel, once it has read the counts), and the placement kernel, launched by PDL after the
    count, waits for it. The GEMM launched next by PDL must wait for the placement
    (``griddepcontrol.wait``) before it reads the routing.
    """
    num_pairs = topk_ids.numel()
    nb = max_blocks(num_pairs, num_experts, block_m)
    dev = topk_ids.device
    sorted_pairs = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
    block_rows = torch.empty(nb, dtype=torch.int32, device=dev)
    if nb > 0:
        ids = topk_ids.reshape(-1)  # any integer dtype: the kernels compare it as loaded
        e_pow2 = next_power_of_2(max(num_experts, 2))
        if chunk is None:
            chunk = max(64, next_power_of_2(cdiv(num_pairs, 128)))
        num_chunks = cdiv(num_pairs, chunk)
        chunk = min(chunk, max(16, next_power_of_2(num_pairs)))
        counts = block_rows  # placeholder pointer: unused with ONE_CHUNK
        if num_chunks > 1:
            counts = torch.empty(num_chunks, e_pow2, dtype=torch.int32, device=dev)
            _COUNT[(num_chunks,)](ids, counts, num_pairs, num_experts, E_POW2=e_pow2, CHUNK=chunk, PDL=pdl)
        _PLACE[(num_chunks,)](
            ids, counts, sorted_pairs, block_expert, block_rows, num_pairs, num_experts, num_chunks, nb,
            BLOCK_M=block_m, E_POW2=e_pow2, CHUNK=chunk, SUB=min(chunk, 64),
            NC_POW2=next_power_of_2(num_chunks), ONE_CHUNK=num_chunks == 1, PDL=pdl,
            # (an option of the CUDA backend only)
            **({"launch_pdl": True} if pdl and num_chunks > 1 else {}),
            # The id check is a device-side assert (no host synchronisation). Debug mode would
            # also check every integer add for overflow: 3x the instructions, so that is off.
            debug=True, sanitize_overflow=False,
        )
    return Routing(sorted_pairs, block_expert, block_rows, block_m, num_pairs)
