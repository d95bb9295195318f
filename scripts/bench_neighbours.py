#!/usr/bin/env python3
"""Issue #37: does a compiled model keep its speed beside other runtimes and processes?

For each workload (ONNX: a corpus model with its saved inputs, or ``gemm``, a 64x768 @ 768x3072
MatMul with a constant weight), ours is compiled once here and exported as a library; then
``--processes`` fresh processes per condition load it and an ONNX Runtime session of the same
model, and time both in alternating blocks of calls with pauses between (each pool spins on
after a run), medians per process. Conditions:

- ``alone``: nothing else;
- ``ort``: another ONNX Runtime session (of the same model) runs once before each timed call;
- ``torch``: a thread of the same process runs torch matmuls without a pause;
- ``busy``: another process spins on one core (the last of this process's affinity).

Per condition: the median and the worst of the per-process medians, ours and ORT side by side,
and each over its own quiet median (ORT's factor is the anchor). The thread pool runs as
``import tvm_fusion`` sets it (``tvm_fusion/pool.py``); run with ``TVM_BIND_THREADS=1`` to see
the pinned pool.

    python scripts/bench_neighbours.py --processes 20           # bench/neighbours.{json,md}
    python scripts/bench_neighbours.py --workloads gemm --conditions alone,busy --processes 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONDITIONS = ("alone", "ort", "torch", "busy")
DEFAULT_WORKLOADS = "gpt2_dynamo,lstm_dynamo,gemm"
GEMM = (64, 768, 3072)


def _gemm_model():
    import numpy as np

    from tvm_fusion.tools.bench import matmul_onnx

    m, k, n = GEMM
    w = np.random.default_rng(0).standard_normal((k, n)).astype("float32")
    x = np.random.default_rng(1).standard_normal((m, k)).astype("float32")
    return matmul_onnx(w, m), {"x": x}


def prepare(name: str, target, work: Path) -> dict:
    """The workload's ONNX file, inputs (.npz) and our library (.so) under ``work``."""
    import numpy as np
    import onnx

    import tvm_fusion
    from tvm_fusion.build import engine
    from tvm_fusion.tools import model_bench

    if name == "gemm":
        model, inputs = _gemm_model()
    else:
        (case,) = model_bench.load_cases(ROOT / "tests" / "corpus", only=[name])
        model, inputs = onnx.load(str(case.path)), case.inputs
    onnx_path, npz, lib = work / f"{name}.onnx", work / f"{name}.npz", work / f"{name}.so"
    onnx.save(model, str(onnx_path))
    np.savez(npz, **inputs)
    compiled = engine.compile_module(tvm_fusion.load_onnx(onnx_path), target, "tvm_fusion")
    compiled.executable.export_library(str(lib))
    return {"onnx": str(onnx_path), "inputs": str(npz), "lib": str(lib)}


def child(args) -> None:
    """One fresh process: ours and ORT under ``args.condition``; prints their medians (ms)."""
    import threading
    import time

    import numpy as np
    import tvm
    from tvm import relax

    import tvm_fusion
    from tvm_fusion.build import engine

    threads = tvm_fusion.pool.threads()
    inputs = dict(np.load(args.inputs))
    vm = relax.VirtualMachine(tvm.runtime.load_module(args.lib), tvm.cpu(0))
    main, tensors = vm["main"], [tvm.runtime.tensor(a) for a in inputs.values()]
    import onnx

    model = onnx.load(args.onnx)
    ort = engine.onnxruntime_runner(model, inputs, threads)
    before = engine.onnxruntime_runner(model, inputs, threads) if args.condition == "ort" else None
    stop, spinner = threading.Event(), None
    if args.condition == "torch":
        import torch

        torch.set_num_threads(threads)
        a = torch.randn(256, 256)

        def spin():
            while not stop.is_set():
                torch.mm(a, a)

        spinner = threading.Thread(target=spin, daemon=True)
        spinner.start()
    runs = {"ours": lambda: main(*tensors), "ort": ort}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.warmup):
        for run in runs.values():
            run()
    # Engines in blocks of calls with a pause between (each pool's workers spin on after a run:
    # TVM's for about 250 ms), the first call after a pause untimed.
    for b in range(0, args.calls, args.block):
        for name, run in runs.items():
            time.sleep(args.pause)
            run()
            for _ in range(min(args.block, args.calls - b)):
                if before is not None:
                    before()
                start = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - start) * 1e3)
    stop.set()
    if spinner is not None:  # a daemon thread inside torch.mm at exit aborts the process
        spinner.join()
    print(json.dumps({k: statistics.median(v) for k, v in times.items()}), flush=True)


def _busy() -> subprocess.Popen:
    core = sorted(os.sched_getaffinity(0))[-1]
    code = f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    return subprocess.Popen([sys.executable, "-c", code])


def run_condition(files: dict, condition: str, args) -> list[dict]:
    command = [sys.executable, __file__, "--child", "--condition", condition]
    command += ["--lib", files["lib"], "--onnx", files["onnx"], "--inputs", files["inputs"]]
    command += ["--calls", str(args.calls), "--warmup", str(args.warmup)]
    command += ["--block", str(args.block), "--pause", str(args.pause)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    busy = _busy() if condition == "busy" else None
    try:
        medians = []
        for _ in range(args.processes):
            try:
                out = subprocess.run(
                    command, env=env, capture_output=True, text=True, timeout=args.child_timeout
                )
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"{condition}: a process ran past {args.child_timeout} s"
                ) from None
            if out.returncode != 0:
                raise RuntimeError(f"{condition}: child failed: {out.stderr.strip()[-500:]}")
            medians.append(json.loads(out.stdout.strip().splitlines()[-1]))
        return medians
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()


def summary(per_process: list[dict]) -> dict:
    return {
        engine: {
            "median_ms": statistics.median(p[engine] for p in per_process),
            "worst_ms": max(p[engine] for p in per_process),
        }
        for engine in ("ours", "ort")
    }


def markdown(result: dict) -> str:
    lines = [
        "# Beside neighbours (issue #37)",
        "",
        f"Machine: {result['machine'].get('processor', '?')}, {result['machine']['threads']} "
        f"threads, TVM_BIND_THREADS={result['bind_threads']}. Command: `{result['command']}`. "
        "Medians per fresh process; worst: the slowest process's median; x quiet: over the "
        "condition `alone`'s median.",
        "",
        "| workload | condition | ours ms | ours worst | ours worst x quiet | ORT ms | ORT worst "
        "| ORT worst x quiet |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, conditions in result["workloads"].items():
        quiet = conditions.get("alone")
        for condition, s in conditions.items():

            def factor(engine, s=s, quiet=quiet):
                if not quiet:
                    return "-"
                return f"{s[engine]['worst_ms'] / quiet[engine]['median_ms']:.2f}x"

            lines.append(
                f"| {name} | {condition} | {s['ours']['median_ms']:.3f} | "
                f"{s['ours']['worst_ms']:.3f} | {factor('ours')} | {s['ort']['median_ms']:.3f} | "
                f"{s['ort']['worst_ms']:.3f} | {factor('ort')} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS)
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--processes", type=int, default=20, help="fresh processes per condition")
    parser.add_argument("--calls", type=int, default=100, help="timed calls per engine and process")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block", type=int, default=25, help="calls of one engine in a row")
    parser.add_argument("--pause", type=float, default=0.3, help="seconds between blocks")
    parser.add_argument("--child-timeout", type=float, default=300, help="seconds per process")
    parser.add_argument("--mcpu", default=None, help="build for this CPU (LLVM's name)")
    parser.add_argument("--output", default="bench/neighbours.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--condition", "--lib", "--onnx", "--inputs"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    unknown = [c for c in conditions if c not in CONDITIONS]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    # refused before importing TVM (~6 s)
    refusal = None
    if unknown or not conditions:
        refusal = (
            f"unknown condition(s) {', '.join(unknown) or '(none)'}; known: {', '.join(CONDITIONS)}"
        )
    elif args.processes < 1 or args.calls < 1:
        refusal = "--processes and --calls expect integers >= 1"
    if refusal:
        print(f"bench_neighbours: error: {refusal}", file=sys.stderr)
        return 2
    import tvm_fusion
    from tvm_fusion.tools.bench import bench_target, machine_info

    try:
        target = bench_target(tvm_fusion.host_target(), args.mcpu)
        result = {"machine": machine_info(target), "workloads": {}}
        with tempfile.TemporaryDirectory(prefix="neighbours-") as work:
            for name in workloads:
                files = prepare(name, target, Path(work))
                rows = result["workloads"].setdefault(name, {})
                for condition in conditions:
                    rows[condition] = summary(run_condition(files, condition, args))
                    print(
                        json.dumps({"workload": name, "condition": condition, **rows[condition]}),
                        flush=True,
                    )
    except (tvm_fusion.TvmFusionError, RuntimeError) as err:
        print(f"bench_neighbours: error: {err}", file=sys.stderr)
        return 2
    result["bind_threads"] = os.environ.get("TVM_BIND_THREADS")
    result["command"] = " ".join(["python", "scripts/bench_neighbours.py", *(argv or sys.argv[1:])])
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
