"""XLNet's ``index_select(x, 3, arange(klen))`` (ONNX Runtime PR #13599).

``take_arange``: in XLNet's relative attention, ``bd = rel_shift(bd)`` ends with
``torch.index_select(bd, 3, torch.arange(klen))``; the score is then ``(ac + bd) * scale``.
Here bd is (16, 16, 128, 256) and klen = 128.
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax import op as R

from . import Instance, register
from ._build import dim, onnx_input, onnx_model, randn, rng, tensor_var


@register("take_arange", "gather_to_slice", "(ac + take(bd, arange(klen), axis=3)) * scale (XLNet)")
def take_arange(size: str = "seed", dynamic: bool = False) -> Instance:
    b_val, heads, qlen, width, klen = (
        (16, 16, 128, 256, 128) if size == "seed" else (2, 3, 8, 20, 8)
    )
    scale = 0.125
    gen = rng(13599)
    bd_np = randn(gen, b_val, heads, qlen, width)
    ac_np = randn(gen, b_val, heads, qlen, klen)

    b = dim("b", b_val, dynamic)
    bd = tensor_var("bd", (b, heads, qlen, width))
    ac = tensor_var("ac", (b, heads, qlen, klen))
    bb = relax.BlockBuilder()
    with bb.function("main", [bd, ac]):
        with bb.dataflow():
            idx = bb.emit(R.arange(0, klen, 1, "int64"))
            picked = bb.emit(R.take(bd, idx, axis=3))
            out = bb.emit_output(
                R.multiply(bb.emit(R.add(ac, picked)), relax.const(scale, "float32"))
            )
        bb.emit_func_output(out)

    def reference(bd, ac):
        return [(ac + np.take(bd, np.arange(klen), axis=3)) * np.float32(scale)]

    from onnx import helper

    model = onnx_model(
        [
            helper.make_node("Range", ["start", "limit", "delta"], ["idx"]),
            helper.make_node("Gather", ["bd", "idx"], ["picked"], axis=3),
            helper.make_node("Add", ["ac", "picked"], ["sum"]),
            helper.make_node("Mul", ["sum", "scale"], ["out"]),
        ],
        [
            onnx_input("bd", "float32", ["b", heads, qlen, width]),
            onnx_input("ac", "float32", ["b", heads, qlen, klen]),
        ],
        [onnx_input("out", "float32", ["b", heads, qlen, klen])],
        {
            "start": np.array(0, dtype="int64"),
            "limit": np.array(klen, dtype="int64"),
            "delta": np.array(1, dtype="int64"),
            "scale": np.array(scale, dtype="float32"),
        },
    )

    def torch_fn(torch):
        idx = torch.arange(klen)

        def fn(bd, ac):
            return ((ac + torch.index_select(bd, 3, idx)) * scale,)

        return fn

    return Instance(
        "take_arange",
        bb.get(),
        {"bd": bd_np, "ac": ac_np},
        reference,
        model,
        torch_fn,
        rtol=1e-5,
        atol=1e-5,
        expect="GatherToSlice: take(arange) -> strided_slice, fused with add and multiply",
    )


def xlnet_loss(bd_shape, ac_shape, scale: float = 0.125):
    """``sum(((ac + take(bd, arange(klen), axis=3)) * scale) ** 2)``: the workload as a scalar
    loss whose gradient depends on the inputs (for ``relax.transform.Gradient``)."""
    bd = relax.Var("bd", relax.TensorType(tuple(bd_shape), "float32"))
    ac = relax.Var("ac", relax.TensorType(tuple(ac_shape), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [bd, ac]):
        with bb.dataflow():
            idx = bb.emit(R.arange(0, ac_shape[-1], 1, "int64"))
            picked = bb.emit(R.take(bd, idx, axis=3))
            out = bb.emit(R.multiply(bb.emit(R.add(ac, picked)), relax.const(scale, "float32")))
            loss = bb.emit_output(R.sum(bb.emit(R.multiply(out, out))))
        bb.emit_func_output(loss)
    return bb.get()
