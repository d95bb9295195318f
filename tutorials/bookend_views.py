"""Bookend views: reshapes on the edge of a fused group stay outside it, as zero-copy views.

nvFuser (upstreamed as pytorch PR #88457): a gelu whose input and output are reshaped, or an
attention head merge ``reshape -> permute -> reshape -> reshape``, should be ONE kernel whose
edges are metadata-only views. After FuseOps, ``StripBookendViews`` peels reshape / squeeze /
expand_dims / flatten off the entry and exit of each fused function into ``R.reshape`` in the
caller (which the VM runs without a copy); interior views and transposes (not views) stay.

Run it::

    .venv/bin/python tutorials/bookend_views.py            # BERT's shapes
    .venv/bin/python tutorials/bookend_views.py --size small
"""

import argparse

import numpy as np
from tvm import relax

import tvm_fusion
from tvm_fusion import analysis, models
from tvm_fusion.build import engine


def plain(shape, make):
    x = relax.Var("x", relax.TensorType(tuple(shape), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(make(x))
        bb.emit_func_output(out)
    return bb.get()


def main(size: str = "seed", repeat: int = 5) -> dict:
    target = tvm_fusion.host_target()
    gelu = models.build("gelu_views", size)
    mha = models.build("mha_transpose", size)
    x_mha = mha.input_list()[0]
    heads = 12 if size == "seed" else 3
    shape4 = (x_mha.shape[0] // heads, heads, *x_mha.shape[1:])

    cases = [
        # (name, module with views, the same work without views, inputs of each)
        (
            "gelu",
            gelu.mod,
            plain(gelu.input_list()[0].shape, relax.op.nn.gelu),
            gelu.input_list(),
            gelu.input_list(),
        ),
        (
            "mha_transpose",
            mha.mod,
            plain(shape4, lambda x: relax.op.permute_dims(x, [0, 2, 1, 3])),
            [x_mha],
            [x_mha.reshape(shape4)],
        ),
    ]
    results = {}
    for name, with_views, without, inputs, plain_inputs in cases:
        # Where the views went: in the caller, as R.reshape around one kernel.
        lowered = analysis.grouped(with_views, target, ours=True)
        print(lowered["main"])
        report = analysis.fusion_report(with_views, target, name=name)
        print(report.to_text())

        a = engine.compile_module(with_views, target, "tvm_fusion")
        b = engine.compile_module(without, target, "tvm_fusion")
        ra, rb = engine.TvmRunner(a, inputs), engine.TvmRunner(b, plain_inputs)
        out_a, out_b = ra.outputs()[0], rb.outputs()[0]
        assert np.allclose(out_a.reshape(-1), out_b.reshape(-1), rtol=1e-5, atol=1e-6)
        t_a = engine.time_runs(ra, repeat=repeat)["median_ms"]
        t_b = engine.time_runs(rb, repeat=repeat)["median_ms"]
        results[name] = {
            "kernels_stock": report.stock_kernels,
            "kernels_ours": report.ours_kernels,
            "with_views_ms": t_a,
            "without_views_ms": t_b,
        }
        print(
            f"{name} ({size}): kernels stock {report.stock_kernels}, ours "
            f"{report.ours_kernels}; with views {t_a:.3f} ms, without {t_b:.3f} ms "
            f"({t_a / t_b:.2f}x)\n"
        )
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="seed", choices=models.SIZES)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    main(args.size, args.repeat)
