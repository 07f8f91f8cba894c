"""Every kernel specialization the launch code makes compiles to a device binary for the GPU
targets mxfx supports, CUDA and ROCm, on a machine without either (the interpreter used by
the other kernel tests never runs Triton's compiler, and ROCm cannot be run here at all)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

TOOL = Path(__file__).resolve().parent.parent / "tools" / "compile_kernels.py"
KERNELS = {"_moe_gemm", "_sum_slots", "_place_kernel", "_count_kernel", "_gated_activation_kernel",
           "_qdq_kernel", "_dequant_kernel"}


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "hip:gfx942", "hip:gfx950"])
def test_every_kernel_compiles_for(target):
    r = subprocess.run([sys.executable, str(TOOL), "--target", target, "--json"],
                       capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    failed = [f"{row['kernel']}: {row['error']}" for row in rows if "error" in row]
    assert not failed, "\n".join(failed)
    assert r.returncode == 0, r.stderr[-2000:]
    # The Hopper kernels are compiled for sm_90 only (wgmma), and the launch code chooses them there;
    # on GPUs with MX matrix instructions A8/A4 quantize into MX elements for tl.dot_scaled.
    native = target in ("cuda:100", "hip:gfx950")
    assert {row["kernel"].split()[0] for row in rows} == (
        KERNELS | ({"_moe_gemm_sm90", "_moe_gemm_sm90_ws", "_dot_order_kernel"} if target == "cuda:90" else set())
        | ({"_quantize_kernel"} if native else set()))
    scaled = {fmt for row in rows for fmt in (1, 2) if f"'A_FMT': {fmt}" in row["kernel"]}
    assert scaled == ({1, 2} if native else set())
    assert len(rows) > 50  # MoE GEMM variants: dtypes, weight kinds, tile regimes, epilogues
