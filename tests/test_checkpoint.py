"""MXFP4 checkpoints (gpt-oss and AMD Quark conventions) written here and loaded packed."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import mxfx
from mxfx import formats
from mxfx.demo import MODELS
from mxfx.nn import LoadedLayer, empty_parameters, load_mxfp4_checkpoint, to_mxfp4
from mxfx.nn.checkpoint import quark_activation_quant, quark_experts
from mxfx.oracle import NoBackendError, Platform, select

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from test_nn import TINY, E, H, I, tiny  # noqa: E402  (the tiny model builders)

PREFIX = "model.layers.0.mlp.experts"
MX = {"qscheme": "per_group", "group_size": 32, "scale_format": "e8m0", "is_dynamic": True}
W_FP4 = {"dtype": "fp4", **MX, "is_dynamic": False}
A_FP4 = {"dtype": "fp4", **MX, "scale_calculation_mode": "even"}
A_FP8 = {"dtype": "fp8_e4m3", **MX}


def zeroed(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every tensor zeroed, so only what a load writes is non-zero."""
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if t.is_floating_point() and t.dim() > 1:
                t.zero_()
    return model


def non_expert_state(model: torch.nn.Module) -> dict:
    return {k: v for k, v in model.state_dict().items() if ".experts." not in k}


@pytest.mark.parametrize("empty", [False, True], ids=["built", "empty_parameters"])
def test_gpt_oss_checkpoint_loads_packed_in_the_gpt_oss_convention(tmp_path, empty):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    source = tiny("gpt-oss")
    experts = source.model.layers[0].mlp.experts
    state = dict(source.state_dict())
    blocks = {}
    for proj in ("gate_up_proj", "down_proj"):
        w = getattr(experts, proj).detach().transpose(1, 2)  # gpt-oss stores [E, K, N]
        packed, scales = formats.quantize(w, "mxfp4", "round_up")
        del state[f"{PREFIX}.{proj}"]
        n, k = w.shape[1:]
        blocks[proj] = (packed.reshape(E, n, k // 32, 16), scales)
        state[f"{PREFIX}.{proj}_blocks"], state[f"{PREFIX}.{proj}_scales"] = blocks[proj]
    state = {k: v.contiguous() for k, v in state.items()}
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))

    if empty:  # parameters on the meta device: the float experts are never allocated
        import transformers

        config = transformers.GptOssConfig(**{**MODELS["gpt-oss"][2], **TINY["gpt-oss"]})
        with empty_parameters():
            target = transformers.GptOssForCausalLM(config).eval()
        assert all(p.device.type == "meta" for p in target.parameters())
    else:
        target = zeroed(tiny("gpt-oss"))
    loaded = load_mxfp4_checkpoint(target, tmp_path)

    assert loaded == [LoadedLayer(PREFIX, "gpt-oss", "none")]
    module = target.model.layers[0].mlp.experts
    # transformers' own gpt-oss dequantizer reads the same weights out of those tensors.
    for proj in ("gate_up_proj", "down_proj"):
        want = convert_moe_packed_tensors(*blocks[proj], dtype=torch.float32)
        assert torch.equal(getattr(module, proj), want), proj
    assert torch.equal(module.gate_up_proj_bias, experts.gate_up_proj_bias)
    assert torch.equal(module.down_proj_bias, experts.down_proj_bias)
    mxfx.quantize_(source)
    for name, t in non_expert_state(source).items():
        assert torch.equal(target.state_dict()[name], t), name
    tokens = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(target(tokens).logits, source(tokens).logits, rtol=0, atol=0)


def write_quark(tmp_path, model, names, input_tensors, layer_quant_config=None) -> dict:
    """``model`` saved as Quark exports MXFP4 experts: one packed Linear per expert and
    projection (gate, up, down named by ``names``), scales rounded "even"; returns the
    canonical (w13, w13_scale, w2, w2_scale) it wrote."""
    experts = model.model.layers[0].mlp.experts
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(f"{PREFIX}.")}
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    parts = {names[0]: gate_up[:, :I], names[1]: gate_up[:, I:], names[2]: down}
    for e in range(E):
        for name, w in parts.items():
            packed, scale = formats.quantize(w[e], "mxfp4", "even")
            state[f"{PREFIX}.{e}.{name}.weight"] = packed
            state[f"{PREFIX}.{e}.{name}.weight_scale"] = scale
    state = {k: v.contiguous() for k, v in state.items()}
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    scheme = {"weight": W_FP4, "input_tensors": input_tensors, "output_tensors": None, "bias": None}
    quantization_config = {
        "quant_method": "quark", "global_quant_config": scheme, "exclude": ["lm_head"],
        "layer_quant_config": layer_quant_config or {},
    }
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quantization_config}))
    return dict(
        zip(("w13", "w13_scale"), formats.quantize(gate_up, "mxfp4", "even")),
        **dict(zip(("w2", "w2_scale"), formats.quantize(down, "mxfp4", "even"))),
    )


@pytest.mark.parametrize(
    "name, names, input_tensors, aq",
    [
        ("qwen3-moe", ("gate_proj", "up_proj", "down_proj"), A_FP4, "mxfp4"),
        ("qwen3-moe", ("gate_proj", "up_proj", "down_proj"), A_FP8, "mxfp8"),
        ("mixtral", ("w1", "w3", "w2"), None, "none"),
    ],
)
def test_quark_checkpoint_loads_packed_with_its_activation_scheme(tmp_path, name, names, input_tensors, aq):
    source = tiny(name)
    written = write_quark(tmp_path, source, names, input_tensors)

    target = zeroed(tiny(name))
    loaded = load_mxfp4_checkpoint(target, tmp_path)

    assert loaded == [LoadedLayer(PREFIX, "quark", aq)]
    module = target.model.layers[0].mlp.experts
    for key, t in written.items():
        assert torch.equal(getattr(module, key), t), key
    assert module.activation_quant == aq and module.activation_scale_rounding == "even"
    for key, t in non_expert_state(source).items():
        assert torch.equal(target.state_dict()[key], t), key
    twin = tiny(name).model.layers[0].mlp.experts
    to_mxfp4(twin, *written.values(), activation_quant=aq)
    x = torch.randn(9, H)
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(9)])
    w = torch.softmax(torch.randn(9, 2), dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(module(x, ids, w), twin(x, ids, w), rtol=0, atol=0)
        target(torch.randint(0, 128, (1, 6)))


def test_w4a4_checkpoint_layer_refuses_the_unfused_backend(tmp_path):
    write_quark(tmp_path, tiny("qwen3-moe"), ("gate_proj", "up_proj", "down_proj"), A_FP4)
    target = tiny("qwen3-moe")
    load_mxfp4_checkpoint(target, tmp_path)
    config = target.model.layers[0].mlp.experts.moe_config()
    assert str(config.activation_quant) == "mxfp4" and config.top_k == 2
    hopper = Platform(kind="cuda", arch="sm90", packages=frozenset({"triton"}))
    with pytest.raises(NoBackendError, match="triton_unfused.*activation"):
        select(config, platform=hopper, backend="triton_unfused")
    mi355 = Platform(kind="rocm", arch="gfx950", packages=frozenset({"triton"}))
    assert select(config, platform=mi355).backend != "triton_unfused"
    weight_only = dataclasses.replace(config, activation_quant="none")
    assert select(weight_only, platform=hopper, backend="triton_unfused").backend == "triton_unfused"


def test_quark_scheme_lookup_and_refusals():
    config = {
        "quant_method": "quark",
        "global_quant_config": {"weight": W_FP4, "input_tensors": A_FP4},
        "layer_quant_config": {"*layers.1.*": {"weight": W_FP4, "input_tensors": None}},
        "exclude": ["*layers.2.*"],
    }
    assert quark_activation_quant(config, "model.layers.0.mlp.experts.0.gate_proj") == ("mxfp4", "even")
    assert quark_activation_quant(config, "model.layers.1.mlp.experts.0.gate_proj") == ("none", "even")
    assert quark_activation_quant(config, "model.layers.2.mlp.experts.0.gate_proj") == ("none", "even")
    def with_input(input_tensors) -> dict:
        return {**config, "global_quant_config": {"weight": W_FP4, "input_tensors": input_tensors}}

    floor = with_input({**A_FP4, "scale_calculation_mode": "floor"})
    assert quark_activation_quant(floor, "x") == ("mxfp4", "floor")
    static_fp8 = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False}
    for bad in (static_fp8, {**A_FP4, "group_size": 16}, {**A_FP4, "scale_calculation_mode": "ceil"}):
        with pytest.raises(ValueError, match="input_tensors scheme"):
            quark_activation_quant(with_input(bad), "x")
    with pytest.raises(ValueError, match="weight scheme"):
        quark_activation_quant({**config, "global_quant_config": {"weight": {**W_FP4, "dtype": "int4"}}}, "x")
    with pytest.raises(ValueError, match="quant_method"):
        quark_activation_quant({"quant_method": "gptq"}, "x")


def test_checkpoint_mismatch_is_an_error(tmp_path):
    source = tiny("mixtral")
    write_quark(tmp_path, source, ("w1", "w3", "w2"), None)
    extra = dict(safetensors_torch.load_file(str(tmp_path / "model.safetensors")))
    extra["model.layers.0.self_attn.q_proj.weight_scale"] = torch.zeros(4, dtype=torch.uint8)
    safetensors_torch.save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="keys the model does not take.*q_proj.weight_scale"):
        load_mxfp4_checkpoint(tiny("mixtral"), tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="quantization_config"):
        load_mxfp4_checkpoint(tiny("mixtral"), tmp_path)


def _quark_tensors(bias: bool) -> dict:
    """Quark's per-expert packed Linears (gate_proj, up_proj, down_proj), with biases or not."""
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for e in range(E):
        for name, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            key = f"{PREFIX}.{e}.{name}"
            w = torch.randn(n, k, generator=g)
            tensors[f"{key}.weight"], tensors[f"{key}.weight_scale"] = formats.quantize(w, "mxfp4", "even")
            if bias:
                tensors[f"{key}.bias"] = torch.randn(n, generator=g)
    return tensors


def test_quark_experts_biases_follow_gate_then_up_and_all_or_none():
    """Quark's per-expert biases stack as the weights do (gate, then up), and a bias that only
    some experts have is an error."""
    tensors = _quark_tensors(bias=True)
    weights = quark_experts(tensors, PREFIX, E)

    def stacked(name):
        return torch.stack([tensors[f"{PREFIX}.{e}.{name}.bias"] for e in range(E)])

    assert torch.equal(weights.w13_bias, torch.cat((stacked("gate_proj"), stacked("up_proj")), dim=1))
    assert torch.equal(weights.w2_bias, stacked("down_proj"))
    del tensors[f"{PREFIX}.2.up_proj.bias"]
    with pytest.raises(ValueError, match="present for some experts and not others"):
        quark_experts(tensors, PREFIX, E)


def test_quark_scheme_refuses_static_and_e5m2_activations_and_takes_the_first_pattern():
    """Static MX activations and fp8_e5m2 ones (mxfp8 is e4m3) are refused, not run as dynamic
    e4m3; of several matching ``layer_quant_config`` patterns the first decides."""
    def with_input(input_tensors) -> dict:
        return {"quant_method": "quark", "global_quant_config": {"weight": W_FP4, "input_tensors": input_tensors}}

    for bad in ({**A_FP8, "is_dynamic": False}, {**A_FP8, "dtype": "fp8_e5m2"}):
        with pytest.raises(ValueError, match="input_tensors scheme"):
            quark_activation_quant(with_input(bad), "model.layers.0.mlp.experts.0.gate_proj")
    config = {
        **with_input(A_FP4),
        "layer_quant_config": {
            "*experts.0.*": {"weight": W_FP4, "input_tensors": A_FP8},
            "*gate_proj": {"weight": W_FP4, "input_tensors": None},
        },
    }
    assert quark_activation_quant(config, "model.layers.0.mlp.experts.0.gate_proj") == ("mxfp8", "even")


def test_quark_layer_config_by_exact_linear_name(tmp_path):
    """A layer's scheme is looked up by its expert-0 gate Linear's full name, so an exact-name
    ``layer_quant_config`` entry (as Quark writes them) applies."""
    override = {f"{PREFIX}.0.gate_proj": {"weight": W_FP4, "input_tensors": None}}
    write_quark(tmp_path, tiny("qwen3-moe"), ("gate_proj", "up_proj", "down_proj"), A_FP8, override)
    assert load_mxfp4_checkpoint(tiny("qwen3-moe"), tmp_path) == [LoadedLayer(PREFIX, "quark", "none")]


def test_checkpoint_lacking_a_model_tensor_is_an_error(tmp_path):
    """A checkpoint without one of the model's tensors is an error under ``strict`` (the
    tensor would keep the value it was built with); ``strict=False`` loads the rest."""
    write_quark(tmp_path, tiny("mixtral"), ("w1", "w3", "w2"), None)
    state = dict(safetensors_torch.load_file(str(tmp_path / "model.safetensors")))
    del state["model.norm.weight"]
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model tensors not in the checkpoint.*model.norm.weight"):
        load_mxfp4_checkpoint(tiny("mixtral"), tmp_path)
    target = zeroed(tiny("mixtral"))
    assert load_mxfp4_checkpoint(target, tmp_path, strict=False) == [LoadedLayer(PREFIX, "quark", "none")]
    assert torch.equal(target.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                       state["model.layers.0.self_attn.q_proj.weight"])


def test_gpt_oss_checkpoint_without_the_model_biases_is_an_error():
    """Experts with biases do not load a gpt-oss checkpoint that lacks them (the biases would
    keep the values they were built with)."""
    source = tiny("gpt-oss")
    experts = source.model.layers[0].mlp.experts
    state = dict(source.state_dict())
    for proj in ("gate_up_proj", "down_proj"):
        w = getattr(experts, proj).detach().transpose(1, 2)
        packed, scales = formats.quantize(w, "mxfp4", "round_up")
        n, k = w.shape[1:]
        del state[f"{PREFIX}.{proj}"], state[f"{PREFIX}.{proj}_bias"]
        state[f"{PREFIX}.{proj}_blocks"] = packed.reshape(E, n, k // 32, 16)
        state[f"{PREFIX}.{proj}_scales"] = scales
    with pytest.raises(ValueError, match="gate_up_proj_bias: the model has this bias but the checkpoint lacks it"):
        load_mxfp4_checkpoint(tiny("gpt-oss"), state)
