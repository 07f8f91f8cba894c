"""``python -m mxfx demo | doctor | bench``."""
from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    import torch

    from mxfx import ops  # noqa: F401  (registers torch.ops.mxfx)

    torch.manual_seed(0)
    E, H, I, T, k = 8, 256, 128, 16, 2
    w13 = torch.randn(E, 2 * I, H) / H**0.5
    w2 = torch.randn(E, H, I) / I**0.5
    x = torch.randn(T, H)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    tw = torch.softmax(torch.randn(T, k), dim=-1)
    p13, s13 = torch.ops.mxfx.quantize_mx(w13, "mxfp4", "round_up")
    p2, s2 = torch.ops.mxfx.quantize_mx(w2, "mxfp4", "round_up")
    act = ("interleaved", 1.702, 1.0, 7.0)
    out = torch.ops.mxfx.moe(x, tw, ids, p13, s13, None, p2, s2, None, *act)
    ref = torch.ops.mxfx.moe(x, tw, ids, w13, None, None, w2, None, None, *act)
    rel = ((out - ref).norm() / ref.norm()).item()
    print(f"MXFP4 MoE E={E} H={H} I={I} T={T} top-{k}: backend=emulation")
    print(f"relative error vs float weights: {rel:.4f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mxfx")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="quantize a small MoE to MXFP4 and run it")
    args = parser.parse_args(argv)
    return {"demo": _demo}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
