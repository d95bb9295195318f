#!/usr/bin/env python3
"""WinogradConv per layer: the direct 3 x 3 convolution vs Winograd F(2,3) and F(4,3).

Each layer is ``relu(conv3x3(x, W, padding=1) + b)`` at batch 1 with seeded random weights,
compiled by the ``tvm_fusion`` pipeline three times: without the pass (``winograd_conv=False``:
the direct kernel), and with it forced to each tile size (its channel threshold off). The
outputs are checked against the direct build (relative error ``max|d| / max|direct|``), then the
three are timed in alternating rounds (:func:`tvm_fusion.build.engine.time_interleaved`,
medians) with TVM's thread count; GFLOP/s count the direct convolution's FLOPs
(``2 N K C 9 H W``) for all three; the load average is printed beside each row.

    TVM_NUM_THREADS=2 python scripts/bench_winograd.py
    TVM_NUM_THREADS=2 python scripts/bench_winograd.py --layers 128x128@28,512x512@7
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from tvm import relax

# ResNet-50's, VGG's and SqueezeNet's 3 x 3 convolutions: in x out channels @ size
LAYERS = (
    "64x64@56,128x128@28,256x256@14,512x512@7,64x64@224,256x256@56,512x512@14,"
    "64x256@13,48x192@13,16x64@55"
)


def layer(c: int, k: int, size: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, c, 3, 3)) * np.sqrt(2 / (9 * c))).astype("float32")
    b = (rng.standard_normal(k) * 0.1).astype("float32")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, c, size, size), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(w), padding=1))
            y = bb.emit(relax.op.add(y, relax.const(b.reshape(1, k, 1, 1))))
            gv = bb.emit_output(bb.emit(relax.op.nn.relu(y)))
        bb.emit_func_output(gv)
    return bb.get()


def main() -> None:
    from tvm_fusion.build import engine
    from tvm_fusion.target import host_target
    from tvm_fusion.transform import winograd_conv

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default=LAYERS)
    parser.add_argument("--budget", type=float, default=3.0, help="seconds of runs per variant")
    args = parser.parse_args()
    target = host_target()
    rng = np.random.default_rng(1)
    winograd_conv.MIN_IN_CHANNELS = winograd_conv.MIN_OUT_CHANNELS = winograd_conv.MIN_TILES = 0
    print("layer              direct GF/s  F(2,3) GF/s  F(4,3) GF/s  F2/direct  F4/direct  load")
    for spec in args.layers.split(","):
        channels, size = spec.split("@")
        c, k = (int(v) for v in channels.split("x"))
        size = int(size)
        x = rng.standard_normal((1, c, size, size)).astype("float32")
        runs, outs = {}, {}
        for label, sizes in (("direct", ()), ("F2", (2,)), ("F4", (4,))):
            winograd_conv.TILE_SIZES = sizes
            flags = {"winograd_conv": bool(sizes)}
            compiled = engine.compile_module(layer(c, k, size), target, "tvm_fusion", **flags)
            runs[label] = engine.TvmRunner(compiled, [x])
            outs[label] = runs[label].outputs()[0]
        for label in ("F2", "F4"):
            err = np.abs(outs[label] - outs["direct"]).max() / np.abs(outs["direct"]).max()
            if err > 1e-4:
                raise SystemExit(f"{spec} {label}: relative error {err:.2e} against direct")
        res = engine.time_interleaved(runs, repeat=50, budget_s=args.budget)
        flops = 2 * k * c * 9 * size * size
        gf = {name: flops / r["median_ms"] / 1e6 for name, r in res.items()}
        d = res["direct"]["median_ms"]
        print(
            f"{spec:18} {gf['direct']:11.0f}  {gf['F2']:11.0f}  {gf['F4']:11.0f}  "
            f"{res['F2']['median_ms'] / d:9.2f}  {res['F4']['median_ms'] / d:9.2f}  "
            f"{os.getloadavg()[0]:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
