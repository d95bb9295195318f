"""ONNX converters for operands that are known at run time only (issue #40), registered in
:data:`~.onnx_ops.OVERRIDES` by :data:`DYNAMIC`.

- ``Size`` of a value whose shape is known (a shape value: ``Size(Shape(x))`` is ``x``'s rank,
  as in the function-expanded LayerNormalization): a constant, so that the shape arithmetic
  after it (``Sub``, ``ConstantOfShape``, ``Concat``) folds and ``Reshape`` gets a shape
  (stock: ``relax.op.size`` at run time, then "Reshape requires the input new shape to be
  Shape").
- ``Pad`` with ``pads`` (and ``constant_value``, ``axes``) given at run time (stock: "Dynamic
  pads are not supported yet", or "'Var' object has no attribute 'value'"): the pads (and
  axes) become shape values (``tensor_to_shape``, ``match_cast`` to fresh dims), and one TE
  kernel with symbolic widths pads in mode constant / edge / reflect / wrap; negative pads
  crop first, as ONNX's reference does. What the mode needs (reflect: a width below the
  cropped extent; edge / wrap: a non-empty extent; every mode: a crop no larger than the
  extent, axes in range and distinct) is checked at run time by a kernel that raises
  ``ValueError`` naming the node before the pad runs. Constant pads keep stock's converter.
- ``Split`` with ``split`` sizes given at run time (stock: "Dynamic Split not yet supported"):
  the sizes become shape values and each part is a TE copy of its symbolic range; a run-time
  check raises ``ValueError`` unless every size is >= 0 and they add up to the axis's extent.
  Zero-sized parts are empty tensors.

Run-time operands that are data (graph inputs, values computed from data) first go through a
small int kernel of their own (:func:`_mapped`) that maps every value to one >= 0 (pads split
into grow / crop parts, axes counted from 0 with an out-of-range one as ``rank``, a negative
split size as ``2**40``): shape vars are taken as >= 0 by TVM's simplifier, and
PlaceShapeOnHost evaluates Relax ops over a graph input read into such vars (``less(v, 0)``
there is false: a first version of this converter padded nothing for
``test_constant_pad_negative_axes``).
Operands computed from shapes stay symbolic, with no kernel.

The checks are ``call_tir_inplace`` kernels that only assert (as CheckGatherBounds' span
check): in place on the data, which they do not touch, so the kernel after them depends on
them and neither dead-code elimination nor reordering drops them (``R.assert_op`` is impure,
not allowed in the importer's dataflow block). A condition that the dims' being >= 0 proves
gets no kernel; one that is false at import is refused (``ModelError``). Built for CUDA the
modules compile; they were not run on a GPU.
"""

from __future__ import annotations

import numpy as np
from tvm import relax, sym, te, tirx
from tvm.ir import is_prim_expr
from tvm.ir.expr import GenericConst
from tvm.relax.frontend.onnx import onnx_frontend as _frontend

from ..check_kernels import Buf, assert_kernel, shape_vars
from ..errors import ModelError
from ..transform._common import as_i64 as _i64
from ..transform._common import op_name


def _const_ints(expr) -> list[int] | None:
    if isinstance(expr, GenericConst):
        return [int(v) for v in expr.value.numpy().reshape(-1)]
    return None


def _shape_dims(bb, expr, prefix: str) -> list | None:
    """The numbers of the int 1-D tensor ``expr`` as int64 PrimExprs: constants, the values of
    a shape value it was made from (``shape_to_tensor`` / ``astype``), or fresh dims matched
    to ``tensor_to_shape(expr)`` at run time; None when its length is unknown."""
    ints = _const_ints(expr)
    if ints is not None:
        return [_i64(v) for v in ints]
    values = _shape_value(bb, expr)
    if values is not None:
        return [_i64(v) for v in values]
    return fresh_shape(bb, expr, prefix)


def fresh_shape(bb, tensor, prefix: str) -> list | None:
    """``tensor_to_shape(tensor)`` matched to fresh dims, or None when its length is unknown
    (also the importer's Reshape / ConstantOfShape to a run-time target, onnx_ops)."""
    sinfo = getattr(tensor, "ty", None)
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


def _static(bb, expr) -> bool:
    """Whether the numbers of ``expr`` are constants or a shape value's (not run-time data)."""
    return isinstance(expr, GenericConst) or _shape_value(bb, expr) is not None


def _shape_value(bb, expr) -> list | None:
    """The values of the shape value ``expr`` was made from (through ``shape_to_tensor`` /
    ``astype``, as ``cast_shape_operands`` hands it over), or None."""
    for _ in range(8):
        if isinstance(expr, relax.ShapeExpr):
            return list(expr.values)
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


def _i64_tensor(bb, expr):
    if str(expr.ty.dtype) != "int64":
        return bb.normalize(relax.op.astype(expr, "int64"))
    return expr


def _mapped(bb, tensor, fn):
    """``fn`` of every element of the 1-D int tensor ``tensor`` (as int64), in a kernel of its
    own. Shape vars are taken as >= 0 by the simplifier, and PlaceShapeOnHost evaluates the
    Relax ops of a shape chain over such vars (a graph input read into dims): ``less(v, 0)``
    there is false. ``fn`` maps every value to one >= 0 before it becomes dims, and the
    kernel is opaque to that evaluation (it reads the kernel's result instead)."""
    tensor = _i64_tensor(bb, tensor)

    def kernel(t):
        return te.compute(t.shape, lambda i: fn(t[i]), name="operand")

    return bb.emit_te(kernel, tensor, primfunc_name_hint="runtime_operand")


def _bound(bb, exprs: list, prefix: str) -> list:
    """``exprs`` with every one that is neither a constant nor a dim replaced by a fresh dim
    bound to its value at run time (kernel shapes stay plain dims)."""
    todo = [i for i, e in enumerate(exprs) if not isinstance(e, tirx.IntImm | tirx.Var)]
    if not todo:
        return list(exprs)
    fresh = [tirx.Var(f"{prefix}_{i}", "int64") for i in todo]
    shape = bb.emit(relax.ShapeExpr([exprs[i] for i in todo]))
    bb.match_cast(shape, relax.ShapeType(fresh))
    out = list(exprs)
    for i, v in zip(todo, fresh, strict=True):
        out[i] = v
    return out


def _check(bb, data, ok, message: str):
    """``data`` after a run-time check that raises ``ValueError: message`` unless the PrimExpr
    ``ok`` holds (nothing when it is a constant true; a constant false is refused now)."""
    # every dim here holds a value >= 0 (the input's dims; the run-time operands mapped to
    # values >= 0 by _mapped before they became dims): what that proves needs no check
    analyzer = sym.Analyzer()
    known = _all([v >= 0 for v in tirx.analysis.undefined_vars(ok)])
    with analyzer.constraint_scope(known):
        ok = analyzer.simplify(tirx.Cast("int64", ok))
    if isinstance(ok, tirx.IntImm):
        if int(ok.value):
            return data
        raise ModelError(message)
    sinfo = data.ty
    x = Buf("x", shape_vars("x", sinfo.ndim), str(sinfo.dtype))
    kernel = assert_kernel("check_operands", [x], ["ok"], "ok == T.int64(1)", message, "ValueError")
    gv = bb.add_func(kernel, "check_operands")
    return bb.emit(relax.call_tir_inplace(gv, (data, relax.prim_value(ok)), 0, sinfo))


def _simplify(expr):
    return sym.Analyzer().simplify(expr)


def _all(conds: list):
    out = tirx.const(True, "bool")
    for c in conds:
        out = tirx.And(out, c)
    return out


def _dims_of(data) -> list | None:
    sinfo = getattr(data, "ty", None)
    if not isinstance(sinfo, relax.TensorType) or not isinstance(sinfo.shape, relax.ShapeExpr):
        return None
    return [_i64(d) for d in sinfo.shape.values]


def _node(attr) -> str:
    name = attr.get("tvm_custom", {}).get("name") if isinstance(attr, dict) else None
    return repr(name) if name else "(unnamed)"


class Size(_frontend.Size):
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        data = inputs[0]
        if isinstance(data, relax.ShapeExpr):
            return relax.const(len(data.values), "int64")
        sinfo = getattr(data, "ty", None)
        if isinstance(sinfo, relax.ShapeType) and sinfo.ndim >= 0:
            return relax.const(int(sinfo.ndim), "int64")
        dims = _dims_of(data)
        if dims is not None and all(isinstance(d, tirx.IntImm) for d in dims):
            return relax.const(int(np.prod([int(d.value) for d in dims])), "int64")
        return super()._impl_v1(bb, inputs, attr, params)


class Pad(_frontend.Pad):
    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        return cls._dynamic(bb, inputs, attr, params, ("constant", "edge", "reflect"), 11)

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        return cls._dynamic(bb, inputs, attr, params, ("constant", "edge", "reflect"), 18)

    @classmethod
    def _impl_v19(cls, bb, inputs, attr, params):
        return cls._dynamic(bb, inputs, attr, params, ("constant", "edge", "reflect", "wrap"), 19)

    @classmethod
    def _dynamic(cls, bb, inputs, attr, params, modes, version):
        data = inputs[0]
        pads = _frontend.get_constant(inputs[1], params)
        value = _frontend.get_constant(inputs[2], params) if len(inputs) > 2 else None
        axes = _frontend.get_constant(inputs[3], params) if len(inputs) > 3 else None
        runtime = any(
            e is not None and not isinstance(e, GenericConst) for e in (pads, value, axes)
        )
        stock = {11: super()._impl_v11, 18: super()._impl_v18, 19: super()._impl_v19}[version]
        if not runtime:
            return stock(bb, inputs, attr, params)
        node = f"Pad {_node(attr)}"
        mode = attr.get("mode", b"constant")
        mode = mode.decode() if isinstance(mode, bytes) else str(mode)
        if mode not in modes:
            raise ModelError(f"{node}: mode {mode!r} is not one of {', '.join(modes)}")
        dims = _dims_of(data)
        if dims is None:
            raise ModelError(f"{node}: pads given at run time need the input's rank")
        rank = len(dims)
        zero = _i64(0)
        # shape vars are taken as >= 0 by the simplifier: a run-time tensor's signs are
        # split before it becomes dims (widths into grow / crop parts, axes counted from 0)
        if _static(bb, pads):
            widths = _shape_dims(bb, pads, "pad") or []
            grow = [_simplify(tirx.max(w, zero)) for w in widths]
            crop = [_simplify(tirx.max(-w, zero)) for w in widths]
        else:
            grow = _shape_dims(bb, _mapped(bb, pads, lambda v: tirx.max(v, 0)), "pad_grow")
            crop = _shape_dims(bb, _mapped(bb, pads, lambda v: tirx.max(-v, 0)), "pad_crop")
        if grow is None or crop is None:
            raise ModelError(f"{node}: pads given at run time need a known length")
        conds = []
        if axes is None:
            normal = [_i64(a) for a in range(rank)]
        elif _static(bb, axes):
            normal = []
            for a in _shape_dims(bb, axes, "pad_axis") or []:
                a = _simplify(a)
                if not isinstance(a, tirx.IntImm) or not -rank <= int(a.value) < rank:
                    raise ModelError(f"{node}: axes must be constants in [-{rank}, {rank})")
                normal.append(_i64(int(a.value) % rank))
        else:

            def count(v):  # from 0; out of range: rank
                v = tirx.Select(v < 0, v + rank, v)
                return tirx.Select(tirx.Or(v < 0, v >= rank), _i64(rank), v)

            normal = _shape_dims(bb, _mapped(bb, axes, count), "pad_axis")
            if normal is None:
                raise ModelError(f"{node}: axes given at run time need a known length")
            conds += [n < rank for n in normal]
        if len(grow) != 2 * len(normal):
            raise ModelError(
                f"{node}: {len(grow)} pads for {len(normal)} axes (expected twice as many)"
            )
        for i in range(len(normal)):
            for j in range(i):
                conds.append(normal[i] != normal[j])
        k = len(normal)
        parts = {"grow_b": [], "grow_a": [], "crop_b": [], "crop_a": []}
        for d in range(rank):
            for name, values in (("grow", grow), ("crop", crop)):
                b, e = zero, zero
                for i, a in enumerate(normal):
                    hit = _simplify(a == d)
                    if isinstance(hit, tirx.IntImm):
                        b, e = (values[i], values[k + i]) if int(hit.value) else (b, e)
                    else:
                        b = tirx.Select(hit, values[i], b)
                        e = tirx.Select(hit, values[k + i], e)
                parts[f"{name}_b"].append(_simplify(b))
                parts[f"{name}_a"].append(_simplify(e))
        grow_b, grow_a, crop_b, crop_a = (
            _bound(bb, parts[n], f"pad_{n}") for n in ("grow_b", "grow_a", "crop_b", "crop_a")
        )
        # negative widths crop first (ONNX's reference), then the rest pads the cropped extent
        off = crop_b
        kept = [_simplify(n - cb - ca) for n, cb, ca in zip(dims, crop_b, crop_a, strict=True)]
        for m, gb, ga in zip(kept, grow_b, grow_a, strict=True):
            conds.append(m >= 0)
            if mode == "reflect":
                conds.append(tirx.Or(gb == 0, gb < m))
                conds.append(tirx.Or(ga == 0, ga < m))
            elif mode in ("edge", "wrap"):
                conds.append(tirx.Or(gb + ga == 0, m > 0))
        need = {
            "constant": "crops no larger than the input",
            "edge": "crops no larger than the input, a non-empty axis to pad",
            "wrap": "crops no larger than the input, a non-empty axis to pad",
            "reflect": "crops no larger than the input, pads smaller than the axis",
        }[mode]
        message = f"{node} (mode {mode}): pads/axes given at run time out of range: needs {need}"
        data = _check(bb, data, _all(conds), message)
        fill = cls._fill(bb, value, data)
        args = [data] if not isinstance(fill, relax.Expr) else [data, fill]

        def kernel(x, *rest):
            fill_value = rest[0][()] if rest else tirx.const(fill, str(data.ty.dtype))
            out_shape = [
                _simplify(m + gb + ga) for m, gb, ga in zip(kept, grow_b, grow_a, strict=True)
            ]

            def at(*idx):
                src, inside = [], tirx.const(True, "bool")
                for d, i in enumerate(idx):
                    m, gb, o = kept[d], grow_b[d], off[d]
                    if _is_zero(gb) and _is_zero(grow_a[d]):
                        src.append(i + o)
                        continue
                    j = i - gb
                    last = tirx.max(m - 1, zero)
                    if mode == "constant":
                        inside = tirx.And(inside, tirx.And(j >= 0, j < m))
                        j = tirx.min(tirx.max(j, zero), last)
                    elif mode == "edge":
                        j = tirx.min(tirx.max(j, zero), last)
                    elif mode == "reflect":
                        j = tirx.Select(j < 0, -j, tirx.Select(j >= m, 2 * last - j, j))
                        j = tirx.min(tirx.max(j, zero), last)
                    else:  # wrap
                        j = tirx.floormod(j, tirx.max(m, _i64(1)))
                    src.append(o + j)
                v = x(*src)
                if mode == "constant":
                    return tirx.if_then_else(inside, v, fill_value)
                return v

            return te.compute(out_shape, at, name="pad")

        return bb.emit_te(kernel, *args, primfunc_name_hint="dynamic_pad")

    @staticmethod
    def _fill(bb, value, data):
        """The constant of mode constant: a Python number, or a 0-d tensor read in the
        kernel when it comes at run time."""
        if value is None:
            return 0
        if isinstance(value, GenericConst):
            return value.value.numpy().reshape(-1)[0].item()
        sinfo = getattr(value, "ty", None)
        if not isinstance(sinfo, relax.TensorType) or sinfo.ndim not in (0, 1):
            raise ModelError("Pad: constant_value given at run time must be a scalar")
        if str(sinfo.dtype) != str(data.ty.dtype):
            value = bb.normalize(relax.op.astype(value, str(data.ty.dtype)))
        if sinfo.ndim == 1:
            value = bb.normalize(relax.op.reshape(value, relax.ShapeExpr([])))
        return value


def _is_zero(e) -> bool:
    return isinstance(e, tirx.IntImm) and int(e.value) == 0


class Split(_frontend.Split):
    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        sizes = inputs[1] if len(inputs) > 1 else None
        if sizes is not None:
            sizes = _frontend.get_constant(sizes, params)
        if sizes is None or isinstance(sizes, GenericConst) or is_prim_expr(sizes):
            return super()._impl_v13(bb, inputs, attr, params)
        data = inputs[0]
        node = f"Split {_node(attr)}"
        dims = _dims_of(data)
        if not _static(bb, sizes):
            # shape vars are taken as >= 0: a negative size becomes one no sum can match
            sizes = _mapped(bb, sizes, lambda v: tirx.Select(v < 0, _i64(1 << 40), v))
        parts = _shape_dims(bb, sizes, "split")
        if dims is None or parts is None:
            raise ModelError(f"{node}: split sizes given at run time need the input's shape")
        axis = int(attr.get("axis", 0))
        if not -len(dims) <= axis < len(dims):
            raise ModelError(f"{node}: axis {axis} out of range for rank {len(dims)}")
        axis %= len(dims)
        outputs = attr.get("tvm_custom", {}).get("num_outputs")
        if outputs is not None and int(outputs) != len(parts):
            raise ModelError(f"{node}: {len(parts)} split sizes for {outputs} outputs")
        total = _i64(0)
        conds = []
        for p in parts:
            conds.append(p >= 0)
            total = total + p
        conds.append(total == dims[axis])
        message = (
            f"{node} (axis {axis}): split sizes given at run time must be >= 0 and add up "
            "to the axis's extent"
        )
        data = _check(bb, data, _all(conds), message)
        results, start = [], _i64(0)
        for i, p in enumerate(parts):
            begin = _simplify(start)

            def kernel(x, begin, p=p):
                shape = [p if d == axis else n for d, n in enumerate(dims)]

                def at(*idx):
                    return x(*[i + begin if d == axis else i for d, i in enumerate(idx)])

                return te.compute(shape, at, name="split")

            results.append(bb.emit_te(kernel, data, begin, primfunc_name_hint=f"dynamic_split_{i}"))
            start = start + p
        return relax.Tuple(results)

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        return cls._impl_v13(bb, inputs, attr, params)


DYNAMIC = {"Size": Size, "Pad": Pad, "Split": Split}
