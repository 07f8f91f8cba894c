"""Which transformers MoE families the mxfx lowering rewrites: tiny models, CPU, no downloads.

    python tools/survey_models.py                       # every family with experts modules
    python tools/survey_models.py qwen2_moe olmoe       # some families
    python tools/survey_models.py --quantize            # experts in MXFP4 first (mxfx.quantize_)

For each ``model_type`` whose modeling file uses transformers' experts implementations, a
model with tiny sizes is built from the config class's defaults (two layers; hybrid models as
many as it takes to hold each kind of layer once; a multimodal family's text decoder; an
encoder's base model), its weights drawn at random, and compiled with mxfx enabled
(``experts_implementation="grouped_mm"``). One row per family: experts modules, ``mxfx.moe``
calls in the generated code, the relative error of the logits (an encoder's last hidden state)
against eager, and the reasons of any layer left alone. An ``error`` row gives the last line of
what failed to build, run or compile the model. Each family runs in its own process.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Applied to the config (and its text decoder's) where the attribute exists.
SMALL = dict(
    hidden_size=64, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, top_k=2,
    top_k_experts=2, enable_moe_block=True, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, vocab_size=128, max_position_embeddings=256, pad_token_id=0,
    first_k_dense_replace=0, n_group=1, topk_group=1, decoder_sparse_step=1, mlp_only_layers=[],
    sliding_window=16, moe_layer_freq=1, num_dense_layers=0, mamba_n_heads=2, mamba_d_head=64,
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
)


def families() -> list[str]:
    import transformers

    models = Path(transformers.__file__).parent / "models"
    return sorted(
        f.parent.name for f in models.glob("*/modeling_*.py") if "use_experts_implementation" in f.read_text()
    )


def _set(cfg, values: dict) -> None:
    for name, value in values.items():
        try:
            if hasattr(cfg, name):
                setattr(cfg, name, value)
        except Exception:  # noqa: BLE001 - a config that derives or forbids it keeps its own
            pass


def _text(cfg):
    """A multimodal config's text decoder config (Qwen3-Omni's inside its thinker), or None."""
    thinker = getattr(cfg, "thinker_config", None)
    return getattr(cfg, "text_config", None) or getattr(thinker, "text_config", None)


def _small(cfg) -> None:
    for target in (cfg, _text(cfg)):
        if target is None:
            continue
        mla = getattr(target, "kv_lora_rank", None) is not None
        _set(target, SMALL)
        if getattr(target, "n_shared_experts", 0) is None:  # dots1's default: no model builds
            target.n_shared_experts = 1
        if hasattr(target, "layer_types") and target.layer_types is None:  # LFM2-MoE's default
            target.layer_types = ["full_attention"] * target.num_hidden_layers
        dims = dict(head_dim=SMALL["qk_rope_head_dim"] if mla else 32)
        if mla:  # keys and values per attention head
            dims["num_key_value_heads"] = target.num_attention_heads
        _set(target, dims)
        if target is not cfg and not mla:  # multimodal decoders fix their rope sections for 128
            target.head_dim = 128
        types = list(getattr(target, "layer_types", None) or [])
        if types:  # hybrid models: enough layers for one of each kind
            n = max(2, max(types.index(t) for t in set(types)) + 1)
            try:
                target.num_hidden_layers, target.layer_types = n, types[:n]
            except (AttributeError, TypeError, ValueError):
                pass
        if hasattr(target, "mlp_layer_types"):  # dense first layers (DeepSeek-V3.2) or None (OCR 2)
            target.mlp_layer_types = ["sparse"] * target.num_hidden_layers
        rope = getattr(target, "rope_parameters", None)
        if mla and isinstance(rope, dict) and rope.get("partial_rotary_factor"):
            # Mistral 4: heads are nope + rope wide, and the rope's width derives from head_dim.
            target.head_dim = int(target.qk_rope_head_dim / rope["partial_rotary_factor"])


def _build(cfg):
    """The model to compile: a causal LM where the config has one, else the text decoder of a
    multimodal config (its vision towers at their default sizes would not fit), else the base
    model (encoders)."""
    import importlib

    from transformers import AutoModel, AutoModelForCausalLM, PreTrainedModel

    kw = dict(experts_implementation="grouped_mm")
    try:
        return AutoModelForCausalLM.from_config(cfg, **kw)
    except ValueError:  # no causal LM for this config
        pass
    text = _text(cfg)
    if text is None:
        return AutoModel.from_config(cfg, **kw)
    module = importlib.import_module(type(text).__module__.replace(".configuration_", ".modeling_"))
    classes = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, PreTrainedModel)
               and getattr(c, "config_class", None) is type(text)
               and not c.__name__.endswith("PreTrainedModel")]
    classes.sort(key=lambda c: not c.__name__.endswith("ForCausalLM"))
    if not classes:
        raise ValueError(f"no model class in {module.__name__} takes {type(text).__name__}")
    return classes[0]._from_config(text, **kw)


def _output(out):
    return (out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state).double()


def one(model_type: str, quantize: bool) -> dict:
    import torch
    from torch import nn
    from torch._inductor.utils import run_and_get_code
    from transformers import AutoConfig

    import mxfx
    from mxfx import lowering

    cfg = AutoConfig.for_model(model_type)
    _small(cfg)
    torch.manual_seed(0)
    model = _build(cfg).eval()
    for p in model.parameters():
        nn.init.normal_(p, std=0.2)
    if quantize:
        mxfx.quantize_(model)
    experts = sum(type(m).__name__.endswith("Experts") for m in model.modules())
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    lowering.clear()
    # No cache: a hybrid model cut to a few layers may have no attention layer to size one by.
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        ref = _output(model(ids, use_cache=False))
        with mxfx.enabled():
            out, code = run_and_get_code(torch.compile(model), ids, use_cache=False)
    code = "\n".join(code)
    err = ((_output(out) - ref).norm() / ref.norm()).item()
    return dict(
        experts=experts, moe_calls=code.count("torch.ops.mxfx.moe.default("), error=f"{err:.1e}",
        left=sorted({r.reason for r in lowering.report() if not r.rewritten}),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("families", nargs="*", help="model_type names (default: every MoE family)")
    ap.add_argument("--quantize", action="store_true", help="mxfx.quantize_ the experts first")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=int, default=600, help="seconds per family")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.quantize)))
        return
    for name in args.families or families():
        cmd = [sys.executable, __file__, "--one", name] + (["--quantize"] if args.quantize else [])
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
            lines = run.stdout.strip().splitlines()
            row = json.loads(lines[-1]) if run.returncode == 0 and lines else None
            why = (run.stderr.strip().splitlines() or ["no output"])[-1]
        except subprocess.TimeoutExpired:
            row, why = None, f"timed out after {args.timeout} s"
        if row is None:
            print(f"{name:22s} error: {why[:110]}", flush=True)
        else:
            left = f"  left: {'; '.join(row['left'])}" if row["left"] else ""
            print(f"{name:22s} experts {row['experts']}  mxfx.moe {row['moe_calls']}  "
                  f"error {row['error']}{left}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
