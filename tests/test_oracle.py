"""The backend oracle on simulated platforms, and the eager op going through it (the oracle's
inputs, platforms, quantization keys and MoEConfig, are in ``test_oracle_config.py``)."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import mxfx
from mxfx import backends
from mxfx.__main__ import main as cli
from mxfx.backends import emulation
from mxfx.backends.base import Backend, Capabilities
from mxfx.moe_call import ActivationQuant, MoEWeights
from mxfx.oracle import (
    PRIORITY,
    MoEConfig,
    NoBackendError,
    Platform,
    clear_cache,
    explain,
    select,
    supports,
)
from mxfx.oracle.shapes import SHAPES

ENV = "MXFX_MOE_BACKEND"
GFX950 = Platform("rocm", "gfx950", frozenset({"triton"}))
GFX950_AITER = Platform("rocm", "gfx950", frozenset({"triton", "aiter"}))
GFX942_AITER = Platform("rocm", "gfx942", frozenset({"triton", "aiter"}))
SM90 = Platform("cuda", "sm90", frozenset({"triton"}))
SM90_NO_TRITON = Platform("cuda", "sm90")
CPU = Platform("cpu", "x86_64", frozenset({"triton"}))
XPU = Platform("xpu", "pvc", frozenset({"triton"}))


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    mxfx.configure()
    clear_cache()
    yield
    mxfx.configure()
    clear_cache()


def shape(name: str, aq: str = "none", **kw) -> MoEConfig:
    return dataclasses.replace(SHAPES[name], activation_quant=aq, **kw)


def executes(name: str, aq: str) -> bool:
    return aq in backends.get(name).capabilities.activation_quant


# ------------------------------------------------------------------------- selection


def _fused_a4_else_emulation() -> str:
    return "triton" if executes("triton", "mxfp4") else "emulation"


def _a8_backend_on_sm90() -> str:
    return "triton" if executes("triton", "mxfp8") else "emulation"


# (id, platform, config, settings for configure, env, expected backend)
SELECT_ROWS = [
    ("cuda-sm90-gpt-oss-W4A16", SM90, shape("gpt-oss-120b"), {}, None, "triton"),
    ("cuda-sm90-gpt-oss-20b-W4A16", SM90, shape("gpt-oss-20b"), {}, None, "triton"),
    ("cuda-sm90-float-weights", SM90, shape("Mixtral-8x7B", weight_quant="float"), {}, None, "triton"),
    ("cuda-sm90-no-triton", SM90_NO_TRITON, shape("gpt-oss-120b"), {}, None, "emulation"),
    ("cuda-sm90-float64", SM90, shape("Qwen3-30B-A3B", dtype=torch.float64), {}, None, "emulation"),
    ("cuda-sm90-W4A8", SM90, shape("gpt-oss-120b", "mxfp8"), {}, None, _a8_backend_on_sm90()),
    ("rocm-gfx950-W4A16", GFX950, shape("MiniMax-M3"), {}, None, "triton"),
    ("rocm-gfx950-W4A4-no-aiter", GFX950, shape("MiniMax-M3", "mxfp4"), {}, None, _fused_a4_else_emulation()),
    ("rocm-gfx950-aiter-W4A4-unverified", GFX950_AITER, shape("Qwen3-30B-A3B", "mxfp4"), {}, None,
     _fused_a4_else_emulation()),
    ("cpu-gpt-oss", CPU, shape("gpt-oss-120b"), {}, None, "emulation"),
    ("cpu-minimax-W4A4", CPU, shape("MiniMax-M3", "mxfp4"), {}, None, "emulation"),
    ("cpu-mixtral-W4A8", CPU, shape("Mixtral-8x7B", "mxfp8"), {}, None, "emulation"),
    ("xpu-falls-to-emulation", XPU, shape("gpt-oss-20b"), {}, None, "emulation"),
    ("env-override", SM90, shape("gpt-oss-120b"), {}, "emulation", "emulation"),
    ("env-auto-is-auto", SM90, shape("gpt-oss-120b"), {}, "auto", "triton"),
    ("configure-beats-env", SM90, shape("gpt-oss-120b"), {"moe_backend": "triton_unfused"}, "emulation",
     "triton_unfused"),
    ("opt-in-does-not-change-A16", SM90, shape("gpt-oss-120b"), {"allow_higher_precision_activations": True},
     None, "triton"),
]


@pytest.mark.parametrize("platform,config,conf,env,want", [r[1:] for r in SELECT_ROWS],
                         ids=[r[0] for r in SELECT_ROWS])
def test_select(monkeypatch, platform, config, conf, env, want):
    if env is not None:
        monkeypatch.setenv(ENV, env)
    mxfx.configure(**conf)
    d = select(config, platform)
    assert d.backend == want, str(d)
    assert not d.higher_precision
    assert d.activation_quant == config.activation_quant
    assert ok(want, config, platform)
    for name, reason in d.rejected:
        assert reason and not supports(backends.get(name), config, platform)[0]
    # auto never takes a backend that does not execute the activation quantization
    assert executes(d.backend, str(config.activation_quant))


def ok(name, config, platform):
    return supports(backends.get(name), config, platform)[0]


def test_rocm_w4a4_never_unfused_and_its_reason_names_activation_quant():
    config = shape("MiniMax-M3", "mxfp4")
    d = select(config, GFX950)
    assert d.backend != "triton_unfused"
    reasons = dict(d.rejected)
    assert "activation_quant=mxfp4" in reasons["triton_unfused"]
    assert "higher-precision activations" in reasons["triton_unfused"]
    assert "triton_unfused" in str(d) and "activation_quant=mxfp4" in str(d)


# (id, platform, config, backend argument, configure kwargs, env, words the error must contain)
REFUSED_ROWS = [
    ("explicit-unfused-W4A4", GFX950, shape("MiniMax-M3", "mxfp4"), "triton_unfused", {}, None,
     ["triton_unfused", "activation_quant=mxfp4", "the backend argument"]),
    ("configured-unfused-W4A8", SM90, shape("Qwen3-30B-A3B", "mxfp8"), "auto",
     {"moe_backend": "triton_unfused"}, None, ["triton_unfused", "activation_quant=mxfp8", "configure"]),
    ("env-unfused-W4A4", GFX950, shape("MiniMax-M3", "mxfp4"), "auto", {}, "triton_unfused",
     ["triton_unfused", "activation_quant=mxfp4", ENV]),
    ("explicit-triton-on-cpu", CPU, shape("gpt-oss-20b"), "triton", {}, None, ["triton", "platform=cpu"]),
    ("explicit-triton-without-package", SM90_NO_TRITON, shape("gpt-oss-20b"), "triton", {}, None,
     ["packages", "triton"]),
    ("explicit-aiter-on-gfx942", GFX942_AITER, shape("Qwen3-30B-A3B", "mxfp4"), "aiter", {}, None,
     ["arch=gfx942", "gfx950"]),
    ("explicit-aiter-unverified", GFX950_AITER, shape("Qwen3-30B-A3B", "mxfp4"), "aiter", {}, None,
     ["not verified by mxfx"]),
    ("explicit-aiter-bias", GFX950_AITER, shape("gpt-oss-20b", "mxfp4"), "aiter", {}, None,
     ["has_bias=True", "layout=interleaved"]),
    ("argument-beats-configure", SM90, shape("gpt-oss-20b", "mxfp4"), "triton_unfused",
     {"moe_backend": "emulation"}, None, ["triton_unfused", "activation_quant=mxfp4"]),
]


@pytest.mark.parametrize("platform,config,backend,conf,env,words", [r[1:] for r in REFUSED_ROWS],
                         ids=[r[0] for r in REFUSED_ROWS])
def test_explicit_request_is_honoured_or_raises(monkeypatch, platform, config, backend, conf, env, words):
    if env is not None:
        monkeypatch.setenv(ENV, env)
    mxfx.configure(**conf)
    with pytest.raises(NoBackendError) as e:
        select(config, platform, backend)
    assert len(e.value.rejected) == 1  # only the requested backend: no fall-through
    for word in words:
        assert word in str(e.value)


def test_explicit_request_that_fits_is_used():
    d = select(shape("gpt-oss-20b"), SM90, "emulation")
    assert (d.backend, d.requested, d.considered) == ("emulation", "emulation", ("emulation",))


def test_opt_in_runs_a16_for_w4a4_logs_a_warning_and_records_it(caplog):
    config = shape("MiniMax-M3", "mxfp4")
    mxfx.configure(moe_backend="triton_unfused", allow_higher_precision_activations=True)
    with caplog.at_level(logging.INFO, logger="mxfx"):
        d = select(config, GFX950)
    assert d.backend == "triton_unfused"
    assert d.higher_precision and d.activation_quant == "none"
    assert "higher precision" in str(d)
    warnings = [r for r in caplog.records if r.name == "mxfx" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "activations run as none" in warnings[0].getMessage()


def test_opt_in_auto_takes_the_first_backend_in_priority_order():
    mxfx.configure(allow_higher_precision_activations=True)
    d = select(shape("MiniMax-M3", "mxfp4"), GFX950)
    assert d.backend == "triton"
    # the nearest higher precision the backend executes exactly
    want = "mxfp8" if executes("triton", "mxfp8") else "none"
    assert d.activation_quant == ("mxfp4" if executes("triton", "mxfp4") else want)


def test_opt_in_never_overrides_other_reasons():
    mxfx.configure(moe_backend="triton", allow_higher_precision_activations=True)
    with pytest.raises(NoBackendError, match="platform=cpu"):
        select(shape("MiniMax-M3", "mxfp4"), CPU)


def test_nothing_fits_lists_every_candidate_and_reason(monkeypatch):
    # A ROCm box where neither Triton nor aiter imports, with the reference taken away.
    monkeypatch.setitem(PRIORITY, "rocm", ("aiter", "triton", "triton_unfused"))
    with pytest.raises(NoBackendError) as e:
        select(shape("MiniMax-M3", "mxfp4"), Platform("rocm", "gfx950"))
    assert [n for n, _ in e.value.rejected] == ["aiter", "triton", "triton_unfused"]
    message = str(e.value)
    assert message.startswith("no MoE backend can run E=128 H=6144")
    for name, reason in e.value.rejected:
        assert f"  {name}: {reason}" in message
    assert "packages: needs ['aiter']" in message and "packages: needs ['triton']" in message
    assert "activation_quant=mxfp4" in dict(e.value.rejected)["triton_unfused"]


# (id, where the name is given, call)
UNKNOWN_ROWS = [
    ("select-argument", "backend", lambda: select(shape("gpt-oss-20b"), CPU, "tritonn")),
    ("configure", "moe_backend", lambda: mxfx.configure(moe_backend="tritonn")),
    ("env", ENV, lambda: select(shape("gpt-oss-20b"), CPU)),
]


@pytest.mark.parametrize("argument,call", [r[1:] for r in UNKNOWN_ROWS], ids=[r[0] for r in UNKNOWN_ROWS])
def test_unknown_backend_name_lists_valid_names(monkeypatch, argument, call):
    monkeypatch.setenv(ENV, "tritonn")
    with pytest.raises(ValueError) as e:
        call()
    message = str(e.value)
    assert message.startswith(f"{argument}: got 'tritonn'")
    for name in ("triton", "triton_unfused", "emulation", "aiter"):
        assert repr(name) in message


def test_decisions_are_cached_and_logged_once(caplog, monkeypatch):
    config = shape("gpt-oss-120b")
    with caplog.at_level(logging.INFO, logger="mxfx"):
        first = select(config, SM90)
        assert select(dataclasses.replace(config), SM90) is first  # equal config: a cache hit
        assert explain(config, SM90) is first
        infos = [r for r in caplog.records if r.name == "mxfx"]
        assert len(infos) == 1 and infos[0].levelno == logging.INFO and "triton" in infos[0].getMessage()
        monkeypatch.setenv(ENV, "emulation")  # settings are part of the key
        assert select(config, SM90).backend == "emulation"
        monkeypatch.delenv(ENV)
        assert select(config, SM90) is first
        assert select(config, GFX950) is not first  # so is the platform
    assert len([r for r in caplog.records if r.name == "mxfx"]) == 3


def test_decision_table_names_every_candidate():
    d = select(shape("MiniMax-M3", "mxfp8"), GFX950_AITER)
    text = str(d)
    assert d.considered == ("aiter", "triton", "triton_unfused", "emulation")
    for name, reason in d.rejected:
        assert name in text and reason in text
    assert f"\n  {d.backend:<14}  chosen" in text
    for name in d.considered[d.considered.index(d.backend) + 1:]:
        status = f"rejected: {dict(d.rejected)[name]}" if name in dict(d.rejected) else "eligible, lower priority"
        assert f"\n  {name:<14}  {status}" in text
    assert isinstance(d.rejected, list) and all(isinstance(r, tuple) and len(r) == 2 for r in d.rejected)


def test_explain_uses_this_machine():
    d = mxfx.explain(shape("Mixtral-8x7B"))
    assert d.platform == Platform.current()


# ------------------------------------------------------------------------- registry


class _Recorder(Backend):
    """A third-party backend for the CPU that records its calls and delegates to emulation."""

    name = "recorder"
    capabilities = Capabilities(
        platforms=frozenset({"cpu"}),
        weight_quant=frozenset({"mxfp4"}),
        activation_quant=frozenset({"none"}),
        dtypes=frozenset({torch.float32}),
        bias=False,
        hidden_align=64,
    )

    def __init__(self):
        self.calls = []

    def run(self, x, topk_weights, topk_ids, weights, act, aq):
        self.calls.append(aq)
        return emulation.moe(x, topk_weights, topk_ids, weights, act, aq)


@pytest.fixture
def recorder():
    backend = _Recorder()
    backends.register(backend)
    yield backend
    backends.unregister(backend.name)


def test_registered_backend_is_tried_first_where_it_fits(recorder):
    fits = MoEConfig(4, 64, 32, 2, dtype=torch.float32)
    assert select(fits, CPU).backend == "recorder"
    assert "recorder" in backends.names()
    d = select(dataclasses.replace(fits, hidden_size=96), CPU)
    assert d.backend == "emulation"
    assert dict(d.rejected)["recorder"] == "hidden_size=96: needs a multiple of 64"
    with pytest.raises(ValueError, match="new name"):
        backends.register(_Recorder())
    with pytest.raises(ValueError, match="new name"):
        backends.register(type("T", (_Recorder,), {"name": "triton"})())


def test_unregistered_backend_is_gone(recorder):
    backends.unregister("recorder")
    with pytest.raises(ValueError, match="'recorder'"):
        select(MoEConfig(4, 64, 32, 2, dtype=torch.float32), CPU, "recorder")
    backends.register(recorder)


# ------------------------------------------------------------------------- the eager op


def _moe_inputs(dtype=torch.float32, bias=False):
    g = torch.Generator().manual_seed(0)
    E, H, I, T, k = 4, 64, 32, 5, 2
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    p13, s13 = mxfx.formats.quantize(w13, "mxfp4", "round_up")
    p2, s2 = mxfx.formats.quantize(w2, "mxfp4", "round_up")
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    tw = torch.softmax(torch.randn(T, k, generator=g), -1)
    b13 = torch.randn(E, 2 * I, generator=g) if bias else None
    return x, tw, ids, p13, s13, b13, p2, s2, None


def _reference(args, aq="none"):
    x, tw, ids, p13, s13, b13, p2, s2, b2 = args
    weights = MoEWeights(p13, s13, b13, p2, s2, b2)
    act = mxfx.GatedActivation("halves", 1.0, 0.0, None)
    return emulation.moe(x, tw, ids, weights, act, ActivationQuant(aq, "even"))


# (id, backend argument, configure kwargs, env, activation_quant, error type and words, or None)
OP_ROWS = [
    ("auto", "auto", {}, None, "mxfp4", None),
    ("explicit-emulation", "emulation", {}, None, "mxfp8", None),
    ("explicit-triton-on-cpu", "triton", {}, None, "none", (NoBackendError, "platform=cpu")),
    ("configured-triton-on-cpu", "auto", {"moe_backend": "triton"}, None, "none", (NoBackendError, "platform=cpu")),
    ("env-triton-on-cpu", "auto", {}, "triton_unfused", "none", (NoBackendError, ENV)),
    ("argument-beats-env", "emulation", {}, "triton", "none", None),
    ("unknown-name", "tritonn", {}, None, "none", (ValueError, "backend: got 'tritonn'")),
]


@pytest.mark.parametrize("backend,conf,env,aq,error", [r[1:] for r in OP_ROWS], ids=[r[0] for r in OP_ROWS])
def test_eager_op_goes_through_the_selector(monkeypatch, backend, conf, env, aq, error):
    if env is not None:
        monkeypatch.setenv(ENV, env)
    mxfx.configure(**conf)
    args = _moe_inputs()
    call = lambda: torch.ops.mxfx.moe(*args, "halves", 1.0, 0.0, None, aq, backend)  # noqa: E731
    if error is None:
        torch.testing.assert_close(call(), _reference(args, aq), rtol=0, atol=0)
    else:
        with pytest.raises(error[0], match=error[1]):
            call()


def test_eager_op_runs_the_chosen_backend_and_follows_settings(recorder):
    args = _moe_inputs()
    out = torch.ops.mxfx.moe(*args)
    assert len(recorder.calls) == 1
    torch.testing.assert_close(out, _reference(args), rtol=0, atol=0)
    torch.ops.mxfx.moe(*args)
    assert len(recorder.calls) == 2  # the cached path runs the same backend
    mxfx.configure(moe_backend="emulation")
    torch.ops.mxfx.moe(*args)
    assert len(recorder.calls) == 2
    mxfx.configure()
    torch.ops.mxfx.moe(*_moe_inputs(bias=True))  # the recorder takes no biases
    assert len(recorder.calls) == 2


def test_eager_op_passes_the_executed_activation_quant_on_opt_in(recorder):
    args = _moe_inputs()
    with pytest.raises(NoBackendError, match="activation_quant=mxfp4"):
        torch.ops.mxfx.moe(*args, "halves", 1.0, 0.0, None, "mxfp4", "recorder")
    mxfx.configure(allow_higher_precision_activations=True)
    out = torch.ops.mxfx.moe(*args, "halves", 1.0, 0.0, None, "mxfp4", "recorder")
    assert [aq.fmt for aq in recorder.calls] == ["none"]
    torch.testing.assert_close(out, _reference(args, "none"), rtol=0, atol=0)


# ------------------------------------------------------------------------- doctor


def test_doctor_on_this_machine(capsys):
    assert cli(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and str(Platform.current()) in out
    for name in SHAPES:
        assert f"{name}: " in out
    assert out.count("A=mxfp4 -> ") == len(SHAPES) and "NO BACKEND" not in out


def test_doctor_on_simulated_gfx950(capsys):
    assert cli(["doctor", "--platform", "rocm:gfx950", "--packages", "triton,aiter"]) == 0
    out = capsys.readouterr().out
    assert "rocm gfx950 (native MX; optional packages: aiter, triton) (simulated)" in out
    minimax = out.split("MiniMax-M3:")[1].split("\n\n")[0]
    a4 = minimax.split("A=mxfp4 -> ")[1].split("\n  A=")[0]
    assert a4.startswith(_fused_a4_else_emulation())
    assert "triton_unfused: activation_quant=mxfp4" in a4
    assert "aiter: not verified by mxfx" in a4


# ---------------------------------------------------------------- reasons, cache keys, settings


def test_wrong_platform_is_the_only_platform_reason():
    p = Platform("cuda", "sm100", frozenset({"triton", "aiter"}))
    ok, reason = supports(backends.get("aiter"), shape("Qwen3-30B-A3B", "mxfp4"), p)
    assert not ok
    assert reason == "platform=cuda: runs only on ['rocm']"


def test_activation_quant_reason_has_no_hint_when_no_higher_precision_is_executed():
    # aiter executes only mxfp4: an A16 layer gets the plain reason, and extra_check ("not
    # verified") is not asked because a declared field already failed.
    ok, reason = supports(backends.get("aiter"), shape("Qwen3-30B-A3B"), GFX950_AITER)
    assert not ok
    assert reason == "activation_quant=none: executes only ['mxfp4']"


class _Declared(Backend):
    """A third-party CPU backend whose capabilities a test sets; it never runs."""

    def __init__(self, name, **caps):
        self.name = name
        base = dict(platforms=frozenset({"cpu"}), weight_quant=frozenset({"mxfp4"}),
                    activation_quant=frozenset({"none"}), dtypes=frozenset({torch.float32}))
        self.capabilities = Capabilities(**{**base, **caps})

    def run(self, x, topk_weights, topk_ids, weights, act, aq):
        raise AssertionError("not run by these tests")


@pytest.fixture
def declared():
    added = []

    def add(name, **caps):
        backend = _Declared(name, **caps)
        backends.register(backend)
        added.append(name)
        return backend

    yield add
    for name in added:
        backends.unregister(name)


def test_intermediate_align_is_checked(declared):
    declared("aligned", intermediate_align=64)
    d = select(MoEConfig(4, 64, 32, 2, dtype=torch.float32), CPU)
    assert d.backend == "emulation"
    assert dict(d.rejected)["aligned"] == "intermediate_size=32: needs a multiple of 64"
    assert select(MoEConfig(4, 64, 128, 2, dtype=torch.float32), CPU).backend == "aligned"


def test_weight_quant_is_checked(recorder):
    d = select(MoEConfig(4, 64, 32, 2, dtype=torch.float32, weight_quant="float"), CPU)
    assert d.backend == "emulation"
    assert dict(d.rejected)["recorder"] == "weight_quant=float: executes only ['mxfp4']"


def test_opt_in_takes_the_nearest_higher_precision(declared):
    declared("a8", activation_quant=frozenset({"none", "mxfp8"}))
    mxfx.configure(allow_higher_precision_activations=True)
    d = select(MoEConfig(4, 64, 32, 2, dtype=torch.float32, activation_quant="mxfp4"), CPU)
    assert (d.backend, d.activation_quant, d.higher_precision) == ("a8", "mxfp8", True)
    assert "activations run as mxfp8, not the checkpoint's mxfp4" in d.summary()


def test_opt_in_setting_is_part_of_the_cache_key(recorder):
    config = MoEConfig(4, 64, 32, 2, dtype=torch.float32, activation_quant="mxfp4")
    assert select(config, CPU).backend == "emulation"
    mxfx.configure(allow_higher_precision_activations=True)
    d = select(config, CPU)
    assert (d.backend, d.activation_quant) == ("recorder", "none")


def test_registering_a_backend_invalidates_cached_decisions():
    config = MoEConfig(4, 64, 32, 2, dtype=torch.float32)
    assert select(config, CPU).backend == "emulation"
    backends.register(_Recorder())
    try:
        assert select(config, CPU).backend == "recorder"
    finally:
        backends.unregister("recorder")
    assert select(config, CPU).backend == "emulation"


def test_xpu_considers_triton_and_says_why_not():
    d = select(shape("gpt-oss-20b"), XPU)
    assert d.considered == ("triton", "emulation")
    assert dict(d.rejected)["triton"] == "platform=xpu: runs only on ['cuda', 'rocm']"


@pytest.mark.parametrize("value", ["false", 1, None])
def test_configure_opt_in_must_be_a_bool(value):
    with pytest.raises(TypeError, match="^allow_higher_precision_activations: got"):
        mxfx.configure(allow_higher_precision_activations=value)
    assert not mxfx.oracle.settings.current().allow_higher_precision_activations


def test_empty_env_is_auto(monkeypatch):
    monkeypatch.setenv(ENV, "")
    d = select(shape("gpt-oss-120b"), SM90)
    assert (d.backend, d.requested, d.source) == ("triton", "auto", "auto")


def test_eager_op_follows_a_later_env_change(monkeypatch):
    args = _moe_inputs()
    torch.testing.assert_close(torch.ops.mxfx.moe(*args), _reference(args), rtol=0, atol=0)
    monkeypatch.setenv(ENV, "triton")
    with pytest.raises(NoBackendError, match=ENV):
        torch.ops.mxfx.moe(*args)


def test_summary_says_how_the_backend_was_chosen():
    assert select(shape("gpt-oss-20b"), SM90).summary().endswith(": triton (auto)")
    explicit = select(shape("gpt-oss-20b"), SM90, "emulation").summary()
    assert explicit.endswith(": emulation (requested by the backend argument)")


def test_decision_table_shows_the_chosen_backends_note():
    d = select(shape("gpt-oss-20b"), CPU)
    note = backends.get("emulation").capabilities.note
    assert d.note == note and f"emulation  chosen; {note}" in str(d)


def test_eager_op_w2_bias_alone_counts_as_bias(recorder):
    x, tw, ids, p13, s13, _, p2, s2, _ = _moe_inputs()
    b2 = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    out = torch.ops.mxfx.moe(x, tw, ids, p13, s13, None, p2, s2, b2)
    assert recorder.calls == []  # emulation ran it
    want = emulation.moe(x, tw, ids, MoEWeights(p13, s13, None, p2, s2, b2),
                         mxfx.GatedActivation("halves", 1.0, 0.0, None), ActivationQuant("none", "even"))
    torch.testing.assert_close(out, want, rtol=0, atol=0)


class _NoIdCheck(_Recorder):
    """Like the recorder, but runs no expert-id check of its own (as a GPU kernel would not)."""

    name = "no_id_check"

    def run(self, x, topk_weights, topk_ids, weights, act, aq):
        self.calls.append(aq)
        return torch.zeros_like(x)


def test_eager_op_rejects_id_equal_to_e_before_any_backend_runs():
    backend = _NoIdCheck()
    backends.register(backend)
    try:
        x, tw, ids, p13, s13, b13, p2, s2, b2 = _moe_inputs()
        ids[1, 0] = 4  # E = 4
        with pytest.raises(ValueError, match="^topk_ids: expert id 4 out of range"):
            torch.ops.mxfx.moe(x, tw, ids, p13, s13, b13, p2, s2, b2)
        assert backend.calls == []
    finally:
        backends.unregister(backend.name)


def test_unfused_declares_float32():
    config = shape("Mixtral-8x7B", dtype=torch.float32)
    assert supports(backends.get("triton_unfused"), config, SM90) == (True, "")
    mxfx.configure(moe_backend="triton_unfused")
    assert select(config, SM90).backend == "triton_unfused"


def test_doctor_says_when_activations_run_at_higher_precision(capsys):
    """With allow_higher_precision_activations, a backend that does not execute a layer's
    activation quantization may still be chosen; the doctor says so beside the choice."""
    mxfx.configure(moe_backend="triton_unfused", allow_higher_precision_activations=True)
    assert cli(["doctor", "--platform", "cuda:sm90", "--packages", "triton"]) == 0
    out = capsys.readouterr().out
    mixtral = out.split("Mixtral-8x7B:")[1].split("\n\n")[0]
    assert "A=none  -> triton_unfused\n" in mixtral
    assert "A=mxfp8 -> triton_unfused (runs activations as none: higher precision)" in mixtral
    assert "A=mxfp4 -> triton_unfused (runs activations as none: higher precision)" in mixtral
