#!/usr/bin/env python3
"""A dynamic LM head with labels (GPT-2's: hidden 768, vocabulary 50257, loss of the shifted
labels), through both of a user's paths: ``torch.export`` -> ``from_exported_program`` and
``torch.onnx.export`` -> ``tvm_fusion.load_onnx``; batch and sequence symbolic.

For each path: the rewrites per pass, the planned peak memory (``analysis.peak_bytes``) of
stock TVM's build and ours with the Relax function's ``tir_var_upper_bound`` at (batch, seq)
(what ``torch.export``'s ``Dim(max=...)`` sets; the ONNX import gets the same), and the time
of ours against ONNX Runtime and PyTorch at (batch, seq), engines in alternating rounds
with pauses (engine.time_interleaved).
Stock is compiled, not run: its unscheduled (1024 x 768 x 50257) GEMM takes minutes a call.

    python scripts/bench_lm_head.py                 # (8, 128, 50257): bench/lm_head.{json,md}
    python scripts/bench_lm_head.py --vocab 1003 --hidden 64 --output /tmp/lm.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--budget", type=float, default=10.0, help="timed seconds per engine")
    parser.add_argument("--output", default="bench/lm_head.json")
    return parser.parse_args(argv)


def _head(torch, hidden: int, vocab: int):
    import torch.nn.functional as F

    class LMHeadLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

        def forward(self, hidden_states, labels):
            logits = self.lm_head(hidden_states)
            shifted = logits[:, :-1, :].contiguous()
            return F.cross_entropy(shifted.view(-1, vocab), labels[:, 1:].contiguous().view(-1))

    torch.manual_seed(0)
    return LMHeadLoss().eval()


def _rewrites(mod, target) -> dict:
    import tvm

    from tvm_fusion.build.pipeline import fusion_passes
    from tvm_fusion.transform import collect_rewrites

    with collect_rewrites() as counts:
        tvm.transform.Sequential(fusion_passes(target))(mod)
    return {name: n for name, n in counts.items() if n}


def _peaks(mod, target) -> dict:
    from tvm_fusion import analysis
    from tvm_fusion.build import engine

    out, compiled = {}, {}
    for name in ("stock", "tvm_fusion"):
        compiled[name] = engine.compile_module(mod, target, name)
        peak = analysis.peak_bytes(compiled[name].lowered)
        out[f"{'ours' if name == 'tvm_fusion' else name}_peak_MB"] = (
            None if peak is None else peak / 2**20
        )
    if out["stock_peak_MB"] and out["ours_peak_MB"]:
        out["ours/stock_peak"] = out["ours_peak_MB"] / out["stock_peak_MB"]
    return out


def _with_bound(mod, bound: dict):
    """``mod`` with ``tir_var_upper_bound`` on main: each symbolic var of the inputs named by
    the input dims it stands for (``batch``, ``seq``)."""
    import tvm
    from tvm import tirx

    func = mod["main"]
    bounds = {}
    for param, dims in zip(func.params, (("batch", "seq", None), ("batch", "seq")), strict=False):
        for value, dim in zip(param.ty.shape.values, dims, strict=False):
            if isinstance(value, tirx.Var) and dim:
                bounds[value.name] = bound[dim]
    mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    mod["main"] = func.with_attr("tir_var_upper_bound", bounds)
    return mod


def main(argv=None) -> int:
    args = _parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench_lm_head: error: needs torch (pip install -e '.[test]')", file=sys.stderr)
        return 2
    import numpy as np
    from tvm.relax.frontend.torch import from_exported_program

    import tvm_fusion
    from tvm_fusion.build import engine
    from tvm_fusion.tools.bench import machine_info

    threads = tvm_fusion.pool.threads()
    torch.set_num_threads(threads)
    target = tvm_fusion.host_target()
    head = _head(torch, args.hidden, args.vocab)
    b, s = args.batch, args.seq
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((b, s, args.hidden)).astype("float32")
    labels = rng.integers(0, args.vocab, (b, s)).astype("int64")
    labels[:, -3:] = -100  # padding
    with torch.no_grad():
        expect = float(head(torch.from_numpy(hidden), torch.from_numpy(labels)))
    bound = {"batch": b, "seq": s}

    dims = {0: torch.export.Dim("batch", max=b), 1: torch.export.Dim("seq", min=3, max=s)}
    example = tuple(torch.from_numpy(np.ascontiguousarray(a[:2, :9])) for a in (hidden, labels))
    program = torch.export.export(
        head, example, dynamic_shapes={"hidden_states": dims, "labels": dims}
    )
    exported = from_exported_program(program, keep_params_as_input=False)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lm_head.onnx"
        torch.onnx.export(
            head,
            example,
            str(path),
            input_names=["hidden_states", "labels"],
            output_names=["loss"],
            dynamic_axes={name: {0: "batch", 1: "seq"} for name in ("hidden_states", "labels")},
            dynamo=False,
        )
        import onnx

        onnx_model = onnx.load(str(path))
    imported = tvm_fusion.load_onnx(onnx_model)

    rows, runs = [], {}
    for name, mod in (("torch.export", exported), ("onnx (TorchScript exporter)", imported)):
        mod = _with_bound(mod, bound)
        row = {"path": name, "rewrites": _rewrites(mod, target)}
        row.update(_peaks(mod, target))
        compiled = engine.compile_module(mod, target, "tvm_fusion")
        runner = engine.TvmRunner(compiled, [hidden, labels])
        got = float(runner.outputs()[0])
        row["loss_abs_err_vs_torch"] = abs(got - expect)
        runs[f"ours ({name})"] = runner
        rows.append(row)
    runs["onnxruntime"] = engine.onnxruntime_runner(
        onnx_model, {"hidden_states": hidden, "labels": labels}, threads
    )
    th, tl = torch.from_numpy(hidden), torch.from_numpy(labels)

    def torch_run():
        with torch.inference_mode():
            return head(th, tl)

    runs["torch"] = torch_run
    times = engine.time_interleaved(runs, repeat=args.repeat, budget_s=args.budget)
    result = {
        "machine": machine_info(target),
        "threads": threads,
        "sizes": {"batch": b, "seq": s, "hidden": args.hidden, "vocab": args.vocab},
        "paths": rows,
        "times_ms": {name: t["median_ms"] for name, t in times.items()},
    }
    ort = result["times_ms"]["onnxruntime"]
    result["ours/onnxruntime"] = {
        name: t / ort for name, t in result["times_ms"].items() if name.startswith("ours")
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


def _markdown(result: dict) -> str:
    sz = result["sizes"]
    lines = [
        f"# Dynamic LM head with labels: batch {sz['batch']}, seq {sz['seq']}, "
        f"hidden {sz['hidden']}, vocabulary {sz['vocab']}",
        "",
        f"Machine: {result['machine'].get('processor', '?')}, {result['threads']} threads. "
        "Command: `python scripts/bench_lm_head.py`.",
        "",
        "| path | rewrites | stock peak MB | ours peak MB | ours/stock | |loss err| |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["paths"]:
        rewrites = ", ".join(f"{k} {v}" for k, v in sorted(row["rewrites"].items()))

        def mb(value):
            return "-" if value is None else f"{value:.1f}"

        ratio = row.get("ours/stock_peak")
        lines.append(
            f"| {row['path']} | {rewrites} | {mb(row['stock_peak_MB'])} | "
            f"{mb(row['ours_peak_MB'])} | {'-' if ratio is None else f'{ratio:.3f}'} | "
            f"{row['loss_abs_err_vs_torch']:.2e} |"
        )
    lines += ["", "| engine | median ms | / onnxruntime |", "|---|---|---|"]
    ort = result["times_ms"]["onnxruntime"]
    for name, ms in result["times_ms"].items():
        lines.append(f"| {name} | {ms:.1f} | {ms / ort:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
