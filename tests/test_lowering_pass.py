"""The lowering pass itself: gated-activation spellings, look-alikes left alone, the rewritten
graph (expect tests over a rendering free of node names), installing the pass, its uuid and
the FX graph cache."""
from __future__ import annotations

import operator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch import nn
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import mxfx
from mxfx import backends, lowering
from mxfx.lowering import ComposedPass
from mxfx.oracle import Platform

# ----------------------------------------------------------------------------- rendering


def _describe(a) -> str:
    if isinstance(a, torch.fx.Node):
        v = a.meta.get("val")
        if a.op == "placeholder":
            name = "input"
        elif a.target is operator.getitem:
            name = f"{_op(a.args[0])}[{a.args[1]}]"
        else:
            name = _op(a)
        return f"{name}: {_tensor(v)}" if isinstance(v, torch.Tensor) else name
    if isinstance(a, float):
        return f"{a:g}"
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_describe(x) for x in a) + "]"
    return repr(a)


def _op(n: torch.fx.Node) -> str:
    t = getattr(n.target, "overloadpacket", n.target)
    qualified = getattr(t, "_qualified_op_name", None)
    return qualified.replace("::", ".") if qualified else getattr(t, "__name__", str(t))


def _tensor(v: torch.Tensor) -> str:
    dims = ", ".join(str(d) if isinstance(d, int) else "s" for d in v.shape)
    return f"{str(v.dtype).removeprefix('torch.')}[{dims}]"


def render(graph: torch.fx.Graph) -> str:
    """The mxfx calls of ``graph``, their arguments described by op and shape (no node names)."""
    lines = []
    for n in graph.nodes:
        if n.op == "call_function" and _op(n).startswith("mxfx."):
            args = ", ".join(_describe(a) for a in n.args)
            lines.append(f"{_op(n)}({args}) -> {_tensor(n.meta['val'])}")
    return "\n".join(lines)


class Capture(CustomGraphPass):
    """Keeps the graph it sees (run after the mxfx pass)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph):
        self.graphs.append(graph)

    def uuid(self):
        return None


def lowered(fn, *args, dynamic_dim=None) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(rendering of the rewritten graph, compiled output, eager output)."""
    torch._dynamo.reset()
    capture = Capture()
    if dynamic_dim is not None:
        torch._dynamo.mark_dynamic(args[0], dynamic_dim)
    with inductor_config.patch(
        post_grad_custom_post_pass=ComposedPass(lowering.PASS, capture), fx_graph_cache=False
    ):
        out = torch.compile(fn)(*args)
    (graph,) = capture.graphs
    return render(graph), out, fn(*args)


def probe(rows: int = 8, width: int = 64, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(rows, width, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)


def close(out, ref) -> bool:
    tol = 1e-5 if out.dtype == torch.float32 else 2e-2
    return bool(((out.double() - ref.double()).norm() <= tol * ref.double().norm()).item())


# ----------------------------------------------------------------------------- activations


def gpt_oss_glu(x):  # transformers GptOssExperts._apply_gate
    gate, up = x[..., ::2], x[..., 1::2]
    gate = gate.clamp(min=None, max=7.0)
    up = up.clamp(min=-7.0, max=7.0)
    glu = gate * torch.sigmoid(gate * 1.702)
    return (up + 1) * glu


def silu_and_mul(x):  # transformers default _apply_gate with act_fn=silu
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def minimax_uninterleave(x):  # gpt-oss formula on halves, written with clamp_min/clamp_max
    d = x.shape[-1] // 2
    gate, up = x[..., :d].clamp_max(7.0), x[..., d:].clamp_min(-7.0).clamp_max(7.0)
    return gate * torch.sigmoid(1.702 * gate) * (up + 1.0)


def custom_constants(x):  # any alpha, beta, limit: read off the expression and confirmed
    gate, up = x.chunk(2, dim=-1)
    gate, up = torch.clamp(gate, max=5.0), torch.clamp(up, min=-5.0, max=5.0)
    return gate * torch.sigmoid(gate * 1.25) * (up + 0.5)


def swiglu_limit_fp32(x):  # upcast to fp32, compute, cast back
    gate, up = x.float().chunk(2, dim=-1)
    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    return (gate * torch.sigmoid(gate) * up).to(x.dtype)


def test_gpt_oss_activation_expect():
    text, out, ref = lowered(gpt_oss_glu, probe())
    assert close(out, ref)
    assert_expected_inline(
        text,
        """mxfx.gated_activation(input: float32[8, 64], 'interleaved', 1.702, 1, 7) -> float32[8, 32]""",
    )


def test_silu_and_mul_bf16_dynamic_expect():
    text, out, ref = lowered(silu_and_mul, probe(dtype=torch.bfloat16), dynamic_dim=0)
    assert close(out, ref)
    assert_expected_inline(
        text,
        """mxfx.gated_activation(input: bfloat16[s, 64], 'halves', 1, 0, None) -> bfloat16[s, 32]""",
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "fn, params",
    [
        (gpt_oss_glu, ("interleaved", 1.702, 1.0, 7.0)),
        (silu_and_mul, ("halves", 1.0, 0.0, None)),
        (minimax_uninterleave, ("halves", 1.702, 1.0, 7.0)),
        (swiglu_limit_fp32, ("halves", 1.0, 0.0, 7.0)),
        (custom_constants, ("halves", 1.25, 0.5, 5.0)),
    ],
    ids=["gpt_oss", "silu_and_mul", "minimax_m3", "swiglu_limit", "custom"],
)
def test_activation_spellings(fn, params, dtype):
    text, out, ref = lowered(fn, probe(dtype=dtype).unsqueeze(0))
    assert close(out, ref)
    layout, alpha, beta, limit = params
    limit = "None" if limit is None else f"{limit:g}"
    assert f"'{layout}', {alpha:g}, {beta:g}, {limit})" in text
    assert text.count("mxfx.gated_activation") == 1


# ----------------------------------------------------------------------------- look-alikes


def plain_bmm(a, b):
    return torch.bmm(a, b) * torch.sigmoid(torch.bmm(a, b))


def silu_whole(x):  # x * sigmoid(x): no gate/up split
    return x * torch.sigmoid(x)


def gate_on_odd(x):  # gate read from the odd columns: not a layout mxfx has
    gate, up = x[..., 1::2], x[..., ::2]
    return F.silu(gate) * up


def product_without_sigmoid(x):
    gate, up = x.chunk(2, dim=-1)
    return gate.clamp(max=7.0) * up


def wrong_clamp(x):  # up clamped to a different bound than the gate: not the formula
    gate, up = x.chunk(2, dim=-1)
    gate, up = gate.clamp(max=7.0), up.clamp(-3.0, 3.0)
    return gate * torch.sigmoid(gate) * up


@pytest.mark.parametrize("fn", [silu_whole, gate_on_odd, product_without_sigmoid, wrong_clamp])
def test_look_alike_activations_stay(fn):
    text, out, ref = lowered(fn, probe())
    assert close(out, ref)
    assert text == ""


def test_plain_bmm_stays():
    a = torch.randn(4, 8, 16)
    b = torch.randn(4, 16, 8)
    text, out, ref = lowered(plain_bmm, a, b)
    assert close(out, ref) and text == ""


# ----------------------------------------------------------------------------- MoE expect


class GatherEinsumMoE(nn.Module):
    """gpt-fast's experts with routing given: per-token gathers, einsums, separate w1/w3."""

    def __init__(self, e=4, h=64, i=32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(e, i, h, generator=g) * 0.1)
        self.w2 = nn.Parameter(torch.randn(e, h, i, generator=g) * 0.1)
        self.w3 = nn.Parameter(torch.randn(e, i, h, generator=g) * 0.1)

    def forward(self, x, weights, ids):
        x1 = F.silu(torch.einsum("ti,taoi -> tao", x, self.w1[ids]))
        x3 = torch.einsum("ti, taoi -> tao", x, self.w3[ids])
        y = torch.einsum("tao, taio -> tai", (x1 * x3), self.w2[ids])
        return torch.einsum("tai,ta -> ti", y, weights)


def test_gather_einsum_moe_expect():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[0, 1], [2, 3], [3, 0], [1, 1], [2, 0]])
    with torch.no_grad():
        text, out, ref = lowered(GatherEinsumMoE(), x, weights, ids)
    assert close(out, ref)
    assert_expected_inline(
        text,
        """mxfx.moe(input: float32[5, 64], input: float32[5, 2], input: int64[5, 2], aten.cat: float32[4, 64, 64], None, None, input: float32[4, 64, 32], None, None, 'halves', 1, 0, None, 'none', 'emulation', 'even') -> float32[5, 64]""",
    )


def test_grouped_mm_experts_expect():
    """transformers' default experts (routing given): ids >= E are dropped, as transformers does."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=4,
                         num_experts_per_tok=2, experts_implementation="grouped_mm")
    experts = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=0.2, generator=torch.Generator().manual_seed(0))
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
        ids = torch.tensor([[0, 1], [2, 3], [3, 0], [1, 1], [2, 0]])
        text, out, ref = lowered(experts, x, ids, torch.rand(5, 2))
    assert close(out, ref)
    assert_expected_inline(
        text,
        """\
mxfx.moe(input: float32[5, 64], input: float32[5, 2], aten.where: int64[5, 2], input: float32[4, 64, 64], None, None, input: float32[4, 64, 32], None, None, 'halves', 1, 0, None, 'none', 'emulation', 'even') -> float32[5, 64]""",
    )


# ----------------------------------------------------------------------------- installing


@inductor_config.patch(post_grad_custom_post_pass=None)
def test_enable_disable_and_scoped():
    mxfx.enable()
    mxfx.enable()
    assert inductor_config.post_grad_custom_post_pass is lowering.PASS
    mxfx.disable()
    assert inductor_config.post_grad_custom_post_pass is None
    with mxfx.enabled():
        assert inductor_config.post_grad_custom_post_pass is lowering.PASS
    assert inductor_config.post_grad_custom_post_pass is None


def test_composes_with_a_users_pass():
    mine = Capture()
    with inductor_config.patch(post_grad_custom_post_pass=mine):
        with mxfx.enabled():
            installed = inductor_config.post_grad_custom_post_pass
            assert isinstance(installed, ComposedPass) and installed.passes == (mine, lowering.PASS)
        assert inductor_config.post_grad_custom_post_pass is mine
        mxfx.enable()
        mxfx.disable()
        assert inductor_config.post_grad_custom_post_pass is mine
        options = mxfx.inductor_options()
        assert options["post_grad_custom_post_pass"].passes == (mine, lowering.PASS)
        assert inductor_config.post_grad_custom_post_pass is mine
        torch._dynamo.reset()
        out = torch.compile(silu_and_mul, options=options)(probe())
    assert close(out, silu_and_mul(probe()))
    assert len(mine.graphs) == 1  # the user's pass ran, on the graph mxfx then rewrote
    assert "mxfx.gated_activation" in render(mine.graphs[0])


def test_uuid_follows_the_settings():
    base = lowering.PASS.uuid()
    assert base == lowering.PASS.uuid()
    try:
        mxfx.configure(moe_backend="emulation")
        assert lowering.PASS.uuid() != base
    finally:
        mxfx.configure()
    assert lowering.PASS.uuid() == base
    assert ComposedPass(Capture(), lowering.PASS).uuid() is None  # a pass without uuid: no caching


def test_uuid_follows_the_source(tmp_path, monkeypatch):
    from mxfx.lowering import pass_

    src = tmp_path / "rule.py"
    src.write_text("A = 1\n")
    monkeypatch.setattr(pass_, "_source_files", lambda: (str(src),))
    first = lowering.PASS.uuid()
    src.write_text("A = 2\n")
    assert lowering.PASS.uuid() != first
    monkeypatch.undo()
    assert any(f.endswith("lowering/moe_grouped_mm.py") for f in pass_._source_files())


def silu_and_mul_minus(x):  # beta written as a subtraction
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * (up - 0.5)


def test_activation_beta_written_as_subtraction():
    """``up - c`` is beta = -c (the spellings above only add)."""
    text, out, ref = lowered(silu_and_mul_minus, probe())
    assert close(out, ref)
    assert "'halves', 1, -0.5, None)" in text and text.count("mxfx.gated_activation") == 1


def silu_and_mul_off_by_2e4(x):  # 2e-4 relative off SiLU-and-mul: twice the fp32 tolerance
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * (up * 1.0002)


def test_near_miss_activation_stays():
    """An expression within 2e-4 of the formula is still not the formula: the numerical
    confirmation leaves it alone (the look-alikes above are all far from it)."""
    text, out, ref = lowered(silu_and_mul_off_by_2e4, probe())
    assert close(out, ref)
    assert text == ""


def test_report_keeps_the_newest_thousand_records_and_says_the_backend():
    """The report holds at most 1000 records, the newest (a long-running process keeps seeing
    its latest compiles); a rewritten record names the backend, a skipped one its reason."""
    from mxfx.lowering.report import Record, add

    lowering.clear()
    try:
        for i in range(1005):
            add(Record("grouped_mm", True, f"layer {i}", backend="emulation"))
        records = lowering.report()
        assert len(records) == 1000
        assert records[0].detail == "layer 5" and records[-1].detail == "layer 1004"
        assert str(records[-1]) == "rewrote grouped_mm: layer 1004 -> emulation"
        left = Record("batched_mm", False, "E=4", reason="no backend")
        assert str(left) == "left batched_mm: E=4: no backend"
    finally:
        lowering.clear()


def test_enable_twice_beside_a_users_pass_installs_mxfx_once():
    """With a user's pass set, enable() twice still runs the mxfx pass once, and one disable()
    gives back exactly the user's pass."""
    mine = Capture()
    with inductor_config.patch(post_grad_custom_post_pass=mine):
        mxfx.enable()
        mxfx.enable()
        installed = inductor_config.post_grad_custom_post_pass
        assert isinstance(installed, ComposedPass) and installed.passes == (mine, lowering.PASS)
        mxfx.disable()
        assert inductor_config.post_grad_custom_post_pass is mine


def test_enabled_block_inside_enable_keeps_the_pass():
    """``with mxfx.enabled():`` restores the option as it was: after mxfx.enable() the pass
    stays installed when the block exits (alone, and beside a user's pass)."""
    with inductor_config.patch(post_grad_custom_post_pass=None):
        mxfx.enable()
        with mxfx.enabled():
            pass
        assert inductor_config.post_grad_custom_post_pass is lowering.PASS
    mine = Capture()
    with inductor_config.patch(post_grad_custom_post_pass=mine):
        mxfx.enable()
        before = inductor_config.post_grad_custom_post_pass
        with mxfx.enabled():
            pass
        assert inductor_config.post_grad_custom_post_pass is before
        assert before.passes == (mine, lowering.PASS)


def test_uuid_follows_the_environment_platform_and_backends(monkeypatch):
    """The compiled graph depends on the backend the oracle picks, which depends on
    $MXFX_MOE_BACKEND, the platform and the registered backends: each changes the cache key."""
    from mxfx.lowering import pass_
    from mxfx.oracle import settings

    monkeypatch.delenv(settings.ENV_BACKEND, raising=False)
    base = lowering.PASS.uuid()
    monkeypatch.setenv(settings.ENV_BACKEND, "emulation")
    assert lowering.PASS.uuid() != base
    monkeypatch.delenv(settings.ENV_BACKEND)
    assert lowering.PASS.uuid() == base
    with monkeypatch.context() as m:
        m.setattr(Platform, "current", staticmethod(lambda device=None: Platform("cuda", "sm90", frozenset({"triton"}))))
        assert lowering.PASS.uuid() != base
    names = backends.names()
    with monkeypatch.context() as m:
        m.setattr(backends, "names", lambda: (*names, "mine"))
        assert lowering.PASS.uuid() != base
    assert lowering.PASS.uuid() == base
    assert pass_.backends is backends  # the module the uuid reads


def test_uuid_hashes_the_modules_the_rewrite_depends_on():
    """The hashed sources cover the lowering rules, the oracle, the backends and the op and
    format definitions the rewritten graph calls."""
    from mxfx.lowering import pass_

    files = {Path(f).relative_to(pass_._PACKAGE).as_posix() for f in pass_._source_files()}
    assert {"formats.py", "ops.py", "activation.py"} <= files
    for package in ("lowering", "oracle", "backends"):
        want = {p.relative_to(pass_._PACKAGE).as_posix() for p in (pass_._PACKAGE / package).glob("*.py")}
        assert want and want <= files, package


def gate_and_up_of_two_tensors(a, b):  # even columns of a, odd columns of b
    return F.silu(a[..., ::2]) * b[..., 1::2]


def halves_of_two_tensors(a, b):  # first half of a, second half of b
    return F.silu(a.chunk(2, dim=-1)[0]) * b.chunk(2, dim=-1)[1]


@pytest.mark.parametrize("fn", [gate_and_up_of_two_tensors, halves_of_two_tensors])
def test_gate_and_up_read_from_two_tensors_stay(fn):
    """Gate and up read as the columns (or halves) of two different tensors are not one
    tensor's gated activation: the expression is left as written and keeps eager's output."""
    a, b = probe(), probe() * -0.5 + 1.0
    text, out, ref = lowered(fn, a, b)
    assert close(out, ref)
    assert text == ""


def silu_and_mul_upcast_each(x):  # bf16 halves, each upcast to fp32, the product cast back
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


def test_activation_upcast_per_operand_is_recognised():
    """bf16 gate and up each upcast to fp32 (the product cast back to bf16) is SiLU-and-mul on
    bf16 data: it is confirmed within bf16's tolerance and rewritten, keeping eager's output."""
    text, out, ref = lowered(silu_and_mul_upcast_each, probe(dtype=torch.bfloat16))
    assert close(out, ref)
    assert "'halves', 1, 0, None)" in text and text.count("mxfx.gated_activation") == 1


def silu_times_clamped_up(x):  # up clamped at 0 from below: not the formula's clamp
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up.clamp(min=0.0)


def test_a_clamp_at_zero_is_no_limit_and_stays():
    """SiLU(gate) times up clamped at zero is not a gated activation mxfx computes (zero is no
    limit): compiling it leaves the expression as written and keeps eager's output."""
    text, out, ref = lowered(silu_times_clamped_up, probe())
    assert close(out, ref)
    assert text == ""
