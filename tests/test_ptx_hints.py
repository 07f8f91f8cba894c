"""The PTX rewrite of :mod:`mxfx.kernels.ptx_hints`: only the named kernels' cp.async copies get
``.L2::128B``, and a stages hook installed before mxfx's still runs."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from triton import knobs  # noqa: E402

from mxfx.kernels import ptx_hints  # noqa: E402

PTX = ("cp.async.cg.shared.global [%r1+0], [%rd2+0], 0x10, %r3;\n"
       "cp.async.ca.shared.global [%r1+0], [%rd2+0], 0x4;\n"
       "ld.global.v4.b32 {%r4, %r5, %r6, %r7}, [%rd8+0];\n")


def test_rewrite_hints_the_cg_copies_only():
    out = ptx_hints.rewrite(PTX)
    assert "cp.async.cg.shared.global.L2::128B [%r1+0], [%rd2+0], 0x10, %r3;" in out
    # The 4-byte .ca copies and plain loads have no such form here: left as they are.
    assert out.splitlines()[1:] == PTX.splitlines()[1:]


def test_hook_rewrites_named_kernels_and_chains(monkeypatch):
    calls = []

    def previous(backend, stages, options, language, capability):
        calls.append(language)

    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", previous)
    monkeypatch.setattr(ptx_hints, "_KERNELS", set())
    ptx_hints.l2_prefetch_128b("hinted_kernel")
    ptx_hints.l2_prefetch_128b("other_hinted_kernel")  # the hook is installed once
    hook = knobs.runtime.add_stages_inspection_hook
    assert hook is not previous and "ptx_hints" in hook.mxfx_hooks
    stages = {"llir": None, "ptx": lambda src, metadata: PTX}
    hook(None, stages, None, "gluon", 90)
    assert calls == ["gluon"]
    assert ".L2::128B" in stages["ptx"](None, {"name": "hinted_kernel"})
    assert ".L2::128B" in stages["ptx"](None, {"name": "other_hinted_kernel"})
    assert stages["ptx"](None, {"name": "plain_kernel"}) == PTX
    # A backend without a ptx stage (ROCm) is left alone.
    amd = {"amdgcn": None}
    hook(None, amd, None, "gluon", None)
    assert amd == {"amdgcn": None} and calls == ["gluon", "gluon"]
