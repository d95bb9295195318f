#!/usr/bin/env python3
"""Benchmark stock TVM, tvm_fusion, ONNX Runtime, Inductor and PyTorch side by side in one process.

Same as ``tvm-fusion bench``; writes ``bench/results.json`` and ``bench/results.md``.

    python scripts/bench.py --workloads gate_2890,cross_entropy --repeat 20
"""

from __future__ import annotations

import argparse
import sys


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=None)
    parser.add_argument("--engines", default=None)
    parser.add_argument("--size", default="seed", choices=["seed", "small"])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--budget", type=float, default=10.0)
    parser.add_argument("--min-time", type=float, default=0.5)
    parser.add_argument("--target", default=None)
    parser.add_argument("--mcpu", default=None, help="build for this CPU, e.g. znver3")
    parser.add_argument("--tuning-db", default=None)
    parser.add_argument("--output", default="bench/results.json")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    from tvm_fusion.tools.cli import main as cli_main

    forwarded = [
        "bench",
        "--size",
        args.size,
        "--repeat",
        str(args.repeat),
        "--budget",
        str(args.budget),
        "--min-time",
        str(args.min_time),
        "--output",
        args.output,
    ]
    for flag, value in [
        ("--workloads", args.workloads),
        ("--engines", args.engines),
        ("--target", args.target),
        ("--mcpu", args.mcpu),
        ("--tuning-db", args.tuning_db),
    ]:
        if value:
            forwarded += [flag, value]
    return cli_main(forwarded)


if __name__ == "__main__":
    sys.exit(main())
