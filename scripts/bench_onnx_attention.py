"""ONNX's opset-23 ``Attention`` on the CPU: our converter (the chain FuseAttention fuses) vs
the same node imported through ONNX's function body (``onnx_functions``, what every form the
converter does not take gets) vs ONNX Runtime, on one model per shape.

Engines alternate call by call with a pause between rounds; medians of ``--reps`` rounds.

    TVM_NUM_THREADS=2 PYTHONPATH=$PWD python scripts/bench_onnx_attention.py \
        [--shapes B,Hq,Hkv,S,D ...] [--causal yes|no] [--reps 15]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np
from onnx import TensorProto, helper

SHAPES = ["1,8,8,512,64", "1,8,2,512,64", "4,8,8,128,64"]


def model(b, hq, hkv, s, d, causal: bool):
    dims = {"q": [b, hq, s, d], "k": [b, hkv, s, d], "v": [b, hkv, s, d]}
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, dims[n]) for n in "qkv"]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, hq, s, d])
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=int(causal))
    graph = helper.make_graph([node], "attention", inputs, [out])
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    onnx_model.ir_version = 10  # opset 23's IR (ONNX Runtime 1.31 reads up to 13)
    return onnx_model


def compiled(onnx_model, native: bool):
    from tvm_fusion import host_target, load_onnx
    from tvm_fusion.build import engine
    from tvm_fusion.frontend import onnx_functions

    saved = onnx_functions._converted_natively
    if not native:
        onnx_functions._converted_natively = lambda node, types, opset: False
    try:
        return engine.compile_module(load_onnx(onnx_model), host_target(), "tvm_fusion")
    finally:
        onnx_functions._converted_natively = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    ap.add_argument("--causal", choices=["yes", "no"], default="yes")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    try:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
        assert all(len(s) == 5 and min(s) > 0 and s[1] % s[2] == 0 for s in shapes)
    except (ValueError, AssertionError):
        ap.error("--shapes: B,Hq,Hkv,S,D with Hq a multiple of Hkv")
    from tvm_fusion.build import engine

    threads = int(os.environ.get("TVM_NUM_THREADS", "0") or 0) or os.cpu_count()
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, threads {threads}")
    print("| B,Hq,Hkv,S,D | ours ms | via body ms | ORT ms | ours / body | ours / ORT | err |")
    print("|---|---|---|---|---|---|---|")
    for shape in shapes:
        b, hq, hkv, s, d = shape
        m = model(*shape, args.causal == "yes")
        rng = np.random.default_rng(0)
        feeds = {
            "q": rng.standard_normal((b, hq, s, d), np.float32),
            "k": rng.standard_normal((b, hkv, s, d), np.float32),
            "v": rng.standard_normal((b, hkv, s, d), np.float32),
        }
        session = engine.onnxruntime_session(m, threads)
        want = session.run(None, feeds)[0]
        runners = {
            "ours": engine.TvmRunner(compiled(m, True), list(feeds.values())),
            "body": engine.TvmRunner(compiled(m, False), list(feeds.values())),
        }
        calls = dict(runners)
        calls["ort"] = lambda session=session, feeds=feeds: session.run(None, feeds)
        err = max(float(np.abs(r.outputs()[0] - want).max()) for r in runners.values())
        times = {name: [] for name in calls}
        for _ in range(args.reps):
            for name, call in calls.items():
                call()
                start = time.perf_counter()
                call()
                times[name].append((time.perf_counter() - start) * 1e3)
                time.sleep(0.05)
        med = {name: statistics.median(t) for name, t in times.items()}
        print(
            f"| {','.join(map(str, shape))} | {med['ours']:.3f} | {med['body']:.3f} | "
            f"{med['ort']:.3f} | {med['ours'] / med['body']:.2f} | {med['ours'] / med['ort']:.2f}"
            f" | {err:.1e} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
