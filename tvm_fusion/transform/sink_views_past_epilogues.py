"""SinkViewsPastEpilogues: a GEMM's elementwise epilogue runs on the GEMM's own layout, and the
view that unflattens the rows moves past it.

Exporters write a linear layer on a ``(batch, seq, K)`` input as ``view(-1, K) -> addmm ->
view(batch, seq, N)`` (HF GPT-2's ``Conv1D``, torch's ``F.linear`` with a bias under dynamo);
GELU and the residual add then read the unflattened view::

    y = R.matmul(R.reshape(x, (b * s, K)), W)          # (b * s, N)
    r = R.reshape(y, (b, s, N))
    o = R.add(R.multiply(r, R.const(0.5)), residual)   # residual: (b, s, N)

The reshape between the GEMM and its epilogue is injective, not elementwise, so stock FuseOps
ends the GEMM's group at it: the GEMM writes ``(b * s, N)`` to memory and a second kernel
reads it back for the epilogue (GPT-2: the GELU kernel and two residual adds per layer). This
pass moves such a view past every elementwise op that reads it, rewriting the op on the flat
layout; the ops' other operands are given the flat layout as views too::

    y = R.matmul(R.reshape(x, (b * s, K)), W)
    t = R.multiply(y, R.const(0.5))
    o2 = R.add(t, R.reshape(residual, (b * s, N)))
    o = R.reshape(o2, (b, s, N))

FuseOps then puts the GEMM and its epilogue in one group, whose views at the boundary
``StripBookendViews`` keeps outside as zero-copy views (the mission's bookend views: views
belong at a group's edge, not between a GEMM and its epilogue). A view of a sunk result that
restores the flat shape (the next layer's ``view(-1, N)``) is dropped.

Matches ``r = R.reshape(y, S)`` where ``y`` is a ``R.matmul`` result (or elementwise math on
one, such as ``addmm``'s bias add) whose last axis ``S`` keeps (only leading axes are split or
merged), then every elementwise op (unary math and
activations, ``astype``, ``clip``, binary arithmetic, ``where``) whose operands are each

- a sunk view of the same shape ``S`` (its flat value is used),
- a scalar or an all-ones shape (viewed as a scalar),
- a row vector ``(1, .., 1, N)`` of the last axis (viewed as ``(N,)``), or
- any other tensor of exactly the shape ``S`` (viewed with the flat shape),

and whose result has the shape ``S``. Chains are followed: a sunk op's result is itself a
sunk view. Where it must run: before LegalizeOps (Phase 1), after the passes that match
GEMM patterns of their own (FuseSplitGates).

Left alone, with the reason logged at debug level: a view that changes the last axis (the
epilogue's broadcasts would no longer line up), an operand that broadcasts other than along
the last axis (e.g. ``(b, 1, N)``), ops other than the elementwise ones listed, and views of
anything but a GEMM result (nothing would fuse better).
"""

from __future__ import annotations

import tvm
from tvm import IRModule, relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._common import (
    ELEMENTWISE_BINARY,
    ELEMENTWISE_UNARY,
    get_logger,
    op_name,
    prove_equal,
    record_rewrite,
    same_dims,
    skip,
    static_shape,
)

logger = get_logger(__name__)
NAME = "SinkViewsPastEpilogues"

_GEMMS = ("relax.matmul",)


@tvm.transform.module_pass(opt_level=0, name=NAME)
class SinkViewsPastEpilogues:
    """Moves the view that unflattens a GEMM's rows past the GEMM's elementwise epilogue (see
    the module docstring)."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        rewriter = _Rewriter(mod)
        mod = rewriter.transform()
        record_rewrite(NAME, rewriter.count)
        return mod


def _is_one(dim) -> bool:
    return prove_equal(dim, 1)


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.mod = mod
        self.count = 0
        # var (original) -> (flat value, unflattened shape S) for views that have been sunk
        self.flat: dict = {}
        self.var2val: dict = {}
        self.starts: set = set()  # views of GEMM results not yet sunk past any op

    def transform(self) -> IRModule:
        for gv, func in self.mod.functions_items():
            if not isinstance(func, relax.Function) or func.attrs.get("Primitive", False):
                continue
            self.flat, self.starts = {}, set()
            self.var2val = relax.analysis.get_var2val(func)
            before = self.count
            new_func = self.visit_expr(func)
            if self.count > before:  # a function it leaves alone stays as it was
                self.builder_.update_func(gv, relax.analysis.remove_all_unused(new_func))
        return self.builder_.get() if self.count else self.mod

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        name = op_name(value)
        if name == "relax.reshape":
            if self._view(binding):
                return None
        elif name in ELEMENTWISE_UNARY or name in ELEMENTWISE_BINARY:
            if self._sink(binding):
                return None
        return super().visit_var_binding_(binding)

    def _view(self, binding: relax.VarBinding) -> bool:
        """Record ``r = reshape(y, S)`` of a GEMM result as a view that may be sunk. A view of
        a sunk result reads its flat value directly (the flat value itself when it restores
        the flat shape); returns True when it emitted that binding."""
        src, var = binding.value.args[0], binding.var
        shape = static_shape(var)
        if shape is None or not shape:
            return False
        if src in self.flat:
            flat_value = self.visit_expr(self.flat[src][0])
            flat_shape = static_shape(flat_value)
            if prove_equal(flat_shape[-1], shape[-1]):
                self.flat[var] = (flat_value, shape)  # a view of a view: the same data
            if same_dims(flat_shape, shape) and isinstance(var, relax.DataflowVar):
                self.set_var_remap(var, flat_value)
            else:
                new = self.builder_.normalize(relax.op.reshape(flat_value, shape))
                self.builder_.emit_normalized(relax.VarBinding(var, new))
            return True
        if not self._gemm_result(src):
            return False
        src_shape = static_shape(src)
        if not src_shape:
            return False
        if not prove_equal(src_shape[-1], shape[-1]):
            return skip(logger, f"view {var.name}", "it changes the last axis")
        self.flat[var] = (src, shape)
        self.starts.add(var)
        return False

    def _gemm_result(self, var, depth: int = 8) -> bool:
        """``var`` is a GEMM's result, or elementwise math on one (the bias add of ``addmm``)
        of the same shape, which FuseOps already puts in the GEMM's group."""
        value = self.var2val.get(var)
        name = op_name(value)
        if name in _GEMMS:
            return True
        if depth == 0 or (name not in ELEMENTWISE_UNARY and name not in ELEMENTWISE_BINARY):
            return False
        shape = static_shape(var)
        return shape is not None and any(
            isinstance(a, relax.Var)
            and same_dims(static_shape(a) or [], shape)
            and self._gemm_result(a, depth - 1)
            for a in value.args
        )

    def _sink(self, binding: relax.VarBinding) -> bool:
        call, var = binding.value, binding.var
        shape = static_shape(var)
        sunk = [a for a in call.args if isinstance(a, relax.Var) and a in self.flat]
        if shape is None or not sunk:
            return False
        what = f"{op_name(call)} {var.name}"
        views = [self.flat[a] for a in sunk]
        flat_shape = static_shape(views[0][0])
        if not all(same_dims(s, shape) for _, s in views):
            return skip(logger, what, "its result does not have the view's shape")
        if any(not same_dims(static_shape(f), flat_shape) for f, _ in views):
            return skip(logger, what, "its views flatten differently")
        bb = self.builder_
        args = []
        for arg in call.args:
            if isinstance(arg, relax.Var) and arg in self.flat:
                args.append(self.visit_expr(self.flat[arg][0]))
                continue
            new = self.visit_expr(arg)
            arg_shape = static_shape(arg)
            if not isinstance(arg.ty, relax.TensorType):
                args.append(new)  # clip's bounds (PrimValues)
            elif arg_shape is None:
                return skip(logger, what, f"operand {arg} of unknown shape")
            elif all(_is_one(d) for d in arg_shape):
                args.append(new if not arg_shape else bb.emit(relax.op.reshape(new, [])))
            elif all(_is_one(d) for d in arg_shape[:-1]) and prove_equal(arg_shape[-1], shape[-1]):
                if len(arg_shape) == 1:
                    args.append(new)
                else:
                    args.append(bb.emit(relax.op.reshape(new, [arg_shape[-1]])))
            elif same_dims(arg_shape, shape):
                args.append(bb.emit(relax.op.reshape(new, flat_shape)))
            else:
                return skip(logger, what, f"operand {arg} broadcasts other than by the last axis")
        flat_out = bb.emit(
            relax.Call(call.op, args, call.attrs, call.ty_args), name_hint=f"{var.name}_flat"
        )
        self.flat[var] = (flat_out, shape)
        for arg in sunk:
            if arg in self.starts:
                self.starts.remove(arg)
                self.count += 1  # a GEMM's view sunk past (at least) one op
        new = bb.normalize(relax.op.reshape(flat_out, shape))
        self.builder_.emit_normalized(relax.VarBinding(var, new))
        return True
