"""Gather to slice: XLNet's ``index_select(x, 3, arange(klen))``, forward and backward.

ONNX Runtime PR #13599: XLNet's relative attention ends with
``torch.index_select(bd, 3, torch.arange(klen))``, exported as Range -> Gather. A gather is
opaque to fusion and its gradient must scatter-add (indices may repeat); a slice fuses with its
neighbours and its gradient is a plain slice-scatter. ``GatherToSlice`` proves the indices are an
arithmetic progression inside the axis and rewrites ``take`` into ``strided_slice`` -- and, when
the graph was differentiated first, ``take_backward`` into ``slice_scatter``.

Run it::

    .venv/bin/python tutorials/gather_to_slice.py            # XLNet's shapes
    .venv/bin/python tutorials/gather_to_slice.py --size small
"""

import argparse

import numpy as np
from tvm import relax

import tvm_fusion
from tvm_fusion import analysis, models
from tvm_fusion.build import engine
from tvm_fusion.models.take_arange import xlnet_loss
from tvm_fusion.transform import GatherToSlice


def main(size: str = "seed", repeat: int = 5) -> dict:
    target = tvm_fusion.host_target()

    # 1. Forward: the embedded workload (ac + take(bd, arange(klen), 3)) * scale.
    inst = models.build("take_arange", size)
    print(GatherToSlice()(inst.mod)["main"])  # the take is now a strided_slice
    print(analysis.fusion_report(inst.mod, target, name="take_arange").to_text())

    # 2. Backward: differentiate first, as a training script would. Stock TVM keeps
    #    take_backward (a serial scatter-add); tvm_fusion makes it a slice_scatter.
    bd, ac = inst.input_list()
    grad_mod = relax.transform.Gradient("main")(xlnet_loss(bd.shape, ac.shape))

    results = {}
    for phase, mod, fn in (("forward", inst.mod, "main"), ("fwd+bwd", grad_mod, "main_adjoint")):
        row = {}
        outputs = {}
        for pipeline in ("stock", "tvm_fusion"):
            compiled = engine.compile_module(mod, target, pipeline)
            runner = engine.TvmRunner(compiled, [bd, ac], fn)
            outputs[pipeline] = runner.outputs()
            timing = engine.time_runs(runner, repeat=repeat)
            row[pipeline] = {
                "kernels": analysis.kernel_count(compiled.lowered),
                "median_ms": timing["median_ms"],
            }
        err = engine.max_error(outputs["tvm_fusion"], outputs["stock"])
        scale = max(float(np.abs(o).max()) for o in outputs["stock"])
        assert err <= 1e-4 * max(scale, 1.0), f"{phase}: max difference {err}"
        results[phase] = row
        s, o = row["stock"], row["tvm_fusion"]
        print(
            f"{phase} ({size}): kernels {s['kernels']} -> {o['kernels']}, "
            f"median {s['median_ms']:.3f} ms -> {o['median_ms']:.3f} ms "
            f"({s['median_ms'] / o['median_ms']:.1f}x)"
        )
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="seed", choices=models.SIZES)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    main(args.size, args.repeat)
