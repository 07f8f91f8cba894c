#!/usr/bin/env bash
# The GPU validation run (on the H200 through the device tool): the whole test suite on CUDA,
# the lowering benchmark and the demo. Logs land in $OUT (or ./gpu_check_out).
# Usage: bash tools/gpu_check.sh   (carry .whl holding expecttest, which the box lacks).
# --timeout (pytest-timeout, on the box) reports a hanging test instead of losing the log.
set -u
out="${OUT:-gpu_check_out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
timeout "${PYTEST_TIMEOUT:-330}" python3 -m pytest -q -p no:cacheprovider -rfE --timeout=90 tests 2>&1 | tee "$out/pytest.log" | tail -25
timeout "${BENCH_TIMEOUT:-200}" python3 tools/bench_lowering.py 2>&1 | tee "$out/bench_lowering.log" | tail -20
timeout 120 python3 -m mxfx demo --device cuda --dtype bfloat16 --json > "$out/demo.json" 2> "$out/demo.err"; echo "demo rc=$?"
python3 -c "import json,sys; d=json.load(open('$out/demo.json')); print({k: d[k] for k in list(d)[:12]})" 2>&1 | tail -3
