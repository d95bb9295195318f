#!/usr/bin/env python3
"""The nine model-zoo CNNs of the ``onnx`` package: ours vs ONNX Runtime vs stock TVM.

The models are ``onnx/backend/test/data/light/light_*.onnx`` (AlexNet, DenseNet-121, Inception
v1/v2, ResNet-50, ShuffleNet, SqueezeNet, VGG-19, ZFNet-512; inputs 1x3x224x224). Per model:

- the input is the one ONNX's backend test feeds these models (``arange(n) / n``), and ONNX
  Runtime's output is first checked against the ``_output_0.pb`` saved beside the model;
- the light models carry no weights (each is ``ConstantOfShape(0.02)``, every output a uniform
  0.001): they get random ones (:func:`randomized`, seeded), so that the checks below can fail;
- ours (``load_onnx`` + the ``tvm_fusion`` pipeline) and stock TVM (its importer and pipeline)
  are compiled for the host (``--mcpu``: for that CPU): compile seconds, kernels, and the kernels
  that only the fallback rule scheduled (:func:`tvm_fusion.tools.analysis.fallback_kernels`);
- outputs against ONNX Runtime's: relative error ``max|ours - ort| / max|ort|`` <= 1e-3, at batch 1
  and, where the model allows it (ONNX Runtime runs it with the batch axis set to 3: no
  reshape fixed to batch 1), at batch 3 (ours compiled again for that shape, numbers only);
- batch-1 run times of the three engines timed together in alternating rounds, with pauses
  (:func:`tvm_fusion.build.engine.time_interleaved`); ONNX Runtime with TVM's thread count.

    python scripts/bench_cnn.py                      # all nine -> bench/cnn.json, bench/cnn.md
    python scripts/bench_cnn.py --models resnet50,shufflenet --output /tmp/cnn.json
    python scripts/tune.py .../light_squeezenet.onnx --trials 500 --work-dir tune/squeezenet
    python scripts/bench_cnn.py --models squeezenet --tuned tune     # + the tuned build
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

MODELS = (
    "bvlc_alexnet",
    "densenet121",
    "inception_v1",
    "inception_v2",
    "resnet50",
    "shufflenet",
    "squeezenet",
    "vgg19",
    "zfnet512",
)
MAX_REL_ERR = 1e-3


def light_dir() -> Path:
    import onnx

    return Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def dummy_input(model, batch: int) -> tuple[str, np.ndarray]:
    """ONNX's backend-test input for a light model (``arange(n) / n``), batch ``batch``."""
    inits = {t.name for t in model.graph.initializer}
    (value,) = [i for i in model.graph.input if i.name not in inits]
    dims = [d.dim_value or 1 for d in value.type.tensor_type.shape.dim]
    dims[0] = batch
    n = int(np.prod(dims))
    return value.name, (np.arange(n).reshape(dims) / n).astype(np.float32)


def randomized(model, seed: int = 0):
    """``model`` with random weights. The light models are stripped of theirs: every weight is
    ``ConstantOfShape(0.02)``, and every output is a uniform 0.001, which any engine that runs
    at all matches. Each such node becomes an initializer: a Conv/Gemm weight He-initialised
    (``N(0, 2 / fan_in)``), a BatchNormalization scale or variance in U(0.5, 1.5) (positive),
    anything else (biases, means) N(0, 0.1). A final Softmax's input (the logits) becomes a
    second output: the softmax of these weights is near one-hot, which hides small errors."""
    import onnx
    from onnx import numpy_helper

    rng = np.random.default_rng(seed)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    role = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            if node.op_type in ("Conv", "Gemm") and i == 1:
                trans_b = any(a.name == "transB" and a.i for a in node.attribute)
                role[name] = ("weight", node.op_type, trans_b)
            elif node.op_type == "BatchNormalization" and i in (1, 4):
                role[name] = ("positive",)
    keep = []
    for node in graph.node:
        if node.op_type != "ConstantOfShape" or node.input[0] not in consts:
            keep.append(node)
            continue
        shape = [int(d) for d in consts[node.input[0]]]
        kind = role.get(node.output[0], ("other",))
        if kind[0] == "weight":
            fan_in = shape[1] if kind[1] == "Gemm" and kind[2] else int(np.prod(shape[1:]))
            if kind[1] == "Gemm" and not kind[2]:
                fan_in = shape[0]
            value = rng.standard_normal(shape) * np.sqrt(2.0 / max(fan_in, 1))
        elif kind[0] == "positive":
            value = rng.uniform(0.5, 1.5, shape)
        else:
            value = rng.standard_normal(shape) * 0.1
        graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), node.output[0]))
        if copy.ir_version < 4:  # initializers must be graph inputs then
            graph.input.append(
                onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, shape)
            )
    del graph.node[:]
    graph.node.extend(keep)
    producer = {out: node for node in graph.node for out in node.output}
    last = producer.get(graph.output[0].name)
    if last is not None and last.op_type == "Softmax":  # the logits too: softmax saturates
        logits = onnx.ValueInfoProto()
        logits.CopyFrom(graph.output[0])  # a softmax keeps its input's shape
        logits.name = last.input[0]
        graph.output.append(logits)
    return copy


def with_batch(model, batch: int):
    """A copy of ``model`` whose input's batch axis is ``batch`` (outputs' shapes cleared)."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    inits = {t.name for t in copy.graph.initializer}
    for value in copy.graph.input:
        if value.name not in inits:
            value.type.tensor_type.shape.dim[0].dim_value = batch
    for value in copy.graph.output:
        for i, dim in enumerate(value.type.tensor_type.shape.dim):
            dim.dim_param = f"out_{i}"
    del copy.graph.value_info[:]
    return copy


def rel_err(outputs, reference) -> float:
    worst = 0.0
    for out, ref in zip(outputs, reference, strict=True):
        out, ref = np.asarray(out, "float64"), np.asarray(ref, "float64")
        if out.shape != ref.shape:
            return float("inf")
        err = float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))
        worst = max(worst, err if np.isfinite(err) else float("inf"))  # NaN: a failure
    return worst


def _compile(mod, target, pipeline: str, **flags):
    from tvm_fusion.build import engine
    from tvm_fusion.tools import analysis

    compiled = engine.compile_module(mod, target, pipeline, **flags)
    info = {
        "compile_s": round(compiled.compile_s, 2),
        "kernels": analysis.kernel_count(compiled.lowered),
        "fallback": analysis.fallback_kernels(compiled.lowered),
    }
    return compiled, info


def bench_model(name: str, target, args) -> dict:
    import onnx
    from onnx import numpy_helper

    from tvm_fusion import load_onnx
    from tvm_fusion.build import engine
    from tvm_fusion.errors import first_line
    from tvm_fusion.frontend.onnx_ops import stock_from_onnx

    path = light_dir() / f"light_{name}.onnx"
    stripped = onnx.load(str(path))
    threads = engine.threads_for(target)
    row: dict = {"model": name}
    in_name, x = dummy_input(stripped, 1)
    saved = numpy_helper.to_array(onnx.load_tensor(str(path).replace(".onnx", "_output_0.pb")))
    ort0 = engine.onnxruntime_runner(stripped, {in_name: x}, threads)  # the saved output's
    row["ort_vs_saved_rel_err"] = rel_err([np.asarray(ort0()[0])], [saved])
    model = randomized(stripped)
    ort1 = engine.onnxruntime_runner(model, {in_name: x}, threads)
    ref = [np.asarray(o) for o in ort1()]
    row["ort_outputs"] = [{"std": float(np.std(r)), "max": float(np.abs(r).max())} for r in ref]
    runs = {}
    engines = [("tvm-fusion", "tvm_fusion"), ("tvm-stock", "stock")][: 2 if args.stock else 1]
    if args.without:
        engines.append((f"tvm-fusion-no-{args.without}", "tvm_fusion"))
    tuned_db = Path(args.tuned) / name if args.tuned else None
    if tuned_db is not None and tuned_db.is_dir():
        engines.append(("tvm-fusion-tuned", "tvm_fusion"))
    for engine_name, pipeline in engines:
        start = time.perf_counter()
        flags = {args.without: False} if engine_name.startswith("tvm-fusion-no-") else {}
        if engine_name == "tvm-fusion-tuned":
            flags = {"tuning_db": str(tuned_db)}
        try:
            mod = load_onnx(model) if pipeline == "tvm_fusion" else stock_from_onnx(model)
            compiled, info = _compile(mod, target, pipeline, **flags)
            runner = engine.TvmRunner(compiled, [x])
            info["rel_err"] = rel_err(runner.outputs(), ref)
            info["ok"] = info["rel_err"] <= MAX_REL_ERR
            runs[engine_name] = runner
        except Exception as err:  # noqa: BLE001 - the row says which engine failed and why
            info = {"failed": first_line(err)}
        info["import_and_compile_s"] = round(time.perf_counter() - start, 2)
        row[engine_name] = info
        print(f"{name}: {engine_name} {info}", flush=True)
    runs["onnxruntime"] = ort1
    if args.batch3:
        row["batch3"] = batch3(model, target, threads)
        print(f"{name}: batch 3 {row['batch3']}", flush=True)
    timings = engine.time_interleaved(
        runs, repeat=args.repeat, budget_s=args.budget, min_time_s=args.min_time
    )
    row["times"] = {k: {kk: round(vv, 3) for kk, vv in v.items() if vv} for k, v in timings.items()}
    med = {k: v["median_ms"] for k, v in timings.items()}
    if "tvm-fusion" in med:
        row["ours/ort"] = round(med["tvm-fusion"] / med["onnxruntime"], 3)
        if "tvm-stock" in med:
            row["ours/stock"] = round(med["tvm-fusion"] / med["tvm-stock"], 3)
        if "tvm-fusion-tuned" in med:
            row["tuned/ort"] = round(med["tvm-fusion-tuned"] / med["onnxruntime"], 3)
            row["tuned/ours"] = round(med["tvm-fusion-tuned"] / med["tvm-fusion"], 3)
        without = f"tvm-fusion-no-{args.without}"
        if without in med:
            row[f"ours/no-{args.without}"] = round(med["tvm-fusion"] / med[without], 3)
            row[f"no-{args.without}/ort"] = round(med[without] / med["onnxruntime"], 3)
    print(f"{name}: {row['times']}", flush=True)
    return row


def batch3(model, target, threads) -> dict:
    """Ours at batch 3 against ONNX Runtime at batch 3; skipped where ORT refuses the batch."""
    from tvm_fusion import load_onnx
    from tvm_fusion.build import engine
    from tvm_fusion.errors import first_line

    model3 = with_batch(model, 3)
    in_name, x = dummy_input(model, 3)
    try:
        ref = [np.asarray(o) for o in engine.onnxruntime_runner(model3, {in_name: x}, threads)()]
    except Exception as err:  # noqa: BLE001 - a reshape fixed to batch 1
        return {"skipped": f"ONNX Runtime refuses batch 3: {first_line(err)[:160]}"}
    if ref[0].shape[0] != 3:
        return {"skipped": f"the output at batch 3 has shape {list(ref[0].shape)}"}
    try:
        compiled, info = _compile(load_onnx(model3), target, "tvm_fusion")
        info["rel_err"] = rel_err(engine.TvmRunner(compiled, [x]).outputs(), ref)
        info["ok"] = info["rel_err"] <= MAX_REL_ERR
    except Exception as err:  # noqa: BLE001
        info = {"failed": first_line(err)}
    return info


def _ms(row, engine_name) -> str:
    t = row["times"].get(engine_name)
    return f"{t['median_ms']:.1f}" if t else "-"


def markdown(rows, machine, args) -> str:
    lines = [
        f"# The nine light model-zoo CNNs: ours vs ONNX Runtime vs stock TVM "
        f"({machine['processor']}, {machine['threads']} threads, {machine['date']})",
        "",
        f"`{' '.join(sys.argv)}`; target `{machine['target']}`. Input: ONNX's backend-test "
        "input (`arange(n) / n`, 1x3x224x224); the models' stripped weights (all 0.02) "
        "replaced by seeded random ones (`randomized`), so that outputs differ per class. "
        "Median ms of batch-1 runs, the three engines timed in alternating rounds with pauses; "
        "ONNX Runtime with TVM's thread count. "
        f"rel err: max |ours - ORT| / max |ORT| (<= {MAX_REL_ERR}). Fallback: kernels only the "
        "fallback rule scheduled.",
        "",
        f"Machine load while it ran: {args.note or 'not noted'}; load average (1/5/15 min) "
        f"{machine['load_before']} at the start, {machine['load_after']} at the end.",
        "",
        "| model | ours ms | ORT ms | stock ms | ours/ORT | ours/stock | kernels ours/stock "
        "| fallback | compile s ours/stock | rel err b1 | rel err b3 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for row in rows:
        ours, stock, b3 = row["tvm-fusion"], row.get("tvm-stock", {}), row.get("batch3", {})
        if "ours/ort" in row:
            ratios.append(row["ours/ort"])
        if "rel_err" in b3:
            b3_cell = f"{b3['rel_err']:.1e}"
        else:
            b3_cell = "skip" if "skipped" in b3 or not b3 else "fail"
        lines.append(
            f"| {row['model']} | {_ms(row, 'tvm-fusion')} | {_ms(row, 'onnxruntime')} | "
            f"{_ms(row, 'tvm-stock')} | {row.get('ours/ort', '-')} | {row.get('ours/stock', '-')}"
            f" | {ours.get('kernels', '-')}/{stock.get('kernels', '-')} | "
            f"{len(ours.get('fallback', [])) if 'kernels' in ours else '-'} | "
            f"{ours.get('compile_s', '-')}/{stock.get('compile_s', '-')} | "
            f"{ours['rel_err']:.1e} | {b3_cell} |"
            if "rel_err" in ours
            else f"| {row['model']} | fail: {ours.get('failed')} |"
        )
    if ratios:
        geo = float(np.exp(np.mean(np.log(ratios))))
        lines += ["", f"Geomean ours/ORT over {len(ratios)} models: {geo:.2f}x."]
    notes = [
        f"- {row['model']}: fallback kernels {row['tvm-fusion']['fallback']}"
        for row in rows
        if row["tvm-fusion"].get("fallback")
    ]
    notes += [
        f"- {row['model']}: batch 3 {row['batch3'].get('skipped') or row['batch3'].get('failed')}"
        for row in rows
        if "rel_err" not in row.get("batch3", {"rel_err": 0})
    ]
    notes += [
        f"- {row['model']}: stock failed: {row['tvm-stock']['failed']}"
        for row in rows
        if "failed" in row.get("tvm-stock", {})
    ]
    notes += [
        f"- {row['model']}: tuned ({args.tuned}/{row['model']}) {_ms(row, 'tvm-fusion-tuned')} "
        f"ms, {row['tuned/ort']}x ORT, {row['tuned/ours']}x untuned; rel err "
        f"{row['tvm-fusion-tuned'].get('rel_err', float('nan')):.1e}"
        for row in rows
        if "tuned/ort" in row
    ]
    notes += [
        f"- {row['model']}: ORT vs the saved output: rel err {row['ort_vs_saved_rel_err']:.1e}"
        for row in rows
    ]
    return "\n".join(lines + ["", "Notes:", *notes]) + "\n"


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated, e.g. resnet50,vgg19")
    parser.add_argument("--mcpu", default=None, help="build for this CPU, e.g. znver3")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--budget", type=float, default=5.0, help="timed seconds per engine")
    parser.add_argument("--min-time", type=float, default=0.0)
    parser.add_argument("--no-batch3", dest="batch3", action="store_false")
    parser.add_argument(
        "--no-stock", dest="stock", action="store_false", help="ours and ORT only (stock is slow)"
    )
    parser.add_argument(
        "--without",
        default=None,
        metavar="FLAG",
        help="also time ours with the pipeline flag FLAG off (an A/B of one pass, e.g. "
        "winograd_conv), in the same alternating rounds",
    )
    parser.add_argument(
        "--tuned",
        default=None,
        metavar="DIR",
        help="also time ours with the tuning database DIR/<model> where there is one (made by "
        "scripts/tune.py <model.onnx> --work-dir DIR/<model>), in the same alternating rounds",
    )
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument("--output", default="bench/cnn.json", help="'' to print only")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    from tvm_fusion.errors import UsageError
    from tvm_fusion.target import host_target
    from tvm_fusion.tools.bench import bench_target, machine_info

    names = [m.strip() for m in args.models.split(",")] if args.models else list(MODELS)
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        print(f"error: unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
        return 2
    try:
        target = bench_target(host_target(), args.mcpu)
    except UsageError as err:
        print(f"error: {err}")
        return 2
    import os

    load_before = [round(v, 2) for v in os.getloadavg()]
    rows = [bench_model(name, target, args) for name in names]
    machine = machine_info(target)
    machine["load_before"] = load_before
    machine["load_after"] = [round(v, 2) for v in os.getloadavg()]
    text = markdown(rows, machine, args)
    if args.output:  # --output '': the table printed only (make demo)
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"machine": machine, "command": " ".join(sys.argv), "note": args.note}
        out.write_text(json.dumps({**payload, "rows": rows}, indent=2) + "\n")
        out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
