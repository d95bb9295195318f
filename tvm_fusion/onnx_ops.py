"""ONNX operators apache-tvm 0.27's importer lacks, added to its converter map by
:func:`install` (``load_onnx`` calls it).

- ``SoftmaxCrossEntropyLoss`` (opset 12/13): ``log_softmax(scores, axis=1)`` then
  ``nll_loss(log_prob, labels, weights, reduction, ignore_index)``; the optional second output
  is the log-probabilities (FuseCrossEntropy then leaves the graph alone, as it must).
- ``NegativeLogLikelihoodLoss`` (opset 12/13): ``nll_loss``.

Overrides of stock converters for shapes computed at run time (int64 tensors rather than
constants or shapes), which stock rejects or turns into tensors of unknown shape:

- ``Reshape`` with a computed target (stock: "Reshape requires the input new shape to be
  Shape"): ``tensor_to_shape`` of the target, ``match_cast`` to fresh dims, ONNX's 0 (copy the
  input dim) and -1 (infer) rules written as symbolic expressions over them;
- ``ConstantOfShape`` with an empty shape (a scalar; transformers' attention-mask code): stock
  fails with "broadcast_to expects the input shape to have the number of ndim at least as the
  input tensor's";
- ``ConstantOfShape`` with a computed shape: the same as Reshape, so the result has a
  (symbolic) shape instead of none (stock's breaks a later ``Expand``: "'NoneType' object is
  not iterable");
- ``Expand`` to a constant shape of an input with symbolic dims (stock reads ``dim.value`` of
  every input dim: "'Var' object has no attribute 'value'", as in a Llama block's rotary
  tables).

Both leave a ``tensor_to_shape`` that :class:`~tvm_fusion.transform.PlaceShapeOnHost` then
evaluates symbolically (no kernel, no copy) when the target is computed from shapes, and that
reads a shape input once on the host when it is a graph input. Upstream, the importer should do
this itself (the Expand converter already does it for its dynamic case).

Without ``ignore_index`` ONNX ignores nothing; ``nll_loss`` then gets -100, which no valid
label (``0 <= label < C``) equals. A float16/bfloat16 ``scores`` is kept in its dtype.
"""

from __future__ import annotations

import numpy as np
from tvm import relax, tirx
from tvm.ir.expr import GenericConst
from tvm.relax.frontend.onnx import onnx_frontend as _frontend

_NO_IGNORE = -100


def _attr_str(attr: dict, key: str, default: str) -> str:
    value = attr.get(key, default)
    return value.decode() if isinstance(value, bytes) else str(value)


def _nll(bb, log_prob, labels, weights, attr) -> relax.Expr:
    reduction = _attr_str(attr, "reduction", "mean")
    ignore = int(attr.get("ignore_index", _NO_IGNORE))
    if str(labels.ty.dtype) != "int64":
        labels = bb.normalize(relax.op.astype(labels, "int64"))
    return relax.op.nn.nll_loss(log_prob, labels, weights, reduction, ignore)


class SoftmaxCrossEntropyLoss(_frontend.OnnxOpConverter):
    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        scores, labels = inputs[0], inputs[1]
        weights = inputs[2] if len(inputs) > 2 else None
        log_prob = bb.normalize(relax.op.nn.log_softmax(scores, axis=1))
        loss = _nll(bb, log_prob, labels, weights, attr)
        if attr["tvm_custom"]["num_outputs"] > 1:
            return relax.Tuple([bb.normalize(loss), log_prob])
        return loss


class NegativeLogLikelihoodLoss(_frontend.OnnxOpConverter):
    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        weights = inputs[2] if len(inputs) > 2 else None
        return _nll(bb, inputs[0], inputs[1], weights, attr)


def _fresh_shape(bb, tensor, prefix: str) -> list | None:
    """``tensor_to_shape(tensor)`` matched to fresh dims, or None when its length is unknown."""
    sinfo = tensor.ty
    if not isinstance(sinfo, relax.TensorType) or sinfo.ndim != 1:
        return None
    if not isinstance(sinfo.shape, relax.ShapeExpr):
        return None
    length = sinfo.shape.values[0]
    if not isinstance(length, tirx.IntImm):
        return None
    if str(sinfo.dtype) != "int64":
        tensor = bb.normalize(relax.op.astype(tensor, "int64"))
    shape = bb.emit(relax.op.tensor_to_shape(tensor))
    dims = [tirx.Var(f"{prefix}_{i}", "int64") for i in range(int(length.value))]
    bb.match_cast(shape, relax.ShapeType(dims))
    return dims


def _is_runtime(expr) -> bool:
    return not isinstance(expr, relax.ShapeExpr | GenericConst) and isinstance(
        getattr(expr, "ty", None), relax.TensorType
    )


class Reshape(_frontend.Reshape):
    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, target = inputs[0], _frontend.get_constant(inputs[1], params)
        data_sinfo = getattr(data, "ty", None)
        if not _is_runtime(target) or not isinstance(data_sinfo, relax.TensorType):
            return super()._impl_v13(bb, inputs, attr, params)
        dims = _fresh_shape(bb, target, "reshape_dim")
        in_shape = data_sinfo.shape
        if dims is None or not isinstance(in_shape, relax.ShapeExpr):
            return super()._impl_v13(bb, inputs, attr, params)
        in_dims = list(in_shape.values)
        if not attr.get("allowzero", 0):  # 0 copies the input's dim at the same position
            dims = [
                tirx.Select(d == 0, _i64(in_dims[i]), d) if i < len(in_dims) else d
                for i, d in enumerate(dims)
            ]
        total = _i64(1)
        for d in in_dims:
            total = total * _i64(d)
        known = _i64(1)
        for d in dims:
            known = known * tirx.Select(d == -1, _i64(1), d)
        dims = [tirx.Select(d == -1, tirx.floordiv(total, known), d) for d in dims]
        # Not match_cast to fresh dims: VMShapeLower then checks the Selects under the
        # assumption that dims are >= 0 and rejects a -1 target (seen with flatten_tokens).
        return relax.op.reshape(data, relax.ShapeExpr(dims))


def _fill_value(attr) -> np.ndarray:
    value = attr.get("value")
    return _frontend.get_numpy(value) if value is not None else np.zeros(1, "float32")


class ConstantOfShape(_frontend.ConstantOfShape):
    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        shape = _frontend.get_constant(inputs[0], params)
        if isinstance(shape, GenericConst) and shape.value.numpy().size == 0:
            # an empty shape is a scalar (transformers' attention-mask code); stock
            # broadcasts the 1-element value to rank 0 and fails
            return relax.const(_fill_value(attr).reshape(-1)[0])
        if not _is_runtime(shape):
            return super()._impl_v9(bb, inputs, attr, params)
        dims = _fresh_shape(bb, shape, "fill_dim")
        if dims is None:
            return super()._impl_v9(bb, inputs, attr, params)
        array = _fill_value(attr)
        scalar = relax.const(array.reshape(-1)[0], str(array.dtype))
        return relax.op.broadcast_to(scalar, relax.ShapeExpr(dims))


class Expand(_frontend.Expand):
    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, shape = inputs[0], _frontend.get_constant(inputs[1], params)
        sinfo = getattr(data, "ty", None)
        symbolic = (
            isinstance(shape, GenericConst)
            and isinstance(sinfo, relax.TensorType)
            and isinstance(sinfo.shape, relax.ShapeExpr)
            and not all(isinstance(d, tirx.IntImm) for d in sinfo.shape.values)
        )
        if not symbolic:
            return super()._impl_v13(bb, inputs, attr, params)
        target = [int(t) for t in shape.value.numpy().reshape(-1)]
        dims = list(sinfo.shape.values)
        rank = max(len(target), len(dims))
        dims = [tirx.IntImm("int64", 1)] * (rank - len(dims)) + dims
        target = [1] * (rank - len(target)) + target
        out = []
        for d, t in zip(dims, target, strict=True):
            if t in (-1, 1):
                out.append(d)  # keep the input's dim (it is 1 or broadcasts itself)
            elif isinstance(d, tirx.IntImm) and int(d.value) not in (1, t):
                raise ValueError(f"Expand: cannot broadcast dim {int(d.value)} to {t}")
            else:
                out.append(tirx.IntImm("int64", t))  # a symbolic input dim must be 1 or t
        return relax.op.broadcast_to(data, relax.ShapeExpr(out))


def _i64(value):
    if isinstance(value, int):
        return tirx.IntImm("int64", value)
    return value if str(value.ty.dtype) == "int64" else tirx.Cast("int64", value)


# Stock converters we replace (ours fall back to them for everything but the cases above).
OVERRIDES = {"Reshape": Reshape, "ConstantOfShape": ConstantOfShape, "Expand": Expand}

CONVERTERS = {
    "SoftmaxCrossEntropyLoss": SoftmaxCrossEntropyLoss,
    "NegativeLogLikelihoodLoss": NegativeLogLikelihoodLoss,
}

_INSTALLED = False


def install() -> None:
    """Add :data:`CONVERTERS` to the importer's map (idempotent; stock ones win) and replace
    the stock converters in :data:`OVERRIDES`."""
    global _INSTALLED
    if _INSTALLED:
        return
    original = _frontend._get_convert_map

    def convert_map():
        table = dict(original())
        for name, converter in CONVERTERS.items():
            table.setdefault(name, converter)
        table.update(OVERRIDES)
        return table

    _frontend._get_convert_map = convert_map
    _INSTALLED = True
