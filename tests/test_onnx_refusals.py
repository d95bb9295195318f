"""Converters of ``tvm_fusion/frontend/onnx_refusals.py`` on small models made here (the ONNX
node cases that found them are in ``test_onnx_node_cases``): float16 Softmax in float32."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

import tvm_fusion
from tvm_fusion.build import engine as engines


def _run(model, *inputs):
    compiled = engines.compile_module(
        tvm_fusion.load_onnx(model), tvm_fusion.host_target(), "tvm_fusion"
    )
    return engines.TvmRunner(compiled, list(inputs))().numpy()


def test_float16_softmax_sums_in_float32():
    # 2048 logits: TVM's float16 kernel summed the exponentials in float16 (the sum's
    # rounding then scaled every probability: 1 % off); the float64 result rounded to float16
    # is within one ulp of what the float32 sum gives
    n = 2048
    graph = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["y"], axis=-1)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, n])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    x = np.random.default_rng(0).standard_normal((2, n)).astype("float16")
    e = np.exp(x.astype("float64") - x.astype("float64").max(-1, keepdims=True))
    want = e / e.sum(-1, keepdims=True)
    got = _run(model, x)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype("float64"), want, rtol=2.0**-9, atol=1e-7)


def _resize_model(scales=None, sizes=None, mode="linear", antialias=0, dims=("n", 3, "h", "w")):
    from onnx import numpy_helper

    inits = [numpy_helper.from_array(np.zeros(0, np.float32), "roi")]
    names = ["x", "roi"]
    if scales is not None:
        inits.append(numpy_helper.from_array(np.array(scales, np.float32), "scales"))
        names.append("scales")
    else:
        names.append("")
        inits.append(numpy_helper.from_array(np.array(sizes, np.int64), "sizes"))
        names.append("sizes")
    node = helper.make_node("Resize", names, ["y"], mode=mode, antialias=antialias, name="rs")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(dims))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b", "c", "d"])],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_resize_refuses_what_stock_gets_wrong():
    """Constant scales whose product is not whole (stock: the ratio of the sizes instead of the
    scale, errors up to 1.2 on ONNX's downsample cases) and antialias when shrinking (stock
    ignores it) are refused in one line naming the node."""
    import pytest

    from tvm_fusion.errors import ModelError

    cases = [
        (_resize_model(scales=[1, 1, 0.6, 0.6], dims=(1, 3, 4, 4)), "scale 0.6 on axis 2"),
        (_resize_model(scales=[1, 1, 0.5, 0.5]), "scale 0.5 on axis 2"),  # symbolic h
        (_resize_model(sizes=[1, 3, 2, 2], antialias=1, dims=(1, 3, 4, 4)), "antialias"),
    ]
    for model, message in cases:
        with pytest.raises(ModelError, match=f"Resize node 'rs': {message}"):
            tvm_fusion.load_onnx(model)


def test_resize_whole_scales_symbolic_and_antialias_growing_match_onnx():
    """Must not fire: integer scales on symbolic extents, a shrink to whole extents, and
    antialias when growing (no effect) keep stock's converter and ONNX's numbers."""
    from onnx.reference import ReferenceEvaluator

    models = [
        (_resize_model(scales=[1, 1, 2, 3]), (2, 3, 5, 4)),
        (_resize_model(scales=[1, 1, 0.5, 0.25], dims=(1, 3, 6, 8)), (1, 3, 6, 8)),
        (_resize_model(sizes=[1, 3, 7, 9], antialias=1, dims=(1, 3, 4, 4)), (1, 3, 4, 4)),
    ]
    for model, shape in models:
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        (want,) = ReferenceEvaluator(model).run(None, {"x": x})
        got = _run(model, x)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _topk_model(opset: int, dtype: str):
    from onnx import numpy_helper

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1, name="tk")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", elem, ["n", 5])],
        [
            helper.make_tensor_value_info("v", elem, ["n", 2]),
            helper.make_tensor_value_info("i", TensorProto.INT64, ["n", 2]),
        ],
        initializer=[numpy_helper.from_array(np.array([2], np.int64), "k")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_topk_opset10_and_narrow_integers_match_onnx():
    """Opset 10's TopK took stock's opset-1 converter (the top 1, not K); int16 / uint16 /
    uint32 inputs raised in the sort kernel at run time (now widened, exactly)."""
    from onnx.reference import ReferenceEvaluator

    from tvm_fusion.build import engine

    for opset, dtype in ((10, "float32"), (11, "int16"), (18, "uint16"), (18, "uint32")):
        model = _topk_model(opset, dtype)
        compiled = engine.compile_module(
            tvm_fusion.load_onnx(model), tvm_fusion.host_target(), "tvm_fusion"
        )
        for rows in (1, 3):
            x = np.random.default_rng(rows).permutation(rows * 5).reshape(rows, 5).astype(dtype)
            want = ReferenceEvaluator(model).run(None, {"x": x})
            got = engine.TvmRunner(compiled, [x]).outputs()
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype and g.shape == w.shape, (opset, dtype)
                np.testing.assert_array_equal(g, w)


def test_topk_uint64_is_refused():
    import pytest

    from tvm_fusion.errors import ModelError

    with pytest.raises(ModelError, match="TopK node 'tk': uint64"):
        tvm_fusion.load_onnx(_topk_model(18, "uint64"))
