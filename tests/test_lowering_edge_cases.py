"""The lowering on forms that are almost a MoE layer or an activation it knows, and on the
details a rewrite must keep (stored weight formats, scale roundings, dtypes, views, biases):
each compiled with mxfx keeps eager's output, rewritten or left as written. The models and
helpers are those of test_lowering_models."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mxfx import lowering

from test_lowering_models import (  # the models and helpers
    E, H, I, K, DenseBmmExperts, DenseMoE, GptFastMoE, assert_rewritten, compiled, gpt_oss_block, hidden,
    moe_calls, qwen_block, randomize, rel_err,
)


class PackedGptFastMoE(GptFastMoE):
    """gpt-fast's MoE with w1, w3, w2 stored as ``fmt`` (MXFP4 as mxfx.nn stores experts, or
    MXFP8) and read through ``mxfx.dequantize_mx``; w3 is scaled up so gate and up have
    different scales."""

    def __init__(self, fmt="mxfp4"):
        super().__init__()
        randomize(self)
        self.fmt = fmt
        with torch.no_grad():
            self._parameters["w3"].mul_(8)
        for name in ("w1", "w2", "w3"):
            w = self._parameters.pop(name).detach().contiguous()
            packed, scale = torch.ops.mxfx.quantize_mx(w, fmt, "round_up")
            self.register_buffer(f"{name}_packed", packed)
            self.register_buffer(f"{name}_scale", scale)

    def _dequantized(self, name):
        return torch.ops.mxfx.dequantize_mx(
            getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale"), self.fmt, torch.float32
        )

    w1 = property(lambda self: self._dequantized("w1"))
    w2 = property(lambda self: self._dequantized("w2"))
    w3 = property(lambda self: self._dequantized("w3"))


def test_gpt_fast_moe_on_mxfp4_weights():
    ref, out, code = compiled(PackedGptFastMoE().eval(), hidden())
    assert rel_err(out, ref) < 1e-5
    assert_rewritten(code, layers=1, form="gather_einsum")
    assert "dequantize_mx" not in code  # the packed gate and up are concatenated, not dequantized
    assert "W=mxfp4" in next(r.detail for r in lowering.report() if r.form == "gather_einsum")


class DenseNearMiss(DenseMoE):
    """DenseMoE's routing and expert rows written slightly differently: ``ones`` fills the
    unselected experts' weights with 1 (a dense layer, not a top-k one), ``untransposed`` views
    R [T, E] as [E, T] without transposing it, ``tiled`` repeats x along columns."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant

    def forward(self, x):
        ex, v = self.experts, self.variant
        x = x.reshape(-1, H)
        logits = self.router(x)
        top_v, top_i = torch.topk(logits, K, dim=-1)
        fill = torch.ones_like if v == "ones" else torch.zeros_like
        r = fill(logits).scatter(1, top_i, F.softmax(top_v, dim=1))
        rows = x.repeat(1, E) if v == "tiled" else x.repeat(E, 1)
        h = torch.bmm(rows.view(E, -1, H), ex.gate_up_proj) + ex.gate_up_proj_bias[..., None, :]
        gate, up = h[..., ::2].clamp(max=7.0), h[..., 1::2].clamp(-7.0, 7.0)
        y = torch.bmm((up + 1) * (gate * torch.sigmoid(gate * 1.702)), ex.down_proj) + ex.down_proj_bias[..., None, :]
        rt = r.reshape(E, 1, -1) if v == "untransposed" else r.transpose(0, 1).view(E, 1, -1)
        return (y.view(E, 1, -1, H) * rt[..., None]).sum(dim=0)


@pytest.mark.parametrize("variant", ["ones", "untransposed", "tiled"])
def test_dense_bmm_near_misses_keep_eager_output(variant):
    """Dense-bmm experts whose routing or rows differ from the 4.x form: a ones-filled scatter
    is dense routing (every expert weighted), rewritten as such; a routing tensor viewed without
    its transpose, or x tiled along columns, is not the form and is left as written."""
    ref, out, code = compiled(randomize(DenseNearMiss(variant)), hidden())
    assert rel_err(out, ref) < 1e-5
    assert moe_calls(code) == (1 if variant == "ones" else 0)


class BatchedExperts(nn.Module):
    """transformers' batched_mm experts written by hand (SiLU-and-mul, biases); ``variant``
    makes it compute something else: ``tiled`` pairs token t*k+j with x[(t*k+j) % T] (x tiled,
    as x.repeat(k, 1), rather than repeat_interleave), ``twice`` applies the routing weights twice, ``other_bias``
    adds the down bias of another expert than the pair's."""

    def __init__(self, variant="plain"):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w13 = nn.Parameter(torch.randn(E, H, 2 * I, generator=g) / H**0.5)
        self.b13 = nn.Parameter(torch.randn(E, 2 * I, generator=g))
        self.w2 = nn.Parameter(torch.randn(E, I, H, generator=g) / I**0.5)
        self.b2 = nn.Parameter(torch.randn(E, H, generator=g))
        self.variant = variant

    def forward(self, x, ids, weights):
        v = self.variant
        flat = ids.reshape(-1).clamp(0, E - 1)
        rows = x[None].expand(K, -1, -1).reshape(-1, H) if v == "tiled" else x.repeat_interleave(K, 0)
        h = torch.bmm(rows[:, None], self.w13[flat]).squeeze(1) + self.b13[flat]
        a = F.silu(h[:, :I]) * h[:, I:]
        b2 = self.b2[(flat + 1) % E] if v == "other_bias" else self.b2[flat]
        y = torch.bmm(a[:, None], self.w2[flat]).squeeze(1) + b2
        y = y * weights.reshape(-1).unsqueeze(-1)
        if v == "twice":
            y = y * weights.reshape(-1).unsqueeze(-1)
        return y.view(-1, K, H).sum(1)


class GroupedExperts(BatchedExperts):
    """transformers' grouped_mm experts written by hand (sort by expert, grouped GEMMs on the
    offsets, un-permute, sum the slots); ``variant``: ``by_perm`` un-permutes with the sort's
    permutation rather than its inverse, ``weights_by_inverse`` gathers the routing weights by
    the inverse permutation, ``twice`` applies them twice."""

    def forward(self, x, ids, weights):
        from transformers.integrations.moe import _grouped_mm

        v = self.variant
        ids_g, perm = torch.sort(ids.reshape(-1))
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        offs = torch.cumsum(torch.histc(ids_g.float(), bins=E, min=0, max=E - 1), dim=0, dtype=torch.int32)
        w_g = weights.reshape(-1)[inv if v == "weights_by_inverse" else perm]
        h = _grouped_mm(x[perm // K], self.w13, offs=offs) + self.b13[ids_g]
        a = F.silu(h[:, :I]) * h[:, I:]
        y = (_grouped_mm(a, self.w2, offs=offs) + self.b2[ids_g]) * w_g.unsqueeze(-1)
        if v == "twice":
            y = y * w_g.unsqueeze(-1)
        return y[perm if v == "by_perm" else inv].view(-1, K, H).sum(1)


@pytest.mark.parametrize("form,variant", [
    *((BatchedExperts, v) for v in ("plain", "tiled", "twice", "other_bias")),
    *((GroupedExperts, v) for v in ("plain", "by_perm", "weights_by_inverse", "twice")),
], ids=lambda p: p.__name__ if isinstance(p, type) else p)
def test_hand_written_expert_near_misses_keep_eager_output(form, variant):
    """The batched_mm and grouped_mm forms are rewritten; rows paired with the wrong tokens,
    un-permuted by the permutation itself, routing weights gathered in another order or applied
    twice, or a bias gathered by other ids are not those forms and keep eager's output."""
    x = hidden(6)[0]
    ids = torch.randint(0, E, (6, K), generator=torch.Generator().manual_seed(4))
    weights = torch.rand(6, K, generator=torch.Generator().manual_seed(5)) + 0.5
    ref, out, code = compiled(form(variant).eval(), x, ids, weights)
    assert rel_err(out, ref) < 1e-5
    assert moe_calls(code) == (1 if variant == "plain" else 0)


def _qdq(t):
    return torch.ops.mxfx.dequantize_mx(*torch.ops.mxfx.quantize_mx(t, "mxfp8", "even"), "mxfp8", t.dtype)


class GatherEinsumNearMiss(nn.Module):
    """gpt-fast's experts (routing given) where the up projection differs from the gate's:
    ``other_ids`` gathers w3 by the slots in the other order, ``up_unquantized`` feeds the gate
    quantize-dequantized x (MXFP8) and the up x as it is (the intermediate is quantized too)."""

    def __init__(self, variant):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(E, I, H, generator=g) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, H, I, generator=g) * 0.1)
        self.w3 = nn.Parameter(torch.randn(E, I, H, generator=g) * 0.1)
        self.variant = variant

    def forward(self, x, weights, ids):
        v = self.variant
        xq = _qdq(x) if v == "up_unquantized" else x
        x1 = F.silu(torch.einsum("ti,taoi -> tao", xq, self.w1[ids]))
        x3 = torch.einsum("ti, taoi -> tao", x, self.w3[ids.flip(-1) if v == "other_ids" else ids])
        mid = x1 * x3
        mid = _qdq(mid) if v == "up_unquantized" else mid
        y = torch.einsum("tao, taio -> tai", mid, self.w2[ids])
        return torch.einsum("tai,ta -> ti", y, weights)


@pytest.mark.parametrize("variant", ["other_ids", "up_unquantized"])
def test_gather_einsum_gate_and_up_must_read_the_same_rows(variant):
    """Gate and up projections gathered by different ids, or reading differently quantized
    tokens, are not one MoE layer's halves: eager's output is kept."""
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    weights = torch.rand(5, K, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[0, 1], [2, 3], [3, 0], [1, 2], [2, 0]])
    ref, out, code = compiled(GatherEinsumNearMiss(variant).eval(), x, weights, ids)
    assert rel_err(out, ref) < 1e-5
    assert moe_calls(code) == 0


def _embedding_bmm(q, idx, table):
    return torch.bmm(q, table[idx].view(q.shape[0], q.shape[2], -1))


def test_a_bmm_on_an_embedding_lookup_is_not_reported_as_experts():
    """A bmm reading rows gathered from a 2-D table (relative-position embeddings, say) is not
    an expert GEMM: the report gets no record for it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from mxfx.lowering import leftover

    args = (torch.randn(4, 3, 8), torch.randint(0, 16, (4, 8)), torch.randn(16, 5))
    graph = make_fx(_embedding_bmm, tracing_mode="fake")(*args).graph
    lowering.clear()
    leftover.record(graph, [])
    assert lowering.report() == []


class RoundedActivationMoE(nn.Module):
    """Qwen3 experts whose two GEMM inputs are MXFP8 quantize-dequantized with ``rounding``
    (the first) and ``rounding_mid`` (the second; the same unless given)."""

    def __init__(self, rounding, rounding_mid=...):
        super().__init__()
        self.block = qwen_block("grouped_mm")
        experts = self.block.experts
        apply_gate, forward = type(experts)._apply_gate, experts.forward

        def qdq(t, r):
            q = torch.ops.mxfx.quantize_mx(t, "mxfp8", *([r] if r else []))
            return torch.ops.mxfx.dequantize_mx(*q, "mxfp8", t.dtype)

        mid = rounding if rounding_mid is ... else rounding_mid
        experts._apply_gate = lambda gate_up: qdq(apply_gate(experts, gate_up), mid)
        experts.forward = lambda hidden_states, *args: forward(qdq(hidden_states, rounding), *args)

    def forward(self, x):
        return self.block(x)


@pytest.mark.parametrize("rounding", ["floor", "round_up", None])
def test_activation_quantization_keeps_the_models_scale_rounding(rounding):
    """The experts' activation quantize-dequantize with floor / round-up scales (or quantize_mx's
    own default, floor, when the call leaves it out) becomes an mxfx.moe quantizing with that
    same rounding, so eager's output is kept."""
    x = hidden() * 3.0
    ref, out, code = compiled(RoundedActivationMoE(rounding), x)
    assert rel_err(out, ref) < 1e-5
    assert_rewritten(code, layers=1, form="grouped_mm")
    assert f"'mxfp8', 'emulation', '{rounding or 'floor'}'" in code


class RowQuantizedDenseExperts(DenseBmmExperts):
    """The dense-bmm experts with MXFP8 quantize-dequantize on the repeated token rows (after
    ``repeat``, not before) and on the activation entering the down projection."""

    def forward(self, hidden_states, routing_weights):
        def qdq(t):
            return torch.ops.mxfx.dequantize_mx(*torch.ops.mxfx.quantize_mx(t, "mxfp8", "even"), "mxfp8", t.dtype)

        batch_size = hidden_states.shape[0]
        hidden_states = hidden_states.reshape(-1, H)
        num_experts = routing_weights.shape[1]
        hidden_states = qdq(hidden_states.repeat(num_experts, 1).view(num_experts, -1, H))
        gate_up = torch.bmm(hidden_states, self.gate_up_proj) + self.gate_up_proj_bias[..., None, :]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        next_states = torch.bmm(qdq((up + 1) * glu), self.down_proj)
        next_states = next_states + self.down_proj_bias[..., None, :]
        next_states = next_states.view(num_experts, batch_size, -1, H)
        next_states = next_states * routing_weights.transpose(0, 1).view(num_experts, batch_size, -1)[..., None]
        return next_states.sum(dim=0)


class RowQuantizedDenseMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E)
        self.experts = RowQuantizedDenseExperts()

    def forward(self, x):
        return self.experts(x, torch.softmax(self.router(x.reshape(-1, H)), dim=-1))


def test_activation_quantization_after_the_row_repeat_is_recognised():
    """Tokens quantize-dequantized after being repeated per expert (the same values as before
    it) count as the first GEMM's activation quantization: one mxfx.moe quantizing both inputs."""
    ref, out, code = compiled(randomize(RowQuantizedDenseMoE()), hidden())
    assert rel_err(out, ref) < 1e-5
    assert_rewritten(code, layers=1, form="dense_bmm")
    assert "'mxfp8', 'emulation', 'even'" in code and "quantize_mx" not in code


def test_gpt_fast_moe_on_mxfp8_weights_uses_them_dequantized():
    """Experts stored MXFP8 (read through dequantize_mx) become one mxfx.moe on the dequantized
    float weights, keeping eager's output: only MXFP4 storage is handed over packed."""
    ref, out, code = compiled(PackedGptFastMoE("mxfp8").eval(), hidden())
    assert rel_err(out, ref) < 1e-5
    assert_rewritten(code, layers=1, form="gather_einsum")
    assert "W=float" in next(r.detail for r in lowering.report() if r.form == "gather_einsum")


class Fp32RoutedDenseMoE(DenseMoE):
    """bf16 experts under an fp32 router: the fp32 routing weights promote the weighted sum
    of the bf16 expert outputs to fp32."""

    def forward(self, x):
        logits = self.router(x.reshape(-1, H).float())
        top_v, top_i = torch.topk(logits, K, dim=-1)
        return self.experts(x, torch.zeros_like(logits).scatter(1, top_i, F.softmax(top_v, dim=1)))


def test_experts_output_keeps_the_models_dtype():
    """The mxfx.moe computing in the experts' bf16 is cast back to the fp32 the model's
    weighted sum has, so the compiled output has eager's dtype and values."""
    model = randomize(Fp32RoutedDenseMoE())
    model.experts.to(torch.bfloat16)
    ref, out, code = compiled(model, hidden(dtype=torch.bfloat16))
    assert ref.dtype == out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-2
    assert_rewritten(code, layers=1, form="dense_bmm")


def test_batched_mm_negative_ids_clamp_to_the_first_expert():
    """batched_mm clamps ids into [0, E): a negative id (with a nonzero weight) runs expert 0,
    as it does in eager, not nothing."""
    experts = gpt_oss_block("batched_mm").experts
    x = hidden(5)[0]
    ids = torch.tensor([[0, -1], [1, 2], [-1, 3], [E, 0], [3, 1]])
    weights = torch.rand(5, K, generator=torch.Generator().manual_seed(3)) + 0.5
    ref, out, code = compiled(experts, x, ids, weights)
    assert rel_err(out, ref) < 1e-5
    assert_rewritten(code, layers=1, form="batched_mm")


class DownBiasOnlyMoE(DenseMoE):
    """DenseMoE's experts with a bias on the down projection only."""

    def forward(self, x):
        ex = self.experts
        x = x.reshape(-1, H)
        logits = self.router(x)
        top_v, top_i = torch.topk(logits, K, dim=-1)
        r = torch.zeros_like(logits).scatter(1, top_i, F.softmax(top_v, dim=1))
        h = torch.bmm(x.repeat(E, 1).view(E, -1, H), ex.gate_up_proj)
        gate, up = h[..., ::2].clamp(max=7.0), h[..., 1::2].clamp(-7.0, 7.0)
        y = torch.bmm((up + 1) * (gate * torch.sigmoid(gate * 1.702)), ex.down_proj) + ex.down_proj_bias[..., None, :]
        return (y.view(E, 1, -1, H) * r.transpose(0, 1).view(E, 1, -1)[..., None]).sum(dim=0)


def test_a_down_projection_bias_alone_is_a_biased_layer_for_the_oracle(monkeypatch):
    """A layer whose only bias is the down projection's is rewritten with that bias, and the
    oracle choosing its backend is told the layer has biases."""
    from mxfx.lowering import moe

    configs, select = [], moe.select
    monkeypatch.setattr(moe, "select", lambda config, platform: configs.append(config) or select(config, platform))
    ref, out, code = compiled(randomize(DownBiasOnlyMoE()), hidden())
    assert rel_err(out, ref) < 1e-5
    assert_rewritten(code, layers=1, form="dense_bmm")
    assert [c.has_bias for c in configs] == [True]


class Bf16ExpertsOnFp32Tokens(nn.Module):
    """bf16 dense-bmm experts called on fp32 tokens cast to bf16 (routing weights given)."""

    def __init__(self):
        super().__init__()
        self.experts = randomize(DenseBmmExperts()).to(torch.bfloat16)

    def forward(self, x, routing):
        return self.experts(x.reshape(-1, H).to(torch.bfloat16), routing)


def test_experts_see_the_tokens_in_their_own_dtype():
    """The experts read the fp32 tokens rounded to bf16, as in eager: the compiled layer gives
    the same output for the tokens and for the tokens already rounded to bf16."""
    model = Bf16ExpertsOnFp32Tokens()
    x = hidden()
    g = torch.Generator().manual_seed(4)
    routing = torch.zeros(7, E).scatter(1, torch.randint(0, E, (7, 1), generator=g), 1.0).to(torch.bfloat16)
    ref, out, code = compiled(model, x, routing)
    assert rel_err(out, ref) < 1e-2
    assert_rewritten(code, layers=1, form="dense_bmm")
    _, out_rounded, _ = compiled(model, x.to(torch.bfloat16).float(), routing)
    assert torch.equal(out, out_rounded)


class ViewedWeightsDenseMoE(DenseMoE):
    """DenseMoE whose expert weights are stored in another shape and viewed as [E, K, N] in
    forward: ``flat`` as [E, K * N], ``regrouped`` as [E, N, K] memory read as [E, K, N]
    (a view, not a transpose). Taking such a view for an identity crashes the compile (flat)
    or misses the layer (regrouped)."""

    def __init__(self, storage):
        super().__init__()
        randomize(self)
        ex = self.experts
        for name in ("gate_up_proj", "down_proj"):
            w = ex._parameters.pop(name).detach()
            e, k, n = w.shape
            stored = w.reshape(e, k * n) if storage == "flat" else w.reshape(e, n, k)
            ex.register_parameter(name + "_stored", nn.Parameter(stored.clone()))
        self.storage = storage

    def forward(self, x):
        ex = self.experts
        ex.gate_up_proj = ex.gate_up_proj_stored.view(E, H, -1)
        ex.down_proj = ex.down_proj_stored.view(E, -1, H)
        return super().forward(x)


@pytest.mark.parametrize("storage", ["flat", "regrouped"])
def test_experts_read_through_a_reshaping_view(storage):
    """Weights reshaped by a view before the expert GEMMs are read as the viewed tensor (a
    view that changes the shape is no identity): one mxfx.moe with eager's output."""
    ref, out, code = compiled(ViewedWeightsDenseMoE(storage), hidden())
    assert rel_err(out, ref) < 1e-5
    assert_rewritten(code, layers=1, form="dense_bmm")


def moe_on_emulation(x, weights, ids, w13, w2):
    return torch.ops.mxfx.moe(x, weights, ids, w13, None, None, w2, None, None,
                              "halves", 1.0, 0.0, None, "none", "emulation", "even")


def test_a_backend_the_call_names_is_kept():
    """An mxfx.moe call that names its backend keeps it: the pass pins only backend="auto"
    (nothing is reported for the call), and the output is eager's."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, H, generator=g)
    weights, ids = torch.rand(6, K, generator=g), torch.randint(0, E, (6, K), generator=g)
    w13, w2 = torch.randn(E, 2 * 32, H, generator=g) * 0.1, torch.randn(E, H, 32, generator=g) * 0.1
    ref, out, code = compiled(moe_on_emulation, x, weights, ids, w13, w2)
    assert rel_err(out, ref) < 1e-6
    assert moe_calls(code) == 1 and "'emulation'" in code
    assert [r for r in lowering.report() if r.form == "pinned"] == []


def test_activation_quantization_with_two_scale_roundings_is_left_alone():
    """The two expert GEMM inputs quantized to MXFP8 with different scale roundings (floor,
    even) are not what one mxfx.moe does: the layer is left as written, with its reason."""
    ref, out, code = compiled(RoundedActivationMoE("floor", "even"), hidden() * 3.0)
    assert rel_err(out, ref) < 1e-6
    assert moe_calls(code) == 0
    (skip,) = [r for r in lowering.report() if r.form == "grouped_mm"]
    assert not skip.rewritten and "quantized differently" in skip.reason
