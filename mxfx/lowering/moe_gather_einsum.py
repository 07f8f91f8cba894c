"""gpt-fast style MoE: expert weights gathered per token, ``einsum`` GEMMs, separate gate/up.

    w1, w3, w2 = W1[ids], W3[ids], W2[ids]                  ids = topk_ids [T, k]
    y   = einsum('tao,taio->tai', act(einsum('ti,taoi->tao', x, w1), einsum(.., x, w3)), w2)
    out = einsum('tai,ta->ti', y, topk_weights)

Inductor lowers each einsum to a ``bmm`` between permuted/reshaped views. Which axes each
``bmm`` contracts is recovered by following the views with labelled axes ("t", "a", "h",
and the weights' own axes), so a weight used transposed is read correctly, and a layout
this module cannot follow is left alone.
"""
from __future__ import annotations

from typing import Optional

from torch.fx import Graph, Node

from mxfx.lowering import moe
from mxfx.lowering.activation import Gated
from mxfx.lowering.fx import aten, as_int, dtype, is_op, norm_dim, only_user, prims, same, shape

FORM = "gather_einsum"
_VIEWS = (aten.reshape, aten.view, aten.permute, aten.unsqueeze, aten.squeeze, aten.clone, prims.convert_element_type)

Dims = list  # one tuple of axis labels per dimension; () for a size-1 dimension


def _chain(node: Node, rank: Optional[int] = None) -> tuple[Node, list[Node]]:
    """``(base, views)``: the views leading from ``base`` to ``node``; with ``rank``, the base
    is the first tensor of that rank going back."""
    views = []
    while is_op(node, *_VIEWS) and (rank is None or len(shape(node)) != rank):
        views.append(node)
        node = node.args[0]
    return node, views[::-1]


def _apply(dims: Dims, sizes: dict, views: list[Node]) -> Optional[Dims]:
    """The labels of ``views[-1]`` given those of the chain's base; None if a view splits an axis."""
    for v in views:
        if is_op(v, aten.permute):
            dims = [dims[i] for i in v.args[1]]
        elif is_op(v, aten.unsqueeze):
            dims = list(dims)
            dims.insert(norm_dim(v.args[1], len(dims) + 1), ())
        elif is_op(v, aten.squeeze):
            dims = [d for d in dims if d]
            if len(dims) != len(shape(v)):
                return None
        elif is_op(v, aten.reshape, aten.view):
            atoms = [a for d in dims for a in d]
            out, i = [], 0
            for size in shape(v):
                if as_int(size) == 1:
                    out.append(())
                    continue
                group, prod = [], 1
                while not same(prod, size):
                    if i >= len(atoms) or len(group) > len(atoms):
                        return None
                    group.append(atoms[i])
                    prod = prod * sizes[atoms[i]]
                    i += 1
                out.append(tuple(group))
            if i != len(atoms):
                return None
            dims = out
    return dims


def _label(node: Node, names: tuple) -> tuple[Dims, dict]:
    """Labels for a base tensor's axes (size-1 axes get none)."""
    dims, sizes = [], {}
    for name, size in zip(names, shape(node)):
        if as_int(size) == 1:
            dims.append(())
        else:
            dims.append((name,))
            sizes[name] = size
    return dims, sizes


def _expect(sizes: dict, *names) -> Dims:
    """The labels of a tensor with these axes (an axis of size 1 has none)."""
    return [(n,) if n in sizes else () for n in names]


def _bmm(a_dims: Dims, b_dims: Dims) -> Optional[tuple[Dims, tuple, tuple]]:
    """``bmm`` output labels and the contracted label groups of its two operands."""
    if len(a_dims) != 3 or len(b_dims) != 3 or a_dims[0] != b_dims[0]:
        return None
    return [a_dims[0], a_dims[1], b_dims[2]], a_dims[2], b_dims[1]


def _expert_gemm(leaf: Node, ids: Optional[Node]):
    """For a ``[T, k, N]`` GEMM result ``leaf`` = einsum(x, W[ids]): ``(x, weight, ids, gemm)``."""
    c, views_out = _chain(leaf)
    if not is_op(c, aten.bmm):
        return None
    a_base, a_views = _chain(c.args[0], rank=2)
    g, b_views = _chain(c.args[1])
    if not (is_op(g, aten.index) and len(g.args[1]) == 1 and len(shape(g)) == 4):
        return None
    w, gids = g.args[0], g.args[1][0]
    if (ids is not None and gids is not ids) or len(shape(w)) != 3 or len(shape(a_base)) != 2:
        return None
    x, qdq = moe.strip_qdq(a_base)
    xd, xs = _label(a_base, ("t", "h"))
    gd, gs = _label(g, ("t", "a", 1, 2))
    if not same(xs.get("t"), gs.get("t")):
        return None
    sizes = {**xs, **gs}
    a_dims, b_dims = _apply(xd, sizes, a_views), _apply(gd, sizes, b_views)
    if a_dims is None or b_dims is None:
        return None
    found = _bmm(a_dims, b_dims)
    if found is None:
        return None
    c_dims, ka, kb = found
    if ka != ("h",) or kb not in ((1,), (2,)):
        return None
    n_axis = 3 - kb[0]
    if _apply(c_dims, sizes, views_out) != _expect(sizes, "t", "a", n_axis):
        return None
    return x, qdq, moe.weight_from(w, (0, n_axis, kb[0])), gids, dtype(c.args[0])


def match(act: Gated) -> Optional[moe.Match]:
    gate = _expert_gemm(act.gate, None)
    if gate is None:
        return None
    x, qdq_x, w_gate, ids, gemm_dtype = gate
    up = _expert_gemm(act.up, ids)
    if up is None or up[0] is not x or up[1] != qdq_x:
        return None
    w_up = up[2]

    # Down projection: bmm(act-view, W2[ids]-view) contracting the intermediate axis.
    for g in ids.users:
        if not (is_op(g, aten.index) and len(shape(g)) == 4 and g.args[0] not in (w_gate.node, w_up.node)):
            continue
        for c in _consumers(g):
            found = _down(c, act, g)
            if found is not None:
                out, weights, w2, qdq_mid = found
                return moe.Match(
                    FORM, out, x, ids, weights, (w_gate, w_up), w2, None, None, act.act,
                    gemm_dtype, qdq_x, qdq_mid,
                )
    return None


def _consumers(g: Node) -> list[Node]:
    """The bmm nodes reading ``g`` through views."""
    found, stack = [], [g]
    while stack:
        n = stack.pop()
        for u in n.users:
            if is_op(u, aten.bmm):
                found.append(u)
            elif is_op(u, *_VIEWS):
                stack.append(u)
    return found


def _down(c: Node, act: Gated, g: Node):
    a_base, a_views = _chain(c.args[0])
    g_base, b_views = _chain(c.args[1])
    if g_base is not g:
        return None
    mid, qdq_mid = moe.strip_qdq(a_base)
    if mid is not act.out:
        return None
    md, ms = _label(a_base, ("t", "a", "i"))
    gd, gs = _label(g, ("t", "a", 1, 2))
    sizes = {**ms, **gs}
    a_dims, b_dims = _apply(md, sizes, a_views), _apply(gd, sizes, b_views)
    if a_dims is None or b_dims is None:
        return None
    found = _bmm(a_dims, b_dims)
    if found is None or found[1] != ("i",) or found[2] not in ((1,), (2,)):
        return None
    c_dims, kb = found[0], found[2][0]
    n_axis = 3 - kb
    w2 = moe.weight_from(g.args[0], (0, n_axis, kb))

    # Weighted sum over the k slots (einsum 'tai,ta->ti'): a bmm of y and the weights, either
    # way round, contracting the slot axis.
    node, views = c, []
    while True:
        nxt = only_user(node)
        if nxt is None:
            return None
        if is_op(nxt, aten.bmm) and node in nxt.args[:2]:
            break
        if not is_op(nxt, *_VIEWS):
            return None
        views.append(nxt)
        node = nxt
    final = nxt
    y_dims = _apply(c_dims, sizes, views)
    w_base, w_views = _chain(final.args[1] if final.args[0] is node else final.args[0], rank=2)
    if y_dims is None or len(shape(w_base)) != 2:
        return None
    wd, ws = _label(w_base, ("t", "a"))
    w_dims = _apply(wd, {**sizes, **ws}, w_views)
    if w_dims is None:
        return None
    found = _bmm(y_dims, w_dims) if final.args[0] is node else _bmm(w_dims, y_dims)
    slot = tuple(_expect(sizes, "a")[0])
    if found is None or found[1] != slot or found[2] != slot:
        return None
    out_dims, out = found[0], final
    while out_dims != _expect(sizes, "t", n_axis) or len(shape(out)) != 2:
        nxt = only_user(out)
        if not is_op(nxt, *_VIEWS):
            return None
        out_dims = _apply(out_dims, {**sizes, **ws}, [nxt])
        if out_dims is None:
            return None
        out = nxt
    return out, w_base, w2, qdq_mid


def rewrite(graph: Graph, separate: list[Gated]) -> None:
    for act in separate:
        m = match(act)
        if m is not None:
            moe.emit(graph, m)
