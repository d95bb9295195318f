"""ONNX reductions whose ``axes`` are known at run time only, registered in
:data:`~.onnx_ops.OVERRIDES` by :data:`RUNTIME_AXES` over the converters they extend.

Stock's ``Reduce*`` converters (opset 13 / 18: ``axes`` an input) assert "Only constant axes
currently supported": a graph input or a computed ``axes`` was refused (126 of ONNX's node
cases). Here the input's rank is known, so the axes become dims (:mod:`.onnx_dynamic`'s
``_mapped``: counted from 0, an out-of-range one as the rank) and one TE kernel reduces over
every axis with a symbolic extent: the input's extent where the axis is reduced, 1 where it
is not, the output index taken from the kept axes (with ``keepdims=0``: the ``m``-th kept axis
is the ``m``-th output one). The output dims are bound to fresh dims at run time. A run-time
check raises ``ValueError`` naming the node unless every axis is in ``[-r, r)`` and the axes
are distinct. An empty ``axes`` (static length 0) reduces every axis, or nothing with
``noop_with_empty_axes``.

Reducers start from ONNX's identities (the empty set: 0 for sums, 1 for products, -inf / +inf
for float max / min, the dtype's limits for integers; a mean of nothing is NaN), and
``ReduceL2`` / ``ReduceLogSum`` / ``ReduceLogSumExp`` / ``ReduceMean`` of integers are refused
(ONNX's reference computes them in float and truncates). Constant axes keep the converters
these extend (stock's, and ``onnx_refusals``' ReduceMax / ReduceMin).
"""

from __future__ import annotations

from tvm import relax, te, tirx
from tvm.ir.expr import GenericConst
from tvm.relax.frontend.onnx import onnx_frontend as _frontend

from ..errors import ModelError
from ..transform._common import as_i64 as _i64
from .onnx_dynamic import _all, _bound, _check, _dims_of, _mapped, _node, _shape_dims, _simplify
from .onnx_refusals import FIXES as _REFUSAL_FIXES

# op -> (what each element contributes, reducer, what the result becomes, float only)
_OPS = {
    "ReduceSum": ("x", "sum", "r", False),
    "ReduceSumSquare": ("x*x", "sum", "r", False),
    "ReduceL1": ("abs", "sum", "r", False),
    "ReduceL2": ("x*x", "sum", "sqrt", True),
    "ReduceMean": ("x", "sum", "mean", True),
    "ReduceLogSum": ("x", "sum", "log", True),
    "ReduceLogSumExp": ("exp", "sum", "log", True),
    "ReduceProd": ("x", "prod", "r", False),
    "ReduceMax": ("x", "max", "r", False),
    "ReduceMin": ("x", "min", "r", False),
}


def _identity(kind: str, dtype: str, bool_in: bool):
    """The reducer's start: 0 / 1 for sums / products, -inf / +inf for float max / min, the
    dtype's limits for integers (False / True for booleans, computed as int8)."""
    if kind == "sum":
        return tirx.const(0, dtype)
    if kind == "prod":
        return tirx.const(1, dtype)
    if bool_in:
        return tirx.const(0 if kind == "max" else 1, dtype)
    if dtype.startswith(("float", "bfloat")):
        return tirx.const(float("-inf") if kind == "max" else float("inf"), dtype)
    return tirx.min_value(dtype) if kind == "max" else tirx.max_value(dtype)


def _reducer(kind: str, dtype: str, bool_in: bool):
    start = _identity(kind, dtype, bool_in)
    combine = {
        "sum": lambda a, b: a + b,
        "prod": lambda a, b: a * b,
        "max": lambda a, b: tirx.max(a, b),
        "min": lambda a, b: tirx.min(a, b),
    }[kind]
    return te.comm_reducer(combine, lambda t: start, name=kind)


def _reduce(bb, op: str, data, axes, attr) -> relax.Expr:
    """``op`` of ``data`` over the run-time ``axes`` (see the module docstring)."""
    node = f"{op} {_node(attr)}"
    element, kind, finish, float_only = _OPS[op]
    dims = _dims_of(data)
    if dims is None:
        raise ModelError(f"{node}: axes given at run time need the input's rank")
    dtype = str(data.ty.dtype)
    if float_only and not dtype.startswith(("float", "bfloat")):
        raise ModelError(f"{node}: axes given at run time, of {dtype} (floats only)")
    rank = len(dims)

    def count(v):  # from 0; out of range: rank
        v = tirx.Select(v < 0, v + rank, v)
        return tirx.Select(tirx.Or(v < 0, v >= rank), tirx.IntImm("int64", rank), v)

    if _empty(axes, attr):
        normal = []
    else:
        normal = _shape_dims(bb, _mapped(bb, axes, count), "reduce_axis")
    if normal is None:
        raise ModelError(f"{node}: axes given at run time need a known length")
    if not normal and int(attr.get("noop_with_empty_axes", 0)):
        return data
    if normal:
        conds = [a < rank for a in normal]
        conds += [normal[i] != normal[j] for i in range(len(normal)) for j in range(i)]
        data = _check(bb, data, _all(conds), f"{node}: axes out of [-{rank}, {rank}) or repeated")
    keep = int(attr.get("keepdims", 1)) != 0
    kept = rank if keep else rank - (len(normal) if normal else rank)
    one, zero = tirx.IntImm("int64", 1), tirx.IntImm("int64", 0)

    def plan(axis_vars, dims):
        """Per input axis: reduced?, the reduction's extent, its place among the kept axes."""
        if axis_vars:
            flags = [_simplify(_any([a == j for a in axis_vars])) for j in range(rank)]
        else:
            flags = [tirx.const(True, "bool")] * rank
        extents = [_simplify(tirx.Select(f, d, one)) for f, d in zip(flags, dims, strict=True)]
        before = [sum((tirx.Cast("int64", f) for f in flags[:j]), zero) for j in range(rank)]
        return flags, extents, [_simplify(j - b) for j, b in enumerate(before)]

    flags, _, position = plan(normal, dims)
    if keep:
        out_dims = [_simplify(tirx.Select(f, one, d)) for f, d in zip(flags, dims, strict=True)]
    else:
        out_dims = [
            _simplify(
                sum(
                    (
                        tirx.Select(tirx.And(tirx.Not(f), p == m), d, zero)
                        for f, p, d in zip(flags, position, dims, strict=True)
                    ),
                    zero,
                )
            )
            for m in range(kept)
        ]
    out_dims = _bound(bb, out_dims, "reduce_dim")
    compute_dtype = "int8" if dtype == "bool" else dtype
    reducer = _reducer(kind, compute_dtype, dtype == "bool")
    identity = _identity(kind, compute_dtype, dtype == "bool")

    def kernel(x, *axis_vars):  # the kernel's own parameters for the axes' dims
        flags, extents, position = plan(list(axis_vars), [_i64(d) for d in x.shape])
        # a reduction over an empty extent never runs TIR's init: every loop runs at least
        # once, and an element past a (zero) extent is the identity, never read
        maybe_empty = [not (isinstance(e, tirx.IntImm) and e.value > 0) for e in extents]
        axes_r = [
            te.reduce_axis((0, tirx.max(e, one) if m else e), name=f"r{j}")
            for j, (e, m) in enumerate(zip(extents, maybe_empty, strict=True))
        ]
        inside = _all(
            [a.var < e for a, e, m in zip(axes_r, extents, maybe_empty, strict=True) if m]
        )

        def source(idx):
            out = []
            for j in range(rank):
                if keep:
                    o = idx[j]
                else:
                    o = tirx.IntImm("int64", 0)
                    for m in range(kept):
                        o = tirx.Select(position[j] == m, tirx.Cast("int64", idx[m]), o)
                out.append(tirx.Select(flags[j], axes_r[j].var, o))
            return out

        def value(idx):
            v = x[tuple(source(idx))]
            v = v.astype(compute_dtype) if compute_dtype != dtype else v
            if element == "x*x":
                v = v * v
            elif element == "abs":
                v = tirx.abs(v)
            elif element == "exp":
                v = tirx.exp(v)
            return tirx.if_then_else(inside, v, identity) if any(maybe_empty) else v

        red = te.compute(out_dims, lambda *idx: reducer(value(idx), axis=axes_r), name="reduced")
        if finish == "r" and compute_dtype == dtype:
            return red
        total = one
        for e in extents:
            total = total * e

        def done(*idx):
            r = red[idx]
            if finish == "sqrt":
                return tirx.sqrt(r)
            if finish == "log":
                return tirx.log(r)
            if finish == "mean":
                return r / tirx.Cast(dtype, total)
            return r.astype(dtype)

        return te.compute(out_dims, done, name="result")

    return bb.emit_te(
        kernel,
        data,
        *normal,
        primfunc_name_hint=op.lower() + "_runtime_axes",
        # opaque: fused with its neighbours, FuseTIR refused its symbolic buffers
        primfunc_attrs={"op_pattern": 8},
    )


def _empty(axes, attr) -> bool:
    """Whether ``axes`` has no element: the importer gives a graph input declared ``[0]`` a
    symbolic length, ONNX shape inference (``onnx_known_shapes``) still knows it."""
    from . import onnx_known_shapes

    length = axes.ty.shape.values[0] if axes.ty.ndim == 1 else None
    if isinstance(length, tirx.IntImm):
        return int(length.value) == 0
    shapes = onnx_known_shapes._SHAPES.get(attr.get("tvm_custom", {}).get("name", ""), [])
    return len(shapes) > 1 and shapes[1] == [0]


def _any(conds: list):
    out = tirx.const(False, "bool")
    for c in conds:
        out = tirx.Or(out, c)
    return out


def _extend(op: str, base):
    """``base`` (a converter class) with run-time axes handled at opset 13 / 18 on."""

    def runtime(bb, inputs, attr, params):
        if len(inputs) < 2 or inputs[1] is None:
            return None
        axes = _frontend.get_constant(inputs[1], params)
        if isinstance(axes, GenericConst) or not isinstance(axes, relax.Expr):
            return None
        return _reduce(bb, op, bb.normalize(inputs[0]), bb.normalize(axes), attr)

    version = 13 if op == "ReduceSum" else 18
    stock = getattr(base, f"_impl_v{version}")

    def impl(cls, bb, inputs, attr, params):
        out = runtime(bb, inputs, attr, params)
        return stock(bb, inputs, attr, params) if out is None else out

    return type(op, (base,), {f"_impl_v{version}": classmethod(impl), "__doc__": base.__doc__})


RUNTIME_AXES = {op: _extend(op, _REFUSAL_FIXES.get(op) or getattr(_frontend, op)) for op in _OPS}
