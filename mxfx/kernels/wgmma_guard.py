"""Refuse a Hopper kernel binary in which ptxas left an HGMMA's descriptor registers unwritten.

Such a binary runs an MMA on a stale shared-memory descriptor
(:mod:`mxfx.kernels.sass_dataflow`): an illegal-address fault at best, a wrong result at worst,
for whichever shapes the miscompiled specialization serves. The compile-time tests check a few
model sizes; this checks every binary a registered kernel is actually compiled to, on the
user's ptxas, once per compilation (Triton's cache then serves the checked binary). It runs in
Triton's ``cubin`` stage (:mod:`mxfx.kernels.stage_hooks`), disassembling with the
``cuobjdump`` Triton ships; where there is none, it warns and does not check. A refused
binary raises :class:`MiscompiledKernel` from the launch that compiled it.
"""
from __future__ import annotations

import subprocess
import tempfile
import warnings
from typing import Optional

from triton import knobs

from mxfx.kernels import stage_hooks
from mxfx.kernels.sass_dataflow import unwritten_descriptor_reads

_KERNELS: set[str] = set()


class MiscompiledKernel(RuntimeError):
    """ptxas produced a binary that reads unwritten wgmma descriptor registers."""


def _cuobjdump() -> Optional[str]:
    try:
        return knobs.nvidia.cuobjdump.path
    except RuntimeError:  # Triton's lookup found none
        return None


def check_cubin(name: str, cubin: bytes) -> None:
    """Raise :class:`MiscompiledKernel` if ``cubin`` (kernel ``name``) has an HGMMA whose
    descriptor registers some path leaves unwritten."""
    tool = _cuobjdump()
    if tool is None:
        warnings.warn("mxfx: no cuobjdump, so Hopper kernels' wgmma descriptors are not checked", stacklevel=2)
        return
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    bad = unwritten_descriptor_reads(sass)
    if bad:
        raise MiscompiledKernel(f"{name}: ptxas left wgmma descriptor registers unwritten on some path, so the "
                                f"MMA would read a stale shared-memory address: {bad[0]} ({len(bad)} in all). "
                                "Report the shape; a different ptxas (TRITON_PTXAS_PATH) may compile it right.")


def guard(kernel_name: str) -> None:
    """Check every binary of the kernel whose entry is ``kernel_name`` as Triton compiles it."""
    _KERNELS.add(kernel_name)
    stage_hooks.install("wgmma_guard", "cubin", _KERNELS, check_cubin)
