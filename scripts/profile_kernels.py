#!/usr/bin/env python3
"""Where a compiled model's time goes, kernel by kernel, inside the model: ours beside ONNX
Runtime's own per-node profile.

apache-tvm 0.27's Python VM has no ``profile=``; its ``set_instrument`` hook is called before
and after every call instruction, so each kernel is timed between the two (``perf_counter``)
in the model's own order, with the caches as the model leaves them (the weights of the layers
before evicted, as in a real inference), not one layer alone in a loop. The hook itself costs
a Python call per kernel: the ``model`` line (no hook, the model timed whole) says how much
the kernels' sum leaves out. ONNX Runtime's per-node times come from its profiler
(``SessionOptions.enable_profiling``), the same model, the same input and threads.

Per kernel: the median of ``--runs`` inferences; the table groups kernels by name (digits
stripped: ``fused_conv2d6_add6_add7_relu_prepacked`` and its siblings) with their count.

    python scripts/profile_kernels.py resnet50               # a light model-zoo CNN
    python scripts/profile_kernels.py path/to/model.onnx --runs 30 --top 25
    python scripts/profile_kernels.py squeezenet --kernels --ort-nodes  # one by one, both
    python scripts/profile_kernels.py squeezenet --kernels --tuning-db tune/squeezenet
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def load_model(spec: str):
    import onnx

    from tvm_fusion.errors import ModelError, UsageError

    path = Path(spec)
    if path.suffix == ".onnx" and path.exists():
        try:
            return onnx.load(str(path))
        except Exception as err:  # noqa: BLE001 - protobuf's DecodeError and kin: one line
            raise ModelError(f"{path} is not an ONNX model: {err}") from None
    from bench_cnn import light_dir, randomized

    light = light_dir() / f"light_{spec}.onnx"
    if not light.exists():
        raise UsageError(f"profile_kernels: no model {spec!r} (an .onnx path or a light model)")
    return randomized(onnx.load(str(light)))


def group_of(name: str) -> str:
    """A kernel's family: its name without the numbers TVM appends to tell siblings apart."""
    return re.sub(r"\d+", "", name)


def kernel_shapes(mod) -> dict[str, str]:
    """{kernel: its arguments' shapes at its first launch} for the --kernels listing."""
    from tvm_fusion.tools import analysis

    out: dict[str, str] = {}
    for kernel in analysis.kernels(mod):
        out.setdefault(kernel.name, " ".join(kernel.shapes))
    return out


def profile_ours(compiled, inputs, runs: int) -> tuple[dict, list[float]]:
    """{kernel: [ms per run]} in call order, and the whole model's ms per run (no hook)."""
    import tvm

    from tvm_fusion.build import engine

    runner = engine.TvmRunner(compiled, inputs)
    for _ in range(3):
        runner()
    whole = []
    for _ in range(runs):
        t0 = time.perf_counter()
        runner()
        whole.append((time.perf_counter() - t0) * 1e3)
    names = {
        gv.name_hint
        for gv, f in compiled.lowered.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc)
    }
    per_run: dict[str, float] = defaultdict(float)
    started = {}

    def instrument(func, symbol, before, ret, *args):
        if symbol not in names:
            return 0
        now = time.perf_counter()
        if before:
            started[symbol] = now
        else:
            per_run[symbol] += (now - started.pop(symbol)) * 1e3
        return 0

    runner.vm.set_instrument(instrument)
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(runs):
        per_run.clear()
        runner()
        for name, ms in per_run.items():
            times[name].append(ms)
    return times, whole


def profile_ort(model, feed: dict, threads: int, runs: int, by_node: bool = False):
    """{node op type (``by_node``: op, node name, input shapes): [ms per run]} from ONNX
    Runtime's profiler, and its ms per run."""
    from tvm_fusion.build import engine

    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "ort")
        session = engine.onnxruntime_session(
            model, threads, enable_profiling=True, profile_file_prefix=prefix
        )
        for _ in range(3):
            session.run(None, feed)
        whole = []
        for _ in range(runs):
            t0 = time.perf_counter()
            session.run(None, feed)
            whole.append((time.perf_counter() - t0) * 1e3)
        events = json.loads(Path(session.end_profiling()).read_text())
    per_run: list[dict] = []
    for event in events:
        if event.get("cat") == "Session" and event.get("name") == "model_run":
            per_run.append(defaultdict(float))
        elif event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and per_run:
            info = event.get("args", {})
            op = info.get("op_name", "?")
            if by_node:
                shapes = [list(s.values())[0] for s in info.get("input_type_shape", [])[:2]]
                op = f"{op} {event['name'][: -len('_kernel_time')]} {shapes}"
            per_run[-1][op] += event["dur"] / 1e3
    # the profiler's run events close after their nodes: the runs are assigned in order
    times: dict[str, list[float]] = defaultdict(list)
    for run in per_run[-runs:]:
        for op, ms in run.items():
            times[op].append(ms)
    return times, whole


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a light model-zoo name (resnet50) or an .onnx path")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--top", type=int, default=20, help="kernel families listed")
    parser.add_argument("--mcpu", default=None)
    parser.add_argument("--no-ort", dest="ort", action="store_false")
    parser.add_argument("--ort-nodes", action="store_true", help="ONNX Runtime node by node")
    parser.add_argument("--kernels", action="store_true", help="ours kernel by kernel")
    parser.add_argument(
        "--tuning-db", default=None, metavar="DIR", help="ours with this tuning database"
    )
    args = parser.parse_args(argv)

    from bench_cnn import dummy_input

    from tvm_fusion import load_onnx
    from tvm_fusion.build import engine
    from tvm_fusion.errors import TvmFusionError
    from tvm_fusion.target import host_target

    try:
        model = load_model(args.model)
        name, x = dummy_input(model, 1)
        target = host_target(mcpu=args.mcpu)
        options = {"tuning_db": args.tuning_db} if args.tuning_db else {}
        compiled = engine.compile_module(load_onnx(model), target, "tvm_fusion", **options)
    except (TvmFusionError, OSError, ValueError) as err:
        print(f"profile_kernels: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    threads = engine.threads_for(target)
    times, whole = profile_ours(compiled, [x], args.runs)
    families: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for kernel, ms in times.items():
        families[group_of(kernel)][0] += 1
        families[group_of(kernel)][1] += statistics.median(ms)
    total = sum(f[1] for f in families.values())
    print(f"target {target}, {threads} threads, median of {args.runs} runs")
    print(
        f"ours: model {statistics.median(whole):.2f} ms, kernels' sum {total:.2f} ms, "
        f"{len(times)} kernels"
    )
    if args.kernels:  # in call order: each kernel's ms summed over its calls in a run
        shapes = kernel_shapes(compiled.lowered)
        for kernel, ms in times.items():
            print(f"{statistics.median(ms):8.3f}  {kernel}  {shapes.get(kernel, '')}")
    print(f"{'ms':>8} {'share':>6} {'n':>3}  kernel family")
    for fam, (n, ms) in sorted(families.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"{ms:8.3f} {ms / total:6.1%} {n:3d}  {fam}")
    if args.ort:
        ort_times, ort_whole = profile_ort(model, {name: x}, threads, args.runs, args.ort_nodes)
        ort_total = sum(statistics.median(v) for v in ort_times.values())
        print(
            f"\nONNX Runtime: model {statistics.median(ort_whole):.2f} ms, "
            f"nodes' sum {ort_total:.2f} ms"
        )
        ranked = sorted(ort_times.items(), key=lambda kv: -statistics.median(kv[1]))
        for op, ms in ranked[: args.top] if args.ort_nodes else ranked:
            print(f"{statistics.median(ms):8.3f}  {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
