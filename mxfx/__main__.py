"""``python -m mxfx demo | doctor | bench``."""
from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from mxfx.demo import main as demo_main

    return demo_main(args)


def _doctor(args: argparse.Namespace) -> int:
    from mxfx.oracle import Platform
    from mxfx.oracle.doctor import report

    platform = None
    if args.platform:
        kind, _, arch = args.platform.partition(":")
        packages = Platform.current().packages if args.packages is None else args.packages.split(",")
        try:
            platform = Platform(kind, arch, frozenset(p for p in packages if p))
        except ValueError as e:
            print(f"--platform: {e}", file=sys.stderr)
            return 2
    print(report(platform))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark parses its own options
        from mxfx.bench import main as bench_main

        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m mxfx")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="quantize a small MoE model to MXFP4 and compile it with mxfx")
    from mxfx.demo import add_arguments as demo_arguments

    demo_arguments(demo)
    sub.add_parser("bench", help="MoE layer time against the roofline (bench --help for options)")
    doctor = sub.add_parser("doctor", help="this platform and the MoE backend chosen for known models")
    doctor.add_argument("--platform", help="simulate KIND:ARCH, e.g. rocm:gfx950 or cuda:sm90")
    doctor.add_argument("--packages", help="with --platform: optional packages that import, e.g. triton,aiter")
    args = parser.parse_args(argv)
    return {"demo": _demo, "doctor": _doctor}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
