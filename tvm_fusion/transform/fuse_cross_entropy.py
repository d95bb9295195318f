"""FuseCrossEntropy: ``log_softmax -> gather(targets)`` without the (N, V) log-probabilities.

Cross entropy is ``log_softmax(x)[i, t_i]`` (nvFuser #2556). Stock Relax computes the whole
``(N, V)`` log-softmax, writes it, and reads one value per row back. This pass replaces the
log-softmax and its gather by one kernel per row block, ``ce_rows(x, t) -> (N, 2)`` holding the
row's ``lse = max + log(sum(exp(x - max)))`` and the target logit ``x[i, t_i]``, computed while
the row is in cache; the picked log-probability is ``x_t - lse``. Every other step of the loss
(ignore_index, class weights, the reduction) works on ``(N,)`` vectors in ordinary Relax ops.

Matches (``x`` 2-D ``(N, V)``, ``N`` static or symbolic, float16/bfloat16/float32 logits
accumulated in float32; ``L = log_softmax(x, axis=-1)`` with no other use):

- ``gather_elements(L, idx, axis=1)`` with ``idx`` of shape ``(N, 1)`` (what exporters make of
  ``take_along_axis`` / ``torch.gather``), e.g. the embedded ``cross_entropy`` workload;
- ``nll_loss(L, t, weights, reduction, ignore_index)`` (PyTorch's ``F.cross_entropy``
  semantics: weighted mean over non-ignored rows, NaN when every row is ignored).

Gradient: the kernel is emitted as ``call_tir_with_grad`` with a TE gradient registered under
``tvm_fusion.cross_entropy_grad``. Run the pass (or :func:`tvm_fusion.fusion_passes`) before
``relax.transform.Gradient``: the adjoint is then one elementwise pass over the logits,
``dx = g_lse * exp(x - lse) + g_xt * onehot(t)``, reading the saved ``lse`` (no (N, V) tensor is
saved by the forward). The pipeline turns remaining ``call_tir_with_grad`` into ``call_tir``.

Reads of the logits: the max, the sum of exponentials and the target pick are separate
reductions over the same row in one kernel; the schedule computes them row by row, so a row of
``V`` floats is read from memory once and re-read from cache (128 KiB for V = 32768).

Left alone, with the reason at debug level: log-softmax on another axis or of another rank, a
log-softmax also used elsewhere (e.g. returned), a gather of other shape, a non-integer target.
On CPU targets ``exp`` is TVM's polynomial ``fast_exp`` (see :mod:`tvm_fusion.legalize`).
"""

from __future__ import annotations

import tvm
from tvm import IRModule, relax, te, tirx, topi
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.relax.training.utils import register_global_func

from .. import target as _target
from ._common import get_logger, record_rewrite, skip

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


def cross_entropy_rows(x: te.Tensor, t: te.Tensor, fast_exp: bool = False) -> te.Tensor:
    """``(N, 2)`` float32: column 0 the row's log-sum-exp, column 1 the logit of its target.

    A target outside ``[0, V)`` (an ignored row) picks column 0; callers mask such rows.
    """
    n, v = x.shape
    xf = _acc(x)
    k = te.reduce_axis((0, v), "k")
    row_max = te.compute((n,), lambda i: te.max(xf(i, k), axis=k), name="ce_max")
    shifted = te.compute((n, v), lambda i, j: xf(i, j) - row_max[i], name="ce_shifted")
    exp = _exp_at(shifted, fast_exp)
    k2 = te.reduce_axis((0, v), "k2")
    sum_exp = te.compute((n,), lambda i: te.sum(exp(i, k2), axis=k2), name="ce_sumexp")

    def pick(i):
        ti = t[i].astype("int64")
        safe = tirx.Select(tirx.all(ti >= 0, ti < v), ti, tirx.const(0, "int64"))
        return xf(i, safe)

    return te.compute(
        (n, 2),
        lambda i, c: tirx.Select(c == 0, row_max[i] + te.log(sum_exp[i]), pick(i)),
        name="ce_rows",
    )


def cross_entropy_grad(
    output_grad: te.Tensor, rows: te.Tensor, x: te.Tensor, t: te.Tensor, fast_exp: bool = False
):
    """d/dx of ``rows = cross_entropy_rows(x, t)``: ``g_lse * softmax(x) + g_xt * onehot(t)``,
    one elementwise pass over the logits, ``softmax = exp(x - lse)`` from the saved lse."""
    n, v = x.shape
    xf = _acc(x)
    shifted = te.compute((n, v), lambda i, j: xf(i, j) - rows[i, 0], name="ce_grad_shifted")
    prob = _exp_at(shifted, fast_exp)

    def grad(i, j):
        hit = j.astype("int64") == t[i].astype("int64")
        value = output_grad[i, 0] * prob(i, j) + tirx.Select(
            hit, output_grad[i, 1], tirx.const(0.0, ACC)
        )
        return value if x.dtype == ACC else value.astype(x.dtype)

    return [te.compute((n, v), grad, name="ce_grad")]


def _grad_handler(orig_var, call, output_grad, ctx: relax.BlockBuilder):
    """Gradient of ``call_tir_with_grad(ce_rows, (x, t))``: dx, and no gradient for t.

    Registered by hand (not with ``register_te_gradient``) because the gradient reads the
    forward's output (the saved lse), which the stock handler does not pass on.
    """
    x, t = call.args[1]
    fast = bool(call.attrs.te_grad_kwargs.get("fast_exp", False))
    dx = ctx.emit_te(
        cross_entropy_grad, output_grad, orig_var, x, t, fast, primfunc_name_hint="ce_grad"
    )
    return ctx.emit(relax.Tuple([dx, relax.op.zeros_like(t)]))


_REGISTERED = False


def register_gradient() -> None:
    global _REGISTERED
    if not _REGISTERED:
        register_global_func("tvm.relax.te_grad._register." + GRAD_NAME, _grad_handler)
        _REGISTERED = True


@tvm.transform.module_pass(opt_level=0, name=NAME)
class FuseCrossEntropy:
    """``log_softmax -> gather_elements / nll_loss`` as one pass over the logits per row (see
    the module docstring)."""

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


def _op_name(expr) -> str | None:
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


def _uses(func: relax.Function) -> dict:
    counts: dict = {}

    def visit(expr):
        if isinstance(expr, relax.Var):
            counts[expr] = counts.get(expr, 0) + 1

    relax.analysis.post_order_visit(func.body, visit)
    return counts


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, fast_exp: bool):
        super().__init__(mod)
        self.mod = mod
        self.fast_exp = fast_exp
        self.count = 0
        self.var2val: dict = {}
        self.uses: dict = {}

    def transform(self) -> IRModule:
        for gv, func in self.mod.functions_items():
            if not isinstance(func, relax.Function) or func.attrs.get("Primitive", False):
                continue
            self.var2val = relax.analysis.get_var2val(func)
            self.uses = _uses(func)
            new_func = self.visit_expr(func)
            new_func = relax.analysis.remove_all_unused(new_func)
            self.builder_.update_func(gv, new_func)
        return self.builder_.get()

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        name = _op_name(call)
        replaced = None
        if name == "relax.gather_elements":
            replaced = self._gather(call)
        elif name == "relax.nn.nll_loss":
            replaced = self._nll(call)
        if replaced is None:
            return super().visit_call_(call)
        self.count += 1
        return replaced

    # -- matching ---------------------------------------------------------------------------

    def _log_softmax_input(self, what: str, lsm) -> relax.Expr | None:
        """``x`` when ``lsm`` is a single-use ``log_softmax(x)`` over the last axis of 2-D x."""
        if not isinstance(lsm, relax.Var) or lsm not in self.var2val:
            return _leave(what, "input is not a bound log_softmax")
        value = self.var2val[lsm]
        if _op_name(value) != "relax.nn.log_softmax":
            return _leave(what, "input is not a log_softmax")
        x = value.args[0]
        sinfo = x.ty
        if not isinstance(sinfo, relax.TensorType) or sinfo.ndim != 2:
            return _leave(what, "logits are not 2-D (N, V)")
        if str(sinfo.dtype) not in _FLOATS:
            return _leave(what, f"logits of dtype {sinfo.dtype}")
        if int(value.attrs.axis) % 2 != 1:
            return _leave(what, "log_softmax over another axis than the classes")
        if self.uses.get(lsm, 0) != 1:
            return _leave(what, "the log-probabilities are used elsewhere")
        return x

    def _rows(self, x, t) -> tuple[relax.Expr, relax.Expr]:
        """Emit the fused kernel; return (lse, x_t), each (N,) float32."""
        n = x.ty.shape.values[0]
        packed = self.builder_.emit(
            self.builder_.call_te_with_grad(
                cross_entropy_rows,
                x,
                t,
                self.fast_exp,
                te_grad_name=GRAD_NAME,
                te_grad_kwargs={"fast_exp": self.fast_exp},
                primfunc_name_hint="cross_entropy_rows",
            )
        )
        parts = self.builder_.emit(relax.op.split(packed, 2, axis=1))
        lse = self.builder_.emit(relax.op.reshape(relax.TupleGetItem(parts, 0), [n]))
        xt = self.builder_.emit(relax.op.reshape(relax.TupleGetItem(parts, 1), [n]))
        return lse, xt

    def _gather(self, call: relax.Call) -> relax.Expr | None:
        lsm, idx = call.args
        what = f"gather_elements of {lsm}"
        x = self._log_softmax_input(what, lsm)
        if x is None:
            return None
        if int(call.attrs.axis) % 2 != 1:
            return _leave(what, "gather over the rows")
        isinfo = idx.ty
        if not isinstance(isinfo, relax.TensorType) or isinfo.ndim != 2:
            return _leave(what, "index is not (N, 1)")
        if not str(isinfo.dtype).startswith(("int", "uint")):
            return _leave(what, "non-integer index")
        analyzer = tvm.sym.Analyzer()
        n = x.ty.shape.values[0]
        if not (
            analyzer.can_prove_equal(isinfo.shape.values[0], n)
            and analyzer.can_prove_equal(isinfo.shape.values[1], 1)
        ):
            return _leave(what, "index is not (N, 1)")
        t = self.builder_.emit(relax.op.reshape(self.visit_expr(idx), [n]))
        lse, xt = self._rows(self.visit_expr(x), t)
        picked = self.builder_.emit(relax.op.subtract(xt, lse))
        out = relax.op.reshape(picked, [n, 1])
        dtype = str(x.ty.dtype)
        if dtype != ACC:
            out = relax.op.astype(self.builder_.emit(out), dtype)
        return self.builder_.normalize(out)

    def _nll(self, call: relax.Call) -> relax.Expr | None:
        lsm, t = call.args[0], call.args[1]
        weights = call.args[2] if len(call.args) > 2 else None
        what = f"nll_loss of {lsm}"
        x = self._log_softmax_input(what, lsm)
        if x is None:
            return None
        tsinfo = t.ty
        if not isinstance(tsinfo, relax.TensorType) or tsinfo.ndim != 1:
            return _leave(what, "targets are not (N,)")
        if not str(tsinfo.dtype).startswith(("int", "uint")):
            return _leave(what, "non-integer targets")
        reduction = str(call.attrs.reduction)
        ignore = int(call.attrs.ignore_index)
        bb = self.builder_
        t = self.visit_expr(t)
        lse, xt = self._rows(self.visit_expr(x), t)
        tdtype = str(tsinfo.dtype)
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
        rows = bb.emit(relax.op.multiply(bb.emit(relax.op.subtract(lse, xt)), w_t))
        if reduction == "none":
            out = rows
        elif reduction == "sum":
            out = bb.emit(relax.op.sum(rows))
        elif reduction == "mean":
            out = bb.emit(relax.op.divide(bb.emit(relax.op.sum(rows)), bb.emit(relax.op.sum(w_t))))
        else:
            return _leave(what, f"unknown reduction {reduction!r}")
        dtype = str(x.ty.dtype)
        if dtype != ACC:
            out = bb.emit(relax.op.astype(out, dtype))
        return out


def _is_null(expr) -> bool:
    return expr is None or (isinstance(expr, relax.Tuple) and not expr.fields)


def _leave(what: str, reason: str) -> None:
    skip(logger, what, reason)
    return None
