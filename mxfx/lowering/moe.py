"""What every MoE form hands over once matched, and how it becomes one ``mxfx.moe`` call.

A form module (``moe_grouped_mm``, ...) finds the nodes; this module reads expert weights
(float views or ``mxfx.dequantize_mx`` of MXFP4 buffers), activation quantize-dequantize
pairs, asks the oracle for a backend at compile time and emits the op, or records why not.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch.fx import Graph, Node
from torch.fx.operator_schemas import normalize_function

from mxfx.activation import GatedActivation
from mxfx.lowering import report
from mxfx.lowering.fx import (
    aten,
    arg,
    as_int,
    call,
    dtype,
    is_op,
    only_user,
    same,
    permute,
    permute_chain,
    prims,
    shape,
    sizes_of,
    strip_converts,
    to_dtype,
    val,
)
from mxfx.oracle import MoEConfig, NoBackendError, Platform, select
from mxfx.ops import ACTIVATION_QUANTS

mxfx_ops = torch.ops.mxfx

# Set in the meta of a matched layer's output that was left alone, its reason recorded.
REPORTED = "mxfx_reported"

# (fmt, scale_rounding) of a quantize-dequantize pair on a GEMM input, or None.
QDQ = Optional[tuple[str, str]]


@dataclass(frozen=True)
class Weight:
    """An expert projection in canonical ``[E, N, K]`` orientation: a float view of ``node``
    (``node.permute(perm)``) or MXFP4 ``node`` (packed) with ``scales``."""

    node: Node
    perm: tuple[int, ...] = (0, 1, 2)
    scales: Optional[Node] = None

    @property
    def mxfp4(self) -> bool:
        return self.scales is not None

    def shape(self) -> tuple:
        s = shape(self.node)
        if self.mxfp4:
            return (s[0], s[1], s[2] * 2)
        return tuple(s[p] for p in self.perm)


def weight(node: Node, kn: bool) -> Weight:
    """The canonical weight behind a GEMM operand ``node``: ``[E, K, N]`` (``out = a @ w[e]``)
    if ``kn`` else ``[E, N, K]``."""
    base, perm = permute_chain(strip_converts(node))
    return weight_from(base, [perm[0], perm[2], perm[1]] if kn else perm)


def weight_from(base: Node, nk) -> Weight:
    """The weight ``base.permute(nk)`` (canonical ``[E, N, K]``). A ``dequantize_mx`` of MXFP4
    blocks along K is read as the packed weight itself, so no float copy is made."""
    base, perm = permute_chain(strip_converts(base))
    nk = [perm[i] for i in nk]
    if (
        is_op(base, mxfx_ops.dequantize_mx)
        and arg(base, 2, "fmt", "mxfp4") == "mxfp4"
        and nk == [0, 1, 2]
    ):
        return Weight(base.args[0], scales=base.args[1])
    return Weight(base, tuple(nk))


def strip_qdq(node: Node) -> tuple[Node, QDQ]:
    """``(x, (fmt, rounding))`` if ``node`` is ``dequantize_mx(*quantize_mx(x, fmt, rounding))``
    (casts around it allowed), else ``(node, None)``."""
    inner = strip_converts(node)
    if not is_op(inner, mxfx_ops.dequantize_mx):
        return node, None
    packed, scales = inner.args[0], inner.args[1]
    if not (
        is_op(packed, operator.getitem)
        and is_op(scales, operator.getitem)
        and packed.args[0] is scales.args[0]
        and (packed.args[1], scales.args[1]) == (0, 1)
        and is_op(packed.args[0], mxfx_ops.quantize_mx)
    ):
        return node, None
    q = packed.args[0]
    fmt = arg(q, 1, "fmt", "mxfp4")
    if arg(inner, 2, "fmt", "mxfp4") != fmt:
        return node, None
    return q.args[0], (fmt, arg(q, 2, "scale_rounding", "floor"))


@dataclass
class Match:
    """A MoE subgraph ready to emit. ``out`` is replaced; it holds Σ_k w·expert(x) for every
    token, as ``[T, H]`` or any shape with the same elements in that order.

    ``topk_ids`` None means dense routing: ``topk_weights`` is ``[T, E]``, every expert is a slot.
    ``qdq_in``/``qdq_mid``: the activation quantization seen on the first / second GEMM input.
    ``ids_beyond``: what the model does with ids >= E (expert-parallel sentinels): "clamp"
    (use expert E-1), "drop" (add nothing), or None (no handling: they cannot occur or fail).
    """

    form: str
    out: Node
    x: Node
    topk_ids: Optional[Node]
    topk_weights: Node
    w13: Union[Weight, tuple[Weight, Weight]]
    w2: Weight
    b13: Optional[Node]
    b2: Optional[Node]
    act: GatedActivation
    gemm_dtype: torch.dtype
    qdq_in: QDQ = None
    qdq_mid: QDQ = None
    ids_beyond: Optional[str] = None


def slot_sum(node: Node, k: int) -> Optional[Node]:
    """The ``.sum(1)`` over the k slots that ends a per-pair expert output: ``node`` is a
    reshape/view to ``[T, k, H]`` whose only user sums dim 1. Returns that sum, else None."""
    s = shape(node)
    out = only_user(node)
    if len(s) == 3 and as_int(s[1]) == k and is_op(out, aten.sum) and list(out.args[1]) == [1]:
        return out
    return None


def one_qdq(a: QDQ, b: QDQ) -> Union[QDQ, bool]:
    """The quantization of a GEMM input seen at two places (before and after the routing
    gather); False if both are present (quantized twice: not what ``mxfx.moe`` does)."""
    return False if (a and b) else (a or b)


def activation_of(ga: Node) -> GatedActivation:
    """The activation of an ``mxfx.gated_activation`` node (as the activation pass emits it)."""
    return GatedActivation(*ga.args[1:5])


def _activation_quant(m: Match) -> Union[tuple[str, str], str]:
    """``(fmt, rounding)`` for ``mxfx.moe``, or the reason the two GEMM inputs disagree."""
    if m.qdq_in == m.qdq_mid:
        if m.qdq_in is None:
            return "none", "even"
        if m.qdq_in[0] not in ACTIVATION_QUANTS:
            return f"activation quantization {m.qdq_in[0]!r} is not one of {list(ACTIVATION_QUANTS)[1:]}"
        return m.qdq_in
    return (
        f"the two expert GEMM inputs are quantized differently (first: {m.qdq_in}, "
        f"second: {m.qdq_mid}); mxfx.moe quantizes both the same way"
    )


def _describe(m: Match, e, h, i, k, wq, aq) -> str:
    act = m.act
    limit = "none" if act.limit is None else f"{act.limit:g}"
    bias = " bias" if (m.b13 is not None or m.b2 is not None) else ""
    return (
        f"E={e} H={h} I={i} top-{k} {act.layout} alpha={act.alpha:g} beta={act.beta:g} "
        f"limit={limit}{bias} {str(m.gemm_dtype).removeprefix('torch.')} W={wq} A={aq}"
    )


def _w13_shape(w13) -> tuple:
    """``(E, 2I, H)`` of the gate+up projection (one weight, or separate gate and up)."""
    if isinstance(w13, tuple):
        e, i, h = w13[0].shape()
        return e, 2 * i, h
    return w13.shape()


def emit(graph: Graph, m: Match) -> bool:
    """Replace ``m.out`` by one ``mxfx.moe`` on the backend the oracle picks. On any reason not
    to, leave the graph as it is and record the reason. Returns whether it rewrote."""
    w13 = m.w13
    parts = w13 if isinstance(w13, tuple) else (w13,)
    e, two_i, h = _w13_shape(w13)
    detail = f"E={e} H={h} 2I={two_i}"
    wq = "mxfp4" if parts[0].mxfp4 else "float"
    if any(w.mxfp4 != parts[0].mxfp4 for w in (*parts, m.w2)):
        return _skip(m, detail, "the expert projections are stored differently (MXFP4 and float)")
    dims = [as_int(d) for d in (e, two_i, h)]
    k = as_int(shape(m.topk_ids)[1]) if m.topk_ids is not None else dims[0]
    if None in dims or k is None:
        return _skip(m, detail, "the expert count and sizes must be static")
    e, two_i, h = dims
    aq = _activation_quant(m)
    if isinstance(aq, str):
        return _skip(m, detail, aq)
    bad = _inconsistent(m, e, two_i, h, k)
    if bad:
        return _skip(m, detail, bad)
    out_sizes = [as_int(s) for s in shape(m.out)]
    if len(out_sizes) != 2 and out_sizes.count(None) > 1:
        return _skip(m, detail, "the output has more than one symbolic size")
    detail = _describe(m, e, h, two_i // 2, k, wq, aq[0])
    try:
        config = MoEConfig(
            num_experts=e, hidden_size=h, intermediate_size=two_i // 2, top_k=k,
            layout=m.act.layout, alpha=float(m.act.alpha), beta=float(m.act.beta),
            limit=None if m.act.limit is None else float(m.act.limit),
            has_bias=m.b13 is not None or m.b2 is not None, dtype=m.gemm_dtype,
            weight_quant=wq, activation_quant=aq[0], activation_scale_rounding=aq[1],
        )
        decision = select(config, Platform.current(val(m.x).device))
    except (NoBackendError, ValueError, TypeError) as exc:
        return _skip(m, detail, str(exc))
    with graph.inserting_before(m.out):
        x = to_dtype(graph, m.x, m.gemm_dtype)
        w13_node, w13_scale = _build_w13(graph, w13)
        w2_node = permute(graph, m.w2.node, m.w2.perm)
        ids, weights = m.topk_ids, m.topk_weights
        if ids is None:
            iota = call(
                graph, prims.iota.default, (e,),
                dict(start=0, step=1, dtype=torch.int64, device=val(x).device, requires_grad=False),
            )
            ids = call(graph, aten.expand.default, (iota, [sizes_of(graph, weights)[0], e]))
        elif m.ids_beyond == "clamp":  # (post-grad graphs hold only ops Inductor lowers)
            ids = call(graph, aten.clamp_max.default, (call(graph, aten.clamp_min.default, (ids, 0)), e - 1))
        elif m.ids_beyond == "drop":  # mxfx.moe skips ids < 0
            minus_one = call(
                graph, aten.full.default, ([], -1),
                dict(dtype=dtype(ids), layout=torch.strided, device=val(ids).device, pin_memory=False),
            )
            ids = call(graph, aten.where.self, (call(graph, aten.ge.Scalar, (ids, e)), minus_one, ids))
        node = call(
            graph,
            mxfx_ops.moe.default,
            (x, weights, ids, w13_node, w13_scale, m.b13, w2_node, m.w2.scales, m.b2,
             m.act.layout, float(m.act.alpha), float(m.act.beta),
             None if m.act.limit is None else float(m.act.limit), aq[0], decision.backend, aq[1]),
        )
        if len(out_sizes) != 2:
            node = call(graph, aten.reshape.default, (node, [-1 if s is None else s for s in out_sizes]))
        node = to_dtype(graph, node, dtype(m.out))
    m.out.replace_all_uses_with(node)
    report.add(report.Record(m.form, True, detail, backend=decision.backend))
    return True


def pin_backends(graph: Graph) -> None:
    """``mxfx.moe`` calls already in the graph with ``backend="auto"`` (e.g. ``mxfx.nn``'s
    activation-quantized experts) get the oracle's choice now, so it appears in the graph."""
    for node in list(graph.find_nodes(op="call_function", target=mxfx_ops.moe.default)):
        found = normalize_function(
            node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True
        )
        kw = dict(found.kwargs) if found is not None else None
        if kw is None or kw.get("backend", "auto") != "auto":
            continue
        x, w13, ids = val(kw["x"]), val(kw["w13"]), val(kw["topk_ids"])
        dims = [as_int(d) for d in (w13.shape[0], w13.shape[1], x.shape[1], ids.shape[1])]
        if None in dims:
            continue
        e, two_i, h, k = dims
        act = GatedActivation(kw["layout"], kw["alpha"], kw["beta"], kw["limit"])
        aq = kw.get("activation_quant", "none")
        detail = (
            f"E={e} H={h} I={two_i // 2} top-{k} (mxfx.moe with backend='auto', activation {act})"
        )
        try:
            config = MoEConfig(
                num_experts=e, hidden_size=h, intermediate_size=two_i // 2, top_k=k,
                layout=act.layout, alpha=act.alpha, beta=act.beta, limit=act.limit,
                has_bias=kw.get("w13_bias") is not None or kw.get("w2_bias") is not None,
                dtype=x.dtype, weight_quant="mxfp4" if w13.dtype == torch.uint8 else "float",
                activation_quant=aq,
                activation_scale_rounding=kw.get("activation_scale_rounding", "even"),
            )
            decision = select(config, Platform.current(x.device))
        except (NoBackendError, ValueError, TypeError) as exc:
            report.add(report.Record("pinned", False, detail, reason=str(exc)))
            continue
        # Keep the call's own structure (Inductor matches it against the traced inputs).
        index = [a.name for a in node.target._schema.arguments].index("backend")
        if len(node.args) > index:
            node.update_arg(index, decision.backend)
        else:
            node.update_kwarg("backend", decision.backend)
        report.add(report.Record("pinned", True, detail, backend=decision.backend))


def _inconsistent(m: Match, e: int, two_i: int, h: int, k: int) -> str:
    """Why the matched tensors cannot be one MoE layer's operands ("" if they can)."""
    x = shape(m.x)
    if x is None or len(x) != 2 or as_int(x[1]) != h:
        return f"tokens of shape {x} do not match the hidden size {h}"
    t = x[0]
    want = {"topk_weights": (t, k if m.topk_ids is not None else e)}
    if m.topk_ids is not None:
        want["topk_ids"] = (t, k)
    for name, w in want.items():
        got = shape(getattr(m, name))
        if got is None or not same(got, w):
            return f"{name} of shape {got} do not match [T, k] = {list(w)}"
    if tuple(as_int(d) for d in m.w2.shape()) != (e, h, two_i // 2):
        return f"down projection of shape {m.w2.shape()} does not match [E, H, I] = {[e, h, two_i // 2]}"
    for name, b, n in (("w13_bias", m.b13, two_i), ("w2_bias", m.b2, h)):
        if b is not None and tuple(as_int(d) for d in shape(b)) != (e, n):
            return f"{name} of shape {shape(b)} does not match {[e, n]}"
    return ""


def _build_w13(graph: Graph, w13) -> tuple[Node, Optional[Node]]:
    """The ``w13`` (and scales) arguments of ``mxfx.moe``."""
    if not isinstance(w13, tuple):
        return permute(graph, w13.node, w13.perm), w13.scales
    gate, up = w13
    # Separate gate/up weights become one [E, 2I, K] tensor in the halves layout. This is a
    # copy per call (as the model's own per-token weight gather was); it is documented.
    w = call(graph, aten.cat.default, ([permute(graph, gate.node, gate.perm), permute(graph, up.node, up.perm)], 1))
    scales = None
    if gate.mxfp4:
        scales = call(graph, aten.cat.default, ([gate.scales, up.scales], 1))
    return w, scales


def _skip(m: Match, detail: str, reason: str) -> bool:
    m.out.meta[REPORTED] = True
    report.add(report.Record(m.form, False, detail, reason=reason))
    return False
