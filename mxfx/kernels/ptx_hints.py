"""PTX qualifiers that Gluon has no spelling for, added to named kernels as Triton compiles them.

Gluon's ``async_copy_global_to_shared`` emits ``cp.async.cg.shared.global`` without the L2
prefetch-size qualifier, and neither it nor ``gl.load`` has a way to add one.
:func:`l2_prefetch_128b` registers a kernel whose copies and plain global loads then carry
``.L2::128B``, so an L2 miss fetches the whole 128-byte line rather than the sectors asked for.
The rewrite runs in Triton's ``ptx`` stage (:mod:`mxfx.kernels.stage_hooks`), on kernels
compiled after the registration, CUDA only. A kernel compiled with the hook replaced by
someone else's is right, only without the hint.
"""
from __future__ import annotations

import re

from mxfx.kernels import stage_hooks

_KERNELS: set[str] = set()
# cp.async copies, and loads with no qualifier but a cache operator (the hint goes between that
# and the vector width, PTX's order; loads qualified otherwise, .nc or an eviction priority, are
# left). Group 2 is the hint where one is there already: tools/compile_kernels.py counts them.
COPY = re.compile(r"(cp\.async\.cg\.shared\.global)(\.L2::128B)? ")
LOAD = re.compile(r"(\bld\.global(?:\.c[ags])?)(\.L2::128B)?((?:\.v[248])?\.[bfsu]\d+ )")


def rewrite(ptx: str) -> str:
    """``ptx`` with every ``cp.async.cg.shared.global`` and plain ``ld.global`` given
    ``.L2::128B`` (once)."""
    return LOAD.sub(r"\1.L2::128B\3", COPY.sub(r"\1.L2::128B ", ptx))


def l2_prefetch_128b(kernel_name: str) -> None:
    """Give the cp.async copies and global loads of the kernel whose entry is ``kernel_name``
    ``.L2::128B``."""
    _KERNELS.add(kernel_name)
    stage_hooks.install("ptx_hints", "ptx", _KERNELS, lambda name, ptx: rewrite(ptx))
