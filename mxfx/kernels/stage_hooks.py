"""mxfx's wrappers of Triton compilation stages, installed through
``knobs.runtime.add_stages_inspection_hook``.

Each wrapper is installed once, by name, chained after the hook already there (someone
else's or another of mxfx's), and applies to kernels compiled after its installation. A
backend without the stage (ROCm has no ``ptx`` or ``cubin``) is left alone. A hook that
replaces the chain later drops the wrappers: kernels compiled then are built without them.
"""
from __future__ import annotations

from typing import Callable

from triton import knobs

Stage = Callable[[object, dict], object]


def install(name: str, stage: str, wrap: Callable[[Stage], Stage]) -> None:
    """Replace Triton's ``stage`` (e.g. ``"ptx"``, ``"cubin"``) by ``wrap(stage)`` in every
    later compilation, unless a hook called ``name`` is already in the chain."""
    previous = knobs.runtime.add_stages_inspection_hook
    installed = getattr(previous, "mxfx_hooks", frozenset())
    if name in installed:
        return

    def add_stages(backend, stages, options, language, capability):
        if previous is not None:
            previous(backend, stages, options, language, capability)
        if stage in stages:
            stages[stage] = wrap(stages[stage])

    add_stages.mxfx_hooks = installed | {name}
    knobs.runtime.add_stages_inspection_hook = add_stages
