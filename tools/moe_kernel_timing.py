"""Quick timing of mxfx's Triton MoE kernels (kernel tuning aid; the official benchmark is
tools/bench_moe.py). gpt-oss-120b shape, random MXFP4 weights, several routing sets rotated
under one CUDA graph, median per call, against the roofline measured in the same run.

    python tools/moe_kernel_timing.py [--tokens 1 8 64 512 4096] [--variants fused unfused]
                                      [--sweep] [--aq] [--kernels] [--profile]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mxfx.activation import GPT_OSS  # noqa: E402
from mxfx.backends.base import ActivationQuant, MoEWeights  # noqa: E402
from mxfx.kernels import activation, moe, mx  # noqa: E402

E, H, I, K = 128, 2880, 2880, 4
SETS = 8


def ceilings() -> tuple[float, float]:
    """(copy bytes/s counting read + write, bf16 matmul FLOP/s), measured now."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    def t(fn, n=10):
        fn(); torch.cuda.synchronize()
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        times = []
        for _ in range(n):
            s.record(); fn(); e.record(); e.synchronize(); times.append(s.elapsed_time(e) / 1e3)
        return statistics.median(times)
    bw = 2 * a.numel() / t(lambda: b.copy_(a))
    flops = 2 * 8192**3 / t(lambda: m @ m)
    del a, b, m
    return bw, flops


def weights() -> MoEWeights:
    g = torch.Generator(device="cuda").manual_seed(0)
    def u8(*shape, lo=0, hi=256):
        return torch.randint(lo, hi, shape, generator=g, device="cuda", dtype=torch.uint8)
    return MoEWeights(
        u8(E, 2 * I, H // 2), u8(E, 2 * I, H // 32, lo=119, hi=124),
        torch.randn(E, 2 * I, device="cuda", dtype=torch.bfloat16, generator=g),
        u8(E, H, I // 2), u8(E, H, I // 32, lo=119, hi=124),
        torch.randn(E, H, device="cuda", dtype=torch.bfloat16, generator=g),
    )


def routing_sets(T: int):
    g = torch.Generator(device="cuda").manual_seed(T)
    sets = []
    for _ in range(SETS):
        x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        tw, ids = torch.topk(torch.randn(T, E, device="cuda", generator=g).softmax(-1), K, dim=-1)
        sets.append((x, tw.to(torch.bfloat16), ids.to(torch.int32)))
    return sets


def touched_bytes(ids: torch.Tensor) -> int:
    n = torch.unique(ids).numel()
    per = 2 * I * (H // 2 + H // 32 + 2) + H * (I // 2 + I // 32 + 2)
    return n * per


def time_graph(fn, sets, replays=20) -> float:
    for s in sets:
        fn(*s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in sets:
            fn(*s)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for s in sets:
            fn(*s)
    graph.replay()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(True), torch.cuda.Event(True)
    times = []
    for _ in range(replays):
        st.record(); graph.replay(); en.record(); en.synchronize()
        times.append(st.elapsed_time(en) * 1e3 / len(sets))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 64, 512, 4096])
    p.add_argument("--sweep", action="store_true", help="try several tile configs per T")
    p.add_argument("--variants", nargs="*", default=["fused", "fused-f32unpack", "unfused"],
                   help="fused (default unpack), fused-f32unpack (portable unpack), unfused")
    p.add_argument("--aq", action="store_true", help="also time W4A8 and W4A4 (fused)")
    p.add_argument("--kernels", action="store_true", help="per-kernel device times (torch.profiler)")
    p.add_argument("--profile", action="store_true", help="cProfile the eager T=1 host path")
    args = p.parse_args()
    bw, fl = ceilings()
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {fl / 1e12:.0f} TFLOP/s")
    W = weights()
    base_pick = moe.pick_config
    base_ptx = mx.ptx_unpack
    rows = []
    for T in args.tokens:
        sets = routing_sets(T)
        mem = statistics.mean(touched_bytes(s[2]) for s in sets) / bw
        roof = max(mem, 2 * T * K * 3 * H * I / fl) * 1e6
        variants = [(v, ActivationQuant(), None) for v in args.variants]
        if args.aq:
            variants += [("fused", ActivationQuant("mxfp8"), None), ("fused", ActivationQuant("mxfp4"), None)]
        if args.sweep:
            rows_per_expert = T * K / E
            # (block_m, block_n1, block_n2, block_k, warps, swap, split)
            if rows_per_expert <= 4:
                tiles = [(16, 32, 64, 128, 4, True, True), (16, 32, 64, 128, 4, False, True),
                         (16, 16, 32, 128, 4, True, True), (16, 32, 64, 64, 4, True, True)]
            elif rows_per_expert <= 32:
                tiles = [(32, 64, 128, 64, 4, True, False), (32, 64, 128, 64, 4, True, True),
                         (32, 32, 64, 128, 4, True, True), (64, 64, 128, 64, 4, False, False)]
            else:
                tiles = [(128, 64, 128, 64, 4, False, False), (128, 64, 128, 64, 8, False, False),
                         (128, 128, 128, 64, 8, False, False), (64, 64, 128, 64, 4, False, False)]
            for t in tiles:
                variants.append(("fused", ActivationQuant(), moe.GemmConfig(*t)))
        for name, aq, cfg in variants:
            moe.pick_config = (lambda *a, c=cfg: c) if cfg is not None else base_pick
            mx.ptx_unpack = (lambda *a: False) if name == "fused-f32unpack" else base_ptx
            if name.startswith("fused"):
                fn = lambda x, tw, ids, aq=aq: moe.fused_moe(x, tw, ids, W, GPT_OSS, aq)  # noqa: E731
            else:
                fn = lambda x, tw, ids: moe.unfused_moe(x, tw, ids, W, GPT_OSS, activation.gated_activation)  # noqa: E731
            try:
                us = time_graph(fn, sets)
            except Exception as e:  # a config that does not compile: report, go on
                print(f"T={T} {name} {cfg}: {type(e).__name__}: {str(e)[:200]}")
                continue
            label = f"{name}/{aq.fmt}" + (f" {tuple(cfg)}" if cfg else f" {tuple(base_pick(T * K, E))}")
            rows.append((T, label, us, roof))
            print(f"T={T:5d} {label:48s} {us:9.1f} us  roofline {roof:7.1f} us  {100 * roof / us:5.1f} %", flush=True)
        moe.pick_config = base_pick
        mx.ptx_unpack = base_ptx
    x, tw, ids = routing_sets(1)[0]
    for _ in range(3):
        moe.fused_moe(x, tw, ids, W, GPT_OSS, ActivationQuant())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        moe.fused_moe(x, tw, ids, W, GPT_OSS, ActivationQuant())
    torch.cuda.synchronize()
    print(f"eager T=1 fused: {(time.perf_counter() - t0) / 200 * 1e6:.1f} us per call (host loop)")
    if args.kernels:
        from torch.profiler import ProfilerActivity, profile

        for T in (1, 64, 4096):
            x, tw, ids = routing_sets(T)[0]
            moe.fused_moe(x, tw, ids, W, GPT_OSS, ActivationQuant())
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    moe.fused_moe(x, tw, ids, W, GPT_OSS, ActivationQuant())
                torch.cuda.synchronize()
            print(f"--- T={T} kernels (10 calls)")
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=8))
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            moe.fused_moe(x, tw, ids, W, GPT_OSS, ActivationQuant())
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    print("\nT | variant | us | roofline us | % roofline")
    for T, label, us, roof in rows:
        print(f"{T} | {label} | {us:.1f} | {roof:.1f} | {100 * roof / us:.0f}")


if __name__ == "__main__":
    main()
