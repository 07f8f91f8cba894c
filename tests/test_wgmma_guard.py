"""mxfx.kernels.wgmma_guard: Hopper binaries with unwritten wgmma descriptors are refused as
they are compiled (the analysis itself: tests/test_sass_dataflow.py; every MoE kernel compiled
through it for sm_90: tests/test_kernels_compile.py)."""
import os
import subprocess
import sys

import pytest
import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction

from mxfx.kernels import ptx_hints, wgmma_guard


def _add_one(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


def compile_sm90() -> bytes:
    # A JIT function even under TRITON_INTERPRET (CI), where triton.jit would interpret it.
    src = triton.compiler.ASTSource(JITFunction(_add_one), signature={"x_ptr": "*fp32"}, constexprs={})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


def _sm90_cubin(tmp_path) -> bytes:
    """:func:`compile_sm90` in a fresh process: in this one, under TRITON_INTERPRET, an earlier
    test's interpreted kernel can leave ``tl.tensor``'s operators patched (seen in CI on a
    whole run, never on this file alone), and compiling ``_add_one`` then fails."""
    out = tmp_path / "add_one.cubin"
    code = ("import importlib.util as u; "
            f"s = u.spec_from_file_location('wgmma_guard_test', {__file__!r}); m = u.module_from_spec(s); "
            f"s.loader.exec_module(m); open({str(out)!r}, 'wb').write(m.compile_sm90())")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    return out.read_bytes()


def test_hook_checks_named_kernels_once_in_the_chain(monkeypatch):
    calls, checked = [], []

    def previous(backend, stages, options, language, capability):
        calls.append(language)

    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", previous)
    monkeypatch.setattr(wgmma_guard, "_KERNELS", set())
    monkeypatch.setattr(wgmma_guard, "check_cubin", lambda name, cubin: checked.append((name, cubin)))
    wgmma_guard.guard("guarded_kernel")
    ptx_hints.l2_prefetch_128b("guarded_kernel")
    hook = knobs.runtime.add_stages_inspection_hook
    wgmma_guard.guard("other_guarded_kernel")  # already in the chain: not installed again
    assert knobs.runtime.add_stages_inspection_hook is hook
    assert hook.mxfx_hooks == {"wgmma_guard", "ptx_hints"}
    stages = {"ptx": lambda src, metadata: "", "cubin": lambda src, metadata: b"binary"}
    hook(None, stages, None, "gluon", 90)
    assert calls == ["gluon"]
    for name in ("guarded_kernel", "plain_kernel", "other_guarded_kernel"):
        assert stages["cubin"](None, {"name": name}) == b"binary"
    assert checked == [("guarded_kernel", b"binary"), ("other_guarded_kernel", b"binary")]
    amd = {"amdgcn": None}  # ROCm: no cubin stage, left alone
    hook(None, amd, None, "gluon", None)
    assert amd == {"amdgcn": None}


def test_a_binary_is_refused_when_the_analysis_finds_an_unwritten_descriptor(monkeypatch, tmp_path):
    cubin = _sm90_cubin(tmp_path)
    wgmma_guard.check_cubin("_add_one", cubin)  # a real binary, disassembled: nothing to find
    seen = []

    def finds(sass):
        seen.append(sass)
        return ["0x2a1b0 HGMMA.64x64x16.F32.BF16 R24, R88, gdesc[UR12], R24: UR[14, 15] not written on every path"]

    monkeypatch.setattr(wgmma_guard, "unwritten_descriptor_reads", finds)
    with pytest.raises(wgmma_guard.MiscompiledKernel, match=r"_add_one: .*0x2a1b0 HGMMA.*1 in all"):
        wgmma_guard.check_cubin("_add_one", cubin)
    assert "_add_one" in seen[0] and "LDG" in seen[0]  # it was given the binary's SASS


def test_without_cuobjdump_it_warns_and_does_not_check(monkeypatch):
    monkeypatch.setattr(wgmma_guard, "_cuobjdump", lambda: None)
    monkeypatch.setattr(wgmma_guard, "unwritten_descriptor_reads", lambda sass: ["would refuse"])
    with pytest.warns(UserWarning, match="no cuobjdump"):
        wgmma_guard.check_cubin("_add_one", b"not disassembled")


def test_the_whole_binary_is_disassembled_and_the_first_finding_named(monkeypatch, tmp_path):
    """check_cubin hands the disassembler a file holding all of ``cubin`` (a stand-in tool that
    prints the file back), gives the analysis its output, and names the first (lowest-address)
    finding with the count of all of them."""
    tool = tmp_path / "cuobjdump"
    tool.write_text('#!/bin/sh\n[ "$1" = -sass ] || exit 2\ncat "$2"\n')
    tool.chmod(0o755)
    monkeypatch.setattr(wgmma_guard, "_cuobjdump", lambda: str(tool))
    seen = []

    def finds(sass):
        seen.append(sass)
        return ["0x100 HGMMA a: UR[14] not written on every path", "0x200 HGMMA b: UR[15] not written on every path"]

    monkeypatch.setattr(wgmma_guard, "unwritten_descriptor_reads", finds)
    with pytest.raises(wgmma_guard.MiscompiledKernel, match=r"^k: .*0x100 HGMMA a.*\(2 in all\)"):
        wgmma_guard.check_cubin("k", b"a small binary")
    assert seen == ["a small binary"]
