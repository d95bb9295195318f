"""Frontends' spellings of cross entropy's pieces, read as the forms FuseCrossEntropy fuses.

Exporters and importers write the same cross entropy in different ops; these helpers say what a
spelling means, so the matcher in :mod:`._cross_entropy_match` handles one form. Nothing here
changes the graph: a spelling that is not recognised is simply not matched.

- ``log(softmax(x, axis))`` (ONNX ``Softmax -> Log``, ``torch.log(torch.softmax(x, -1))``) is
  ``log_softmax(x, axis)`` when the softmax has no other reader (the kernel computes no
  probabilities). The fused value is the log-softmax's: finite where ``softmax`` underflows to 0
  and ``log`` of it gives ``-inf``.
- ``where(t < 0, t + E, t)``, TVM's ONNX importer's normalisation of negative
  ``GatherElements`` indices, with ``E`` the gathered axis' extent ``V``, read as ``t``: the
  kernel itself treats a target ``-V <= t < 0`` as ``t + V``. ``E`` is the importer's
  ``take(shape_to_tensor(shape_of(L)), 1)`` (possibly cast to the indices' dtype) or a constant;
  an ``E`` not provably ``V`` leaves the ``where`` in place (the kernel then reads its result).
- ``shape_of(L)`` (how the importer gets ``E``) reads only the shape of the log-probabilities,
  which is known: it becomes that shape, so it does not keep ``L`` alive.
"""

from __future__ import annotations

from tvm import relax, tirx
from tvm.ir.expr import GenericConst

from ._common import get_logger, op_name, prove_equal, skip

logger = get_logger(__name__)


def log_softmax_source(var: relax.Var, value, var2val, consumers) -> tuple | None:
    """``(x, axis)`` when ``var = value`` is ``log_softmax(x, axis)`` or ``log(softmax(x, axis))``
    with the softmax read by this ``log`` alone, else None. Reshapes to the same shape around
    either (the ONNX importer's opset <= 12 ``Softmax`` / ``LogSoftmax`` flatten a 2-D input
    to itself) are looked through when nothing else reads what they reshape."""
    var, value = _through_views(var, value, var2val, consumers)
    name = op_name(value)
    if name == "relax.nn.log_softmax":
        return _source(value.args[0], var2val), int(value.attrs.axis)
    if name != "relax.log" or not isinstance(value.args[0], relax.Var):
        return None
    probs, softmax = _through_views(value.args[0], var2val.get(value.args[0]), var2val, consumers)
    if op_name(softmax) != "relax.nn.softmax":
        return None
    if not _read_once(value.args[0], consumers):
        skip(logger, f"log(softmax) {var.name}", "the probabilities have other readers")
        return None
    return _source(softmax.args[0], var2val), int(softmax.attrs.axis)


def _through_views(var, value, var2val, consumers) -> tuple:
    """``(var, value)`` past reshapes of ``var`` to its own shape whose input only they read."""
    while _is_same_shape_reshape(value) and isinstance(value.args[0], relax.Var):
        inner = value.args[0]
        if not _read_once(inner, consumers) or inner not in var2val:
            break
        var, value = inner, var2val[inner]
    return var, value


def _source(x, var2val):
    """``x`` past reshapes to its own shape (their input is the same tensor)."""
    while isinstance(x, relax.Var) and _is_same_shape_reshape(var2val.get(x)):
        x = var2val[x].args[0]
    return x


def _is_same_shape_reshape(value) -> bool:
    return op_name(value) == "relax.reshape" and _same_shape(value.args[0], value)


def _read_once(var, consumers) -> bool:
    readers = consumers.get(var, [])
    return len(readers) == 1 and readers[0][0] is not None


def unwrap_negative_index(idx, var2val, v) -> relax.Expr | None:
    """``t`` when ``idx`` is ``where(t < 0, t + E, t)`` with ``E`` provably ``v``, else None."""
    where = var2val.get(idx) if isinstance(idx, relax.Var) else None
    if op_name(where) != "relax.where":
        return None
    cond, wrapped, t = where.args
    cond = _value(cond, var2val)
    wrapped = _value(wrapped, var2val)
    if op_name(cond) != "relax.less" or not cond.args[0].same_as(t) or not _is_zero(cond.args[1]):
        return None
    if op_name(wrapped) != "relax.add":
        return None
    a, b = wrapped.args
    extent = b if a.same_as(t) else a if b.same_as(t) else None
    if extent is None:
        return None
    value = extent_value(extent, var2val)
    if value is None or not prove_equal(value, v):
        skip(logger, f"where {idx.name}", f"adds {value}, not the class count {v}")
        return None
    if t.ty.shape is None or not _same_shape(t, idx):
        return None
    return t


def extent_value(expr, var2val, depth: int = 8):
    """The PrimExpr a scalar int tensor ``expr`` holds: a constant, ``astype`` of one, or
    ``take(shape_to_tensor(shape_of(s)), k)``, the ``k``-th dim of ``s``; None when unknown."""
    if depth == 0:
        return None
    expr = _value(expr, var2val)
    if isinstance(expr, GenericConst):
        data = expr.value.numpy()
        values = set(data.reshape(-1).tolist())
        if len(values) == 1 and data.dtype.kind in "iu":
            return tirx.IntImm("int64", int(values.pop()))
        return None
    name = op_name(expr)
    if name == "relax.astype" and str(expr.attrs.dtype).startswith("int"):
        return extent_value(expr.args[0], var2val, depth - 1)
    if name != "relax.take" or not isinstance(expr.args[1], GenericConst):
        return None
    k = expr.args[1].value.numpy()
    shape = _shape_tensor_dims(_value(expr.args[0], var2val), var2val)
    if shape is None or k.ndim != 0:
        return None
    k = int(k)
    if not -len(shape) <= k < len(shape):
        return None
    return shape[k]


def _shape_tensor_dims(expr, var2val) -> list | None:
    """The dims of ``shape_to_tensor(shape_of(s))`` / ``shape_to_tensor(ShapeExpr)``."""
    if op_name(expr) != "relax.shape_to_tensor":
        return None
    shape = _value(expr.args[0], var2val)
    if op_name(shape) == "relax.shape_of":
        sinfo = shape.args[0].ty
        shape = sinfo.shape if isinstance(sinfo, relax.TensorType) else None
    if isinstance(shape, relax.ShapeExpr):
        return list(shape.values)
    return None


def _value(expr, var2val):
    """The bound value of a variable (once), else the expression itself."""
    if isinstance(expr, relax.Var) and expr in var2val:
        return var2val[expr]
    return expr


def _is_zero(expr) -> bool:
    if not isinstance(expr, GenericConst):
        return False
    data = expr.value.numpy()
    return data.size == 1 and int(data.reshape(-1)[0]) == 0 and data.dtype.kind in "iu"


def _same_shape(a, b) -> bool:
    ta, tb = a.ty, b.ty
    if not isinstance(ta, relax.TensorType) or not isinstance(tb, relax.TensorType):
        return False
    sa, sb = ta.shape, tb.shape
    if not isinstance(sa, relax.ShapeExpr) or not isinstance(sb, relax.ShapeExpr):
        return False
    if len(sa.values) != len(sb.values):
        return False
    return all(prove_equal(x, y) for x, y in zip(sa.values, sb.values, strict=True))
