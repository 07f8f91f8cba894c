"""transformers 5.x ``grouped_mm`` experts (the default ``experts_implementation``).

    ids_sorted, perm = sort(topk_ids.reshape(-1))
    a   = x[perm // k]                                  (rows of expert-sorted slots)
    h   = grouped_mm(a, W13, offs) [+ b13[ids_sorted]]  (masked_fill of EP sentinel rows)
    y   = grouped_mm(act(h), W2, offs) [+ b2[ids_sorted]] * topk_weights.reshape(-1)[perm]
    out = y[inverse(perm)].view(T, k, H).sum(1)

``grouped_mm`` is ``aten._grouped_mm`` (bf16) or ``transformers::grouped_mm_fallback``.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import Graph, Node

from mxfx.lowering import moe
from mxfx.lowering.fx import (
    aten, arg, as_int, dtype, is_op, number, only_user, prims, same, shape, strip_converts,
)

FORM = "grouped_mm"


def grouped_mm_ops() -> tuple:
    ops = [aten._grouped_mm]
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    return (*ops, fallback) if fallback is not None else tuple(ops)


def _is_zero_fill(node: Node) -> bool:
    """``where(mask, 0, t)``: transformers' masked_fill of expert-parallel sentinel rows."""
    if not is_op(node, aten.where) or len(node.args) != 3:
        return False
    fill = node.args[1]
    if isinstance(fill, Node):
        return is_op(fill, aten.full) and number(fill.args[1]) == 0.0
    return number(fill) == 0.0


def _plain(gemm: Node) -> bool:
    """A grouped GEMM with no fused bias or output dtype (``aten._grouped_mm`` can have both)."""
    return arg(gemm, 3, "bias") is None and arg(gemm, 4, "out_dtype") is None


def _sorted_ids_of(node) -> Optional[Node]:
    """The sort node whose values (possibly clamped) index a per-expert bias."""
    node = node.args[1][0] if is_op(node, aten.index) and len(node.args[1]) == 1 else None
    while is_op(node, aten.clamp, aten.clamp_max, aten.clamp_min, prims.convert_element_type):
        node = node.args[0]
    if is_op(node, operator.getitem) and node.args[1] == 0 and is_op(node.args[0], aten.sort):
        return node.args[0]
    return None


def _bias(node: Node, sort: Node) -> tuple[Node, Optional[Node]]:
    """Peel ``t + bias[ids_sorted]`` and zero fills off ``node`` going backwards."""
    bias = None
    while True:
        if _is_zero_fill(node):
            node = node.args[2]
        elif is_op(node, aten.add) and bias is None and _sorted_ids_of(node.args[1]) is sort:
            bias, node = node.args[1].args[0], node.args[0]
        else:
            return node, bias


def match(ga: Node) -> Optional[moe.Match]:
    gmm = grouped_mm_ops()
    up = strip_converts(ga.args[0])
    # The sort is known only from the GEMM input; find the GEMM through fills first.
    probe = up
    while _is_zero_fill(probe) or is_op(probe, aten.add):
        probe = probe.args[2] if _is_zero_fill(probe) else probe.args[0]
    if not is_op(probe, *gmm):
        return None
    gemm1 = probe
    if not _plain(gemm1):
        return None
    a, w13, offs = gemm1.args[:3]
    a = strip_converts(a)
    while _is_zero_fill(a):
        a = strip_converts(a.args[2])
    a, qdq_gathered = moe.strip_qdq(a)
    if not (is_op(a, aten.index) and len(a.args[1]) == 1 and is_op(a.args[1][0], aten.div)):
        return None
    div = a.args[1][0]
    if div.kwargs.get("rounding_mode") != "floor" or as_int(div.args[1]) is None:
        return None
    k = as_int(div.args[1])
    perm = div.args[0]
    if not (is_op(perm, operator.getitem) and perm.args[1] == 1 and is_op(perm.args[0], aten.sort)):
        return None
    sort = perm.args[0]
    flat_ids = sort.args[0]
    if not is_op(flat_ids, aten.reshape, aten.view):
        return None
    topk_ids = flat_ids.args[0]
    x, qdq_x = moe.strip_qdq(strip_converts(a.args[0]))
    node, b13 = _bias(up, sort)
    if node is not gemm1:
        return None

    # Down projection: the other grouped_mm on the same offsets, reading the activation.
    gemm2 = next((u for u in offs.users if u is not gemm1 and is_op(u, *gmm)), None)
    if gemm2 is None or not _plain(gemm2):
        return None
    mid, qdq_mid = moe.strip_qdq(strip_converts(gemm2.args[0]))
    if strip_converts(mid) is not ga:
        return None

    # Epilogue: bias, fills, routing weights, un-permute, sum over the k slots.
    node, b2, weights, unpermuted = gemm2, None, None, False
    while True:
        nxt = only_user(node)
        if nxt is None:
            return None
        if _is_zero_fill(nxt) or is_op(nxt, prims.convert_element_type):
            pass
        elif is_op(nxt, aten.add) and b2 is None and _sorted_ids_of(nxt.args[1]) is sort:
            b2 = nxt.args[1].args[0]
        elif is_op(nxt, aten.mul) and weights is None:
            weights = _routing_weights(nxt.args[1] if nxt.args[0] is node else nxt.args[0], perm)
            if weights is None:
                return None
        elif is_op(nxt, aten.index) and not unpermuted and _is_inverse(nxt.args[1][0], perm):
            unpermuted = True
        elif is_op(nxt, aten.reshape, aten.view):
            out = moe.slot_sum(nxt, k)
            if out is None:
                return None
            break
        else:
            return None
        node = nxt
    qdq_in = moe.one_qdq(qdq_x, qdq_gathered)
    if weights is None or not unpermuted or qdq_in is False or not same(shape(topk_ids), shape(weights)):
        return None
    # transformers sorts ids >= E (expert-parallel sentinels) last and zeroes their rows.
    return moe.Match(
        FORM, out, x, topk_ids, weights, moe.weight(w13, kn=True), moe.weight(gemm2.args[1], kn=True),
        b13, b2, moe.activation_of(ga), dtype(gemm1.args[0]), qdq_in, qdq_mid, ids_beyond="drop",
    )


def _routing_weights(node: Node, perm: Node) -> Optional[Node]:
    """``topk_weights`` from ``topk_weights.reshape(-1)[perm].unsqueeze(-1)``."""
    node = strip_converts(node)
    if not is_op(node, aten.unsqueeze):
        return None
    node = strip_converts(node.args[0])
    if not (is_op(node, aten.index) and node.args[1][0] is perm):
        return None
    flat = node.args[0]
    return flat.args[0] if is_op(flat, aten.reshape, aten.view) and len(shape(flat.args[0])) == 2 else None


def _is_inverse(node: Node, perm: Node) -> bool:
    """``index_put(empty, [perm], arange)``: the inverse permutation of ``perm``."""
    return (
        is_op(node, aten.index_put)
        and list(node.args[1]) == [perm]
        and is_op(node.args[2], prims.iota, aten.arange)
    )


def rewrite(graph: Graph, separate) -> None:
    for ga in list(graph.find_nodes(op="call_function", target=torch.ops.mxfx.gated_activation.default)):
        m = match(ga)
        if m is not None:
            moe.emit(graph, m)
