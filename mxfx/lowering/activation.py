"""Gated activations as models write them → ``mxfx.gated_activation``.

A candidate is the elementwise expression that ends in a ``mul`` and reads two tensors: the
gate and the up operand. They are either two halves / the even and odd columns of one tensor
(``chunk(2)``, ``[..., ::2]``), or two separate tensors (gpt-fast's ``w1``/``w3`` GEMMs).
The parameters are read off the expression's constants (``alpha`` in ``sigmoid(alpha*x)``,
``beta`` in ``up + beta``, ``limit`` in the clamps) and then *confirmed numerically*: the
expression is evaluated on a fixed probe and compared with the one formula of
:mod:`mxfx.activation`. So every spelling (``F.silu``, ``x*sigmoid(x)``, ``x/(1+exp(-x))``,
``clamp``/``clamp_min``/``clamp_max``, ``+1``, casts to fp32 and back) is accepted exactly
when it computes that formula, and nothing else is.
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx import Graph, Node

from mxfx.activation import GatedActivation
from mxfx.backends import emulation
from mxfx.lowering import report
from mxfx.lowering.fx import (
    aten,
    arg,
    as_int,
    call,
    dtype,
    is_op,
    norm_dim,
    number,
    prims,
    same,
    shape,
    strip_identity_views,
    to_dtype,
)

ELEMENTWISE = (
    aten.mul, aten.add, aten.sub, aten.rsub, aten.div, aten.neg, aten.exp, aten.sigmoid,
    aten.silu, aten.clamp, aten.clamp_min, aten.clamp_max, aten.reciprocal,
    prims.convert_element_type,
)
_NONLINEAR = (aten.sigmoid, aten.exp, aten.silu)
# Elementwise |got - want| <= ATOL + RTOL * |want| on the probe; half types round each op.
_TOL = {torch.float64: (1e-9, 1e-7), torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 4e-2), torch.float16: (5e-3, 1e-2)}
_MAX_REGION = 40


@dataclass(frozen=True)
class Gated:
    """A recognised gated activation ending at ``out``.

    ``source`` is the [..., 2d] tensor both operands are read from (None when gate and up
    are separate tensors ``gate``/``up``); ``act.layout`` says how they are read from it.
    """

    out: Node
    gate: Node
    up: Node
    source: Optional[Node]
    act: GatedActivation


def _region(out: Node) -> Optional[tuple[list[Node], list[Node]]]:
    """The elementwise nodes computing ``out`` (graph order) and the tensor leaves they read."""
    seen: dict[Node, None] = {}
    leaves: dict[Node, None] = {}
    stack = [out]
    while stack:
        n = stack.pop()
        if n in seen or n in leaves:
            continue
        if is_op(n, *ELEMENTWISE):
            seen[n] = None
            if len(seen) > _MAX_REGION:
                return None
            stack.extend(a for a in (*n.args, *n.kwargs.values()) if isinstance(a, Node))
        else:
            leaves[n] = None
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    return sorted(seen, key=order.__getitem__), list(leaves)


def _selection(leaf: Node) -> Optional[tuple[Node, str]]:
    """``(source, part)`` if ``leaf`` reads ``part`` ∈ {even, odd, lo, hi} of ``source``'s last dim."""
    if is_op(leaf, aten.slice):
        src = leaf.args[0]
        n = len(shape(src) or ())
        if n == 0 or norm_dim(arg(leaf, 1, "dim", 0), n) != n - 1:
            return None
        width = as_int(shape(src)[-1])
        start = as_int(arg(leaf, 2, "start", 0) or 0)
        end = as_int(arg(leaf, 3, "end", None) or 2**62)
        step = as_int(arg(leaf, 4, "step", 1))
        if width is None or width % 2 or None in (start, end, step):
            return None
        end = min(end, width)
        part = {
            (0, width, 2): "even", (1, width, 2): "odd",
            (0, width // 2, 1): "lo", (width // 2, width, 1): "hi",
        }.get((start, end, step))
        return (src, part) if part else None
    if is_op(leaf, operator.getitem) and is_op(leaf.args[0], aten.split, aten.split_with_sizes):
        split = leaf.args[0]
        src = split.args[0]
        n = len(shape(src) or ())
        if n == 0 or norm_dim(arg(split, 2, "dim", 0), n) != n - 1:
            return None
        width = as_int(shape(src)[-1])
        sizes = split.args[1]
        halves = sizes == width // 2 if isinstance(sizes, int) else list(sizes) == [width // 2] * 2
        if width is None or width % 2 or not halves:
            return None
        return src, ("lo", "hi")[leaf.args[1]]
    return None


def _constants(region: list[Node]) -> tuple[list[float], list[float], list[float]]:
    """Candidate alphas, betas and limits read off the region's scalar arguments."""
    alphas, betas, limits = {1.0: None}, {0.0: None}, {}
    for n in region:
        scalars = [number(a) for a in n.args[1:] + tuple(n.kwargs.values())]
        scalars = [s for s in scalars if s is not None]
        if is_op(n, aten.mul):
            alphas.update(dict.fromkeys(scalars))
        elif is_op(n, aten.add):
            betas.update(dict.fromkeys(scalars))
        elif is_op(n, aten.sub):
            betas.update(dict.fromkeys(-s for s in scalars))
        elif is_op(n, aten.clamp, aten.clamp_min, aten.clamp_max):
            limits.update(dict.fromkeys(abs(s) for s in scalars if s != 0))
    return list(alphas), list(betas), [None, *limits]


def _evaluate(region: list[Node], env: dict) -> torch.Tensor:
    def value(a):
        if isinstance(a, Node):
            return env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(value(x) for x in a)
        return a

    for n in region:
        env[n] = n.target(*value(n.args), **{k: value(v) for k, v in n.kwargs.items()})
    return env[region[-1]]


def _probe_shape(like: Node, width: int) -> list[int]:
    rank = len(shape(like))
    return [1] * max(rank - 2, 0) + ([16] if rank >= 2 else []) + [width]


def parse(out: Node) -> Optional[Gated]:
    """The gated activation computed by ``out`` (a ``mul``), or None."""
    if not is_op(out, aten.mul) or dtype(out) not in _TOL:
        return None
    found = _region(out)
    if found is None:
        return None
    region, leaves = found
    if len(leaves) != 2 or not any(is_op(n, *_NONLINEAR) for n in region):
        return None
    sels = [_selection(leaf) for leaf in leaves]
    if all(sels) and strip_identity_views(sels[0][0]) is strip_identity_views(sels[1][0]):
        parts = {sels[0][1], sels[1][1]}
        if parts not in ({"even", "odd"}, {"lo", "hi"}):
            return None
        source = strip_identity_views(sels[0][0])
        layout = "interleaved" if "even" in parts else "halves"
        gate_part = "even" if layout == "interleaved" else "lo"
        gate, up = leaves if sels[0][1] == gate_part else leaves[::-1]
        return _confirm(out, region, gate, up, source, layout, sels)
    if any(sels) or not same(shape(leaves[0]), shape(leaves[1])):
        return None
    for gate, up in (leaves, leaves[::-1]):
        found = _confirm(out, region, gate, up, None, "halves", None)
        if found:
            return found
    return None


def _confirm(out, region, gate, up, source, layout, sels) -> Optional[Gated]:
    """Evaluate the region on a fixed probe; the candidate parameters that reproduce it best,
    if within the dtype's tolerance everywhere, are the activation's."""
    dt = dtype(gate)
    if dt not in _TOL:
        return None
    atol, rtol = max(_TOL[dtype(out)], _TOL[dt])
    alphas, betas, limits = _constants(region)
    width = as_int(shape(source if source is not None else gate)[-1])
    if width is None:
        return None
    # Mostly |v| < 3 (where alpha and beta show), a few per cent beyond the largest limit.
    scale = max([lim for lim in limits if lim is not None] + [3.0]) / 2.3
    gen = torch.Generator().manual_seed(0)
    if source is not None:
        probe = (torch.randn(_probe_shape(source, width), generator=gen) * scale).to(dt)
        env = {sel[0]: probe for sel in sels}
        for leaf in (gate, up):
            if is_op(leaf.args[0], aten.split, aten.split_with_sizes):
                env[leaf.args[0]] = leaf.args[0].target(probe, *leaf.args[0].args[1:], **leaf.args[0].kwargs)
            env[leaf] = leaf.target(env[leaf.args[0]], *leaf.args[1:], **leaf.kwargs)
        x = probe
    else:
        g, u = (torch.randn(2, *_probe_shape(gate, width), generator=gen) * scale).to(dt)
        env = {gate: g, up: u}
        x = torch.cat((g, u), dim=-1)
    try:
        got = _evaluate(region, env).to(torch.float64)
    except (RuntimeError, TypeError, ValueError, KeyError):
        return None
    best, best_err = None, 1.0
    for alpha, beta, limit in itertools.product(alphas, betas, limits):
        act = GatedActivation(layout, alpha, beta, limit)
        want = emulation.gated_activation(x, act).to(torch.float64)
        if got.shape != want.shape:
            return None
        err = ((got - want).abs() / (atol + rtol * want.abs())).max().item()
        if err <= best_err:
            best, best_err = act, err
    return Gated(out, gate, up, source, best) if best is not None else None


def _describe(g: Gated) -> str:
    limit = "none" if g.act.limit is None else f"{g.act.limit:g}"
    return (
        f"{g.act.layout} alpha={g.act.alpha:g} beta={g.act.beta:g} limit={limit} "
        f"{str(dtype(g.source)).removeprefix('torch.')} {list(shape(g.out))}"
    )


def rewrite(graph: Graph) -> list[Gated]:
    """Replace every gated activation read from one tensor by ``mxfx.gated_activation``.

    Returns the recognised activations whose gate and up are separate tensors (left as
    written; the gpt-fast MoE form consumes them).
    """
    separate: list[Gated] = []
    done: set[Node] = set()
    for node in reversed(list(graph.nodes)):
        if node in done or not is_op(node, aten.mul):
            continue
        g = parse(node)
        if g is None:
            continue
        done.update(_region(node)[0])
        if g.source is None:
            separate.append(g)
            continue
        with graph.inserting_before(node):
            new = call(
                graph,
                torch.ops.mxfx.gated_activation.default,
                (g.source, g.act.layout, float(g.act.alpha), float(g.act.beta),
                 None if g.act.limit is None else float(g.act.limit)),
            )
            new = to_dtype(graph, new, dtype(node))
        node.replace_all_uses_with(new)
        report.add(report.Record("gated_activation", True, _describe(g)))
    return separate
