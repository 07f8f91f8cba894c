"""MoE roofline benchmark: a launcher for ``python -m mxfx bench`` (see :mod:`mxfx.bench`).

    python tools/bench_moe.py --model gpt-oss-120b --act-quant none
    python tools/bench_moe.py --quick          # tiny shape, any device: a smoke test
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mxfx.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
