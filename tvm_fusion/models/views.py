"""Workloads with bookend views (nvFuser, pytorch PR #88457).

- ``gelu_views``: BERT's FFN activation, (8192, 3072) -> reshape (64, 128, 3072) -> gelu ->
  reshape (8192, 3072);
- ``mha_transpose``: the attention head merge, (768, 128, 64) -> reshape (64, 12, 128, 64) ->
  permute (0, 2, 1, 3) -> reshape (64, 128, 768) -> reshape (8192, 768).
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax import op as R

from . import Instance, register
from ._build import dim, gelu_np, onnx_input, onnx_model, randn, rng, tensor_var


@register("gelu_views", "views", "reshape -> gelu -> reshape on BERT's FFN activation")
def gelu_views(size: str = "seed", dynamic: bool = False) -> Instance:
    batch_val, seq, hidden = (64, 128, 3072) if size == "seed" else (2, 8, 48)
    gen = rng(88457)
    x_np = randn(gen, batch_val * seq, hidden)

    # A symbolic dim must be definable from a parameter's shape: the dynamic variant takes
    # (batch, seq, hidden) and views it as (batch * seq, hidden) around the gelu instead.
    batch = dim("batch", batch_val, dynamic)
    outer, inner = ((batch, seq, hidden), (batch * seq, hidden))
    if not dynamic:
        outer, inner = inner, outer
    else:
        x_np = x_np.reshape(batch_val, seq, hidden)
    x = tensor_var("x", outer)
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            x3 = bb.emit(R.reshape(x, inner))
            g = bb.emit(R.nn.gelu(x3))
            out = bb.emit_output(R.reshape(g, outer))
        bb.emit_func_output(out)

    def reference(x):
        return [gelu_np(x)]

    from onnx import helper

    model = onnx_model(
        [
            helper.make_node("Reshape", ["x", "s3"], ["x3"]),
            helper.make_node("Gelu", ["x3"], ["g"]),
            helper.make_node("Reshape", ["g", "s2"], ["out"]),
        ],
        [onnx_input("x", "float32", ["bs", hidden])],
        [onnx_input("out", "float32", ["bs", hidden])],
        {
            "s3": np.array([-1, seq, hidden], dtype="int64"),
            "s2": np.array([-1, hidden], dtype="int64"),
        },
        opset=20,
    )

    def torch_fn(torch):
        def fn(x):
            return (torch.nn.functional.gelu(x.view(-1, seq, hidden)).view(-1, hidden),)

        return fn

    return Instance(
        "gelu_views",
        bb.get(),
        {"x": x_np},
        reference,
        model,
        torch_fn,
        rtol=1e-4,
        atol=1e-5,
        expect="StripBookendViews: reshapes become views, gelu is one kernel",
    )


@register("mha_transpose", "views", "reshape -> permute(0,2,1,3) -> reshape -> reshape (MHA)")
def mha_transpose(size: str = "seed", dynamic: bool = False) -> Instance:
    batch_val, heads, seq, head_dim = (64, 12, 128, 64) if size == "seed" else (2, 3, 8, 4)
    gen = rng(8845)
    x_np = randn(gen, batch_val * heads, seq, head_dim)

    batch = dim("batch", batch_val, dynamic)
    if dynamic:  # (batch, heads * seq * head_dim): a shape that defines batch
        x_np = x_np.reshape(batch_val, heads * seq * head_dim)
        x = tensor_var("x", (batch, heads * seq * head_dim))
    else:
        x = tensor_var("x", (batch * heads, seq, head_dim))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            x4 = bb.emit(R.reshape(x, (batch, heads, seq, head_dim)))
            t = bb.emit(R.permute_dims(x4, [0, 2, 1, 3]))
            m = bb.emit(R.reshape(t, (batch, seq, heads * head_dim)))
            out = bb.emit_output(R.reshape(m, (batch * seq, heads * head_dim)))
        bb.emit_func_output(out)

    def reference(x):
        b = x.size // (heads * seq * head_dim)
        t = x.reshape(b, heads, seq, head_dim).transpose(0, 2, 1, 3)
        return [np.ascontiguousarray(t).reshape(b * seq, heads * head_dim)]

    from onnx import helper

    model = onnx_model(
        [
            helper.make_node("Reshape", ["x", "s4"], ["x4"]),
            helper.make_node("Transpose", ["x4"], ["t"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", ["t", "s3"], ["m"]),
            helper.make_node("Reshape", ["m", "s2"], ["out"]),
        ],
        [onnx_input("x", "float32", ["bh", seq, head_dim])],
        [onnx_input("out", "float32", ["bs", heads * head_dim])],
        {
            "s4": np.array([-1, heads, seq, head_dim], dtype="int64"),
            "s3": np.array([-1, seq, heads * head_dim], dtype="int64"),
            "s2": np.array([-1, heads * head_dim], dtype="int64"),
        },
    )

    def torch_fn(torch):
        def fn(x):
            t = x.view(-1, heads, seq, head_dim).permute(0, 2, 1, 3)
            return (t.reshape(-1, seq, heads * head_dim).reshape(-1, heads * head_dim),)

        return fn

    return Instance(
        "mha_transpose",
        bb.get(),
        {"x": x_np},
        reference,
        model,
        torch_fn,
        rtol=0,
        atol=0,
        expect="StripBookendViews: one transpose kernel between views",
    )
