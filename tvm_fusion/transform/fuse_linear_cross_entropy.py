"""FuseLinearCrossEntropy: ``hidden @ W^T -> cross entropy`` chunked over rows, so the (N, V)
logits never exist at once, forward or backward (Liger Kernel's fused linear cross entropy).

A language model's loss multiplies ``N`` hidden states ``(N, K)`` by the vocabulary projection
``(K, V)`` and takes the cross entropy of the ``(N, V)`` logits: at N = 2048, V = 32000 the
logits alone are 262 MB, the log-probs of the stock graph another 262 MB, and the backward adds
their gradients. FuseCrossEntropy already removes the log-probs; this pass removes the logits.

Matches what FuseCrossEntropy emits (run it after that pass): its row kernel
``call_tir_with_grad(cross_entropy_rows, (logits, t[, w]))`` whose ``logits`` are read by
nothing else and are ``matmul(h, Wt)`` (``+ bias``), possibly through a ``reshape`` of
``(B, S, V)`` logits to ``(N, V)`` (an LM head over a batch of sequences). ``N`` and ``V``
static, ``Wt`` 2-D.

Emits: ``h`` (as ``(N, K)``) and ``t`` split into row chunks of ``C`` rows
(``C * V * 4 <= chunk_bytes``), and per chunk
``start_checkpoint(h_c) -> matmul(h_c, Wt) (+ bias) -> end_checkpoint -> cross_entropy_rows``;
the ``(C, k)`` row statistics are concatenated back to ``(N, k)``, which the rest of the loss
reads as before. The memory planner reuses one chunk's logits buffer for the next, so the
forward holds ``C * V`` logits, not ``N * V``. The checkpoint marks make
``relax.transform.Gradient`` recompute each chunk's logits in the backward instead of saving
them (one extra GEMM per chunk, as Liger does); the backward then holds one chunk's logits and
logit gradients at a time, plus the ``(K, V)`` weight gradient it accumulates. Forward-only
builds lower the marks to nothing.

Left alone, with the reason at debug level: symbolic ``N`` or ``V`` (the chunks are static
splits), logits read elsewhere (returned, or a second loss), ``N`` within one chunk, a matmul
that is not 2-D x 2-D after the reshape.
"""

from __future__ import annotations

import tvm
from tvm import IRModule, relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.relax.training.utils import register_global_func

from ._common import get_logger, op_name, record_rewrite, skip, use_counts
from .fuse_cross_entropy import GRAD_NAME, cross_entropy_rows
from .fuse_cross_entropy import register_gradient as register_ce_gradient

logger = get_logger(__name__)
NAME = "FuseLinearCrossEntropy"
LOGITS_GRAD_NAME = "tvm_fusion.linear_logits_grad"
CHUNK_BYTES = 16 << 20  # logits of one chunk: 16 MiB (128 rows at V = 32000)
_ROW_MULTIPLE = 16


def chunk_rows(v: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk: a multiple of 16 whose float32 logits fit ``chunk_bytes`` (16 at least)."""
    rows = chunk_bytes // (4 * v)
    return max(_ROW_MULTIPLE, rows // _ROW_MULTIPLE * _ROW_MULTIPLE)


def linear_logits(h: te.Tensor, w: te.Tensor, bias: te.Tensor | None = None) -> te.Tensor:
    """``h @ w^T (+ bias)`` with ``w`` in its ``(V, K)`` layout: the chunk reads the weight in
    place instead of a transposed ``(K, V)`` copy of it (the schedule packs its panels)."""
    c, k = h.shape
    v = w.shape[0]
    r = te.reduce_axis((0, k), "k")
    out = te.compute((c, v), lambda i, j: te.sum(h[i, r] * w[j, r], axis=r), name="logits")
    if bias is None:
        return out
    return te.compute((c, v), lambda i, j: out[i, j] + bias[j], name="logits_bias")


def _logits_grad(orig_var, call, output_grad, ctx: relax.BlockBuilder):
    """Gradient of ``linear_logits(h, w[, bias])``: ``dh = g @ w``, ``dw = g^T @ h``,
    ``dbias = sum_rows(g)``, as Relax matmuls that the GEMM schedule handles."""
    args = list(call.args[1])
    h, w = args[0], args[1]
    grads = [
        ctx.emit(relax.op.matmul(output_grad, w)),
        ctx.emit(relax.op.matmul(ctx.emit(relax.op.permute_dims(output_grad)), h)),
    ]
    if len(args) > 2:
        grads.append(ctx.emit(relax.op.sum(output_grad, axis=[0])))
    return ctx.emit(relax.Tuple(grads))


_REGISTERED = False


def register_gradient() -> None:
    global _REGISTERED
    register_ce_gradient()
    if not _REGISTERED:
        register_global_func("tvm.relax.te_grad._register." + LOGITS_GRAD_NAME, _logits_grad)
        _REGISTERED = True


@tvm.transform.module_pass(opt_level=0, name=NAME)
class FuseLinearCrossEntropy:
    """``matmul -> cross entropy`` row kernel, chunked over rows with recomputed logits (see the
    module docstring). ``rows`` fixes the chunk size (tests); else it comes from
    ``chunk_bytes``."""

    def __init__(self, target=None, chunk_bytes: int = CHUNK_BYTES, rows: int | None = None):
        self.target = target
        self.chunk_bytes = chunk_bytes
        self.rows = rows

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        register_gradient()
        rewriter = _Rewriter(mod, self.chunk_bytes, self.rows)
        mod = rewriter.transform()
        record_rewrite(NAME, rewriter.count)
        return mod


def _static(shape) -> list[int] | None:
    if not isinstance(shape, relax.ShapeExpr):
        return None
    dims = list(shape.values)
    if not all(isinstance(d, tirx.IntImm) for d in dims):
        return None
    return [int(d.value) for d in dims]


class _Match:
    """``logits = [reshape](matmul(h, wt) [+ bias])`` feeding one row kernel; ``w`` is the
    ``(V, K)`` weight when ``wt = permute_dims(w)``."""

    def __init__(self, h, wt, w, bias, n: int, v: int, k: int):
        self.h, self.wt, self.w, self.bias = h, wt, w, bias
        self.n, self.v, self.k = n, v, k


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, chunk_bytes: int, rows: int | None):
        super().__init__(mod)
        self.mod = mod
        self.chunk_bytes = chunk_bytes
        self.rows = rows
        self.count = 0
        self.var2val: dict = {}
        self.uses: dict = {}

    def transform(self) -> IRModule:
        kernel_op = tvm.ir.Op.get("relax.call_tir_with_grad")
        for gv, func in self.mod.functions_items():
            if not isinstance(func, relax.Function) or func.attrs.get("Primitive", False):
                continue
            self.var2val = relax.analysis.get_var2val(func)
            if not any(
                isinstance(value, relax.Call) and value.op.same_as(kernel_op)
                for value in self.var2val.values()
            ):
                continue
            self.uses = use_counts(func)
            new_func = self.visit_expr(func)
            new_func = relax.analysis.remove_all_unused(new_func)
            self.builder_.update_func(gv, new_func)
        mod = self.builder_.get()
        if self.count:  # drop the unchunked kernels, keep every Relax function
            entries = [
                gv.name_hint for gv, f in mod.functions_items() if isinstance(f, relax.Function)
            ]
            mod = relax.transform.DeadCodeElimination(entries)(mod)
        return mod

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        if op_name(call) == "relax.call_tir_with_grad" and str(call.attrs.te_grad_name) == (
            GRAD_NAME
        ):
            match = self._match(call)
            if match is not None:
                self.count += 1
                return self._chunked(call, match)
        return super().visit_call_(call)

    # -- matching ---------------------------------------------------------------------------

    def _single_use_value(self, var, what: str, role: str):
        if not isinstance(var, relax.Var) or var not in self.var2val:
            return _leave(what, f"{role} is not a bound value")
        if self.uses.get(var, 0) != 1:
            return _leave(what, f"{role} is read elsewhere")
        return self.var2val[var]

    def _match(self, call: relax.Call) -> _Match | None:
        logits = call.args[1][0]
        what = f"cross entropy of {getattr(logits, 'name', logits)}"
        shape = _static(logits.ty.shape) if isinstance(logits.ty, relax.TensorType) else None
        if shape is None or len(shape) != 2:
            return _leave(what, "logits are not a static (N, V) tensor")
        n, v = shape
        value = self._single_use_value(logits, what, "the logits")
        if value is None:
            return None
        if op_name(value) == "relax.reshape":
            value = self._single_use_value(value.args[0], what, "the unreshaped logits")
            if value is None:
                return None
        bias = None
        if op_name(value) == "relax.add":
            a, b = value.args
            mm = a if op_name(self.var2val.get(a)) == "relax.matmul" else b
            bias = b if mm.same_as(a) else a
            if _static(bias.ty.shape) not in ([v], [1, v]):
                return _leave(what, "the add after the matmul is no (V,) bias")
            value = self._single_use_value(mm, what, "the matmul")
            if value is None:
                return None
        if op_name(value) != "relax.matmul":
            return _leave(what, "the logits are not a matmul")
        h, wt = value.args
        if value.attrs.out_dtype and str(value.attrs.out_dtype) not in ("", "void", "float32"):
            return _leave(what, f"matmul to {value.attrs.out_dtype}")
        h_shape, w_shape = _static(h.ty.shape), _static(wt.ty.shape)
        if h_shape is None or w_shape is None or len(w_shape) != 2 or w_shape[1] != v:
            return _leave(what, "the weight is not a static (K, V) matrix")
        k = w_shape[0]
        lead = 1
        for d in h_shape[:-1]:
            lead *= d
        if len(h_shape) < 2 or h_shape[-1] != k or lead != n:
            return _leave(what, "the hidden states do not flatten to (N, K)")
        if str(logits.ty.dtype) != "float32":
            return _leave(what, f"{logits.ty.dtype} logits")
        rows = self.rows or chunk_rows(v, self.chunk_bytes)
        if n <= rows:
            return _leave(what, f"N = {n} fits one chunk of {rows} rows")
        w = None
        transpose = self.var2val.get(wt) if isinstance(wt, relax.Var) else None
        if op_name(transpose) == "relax.permute_dims" and (
            transpose.attrs.axes is None or [int(a) for a in transpose.attrs.axes] == [1, 0]
        ):
            w = transpose.args[0]
        return _Match(h, wt, w, bias, n, v, k)

    # -- rewriting --------------------------------------------------------------------------

    def _chunked(self, call: relax.Call, match: _Match) -> relax.Expr:
        bb = self.builder_
        rows = self.rows or chunk_rows(match.v, self.chunk_bytes)
        h = self.visit_expr(match.h)
        if h.ty.ndim != 2:
            h = bb.emit(relax.op.reshape(h, [match.n, match.k]))
        weight = self.visit_expr(match.w if match.w is not None else match.wt)
        bias = self.visit_expr(match.bias) if match.bias is not None else None
        if bias is not None and match.w is not None and bias.ty.ndim != 1:
            bias = bb.emit(relax.op.reshape(bias, [match.v]))  # linear_logits reads bias[j]
        args = [self.visit_expr(a) for a in call.args[1]]
        t, extra = args[1], args[2:]
        options = call.attrs.te_grad_kwargs
        fast = bool(options.get("fast_exp", False))
        row_sum = bool(options.get("row_sum", False))
        kwargs = {"row_sum": True} if row_sum else {}
        if extra:
            kwargs["weights"] = extra[0]
        bounds = list(range(rows, match.n, rows))
        h_parts = bb.emit(relax.op.split(h, bounds, axis=0))
        t_parts = bb.emit(relax.op.split(t, bounds, axis=0))
        pieces = []
        for i in range(len(bounds) + 1):
            h_c = bb.emit(relax.op.grad.start_checkpoint(relax.TupleGetItem(h_parts, i)))
            if match.w is not None:  # x @ w^T without the transposed copy of w
                logit_args = [h_c, weight] + ([bias] if bias is not None else [])
                logits = bb.emit(
                    bb.call_te_with_grad(
                        linear_logits,
                        *logit_args,
                        te_grad_name=LOGITS_GRAD_NAME,
                        primfunc_name_hint="linear_logits",
                    )
                )
            else:
                logits = bb.emit(relax.op.matmul(h_c, weight))
                if bias is not None:
                    logits = bb.emit(relax.op.add(logits, bias))
            logits = bb.emit(relax.op.grad.end_checkpoint(logits))
            pieces.append(
                bb.emit(
                    bb.call_te_with_grad(
                        cross_entropy_rows,
                        logits,
                        relax.TupleGetItem(t_parts, i),
                        fast,
                        te_grad_name=GRAD_NAME,
                        te_grad_kwargs=dict(options.items()),
                        primfunc_name_hint="cross_entropy_rows_chunk",
                        **kwargs,
                    )
                )
            )
        return relax.op.concat(pieces, axis=0)


def _leave(what: str, reason: str) -> None:
    skip(logger, what, reason)
    return None
