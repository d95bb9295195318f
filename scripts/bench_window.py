#!/usr/bin/env python3
"""Window reductions (depthwise convolution, pooling) on the CPU: the WindowReduction rule
against the fallback rule it replaces and against ONNX Runtime, on single-op ONNX models.

Each case is compiled twice with our pipeline, once as it is and once with the WindowReduction
rule switched off (the kernel then falls to the ``Fallback`` rule, as before the rule existed),
checked against ONNX Runtime, and the three are timed in alternating rounds
(``engine.time_interleaved``). Writes ``bench/window.json`` and ``bench/window.md``.

    python scripts/bench_window.py                  # ConvNeXt's depthwise 7 x 7, ResNet's maxpool
    python scripts/bench_window.py --match maxpool --output /tmp/window.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import numpy as np

# name: (op, input shape, attributes); depthwise convolutions have groups = channels
CASES = {
    "depthwise 1x96x56x56 k7 (ConvNeXt)": ("Conv", (1, 96, 56, 56), {"k": 7, "pad": 3}),
    "maxpool 1x64x112x112 k3 s2 (ResNet)": ("MaxPool", (1, 64, 112, 112), {"k": 3, "s": 2}),
    "avgpool 1x64x55x55 k3 s2": ("AveragePool", (1, 64, 55, 55), {"k": 3, "s": 2}),
}


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--match", default=None, help="only cases whose name contains this")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--budget", type=float, default=3.0, help="timed seconds per engine")
    parser.add_argument("--target", default="llvm")
    parser.add_argument("--output", default="bench/window.json")
    return parser.parse_args(argv)


def model(op: str, shape, attrs: dict, seed: int = 0):
    """(onnx.ModelProto, {input name: array}) of one ``op`` node (with a bias for Conv)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    n, c, h, w = shape
    k, s = attrs["k"], attrs.get("s", 1)
    pad = attrs.get("pad", (k - 1) // 2)
    x = rng.standard_normal(shape).astype("float32")
    inits = []
    if op == "Conv":
        weight = (rng.standard_normal((c, 1, k, k)) / k).astype("float32")
        bias = rng.standard_normal(c).astype("float32")
        inits = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")]
        node = helper.make_node(
            "Conv", ["x", "w", "b"], ["y"], group=c, kernel_shape=[k, k], pads=[pad] * 4
        )
        oh, ow = (h + 2 * pad - k) // s + 1, (w + 2 * pad - k) // s + 1
    else:
        node = helper.make_node(
            op, ["x"], ["y"], kernel_shape=[k, k], strides=[s, s], pads=[pad] * 4
        )
        oh, ow = (h + 2 * pad - k) // s + 1, (w + 2 * pad - k) // s + 1
    graph = helper.make_graph(
        [node],
        "window",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, c, oh, ow])],
        inits,
    )
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx_model.ir_version = 8
    return onnx_model, {"x": x}


@contextlib.contextmanager
def without_window_rule():
    """Our pipeline as it was before the WindowReduction rule: the rule declines everything."""
    from tvm_fusion.schedule.cpu import window

    apply = window.WindowReduction.apply
    window.WindowReduction.apply = lambda self, func, target, tunable: None
    try:
        yield
    finally:
        window.WindowReduction.apply = apply


def run_case(name: str, target, repeat: int, budget: float) -> dict:
    from tvm_fusion import analysis
    from tvm_fusion.build import engine
    from tvm_fusion.frontend import load_onnx

    op, shape, attrs = CASES[name]
    onnx_model, inputs = model(op, shape, attrs)
    threads = engine.threads_for(target)
    ort = engine.onnxruntime_runner(onnx_model, inputs, threads)
    reference = [np.asarray(o) for o in ort()]
    runs, rules = {"ort": ort}, {}
    for key in ("ours", "fallback"):
        with without_window_rule() if key == "fallback" else contextlib.nullcontext():
            compiled = engine.compile_module(load_onnx(onnx_model), target, "tvm_fusion")
        runner = engine.TvmRunner(compiled, [inputs["x"]])
        if not engine.allclose(runner.outputs(), reference, 1e-4, 1e-4):
            raise SystemExit(f"bench_window: {name} ({key}) differs from ONNX Runtime")
        rules[key] = sorted({str(i.rule) for i in analysis.schedule_info(compiled.lowered)})
        runs[key] = runner
    timing = engine.time_interleaved(runs, repeat=repeat, budget_s=budget, min_time_s=0.5)
    row = {"case": name, "rules": rules}
    for key in runs:
        row[f"{key}_ms"] = round(timing[key]["median_ms"], 4)
    row["ours_vs_fallback"] = round(row["ours_ms"] / row["fallback_ms"], 3)
    row["ours_vs_ort"] = round(row["ours_ms"] / row["ort_ms"], 3)
    return row


def markdown(rows: list[dict], machine: dict) -> str:
    about = ", ".join(
        f"{k} {machine[k]}" for k in ("processor", "threads", "tvm", "onnxruntime", "date", "load")
    )
    lines = [
        "# Window reductions on the CPU: WindowReduction vs the fallback rule vs ONNX Runtime",
        "",
        f"Machine: {about}; target `{machine['target']}`. Single-op ONNX models, medians of "
        "alternating rounds (`python scripts/bench_window.py`); the fallback build is ours with "
        "the WindowReduction rule switched off.",
        "",
        "| case | ours ms | fallback ms | ORT ms | ours / fallback | ours / ORT |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['ours_ms']} | {r['fallback_ms']} | {r['ort_ms']} | "
            f"{r['ours_vs_fallback']}x | {r['ours_vs_ort']}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = _parse_args(argv)
    from tvm_fusion.target import parse_target
    from tvm_fusion.tools.bench import machine_info

    target = parse_target(args.target)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"load at start: {load}", flush=True)
    names = [n for n in CASES if args.match is None or args.match in n]
    rows = []
    for name in names:
        row = run_case(name, target, args.repeat, args.budget)
        rows.append(row)
        print(
            f"{name}: ours {row['ours_ms']} ms, fallback {row['fallback_ms']} ms, "
            f"ORT {row['ort_ms']} ms",
            flush=True,
        )
    machine = {**machine_info(target), "load": load}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rows, machine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
