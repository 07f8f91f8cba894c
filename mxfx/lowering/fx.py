"""Small helpers for reading and editing post-grad (aten-level) FX graphs."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._pytree import tree_leaves, tree_map

aten = torch.ops.aten
prims = torch.ops.prims


def packet(node: Any):
    """The op packet a ``call_function`` node calls (``aten.mul`` for ``aten.mul.Tensor``), or None."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    return getattr(node.target, "overloadpacket", node.target)


def is_op(node: Any, *packets) -> bool:
    p = packet(node)
    return p is not None and p in packets


def val(node: Any):
    """The fake tensor (or SymInt) Inductor recorded for ``node``; None for non-nodes."""
    return node.meta.get("val") if isinstance(node, Node) else None


def shape(node: Any) -> Optional[tuple]:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype(node: Any) -> Optional[torch.dtype]:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def same(a, b) -> bool:
    """``a == b`` for ints or SymInts, without adding guards (unknown counts as different)."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (
            isinstance(a, (list, tuple))
            and isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b))
        )
    return bool(statically_known_true(a == b))


def as_int(x) -> Optional[int]:
    """``x`` as a Python int when it is one statically (SymInts with a constant value included)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt) and x.node.is_constant():
        return int(x.node.maybe_as_int())
    return None


def number(x) -> Optional[float]:
    """``x`` as a Python number if it is a scalar argument (not a tensor/node)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def arg(node: Node, index: int, name: str, default=None):
    """Argument ``index`` (positional) or ``name`` (keyword) of ``node``, else ``default``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def only_user(node: Node) -> Optional[Node]:
    us = list(node.users)
    return us[0] if len(us) == 1 else None


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def skip(node: Any, pred: Callable[[Node], bool]) -> Any:
    """Follow ``args[0]`` while ``pred(node)``."""
    while isinstance(node, Node) and pred(node):
        node = node.args[0]
    return node


def strip_converts(node: Any) -> Any:
    return skip(node, lambda n: is_op(n, prims.convert_element_type))


def strip_identity_views(node: Any) -> Any:
    """Drop views that do not change the tensor: ``squeeze(unsqueeze(x, d), d)``, dtype
    converts to the same dtype, and reshapes to the same shape."""
    while isinstance(node, Node):
        src = node.args[0] if node.args else None
        if (
            is_op(node, aten.squeeze)
            and is_op(src, aten.unsqueeze)
            and len(node.args) > 1
            and shape(src) is not None
            and norm_dim(_first(node.args[1]), len(shape(src))) == norm_dim(src.args[1], len(shape(src)))
        ):
            node = src.args[0]
        elif is_op(node, aten.reshape, aten.view, prims.convert_element_type, aten.clone) and (
            shape(src) is not None and same(shape(src), shape(node)) and dtype(src) == dtype(node)
        ):
            node = src
        else:
            return node
    return node


def _first(d):
    return d[0] if isinstance(d, (list, tuple)) and len(d) == 1 else d


def permute_chain(node: Any) -> tuple[Any, list[int]]:
    """``(base, perm)`` with ``node == base.permute(perm)``, following permutes/transposes."""
    rank = len(shape(node) or ())
    perm = list(range(rank))
    while True:
        if is_op(node, aten.permute):
            p = list(node.args[1])
            perm = [p[i] for i in perm]
            node = node.args[0]
        elif is_op(node, aten.transpose):
            n = len(shape(node.args[0]))
            a, b = norm_dim(node.args[1], n), norm_dim(node.args[2], n)
            p = list(range(n))
            p[a], p[b] = p[b], p[a]
            perm = [p[i] for i in perm]
            node = node.args[0]
        else:
            nxt = strip_identity_views(node)
            if nxt is node:
                return node, perm
            node = nxt


def fake_mode_of(nodes: Iterable[Node]):
    return detect_fake_mode([val(n) for n in nodes if isinstance(val(n), torch.Tensor)])


def call(graph: Graph, target, args: Sequence = (), kwargs: Optional[dict] = None) -> Node:
    """Insert ``target(*args, **kwargs)`` at the graph's insertion point, with its meta ``val``
    computed under the graph's fake mode (so later Inductor passes see shapes and strides)."""
    kwargs = kwargs or {}
    node = graph.call_function(target, tuple(args), kwargs)
    mode = fake_mode_of(a for a in tree_leaves((tuple(args), kwargs)) if isinstance(a, Node))
    fargs, fkwargs = tree_map(lambda a: val(a) if isinstance(a, Node) else a, (tuple(args), kwargs))
    with mode:
        node.meta["val"] = target(*fargs, **fkwargs)
    return node


def to_dtype(graph: Graph, node: Node, dt: torch.dtype) -> Node:
    if dtype(node) == dt:
        return node
    return call(graph, prims.convert_element_type.default, (node, dt))


def permute(graph: Graph, node: Node, perm: Sequence[int]) -> Node:
    if list(perm) == list(range(len(perm))):
        return node
    return call(graph, aten.permute.default, (node, list(perm)))


def sizes_of(graph: Graph, node: Node) -> list:
    """``node``'s sizes as reshape arguments: ints, or ``sym_size`` nodes for symbolic ones."""
    out = []
    for i, s in enumerate(shape(node)):
        n = as_int(s)
        out.append(n if n is not None else call(graph, aten.sym_size.int, (node, i)))
    return out
