"""Where the host time of one eager MoE call goes.

    python tools/profile_moe_eager.py [--T 1] [--calls 300] [--profile]

On a GPU: the wall time of an eager ``torch.ops.mxfx.moe`` call (gpt-oss-120b shape,
``triton`` backend) against the same call replayed in a CUDA graph, then the host time of
each piece (the op, ``fused_moe``, routing, one GEMM launch, a plain torch launch for scale)
on a tiny shape whose kernels take a few µs, so that back-to-back calls measure the host.
Both with mxfx's direct kernel launches (:mod:`mxfx.kernels.launch`) on and off, in the same
process. Without a GPU (or with ``--host-only``): the host path of the op, its body and
``fused_moe`` on CPU tensors, as a call replayed on a Hopper GPU runs it but with the launches
recorded instead of run (:func:`host_only`). ``--profile`` adds a cProfile of the op's host path.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mxfx.ops  # noqa: E402  (registers torch.ops.mxfx)
from mxfx.kernels import launch, moe, moe_sm90, routing  # noqa: E402
from mxfx.moe_call import ActivationQuant, MoEWeights  # noqa: E402
from mxfx.oracle import Platform  # noqa: E402
from mxfx.oracle.shapes import SHAPES  # noqa: E402

SHAPE = SHAPES["gpt-oss-120b"]
ACT = SHAPE.activation


def per_call_us(fn, calls: int, sync) -> float:
    """µs per call of ``fn`` over ``calls`` back-to-back calls: the least of 7 batches, since
    the GPU box's host time is noisy and noise only ever adds."""
    for _ in range(10):
        fn()
    sync()
    batches = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        batches.append((time.perf_counter() - t0) / calls * 1e6)
    return min(batches)


def problem(T: int, E: int, H: int, I: int, k: int, dev: str):
    """Uninitialised MXFP4 weights (the host path does not look at the values), x, routing."""
    W = MoEWeights(
        torch.empty(E, 2 * I, H // 2, dtype=torch.uint8, device=dev),
        torch.full((E, 2 * I, H // 32), 120, dtype=torch.uint8, device=dev),
        torch.zeros(E, 2 * I, dtype=torch.bfloat16, device=dev),
        torch.empty(E, H, I // 2, dtype=torch.uint8, device=dev),
        torch.full((E, H, I // 32), 120, dtype=torch.uint8, device=dev),
        torch.zeros(E, H, dtype=torch.bfloat16, device=dev),
    )
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    tw, ids = torch.topk(torch.randn(T, E, device=dev).softmax(-1), k)
    return W, x, tw.to(torch.bfloat16), ids


def op_call(W, x, tw, ids, fn=None):
    """``torch.ops.mxfx.moe`` on these arguments, or ``fn`` (the op's Python body) on them."""
    fn = fn or torch.ops.mxfx.moe
    return lambda: fn(
        x, tw, ids, W.w13, W.w13_scale, W.w13_bias, W.w2, W.w2_scale, W.w2_bias,
        ACT.layout, ACT.alpha, ACT.beta, ACT.limit, "none", "triton")


def pieces(T: int, E: int, H: int, I: int, k: int, dev: str) -> dict:
    """The host path's pieces to time: the op, its body and ``fused_moe``; on CUDA also the
    routing, one GEMM launch and plain torch calls for scale."""
    W, x, tw, ids = problem(T, E, H, I, k, dev)
    out = {
        "torch.ops.mxfx.moe": op_call(W, x, tw, ids),
        "the op's body, no dispatcher": op_call(W, x, tw, ids, mxfx.ops.moe),
        "fused_moe": lambda: moe.fused_moe(x, tw, ids, W, ACT, ActivationQuant()),
    }
    if dev == "cuda":
        cfg = moe.pick_config(T * k, E, x.shape[1], moe.hopper_fits(x, W))
        r = routing.align(ids, E, cfg.block_m)
        inter = torch.empty(T * k, I, dtype=x.dtype, device=dev)
        out.update({
            "routing.align": lambda: routing.align(ids, E, cfg.block_m),
            "one GEMM launch": lambda: moe._gemm(x, k, W.w13, W.w13_scale, W.w13_bias, r, inter, 0, I,
                                                 H, cfg, block_n=cfg.block_n1, act=ACT),
            "torch.empty": lambda: torch.empty(T * k, I, dtype=x.dtype, device=dev),
            "torch x.add_(0), for scale": lambda: x.add_(0),
        })
    return out


def host_only() -> None:
    """The host path of a replayed call on a simulated Hopper GPU, with CPU tensors: launches
    recorded and replayed as on the GPU, but not run (as tests/test_replay.py fakes them), and
    the expert ids not read back (on a GPU a kernel checks them)."""

    class NotRun:
        name = "not run"

        def __call__(self, grid, stream, call) -> None:
            pass

    def record(self, grid, a, meta) -> None:
        into = launch.recorded()
        if into is not None:
            into.append((NotRun(), grid, a, launch.key_and_call(0, a, meta)[1]))

    hopper = Platform("cuda", "sm90", frozenset({"triton"}))
    sync = torch.zeros(moe._SYNC_WORDS, dtype=torch.int32)
    launch.Launcher._launch = record
    launch.direct_launches = lambda t: True
    torch.cuda.current_device = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    mxfx.ops.Platform.current = staticmethod(lambda device=None: hopper)
    mxfx.ops.check_expert_ids = lambda ids, experts: None
    moe_sm90.runs_on = lambda device: True
    moe.hopper_fits = lambda x, weights: True
    moe._sync_buffer = lambda x: sync


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=1)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--host-only", action="store_true", help="CPU tensors, launches recorded, not run")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    gpu = torch.cuda.is_available() and not args.host_only
    E, H, I, k = SHAPE.num_experts, SHAPE.hidden_size, SHAPE.intermediate_size, SHAPE.top_k
    if not gpu:
        host_only()
        for name, fn in pieces(args.T, E, H, I, k, "cpu").items():
            print(f"{name:28s} {per_call_us(fn, args.calls, lambda: None):8.1f} µs host (launches not run)")
        plans = [p for p in moe._FUSED._plans.values() if not isinstance(p, str)]
        print(f"replayed from a plan: {bool(plans)}")
        return
    sync = torch.cuda.synchronize
    op = op_call(*problem(args.T, E, H, I, k, "cuda"))
    graph = torch.cuda.CUDAGraph()
    op()
    with torch.cuda.graph(graph):
        op()
    tiny = pieces(args.T, 8, 128, 128, 2, "cuda")
    rows = {}
    for fast in (False, True):
        launch.ENABLED = fast
        rows[f"eager, gpt-oss-120b T={args.T}"] = rows.get(f"eager, gpt-oss-120b T={args.T}", []) + [
            per_call_us(op, args.calls, sync)]
        for name, fn in tiny.items():
            rows[name] = rows.get(name, []) + [per_call_us(fn, args.calls, sync)]
    replay = per_call_us(graph.replay, args.calls, sync)
    eager = rows[f"eager, gpt-oss-120b T={args.T}"][1]
    # Serving stacks call the model under inference mode, where the op's Autograd kernel (a
    # Python layer here) is skipped.
    with torch.inference_mode():
        inference = per_call_us(op, args.calls, sync)
    print(f"CUDA graph replay, gpt-oss-120b T={args.T}: {replay:.1f} µs; eager - graph with fast "
          f"launches: {eager - replay:.1f} µs, under torch.inference_mode {inference - replay:.1f} µs "
          f"(the issue's budget: 60)")
    print(f"{'host µs (tiny shape below)':34s} {'Triton launch':>14s} {'fast launch':>12s}")
    for name, (slow, fast) in rows.items():
        print(f"{name:34s} {slow:14.1f} {fast:12.1f}")
    if args.profile:
        fn = tiny["torch.ops.mxfx.moe"]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        sync()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
