#!/usr/bin/env python3
"""What fp32 GEMM throughput this CPU attains, and where issue #25's 2-layer LSTM stands on it.

Times, engines alternating in rounds (``engine.time_interleaved``), medians:

- the FMA peak: a kernel of register-only vector FMAs (independent accumulators of one vector
  each per thread, as many as the target's vector registers hold beside the two operands: 16 with
  32 registers, 12 with AVX2's 16; no memory traffic in its loop), one loop per thread;
- a square GEMM (``--square``, default 2048): ``torch.mm``, ``numpy.matmul`` (its BLAS) and our
  Matmul rule (a Relax ``matmul`` with a constant weight through the ``tvm_fusion`` pipeline);
- the LSTM's GEMMs (hidden 512, seq 64, batch 8): the input projection of all steps
  ``(seq * batch, 512) @ (512, 4 * 512)`` (torch, ours) and one step's recurrent GEMM
  ``(batch, 512) @ (512, 4 * 512)`` (torch; times 64 steps);
- ``nn.LSTM(512, 512, num_layers=2)`` at (64, 8, 512) in torch eager;
- the gated MLP's GEMM of ``scripts/bench_frontend_forms.py`` (gate and up side by side),
  ``(256, 512) @ (512, 2 * 1376)``: torch, ours.

Prints GFLOP/s per row (2 flops per multiply-add) and writes them to ``--output`` as JSON.
With ``--gemms MxKxN,...`` it times instead the FMA peak and each GEMM (a constant B, as a
model's weight): ours against ONNX Runtime's ``MatMul`` (its MLAS) and the FMA peak kernel in
the same rounds, each GEMM's fraction of that peak (issue #37's figure: AVX2 GEMMs at 85%).

    python scripts/bench_roofline.py --repeat 10 --output /tmp/roofline.json
    python scripts/bench_roofline.py --gemms 64x768x768,64x768x3072 --output /tmp/gemms.json
    python scripts/bench_roofline.py --mcpu znver3   # AVX2 code (and AVX2 peak) on this host
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

HIDDEN, SEQ, BATCH, LAYERS, GATES = 512, 64, 8, 2, 4
MLP = (256, 512, 2 * 1376)  # bench_frontend_forms' x (4, 64, 512), gate and up 1376 each
PEAK_ITERS = 1 << 20


def _fma_peak(threads: int, target):
    """A runner of ``threads`` loops of PEAK_ITERS x ``acc`` vector FMAs on registers, and its
    flops (the vector is the target's: 16 float32 lanes with AVX-512). ``acc`` leaves 4 of the
    target's vector registers free: 16 accumulators on AVX2's 16 registers spilled every
    iteration (89.6 GFLOP/s on Zen 3, under the 132 of a GEMM)."""
    import numpy as np
    import tvm
    from tvm.script import tirx as T

    from tvm_fusion.target import vector_lanes, vector_registers

    lanes = vector_lanes(target, "float32")
    acc_n = max(4, min(16, vector_registers(target) - 4))

    @T.prim_func(s_tir=True)
    def peak(
        x: T.Buffer((threads, 16, lanes), "float32"), y: T.Buffer((threads, 16, lanes), "float32")
    ):
        T.func_attr({"global_symbol": "peak", "tirx.noalias": True})
        for t in T.parallel(threads):
            acc = T.decl_buffer((acc_n, lanes), "float32", scope="local")
            for a, v in T.grid(acc_n, lanes):
                acc[a, v] = x[t, a, v]
            for _ in range(PEAK_ITERS):
                for a in T.unroll(acc_n):
                    for v in T.vectorized(lanes):
                        acc[a, v] = acc[a, v] * x[t, 0, 0] + x[t, 1, 1]
            for a, v in T.grid(acc_n, lanes):
                y[t, a, v] = acc[a, v]

    lib = tvm.compile(tvm.IRModule({"peak": peak}), target)
    x = tvm.runtime.tensor(np.full((threads, 16, lanes), 0.5, "float32"))
    y = tvm.runtime.tensor(np.zeros((threads, 16, lanes), "float32"))
    run = lib["peak"]
    return (lambda: run(x, y)), 2.0 * threads * PEAK_ITERS * acc_n * lanes


def _ours_matmul(m: int, k: int, n: int, target):
    import numpy as np
    from tvm import relax

    from tvm_fusion.build import engine

    rng = np.random.default_rng(0)
    w = rng.standard_normal((k, n)).astype("float32")
    x = rng.standard_normal((m, k)).astype("float32")
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType([m, k], "float32"))
    with bb.function("main", [xv]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(xv, relax.const(w)))
        bb.emit_func_output(out)
    compiled = engine.compile_module(bb.get(), target, "tvm_fusion")
    runner = engine.TvmRunner(compiled, [x])
    error = float(np.abs(runner.outputs()[0] - x @ w).max())
    return runner, error


def _ort_matmul(m: int, k: int, n: int, threads: int):
    """ONNX Runtime's MatMul of an (m, k) input by a constant (k, n) weight."""
    import numpy as np

    from tvm_fusion.build import engine
    from tvm_fusion.tools.bench import matmul_onnx

    rng = np.random.default_rng(0)  # the same operands as _ours_matmul's
    w = rng.standard_normal((k, n)).astype("float32")
    x = rng.standard_normal((m, k)).astype("float32")
    return engine.onnxruntime_runner(matmul_onnx(w, m), {"x": x}, threads)


def _gemm_shapes(spec: str) -> list[tuple[int, int, int]]:
    """``--gemms``'s shapes; ValueError where one is not MxKxN."""
    shapes = [tuple(int(d) for d in one.lower().split("x")) for one in spec.split(",")]
    if any(len(s) != 3 or min(s) < 1 for s in shapes):
        raise ValueError(spec)
    return shapes


def _gemm_rows(shapes: list, target, threads: int, record, peak) -> None:
    """The ``--gemms`` rows: per shape, ours, ONNX Runtime and the FMA peak kernel timed in the
    same alternating rounds (on a shared VM the peak itself moves, 100-190 GFLOP/s on 2 Zen 3
    vCPUs within minutes), each GEMM's fraction of that peak printed."""
    run_peak, peak_flops = peak
    for m, k, n in shapes:
        ours, err = _ours_matmul(m, k, n, target)
        flops = 2.0 * m * k * n
        runners = {"ours": ours, "onnxruntime": _ort_matmul(m, k, n, threads)}
        rows = record(f"GEMM {m}x{k}x{n}", {**runners, "FMA peak": run_peak}, flops)
        (peak_row,) = [r for r in rows if r["engine"] == "FMA peak"]
        peak_row["gflops"] = peak_flops / (peak_row["median_ms"] * 1e6)
        for row in rows:
            row["ours_max_err"] = err
            row["peak_fraction"] = row["gflops"] / peak_row["gflops"]
            if row is not peak_row:
                print(f"  {row['case']} {row['engine']}: {100 * row['peak_fraction']:.1f}% of peak")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--square", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--budget", type=float, default=3.0)
    parser.add_argument("--output", default="bench/roofline.json")
    parser.add_argument(
        "--gemms", default=None, help="MxKxN,...: only the FMA peak and these GEMMs, ours vs ORT"
    )
    parser.add_argument(
        "--mcpu", default=None, help="build for this CPU (LLVM's name, e.g. znver3, x86-64-v3)"
    )
    args = parser.parse_args(argv)
    try:
        shapes = _gemm_shapes(args.gemms) if args.gemms else []
    except ValueError:
        print(f"bench_roofline: error: --gemms {args.gemms!r}: not MxKxN,...", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print("bench_roofline: error: needs torch (pip install -e '.[test]')", file=sys.stderr)
        return 2
    import numpy as np

    import tvm_fusion
    from tvm_fusion.build import engine
    from tvm_fusion.tools.bench import bench_target

    warnings.simplefilter("ignore")
    try:
        target = bench_target(tvm_fusion.host_target(), args.mcpu)
    except tvm_fusion.UsageError as err:
        print(f"bench_roofline: error: {err}", file=sys.stderr)
        return 2
    threads = tvm_fusion.pool.threads()
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    rows = []

    def record(group: str, runners: dict, flops: float, note: dict | None = None) -> list:
        times = engine.time_interleaved(runners, repeat=args.repeat, budget_s=args.budget)
        added = []
        for name, t in times.items():
            row = {
                "case": group,
                "engine": name,
                "median_ms": t["median_ms"],
                "gflops": flops / (t["median_ms"] * 1e6),
                "load_avg": os.getloadavg()[0],
                **(note or {}),
            }
            rows.append(row)
            added.append(row)
            print(json.dumps(row), flush=True)
        return added

    peak, flops = _fma_peak(threads, target)
    if shapes:
        _gemm_rows(shapes, target, threads, record, (peak, flops))
        return _write(args, argv, target, threads, rows, None)
    record(f"FMA peak, {threads} threads", {"registers only": peak}, flops)

    n = args.square
    a = rng.standard_normal((n, n)).astype("float32")
    b = rng.standard_normal((n, n)).astype("float32")
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    ours, err = _ours_matmul(n, n, n, target)
    record(
        f"square GEMM {n}^3",
        {"torch.mm": lambda: torch.mm(ta, tb), "numpy": lambda: a @ b, "ours": ours},
        2.0 * n**3,
        {"ours_max_err": err},
    )

    m, k, w = SEQ * BATCH, HIDDEN, GATES * HIDDEN
    x = rng.standard_normal((m, k)).astype("float32")
    wt = rng.standard_normal((k, w)).astype("float32")
    tx, tw = torch.from_numpy(x), torch.from_numpy(wt)
    ours, err = _ours_matmul(m, k, w, target)
    record(
        f"LSTM input projection ({m}, {k}) @ ({k}, {w})",
        {"torch.mm": lambda: torch.mm(tx, tw), "ours": ours},
        2.0 * m * k * w,
        {"ours_max_err": err},
    )

    h = torch.from_numpy(rng.standard_normal((BATCH, HIDDEN)).astype("float32"))

    def steps():
        for _ in range(SEQ):
            torch.mm(h, tw)

    record(
        f"LSTM recurrent GEMMs, {SEQ} x ({BATCH}, {k}) @ ({k}, {w})",
        {"torch.mm x64": steps},
        2.0 * SEQ * BATCH * k * w,
    )

    torch.manual_seed(0)
    lstm = torch.nn.LSTM(HIDDEN, HIDDEN, num_layers=LAYERS).eval()
    xs = torch.randn(SEQ, BATCH, HIDDEN)

    def eager():
        with torch.inference_mode():
            return lstm(xs)

    total = LAYERS * 2.0 * (SEQ * BATCH * k * w + SEQ * BATCH * HIDDEN * w)
    record(f"nn.LSTM {HIDDEN}x{LAYERS} seq{SEQ} b{BATCH}", {"torch": eager}, total)

    m, k, w = MLP
    x = rng.standard_normal((m, k)).astype("float32")
    wt = rng.standard_normal((k, w)).astype("float32")
    tx, tw = torch.from_numpy(x), torch.from_numpy(wt)
    ours, err = _ours_matmul(m, k, w, target)
    record(
        f"gated MLP GEMM ({m}, {k}) @ ({k}, {w})",
        {"torch.mm": lambda: torch.mm(tx, tw), "ours": ours},
        2.0 * m * k * w,
        {"ours_max_err": err},
    )

    return _write(args, argv, target, threads, rows, total / 1e9)


def _write(args, argv, target, threads: int, rows: list, lstm_gflop) -> int:
    from tvm_fusion.tools.bench import machine_info

    result = {"machine": machine_info(target), "threads": threads, "rows": rows}
    result["command"] = " ".join(["python", "scripts/bench_roofline.py", *(argv or sys.argv[1:])])
    if lstm_gflop is not None:
        result["lstm_gflop"] = lstm_gflop
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
