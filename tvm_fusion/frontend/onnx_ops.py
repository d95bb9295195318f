"""ONNX operators apache-tvm 0.27's importer lacks, added to its converter map by
:func:`install` (``load_onnx`` calls it).

- ``SoftmaxCrossEntropyLoss`` (opset 12/13): ``log_softmax(scores, axis=1)`` then
  ``nll_loss(log_prob, labels, weights, reduction, ignore_index)``; the optional second output
  is the log-probabilities (FuseCrossEntropy then leaves the graph alone, as it must).
- ``NegativeLogLikelihoodLoss`` (opset 12/13): ``nll_loss``.

Overrides of stock converters for shapes computed at run time (int64 tensors rather than
constants or shapes), which stock rejects or turns into tensors of unknown shape:

- ``Reshape`` of a scalar dim (a PrimExpr: stock "expects the input data to be a Tensor");
- ``Reshape`` with a computed target (stock: "Reshape requires the input new shape to be
  Shape"): ``tensor_to_shape`` of the target, ``match_cast`` to fresh dims, ONNX's 0 (copy the
  input dim) and -1 (infer) rules written as symbolic expressions over them, the element
  count checked at run time unless proven (:mod:`~.onnx_reshape_check`);
- ``ConstantOfShape`` with an empty shape (a scalar; transformers' attention-mask code): stock
  fails with "broadcast_to expects the input shape to have the number of ndim at least as the
  input tensor's";
- ``ConstantOfShape`` with a computed shape: the same as Reshape, so the result has a
  (symbolic) shape instead of none (stock's breaks a later ``Expand``: "'NoneType' object is
  not iterable");
- ``Expand`` to a constant shape of an input with symbolic dims (stock reads ``dim.value`` of
  every input dim: "'Var' object has no attribute 'value'", as in a Llama block's rotary
  tables), and to a shape value (stock compares lists of PrimExprs with ``==``: "Cannot use and
  / or / not operator to Expr", DistilBERT's attention mask in a static-shape import), and to
  a shape computed at run time (:func:`~.onnx_fixes.expand_to_runtime_shape`).
- The converters of :mod:`~.onnx_fixes` (stock's wrong numbers for some attribute values).
- ``Slice`` with a symbolic bound (``x[:, n // 2:]`` with ``n`` from ``Shape``): stock assumes
  every such slice in bounds, an end of INT64_MAX included, and declares ``INT64_MAX - n // 2``
  elements (int64 overflow further on). Ends past the axis are cut to its length, negative
  constants count from its end, and a begin or constant end that may pass the axis is
  clamped with ``min`` (:func:`_inbound_bounds`); a symbolic end that cannot be proven within
  the axis keeps stock's promise, as do negative or run-time steps.
- ``Tile`` with repeats computed from shapes (DeBERTa's ``repeat(batch, 1, 1)``): the importer
  refuses a shape value there before any converter runs, so
  :func:`~.onnx_shape_operands.cast_shape_operands` (called by ``load_onnx``) puts a no-op
  int64 ``Cast`` in front, and ``Tile`` becomes reshape / broadcast_to / reshape with symbolic
  dims (stock's ``dyn_tile`` to fresh dims broke FuseTIR); repeats that are data keep stock's
  converter.
- ``Concat`` of shape values with int64 tensors computed at run time: the shape values become
  int64 tensors (stock hands ``relax.concat`` a shape: "expects a Tuple of Tensors").
- ``MatMul`` of batched operands whose batch dims the importer cannot prove equal (the
  TorchScript export of transformers' ``batched_mm`` experts: ``bmm(W[ids], x.unsqueeze(-1))``
  with ``x`` a ``repeat_interleave`` that became ``Tile`` to fresh ``tile_dim`` vars): stock's
  result has no shape, and legalizing it failed with a raw "'NoneType' object is not
  iterable". The second operand is ``match_cast`` to the first's batch dims (ONNX requires them
  equal where neither is 1; a mismatch at run time is then the VM's shape error, never a
  wrong number); a batch dim of 1 (broadcasting) keeps stock's converter.
- ``Clip`` as Relax ``maximum`` / ``minimum`` (stock's import-time kernels keep the import's
  dims, which FuseTIR rejects once PlaceShapeOnHost has bound them).

Both leave a ``tensor_to_shape`` that :class:`~tvm_fusion.transform.PlaceShapeOnHost` then
evaluates symbolically (no kernel, no copy) when the target is computed from shapes, and that
reads a shape input once on the host when it is a graph input. Upstream, the importer should do
this itself (the Expand converter already does it for its dynamic case).

Without ``ignore_index`` ONNX ignores nothing; ``nll_loss`` then gets -100, which no valid
label (``0 <= label < C``) equals. A float16/bfloat16 ``scores`` is kept in its dtype.

:func:`install` also wraps every converter in :class:`~.onnx_known_shapes.KnownShapes` (inputs
the importer lost the shape of get the dims shape inference finds); :func:`stock_from_onnx`
imports with stock's converters only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
from tvm import relax, tirx
from tvm.ir import is_prim_expr
from tvm.ir.expr import GenericConst
from tvm.relax.frontend.onnx import onnx_frontend as _frontend

from ..transform._common import as_i64 as _i64
from ..transform._common import op_name
from . import onnx_known_shapes
from .onnx_attention import Attention as _Attention
from .onnx_dynamic import DYNAMIC as _DYNAMIC
from .onnx_dynamic import fresh_shape as _fresh_shape
from .onnx_fixes import FIXES as _FIXES
from .onnx_fixes import expand_to_runtime_shape
from .onnx_known_shapes import KnownShapes
from .onnx_op_gaps import CONVERTERS as _GAPS
from .onnx_reduce_axes import RUNTIME_AXES as _RUNTIME_AXES
from .onnx_refusals import FIXES as _SUITE_FIXES
from .onnx_reshape_check import checked_input, computed_from_data, resolved_shape
from .onnx_rnn import CONVERTERS as _RNN_CONVERTERS
from .onnx_variadic import CONVERTERS as _VARIADIC

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


def _is_runtime(expr) -> bool:
    return not isinstance(expr, relax.ShapeExpr | GenericConst) and isinstance(
        getattr(expr, "ty", None), relax.TensorType
    )


class Reshape(_frontend.Reshape):
    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, target = inputs[0], _frontend.get_constant(inputs[1], params)
        if is_prim_expr(data):
            # a dim computed as a scalar (``2 * seq``, the dynamo exporter's XLNet): stock
            # fails with "Reshape expects the input data to be a Tensor". To (1,) it is a
            # one-dim shape (the importer's shape ops take it on), to () the scalar itself.
            if isinstance(target, GenericConst):
                size = target.value.numpy().reshape(-1).tolist()
                if size in ([1], [-1]):
                    return relax.ShapeExpr([_i64(data)])
                if size == []:
                    return data
            value = _i64(data)
            data = bb.normalize(relax.op.shape_to_tensor(relax.ShapeExpr([value])))
            inputs = _frontend.onnx_input([data, *inputs[1:]])
        data_sinfo = getattr(data, "ty", None)
        if not _is_runtime(target) or not isinstance(data_sinfo, relax.TensorType):
            return super()._impl_v13(bb, inputs, attr, params)
        dims = _fresh_shape(bb, target, "reshape_dim")
        in_shape = data_sinfo.shape
        if dims is None or not isinstance(in_shape, relax.ShapeExpr):
            return super()._impl_v13(bb, inputs, attr, params)
        in_dims = list(in_shape.values)
        node = attr.get("tvm_custom", {}).get("name") or "(unnamed)"
        x_name = repr(data.name) if isinstance(data, relax.Var) else "its input"
        checked = checked_input(
            bb, data, target, dims, bool(attr.get("allowzero", 0)), f"Reshape {node!r} of {x_name}"
        )
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
        # a 0 among the dims makes ``known`` 0, and the Select computes both branches: a
        # division by 0 killed the process (SIGFPE, ONNX's test_reshape_allowzero_reordered)
        inferred = tirx.floordiv(total, tirx.max(known, _i64(1)))
        dims = [tirx.Select(d == -1, inferred, d) for d in dims]
        # Not match_cast the target to these dims: VMShapeLower then checks the Selects under
        # the assumption that dims are >= 0 and rejects a -1 target (seen with flatten_tokens).
        if checked is not data and computed_from_data(bb, target):
            # a target computed from the data (tensor ops that stay kernels anyway), checked at
            # run time: its dims resolved by tensor ops and matched to fresh vars. The Selects
            # above in the reshape's shape cost dlight and has_reshape_pattern 4-15 s a kernel
            # (the fuzzer's signed targets); matched as a shape, TVM simplifies them under
            # "dims >= 0" and loses the -1. A target that is a model input or comes from shapes
            # keeps the Selects: PlaceShapeOnHost reads it once and computes them on the host.
            shape = resolved_shape(bb, target, in_dims, bool(attr.get("allowzero", 0)))
            return relax.op.reshape(checked, shape)
        # The Selects stay in this one view (the VM computes them on the host) and its output
        # is matched to fresh dims: with the Selects in every consumer's shape, a relu after a
        # model-input target took 170 s to compile (has_reshape_pattern, dlight, lowering).
        # The view's type is left without a shape: R.reshape's own would be simplified under
        # "dims >= 0" (losing the -1) and substituted for the fresh dims.
        out = bb.emit(
            relax.call_pure_packed(
                "vm.builtin.reshape",
                checked,
                relax.ShapeExpr(dims),
                ty_args=relax.TensorType(ndim=len(dims), dtype=data_sinfo.dtype),
            )
        )
        fresh = [tirx.Var(f"reshape_to_{i}", "int64") for i in range(len(dims))]
        return bb.match_cast(out, relax.TensorType(fresh, data_sinfo.dtype))


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
        if (
            isinstance(shape, relax.ShapeExpr)
            and isinstance(sinfo, relax.TensorType)
            and isinstance(sinfo.shape, relax.ShapeExpr)
        ):
            return cls._to_shape(data, list(sinfo.shape.values), list(shape.values))
        symbolic = (
            isinstance(shape, GenericConst)
            and isinstance(sinfo, relax.TensorType)
            and isinstance(sinfo.shape, relax.ShapeExpr)
            and not all(isinstance(d, tirx.IntImm) for d in sinfo.shape.values)
        )
        if not symbolic:
            if _is_runtime(shape):
                out = expand_to_runtime_shape(bb, data, shape)
                if out is not None:
                    return out
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

    @staticmethod
    def _to_shape(data, dims: list, target: list):
        """To a shape value (what a static-shape import folds a computed target to, e.g.
        ``R.shape([2, -1, 5, 5])`` in DistilBERT's mask): stock compares the two lists of
        PrimExprs with ``==``, which raises "Cannot use and / or / not operator to Expr".
        A target dim of -1 or 1 keeps the input's dim."""
        rank = max(len(target), len(dims))
        dims = [tirx.IntImm("int64", 1)] * (rank - len(dims)) + dims
        target = [tirx.IntImm("int64", 1)] * (rank - len(target)) + target
        out = []
        for d, t in zip(dims, target, strict=True):
            if isinstance(t, tirx.IntImm) and int(t.value) in (-1, 1):
                out.append(d)
            elif (
                isinstance(t, tirx.IntImm)
                and isinstance(d, tirx.IntImm)
                and int(d.value) not in (1, int(t.value))
            ):
                raise ValueError(f"Expand: cannot broadcast dim {int(d.value)} to {t}")
            else:
                out.append(t)
        same = len(out) == len(dims) and all(
            o.same_as(d)
            or (isinstance(o, tirx.IntImm) and isinstance(d, tirx.IntImm) and int(o) == int(d))
            for o, d in zip(out, dims, strict=True)
        )
        if same and rank == len(data.ty.shape.values):
            return data
        return relax.op.broadcast_to(data, relax.ShapeExpr(out))


def _shape_values(bb, expr) -> list | None:
    """The numbers of a shape value that reaches an operand as an int tensor (through
    ``astype`` / ``shape_to_tensor`` of a shape, as
    :func:`~.onnx_shape_operands.cast_shape_operands` makes it),
    or None."""
    for _ in range(8):
        if isinstance(expr, relax.ShapeExpr):
            return list(expr.values)
        sinfo = getattr(expr, "ty", None)
        if isinstance(sinfo, relax.ShapeType) and sinfo.values is not None:
            return list(sinfo.values)
        if isinstance(expr, relax.Call) and op_name(expr) in (
            "relax.astype",
            "relax.shape_to_tensor",
        ):
            expr = expr.args[0]
        elif isinstance(expr, relax.Var) and bb.lookup_binding(expr) is not None:
            expr = bb.lookup_binding(expr)
        else:
            return None
    return None


class Tile(_frontend.Tile):
    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        """Repeats given as a shape value (:func:`~.onnx_shape_operands.cast_shape_operands`
        brings it as ``shape_to_tensor(R.shape([...]))``): ``reshape`` to a 1 before each
        repeated dim, ``broadcast_to`` the repeats, ``reshape`` to the products, all with
        symbolic dims.
        Stock makes ``dyn_tile`` to fresh ``tile_dim`` vars, which loses the static dims
        (DeBERTa's head size then reaches ``Sqrt`` as a PrimExpr) and breaks FuseTIR."""
        data, values = inputs[0], _shape_values(bb, inputs[1])
        sinfo = getattr(data, "ty", None)
        if (
            values is not None
            and isinstance(sinfo, relax.TensorType)
            and isinstance(sinfo.shape, relax.ShapeExpr)
        ):
            return cls._symbolic(data, list(sinfo.shape.values), values)
        return super()._impl_v13(bb, inputs, attr, params)

    @staticmethod
    def _symbolic(data, dims: list, reps: list):
        if len(reps) != len(dims):  # ONNX: one repeat per input dim
            raise ValueError(f"Tile: {len(reps)} repeats for a rank-{len(dims)} input")
        one = tirx.IntImm("int64", 1)
        if all(isinstance(r, tirx.IntImm) and int(r.value) == 1 for r in reps):
            return data
        split, wide, out = [], [], []
        for d, r in zip(dims, reps, strict=True):
            split += [one, d]
            wide += [_i64(r), d]
            out.append(_i64(r) * _i64(d))
        view = relax.op.reshape(data, relax.ShapeExpr(split))
        return relax.op.reshape(relax.op.broadcast_to(view, relax.ShapeExpr(wide)), out)


class MatMul(_frontend.MatMul):
    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        """Batch dims of ``b`` cast to ``a``'s where the product has no shape (see the
        module docstring)."""
        a, b = inputs[0], inputs[1]
        a_ty, b_ty = getattr(a, "ty", None), getattr(b, "ty", None)
        if (
            not all(
                isinstance(t, relax.TensorType) and isinstance(t.shape, relax.ShapeExpr)
                for t in (a_ty, b_ty)
            )
            or a_ty.ndim != b_ty.ndim
            or a_ty.ndim < 3
        ):
            return super()._impl_v13(bb, inputs, attr, params)
        product = bb.normalize(relax.op.matmul(a, b))
        if isinstance(product.ty.shape, relax.ShapeExpr):
            return product
        a_dims, b_dims = list(a_ty.shape.values), list(b_ty.shape.values)
        for d in a_dims[:-2] + b_dims[:-2]:
            if isinstance(d, tirx.IntImm) and int(d.value) == 1:
                return product  # broadcasting: stock's
        dims = a_dims[:-2] + b_dims[-2:]
        b = bb.match_cast(b, relax.TensorType(dims, b_ty.dtype, b_ty.vdevice))
        return relax.op.matmul(a, b)


def _is_shape_value(expr) -> bool:
    return isinstance(expr, relax.ShapeExpr) or isinstance(
        getattr(expr, "ty", None), relax.ShapeType
    )


class Concat(_frontend.Concat):
    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        """Shape values concatenated with int64 tensors that are not constants (CLIP's
        TorchScript export: ``Concat(Shape(x), Unsqueeze(Cast(...)))``): each shape value
        becomes the int64 tensor it stands for (``shape_to_tensor``, which PlaceShapeOnHost
        evaluates symbolically) and the result is a tensor. Stock keeps shape values only when
        every input is one or a constant, and otherwise hands ``relax.concat`` a shape ("expects
        the input to be a Tuple of Tensors")."""
        result = super()._impl_v13(bb, inputs, attr, params)
        if not (isinstance(result, relax.Call) and op_name(result) == "relax.concat"):
            return result
        if not any(_is_shape_value(x) for x in inputs):
            return result
        tensors = [relax.op.shape_to_tensor(x) if _is_shape_value(x) else x for x in inputs]
        return relax.op.concat(tensors, axis=attr.get("axis", 0))


class Clip(_frontend.Clip):
    """``maximum`` / ``minimum`` as Relax ops, not stock's ``emit_te`` kernels: a kernel made
    at import keeps the import's dims (``range_len_0`` of a Range with a computed limit), and
    once PlaceShapeOnHost has bound them (to ``seq``) FuseTIR refuses to fuse it with its
    neighbours ("Inconsistent buffers"; DeBERTa's relative-position clamp)."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x = inputs[0]
        dtype = x.ty.dtype
        lo, hi = float(attr.get("min", -np.inf)), float(attr.get("max", np.inf))
        out = relax.op.maximum(x, relax.const(lo, dtype))
        return relax.op.minimum(bb.normalize(out), relax.const(hi, dtype))

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        out = inputs[0]
        if not isinstance(getattr(out, "ty", None), relax.TensorType):
            return super()._impl_v13(bb, inputs, attr, params)
        if inputs[1] is not None:
            lo = cls._sanitize_nan_clip_bound(bb, inputs[1], for_min=True)
            out = bb.normalize(relax.op.maximum(out, lo))
        if inputs[2] is not None:
            hi = cls._sanitize_nan_clip_bound(bb, inputs[2], for_min=False)
            out = bb.normalize(relax.op.minimum(out, hi))
        return out


_TO_THE_END = (1 << 31) - 1  # an end at least this large means "to the end of the axis"


class Slice(_frontend.Slice):
    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        out = super()._impl_v13(bb, inputs, attr, params)
        if not isinstance(out, relax.Call) or op_name(out) != "relax.strided_slice":
            return out
        if not out.attrs.assume_inbound and not all(
            isinstance(v, tirx.IntImm) for a in out.args[2:4] for v in getattr(a, "fields", [None])
        ):
            return out
        # Constant bounds (``labels[:, 1:]``: 1 to INT64_MAX): stock declares
        # ``min(INT64_MAX, seq) - min(1, seq)`` elements, a form FuseTIR's shape matching and the
        # analyzer cannot reduce to ``seq - 1``; the clamped bounds give that directly.
        # Stock sets assume_inbound whenever a bound is symbolic (``Div(Shape(x)[1], 2)``), even
        # with an end of INT64_MAX (``x[:, n // 2:]``): the slice is then declared with
        # ``INT64_MAX - n // 2`` elements, which overflows in the shape arithmetic after it.
        bounds = _inbound_bounds(out)
        if bounds is None:
            return out
        begins, ends = ([relax.prim_value(v) for v in seq] for seq in bounds)
        return relax.op.strided_slice(
            out.args[0], out.args[1], begins, ends, out.args[4], assume_inbound=True
        )


def _inbound_bounds(call: relax.Call) -> tuple[list, list] | None:
    """In-bound (begins, ends) for a ``strided_slice`` that stock declared in bounds, or None
    to keep stock's call (a step that is not a positive constant, a bound that may be
    negative, an unknown input shape). Per axis: an end of at least ``2**31 - 1`` (ONNX's
    INT64_MAX, "to the end") is the axis length and negative constants count from the end; a
    constant end that may pass the axis becomes ``min(end, dim)``; a begin that may pass the
    end becomes ``min(begin, end)`` (ONNX clamps both). A symbolic end that cannot be proven
    within the axis (``position_ids[:, :seq]`` of a 512-row table) keeps stock's promise that
    it is: declaring it ``min(seq, 512)`` would leave every shape after it unknown."""
    from tvm import sym

    from ..transform._common import at_most, floor_divisions

    data = call.args[0]
    sinfo = getattr(data, "ty", None)
    if not isinstance(sinfo, relax.TensorType) or not isinstance(sinfo.shape, relax.ShapeExpr):
        return None
    if len(call.args) < 5 or not all(isinstance(a, relax.Tuple) for a in call.args[1:5]):
        return None
    dims = [_i64(d) for d in sinfo.shape.values]
    analyzer = sym.Analyzer()
    tensor_dims = [v for d in dims for v in tirx.analysis.undefined_vars(d)]
    for var in [
        *tensor_dims,
        *onnx_known_shapes._DIM_VARS.values(),
    ]:  # a tensor's dims are never negative
        analyzer.update(var, sym.ConstIntBound(0, sym.ConstIntBound.POS_INF), override=True)
    axes, begins, ends, strides = (list(a.fields) for a in call.args[1:5])
    new_begins, new_ends = [], []
    for axis, begin, end, stride in zip(axes, begins, ends, strides, strict=True):
        if not isinstance(axis, tirx.IntImm) or not isinstance(stride, tirx.IntImm):
            return None
        if not is_prim_expr(begin) or not is_prim_expr(end) or int(stride.value) <= 0:
            return None
        dim = dims[int(axis.value) % len(dims)]
        begin, end = _i64(begin), _i64(end)
        constant_end = isinstance(end, tirx.IntImm)
        if isinstance(begin, tirx.IntImm) and int(begin.value) < 0:
            begin = dim + begin
        if constant_end and int(end.value) >= _TO_THE_END:
            end = dim
        elif constant_end and int(end.value) < 0:
            end = dim + end
        begin = analyzer.simplify(floor_divisions(analyzer, begin))
        end = analyzer.simplify(floor_divisions(analyzer, end))
        if not (analyzer.can_prove(begin >= 0) and analyzer.can_prove(end >= 0)):
            return None
        if constant_end and not at_most(analyzer, end, dim):
            end = tirx.min(end, dim)
        if not at_most(analyzer, begin, end):
            begin = tirx.min(begin, end)
        new_begins.append(begin)
        new_ends.append(end)
    return new_begins, new_ends


# Stock converters we replace (ours fall back to them for everything but the cases above).
OVERRIDES = {
    "Reshape": Reshape,
    "ConstantOfShape": ConstantOfShape,
    "Expand": Expand,
    "Slice": Slice,
    "Tile": Tile,
    "MatMul": MatMul,
    "Clip": Clip,
    "Concat": Concat,
    **_FIXES,  # wrong numbers for some attribute values (onnx_fixes.py)
    **_GAPS,  # forms stock refuses: MaxPool Indices, integer Pow, run-time CumSum axis
    **_DYNAMIC,  # Size, Pad, Split with operands known at run time (onnx_dynamic.py)
    **_SUITE_FIXES,  # the same, found by the whole node suite (onnx_refusals.py)
    **_RUNTIME_AXES,  # Reduce* with axes given at run time (onnx_reduce_axes.py)
    **_VARIADIC,  # Sum / Mean as elementwise adds, not stack + reduce (onnx_variadic.py)
    "Attention": _Attention,  # opset 23's, not com.microsoft's (onnx_attention.py)
}

CONVERTERS = {
    "SoftmaxCrossEntropyLoss": SoftmaxCrossEntropyLoss,
    "NegativeLogLikelihoodLoss": NegativeLogLikelihoodLoss,
    **_RNN_CONVERTERS,  # LSTM, GRU, RNN (onnx_rnn.py)
}

_INSTALLED = False
_STOCK_MAP = None  # the importer's own _get_convert_map, once install() replaced it


def install() -> None:
    """Add :data:`CONVERTERS` to the importer's map (idempotent; stock ones win), replace
    the stock converters in :data:`OVERRIDES`, and give every converter known input shapes
    (:class:`~.onnx_known_shapes.KnownShapes`)."""
    global _INSTALLED, _STOCK_MAP
    if _INSTALLED:
        return
    original = _STOCK_MAP = _frontend._get_convert_map

    def convert_map():
        table = dict(original())
        for name, converter in CONVERTERS.items():
            table.setdefault(name, converter)
        table.update(OVERRIDES)
        return {name: KnownShapes(converter) for name, converter in table.items()}

    _frontend._get_convert_map = convert_map
    _INSTALLED = True


def stock_from_onnx(model):
    """Stock TVM's ONNX importer as a user calls it, without our converters (benchmarks and
    tutorials show what it makes of a model); the lines it prints are silenced."""
    import io
    import warnings

    with (
        stock_converters(),
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        return _frontend.from_onnx(model, keep_params_in_input=False)


@contextlib.contextmanager
def stock_converters() -> Iterator[None]:
    """While inside, TVM's importer uses its own converters only (benchmarks of stock TVM)."""
    if not _INSTALLED:
        yield
        return
    ours = _frontend._get_convert_map
    _frontend._get_convert_map = _STOCK_MAP
    try:
        yield
    finally:
        _frontend._get_convert_map = ours
