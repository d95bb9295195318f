"""A dynamic-shape block whose reshape target is computed from the input's shape.

``dynamic_reshape`` (ONNX Runtime PR #19769): attention-style split of heads where the target
shape is computed as a tensor, as exporters write it: ``Shape -> Gather -> Mul -> Concat ->
Reshape``; in Relax ``shape_of -> shape_to_tensor -> take -> multiply -> concat ->
tensor_to_shape -> match_cast -> reshape``. Then ``softmax(x * scale)`` over the head dim and a
reshape back to the input's shape. x is (batch, seq, 768) with batch and seq symbolic.
"""

from __future__ import annotations

import numpy as np
from tvm import relax, tirx
from tvm.relax import op as R

from . import Instance, register
from ._build import const, onnx_input, onnx_model, randn, rng, tensor_var


@register("dynamic_reshape", "shape", "reshape to (B*S, 12, 64) via shape arithmetic on tensors")
def dynamic_reshape(size: str = "seed", dynamic: bool = True) -> Instance:
    b_val, s_val = (8, 128) if size == "seed" else (2, 5)
    heads, head_dim = (12, 64) if size == "seed" else (3, 4)
    hidden = heads * head_dim
    scale = float(head_dim) ** -0.5
    gen = rng(19769)
    x_np = randn(gen, b_val, s_val, hidden)

    # Always dynamic: the point of the workload is the shape arithmetic.
    b, s = tirx.Var("batch", "int64"), tirx.Var("seq", "int64")
    x = tensor_var("x", (b, s, hidden))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            shp = bb.emit(R.shape_to_tensor(bb.emit(R.shape_of(x))))
            b_t = bb.emit(R.take(shp, const(np.array([0], "int64")), axis=0))
            s_t = bb.emit(R.take(shp, const(np.array([1], "int64")), axis=0))
            bs = bb.emit(R.multiply(b_t, s_t))
            tail = const(np.array([heads, head_dim], "int64"))
            target = bb.emit(R.concat([bs, tail], axis=0))
            m = tirx.Var("m", "int64")
            new_shape = bb.emit(R.tensor_to_shape(target))
            new_shape = bb.match_cast(new_shape, relax.ShapeType([m, heads, head_dim]))
            xr = bb.emit(R.reshape(x, relax.ShapeExpr([m, heads, head_dim])))
            y = bb.emit(R.nn.softmax(bb.emit(R.multiply(xr, relax.const(scale, "float32")))))
            out = bb.emit_output(R.reshape(y, relax.ShapeExpr([b, s, hidden])))
        bb.emit_func_output(out)

    def reference(x):
        y = x.reshape(-1, heads, head_dim).astype("float64") * scale
        y = np.exp(y - y.max(axis=-1, keepdims=True))
        y = y / y.sum(axis=-1, keepdims=True)
        return [y.astype("float32").reshape(x.shape)]

    from onnx import helper

    model = onnx_model(
        [
            helper.make_node("Shape", ["x"], ["shp"]),
            helper.make_node("Gather", ["shp", "i0"], ["b"], axis=0),
            helper.make_node("Gather", ["shp", "i1"], ["s"], axis=0),
            helper.make_node("Mul", ["b", "s"], ["bs"]),
            helper.make_node("Concat", ["bs", "tail"], ["target"], axis=0),
            helper.make_node("Reshape", ["x", "target"], ["xr"]),
            helper.make_node("Mul", ["xr", "scale"], ["xs"]),
            helper.make_node("Softmax", ["xs"], ["y"], axis=-1),
            helper.make_node("Reshape", ["y", "shp"], ["out"]),
        ],
        [onnx_input("x", "float32", ["batch", "seq", hidden])],
        [onnx_input("out", "float32", ["batch", "seq", hidden])],
        {
            "i0": np.array([0], dtype="int64"),
            "i1": np.array([1], dtype="int64"),
            "tail": np.array([heads, head_dim], dtype="int64"),
            "scale": np.array(scale, dtype="float32"),
        },
    )

    def torch_fn(torch):
        def fn(x):
            y = torch.softmax(x.reshape(-1, heads, head_dim) * scale, dim=-1)
            return (y.reshape(x.shape),)

        return fn

    return Instance(
        "dynamic_reshape",
        bb.get(),
        {"x": x_np},
        reference,
        model,
        torch_fn,
        rtol=1e-5,
        atol=1e-6,
        expect="PlaceShapeOnHost: the shape chain becomes one symbolic shape (no kernels)",
    )
