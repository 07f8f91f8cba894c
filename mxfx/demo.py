"""``python -m mxfx demo``: a small transformers MoE model, quantized to MXFP4, compiled with mxfx.

Builds the model from an embedded config (no downloads), runs ``mxfx.quantize_`` on it, and
compares three runs of the same MXFP4 model on the same tokens: eager, ``torch.compile``
without mxfx, and ``torch.compile`` with mxfx's lowering pass. Prints the oracle's decision,
what the lowering rewrote, the compiled-with-mxfx error against eager, and the times.
Progress goes to stderr; ``--json`` prints one JSON object on stdout.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from typing import Any, Callable

import torch

# Two decoder layers, so the lowering has more than one MoE block to find; sizes are
# multiples of 32 (MXFP4 blocks) and small enough that the CPU demo stays well under a minute.
_ATTN = dict(
    vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
)
MODELS: dict[str, tuple[str, str, dict]] = {
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        _ATTN, intermediate_size=128, num_local_experts=8, num_experts_per_tok=4,
        sliding_window=64, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
    )),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _ATTN, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
        num_experts_per_tok=2,
    )),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        _ATTN, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
    )),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt-oss",
                        help="built-in model shape (default: gpt-oss)")
    parser.add_argument("--device", default=None,
                        help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="model dtype (default: bfloat16 on GPUs, float32 on CPU)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per forward (default: 32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per variant (default: 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


class _Progress:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[mxfx demo {time.perf_counter() - self.start:6.1f}s] {message}", file=sys.stderr, flush=True)


def build_model(
    name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **overrides
) -> torch.nn.Module:
    """The built-in model ``name`` (see :data:`MODELS`) with config fields ``overrides``,
    randomly initialised from seed 0, in eval mode."""
    try:
        import transformers
    except ImportError:
        raise SystemExit(
            "python -m mxfx demo builds a transformers model: pip install 'mxfx[hf]'"
        ) from None
    config_cls, model_cls, kwargs = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**kwargs, **overrides})
    return getattr(transformers, model_cls)(config).to(device=device, dtype=dtype).eval()


def _timed(fn: Callable[[], torch.Tensor], device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn`` in milliseconds, after one warm-up run."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@contextlib.contextmanager
def _no_compile_caches():
    """Compile for real: a graph served from Inductor's caches skips the lowering pass, and the
    demo is there to show what the pass does."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False):
        with functorch_config.patch(enable_autograd_cache=False):
            yield


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the demo; returns the results (what ``--json`` prints)."""
    import mxfx
    import mxfx.lowering

    progress = _Progress()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _DTYPES[args.dtype] if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    progress(f"building {args.model} ({dtype}) on {device}")
    model = build_model(args.model, device, dtype)
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, model.config.vocab_size, (1, args.tokens), device=device)

    quantized = mxfx.quantize_(model)
    progress(str(quantized))
    layer = next(m for m in model.modules() if isinstance(m, mxfx.nn.MXFP4Experts))
    decision = mxfx.explain(layer.moe_config())

    def logits(m: torch.nn.Module) -> Callable[[], torch.Tensor]:
        return lambda: m(tokens).logits

    with torch.no_grad():
        progress("eager run (dequantizes the weights on every call)")
        eager = logits(model)()
        float_out = logits(reference)()
        del reference
        compiled_s: dict[str, float] = {}
        torch._dynamo.reset()
        progress("compiling without mxfx ...")
        t0 = time.perf_counter()
        plain = torch.compile(model)
        logits(plain)()
        compiled_s["compiled"] = time.perf_counter() - t0
        progress(f"compiled without mxfx in {compiled_s['compiled']:.1f}s")

        torch._dynamo.reset()
        mxfx.lowering.clear()
        progress("compiling with mxfx ...")
        t0 = time.perf_counter()
        with _no_compile_caches():
            fast = torch.compile(model, options=mxfx.inductor_options())
            out = logits(fast)()
        compiled_s["compiled_mxfx"] = time.perf_counter() - t0
        records = mxfx.lowering.report()
        progress(f"compiled with mxfx in {compiled_s['compiled_mxfx']:.1f}s")

        progress("timing")
        time_ms = {
            "eager": _timed(logits(model), device, args.repeats),
            "compiled": _timed(logits(plain), device, args.repeats),
            "compiled_mxfx": _timed(logits(fast), device, args.repeats),
        }
    diff = out.float() - eager.float()
    return dict(
        model=args.model,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        tokens=args.tokens,
        layer=str(layer.moe_config()),
        quantize=dict(
            layers=len(quantized.layers),
            bytes_before=quantized.bytes_before,
            bytes_after=quantized.bytes_after,
            ratio=quantized.bytes_after / quantized.bytes_before,
        ),
        decision=dict(
            backend=decision.backend,
            rejected=[list(r) for r in decision.rejected],
            table=str(decision),
        ),
        lowering=dict(
            rewrites=sum(r.rewritten for r in records),
            moe_rewrites=sum(r.rewritten and r.form != "gated_activation" for r in records),
            records=[str(r) for r in records],
        ),
        error=dict(
            max_abs=diff.abs().max().item(),
            rel=(diff.norm() / eager.float().norm()).item(),
        ),
        mxfp4_vs_float_rel=((eager.float() - float_out.float()).norm() / float_out.float().norm()).item(),
        compile_s=compiled_s,
        time_ms=time_ms,
    )


def render(r: dict[str, Any]) -> str:
    """The results of :func:`run` as text."""
    q, e, t, low = r["quantize"], r["error"], r["time_ms"], r["lowering"]
    mib = 1 << 20
    lines = [
        f"mxfx demo: {r['model']} ({r['dtype']}, {r['tokens']} tokens) on {r['device']}",
        f"MoE layer: {r['layer']}",
        f"experts: {q['layers']} modules, {q['bytes_before'] / mib:.2f} MiB -> "
        f"{q['bytes_after'] / mib:.2f} MiB ({q['ratio']:.1%})",
        "",
        "oracle decision:",
        r["decision"]["table"],
        "",
        f"lowering: {low['rewrites']} rewrites ({low['moe_rewrites']} MoE blocks)",
        *(f"  {rec}" for rec in low["records"]),
        "",
        f"compiled with mxfx vs eager (same MXFP4 weights): max abs {e['max_abs']:.3g}, "
        f"relative {e['rel']:.3g}",
        f"MXFP4 model vs the {r['dtype']} model it was quantized from: "
        f"relative {r['mxfp4_vs_float_rel']:.3g}",
        "",
        f"{'variant':<28}{'time / forward':>16}{'compile':>10}",
        f"{'eager':<28}{t['eager']:>13.2f} ms{'':>10}",
        f"{'torch.compile':<28}{t['compiled']:>13.2f} ms{r['compile_s']['compiled']:>9.1f}s",
        f"{'torch.compile + mxfx':<28}{t['compiled_mxfx']:>13.2f} ms{r['compile_s']['compiled_mxfx']:>9.1f}s",
    ]
    if r["device"] == "cpu":
        lines.append("(CPU runs mxfx's emulation backend, the reference; speed is measured on GPUs)")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.tokens < 1 or args.repeats < 1:
        raise SystemExit(f"--tokens and --repeats must be >= 1, got {args.tokens} and {args.repeats}")
    results = run(args)
    print(json.dumps(results, indent=2) if args.json else render(results))
    return 0
