"""Building the ONNX fuzzer's graphs: :class:`_Graph` (nodes, inputs, initializers, outputs with
fresh names; the model with its outputs' types from ONNX's shape inference, or
:class:`~.common.InvalidCase`) and the dims of its inputs, static or symbolic, fed at two sizes.
"""

from __future__ import annotations

import numpy as np

from .common import SIZES, InvalidCase

INT64_MAX = 2**63 - 1
OPSET = 18


class _Graph:
    """Nodes, inputs, initializers under construction; fresh names."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.nodes: list = []
        self.inputs: list = []
        self.inits: list = []
        self.outputs: list = []
        self._n = 0

    def name(self, base: str = "t") -> str:
        self._n += 1
        return f"{base}{self._n}"

    def node(self, op: str, inputs, n_out: int = 1, **attrs):
        from onnx import helper

        outs = [self.name(op.lower()) for _ in range(n_out)]
        # named as exporters do: the importer's errors name the node
        node = helper.make_node(op, list(inputs), outs, name=f"{op}_{outs[0]}", **attrs)
        self.nodes.append(node)
        return outs[0] if n_out == 1 else outs

    def const(self, array, base: str = "c") -> str:
        from onnx import numpy_helper

        name = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def i64(self, *values) -> str:
        return self.const(np.array(values, dtype="int64"), "i")

    def scalar64(self, value: int) -> str:
        return self.const(np.array(value, dtype="int64"), "s")

    def f32(self, *shape, scale: float = 1.0) -> str:
        return self.const((self.rng.standard_normal(shape) * scale).astype("float32"), "w")

    def input(self, name: str, shape, elem=None) -> str:
        from onnx import TensorProto, helper

        self.inputs.append(
            helper.make_tensor_value_info(name, elem or TensorProto.FLOAT, list(shape))
        )
        return name

    def output(self, name: str) -> None:
        from onnx import helper

        self.outputs.append(helper.make_empty_tensor_value_info(name))

    def model(self):
        import onnx
        from onnx import helper

        graph = helper.make_graph(self.nodes, "fuzz", self.inputs, self.outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8
        # the outputs' types from ONNX's shape inference
        inferred = onnx.shape_inference.infer_shapes(model)
        types = {v.name: v for v in inferred.graph.value_info}
        for out in model.graph.output:
            if out.name not in types or not types[out.name].type.tensor_type.HasField("shape"):
                raise InvalidCase(f"no type inferred for {out.name}")
            out.CopyFrom(types[out.name])
        return model


def _two_sizes(rng, lo: int = 1) -> tuple[int, int]:
    """Two different sizes for a dynamic dim."""
    pool = [s for s in SIZES if s >= lo]
    a, b = rng.choice(pool, 2, replace=False)
    return int(a), int(b)


def _dim(rng, name: str, static_p: float = 0.3, lo: int = 1):
    """A dim: ``(onnx dim, [size for feed 0, size for feed 1])``, static or symbolic."""
    if rng.random() < static_p:
        size = int(rng.choice([s for s in SIZES if s >= lo]))
        return size, [size, size]
    return name, list(_two_sizes(rng, lo))


def _randn(rng, shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype("float32")
