#!/usr/bin/env python3
"""Shape sweep: single-op ONNX models at awkward sizes, tvm_fusion against ONNX Runtime.

Writes ``bench/sweep.json`` and ``bench/sweep.md`` (see :mod:`tvm_fusion.tools.sweep`).

    python scripts/bench_sweep.py                       # every case, about 10 minutes here
    python scripts/bench_sweep.py --family gemm,softmax --output /tmp/sweep.json
    python scripts/bench_sweep.py --mcpu znver3          # AVX2 code on an AVX-512 host
"""

from __future__ import annotations

import argparse
import sys


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of the random sizes")
    parser.add_argument("--per-family", type=int, default=4, help="random cases per family")
    parser.add_argument("--family", default=None, help="comma-separated families to run")
    parser.add_argument("--match", default=None, help="only cases whose name contains this")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--budget", type=float, default=2.0, help="timed seconds per engine")
    parser.add_argument("--target", default="llvm")
    parser.add_argument(
        "--mcpu", default=None, help="build for this CPU (LLVM's name, e.g. znver3, x86-64-v3)"
    )
    parser.add_argument("--output", default="bench/sweep.json")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    from tvm_fusion.errors import UsageError
    from tvm_fusion.target import parse_target
    from tvm_fusion.tools import sweep
    from tvm_fusion.tools.bench import bench_target, machine_info

    try:
        target = bench_target(parse_target(args.target), args.mcpu)
    except UsageError as err:
        print(f"bench_sweep: error: {err}", file=sys.stderr)
        return 2
    cases = sweep.cases(args.seed, args.per_family)
    if args.family:
        wanted = set(args.family.split(","))
        unknown = wanted - set(sweep.FAMILIES)
        if unknown:
            print(f"bench_sweep: error: unknown families {sorted(unknown)}", file=sys.stderr)
            return 2
        cases = [c for c in cases if c.family in wanted]
    if args.match:
        cases = [c for c in cases if args.match in c.name]
    results = []
    for i, case in enumerate(cases, 1):
        result = sweep.run_case(case, target, repeat=args.repeat, budget_s=args.budget)
        results.append(result)
        status = result.error or (
            f"{result.ours_ms} ms vs ORT {result.ort_ms} ms = {result.ratio}x"
            + ("" if result.ok else " WRONG")
            + (f" fallback: {result.fallback}" if result.fallback else "")
        )
        print(f"[{i}/{len(cases)}] {case.name} {case.note}: {status}", flush=True)
        sweep.write(results, args.output, machine_info(target))
    print(sweep.summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
