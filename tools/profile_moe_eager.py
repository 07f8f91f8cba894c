"""Where the host time of one eager ``torch.ops.mxfx.moe`` call goes (GPU only).

    python tools/profile_moe_eager.py [--T 1] [--backend triton] [--calls 300]

Prints the median wall time of an eager call, the same call replayed in a CUDA graph, and the
top functions of a cProfile of the eager calls (by own time).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import mxfx  # noqa: F401  (registers torch.ops.mxfx)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=1)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    E, H, I, k = 128, 2880, 2880, 4
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, device=dev, generator=g)
    s13 = torch.randint(118, 122, (E, 2 * I, H // 32), dtype=torch.uint8, device=dev, generator=g)
    w2 = torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, device=dev, generator=g)
    s2 = torch.randint(118, 122, (E, H, I // 32), dtype=torch.uint8, device=dev, generator=g)
    b13 = torch.zeros(E, 2 * I, dtype=torch.bfloat16, device=dev)
    b2 = torch.zeros(E, H, dtype=torch.bfloat16, device=dev)
    x = torch.randn(args.T, H, dtype=torch.bfloat16, device=dev)
    logits = torch.randn(args.T, E, device=dev)
    tw, ids = torch.topk(torch.softmax(logits, -1), k)
    call = lambda: torch.ops.mxfx.moe(  # noqa: E731
        x, tw, ids, w13, s13, b13, w2, s2, b2, "interleaved", 1.702, 1.0, 7.0, "none", args.backend
    )
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    gtimes = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        gtimes.append((time.perf_counter() - t0) * 1e6)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    print(f"T={args.T} backend={args.backend}: eager {statistics.median(times):.1f} us, "
          f"graph replay {statistics.median(gtimes):.1f} us (wall, incl. sync)")


if __name__ == "__main__":
    main()
