"""Two rewrites that bring other spellings of a gate GEMM to the matched form (constant weights
only), run before the matcher:

- :class:`_MergeSummedGemms`: two linear layers summed before the split (torch's LSTMCell,
  ``x @ Wih^T + h @ Whh^T``) become one GEMM over ``concat(x, h)``;
- :class:`_MergeSiblingGemms` (through :func:`_merge_siblings`, which keeps a merge only where
  the joined GEMM then fuses): sibling linear layers of one input whose results meet in the
  gate math (Llama's ``silu(x @ Wg) * (x @ Wu)``, GeGLU alike) become one GEMM over the joined
  weights, split into the members' results.

The joined weight and bias are computed here, at compile time; only a bias that broadcasts
along the features alone joins a merged GEMM.
"""

from __future__ import annotations

import numpy as np
from tvm import IRModule, relax
from tvm.ir.expr import GenericConst
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._common import get_logger, skip, use_counts
from .group import _grow
from .match import _Block, _find_gemms, _op, _shape
from .ops import _DTYPES, _ELEMENTWISE
from .plan import _plan_block

logger = get_logger(__name__)


# ---------------------------------------------------------------------------------------------
# Two GEMMs summed before the split (torch.nn.LSTMCell / GRU-style i2h + h2h)


def _const_array(expr) -> np.ndarray | None:
    return expr.value.numpy() if isinstance(expr, GenericConst) else None


def _const_linear(blk: _Block, var):
    """(x, W as (N, K), bias array or None) of ``var = x @ W^T (+ b)`` or ``x @ W (+ b)``
    with a constant 2-D weight (and bias) of ``x``'s data type (float32, float16, bfloat16),
    else None."""
    value, bias = blk.value.get(var), None
    if _op(value) == "relax.add":
        lhs, rhs = value.args
        for mm, b in ((lhs, rhs), (rhs, lhs)):
            if _op(blk.value.get(mm)) == "relax.matmul" and blk.single_use(mm):
                bias = _const_array(b)
                if bias is None:
                    return None
                value = blk.value[mm]
                break
        else:
            return None
    if _op(value) != "relax.matmul":
        return None
    x, w = value.args
    weight = _const_array(w)
    if weight is None and _op(blk.value.get(w)) == "relax.permute_dims":
        perm = blk.value[w]
        axes = perm.attrs.axes
        inner = _const_array(perm.args[0])
        if inner is not None and inner.ndim == 2 and (axes is None or list(axes) == [1, 0]):
            weight = inner  # already (N, K)
    elif weight is not None:
        weight = weight.T if weight.ndim == 2 else None  # (K, N) -> (N, K)
    if weight is None or _shape(x) is None or len(_shape(x)) < 2:
        return None
    dtype = str(x.ty.dtype)
    if dtype not in _DTYPES or str(weight.dtype) != dtype:
        return None
    if bias is not None and str(bias.dtype) != dtype:
        return None
    if bias is not None and not _feature_bias(bias.shape, weight.shape[0], len(_shape(x))):
        return None
    return x, weight, bias


def _feature_bias(shape, n_features: int, rank: int) -> bool:
    """Whether a constant of ``shape`` added to a ``rank``-D GEMM result with ``n_features``
    output features broadcasts along the feature (last) axis only: ``()``, ``(N,)``, ``(1, N)``,
    ``(1, ..., 1, N)`` or all ones, of at most ``rank`` dims. Its size alone says nothing: a
    per-row ``(rows, 1)`` bias has ``N`` elements too when ``rows == N``."""
    shape = tuple(int(d) for d in shape)
    if len(shape) > rank or any(d != 1 for d in shape[:-1]):
        return False
    return not shape or shape[-1] in (1, n_features)


def _apply_plans(rewrite) -> IRModule:
    """Run a planning rewrite (``_MergeSummedGemms``, ``_MergeSiblingGemms``) over every Relax
    function of ``rewrite.mod``: per function it resets ``uses`` and ``plan``, visits (the
    dataflow blocks fill ``plan``, the bindings carry it out) and keeps the result only where
    something was planned. The module itself when nothing was."""
    changed = False
    for gv, func in rewrite.mod.functions_items():
        if not isinstance(func, relax.Function) or func.attrs.get("Primitive", False):
            continue
        rewrite.uses = use_counts(func)
        rewrite.plan = {}
        new_func = rewrite.visit_expr(func)
        if rewrite.plan:
            changed = True
            rewrite.builder_.update_func(gv, relax.analysis.remove_all_unused(new_func))
    return rewrite.builder_.get() if changed else rewrite.mod


@mutator
class _MergeSummedGemms(PyExprMutator):
    """``(x1 @ W1^T + b1) + (x2 @ W2^T + b2)`` with constant weights, whose sum only feeds a
    split (or slices), becomes ``concat(x1, x2) @ [W1 W2]^T + (b1 + b2)``: one gate GEMM that
    the matcher below takes. torch's LSTMCell (both ONNX exporters) and hand-written cells
    with separate ``ih``/``hh`` Linear layers are written this way. The weights are joined at
    compile time; the concat copies ``rows x (K1 + K2)`` inputs, a small kernel before the gate
    kernel."""

    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.mod = mod
        self.uses: dict = {}
        self.plan: dict = {}  # sum var -> (x1, x2, W (N, K1+K2), b or None)

    def transform(self) -> IRModule:
        return _apply_plans(self)

    def _linear(self, blk: _Block, var):
        """(x, W as (N, K), bias array or None) of ``x @ W^T (+ b)`` bound to ``var``, x 2-D."""
        if not isinstance(var, relax.Var) or not blk.single_use(var):
            return None
        found = _const_linear(blk, var)
        if found is None or len(_shape(found[0]) or []) != 2:
            return None
        return found

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.BindingBlock:
        blk = _Block.of(block, self.uses)
        for b in blk.bindings:
            if _op(b.value) != "relax.add" or b.var in blk.outputs:
                continue
            users = blk.users.get(b.var, [])
            ops = {_op(blk.value.get(u)) for u in users}
            if not ((len(users) == 1 and ops == {"relax.split"}) or ops == {"relax.strided_slice"}):
                continue
            sides = [self._linear(blk, a) for a in b.value.args]
            if None in sides:
                skip(logger, f"sum {b.var.name}", "not two linear layers with constant weights")
                continue
            (x1, w1, b1), (x2, w2, b2) = sides
            if w1.shape[0] != w2.shape[0] or str(_shape(x1)[0]) != str(_shape(x2)[0]):
                continue
            bias = None
            for part in (b1, b2):  # summed in float32, rounded once to the weights' dtype
                if part is not None:
                    part = np.broadcast_to(part.reshape(-1).astype(np.float32), (w1.shape[0],))
                    bias = part if bias is None else bias + part
            bias = None if bias is None else bias.astype(w1.dtype)
            self.plan[b.var] = (x1, x2, np.concatenate([w1, w2], axis=1), bias)
        return super().visit_dataflow_block_(block)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        found = self.plan.get(binding.var)
        if found is None:
            return super().visit_var_binding_(binding)
        x1, x2, weight, bias = found
        bb = self.builder_
        xc = bb.emit(relax.op.concat([self.visit_expr(x1), self.visit_expr(x2)], axis=-1))
        dtype = str(weight.dtype)
        wt = bb.emit(relax.op.permute_dims(relax.const(weight, dtype), axes=[1, 0]))
        out = relax.op.matmul(xc, wt)
        if bias is not None:
            out = relax.op.add(bb.emit(out), relax.const(bias, dtype))
        new = bb.emit(out, name_hint=binding.var.name)
        self.set_var_remap(binding.var, new)
        return None


# ---------------------------------------------------------------------------------------------
# Sibling GEMMs of one input whose results meet in gate math (Llama's gate_proj and up_proj)


def _linear_users_elementwise(blk: _Block, var) -> bool:
    users = blk.users.get(var, [])
    if not users or var in blk.outputs:
        return False
    others = sorted({str(_op(blk.value.get(u))) for u in users} - set(_ELEMENTWISE))
    if others:
        return skip(logger, f"linear layer {var.name}", f"read by non-elementwise ops {others}")
    return True


def _elementwise_closure(blk: _Block, var, limit: int = 64) -> set:
    """The bindings reached from ``var`` through elementwise ops only."""
    seen: set = set()
    stack = [var]
    while stack and len(seen) < limit:
        for user in blk.users.get(stack.pop(), []):
            if user not in seen and _op(blk.value.get(user)) in _ELEMENTWISE:
                seen.add(user)
                stack.append(user)
    return seen


def _root(parent: dict, m):
    while parent[m] is not m:
        m = parent[m]
    return m


def _sibling_sets(blk: _Block) -> list[list]:
    """Sets (block order) of >= 2 linear layers ``x @ W_i (+ b_i)`` with the same input ``x``,
    constant weights of one shape, results read by elementwise ops only, that meet in those
    ops: ``silu(x @ Wg) * (x @ Wu)`` (SwiGLU as Llama/Mistral write it), GeGLU alike. Sibling
    projections read by anything else (attention's q/k/v, reshaped into heads) are not sets."""
    by_input: dict = {}
    for b in blk.bindings:
        if not isinstance(b, relax.VarBinding) or b.var in blk.outputs:
            continue
        users = blk.users.get(b.var, [])
        if _op(b.value) == "relax.matmul" and len(users) == 1:
            if _const_linear(blk, users[0]) is not None:
                continue  # the bias add is the linear layer
        found = _const_linear(blk, b.var)
        if found is None or not isinstance(found[0], relax.Var):
            continue
        if not _linear_users_elementwise(blk, b.var):
            continue
        key = (found[0], found[1].shape)
        by_input.setdefault(key, []).append(b.var)
    sets = []
    for members in by_input.values():
        if len(members) < 2:
            continue
        closures = {m: _elementwise_closure(blk, m) for m in members}
        parent = {m: m for m in members}
        for i, a in enumerate(members):
            for b in members[i + 1 :]:
                if closures[a] & closures[b]:
                    parent[_root(parent, b)] = _root(parent, a)
        joined: dict = {}
        for m in members:
            joined.setdefault(_root(parent, m), []).append(m)
        sets += [sorted(ms, key=lambda v: blk.index[v]) for ms in joined.values() if len(ms) > 1]
    return sets


@mutator
class _MergeSiblingGemms(PyExprMutator):
    """Each set of :func:`_sibling_sets` becomes one GEMM over the joined weights, split into
    the members' results: ``split(x @ [Wg Wu]^T (+ [bg bu]), 2)``, the form torch's ``chunk``
    SwiGLU exports as, which the matcher below fuses (one kernel: both projections per output
    tile, the gate math on it; the up projection's result is never written). Sets named in
    ``exclude`` (first member) are left alone; ``merged`` lists ``(first member, joined GEMM
    output)`` of the rewrites made."""

    def __init__(self, mod: IRModule, exclude: frozenset = frozenset()):
        super().__init__(mod)
        self.mod = mod
        self.exclude = exclude
        self.uses: dict = {}
        self.plan: dict = {}  # first member -> (members, x, W (k*N, K), bias or None)
        self.merged: list = []

    def transform(self) -> IRModule:
        return _apply_plans(self)

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.BindingBlock:
        blk = _Block.of(block, self.uses)
        for members in _sibling_sets(blk):
            if members[0] in self.exclude:
                continue
            linears = [_const_linear(blk, m) for m in members]
            x = linears[0][0]
            weight = np.concatenate([w for _, w, _ in linears], axis=0)
            bias = None
            if any(b is not None for _, _, b in linears):
                n = linears[0][1].shape[0]
                bias = np.concatenate(
                    [
                        np.zeros(n, weight.dtype)
                        if b is None
                        else np.broadcast_to(b.reshape(-1), n)
                        for _, _, b in linears
                    ]
                )
            self.plan[members[0]] = (members, x, weight, bias)
        return super().visit_dataflow_block_(block)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        found = self.plan.get(binding.var)
        if found is None:
            return super().visit_var_binding_(binding)
        members, x, weight, bias = found
        bb = self.builder_
        dtype = str(weight.dtype)
        wt = bb.emit(relax.op.permute_dims(relax.const(weight, dtype), axes=[1, 0]))
        out = relax.op.matmul(self.visit_expr(x), wt)
        if bias is not None:
            out = relax.op.add(bb.emit(out), relax.const(bias, dtype))
        joined = bb.emit(out, name_hint=binding.var.name + "_siblings")
        parts = bb.emit(relax.op.split(joined, len(members), axis=-1))
        for i, member in enumerate(members):
            self.set_var_remap(member, bb.emit(relax.TupleGetItem(parts, i), member.name))
        self.merged.append((members[0], joined))
        return None


def _merge_siblings(mod: IRModule, target) -> IRModule:
    """:class:`_MergeSiblingGemms` where the joined GEMM then fuses with its gate math; a set
    whose joined GEMM would not (a gate group the matcher or the target refuses) keeps its
    separate GEMMs: a lone joined GEMM plus a split costs a copy that separate GEMMs do not."""
    exclude: set = set()
    while True:
        merger = _MergeSiblingGemms(mod, frozenset(exclude))
        new = merger.transform()
        if not merger.merged:
            return mod
        fused = _fused_gemm_outputs(new, target)
        refused = {first for first, joined in merger.merged if joined not in fused}
        if not refused:
            return new
        for first in refused:
            skip(logger, f"sibling GEMMs from {first.name}", "the joined GEMM would not fuse")
        exclude |= refused


def _fused_gemm_outputs(mod: IRModule, target) -> set:
    """Every binding of a gate group that :class:`_Rewriter` would fuse in ``mod``."""
    found: set = set()
    for func in mod.functions.values():
        if not isinstance(func, relax.Function) or func.attrs.get("Primitive", False):
            continue
        uses = use_counts(func)
        for block in func.body.blocks:
            if not isinstance(block, relax.DataflowBlock):
                continue
            blk = _Block.of(block, uses)
            gemms = _find_gemms(blk)
            for group in _grow(blk, gemms) if gemms else []:
                if _plan_block(group, target) is not None:
                    found |= {v for g in group.gemms for v in g.chain}
    return found
