"""Compile every kernel specialization mxfx's launch code makes, for GPU targets, on any machine.

The launch code runs on CPU tensors with the launches recorded instead of run: the MoE fused
and unfused, MXFP4 and float weights, float16 / bfloat16 / float32, activation quantization,
the tile regime of each branch of ``pick_config``, routing in one and in several chunks, the
MX helpers. Each distinct specialization is then bound, specialized and compiled the way
Triton's own launch would do it for the target, through to the device binary (ptxas for
CUDA, the AMDGPU backend for ROCm), so a kernel that does not build for a GPU fails here
without one. One line per specialization, or ``--json``. ``--sass`` (CUDA targets) adds the
SASS instruction count of each kernel's longest loop (in its own code, not in the functions it
calls) and its most frequent opcodes, a first look at a variant's arithmetic cost before timing
it on a GPU (with a model's sizes, so that the K loop is a loop). CUDA kernels are compiled afresh, not taken from Triton's cache,
so that ptxas's log is read: a kernel whose wgmma instructions ptxas serialized (too few
registers, for one) is marked ``WGMMA SERIALIZED`` (``serialized_wgmma`` in ``--json``), one that
spills registers to local memory ``SPILLS`` (``spill_bytes``). Kernels with PDL instructions
report them (``launches_dependents``, ``loads_before_waits``: :func:`grid_control`). A CUDA
kernel's cp.async copies and plain global loads are counted, with those carrying ``.L2::128B``
(``cp_async``, ``ld_global`` in ``--json``; see :mod:`mxfx.kernels.ptx_hints`). A Hopper
kernel whose binary :mod:`mxfx.kernels.wgmma_guard` refuses (an HGMMA reading descriptor
registers that some path leaves unwritten) fails with ``MiscompiledKernel``.

    python tools/compile_kernels.py [--target cuda:90 hip:gfx942 ...] [--json]
    python tools/compile_kernels.py --target cuda:90 --sass --hidden 2880 --intermediate 2880
    python tools/compile_kernels.py --target cuda:90 --hidden 1024 --intermediate 512 --match "_ws .*'NC': 4"
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

os.environ.pop("TRITON_INTERPRET", None)  # kernels must be JIT functions, not interpreted

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mxfx.activation import GPT_OSS, SILU_AND_MUL, minimax_m3  # noqa: E402
from mxfx.kernels import activation, launch, moe, moe_sm90, mx, ptx_hints, routing  # noqa: E402
from mxfx.moe_call import ActivationQuant, MoEWeights  # noqa: E402

DEFAULT_TARGETS = ("cuda:90", "cuda:100", "hip:gfx942", "hip:gfx950")
_OPTIONS = ("num_warps", "num_stages", "debug")



def parse_target(text: str) -> GPUTarget:
    """``cuda:90`` / ``hip:gfx942`` → a Triton ``GPUTarget``."""
    backend, _, arch = text.partition(":")
    if backend == "cuda" and arch.isdigit():
        return GPUTarget("cuda", int(arch), 32)
    if backend == "hip" and arch.startswith("gfx"):
        return GPUTarget("hip", arch, 64)
    raise ValueError(f"target: got {text!r}, expected cuda:<sm> or hip:gfx<N>")


def _weights(E: int, H: int, I: int, dtype: torch.dtype, quantized: bool) -> MoEWeights:
    if quantized:
        return MoEWeights(
            torch.zeros(E, 2 * I, H // 2, dtype=torch.uint8), torch.zeros(E, 2 * I, H // 32, dtype=torch.uint8),
            torch.zeros(E, 2 * I, dtype=dtype), torch.zeros(E, H, I // 2, dtype=torch.uint8),
            torch.zeros(E, H, I // 32, dtype=torch.uint8), torch.zeros(E, H, dtype=dtype),
        )
    return MoEWeights(torch.zeros(E, 2 * I, H, dtype=dtype), None, None,
                      torch.zeros(E, H, I, dtype=dtype), None, None)


def record_launches(target: GPUTarget, H: int = 64, I: int = 96) -> list[tuple]:
    """(kernel, args, meta) of every distinct launch the launch code makes for the cases."""
    launches: dict[tuple, tuple] = {}

    def record(self, grid, args, meta):
        if self._fast:  # a direct launch passes every constexpr, defaults included
            self.constexpr_values(meta)
        key = (self._kernel.__name__, launch.key_and_call(0, args, meta)[0])
        launches.setdefault(key, (self._kernel, args, meta))

    ptx = target.backend == "cuda" and target.arch >= 90
    native = target.arch >= 100 if target.backend == "cuda" else target.arch == "gfx950"
    saved = (launch.Launcher._launch, mx.ptx_unpack, moe_sm90.runs_on, mx.native_scaled_mma,
             moe.PER_PAIR_REPEAT_BYTES, moe.num_sms, moe._sync_buffer, moe._gemm1_quantizes_x)
    launch.Launcher._launch = record
    mx.ptx_unpack = lambda dtype, device: ptx and dtype == torch.bfloat16
    moe_sm90.runs_on = lambda device: target.backend == "cuda" and target.arch == 90
    mx.native_scaled_mma = lambda device: native
    try:
        E, k = 4, 2
        # T = 1, 14, 80, 200 at E=4, k=2: pick_config's tiles on Hopper (per-pair blocks, then the
        # warp-specialized kernel's 32-, 64- and 160-row blocks).
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for quantized in (True, False):
                w = _weights(E, H, I, dtype, quantized)
                for T in (1, 14, 80, 200) if dtype == torch.bfloat16 else (1,):
                    x = torch.zeros(T, H, dtype=dtype)
                    ids = torch.arange(T * k, dtype=torch.int32).reshape(T, k) % E
                    tw = torch.ones(T, k, dtype=dtype)
                    # The epilogue's variants (layout, limit) once; the main loop's at every T.
                    acts = (GPT_OSS, minimax_m3(1.702, 1.0, 7.0), SILU_AND_MUL) if T == 1 else (GPT_OSS,)
                    for act in acts:
                        moe.fused_moe(x, tw, ids, w, act, ActivationQuant())
                    moe.unfused_moe(x, tw, ids, w, GPT_OSS, activation.gated_activation)
                    if dtype == torch.bfloat16:
                        for fmt in ("mxfp8", "mxfp4"):
                            moe.fused_moe(x, tw, ids, w, GPT_OSS, ActivationQuant(fmt, "even"))
            mx.dequantize_mxfp4(torch.zeros(8, 32, dtype=torch.uint8), torch.zeros(8, 2, dtype=torch.uint8), dtype)
        # One token as in a CUDA graph (two launches) on an H200 (132 SMs, not the one counted
        # here), where per-pair GEMM1 runs each program's K loop in two warpgroups (moe._halves);
        # under activation quantization quantizing x's row itself (each warpgroup its half), and
        # launched by PDL after x's quantize pass (moe._gemm1_quantizes_x).
        moe.num_sms = lambda device: 132
        moe._sync_buffer = lambda x: None
        for aq, in_gemm1 in ((ActivationQuant(), False), (ActivationQuant("mxfp8", "even"), True),
                             (ActivationQuant("mxfp8", "even"), False)):
            moe._gemm1_quantizes_x = lambda programs, hidden, device, in_gemm1=in_gemm1: in_gemm1
            moe.fused_moe(torch.zeros(1, H, dtype=torch.bfloat16), torch.ones(1, k, dtype=torch.bfloat16),
                          torch.arange(k, dtype=torch.int32).reshape(1, k), _weights(E, H, I, torch.bfloat16, True),
                          GPT_OSS, aq)
        # Grouped 8-row blocks on Hopper (per-pair blocks off; 2.5 rows per expert), the routing
        # in two kernels (80 pairs): a chain of launches by PDL.
        moe.PER_PAIR_REPEAT_BYTES = 0
        ids = torch.arange(80, dtype=torch.int32).reshape(40, k) % 32
        moe.fused_moe(torch.zeros(40, H, dtype=torch.bfloat16), torch.ones(40, k, dtype=torch.bfloat16), ids,
                      _weights(32, H, I, torch.bfloat16, True), GPT_OSS, ActivationQuant())
        # A few pairs (6) in grouped 8-row blocks: GEMM2's K range split in four (pick_config;
        # Mixtral-8x7B at T=2-5), the k-sum adding the parts.
        ids = torch.arange(6, dtype=torch.int32).reshape(3, k) % E
        moe.fused_moe(torch.zeros(3, H, dtype=torch.bfloat16), torch.ones(3, k, dtype=torch.bfloat16), ids,
                      _weights(E, H, I, torch.bfloat16, True), GPT_OSS, ActivationQuant())
        # Routing: one chunk smaller than, one as large as the default, several chunks.
        for pairs in (100, 256, 1000):
            routing.align(torch.zeros(pairs, 1, dtype=torch.int64), 128, 16)
    finally:
        (launch.Launcher._launch, mx.ptx_unpack, moe_sm90.runs_on, mx.native_scaled_mma,
         moe.PER_PAIR_REPEAT_BYTES, moe.num_sms, moe._sync_buffer, moe._gemm1_quantizes_x) = saved
    return list(launches.values())


def compile_launch(kernel, args: tuple, meta: dict, target: GPUTarget, ptxas_log: Optional[list] = None):
    """Bind, specialize and compile one launch as Triton's ``kernel[grid](...)`` would. With
    ``ptxas_log`` (CUDA targets) the kernel is compiled afresh, not taken from Triton's cache,
    and the lines of ptxas's log are appended to it."""
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **meta)
    options, signature, constexprs, attrs = kernel._pack_args(backend, meta, bound, specialization, options)
    source = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    reading = ptxas_log is not None and target.backend == "cuda"
    with _reading_ptxas_log(ptxas_log) if reading else contextlib.nullcontext():
        return triton.compile(source(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


@contextlib.contextmanager
def _reading_ptxas_log(into: list):
    """Inside, Triton recompiles (no cache hit, so ptxas runs) and prints ptxas's log, whose
    lines go to ``into``."""
    saved = knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
    knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = True, True
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = saved
        into.extend(printed.getvalue().splitlines())


def serialized_wgmma(ptxas_log: list) -> list:
    """ptxas's notes that it serialized a kernel's wgmma instructions (C7510-C7515: e.g. too few
    registers for the function): each MMA then waits for the previous one, a large slowdown
    that only a GPU run would otherwise show."""
    return [line.strip() for line in ptxas_log if "wgmma" in line and "Performance Loss" in line]


def spill_bytes(ptxas_log: list) -> int:
    """Bytes a kernel spills to local memory (stores), from ptxas's log: a register cap
    (``maxnreg``) that is too low for a loop shows here before any GPU run."""
    return sum(int(n) for line in ptxas_log for n in re.findall(r"(\d+) bytes spill stores", line))


def _sass(cubin: bytes) -> list:
    """The lines of a CUDA binary's SASS, disassembled by Triton's nvdisasm."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout.splitlines()


def _opcodes(sass: list) -> list:
    """The opcode (with its modifiers, without its predicate) of each instruction line."""
    return [re.sub(r"^@!?U?P[T0-9]\s+", "", re.sub(r"^.*?\*/\s*", "", line).strip()).split()[0]
            for line in sass if re.search(r"/\*[0-9a-f]{4,}\*/", line)]


def grid_control(cubin: bytes) -> dict:
    """Where a CUDA kernel's PDL instructions sit in its SASS: whether it lets the grid launched
    after it start (``griddepcontrol.launch_dependents``: PREEXIT) and how many global loads
    come before that, and for each wait for the grid launched before it
    (``griddepcontrol.wait``: ACQBULK) how many global loads come between it and the wait
    before it (or the start), in instruction order."""
    ops = _opcodes(_sass(cubin))
    waits = [i for i, op in enumerate(ops) if op == "ACQBULK"]
    loads = [op.startswith("LDG") for op in ops]
    return {"launches_dependents": "PREEXIT" in ops,
            "loads_before_trigger": sum(loads[:ops.index("PREEXIT")]) if "PREEXIT" in ops else None,
            "loads_before_waits": [sum(loads[start + 1:end]) for start, end in zip([-1] + waits, waits)]}


def longest_loop(sass: list) -> list:
    """The lines of the longest loop (the span between a backward branch and its target) in the
    kernel's own code. Functions it calls are left out: nvdisasm places a noinline function's
    body (labelled ``$kernel$function:``) after the kernel's, and moe_sm90's exact redo
    (``_k_loops_exact``), a longer loop than the one that runs, would otherwise be reported."""
    text = next((sass[:i] for i, line in enumerate(sass) if re.match(r"^\$\S+:$", line)), sass)
    labels = {line[:-1]: i for i, line in enumerate(text) if re.match(r"^\.L_x_\d+:$", line)}
    best: list[str] = []
    for i, line in enumerate(text):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i and i - labels[m.group(1)] > len(best):
            best = text[labels[m.group(1)]:i + 1]
    return best


def loop_sass(cubin: bytes, top: int = 8) -> dict:
    """Instruction count and most frequent opcodes of a CUDA binary's :func:`longest_loop`."""
    ops = [op.split(".")[0] for op in _opcodes(longest_loop(_sass(cubin)))]
    return {"loop_instructions": len(ops), "top": collections.Counter(ops).most_common(top)}


def failure(e: BaseException) -> str:
    """A failed compile's report: the innermost cause's type and last line, as a traceback
    ends (Gluon's CompilationError of a call ends with the caret under the call; the error
    inside it says what went wrong)."""
    while True:
        inner = e.__cause__ if e.__cause__ is not None else (None if e.__suppress_context__ else e.__context__)
        if inner is None:
            break
        e = inner
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {lines[-1].strip()[:300]}"


def _describe(kernel, args, meta) -> str:
    consts = {k: v for k, v in meta.items() if k not in _OPTIONS}
    dtypes = sorted({str(a.dtype).removeprefix("torch.") for a in args if isinstance(a, torch.Tensor)})
    return f"{kernel.__name__} {'/'.join(dtypes)} {consts}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", nargs="*", default=list(DEFAULT_TARGETS))
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--sass", action="store_true", help="SASS counts of the main loop (CUDA targets)")
    p.add_argument("--hidden", type=int, default=64, help="H of the recorded MoE calls (e.g. 2880 for --sass)")
    p.add_argument("--intermediate", type=int, default=96, help="I of the recorded MoE calls")
    p.add_argument("--match", help="compile only the specializations whose line (kernel, dtypes, constexprs) "
                   "this regular expression matches, e.g. \"_ws .*'NC': 4\"")
    a = p.parse_args(argv)
    failed = 0
    for text in a.target:
        target = parse_target(text)
        for kernel, args, meta in record_launches(target, a.hidden, a.intermediate):
            row = {"target": text, "kernel": _describe(kernel, args, meta)}
            if a.match and not re.search(a.match, row["kernel"]):
                continue
            try:
                log: list = []
                compiled = compile_launch(kernel, args, meta, target, log)
                row["shared"] = compiled.metadata.shared
                serialized = serialized_wgmma(log)
                if serialized:
                    row["serialized_wgmma"] = serialized
                spilled = spill_bytes(log)
                if spilled:
                    row["spill_bytes"] = spilled
                if target.backend == "cuda":
                    ptx = compiled.asm["ptx"]
                    for key, pattern in (("cp_async", ptx_hints.COPY), ("ld_global", ptx_hints.LOAD)):
                        found = pattern.findall(ptx)
                        if found:
                            row[key] = {"L2::128B": sum(1 for m in found if m[1]), "all": len(found)}
                if target.backend == "cuda" and "griddepcontrol" in compiled.asm["ptx"]:
                    row.update(grid_control(compiled.asm["cubin"]))
                if a.sass and target.backend == "cuda":
                    row.update(loop_sass(compiled.asm["cubin"]))
            except Exception as e:  # every failure is reported, then the exit status says so
                failed += 1
                row["error"] = failure(e)
            status = f"FAIL {row['error']}" if "error" in row else f"ok   smem {row['shared']}"
            if "serialized_wgmma" in row:
                status += " WGMMA SERIALIZED"
            if "spill_bytes" in row:
                status += f" SPILLS {row['spill_bytes']} B"
            if "loop_instructions" in row:
                status += f" loop {row['loop_instructions']} {dict(row['top'])}"
            print(json.dumps(row) if a.json else f"{text:11s} {status:50s} {row['kernel']}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
