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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import IRModule, relax, te, tirx, topi
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.relax.training.utils import register_global_func

from .. import target as _target
from ._common import get_logger, op_name, prove_equal_shapes, record_rewrite, skip, vars_in
from ._cross_entropy_spellings import log_softmax_source, unwrap_negative_index

logger = get_logger(__name__)
NAME = "FuseCrossEntropy"
GRAD_NAME = "tvm_fusion.cross_entropy_grad"
KERNEL_ATTR = "tvm_fusion.cross_entropy"
_FLOATS = ("float32", "float16", "bfloat16")
ACC = "float32"


def _acc(x: te.Tensor):
    """``x[i, j]`` read in the float32 accumulation type."""
    if x.dtype == ACC:
        return lambda i, j: x[i, j]
    return lambda i, j: x[i, j].astype(ACC)


def _exp_at(value: te.Tensor, fast: bool):
    """``exp(value[i, j])``: TVM's polynomial ``fast_exp`` (CPU), else the exact intrinsic."""
    if fast:
        ex = topi.fast_exp(value)
        return lambda i, j: ex[i, j]
    return lambda i, j: te.exp(value[i, j])


def row_columns(row_sum: bool, weighted: bool) -> list[str]:
    """The columns of the kernel's ``(N, k)`` output, in order."""
    return ["lse", "x_t"] + (["sum_x"] if row_sum else []) + (["sum_wx"] if weighted else [])


def cross_entropy_rows(
    x: te.Tensor,
    t: te.Tensor,
    fast_exp: bool = False,
    row_sum: bool = False,
    weights: te.Tensor | None = None,
) -> te.Tensor:
    """``(N, k)`` float32 row statistics of the logits, one pass over each row.

    Columns (:func:`row_columns`): the log-sum-exp, the logit of the row's target, and when
    asked the row sum ``sum_j x[i, j]`` and the weighted row sum ``sum_j w[j] * x[i, j]``
    (label smoothing: ``sum_j log_softmax(x)[i, j] = sum_x - V * lse``). A target outside
    ``[0, V)`` (an ignored row) picks some column (:func:`target_column`); callers mask such
    rows.
    """
    n, v = x.shape
    xf = _acc(x)
    if fast_exp:
        # CPU: the row reductions in the vector-split form of the fast-math legalisation,
        # vectorised at any V (a vocabulary of 50257: 5x the time of 50256 when scalar)
        from ..lower.legalize import _row_reduce

        def reduce_rows(tensor, kind, _name):
            out = _row_reduce(tensor, 1, kind)
            return lambda i: out[i, 0]

        xa = te.compute((n, v), xf, name="ce_x")
        row_max = reduce_rows(xa, "max", "ce_max")
        shifted = te.compute((n, v), lambda i, j: xa[i, j] - row_max(i), name="ce_shifted")
        ex = topi.fast_exp(shifted)
        sum_exp = reduce_rows(ex, "sum", "ce_sumexp")
    else:

        def reduce_rows(tensor, kind, name):
            k = te.reduce_axis((0, v), "k")
            red = te.max if kind == "max" else te.sum
            out = te.compute((n,), lambda i: red(tensor[i, k], axis=k), name=name)
            return lambda i: out[i]

        xa = te.compute((n, v), xf, name="ce_x")
        row_max = reduce_rows(xa, "max", "ce_max")
        shifted = te.compute((n, v), lambda i, j: xa[i, j] - row_max(i), name="ce_shifted")
        ex = te.compute((n, v), lambda i, j: te.exp(shifted[i, j]), name="ce_exp")
        sum_exp = reduce_rows(ex, "sum", "ce_sumexp")

    def pick(i):
        return xf(i, target_column(t[i], v))

    columns = [lambda i: row_max(i) + te.log(sum_exp(i)), pick]
    if row_sum:
        columns.append(reduce_rows(xa, "sum", "ce_rowsum"))
    if weights is not None:
        wf = _acc_vector(weights)
        weighted = te.compute((n, v), lambda i, j: wf(j) * xa[i, j], name="ce_weighted")
        columns.append(reduce_rows(weighted, "sum", "ce_weighted_rowsum"))

    def value(i, c):
        out = columns[-1](i)
        for index in range(len(columns) - 2, -1, -1):
            out = tirx.Select(c == index, columns[index](i), out)
        return out

    return te.compute((n, len(columns)), value, name="ce_rows")


def cross_entropy_grad(
    output_grad: te.Tensor,
    rows: te.Tensor,
    x: te.Tensor,
    t: te.Tensor,
    fast_exp: bool = False,
    row_sum: bool = False,
    weights: te.Tensor | None = None,
):
    """d/dx (and d/dw) of ``rows = cross_entropy_rows(x, t, ...)``, one elementwise pass over
    the logits: ``g_lse * softmax(x) + g_xt * onehot(t) + g_sum + g_wsum * w``, the softmax
    ``exp(x - lse)`` from the saved lse. With weights, ``dw[j] = sum_i g_wsum[i] * x[i, j]``."""
    n, v = x.shape
    xf = _acc(x)
    shifted = te.compute((n, v), lambda i, j: xf(i, j) - rows[i, 0], name="ce_grad_shifted")
    prob = _exp_at(shifted, fast_exp)
    col_sum = 2
    col_wsum = 3 if row_sum else 2
    wf = _acc_vector(weights) if weights is not None else None

    def grad(i, j):
        hit = j.astype("int64") == target_column(t[i], v)
        value = output_grad[i, 0] * prob(i, j) + tirx.Select(
            hit, output_grad[i, 1], tirx.const(0.0, ACC)
        )
        if row_sum:
            value = value + output_grad[i, col_sum]
        if wf is not None:
            value = value + output_grad[i, col_wsum] * wf(j)
        return value if x.dtype == ACC else value.astype(x.dtype)

    grads = [te.compute((n, v), grad, name="ce_grad")]
    if weights is not None:
        r = te.reduce_axis((0, n), "r")
        dw = te.compute(
            (v,), lambda j: te.sum(output_grad[r, col_wsum] * xf(r, j), axis=r), name="ce_grad_w"
        )
        grads.append(
            dw
            if weights.dtype == ACC
            else te.compute((v,), lambda j: dw[j].astype(weights.dtype), name="ce_grad_w_cast")
        )
    return grads


def target_column(target, v):
    """The column a row's target picks: ``t mod V``. A target in ``[0, V)`` is itself, one in
    ``[-V, 0)`` counts from the end (``t + V``, ONNX's negative GatherElements indices); any
    other (an ignored row, which every reader masks) picks some column inside the row, never
    memory outside it."""
    return tirx.floormod(target.astype("int64"), v)


def _acc_vector(w: te.Tensor):
    if w.dtype == ACC:
        return lambda j: w[j]
    return lambda j: w[j].astype(ACC)


def _grad_handler(orig_var, call, output_grad, ctx: relax.BlockBuilder):
    """Gradient of ``call_tir_with_grad(ce_rows, (x, t[, w]))``: dx, no gradient for t, and dw.

    Registered by hand (not with ``register_te_gradient``) because the gradient reads the
    forward's output (the saved lse), which the stock handler does not pass on.
    """
    args = list(call.args[1])
    x, t = args[0], args[1]
    weights = args[2] if len(args) > 2 else None
    options = call.attrs.te_grad_kwargs
    fast = bool(options.get("fast_exp", False))
    row_sum = bool(options.get("row_sum", False))
    grads = ctx.emit_te(
        cross_entropy_grad,
        output_grad,
        orig_var,
        x,
        t,
        fast,
        row_sum,
        weights,
        primfunc_name_hint="ce_grad",
    )
    if weights is None:
        return ctx.emit(relax.Tuple([grads, relax.op.zeros_like(t)]))
    return ctx.emit(
        relax.Tuple(
            [relax.TupleGetItem(grads, 0), relax.op.zeros_like(t), relax.TupleGetItem(grads, 1)]
        )
    )


_REGISTERED = False


def register_gradient() -> None:
    global _REGISTERED
    if not _REGISTERED:
        register_global_func("tvm.relax.te_grad._register." + GRAD_NAME, _grad_handler)
        _REGISTERED = True


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


def _consumers(func: relax.Function) -> dict:
    """``var -> [(binding var or None, value)]``: every binding (or the function's result, with
    ``None``) that reads ``var``, once per occurrence."""
    out: dict = {}
    body = func.body
    for block in body.blocks:
        for binding in block.bindings:
            for var in vars_in(binding.value):
                out.setdefault(var, []).append((binding.var, binding.value))
    for var in vars_in(body.body):
        out.setdefault(var, []).append((None, body.body))
    return out


@dataclass
class _Use:
    """One reader of the log-probabilities ``L``, and what it becomes."""

    kind: str  # gather | nll | rowsum | rowmean | onehot | wsum | wgather | shape
    var: relax.Var  # the binding of the replaced call
    call: relax.Call  # the call that is replaced (the sum or gather, for the multiply forms)
    keepdims: bool = False
    weights: relax.Expr | None = None  # wgather: the (V,) or (1, V) class weights


@dataclass
class _Plan:
    """Every use of one ``L = log_softmax(x)``: one kernel serves them all."""

    lsm: relax.Var
    x: relax.Expr
    uses: list = field(default_factory=list)
    pick: tuple | None = None  # ("gather", idx (N, 1)) or ("vector", t (N,))
    weights: relax.Expr | None = None  # (V,) or (1, V): the weighted row sum's weights
    row_sum: bool = False
    columns: dict | None = None  # emitted: column name -> (N,) float32 var
    wraps: bool = False  # the pick's negative targets count from the end (ONNX indices)


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, fast_exp: bool):
        super().__init__(mod)
        self.mod = mod
        self.fast_exp = fast_exp
        self.count = 0
        self.planned: dict = {}  # replaced call -> (_Plan, _Use)
        self.weight_picks: dict = {}  # gather of broadcast class weights -> the (V,) weights

    def transform(self) -> IRModule:
        for gv, func in self.mod.functions_items():
            if not isinstance(func, relax.Function) or func.attrs.get("Primitive", False):
                continue
            self.planned = {}
            for plan in _plans(func):
                for use in plan.uses:
                    self.planned[use.call] = (plan, use)
            if not self.planned:
                continue
            self.weight_picks = _weight_picks(func)
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

    def _emit_kernel(self, plan: _Plan) -> dict:
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

    def _replace(self, plan: _Plan, use: _Use) -> relax.Expr:
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


# -- matching -------------------------------------------------------------------------------


def _plans(func: relax.Function) -> list:
    """A plan for every ``log_softmax`` all of whose uses the kernel's columns can serve."""
    var2val = relax.analysis.get_var2val(func)
    consumers = _consumers(func)
    order: dict = {param: -1 for param in func.params}
    position = 0
    for block in func.body.blocks:
        for binding in block.bindings:
            order[binding.var] = position
            position += 1
    plans = []
    for lsm, value in var2val.items():
        source = log_softmax_source(lsm, value, var2val, consumers)
        if source is not None:
            plan = _plan(lsm, *source, var2val, consumers, order)
            if plan is not None:
                plans.append(plan)
    return plans


def _plan(lsm, x, axis, var2val, consumers, order) -> _Plan | None:
    what = f"log_softmax {lsm.name}"
    sinfo = x.ty
    if not isinstance(sinfo, relax.TensorType) or sinfo.ndim != 2:
        return _leave(what, "logits are not 2-D (N, V)")
    if str(sinfo.dtype) not in _FLOATS:
        return _leave(what, f"logits of dtype {sinfo.dtype}")
    if axis % 2 != 1:
        return _leave(what, "log_softmax over another axis than the classes")
    if not isinstance(sinfo.shape, relax.ShapeExpr):
        return _leave(what, "logits of unknown shape")
    n, v = sinfo.shape.values
    plan = _Plan(lsm, x)
    uses = consumers.get(lsm, [])
    if not uses:
        return _leave(what, "unused")
    for bvar, use_value in uses:
        reason = _add_use(plan, bvar, use_value, n, v, consumers, var2val)
        if reason:
            return _leave(what, reason)
    # the kernel is emitted at the first use that reads it: its inputs must exist there
    reads = [order[use.var] for use in plan.uses if use.kind != "shape"]
    if not reads:
        return _leave(what, "only its shape is read")
    first = min(reads)
    operands = [plan.pick[1] if plan.pick else None, plan.weights]
    operands += [use.weights for use in plan.uses]
    for operand in operands:
        if isinstance(operand, relax.Var) and order.get(operand, first) >= first:
            return _leave(what, f"{operand.name} is computed after the first use")
    return plan


def _int_tensor(expr, ndim: int) -> bool:
    sinfo = expr.ty
    return (
        isinstance(sinfo, relax.TensorType)
        and sinfo.ndim == ndim
        and str(sinfo.dtype).startswith(("int", "uint"))
    )


def _set_pick(plan: _Plan, pick: tuple) -> str | None:
    if plan.pick is None:
        plan.pick = pick
        return None
    if plan.pick[0] != pick[0] or not plan.pick[1].same_as(pick[1]):
        return "the uses pick different targets"
    return None


def _row_axis(call: relax.Call) -> bool:
    axis = call.attrs.axis
    return axis is not None and len(axis) == 1 and int(axis[0]) % 2 == 1


def _add_use(plan: _Plan, bvar, value, n, v, consumers, var2val) -> str | None:
    """Record one use of ``L``; a reason when the kernel cannot serve it."""
    name = op_name(value)
    lsm = plan.lsm
    if bvar is None:
        return "the log-probabilities are returned"
    if sum(1 for arg in vars_in(value) if arg.same_as(lsm)) != 1:
        return f"{name} reads the log-probabilities twice"
    if name == "relax.shape_of":
        plan.uses.append(_Use("shape", bvar, value))
        return None
    if name == "relax.gather_elements":
        reason = _gather_reason(value, lsm, n)
        if reason:
            return reason
        plan.uses.append(_Use("gather", bvar, value))
        return _set_pick(plan, _gather_pick(plan, value.args[1], v, var2val))
    if name == "relax.nn.nll_loss":
        t = value.args[1]
        if not value.args[0].same_as(lsm) or not _int_tensor(t, 1):
            return "nll_loss targets are not (N,) integers"
        if str(value.attrs.reduction) not in ("none", "sum", "mean"):
            return f"unknown reduction {value.attrs.reduction!r}"
        plan.uses.append(_Use("nll", bvar, value))
        return _set_pick(plan, ("vector", t))
    if name in ("relax.sum", "relax.mean"):
        if not _row_axis(value):
            return f"{name} not over the classes alone"
        if not isinstance(v, tirx.IntImm):
            return "a row sum over a symbolic number of classes"
        kind = "rowsum" if name == "relax.sum" else "rowmean"
        plan.row_sum = True
        plan.uses.append(_Use(kind, bvar, value, bool(value.attrs.keepdims)))
        return None
    if name == "relax.multiply":
        return _add_product(plan, bvar, value, n, v, consumers, var2val)
    return f"used by {name or type(value).__name__}"


def _add_product(plan: _Plan, bvar, value, n, v, consumers, var2val) -> str | None:
    """``L * m`` read by one row sum (``m`` a one-hot of the targets, or class weights) or by a
    gather of the target column (``m`` class weights: PyTorch's weighted ``nll_loss``)."""
    a, b = value.args
    other = b if a.same_as(plan.lsm) else a
    readers = consumers.get(bvar, [])
    if len(readers) != 1 or readers[0][0] is None:
        return "L * m is used other than by one row sum or gather"
    reader_var, reader = readers[0]
    hot = var2val.get(other) if isinstance(other, relax.Var) else None
    if op_name(hot) == "relax.one_hot":
        if op_name(reader) != "relax.sum" or not _row_axis(reader):
            return "L * one_hot is not summed over the classes"
        t = hot.args[0]
        on, off = hot.args[1], hot.args[2]
        if not _int_tensor(t, 1) or int(hot.attrs.axis) not in (-1, 1):
            return "one_hot of other targets than (N,) integers"
        if not (_prim_is(on, 1) and _prim_is(off, 0) and _equal(hot.attrs.depth, v)):
            return "one_hot is not 1/0 over the V classes"
        plan.uses.append(_Use("onehot", reader_var, reader, bool(reader.attrs.keepdims)))
        return _set_pick(plan, ("vector", t))
    if not _class_weights(other, v):
        return "L is multiplied by something other than a one-hot or (V,) weights"
    other = _view_source(other, var2val, v)
    if op_name(reader) == "relax.gather_elements":
        reason = _gather_reason(reader, bvar, n)
        if reason:
            return reason
        plan.uses.append(_Use("wgather", reader_var, reader, weights=other))
        return _set_pick(plan, _gather_pick(plan, reader.args[1], v, var2val))
    if op_name(reader) != "relax.sum" or not _row_axis(reader):
        return "L * w is neither summed over the classes nor gathered"
    if plan.weights is not None and not plan.weights.same_as(other):
        return "two different class weightings summed"
    plan.weights = other
    plan.uses.append(_Use("wsum", reader_var, reader, bool(reader.attrs.keepdims)))
    return None


def _gather_pick(plan: _Plan, idx, v, var2val) -> tuple:
    """The pick of ``gather_elements(L, idx)``: the targets before the importer's negative-index
    ``where`` (the kernel wraps negative targets itself), else ``idx``."""
    targets = unwrap_negative_index(idx, var2val, v)
    if targets is None:
        return ("gather", idx)
    plan.wraps = True
    return ("gather", targets)


def _weight_picks(func: relax.Function) -> dict:
    """``gather_elements(broadcast_to(w, (N, V)), idx (N, 1), axis=1)`` with class weights ``w``
    (``(V,)`` / ``(1, V)``): ``{gather call: w}``. PyTorch's weighted ``nll_loss`` with the mean
    reduction picks its denominator's weights so, an (N, V) broadcast that stock builds in
    memory; ``w[idx]`` reads V floats once. Only looked for beside a fused log-softmax."""
    var2val = relax.analysis.get_var2val(func)
    picks = {}
    for value in var2val.values():
        if op_name(value) != "relax.gather_elements" or not isinstance(value.args[0], relax.Var):
            continue
        broadcast = var2val.get(value.args[0])
        sinfo = value.args[0].ty
        if op_name(broadcast) != "relax.broadcast_to" or not isinstance(
            getattr(sinfo, "shape", None), relax.ShapeExpr
        ):
            continue
        if sinfo.ndim != 2:
            continue
        n, v = sinfo.shape.values
        weights = broadcast.args[0]
        if not _class_weights(weights, v) or _gather_reason(value, value.args[0], n):
            continue
        picks[value] = _view_source(weights, var2val, v)
    return picks


def _view_source(expr, var2val, v):
    """Follow ``reshape`` / ``expand_dims`` / ``squeeze`` of class weights back to the tensor
    they view (exporters emit ``w.view(1, V)`` right before each use; the kernel needs a value
    that exists at the first use of the log-probabilities)."""
    views = ("relax.reshape", "relax.expand_dims", "relax.squeeze")
    while isinstance(expr, relax.Var) and op_name(var2val.get(expr)) in views:
        source = var2val[expr].args[0]
        if not _class_weights(source, v):
            break
        expr = source
    return expr


def _class_weights(expr, v) -> bool:
    """``expr`` is a float ``(V,)`` or ``(1, V)`` tensor."""
    sinfo = expr.ty
    if not (
        isinstance(sinfo, relax.TensorType)
        and str(sinfo.dtype) in _FLOATS
        and isinstance(sinfo.shape, relax.ShapeExpr)
        and sinfo.ndim in (1, 2)
    ):
        return False
    dims = sinfo.shape.values
    return _equal(dims[-1], v) and (sinfo.ndim == 1 or _equal(dims[0], 1))


def _gather_reason(call: relax.Call, source, n) -> str | None:
    """Why ``call`` is not ``gather_elements(source, idx (N, 1), axis=1)``, or None."""
    idx = call.args[1]
    if not call.args[0].same_as(source) or int(call.attrs.axis) % 2 != 1:
        return "gather over the rows"
    if not _int_tensor(idx, 2):
        return "gather index is not an integer (N, 1)"
    shape = idx.ty.shape
    if not isinstance(shape, relax.ShapeExpr) or not (
        _equal(shape.values[0], n) and _equal(shape.values[1], 1)
    ):
        return "gather index is not (N, 1)"
    return None


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


def _prim_is(expr, number) -> bool:
    """``expr`` (an ``IntImm`` / ``FloatImm``, or a ``PrimValue`` of one) equals ``number``."""
    value = getattr(expr, "value", None)
    if isinstance(value, tirx.IntImm | tirx.FloatImm):
        value = value.value
    return isinstance(value, int | float) and float(value) == float(number)


def _equal(a, b) -> bool:
    return prove_equal_shapes(a, b)


def _is_null(expr) -> bool:
    return expr is None or (isinstance(expr, relax.Tuple) and not expr.fields)


def _leave(what: str, reason: str) -> None:
    skip(logger, what, reason)
    return None
