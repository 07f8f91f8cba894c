"""``torch.ops.mxfx.*``: the custom ops, their fake implementations and input checks.

Every op is functional (``mutates_args=()``). Input checks live in ``check_*`` functions
that both the real and the fake implementation call, so bad input fails at compile time
with the same message as in eager mode.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Optional, Sequence

import torch
from torch import Tensor

from mxfx import backends, formats
from mxfx.activation import GatedActivation, check_activation, join_gate_up, split_gate_up
from mxfx.backends import emulation
from mxfx.backends.base import Backend, expert_id_error
from mxfx.moe_call import ActivationQuant, MoEWeights, signature
from mxfx.oracle import MoEConfig, Platform, select
from mxfx.oracle import settings as oracle_settings

ACTIVATION_QUANTS = ("none", "mxfp8", "mxfp4")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shape(t: Tensor) -> tuple:
    return tuple(t.shape)


# ---------------------------------------------------------------------------- checks


def check_quantize_mx(x: Tensor, fmt: str, scale_rounding: str) -> None:
    formats.element_format(fmt)
    formats.check_scale_rounding(scale_rounding)
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x: got dtype {x.dtype}, expected one of {list(_FLOAT_DTYPES)}")
    if x.dim() == 0 or x.shape[-1] % formats.BLOCK != 0:
        raise ValueError(
            f"x: last dimension must be a multiple of {formats.BLOCK}, got shape {_shape(x)}"
        )


def check_dequantize_mx(packed: Tensor, scales: Tensor, fmt: str, out_dtype: torch.dtype) -> int:
    """Returns K, the dequantized last dimension."""
    ef = formats.element_format(fmt)
    if packed.dtype != ef.storage:
        raise TypeError(f"packed: got dtype {packed.dtype}, expected {ef.storage} for {fmt!r}")
    if scales.dtype != torch.uint8:
        raise TypeError(f"scales: got dtype {scales.dtype}, expected torch.uint8 (E8M0)")
    if out_dtype not in _FLOAT_DTYPES:
        raise TypeError(f"out_dtype: got {out_dtype}, expected one of {list(_FLOAT_DTYPES)}")
    if packed.dim() == 0:
        raise ValueError("packed: expected at least one dimension, got a scalar")
    k = packed.shape[-1] * ef.per_byte
    want = (*packed.shape[:-1], k // formats.BLOCK)
    if k % formats.BLOCK != 0 or _shape(scales) != want:
        raise ValueError(
            f"scales: got shape {_shape(scales)}, expected {want} for packed of shape "
            f"{_shape(packed)} ({fmt!r}, K={k} must be a multiple of {formats.BLOCK})"
        )
    return k


def check_gated_activation(
    x: Tensor, layout: str, alpha: float, beta: float, limit: Optional[float]
) -> None:
    check_activation(layout, alpha, beta, limit)
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x: got dtype {x.dtype}, expected one of {list(_FLOAT_DTYPES)}")
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x: last dimension must be even (gate and up), got shape {_shape(x)}")


def _check_expert_weight(
    name: str, w: Tensor, scale: Optional[Tensor], e: int, n: int, k: int, k_name: str
) -> None:
    """``w`` must be float ``[E, n, k]`` or MXFP4 uint8 ``[E, n, k/2]`` with ``scale [E, n, k/32]``."""
    if w.dim() != 3:
        raise ValueError(f"{name}: expected rank 3 [E, N, K], got shape {_shape(w)}")
    if w.dtype == torch.uint8:
        if scale is None:
            raise ValueError(f"{name}_scale: {name} is MXFP4 (uint8) and needs its E8M0 scales")
        if k % formats.BLOCK != 0:
            raise ValueError(
                f"{name}: MXFP4 needs {k_name} to be a multiple of {formats.BLOCK}, got {k}"
            )
        want_w, want_s = (e, n, k // 2), (e, n, k // formats.BLOCK)
        if _shape(w) != want_w:
            raise ValueError(f"{name}: got shape {_shape(w)}, expected {want_w} (packed MXFP4)")
        if scale.dtype != torch.uint8:
            raise TypeError(f"{name}_scale: got dtype {scale.dtype}, expected torch.uint8 (E8M0)")
        if _shape(scale) != want_s:
            raise ValueError(f"{name}_scale: got shape {_shape(scale)}, expected {want_s}")
    elif w.dtype in _FLOAT_DTYPES:
        if scale is not None:
            raise ValueError(
                f"{name}_scale: {name} is {w.dtype} (not quantized); expected no scale, "
                f"got shape {_shape(scale)}"
            )
        if _shape(w) != (e, n, k):
            raise ValueError(f"{name}: got shape {_shape(w)}, expected {(e, n, k)}")
    else:
        raise TypeError(f"{name}: got dtype {w.dtype}, expected a float dtype or uint8 (MXFP4)")


def _check_bias(name: str, b: Optional[Tensor], want: tuple) -> None:
    if b is None:
        return
    if b.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: got dtype {b.dtype}, expected a float dtype")
    if _shape(b) != want:
        raise ValueError(f"{name}: got shape {_shape(b)}, expected {want}")


def check_moe(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13: Tensor,
    w13_scale: Optional[Tensor],
    w13_bias: Optional[Tensor],
    w2: Tensor,
    w2_scale: Optional[Tensor],
    w2_bias: Optional[Tensor],
    layout: str,
    alpha: float,
    beta: float,
    limit: Optional[float],
    activation_quant: str,
    backend: str,
    activation_scale_rounding: str,
) -> None:
    """Every argument of ``mxfx.moe`` checked; raises ``ValueError``/``TypeError`` naming it."""
    check_activation(layout, alpha, beta, limit)
    if activation_quant not in ACTIVATION_QUANTS:
        raise ValueError(
            f"activation_quant: got {activation_quant!r}, expected one of {list(ACTIVATION_QUANTS)}"
        )
    formats.check_scale_rounding(activation_scale_rounding, "activation_scale_rounding")
    if not isinstance(backend, str):
        raise TypeError(f"backend: got {backend!r}, expected a backend name or 'auto'")
    backends.check_name(backend)
    dense = {"x": x, "topk_weights": topk_weights, "topk_ids": topk_ids, "w13": w13, "w13_scale": w13_scale,
             "w13_bias": w13_bias, "w2": w2, "w2_scale": w2_scale, "w2_bias": w2_bias}
    for name, t in dense.items():
        if t is not None and t.layout != torch.strided:
            raise ValueError(f"{name}: got layout {t.layout}, expected torch.strided (a dense tensor)")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x: got dtype {x.dtype}, expected one of {list(_FLOAT_DTYPES)}")
    if x.dim() != 2:
        raise ValueError(f"x: expected rank 2 [T, H], got shape {_shape(x)}")
    T, H = x.shape
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids: got dtype {topk_ids.dtype}, expected an integer dtype")
    if topk_weights.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"topk_weights: got dtype {topk_weights.dtype}, expected a float dtype")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids: expected shape [T={T}, k], got {_shape(topk_ids)}")
    if _shape(topk_weights) != _shape(topk_ids):
        raise ValueError(
            f"topk_weights: got shape {_shape(topk_weights)}, expected the shape of "
            f"topk_ids {_shape(topk_ids)}"
        )
    if w13.dim() != 3:
        raise ValueError(f"w13: expected rank 3 [E, 2I, H], got shape {_shape(w13)}")
    E, two_i = w13.shape[0], w13.shape[1]
    if E < 1 or two_i % 2 != 0:
        raise ValueError(f"w13: expected [E >= 1, 2I (even), H], got shape {_shape(w13)}")
    if (w13.dtype == torch.uint8) != (w2.dtype == torch.uint8):
        raise TypeError(
            f"w2: got dtype {w2.dtype} while w13 is {w13.dtype}; both must be MXFP4 or both float"
        )
    _check_expert_weight("w13", w13, w13_scale, E, two_i, H, "hidden size H")
    _check_expert_weight("w2", w2, w2_scale, E, H, two_i // 2, "intermediate size I")
    _check_bias("w13_bias", w13_bias, (E, two_i))
    _check_bias("w2_bias", w2_bias, (E, H))
    if activation_quant != "none" and (H % formats.BLOCK or (two_i // 2) % formats.BLOCK):
        raise ValueError(
            f"activation_quant: {activation_quant!r} quantizes each GEMM input per "
            f"{formats.BLOCK}-block along K, so the hidden size H and the intermediate size I "
            f"must be multiples of {formats.BLOCK}; got H={H}, I={two_i // 2}"
        )
    # k > E is allowed: under expert parallelism a device holds fewer experts than k and
    # marks the slots routed elsewhere with id -1.
    for name, t in dense.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, expected x's device {x.device}")


# Read once: an eager call's host time is the budget, and a read of the environment costs
# about 1 µs of it.
_DEBUG = os.environ.get("MXFX_DEBUG") == "1"


def check_expert_ids(topk_ids: Tensor, num_experts: int) -> None:
    """Ids >= E are an error. On CPU (or with ``MXFX_DEBUG=1`` set when mxfx is imported) this
    raises here. On an accelerator the backend checks them without adding a host
    synchronisation: the Triton backends with a device-side assert in their routing kernel (or,
    where each pair is its own block, in the first GEMM), the emulation (which synchronises
    anyway) by raising."""
    if (topk_ids.is_cpu or _DEBUG) and topk_ids.numel():
        top = int(topk_ids.max())
        if top >= num_experts:
            raise ValueError(expert_id_error(top, num_experts))


# ---------------------------------------------------------------------------- ops


@torch.library.custom_op("mxfx::quantize_mx", mutates_args=())
def quantize_mx(x: Tensor, fmt: str = "mxfp4", scale_rounding: str = "floor") -> tuple[Tensor, Tensor]:
    """MX-quantize ``x [..., K]`` along K → ``(packed, scales)``; see :mod:`mxfx.formats`."""
    check_quantize_mx(x, fmt, scale_rounding)
    return formats.quantize(x, fmt, scale_rounding)


@quantize_mx.register_fake
def _(x, fmt="mxfp4", scale_rounding="floor"):
    check_quantize_mx(x, fmt, scale_rounding)
    ef = formats.element_format(fmt)
    k = x.shape[-1]
    packed = x.new_empty((*x.shape[:-1], k // ef.per_byte), dtype=ef.storage)
    scales = x.new_empty((*x.shape[:-1], k // formats.BLOCK), dtype=torch.uint8)
    return packed, scales


@torch.library.custom_op("mxfx::dequantize_mx", mutates_args=())
def dequantize_mx(
    packed: Tensor, scales: Tensor, fmt: str = "mxfp4", out_dtype: torch.dtype = torch.float32
) -> Tensor:
    """Dequantize MX ``(packed, scales)`` → contiguous ``[..., K]`` in ``out_dtype``."""
    check_dequantize_mx(packed, scales, fmt, out_dtype)
    return formats.dequantize(packed, scales, fmt, out_dtype).contiguous()


@dequantize_mx.register_fake
def _(packed, scales, fmt="mxfp4", out_dtype=torch.float32):
    k = check_dequantize_mx(packed, scales, fmt, out_dtype)
    return packed.new_empty((*packed.shape[:-1], k), dtype=out_dtype)


@torch.library.custom_op("mxfx::gated_activation", mutates_args=())
def gated_activation(
    x: Tensor,
    layout: str = "halves",
    alpha: float = 1.0,
    beta: float = 0.0,
    limit: Optional[float] = None,
) -> Tensor:
    """Clamped gated activation (see :mod:`mxfx.activation`): ``[..., 2d]`` → contiguous
    ``[..., d]`` in ``x.dtype``, computed in float32."""
    check_gated_activation(x, layout, alpha, beta, limit)
    act = GatedActivation(layout, alpha, beta, limit)
    kernel = _activation_kernel() if x.device.type == "cuda" else None
    if kernel is not None and x.dtype in kernel.DTYPES:
        return kernel.gated_activation(x, act)
    return emulation.gated_activation(x, act).contiguous()


@functools.lru_cache(maxsize=None)
def _activation_kernel():
    """The Triton activation kernel module, or None where Triton does not import.
    Imported on first use so that machines without Triton never load it."""
    try:
        from mxfx.kernels import activation
    except ImportError:
        return None
    return activation


@gated_activation.register_fake
def _(x, layout="halves", alpha=1.0, beta=0.0, limit=None):
    check_gated_activation(x, layout, alpha, beta, limit)
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _gated_activation_setup(ctx, inputs, output):
    x, layout, alpha, beta, limit = inputs
    ctx.save_for_backward(x)
    ctx.act = GatedActivation(layout, alpha, beta, limit)


def _gated_activation_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    act = ctx.act
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    g, u = split_gate_up(xf, act.layout)
    gate_pass = torch.ones_like(g)
    up_pass = torch.ones_like(u)
    if act.limit is not None:
        # clamp passes the gradient where the input is inside the bounds (ends included).
        gate_pass = (g <= act.limit).to(acc)
        up_pass = ((u >= -act.limit) & (u <= act.limit)).to(acc)
        g = g.clamp(max=act.limit)
        u = u.clamp(-act.limit, act.limit)
    s = torch.sigmoid(act.alpha * g)
    gr = grad.to(acc)
    d_gate = gr * (u + act.beta) * (s + act.alpha * g * s * (1 - s)) * gate_pass
    d_up = gr * g * s * up_pass
    dx = join_gate_up(d_gate, d_up, act.layout)
    return dx.to(x.dtype), None, None, None, None


gated_activation.register_autograd(_gated_activation_backward, setup_context=_gated_activation_setup)


_MOE_SCHEMA = (
    "moe(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor w13, Tensor? w13_scale, "
    "Tensor? w13_bias, Tensor w2, Tensor? w2_scale, Tensor? w2_bias, str layout=\"halves\", "
    "float alpha=1.0, float beta=0.0, float? limit=None, str activation_quant=\"none\", "
    "str backend=\"auto\", str activation_scale_rounding=\"even\") -> Tensor"
)
# ``mxfx::moe`` is defined through ``torch.library.Library``, not ``custom_op``: custom_op's two
# Python layers (autograd, then the device kernel) cost about 30 µs per eager call on the H200
# box, against a 60 µs budget for the whole call's host time.
_LIB = torch.library.Library("mxfx", "FRAGMENT")
_LIB.define(_MOE_SCHEMA)


class _Resolved:
    """A call's checked arguments: the oracle's backend, with the activation and the activation
    quantization it executes. One object per cached call signature, so that a backend whose
    ``run`` takes a ``key`` (see :meth:`Backend.run`) can be given this object (``keyed``) and
    cache on its identity."""

    __slots__ = ("backend", "act", "aq", "keyed")

    def __init__(self, backend: Backend, act: GatedActivation, aq: ActivationQuant, cached: bool) -> None:
        self.backend, self.act, self.aq = backend, act, aq
        self.keyed = cached and "key" in inspect.signature(backend.run).parameters


_CHECKED: dict[tuple, _Resolved] = {}


def _resolve_moe(
    tensors: tuple, layout: str, alpha: float, beta: float, limit: Optional[float],
    activation_quant: str, backend: str, activation_scale_rounding: str,
) -> _Resolved:
    """The arguments checked (:func:`check_moe`), and the oracle's backend with the activation
    and the activation quantization it executes.

    Cached per signature (the tensors' :func:`~mxfx.moe_call.signature`, the scalars, the
    oracle's settings): a repeated call costs the key and one dict lookup.
    """
    try:
        key = (signature(tensors), layout, alpha, beta, limit, activation_quant, backend,
               activation_scale_rounding, oracle_settings.token())
    except RuntimeError:  # a tensor without strides or storage: checked on every call, never cached
        key = None
    hit = None if key is None else _CHECKED.get(key)
    if hit is not None:
        return hit
    check_moe(*tensors, layout, alpha, beta, limit, activation_quant, backend, activation_scale_rounding)
    x, _, topk_ids, w13, _, w13_bias, _, _, w2_bias = tensors
    config = MoEConfig(
        num_experts=w13.shape[0],
        hidden_size=x.shape[1],
        intermediate_size=w13.shape[1] // 2,
        top_k=topk_ids.shape[1],
        layout=layout,
        alpha=alpha,
        beta=beta,
        limit=limit,
        has_bias=w13_bias is not None or w2_bias is not None,
        dtype=x.dtype,
        weight_quant="mxfp4" if w13.dtype == torch.uint8 else "float",
        activation_quant=activation_quant,
        activation_scale_rounding=activation_scale_rounding,
    )
    decision = select(config, Platform.current(x.device), backend)
    act = GatedActivation(layout, alpha, beta, limit)
    aq = ActivationQuant(decision.activation_quant.value, activation_scale_rounding)
    hit = _Resolved(backends.get(decision.backend), act, aq, key is not None)
    if key is not None:
        _CHECKED[key] = hit
    return hit


def moe(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13: Tensor,
    w13_scale: Optional[Tensor],
    w13_bias: Optional[Tensor],
    w2: Tensor,
    w2_scale: Optional[Tensor],
    w2_bias: Optional[Tensor],
    layout: str = "halves",
    alpha: float = 1.0,
    beta: float = 0.0,
    limit: Optional[float] = None,
    activation_quant: str = "none",
    backend: str = "auto",
    activation_scale_rounding: str = "even",
) -> Tensor:
    """Fused MoE layer → ``[T, H]`` in ``x.dtype`` (``torch.ops.mxfx.moe``).

    ``out[t] = Σ_k topk_weights[t,k] · (act(x[t] @ w13[e]ᵀ + w13_bias[e]) @ w2[e]ᵀ + w2_bias[e])``
    with ``e = topk_ids[t,k]``; a slot with ``e < 0`` adds nothing. No backward (an error if
    one is asked for).

    Args:
        x: ``[T, H]`` float16 / bfloat16 / float32 activations.
        topk_weights: ``[T, k]`` float routing weights.
        topk_ids: ``[T, k]`` integer expert ids in ``[-1, E)``.
        w13, w13_scale, w13_bias: gate+up projection, float ``[E, 2I, H]`` (any strides) or
            MXFP4 uint8 ``[E, 2I, H/2]`` with scales uint8 ``[E, 2I, H/32]``; bias ``[E, 2I]``.
        w2, w2_scale, w2_bias: down projection, float ``[E, H, I]`` or MXFP4 ``[E, H, I/2]``
            with ``[E, H, I/32]`` scales; bias ``[E, H]``.
        layout, alpha, beta, limit: the gated activation (see :mod:`mxfx.activation`).
        activation_quant: ``"none"``, ``"mxfp8"`` or ``"mxfp4"``: the input of each GEMM is
            quantized per 32-block along K with ``activation_scale_rounding``.
        backend: ``"auto"`` (the oracle chooses) or a backend name (honoured or an error).
    """
    tensors = (x, topk_weights, topk_ids, w13, w13_scale, w13_bias, w2, w2_scale, w2_bias)
    call = _resolve_moe(
        tensors, layout, alpha, beta, limit, activation_quant, backend, activation_scale_rounding
    )
    check_expert_ids(topk_ids, w13.shape[0])
    weights = MoEWeights(w13, w13_scale, w13_bias, w2, w2_scale, w2_bias)
    if call.keyed:
        return call.backend.run(x, topk_weights, topk_ids, weights, call.act, call.aq, key=call)
    return call.backend.run(x, topk_weights, topk_ids, weights, call.act, call.aq)


_LIB.impl("moe", moe, "CompositeExplicitAutograd")


class _NoBackward(torch.autograd.Function):
    """Gives ``mxfx.moe``'s output a backward that raises, as an op without a derivative
    should (the default would warn and return no gradient)."""

    @staticmethod
    def forward(ctx, out: Tensor, *inputs: Tensor) -> Tensor:
        return out

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("mxfx.moe has no backward: it is an inference op (no autograd formula)")


_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_MOE_OP = torch.ops.mxfx.moe.default
# The keys left below Autograd in a call on plain dense CPU or CUDA tensors (no subclass,
# dispatch mode or functionalization), for which the redispatch would reach :func:`moe`
# (ADInplaceOrView, a fallthrough for this op, with or without).
_PLAIN = frozenset(
    keys.raw_repr()
    for backend in (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)
    for keys in (torch._C.DispatchKeySet(backend),
                 torch._C.DispatchKeySet(backend).add(torch._C.DispatchKey.ADInplaceOrView))
)


# Per keyset a call came with (its raw_repr): whether its keys below Autograd are _PLAIN.
_PLAIN_BELOW: dict[int, bool] = {}


def _moe_autograd(keyset, *args) -> Tensor:
    # Only the float tensors can require grad (x, topk_weights, w13, w13_bias, w2, w2_bias): the
    # ids and scales are integers, or rejected.
    grad = torch.is_grad_enabled() and torch._C._any_requires_grad(
        args[0], args[1], args[3], args[5], args[6], args[8])
    plain = _PLAIN_BELOW.get(keyset.raw_repr())
    if plain is None:
        plain = _PLAIN_BELOW[keyset.raw_repr()] = (keyset & _AFTER_AUTOGRAD).raw_repr() in _PLAIN
    if not grad and plain:
        # What the redispatch would run, without converting the arguments to the dispatcher's
        # and back a second time (an eager call's host time 29 -> 25 µs on 2 CPU cores).
        return moe(*args)
    out = _MOE_OP.redispatch(keyset & _AFTER_AUTOGRAD, *args)
    if grad:
        return _NoBackward.apply(out, *[a for a in args if isinstance(a, Tensor) and a.requires_grad])
    return out


_LIB.impl("moe", _moe_autograd, "Autograd", with_keyset=True)


@torch.library.register_fake("mxfx::moe", lib=_LIB)
def _(
    x, topk_weights, topk_ids, w13, w13_scale, w13_bias, w2, w2_scale, w2_bias,
    layout="halves", alpha=1.0, beta=0.0, limit=None, activation_quant="none",
    backend="auto", activation_scale_rounding="even",
):
    check_moe(
        x, topk_weights, topk_ids, w13, w13_scale, w13_bias, w2, w2_scale, w2_bias,
        layout, alpha, beta, limit, activation_quant, backend, activation_scale_rounding,
    )
    return torch.empty_like(x, memory_format=torch.contiguous_format)


__all__: Sequence[str] = ("quantize_mx", "dequantize_mx", "gated_activation", "moe")
