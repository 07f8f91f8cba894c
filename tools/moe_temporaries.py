"""Device memory one MoE call allocates besides its output, as a multiple of its input's size.

    python tools/moe_temporaries.py [--model gpt-oss-120b] [--T 1 8 64 512 4096] [--backend triton]

On a CUDA device: for each T, the peak allocated during one eager ``torch.ops.mxfx.moe`` call
(after a warm-up call, so compilation and launch plans are not counted) minus what was
allocated before it and minus its output, divided by the bytes of ``x [T, H]``. Issue 4 asks
for at most 2x; next to each measurement is what the temporaries are by construction.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mxfx.ops  # noqa: E402,F401  (registers torch.ops.mxfx)
from mxfx import bench  # noqa: E402
from mxfx.oracle.shapes import SHAPES  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-oss-120b", choices=sorted(SHAPES))
    ap.add_argument("--T", type=int, nargs="*", default=[1, 8, 64, 512, 4096])
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--act-quant", default="none", choices=["none", "mxfp8", "mxfp4"])
    args = ap.parse_args()
    device = torch.device("cuda")
    shape = SHAPES[args.model]
    gen = torch.Generator(device=device).manual_seed(0)
    W = bench._random_weights(shape, device, gen)
    act = shape.activation
    print(f"{args.model} {args.backend} A={args.act_quant}: temporaries / bytes of x")
    for T in args.T:
        x, tw, ids = bench._routing_sets(shape, T, 1, device, gen)[0]
        call = lambda: torch.ops.mxfx.moe(  # noqa: E731
            x, tw, ids, W.w13, W.w13_scale, W.w13_bias, W.w2, W.w2_scale, W.w2_bias, act.layout,
            act.alpha, act.beta, act.limit, args.act_quant, args.backend)
        call()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = call()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated(device) - before - out.numel() * out.element_size()
        x_bytes = x.numel() * x.element_size()
        print(f"T={T:5d}  x {x_bytes / 2**20:8.2f} MiB  temporaries {extra / 2**20:9.2f} MiB  "
              f"= {extra / x_bytes:5.1f}x")


if __name__ == "__main__":
    main()
