#!/usr/bin/env bash
# The GPU validation run (on the H200 through the device tool): the GPU tests, then the demo
# on CUDA. The pytest log lands in $OUT/pytest.log (or ./gpu_check_out/); printed: each
# process's summary, the total, and the failed, errored and skipped tests with their reasons.
# Usage: bash tools/gpu_check.sh [pytest paths]   (default: tests/gpu tests/test_replay.py;
# carry .whl holding expecttest, which the box lacks). NPROC (default 6) pytest processes
# share the GPU, each taking every NPROC-th test id: the warp-specialized tests compile dozens
# of specializations each, and one process runs past the device tool's 10-minute call.
# --timeout (pytest-timeout, on the box; left out where it is missing) reports a hanging test
# instead of losing the log.
set -u
out="${OUT:-gpu_check_out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
[ $# -gt 0 ] || set -- tests/gpu tests/test_replay.py
nproc_="${NPROC:-6}"
ids="$(mktemp -d)"; trap 'rm -rf "$ids"' EXIT
python3 -m pytest -q -p no:cacheprovider --collect-only "$@" | grep '::' > "$ids/all"
echo "$(wc -l < "$ids/all") tests over $nproc_ processes"
split -n "r/$nproc_" "$ids/all" "$ids/part."
per_test=()
python3 -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout=240)
for part in "$ids"/part.*; do
  # Test ids hold spaces (parametrized reprs): pass them NUL-separated.
  tr '\n' '\0' < "$part" | timeout "${PYTEST_TIMEOUT:-480}" xargs -0 python3 -m pytest -q \
    -p no:cacheprovider -rfEs "${per_test[@]}" > "$out/pytest.${part##*.}.log" 2>&1 &
done
wait
for log in "$out"/pytest.*.log; do echo "$(basename "$log"): $(tail -1 "$log")"; done
# A process cut by PYTEST_TIMEOUT prints no summary line: its count is missing from the total.
tail -qn1 "$out"/pytest.*.log | grep -o '[0-9]* \(passed\|failed\|skipped\|errors\?\)' |
  awk '{n[$2] += $1} END {printf "total:"; for (k in n) printf " %d %s", n[k], k; print ""}'
grep -h '^\(FAILED\|ERROR\|SKIPPED\)' "$out"/pytest.*.log | sort | uniq -c
# The per-process logs stay in $OUT while the tests run (a call cut short still returns them),
# then become one file: the device tool brings back only a few files from $OUT.
for log in "$out"/pytest.*.log; do echo "===== $(basename "$log")"; cat "$log"; done > "$out/pytest.log"
rm "$out"/pytest.*.log
timeout 120 python3 -m mxfx demo --device cuda --dtype bfloat16 --json > "$out/demo.json" 2> "$out/demo.err"; echo "demo rc=$?"
python3 -c "import json,sys; d=json.load(open('$out/demo.json')); print({k: d[k] for k in list(d)[:12]})" 2>&1 | tail -3
