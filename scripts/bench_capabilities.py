#!/usr/bin/env python3
"""Capability benchmarks: the figures of issues #5, #6 and #7 that the workload table does not show.

All in one process, medians of repeated runs, written to ``bench/capabilities.json`` and
``bench/capabilities.md``:

- ``take``: XLNet's ``(ac + take(bd, arange(klen), 3)) * scale`` at bd (16, 16, 128, 256),
  klen 128, forward and forward+backward (``relax.transform.Gradient`` of ``sum(out ** 2)``),
  stock
  TVM's pipeline (take / take_backward) vs tvm_fusion (strided_slice / slice_scatter), and
  PyTorch's ``index_select`` when installed;
- ``cross_entropy``: ``nll_loss(log_softmax(x), t, ignore_index=-100)`` at (512, 32768),
  forward and forward+backward (``Gradient`` w.r.t. the logits), stock vs tvm_fusion (with
  FuseCrossEntropy run before Gradient) vs PyTorch, and the largest buffer each allocates;
- ``linear_ce``: the LM head ``hidden @ W^T -> cross entropy`` at N 2048, hidden 1024,
  V 32000 (issue #6's fused linear cross entropy): planned peak memory of stock's unfused
  graph vs ours, forward and forward+backward, with ONNX Runtime and PyTorch times;
- ``views``: the gelu with bookend views vs the same gelu without views, and the MHA transpose
  with views vs a plain transpose of the same bytes, both compiled by tvm_fusion;
- ``tuned``: issue #5's gate workloads (LSTM x(1, 1024), the #2890 gate, SwiGLU) after
  same-budget tuning runs of ours and stock's (those with ``tune/<workload>_tvm_fusion`` and
  ``tune/<workload>_stock``);
- ``shapes``: the shape idioms of ONNX exporters (issue #8): shape-only kernels and shape
  copies in the CUDA build, stock vs ours, and llvm times (run it with
  ``--only shapes --output bench/shapes.json``);
- ``gates``: the gate workloads at the issue's shapes vs stock TVM and ONNX Runtime (LSTM at
  x(1, 1024), the #2890 gate at x(64, 1024), SwiGLU 2048 -> 2x5632 at 64 rows).

    python scripts/bench_capabilities.py                  # everything
    python scripts/bench_capabilities.py --only take --repeat 20
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def _time(run, repeat: int, budget: float) -> float:
    from tvm_fusion.build.engine import time_runs

    return time_runs(run, repeat=repeat, budget_s=budget)["median_ms"]


def bench_take(target, repeat: int, budget: float, size: str) -> list[dict]:
    from tvm import relax

    from tvm_fusion import analysis, models
    from tvm_fusion.build import engine
    from tvm_fusion.models.take_arange import xlnet_loss

    inst = models.build("take_arange", size)
    inputs = inst.input_list()
    bd, ac = inputs
    grad_mod = relax.transform.Gradient("main")(xlnet_loss(bd.shape, ac.shape))
    rows = []
    for phase, mod, fn in (("forward", inst.mod, "main"), ("fwd+bwd", grad_mod, "main_adjoint")):
        row = {"case": f"take {phase}"}
        outs = {}
        for pipeline in ("stock", "tvm_fusion"):
            compiled = engine.compile_module(mod, target, pipeline)
            run = engine.TvmRunner(compiled, inputs, fn)
            outs[pipeline] = run.outputs()
            row[pipeline] = _time(run, repeat, budget)
            row[f"{pipeline}_kernels"] = analysis.kernel_count(compiled.lowered)
        row["max_diff"] = engine.max_error(outs["tvm_fusion"], outs["stock"])
        row["torch"] = _torch_take(inst, phase == "fwd+bwd", repeat, budget)
        rows.append(row)
    return rows


def _torch_take(inst, backward: bool, repeat: int, budget: float) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    from tvm_fusion.build.engine import time_runs

    torch.set_num_threads(_threads())
    bd, ac = (torch.from_numpy(a) for a in inst.input_list())
    klen = ac.shape[-1]
    idx = torch.arange(klen)

    def fwd():
        with torch.inference_mode():
            return (ac + torch.index_select(bd, 3, idx)) * 0.125

    def fwd_bwd():
        x = bd.detach().requires_grad_(True)
        loss = (((ac + torch.index_select(x, 3, idx)) * 0.125) ** 2).sum()
        loss.backward()
        return x.grad

    return time_runs(fwd_bwd if backward else fwd, repeat=repeat, budget_s=budget)["median_ms"]


def _threads() -> int:
    from tvm_fusion import pool

    return pool.threads()


def bench_cross_entropy(target, repeat: int, budget: float, size: str) -> list[dict]:
    """F.cross_entropy(x, t, ignore_index=-100) as log_softmax + nll_loss at (512, 32768):
    forward, and forward+backward (d loss / d logits), with peak extra memory."""
    from tvm import relax

    from tvm_fusion import analysis, models
    from tvm_fusion.build import engine
    from tvm_fusion.models.cross_entropy import nll_module
    from tvm_fusion.transform import FuseCrossEntropy

    inst = models.build("cross_entropy", size)
    x, t = inst.input_list()
    n, v = x.shape
    mod = nll_module(n, v)
    rows = []
    for phase in ("forward", "fwd+bwd"):
        row = {"case": f"cross entropy {phase}"}
        outs = {}
        for pipeline in ("stock", "tvm_fusion"):
            m = FuseCrossEntropy(target)(mod) if pipeline == "tvm_fusion" else mod
            fn = "main"
            if phase == "fwd+bwd":
                m = relax.transform.Gradient("main", require_grads=m["main"].params[0])(m)
                fn = "main_adjoint"
            compiled = engine.compile_module(m, target, pipeline)
            run = engine.TvmRunner(compiled, [x, t], fn)
            outs[pipeline] = run.outputs()
            row[pipeline] = _time(run, repeat, budget)
            largest = max(a.elements or 0 for a in analysis.allocations(compiled.lowered))
            row[f"{pipeline}_largest_alloc_MB"] = 4 * largest / 2**20
        row["loss_diff"] = abs(float(outs["tvm_fusion"][0]) - float(outs["stock"][0]))
        row["torch"] = _torch_ce(x, t, phase == "fwd+bwd", repeat, budget)
        rows.append(row)
    return rows


def _torch_ce(x, t, backward: bool, repeat: int, budget: float) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    from tvm_fusion.build.engine import time_runs

    torch.set_num_threads(_threads())
    xt, tt = torch.from_numpy(x), torch.from_numpy(t)

    def fwd():
        with torch.inference_mode():
            return torch.nn.functional.cross_entropy(xt, tt, ignore_index=-100)

    def fwd_bwd():
        xg = xt.detach().requires_grad_(True)
        torch.nn.functional.cross_entropy(xg, tt, ignore_index=-100).backward()
        return xg.grad

    return time_runs(fwd_bwd if backward else fwd, repeat=repeat, budget_s=budget)["median_ms"]


def bench_linear_ce(target, repeat: int, budget: float, size: str) -> list[dict]:
    """The LM head ``hidden @ W^T -> cross entropy`` (workload ``linear_cross_entropy``: N 2048,
    hidden 1024, V 32000 at seed), forward and forward+backward (``Gradient`` w.r.t. hidden
    and weight): planned peak memory (``analysis.peak_bytes``) of stock's unfused graph, of
    ours with FuseCrossEntropy alone, and of ours with FuseLinearCrossEntropy; times of ours,
    ONNX Runtime (forward) and PyTorch. Stock is compiled, not run, at seed: its unscheduled
    134 GFLOP GEMM takes minutes a call."""
    import tvm
    from tvm import relax

    from tvm_fusion import analysis, models
    from tvm_fusion.build import engine
    from tvm_fusion.build.pipeline import fusion_passes

    inst = models.build("linear_cross_entropy", size)
    inputs = inst.input_list()
    run_stock = "tvm-stock" not in inst.skip
    variants = (
        ("stock", "stock", {}),
        ("ours_ce_only", "tvm_fusion", {"fuse_linear_cross_entropy": False}),
        ("ours", "tvm_fusion", {}),
    )
    rows = []
    for phase in ("forward", "fwd+bwd"):
        row = {"case": f"linear+CE {phase}"}
        outs = {}
        for name, pipeline, flags in variants:
            mod, fn = inst.mod, "main"
            if phase == "fwd+bwd":
                if pipeline == "tvm_fusion":  # our graph passes before Gradient
                    mod = tvm.transform.Sequential(fusion_passes(target, **flags))(mod)
                params = mod["main"].params
                mod = relax.transform.Gradient("main", require_grads=params[:2])(mod)
                fn = "main_adjoint"
            compiled = engine.compile_module(mod, target, pipeline, **flags)
            peak = analysis.peak_bytes(compiled.lowered, fn)
            row[f"{name}_peak_MB"] = None if peak is None else peak / 2**20
            if name == "stock" and not run_stock:
                continue
            if name in ("stock", "ours"):
                runner = engine.TvmRunner(compiled, inputs, fn)
                outs[name] = runner.outputs()
                row[f"{name}_ms"] = _time(runner, repeat, budget)
        if row.get("stock_peak_MB") and row.get("ours_peak_MB"):
            row["ours/stock_peak"] = row["ours_peak_MB"] / row["stock_peak_MB"]
        if phase == "forward":
            row["loss_err_vs_ref"] = engine.max_error(outs["ours"], inst.reference(*inputs))
            row["onnxruntime_ms"] = _ort_time(inst, repeat, budget)
        row["torch_ms"] = _torch_linear_ce(inputs, phase == "fwd+bwd", repeat, budget)
        rows.append(row)
    return rows


def _ort_time(inst, repeat: int, budget: float) -> float | None:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return None
    from tvm_fusion.build import engine

    run = engine.onnxruntime_runner(inst.onnx_model, inst.inputs, _threads())
    return _time(run, repeat, budget)


def _torch_linear_ce(inputs, backward: bool, repeat: int, budget: float) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    from tvm_fusion.build.engine import time_runs

    torch.set_num_threads(_threads())
    h, w, t = (torch.from_numpy(a) for a in inputs)

    def fwd():
        with torch.inference_mode():
            return torch.nn.functional.cross_entropy(h @ w.T, t, ignore_index=-100)

    def fwd_bwd():
        hg, wg = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
        torch.nn.functional.cross_entropy(hg @ wg.T, t, ignore_index=-100).backward()
        return hg.grad, wg.grad

    return time_runs(fwd_bwd if backward else fwd, repeat=repeat, budget_s=budget)["median_ms"]


def bench_views(target, repeat: int, budget: float, size: str) -> list[dict]:
    from tvm import relax

    from tvm_fusion import models

    rows = []
    gelu = models.build("gelu_views", size)
    x = gelu.input_list()[0]
    plain = _single_op_module(x.shape, lambda bb, v: relax.op.nn.gelu(v))
    rows.append(_compare_two("gelu: views vs none", gelu.mod, plain, [x], target, repeat, budget))

    mha = models.build("mha_transpose", size)
    x = mha.input_list()[0]
    heads = 12 if size == "seed" else 3
    bh, seq, hd = x.shape
    shape4 = (bh // heads, heads, seq, hd)
    transpose = _single_op_module(shape4, lambda bb, v: relax.op.permute_dims(v, [0, 2, 1, 3]))
    rows.append(
        _compare_two(
            "mha: views vs plain transpose",
            mha.mod,
            transpose,
            [x],
            target,
            repeat,
            budget,
            plain_inputs=[x.reshape(shape4)],
        )
    )
    return rows


def _single_op_module(shape, make):
    from tvm import relax

    x = relax.Var("x", relax.TensorType(tuple(shape), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(make(bb, x))
        bb.emit_func_output(out)
    return bb.get()


def _compare_two(case, mod, plain, inputs, target, repeat, budget, plain_inputs=None) -> dict:
    from tvm_fusion import analysis
    from tvm_fusion.build import engine

    a = engine.compile_module(mod, target, "tvm_fusion")
    b = engine.compile_module(plain, target, "tvm_fusion")
    ra, rb = engine.TvmRunner(a, inputs), engine.TvmRunner(b, plain_inputs or inputs)
    out_a, out_b = ra.outputs()[0], rb.outputs()[0]
    same = np.allclose(out_a.reshape(-1), out_b.reshape(-1), rtol=1e-5, atol=1e-6)
    # interleave the two so that drift on a noisy machine hits both alike
    ta, tb = [], []
    for _ in range(3):
        ta.append(_time(ra, max(repeat // 3, 3), budget / 3))
        tb.append(_time(rb, max(repeat // 3, 3), budget / 3))
    with_views, without = float(np.median(ta)), float(np.median(tb))
    return {
        "case": case,
        "with_views_ms": with_views,
        "without_ms": without,
        "ratio": with_views / without,
        "kernels": f"{analysis.kernel_count(a.lowered)}/{analysis.kernel_count(b.lowered)}",
        "same_values": bool(same),
    }


def bench_gates(target, repeat: int, budget: float, size: str) -> list[dict]:
    from tvm_fusion.tools.bench import run_bench

    results = run_bench(
        ["lstm_cell", "gate_2890", "swiglu", "gru_cell", "geglu"],
        ["tvm-stock", "tvm-fusion", "onnxruntime"],
        size=size,
        target=target,
        repeat=repeat,
        budget_s=budget,
    )
    rows = []
    for res in results:
        e = res.engines
        rows.append(
            {
                "case": res.workload,
                "stock_ms": e["tvm-stock"].median_ms,
                "ours_ms": e["tvm-fusion"].median_ms,
                "ort_ms": e["onnxruntime"].median_ms if "onnxruntime" in e else None,
                "kernels": f"{e['tvm-stock'].kernels}/{e['tvm-fusion'].kernels}",
                "ours_vs_ort": res.ratio("tvm-fusion", "onnxruntime"),
                "stock_vs_ours": res.ratio("tvm-stock", "tvm-fusion"),
                "ok": all(r.ok is not False for r in e.values()),
            }
        )
    return rows


# Issue #5's three figures, each after same-budget tuning runs of ours and stock's.
TUNED = (
    ("lstm_cell", "lstm_cell x(1,1024)"),
    ("gate_2890", "gate_2890 x(64,1024)"),
    ("swiglu", "swiglu x(64,2048)"),
)


def bench_tuned(target, repeat: int, budget: float, size: str) -> list[dict]:
    """Issue #5's gate workloads after tuning runs of the same budget, ours and stock's:
    ``tune/<workload>_tvm_fusion`` and ``tune/<workload>_stock`` (``tvm-fusion tune <workload>
    --trials N --work-dir ... [--pipeline stock]``), with the untuned pipelines and ONNX
    Runtime beside them. A workload without both databases is left out; stock's untuned
    pipeline is timed with a few runs only (seconds per call on SwiGLU)."""
    rows = []
    for workload, label in TUNED:
        ours_db = Path(f"tune/{workload}_tvm_fusion")
        stock_db = Path(f"tune/{workload}_stock")
        if ours_db.is_dir() and stock_db.is_dir():
            rows.append(
                _tuned_row(target, workload, label, ours_db, stock_db, repeat, budget, size)
            )
    return rows


def _tuned_row(target, workload, label, ours_db, stock_db, repeat, budget, size) -> dict:
    from tvm_fusion import models
    from tvm_fusion.build import engine
    from tvm_fusion.build.tuning import trials_spent

    inst = models.build(workload, size)
    reference = inst.reference(*inst.input_list())
    row: dict = {"case": label if size == "seed" else f"{workload} ({size})"}
    row["trials (ours/stock)"] = None
    columns = ("stock", "stock_tuned", "ours", "ours_tuned", "onnxruntime")
    row.update(dict.fromkeys(columns))
    ratios = ("ours_tuned / ORT", "stock_tuned / ORT", "ours_tuned / stock_tuned")
    row.update(dict.fromkeys((*ratios, "ours_tuned / ORT, first calls")))
    runs = {}
    slow = {}
    for name, pipeline, db in (
        ("stock", "stock", None),
        ("stock_tuned", "stock", stock_db),
        ("ours", "tvm_fusion", None),
        ("ours_tuned", "tvm_fusion", ours_db),
    ):
        options = {"tuning_db": str(db)} if db is not None else {}
        compiled = engine.compile_module(inst.mod, target, pipeline, **options)
        runner = engine.TvmRunner(compiled, inst.input_list())
        start = time.perf_counter()
        outputs = runner.outputs()
        seconds = time.perf_counter() - start
        err = engine.max_error(outputs, reference)
        if err >= 1e-3:
            row[name] = f"wrong ({err:.2g})"
        elif seconds > 1.0:  # stock's untuned SwiGLU: seconds per call
            slow[name] = runner
        else:
            runs[name] = runner
    row["trials (ours/stock)"] = f"{trials_spent(ours_db)}/{trials_spent(stock_db)}"
    try:
        runs["onnxruntime"] = engine.onnxruntime_runner(
            inst.onnx_model, inst.inputs, engine.threads_for(target)
        )
    except ImportError:
        row["onnxruntime"] = None
    # all engines in alternating rounds: a slow phase of the machine falls on all of them
    times = engine.time_interleaved(runs, repeat=repeat, budget_s=budget, min_time_s=0.5)
    times.update(engine.time_interleaved(slow, repeat=3, budget_s=budget))
    row.update({name: t["median_ms"] for name, t in times.items()})
    ort = row.get("onnxruntime")
    for name in ("ours_tuned", "stock_tuned"):
        if isinstance(row.get(name), float) and isinstance(ort, float):
            row[f"{name} / ORT"] = row[name] / ort
    if isinstance(row.get("ours_tuned"), float) and isinstance(row.get("stock_tuned"), float):
        row["ours_tuned / stock_tuned"] = row["ours_tuned"] / row["stock_tuned"]
    # the first call after a pause (engine.time_interleaved: the medians are of warm calls)
    firsts = {
        name: times.get(name, {}).get("first_call_ms") for name in ("ours_tuned", "onnxruntime")
    }
    if all(isinstance(v, float) for v in firsts.values()):
        row["ours_tuned / ORT, first calls"] = firsts["ours_tuned"] / firsts["onnxruntime"]
    return row


def bench_shapes(target, repeat: int, budget: float, size: str) -> list[dict]:
    """The shape idioms (tvm_fusion.models.shape_idioms): per model, shape-only kernels and
    shape copies of the CUDA build (inspected here, no GPU needed), stock vs ours, and the llvm
    end-to-end time of stock, ours and ONNX Runtime."""
    import tvm

    from tvm_fusion import analysis, load_onnx
    from tvm_fusion.build import engine
    from tvm_fusion.models import shape_idioms

    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
    batch, seq = (8, 128) if size == "seed" else (2, 5)
    rows = []
    cases = [(name, shape_idioms.build(name, batch, seq)) for name in shape_idioms.names()]
    try:  # the Llama-style block as torch.onnx exports it (torch is optional)
        model = shape_idioms.llama_block()
        x = np.random.default_rng(0).standard_normal((batch, seq, 64)).astype("float32")
        cases.append(("llama_block", shape_idioms.Idiom("llama_block", "", model, {"x": x})))
    except ImportError:
        pass
    for name, idiom in cases:
        mod = load_onnx(idiom.model)
        row: dict = {"model": name}
        for pipeline, label in (("stock", "stock"), ("tvm_fusion", "ours")):
            try:
                work = analysis.shape_work(engine.compile_module(mod, cuda, pipeline).lowered, cuda)
                row[f"{label} cuda shape kernels/copies"] = f"{len(work.kernels)}/{work.copies}"
            except Exception:  # stock cannot compile several of these
                row[f"{label} cuda shape kernels/copies"] = "fails to compile"
        for pipeline, label in (("stock", "stock ms"), ("tvm_fusion", "ours ms")):
            try:
                compiled = engine.compile_module(mod, target, pipeline)
                run = engine.TvmRunner(compiled, list(idiom.inputs.values()))
                row[label] = _time(run, repeat, budget)
                row[label.replace("ms", "kernels")] = analysis.kernel_count(compiled.lowered)
            except Exception:
                row[label] = None
                row[label.replace("ms", "kernels")] = "fails"
        try:
            from tvm_fusion.build.engine import onnxruntime_runner

            row["onnxruntime ms"] = _time(
                onnxruntime_runner(idiom.model, idiom.inputs, _threads()), repeat, budget
            )
        except ImportError:
            row["onnxruntime ms"] = None
        rows.append(row)
    return rows


def _markdown(section: str, rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    lines = [f"### {section}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = []
        for k in keys:
            v = row.get(k)
            cells.append(f"{v:.3f}" if isinstance(v, float) else ("-" if v is None else str(v)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


SECTIONS = {
    "take": bench_take,
    "cross_entropy": bench_cross_entropy,
    "linear_ce": bench_linear_ce,
    "views": bench_views,
    "gates": bench_gates,
    "tuned": bench_tuned,
    "shapes": bench_shapes,
}


def _run_section(name: str, args) -> list[dict] | str:
    """One section in a child process: stock TVM 0.27's nll_loss gradient reads memory it
    never wrote, and a crash there must not take the other sections down."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "section.json"
        cmd = [
            sys.executable,
            __file__,
            "--section",
            name,
            "--size",
            args.size,
            "--repeat",
            str(args.repeat),
            "--budget",
            str(args.budget),
            "--output",
            str(out),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return f"section failed (exit {proc.returncode}): {tail[0]}"
        return json.loads(out.read_text())[name]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help=",".join(SECTIONS))
    parser.add_argument("--section", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size", default="seed", choices=["seed", "small"])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--budget", type=float, default=10.0)
    parser.add_argument("--output", default="bench/capabilities.json")
    args = parser.parse_args(argv)

    import tvm_fusion
    from tvm_fusion.tools.bench import machine_info

    target = tvm_fusion.host_target()
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.section:  # child: one section, in this process
        rows = SECTIONS[args.section](target, args.repeat, args.budget, args.size)
        out.write_text(json.dumps({args.section: rows}, indent=2) + "\n")
        return 0
    payload = {"machine": machine_info(target), "size": args.size}
    md = [f"# Capability benchmarks ({args.size})", ""]
    for name in args.only.split(","):
        if name not in SECTIONS:
            print(f"bench_capabilities: unknown section {name!r}", file=sys.stderr)
            return 2
        rows = _run_section(name, args)
        payload[name] = rows
        text = _markdown(name, rows) if isinstance(rows, list) else f"### {name}\n\n{rows}\n"
        md.append(text)
        print(text, flush=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    out.with_suffix(".md").write_text("\n".join(md))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
