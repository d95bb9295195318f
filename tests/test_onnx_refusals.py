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
