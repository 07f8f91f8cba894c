"""MXFP4 storage for the experts of a MoE model, and the experts protocol mxfx converts.

**The experts protocol.** mxfx converts any ``nn.Module`` that holds its experts the way
transformers 5.x does (``GptOssExperts``, ``Qwen3MoeExperts``, ``MixtralExperts``,
``MiniMax*Experts`` all do):

- ``gate_up_proj``: an ``nn.Parameter``, float, ``[E, 2I, H]`` — or ``[E, H, 2I]`` when the
  module has ``is_transposed = True`` (gpt-oss). Gate and up are either interleaved along 2I
  (gpt-oss) or the two halves (everyone else); mxfx keeps whatever order the model uses.
- ``down_proj``: an ``nn.Parameter``, float, ``[E, H, I]`` — or ``[E, I, H]`` when transposed.
- optional ``gate_up_proj_bias [E, 2I]`` and ``down_proj_bias [E, H]``; they stay float.
- ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` reads
  the weights as ``self.gate_up_proj`` / ``self.down_proj`` on every call (no cached copies).
- the gated activation is recognised for the transformers classes above; any other module
  declares it as ``mxfx_activation = mxfx.GatedActivation(layout, alpha, beta, limit)``.
  It is needed only to describe the layer to the oracle (:meth:`MXFP4Experts.moe_config`)
  and for activation-quantized layers.

**What conversion does.** The float parameters are replaced by MXFP4 buffers in the
canonical layout (``w13 uint8 [E, 2I, H/2]`` + ``w13_scale uint8 [E, 2I, H/32]``,
``w2 uint8 [E, H, I/2]`` + ``w2_scale uint8 [E, H, I/32]``) and the module's class becomes a
subclass of itself and :class:`MXFP4Experts`, whose ``gate_up_proj`` / ``down_proj`` are
properties returning ``torch.ops.mxfx.dequantize_mx(...)`` viewed back to the original layout.
So the model's own forward runs unchanged in eager mode (it dequantizes on every call: right,
and slow), and under ``torch.compile`` with mxfx enabled the lowering sees ``dequantize_mx``
feeding the expert matmuls and rewrites the block into one ``mxfx.moe`` on the packed weights.

**Activation-quantized layers** (W4A8 / W4A4 checkpoints, ``activation_quant`` "mxfp8" or
"mxfp4") do not run the model's forward: the model's expert loops have no place where the
activation entering the down projection could be quantized. Their forward is one call
``torch.ops.mxfx.moe(..., activation_quant, backend="auto")``, so every GEMM input is
quantized as the checkpoint was calibrated — in eager mode and compiled alike — and the oracle
picks, at call time, only a backend that executes that quantization.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from mxfx import formats
from mxfx import ops  # noqa: F401  (registers torch.ops.mxfx)
from mxfx.activation import GPT_OSS, SILU_AND_MUL, GatedActivation, minimax_m3
from mxfx.ops import ACTIVATION_QUANTS
from mxfx.oracle import MoEConfig

_WEIGHTS = ("gate_up_proj", "down_proj")


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` follows the experts protocol and still holds float weights."""
    params = module._parameters
    return all(
        isinstance(params.get(name), nn.Parameter)
        and params[name].dim() == 3
        and params[name].is_floating_point()
        for name in _WEIGHTS
    )


def expert_activation(module: nn.Module) -> Optional[GatedActivation]:
    """The gated activation of an experts module, or None when mxfx cannot tell.

    ``mxfx_activation`` wins; otherwise the transformers classes are recognised: gpt-oss
    (``alpha``/``limit``, interleaved, β=1), MiniMax-M3 (``swiglu_alpha``/``swiglu_limit``,
    halves, β=1), and SiLU-and-mul for modules whose gate is transformers' default
    (``act_fn(gate) * up`` with ``act_fn`` SiLU).
    """
    declared = getattr(module, "mxfx_activation", None)
    if declared is not None:
        if not isinstance(declared, GatedActivation):
            raise TypeError(
                f"mxfx_activation: got {type(declared).__name__}, expected mxfx.GatedActivation"
            )
        return declared
    names = {cls.__name__ for cls in type(module).__mro__}
    if "GptOssExperts" in names:
        return GatedActivation(GPT_OSS.layout, float(module.alpha), 1.0, float(module.limit))
    if "MiniMaxM3VLExperts" in names:
        return minimax_m3(float(module.swiglu_alpha), 1.0, float(module.swiglu_limit))
    act_fn = getattr(module, "act_fn", None)
    apply_gate = getattr(type(module), "_apply_gate", None)
    default_gate = apply_gate is None or apply_gate.__name__ == "_default_apply_gate"
    if default_gate and act_fn is not None and _is_silu(act_fn):
        return SILU_AND_MUL
    return None


def _is_silu(fn) -> bool:
    return isinstance(fn, nn.SiLU) or type(fn).__name__ == "SiLUActivation" or fn is torch.nn.functional.silu


class MXFP4Experts(nn.Module):
    """Mixed into an experts module's class by :func:`to_mxfp4`; never built directly.

    Buffers: ``w13`` uint8 ``[E, 2I, H/2]``, ``w13_scale`` uint8 ``[E, 2I, H/32]``, ``w2`` uint8
    ``[E, H, I/2]``, ``w2_scale`` uint8 ``[E, H, I/32]`` (E8M0). Attributes: ``mxfx_dtype`` (the
    dtype the weights dequantize to), ``mxfx_transposed``, ``activation_quant`` ("none",
    "mxfp8", "mxfp4"), ``activation_scale_rounding``, ``mxfx_activation`` (or None).
    """

    w13: Tensor
    w13_scale: Tensor
    w2: Tensor
    w2_scale: Tensor
    mxfx_dtype: torch.dtype
    mxfx_transposed: bool
    activation_quant: str
    activation_scale_rounding: str
    mxfx_activation: Optional[GatedActivation]

    @property
    def gate_up_proj(self) -> Tensor:
        """The dequantized gate+up weight in the model's layout (``[E, 2I, H]`` or ``[E, H, 2I]``)."""
        w = torch.ops.mxfx.dequantize_mx(self.w13, self.w13_scale, "mxfp4", self.mxfx_dtype)
        return w.transpose(1, 2) if self.mxfx_transposed else w

    @property
    def down_proj(self) -> Tensor:
        """The dequantized down weight in the model's layout (``[E, H, I]`` or ``[E, I, H]``)."""
        w = torch.ops.mxfx.dequantize_mx(self.w2, self.w2_scale, "mxfp4", self.mxfx_dtype)
        return w.transpose(1, 2) if self.mxfx_transposed else w

    def forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
        if self.activation_quant == "none":
            return super().forward(hidden_states, *args, **kwargs)
        top_k_index, top_k_weights = _routing(args, kwargs)
        act = self.mxfx_activation
        return torch.ops.mxfx.moe(
            hidden_states, top_k_weights, top_k_index,
            self.w13, self.w13_scale, getattr(self, "gate_up_proj_bias", None),
            self.w2, self.w2_scale, getattr(self, "down_proj_bias", None),
            act.layout, act.alpha, act.beta, act.limit,
            self.activation_quant, "auto", self.activation_scale_rounding,
        )

    def moe_config(self, top_k: Optional[int] = None) -> MoEConfig:
        """This layer as the oracle sees it: an ``mxfx.oracle.MoEConfig``.

        ``top_k`` defaults to ``self.config.num_experts_per_tok`` (transformers modules).
        Raises ``ValueError`` when mxfx does not know the layer's gated activation.
        """
        if top_k is None:
            top_k = getattr(getattr(self, "config", None), "num_experts_per_tok", None)
            if top_k is None:
                raise ValueError("top_k: the module has no config.num_experts_per_tok; pass top_k")
        act = self.mxfx_activation
        if act is None:
            raise ValueError(
                f"{type(self).__name__}: mxfx does not know this layer's gated activation; "
                "set module.mxfx_activation = mxfx.GatedActivation(...)"
            )
        e, two_i, half_h = self.w13.shape
        return MoEConfig(
            num_experts=e,
            hidden_size=half_h * 2,
            intermediate_size=two_i // 2,
            top_k=int(top_k),
            layout=act.layout,
            alpha=act.alpha,
            beta=act.beta,
            limit=act.limit,
            has_bias=getattr(self, "gate_up_proj_bias", None) is not None,
            dtype=self.mxfx_dtype,
            weight_quant="mxfp4",
            activation_quant=self.activation_quant,
            activation_scale_rounding=self.activation_scale_rounding,
        )


def _routing(args: tuple, kwargs: dict) -> tuple[Tensor, Tensor]:
    """(top_k_index, top_k_weights) from the forward's arguments, under either naming
    transformers uses (``top_k_index``/``top_k_weights``, gpt-oss's ``router_indices``/
    ``routing_weights``)."""
    names = (("top_k_index", "router_indices"), ("top_k_weights", "routing_weights"))
    values = list(args[:2])
    for i, aliases in enumerate(names[len(values):], start=len(values)):
        found = [kwargs[a] for a in aliases if a in kwargs]
        if not found:
            raise TypeError(f"forward: missing argument {aliases[0]!r}")
        values.append(found[0])
    return values[0], values[1]


_CLASSES: dict[type, type] = {}


def _mxfp4_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"MXFP4{cls.__name__}", (MXFP4Experts, cls), {"__module__": __name__})
    return _CLASSES[cls]


def to_mxfp4(
    module: nn.Module,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    *,
    activation_quant: str = "none",
    activation_scale_rounding: str = "even",
) -> nn.Module:
    """Turn an experts ``module`` (see the protocol above) into MXFP4 storage, in place.

    ``w13``/``w2`` and their scales are the packed weights in canonical layout (uint8; shapes
    in :class:`MXFP4Experts`), e.g. from ``torch.ops.mxfx.quantize_mx`` or a checkpoint; their
    gate/up order must be the module's. They become buffers on the device they are on. The
    float parameters are dropped (they may be on the meta device); biases stay. Returns ``module``.
    """
    if not is_experts_module(module):
        raise TypeError(
            f"module: {type(module).__name__} does not follow the experts protocol "
            "(3-D float nn.Parameters gate_up_proj and down_proj; see mxfx.nn.experts)"
        )
    if activation_quant not in ACTIVATION_QUANTS:
        raise ValueError(
            f"activation_quant: got {activation_quant!r}, expected one of {list(ACTIVATION_QUANTS)}"
        )
    formats.check_scale_rounding(activation_scale_rounding)
    transposed = bool(getattr(module, "is_transposed", False))
    gate_up, down = module.gate_up_proj, module.down_proj
    if transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    e, two_i, h = gate_up.shape
    if tuple(down.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"module: down_proj has shape {tuple(module.down_proj.shape)}, which does not fit "
            f"gate_up_proj {tuple(module.gate_up_proj.shape)} (is_transposed={transposed})"
        )
    _check_packed("w13", w13, w13_scale, (e, two_i, h))
    _check_packed("w2", w2, w2_scale, (e, h, two_i // 2))
    devices = {str(t.device) for t in (w13, w13_scale, w2, w2_scale)}
    if len(devices) != 1:
        raise ValueError(f"w13, w13_scale, w2, w2_scale: on {sorted(devices)}, expected one device")
    act = expert_activation(module)
    if activation_quant != "none" and act is None:
        raise ValueError(
            f"activation_quant: {activation_quant!r} needs the layer's gated activation, which "
            f"mxfx does not know for {type(module).__name__}; set module.mxfx_activation"
        )
    dtype = module.gate_up_proj.dtype
    for name in _WEIGHTS:
        delattr(module, name)
    for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        module.register_buffer(name, t)
    module.__class__ = _mxfp4_class(type(module))
    module.mxfx_dtype = dtype
    module.mxfx_transposed = transposed
    module.activation_quant = activation_quant
    module.activation_scale_rounding = activation_scale_rounding
    module.mxfx_activation = act
    return module


def _check_packed(name: str, w: Tensor, scale: Tensor, float_shape: tuple) -> None:
    e, n, k = float_shape
    if k % formats.BLOCK != 0:
        raise ValueError(
            f"{name}: MXFP4 needs the reduction dimension to be a multiple of {formats.BLOCK}, "
            f"got {k} (float shape {float_shape})"
        )
    for t, want, label in ((w, (e, n, k // 2), name), (scale, (e, n, k // formats.BLOCK), f"{name}_scale")):
        if t.dtype != torch.uint8:
            raise TypeError(f"{label}: got dtype {t.dtype}, expected torch.uint8")
        if tuple(t.shape) != want:
            raise ValueError(f"{label}: got shape {tuple(t.shape)}, expected {want}")


def stored_bytes(module: nn.Module) -> int:
    """Bytes of an experts module's expert weights as stored now (float or MXFP4)."""
    names = ("w13", "w13_scale", "w2", "w2_scale") if isinstance(module, MXFP4Experts) else _WEIGHTS
    return sum(getattr(module, n).numel() * getattr(module, n).element_size() for n in names)
