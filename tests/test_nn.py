"""``mxfx.quantize_`` and MXFP4 expert storage on tiny transformers models and a protocol module."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mxfx
from mxfx import formats
from mxfx.activation import GPT_OSS, SILU_AND_MUL, GatedActivation, minimax_m3, swiglu_limit
from mxfx.demo import build_model
from mxfx.nn import MXFP4Experts, expert_activation, to_mxfp4
from mxfx.nn.quantize import quantize_weight

pytest.importorskip("transformers")

H, I, E = 64, 32, 4
_SMALL = dict(
    num_hidden_layers=1, hidden_size=H, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    vocab_size=128,
)
TINY = {
    "gpt-oss": dict(_SMALL, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2,
                    layer_types=["full_attention"]),
    "qwen3-moe": dict(_SMALL, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=2),
    "mixtral": dict(_SMALL, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2),
}


def tiny(name: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    return build_model(name, "cpu", dtype, **TINY[name])


def experts_of(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]


def canonical(module: nn.Module, w: torch.Tensor) -> torch.Tensor:
    """A weight in the model's layout → [E, N, K] (K the reduction dimension)."""
    return w.transpose(1, 2) if getattr(module, "is_transposed", False) else w


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("name", sorted(TINY))
def test_quantize_stores_canonical_mxfp4_and_eager_runs_on_it(name, mx_ref_dequantize):
    model = tiny(name)
    reference = copy.deepcopy(model)
    floats = [
        (canonical(m, m.gate_up_proj.detach()), canonical(m, m.down_proj.detach()))
        for m in experts_of(model)
    ]
    float_bytes = sum(w.numel() * 4 for pair in floats for w in pair)

    report = mxfx.quantize_(model)

    assert report.layers == ("model.layers.0.mlp.experts",)
    assert report.bytes_before == float_bytes
    assert report.bytes_after / report.bytes_before == pytest.approx(4.25 / 32)
    names = dict(model.named_parameters())
    assert not any(n.endswith(("gate_up_proj", "down_proj")) for n in names)
    dequantized = copy.deepcopy(reference)
    for module, twin, (gate_up, down) in zip(experts_of(model), experts_of(dequantized), floats):
        assert isinstance(module, MXFP4Experts)
        for packed, scale, w in ((module.w13, module.w13_scale, gate_up), (module.w2, module.w2_scale, down)):
            want_packed, want_scale = formats.quantize(w, "mxfp4", "round_up")
            assert torch.equal(packed, want_packed) and torch.equal(scale, want_scale)
        # The properties give back the model's layout, decoded as the OCP spec says.
        assert torch.equal(
            canonical(module, module.gate_up_proj).double(),
            mx_ref_dequantize(module.w13, module.w13_scale, "mxfp4"),
        )
        assert torch.equal(
            canonical(module, module.down_proj).double(),
            mx_ref_dequantize(module.w2, module.w2_scale, "mxfp4"),
        )
        twin.gate_up_proj.data.copy_(module.gate_up_proj)
        twin.down_proj.data.copy_(module.down_proj)

    tokens = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        out = model(tokens).logits
        torch.testing.assert_close(out, dequantized(tokens).logits, rtol=1e-5, atol=1e-5)
        assert rel(out, reference(tokens).logits) < 0.2


@pytest.mark.parametrize("dtype, ratio", [(torch.bfloat16, 4.25 / 16), (torch.float16, 4.25 / 16)])
def test_quantize_memory_in_half_precision(dtype, ratio):
    model = tiny("mixtral", dtype)
    def stored(m: nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))

    before = stored(model)
    report = mxfx.quantize_(model)
    after = stored(model)
    assert report.bytes_after / report.bytes_before == pytest.approx(ratio)
    assert before - after == report.bytes_saved
    (module,) = experts_of(model)
    assert module.gate_up_proj.dtype == dtype and module.mxfx_dtype == dtype
    with pytest.raises(ValueError, match="MXFP4 already"):
        mxfx.quantize_(model)


def test_requantizing_dequantized_mxfp4_is_lossless():
    """A model whose weights were dequantized from MXFP4 (transformers loads gpt-oss so where
    its kernels are missing) gets its MXFP4 weights back exactly with round_up scales."""
    module = GatherExperts()
    mxfx.quantize_(module)
    again = GatherExperts()
    with torch.no_grad():
        again.gate_up_proj.copy_(module.gate_up_proj.to(torch.bfloat16))
        again.down_proj.copy_(module.down_proj.to(torch.bfloat16))
    mxfx.quantize_(again)
    assert torch.equal(again.gate_up_proj, module.gate_up_proj)
    assert torch.equal(again.down_proj, module.down_proj)


@pytest.mark.parametrize("name, block", [("gpt-oss", "GptOssMLP"), ("mixtral", "MixtralSparseMoeBlock")])
def test_quantized_block_compiles_to_mxfx_moe_on_packed_weights(name, block):
    from torch._inductor.utils import run_and_get_code

    model = tiny(name)
    mxfx.quantize_(model)
    moe_block = model.model.layers[0].mlp
    assert type(moe_block).__name__ == block
    x = torch.randn(1, 24, H)
    torch._dynamo.reset()
    compiled = torch.compile(moe_block, options=mxfx.inductor_options())
    with torch.no_grad():
        eager = moe_block(x)
        out, codes = run_and_get_code(compiled, x)
    code = "\n".join(codes)
    assert "mxfx.moe" in code
    assert "dequantize_mx" not in code
    eager = eager[0] if isinstance(eager, tuple) else eager
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)


def test_activation_of_transformers_experts_matches_their_gate():
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLExperts

    minimax = MiniMaxM3VLExperts(MiniMaxM3VLTextConfig(
        hidden_size=H, intermediate_size=I, num_local_experts=E, swiglu_alpha=1.5, swiglu_limit=5.0,
    ))
    modules = {name: experts_of(tiny(name))[0] for name in TINY}
    modules["minimax-m3"] = minimax
    expected = {
        "gpt-oss": GPT_OSS, "qwen3-moe": SILU_AND_MUL, "mixtral": SILU_AND_MUL,
        "minimax-m3": minimax_m3(1.5, 1.0, 5.0),
    }
    x = torch.randn(16, 2 * I) * 6
    for name, module in modules.items():
        act = expert_activation(module)
        assert act == expected[name], name
        want = module._apply_gate(x)
        got = torch.ops.mxfx.gated_activation(x, act.layout, act.alpha, act.beta, act.limit)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)


class GatherExperts(nn.Module):
    """A hand-written experts module following the protocol (gpt-fast style gather)."""

    mxfx_activation = swiglu_limit(3.0)

    def __init__(self, e: int = E, h: int = H, i: int = I, bias: bool = True):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h) / h**0.5)
        self.down_proj = nn.Parameter(torch.randn(e, h, i) / i**0.5)
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.randn(e, 2 * i) * 0.1)
            self.down_proj_bias = nn.Parameter(torch.randn(e, h) * 0.1)

    def forward(self, x, top_k_index, top_k_weights):
        a = self.mxfx_activation
        out = torch.zeros_like(x)
        for slot in range(top_k_index.shape[1]):
            e = top_k_index[:, slot]
            h = torch.einsum("th,tnh->tn", x, self.gate_up_proj[e]) + self.gate_up_proj_bias[e]
            gate, up = h.chunk(2, dim=-1)
            gate, up = gate.clamp(max=a.limit), up.clamp(-a.limit, a.limit)
            y = torch.einsum("ti,thi->th", torch.nn.functional.silu(gate) * up, self.down_proj[e])
            out += top_k_weights[:, slot, None] * (y + self.down_proj_bias[e])
        return out


def _routing(t: int, k: int = 2):
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
    return ids, torch.softmax(torch.randn(t, k, generator=g), dim=-1)


def test_protocol_module_quantizes_and_describes_itself():
    torch.manual_seed(0)
    module = GatherExperts()
    twin = copy.deepcopy(module)
    report = mxfx.quantize_(module, scale_rounding="floor")
    assert report.layers == ("",)
    want, _ = formats.quantize(twin.gate_up_proj.detach(), "mxfp4", "floor")
    assert torch.equal(module.w13, want)
    with torch.no_grad():
        twin.gate_up_proj.copy_(module.gate_up_proj)
        twin.down_proj.copy_(module.down_proj)
    x = torch.randn(10, H)
    ids, w = _routing(10)
    with torch.no_grad():
        torch.testing.assert_close(module(x, ids, w), twin(x, ids, w), rtol=1e-5, atol=1e-5)
    config = module.moe_config(top_k=2)
    assert (config.num_experts, config.hidden_size, config.intermediate_size, config.top_k) == (E, H, I, 2)
    assert config.activation == swiglu_limit(3.0) and config.has_bias
    assert str(config.activation_quant) == "none" and str(config.weight_quant) == "mxfp4"


def _reference_moe(x, ids, w, w13, b13, w2, b2, act: GatedActivation, aq: str):
    """Σ_k w · (act(q(x) @ w13ᵀ + b13) → q → @ w2ᵀ + b2) in float64, written from the spec."""
    def q(t):
        return t if aq == "none" else formats.quantize_dequantize(t.float(), aq, "even").double()

    out = torch.zeros(x.shape, dtype=torch.float64)
    xq = q(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            h = w13[e] @ xq[t] + b13[e]
            gate, up = h.chunk(2)
            gate, up = gate.clamp(max=act.limit), up.clamp(-act.limit, act.limit)
            a = gate * torch.sigmoid(act.alpha * gate) * (up + act.beta)
            out[t] += w[t, slot].double() * (w2[e] @ q(a.float()).double().squeeze(0) + b2[e])
    return out


@pytest.mark.parametrize("aq", ["mxfp4", "mxfp8"])
def test_activation_quantized_layer_quantizes_each_gemm_input(aq, mx_ref_dequantize):
    torch.manual_seed(0)
    module = GatherExperts()
    w13, s13 = quantize_weight(module.gate_up_proj.detach(), "even")
    w2, s2 = quantize_weight(module.down_proj.detach(), "even")
    plain = copy.deepcopy(module)
    to_mxfp4(plain, w13, s13, w2, s2)
    to_mxfp4(module, w13, s13, w2, s2, activation_quant=aq)
    assert module.activation_quant == aq and str(module.moe_config(top_k=2).activation_quant) == aq
    x = torch.randn(12, H)
    ids, w = _routing(12)
    args = (
        mx_ref_dequantize(w13, s13, "mxfp4"), module.gate_up_proj_bias.detach().double(),
        mx_ref_dequantize(w2, s2, "mxfp4"), module.down_proj_bias.detach().double(),
    )
    with torch.no_grad():
        out = module(x, ids, w)
        unquantized = plain(x, ids, w)
    want = _reference_moe(x.double(), ids, w, *args, module.mxfx_activation, aq)
    assert rel(out, want) < 1e-4
    # Not the weight-only result: the activation quantization really ran.
    assert rel(unquantized, want) > 10 * rel(out, want)
    assert rel(unquantized, _reference_moe(x.double(), ids, w, *args, module.mxfx_activation, "none")) < 1e-5


def test_bad_input_is_refused_with_the_argument_named():
    with pytest.raises(ValueError, match="model: no experts module"):
        mxfx.quantize_(nn.Sequential(nn.Linear(32, 32)))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfx.quantize_(GatherExperts(h=48))
    with pytest.raises(ValueError, match="scale_rounding"):
        mxfx.quantize_(GatherExperts(), scale_rounding="nearest")
    module = GatherExperts()
    w13, s13 = quantize_weight(module.gate_up_proj.detach())
    w2, s2 = quantize_weight(module.down_proj.detach())
    with pytest.raises(ValueError, match="w13: got shape"):
        to_mxfp4(module, w13[:, :-1], s13, w2, s2)
    with pytest.raises(TypeError, match="w2_scale: got dtype"):
        to_mxfp4(module, w13, s13, w2, s2.float())
    with pytest.raises(ValueError, match="activation_quant"):
        to_mxfp4(module, w13, s13, w2, s2, activation_quant="int4")
    unknown = GatherExperts()
    unknown.mxfx_activation = None
    with pytest.raises(ValueError, match="mxfx_activation"):
        to_mxfp4(unknown, w13, s13, w2, s2, activation_quant="mxfp4")
    to_mxfp4(module, w13, s13, w2, s2)
    with pytest.raises(TypeError, match="experts protocol"):
        to_mxfp4(module, w13, s13, w2, s2)


def test_activation_quantized_layer_uses_its_scale_rounding():
    """An activation-quantized layer quantizes with its own scale rounding (a Quark "floor"
    checkpoint is not run with "even" scales)."""
    torch.manual_seed(0)
    module = GatherExperts()
    w13, s13 = formats.quantize(module.gate_up_proj.detach(), "mxfp4", "even")
    w2, s2 = formats.quantize(module.down_proj.detach(), "mxfp4", "even")
    b13, b2 = module.gate_up_proj_bias.detach(), module.down_proj_bias.detach()
    to_mxfp4(module, w13, s13, w2, s2, activation_quant="mxfp8", activation_scale_rounding="floor")
    x = torch.randn(12, H) * 3
    ids, w = _routing(12)
    act = module.mxfx_activation

    def moe(rounding):
        return torch.ops.mxfx.moe(x, w, ids, w13, s13, b13, w2, s2, b2, act.layout, act.alpha, act.beta,
                                  act.limit, "mxfp8", "emulation", rounding)

    with torch.no_grad():
        out, floor, even = module(x, ids, w), moe("floor"), moe("even")
    assert not torch.equal(floor, even)  # the probe tells the two roundings apart
    torch.testing.assert_close(out, floor, rtol=0, atol=0)


def test_quantize_converts_the_experts_of_every_layer():
    """A two-layer model: both layers' experts become MXFP4, both are in the report, and the
    report's bytes cover both."""
    model = build_model("mixtral", "cpu", torch.float32, **{**TINY["mixtral"], "num_hidden_layers": 2})
    experts = experts_of(model)
    assert len(experts) == 2
    float_bytes = sum((m.gate_up_proj.numel() + m.down_proj.numel()) * 4 for m in experts)
    report = mxfx.quantize_(model)
    assert report.layers == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
    assert all(isinstance(m, mxfx.nn.MXFP4Experts) for m in experts_of(model))
    assert report.bytes_before == float_bytes
    assert report.bytes_after == pytest.approx(float_bytes * 4.25 / 32)


def test_quantize_uses_its_scale_rounding_for_both_projections():
    """scale_rounding applies to gate_up_proj and down_proj alike."""
    torch.manual_seed(0)
    module = GatherExperts()
    gate_up, down = module.gate_up_proj.detach().clone(), module.down_proj.detach().clone()
    mxfx.quantize_(module, scale_rounding="floor")
    for packed, scale, w in ((module.w13, module.w13_scale, gate_up), (module.w2, module.w2_scale, down)):
        want_packed, want_scale = formats.quantize(w, "mxfp4", "floor")
        assert torch.equal(scale, want_scale) and torch.equal(packed, want_packed)
    _, round_up_scale = formats.quantize(down, "mxfp4", "round_up")
    assert not torch.equal(module.w2_scale, round_up_scale)  # the two roundings differ on these weights


def test_quantize_report_text():
    """The report says MiB before and after, MiB saved, and after as a share of before."""
    report = mxfx.nn.QuantizeReport(("a", "b"), 32 << 20, 17 << 18)  # 32 MiB -> 4.25 MiB
    assert report.bytes_saved == (32 << 20) - (17 << 18)
    assert str(report) == ("quantized 2 experts modules to MXFP4: 32.00 MiB -> 4.25 MiB "
                           "(saved 27.75 MiB, 13.3% of before)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_moe_config_of_a_biasless_layer_keeps_its_dtype(dtype):
    """A layer without biases is described as such (backends differ in bias support), and
    with the dtype its weights dequantize to."""
    module = GatherExperts(bias=False).to(dtype)
    mxfx.quantize_(module)
    config = module.moe_config(top_k=2)
    assert config.has_bias is False
    assert config.dtype == dtype == module.gate_up_proj.dtype
