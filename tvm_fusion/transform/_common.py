"""What every pass shares: its logger, the rewrite counter, and small shape helpers.

Passes report what they did through :func:`record_rewrite`; whoever wants the counts (the fusion
report, the CLI, tests) wraps the build in :func:`collect_rewrites`. Near-misses are logged at
debug level through :func:`skip`, so ``TVM_FUSION_LOG=debug`` shows why a pattern did not fire.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterator

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.ir.expr import GenericConst

_COLLECTORS: list[Counter] = []


@contextlib.contextmanager
def collect_rewrites() -> Iterator[Counter]:
    """Count the rewrites made by our passes while the block runs: ``{pass_name: count}``."""
    counter: Counter = Counter()
    _COLLECTORS.append(counter)
    try:
        yield counter
    finally:
        _COLLECTORS.remove(counter)


def record_rewrite(pass_name: str, count: int = 1) -> None:
    if count:
        for counter in _COLLECTORS:
            counter[pass_name] += count


def get_logger(module_name: str) -> logging.Logger:
    return logging.getLogger(module_name)


def skip(logger: logging.Logger, what: str, reason: str) -> bool:
    """Log why a candidate was left alone; returns False so checks can ``return skip(...)``."""
    logger.debug("left alone %s: %s", what, reason)
    return False


# ---------------------------------------------------------------------------------------------
# Relax expression helpers


def op_name(expr) -> str | None:
    """``"relax.<op>"`` of a call to a Relax operator, else None."""
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


def vars_in(expr) -> list:
    """Every Relax variable ``expr`` reads, once per occurrence."""
    found: list = []

    def visit(e):
        if isinstance(e, relax.Var):
            found.append(e)

    relax.analysis.post_order_visit(expr, visit)
    return found


def use_counts(func: relax.Function) -> dict:
    """``var -> occurrences`` of every variable read in ``func``'s body."""
    counts: dict = {}
    for var in vars_in(func.body):
        counts[var] = counts.get(var, 0) + 1
    return counts


# ---------------------------------------------------------------------------------------------
# Struct-info helpers


def tensor_sinfo(expr: relax.Expr) -> relax.TensorType | None:
    sinfo = expr.ty
    return sinfo if isinstance(sinfo, relax.TensorType) else None


def static_shape(expr: relax.Expr) -> list[tirx.Expr] | None:
    """The shape of a tensor expression as PrimExprs, or None when unknown."""
    sinfo = tensor_sinfo(expr)
    if sinfo is None or sinfo.shape is None or not isinstance(sinfo.shape, relax.ShapeExpr):
        return None
    return list(sinfo.shape.values)


def shape_dims(shape: relax.Expr) -> list[tirx.Expr] | None:
    """The dims of a shape value: a ``ShapeExpr``, ``shape_of`` a tensor of known shape, or an
    expression typed as a shape of known dims; None when unknown."""
    if isinstance(shape, relax.ShapeExpr):
        return list(shape.values)
    if op_name(shape) == "relax.shape_of":
        sinfo = shape.args[0].ty
        if isinstance(sinfo, relax.TensorType) and isinstance(sinfo.shape, relax.ShapeExpr):
            return list(sinfo.shape.values)
    sinfo = getattr(shape, "ty", None)
    if isinstance(sinfo, relax.ShapeType) and sinfo.values is not None:
        return list(sinfo.values)
    return None


def const_int(value: tirx.Expr | int) -> int | None:
    if isinstance(value, int):
        return value
    if isinstance(value, tirx.IntImm):
        return int(value.value)
    return None


def as_i64(value) -> tirx.Expr:
    """An int, a NumPy integer or an integer PrimExpr as an int64 PrimExpr."""
    if isinstance(value, int | np.integer):
        return tirx.IntImm("int64", int(value))
    return value if str(value.ty.dtype) == "int64" else tirx.Cast("int64", value)


def prove_equal(a: tirx.Expr | int, b: tirx.Expr | int) -> bool:
    analyzer = tvm.sym.Analyzer()
    return bool(
        analyzer.can_prove_equal(
            tirx.const(a, "int64") if isinstance(a, int) else a,
            tirx.const(b, "int64") if isinstance(b, int) else b,
        )
    )


def prove_equal_shapes(a: tirx.Expr | int, b: tirx.Expr | int) -> bool:
    """``a == b`` for every value of their variables that a shape can take (>= 0).

    Stronger than ``prove_equal``: exporters spell one extent in forms that agree only on
    non-negative sizes (``min(max(s - 1, 0), s)`` and ``min(INT64_MAX, s) - min(1, s)`` are both
    ``s - 1`` for ``s >= 1`` and 0 at ``s = 0``), so each variable is proved at 0 and on
    ``[1, inf)`` separately (at most 4 variables: 16 cases)."""
    a = tirx.const(a, "int64") if isinstance(a, int) else a
    b = tirx.const(b, "int64") if isinstance(b, int) else b
    if prove_equal(a, b):
        return True
    free = {v.name: v for v in tvm.tirx.analysis.undefined_vars(a - b)}
    free = list(free.values())
    if not free or len(free) > 4:
        return False
    for zeros in range(1 << len(free)):
        analyzer = tvm.sym.Analyzer()
        for i, var in enumerate(free):
            if zeros >> i & 1:
                analyzer.bind(var, tirx.const(0, var.ty.dtype))
            else:
                analyzer.bind(var, tvm.ir.Range(1, 1 << 40))
        if not analyzer.can_prove(a - b == 0):
            return False
    return True


def at_most(analyzer, expr: tirx.Expr, bound: tirx.Expr) -> bool:
    """``expr <= bound``, also for ``x // c`` and ``truncdiv(x, c)`` (c >= 1, 0 <= x <= bound),
    which the analyzer does not prove on its own (``n // 2 <= n``)."""
    if analyzer.can_prove(expr <= bound):
        return True
    if (
        isinstance(expr, tirx.FloorDiv | tirx.Div)
        and isinstance(expr.b, tirx.IntImm)
        and expr.b.value >= 1
    ):
        return analyzer.can_prove(expr.a >= 0) and at_most(analyzer, expr.a, bound)
    return False


_BINARY_EXPRS = (
    tirx.Add,
    tirx.Sub,
    tirx.Mul,
    tirx.Div,
    tirx.Mod,
    tirx.FloorDiv,
    tirx.FloorMod,
    tirx.Min,
    tirx.Max,
)


def floor_divisions(analyzer, expr: tirx.Expr) -> tirx.Expr:
    """``expr`` with every ``truncdiv(x, c)`` / ``truncmod(x, c)`` of a provably non-negative
    ``x`` by a constant ``c >= 1`` written as ``x // c`` / ``x % c`` (the same values). ONNX
    ``Div`` of shape numbers is truncating (``T.Div(s, 2)``) while shape inference writes
    ``floor(s/2)``; the analyzer does not prove the two equal, so a binary op of two such
    halves had no known shape and did not build."""
    if not isinstance(expr, _BINARY_EXPRS):
        return expr
    a, b = floor_divisions(analyzer, expr.a), floor_divisions(analyzer, expr.b)
    if (
        isinstance(expr, tirx.Div | tirx.Mod)
        and isinstance(b, tirx.IntImm)
        and b.value >= 1
        and analyzer.can_prove(a >= 0)
    ):
        return tirx.floordiv(a, b) if isinstance(expr, tirx.Div) else tirx.floormod(a, b)
    if a.same_as(expr.a) and b.same_as(expr.b):
        return expr
    return type(expr)(a, b)


def normalize_axis(axis: int, ndim: int) -> int | None:
    if ndim < 0 or not -ndim <= axis < ndim:
        return None
    return axis % ndim


# ---------------------------------------------------------------------------------------------
# Binding-level rewriters (FoldBatchNorm, SplitGroupedConv)


def bound_values(func: relax.Function) -> dict:
    """``var -> value`` of every binding in ``func``'s body."""
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return {}
    return {b.var: b.value for block in body.blocks for b in block.bindings}


def graph_functions(mod) -> list[tuple]:
    """``(gv, func)`` of every Relax function of ``mod`` that is not primitive (a fused group)."""
    return [
        (gv, func)
        for gv, func in list(mod.functions.items())
        if isinstance(func, relax.Function) and not (func.attrs and "Primitive" in func.attrs)
    ]


def rewrite_each_function(mod, make_rewriter, prune_first: bool = False) -> int:
    """Run ``make_rewriter(mod, func)`` (a PyExprMutator counting its rewrites in ``count``)
    over every Relax function of ``mod`` that is not primitive; a function it rewrote is
    stored with its dead bindings removed, with the PrimFuncs the rewriter added to its
    builder (``bb.add_func``). ``prune_first``: remove them before the rewriter reads the
    function too (use counts of the importer's unused items). Returns the count."""
    count = 0
    for gv, func in graph_functions(mod):
        if prune_first:
            func = relax.analysis.remove_all_unused(func)
        rewriter = make_rewriter(mod, func)
        new = rewriter.visit_expr(func)
        if rewriter.count:
            for kernel_gv, kernel in rewriter.builder_.get().functions.items():
                if isinstance(kernel, tirx.PrimFunc) and kernel_gv not in mod.functions:
                    mod[kernel_gv] = kernel
            mod[gv] = relax.analysis.remove_all_unused(new)
            count += rewriter.count
    return count


# ---------------------------------------------------------------------------------------------
# Constant operands of convolutions (FoldBatchNorm, SplitGroupedConv)

CONVS = ("relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d")
# elementwise ops whose operands a layout rewrite may view differently (one value per element:
# what the result's element reads is the same element of each operand, broadcasts aside)
ELEMENTWISE_UNARY = frozenset(
    f"relax.{name}"
    for name in (
        "exp",
        "log",
        "tanh",
        "sigmoid",
        "sqrt",
        "rsqrt",
        "erf",
        "negative",
        "abs",
        "square",
        "sin",
        "cos",
        "floor",
        "ceil",
        "round",
        "sign",
        "astype",
        "clip",
        "nn.relu",
        "nn.gelu",
        "nn.gelu_tanh",
        "nn.silu",
    )
)
ELEMENTWISE_BINARY = frozenset(
    f"relax.{name}"
    for name in ("add", "subtract", "multiply", "divide", "power", "maximum", "minimum", "where")
)


def same_dims(a: list, b: list) -> bool:
    """Two shapes of the same rank whose dims are provably equal."""
    return len(a) == len(b) and all(prove_equal(x, y) for x, y in zip(a, b, strict=True))


# ops whose output holds the input's values in another shape (the importer's bias reshape)
_SAME_VALUES = ("relax.broadcast_to", "relax.reshape", "relax.expand_dims", "relax.squeeze")


def constant_value(expr, bound: dict) -> np.ndarray | None:
    """The value of a constant operand: a constant, a variable bound to one, a
    ``broadcast_to`` / reshape of one to a static shape, or a ``permute_dims`` of one; None for
    anything else."""
    for _ in range(8):
        if isinstance(expr, relax.Var) and expr in bound:
            expr = bound[expr]
        else:
            break
    if isinstance(expr, GenericConst):
        return expr.value.numpy()
    if op_name(expr) == "relax.permute_dims":  # ConvertLayout's view of a constant weight
        value = constant_value(expr.args[0], bound)
        if value is None:
            return None
        axes = expr.attrs.axes
        return np.transpose(value, None if axes is None else [int(a) for a in axes])
    if op_name(expr) in _SAME_VALUES:
        value = constant_value(expr.args[0], bound)
        shape = expr.ty.shape if isinstance(expr.ty, relax.TensorType) else None
        if value is None or shape is None:
            return None
        try:
            dims = [int(d) for d in shape.values]
        except (TypeError, AttributeError):
            return None
        if op_name(expr) == "relax.broadcast_to":
            return np.broadcast_to(value, dims)
        return value.reshape(dims) if value.size == int(np.prod(dims)) else None
    return None


def ints(values) -> list[int]:
    """An attribute's static integers (strides, padding, dilation) as Python ints."""
    return [int(v) for v in values]


_CONV_LAYOUTS = {("NCHW", "OIHW", "NCHW"): "NCHW", ("NHWC", "OHWI", "NHWC"): "NHWC"}


def float32_conv2d_form(conv) -> tuple[str, list[int] | None, str]:
    """``(data layout, input dims as laid out, "")`` of a ``conv2d`` in NCHW / OIHW -> NCHW or
    NHWC / OHWI -> NHWC (what ChannelsLast makes), one group, float32 throughout and a static
    4-D input; else ``("", None, why not)``."""
    attrs = conv.attrs
    layouts = (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout))
    layout = _CONV_LAYOUTS.get(layouts)
    if layout is None:
        return "", None, f"layouts {layouts}"
    if int(attrs.groups) != 1:
        return "", None, f"{int(attrs.groups)} groups"
    x, w = conv.args
    out_dtype = str(attrs.out_dtype) if attrs.out_dtype is not None else ""
    dtypes = {str(x.ty.dtype), str(w.ty.dtype), out_dtype or "float32"} - {"void"}
    if dtypes != {"float32"}:
        return "", None, f"dtypes {sorted(dtypes)}"
    shape = static_shape(x)
    dims = None if shape is None else [const_int(d) for d in shape]
    if dims is None or len(dims) != 4 or None in dims:
        return "", None, "symbolic or unknown input shape"
    return layout, dims, ""


def float32_conv2d(conv, bound: dict) -> tuple[str, list[int] | None, np.ndarray | None, str]:
    """``(data layout, input dims in NCHW order, weight in OIHW, "")`` of a conv2d that
    :func:`float32_conv2d_form` takes, with a constant 4-D weight; else ``("", None, None, why
    not)``."""
    layout, dims, why = float32_conv2d_form(conv)
    if why:
        return "", None, None, why
    weight = constant_value(conv.args[1], bound)
    if weight is None or weight.ndim != 4:
        return "", None, None, "the weight is not a 4-D constant"
    if layout == "NHWC":
        dims = [dims[0], dims[3], dims[1], dims[2]]
        weight = np.ascontiguousarray(weight.transpose(0, 3, 1, 2))
    return layout, dims, weight, ""


def float32_nchw_conv2d(conv, bound: dict) -> tuple[list[int] | None, np.ndarray | None, str]:
    """``(input dims, weight, "")`` of a ``conv2d`` in NCHW / OIHW -> NCHW, one group, float32
    throughout, a static input shape and a constant 4-D weight (StemChannelsLast's
    convolutions); else ``(None, None, why not)``."""
    layout, dims, weight, why = float32_conv2d(conv, bound)
    if not why and layout != "NCHW":
        return None, None, f"layout {layout}"
    return dims, weight, why


def plain_axis(layout: str, letter: str) -> int | None:
    """Where ``letter`` is in a layout without sub-blocks (``NCHW`` -> C at 1), else None."""
    if not layout.isalpha() or not layout.isupper() or layout.count(letter) != 1:
        return None
    return layout.index(letter)
