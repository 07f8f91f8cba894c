"""transformers 5.x ``batched_mm`` experts: every (token, slot) pair gathers its expert's weights.

    ids = topk_ids.reshape(-1).clamp(0, E - 1)
    a   = x.repeat_interleave(k, 0)
    h   = bmm(a[:, None], W13[ids]).squeeze(1) [+ b13[ids]]     (or bmm(W13[ids], a[..., None]))
    y   = bmm(act(h)[:, None], W2[ids]).squeeze(1) [+ b2[ids]]
    out = (y * topk_weights.reshape(-1, 1)).view(T, k, H).sum(1)
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, Node

from mxfx.lowering import moe
from mxfx.lowering.fx import (
    aten, as_int, dtype, is_op, only_user, prims, same, shape, strip_converts,
)

FORM = "batched_mm"
_RESHAPES = (aten.squeeze, aten.unsqueeze, aten.reshape, aten.view, prims.convert_element_type)


def _strip(node):
    while is_op(node, *_RESHAPES):
        node = node.args[0]
    return node


def _gemm(node: Node, ids: Optional[Node] = None):
    """``(a, W, kn, ids)`` if ``node`` is a bmm of rows ``a`` with gathered ``W[ids]``."""
    if not is_op(node, aten.bmm):
        return None
    lhs, rhs = node.args
    for gathered, a, kn in ((rhs, lhs, True), (lhs, rhs, False)):
        if is_op(gathered, aten.index) and len(gathered.args[1]) == 1:
            if ids is None or gathered.args[1][0] is ids:
                return a, gathered.args[0], kn, gathered.args[1][0]
    return None


def _bias(node: Node, ids: Node) -> Optional[Node]:
    other = node.args[1]
    if is_op(other, aten.index) and list(other.args[1]) == [ids]:
        return other.args[0]
    return None


def _topk_ids(ids: Node) -> Optional[Node]:
    node = ids
    while is_op(node, aten.clamp, aten.clamp_min, aten.clamp_max):
        node = node.args[0]
    if not is_op(node, aten.reshape, aten.view) or len(shape(node.args[0])) != 2:
        return None
    return node.args[0]


def _repeated_rows(a: Node) -> Optional[Node]:
    """``x`` from ``x.repeat_interleave(k, 0)`` (decomposed: unsqueeze, expand, clone, reshape)."""
    node = a
    if is_op(node, aten.reshape, aten.view):
        node = node.args[0]
    if is_op(node, aten.clone):
        node = node.args[0]
    if is_op(node, aten.expand) and is_op(node.args[0], aten.unsqueeze) and node.args[0].args[1] == 1:
        return node.args[0].args[0]
    return None


def match(ga: Node) -> Optional[moe.Match]:
    h = strip_converts(ga.args[0])
    b13 = None
    found = _gemm(_strip(h.args[0])) if is_op(h, aten.add) else None
    if found is not None:
        b13 = _bias(h, found[3])
        if b13 is None:
            return None
    else:
        found = _gemm(_strip(h))
    if found is None:
        return None
    a, w13, kn, ids = found
    topk_ids = _topk_ids(ids)
    if topk_ids is None:
        return None
    k = as_int(shape(topk_ids)[1])
    a, qdq_rows = moe.strip_qdq(_strip(a))
    x = _repeated_rows(a)
    if x is None:
        return None
    x, qdq_x = moe.strip_qdq(strip_converts(x))

    gemm2 = None
    for g in ids.users:
        for u in g.users:
            f = _gemm(u, ids)
            if f is not None and f[1] is not w13:
                mid, qdq = moe.strip_qdq(_strip(f[0]))
                if _strip(mid) is ga:
                    gemm2, w2, kn2, qdq_mid = u, f[1], f[2], qdq
    if gemm2 is None:
        return None

    node, b2, weights = gemm2, None, None
    while True:
        nxt = only_user(node)
        if nxt is None:
            return None
        if is_op(nxt, aten.squeeze, aten.unsqueeze, prims.convert_element_type):
            pass
        elif is_op(nxt, aten.add) and b2 is None and _bias(nxt, ids) is not None:
            b2 = _bias(nxt, ids)
        elif is_op(nxt, aten.mul) and weights is None:
            weights = _routing_weights(nxt.args[1] if nxt.args[0] is node else nxt.args[0])
            if weights is None:
                return None
        elif is_op(nxt, aten.reshape, aten.view):
            out = moe.slot_sum(nxt, k)
            if out is None:
                return None
            break
        else:
            return None
        node = nxt
    qdq_in = moe.one_qdq(qdq_x, qdq_rows)
    if weights is None or qdq_in is False or not same(shape(weights), shape(topk_ids)):
        return None
    # transformers clamps ids into [0, E) (sentinel slots then carry zero routing weight).
    return moe.Match(
        FORM, out, x, topk_ids, weights, moe.weight(w13, kn), moe.weight(w2, kn2), b13, b2,
        moe.activation_of(ga), dtype(a), qdq_in, qdq_mid, ids_beyond="clamp",
    )


def _routing_weights(node: Node) -> Optional[Node]:
    """``topk_weights`` from ``topk_weights.reshape(-1).unsqueeze(-1)``."""
    node = strip_converts(node)
    if not is_op(node, aten.unsqueeze):
        return None
    flat = strip_converts(node.args[0])
    if is_op(flat, aten.reshape, aten.view) and len(shape(flat.args[0])) == 2:
        return flat.args[0]
    return None


def rewrite(graph: Graph, separate) -> None:
    for ga in list(graph.find_nodes(op="call_function", target=torch.ops.mxfx.gated_activation.default)):
        m = match(ga)
        if m is not None:
            moe.emit(graph, m)
