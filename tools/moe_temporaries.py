"""Device memory one MoE call allocates besides its output, as a multiple of its input's size.

    python tools/moe_temporaries.py [--model gpt-oss-120b] [--T 1 8 64 512 4096] [--backend triton]
    python tools/moe_temporaries.py --plan [--model ...] [--T ...] [--act-quant ...]

On a CUDA device: for each T, the peak allocated during one eager ``torch.ops.mxfx.moe`` call
(after a warm-up call, so compilation and launch plans are not counted) minus what was
allocated before it and minus its output, divided by the bytes of ``x [T, H]``. Issue 4 asks
for at most 2x.

``--plan`` (any machine): the same ratio by construction, for the fused backend on a Hopper GPU:
the workspace of the launch plan that :mod:`mxfx.kernels.replay` records for an eager call,
with the launches recorded on CPU, not run (the counters of its one-launch path at small T,
16 KB kept per device and stream, are no temporary and not counted).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mxfx.ops  # noqa: E402,F401  (registers torch.ops.mxfx)
from mxfx import bench  # noqa: E402
from mxfx.kernels import launch, moe, moe_sm90  # noqa: E402
from mxfx.kernels.replay import Replayer  # noqa: E402
from mxfx.moe_call import ActivationQuant, MoEWeights  # noqa: E402
from mxfx.oracle.shapes import SHAPES  # noqa: E402


def plan_ratio(model: str, T: int, act_quant: str) -> float:
    """Bytes of the replay plan's workspace for one fused call ÷ bytes of x (see ``--plan``)."""
    shape = SHAPES[model]
    E, H, I, k = shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.top_k
    u8, bf16 = torch.uint8, torch.bfloat16
    w = MoEWeights(torch.zeros(E, 2 * I, H // 2, dtype=u8), torch.zeros(E, 2 * I, H // 32, dtype=u8),
                   torch.zeros(E, 2 * I, dtype=bf16) if shape.has_bias else None,
                   torch.zeros(E, H, I // 2, dtype=u8), torch.zeros(E, H, I // 32, dtype=u8),
                   torch.zeros(E, H, dtype=bf16) if shape.has_bias else None)
    x = torch.zeros(T, H, dtype=bf16)
    ids = (torch.arange(T * k, dtype=torch.int32).reshape(T, k) * 37) % E  # k distinct experts per token
    tw = torch.ones(T, k, dtype=bf16)

    def record(self, grid, args, meta):
        launch.recorded().append((SimpleNamespace(name=self._kernel.__name__), grid, args,
                                  launch.key_and_call(0, args, meta)[1]))

    replayer = Replayer(moe._fused_moe)
    with mock.patch.object(launch.Launcher, "_launch", record), \
            mock.patch.object(launch, "direct_launches", lambda t: True), \
            mock.patch.object(torch.cuda, "current_device", lambda: 0), \
            mock.patch.object(moe_sm90, "runs_on", lambda device: True):
        replayer((x, tw, ids, w.w13, w.w13_scale, w.w13_bias, w.w2, w.w2_scale, w.w2_bias, moe._sync_buffer(x)),
                 (shape.activation, ActivationQuant(act_quant)))
    (plan,) = replayer._plans.values()
    if isinstance(plan, str):
        raise RuntimeError(f"no launch plan: {plan}")
    return plan.workspace / x.nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-oss-120b", choices=sorted(SHAPES))
    ap.add_argument("--T", type=int, nargs="*", default=[1, 8, 64, 512, 4096])
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--act-quant", default="none", choices=["none", "mxfp8", "mxfp4"])
    ap.add_argument("--plan", action="store_true", help="by construction, on CPU (fused backend, Hopper)")
    args = ap.parse_args()
    if args.plan:
        print(f"{args.model} triton (sm_90 launch code) A={args.act_quant}: replay workspace / bytes of x")
        for T in args.T:
            print(f"T={T:5d}  {plan_ratio(args.model, T, args.act_quant):5.1f}x")
        return
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
