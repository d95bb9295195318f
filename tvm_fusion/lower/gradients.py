"""Gradients that apache-tvm 0.27 lacks, registered on ``import tvm_fusion``.

``relax.transform.Gradient`` needs an ``FPrimalGradient`` for every op it differentiates. Our
rewrites emit ops that stock TVM has no gradient for:

- ``relax.strided_slice`` (what GatherToSlice emits): the gradient scatters the output gradient
  into zeros of the input's shape with ``slice_scatter``, one sliced axis at a time; a negative
  stride is the positive-stride slice of the flipped gradient. No scatter-add: slice indices
  never repeat.
- ``relax.squeeze`` (what PyTorch's decompositions emit after every gather): the output gradient
  reshaped to the input's shape.

A gradient that TVM itself registers later wins: ours is only added where none exists.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax.op import flip, slice_scatter, zeros
from tvm.relax.op.grad import no_grad

from ..errors import TvmFusionError


def _ints(tup) -> list:
    fields = tup.fields if isinstance(tup, relax.Tuple) else list(tup)
    return list(fields)


def _static(value) -> int | None:
    return int(value.value) if isinstance(value, tirx.IntImm) else None


def _axis_range(begin, end, stride, dim, assume_inbound: bool):
    """(first, stop, step, flipped): the slice as a positive-step range [first, stop)."""
    b, e, s, d = _static(begin), _static(end), _static(stride), _static(dim)
    if s is None or s == 0:
        raise TvmFusionError("strided_slice gradient needs a constant non-zero stride")
    if b is not None and e is not None and d is not None:
        start, stop, step = slice(b, e, s).indices(d)
        count = len(range(start, stop, step))
        if count == 0:
            return 0, 0, 1, False
        last = start + (count - 1) * step
        if step > 0:
            return start, last + 1, step, False
        return last, start + 1, -step, True
    if s > 0 and assume_inbound:
        return begin, end, s, False
    raise TvmFusionError(
        "strided_slice gradient with symbolic bounds needs assume_inbound=True and a "
        "positive stride"
    )


def strided_slice_grad(orig_var, orig_call, output_grad, ctx: relax.BlockBuilder):
    """Gradient of ``y = strided_slice(x, axes, begin, end, strides)``: x_grad, then no_grad for
    the (non-differentiable) axes/begin/end/strides arguments."""
    x = orig_call.args[0]
    axes = [int(a.value) for a in _ints(orig_call.args[1])]
    begins = _ints(orig_call.args[2])
    ends = _ints(orig_call.args[3])
    if len(orig_call.args) > 4 and orig_call.args[4] is not None:
        strides = _ints(orig_call.args[4])
    else:
        strides = [tirx.IntImm("int64", 1)] * len(axes)
    x_shape = list(x.ty.shape.values)
    out_shape = list(orig_var.ty.shape.values)
    ndim = len(x_shape)
    axes = [a % ndim for a in axes]
    assume_inbound = bool(orig_call.attrs.assume_inbound)
    dtype = x.ty.dtype

    grad = output_grad
    for j in reversed(range(len(axes))):
        axis = axes[j]
        before = [out_shape[a] if a in axes[:j] else x_shape[a] for a in range(ndim)]
        first, stop, step, flipped = _axis_range(
            begins[j], ends[j], strides[j], x_shape[axis], assume_inbound
        )
        src = ctx.emit(flip(grad, axis)) if flipped else grad
        base = ctx.emit(zeros(relax.ShapeExpr(before), dtype))
        grad = ctx.emit(slice_scatter(base, src, first, stop, step, axis))
    return [grad] + [no_grad(arg) for arg in orig_call.args[1:]]


def squeeze_grad(orig_var, orig_call, output_grad, ctx: relax.BlockBuilder):
    """Gradient of ``y = squeeze(x, axis)``: the output gradient in x's shape."""
    return [ctx.emit(relax.op.reshape(output_grad, orig_call.args[0].ty.shape))]


_GRADIENTS = {
    "relax.strided_slice": strided_slice_grad,
    "relax.squeeze": squeeze_grad,
}
_REGISTERED = False


def register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    for name, grad in _GRADIENTS.items():
        if tvm.ir.Op.get(name).get_attr("FPrimalGradient") is None:
            relax.op.base.register_gradient(name, grad)
