"""The PTX rewrite of :mod:`mxfx.kernels.ptx_hints`: only the named kernels' cp.async copies and
plain global loads get ``.L2::128B``, and a stages hook installed before mxfx's still runs."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from triton import knobs  # noqa: E402

from mxfx.kernels import ptx_hints  # noqa: E402

PTX = ("cp.async.cg.shared.global [%r1+0], [%rd2+0], 0x10, %r3;\n"
       "cp.async.ca.shared.global [%r1+0], [%rd2+0], 0x4;\n"
       "ld.global.v4.b32 {%r4, %r5, %r6, %r7}, [%rd8+0];\n"
       "@%p1 ld.global.cg.u8 %rs1, [%rd9+0];\n"
       "ld.global.nc.b32 %r10, [%rd11+0];\n"
       "ld.global.L1::evict_last.b16 %rs2, [%rd12+0];\n"
       "ld.shared.b32 %r13, [%r14];\n")


def test_rewrite_hints_cg_copies_and_plain_loads():
    out = ptx_hints.rewrite(PTX).splitlines()
    assert out[0] == "cp.async.cg.shared.global.L2::128B [%r1+0], [%rd2+0], 0x10, %r3;"
    # The qualifier goes after a cache operator and before the vector width, as PTX orders them.
    assert out[2:4] == ["ld.global.L2::128B.v4.b32 {%r4, %r5, %r6, %r7}, [%rd8+0];",
                        "@%p1 ld.global.cg.L2::128B.u8 %rs1, [%rd9+0];"]
    # The 4-byte .ca copies have no such form, loads qualified otherwise are left to their
    # author, and shared memory has no L2: left as they are.
    assert [out[1]] + out[4:] == [PTX.splitlines()[1]] + PTX.splitlines()[4:]
    # A second pass adds nothing (the hint is there once).
    assert ptx_hints.rewrite(ptx_hints.rewrite(PTX)) == ptx_hints.rewrite(PTX)


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


def test_rewrite_hints_every_cache_operator_type_and_width_but_no_store():
    """Every plain ``ld.global`` is hinted whatever its cache operator (.ca/.cg/.cs), element
    type (b/f/s/u) and vector width (none, .v2/.v4/.v8); stores have no prefetch size and are
    left as written."""
    ptx = ("ld.global.ca.s32 %r1, [%rd1+0];\n"
           "ld.global.cs.v2.f32 {%f1, %f2}, [%rd2+0];\n"
           "ld.global.v8.b32 {%r2, %r3, %r4, %r5, %r6, %r7, %r8, %r9}, [%rd3+0];\n"
           "ld.global.s16 %rs1, [%rd4+0];\n"
           "st.global.v4.b32 [%rd5+0], {%r10, %r11, %r12, %r13};\n"
           "st.global.cg.u8 [%rd6+0], %rs2;\n")
    assert ptx_hints.rewrite(ptx).splitlines() == [
        "ld.global.ca.L2::128B.s32 %r1, [%rd1+0];",
        "ld.global.cs.L2::128B.v2.f32 {%f1, %f2}, [%rd2+0];",
        "ld.global.L2::128B.v8.b32 {%r2, %r3, %r4, %r5, %r6, %r7, %r8, %r9}, [%rd3+0];",
        "ld.global.L2::128B.s16 %rs1, [%rd4+0];",
        "st.global.v4.b32 [%rd5+0], {%r10, %r11, %r12, %r13};",
        "st.global.cg.u8 [%rd6+0], %rs2;",
    ]


def test_patterns_find_instructions_with_or_without_the_hint():
    """COPY and LOAD match an instruction whether or not it already has ``.L2::128B`` and give
    the hint (or "") as group 2, which tools/compile_kernels.py counts."""
    before = [m[1] for m in ptx_hints.COPY.findall(PTX)] + [m[1] for m in ptx_hints.LOAD.findall(PTX)]
    hinted = ptx_hints.rewrite(PTX)
    after = [m[1] for m in ptx_hints.COPY.findall(hinted)] + [m[1] for m in ptx_hints.LOAD.findall(hinted)]
    # One cg copy and two plain loads in PTX (the .ca copy, .nc, evict_last and shared loads are not).
    assert before == ["", "", ""]
    assert after == [".L2::128B"] * 3


def test_hook_wraps_the_stage_an_earlier_hook_put_in_place(monkeypatch):
    """An earlier hook may replace the ptx stage with its own function; mxfx's rewrite is applied
    to what that function returns (mxfx's wrapper is outermost)."""
    def previous(backend, stages, options, language, capability):
        stages["ptx"] = lambda src, metadata: PTX

    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", previous)
    monkeypatch.setattr(ptx_hints, "_KERNELS", set())
    ptx_hints.l2_prefetch_128b("hinted_kernel")
    stages = {"ptx": lambda src, metadata: "not this"}
    knobs.runtime.add_stages_inspection_hook(None, stages, None, "gluon", 90)
    assert stages["ptx"](None, {"name": "hinted_kernel"}) == ptx_hints.rewrite(PTX) != PTX
    assert stages["ptx"](None, {"name": "plain_kernel"}) == PTX
