"""ONNX ``Sum`` as pairwise adds: stock apache-tvm 0.27 imports a ``Sum`` of inputs whose shapes
it knows as ``sum(stack(inputs), axis=0)``, a copy of every input into a stacked buffer and a
reduction over it, which FuseOps cannot fuse with the adds and activations around it (a
reduction kernel of its own). ONNX's ``Sum`` is elementwise with multidirectional broadcasting,
so ``((a + b) + c) ...`` is the same sum, in the same order, and an elementwise op: ShuffleNet's
residual ``Sum`` then ``Relu`` is one kernel, or the epilogue of the grouped convolution before it
(``GroupedConvToGemm``), instead of a stack-and-sum kernel and a ReLU kernel per unit.

A ``Sum`` of constants only stays stock's (folded at import).
"""

from __future__ import annotations

import functools

from tvm import relax
from tvm.ir import GenericConst
from tvm.relax.frontend.onnx import onnx_frontend as _frontend


class Sum(_frontend.Sum):
    """``Sum`` of tensors as pairwise ``add`` (see the module docstring)."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        if all(isinstance(inp, GenericConst) for inp in inputs):
            return super()._impl_v1(bb, inputs, attr, params)
        return functools.reduce(lambda a, b: bb.normalize(relax.op.add(a, b)), inputs)


ELEMENTWISE = {"Sum": Sum}
