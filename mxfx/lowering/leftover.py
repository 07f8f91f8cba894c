"""Expert GEMMs that no MoE form rewrote, recorded with the reason.

A form matches a whole layer or nothing, so a layer written some other way would otherwise
leave no trace in :func:`mxfx.lowering.report`. Two signatures mark expert GEMMs after the
forms ran: ``grouped_mm`` over 3-D weights (grouped by their offsets: one layer), and a ``bmm``
reading weights gathered by routing ids (``W[ids]``; grouped by the ids). The reason names
what mxfx saw between the GEMMs when it is not a gated activation, the common cause (ReLU²
or GELU MLP experts, which ``mxfx.moe`` does not compute).
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, Optional

import torch
from torch.fx import Graph, Node

from mxfx.lowering import moe, report
from mxfx.lowering.activation import Gated
from mxfx.lowering.fx import aten, arg, is_op, packet, prims, shape, skip
from mxfx.lowering.moe_grouped_mm import grouped_mm_ops

_VIEWS = (
    aten.reshape, aten.view, aten.permute, aten.transpose, aten.unsqueeze, aten.squeeze,
    aten.expand, aten.clone, aten.slice, prims.convert_element_type,
)
_REACH = 200  # nodes followed each way from a layer's GEMMs


def record(graph: Graph, separate: Iterable[Gated]) -> None:
    """Add a report record for every layer of expert GEMMs still in ``graph``. Backward graphs
    (AOTAutograd names their gradient inputs ``tangents_*``) are skipped: their GEMMs are
    gradients, which mxfx does not compute."""
    if any("tangents" in str(n.target) for n in graph.find_nodes(op="placeholder")):
        return
    gated = {g.out for g in separate}
    gated.update(graph.find_nodes(op="call_function", target=torch.ops.mxfx.gated_activation.default))
    for form, gemms in _layers(graph):
        below = _reach(gemms, lambda n: n.users)
        if any(n.meta.get(moe.REPORTED) for n in below):
            continue  # the form matched this layer and recorded why it left it
        between = below & _reach(gemms, lambda n: n.all_input_nodes)
        e = (shape(_weight(gemms[0])) or ("?",))[0]
        detail = f"{len(gemms)} expert GEMM{'s' if len(gemms) > 1 else ''}, E={e}"
        report.add(report.Record(form, False, detail, reason=_reason(gemms, between, gated)))


def _layers(graph: Graph) -> list[tuple[str, list[Node]]]:
    layers: dict[Node, tuple[str, list[Node]]] = {}
    gmm = grouped_mm_ops()
    for node in graph.nodes:
        offs = arg(node, 2, "offs") if is_op(node, *gmm) else None
        if offs is not None and len(shape(node.args[1]) or ()) == 3:
            layers.setdefault(offs, ("grouped_mm", []))[1].append(node)
        elif is_op(node, aten.bmm):
            ids = next((g.args[1][0] for g in map(_gathered, node.args) if g is not None), None)
            if ids is not None:
                layers.setdefault(ids, ("gathered_bmm", []))[1].append(node)
    return list(layers.values())


def _gathered(node) -> Optional[Node]:
    """``W[ids]`` (3-D ``W``, one index tensor) under views, or None."""
    node = skip(node, lambda n: is_op(n, *_VIEWS))
    if is_op(node, aten.index) and len(node.args[1]) == 1 and len(shape(node.args[0]) or ()) == 3:
        return node
    return None


def _weight(gemm: Node) -> Node:
    if is_op(gemm, aten.bmm):
        return next(g.args[0] for g in map(_gathered, gemm.args) if g is not None)
    return gemm.args[1]


def _reach(start: list[Node], step) -> set[Node]:
    seen: set[Node] = set()
    todo = deque(n for s in start for n in step(s))
    while todo and len(seen) < _REACH:
        n = todo.popleft()
        if n not in seen:
            seen.add(n)
            todo.extend(step(n))
    return seen


def _reason(gemms: list[Node], between: set[Node], gated: set[Node]) -> str:
    if len(gemms) == 1:
        return "one expert GEMM alone: mxfx.moe replaces a layer's up and down projections together"
    if not between & gated:
        ops = sorted({packet(n).__name__ for n in between if packet(n) is not None and not is_op(n, *_VIEWS)})
        return (
            "no gated activation mxfx knows between the expert GEMMs (mxfx.moe computes clamped "
            f"SwiGLU and SiLU-and-mul; the ops there: {', '.join(ops) or 'none'})"
        )
    return (
        "the routing around the expert GEMMs is not written in a form mxfx rewrites "
        "(transformers grouped_mm / batched_mm / 4.x bmm, gpt-fast gather + einsum)"
    )
