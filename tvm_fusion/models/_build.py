"""Small helpers shared by the workload builders."""

from __future__ import annotations

import numpy as np
from tvm import relax, tirx


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def randn(gen: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (gen.standard_normal(shape) * scale).astype("float32")


def dim(name: str, value: int, dynamic: bool):
    """A symbolic dimension when ``dynamic``, else the int."""
    return tirx.Var(name, "int64") if dynamic else value


def tensor_var(name: str, shape, dtype: str = "float32") -> relax.Var:
    return relax.Var(name, relax.TensorType(shape, dtype))


def const(array: np.ndarray) -> relax.Constant:
    """``relax.const`` keeping the array's dtype (it turns int64 arrays into int32 otherwise)."""
    return relax.const(array, str(array.dtype))


def sigmoid_np(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-x.astype("float64")))).astype(x.dtype)


def gelu_np(x: np.ndarray) -> np.ndarray:
    from math import sqrt

    from scipy.special import erf

    xd = x.astype("float64")
    return (0.5 * xd * (1.0 + erf(xd / sqrt(2.0)))).astype(x.dtype)


def onnx_model(nodes, inputs, outputs, initializers, opset: int = 18, name: str = "workload"):
    """An ONNX model from helper-made nodes, value infos and numpy initializers."""
    import onnx
    from onnx import helper, numpy_helper

    graph = helper.make_graph(
        nodes,
        name,
        inputs,
        outputs,
        initializer=[numpy_helper.from_array(v, k) for k, v in initializers.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def onnx_input(name: str, dtype: str, shape) -> object:
    from onnx import helper

    return helper.make_tensor_value_info(name, _onnx_dtype(dtype), list(shape))


def _onnx_dtype(dtype: str) -> int:
    from onnx import TensorProto

    return {
        "float32": TensorProto.FLOAT,
        "float16": TensorProto.FLOAT16,
        "int64": TensorProto.INT64,
        "int32": TensorProto.INT32,
        "bool": TensorProto.BOOL,
    }[dtype]
