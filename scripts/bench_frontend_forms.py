#!/usr/bin/env python3
"""Issue #25's figures for the frontend forms of gated MLPs and cross entropy.

- ``gate_up``: an MLP gate with one ``gate_up_proj`` Linear (512 -> 2 x 1376), ``chunk(2)``,
  ``silu(gate) * up`` (Phi-3 / Qwen), x (4, 64, 512), through ``torch.export`` and
  ``from_exported_program``: tvm_fusion vs PyTorch eager;
- ``swiglu``: the same with sibling ``gate_proj`` / ``up_proj`` Linears (Llama, no bias);
- ``ce``: ONNX ``LogSoftmax(axis 1) -> GatherElements(axis 1, targets (N, 1)) -> ReduceMean ->
  Neg`` at (256, 50257), through ``load_onnx``: tvm_fusion vs ONNX Runtime (and PyTorch's
  ``F.cross_entropy`` on the same inputs).

Engines alternate in rounds (``engine.time_interleaved``), medians; the load average is
recorded beside each row.

    python scripts/bench_frontend_forms.py                 # bench/frontend_forms.{json,md}
    python scripts/bench_frontend_forms.py --only ce --repeat 10 --output /tmp/f.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

HIDDEN, WIDTH, X = 512, 1376, (4, 64, 512)
CE = (256, 50257)


def _gate_modules(torch):
    class GateUp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Linear(HIDDEN, 2 * WIDTH)

        def forward(self, x):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return torch.nn.functional.silu(gate) * up

    class SwiGLU(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Linear(HIDDEN, WIDTH, bias=False)
            self.up_proj = torch.nn.Linear(HIDDEN, WIDTH, bias=False)

        def forward(self, x):
            return torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)

    return {"gate_up": GateUp, "swiglu": SwiGLU}


def bench_gate(name: str, args, target) -> dict:
    import numpy as np
    import torch
    from tvm.relax.frontend.torch import from_exported_program

    from tvm_fusion import analysis
    from tvm_fusion.build import engine

    torch.manual_seed(0)
    module = _gate_modules(torch)[name]().eval()
    x = torch.randn(*X)
    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("seq", min=1, max=256)
    ep = torch.export.export(module, (x,), dynamic_shapes=({0: batch, 1: seq},))
    mod = from_exported_program(ep, keep_params_as_input=False)
    compiled = engine.compile_module(mod, target, "tvm_fusion")
    report = analysis.fusion_report(mod, target, name=name)
    ours = engine.TvmRunner(compiled, [x.numpy()])
    with torch.inference_mode():
        want = module(x).numpy()
    error = float(np.abs(ours.outputs()[0] - want).max())

    def eager():
        with torch.inference_mode():
            return module(x)

    times = engine.time_interleaved(
        {"ours": ours, "torch": eager}, repeat=args.repeat, budget_s=args.budget
    )
    row = {
        "case": f"{name} x{X} via torch.export",
        "kernels_ours": report.ours_kernels,
        "gate_rewrites": report.rewrites.get("FuseSplitGates", 0),
        "max_abs_err_vs_torch": error,
        **{f"{k}_ms": v["median_ms"] for k, v in times.items()},
    }
    row["ours/torch"] = row["ours_ms"] / row["torch_ms"]
    return row


def _ce_model():
    import onnx
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("LogSoftmax", ["x"], ["lsm"], axis=1),
        helper.make_node("GatherElements", ["lsm", "t"], ["g"], axis=1),
        helper.make_node("ReduceMean", ["g"], ["r"], keepdims=0),
        helper.make_node("Neg", ["r"], ["loss"]),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", CE[1]]),
        helper.make_tensor_value_info("t", TensorProto.INT64, ["n", 1]),
    ]
    out = helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])
    graph = helper.make_graph(nodes, "ce", inputs, [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def bench_ce(args, target, threads: int) -> dict:
    import numpy as np

    import tvm_fusion
    from tvm_fusion import analysis
    from tvm_fusion.build import engine

    model = _ce_model()
    mod = tvm_fusion.load_onnx(model)
    compiled = engine.compile_module(mod, target, "tvm_fusion")
    report = analysis.fusion_report(mod, target, name="ce")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(CE).astype("float32")
    t = rng.integers(0, CE[1], (CE[0], 1)).astype("int64")
    ours = engine.TvmRunner(compiled, [x, t])
    ort = engine.onnxruntime_runner(model, {"x": x, "t": t}, threads)
    error = float(np.abs(ours.outputs()[0] - ort()[0]).max())
    runners = {"ours": ours, "onnxruntime": ort}
    try:
        import torch

        xt, tt = torch.from_numpy(x), torch.from_numpy(t[:, 0])

        def eager():
            with torch.inference_mode():
                return torch.nn.functional.cross_entropy(xt, tt)

        runners["torch"] = eager
    except ImportError:
        pass
    times = engine.time_interleaved(runners, repeat=args.repeat, budget_s=args.budget)
    row = {
        "case": f"ONNX LogSoftmax->GatherElements->ReduceMean->Neg {CE}",
        "kernels_ours": report.ours_kernels,
        "ce_rewrites": report.rewrites.get("FuseCrossEntropy", 0),
        "max_abs_err_vs_ort": error,
        **{f"{k}_ms": v["median_ms"] for k, v in times.items()},
    }
    row["ours/ort"] = row["ours_ms"] / row["onnxruntime_ms"]
    if "torch_ms" in row:
        row["ours/torch"] = row["ours_ms"] / row["torch_ms"]
    return row


def _markdown(result: dict) -> str:
    lines = [
        "# Issue #25: gated MLPs via torch.export, the ONNX GatherElements cross entropy",
        "",
        f"Machine: {result['machine'].get('processor', '?')}, {result['threads']} threads. "
        f"Command: `{result['command']}`. Medians of warm calls, engines "
        "alternating in rounds; `load`: 1-minute load average when the row was measured.",
        "",
        "| case | our kernels | rewrites | ours ms | torch ms | ORT ms | ours/torch | ours/ORT "
        "| max err | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        rewrites = r.get("gate_rewrites", r.get("ce_rewrites"))
        err = r.get("max_abs_err_vs_torch", r.get("max_abs_err_vs_ort"))

        def cell(key, fmt, r=r):
            return format(r[key], fmt) if key in r else "-"

        lines.append(
            f"| {r['case']} | {r['kernels_ours']} | {rewrites} | {r['ours_ms']:.3f} | "
            f"{cell('torch_ms', '.3f')} | {cell('onnxruntime_ms', '.3f')} | "
            f"{cell('ours/torch', '.2f')} | {cell('ours/ort', '.2f')} | {err:.1e} | "
            f"{r['load_avg']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="gate_up,swiglu,ce")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--budget", type=float, default=3.0)
    parser.add_argument("--output", default="bench/frontend_forms.json")
    args = parser.parse_args(argv)
    import tvm_fusion
    from tvm_fusion.tools.bench import machine_info

    warnings.simplefilter("ignore")
    threads = tvm_fusion.pool.threads()
    target = tvm_fusion.host_target()
    sections = args.only.split(",")
    if any(s in ("gate_up", "swiglu") for s in sections):
        try:
            import torch
        except ImportError:
            print("bench_frontend_forms: error: gate_up/swiglu need torch", file=sys.stderr)
            return 2
        torch.set_num_threads(threads)
    rows = []
    for section in sections:
        row = (
            bench_ce(args, target, threads)
            if section == "ce"
            else bench_gate(section, args, target)
        )
        row["load_avg"] = os.getloadavg()[0]
        rows.append(row)
        print(json.dumps(row), flush=True)
    command = " ".join(["python", "scripts/bench_frontend_forms.py", *(argv or sys.argv[1:])])
    result = {"machine": machine_info(target), "threads": threads, "command": command}
    result["rows"] = rows
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
