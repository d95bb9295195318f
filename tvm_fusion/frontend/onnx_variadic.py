"""ONNX Sum / Mean of several tensors as a chain of elementwise adds.

Stock's converter broadcasts every input to the common shape, stacks them and reduces the new
axis: a stacked copy, a reduction kernel that FuseOps keeps apart from the producer before it
and the activation after it. ResNet-50's residual adds are ``Sum(conv, shortcut)`` followed by
``Relu``: as ``stack`` + ``sum`` they took two extra passes over each block's output; as
``add`` they join the convolution's epilogue (bias, residual add, ReLU in one kernel).

The pairwise form is stock's own ``_impl_dynamic`` (ONNX defines the ops as elementwise with
multidirectional broadcasting, so it is the same function), used here for every non-constant
input list: the adds run left to right, the order in which the stacked reduction summed;
``Mean`` then divides by the count in the inputs' dtype (stock's dynamic form). All-constant
inputs keep stock's path (folded at import). Max / Min keep stock's stacked form (a NaN's
handling by ``max`` and ``maximum`` is not checked here).
"""

from __future__ import annotations

from tvm.ir.expr import GenericConst
from tvm.relax.frontend.onnx import onnx_frontend as _frontend


def _pairwise(base):
    class Pairwise(base):
        @classmethod
        def _impl_v1(cls, bb, inputs, attr, params):
            if all(isinstance(i, GenericConst) for i in inputs):
                return super()._impl_v1(bb, inputs, attr, params)
            if len(inputs) == 1:  # the sum or mean of one tensor is that tensor
                return inputs[0]
            return cls._impl_dynamic(bb, inputs)

    Pairwise.__name__ = base.__name__
    Pairwise.__qualname__ = base.__name__
    return Pairwise


CONVERTERS = {"Sum": _pairwise(_frontend.Sum), "Mean": _pairwise(_frontend.Mean)}
