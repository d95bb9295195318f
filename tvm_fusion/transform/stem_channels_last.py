"""StemChannelsLast: a CNN's stem (a convolution of few input channels, its elementwise
epilogue and a max pooling) computed channels-last, the pooled result transposed back.

A convolution in NCHW is scheduled by the CPU GEMM rule with the output channels as the vector
axis, so each register tile is written back with one scalar store per element, across the
channel planes. Behind a long reduction that costs little; a stem's is short (3 channels x
3 x 3 = 27 products per output in SqueezeNet, 147 in ResNet-50), and there the write-back took
more time than the products: SqueezeNet's 3 -> 64 3 x 3 stride-2 stem (111 x 111) 0.41 ms
alone, 0.17 ms with the same tile writing channels-last. Here the convolution writes NHWC
(whole vectors), its epilogue and the pooling run in NHWC, and only the pooled tensor (a
quarter of the elements after a 3 x 3 stride-2 pool) is transposed back to NCHW, by a copy
that the Injective rule tiles (``block_transpose``).

Matches ``max_pool2d(f_n(...f_1(conv2d(x, W))))`` where

- ``conv2d`` is NCHW / OIHW -> NCHW, one group, any stride, padding and dilation, float32,
  static shapes, a constant weight of at most :data:`MAX_REDUCTION` products per output
  (``C_in x kh x kw``: the stems of the model zoo's CNNs have 27-363);
- each ``f_i`` is an elementwise op of the value before it alone (``relu``, ``clip``, ...),
  with a constant that varies along the channels only (a bias, a folded batch-norm's), or with
  a scalar (rank 0, computed or not: the ONNX importer's Clip bounds);
- ``max_pool2d`` is NCHW -> NCHW; every value in between has no other use.

It emits a ``call_tir`` of the convolution with an NHWC output (a TE compute of the same
products in the same order, its padding a separate stage, as the stock legalisation's), the
``f_i`` on it with their constants viewed ``[1, 1, 1, C]``, ``max_pool2d`` with layout NHWC,
and ``permute_dims`` back to NCHW. FuseOps fuses the convolution with the ``f_i``. CPU only.
Left alone, with the reason logged at debug level: anything else (an LRN between the
convolution and the pooling, AlexNet's; average pooling; a symbolic batch).

Measured (Intel AVX-512 host, 2 threads, conv + bias + ReLU + pooling as one Relax function,
engines alternating): SqueezeNet's stem 0.56 -> 0.36 ms, ResNet-50's (7 x 7 stride 2, pad 3,
pool pad 1) 1.14 -> 1.03 ms, ShuffleNet's (3 -> 24) 0.26 -> 0.22 ms.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import IRModule, relax, te, topi
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import target as _target
from ._common import (
    ELEMENTWISE_BINARY,
    ELEMENTWISE_UNARY,
    bound_values,
    constant_value,
    float32_nchw_conv2d,
    get_logger,
    ints,
    op_name,
    record_rewrite,
    rewrite_each_function,
    skip,
    use_counts,
)

logger = get_logger(__name__)
NAME = "StemChannelsLast"
MAX_REDUCTION = 384  # C_in x kh x kw: AlexNet's 3 x 11 x 11 (363) and below
_POOL = "relax.nn.max_pool2d"


def conv2d_to_nhwc(x, w, strides, padding, dilation):
    """TE: ``conv2d`` of NCHW ``x`` and OIHW ``w`` with the output in NHWC; ``padding`` is
    (top, left, bottom, right)."""
    n, c, h, wd = (int(d) for d in x.shape)
    f, _, kh, kw = (int(d) for d in w.shape)
    sh, sw = strides
    dh, dw = dilation
    top, left, bottom, right = padding
    if any(padding):
        x = topi.nn.pad(x, [0, 0, top, left], [0, 0, bottom, right], name="pad_temp")
    oh = (h + top + bottom - dh * (kh - 1) - 1) // sh + 1
    ow = (wd + left + right - dw * (kw - 1) - 1) // sw + 1
    rc = te.reduce_axis((0, c), "rc")
    ry = te.reduce_axis((0, kh), "ry")
    rx = te.reduce_axis((0, kw), "rx")
    return te.compute(
        (n, oh, ow, f),
        lambda b, i, j, o: te.sum(
            x[b, rc, i * sh + ry * dh, j * sw + rx * dw] * w[o, rc, ry, rx], axis=[rc, ry, rx]
        ),
        name="conv2d_nhwc",
    )


@tvm.transform.module_pass(opt_level=0, name=NAME)
class StemChannelsLast:
    """Computes a CNN stem's convolution, epilogue and max pooling channels-last (see the
    module docstring)."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        if not _target.is_cpu(_target.resolve_target(self.target)):
            return mod
        record_rewrite(NAME, rewrite_each_function(mod, _Rewriter))
        return mod


def _is_scalar(expr) -> bool:
    """A rank-0 tensor: it broadcasts the same way in every layout."""
    return isinstance(expr.ty, relax.TensorType) and expr.ty.ndim == 0


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, func: relax.Function):
        super().__init__(mod)
        self.bound = bound_values(func)
        self.uses = use_counts(func)
        self.count = 0

    def visit_var_binding_(self, binding) -> None:
        new = self._rewrite(binding.value, binding.var.name)
        if new is None:
            super().visit_var_binding_(binding)
            return
        self.set_var_remap(binding.var, new)
        self.count += 1

    def _single_use(self, var) -> bool:
        return isinstance(var, relax.Var) and self.uses.get(var, 0) == 1

    def _chain(self, value, what):
        """The elementwise ops between the pooling's input and the convolution, first to last,
        each ``(call, index of the chain operand, other operand)`` (a constant array to view in
        NHWC, a scalar expression, or None), and the convolution's
        call; or None."""
        chain = []
        while True:
            if not self._single_use(value):
                return skip(logger, what, "a value between the stem's ops has another use")
            call = self.bound.get(value)
            name = op_name(call)
            if name == "relax.nn.conv2d":
                return chain[::-1], call
            if name in ELEMENTWISE_UNARY and len(call.args) >= 1:
                if any(not isinstance(a, relax.PrimValue | relax.Constant) for a in call.args[1:]):
                    return skip(logger, what, f"{name} with tensor operands")
                chain.append((call, 0, None))
                value = call.args[0]
            elif name in ELEMENTWISE_BINARY and name != "relax.where":
                for i in (0, 1):
                    other = call.args[1 - i]
                    if not isinstance(call.args[i], relax.Var):
                        continue
                    if _is_scalar(other):  # the same in every layout (Clip's bounds)
                        break
                    other = constant_value(other, self.bound)
                    if other is not None:
                        break
                else:
                    return skip(logger, what, f"{name} of two computed tensors")
                chain.append((call, i, other))
                value = call.args[i]
            else:
                return skip(logger, what, f"{name} between the convolution and the pooling")

    def _rewrite(self, call, name: str):  # noqa: C901, PLR0911 - one check per condition
        if op_name(call) != _POOL:
            return None
        what = f"max_pool2d {name}"
        attrs = call.attrs
        if (str(attrs.layout), str(attrs.out_layout)) != ("NCHW", "NCHW"):
            return skip(logger, what, "not NCHW") or None
        found = self._chain(call.args[0], what)
        if not found:
            return None
        chain, conv = found
        cattrs = conv.attrs
        _, weight, why = float32_nchw_conv2d(conv, self.bound)
        if why:
            return skip(logger, what, why) or None
        x = conv.args[0]
        channels = weight.shape[0]
        reduction = int(np.prod(weight.shape[1:]))
        if reduction > MAX_REDUCTION:
            return skip(logger, what, f"{reduction} products per output") or None
        consts = []
        for op, _i, const in chain:
            if not isinstance(const, np.ndarray):
                consts.append(const)
                continue
            if const.ndim > 4:
                return skip(logger, what, f"a {op_name(op)} operand of rank {const.ndim}") or None
            aligned = (1,) * (4 - const.ndim) + tuple(const.shape)
            if aligned[0] != 1 or aligned[2:] != (1, 1) or aligned[1] not in (1, channels):
                return skip(logger, what, f"a {op_name(op)} operand of shape {aligned}") or None
            consts.append(const.reshape(aligned).transpose(0, 2, 3, 1))
        bb = self.builder_
        y = bb.emit_te(
            conv2d_to_nhwc,
            self.visit_expr(x),
            relax.const(weight),
            ints(cattrs.strides),
            ints(cattrs.padding),
            ints(cattrs.dilation),
            primfunc_name_hint="conv2d_nhwc",
        )
        for (op, i, _const), const in zip(chain, consts, strict=True):
            args = list(op.args)
            args[i] = y
            if isinstance(const, np.ndarray):
                args[1 - i] = relax.const(const)
            elif const is not None:
                args[1 - i] = self.visit_expr(const)
            y = bb.emit(relax.Call(op.op, args, op.attrs, op.ty_args))
        pooled = bb.emit(
            relax.op.nn.max_pool2d(
                y,
                ints(attrs.pool_size),
                ints(attrs.strides),
                ints(attrs.padding),
                ints(attrs.dilation),
                bool(attrs.ceil_mode),
                bool(attrs.count_include_pad),
                layout="NHWC",
                out_layout="NHWC",
            )
        )
        return bb.emit(relax.op.permute_dims(pooled, [0, 3, 1, 2]), name_hint=name)
