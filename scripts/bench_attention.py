"""Attention on the CPU: FuseAttention's fused kernel vs our unfused pipeline (FuseAttention
off) vs torch eager ``scaled_dot_product_attention``, causal and not.

The graph is the ONNX exporters' form built directly in Relax: ``permute_dims(K)``, ``matmul``,
``multiply`` by ``1/sqrt(D)``, for causal ``where(tril, scores, -inf)`` with a constant boolean
``tril``, ``softmax``, ``matmul(V)``. Engines alternate call by call (the machine is shared:
compare the ratios of one run, not absolute times across runs); medians of ``--reps`` calls.

    TVM_NUM_THREADS=2 PYTHONPATH=$PWD python scripts/bench_attention.py [--shapes 1,4,512,64 ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
import tvm
from tvm import relax
from tvm.relax import op as R

from tvm_fusion.transform import fuse_attention

SHAPES = ["1,4,512,64", "4,8,512,64", "8,4,63,64", "1,8,2048,64"]


def graph(b, h, s, d, causal):
    q, k, v = (relax.Var(n, relax.TensorType((b, h, s, d), "float32")) for n in "qkv")
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            kt = bb.emit(R.permute_dims(k, [0, 1, 3, 2]))
            s0 = bb.emit(R.matmul(q, kt))
            x = bb.emit(R.multiply(s0, relax.const(1 / np.sqrt(d), "float32")))
            if causal:
                tri = relax.const(np.tril(np.ones((s, s), bool)))
                x = bb.emit(R.where(tri, x, relax.const(float("-inf"), "float32")))
            p = bb.emit(R.nn.softmax(x, axis=-1))
            out = bb.emit_output(R.matmul(p, v))
        bb.emit_func_output(out)
    return bb.get()


def build(mod, fused):
    disabled = [] if fused else ["FuseAttention"]
    with tvm.transform.PassContext(opt_level=3, disabled_pass=disabled):
        ex = tvm.compile(
            mod, tvm.target.Target({"kind": "llvm", "mcpu": "znver3"}), relax_pipeline="tvm_fusion"
        )
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: the process's CPU time per call (with one thread, less sensitive to a loaded"
        " machine than wall time)",
    )
    args = ap.parse_args()
    fuse_attention.MIN_STATIC_SCORES = 0  # time the kernel at every size
    threads = int(os.environ.get("TVM_NUM_THREADS", "1"))
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    torch.set_num_threads(threads)
    print(f"threads {threads}, {args.clock} clock, load average {os.getloadavg()}")
    print("B,H,S,D      causal  fused ms  unfused ms  torch ms  fused/unfused  fused/torch")
    for shape in args.shapes:
        b, h, s, d = (int(x) for x in shape.split(","))
        for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]:
            rng = np.random.default_rng(0)
            qkv = [rng.standard_normal((b, h, s, d)).astype("float32") for _ in range(3)]
            mod = graph(b, h, s, d, causal)
            tv = [tvm.runtime.tensor(a) for a in qkv]
            tt = [torch.from_numpy(a) for a in qkv]
            fused, unfused = build(mod, True), build(mod, False)
            engines = {
                "fused": lambda f=fused, a=tv: f(*a),
                "unfused": lambda f=unfused, a=tv: f(*a),
                "torch": lambda a=tt, c=causal: F.scaled_dot_product_attention(*a, is_causal=c),
            }
            ref = engines["torch"]().numpy()
            for name in ("fused", "unfused"):
                got = engines[name]().numpy()
                np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-3, err_msg=name)
            times = {name: [] for name in engines}
            for _ in range(args.reps):
                for name, fn in engines.items():
                    t0 = clock()
                    fn()
                    times[name].append(clock() - t0)
            med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            print(
                f"{shape:12s} {causal!s:6s} {med['fused']:9.2f} {med['unfused']:11.2f}"
                f" {med['torch']:9.2f} {med['fused'] / med['unfused']:14.2f}"
                f" {med['fused'] / med['torch']:12.2f}"
            )
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
