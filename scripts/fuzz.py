"""Differential fuzzer: random graphs of the patterns our passes rewrite, ours vs a reference.

    python scripts/fuzz.py --minutes 60 --seed 0 --out fuzz_failures
    python scripts/fuzz.py --frontend torch --minutes 15 --seed 0   # torch.export vs eager
    python scripts/fuzz.py --families convnets --mcpu znver3 --minutes 10   # AVX2 code

Cases run round-robin over the families (``tvm_fusion.testing.fuzz.FAMILIES``) in one worker
subprocess (a segfault or a hang costs one case); each failure is minimised and saved under
``--out`` as ``FAMILY-SEED/model.onnx``, ``inputs.npz`` and ``reason.txt``. Totals per family
go to ``bench/fuzz.json`` and ``bench/fuzz.md`` (``--output ''`` to skip). ``--frontend torch``
runs ``tvm_fusion.testing.fuzz.torch_frontend``'s families (torch.nn modules through torch.export,
against torch eager; failures saved unminimised, with the exported program) into
``bench/fuzz_torch.*``. The exit status is 1 when a case failed, crashed or hung.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _parse_args(argv=None):
    from tvm_fusion.testing.fuzz import FRONTENDS, frontend_module

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frontend", choices=FRONTENDS, default="onnx", help="ONNX or torch.export")
    p.add_argument("--minutes", type=float, default=None, help="stop after this long")
    p.add_argument("--cases", type=int, default=None, help="... or after this many per family")
    p.add_argument("--seed", type=int, default=0, help="first seed (cases use seed, seed+1, ...)")
    p.add_argument("--families", default="", help="comma-separated (default: all)")
    p.add_argument("--out", default="fuzz_failures", help="minimised failures go here")
    p.add_argument(
        "--output", default=None, help="totals (.json/.md; default bench/fuzz, bench/fuzz_torch)"
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    p.add_argument("--minimise", type=float, default=120.0, help="seconds per failure")
    p.add_argument("--mcpu", default=None, help="build for this CPU (znver3: AVX2 code)")
    args = p.parse_args(argv)
    families = frontend_module(args.frontend).FAMILIES
    args.families = tuple(f for f in args.families.split(",") if f) or families
    if args.output is None:
        name = "fuzz" if args.frontend == "onnx" else "fuzz_torch"
        args.output = str(ROOT / "bench" / name)
    unknown = set(args.families) - set(families)
    if unknown:
        p.error(f"unknown families {sorted(unknown)}; known: {', '.join(families)}")
    if args.minutes is None and args.cases is None:
        p.error("give --minutes or --cases")
    return args


def _markdown(result: dict) -> str:
    from tvm_fusion.testing.fuzz import OUTCOMES

    title = {
        "onnx": "random ONNX graphs, tvm_fusion vs ONNX Runtime",
        "torch": "random torch.nn modules through torch.export, tvm_fusion vs torch eager",
    }[result.get("frontend", "onnx")]
    reference = "ONNX Runtime" if result.get("frontend", "onnx") == "onnx" else "torch"
    lines = [
        f"# Differential fuzzer: {title}",
        "",
        f"`{result['command']}`",
        "",
        f"{result['date']}, {result['machine']}, load average before/after "
        f"{result['load_before']} / {result['load_after']}, {result['seconds']:.0f} s.",
        "",
        "| family | graphs run | " + " | ".join(OUTCOMES) + " |",
        "|---|---:|" + "---:|" * len(OUTCOMES),
    ]
    total = dict.fromkeys(OUTCOMES, 0)
    for family, row in result["counts"].items():
        run = sum(row[o] for o in OUTCOMES if o != "discarded")
        lines.append(f"| {family} | {run} | " + " | ".join(str(row[o]) for o in OUTCOMES) + " |")
        for o in OUTCOMES:
            total[o] += row[o]
    run = sum(total[o] for o in OUTCOMES if o != "discarded")
    lines.append(f"| **all** | **{run}** | " + " | ".join(str(total[o]) for o in OUTCOMES) + " |")
    lines += [
        "",
        f"Graphs run: every case but the discarded ones ({reference} itself failed). "
        "`refused`: a one-line ModelError from us where stock TVM (its importer and pipeline) "
        "fails too; a refusal of what stock runs counts as a failure.",
    ]
    if result["failures"]:
        lines += ["", "## Failures", ""]
        for f in result["failures"]:
            lines.append(f"- {f['outcome']} `{f['case']}` ({f['note']}): {f['reason']}")
    if result["refusals"]:
        lines += ["", "## Refusals (stock TVM fails too), by message", ""]
        by: dict[str, list[str]] = {}
        for r in result["refusals"]:  # by message, the node's name reduced to its op
            reason = re.sub(r"Node (\w+?)_\w+ ", r"Node \1 ", r["reason"])
            by.setdefault(reason, []).append(r["case"])
        for reason, cases in sorted(by.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"- {len(cases)}x {reason} (e.g. `{cases[0]}`)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    os.environ.setdefault("TVM_NUM_THREADS", "1")
    args = _parse_args(argv)
    from tvm_fusion.testing.fuzz import fuzz
    from tvm_fusion.testing.fuzz.common import MCPU_ENV, fuzz_target

    if args.mcpu:
        os.environ[MCPU_ENV] = args.mcpu  # the worker subprocesses inherit it
    try:
        target = fuzz_target()
    except Exception as err:  # an unknown or foreign CPU: one line, exit 2
        print(f"fuzz.py: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2

    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    start = time.time()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    command = "python scripts/fuzz.py " + " ".join(argv if argv is not None else sys.argv[1:])
    last = [0.0]

    def result_of(totals) -> dict:
        return {
            "command": command,
            "frontend": args.frontend,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(start)),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"TVM_NUM_THREADS={os.environ.get('TVM_NUM_THREADS')}, "
            f"mcpu {target.attrs.get('mcpu', '')}",
            "load_before": load_before,
            "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "seconds": time.time() - start,
            "counts": totals.counts,
            "failures": totals.failures,
            "refusals": totals.refusals,
        }

    def write(result) -> str:
        text = _markdown(result)
        if args.output:
            out = Path(args.output)
            out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
            out.with_suffix(".md").write_text(text)
        return text

    def progress(totals) -> None:  # totals so far, once a minute: a killed run leaves them
        if time.time() - last[0] > 60:
            last[0] = time.time()
            write(result_of(totals))

    totals = fuzz(
        args.families,
        seed=args.seed,
        minutes=args.minutes,
        cases=args.cases,
        out_dir=Path(args.out) if args.out else None,
        timeout_s=args.timeout,
        minimise_s=args.minimise,
        log=log,
        progress=progress,
        frontend=args.frontend,
    )
    print(write(result_of(totals)))
    return 1 if totals.failures else 0


if __name__ == "__main__":
    sys.exit(main())
