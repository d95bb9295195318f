"""GroupedConvToGemm: a grouped 1 x 1 convolution becomes a batched GEMM (one per group), with its
elementwise epilogue on the GEMM's layout.

ShuffleNet's grouped 1 x 1 convolutions (``Conv2d(C, K, 1, groups=G)`` in NCHW) are, per group
``g``, the GEMM ``Y[n, g, j, p] = sum_c X[n, g, c, p] * W[g, j, c]`` over the flat positions
``p = h * W + w``. As a convolution, the schedule rules see an input channel index
``oc // OG * CG + c`` that no GEMM rule takes (``GroupedConv`` computes it with its positions as
the vector axis: 7 of 8 lanes at 14 x 14, a tile of 2 channels where ``OG`` = 34); as an einsum
over views of the same memory, the Matmul rule takes it: the output channels are the vector axis,
the weights packed at compile time, 12 accumulators on AVX2 (Matmul's own tiles)::

    x4 = R.reshape(x, (N, G, CG, H * W))
    y4 = R.einsum((x4, W3), "ngcp,gjc->ngjp")      # W3 = W as (G, OG, CG), a constant
    t4 = R.nn.relu(R.add(y4, R.reshape(b, (1, G, OG, 1))))
    y = R.reshape(t4, (N, G * OG, H, W))

Like ``SinkViewsPastEpilogues``, the view back to NCHW moves past every elementwise op
(unary math and activations, binary arithmetic) whose operands are each the sunk result, a
scalar or all-ones shape, a per-channel vector ``(1, C, 1, 1)`` / ``(C, 1, 1)`` (viewed as
``(1, G, OG, 1)``) or a tensor of the convolution's shape (viewed as ``(N, G, OG, H * W)``),
so FuseOps puts the einsum and its epilogue in one group (the bias, the ReLU, a residual add).

Measured (``scripts/bench_conv_layers.py``-style one-layer models, ``Relu(Conv + b)``, ours and
ONNX Runtime alternating, 2 threads on a shared Zen 3, load average 5-6): ShuffleNet's
272 -> 272 at 14 x 14 groups 4, ours/ORT 1.36 as a convolution, 0.98 as the einsum with its
epilogue (1.51 with the epilogue left behind the view); 544 -> 544 at 7 x 7, 1.53 -> 0.82;
136 -> 136 at 28 x 28, 1.73 -> 1.28. ShuffleNet end to end (the pass off and on, alternating
with ORT in one run, BatchNorm folded or not, load 4.4-4.8): on / off 0.76, 0.80, 0.83.

Matches ``R.nn.conv2d`` with ``1 < groups``, ``CG = C / groups >= 32`` (``MIN_GROUP_CHANNELS``:
a shorter reduction stays with the GroupedConv rule, a depthwise convolution with the window
rule), a 1 x 1 kernel, strides and dilations 1, no padding, NCHW / OIHW layouts, static channels
and positions (the batch may be symbolic), a float dtype without an ``out_dtype`` change and a
constant weight. Where it must run: before LegalizeOps (Phase 1), after BatchNorm folding (the
folded bias is the epilogue).

Left alone, with the reason logged at debug level: other convolutions, and epilogue ops whose
operands broadcast other than per channel (those read the NCHW view, which stays).
"""

from __future__ import annotations

import tvm
from tvm import IRModule, relax
from tvm.ir.expr import GenericConst
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._common import (
    ELEMENTWISE_BINARY,
    ELEMENTWISE_UNARY,
    const_int,
    get_logger,
    op_name,
    prove_equal,
    record_rewrite,
    rewrite_each_function,
    same_dims,
    skip,
)
from ._common import static_shape as _shape

logger = get_logger(__name__)
NAME = "GroupedConvToGemm"

_FLOATS = ("float32", "float64", "float16")
# The einsum's tile accumulates output channels as vectors and writes them back to NCHW
# transposed, a cost per output that the reduction over a group's input channels must outweigh:
# at 28 x 28, groups 4 (kernels alone, alternating, load ~6.8), 24 -> 112 (6 channels a group)
# took 3.7x the GroupedConv rule's time, 112 -> 112 (28) 1.15-1.4x, 128 -> 128 (32) 0.95,
# 136 -> 136 (34) 0.48-0.68; 272 -> 272 at 14 x 14 (68) 0.69, 544 -> 544 at 7 x 7 (136) 0.58.
MIN_GROUP_CHANNELS = 32


@tvm.transform.module_pass(opt_level=0, name=NAME)
class GroupedConvToGemm:
    """Rewrites grouped 1 x 1 convolutions as batched GEMMs (see the module docstring)."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        record_rewrite(NAME, rewrite_each_function(mod, _Rewriter))
        return mod


def _ints(values) -> list[int] | None:
    out = [const_int(v) for v in values]
    return None if any(v is None for v in out) else out


def grouped_1x1(call: relax.Call) -> tuple | None:
    """``(G, CG, OG, H, W)`` of a grouped 1 x 1 convolution this pass rewrites, else None."""
    if op_name(call) != "relax.nn.conv2d":
        return None
    x, w = call.args
    attrs = call.attrs
    what = "conv2d"
    groups = int(attrs.groups)
    if groups <= 1:
        return None
    if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NCHW", "OIHW", "NCHW"):
        return skip(logger, what, "not NCHW / OIHW")
    if _ints(attrs.strides) != [1, 1] or _ints(attrs.dilation) != [1, 1]:
        return skip(logger, what, "strided or dilated")
    if any(v != 0 for v in _ints(attrs.padding) or [1]):
        return skip(logger, what, "padded")
    if not isinstance(w, GenericConst):
        return skip(logger, what, "the weight is not a constant")
    x_shape, w_shape = _shape(x), _shape(w)
    if x_shape is None or w_shape is None or len(x_shape) != 4:
        return skip(logger, what, "unknown shapes")
    dtype = str(x.ty.dtype)
    if dtype not in _FLOATS or str(w.ty.dtype) != dtype:
        return skip(logger, what, f"dtype {dtype}")
    if str(attrs.out_dtype) not in ("", "void", "None", dtype):
        return skip(logger, what, f"out_dtype {attrs.out_dtype}")
    dims = _ints(x_shape[1:])
    k = _ints(w_shape)
    if dims is None or k is None:
        return skip(logger, what, "symbolic channels or positions")
    c, h, wd = dims
    if k[2:] != [1, 1] or c % groups or k[0] % groups or k[1] * groups != c:
        return skip(logger, what, "not a 1 x 1 kernel of whole groups")
    cg, og = c // groups, k[0] // groups
    if cg == 1:
        return skip(logger, what, "depthwise")
    if cg < MIN_GROUP_CHANNELS:
        return skip(logger, what, f"{cg} input channels a group: the GroupedConv rule's")
    return groups, cg, og, h, wd


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, _func: relax.Function):
        super().__init__(mod)
        self.count = 0
        # var (original, NCHW) -> (its value on the GEMM layout, NCHW shape, GEMM shape)
        self.flat: dict = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        name = op_name(value)
        if name == "relax.nn.conv2d":
            found = grouped_1x1(value)
            if found:
                self._rewrite(binding, *found)
                return None
        elif (name in ELEMENTWISE_UNARY or name in ELEMENTWISE_BINARY) and self._sink(binding):
            return None
        return super().visit_var_binding_(binding)

    def _emit_back(self, var, flat_value, shape) -> None:
        """``var`` = the NCHW view of ``flat_value`` (dropped later when nothing reads it)."""
        new = self.builder_.normalize(relax.op.reshape(flat_value, shape))
        self.builder_.emit_normalized(relax.VarBinding(var, new))

    def _rewrite(self, binding, groups, cg, og, h, wd) -> None:
        call, var = binding.value, binding.var
        bb = self.builder_
        x = self.visit_expr(call.args[0])
        n = _shape(call.args[0])[0]
        weight = call.args[1].value.numpy().reshape(groups, og, cg)
        x4 = bb.emit(relax.op.reshape(x, [n, groups, cg, h * wd]))
        y4 = bb.emit(
            relax.op.einsum((x4, relax.const(weight)), "ngcp,gjc->ngjp"),
            name_hint=f"{var.name}_gemm",
        )
        shape = _shape(var)
        self.flat[var] = (y4, shape, [n, groups, og, h * wd])
        self.count += 1
        self._emit_back(var, y4, shape)

    def _operand(self, arg, shape, flat_shape):
        """``arg`` on the GEMM layout, or None where it broadcasts otherwise."""
        bb = self.builder_
        new = self.visit_expr(arg)
        if not isinstance(arg.ty, relax.TensorType):
            return new  # clip's bounds (PrimValues)
        arg_shape = _shape(arg)
        if arg_shape is None:
            return None
        if all(prove_equal(d, 1) for d in arg_shape):
            return new if not arg_shape else bb.emit(relax.op.reshape(new, []))
        if 3 <= len(arg_shape) <= 4:
            lead, (ch, hh, ww) = arg_shape[:-3], arg_shape[-3:]
            per_channel = prove_equal(hh, 1) and prove_equal(ww, 1)
            if per_channel and all(prove_equal(d, 1) for d in lead):
                if prove_equal(ch, shape[1]):
                    return bb.emit(relax.op.reshape(new, [1, flat_shape[1], flat_shape[2], 1]))
        if len(arg_shape) == 4 and all(
            prove_equal(a, b) for a, b in zip(arg_shape, shape, strict=True)
        ):
            return bb.emit(relax.op.reshape(new, flat_shape))
        return None

    def _sink(self, binding: relax.VarBinding) -> bool:
        call, var = binding.value, binding.var
        sunk = [a for a in call.args if isinstance(a, relax.Var) and a in self.flat]
        out_shape = _shape(var)
        if not sunk or out_shape is None:
            return False
        what = f"{op_name(call)} {var.name}"
        _, shape, flat_shape = self.flat[sunk[0]]
        if len(out_shape) != 4 or not all(
            prove_equal(a, b) for a, b in zip(out_shape, shape, strict=True)
        ):
            return skip(logger, what, "its result does not have the convolution's shape")
        if any(not same_dims(self.flat[a][2], flat_shape) for a in sunk):
            return skip(logger, what, "its operands are grouped differently")
        if str(var.ty.dtype) != str(sunk[0].ty.dtype):
            return skip(logger, what, "it changes the dtype")
        args = []
        for arg in call.args:
            if isinstance(arg, relax.Var) and arg in self.flat:
                args.append(self.flat[arg][0])
                continue
            new = self._operand(arg, shape, flat_shape)
            if new is None:
                return skip(logger, what, f"operand {arg} broadcasts other than per channel")
            args.append(new)
        flat_out = self.builder_.emit(
            relax.Call(call.op, args, call.attrs, call.ty_args), name_hint=f"{var.name}_gemm"
        )
        self.flat[var] = (flat_out, shape, flat_shape)
        self._emit_back(var, flat_out, shape)
        return True
