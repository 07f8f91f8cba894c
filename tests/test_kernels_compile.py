"""Every kernel specialization the launch code makes compiles to a device binary for the GPU
targets mxfx supports, CUDA and ROCm, on a machine without either (the interpreter used by
the other kernel tests never runs Triton's compiler, and ROCm cannot be run here at all)."""
from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("triton")

TOOL = Path(__file__).resolve().parent.parent / "tools" / "compile_kernels.py"
KERNELS = {"_moe_gemm", "_sum_slots", "_place_kernel", "_count_kernel", "_gated_activation_kernel",
           "_qdq_kernel", "_dequant_kernel"}


TARGETS = ["cuda:90", "cuda:100", "hip:gfx942", "hip:gfx950"]
MODEL_SIZES = [(2880, 2880), (352, 160)]
# Sizes at which the warp-specialized kernel's 32- and 64-row blocks take four consumer
# warpgroups (moe_sm90_ws.consumers, which on a machine without a GPU counts one SM; three at the
# sizes above). Only those are compiled: all of a size's launches would add 4.5 min to CI on 2 cores.
FOUR_CONSUMERS = {"hidden": 1024, "intermediate": 512, "match": "_moe_gemm_sm90_ws .*'NC': 4"}


def _tool_args(params: dict) -> tuple[str, ...]:
    """The tool's arguments for a test of this file parametrized with ``params``."""
    if "target" in params:
        return ("--target", params["target"])
    return ("--target", "cuda:90", "--hidden", str(params["hidden"]), "--intermediate", str(params["intermediate"]),
            *(("--match", params["match"]) if "match" in params else ()))


def _in_tool_process(code: str, stdin: str = "") -> list[str]:
    """The stdout lines of ``code`` run in a process of its own beside the tool (importable as
    ``compile_kernels``): the tool compiles for GPUs, this process interprets kernels."""
    r = subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True, text=True,
                       cwd=TOOL.parent, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.splitlines()


@pytest.fixture(scope="module")
def tool_runs(request):
    """Every tool run the selected tests of this file need, started together and run as many
    at a time as there are CPUs: each is a single-threaded compiler, and in turn they took
    most of CI's time (500 s of 626 on 2 cores). Maps the arguments to the finished process."""
    wanted = {_tool_args(item.callspec.params) for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {args: pool.submit(subprocess.run, [sys.executable, str(TOOL), *args, "--json"],
                                     capture_output=True, text=True, timeout=900)
                   for args in sorted(wanted)}
        yield {args: f.result for args, f in futures.items()}


def test_serialized_wgmma_is_read_from_the_ptxas_log():
    # ptxas 12.9 -v, on a warp-specialized kernel whose consumers had 216 registers (session 11).
    log = ["ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
           "to insufficient register resources for the function '_moe_gemm_sm90_ws'",
           "ptxas info    : Used 168 registers, used 4 barriers, 48 bytes cumulative stack size"]
    code = ("import json, sys; import compile_kernels as c; log = json.load(sys.stdin); "
            "print(json.dumps([c.serialized_wgmma(log), c.serialized_wgmma(log[1:])]))")
    assert json.loads(_in_tool_process(code, json.dumps(log))[-1]) == [[log[0].strip()], []]


def test_a_failed_compile_reports_the_error_inside_the_call():
    # What Gluon raises for a bad layout in a called function: a CompilationError whose last
    # line is the caret under the call, caused by the one that says what is wrong.
    code = ("import compile_kernels as c\n"
            "def fail(suppress):\n"
            "    try:\n"
            "        try:\n"
            "            raise ValueError('rank must be equal to or one less than the shape size')\n"
            "        except ValueError as inner:\n"
            "            raise RuntimeError('at 12:4:\\n    _program(pid)\\n    ^') from (None if suppress else inner)\n"
            "    except RuntimeError as e:\n"
            "        return c.failure(e)\n"
            "print(fail(False)); print(fail(True))")
    assert _in_tool_process(code)[-2:] == ["ValueError: rank must be equal to or one less than the shape size",
                                          "RuntimeError: ^"]


def test_sass_opcodes_are_read_past_4096_instructions():
    # nvdisasm -c: past byte 0xfff0 (instruction 4096) an address takes five hex digits; the
    # warp-specialized kernels run to 25,000 instructions (the tool once stopped at 4,096).
    sass = [".L_x_1:",
            "        /*fff0*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;",
            "        /*10000*/              @!P0 STL [R1], R2 ;",
            "        /*1a2b0*/                   BRA `(.L_x_1) ;"]
    code = "import json, sys; import compile_kernels as c; print(json.dumps(c._opcodes(json.load(sys.stdin))))"
    assert json.loads(_in_tool_process(code, json.dumps(sass))[-1]) == ["IMAD.MOV.U32", "STL", "BRA"]


def test_longest_loop_is_the_kernels_own_not_a_called_functions():
    # moe_sm90's exact redo (_k_loops_exact, noinline) holds a longer loop than the K loop that
    # runs; nvdisasm places its body after the kernel's, under a "$kernel$function:" label.
    sass = ["_k:",
            ".L_x_0:",
            "        /*0000*/                   IADD3 R1, R1, 0x1, RZ ;",
            "        /*0010*/               @P0 BRA `(.L_x_0) ;",
            "        /*0020*/                   CALL.REL.NOINC `($_k$_redo) ;",
            "        /*0030*/                   EXIT ;",
            "$_k$_redo:",
            ".L_x_1:",
            *[f"        /*{0x40 + 16 * i:04x}*/                   HMUL2.BF16_V2 R2, R2, R3 ;" for i in range(4)],
            "        /*0080*/               @P0 BRA `(.L_x_1) ;",
            "        /*0090*/                   RET.REL.NODEC R4 `(_k) ;"]
    code = ("import json, sys; import compile_kernels as c\n"
            "print(json.dumps(c._opcodes(c.longest_loop(json.load(sys.stdin)))))")
    assert json.loads(_in_tool_process(code, json.dumps(sass))[-1]) == ["IADD3", "BRA"]


def test_dot_order_stores_whole_16_byte_pieces():
    """sm90_tile.ordered_copy permutes each 128-wide step in registers, so that its stores stay
    contiguous, in every order it writes (the warp-specialized kernel's two dot orders, the
    mma.sync loop's paired order): the same permutation done by the stores' addresses (2-byte
    stores, 8 sectors a warp's store) ran at 0.4 TB/s on the H200 against 2.6-4.5
    (tools/PERF_LOG.md, session 36)."""
    code = ("import collections, json, torch, compile_kernels as c\n"
            "from mxfx.kernels import sm90_tile as tile\n"
            "x, out = torch.zeros(37, 2880, dtype=torch.bfloat16), torch.zeros(37, 2944, dtype=torch.bfloat16)\n"
            "stores = {}\n"
            "for split, dot in ((False, True), (True, True), (True, False)):\n"
            "    k = c.compile_launch(tile._dot_order_kernel, (x, out, 37, 2880, 2880, 2944), dict(BLOCK_R=16, FMT=0,"
            " ROUNDING=2, SPLIT=split, DOT=dot, PDL=False, num_warps=4), c.parse_target('cuda:90'))\n"
            "    stores[f'{split} {dot}'] = collections.Counter(o for o in c._opcodes(c._sass(k.asm['cubin']))"
            " if o.startswith('ST'))\n"
            "print(json.dumps(stores))")
    stores = json.loads(_in_tool_process(code)[-1])
    assert len(stores) == 3
    for order, ops in stores.items():  # 16 rows x 128 bf16 over 128 threads: two 16-byte stores each
        assert ops.get("STG.E.128", 0) == 2 and set(ops) <= {"STG.E.128", "STS.128"}, (order, ops)


@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_compiles_for(target, tool_runs):
    r = tool_runs[_tool_args({"target": target})]()
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    failed = [f"{row['kernel']}: {row['error']}" for row in rows if "error" in row]
    assert not failed, "\n".join(failed)
    # A kernel whose wgmmas ptxas serialized builds and runs right, at a fraction of its speed.
    serialized = [f"{row['kernel']}: {row['serialized_wgmma']}" for row in rows if "serialized_wgmma" in row]
    assert not serialized, "\n".join(serialized)
    assert r.returncode == 0, r.stderr[-2000:]
    # The Hopper kernels are compiled for sm_90 only (wgmma, or mma.sync with its PTX unpack),
    # and the launch code chooses them there (the warp-specialized one needs K loops of more than
    # one step: see the next test); on GPUs with MX matrix instructions A8/A4 quantize into MX
    # elements for tl.dot_scaled.
    native = target in ("cuda:100", "hip:gfx950")
    hopper = {"_moe_gemm_sm90", "_moe_per_pair_sm90", "_dot_order_kernel"} if target == "cuda:90" else set()
    assert {row["kernel"].split()[0] for row in rows} == (
        KERNELS | hopper | ({"_quantize_kernel"} if native else set()))
    assert all(row[key]["L2::128B"] == 0 for row in rows for key in ("cp_async", "ld_global") if key in row)
    scaled = {fmt for row in rows for fmt in (1, 2) if f"'A_FMT': {fmt}" in row["kernel"]}
    assert scaled == ({1, 2} if native else set())
    assert len(rows) > 50  # MoE GEMM variants: dtypes, weight kinds, tile regimes, epilogues


@pytest.mark.parametrize("hidden,intermediate", MODEL_SIZES)
def test_hopper_wgmma_kernels_compile_sound_at_model_sizes(hidden, intermediate, tool_runs):
    """At a model's sizes the K loops are loops (gpt-oss: H = I = 2880, 22.5 K steps; a
    tensor-parallel shard: K = 352 and 160, a few steps with tails), where ptxas may serialize
    wgmma for want of registers or on fragments left in flight across the back edge; at the
    tiny sizes above most K loops are a single step and cannot show it. And no HGMMA may read
    descriptor registers that a path to it leaves unwritten (``mxfx.kernels.wgmma_guard`` fails
    the compilation: ptxas once did, and the MMA read an out-of-range shared address on the
    H200)."""
    r = tool_runs[_tool_args({"hidden": hidden, "intermediate": intermediate})]()
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    bad = [f"{row['kernel']}: {row.get('error') or row['serialized_wgmma']}" for row in rows
           if "error" in row or "serialized_wgmma" in row]
    assert rows and not bad, "\n".join(bad) or r.stderr[-2000:]
    assert r.returncode == 0, r.stderr[-2000:]
    assert {"_moe_gemm_sm90", "_moe_gemm_sm90_ws", "_dot_order_kernel"} <= {row["kernel"].split()[0] for row in rows}
    # moe_sm90 spills nothing, its per-pair GEMM2 capped at 80 registers included (moe._gemm).
    sm90 = [row for row in rows if row["kernel"].split()[0] == "_moe_gemm_sm90"]
    assert sm90 and not [row["kernel"] for row in sm90 if row.get("spill_bytes")]
    # GEMM2's K range in four on per-pair blocks and on grouped 8-row blocks (a few pairs).
    assert any("'PER_PAIR_E': 4" in row["kernel"] and "'SPLIT_K': 4" in row["kernel"] for row in sm90)
    assert any("'PER_PAIR_E': 0" in row["kernel"] and "'SYNC_MMA': True" in row["kernel"]
               and "'SPLIT_K': 4" in row["kernel"] for row in sm90)
    # Per-pair GEMM1 in two warpgroups (one token on 132 SMs: moe._halves), at 80 registers,
    # under activation quantization each quantizing its half of x's row.
    assert any("'HALVES': True" in row["kernel"] and "'GATED': True" in row["kernel"] for row in sm90)
    assert any("'HALVES': True" in row["kernel"] and "'X_QDQ': True" in row["kernel"] for row in sm90)
    # Grouped 8-row blocks read paired activations: x's copy, and the intermediate as GEMM1 stores it.
    assert any("'X_ORDER': 2" in row["kernel"] and "'PAIRED_OUT': True" in row["kernel"] for row in sm90)
    assert any(row["kernel"].startswith("_dot_order_kernel") and "'DOT': False" in row["kernel"] for row in rows)
    # The one-launch per-pair kernel under activation quantization quantize-dequantizes x's row
    # as its GEMM1 programs read it, without spills.
    x_qdq = [row for row in rows if row["kernel"].startswith("_moe_per_pair_sm90") and "'X_QDQ': True" in row["kernel"]]
    assert x_qdq and not [row["kernel"] for row in x_qdq if row.get("spill_bytes")]
    # PDL: per-pair GEMM1 lets GEMM2 start (moe._pdl_gemm2), and where it does not quantize x
    # itself (moe._gemm1_quantizes_x) is launched by PDL after x's quantize pass (which lets it
    # start); on grouped 8-row blocks the routing kernels, x's paired copy, both GEMMs and the
    # k-sum are a chain (moe._pdl_chain). A launch by PDL waits before it reads what the launch
    # before it wrote: GEMM1, the placement and the k-sum at once, GEMM2's K loop (and its redo,
    # _k_loops_exact) only after its first steps' weight loads (a word and a scale load at least
    # per step); the copy, which reads only x, after its copy. No other kernel has PDL instructions.
    launches = [(row["kernel"].split()[0], ast.literal_eval(row["kernel"][row["kernel"].index("{"):]), row)
                for row in rows]
    assert all(("launches_dependents" in row) == bool(m.get("PDL")) for _, m, row in launches)
    pdl = [(name, m, row) for name, m, row in launches if m.get("PDL")]
    assert {(name, m["PDL"], m.get("COUNTERS"), m.get("launch_pdl", False)) for name, m, _ in pdl} == {
        ("_moe_gemm_sm90", 1, 1, False), ("_moe_gemm_sm90", 4, 2, True),  # per pair
        ("_qdq_kernel", True, None, False), ("_moe_gemm_sm90", 5, 1, True),  # per pair, x quantized
        ("_count_kernel", True, None, False), ("_place_kernel", True, None, True),  # the chain
        ("_place_kernel", True, None, False),  # the chain of one routing chunk: the placement first
        ("_dot_order_kernel", True, None, True), ("_moe_gemm_sm90", 3, 0, True), ("_moe_gemm_sm90", 5, 0, True),
        ("_sum_slots", True, None, True)}
    for name, meta, row in pdl:
        gemm = name == "_moe_gemm_sm90"
        assert row["launches_dependents"] == (bool(meta["PDL"] & 1) if gemm else name != "_sum_slots")
        waits = row["loads_before_waits"]
        if gemm and meta["PDL"] & 4:
            steps = math.ceil(math.ceil(meta["K"] / 128) / meta["SPLIT_K"])  # K steps per program
            waits = sorted(waits)
            assert len(waits) >= 2 and waits[-2] >= 2 * min(meta["XROW"] or 2, steps), (meta, waits)
        elif name == "_dot_order_kernel":
            assert len(waits) == 1 and waits[0] >= 1, waits
        else:
            assert waits == ([0] if meta.get("launch_pdl") else []), (name, meta, waits)
        if name == "_place_kernel" and not meta["ONE_CHUNK"]:
            # It lets x's paired copy start, which writes before it waits, only once it has read
            # the counts (a temporary whose bytes the copy's may reuse).
            assert row["loads_before_trigger"] >= 1, row
    # The warp-specialized kernel's copies and loads carry the L2 prefetch hint (ptx_hints), no
    # other kernel's.
    for key in ("cp_async", "ld_global"):
        found = [(row["kernel"].split()[0], row[key]) for row in rows if key in row]
        assert all(c["all"] > 0 and c["L2::128B"] == (c["all"] if name == "_moe_gemm_sm90_ws" else 0)
                   for name, c in found), (key, found)
        assert "_moe_gemm_sm90_ws" in {name for name, _ in found}, key


@pytest.mark.parametrize("hidden,intermediate,match", [tuple(FOUR_CONSUMERS.values())])
def test_four_consumer_warp_specialized_kernels_compile_sound(hidden, intermediate, match, tool_runs):
    """The four-consumer binaries (256-row tiles, 96 registers at launch: moe_sm90_ws._REGS4)
    compile for sm_90, with no serialized wgmma and no HGMMA reading unwritten descriptor
    registers, for both GEMMs of the fused and the unfused MoE in 32- and 64-row blocks."""
    r = tool_runs[_tool_args({"hidden": hidden, "intermediate": intermediate, "match": match})]()
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    bad = [f"{row['kernel']}: {row.get('error') or row['serialized_wgmma']}" for row in rows
           if "error" in row or "serialized_wgmma" in row]
    assert rows and not bad, "\n".join(bad) or r.stderr[-2000:]
    assert r.returncode == 0, r.stderr[-2000:]
    metas = [ast.literal_eval(row["kernel"][row["kernel"].index("{"):]) for row in rows]
    assert {(m["NC"], m["BLOCK_M"], m["GATED"], m["CONSUMER_REGS"], m["maxnreg"]) for m in metas} == {
        (4, block_m, gated, 112, 96) for block_m in (32, 64) for gated in (True, False)}
