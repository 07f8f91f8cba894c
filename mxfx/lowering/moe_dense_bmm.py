"""transformers 4.x dense experts: every token through every expert, weighted by dense routing.

    a   = x.repeat(E, 1).view(E, T, H)                    (or x[None].expand(E, T, H))
    h   = bmm(a, W13) [+ b13[:, None]]                    W13: [E, H, 2I]
    y   = bmm(act(h), W2) [+ b2[:, None]]                 W2:  [E, I, H]
    out = (y.view(E, ..., H) * R.T.view(E, ...)[..., None]).sum(0)      R: [T, E]

If ``R`` is ``zeros.scatter(1, topk_ids, topk_weights)`` the layer becomes a top-k MoE;
otherwise every expert is a slot with its dense weight.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, Node

from mxfx.lowering import moe
from mxfx.lowering.fx import aten, as_int, dtype, is_op, number, only_user, same, shape, strip_converts

FORM = "dense_bmm"


def _expert_rows(a: Node, e: int) -> Optional[Node]:
    """``x [T, H]`` from ``x.repeat(E, 1).view(E, T, H)`` or ``x[None].expand(E, T, H)``."""
    node = a
    if is_op(node, aten.reshape, aten.view):
        node = node.args[0]
        if is_op(node, aten.repeat) and list(node.args[1]) == [e, 1]:
            return node.args[0]
    if is_op(node, aten.clone):
        node = node.args[0]
    if is_op(node, aten.expand) and is_op(node.args[0], aten.unsqueeze) and node.args[0].args[1] == 0:
        return node.args[0].args[0]
    return None


def _bias(node: Node) -> Optional[Node]:
    """``b`` from ``b[:, None]`` (``unsqueeze(b, 1)``) of shape [E, N]."""
    other = node.args[1]
    if is_op(other, aten.unsqueeze) and other.args[1] == 1 and len(shape(other.args[0])) == 2:
        return other.args[0]
    return None


def _routing(node: Node, e: int) -> Optional[Node]:
    """``R [T, E]`` from ``R.T.view(E, ...)[..., None]``."""
    node = strip_converts(node)
    if not is_op(node, aten.unsqueeze):
        return None
    node = node.args[0]
    if is_op(node, aten.reshape, aten.view):
        node = node.args[0]
    if not (is_op(node, aten.permute) and list(node.args[1]) == [1, 0]):
        return None
    r = node.args[0]
    return r if as_int(shape(r)[1]) == e else None


def match(ga: Node) -> Optional[moe.Match]:
    h = strip_converts(ga.args[0])
    b13 = None
    if is_op(h, aten.add) and is_op(h.args[0], aten.bmm):
        b13 = _bias(h)
        if b13 is None:
            return None
        h = h.args[0]
    if not is_op(h, aten.bmm) or len(shape(h)) != 3:
        return None
    a, w13 = h.args
    e = as_int(shape(w13)[0])
    if e is None:
        return None
    a, qdq_rows = moe.strip_qdq(a)
    x = _expert_rows(a, e)
    if x is None:
        return None
    x, qdq_x = moe.strip_qdq(strip_converts(x))

    gemm2, qdq_mid = None, None
    for node in ga.graph.find_nodes(op="call_function", target=aten.bmm.default):
        mid, qdq = moe.strip_qdq(strip_converts(node.args[0]))
        if strip_converts(mid) is ga:
            gemm2, qdq_mid = node, qdq
    if gemm2 is None:
        return None
    node, b2 = gemm2, None
    nxt = only_user(node)
    if is_op(nxt, aten.add):
        b2 = _bias(nxt)
        if b2 is None:
            return None
        node, nxt = nxt, only_user(nxt)
    if not is_op(nxt, aten.reshape, aten.view):
        return None
    mul = only_user(nxt)
    if not is_op(mul, aten.mul) or mul.args[0] is not nxt:
        return None
    routing = _routing(mul.args[1], e)
    out = only_user(mul)
    if routing is None or not (is_op(out, aten.sum) and list(out.args[1]) == [0]):
        return None
    if not same(shape(routing)[0], shape(x)[0]):
        return None
    topk_ids, weights = None, routing
    if (
        is_op(routing, aten.scatter)
        and routing.args[1] == 1
        and is_op(routing.args[0], aten.full)
        and number(routing.args[0].args[1]) == 0.0
        and isinstance(routing.args[3], Node)
    ):
        topk_ids, weights = routing.args[2], routing.args[3]
    qdq_in = moe.one_qdq(qdq_x, qdq_rows)
    if qdq_in is False:
        return None
    return moe.Match(
        FORM, out, x, topk_ids, weights, moe.weight(w13, kn=True), moe.weight(gemm2.args[1], kn=True),
        b13, b2, moe.activation_of(ga), dtype(a), qdq_in, qdq_mid,
    )


def rewrite(graph: Graph, separate) -> None:
    for ga in list(graph.find_nodes(op="call_function", target=torch.ops.mxfx.gated_activation.default)):
        m = match(ga)
        if m is not None:
            moe.emit(graph, m)
