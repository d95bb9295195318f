"""StripBookendViews: views on the boundary of a fused group become zero-copy views outside it.

nvFuser (upstreamed as pytorch PR #88457) found that reshapes at the entry and exit of a fused
kernel ("bookends") cost twice: the kernel copies through them with div/mod index arithmetic,
and a group of only views still launches a copy kernel. Stock TVM's FuseOps puts
``reshape -> gelu -> reshape`` into one group whose PrimFunc indexes the input through the
reshape's index map.

Matches, in every fused group (a ``Primitive`` Relax function made by FuseOps), the bindings
whose PrimFunc is a pure reshape of contiguous memory (``relax.analysis.has_reshape_pattern``:
reshape, squeeze, expand_dims, flatten):

- leading views: a chain of views from a group parameter that nothing else in the group uses;
- trailing views: a chain of views ending in a group output that nothing else in the group uses.

Emits the group without them, called on ``R.reshape`` views of its arguments and followed by
``R.reshape`` views of its results (``RewriteDataflowReshape`` later lowers them to
``vm.builtin.reshape``: metadata only). A group made only of views becomes a view. Interior
views (between two computations) stay: they keep the group connected.

Where it must run: after FuseOps and before FuseTIR (Phase 3), where groups are still Relax
functions whose bindings say which step is a view.

Left alone, with the reason logged at debug level:

- a transpose or any other index map that is not a reshape: peeling it would force a copy;
- a view whose input is also read by another op of the group (it would need the data in both
  layouts) or whose output is also used inside the group;
- a group whose symbolic dimensions are defined only through the peeled parameter's shape
  (e.g. ``(n, 8, 48)`` viewed as ``(n * 8, 48)``): the group could no longer name ``n``;
- groups with control flow or several binding blocks.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import IRModule, relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._common import get_logger, record_rewrite, skip

logger = get_logger(__name__)
NAME = "StripBookendViews"


@tvm.transform.module_pass(opt_level=0, name=NAME)
class StripBookendViews:
    """Moves reshape-like views off the entry and exit of fused groups into zero-copy views."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        plans = {}
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function) and func.attrs.get("Primitive", False):
                plan = _plan(mod, gv, func)
                if plan is not None:
                    plans[gv] = plan
        rewriter = _CallSiteRewriter(mod, plans)
        mod = rewriter.transform()
        record_rewrite(NAME, rewriter.count)
        return mod


@dataclasses.dataclass
class _Plan:
    """How one group changes: per parameter the view it now receives, per output the view
    applied to what it now returns; ``func`` is the stripped group, None if only views."""

    func: relax.Function | None
    lead_shapes: dict[int, relax.TensorType]  # param index -> sinfo it now receives
    trail_outputs: list[tuple[relax.TensorType, relax.TensorType]]  # (returned, original)
    views_only_param: int | None = None  # group of views: which parameter flows to the output
    peeled: int = 0


def _is_view(mod: IRModule, value) -> relax.Expr | None:
    """The input of a reshape-like call_tir, or None."""
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)):
        return None
    if value.op.name != "relax.call_tir":
        return None
    callee, args = value.args[0], value.args[1]
    if not isinstance(callee, relax.GlobalVar) or callee not in mod.get_global_vars():
        return None
    prim = mod[callee]
    if not isinstance(prim, tirx.PrimFunc) or len(value.args) > 2:
        return None
    fields = list(args.fields) if isinstance(args, relax.Tuple) else [args]
    if len(fields) != 1 or not isinstance(fields[0], relax.Var):
        return None
    if not relax.analysis.has_reshape_pattern(prim):
        return None
    # has_reshape_pattern also holds for a contiguous strided_slice: a view keeps every element
    if not _same_count(fields[0].ty, value.ty):
        return None
    return fields[0]


def _uses(func: relax.Function) -> dict:
    counts: dict = {}

    def visit(expr):
        if isinstance(expr, relax.Var):
            counts[expr] = counts.get(expr, 0) + 1

    for block in func.body.blocks:
        for binding in block.bindings:
            relax.analysis.post_order_visit(binding.value, visit)
    relax.analysis.post_order_visit(func.body.body, visit)
    return counts


def _plan(mod: IRModule, gv: relax.GlobalVar, func: relax.Function) -> _Plan | None:
    what = f"group {gv.name_hint}"
    body = func.body
    if len(body.blocks) != 1 or not isinstance(body.blocks[0], relax.DataflowBlock):
        return skip(logger, what, "not a single dataflow block") or None
    bindings = list(body.blocks[0].bindings)
    if any(not isinstance(b, relax.VarBinding) for b in bindings):
        return skip(logger, what, "has match_cast bindings") or None
    value_of = {b.var: b.value for b in bindings}
    uses = _uses(func)
    users: dict = {}
    for b in bindings:

        def visit(expr, b=b):
            if isinstance(expr, relax.Var):
                users.setdefault(expr, []).append(b)

        relax.analysis.post_order_visit(b.value, visit)

    removed: set = set()
    lead: dict[int, relax.Var] = {}  # param index -> var the stripped group receives instead
    for index, param in enumerate(func.params):
        cur = param
        while uses.get(cur, 0) == 1 and len(users.get(cur, [])) == 1:
            user = users[cur][0]
            if _is_view(mod, user.value) is None:
                break
            removed.add(user.var)
            cur = user.var
        if cur is not param:
            lead[index] = cur

    outputs = body.body
    out_fields = list(outputs.fields) if isinstance(outputs, relax.Tuple) else [outputs]
    trail: list[relax.Expr] = []
    for out in out_fields:
        cur = out
        while (
            isinstance(cur, relax.Var)
            and cur in value_of
            and cur not in removed
            and uses.get(cur, 0) == 1
            and (src := _is_view(mod, value_of[cur])) is not None
            and src not in func.params
            and src not in removed
        ):
            removed.add(cur)
            cur = src
        trail.append(cur)

    remaining = [b for b in bindings if b.var not in removed]
    if not removed:
        return None
    param_set = list(func.params)
    if not remaining:
        # Only views: the output is a view of one parameter.
        if len(out_fields) == 1 and len(func.params) == 1:
            return _Plan(None, {}, [], views_only_param=0, peeled=len(removed))
        return skip(logger, what, "a group of views with several inputs/outputs") or None
    if any(t in param_set for t in trail):
        return skip(logger, what, "an output would be a parameter") or None

    # Build the stripped group.
    remap: dict = {}
    new_params = []
    for index, param in enumerate(func.params):
        if index in lead:
            src = lead[index]
            new_param = relax.Var(param.name, src.ty)
            remap[src] = new_param
        else:
            new_param = relax.Var(param.name, param.ty)
            remap[param] = new_param
        new_params.append(new_param)
    builder = relax.BlockBuilder()
    try:
        with builder.function(gv.name_hint, new_params, attrs=func.attrs, private=True):
            with builder.dataflow():
                single = not isinstance(outputs, relax.Tuple)
                for i, b in enumerate(remaining):
                    value = _substitute(b.value, remap)
                    if single and i == len(remaining) - 1 and b.var.same_as(trail[0]):
                        remap[b.var] = builder.emit_output(value, b.var.name)
                    else:
                        remap[b.var] = builder.emit(value, b.var.name)
                result = [_substitute(t, remap) for t in trail]
                out = result[0] if single else builder.emit_output(relax.Tuple(result))
                if (
                    single
                    and not isinstance(out, relax.Var)
                    or (single and isinstance(out, relax.DataflowVar))
                ):
                    out = builder.emit_output(out)
            builder.emit_func_output(out)
        new_func = builder.get()[gv.name_hint]
        check = IRModule(dict(mod.functions_items()))
        check[gv] = new_func
        relax.analysis.well_formed(check)  # raises on ill-formed IR
    except Exception as err:  # noqa: BLE001 - a shape the stripped group cannot express
        return skip(logger, what, f"stripped group is not well formed: {err}") or None
    lead_shapes = {i: v.ty for i, v in lead.items()}
    trail_outputs = [(t.ty, o.ty) for t, o in zip(trail, out_fields, strict=True)]
    logger.debug("%s: %d bookend view(s) moved out", what, len(removed))
    return _Plan(new_func, lead_shapes, trail_outputs, peeled=len(removed))


def _group_name(func: relax.Function) -> str:
    """``fused_<ops>`` after the ops that remain, as FuseOps names groups."""
    names = []
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.args[0], relax.GlobalVar):
                names.append(value.args[0].name_hint)
    return "fused_" + "_".join(names)


def _substitute(expr: relax.Expr, remap: dict) -> relax.Expr:
    return _Remapper(remap).visit_expr(expr)


@mutator
class _Remapper(PyExprMutator):
    def __init__(self, remap: dict):
        super().__init__()
        self.remap = remap

    def visit_var_(self, var: relax.Var) -> relax.Expr:
        return self.remap.get(var, var)

    def visit_dataflow_var_(self, var) -> relax.Expr:
        return self.remap.get(var, var)


def _shape_in_caller(sinfo: relax.TensorType, func: relax.Function, args) -> relax.ShapeExpr:
    """``sinfo``'s shape (in the group's symbolic variables) in the caller's terms."""
    analyzer = tvm.sym.Analyzer()
    for param, arg in zip(func.params, args, strict=True):
        p_sinfo, a_sinfo = param.ty, arg.ty
        if not isinstance(p_sinfo, relax.TensorType) or not isinstance(a_sinfo, relax.TensorType):
            continue
        if not isinstance(p_sinfo.shape, relax.ShapeExpr) or not isinstance(
            a_sinfo.shape, relax.ShapeExpr
        ):
            continue
        for p_dim, a_dim in zip(p_sinfo.shape.values, a_sinfo.shape.values, strict=True):
            if isinstance(p_dim, tirx.Var) and not p_dim.same_as(a_dim):
                analyzer.bind(p_dim, a_dim)
    return relax.ShapeExpr([analyzer.simplify(d) for d in sinfo.shape.values])


@mutator
class _CallSiteRewriter(PyExprMutator):
    def __init__(self, mod: IRModule, plans: dict):
        super().__init__(mod)
        self.mod = mod
        self.plans = plans
        self.new_gvs: dict = {}
        self.params: set = set()
        self.count = 0

    def transform(self) -> IRModule:
        for gv, plan in self.plans.items():
            if plan.func is not None:
                self.new_gvs[gv] = self.builder_.add_func(plan.func, _group_name(plan.func))
        for gv, func in self.mod.functions_items():
            if isinstance(func, relax.Function) and not func.attrs.get("Primitive", False):
                self.builder_.update_func(gv, self.visit_expr(func))
        mod = self.builder_.get()
        for gv in self.plans:
            if gv in mod.get_global_vars():
                del mod[gv]
        from ..schedule import RemoveUnusedPrimFuncs  # the peeled views' PrimFuncs

        return RemoveUnusedPrimFuncs()(mod)

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        self.params = set(func.params)
        return super().visit_function_(func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        src = _is_view(self.mod, call)
        if src is not None and src not in self.params:
            # A view left out of every group (FuseOps keeps dynamic reshapes apart): stock
            # RewriteDataflowReshape turns it into a view only inside the dataflow block, so a
            # reshape producing the function's result stays a copy kernel. Not when its input
            # is a parameter: the result would alias the caller's tensor.
            self.count += 1
            return relax.op.reshape(self.visit_expr(src), call.ty.shape)
        if not (isinstance(call.op, relax.GlobalVar) and call.op in self.plans):
            return super().visit_call_(call)
        plan = self.plans[call.op]
        func = self.mod[call.op]
        args = [self.visit_expr(a) for a in call.args]
        self.count += plan.peeled
        if plan.func is None:  # a group of views: one view
            return relax.op.reshape(args[plan.views_only_param], call.ty.shape)
        new_args = []
        for index, arg in enumerate(args):
            if index in plan.lead_shapes:
                shape = _shape_in_caller(plan.lead_shapes[index], func, call.args)
                arg = self.builder_.emit(relax.op.reshape(arg, shape))
            new_args.append(arg)
        new_call = relax.Call(self.new_gvs[call.op], new_args)
        original = call.ty
        returned = plan.trail_outputs
        if len(returned) == 1 and (
            isinstance(returned[0][0], relax.TupleType) or _same(returned[0][0], original)
        ):
            # no trailing view (also a group returning one tuple-typed value, e.g. a split,
            # which is never peeled; its type names the group's own symbolic dims, so it need
            # not compare equal to the call's): the caller's binding takes the call as it is
            return new_call
        result = self.builder_.emit(new_call)
        if isinstance(original, relax.TupleType):
            fields = []
            for i, ((returned, _), field_sinfo) in enumerate(
                zip(plan.trail_outputs, original.fields, strict=True)
            ):
                item = self.builder_.emit(relax.TupleGetItem(result, i))
                fields.append(self._view(item, returned, field_sinfo))
            return relax.Tuple(fields)
        return self._view(result, plan.trail_outputs[0][0], original)

    def _view(self, value, returned, original) -> relax.Expr:
        return value if _same(value.ty, original) else relax.op.reshape(value, original.shape)


def _same_count(a, b) -> bool:
    """Both tensors of the same dtype with provably the same number of elements."""
    if not isinstance(a, relax.TensorType) or not isinstance(b, relax.TensorType):
        return False
    if a.dtype != b.dtype or not isinstance(a.shape, relax.ShapeExpr):
        return False
    if not isinstance(b.shape, relax.ShapeExpr):
        return False
    count_a, count_b = tirx.IntImm("int64", 1), tirx.IntImm("int64", 1)
    for d in a.shape.values:
        count_a = count_a * d
    for d in b.shape.values:
        count_b = count_b * d
    return tvm.sym.Analyzer().can_prove_equal(count_a, count_b)


def _same(a, b) -> bool:
    try:
        tvm.ir.assert_structural_equal(a, b)
        return True
    except (ValueError, AssertionError):
        return False
