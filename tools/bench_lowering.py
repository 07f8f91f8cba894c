"""What the lowering buys: a gpt-oss-120b-shaped experts layer under ``torch.compile``,
without and with mxfx.

    python tools/bench_lowering.py                  # E=128 H=I=2880 top-4, T = 1, 64, 4096
    python tools/bench_lowering.py --quick          # tiny shape, any device: a smoke test

Rows, each the same transformers 5.x ``GptOssExperts`` (``grouped_mm``) module compiled with
``torch.compile(dynamic=False)``:
- ``baseline``: bf16 weights, plain Inductor;
- ``mxfx bf16``: bf16 weights, mxfx enabled (the lowering rewrites to one ``mxfx.moe``);
- ``mxfx mxfp4``: weights in MXFP4 storage (``mxfx.nn.experts.to_mxfp4``, read through
  ``dequantize_mx``), mxfx enabled (``mxfx.moe`` on the packed weights).
Times are the median of CUDA-event-timed calls (µs); speedup is against ``baseline``; the
error is each variant's relative error against the same module run eagerly.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import mxfx  # noqa: E402
from mxfx import lowering  # noqa: E402
from mxfx.nn.experts import to_mxfp4  # noqa: E402


def build(experts: int, hidden: int, intermediate: int, device: str):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_local_experts=experts,
        experts_implementation="grouped_mm",
    )
    torch.manual_seed(0)
    with torch.device(device):
        m = GptOssExperts(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(std=0.02)
    return m.to(torch.bfloat16).eval()


def quantized(m):
    q = copy.deepcopy(m)
    packed = []
    for w in (q.gate_up_proj.detach(), q.down_proj.detach()):  # [E, K, N] → canonical [E, N, K]
        packed += torch.ops.mxfx.quantize_mx(w.transpose(1, 2).contiguous(), "mxfp4", "round_up")
    return to_mxfp4(q, *packed)


def inputs(t: int, m, top_k: int, device: str):
    g = torch.Generator(device=device).manual_seed(t)
    x = torch.randn(t, m.hidden_size, generator=g, device=device, dtype=torch.bfloat16)
    logits = torch.randn(t, m.num_experts, generator=g, device=device)
    vals, ids = torch.topk(logits, top_k, dim=-1)
    return x, ids, torch.softmax(vals, dim=-1).to(torch.bfloat16)


def timed(fn, args, iters: int) -> float:
    """Median µs per call (CUDA events on GPU, wall clock elsewhere)."""
    for _ in range(3):
        fn(*args)
    samples = []
    if torch.cuda.is_available():
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
    else:
        import time

        for _ in range(iters):
            t0 = time.perf_counter()
            fn(*args)
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--intermediate", type=int, default=2880)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 4096])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="E=8 H=I=256 top-2, T=1,16; a smoke test")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\._dynamo.*")
    if args.quick:
        args.experts, args.hidden, args.intermediate, args.top_k = 8, 256, 256, 2
        args.tokens, args.iters = [1, 16], 5
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = build(args.experts, args.hidden, args.intermediate, device)
    variants = {"baseline": (base, False), "mxfx bf16": (base, True), "mxfx mxfp4": (quantized(base), True)}
    print(
        f"# GptOssExperts E={args.experts} H={args.hidden} I={args.intermediate} top-{args.top_k} "
        f"bf16, torch {torch.__version__}, {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}"
    )
    print(f"{'T':>6} | {'variant':<11} | {'µs':>9} | {'speedup':>7} | {'rel err':>8} | backend")
    print("-" * 70)
    for t in args.tokens:
        x, ids, w = inputs(t, base, args.top_k, device)
        base_us = None
        for name, (module, use_mxfx) in variants.items():
            torch._dynamo.reset()
            lowering.clear()
            fn = torch.compile(module, dynamic=False, options=mxfx.inductor_options() if use_mxfx else None)
            # No FX graph cache: a cache hit skips the pass, and the report would be empty.
            with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
                ref = module(x, ids, w).float()
                out = fn(x, ids, w)
                us = timed(fn, (x, ids, w), args.iters)
            backends = sorted({r.backend for r in lowering.report() if r.backend})
            skipped = [r.reason for r in lowering.report() if not r.rewritten and r.form != "gated_activation"]
            base_us = base_us or us
            err = ((out.float() - ref).norm() / ref.norm()).item()
            backend = ",".join(backends) or ("left as written: " + skipped[0] if skipped else "-")
            print(f"{t:>6} | {name:<11} | {us:>9.1f} | {base_us / us:>6.2f}x | {err:>8.1e} | {backend}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
