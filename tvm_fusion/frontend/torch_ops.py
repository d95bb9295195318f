"""torch.export converters that apache-tvm 0.27's ``from_exported_program`` gets wrong.

Passed as its ``custom_convert_map`` by :func:`tvm_fusion.frontend.import_exported_program`
(found by ``scripts/fuzz.py --frontend torch``):

- ``arange.start_step`` with a negative integer step: stock emits ``R.arange(a, b, s)``, whose
  0.27 shape inference takes the ceil-division as if the step were positive
  (``arange(n - 1, n - 3, -1)`` is declared, and computed, with 4 elements, not 2: a reversed
  ``x[:, arange(...)]`` gathers the wrong columns). Emitted as ``arange(-a, -b, -s) * -1``
  (a positive step, the same values), which GatherToSlice still reads as a progression.
- ``cross_entropy_loss.default`` (an export imported without decompositions): stock reads
  ``reduction`` and ``ignore_index`` from keywords only (the program passes them positionally:
  ``reduction = 2`` summed, imported as a mean), takes the log-softmax over the last axis
  (the classes are axis 1 of (N, C, d...)) and drops ``label_smoothing``. Emitted as
  torch defines it: ``log_softmax`` over axis 1, ``nll_loss``, plus the smoothing term.
- ``index.Tensor`` with negative integer indices (``x[..., [-1], :]``, Falcon's multi-query
  split of its fused qkv): stock emits ``take(mode="fast")`` / ``index_tensor`` with the
  indices as they are, which read out of bounds where torch counts from the end. Each integer
  index is made non-negative first: a constant one folded at import (unchanged when it has no
  negative entry), another one as ``where(i < 0, i + n, i)`` on an axis of static length ``n``;
  an ``arange`` with a non-negative start and a positive step is left as it is (GatherToSlice
  reads it as a progression). Left to stock: boolean masks, and a non-constant index (or a
  constant one with negative entries) on an axis of symbolic length (logged at debug level).
- Arithmetic and math on integer or boolean tensors, where torch promotes (found by the held-out
  DeBERTa-v2, whose relative-position buckets take ``log(abs_pos / mid)``): stock computes in the
  input's dtype, so ``int / 3``, ``int * 0.5``, ``int + 0.5`` and ``reciprocal(int)`` give
  integers (wrong numbers, silently), ``log``/``exp``/``sigmoid``/``tanh``/``erf``... of an
  integer tensor and ``int ** 0.5`` fail to import, and ``div(int64, 4, rounding_mode=...)``
  (``//`` on a tensor) fails on an ``int32`` constant. The result dtype torch recorded for the
  node (``node.meta["val"]``) is the dtype of the computation for these ops: tensor operands of
  another dtype are cast to it before stock's converter runs (scalars then take it too), and
  ``div.Tensor_mode`` is emitted with operands of that dtype (``floor_divide``, or ``divide``
  that truncates for integers, ``floor``/``trunc`` of ``divide`` for floats). Nodes whose
  operands already have that dtype go to stock's converter unchanged.
- ``repeat.default`` with a symbolic count (``rel_embeddings.repeat(q.size(0) // heads, 1,
  1)``, DeBERTa-v2's attention): stock passes the count to ``relax.op.tile``, which takes
  integers only (the import failed). Emitted as a reshape that puts a unit axis before each
  axis, ``broadcast_to`` the counts on those, and a reshape that merges each pair (a view, a
  broadcast, a view). Integer counts go to stock's ``tile``.

- ``select.int`` with a negative index (``x[..., -1]``, ``hidden[:, -1]``: the last token):
  stock emits ``take`` of the index as it is in ``fast`` mode, which reads out of bounds
  (wrong numbers, silently; found by the fuzzer's ``dtypes`` family). The index is counted
  from the end at import where the axis has a static length, else taken in ``wrap`` mode.
- Comparisons of an integer or boolean tensor with a float scalar (``ids > 2.5``,
  ``ids == -0.5``, ``pos < 0.5``): stock makes the scalar a constant of the tensor's dtype
  (``2.5`` becomes ``2``, so ``2 < 2.5`` is false). The tensor is cast to torch's default
  float dtype first, as torch compares. A boolean tensor compared with an integer
  (``mask == 0``, ``masked_fill``'s condition) is cast to int64: 0.27's LLVM code generator
  emits a float comparison (``fcmp``) for ``equal`` of two booleans (the build failed).
- Arithmetic of a float tensor and a symbolic size (``x / x.shape[1]``): stock passes the
  int64 size as it is (the import failed on mixed dtypes); it is cast to the result dtype.
- ``clamp`` with one scalar bound, or a bound that promotes (``ids.clamp(max=5)``,
  ``torch.clamp(ids, min=0.5)``), and ``clamp_max``: stock fills a missing bound with an
  infinity (an integer tensor's ``clip`` failed in LegalizeOps: "Cannot convert infinity to
  BigInt"), keeps the operand's dtype (``clamp(int, min=0.5)`` is float in torch) and reads
  ``clamp_max``'s bound from the wrong argument (it clamped nothing, silently). Emitted as
  ``maximum`` / ``minimum`` with constants in torch's result dtype; two scalar bounds on an
  operand of that dtype keep stock's ``clip``.
- ``cumsum`` of a boolean or int32 tensor (``cumsum(mask.bool(), 1)`` for position ids):
  torch sums in int64, stock in the input's dtype (int32: the wrong dtype; bool: the build
  failed). The input is cast to torch's result dtype first.
- ``pow`` with an integer result and a tensor exponent (``2 ** ids``, ``ids ** ids``):
  0.27's ``power`` takes floats only (LegalizeOps failed). Computed in float64, rounded and
  cast back (exact below 2 ** 53); a constant non-negative exponent keeps stock's products.
- ``rsub`` with a scalar (``1 - mask``, the float-bias idiom, on int64): stock makes the
  scalar an int32 / float32 constant whatever the tensor's dtype (the import failed on int64,
  float16, float64). Emitted as ``subtract`` of a constant of torch's result dtype.
- ``where.ScalarOther`` / ``where.ScalarSelf`` / ``where.Scalar`` (``torch.where(c, x, 0.0)``
  imported without decompositions): not in stock's table (the import failed). Emitted as
  ``where`` with the scalar a constant of torch's result dtype (tensor operands cast to it).

- ``view.default`` / ``reshape.default`` to symbolic sizes (found by the held-out GPT-BigCode,
  whose multi-query attention views a ``(b, 1, s, 40)`` key as ``(b, s, -1, 20)``): stock's
  identity check compares the two shapes as lists, and an integer size against a symbolic one
  is a TIR expression whose truth value raises (the import failed). Compared size by size
  (integers by value, symbolic sizes structurally; a mix is not an identity) before stock's
  reshape is emitted. Targets of integers only go to stock's converter.

More of them (``slice.Tensor``): ``torch_ops_extra``. Every other form goes to stock's
converter as it is.
"""

from __future__ import annotations

import logging

import tvm_ffi
from tvm import relax, tirx
from tvm.ir import PrimType

from . import torch_index, torch_moe, torch_ops_extra
from .torch_ops_extra import stock as _stock

logger = logging.getLogger(__name__)

_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _arg(node, i: int, name: str, default):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _arange(node, importer) -> relax.Var:
    import torch

    if len(node.args) >= 2:
        start, end = node.args[0], node.args[1]
    else:
        start, end = node.kwargs.get("start", 0), node.args[0]
    step = _arg(node, 2, "step", 1)
    dtype = node.kwargs.get("dtype")
    bounds = [importer.env[b] if isinstance(b, torch.fx.Node) else b for b in (start, end)]
    if (
        not isinstance(step, int)
        or step >= 0
        or any(isinstance(b, float) for b in bounds)
        or (dtype is not None and dtype.is_floating_point)
    ):
        return importer._arange(node)
    dtype = "int64" if dtype is None else importer._convert_data_type(str(dtype), importer.env)
    up = importer.block_builder.emit(relax.op.arange(-bounds[0], -bounds[1], -step, dtype=dtype))
    return importer.block_builder.emit(relax.op.multiply(up, relax.const(-1, dtype)))


def _cross_entropy_loss(node, importer) -> relax.Var:
    bb = importer.block_builder
    preds, targets = importer.env[node.args[0]], importer.env[node.args[1]]
    weight = _arg(node, 2, "weight", None)
    weight = importer.env[weight] if weight is not None else None
    reduction = _arg(node, 3, "reduction", 1)
    reduction = _REDUCTIONS.get(reduction, reduction)
    ignore = int(_arg(node, 4, "ignore_index", -100))
    eps = float(_arg(node, 5, "label_smoothing", 0.0))
    ndim = preds.ty.ndim
    axis = 1 if ndim >= 2 else 0
    logp = bb.emit(relax.op.nn.log_softmax(preds, axis=axis))
    nll = bb.emit(relax.op.nn.nll_loss(logp, targets, weight, reduction, ignore))
    if eps == 0.0:
        return nll
    # torch: (1 - eps) * nll + eps / C * smooth, smooth = -sum_c(w_c * logp_c), ignored
    # elements 0; a mean divides by the kept elements' weight (their count without weights)
    dtype = preds.ty.dtype
    classes = preds.ty.shape.values[axis]
    if not hasattr(classes, "value"):
        raise ValueError("cross_entropy with label_smoothing over a symbolic class count")
    c = int(classes.value)
    kept = bb.emit(relax.op.not_equal(targets, relax.const(ignore, targets.ty.dtype)))
    keptf = bb.emit(relax.op.astype(kept, dtype))
    terms = logp
    if weight is not None:
        shape = [1] * ndim
        shape[axis] = c
        terms = bb.emit(relax.op.multiply(logp, relax.op.reshape(weight, shape)))
    smooth = bb.emit(relax.op.negative(relax.op.sum(terms, axis=[axis])))
    smooth = bb.emit(relax.op.multiply(smooth, keptf))
    if reduction == "sum":
        smooth = bb.emit(relax.op.sum(smooth))
    elif reduction == "mean":
        if weight is not None:
            safe = relax.op.where(kept, targets, relax.op.zeros_like(targets))
            denom = relax.op.multiply(relax.op.take(weight, safe, axis=0), keptf)
        else:
            denom = keptf
        smooth = bb.emit(relax.op.divide(relax.op.sum(smooth), relax.op.sum(denom)))
    return bb.emit(
        relax.op.add(
            relax.op.multiply(nll, relax.const(1.0 - eps, dtype)),
            relax.op.multiply(smooth, relax.const(eps / c, dtype)),
        )
    )


def _result_dtype(node) -> str | None:
    """The dtype torch recorded for ``node``'s (tensor) result, e.g. ``"float32"``."""
    val = node.meta.get("val")
    dtype = getattr(val, "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def _tensor_dtype(expr) -> str | None:
    ty = getattr(expr, "ty", None)
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else None


def _promoted(name: str):
    """Stock's converter of ``name`` on tensor operands cast to torch's result dtype."""

    def convert(node, importer) -> relax.Var:
        import torch

        want = _result_dtype(node)
        saved = {}
        if want is not None:
            args = [*node.args, *node.kwargs.values()]
            for arg in args:
                if not isinstance(arg, torch.fx.Node) or arg in saved:
                    continue
                expr = importer.env.get(arg)
                ty = getattr(expr, "ty", None)
                if isinstance(ty, PrimType):
                    if str(ty.dtype) == want:
                        continue
                    # a symbolic size (``x / x.shape[1]``): stock's operand is the int64 size
                    saved[arg] = expr
                    importer.env[arg] = tirx.Cast(want, expr)
                    continue
                have = _tensor_dtype(expr)
                if have is not None and have != want:
                    saved[arg] = expr
                    importer.env[arg] = importer.block_builder.emit(relax.op.astype(expr, want))
            if saved:
                logger.debug("%s: operands cast to torch's result dtype %s", node, want)
        try:
            return _stock(importer, name)(node)
        finally:
            importer.env.update(saved)

    return convert


def _div_mode(node, importer) -> relax.Var:
    """``div(a, b, rounding_mode=...)`` with both operands in torch's result dtype."""
    import torch

    mode = _arg(node, 2, "rounding_mode", None)
    want = _result_dtype(node)
    if want is None or mode not in (None, "floor", "trunc"):
        return _stock(importer, "div.Tensor_mode")(node)
    bb = importer.block_builder
    operands = []
    for arg in node.args[:2]:
        expr = importer.env.get(arg) if isinstance(arg, torch.fx.Node) else None
        if expr is None and isinstance(arg, bool | int | float):
            expr = relax.const(arg, want)
        if _tensor_dtype(expr) is None:
            return _stock(importer, "div.Tensor_mode")(node)  # a SymInt operand: stock's way
        if _tensor_dtype(expr) != want:
            expr = bb.emit(relax.op.astype(expr, want))
        operands.append(expr)
    a, b = operands
    integer = want.startswith(("int", "uint"))
    if mode == "floor":
        if integer:
            return bb.emit(relax.op.floor_divide(a, b))
        return bb.emit(relax.op.floor(bb.emit(relax.op.divide(a, b))))
    quotient = bb.emit(relax.op.divide(a, b))  # integers: TIR's division truncates
    return quotient if integer or mode is None else bb.emit(relax.op.trunc(quotient))


def _prim(value) -> bool:
    """An integer or a symbolic integer expression (a size from ``sym_size``, ``s // 2``)."""
    return isinstance(value, int) or isinstance(getattr(value, "ty", None), PrimType)


def _repeat(node, importer) -> relax.Var:
    """``x.repeat(*counts)`` with symbolic counts as reshape, broadcast_to, reshape."""
    import torch

    args = importer.retrieve_args(node)
    x, counts = args[0], args[1] if isinstance(args[1], torch.Size | tuple | list) else args[1:]
    counts = list(counts)
    shape = x.ty.shape if isinstance(x.ty, relax.TensorType) else None
    if all(isinstance(c, int) for c in counts) or not hasattr(shape, "values"):
        return _stock(importer, "repeat.default")(node)
    if not all(_prim(c) for c in counts) or len(counts) < len(shape.values):
        logger.debug("repeat: counts %s left to stock", counts)
        return _stock(importer, "repeat.default")(node)
    dims = [1] * (len(counts) - len(shape.values)) + list(shape.values)
    pairs = list(zip(counts, dims, strict=True))
    bb = importer.block_builder
    units = bb.emit(relax.op.reshape(x, [e for _, d in pairs for e in (1, d)]))
    spread = bb.emit(relax.op.broadcast_to(units, [e for pair in pairs for e in pair]))
    return bb.emit(relax.op.reshape(spread, [c * d for c, d in pairs]))


def _static_length(x, axis: int) -> int | None:
    shape = x.ty.shape if isinstance(getattr(x, "ty", None), relax.TensorType) else None
    values = getattr(shape, "values", None)
    if values is None:
        return None
    length = values[axis]
    return int(length) if isinstance(length, int | tirx.IntImm) else None


def _select(node, importer) -> relax.Var:
    """``select(x, dim, i)`` with a negative ``i`` counted from the end (see the docstring)."""
    x, dim, index = importer.env[node.args[0]], node.args[1], node.args[2]
    if not isinstance(index, int) or index >= 0 or not isinstance(x.ty, relax.TensorType):
        return _stock(importer, "select.int")(node)
    dim = dim + x.ty.ndim if dim < 0 else dim
    length = _static_length(x, dim)
    bb = importer.block_builder
    if length is not None:
        return bb.emit(relax.op.take(x, relax.const(index + length, "int64"), dim))
    logger.debug("select: index %d on an axis of symbolic length, taken in wrap mode", index)
    return bb.emit(relax.op.take(x, relax.const(index, "int64"), dim, mode="wrap"))


def _scalar_compare(name: str):
    """Stock's comparison ``name`` of a tensor with a scalar, the tensor cast to the dtype
    torch compares in where stock would go wrong: an integer / bool tensor with a float scalar
    (to the default float dtype), a bool tensor with an integer one (to int64)."""

    def convert(node, importer) -> relax.Var:
        import torch

        a, b = node.args[0], node.args[1]
        expr = importer.env.get(a) if isinstance(a, torch.fx.Node) else None
        have = _tensor_dtype(expr)
        if have is None or have.startswith("float") or not isinstance(b, bool | int | float):
            return _stock(importer, name)(node)
        if isinstance(b, float):
            want = str(torch.get_default_dtype()).removeprefix("torch.")
        elif have == "bool":
            want = "int64"
        else:
            return _stock(importer, name)(node)
        logger.debug("%s: %s tensor cast to %s to compare with %s", node, have, want, b)
        importer.env[a] = importer.block_builder.emit(relax.op.astype(expr, want))
        try:
            return _stock(importer, name)(node)
        finally:
            importer.env[a] = expr

    return convert


def _where_scalar(node, importer) -> relax.Var:
    """``where(c, x, y)`` where ``x`` and / or ``y`` is a Python scalar."""
    import torch

    want = _result_dtype(node)
    cond = importer.env[node.args[0]]
    bb = importer.block_builder
    branches = []
    for arg in node.args[1:3]:
        if isinstance(arg, torch.fx.Node):
            expr = importer.env[arg]
            if want is not None and _tensor_dtype(expr) not in (None, want):
                expr = bb.emit(relax.op.astype(expr, want))
        else:
            expr = relax.const(arg, want or "float32")
        branches.append(expr)
    return bb.emit(relax.op.where(cond, *branches))


def _clamp(name: str):
    """``clamp`` / ``clamp_min`` / ``clamp_max`` with scalar bounds as ``maximum`` /
    ``minimum`` in torch's result dtype (see the docstring); both bounds on an operand of
    that dtype go to stock's ``clip``."""

    def convert(node, importer) -> relax.Var:
        import torch

        if name == "clamp_max.default":
            low, high = None, _arg(node, 1, "max", None)
        else:
            low = _arg(node, 1, "min", None)
            high = _arg(node, 2, "max", None) if name == "clamp.default" else None
        x = importer.env.get(node.args[0])
        have, want = _tensor_dtype(x), _result_dtype(node)
        bounds = [v for v in (low, high) if v is not None]
        if (
            have is None
            or want is None
            or any(isinstance(v, torch.fx.Node) or not isinstance(v, int | float) for v in bounds)
            or (name == "clamp.default" and len(bounds) == 2 and have == want)
        ):
            return _stock(importer, name)(node)
        bb = importer.block_builder
        y = x if have == want else bb.emit(relax.op.astype(x, want))
        if low is not None:
            y = bb.emit(relax.op.maximum(y, relax.const(low, want)))
        if high is not None:
            y = bb.emit(relax.op.minimum(y, relax.const(high, want)))
        return y

    return convert


def _same_size(a, b) -> bool:
    """``a`` and ``b`` are the same size: integers by value, symbolic ones structurally."""
    if isinstance(a, int | tirx.IntImm) and isinstance(b, int | tirx.IntImm):
        return int(a) == int(b)
    if isinstance(a, int | tirx.IntImm) or isinstance(b, int | tirx.IntImm):
        return False
    return bool(tvm_ffi.structural_equal(a, b))


def _reshape(name: str):
    """``x.view(*sizes)`` / ``x.reshape(*sizes)`` to symbolic sizes without stock's list ``==``."""

    def convert(node, importer) -> relax.Var:
        import torch

        args = importer.retrieve_args(node)
        x = args[0]
        dims = list(args[1] if isinstance(args[1], torch.Size | tuple | list) else args[1:])
        shape = importer.shape_of(x)
        if shape is None or all(isinstance(d, int) for d in dims):
            return _stock(importer, name)(node)
        if len(shape) == len(dims) and all(map(_same_size, shape, dims)):
            return x
        return importer._emit_torch_reshape(x, dims)

    return convert


_KINDS = ("Tensor", "Scalar")
_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
_POW_KINDS = ("Scalar", "Tensor_Scalar", "Tensor_Tensor")
# ops whose computation dtype is torch's result dtype (promoted from integer / bool operands)
_PROMOTED = (
    *(f"{op}.{kind}" for op in ("add", "sub", "mul", "div", "rsub") for kind in _KINDS),
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "reciprocal.default",
    *(
        f"{op}.default"
        for op in (
            "exp", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "sigmoid", "erf",
            "sin", "cos", "tan", "tanh", "sinh", "cosh", "asin", "acos", "atan", "asinh",
            "acosh", "atanh",
        )
    ),
)  # fmt: skip


def _integer_pow(name: str):
    """``pow`` whose result torch makes an integer (``2 ** ids``, ``ids ** ids``) in float64,
    rounded and cast back (exact below 2 ** 53); other forms as before."""
    promoted = _promoted(name) if name in _PROMOTED else _stock_of(name)

    def convert(node, importer) -> relax.Var:
        import torch

        want = _result_dtype(node)
        exponent = node.args[1]
        if (
            want is None
            or not want.startswith(("int", "uint"))
            or (name == "pow.Tensor_Scalar" and isinstance(exponent, int) and exponent >= 0)
        ):
            return promoted(node, importer)  # a constant exponent: stock multiplies
        bb = importer.block_builder
        operands = []
        for arg in node.args[:2]:
            if isinstance(arg, torch.fx.Node):
                expr = importer.env[arg]
                if _tensor_dtype(expr) is None:
                    return promoted(node, importer)
                operands.append(bb.emit(relax.op.astype(expr, "float64")))
            elif isinstance(arg, bool | int):
                operands.append(relax.const(arg, "float64"))
            else:
                return promoted(node, importer)
        logger.debug("%s: integer power computed in float64", node)
        power = bb.emit(relax.op.round(bb.emit(relax.op.power(*operands))))
        return bb.emit(relax.op.astype(power, want))

    return convert


def _stock_of(name: str):
    return lambda node, importer: _stock(importer, name)(node)


def _rsub(name: str):
    """``other - x`` (``rsub``) with a scalar ``other`` as a constant of torch's result dtype."""
    promoted = _promoted(name)

    def convert(node, importer) -> relax.Var:
        import torch

        want = _result_dtype(node)
        x, other = node.args[0], node.args[1]
        expr = importer.env.get(x) if isinstance(x, torch.fx.Node) else None
        if (
            want is None
            or _tensor_dtype(expr) is None
            or not isinstance(other, bool | int | float)
            or _arg(node, 2, "alpha", 1) != 1
        ):
            return promoted(node, importer)
        bb = importer.block_builder
        if _tensor_dtype(expr) != want:
            expr = bb.emit(relax.op.astype(expr, want))
        return bb.emit(relax.op.subtract(relax.const(other, want), expr))

    return convert


CONVERTERS = {
    "arange.start_step": _arange,
    "cross_entropy_loss.default": _cross_entropy_loss,
    "div.Tensor_mode": _div_mode,
    "repeat.default": _repeat,
    "view.default": _reshape("view.default"),
    "reshape.default": _reshape("reshape.default"),
    "select.int": _select,
    **{name: _clamp(name) for name in ("clamp.default", "clamp_min.default", "clamp_max.default")},
    "where.ScalarOther": _where_scalar,
    "where.ScalarSelf": _where_scalar,
    "where.Scalar": _where_scalar,
    **{name: _promoted(name) for name in _PROMOTED},
    **{f"{op}.Scalar": _scalar_compare(f"{op}.Scalar") for op in _COMPARISONS},
    **{f"pow.{kind}": _integer_pow(f"pow.{kind}") for kind in _POW_KINDS},
    "cumsum.default": _promoted("cumsum.default"),
    **{f"rsub.{kind}": _rsub(f"rsub.{kind}") for kind in _KINDS},
    **torch_ops_extra.CONVERTERS,
    **torch_moe.CONVERTERS,
}


def converters(program) -> dict:
    """:data:`CONVERTERS` plus those that read ``program``'s lifted constants (``index.Tensor``)."""
    from torch.export.graph_signature import InputKind

    constants = {
        spec.arg.name: program.constants[spec.target]
        for spec in program.graph_signature.input_specs
        if spec.kind == InputKind.CONSTANT_TENSOR and spec.target in program.constants
    }
    return {
        **CONVERTERS,
        "index.Tensor": lambda node, importer: torch_index.index_tensor(node, importer, constants),
    }
