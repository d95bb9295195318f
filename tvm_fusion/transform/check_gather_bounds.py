"""CheckGatherBounds: a run-time range check before every ``take`` whose indices are not proven.

``R.take(x, idx, axis, mode="fast")`` (ONNX ``Gather``, torch ``embedding`` / ``index_select``)
reads ``x`` at ``idx`` without a check: an id past the table reads the process's heap, a huge
one kills it. Token ids come from the user, so every such take whose indices are not provably
in ``[0, n)`` (``n`` the extent of ``axis``, static or symbolic; the product of all dims for a
take without an axis) is checked at run time by a small TIR kernel of its own::

    idx1 = call_tir_inplace(check_bounds, (x, idx), inplace_indices=1)   # idx1 is idx
    y = take(x, idx1, axis, mode="fast")

``check_bounds`` reads ``n`` from ``x``'s shape (``x``'s data is not read), compares every id
as an unsigned number with ``n`` (a negative id is a huge one) into one flag, a loop LLVM
vectorises, and asserts after the loop: ``IndexError: Gather/take (ONNX Gather, torch
embedding/index_select) of <table> at <index> (axis <a>): index out of range [0, <n>)``, the
index named by the model input it comes from (through casts and the importer's ``where``). The
kernel writes nothing: in place on ``idx`` it costs no copy and no allocation, in-range ids
give exactly the unchecked results, and the take depends on it (so neither dead-code
elimination nor reordering drops the check; ``R.assert_op`` is impure, not allowed in a
dataflow block). Negative ids: the ONNX importer maps ``[-n, 0)`` to ``[0, n)`` before the
take (``where(less(i, 0), add(i, n), i)``), so ONNX's negative indices pass and anything
below ``-n`` fails; torch's ``embedding``/``index_select`` refuse negative ids, as here.

``gather_elements`` (ONNX GatherElements: negatives mapped by the importer) is checked the same
way against ``[0, n)``, ``scatter_elements`` (ONNX ScatterElements: its kernel counts negative
indices from the end) against ``[-n, n)`` (one unsigned compare of ``id + n`` with ``2n``).

``gather_nd`` / ``scatter_nd`` (ONNX GatherND / ScatterND: negatives mapped by the importer,
their kernels read and write wherever an id points, negative ones included): every id of the
index's last dimension is checked against its own data axis (``batch_dims + j`` for
gather_nd, ``j`` for scatter_nd), ``IndexError: GatherND of <table> at <index> (batch_dims
1): index out of range [0, 3) x [0, 4)``; left alone for ids proven inside every axis they
index (constants; argmax/topk indices through views and the importer's ``where``, as for take:
the dynamo ONNX export of a mixture of experts gathers ``W[ids]`` by GatherND).

``dynamic_strided_slice`` (ONNX Slice with starts / ends / steps from the data): its shape
function and TOPI kernel clamp the bounds into the axis as ONNX does (out-of-range bounds
give ONNX's result, checked against onnxruntime), but divide by the steps: a step of 0 (ONNX
refuses it) is SIGFPE. Steps not provably nonzero constants go through ``check_steps`` (in
place): ``ValueError: Slice (dynamic_strided_slice) of <data>: a step of 0 ...``.

An arithmetic progression not proven inside the axis (``take(wpe, arange(0, seq))``: position
ids past a table of ``max_pos`` rows) is checked by its first and last value only::

    x1 = call_tir_inplace(check_span, (x, low, high), inplace_indices=0)   # x1 is x
    y = take(x1, arange(0, seq), axis)

one scalar assert, no index tensor read; the take stays a take of an arange, which
GatherToSlice turns into a slice as before.

The ``check_bounds`` kernel of a take with an axis, or of a gather_nd / scatter_nd whose ids
index one axis, carries what it guarantees, for later passes' range proofs
(FuseGatheredGates): ``CHECKED_AXIS`` (the axis of ``x`` whose extent bounds the ids) and
``CHECKED_SIGNED`` (ids in ``[-n, n)`` rather than ``[0, n)``).

CUDA: no check (a warning at compile time). The kernel above has no thread binding and would
run on the host against device pointers; a device-side flag would need a copy to the host and
a sync per call. Left for later; the takes stay unchecked on CUDA as they were.

Cost (CPU, 1 thread, ``scripts/bench_gather_bounds.py``, a shared 2-core Zen 3; fastest of
the interleaved runs, checked vs unchecked): a Gather of 1 / 64 ids +0.2 us per call, of 4096
ids within noise (the kernel alone: 76 ns / 123 ns / 0.75 us); the corpus' distilbert and gpt2
exports at (3, 7): +1.0 % / +0.2 % (distilbert dynamo / torchscript, 1 / 2 checks), +0.9 % /
-0.3 % (gpt2, 2 / 3 checks); the medians moved by as much between two VMs of one build (5-9 %).
The earlier Python callback cost 25-50 us per take (+81-93 %).

Left as they are (range proven, or no read outside the buffer possible):

- ``mode="clip"`` / ``"wrap"``;
- constant indices provably inside the axis (``[-n, n)`` for scatter_elements: the importer's
  scatter of a dynamic Slice's constant axes; outside it: a warning at compile time, and the
  check, which raises on every call);
- indices that are an arithmetic progression inside the axis (``arange``, a constant
  ``Range``; what GatherToSlice proves, through casts, reshapes, slices and the ONNX importer's
  negative-index ``where``);
- ``argmax`` / ``argmin`` / ``topk`` indices over an axis no longer than the take's, through
  casts, views and the importer's ``where``.

Where it runs: early in Phase 1, after PlaceShapeOnHost, before GatherToSlice and
FuseCrossEntropy (they see the same ``take``: its index or its table becomes the check's
output only where the range is unproven).

Not covered yet: ``take_backward``. The table of bad ids per op (in range, out by 1, by
10**8, below -n) against onnxruntime / torch: ``scripts/bench_gather_bounds.py --table``.
"""

from __future__ import annotations

import tvm
from tvm import IRModule, relax, tirx
from tvm.ir.expr import GenericConst
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..check_kernels import Buf, assert_kernel, flag_kernel, indices, shape_vars
from ._common import as_i64, get_logger, op_name, record_rewrite, skip
from .gather_to_slice import _Values

logger = get_logger(__name__)
NAME = "CheckGatherBounds"
# ops whose output keeps a subset of its input's values
_VIEWS = (
    "relax.astype",
    "relax.reshape",
    "relax.expand_dims",
    "relax.squeeze",
    "relax.permute_dims",
    "relax.strided_slice",
    "relax.broadcast_to",
    "relax.flatten",
)
# op: (the op in messages, whether negative indices count from the end in its kernel); the
# ONNX importer maps Gather's and GatherElements' negative indices before the op
_OPS = {
    "relax.take": ("Gather/take (ONNX Gather, torch embedding/index_select)", False),
    "relax.gather_elements": ("GatherElements", False),
    "relax.scatter_elements": ("ScatterElements", True),
}
# gather_nd / scatter_nd: one id per data axis in the index's last dimension (from the data
# axis ``batch_dims`` on for gather_nd, 0 for scatter_nd); their kernels read and write at
# whatever the ids say, negative ones included (the importer maps ONNX's ``[-n, 0)`` first)
_ND_OPS = {"relax.gather_nd": "GatherND", "relax.scatter_nd": "ScatterND"}
_INT_BITS = {"int8": 8, "int16": 16, "int32": 32, "int64": 64}


CHECKED_AXIS = "tvm_fusion.checked_axis"
CHECKED_SIGNED = "tvm_fusion.checked_signed"


@tvm.transform.module_pass(opt_level=0, name=NAME)
class CheckGatherBounds:
    """Puts a run-time range check before each ``take`` whose indices are not proven in range
    (see the module docstring)."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        target = self.target or tvm.target.Target.current(allow_none=True)
        rewriter = _Rewriter(mod, _skip_reason(target))
        mod = rewriter.transform()
        record_rewrite(NAME, rewriter.count)
        return mod


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, skip_reason: str | None):
        super().__init__(mod)
        self.mod = mod
        self.skip_reason = skip_reason
        self.count = 0
        self.values = _Values({})

    def transform(self) -> IRModule:
        for gv, func in self.mod.functions_items():
            if not isinstance(func, relax.Function) or func.attrs.get("Primitive", False):
                continue
            self.values = _Values(relax.analysis.get_var2val(func))
            self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get() if self.count else self.mod

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if op_name(call) == "relax.dynamic_strided_slice":
            return self._checked_steps(call)
        if op_name(call) in _ND_OPS:
            checked = self._checked_nd(call)
        elif op_name(call) in _OPS:
            checked = self._checked(call)
        else:
            return call
        if checked is None:
            return call
        self.count += 1
        return relax.Call(call.op, [*checked, *call.args[2:]], call.attrs, call.ty_args)

    def _checked(self, call: relax.Call) -> tuple | None:
        """``(data, index)`` of the checked take / gather_elements / scatter_elements, or None
        when the index range is proven (or unknowable)."""
        x, idx = call.args[:2]
        label, negatives = _OPS[op_name(call)]
        what = f"{label} of {_name(x)}"
        mode = getattr(call.attrs, "mode", None)
        if str(mode) in ("clip", "wrap"):
            return _leave(what, f"mode={mode} reads inside the buffer")
        extent = _extent(x, call.attrs.axis)
        x_ty, idx_ty = x.ty, idx.ty
        if (
            extent is None
            or not isinstance(idx_ty, relax.TensorType)
            or x_ty.ndim < 0
            or idx_ty.ndim < 0
        ):
            logger.warning("%s: data shape or index type unknown, left unchecked", what)
            return None
        analyzer = tvm.sym.Analyzer()
        if negatives:  # constants inside [-n, n) (a dynamic Slice's axes), else checked
            found = self._range(idx, analyzer)
            span = found is not None and all(
                analyzer.can_prove(c) for c in (found[0] >= -extent, found[1] <= extent)
            )
            span = span and _proved(what, "constant index values inside [-n, n)")
        else:
            span = self._proven(what, idx, extent, analyzer)
        if span is True:
            return None
        if self.skip_reason:
            logger.warning("%s: left unchecked: %s", what, self.skip_reason)
            return None
        axis = "all" if call.attrs.axis is None else f"axis {int(call.attrs.axis)}"
        size = int(extent.value) if isinstance(extent, tirx.IntImm) else extent
        message = (
            f"{label} of {_name(x)} at {self._source(idx)} ({axis}): index out of range "
            f"[{f'-{size}' if negatives else 0}, {size})"
        )
        bb = self.builder_
        if span is not False:
            # a progression: its first and last value, not the index tensor, are checked; the
            # table goes through the check (unchanged, in place) so that GatherToSlice still
            # sees take(table, arange) and the slice depends on the check
            gv = bb.add_func(span_kernel(x_ty, call.attrs.axis, message), "check_span")
            low, high = (relax.prim_value(analyzer.simplify(v)) for v in span)
            return bb.emit(relax.call_tir_inplace(gv, (x, low, high), 0, x_ty)), idx
        # in place on the index (which it only reads): no copy, no allocation
        kernel = check_kernel(x_ty, call.attrs.axis, idx_ty, message, negatives)
        if call.attrs.axis is not None:  # what it guarantees, for later passes' range proofs
            kernel = kernel.with_attr(CHECKED_AXIS, int(call.attrs.axis)).with_attr(
                CHECKED_SIGNED, bool(negatives)
            )
        gv = bb.add_func(kernel, "check_bounds")
        return x, bb.emit(relax.call_tir_inplace(gv, (x, idx), 1, idx_ty))

    def _checked_nd(self, call: relax.Call) -> tuple | None:
        """``(data, index)`` of a checked gather_nd / scatter_nd: each id of the index's last
        dimension against the extent of its own data axis; None when every id is a constant
        inside its axis (or the shapes are unknown)."""
        x, idx = call.args[:2]
        label = _ND_OPS[op_name(call)]
        start = int(getattr(call.attrs, "batch_dims", 0))
        what = f"{label} of {_name(x)}"
        x_ty, idx_ty = x.ty, idx.ty
        width = None
        if isinstance(idx_ty, relax.TensorType) and isinstance(idx_ty.shape, relax.ShapeExpr):
            last = idx_ty.shape.values[-1] if idx_ty.ndim > 0 else None
            width = int(last.value) if isinstance(last, tirx.IntImm) else None
        if (
            width is None
            or not isinstance(x_ty, relax.TensorType)
            or not isinstance(x_ty.shape, relax.ShapeExpr)
            or start + width > x_ty.ndim
        ):
            logger.warning("%s: data shape or index width unknown, left unchecked", what)
            return None
        extents = [as_i64(d) for d in x_ty.shape.values[start : start + width]]
        if self._constant_inside(idx, extents):
            _proved(what, "constant index values inside their axes")
            return None
        analyzer = tvm.sym.Analyzer()
        found = self._range(idx, analyzer)  # every id, whichever axis it indexes
        if found is not None and all(
            analyzer.can_prove(c) for c in (found[0] >= 0, *(found[1] <= e for e in extents))
        ):
            _proved(what, "index values (constants, argmax/topk) inside every axis")
            return None
        if self.skip_reason:
            logger.warning("%s: left unchecked: %s", what, self.skip_reason)
            return None
        ranges = " x ".join(f"[0, {int(e) if isinstance(e, tirx.IntImm) else e})" for e in extents)
        batch = f" (batch_dims {start})" if start else ""
        message = (
            f"{label} of {_name(x)} at {self._source(idx)}{batch}: index out of range {ranges}"
        )
        kernel = nd_kernel(x_ty, start, idx_ty, message)
        if width == 1:  # ids in [0, n) of the one axis they index, as a take's check
            kernel = kernel.with_attr(CHECKED_AXIS, start).with_attr(CHECKED_SIGNED, False)
        gv = self.builder_.add_func(kernel, "check_bounds")
        return x, self.builder_.emit(relax.call_tir_inplace(gv, (x, idx), 1, idx_ty))

    def _checked_steps(self, call: relax.Call) -> relax.Call:
        """A ``dynamic_strided_slice`` (ONNX Slice with bounds from the data) clamps its
        bounds into the axis as ONNX does, but divides by its steps: a step of 0 (which ONNX
        refuses) kills the process with SIGFPE. Steps not provably nonzero go through a check
        kernel (in place) first."""
        x, steps = call.args[0], call.args[3]
        what = f"Slice (dynamic_strided_slice) of {_name(x)}"
        steps_ty = steps.ty
        if self._nonzero(steps):
            _proved(what, "constant nonzero steps")
            return call
        if not isinstance(steps_ty, relax.TensorType) or steps_ty.ndim != 1:
            logger.warning("%s: steps' type unknown, left unchecked", what)
            return call
        if self.skip_reason:
            logger.warning("%s: left unchecked: %s", what, self.skip_reason)
            return call
        message = f"{what}: a step of 0 (ONNX Slice steps must be nonzero)"
        gv = self.builder_.add_func(steps_kernel(steps_ty, message), "check_steps")
        checked = self.builder_.emit(relax.call_tir_inplace(gv, (steps,), 0, steps_ty))
        self.count += 1
        return relax.Call(call.op, [*call.args[:3], checked], call.attrs, call.ty_args)

    def _nonzero(self, expr, depth: int = 0) -> bool:
        """Whether every value of ``expr`` is a nonzero constant (through the importer's
        ``scatter_elements`` of constant steps into a constant row of ones)."""
        expr = self.values.resolve(expr)
        if isinstance(expr, GenericConst):
            return bool((expr.value.numpy() != 0).all())
        if op_name(expr) == "relax.scatter_elements" and depth < 4:
            return self._nonzero(expr.args[0], depth + 1) and self._nonzero(expr.args[2], depth + 1)
        return False

    def _constant_inside(self, idx, extents: list) -> bool:
        """Whether ``idx`` is a constant (or the importer's negative-index ``where`` of one)
        whose ids along its last dimension lie inside ``extents``."""
        expr = self.values.resolve(idx)
        if op_name(expr) == "relax.where":
            cond = self.values.resolve(expr.args[0])
            plain = self.values.resolve(expr.args[2])
            if op_name(cond) == "relax.less" and self.values.resolve(cond.args[0]).same_as(plain):
                expr = plain
        if not isinstance(expr, GenericConst):
            return False
        arr = expr.value.numpy()
        if arr.dtype.kind not in "iu" or arr.ndim == 0 or arr.shape[-1] != len(extents):
            return False
        if arr.size == 0:
            return True
        analyzer = tvm.sym.Analyzer()
        flat = arr.reshape(-1, len(extents))
        return all(
            int(flat[:, j].min()) >= 0 and analyzer.can_prove(as_i64(int(flat[:, j].max())) < e)
            for j, e in enumerate(extents)
        )

    def _source(self, idx) -> str:
        """The name of the index for a message: the function input it is made of (through
        casts and the importer's negative-index ``where``), else its variable's name."""
        expr = idx
        for _ in range(8):
            value = self.values.resolve(expr)
            name = op_name(value)
            if name == "relax.astype":
                expr = value.args[0]
            elif name == "relax.where" and op_name(self.values.resolve(value.args[0])) == (
                "relax.less"
            ):
                expr = value.args[2]
            else:
                break
        return _name(expr if isinstance(self.values.resolve(expr), relax.Var) else idx)

    def _proven(self, what: str, idx, extent, analyzer) -> bool | tuple:
        """True when every index value is inside ``[0, extent)``; ``(low, high)`` for a
        progression of non-negative values from ``low`` to ``high`` not proven below
        ``extent``; False otherwise."""
        found = self._range(idx, analyzer)
        if found is not None:
            low, high = found
            if analyzer.can_prove(low >= 0) and analyzer.can_prove(high <= extent):
                return _proved(what, "index values (constants, argmax/topk) inside the axis")
            if isinstance(self.values.resolve(idx), GenericConst):
                logger.warning(
                    "%s: constant index outside [0, %s), checked at run time", what, extent
                )
                return False
        prog = self.values.progression(idx, analyzer)
        if prog is not None and prog.step != 0:
            first, last = prog.start, prog.last()
            low, high = (first, last) if prog.step > 0 else (last, first)
            # GatherToSlice's progression looks through casts; the values must fit the index
            # dtype (a constant 200 cast to int8 is -56)
            fits = _fits(analyzer, (low, high + 1), str(idx.ty.dtype))
            if fits and analyzer.can_prove(high < extent):
                return _proved(what, "an arithmetic progression inside the axis")
            if fits:
                return low, high
        return False

    def _range(self, expr, analyzer, depth: int = 0) -> tuple | None:
        """``(low, high)`` with ``low <= expr < high`` for every value of the index: constants,
        the indices an argmax/argmin/topk made, and views of those (slices, broadcasts,
        reshapes, casts that keep the values, the importer's negative-index ``where``)."""
        if depth > 32:
            return None
        expr = self.values.resolve(expr)
        if isinstance(expr, GenericConst):
            arr = expr.value.numpy()
            if arr.dtype.kind not in "iu":
                return None
            if arr.size == 0:
                return as_i64(0), as_i64(0)
            return as_i64(int(arr.min())), as_i64(int(arr.max()) + 1)
        if isinstance(expr, relax.TupleGetItem):
            inner = self.values.resolve(expr.tuple_value)
            if op_name(inner) == "relax.topk" and expr.index == 1:
                return _from_zero(_extent(inner.args[0], inner.attrs.axis))
            return None
        name = op_name(expr)
        if name in ("relax.argmax", "relax.argmin"):
            return _from_zero(_extent(expr.args[0], expr.attrs.axis))
        if name == "relax.topk" and str(expr.attrs.ret_type) == "indices":
            return _from_zero(_extent(expr.args[0], expr.attrs.axis))
        if name in _VIEWS:
            found = self._range(expr.args[0], analyzer, depth + 1)
            if name == "relax.astype" and found is not None:
                # a cast keeps the values only where the new type holds them
                dtype = str(expr.ty.dtype)
                if dtype not in _INT_BITS:
                    return None
                if not _fits(analyzer, found, dtype):
                    return None
            return found
        if name == "relax.where":
            # the ONNX importer's where(less(i, 0), add(i, n), i): i itself when i >= 0
            plain = self.values.resolve(expr.args[2])
            cond = self.values.resolve(expr.args[0])
            if op_name(cond) == "relax.less" and self.values.resolve(cond.args[0]).same_as(plain):
                found = self._range(plain, analyzer, depth + 1)
                if found is not None and analyzer.can_prove(found[0] >= 0):
                    return found
        return None


def _skip_reason(target) -> str | None:
    """Why takes cannot be checked on ``target`` (None: they can; no target: the host)."""
    if target is None or str(target.kind.name) in ("llvm", "c"):
        return None
    return (
        f"no run-time index check on {target.kind.name} targets yet (a device-side assert "
        "would end the CUDA context)"
    )


def check_kernel(
    x_ty: relax.TensorType, axis, ids_ty: relax.TensorType, message: str, negatives: bool
) -> tirx.PrimFunc:
    """``check_bounds(x, ids)``, called in place on ``ids`` (which it only reads): fails with
    ``IndexError: message`` when an id is outside ``[0, n)``, ``n`` the extent of ``x``'s
    ``axis`` (every element of ``x`` for None) read from ``x``'s shape at run time, or outside
    ``[-n, n)`` with ``negatives``. ``x`` is not read."""
    x, extent = _x_buf(x_ty, axis)
    ds = shape_vars("d", ids_ty.ndim)
    # one unsigned comparison per id (a negative id is a huge unsigned one) folded into one
    # flag, one assert after the loop: LLVM vectorises the loop (0.75 us for 4096 ids here,
    # 2.1 us with an assert per id)
    n = f'T.Cast("uint64", {extent})'
    shift, n = (f" + {n}", f"{n} * T.uint64(2)") if negatives else ("", n)
    outside = f'T.Cast("uint64", T.Cast("int64", ids[{indices(len(ds))}])){shift} >= {n}'
    ids = Buf("ids", ds, str(ids_ty.dtype))
    return flag_kernel("check_bounds", [x, ids], ds, [outside], message, "IndexError")


def nd_kernel(
    x_ty: relax.TensorType, start: int, ids_ty: relax.TensorType, message: str
) -> tirx.PrimFunc:
    """``check_bounds(x, ids)`` of a gather_nd / scatter_nd, called in place on ``ids``: fails
    with ``IndexError: message`` unless ``0 <= ids[..., j] < x.shape[start + j]`` for every
    ``j`` of the ids' last (static) dimension. ``x`` is not read."""
    x, _ = _x_buf(x_ty, 0)
    ds = shape_vars("d", ids_ty.ndim - 1)
    width = int(ids_ty.shape.values[-1].value)
    at = [i for i in indices(len(ds)).split(", ") if i != "()"]
    outside = [
        f'T.Cast("uint64", T.Cast("int64", ids[{", ".join([*at, str(j)])}]))'
        f' >= T.Cast("uint64", x{start + j})'
        for j in range(width)
    ]
    ids = Buf("ids", (*ds, str(width)), str(ids_ty.dtype))
    return flag_kernel("check_bounds", [x, ids], ds, outside, message, "IndexError")


def steps_kernel(steps_ty: relax.TensorType, message: str) -> tirx.PrimFunc:
    """``check_steps(steps)``, called in place on ``steps`` (which it only reads): fails with
    ``ValueError: message`` when a step is 0."""
    dtype = str(steps_ty.dtype)
    zero = f"steps[i0] == T.Cast({dtype!r}, 0)"
    steps = Buf("steps", ("n",), dtype)
    return flag_kernel("check_steps", [steps], ("n",), [zero], message, "ValueError")


def span_kernel(x_ty: relax.TensorType, axis, message: str) -> tirx.PrimFunc:
    """``check_span(x, low, high)``, called in place on ``x`` (which it does not touch): fails
    with ``IndexError: message`` unless ``0 <= low`` and ``high < n`` (``n`` as for
    :func:`check_kernel`)."""
    x, extent = _x_buf(x_ty, axis)
    condition = f"0 <= low and high < {extent}"
    return assert_kernel("check_span", [x], ["low", "high"], condition, message, "IndexError")


def _x_buf(x_ty: relax.TensorType, axis) -> tuple[Buf, str]:
    """``x``'s buffer (matched to its shape variables ``x0, x1, ..``) and ``n``, the extent
    of ``axis`` among them (all of ``x`` for None)."""
    xs = shape_vars("x", x_ty.ndim)
    if axis is None:
        extent = " * ".join(xs) if xs else "T.int64(1)"
    else:
        extent = xs[int(axis) % len(xs)]
    return Buf("x", xs, str(x_ty.dtype)), extent


def _fits(analyzer, found: tuple, dtype: str) -> bool:
    """``low >= 0`` and ``high <= 2**(bits - 1)``: a signed ``dtype`` holds every value."""
    if dtype not in _INT_BITS or not analyzer.can_prove(found[0] >= 0):
        return False
    return dtype == "int64" or analyzer.can_prove(found[1] <= as_i64(1 << (_INT_BITS[dtype] - 1)))


def _from_zero(extent) -> tuple | None:
    return None if extent is None else (as_i64(0), extent)


def _extent(x, axis) -> tirx.Expr | None:
    """The extent of ``x``'s ``axis`` (all of ``x`` for None) as an int64 PrimExpr."""
    sinfo = x.ty
    if not isinstance(sinfo, relax.TensorType) or not isinstance(sinfo.shape, relax.ShapeExpr):
        return None
    dims = [as_i64(d) for d in sinfo.shape.values]
    if axis is None:
        total = tirx.IntImm("int64", 1)
        for d in dims:
            total = total * d
        return tvm.sym.Analyzer().simplify(total)
    axis = int(axis)
    if not -len(dims) <= axis < len(dims):
        return None
    return dims[axis % len(dims)]


def _name(x) -> str:
    return repr(x.name) if isinstance(x, relax.Var) else "a constant"


def _leave(what: str, reason: str) -> None:
    skip(logger, what, reason)
    return None


def _proved(what: str, reason: str) -> bool:
    skip(logger, what, reason)
    return True
