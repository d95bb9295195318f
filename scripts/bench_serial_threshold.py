#!/usr/bin/env python3
"""How SerialSmallKernels' thresholds were chosen (issue #37): corpus models compiled with the
pass off and at several (elementwise, dense) thresholds, timed in one process, variants
alternating call block by call block, medians; each over the pass off.

    python scripts/bench_serial_threshold.py                       # the corpus inputs (3 x 7)
    python scripts/bench_serial_threshold.py --tile 3,9            # inputs tiled to 9 x 63
    python scripts/bench_serial_threshold.py --thresholds 4096:131072,4096:524288

``--tile a,b`` repeats every input a times along axis 0 and b times along axis 1 (batch and
sequence of the corpus exports). Quiet machine only: the variants share the process's pool.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2_dynamo,lstm_dynamo,bert_mlm_dynamo")
    parser.add_argument("--thresholds", default="4096:4096,4096:131072,4096:524288")
    parser.add_argument("--tile", default="1,1", help="repeats along axes 0 and 1")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=20, help="calls per block")
    args = parser.parse_args()

    import numpy as np
    import tvm
    from tvm import relax

    import tvm_fusion
    from tvm_fusion.build.pipeline import build_pipeline
    from tvm_fusion.schedule import serial_small_kernels as ssk

    target = tvm_fusion.host_target()
    reps = [int(r) for r in args.tile.split(",")]
    variants = ["off", *args.thresholds.split(",")]
    print(f"target {target}, threads {tvm_fusion.pool.threads()}, tile {reps}")
    for name in args.models.split(","):
        saved = dict(np.load(ROOT / "tests" / "corpus" / f"{name}.npz"))
        inputs = [
            np.ascontiguousarray(np.tile(v, reps + [1] * (v.ndim - 2)))
            for k, v in saved.items()
            if k.startswith("in:")
        ]
        feeds = [tvm.runtime.tensor(a) for a in inputs]
        runs = {}
        for variant in variants:
            if variant != "off":
                ssk.SERIAL_BELOW, ssk.SERIAL_BELOW_DENSE = (int(v) for v in variant.split(":"))
            mod = tvm_fusion.load_onnx(ROOT / "tests" / "corpus" / f"{name}.onnx")
            pipeline = build_pipeline(target, serial_small_kernels=variant != "off")
            exe = tvm.compile(mod, target=target, relax_pipeline=pipeline)
            runs[variant] = relax.VirtualMachine(exe, tvm.cpu())["main"]
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for variant, run in runs.items():
                run(*feeds)
                start = time.perf_counter()
                for _ in range(args.calls):
                    run(*feeds)
                times[variant].append((time.perf_counter() - start) / args.calls * 1e3)
            time.sleep(0.01)
        base = statistics.median(times["off"])
        print(name, [a.shape for a in inputs])
        for variant in variants:
            med = statistics.median(times[variant])
            print(f"  {variant:>14}: {med:.4f} ms  x{med / base:.3f}")


if __name__ == "__main__":
    main()
