"""Shapes on the host: shape arithmetic that exporters write on int64 tensors becomes symbolic.

ONNX Runtime PR #19769: every node reachable backwards from a shape input (Reshape's target,
Range's limit, Slice's ends, ConstantOfShape's shape...) should run on the CPU. In TVM the
ONNX importer folds the simplest chains; what stays an int64 tensor becomes device kernels and,
before every use, a copy to the host with a synchronisation. ``PlaceShapeOnHost`` evaluates such
chains symbolically (``R.shape([batch * seq, 32])``), so the VM computes them from the shapes it
already holds: no kernel, no copy. A shape tensor that is a graph input is read once, on the host.
A shape value computed from data (``x[:, :mask.sum(-1).max()]``, the padding trim) exists only
at run time: it is read once, the small ops before the read run on the host in a CUDA build
(one copy of the per-row lengths), and everything after it is symbolic.

This tutorial imports the exporter idioms of ``tvm_fusion.models.shape_idioms`` (GPT-2's head
merge, ``x.view(-1, x.size(-1))``, Range over the sequence length, a ConstantOfShape causal mask,
chunk as Slice with computed ends, the padding trim), shows the IR before and after the pass,
counts what the CUDA build spends on shapes (inspected here, no GPU needed) and times the llvm
build.

Run it::

    .venv/bin/python tutorials/shape_on_host.py                # batch 8, seq 128
    .venv/bin/python tutorials/shape_on_host.py --size small
"""

import argparse

import numpy as np
import tvm

import tvm_fusion
from tvm_fusion import analysis, load_onnx
from tvm_fusion.build import engine
from tvm_fusion.models import shape_idioms
from tvm_fusion.transform import PlaceShapeOnHost

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
SHOWN = ("merge_heads", "flatten_tokens", "position_ids", "causal_mask", "chunk_slice", "mask_trim")


def main(size: str = "seed", repeat: int = 5) -> dict:
    target = tvm_fusion.host_target()
    batch, seq = (8, 128) if size == "seed" else (2, 5)
    results = {}
    for name in SHOWN:
        idiom = shape_idioms.build(name, batch, seq)
        mod = load_onnx(idiom.model)  # what the importer makes of the exporter's graph
        if name == SHOWN[0]:
            print("--- merge_heads as imported: the head merge computed on int64 tensors")
            print(mod["main"].script(show_meta=False))
            with target:
                print("--- after PlaceShapeOnHost: one symbolic shape")
                print(PlaceShapeOnHost()(mod)["main"].script(show_meta=False))
        row = {}
        for pipeline in ("stock", "tvm_fusion"):
            try:
                work = analysis.shape_work(engine.compile_module(mod, CUDA, pipeline).lowered, CUDA)
                row[f"{pipeline}_cuda"] = work.as_dict()
            except Exception as err:  # stock TVM cannot compile several of these
                reason = str(err).strip().splitlines()[-1].split(": ", 1)[-1]  # after "... in X: "
                row[f"{pipeline}_cuda"] = f"fails: {reason[:80]}"
        compiled = engine.compile_module(mod, target, "tvm_fusion")
        run = engine.TvmRunner(compiled, list(idiom.inputs.values()))
        try:
            import onnxruntime as ort

            ref = ort.InferenceSession(
                idiom.model.SerializeToString(), providers=["CPUExecutionProvider"]
            ).run(None, idiom.inputs)
            for got, want in zip(run.outputs(), ref, strict=True):
                assert np.allclose(got, want, rtol=1e-5, atol=1e-5), name
            row["matches_onnxruntime"] = True
        except ImportError:
            row["matches_onnxruntime"] = None
        row["ours_ms"] = engine.time_runs(run, repeat=repeat)["median_ms"]
        results[name] = row
        print(f"{name} ({idiom.summary}):")
        print(
            f"  CUDA build, shape-only kernels/copies: stock {row['stock_cuda']}, "
            f"ours {row['tvm_fusion_cuda']}; llvm {row['ours_ms']:.3f} ms\n"
        )
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="seed", choices=("seed", "small"))
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    main(args.size, args.repeat)
