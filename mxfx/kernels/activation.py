"""Triton kernel for the gated activation of :mod:`mxfx.activation`.

One pass over ``x [..., 2d]``: each program loads a ``[BLOCK_M, BLOCK_D]`` tile of gate and
up values (for the interleaved layout one contiguous ``[BLOCK_M, 2·BLOCK_D]`` tile, split in
registers, so the loads stay wide), computes in float32 and writes ``[..., d]``.
The op is memory-bound: 3·d·itemsize bytes per row, nothing else.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfx.activation import GatedActivation
from mxfx.kernels.launch import Launcher, cdiv, next_power_of_2, on_device

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TILE = 4096  # elements per program: enough loads in flight per SM, few registers per thread
_MAX_BLOCK_D = 1024


@triton.jit
def _gated_activation_kernel(
    x_ptr,
    out_ptr,
    M,
    D,
    stride_xm,
    stride_xk,
    alpha,
    beta,
    limit,
    INTERLEAVED: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    if INTERLEAVED:
        # gate at 2j, up at 2j+1: load 2·BLOCK_D consecutive columns, split the pairs.
        cols2 = tl.program_id(1) * (2 * BLOCK_D) + tl.arange(0, 2 * BLOCK_D)
        mask2 = row_mask[:, None] & (cols2 < 2 * D)[None, :]
        pairs = tl.load(x_rows + cols2.to(tl.int64)[None, :] * stride_xk, mask=mask2, other=0.0)
        gate, up = tl.split(tl.reshape(pairs.to(tl.float32), (BLOCK_M, BLOCK_D, 2)))
    else:
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (cols < D)[None, :]
        ptrs = x_rows + cols.to(tl.int64)[None, :] * stride_xk
        gate = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(ptrs + D * stride_xk, mask=mask, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        # NaN must stay NaN, as torch.clamp keeps it.
        gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
        up = tl.clamp(up, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
    out = gate * tl.sigmoid(alpha * gate) * (up + beta)
    out_cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    out_mask = row_mask[:, None] & (out_cols < D)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * D + out_cols[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


_GATED = Launcher(_gated_activation_kernel)


def _blocks(m: int, d: int) -> tuple[int, int]:
    block_d = min(next_power_of_2(d), _MAX_BLOCK_D)
    block_m = min(max(_TILE // block_d, 1), next_power_of_2(m))
    return block_m, block_d


def gated_activation(x: torch.Tensor, act: GatedActivation) -> torch.Tensor:
    """``act`` applied to ``x [..., 2d]`` → contiguous ``[..., d]`` in ``x.dtype``.

    ``x`` is float16, bfloat16 or float32 on a CUDA/ROCm device (or on the CPU under
    ``TRITON_INTERPRET=1``), with any strides; the math is float32 (``alpha``, ``beta``,
    ``limit`` rounded to float32, as torch does for a float32 tensor). Equals
    :func:`mxfx.backends.emulation.gated_activation` up to float32 rounding.
    """
    if not isinstance(act, GatedActivation):
        raise TypeError(f"act: got {type(act).__name__}, expected mxfx.activation.GatedActivation")
    if x.dtype not in DTYPES:
        raise TypeError(f"x: got dtype {x.dtype}, expected one of {list(DTYPES)}")
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x: last dimension must be even (gate and up), got shape {tuple(x.shape)}")
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    # reshape is a view whenever the leading dims collapse (the usual case); strides do the rest.
    x2 = x.reshape(-1, 2 * d)
    m = x2.shape[0]
    block_m, block_d = _blocks(m, d)
    grid = (cdiv(m, block_m), cdiv(d, block_d))
    limit = 0.0 if act.limit is None else float(act.limit)
    with on_device(x):
        _GATED[grid](
            x2, out, m, d, x2.stride(0), x2.stride(1),
            float(act.alpha), float(act.beta), limit,
            INTERLEAVED=act.layout == "interleaved",
            HAS_LIMIT=act.limit is not None,
            BLOCK_M=block_m,
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out
