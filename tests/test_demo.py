"""``python -m mxfx demo --json`` in a subprocess, as a user runs it; its report checked."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mxfx import backends
from mxfx.demo import render

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_json_reports_a_rewritten_and_correct_model():
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-m", "mxfx", "demo", "--json", "--repeats", "1"],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiling with mxfx" in done.stderr  # progress goes to stderr
    r = json.loads(done.stdout)

    assert r["model"] == "gpt-oss"
    on_cpu = r["device"] == "cpu"
    assert r["dtype"] == ("float32" if on_cpu else "bfloat16")
    q = r["quantize"]
    assert q["layers"] == 2
    assert q["ratio"] == pytest.approx(4.25 / (32 if on_cpu else 16))
    assert r["decision"]["backend"] in backends.names()
    if on_cpu:
        assert r["decision"]["backend"] == "emulation"
    low = r["lowering"]
    assert low["moe_rewrites"] == 2, low["records"]
    assert sum(f"-> {r['decision']['backend']}" in rec for rec in low["records"]) == 2
    err = r["error"]
    # float32 on CPU: the same emulation math; bf16 on a GPU: a Triton kernel against eager.
    assert math.isfinite(err["max_abs"]) and err["rel"] < (1e-5 if on_cpu else 2e-2)
    assert 0 < r["mxfp4_vs_float_rel"] < 0.3
    assert all(t > 0 for t in r["time_ms"].values())
    assert set(r["time_ms"]) == {"eager", "compiled", "compiled_mxfx"}

    text = render(r)
    assert "oracle decision:" in text and "lowering: " in text and "torch.compile + mxfx" in text
