"""Quick timing of mxfx's Triton MoE kernels by tile config (a tuning aid; the official
benchmark is tools/bench_moe.py, whose problem, ceilings and CUDA-graph timing this reuses).
gpt-oss-120b shape; host time per piece is tools/profile_moe_eager.py.

    python tools/moe_kernel_timing.py [--tokens 1 8 64 512 4096] [--variants fused unfused]
                                      [--sweep] [--aq] [--kernels]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mxfx import bench  # noqa: E402
from mxfx.kernels import activation, moe, mx  # noqa: E402
from mxfx.moe_call import ActivationQuant  # noqa: E402
from mxfx.oracle.shapes import SHAPES  # noqa: E402

SHAPE = SHAPES["gpt-oss-120b"]
SETS = 8

# GemmConfig fields (block_m, block_n1, block_n2, block_k, warps, swap, split, split_k2, sm90,
# sync_mma) tried by --sweep, by rows per expert.
SWEEP = {
    4: [(16, 32, 64, 64, 4, True, True, 1, False, False), (8, 32, 64, 64, 4, True, True, 2, True, True),
        (8, 32, 64, 64, 4, True, True, 1, True, True), (16, 32, 64, 128, 4, True, True, 1, True, False)],
    32: [(32, 64, 128, 64, 4, True, True, 1, False, False), (32, 64, 128, 64, 4, True, True, 1, True, False),
         (16, 64, 128, 64, 4, True, True, 1, True, False), (8, 64, 128, 64, 4, True, True, 1, True, True)],
    None: [(128, 64, 128, 64, 4, False, False, 1, False, False), (64, 64, 128, 64, 4, False, False, 1, True, False),
           (128, 64, 128, 64, 4, False, False, 1, True, False)],
}


def _tiles(rows_per_expert: float) -> list[moe.GemmConfig]:
    limit = next(r for r in SWEEP if r is None or rows_per_expert <= r)
    return [moe.GemmConfig(*t) for t in SWEEP[limit]]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 64, 512, 4096])
    p.add_argument("--sweep", action="store_true", help="try several tile configs per T")
    p.add_argument("--variants", nargs="*", default=["fused", "fused-f32unpack", "unfused"],
                   help="fused (default unpack), fused-f32unpack (portable unpack), unfused")
    p.add_argument("--aq", action="store_true", help="also time W4A8 and W4A4 (fused)")
    p.add_argument("--kernels", action="store_true", help="per-kernel device times (torch.profiler)")
    args = p.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    ceil = bench.measure_ceilings(device)
    print(f"ceilings: copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, "
          f"bf16 matmul {ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s")
    W = bench._random_weights(SHAPE, device, gen)
    act = SHAPE.activation
    base_pick, base_ptx = moe.pick_config, mx.ptx_unpack
    rows = []
    for T in args.tokens:
        sets = bench._routing_sets(SHAPE, T, SETS, device, gen)
        bytes_ = statistics.mean(bench.touched_bytes(SHAPE, s[2]) for s in sets)
        roof = bench.roofline_seconds(bytes_, bench.moe_flops(SHAPE, T), ceil) * 1e6
        variants = [(v, ActivationQuant(), None) for v in args.variants]
        if args.aq:
            variants += [("fused", ActivationQuant(fmt), None) for fmt in ("mxfp8", "mxfp4")]
        if args.sweep:
            variants += [("fused", ActivationQuant(), cfg) for cfg in _tiles(T * SHAPE.top_k / SHAPE.num_experts)]
        for name, aq, cfg in variants:
            for replayer in (moe._FUSED, moe._UNFUSED):  # launch plans recorded under another config
                replayer._plans.clear()
            moe.pick_config = (lambda *a, c=cfg: c) if cfg is not None else base_pick
            mx.ptx_unpack = (lambda *a: False) if name == "fused-f32unpack" else base_ptx
            if name.startswith("fused"):
                fn = lambda x, tw, ids, aq=aq: moe.fused_moe(x, tw, ids, W, act, aq)  # noqa: E731
            else:
                fn = lambda x, tw, ids: moe.unfused_moe(x, tw, ids, W, act, activation.gated_activation)  # noqa: E731
            try:
                us = bench._time_call(fn, sets, device, graph=True, quick=False)[0] * 1e6
            except Exception as e:  # a config that does not compile: report, go on
                print(f"T={T} {name} {cfg}: {type(e).__name__}: {str(e)[:200]}")
                continue
            label = f"{name}/{aq.fmt} {tuple(moe.pick_config(T * SHAPE.top_k, SHAPE.num_experts, SHAPE.hidden_size, moe.hopper_fits(sets[0][0], W)))}"
            rows.append((T, label, us, roof))
            print(f"T={T:5d} {label:60s} {us:9.1f} us  roofline {roof:7.1f} us  {100 * roof / us:5.1f} %", flush=True)
        moe.pick_config, mx.ptx_unpack = base_pick, base_ptx
    if args.kernels:
        from torch.profiler import ProfilerActivity, profile

        for T in (1, 64, 4096):
            x, tw, ids = bench._routing_sets(SHAPE, T, 1, device, gen)[0]
            moe.fused_moe(x, tw, ids, W, act, ActivationQuant())
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    moe.fused_moe(x, tw, ids, W, act, ActivationQuant())
                torch.cuda.synchronize()
            print(f"--- T={T} kernels (10 calls)")
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=8))
    print("\nT | variant | us | roofline us | % roofline")
    for T, label, us, roof in rows:
        print(f"{T} | {label} | {us:.1f} | {roof:.1f} | {100 * roof / us:.0f}")


if __name__ == "__main__":
    main()
