"""The fused cross-entropy kernel of :class:`~.fuse_cross_entropy.FuseCrossEntropy` and its
gradient, written in TE.

``cross_entropy_rows(x, t[, w]) -> (N, k)`` float32 row statistics of the logits computed in one
pass over each row (columns :func:`row_columns`: ``lse``, ``x_t``, optionally ``sum_x`` and
``sum_wx``); :func:`cross_entropy_grad` its adjoint, one elementwise pass over the logits that
reads the saved ``lse``. :func:`register_gradient` registers that adjoint under
:data:`GRAD_NAME` for ``call_tir_with_grad`` (by hand: the stock TE-gradient handler does not
pass the forward's output on). :class:`~.fuse_linear_cross_entropy.FuseLinearCrossEntropy`
emits the same kernel after its GEMM.
"""

from __future__ import annotations

from tvm import relax, te, tirx, topi
from tvm.relax.training.utils import register_global_func

GRAD_NAME = "tvm_fusion.cross_entropy_grad"
KERNEL_ATTR = "tvm_fusion.cross_entropy"
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
