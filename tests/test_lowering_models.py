"""The lowering on real clients: tiny transformers models and hand-written MoE forms, compiled
with mxfx enabled. Each must give eager's output, hold one ``mxfx.moe`` per MoE layer and no
expert matmul (grouped, batched or gathered) any more."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.utils import run_and_get_code

import mxfx
from mxfx import backends, lowering

H, I, E, K = 64, 32, 4, 2


def compiled(model, *args, dynamic_dim=None):
    """(eager output, compiled output, generated code) with mxfx enabled; the report is cleared
    first and the FX graph cache is off, so the pass runs and reports."""
    torch._dynamo.reset()
    lowering.clear()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        ref = model(*args)
        if dynamic_dim is not None:
            torch._dynamo.mark_dynamic(args[0], dynamic_dim)
        with mxfx.enabled():
            out, code = run_and_get_code(torch.compile(model), *args)
    return ref, out, "\n".join(code)


def first(out):
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, tuple) else out


def rel_err(out, ref) -> float:
    out, ref = first(out).double(), first(ref).double()
    return ((out - ref).norm() / ref.norm()).item()


def moe_calls(code: str) -> int:
    return code.count("= torch.ops.mxfx.moe.default(")


def assert_rewritten(code: str, layers: int, form: str, whole_model: bool = False) -> None:
    """``layers`` mxfx.moe calls on the emulation backend (the CPU's), no grouped matmul, and
    for a MoE block (no attention, whose bmm stays) no bmm at all."""
    assert moe_calls(code) == layers
    assert "grouped_mm" not in code
    if not whole_model:
        assert "bmm" not in code
    moe_records = [r for r in lowering.report() if r.form == form]
    assert len(moe_records) == layers and all(r.rewritten and r.backend == "emulation" for r in moe_records)


def randomize(model: nn.Module, std: float = 0.2) -> nn.Module:
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p, std=std)
    return model.eval()


# ----------------------------------------------------------------------------- transformers


def gpt_oss(layers: int = 2, impl: str = "grouped_mm"):
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        vocab_size=128, layer_types=["sliding_attention", "full_attention"][:layers],
        sliding_window=16, experts_implementation=impl,
    )
    return randomize(GptOssForCausalLM(cfg))


def qwen3_moe(impl: str = "grouped_mm"):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=I, intermediate_size=I, num_experts=E,
        num_experts_per_tok=K, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=128, experts_implementation=impl,
    )
    return randomize(Qwen3MoeForCausalLM(cfg))


def mixtral(impl: str = "grouped_mm"):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        vocab_size=128, experts_implementation=impl,
    )
    return randomize(MixtralForCausalLM(cfg))


def deepseek_v3():
    """A shared expert beside the routed ones, sigmoid scores with a correction bias, MLA."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        hidden_size=H, moe_intermediate_size=I, intermediate_size=2 * I, n_routed_experts=E,
        num_experts_per_tok=K, n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None,
        kv_lora_rank=16, head_dim=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        vocab_size=128,
    )
    return randomize(DeepseekV3ForCausalLM(cfg))


def tokens(n: int = 9) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(1))


def test_gpt_oss_two_layers_grouped_mm():
    ref, out, code = compiled(gpt_oss(2), tokens())
    assert rel_err(out, ref) < 1e-5
    assert_rewritten(code, layers=2, form="grouped_mm", whole_model=True)


def test_gpt_oss_generate_compiled_gives_eager_tokens(monkeypatch):
    """transformers' ``generate`` (greedy, KV cache, a batch of two) on MXFP4 experts with the
    forward compiled: the prefill and the one-token decode steps, whose shapes recompile, each
    run ``mxfx.moe``, and the tokens and logits are eager's."""
    model = gpt_oss(2)
    mxfx.quantize_(model)
    prompt = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    backend = backends.get("emulation")
    run, tokens_run = backend.run, []

    def counted(x, *args, **kwargs):
        tokens_run.append(x.shape[0])
        return run(x, *args, **kwargs)

    monkeypatch.setattr(backend, "run", counted)
    torch._dynamo.reset()
    lowering.clear()
    greedy = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        ref = model.generate(prompt, **greedy)
        tokens_run.clear()
        model.forward = torch.compile(model.forward)
        with mxfx.enabled():
            out = model.generate(prompt, **greedy)
    assert torch.equal(out.sequences, ref.sequences)
    assert max(rel_err(o, r) for o, r in zip(out.logits, ref.logits)) < 1e-5
    assert tokens_run == [18] * 2 + [2] * 2 * 4  # two layers: the prompt, then four decode steps
    moe_records = [r for r in lowering.report() if r.form == "grouped_mm"]
    assert moe_records and all(r.rewritten and r.backend == "emulation" for r in moe_records)


def test_qwen3_moe_grouped_mm():
    ref, out, code = compiled(qwen3_moe(), tokens())
    assert rel_err(out, ref) < 1e-5
    assert_rewritten(code, layers=1, form="grouped_mm", whole_model=True)


def test_deepseek_v3_grouped_mm():
    ref, out, code = compiled(deepseek_v3(), tokens())
    assert rel_err(out, ref) < 1e-5
    assert_rewritten(code, layers=1, form="grouped_mm", whole_model=True)


def test_mixtral_grouped_mm_bf16():
    # bf16 takes aten._grouped_mm (fp32 takes transformers' grouped_mm_fallback op).
    ref, out, code = compiled(mixtral().to(torch.bfloat16), tokens())
    assert rel_err(out, ref) < 1e-2
    assert_rewritten(code, layers=1, form="grouped_mm", whole_model=True)


# ----------------------------------------------------------------------------- experts blocks


def gpt_oss_block(impl: str, dtype=torch.float32):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                       num_experts_per_tok=K, experts_implementation=impl)
    return randomize(GptOssMLP(cfg)).to(dtype)


def qwen_block(impl: str, dtype=torch.float32):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                         num_experts_per_tok=K, experts_implementation=impl)
    return randomize(Qwen3MoeSparseMoeBlock(cfg)).to(dtype)


def minimax_m3_block():
    """SWIGLUOAI_UNINTERLEAVE (the gpt-oss formula on halves), sigmoid routing, a shared expert."""
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLSparseMoeBlock

    cfg = MiniMaxM3VLTextConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K,
                                shared_intermediate_size=I, swiglu_alpha=1.702, swiglu_limit=7.0,
                                experts_implementation="grouped_mm")
    return randomize(MiniMaxM3VLSparseMoeBlock(cfg))


def hidden(t: int = 7, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(1, t, H, generator=torch.Generator().manual_seed(2)).to(dtype)


def test_minimax_m3_block_grouped_mm():
    ref, out, code = compiled(minimax_m3_block(), hidden())
    assert rel_err(out, ref) < 1e-5
    assert_rewritten(code, layers=1, form="grouped_mm")
    moe = [r for r in lowering.report() if r.form == "grouped_mm"]
    assert "halves alpha=1.702 beta=1 limit=7 " in moe[0].detail


@pytest.mark.parametrize("block", [gpt_oss_block, qwen_block])
def test_batched_mm_experts(block):
    ref, out, code = compiled(block("batched_mm"), hidden())
    assert rel_err(out, ref) < 1e-5
    assert_rewritten(code, layers=1, form="batched_mm")


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_expert_parallel_sentinel_ids(impl):
    """Ids >= E (slots owned by another rank): grouped_mm drops them, batched_mm clamps them;
    the rewritten layer does the same."""
    experts = gpt_oss_block(impl).experts
    x = hidden(6)[0]
    ids = torch.tensor([[0, E], [1, 2], [E, 3], [2, 0], [3, 1], [E, E]])
    weights = torch.rand(6, K, generator=torch.Generator().manual_seed(3))
    ref, out, code = compiled(experts, x, ids, weights)
    assert rel_err(out, ref) < 1e-5
    assert_rewritten(code, layers=1, form=impl)


def quantize_experts(block: nn.Module, transposed: bool) -> nn.Module:
    """mxfx.nn's MXFP4 storage: the experts read their weights through ``dequantize_mx``."""
    from mxfx.nn.experts import to_mxfp4

    ex = block.experts
    packed = []
    for w in (ex.gate_up_proj.detach(), ex.down_proj.detach()):
        w = w.transpose(1, 2) if transposed else w
        packed += torch.ops.mxfx.quantize_mx(w.contiguous(), "mxfp4", "round_up")
    to_mxfp4(ex, *packed)
    return block


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_mxfp4_experts_use_the_packed_weights(impl):
    block = quantize_experts(gpt_oss_block(impl, torch.bfloat16), transposed=True)
    ref, out, code = compiled(block, hidden(dtype=torch.bfloat16))
    assert rel_err(out, ref) < 1e-2
    assert_rewritten(code, layers=1, form=impl)
    assert "dequantize_mx" not in code  # no float copy of the weights is made
    assert "W=mxfp4" in next(r.detail for r in lowering.report() if r.form == impl)


def test_activation_quantized_experts_get_their_backend_at_compile_time(monkeypatch):
    """mxfx.nn's W4A8 experts call mxfx.moe(backend="auto") themselves; the pass pins it, with
    the backend the oracle picks for exactly that layer (MXFP4 weights, MXFP8 activations,
    biases)."""
    from mxfx.lowering import moe

    configs, select = [], moe.select
    monkeypatch.setattr(moe, "select", lambda config, platform: configs.append(config) or select(config, platform))
    block = gpt_oss_block("grouped_mm")
    ex = block.experts
    packed = []
    for w in (ex.gate_up_proj.detach(), ex.down_proj.detach()):
        packed += torch.ops.mxfx.quantize_mx(w.transpose(1, 2).contiguous(), "mxfp4", "round_up")
    from mxfx.nn.experts import to_mxfp4

    to_mxfp4(ex, *packed, activation_quant="mxfp8")
    ex.mxfx_activation = mxfx.activation.GPT_OSS
    ref, out, code = compiled(block, hidden())
    assert rel_err(out, ref) < 1e-5
    (call,) = [line for line in code.splitlines() if "= torch.ops.mxfx.moe.default(" in line]
    assert "'mxfp8'" in call and "'emulation'" in call and "'auto'" not in call
    (pinned,) = [r for r in lowering.report() if r.form == "pinned"]
    assert pinned.rewritten and pinned.backend == "emulation"
    (config,) = configs
    assert (config.weight_quant, config.activation_quant, config.has_bias) == ("mxfp4", "mxfp8", True)


def test_dynamic_tokens_do_not_recompile():
    from torch._dynamo.utils import counters

    block = qwen_block("grouped_mm")
    torch._dynamo.reset()
    counters.clear()
    # T=1 is left out: dynamo specialises sizes 0 and 1 by design.
    xs = [hidden(t) for t in (5, 3, 11, 64)]
    torch._dynamo.mark_dynamic(xs[0], 1)
    with torch.no_grad(), mxfx.enabled(), torch._inductor.config.patch(fx_graph_cache=False):
        fn = torch.compile(block)
        for x in xs:
            assert rel_err(fn(x), block(x)) < 1e-5
    assert counters["stats"]["unique_graphs"] == 1
    assert len([r for r in lowering.report() if r.form == "grouped_mm" and r.rewritten]) >= 1


def test_second_compile_hits_the_fx_graph_cache():
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    block, x = qwen_block("grouped_mm"), hidden()
    with torch.no_grad(), fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True), mxfx.enabled():
        counters.clear()
        for _ in range(2):
            torch._dynamo.reset()
            _, code = run_and_get_code(torch.compile(block), x)
            assert moe_calls("\n".join(code)) == 1
        assert rel_err(torch.compile(block)(x), block(x)) < 1e-5
    assert counters["inductor"]["fxgraph_cache_miss"] == 1
    assert counters["inductor"]["fxgraph_cache_hit"] == 1


# ----------------------------------------------------------------------------- written here


class DenseBmmExperts(nn.Module):
    """transformers 4.x ``GptOssExperts`` training path: every token through every expert."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * I))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * I))
        self.down_proj = nn.Parameter(torch.empty(E, I, H))
        self.down_proj_bias = nn.Parameter(torch.empty(E, H))
        self.alpha, self.limit = 1.702, 7.0

    def forward(self, hidden_states, routing_weights):
        batch_size = hidden_states.shape[0]
        hidden_states = hidden_states.reshape(-1, H)
        num_experts = routing_weights.shape[1]
        hidden_states = hidden_states.repeat(num_experts, 1).view(num_experts, -1, H)
        gate_up = torch.bmm(hidden_states, self.gate_up_proj) + self.gate_up_proj_bias[..., None, :]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        next_states = torch.bmm(((up + 1) * glu), self.down_proj)
        next_states = next_states + self.down_proj_bias[..., None, :]
        next_states = next_states.view(num_experts, batch_size, -1, H)
        next_states = next_states * routing_weights.transpose(0, 1).view(num_experts, batch_size, -1)[..., None]
        return next_states.sum(dim=0)


class DenseMoE(nn.Module):
    def __init__(self, top_k: int = K):
        super().__init__()
        self.router = nn.Linear(H, E)
        self.experts = DenseBmmExperts()
        self.top_k = top_k

    def forward(self, x):
        logits = self.router(x.reshape(-1, H))
        if self.top_k == E:  # dense routing: every expert, softmax weights
            return self.experts(x, F.softmax(logits, dim=-1))
        top_v, top_i = torch.topk(logits, self.top_k, dim=-1)
        top_v = F.softmax(top_v, dim=1, dtype=top_v.dtype)
        return self.experts(x, torch.zeros_like(logits).scatter_(1, top_i, top_v))


class GptFastMoE(nn.Module):
    """gpt-fast's ``MOEFeedForward``: per-token weight gathers, einsums, separate w1/w3."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, I, H))
        self.w2 = nn.Parameter(torch.empty(E, H, I))
        self.w3 = nn.Parameter(torch.empty(E, I, H))

    def forward(self, x):
        x = x.view(-1, H)
        expert_weights = F.softmax(self.gate(x), dim=-1)
        expert_weights, expert_indices = torch.topk(expert_weights, K, dim=-1)
        expert_weights /= expert_weights.sum(dim=-1, keepdim=True)
        w1, w3, w2 = self.w1[expert_indices], self.w3[expert_indices], self.w2[expert_indices]
        x1 = F.silu(torch.einsum("ti,taoi -> tao", x, w1))
        x3 = torch.einsum("ti, taoi -> tao", x, w3)
        expert_outs = torch.einsum("tao, taio -> tai", (x1 * x3), w2)
        return torch.einsum("tai,ta -> ti", expert_outs, expert_weights)


@pytest.mark.parametrize("top_k", [K, E])
def test_dense_bmm_moe(top_k):
    ref, out, code = compiled(randomize(DenseMoE(top_k)), hidden())
    assert rel_err(out, ref) < 1e-5
    assert_rewritten(code, layers=1, form="dense_bmm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_fast_moe(dtype):
    x = hidden(dtype=dtype)
    ref, out, code = compiled(randomize(GptFastMoE()).to(dtype), x, dynamic_dim=1)
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert_rewritten(code, layers=1, form="gather_einsum")


@pytest.mark.parametrize(
    "build, form",
    [
        (lambda: qwen_block("grouped_mm"), "grouped_mm"),
        (lambda: qwen_block("batched_mm"), "batched_mm"),
        (lambda: randomize(DenseMoE()), "dense_bmm"),
        (lambda: randomize(GptFastMoE()), "gather_einsum"),
    ],
    ids=["grouped_mm", "batched_mm", "dense_bmm", "gather_einsum"],
)
def test_one_token_decode(build, form):
    """T=1 (static, as in decoding): size-1 token axes vanish from Inductor's views."""
    ref, out, code = compiled(build(), hidden(1))
    assert rel_err(out, ref) < 1e-5
    assert_rewritten(code, layers=1, form=form)


# ----------------------------------------------------------------------------- activation QDQ


def qdq(t, fmt):
    return torch.ops.mxfx.dequantize_mx(*torch.ops.mxfx.quantize_mx(t, fmt, "even"), fmt, t.dtype)


class QuantizedActivationMoE(nn.Module):
    """A W4A4/W4A8-style experts block written as a model would: each expert GEMM input is
    quantize-dequantized (the tokens entering the experts, the activation before ``w2``)."""

    def __init__(self, fmt_in, fmt_mid):
        super().__init__()
        self.block = qwen_block("grouped_mm")
        experts = self.block.experts
        apply_gate, forward = type(experts)._apply_gate, experts.forward

        def quantized_apply_gate(gate_up):
            h = apply_gate(experts, gate_up)
            return qdq(h, fmt_mid) if fmt_mid else h

        def quantized_forward(hidden_states, *args):
            return forward(qdq(hidden_states, fmt_in) if fmt_in else hidden_states, *args)

        experts._apply_gate = quantized_apply_gate
        experts.forward = quantized_forward

    def forward(self, x):
        return self.block(x)


def test_activation_quantization_is_recognised():
    ref, out, code = compiled(QuantizedActivationMoE("mxfp8", "mxfp8"), hidden())
    assert rel_err(out, ref) < 1e-5
    assert_rewritten(code, layers=1, form="grouped_mm")
    assert "'mxfp8', 'emulation', 'even'" in code
    assert "quantize_mx" not in code


@pytest.mark.parametrize("fmts", [("mxfp8", None), ("mxfp8", "mxfp4")])
def test_mismatched_activation_quantization_is_left_alone(fmts):
    ref, out, code = compiled(QuantizedActivationMoE(*fmts), hidden())
    assert rel_err(out, ref) < 1e-5
    assert moe_calls(code) == 0
    (skip,) = [r for r in lowering.report() if r.form == "grouped_mm"]
    assert not skip.rewritten and "quantized differently" in skip.reason


def test_no_backend_leaves_the_layer_and_says_why(monkeypatch):
    from mxfx.lowering import moe
    from mxfx.oracle import NoBackendError

    def refuse(config, platform):
        raise NoBackendError(config, platform, "auto", "auto", [("emulation", "simulated refusal")])

    monkeypatch.setattr(moe, "select", refuse)
    ref, out, code = compiled(qwen_block("grouped_mm"), hidden())
    assert rel_err(out, ref) < 1e-5
    assert moe_calls(code) == 0 and "grouped_mm" in code
    (skip,) = [r for r in lowering.report() if r.form == "grouped_mm"]
    assert not skip.rewritten and "simulated refusal" in skip.reason


# ----------------------------------------------------------------------------- left alone, said why


def nemotron_h_block():
    """ReLU² MLP experts (no gate) and a shared expert, as Nemotron-H writes them."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    cfg = NemotronHConfig(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
                          n_shared_experts=1, moe_shared_expert_intermediate_size=I,
                          experts_implementation="grouped_mm")
    return randomize(NemotronHMoE(cfg))


def geglu_block(impl: str):
    """Qwen3-MoE experts gated by GELU (tanh), not SiLU."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                         experts_implementation=impl, hidden_act="gelu_pytorch_tanh")
    return randomize(Qwen3MoeSparseMoeBlock(cfg))


@pytest.mark.parametrize("build, form, ops", [
    (nemotron_h_block, "grouped_mm", "pow, relu"),
    (lambda: geglu_block("grouped_mm"), "grouped_mm", "tanh"),
    (lambda: geglu_block("batched_mm"), "gathered_bmm", "tanh"),
])
def test_experts_mxfx_cannot_compute_are_left_and_reported(build, form, ops):
    """Experts whose activation is not gated SwiGLU keep their GEMMs, and the report says so,
    naming the ops between the GEMMs."""
    ref, out, code = compiled(build(), hidden())
    assert rel_err(out, ref) < 1e-5
    assert moe_calls(code) == 0
    (left,) = [r for r in lowering.report() if r.form == form]
    assert not left.rewritten and left.detail == f"2 expert GEMMs, E={E}"
    assert "no gated activation mxfx knows" in left.reason and ops in left.reason


class MaxOverSlots(nn.Module):
    """SiLU-and-mul experts on gathered weights whose slots are combined by a max, not a sum:
    no form matches (mxfx.moe sums the slots)."""

    def __init__(self):
        super().__init__()
        self.w13 = nn.Parameter(torch.randn(E, 2 * I, H) / H**0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) / I**0.5)

    def forward(self, x, ids, weights):
        flat = ids.reshape(-1)
        h = torch.bmm(self.w13[flat], x.repeat_interleave(K, 0)[..., None]).squeeze(-1)
        a = F.silu(h[:, :I]) * h[:, I:]
        y = torch.bmm(self.w2[flat], a[..., None]).squeeze(-1)
        return (y * weights.reshape(-1, 1)).view(-1, K, H).amax(1)


def test_gated_experts_in_an_unknown_form_are_reported():
    x = hidden(6)[0]
    ids = torch.randint(0, E, (6, K), generator=torch.Generator().manual_seed(4))
    ref, out, code = compiled(MaxOverSlots().eval(), x, ids, torch.rand(6, K))
    assert rel_err(out, ref) < 1e-5 and moe_calls(code) == 0
    (left,) = [r for r in lowering.report() if r.form == "gathered_bmm"]
    assert not left.rewritten and "not written in a form mxfx rewrites" in left.reason


def _relu2_layer(x, ids, w1, w2, scale):
    h = torch.bmm(x[:, None], w1[ids]).squeeze(1).relu() ** 2
    return torch.bmm(h[:, None], w2[ids]).squeeze(1) * scale


def _relu2_backward(x, ids, w1, w2, tangents_1):
    return _relu2_layer(x, ids, w1, w2, tangents_1)


def _one_gemm(x, ids, w1, w2, scale):
    return torch.bmm(x[:, None], w1[ids]).squeeze(1) * scale[:, :I]


@pytest.mark.parametrize("fn, reason", [
    (_relu2_layer, "the ops there: pow, relu"),
    (_one_gemm, "one expert GEMM alone"),
    (_relu2_backward, None),
])
def test_leftover_expert_gemms_of_a_graph(fn, reason):
    """Expert GEMMs on gathered weights are recorded with the reason; a graph with
    AOTAutograd's gradient inputs (``tangents_*``) is not: its GEMMs are gradients, which mxfx
    does not replace, so recording them would only be noise."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from mxfx.lowering import leftover

    args = (torch.randn(6, H), torch.randint(0, E, (6,)), torch.randn(E, H, I), torch.randn(E, I, H),
            torch.randn(6, H))
    graph = make_fx(fn, tracing_mode="fake")(*args).graph
    lowering.clear()
    leftover.record(graph, [])
    left = lowering.report()
    assert len(left) == (reason is not None)
    assert all(r.form == "gathered_bmm" and not r.rewritten and reason in r.reason for r in left)


def test_survey_tool_reports_each_family():
    """``tools/survey_models.py`` (the README's family list): a rewritten family's row counts
    one ``mxfx.moe`` per experts module, a multimodal family's text decoder included; a family
    mxfx cannot compute gets the reason."""
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parent.parent / "tools" / "survey_models.py"
    run = subprocess.run([sys.executable, str(tool), "qwen2_moe", "minimax_m3_vl", "nemotron_h"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr
    qwen, minimax, nemotron = run.stdout.splitlines()
    for row, family in ((qwen, "qwen2_moe"), (minimax, "minimax_m3_vl")):
        assert row.split()[:5] == [family, "experts", "2", "mxfx.moe", "2"] and float(row.split()[6]) < 1e-5
    assert nemotron.split()[:5] == ["nemotron_h", "experts", "1", "mxfx.moe", "0"]
    assert "left: no gated activation mxfx knows" in nemotron
