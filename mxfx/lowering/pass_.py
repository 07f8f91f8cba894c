"""The Inductor post-grad pass, and installing it (``enable``/``disable``/``enabled``/options).

The pass is a :class:`CustomGraphPass` whose ``uuid`` hashes the source of every module whose
behaviour shapes the rewritten graph (this package, the oracle, the backend registry and
capabilities) plus the settings that steer the oracle. So the FX graph cache keys on exactly
what changes the output, and a second compile of the same model hits it.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

from mxfx import backends
from mxfx.lowering import activation, leftover, moe, moe_batched_mm, moe_dense_bmm, moe_gather_einsum, moe_grouped_mm
from mxfx.oracle import Platform, settings

_OPTION = "post_grad_custom_post_pass"
_PACKAGE = Path(__file__).resolve().parent.parent
_SOURCES = ("lowering", "oracle", "backends", "activation.py", "formats.py", "ops.py")
MOE_FORMS = (moe_grouped_mm, moe_batched_mm, moe_dense_bmm, moe_gather_einsum)


def _source_files() -> tuple[str, ...]:
    files: list[Path] = []
    for name in _SOURCES:
        path = _PACKAGE / name
        files.extend(sorted(path.glob("*.py")) if path.is_dir() else [path])
    return tuple(str(p) for p in files)


def _hash(files: tuple[str, ...]) -> str:
    # Read on every call (torch's get_hash_for_files caches per process); names, not paths,
    # so the same source hashes the same wherever it is installed.
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).name.encode())
        h.update(Path(f).read_bytes())
    return h.hexdigest()


class LoweringPass(CustomGraphPass):
    """Rewrites gated activations and MoE subgraphs of a post-grad graph into ``mxfx`` ops."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        before = len(graph.nodes)
        moe.pin_backends(graph)
        separate = activation.rewrite(graph)
        for form in MOE_FORMS:
            form.rewrite(graph, separate)
        if len(graph.nodes) != before:  # every rewrite inserts nodes; drop what it orphaned
            graph.eliminate_dead_code()
            graph.lint()
        leftover.record(graph, separate)

    def uuid(self) -> Any:
        return (
            "mxfx.lowering",
            _hash(_source_files()),
            repr(settings.current()),
            os.environ.get(settings.ENV_BACKEND, ""),
            str(Platform.current()),
            backends.names(),
        )


class ComposedPass(CustomGraphPass):
    """Runs ``passes`` in order. Its ``uuid`` is None (no caching) if any part has none."""

    def __init__(self, *passes) -> None:
        self.passes = passes

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Any:
        ids = []
        for p in self.passes:
            u = p.uuid() if isinstance(p, CustomGraphPass) else None
            if u is None:
                return None
            ids.append(u)
        return tuple(ids)


PASS = LoweringPass()


def _with_mxfx(existing) -> Any:
    """``existing`` (a user's pass, or None) followed by the mxfx pass; never doubled."""
    if existing is None or existing is PASS:
        return PASS
    if isinstance(existing, ComposedPass) and PASS in existing.passes:
        return existing
    return ComposedPass(existing, PASS)


def _without_mxfx(current) -> Any:
    if current is PASS:
        return None
    if isinstance(current, ComposedPass) and PASS in current.passes:
        rest = tuple(p for p in current.passes if p is not PASS)
        return rest[0] if len(rest) == 1 else (ComposedPass(*rest) if rest else None)
    return current


def enable() -> None:
    """Install the mxfx pass for every later ``torch.compile`` (Inductor) in this process,
    after any ``post_grad_custom_post_pass`` already set. Calling it twice is harmless."""
    setattr(inductor_config, _OPTION, _with_mxfx(getattr(inductor_config, _OPTION)))


def disable() -> None:
    """Remove the mxfx pass, keeping any other post-grad pass that was set."""
    setattr(inductor_config, _OPTION, _without_mxfx(getattr(inductor_config, _OPTION)))


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """``with mxfx.enabled():`` the pass is installed inside the block; on exit the
    previous ``post_grad_custom_post_pass`` is restored as it was."""
    before = getattr(inductor_config, _OPTION)
    setattr(inductor_config, _OPTION, _with_mxfx(before))
    try:
        yield
    finally:
        setattr(inductor_config, _OPTION, before)


def inductor_options(existing: Optional[Any] = None) -> dict[str, Any]:
    """Options for ``torch.compile(model, options=mxfx.inductor_options())``: the mxfx pass for
    that compile only, no global state. ``existing``: a post-grad pass of your own to run
    first (default: the one currently set in ``torch._inductor.config``, if any)."""
    if existing is None:
        existing = getattr(inductor_config, _OPTION)
    return {_OPTION: _with_mxfx(existing)}
