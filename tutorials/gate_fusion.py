"""Gate fusion: an LSTM cell and a SwiGLU MLP, stock TVM vs tvm_fusion.

TVM issue #2890: ``matmul -> split -> sigmoid/tanh/...`` is the heart of every LSTM/GRU cell
and of the gated MLPs of recent transformers (SwiGLU, GeGLU). Stock Relax runs the GEMM as one
kernel, writes its ``(N, k*D)`` output to memory, and reads it back in the gate kernel(s).
``FuseSplitGates`` makes it one kernel whose weight is laid out in vector blocks
``(D/V, K, k, V)``: one register tile holds every gate of ``V`` units, and the gate math runs on
the tile. The GEMM output never exists in memory.

Run it::

    .venv/bin/python tutorials/gate_fusion.py            # the seeds' shapes (slow for stock)
    .venv/bin/python tutorials/gate_fusion.py --size small
"""

import argparse

import tvm_fusion  # noqa: F401 - registers the "tvm_fusion" pipeline
from tvm_fusion import analysis, models
from tvm_fusion.build import engine
from tvm_fusion.target import host_target


def main(size: str = "seed", repeat: int = 5) -> dict:
    target = host_target()  # llvm with this machine's mcpu and core count
    results = {}
    for name in ("lstm_cell", "swiglu"):
        inst = models.build(name, size)

        # 1. What the pipelines make of it: stock groups the GEMM and the gates apart.
        report = analysis.fusion_report(inst.mod, target, name=name)
        print(report.to_text())

        # 2. Compile both, check against the NumPy reference, and time them side by side.
        row = {}
        for pipeline in ("stock", "tvm_fusion"):
            compiled = engine.compile_module(inst.mod, target, pipeline)
            runner = engine.TvmRunner(compiled, inst.input_list())
            err = engine.max_error(runner.outputs(), inst.reference(*inst.input_list()))
            assert err < 1e-3, f"{name} {pipeline}: max error {err}"
            timing = engine.time_runs(runner, repeat=repeat, budget_s=20.0)
            row[pipeline] = {
                "kernels": analysis.kernel_count(compiled.lowered),
                "median_ms": timing["median_ms"],
                "max_error": err,
            }
        results[name] = row
        stock, ours = row["stock"], row["tvm_fusion"]
        print(
            f"{name} ({size}): kernels {stock['kernels']} -> {ours['kernels']}, "
            f"median {stock['median_ms']:.3f} ms -> {ours['median_ms']:.3f} ms "
            f"({stock['median_ms'] / ours['median_ms']:.1f}x)\n"
        )
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="seed", choices=models.SIZES)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    main(args.size, args.repeat)
