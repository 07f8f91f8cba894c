"""The oracle's inputs: platforms (kinds, archs, native MX, detection on this machine and on a
simulated ROCm device), the quantization keys, and ``MoEConfig`` (its checks, and its mapping
from transformers configs). Selection among backends is in ``test_oracle.py``."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import mxfx
from mxfx.oracle import ActivationQuantKey, MoEConfig, Platform, WeightQuant
from mxfx.oracle.platform import _current
from test_oracle import GFX950_AITER, shape


NATIVE_MX_ROWS = [
    (Platform("cuda", "sm80"), False), (Platform("cuda", "sm89"), False), (Platform("cuda", "sm90"), False),
    (Platform("cuda", "sm100"), True), (Platform("cuda", "sm120"), True), (Platform("cuda", "sm90a"), False),
    (Platform("cuda", "sm100a"), True), (Platform("cuda", "sm120a"), True), (Platform("rocm", "gfx90a"), False),
    (Platform("rocm", "gfx942"), False), (Platform("rocm", "gfx950"), True), (Platform("rocm", "gfx1100"), False),
    (Platform("cpu", "x86_64"), False), (Platform("xpu", "pvc"), False),
]


@pytest.mark.parametrize("platform,native", NATIVE_MX_ROWS, ids=[f"{p.kind}-{p.arch}" for p, _ in NATIVE_MX_ROWS])
def test_native_mx(platform, native):
    assert platform.native_mx is native


def test_platform_is_frozen_and_validated():
    p = Platform("rocm", "gfx950", ["aiter"])
    q = Platform("rocm", "gfx950", frozenset({"aiter"}))
    assert p == q and hash(p) == hash(q) and p != GFX950_AITER
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.kind = "cuda"
    with pytest.raises(ValueError, match="kind: got 'tpu'"):
        Platform("tpu")
    with pytest.raises(TypeError, match="packages"):
        Platform("cpu", "", "triton")


def test_platform_current_on_this_machine():
    p = Platform.current()
    assert p is Platform.current()  # detected once
    assert Platform.current("cpu").kind == "cpu"
    if not torch.cuda.is_available():
        assert p.kind == "cpu"
    with pytest.raises(ValueError, match="device: got meta"):
        Platform.current("meta")


def test_quant_keys_compare_by_value():
    assert WeightQuant("mxfp4") is WeightQuant.MXFP4 and WeightQuant.MXFP4 == "mxfp4"
    assert ActivationQuantKey.MXFP8 in frozenset({"mxfp8"}) and "mxfp8" in frozenset({ActivationQuantKey.MXFP8})
    assert ActivationQuantKey.MXFP4.higher_precision() == (ActivationQuantKey.MXFP8, ActivationQuantKey.NONE)
    assert ActivationQuantKey.NONE.higher_precision() == ()
    a = MoEConfig(8, 64, 32, 2, activation_quant="mxfp8", weight_quant="float")
    b = MoEConfig(8, 64, 32, 2, activation_quant=ActivationQuantKey.MXFP8, weight_quant=WeightQuant.FLOAT)
    assert a == b and hash(a) == hash(b) and isinstance(a.activation_quant, ActivationQuantKey)
    assert str(a.activation_quant) == "mxfp8"


BAD_CONFIG_ROWS = [
    (dict(activation_quant="int8"), ValueError, "activation_quant: got 'int8'"),
    (dict(weight_quant="nvfp4"), ValueError, "weight_quant: got 'nvfp4'"),
    (dict(top_k=0), ValueError, "top_k: got 0"),
    (dict(num_experts=0, top_k=0), ValueError, "num_experts: got 0"),
    (dict(layout="pairs"), ValueError, "layout: got 'pairs'"),
    (dict(dtype=torch.int8), TypeError, "dtype: got torch.int8"),
    (dict(activation_scale_rounding="up"), ValueError, "scale_rounding"),
    (dict(num_experts=True), ValueError, "num_experts: got True"),
    (dict(has_bias=1), TypeError, "has_bias: got 1"),
    (dict(activation_quant="mxfp8", intermediate_size=48), ValueError, "activation_quant: mxfp8"),
    (dict(activation_quant="mxfp8", hidden_size=48), ValueError, "activation_quant: mxfp8"),
    (dict(dtype=torch.float8_e4m3fn), TypeError, "dtype: got torch.float8_e4m3fn"),
    (dict(limit="7"), ValueError, "limit: got '7'"),
]


@pytest.mark.parametrize("kw,exc,match", BAD_CONFIG_ROWS, ids=[str(r[0])[:48] for r in BAD_CONFIG_ROWS])
def test_bad_config_names_the_field(kw, exc, match):
    with pytest.raises(exc, match=match):
        MoEConfig(**{**dict(num_experts=8, hidden_size=64, intermediate_size=32, top_k=2), **kw})


def _hf_rows():
    transformers = pytest.importorskip("transformers")
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    return [
        (transformers.GptOssConfig(), "gpt-oss-120b"),
        (transformers.GptOssConfig(num_local_experts=32, num_hidden_layers=24), "gpt-oss-20b"),
        (transformers.Qwen3MoeConfig(), "Qwen3-30B-A3B"),
        (transformers.MixtralConfig(), "Mixtral-8x7B"),
        (MiniMaxM3VLTextConfig(), "MiniMax-M3"),
        (transformers.MiniMaxM3VLConfig(), "MiniMax-M3"),
    ]


def test_from_hf_config_matches_the_named_shapes():
    for cfg, name in _hf_rows():
        got = MoEConfig.from_hf_config(cfg, activation_quant="mxfp4")
        assert got == shape(name, "mxfp4"), (type(cfg).__name__, got)


# (config class, its defaults' (E, H, I, k)): SiLU-and-mul experts on halves, no bias
HF_SILU_ROWS = [
    ("Qwen3NextConfig", (512, 2048, 512, 10)),
    ("Qwen3_5MoeConfig", (256, 2048, 512, 8)),
    ("MiniMaxConfig", (8, 4096, 14336, 2)),
    ("MiniMaxM2Config", (256, 3072, 1536, 8)),
]


@pytest.mark.parametrize("cls,want", HF_SILU_ROWS, ids=[r[0] for r in HF_SILU_ROWS])
def test_from_hf_config_silu_models(cls, want):
    transformers = pytest.importorskip("transformers")
    got = MoEConfig.from_hf_config(getattr(transformers, cls)(), dtype=torch.float16, weight_quant="float")
    assert (got.num_experts, got.hidden_size, got.intermediate_size, got.top_k) == want
    assert got.activation == mxfx.activation.SILU_AND_MUL and not got.has_bias
    assert (got.dtype, got.weight_quant, got.activation_quant) == (torch.float16, "float", "none")


def test_from_hf_config_refuses_what_it_does_not_know():
    transformers = pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="model_type 'llama'"):
        MoEConfig.from_hf_config(transformers.LlamaConfig())
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        MoEConfig.from_hf_config(transformers.MixtralConfig(hidden_act="gelu"))


def test_platform_arch_must_be_a_string():
    with pytest.raises(TypeError, match="^arch: got 90"):
        Platform("cuda", 90)


def test_rocm_arch_drops_the_target_features(monkeypatch):
    props = types.SimpleNamespace(gcnArchName="gfx950:sramecc+:xnack-")
    monkeypatch.setattr(torch.version, "hip", "7.0", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    _current.cache_clear()
    try:
        p = Platform.current("cuda:0")
    finally:
        _current.cache_clear()
    assert (p.kind, p.arch, p.native_mx) == ("rocm", "gfx950", True)


def test_activation_limit_must_be_a_number():
    with pytest.raises(ValueError, match="^limit: got '7', expected None or a finite number > 0"):
        mxfx.GatedActivation("halves", 1.0, 0.0, "7")


def test_from_hf_config_reads_the_activation_constants_of_the_config():
    """Non-default swiglu constants in a config reach the MoEConfig (gpt-oss checkpoints carry
    ``swiglu_limit``; MiniMax-M3 carries ``swiglu_alpha`` and ``swiglu_limit``)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    gpt = MoEConfig.from_hf_config(transformers.GptOssConfig(swiglu_limit=5.0))
    assert (gpt.layout, gpt.alpha, gpt.beta, gpt.limit) == ("interleaved", 1.702, 1.0, 5.0)
    m3 = MoEConfig.from_hf_config(MiniMaxM3VLTextConfig(swiglu_alpha=1.5, swiglu_limit=6.0))
    assert (m3.layout, m3.alpha, m3.beta, m3.limit) == ("halves", 1.5, 1.0, 6.0)
    m3_vl = MoEConfig.from_hf_config(transformers.MiniMaxM3VLConfig(text_config=dict(swiglu_alpha=1.25)))
    assert m3_vl.alpha == 1.25
