"""Canonicalisation for FuseSplitGates: a linear layer on N-D rows, written as views around a
2-D GEMM, becomes one GEMM on the N-D rows.

TVM's PyTorch frontend (``torch.export`` -> ``from_exported_program``) writes ``nn.Linear`` on a
``(b, s, K)`` input as::

    xf = R.reshape(x, (b * s, K))
    y = R.matmul(xf, R.permute_dims(W))        # (b * s, N)
    yb = R.add(bias, y)                          # optional
    r = R.reshape(yb, (b, s, N))

so the split of a fused ``gate_up_proj`` (Phi-3, Qwen) reads a view, not a GEMM, and sibling
``gate_proj`` / ``up_proj`` layers read two different views of ``x``. Both become
``r = R.add(bias, R.matmul(x, R.permute_dims(W)))``: the same numbers (the rows are only
renamed), the form the gate matcher takes (its kernel indexes N-D rows).

More generally a view ``r = R.reshape(y, (*lead, N))`` of a 2-D GEMM's rows (``prod(lead)``
rows, the features kept: ``nn.LSTM``'s per-step ``(b, 4D) -> (1, b, 4D)``) becomes the GEMM of
the input viewed as ``(*lead, K)``; that view is ``x`` itself where ``xf`` is a reshape of an
``x`` of shape ``(*lead, K)``.

Matched only where the view ends in gate math: ``r`` read by one ``split`` or by
``strided_slice`` pieces (a chunked GEMM), directly or through one add of another tensor (an
RNN step's input projection), or only by elementwise ops while another such view of a linear
layer of the same ``x`` exists (sibling GEMMs). The view must keep the feature axis, the bias
must broadcast along the features alone, and the GEMM (and its bias sum) must be read by
nothing else. FuseSplitGates keeps the result only when a gate group then fuses.

Before that, ``unbind_to_slices``: torch's ``y.unflatten(-1, (k, D)).unbind(-2)`` (or
``view(..., k, D)`` then ``unbind`` / ``select``), which the frontend writes as::

    v = R.reshape(y, (*lead, k, D))                      # y: (*lead, k * D)
    p = R.strided_slice(v, axes=[-2], begin=[g], end=[g + 1])
    q = R.squeeze(p, axis=[-2])

becomes ``q = R.strided_slice(y, axes=[-1], begin=[g * D], end=[(g + 1) * D])``, the pieces of a
``chunk``. Only when ``v`` splits ``y``'s last axis alone (static ``k`` and ``D``), every
reader of ``v`` is such a slice of width 1 and stride 1, each slice read only by a squeeze of
that axis, and ``v`` is no output of the block.
"""

from __future__ import annotations

from tvm import IRModule, relax
from tvm.ir.expr import GenericConst
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._common import get_logger, op_name, prove_equal, skip, use_counts, vars_in
from .ops import _ELEMENTWISE

logger = get_logger(__name__)

_SPLITS = ("relax.split", "relax.strided_slice")


def _shape(expr) -> list | None:
    sinfo = getattr(expr, "ty", None)
    if isinstance(sinfo, relax.TensorType) and isinstance(sinfo.shape, relax.ShapeExpr):
        return list(sinfo.shape.values)
    return None


def _feature_bias(expr, n_features) -> bool:
    if not isinstance(expr, GenericConst):
        return False
    shape = [int(d) for d in expr.value.numpy().shape]
    if len(shape) > 2 or (len(shape) == 2 and shape[0] != 1):
        return False
    return not shape or shape[-1] in (1, n_features)


def _split_users(value: dict, users: dict, var) -> bool:
    ops = [op_name(value.get(u)) for u in users.get(var, [])]
    return (ops == ["relax.split"]) or (bool(ops) and set(ops) == {"relax.strided_slice"})


def _feeds_split(value: dict, users: dict, var) -> bool:
    """``var`` is split (or sliced), directly or through one add of another tensor (an RNN
    step's input projection added to the hidden GEMM)."""
    if _split_users(value, users, var):
        return True
    mine = users.get(var, [])
    return (
        len(mine) == 1
        and op_name(value.get(mine[0])) == "relax.add"
        and _split_users(value, users, mine[0])
    )


def _n_linear(value: dict, uses: dict, r_var, r_value) -> tuple | None:
    """``(x, matmul call, bias or None, bias first)`` of ``r = reshape(mm(reshape(x)) (+b))``
    that keeps the feature axis, else None (with the reason logged)."""
    what = f"view {r_var.name} of a linear layer"
    src = r_value.args[0]
    bias, bias_first = None, False
    mm = value.get(src)
    if op_name(mm) == "relax.add":
        if uses.get(src, 0) != 1:
            return None
        a, b = mm.args
        bias_first = op_name(value.get(b)) == "relax.matmul"
        gemm_var, bias = (b, a) if bias_first else (a, b)
        if uses.get(gemm_var, 0) != 1:
            return None
        mm = value.get(gemm_var)
    elif uses.get(src, 0) != 1:
        return None
    if op_name(mm) != "relax.matmul":
        return None
    xf, w = mm.args
    w_shape, xf_shape, r_shape = _shape(w), _shape(xf), _shape(r_var)
    if None in (w_shape, xf_shape, r_shape) or len(w_shape) != 2 or len(xf_shape) != 2:
        return None
    n = w_shape[1]
    if bias is not None and not _feature_bias(bias, int(getattr(n, "value", -1))):
        return skip(logger, what, "the bias does not broadcast along the features") or None
    rows = r_shape[0]
    for d in r_shape[1:-1]:
        rows = rows * d
    if len(r_shape) < 2 or not (prove_equal(rows, xf_shape[0]) and prove_equal(r_shape[-1], n)):
        return skip(logger, what, "the view moves the feature axis or the rows differ") or None
    # the input with the view's rows: x itself where xf is x viewed as (prod(lead), K)
    x = value[xf].args[0] if op_name(value.get(xf)) == "relax.reshape" else None
    x_shape = _shape(x) if x is not None else None
    if (
        x_shape is None
        or len(x_shape) != len(r_shape)
        or not all(prove_equal(a, b) for a, b in zip(x_shape[:-1], r_shape[:-1], strict=True))
    ):
        x = relax.op.reshape(xf, [*r_shape[:-1], xf_shape[1]])
    return x, mm, bias, bias_first


def _block_maps(block: relax.DataflowBlock) -> tuple[dict, set, dict]:
    """(the value bound to each var, the block's outputs, the vars whose values read each var)."""
    value = {b.var: b.value for b in block.bindings if isinstance(b, relax.VarBinding)}
    outputs = {b.var for b in block.bindings if not isinstance(b.var, relax.DataflowVar)}
    users: dict = {}
    for b in block.bindings:
        for v in vars_in(b.value):
            users.setdefault(v, []).append(b.var)
    return value, outputs, users


def _rewrite_planned(rewriter: PyExprMutator, plan_of) -> IRModule:
    """``rewriter.mod`` with each Relax function that ``plan_of(func)`` plans a rewrite in
    visited by ``rewriter`` (``rewriter.plan`` set to that plan); ``rewriter.mod`` itself when
    none has one."""
    changed = False
    for gv, func in rewriter.mod.functions_items():
        if not isinstance(func, relax.Function) or func.attrs.get("Primitive", False):
            continue
        rewriter.plan = plan_of(func)
        if not rewriter.plan:
            continue
        new_func = rewriter.visit_expr(func)
        changed = True
        rewriter.builder_.update_func(gv, relax.analysis.remove_all_unused(new_func))
    return rewriter.builder_.get() if changed else rewriter.mod


@mutator
class _FoldRowViews(PyExprMutator):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.mod = mod
        self.plan: dict = {}

    def transform(self) -> IRModule:
        return _rewrite_planned(self, self._plan)

    def _plan(self, func: relax.Function) -> dict:
        plan: dict = {}
        uses = use_counts(func)
        for block in func.body.blocks:
            if not isinstance(block, relax.DataflowBlock):
                continue
            value, outputs, users = _block_maps(block)
            split_fed, elementwise_fed = {}, {}
            for var, val in value.items():
                if op_name(val) != "relax.reshape" or var in outputs:
                    continue
                ops = [op_name(value.get(u)) for u in users.get(var, [])]
                if not ops:
                    continue
                split = _feeds_split(value, users, var)
                if not split and not set(ops) <= set(_ELEMENTWISE):
                    continue
                found = _n_linear(value, uses, var, val)
                if found is None:
                    continue
                (split_fed if split else elementwise_fed)[var] = found
            by_x: dict = {}
            for var, found in elementwise_fed.items():
                by_x.setdefault(found[0], []).append(var)
            plan.update(split_fed)
            for members in by_x.values():
                if len(members) > 1:
                    plan.update({m: elementwise_fed[m] for m in members})
        return plan

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        found = self.plan.get(binding.var)
        if found is None:
            return super().visit_var_binding_(binding)
        x, mm, bias, bias_first = found
        bb = self.builder_
        rows = self.visit_expr(x)
        if isinstance(rows, relax.Call):
            rows = bb.emit(rows)
        out = relax.op.matmul(rows, self.visit_expr(mm.args[1]), out_dtype=mm.attrs.out_dtype)
        if bias is not None:
            out = bb.emit(out)
            out = relax.op.add(bias, out) if bias_first else relax.op.add(out, bias)
        self.set_var_remap(binding.var, bb.emit(out, name_hint=binding.var.name))
        return None


def _static_int(value) -> int | None:
    value = getattr(value, "value", value)
    return int(value) if isinstance(value, int) or hasattr(value, "__index__") else None


def _unit_slice(call, axis: int, ndim: int) -> int | None:
    """``g`` of a ``strided_slice`` of ``[g, g + 1)`` with stride 1 on ``axis`` alone."""
    fields = [list(a.fields) if isinstance(a, relax.Tuple) else None for a in call.args[1:]]
    if len(fields) < 3 or any(f is None or len(f) != 1 for f in fields[:3]):
        return None
    axes, begin, end = (_static_int(f[0]) for f in fields[:3])
    stride = _static_int(fields[3][0]) if len(fields) > 3 and fields[3] else 1
    if None in (axes, begin, end) or axes % ndim != axis or stride != 1 or end != begin + 1:
        return None
    return begin


def _unbind_plan(value: dict, users: dict, outputs: set, v_var, v_value) -> dict:
    """``{squeeze var: (y, begin, end)}`` for the unbind pieces of ``v = reshape(y, ...)``."""
    what = f"unbind view {v_var.name}"
    y = v_value.args[0]
    y_shape, v_shape = _shape(y), _shape(v_var)
    if y_shape is None or v_shape is None or len(v_shape) != len(y_shape) + 1 or v_var in outputs:
        return {}
    if not y_shape:  # a scalar reshaped to (1,) (ONNX Range's length): no axis to unbind
        return {}
    k, d = _static_int(v_shape[-2]), _static_int(v_shape[-1])
    n = _static_int(y_shape[-1])
    if None in (k, d, n) or k * d != n or k < 2:
        return {}
    if not all(prove_equal(a, b) for a, b in zip(y_shape[:-1], v_shape[:-2], strict=True)):
        return {}
    axis, plan = len(v_shape) - 2, {}
    for p in users.get(v_var, []):
        g = _unit_slice(value[p], axis, len(v_shape)) if op_name(value.get(p)) else None
        readers = users.get(p, [])
        q = readers[0] if len(readers) == 1 and p not in outputs else None
        squeeze = value.get(q) if q is not None else None
        axes = getattr(getattr(squeeze, "attrs", None), "axis", None)
        if (
            op_name(value.get(p)) != "relax.strided_slice"
            or g is None
            or op_name(squeeze) != "relax.squeeze"
            or axes is None
            or [int(a) % len(v_shape) for a in axes] != [axis]
        ):
            skip(logger, what, "a reader is not a unit slice of the split axis, then squeezed")
            return {}
        plan[q] = (y, g * d, (g + 1) * d)
    return plan


@mutator
class _UnbindToSlices(PyExprMutator):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.mod = mod
        self.plan: dict = {}

    def transform(self) -> IRModule:
        return _rewrite_planned(self, self._plan)

    def _plan(self, func: relax.Function) -> dict:
        plan: dict = {}
        for block in func.body.blocks:
            if not isinstance(block, relax.DataflowBlock):
                continue
            value, outputs, users = _block_maps(block)
            for var, val in value.items():
                if op_name(val) == "relax.reshape":
                    plan.update(_unbind_plan(value, users, outputs, var, val))
        return plan

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        found = self.plan.get(binding.var)
        if found is None:
            return super().visit_var_binding_(binding)
        y, begin, end = found
        y_new = self.visit_expr(y)
        axis = len(_shape(y)) - 1
        piece = relax.op.strided_slice(y_new, [axis], [begin], [end], [1])
        self.set_var_remap(binding.var, self.builder_.emit(piece, name_hint=binding.var.name))
        return None


def unbind_to_slices(mod: IRModule) -> IRModule:
    """``mod`` with torch's unbind pieces of a split last axis as slices of it (see the module
    docstring; ``mod`` itself when none)."""
    return _UnbindToSlices(mod).transform()


def fold_row_views(mod: IRModule) -> IRModule:
    """``mod`` with the matched views of linear layers folded (``mod`` itself when none)."""
    return _FoldRowViews(mod).transform()
