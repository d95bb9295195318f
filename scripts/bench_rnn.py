#!/usr/bin/env python3
"""Recurrent layers through ONNX: ``nn.LSTM`` / ``nn.GRU`` exported by ``torch.onnx.export``
(ONNX ``LSTM`` / ``GRU`` ops, dynamic batch; the sequence axis static or dynamic), compiled by
tvm_fusion (a static sequence unrolled, one fused gate kernel per step; a dynamic one as one
loop kernel per layer and direction) against ONNX Runtime's own LSTM/GRU kernels on the same
file and PyTorch eager; engines in alternating rounds with pauses, medians.

    python scripts/bench_rnn.py                      # bench/rnn.{json,md}
    python scripts/bench_rnn.py --only "x2 seq64 b8" --output /tmp/rnn.json --repeat 5
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import warnings
from pathlib import Path

# (name, layer, input, hidden, layers, bidirectional, seq, batch)
CASES = [
    ("lstm 512x2 seq64 b8", "LSTM", 512, 512, 2, False, 64, 8),  # issue #25's figures
    ("gru 512x2 seq64 b8", "GRU", 512, 512, 2, False, 64, 8),
    ("lstm 256 seq32 b4", "LSTM", 256, 256, 1, False, 32, 4),
    ("lstm 512x2 bidir seq16 b1", "LSTM", 512, 512, 2, True, 16, 1),
    ("gru 256 seq32 b4", "GRU", 256, 256, 1, False, 32, 4),
    ("gru 1024 seq8 b1", "GRU", 1024, 1024, 1, False, 8, 1),
]


def _export(torch, onnx, module, x, dynamic: bool):
    buffer = io.BytesIO()
    axes = {"x": {0: "seq", 1: "batch"} if dynamic else {1: "batch"}}
    torch.onnx.export(module, (x,), buffer, input_names=["x"], dynamic_axes=axes, dynamo=False)
    return onnx.load_from_string(buffer.getvalue())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--budget", type=float, default=3.0)
    parser.add_argument("--output", default="bench/rnn.json")
    parser.add_argument("--only", default="", help="only the cases whose name contains this")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench_rnn: error: needs torch (pip install -e '.[test]')", file=sys.stderr)
        return 2
    import numpy as np
    import onnx

    import tvm_fusion
    from tvm_fusion import analysis
    from tvm_fusion.build import engine
    from tvm_fusion.tools.bench import machine_info
    from tvm_fusion.transform import collect_rewrites

    warnings.simplefilter("ignore")
    threads = tvm_fusion.pool.threads()
    torch.set_num_threads(threads)
    target = tvm_fusion.host_target()
    rows = []
    for name, layer, inp, hidden, layers, bidir, seq, batch in CASES:
        if args.only not in name:
            continue
        torch.manual_seed(0)
        module = getattr(torch.nn, layer)(inp, hidden, num_layers=layers, bidirectional=bidir)
        module = module.eval()
        x = torch.randn(seq, batch, inp)
        xs = x.numpy()
        row = {"case": name}
        runners = {}
        for form, dynamic in (("loop", True), ("unrolled", False)):
            model = _export(torch, onnx, module, x, dynamic)
            with collect_rewrites() as counts:
                # the static file's recurrences stay unrolled steps (ChooseRecurrence off: on
                # CPU it would make them the loop kernel too)
                compiled = engine.compile_module(
                    tvm_fusion.load_onnx(model), target, "tvm_fusion", choose_recurrence=dynamic
                )
            runners[form] = engine.TvmRunner(compiled, [xs])
            row[f"kernels_{form}"] = analysis.kernel_count(compiled.lowered)
            row[f"gate_rewrites_{form}"] = counts.get("FuseSplitGates", 0)
            row[f"compile_s_{form}"] = compiled.compile_s
        runners["onnxruntime"] = ort = engine.onnxruntime_runner(model, {"x": xs}, threads)
        want = ort()
        row["max_abs_err_vs_ort"] = max(
            float(np.abs(a - b).max())
            for form in ("loop", "unrolled")
            for a, b in zip(runners[form].outputs(), want, strict=True)
        )

        def eager(module=module, x=x):
            with torch.inference_mode():
                return module(x)

        runners["torch"] = eager
        times = engine.time_interleaved(runners, repeat=args.repeat, budget_s=args.budget)
        row.update({f"{k}_ms": v["median_ms"] for k, v in times.items()})
        row["load_avg"] = os.getloadavg()[0]
        for form in ("loop", "unrolled"):
            row[f"{form}/ort"] = row[f"{form}_ms"] / row["onnxruntime_ms"]
            row[f"{form}/torch"] = row[f"{form}_ms"] / row["torch_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", "scripts/bench_rnn.py", *(argv or sys.argv[1:])])
    result = {"machine": machine_info(target), "threads": threads, "command": command}
    result["rows"] = rows
    out.write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Recurrent layers via ONNX: tvm_fusion vs ONNX Runtime's LSTM/GRU kernels and PyTorch",
        "",
        f"Machine: {result['machine'].get('processor', '?')}, {threads} threads. "
        f"Command: `{result['command']}`. Medians of warm calls, engines alternating; "
        "load: 1-minute load average at the row.",
        "",
        "`loop`: the sequence axis exported dynamic, one loop kernel per layer and direction; "
        "`unrolled`: exported static, one fused gate kernel per step. Both, ONNX Runtime (its "
        "LSTM/GRU op on the static file) and torch eager time in the same alternating rounds.",
        "",
        "| case | kernels loop / unrolled | compile s loop / unrolled | loop ms | unrolled ms | "
        "ORT ms | torch ms | loop/ORT | unrolled/ORT | loop/torch | unrolled/torch | max err "
        "| load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['kernels_loop']} / {r['kernels_unrolled']} | "
            f"{r['compile_s_loop']:.1f} / {r['compile_s_unrolled']:.1f} | {r['loop_ms']:.2f} | "
            f"{r['unrolled_ms']:.2f} | {r['onnxruntime_ms']:.2f} | {r['torch_ms']:.2f} | "
            f"{r['loop/ort']:.2f} | {r['unrolled/ort']:.2f} | {r['loop/torch']:.3f} | "
            f"{r['unrolled/torch']:.3f} | {r['max_abs_err_vs_ort']:.1e} | {r['load_avg']:.1f} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
