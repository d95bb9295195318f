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

Symbolic ``N`` (every dynamic export: ``N = batch * seq``): the row count is not known when
the graph is built, and a Relax dataflow graph has no loop, so the chunks are a fixed number
``P`` of equal chunks of ``C = ceil(N / P)`` rows. ``h`` and ``t`` are padded to ``P * C`` rows
(``rows_to``: at most ``P - 1`` zero rows), viewed as ``(P, C, ...)`` and split along the ``P``
axis, and the stacked statistics cut back to ``N`` rows (``rows_to`` again; each is the other's
gradient). ``P``
comes from the function's ``tir_var_upper_bound`` attribute (Relax's way to bound a symbolic
dim, also what lets the memory planner give the chunks static storage) when it bounds ``N``:
``P = ceil(N_max / rows)``, so a chunk never holds more than one static chunk's logits; with no
bound, ``P = chunks`` (8), and a chunk holds ``N / 8`` rows' logits. The alternative, a loop
over chunks of a static size, needs control flow, which ``relax.transform.Gradient`` does not
differentiate, and an unrolled loop needs the chunk count before ``N`` is known.

Left alone, with the reason at debug level: symbolic ``V``, logits read elsewhere (returned,
or a second loss), ``N`` within one chunk (static ``N``, or the bound of a symbolic one), a
matmul that is not 2-D x 2-D after the reshape.
"""

from __future__ import annotations

import tvm
from tvm import IRModule, relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.relax.training.utils import register_global_func

from ._common import (
    const_int,
    get_logger,
    op_name,
    prove_equal_shapes,
    record_rewrite,
    skip,
    static_shape,
    use_counts,
)
from ._cross_entropy_kernel import GRAD_NAME, cross_entropy_rows
from ._cross_entropy_kernel import register_gradient as register_ce_gradient

logger = get_logger(__name__)
NAME = "FuseLinearCrossEntropy"
LOGITS_GRAD_NAME = "tvm_fusion.linear_logits_grad"
CHUNK_BYTES = 16 << 20  # logits of one chunk: 16 MiB (128 rows at V = 32000)
CHUNKS = 8  # chunks of a symbolic N with no upper bound
ROWS_GRAD_NAME = "tvm_fusion.rows_to_grad"
_ROW_MULTIPLE = 16
# Views that move rows only (a last-axis-preserving reshape, a slice of the leading axes), as
# between an LM head's matmul and its loss: ``logits[:, :-1].reshape(-1, V)``.
_ROW_VIEWS = ("relax.reshape", "relax.strided_slice")


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


def rows_to(x: te.Tensor, rows) -> te.Tensor:
    """``x`` with ``rows`` rows: its first rows, then zero rows past its own (pads or cuts)."""
    n = x.shape[0]
    zero = tirx.const(0, x.dtype)
    return te.compute(
        (rows, *x.shape[1:]),
        lambda i, *rest: tirx.if_then_else(i < n, x[(tirx.min(i, n - 1), *rest)], zero),
        name="rows_to",
    )


def _rows_grad(orig_var, call, output_grad, ctx: relax.BlockBuilder):
    """Gradient of ``rows_to(x, rows)``: the output gradient cut or padded back to ``x``'s
    rows."""
    x = call.args[1][0]
    rows = x.ty.shape.values[0]
    return ctx.emit(
        relax.Tuple(
            [
                ctx.emit(
                    ctx.call_te_with_grad(
                        rows_to,
                        output_grad,
                        rows,
                        te_grad_name=ROWS_GRAD_NAME,
                        primfunc_name_hint="rows_to",
                    )
                )
            ]
        )
    )


_REGISTERED = False


def register_gradient() -> None:
    global _REGISTERED
    register_ce_gradient()
    if not _REGISTERED:
        register_global_func("tvm.relax.te_grad._register." + LOGITS_GRAD_NAME, _logits_grad)
        register_global_func("tvm.relax.te_grad._register." + ROWS_GRAD_NAME, _rows_grad)
        _REGISTERED = True


@tvm.transform.module_pass(opt_level=0, name=NAME)
class FuseLinearCrossEntropy:
    """``matmul -> cross entropy`` row kernel, chunked over rows with recomputed logits (see the
    module docstring). ``rows`` fixes the chunk size (tests); else it comes from
    ``chunk_bytes``. ``chunks``: how many chunks a symbolic N with no upper bound becomes."""

    def __init__(
        self,
        target=None,
        chunk_bytes: int = CHUNK_BYTES,
        rows: int | None = None,
        chunks: int = CHUNKS,
    ):
        self.target = target
        self.chunk_bytes = chunk_bytes
        self.rows = rows
        self.chunks = chunks

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        register_gradient()
        rewriter = _Rewriter(mod, self.chunk_bytes, self.rows, self.chunks)
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
    ``(V, K)`` weight when ``wt = permute_dims(w)``. ``n`` is an int or, for a symbolic ``N``, a
    PrimExpr split into ``chunks`` equal chunks."""

    def __init__(self, h, wt, w, bias, n, v: int, k: int, chunks: int | None, views=()):
        self.h, self.wt, self.w, self.bias = h, wt, w, bias
        self.views = list(views)  # row views of the logits, in program order, to apply to h
        self.n, self.v, self.k = n, v, k
        self.chunks = chunks  # equal chunks of a symbolic N; None: static N in ``rows`` rows


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, chunk_bytes: int, rows: int | None, chunks: int):
        super().__init__(mod)
        self.mod = mod
        self.chunk_bytes = chunk_bytes
        self.rows = rows
        self.chunks = max(2, chunks)
        self.bounds: dict[str, int] = {}
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
            bounds = func.attrs.get("tir_var_upper_bound", None) if func.attrs else None
            self.bounds = {str(k): int(b) for k, b in (bounds or {}).items()}
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

    def _row_view(self, view: relax.Call, v: int) -> bool:
        """``view`` regroups or slices rows and keeps every row's ``V`` columns."""
        shapes = [static_shape(view.args[0]), static_shape(view)]
        if any(shape is None or const_int(shape[-1]) != v for shape in shapes):
            return False
        if op_name(view) == "relax.strided_slice":
            rank = len(shapes[0])
            axes = [const_int(getattr(a, "value", a)) for a in view.args[1].fields]
            return all(a is not None and a % rank != rank - 1 for a in axes)
        return True

    def _bias_operands(self, add: relax.Call, v: int):
        """``(matmul side, bias)`` of ``add``; the bias a ``(V,)`` or ``(1, V)`` tensor."""
        for source, bias in (add.args, add.args[::-1]):
            if _static(bias.ty.shape) in ([v], [1, v]) and isinstance(source, relax.Var):
                if op_name(self.var2val.get(source)) in ("relax.matmul", *_ROW_VIEWS):
                    return source, bias
        return None, None

    def _match(self, call: relax.Call) -> _Match | None:
        logits = call.args[1][0]
        what = f"cross entropy of {getattr(logits, 'name', logits)}"
        sinfo = logits.ty if isinstance(logits.ty, relax.TensorType) else None
        shape = static_shape(logits)
        if sinfo is None or shape is None or len(shape) != 2:
            return _leave(what, "logits are not an (N, V) tensor of known shape")
        n, v = shape[0], const_int(shape[1])
        if v is None:
            return _leave(what, "symbolic vocabulary V")
        value = self._single_use_value(logits, what, "the logits")
        if value is None:
            return None
        views, bias = [], None  # row views from the matmul's output to the logits, last first
        while True:
            name = op_name(value)
            if name in _ROW_VIEWS:
                source = value.args[0]
                if not self._row_view(value, v):
                    return _leave(what, f"{name} between the matmul and the logits moves columns")
                views.append(value)
            elif name == "relax.astype" and value.args[0].ty.dtype == value.ty.dtype:
                source = value.args[0]  # ``logits.float()`` of float32 logits: no cast at all
            elif name == "relax.add" and bias is None:
                source, bias = self._bias_operands(value, v)
                if bias is None:
                    return _leave(what, "the add after the matmul is no (V,) bias")
            else:
                break
            value = self._single_use_value(source, what, f"the input of {name}")
            if value is None:
                return None
        if op_name(value) != "relax.matmul":
            return _leave(what, "the logits are not a matmul")
        h, wt = value.args
        if value.attrs.out_dtype and str(value.attrs.out_dtype) not in ("", "void", "float32"):
            return _leave(what, f"matmul to {value.attrs.out_dtype}")
        h_shape, w_shape = static_shape(h), _static(wt.ty.shape)
        if h_shape is None or w_shape is None or len(w_shape) != 2 or w_shape[1] != v:
            return _leave(what, "the weight is not a static (K, V) matrix")
        k = w_shape[0]
        if views:  # the hidden rows the logits' rows come from
            h_shape = list(views[0].ty.shape.values[:-1]) + [k]
        lead = tirx.IntImm("int64", 1)
        for d in h_shape[:-1]:
            lead = lead * d
        if len(h_shape) < 2 or const_int(h_shape[-1]) != k or not prove_equal_shapes(lead, n):
            return _leave(what, "the hidden states do not flatten to (N, K)")
        if str(logits.ty.dtype) != "float32":
            return _leave(what, f"{logits.ty.dtype} logits")
        rows = self.rows or chunk_rows(v, self.chunk_bytes)
        n_int = const_int(n)
        if n_int is not None and n_int <= rows:
            return _leave(what, f"N = {n_int} fits one chunk of {rows} rows")
        chunks = None
        if n_int is None:
            bound = _upper_bound(n, self.bounds)
            if bound is not None and bound <= rows:
                return _leave(what, f"N <= {bound} (tir_var_upper_bound) fits one chunk")
            chunks = -(-bound // rows) if bound is not None else self.chunks
        w = None
        transpose = self.var2val.get(wt) if isinstance(wt, relax.Var) else None
        if op_name(transpose) == "relax.permute_dims" and (
            transpose.attrs.axes is None or [int(a) for a in transpose.attrs.axes] == [1, 0]
        ):
            w = transpose.args[0]
        return _Match(h, wt, w, bias, n if n_int is None else n_int, v, k, chunks, views[::-1])

    # -- rewriting --------------------------------------------------------------------------

    def _chunked(self, call: relax.Call, match: _Match) -> relax.Expr:
        bb = self.builder_
        h = self.visit_expr(match.h)
        for view in match.views:  # the logits' row views, on the hidden states
            if op_name(view) == "relax.reshape":
                h = bb.emit(relax.op.reshape(h, [*view.ty.shape.values[:-1], match.k]))
            else:
                h = bb.emit(relax.Call(view.op, [h, *view.args[1:]], view.attrs))
        if h.ty.ndim != 2:
            h = bb.emit(relax.op.reshape(h, [match.n, match.k]))
        weight = self.visit_expr(match.w if match.w is not None else match.wt)
        bias = self.visit_expr(match.bias) if match.bias is not None else None
        if bias is not None and match.w is not None and bias.ty.ndim != 1:
            bias = bb.emit(relax.op.reshape(bias, [match.v]))  # linear_logits reads bias[j]
        args = [self.visit_expr(a) for a in call.args[1]]
        # Tensors only: call_te appends symbolic sizes its inputs' shapes do not define.
        t, extra = args[1], [a for a in args[2:] if isinstance(a.ty, relax.TensorType)]
        if match.chunks is None:  # static N: chunks of ``rows`` rows, the last one shorter
            rows = self.rows or chunk_rows(match.v, self.chunk_bytes)
            sections = list(range(rows, match.n, rows))
            count = len(sections) + 1
        else:  # symbolic N: ``chunks`` equal chunks of the rows padded to a multiple of it
            count = sections = match.chunks
            # (chunks, C, ...) then a split of the static axis: each chunk's rows are C itself,
            # not the difference of split offsets ((i + 1) * C - i * C), which the memory
            # planner bounds as (i + 1) * C_max.
            rows = tirx.floordiv(match.n + (count - 1), count)
            h, t = (self._rows_to(x, count * rows) for x in (h, t))
            h = bb.emit(relax.op.reshape(h, [count, rows, match.k]))
            t = bb.emit(relax.op.reshape(t, [count, rows]))
        h_parts = bb.emit(relax.op.split(h, sections, axis=0))
        t_parts = bb.emit(relax.op.split(t, sections, axis=0))

        def part(parts, i):
            if match.chunks is None:
                return relax.TupleGetItem(parts, i)
            return bb.emit(relax.op.squeeze(relax.TupleGetItem(parts, i), [0]))

        pieces = [
            self._chunk(call, match, weight, bias, extra, part(h_parts, i), part(t_parts, i))
            for i in range(count)
        ]
        if match.chunks is None:
            return relax.op.concat(pieces, axis=0)
        # Equal chunks stacked on a new axis: the gradient of a concat along a symbolic extent
        # splits at symbolic indices, which relax.op.split does not take.
        stacked = bb.emit(
            relax.op.concat([bb.emit(relax.op.expand_dims(p, 0)) for p in pieces], axis=0)
        )
        shape = stacked.ty.shape.values
        stats = bb.emit(relax.op.reshape(stacked, [shape[0] * shape[1], shape[2]]))
        return self._rows_to(stats, match.n, emit=False)

    def _rows_to(self, x: relax.Expr, rows, emit: bool = True) -> relax.Expr:
        call = self.builder_.call_te_with_grad(
            rows_to, x, rows, te_grad_name=ROWS_GRAD_NAME, primfunc_name_hint="rows_to"
        )
        return self.builder_.emit(call) if emit else call

    def _chunk(self, call, match: _Match, weight, bias, extra, h_part, t_part) -> relax.Expr:
        """One chunk: checkpointed logits (recomputed by the backward), then its row kernel."""
        bb = self.builder_
        options = call.attrs.te_grad_kwargs
        kwargs = {"row_sum": True} if bool(options.get("row_sum", False)) else {}
        if extra:
            kwargs["weights"] = extra[0]
        h_c = bb.emit(relax.op.grad.start_checkpoint(h_part))
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
        return bb.emit(
            bb.call_te_with_grad(
                cross_entropy_rows,
                logits,
                t_part,
                bool(options.get("fast_exp", False)),
                te_grad_name=GRAD_NAME,
                te_grad_kwargs=dict(options.items()),
                primfunc_name_hint="cross_entropy_rows_chunk",
                **kwargs,
            )
        )


def _upper_bound(n: tirx.Expr, bounds: dict[str, int]) -> int | None:
    """The largest value of ``n`` when each of its variables is in ``[0, bound]`` (Relax's
    ``tir_var_upper_bound``), or None when a variable has no bound."""
    free = tvm.tirx.analysis.undefined_vars(n)
    if not free or any(var.name not in bounds for var in free):
        return None
    analyzer = tvm.sym.Analyzer()
    for var in free:
        analyzer.bind(var, tvm.ir.Range(0, bounds[var.name] + 1))
    bound = analyzer.const_int_bound(n).max_value
    return None if bound >= (1 << 62) else int(bound)


def _leave(what: str, reason: str) -> None:
    skip(logger, what, reason)
    return None
