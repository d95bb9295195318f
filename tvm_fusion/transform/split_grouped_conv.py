"""SplitGroupedConv: a convolution of a few wide groups becomes one convolution per group (CPU).

Matches ``R.nn.conv1d`` / ``conv2d`` / ``conv3d`` with ``1 < groups <= MAX_GROUPS`` in a plain
layout (``NCHW``, ``NHWC``, ...; kernel ``OIHW``, ``OHWI``, ...) whose weight is a constant and
whose groups each have at least ``MIN_CHANNELS`` output channels and a reduction (input
channels x window) of at least ``MIN_REDUCTION``: AlexNet's 5 x 5 and 3 x 3 convolutions (2
groups of 48 x 25 -> 128 and 192 x 9 -> 192). It emits

    parts = split(x, groups, axis=C)
    concat([conv(parts[g], W[g], groups=1) for g in range(groups)], axis=C)

with the per-group weights sliced at compile time. Each group is then an ordinary convolution,
which the CPU GEMM rule tiles in registers (12 accumulators on AVX2) with its weights packed at
compile time; the grouped kernel was left to rules that tile one group's output channels only
(AlexNet's 27 x 27 5 x 5 convolution: a dot product per output). The split of the input and the
concatenation are copies of the input and output, small beside the convolution's work (AlexNet
conv2: 0.3 + 0.7 MB against 0.45 GFLOP).

Where it must run: before LegalizeOps (Phase 1), and before FoldBatchNorm would see the
concatenation (FoldBatchNorm runs first: a batch-norm folds into the grouped convolution).

Left alone: more groups than ``MAX_GROUPS`` or narrower groups (ResNeXt's 32 groups of 4-8
channels, depthwise convolutions: the grouped and window rules' forms), shorter reductions
(ShuffleNet's 1 x 1 convolutions in 4 groups of 68 channels: split, they took 1.76x the grouped
rule's time, alternating in one run, load 5.9), a weight that is not a constant, blocked
layouts, targets other than CPUs.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import IRModule, relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import target as _target
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
)

logger = get_logger(__name__)
NAME = "SplitGroupedConv"
MAX_GROUPS = 4
MIN_CHANNELS = 32  # output channels per group: four AVX2 vectors, two AVX-512 ones
MIN_REDUCTION = 256  # input channels x window per group: a GEMM's K that repays its tiles


@tvm.transform.module_pass(opt_level=0, name=NAME)
class SplitGroupedConv:
    """Splits a convolution of a few wide groups into one convolution per group (see the
    module docstring)."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        target = _target.resolve_target(self.target)
        if not _target.is_cpu(target):
            return mod
        record_rewrite(NAME, rewrite_each_function(mod, _Rewriter))
        return mod


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, func: relax.Function):
        super().__init__(mod)
        self.bound = bound_values(func)
        self.count = 0

    def visit_var_binding_(self, binding) -> None:
        split = self._split(binding.value, binding.var.name)
        if split is None:
            super().visit_var_binding_(binding)
            return
        self.set_var_remap(binding.var, self.builder_.emit(split, name_hint=binding.var.name))
        self.count += 1

    def _split(self, call, name: str):
        if op_name(call) not in CONVS:
            return None
        attrs = call.attrs
        groups = int(attrs.groups)
        if groups <= 1:
            return None
        what = f"{op_name(call)} {name}"
        if groups > MAX_GROUPS:
            return skip(logger, what, f"{groups} groups") or None
        c_in = plain_axis(str(attrs.data_layout), "C")
        c_out = plain_axis(str(attrs.out_layout), "C")
        o_axis = plain_axis(str(attrs.kernel_layout), "O")
        i_axis = plain_axis(str(attrs.kernel_layout), "I")
        if None in (c_in, c_out, o_axis, i_axis):
            return skip(logger, what, "a blocked layout") or None
        weight = constant_value(call.args[1], self.bound)
        if weight is None:
            return skip(logger, what, "the weight is not a constant") or None
        per_out = weight.shape[o_axis] // groups
        reduction = int(np.prod(weight.shape)) // weight.shape[o_axis]
        if weight.shape[o_axis] % groups or per_out < MIN_CHANNELS or reduction < MIN_REDUCTION:
            return skip(logger, what, f"groups of {reduction} -> {per_out}") or None
        x = self.visit_expr(call.args[0])
        parts = self.builder_.emit(relax.op.split(x, groups, axis=c_in), name_hint=f"{name}_x")
        outs = []
        for g in range(groups):
            w_g = np.take(weight, range(g * per_out, (g + 1) * per_out), axis=o_axis)
            piece = self.builder_.emit(relax.TupleGetItem(parts, g))
            conv = _conv_per_group(call, piece, w_g)
            outs.append(self.builder_.emit(conv, name_hint=f"{name}_g{g}"))
        return relax.op.concat(outs, axis=c_out)


def _conv_per_group(call, piece, weight: np.ndarray):
    """``call``'s convolution of ``piece`` by ``weight`` with ``groups=1``."""
    attrs = call.attrs
    make = {
        "relax.nn.conv1d": relax.op.nn.conv1d,
        "relax.nn.conv2d": relax.op.nn.conv2d,
        "relax.nn.conv3d": relax.op.nn.conv3d,
    }[op_name(call)]
    out_dtype = attrs.out_dtype
    return make(
        piece,
        relax.const(np.ascontiguousarray(weight)),
        strides=[int(v) for v in attrs.strides],
        padding=[int(v) for v in attrs.padding],
        dilation=[int(v) for v in attrs.dilation],
        groups=1,
        data_layout=str(attrs.data_layout),
        kernel_layout=str(attrs.kernel_layout),
        out_layout=str(attrs.out_layout),
        out_dtype=None if out_dtype is None or str(out_dtype) in ("", "void") else out_dtype,
    )
