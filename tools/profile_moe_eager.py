"""Where the host time of one eager MoE call goes.

    python tools/profile_moe_eager.py [--T 1] [--calls 300] [--profile]

On a GPU: the median wall time of an eager ``torch.ops.mxfx.moe`` call (gpt-oss-120b shape,
``triton`` backend) against the same call replayed in a CUDA graph, then the host time of
each piece (the op, ``fused_moe``, routing, one GEMM launch, a plain torch launch for scale).
Without a GPU (or with ``--host-only``): the Python glue of ``fused_moe`` on CPU tensors with
the kernel launches recorded instead of run. ``--profile`` adds a cProfile of the calls.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mxfx  # noqa: E402,F401  (registers torch.ops.mxfx)
from mxfx.backends.base import ActivationQuant, MoEWeights  # noqa: E402
from mxfx.kernels import launch, moe, routing  # noqa: E402
from mxfx.oracle.shapes import SHAPES  # noqa: E402

SHAPE = SHAPES["gpt-oss-120b"]
E, H, I, K = SHAPE.num_experts, SHAPE.hidden_size, SHAPE.intermediate_size, SHAPE.top_k


def per_call_us(fn, calls: int, sync) -> float:
    """Median µs of ``fn`` over ``calls`` back-to-back calls, in 5 batches."""
    for _ in range(10):
        fn()
    sync()
    batches = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        batches.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(batches)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=1)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--host-only", action="store_true", help="CPU tensors, launches recorded, not run")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    gpu = torch.cuda.is_available() and not args.host_only
    dev = "cuda" if gpu else "cpu"
    if not gpu:
        launch.Launcher._launch = lambda self, grid, a, meta: None
    # Uninitialised weights: the host path does not look at the values.
    W = MoEWeights(
        torch.empty(E, 2 * I, H // 2, dtype=torch.uint8, device=dev),
        torch.full((E, 2 * I, H // 32), 120, dtype=torch.uint8, device=dev),
        torch.zeros(E, 2 * I, dtype=torch.bfloat16, device=dev),
        torch.empty(E, H, I // 2, dtype=torch.uint8, device=dev),
        torch.full((E, H, I // 32), 120, dtype=torch.uint8, device=dev),
        torch.zeros(E, H, dtype=torch.bfloat16, device=dev),
    )
    x = torch.randn(args.T, H, device=dev).to(torch.bfloat16)
    tw, ids = torch.topk(torch.randn(args.T, E, device=dev).softmax(-1), K)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    act = SHAPE.activation
    pieces = {"fused_moe": lambda: moe.fused_moe(x, tw, ids, W, act, ActivationQuant())}
    if gpu:
        cfg = moe.pick_config(args.T * K, E)
        r = routing.align(ids, E, cfg.block_m)
        inter = torch.empty(args.T * K, I, dtype=x.dtype, device=dev)
        op = lambda: torch.ops.mxfx.moe(  # noqa: E731
            x, tw, ids, W.w13, W.w13_scale, W.w13_bias, W.w2, W.w2_scale, W.w2_bias,
            act.layout, act.alpha, act.beta, act.limit, "none", "triton")
        pieces = {
            "torch.ops.mxfx.moe": op,
            **pieces,
            "routing.align": lambda: routing.align(ids, E, cfg.block_m),
            "one GEMM launch": lambda: moe._gemm(x, K, W.w13, W.w13_scale, W.w13_bias, r, inter, I, H,
                                                 cfg, block_n=cfg.block_n1, act=act),
            "torch x.add_(0), for scale": lambda: x.add_(0),
        }
        graph = torch.cuda.CUDAGraph()
        op()
        with torch.cuda.graph(graph):
            op()
        print(f"T={args.T}: eager {per_call_us(op, args.calls, sync):.1f} µs per call, "
              f"CUDA graph replay {per_call_us(graph.replay, args.calls, sync):.1f} µs "
              f"(fast launch {'on' if launch.ENABLED else 'off'})")
    for name, fn in pieces.items():
        print(f"{name:28s} {per_call_us(fn, args.calls, sync):8.1f} µs host" + ("" if gpu else " (launches not run)"))
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            next(iter(pieces.values()))()
        sync()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
