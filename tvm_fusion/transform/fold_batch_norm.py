"""FoldBatchNorm: an inference batch-norm after a convolution becomes the convolution's weights
and a bias, computed at compile time (what ONNX Runtime and every inference engine do).

Matches ``batch_norm(conv(x, W) [+ b], gamma, beta, mean, var)[0]`` with ``training=False``:

- ``conv`` is ``R.nn.conv1d`` / ``conv2d`` / ``conv3d`` of any stride, padding, dilation and
  groups, in a plain layout (``NCHW``, ``NHWC``, ...; kernel ``OIHW``, ``OHWI``, ...); the
  batch-norm's axis is the output's channel axis;
- ``W``, the optional bias ``b`` and the four batch-norm operands are constants (directly, bound
  to a variable, or a ``broadcast_to`` of one to a static shape); ``b`` varies along the channel
  axis only;
- the convolution (and the bias add) has no other use, and the batch-norm tuple no use but its
  item 0 (the running statistics it also returns are then dead).

With ``s = gamma / sqrt(var + eps)``, it emits ``conv(x, W * s) + ((b - mean) * s + beta)``,
the products computed in float64 and rounded once to the weight's dtype. The convolution then
fuses with its bias, activation and residual add (FuseOps) into one kernel instead of a
separate batch-norm pass over the tensor (ResNet-50: 53 batch-norms).

Where it must run: before LegalizeOps (Phase 1), which would split the batch-norm into
elementwise ops.

Left alone, with the reason logged at debug level: a batch-norm in training mode, one whose
operands are not constants (a trainable model), whose axis is not the convolution's channel
axis, a blocked layout (``NCHW8c``), a convolution or batch-norm with another use, a bias that
varies along another axis.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import IRModule, relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._common import (
    CONVS,
    bound_values,
    constant_value,
    get_logger,
    op_name,
    plain_axis,
    record_rewrite,
    rewrite_each_function,
    skip,
    use_counts,
)

logger = get_logger(__name__)
NAME = "FoldBatchNorm"


@tvm.transform.module_pass(opt_level=0, name=NAME)
class FoldBatchNorm:
    """Folds an inference batch-norm into the constant weights of the convolution before it
    (see the module docstring)."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        # pruned first: the importer's unused statistics items would count as uses
        record_rewrite(NAME, rewrite_each_function(mod, _Rewriter, prune_first=True))
        return mod


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, func: relax.Function):
        super().__init__(mod)
        self.bound = bound_values(func)
        self.uses = use_counts(func)
        self.count = 0

    def visit_var_binding_(self, binding) -> None:
        folded = self._fold(binding.value)
        if folded is None:
            super().visit_var_binding_(binding)
            return
        self.set_var_remap(binding.var, self.builder_.emit(folded, name_hint=binding.var.name))
        self.count += 1

    def _fold(self, value):  # noqa: C901 - one check per condition of the module docstring
        if not isinstance(value, relax.TupleGetItem) or value.index != 0:
            return None
        bn_var = value.tuple_value
        bn = self.bound.get(bn_var)
        if op_name(bn) != "relax.nn.batch_norm":
            return None
        what = f"batch_norm {bn_var.name}"
        attrs = bn.attrs
        if bool(attrs.training):
            return skip(logger, what, "training mode") or None
        if self.uses.get(bn_var, 0) != 1:
            return skip(logger, what, "its running statistics are used") or None
        data, gamma, beta, mean, var = bn.args
        bias_var = None
        conv_var = data
        producer = self.bound.get(data)
        if op_name(producer) == "relax.add":
            lhs, rhs = producer.args
            if op_name(self.bound.get(rhs)) in CONVS:
                lhs, rhs = rhs, lhs
            if self.uses.get(data, 0) != 1:
                return skip(logger, what, "the bias add has another use") or None
            bias_var, conv_var = rhs, lhs
            producer = self.bound.get(lhs)
        if op_name(producer) not in CONVS or not isinstance(conv_var, relax.Var):
            return skip(logger, what, "not after a convolution") or None
        if self.uses.get(conv_var, 0) != 1:
            return skip(logger, what, "the convolution has another use") or None
        conv = producer
        c_axis = plain_axis(str(conv.attrs.out_layout), "C")
        o_axis = plain_axis(str(conv.attrs.kernel_layout), "O")
        out_ty = conv.ty
        if c_axis is None or o_axis is None or not isinstance(out_ty, relax.TensorType):
            return skip(logger, what, "a blocked or unknown layout") or None
        ndim = out_ty.ndim
        if int(attrs.axis) % max(ndim, 1) != c_axis:
            return skip(logger, what, "its axis is not the convolution's channels") or None
        weight = constant_value(conv.args[1], self.bound)
        stats = [constant_value(e, self.bound) for e in (gamma, beta, mean, var)]
        if weight is None or any(s is None for s in stats):
            return skip(logger, what, "operands are not constants") or None
        channels = weight.shape[o_axis]
        if any(s.shape != (channels,) for s in stats):
            return skip(logger, what, "statistics of another length") or None
        bias = np.zeros(channels)
        if bias_var is not None:
            b = constant_value(bias_var, self.bound)
            if b is None or b.ndim > ndim:
                return skip(logger, what, "a bias that is not a constant per channel") or None
            aligned = (1,) * (ndim - b.ndim) + tuple(b.shape)  # numpy's broadcasting
            if aligned[c_axis] not in (1, channels) or any(
                d != 1 for i, d in enumerate(aligned) if i != c_axis
            ):
                return skip(logger, what, "a bias along another axis") or None
            bias = np.broadcast_to(b.reshape(-1).astype("float64"), (channels,))
        gamma, beta, mean, var = (s.astype("float64") for s in stats)
        scale = gamma / np.sqrt(var + float(attrs.epsilon))
        shape = [1] * weight.ndim
        shape[o_axis] = channels
        new_weight = (weight.astype("float64") * scale.reshape(shape)).astype(weight.dtype)
        out_dtype = str(out_ty.dtype)
        new_bias = ((bias - mean) * scale + beta).astype(out_dtype)
        bias_shape = [1] * ndim
        bias_shape[c_axis] = channels
        args = [self.visit_expr(conv.args[0]), relax.const(new_weight)]
        new_conv = relax.Call(conv.op, args, conv.attrs, conv.ty_args)
        new_conv = self.builder_.normalize(new_conv)
        return relax.op.add(new_conv, relax.const(new_bias.reshape(bias_shape)))
