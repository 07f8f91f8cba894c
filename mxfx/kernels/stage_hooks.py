"""mxfx's wrappers of Triton compilation stages, installed through
``knobs.runtime.add_stages_inspection_hook``.

Each wrapper is installed once, by name, chained after the hook already there (someone
else's or another of mxfx's), and applies to kernels compiled after its installation. A
backend without the stage (ROCm has no ``ptx`` or ``cubin``) is left alone. A hook that
replaces the chain later drops the wrappers: kernels compiled then are built without them.
"""
from __future__ import annotations

from typing import Any, Callable

from triton import knobs


def install(name: str, stage: str, kernels: set[str], apply: Callable[[str, Any], Any]) -> None:
    """In every later compilation, pass the output of Triton's ``stage`` (e.g. ``"ptx"``,
    ``"cubin"``) for a kernel whose entry is in ``kernels`` (read at compile time, so names
    may be added later) through ``apply(kernel_name, output)``, whose result (``None``: the
    output unchanged) replaces it. Installed once: not again while a hook called ``name`` is
    in the chain."""
    previous = knobs.runtime.add_stages_inspection_hook
    installed = getattr(previous, "mxfx_hooks", frozenset())
    if name in installed:
        return

    def wrap(make):
        def run(src, metadata):
            out = make(src, metadata)
            kernel = metadata.get("name")
            if kernel not in kernels:
                return out
            applied = apply(kernel, out)
            return out if applied is None else applied

        return run

    def add_stages(backend, stages, options, language, capability):
        if previous is not None:
            previous(backend, stages, options, language, capability)
        if stage in stages:
            stages[stage] = wrap(stages[stage])

    add_stages.mxfx_hooks = installed | {name}
    knobs.runtime.add_stages_inspection_hook = add_stages
