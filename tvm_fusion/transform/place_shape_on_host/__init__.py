"""PlaceShapeOnHost: shape arithmetic on int tensors becomes symbolic shape arithmetic on the host
(ONNX Runtime PR #19769).

Exporters compute shapes on int64 tensors (``Shape -> Gather -> Mul -> Concat -> Reshape``,
``Range`` with a limit read from a shape, ``Slice`` ends from ``Shape / 2``, ``Tile`` repeats from
another input's batch); the ONNX importer folds the simplest chains and leaves the rest as
``shape_of -> shape_to_tensor -> take/concat/multiply/where/scatter_elements -> tensor_to_shape``
(or ``dynamic_strided_slice``). Each op of such a chain is a device kernel on CUDA, and the
``tensor_to_shape`` at its end copies the result back to the host and synchronises.

The pass walks backwards from every shape-consuming operand:

- ``tensor_to_shape(t)`` (what Reshape, Expand, Tile, ConstantOfShape and Range targets become),
- ``dynamic_strided_slice(x, begin, end, strides)``,

through the int tensor ops that produce ``t`` (shape_to_tensor of a shape or of ``shape_of``,
int constants, take/strided_slice on axis 0, concat, reshape/squeeze/expand_dims/astype,
elementwise add/subtract/multiply/divide/floor_divide/floor_mod/minimum/maximum/negative,
comparisons, logical ops, where, scatter_elements at constant indices, sum/prod), evaluating
every element as a ``PrimExpr`` over the function's symbolic dims. When every element is known,
the consumer is rewritten: ``tensor_to_shape(t)`` becomes ``R.shape([...])`` and
``dynamic_strided_slice`` becomes ``strided_slice`` with PrimValue bounds. The VM computes these
expressions on the host from the shapes it already has, so the chain costs no kernel and no copy.
Tensors of the chain that nothing else uses are removed; a value that also feeds a non-shape
consumer (``Size(x)`` divided into data, say) keeps its device computation for that consumer.

Shape tensors that are graph inputs (dynamo-captured models pass them) cannot be made symbolic
by reading the graph: their values exist only at run time. The pass reads each such input once,
at the top of the function (``tensor_to_shape`` + ``match_cast`` to fresh dims ``<name>_0..``),
evaluates everything downstream symbolically from those dims, and on GPU targets declares the
input a host tensor (its struct info gets the host VDevice): the caller passes it as a CPU
tensor, and reading it is no device-to-host copy.

A shape value computed from data (``max(sum(attention_mask, -1))`` as a Slice end, an argmax as
a Reshape target) has no symbolic form either. When a short int tensor (rank <= 1, at most 16
elements, static length) on a chain cannot be evaluated, it is read the same way, once, right
before the rewritten consumer, and everything after it becomes symbolic. On GPU targets the ops
between the data and the read that only reduce, cast or reshape 1-D int tensors (the max over
the per-row lengths) are placed on the host VDevice (part b of issue #8): ``to_vdevice`` copies
their 1-D input once, they are legalised as llvm kernels (``KeepHostKernelsApart`` in the
pipeline stops FuseOps from merging them into device kernels), and the read needs no further
copy. Larger inputs (the mask itself) are data and stay on the device. The module's ``vdevice``
global info lists the device first and the host after it, so the VM is created with
``[gpu, cpu]``. Anything the evaluator does not understand is left as it was, with the reason at
debug level. Sign tests (comparisons, abs, min/max, floor division) of values read at run time
are not evaluated: TVM takes every dim a ``match_cast`` defines to be >= 0 and would fold them;
such a chain stays tensor ops, and its result is read instead.

A ``strided_slice`` from a positive constant begin (as written, or clamped by the importer to a
symbolic end: ``min(1, 2 * seq)``) to the end of a symbolic axis or to a symbolic end within it
is inferred ``max(end - begin, 0)`` long; it is matched to ``end - begin`` (a run-time check
that fails only where the slice would be empty), so a reshape after it (XLNet's rel_shift) is a
view, not a copy kernel.

The pass's modules: ``evaluate`` (recognising int shape chains, evaluating them symbolically),
``rewrite`` (the consumers rewritten, the new shapes propagated), ``host`` (the run-time reads
and their placement on the host VDevice of a GPU target); the public pass is here.
"""

from __future__ import annotations

import tvm
from tvm import IRModule

from .._common import record_rewrite
from .rewrite import _Rewriter

NAME = "PlaceShapeOnHost"


@tvm.transform.module_pass(opt_level=0, name=NAME)
class PlaceShapeOnHost:
    """Makes shape arithmetic on int tensors symbolic (see the module docstring)."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        target = self.target or tvm.target.Target.current(allow_none=True)
        rewriter = _Rewriter(mod, target)
        mod = rewriter.transform()
        record_rewrite(NAME, rewriter.count)
        return mod


__all__ = ["PlaceShapeOnHost"]
