#!/usr/bin/env python3
"""The distinct convolution layers of the light model-zoo CNNs, one at a time: ours vs ONNX Runtime.

Each distinct ``Conv`` of the chosen models (input shape, weight shape, strides, pads, group;
found by ONNX shape inference on ``onnx/backend/test/data/light/light_<model>.onnx``) becomes a
one-layer model ``Relu(Conv(x, W, b))`` at batch 1 with seeded random weights. Per layer: ours
(``load_onnx`` + the ``tvm_fusion`` pipeline, compiled for the host) is checked against ONNX
Runtime (relative error ``max|ours - ort| / max|ort|`` <= 1e-4), then both are timed in
alternating rounds (:func:`tvm_fusion.build.engine.time_interleaved`, medians) with TVM's thread
count; the load average is printed beside each row. ``lost ms`` is (ours - ORT) x the number of
times the layer occurs in the models, to rank the layers by what they cost a whole model.

    python scripts/bench_conv_layers.py --models vgg19,resnet50
    python scripts/bench_conv_layers.py --models resnet50 --only 3x3 --output /tmp/layers.json
    python scripts/bench_conv_layers.py --heads   # 1-8 output channels: HEADS, not the models
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


# narrow-output heads (segmentation masks, depth, RGB images): (x, w, strides, pads, group, dil)
HEADS = (
    [
        ((1, 64, 128, 128), (o, 64, 3, 3), (s, s), (1, 1, 1, 1), 1, (1, 1))
        for o in (1, 2, 3, 4, 8)
        for s in (1, 2)
    ]
    + [((2, 64, 30, 30), (o, 64, 3, 3), (1, 1), (1, 1, 1, 1), 1, (1, 1)) for o in (1, 3, 8)]
    + [((1, 32, 97, 97), (o, 32, 5, 5), (1, 1), (2, 2, 2, 2), 1, (1, 1)) for o in (1, 3)]
    + [((1, 64, 128, 128), (1, 64, 1, 1), (1, 1), (0, 0, 0, 0), 1, (1, 1))]
)


def conv_layers(name: str) -> list[tuple]:
    """(x shape, w shape, strides, pads, group, dilations) of each Conv node of a light model."""
    import onnx
    from bench_cnn import light_dir, randomized
    from onnx import numpy_helper

    model = randomized(onnx.load(str(light_dir() / f"light_{name}.onnx")))
    model = onnx.shape_inference.infer_shapes(model)
    shapes = {}
    for v in [*model.graph.input, *model.graph.value_info, *model.graph.output]:
        shapes[v.name] = tuple(d.dim_value or 1 for d in v.type.tensor_type.shape.dim)
    for t in model.graph.initializer:
        shapes[t.name] = tuple(numpy_helper.to_array(t).shape)
    layers = []
    for node in model.graph.node:
        if node.op_type != "Conv":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        w = shapes[node.input[1]]
        k = len(w) - 2
        strides = tuple(attrs.get("strides", [1] * k))
        pads = tuple(attrs.get("pads", [0] * 2 * k))
        dil = tuple(attrs.get("dilations", [1] * k))
        layers.append((shapes[node.input[0]], w, strides, pads, int(attrs.get("group", 1)), dil))
    return layers


def layer_model(x_shape, w_shape, strides, pads, group, dil, seed: int = 0):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    fan_in = int(np.prod(w_shape[1:]))
    w = (rng.standard_normal(w_shape) * np.sqrt(2 / fan_in)).astype(np.float32)
    b = (rng.standard_normal(w_shape[0]) * 0.1).astype(np.float32)
    conv = helper.make_node(
        "Conv",
        ["x", "w", "b"],
        ["c"],
        strides=list(strides),
        pads=list(pads),
        group=group,
        dilations=list(dil),
    )
    relu = helper.make_node("Relu", ["c"], ["y"])
    graph = helper.make_graph(
        [conv, relu],
        "conv_layer",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def describe(layer) -> str:
    x, w, s, p, g, _d = layer
    kh = "x".join(str(v) for v in w[2:])
    text = f"{kh} {x[1]}->{w[0]} on {x[2]}x{x[3]}"
    if x[0] > 1:
        text += f" b{x[0]}"
    if max(s) > 1:
        text += f" s{s[0]}"
    if g > 1:
        text += f" g{g}"
    return text + f" p{p[0]}"


def bench_layer(layer, count: int, target, args) -> dict:
    from bench_cnn import rel_err

    from tvm_fusion import load_onnx
    from tvm_fusion.build import engine
    from tvm_fusion.tools import analysis

    model = layer_model(*layer)
    x = np.random.default_rng(1).standard_normal(layer[0]).astype(np.float32)
    threads = engine.threads_for(target)
    ort = engine.onnxruntime_runner(model, {"x": x}, threads)
    compiled = engine.compile_module(load_onnx(model), target, "tvm_fusion")
    ours = engine.TvmRunner(compiled, [x])
    err = rel_err(ours.outputs(), [np.asarray(o) for o in ort()])
    rules = sorted({i.rule or "pre-scheduled" for i in analysis.schedule_info(compiled.lowered)})
    timings = engine.time_interleaved(
        {"ours": ours, "ort": ort}, repeat=args.repeat, budget_s=args.budget, min_time_s=0.5
    )
    a, b = timings["ours"]["median_ms"], timings["ort"]["median_ms"]
    x_, w = layer[0], layer[1]
    out_hw = [
        (x_[2 + i] + layer[3][i] + layer[3][i + 2] - w[2 + i]) // layer[2][i] + 1 for i in range(2)
    ]
    gflop = 2 * w[0] * int(np.prod(w[1:])) * out_hw[0] * out_hw[1] / 1e9
    return {
        "layer": describe(layer),
        "count": count,
        "gflop": round(gflop, 3),
        "ours_ms": round(a, 3),
        "ort_ms": round(b, 3),
        "ours/ort": round(a / b, 3),
        "lost_ms": round((a - b) * count, 2),
        "rel_err": float(f"{err:.2g}"),
        "rules": rules,
        "load": [round(v, 2) for v in os.getloadavg()],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vgg19,resnet50,inception_v2")
    parser.add_argument("--only", default=None, help="keep layers whose name has this, e.g. 3x3")
    parser.add_argument("--max-gflop", type=float, default=None, help="skip larger layers")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--budget", type=float, default=2.0, help="timed seconds per engine")
    parser.add_argument("--mcpu", default=None)
    parser.add_argument("--output", default=None, help="a JSON file for the rows")
    parser.add_argument("--heads", action="store_true", help="the HEADS layers, not the models'")
    args = parser.parse_args(argv)
    from tvm_fusion.target import host_target
    from tvm_fusion.tools.bench import bench_target

    target = bench_target(host_target(), args.mcpu)
    counts: Counter = Counter(HEADS if args.heads else [])
    for name in [] if args.heads else args.models.split(","):
        counts.update(conv_layers(name.strip()))
    rows = []
    for layer, count in counts.items():
        if args.only and args.only not in describe(layer):
            continue
        x, w = layer[0], layer[1]
        if args.max_gflop is not None:
            if 2 * w[0] * np.prod(w[1:]) * x[2] * x[3] / np.prod(layer[2]) / 1e9 > args.max_gflop:
                continue
        row = bench_layer(layer, count, target, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows.sort(key=lambda r: -r["lost_ms"])
    print("\n| layer | n | GFLOP | ours ms | ORT ms | ours/ORT | lost ms | load |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['layer']} | {r['count']} | {r['gflop']} | {r['ours_ms']} | {r['ort_ms']} "
            f"| {r['ours/ort']} | {r['lost_ms']} | {r['load'][0]} |"
        )
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
