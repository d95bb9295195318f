"""FuseCrossEntropy: ``log_softmax -> gather(targets)`` without the (N, V) log-probabilities.

Cross entropy is ``log_softmax(x)[i, t_i]`` (nvFuser #2556). Stock Relax computes the whole
``(N, V)`` log-softmax, writes it, and reads one value per row back. This pass replaces the
log-softmax and every reader of it by one kernel per row block, ``ce_rows(x, t[, w]) -> (N, k)``
holding row statistics computed while the row is in cache: the row's
``lse = max + log(sum(exp(x - max)))``, the target logit ``x[i, t_i]`` and, when a reader needs
them, the row sum ``sum_j x[i, j]`` and the weighted row sum ``sum_j w[j] * x[i, j]``. Every
reader then works on ``(N,)`` vectors in ordinary Relax ops (ignore_index, class weights,
the reduction, label smoothing's mix).

Matches ``L = log_softmax(x, axis=-1)`` (``x`` 2-D ``(N, V)``, ``N`` static or symbolic,
float16/bfloat16/float32 logits accumulated in float32), also spelled ``log(softmax(x, -1))``
with the softmax read by the log alone, and with reshapes to the same shape around either (the
ONNX importer's opset <= 12 forms; :mod:`._cross_entropy_spellings`), when every reader of
``L`` is one of:

- ``gather_elements(L, idx, axis=1)`` with ``idx`` of shape ``(N, 1)`` (``take_along_axis`` /
  ``torch.gather``), or of ``L * w`` with class weights ``w`` of shape ``(V,)`` / ``(1, V)``
  (PyTorch's decomposition of a weighted ``nll_loss``): ``x_t - lse`` (times ``w[t]``). An
  ``idx`` that is the ONNX importer's ``where(t < 0, t + V, t)`` of targets ``t`` (``V`` a
  constant or read from ``shape_of``) is read as ``t``: the kernel picks column ``t mod V``,
  which is ``t + V`` for ``-V <= t < 0``; a ``where`` adding anything else stays and is read;
- ``nll_loss(L, t, weights, reduction, ignore_index)`` (PyTorch's ``F.cross_entropy``
  semantics: weighted mean over non-ignored rows, NaN when every row is ignored);
- ``sum(L * one_hot(t), axis=1)``: ``x_t - lse``, 0 for a target outside ``[0, V)``;
- ``sum(L, axis=1)`` / ``mean(L, axis=1)`` / ``sum(L * w, axis=1)``: label smoothing's term,
  ``sum_x - V * lse`` (static V) or ``sum_wx - sum(w) * lse``;
- ``shape_of(L)`` (how the importer reads ``V`` for the ``where``): ``L``'s known shape.

Spellings this covers, each tested from its importer (tests/transform/test_ce_spellings.py):
ONNX ``LogSoftmax`` or ``Softmax -> Log``, then ``GatherElements`` (``ReduceMean`` /
``ReduceSum``, ``Neg`` before or after, ``Squeeze``), ``NegativeLogLikelihoodLoss`` or
``SoftmaxCrossEntropyLoss`` (weights, ignore_index, every reduction; converters in
:mod:`tvm_fusion.frontend.onnx_ops`); ``torch.export`` of ``F.cross_entropy`` /
``nn.CrossEntropyLoss`` (weight, ignore_index, label_smoothing, every reduction),
``F.nll_loss(F.log_softmax(x))`` and ``torch.log(torch.softmax(x))`` read by ``nll_loss`` or
``gather``, with a dynamic batch.
PyTorch's weighted mean also picks its denominator's weights as
``gather_elements(broadcast_to(w, (N, V)), idx, axis=1)``, an (N, V) broadcast in memory; beside
a fused log-softmax that becomes ``w[idx]``.

So ``F.cross_entropy(x, t, weight=w, label_smoothing=eps)`` as ``torch.export`` decomposes it
(a gather and a row sum of the same log-probs) becomes one kernel. All target picks must use the
same targets and all weighted sums the same weights (views of them are followed back), and the
kernel's inputs must exist at the first reader; else the log-softmax stays.

Gradient: the kernel is emitted as ``call_tir_with_grad`` with a TE gradient registered under
``tvm_fusion.cross_entropy_grad``. Run the pass (or :func:`tvm_fusion.fusion_passes`) before
``relax.transform.Gradient``: the adjoint is then one elementwise pass over the logits,
``dx = g_lse * exp(x - lse) + g_xt * onehot(t) + g_sum + g_wsum * w``, reading the saved
``lse`` (no (N, V) tensor is saved by the forward). The pipeline turns remaining
``call_tir_with_grad`` into ``call_tir``.

Reads of the logits: the max, the sum of exponentials, the row sums and the target pick are
separate reductions over the same row in one kernel; the schedule computes them row by row, so
a row of ``V`` floats is read from memory once and re-read from cache (128 KiB for V = 32768).

Left alone, with the reason at debug level: log-softmax on another axis or of another rank, a
log-softmax returned or read by anything else (an ``exp`` of it, a sum over the rows), a
``log(softmax)`` whose probabilities are read elsewhere, a gather of other shape, a non-integer
target. The fused value is the log-softmax's, so where ``softmax`` underflows to 0 (``log`` of
it ``-inf``) the fused ``log(softmax)`` spelling gives the finite value. On CPU targets ``exp``
is TVM's polynomial ``fast_exp`` (see :mod:`tvm_fusion.lower.legalize`).

Where the pieces live: the kernel and its gradient in :mod:`._cross_entropy_kernel`, which
log-softmax is fused and how each reader is served in :mod:`._cross_entropy_match`, the
spellings in :mod:`._cross_entropy_spellings`; this module emits the kernel and the readers.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import IRModule, relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import target as _target
from ._common import record_rewrite
from ._cross_entropy_kernel import (
    ACC,
    GRAD_NAME,
    cross_entropy_rows,
    register_gradient,
    row_columns,
)
from ._cross_entropy_match import Plan, Use, plans, weight_picks

NAME = "FuseCrossEntropy"


@tvm.transform.module_pass(opt_level=0, name=NAME)
class FuseCrossEntropy:
    """``log_softmax`` and every reader of it (gathers, nll_loss, row sums) as one pass over
    the logits per row (see the module docstring)."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        register_gradient()
        target = self.target or tvm.target.Target.current(allow_none=True)
        fast = bool(target is not None and _target.is_cpu(target))
        rewriter = _Rewriter(mod, fast)
        mod = rewriter.transform()
        record_rewrite(NAME, rewriter.count)
        return mod


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, fast_exp: bool):
        super().__init__(mod)
        self.mod = mod
        self.fast_exp = fast_exp
        self.count = 0
        self.planned: dict = {}  # replaced call -> (Plan, Use)
        self.weight_picks: dict = {}  # gather of broadcast class weights -> the (V,) weights

    def transform(self) -> IRModule:
        for gv, func in self.mod.functions_items():
            if not isinstance(func, relax.Function) or func.attrs.get("Primitive", False):
                continue
            self.planned = {}
            for plan in plans(func):
                for use in plan.uses:
                    self.planned[use.call] = (plan, use)
            if not self.planned:
                continue
            self.weight_picks = weight_picks(func)
            new_func = self.visit_expr(func)
            new_func = relax.analysis.remove_all_unused(new_func)
            self.builder_.update_func(gv, new_func)
        return self.builder_.get()

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        entry = self.planned.get(call)
        if entry is None:
            if call in self.weight_picks:
                return self._pick_weights(call, self.weight_picks[call])
            return super().visit_call_(call)
        plan, use = entry
        if use.kind == "shape":  # shape_of(L): L's shape is known, no kernel needed
            return relax.ShapeExpr(plan.x.ty.shape.values)
        if plan.columns is None:
            plan.columns = self._emit_kernel(plan)
            self.count += 1
        return self._replace(plan, use)

    # -- emitting ---------------------------------------------------------------------------

    def _emit_kernel(self, plan: Plan) -> dict:
        """The fused kernel at the first use; its columns as (N,) float32 vectors."""
        bb = self.builder_
        x = self.visit_expr(plan.x)
        n = x.ty.shape.values[0]
        if plan.pick is None:
            # no target column: any index; zeros shaped like a column of x, no ShapeExpr
            column = bb.emit(relax.op.strided_slice(x, [1], [0], [1]))
            t = bb.emit(relax.op.zeros_like(_rows(bb, column), "int64"))
        elif plan.pick[0] == "gather":
            t = _rows(bb, self.visit_expr(plan.pick[1]))
        else:
            t = self.visit_expr(plan.pick[1])
        source = t
        # The kernel and every reader take the targets with the logits' row count (see
        # _as_shaped): an exporter's spelling of it (``batch * min(INT64_MAX - 1, seq)``) sent
        # FuseTIR's shape matching into endless recursion.
        t = _as_shaped(bb, t, relax.TensorType([n], t.ty.dtype))
        kwargs = {}
        grad_kwargs = {"fast_exp": self.fast_exp}
        if plan.row_sum:
            kwargs["row_sum"] = True
            grad_kwargs["row_sum"] = True
        if plan.weights is not None:
            w = self.visit_expr(plan.weights)
            if w.ty.ndim != 1:
                w = bb.emit(relax.op.reshape(w, [x.ty.shape.values[1]]))
            kwargs["weights"] = w
        packed = bb.emit(
            bb.call_te_with_grad(
                cross_entropy_rows,
                x,
                t,
                self.fast_exp,
                te_grad_name=GRAD_NAME,
                te_grad_kwargs=grad_kwargs,
                primfunc_name_hint="cross_entropy_rows",
                **kwargs,
            )
        )
        names = row_columns(plan.row_sum, plan.weights is not None)
        parts = bb.emit(relax.op.split(packed, len(names), axis=1))
        columns = {
            name: _rows(bb, bb.emit(relax.TupleGetItem(parts, i))) for i, name in enumerate(names)
        }
        columns["t"] = t
        columns["t_source"] = source
        return columns

    def _replace(self, plan: Plan, use: Use) -> relax.Expr:
        bb = self.builder_
        cols = plan.columns
        lse = cols["lse"]
        n, v = plan.x.ty.shape.values
        dtype = str(plan.x.ty.dtype)
        if use.kind == "nll":
            out = self._nll(use.call, cols)
        elif use.kind == "gather":
            out = relax.op.expand_dims(bb.emit(relax.op.subtract(cols["x_t"], lse)), [1])
        elif use.kind == "wgather":  # gather_elements(L * w, idx) = w[t] * L[i, t]
            w = self._weights_vector(use.weights, v)
            mode = "wrap" if plan.wraps else "fast"
            w_t = bb.emit(relax.op.take(w, cols["t"], axis=0, mode=mode))
            picked = bb.emit(relax.op.subtract(cols["x_t"], lse))
            out = relax.op.expand_dims(bb.emit(relax.op.multiply(w_t, picked)), [1])
        elif use.kind == "onehot":
            # one_hot of a target outside [0, V) is a zero row: its sum is 0
            t = cols["t"]
            tdtype = str(t.ty.dtype)
            inside = bb.emit(
                relax.op.logical_and(
                    bb.emit(relax.op.greater_equal(t, relax.const(0, tdtype))),
                    bb.emit(
                        relax.op.less(t, relax.const(int(v.value), tdtype))
                    ),  # one_hot depth: static
                )
            )
            picked = bb.emit(relax.op.subtract(cols["x_t"], lse))
            out = relax.op.where(inside, picked, relax.const(0.0, ACC))
        else:  # rowsum, rowmean, wsum: sum_j c_j * (x_ij - lse_i)
            if use.kind == "wsum":
                w = self._weights_vector(plan.weights, v)
                scale = bb.emit(relax.op.sum(w))
                total = cols["sum_wx"]
            else:
                scale = relax.const(float(v.value), ACC)  # static: checked by _add_use
                total = cols["sum_x"]
            out = relax.op.subtract(total, bb.emit(relax.op.multiply(scale, lse)))
            if use.kind == "rowmean":
                out = relax.op.divide(bb.emit(out), scale)
        if use.keepdims:
            out = relax.op.expand_dims(_bound(bb, out), [1])
        if dtype != ACC:
            out = relax.op.astype(_bound(bb, out), dtype)
        out = bb.normalize(out)
        return _as_shaped(bb, out, use.call.ty)

    def _pick_weights(self, gather: relax.Call, weights: relax.Expr) -> relax.Expr:
        """``gather_elements(broadcast_to(w, (N, V)), idx, axis=1)`` as ``w[idx]``."""
        bb = self.builder_
        n, v = gather.args[0].ty.shape.values
        w = self.visit_expr(weights)
        if w.ty.ndim != 1:
            w = bb.emit(relax.op.reshape(w, [v]))
        idx = _rows(bb, self.visit_expr(gather.args[1]))
        return relax.op.expand_dims(bb.emit(relax.op.take(w, idx, axis=0)), [1])

    def _weights_vector(self, weights: relax.Expr, v) -> relax.Expr:
        """Class weights ``(V,)`` or ``(1, V)`` as a float32 ``(V,)`` vector."""
        bb = self.builder_
        w = self.visit_expr(weights)
        if w.ty.ndim != 1:
            w = bb.emit(relax.op.reshape(w, [v]))
        if str(w.ty.dtype) != ACC:
            w = bb.emit(relax.op.astype(w, ACC))
        return w

    def _nll(self, call: relax.Call, cols: dict) -> relax.Expr:
        """PyTorch's ``nll_loss``: weighted mean over non-ignored rows, NaN if all ignored."""
        t = call.args[1]
        weights = call.args[2] if len(call.args) > 2 else None
        reduction = str(call.attrs.reduction)
        ignore = int(call.attrs.ignore_index)
        bb = self.builder_
        t = self.visit_expr(t)
        if t.same_as(cols["t_source"]):
            t = cols["t"]
        t = _as_shaped(bb, t, relax.TensorType([cols["lse"].ty.shape.values[0]], t.ty.dtype))
        tdtype = str(t.ty.dtype)
        valid = bb.emit(relax.op.not_equal(t, relax.const(ignore, tdtype)))
        validf = bb.emit(relax.op.astype(valid, ACC))
        if weights is not None and not _is_null(weights):
            safe = bb.emit(relax.op.where(valid, t, relax.const(0, tdtype)))
            w = self.visit_expr(weights)
            if str(w.ty.dtype) != ACC:
                w = bb.emit(relax.op.astype(w, ACC))
            w_t = bb.emit(relax.op.multiply(bb.emit(relax.op.take(w, safe, axis=0)), validf))
        else:
            w_t = validf
        rows = bb.emit(relax.op.multiply(bb.emit(relax.op.subtract(cols["lse"], cols["x_t"])), w_t))
        if reduction == "none":
            return rows
        if reduction == "sum":
            return relax.op.sum(rows)
        return relax.op.divide(bb.emit(relax.op.sum(rows)), bb.emit(relax.op.sum(w_t)))


def _rows(bb: relax.BlockBuilder, column: relax.Expr) -> relax.Expr:
    """An ``(N, 1)`` column as ``(N,)``: a squeeze, not a reshape to ``[n]``, whose ShapeExpr of a
    symbolic ``n`` 0.27's Gradient cannot differentiate (TVM_NOTES)."""
    return bb.emit(relax.op.squeeze(column, [1]))


def _as_shaped(bb: relax.BlockBuilder, out: relax.Expr, sinfo) -> relax.Expr:
    """``out`` with the shape the replaced reader had. The kernel's rows are the logits' rows;
    an exporter may spell the targets' row count differently (``min(INT64_MAX, s) - min(1, s)``
    beside ``min(max(s - 1, 0), s)``, equal on every size, see ``prove_equal_shapes``), and
    a binary op of the two would lose its shape: a match_cast restores it."""
    if (
        isinstance(sinfo, relax.TensorType)
        and isinstance(sinfo.shape, relax.ShapeExpr)
        and isinstance(out.ty, relax.TensorType)
        and not tvm_ffi.structural_equal(out.ty.shape, sinfo.shape)
    ):
        return bb.match_cast(_bound(bb, out), sinfo)
    return out


def _bound(bb: relax.BlockBuilder, expr: relax.Expr) -> relax.Expr:
    return expr if isinstance(expr, relax.Var) else bb.emit(expr)


def _is_null(expr) -> bool:
    return expr is None or (isinstance(expr, relax.Tuple) and not expr.fields)
