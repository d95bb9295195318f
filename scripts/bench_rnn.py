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

# (name, layer, input, hidden, layers, bidirectional, seq, batch, dynamic sequence axis)
CASES = [
    # issue #25's figures: 2 layers, hidden 512, seq 64, batch 8; both sequence forms
    ("lstm 512x2 seq64 b8 dyn", "LSTM", 512, 512, 2, False, 64, 8, True),
    ("lstm 512x2 seq64 b8", "LSTM", 512, 512, 2, False, 64, 8, False),
    ("gru 512x2 seq64 b8 dyn", "GRU", 512, 512, 2, False, 64, 8, True),
    ("gru 512x2 seq64 b8", "GRU", 512, 512, 2, False, 64, 8, False),
    ("lstm 256 seq32 b4", "LSTM", 256, 256, 1, False, 32, 4, False),
    ("lstm 512x2 bidir seq16 b1 dyn", "LSTM", 512, 512, 2, True, 16, 1, True),
    ("lstm 512x2 bidir seq16 b1", "LSTM", 512, 512, 2, True, 16, 1, False),
    ("gru 256 seq32 b4", "GRU", 256, 256, 1, False, 32, 4, False),
    ("gru 1024 seq8 b1 dyn", "GRU", 1024, 1024, 1, False, 8, 1, True),
    ("gru 1024 seq8 b1", "GRU", 1024, 1024, 1, False, 8, 1, False),
]


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
    from tvm_fusion import analysis, engine
    from tvm_fusion.bench import machine_info

    warnings.simplefilter("ignore")
    threads = int(os.environ.get("TVM_NUM_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    target = tvm_fusion.host_target()
    rows = []
    for name, layer, inp, hidden, layers, bidir, seq, batch, dynamic in CASES:
        if args.only not in name:
            continue
        torch.manual_seed(0)
        module = getattr(torch.nn, layer)(inp, hidden, num_layers=layers, bidirectional=bidir)
        module = module.eval()
        x = torch.randn(seq, batch, inp)
        buffer = io.BytesIO()
        torch.onnx.export(
            module,
            (x,),
            buffer,
            input_names=["x"],
            dynamic_axes={"x": {0: "seq", 1: "batch"} if dynamic else {1: "batch"}},
            dynamo=False,
        )
        model = onnx.load_from_string(buffer.getvalue())
        mod = tvm_fusion.load_onnx(model)
        compiled = engine.compile_module(mod, target, "tvm_fusion")
        report = analysis.fusion_report(mod, target, name=name)
        xs = x.numpy()
        ours = engine.TvmRunner(compiled, [xs])
        ort = engine.onnxruntime_runner(model, {"x": xs}, threads)
        error = max(float(np.abs(a - b).max()) for a, b in zip(ours.outputs(), ort(), strict=True))

        def eager(module=module, x=x):
            with torch.inference_mode():
                return module(x)

        times = engine.time_interleaved(
            {"ours": ours, "onnxruntime": ort, "torch": eager},
            repeat=args.repeat,
            budget_s=args.budget,
        )
        row = {
            "case": name,
            "load_avg": os.getloadavg()[0],
            "compile_s": compiled.compile_s,
            "kernels_ours": report.ours_kernels,
            "gate_rewrites": report.rewrites.get("FuseSplitGates", 0),
            "max_abs_err_vs_ort": error,
            **{f"{k}_ms": v["median_ms"] for k, v in times.items()},
        }
        row["ours/ort"] = row["ours_ms"] / row["onnxruntime_ms"]
        row["ours/torch"] = row["ours_ms"] / row["torch_ms"]
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
        "`dyn`: the sequence axis exported dynamic (one loop kernel per layer and direction); "
        "otherwise static (unrolled, one gate kernel per step).",
        "",
        "| case | our kernels | gate kernels | ours ms | ORT ms | torch ms | ours/ORT | "
        "ours/torch | max err | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['kernels_ours']} | {r['gate_rewrites']} | {r['ours_ms']:.3f} | "
            f"{r['onnxruntime_ms']:.3f} | {r['torch_ms']:.3f} | {r['ours/ort']:.2f} | "
            f"{r['ours/torch']:.2f} | {r['max_abs_err_vs_ort']:.1e} | {r['load_avg']:.1f} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
