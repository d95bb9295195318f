"""FuseSplitGates: matmul (+ bias) -> split -> elementwise gates becomes ONE kernel (TVM #2890).

Matches, inside a dataflow block:

- one or more gate GEMMs ``y = x @ W^T`` / ``x @ W`` (``R.matmul``, with ``R.permute_dims`` of
  the weight or not, optionally ``+ b``: what ``FuseTransposeMatmul``'s input, the ONNX
  importer's Gemm/MatMul and frameworks' ``linear`` produce), each split along the
  output-feature axis into ``k`` pieces of equal width ``D`` (``R.split`` by sections or
  indices, or ``R.strided_slice`` pieces covering the axis: ONNX Split/Slice, torch ``chunk``;
  equal slices of the GEMM output, which torch's TorchScript exporter writes once per use of a
  ``chunk`` piece, count as one piece);
- the elementwise/broadcast ops that consume the pieces (sigmoid, tanh, exp, silu, gelu,
  gelu_tanh, relu, add, multiply, ...), together with other tensors broadcast to ``(rows, D)``
  (the LSTM cell state, the GRU hidden state, constants, boolean masks of ``where``; ``clip``'s
  bounds).
  Several GEMMs whose pieces meet in these ops (the GRU cell's input and hidden GEMMs) form one
  group; a GEMM that reads another group's results (the next step of an unrolled RNN: ONNX
  LSTM / GRU, or torch.export's ``nn.LSTM``) starts its own group, which reads them as inputs;
- non-constant tensors added to the GEMM output before the split that broadcast to it with
  all its features (torch.export's ``nn.LSTM``: per step ``h @ W_hh^T + b`` plus the step's
  slice of the input projection computed for all steps): read by the kernel and added to the
  accumulator tile with the bias.

A linear layer on N-D rows written as views around a 2-D GEMM (TVM's PyTorch frontend:
``reshape(x, (b*s, K)) -> matmul (+ bias) -> reshape((b, s, N))``), whose result is split or
meets a sibling's in gate math, is first folded into one GEMM on the N-D rows
(``_gate_views.py``; torch's ``unflatten(-1, (k, D)).unbind(-2)`` pieces become slices of the
last axis there too); the fold is kept only when a gate group then fuses.

Two rewrites then bring other spellings of a gate GEMM to that form (constant weights only):
two linear layers summed before the split (torch's LSTMCell: ``x @ Wih^T + h @ Whh^T``) become
one GEMM over ``concat(x, h)``; sibling linear layers of one input whose results meet in the
gate math (Llama's ``silu(x @ Wg) * (x @ Wu)``, GeGLU alike) become one GEMM over the joined
weights, split into the members' results, where the group then fuses. Only a bias that
broadcasts along the features alone (``(N,)``, ``(1, ..., 1, N)`` or a scalar) joins a merged
GEMM; any other constant added to a member (a per-row ``(rows, 1)``, a full ``(rows, N)``) keeps
its add, as gate math where it broadcasts to the pieces, and a summed pair with one is left
alone.

Emits ONE ``call_tir`` whose PrimFunc computes, per output tile, every gate of every GEMM for
``V`` hidden units, then the gate math on that tile: the ``(rows, k * D)`` GEMM output never
exists in memory. Constant weights (and biases) are laid out at compile time in vector-width
blocks, ``W (k*D, K) -> Wb (D/V, K, k, V)``: for each block of ``V`` units and each step of the
reduction, the ``k`` gates' ``V`` weights are contiguous, so one output tile holds all ``k``
gates of ``V`` units. ``V`` comes from the target's schedule (``schedule.gate_block``); a ``D``
that no ``V`` divides is padded to whole blocks with zero columns that nothing reads. A weight
that is a runtime input is read in place (fused without reordering); reordering it every call
would cost a full pass over it, as much as a batch-1 GEMV itself.

Data types: float32, float16 and bfloat16. In a half-precision group every GEMM input, weight,
bias and addend has the model's dtype; the kernel widens them where it reads them, accumulates the
GEMM in float32, runs the gate math on the float32 tile (an ``astype`` to a half type inside it
rounds there) and rounds each result to its dtype once, where it is written: at least as accurate
as stock TVM, whose unfused kernels round the GEMM and each op's result (float16 also accumulates
in float16).

Where it must run: before LegalizeOps (Phase 1); the kernel is marked opaque so that FuseOps
keeps it whole, and ``schedule/cpu/gate_fusion.py`` (llvm) or ``schedule/cuda/gate_fusion.py``
schedule it.

Left alone, with the reason logged at debug level: a piece also used outside the group, a GEMM
output (or its bias sum) used by anything but the split, a split on another axis or into
unequal pieces, a bias that does not broadcast along the features only (or adds leading axes
to the GEMM result), ops not in the elementwise table, tensors that do not broadcast to the
pieces' shape, data other than float32 / float16 / bfloat16, mixed dtypes (a float16 GEMM
with a float32 result or bias, an ``astype`` between GEMM and split), a split piece no op reads
(an ONNX LSTM with ``input_forget``), and groups whose external inputs depend on the group's
own results (a GRU with ``linear_before_reset = 0``: its second GEMM reads the reset gate).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm
import tvm_ffi
from tvm import IRModule, relax, te, tirx, topi
from tvm.ir import is_prim_expr
from tvm.ir.expr import GenericConst
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import target as _target
from ..lower import legalize as _legalize
from ._common import (
    as_i64,
    get_logger,
    prove_equal,
    record_rewrite,
    skip,
    use_counts,
    vars_in,
)
from ._gate_views import fold_row_views, unbind_to_slices

logger = get_logger(__name__)
NAME = "FuseSplitGates"
GATE_ATTR = "tvm_fusion.gate_fusion"
# Data types a gate GEMM may have (inputs, weight, bias and result alike); half-precision groups
# accumulate and run their gate math in ``_ACC`` and round once, where each result is written.
_HALF = ("float16", "bfloat16")
_DTYPES = ("float32", *_HALF)
_ACC = "float32"


def _unary(fast, stock):
    return lambda t, fm: (fast if fm else stock)(t)


# Relax op -> (arity, builder(te tensors..., fast_math) -> te tensor)
_ELEMENTWISE = {
    "relax.sigmoid": (1, _unary(_legalize.fast_sigmoid, topi.sigmoid)),
    "relax.tanh": (1, _unary(topi.fast_tanh, topi.tanh)),
    "relax.exp": (1, _unary(topi.fast_exp, topi.exp)),
    "relax.nn.silu": (1, _unary(_legalize.fast_silu, lambda t: topi.multiply(t, topi.sigmoid(t)))),
    "relax.nn.gelu": (
        1,
        _unary(
            _legalize.fast_gelu,
            lambda t: topi.multiply(
                t,
                topi.add(
                    tirx.const(0.5, t.dtype),
                    topi.multiply(
                        topi.erf(topi.multiply(t, tirx.const(0.5**0.5, t.dtype))),
                        tirx.const(0.5, t.dtype),
                    ),
                ),
            ),
        ),
    ),
    # torch's gelu(approximate="tanh") (Gemma's GeGLU): TVM's torch frontend writes gelu_tanh
    "relax.nn.gelu_tanh": (1, lambda t, fm: _legalize.gelu_tanh(t, fast=fm)),
    "relax.nn.relu": (1, lambda t, fm: topi.nn.relu(t)),
    "relax.negative": (1, lambda t, fm: topi.negative(t)),
    "relax.sqrt": (1, lambda t, fm: topi.sqrt(t)),
    "relax.add": (2, lambda a, b, fm: topi.add(a, b)),
    "relax.subtract": (2, lambda a, b, fm: topi.subtract(a, b)),
    "relax.multiply": (2, lambda a, b, fm: topi.multiply(a, b)),
    "relax.divide": (2, lambda a, b, fm: topi.divide(a, b)),
    "relax.maximum": (2, lambda a, b, fm: topi.maximum(a, b)),
    "relax.minimum": (2, lambda a, b, fm: topi.minimum(a, b)),
    # T5's gelu_new writes pow(x, 3); an integral constant exponent becomes multiplications
    # (:func:`_emit_op`), any other a power
    "relax.power": (2, lambda a, b, fm: topi.power(a, b)),
    "relax.erf": (1, _unary(topi.fast_erf, topi.erf)),
    "relax.abs": (1, lambda t, fm: topi.abs(t)),
    "relax.log": (1, lambda t, fm: topi.log(t)),
    "relax.rsqrt": (1, lambda t, fm: topi.rsqrt(t)),
    "relax.square": (1, lambda t, fm: topi.multiply(t, t)),
    "relax.where": (3, lambda c, a, b, fm: topi.where(c, a, b)),
    # bounds are PrimValue attributes, not tensors (an ONNX LSTM's clip)
    "relax.clip": (3, lambda t, lo, hi, fm: topi.clip(t, _scalar(lo), _scalar(hi))),
    "relax.greater": (2, lambda a, b, fm: topi.greater(a, b)),
    "relax.greater_equal": (2, lambda a, b, fm: topi.greater_equal(a, b)),
    "relax.less": (2, lambda a, b, fm: topi.less(a, b)),
    "relax.less_equal": (2, lambda a, b, fm: topi.less_equal(a, b)),
    "relax.equal": (2, lambda a, b, fm: topi.equal(a, b)),
    "relax.not_equal": (2, lambda a, b, fm: topi.not_equal(a, b)),
    # casts: the attribute's dtype, see _emit_op
    "relax.astype": (1, None),
}


def _emit_op(call: relax.Call, args: list, fast_math: bool, wide: bool = False):
    """The TE of one gate-math op on the tensors ``args``. ``wide``: floating-point tensors are
    held in float32 (a half-precision group), so a cast to a half type rounds to it and widens
    back, and a cast to float32 is the tensor itself."""
    name = _op(call)
    if name == "relax.astype":
        dtype = str(call.attrs.dtype)
        if not wide:
            return topi.cast(args[0], dtype)
        if dtype == _ACC and args[0].dtype == _ACC:
            return args[0]
        out = topi.cast(args[0], dtype)
        return topi.cast(out, _ACC) if dtype in _DTYPES else out
    if name == "relax.power":
        n = _integral_scalar(call.args[1])
        if n is not None and 1 <= n <= 4:
            x = args[0]

            def times(*i):
                out = x(*i)
                for _ in range(n - 1):
                    out = out * x(*i)
                return out

            return te.compute(x.shape, times, name="T_power")
    return _ELEMENTWISE[name][1](*args, fast_math)


def _scalar(value) -> float:
    """A scalar bound (``clip``'s min / max, a FloatImm / IntImm) as a Python float."""
    return float(value.value)


def _integral_scalar(expr) -> int | None:
    """The value of a constant one-element tensor holding an integral number, else None."""
    from tvm.ir.expr import GenericConst  # relax.Constant's 0.27 spelling

    if not isinstance(expr, GenericConst):
        return None
    value = expr.value.numpy().reshape(-1)
    if value.size != 1 or float(value[0]) != round(float(value[0])):
        return None
    return int(round(float(value[0])))


@tvm.transform.module_pass(opt_level=0, name=NAME)
class FuseSplitGates:
    """Fuses ``matmul(+bias) -> split -> elementwise gates`` into one kernel, weights blocked."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        target = self.target or tvm.target.Target.current(allow_none=True)
        if target is None:
            target = _target.host_target()
        folded = fold_row_views(unbind_to_slices(mod))
        count, out = self._fuse(folded, target)
        if count == 0 and folded is not mod:
            skip(logger, "views of linear layers", "no gate group fused through them")
            count, out = self._fuse(mod, target)
        record_rewrite(NAME, count)
        return out

    @staticmethod
    def _fuse(mod: IRModule, target) -> tuple[int, IRModule]:
        mod = _MergeSummedGemms(mod).transform()
        mod = _merge_siblings(mod, target)
        rewriter = _Rewriter(mod, target)
        mod = rewriter.transform()
        return rewriter.count, mod


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


# ---------------------------------------------------------------------------------------------
# Matching


@dataclasses.dataclass
class _Gemm:
    x: relax.Expr  # (rows..., K)
    weight: relax.Expr  # (k*D, K) when transposed, else (K, k*D)
    transposed: bool
    bias: relax.Expr | None  # broadcastable to (k*D,)
    pieces: list[relax.Var]  # in feature order
    chain: list[relax.Var]  # bindings the group replaces (matmul, add, split, items)
    width: int  # D
    aliases: dict = dataclasses.field(default_factory=dict)  # duplicate slice -> its piece
    # non-constant tensors broadcast to the GEMM output, added to it before the split (an RNN
    # step's input projection): read in the epilogue, added to the accumulator tile
    addends: list = dataclasses.field(default_factory=list)

    @property
    def gates(self) -> int:
        return len(self.pieces)


def _op(expr) -> str | None:
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


def _shape(expr) -> list | None:
    sinfo = getattr(expr, "ty", None)
    if isinstance(sinfo, relax.TensorType) and isinstance(sinfo.shape, relax.ShapeExpr):
        return list(sinfo.shape.values)
    return None


def _int(value) -> int | None:
    return int(value.value) if isinstance(value, tirx.IntImm) else None


class _Block:
    """Bindings of one dataflow block with use counts over the whole function."""

    def __init__(self, block: relax.DataflowBlock, uses: dict, outputs: set):
        self.bindings = list(block.bindings)
        self.value = {b.var: b.value for b in self.bindings if isinstance(b, relax.VarBinding)}
        self.index = {b.var: i for i, b in enumerate(self.bindings)}
        self.uses = uses
        self.outputs = outputs  # vars used after the block (non-dataflow)
        self.users: dict = {}
        for b in self.bindings:
            for v in vars_in(b.value):
                self.users.setdefault(v, []).append(b.var)

    @classmethod
    def of(cls, block: relax.DataflowBlock, uses: dict) -> _Block:
        """The block, its outputs being the variables bound outside the dataflow."""
        outputs = {b.var for b in block.bindings if not isinstance(b.var, relax.DataflowVar)}
        return cls(block, uses, outputs)

    def single_use(self, var) -> bool:
        return self.uses.get(var, 0) == 1 and var not in self.outputs


def _find_gemms(blk: _Block) -> list[_Gemm]:
    gemms = []
    for binding in blk.bindings:
        if not isinstance(binding, relax.VarBinding):
            continue
        pieces = _pieces(blk, binding) or _slice_pieces(blk, binding)
        if pieces is None:
            continue
        source, piece_vars, chain, width, aliases = pieces
        gemm = _gemm_of(blk, source, piece_vars, chain, width, aliases)
        if gemm is not None:
            gemms.append(gemm)
    return gemms


def _pieces(blk: _Block, binding) -> tuple | None:
    """A split of ``y`` along its last axis into equal pieces: (y, pieces, chain, width, {})."""
    value = binding.value
    if _op(value) != "relax.split":
        return None
    y = value.args[0]
    shape = _shape(y)
    if shape is None or len(shape) < 2:
        return None
    axis = int(value.attrs.axis) % len(shape)
    what = f"split {binding.var.name}"
    if axis != len(shape) - 1:
        return skip(logger, what, "not on the output-feature (last) axis") or None
    total = _int(shape[-1])
    if total is None:
        return skip(logger, what, "feature axis is symbolic") or None
    sections = value.attrs.indices_or_sections
    if isinstance(sections, tirx.IntImm | int):
        k = int(sections)
        bounds = [total * i // k for i in range(k + 1)]
    else:
        bounds = [0, *[int(i) for i in sections], total]
    widths = {b - a for a, b in zip(bounds, bounds[1:], strict=False)}
    if len(widths) != 1:
        return skip(logger, what, f"unequal pieces {sorted(widths)}") or None
    users = blk.users.get(binding.var, [])
    items: dict[int, relax.Var] = {}
    for user in users:
        item = blk.value.get(user)
        if not isinstance(item, relax.TupleGetItem) or user in items.values():
            return skip(logger, what, "the split tuple is used other than by indexing") or None
        items[int(item.index)] = user
    k = len(bounds) - 1
    if sorted(items) != list(range(k)) or binding.var in blk.outputs:
        return skip(logger, what, "not every piece is taken exactly once") or None
    return y, [items[i] for i in range(k)], [binding.var, *items.values()], widths.pop(), {}


def _last_axis_range(call, shape) -> tuple[int, int] | None:
    """(begin, end) of a stride-1 ``strided_slice`` of the last axis; other axes it names must
    be whole (begin 0, end the dim: what the importer writes for a Slice with computed bounds
    once PlaceShapeOnHost made them symbolic)."""
    fields = [list(a.fields) if isinstance(a, relax.Tuple) else None for a in call.args[1:]]
    if any(f is None for f in fields[:3]) or len({len(f) for f in fields[:3]}) != 1:
        return None
    strides = fields[3] if len(fields) > 3 and fields[3] else [1] * len(fields[0])
    found = None
    for axis, begin, end, stride in zip(*fields[:3], strides, strict=False):
        axis = _int(axis)
        if axis is None or (stride != 1 and _int(stride) != 1):  # 1: strides not given
            return None
        axis %= len(shape)
        if axis == len(shape) - 1:
            found = (_int(begin), _int(end))
            continue
        whole = _int(end) is not None and _int(shape[axis]) is not None
        whole = whole and _int(end) >= _int(shape[axis])
        if _int(begin) != 0 or not (whole or str(end) == str(shape[axis])):
            return None
    if found is None or None in found:
        return None
    return found


def _same_slice(a: relax.Call, b: relax.Call) -> bool:
    """Whether two ``strided_slice`` calls compute the same tensor: the same input and attributes,
    and axes, begins, ends and strides equal field by field (symbolic bounds structurally equal,
    or proven equal by the arith analyzer)."""
    if len(a.args) != len(b.args) or not a.args[0].same_as(b.args[0]):
        return False
    if not tvm_ffi.structural_equal(a.attrs, b.attrs):
        return False
    for fa, fb in zip(a.args[1:], b.args[1:], strict=True):
        if not isinstance(fa, relax.Tuple) or not isinstance(fb, relax.Tuple):
            if not tvm_ffi.structural_equal(fa, fb):
                return False
            continue
        if len(fa.fields) != len(fb.fields):
            return False
        for p, q in zip(fa.fields, fb.fields, strict=True):
            if tvm_ffi.structural_equal(p, q):
                continue
            if not (_is_index(p) and _is_index(q) and prove_equal(as_i64(p), as_i64(q))):
                return False
    return True


def _is_index(expr) -> bool:
    ty = getattr(expr, "ty", None)
    return isinstance(ty, tvm.ir.PrimType) and str(ty.dtype) in ("int32", "int64")


def _dedup_slices(blk: _Block, users: list) -> tuple[list, dict]:
    """The distinct slices among ``users`` (strided_slice bindings of one tensor, block order)
    and ``{duplicate: the first equal slice}``: torch's TorchScript exporter writes a ``chunk``
    piece as a Slice once per use."""
    distinct: list = []
    aliases: dict = {}
    for u in users:
        for d in distinct:
            if tvm_ffi.structural_equal(u.ty, d.ty) and _same_slice(blk.value[u], blk.value[d]):
                aliases[u] = d
                break
        else:
            distinct.append(u)
    return distinct, aliases


def _slice_pieces(blk: _Block, binding) -> tuple | None:
    """``y`` read only by ``strided_slice`` pieces of the last axis that partition it into equal
    widths (ONNX Slice pieces, a chunk written with slices; equal slices are one piece):
    (y, pieces, chain, width, {duplicate slice: its piece})."""
    y = binding.var
    shape = _shape(y)
    users = blk.users.get(y, [])
    if shape is None or len(shape) < 2 or not users or y in blk.outputs:
        return None
    if any(_op(blk.value.get(u)) != "relax.strided_slice" for u in users):
        return None
    total = _int(shape[-1])
    if total is None:
        return None
    users, aliases = _dedup_slices(blk, list(dict.fromkeys(users)))
    ranges = []
    for u in users:
        piece = _last_axis_range(blk.value[u], shape)
        if piece is None:
            return None
        begin, end = piece
        begin, end = (
            begin % total if begin < 0 else begin,
            min(end if end >= 0 else end + total, total),
        )
        ranges.append((begin, end, u))
    ranges.sort(key=lambda r: r[0])
    widths = {e - b for b, e, _ in ranges}
    bounds_ok = (
        ranges[0][0] == 0
        and ranges[-1][1] == total
        and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    )
    if len(widths) != 1 or not bounds_ok:
        skip(logger, f"slices of {y.name}", "the slices do not partition the axis equally")
        return None
    return y, [u for _, _, u in ranges], [], widths.pop(), aliases


def _gemm_of(blk: _Block, y, pieces, chain, width, aliases) -> _Gemm | None:
    what = f"GEMM feeding {pieces[0].name}"
    sliced = not chain  # strided_slice pieces read y directly (several uses, all pieces)
    if not isinstance(y, relax.Var) or y not in blk.value:
        return skip(logger, what, "GEMM output not computed in this block") or None
    if not sliced and not blk.single_use(y):
        return skip(logger, what, "GEMM output used elsewhere") or None
    value = blk.value[y]
    chain = [y, *chain, *(pieces if sliced else []), *aliases]
    addends = []
    while _op(value) == "relax.add" and len(addends) < 4:
        inner = _addend_split(blk, value, width * len(pieces), _shape(y))
        if inner is None:
            break
        var, addend = inner
        addends.append(addend)
        chain.insert(0, var)
        value = blk.value[var]
    bias = None
    if _op(value) == "relax.add":
        lhs, rhs = value.args
        if _op(blk.value.get(lhs)) == "relax.matmul" and isinstance(lhs, relax.Var):
            mm, bias = lhs, rhs
        elif _op(blk.value.get(rhs)) == "relax.matmul" and isinstance(rhs, relax.Var):
            mm, bias = rhs, lhs
        else:
            return skip(logger, what, "an add that is not matmul + bias") or None
        if not blk.single_use(mm):
            return skip(logger, what, "matmul output also used elsewhere") or None
        bias_shape = _shape(bias)
        total = width * len(pieces)
        if (
            bias_shape is None
            or any(_int(d) != 1 for d in bias_shape[:-1])
            or (bias_shape and _int(bias_shape[-1]) not in (1, total))
        ):
            return skip(logger, what, "bias does not broadcast along the features only") or None
        chain.insert(0, mm)
        value = blk.value[mm]
    if _op(value) != "relax.matmul":
        return skip(logger, what, "split input is not a matmul") or None
    x, w = value.args
    x_shape, out_shape = _shape(x), _shape(y)
    if x_shape is None or out_shape is None or len(x_shape) < 2:
        return skip(logger, what, "unknown shapes") or None
    if len(x_shape) != len(out_shape):  # a bias of more dims than the GEMM result
        return skip(logger, what, "the bias adds leading axes to the GEMM result") or None
    if any(str(a) != str(b) for a, b in zip(x_shape[:-1], out_shape[:-1], strict=True)):
        return skip(logger, what, "batched weight") or None
    transposed = False
    if isinstance(w, relax.Var) and _op(blk.value.get(w)) == "relax.permute_dims":
        perm = blk.value[w]
        axes = perm.attrs.axes
        w_shape = _shape(perm.args[0])
        if (
            w_shape is not None
            and len(w_shape) == 2
            and (axes is None or [int(a) for a in axes] == [1, 0])
        ):
            if blk.single_use(w):
                chain.insert(0, w)
            w, transposed = perm.args[0], True
    w_shape = _shape(w)
    if w_shape is None or len(w_shape) != 2:
        return skip(logger, what, "weight is not a 2-D tensor") or None
    n_feat = _int(w_shape[0] if transposed else w_shape[1])
    if n_feat != width * len(pieces):
        return skip(logger, what, "weight rows do not match the split") or None
    dtypes = [str(t.ty.dtype) for t in (x, w, *([bias] if bias is not None else []), *addends)]
    dtypes += [str(value.ty.dtype), str(y.ty.dtype)]  # the matmul's out_dtype, the split input
    if dtypes[0] not in _DTYPES:
        return skip(logger, what, f"dtype {dtypes[0]} (float32, float16, bfloat16 only)") or None
    if len(set(dtypes)) != 1:  # e.g. a float16 GEMM plus a float32 bias
        return skip(logger, what, f"mixed dtypes {sorted(set(dtypes))}") or None
    return _Gemm(x, w, transposed, bias, pieces, chain, width, aliases, addends)


def _addend_split(blk: _Block, add: relax.Call, n_features: int, out_shape) -> tuple | None:
    """``(inner var, addend)`` of ``add(inner, addend)`` where ``inner`` is a matmul or a sum
    (read only here) and ``addend`` a non-constant tensor that broadcasts to the GEMM output
    ``out_shape`` with all ``n_features`` features (an RNN step's input projection), else
    None."""
    for inner, addend in (add.args, add.args[::-1]):
        if not isinstance(inner, relax.Var) or isinstance(addend, GenericConst):
            continue
        if _op(blk.value.get(inner)) not in ("relax.matmul", "relax.add"):
            continue
        shape = _shape(addend)
        if (
            not blk.single_use(inner)
            or shape is None
            or out_shape is None
            or not 2 <= len(shape) <= len(out_shape)
            or _int(shape[-1]) != n_features
            or [str(d) for d in (_shape(inner) or [])] != [str(d) for d in out_shape]
        ):
            continue
        if all(
            _int(a) == 1 or prove_equal(a, b)
            for a, b in zip(shape[:-1], out_shape[-len(shape) : -1], strict=True)
        ):
            return inner, addend
    return None


@dataclasses.dataclass
class _Group:
    gemms: list[_Gemm]
    ops: list[relax.Var]  # epilogue bindings, block order
    outputs: list[relax.Var]
    externals: list[relax.Expr]
    rows: list
    width: int
    block: int | None = None  # V, chosen for the target


def _grow(blk: _Block, gemms: list[_Gemm]) -> list[_Group]:
    """Epilogue regions from the pieces; GEMMs whose pieces meet are merged."""
    owner: dict = {}  # region var -> group id
    parent = list(range(len(gemms)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for gi, g in enumerate(gemms):
        for p in [*g.pieces, *g.aliases]:
            owner[p] = gi
    ops: dict[int, list] = {}
    start = min(blk.index[p] for g in gemms for p in g.pieces)
    inputs = [_ancestors(blk, [g.x, g.weight, *g.addends]) for g in gemms]

    def gis(root):
        return [gi for gi in range(len(gemms)) if find(gi) == root]

    def _after(gi, root) -> bool:
        """GEMM ``gi`` reads a result of group ``root``."""
        return any(v in owner and find(owner[v]) == root for v in inputs[gi])

    for binding in blk.bindings[start:]:
        if not isinstance(binding, relax.VarBinding) or binding.var in owner:
            continue
        value = binding.value
        name = _op(value)
        if name not in _ELEMENTWISE or len(value.args) != _ELEMENTWISE[name][0]:
            continue
        region_args = [a for a in value.args if isinstance(a, relax.Var) and a in owner]
        if not region_args:
            continue
        groups = {find(owner[a]) for a in region_args}
        later = [r for r in groups if any(_after(gi, q) for gi in gis(r) for q in groups - {r})]
        if later:
            # one group's GEMM reads another's results (the next step of an unrolled RNN):
            # they stay two groups; the op belongs to the later one, the other's result is
            # its input
            # (the one some GEMM of which reads each other's results: a GRU step's input GEMM
            # reads x_t alone, its hidden GEMM h_t)
            last = [
                r for r in later if all(any(_after(gi, q) for gi in gis(r)) for q in groups - {r})
            ]
            if len(last) != 1:
                continue
            groups = {last[0]}
        root = groups.pop()
        for other in groups:
            parent[other] = root
        owner[binding.var] = root
        ops.setdefault(root, []).append(binding)
    result = []
    members: dict[int, list[int]] = {}
    for gi in range(len(gemms)):
        members.setdefault(find(gi), []).append(gi)
    for root, gis in members.items():
        region_ops = [b for r, bs in ops.items() if find(r) == root for b in bs]
        region_ops.sort(key=lambda b: blk.index[b.var])
        group = _check_group(blk, [gemms[i] for i in gis], region_ops)
        if group is not None:
            result.append(group)
    return result


def _check_group(blk: _Block, gemms: list[_Gemm], ops: list) -> _Group | None:
    what = f"gates of {', '.join(g.pieces[0].name for g in gemms)}"
    if not ops:
        return skip(logger, what, "no elementwise op consumes the pieces") or None
    widths = {g.width for g in gemms}
    rows = [_shape(g.pieces[0])[:-1] for g in gemms]
    if len(widths) != 1 or len({tuple(str(d) for d in r) for r in rows}) != 1:
        return skip(logger, what, "GEMMs with different row or piece shapes") or None
    if len({str(g.x.ty.dtype) for g in gemms}) != 1:
        return skip(logger, what, "GEMMs of different dtypes") or None
    width, rows = widths.pop(), rows[0]
    out_shape = [*rows, tirx.IntImm("int64", width)]
    region = {b.var for b in ops} | {p for g in gemms for p in [*g.pieces, *g.aliases]}
    # pieces (and their duplicates) must only feed the region
    for g in gemms:
        for p in [*g.pieces, *g.aliases]:
            if p in blk.outputs or any(u not in region for u in blk.users.get(p, [])):
                return skip(logger, what, f"piece {p.name} is also used outside the group") or None
    for g in gemms:
        if any(_depends_on(blk, a, region) for a in g.addends):
            return skip(logger, what, "an addend depends on the group's own results") or None
    externals: list = []
    for b in ops:
        if [str(d) for d in (_shape(b.var) or [])] != [str(d) for d in out_shape]:
            return skip(logger, what, f"{b.var.name} is not of the pieces' shape") or None
        for arg in b.value.args:
            if isinstance(arg, relax.Var) and arg in region or is_prim_expr(arg):
                continue
            if not _broadcastable(arg, out_shape):
                return skip(logger, what, f"{arg} does not broadcast to the pieces") or None
            if _depends_on(blk, arg, region):
                return skip(logger, what, "an input depends on the group's own results") or None
            if not any(arg.same_as(e) for e in externals):
                externals.append(arg)
    outputs = [
        b.var
        for b in ops
        if b.var in blk.outputs or any(u not in region for u in blk.users.get(b.var, []))
    ]
    if not outputs:
        return skip(logger, what, "no result leaves the group") or None
    return _Group(gemms, [b.var for b in ops], outputs, externals, rows, width)


def _broadcastable(arg, out_shape) -> bool:
    sinfo = getattr(arg, "ty", None)
    if isinstance(sinfo, tvm.ir.PrimType):
        return True
    shape = _shape(arg)
    if shape is None or len(shape) > len(out_shape) or str(sinfo.dtype) not in (*_DTYPES, "bool"):
        return False
    for a, b in zip(reversed(shape), reversed(out_shape), strict=False):
        if _int(a) == 1:
            continue
        if str(a) != str(b):
            return False
    return True


def _ancestors(blk: _Block, exprs: list) -> set:
    """Every variable of the block that ``exprs`` read, directly or through bindings."""
    stack = [v for e in exprs for v in vars_in(e)]
    seen: set = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in blk.value:
            stack.extend(vars_in(blk.value[v]))
    return seen


def _depends_on(blk: _Block, expr, region: set) -> bool:
    stack = [v for v in vars_in(expr)]
    seen = set()
    while stack:
        v = stack.pop()
        if v in region:
            return True
        if v in seen or v not in blk.value:
            continue
        seen.add(v)
        stack.extend(vars_in(blk.value[v]))
    return False


# ---------------------------------------------------------------------------------------------
# Emission


def _blocked_weight(w: np.ndarray, transposed: bool, gates: int, width: int, block: int):
    """(k*D, K) or (K, k*D) -> (ceil(D/V), K, k, V); units past D (when V does not divide D)
    are zero columns whose results nothing reads."""
    wt = w if transposed else w.T  # (k*D, K)
    k_dim = wt.shape[1]
    blocks = -(-width // block)
    per_gate = wt.reshape(gates, width, k_dim)
    if blocks * block != width:
        per_gate = np.pad(per_gate, ((0, 0), (0, blocks * block - width), (0, 0)))
    blocked = per_gate.reshape(gates, blocks, block, k_dim).transpose(1, 3, 0, 2)
    return np.ascontiguousarray(blocked)


def _gemm_stage(x, w, layout: str, block: int, width: int, gates: int, n_rows: int, name: str):
    """``Y[rows, gate, d] = sum_k x[rows, k] * W(gate, d, k)`` for one weight layout. With the
    blocked weight, ``Y`` is blocked like it, ``Y[rows, gate, d // V, d % V]``: every index is
    then a plain iterator (an einsum, which ``pad_einsum`` can pad) and one ``V`` block of
    units is one contiguous vector of each gate. Half-precision ``x`` and ``w`` are widened:
    the sum accumulates in float32."""
    kk = te.reduce_axis((0, x.shape[-1]), name="k")

    def mul(a, b):
        if a.dtype == _ACC:
            return a * b
        return a.astype(_ACC) * b.astype(_ACC)

    if layout == "blocked":  # (D/V, K, gates, V)

        def blocked(*idx):
            rows, gate, do, di = idx[:n_rows], idx[n_rows], idx[n_rows + 1], idx[n_rows + 2]
            return te.sum(mul(x[(*rows, kk)], w[do, kk, gate, di]), axis=kk)

        blocks = -(-width // block)  # the last block padded (zero weight columns)
        return te.compute((*x.shape[:-1], gates, blocks, block), blocked, name=name)

    def weight(gate, d):
        if layout == "nk":  # (gates*D, K)
            return w[gate * width + d, kk]
        return w[kk, gate * width + d]  # (K, gates*D)

    def body(*idx):
        rows, gate, d = idx[:n_rows], idx[n_rows], idx[n_rows + 1]
        return te.sum(mul(x[(*rows, kk)], weight(gate, d)), axis=kk)

    return te.compute((*x.shape[:-1], gates, width), body, name=name)


def _bias_stage(y, bias, width: int, n_rows: int, name: str):
    if not bias.shape:  # a scalar bias (ONNX Add of a 0-d constant)
        return te.compute(y.shape, lambda *idx: y(*idx) + _widen(bias, bias(), y.dtype), name=name)
    per_feature = _int(bias.shape[-1]) != 1
    lead = [0] * (len(bias.shape) - 1)
    blocked = len(y.shape) == n_rows + 3
    block = y.shape[-1] if blocked else None

    def body(*idx):
        gate = idx[n_rows]
        d = idx[n_rows + 1] * block + idx[n_rows + 2] if blocked else idx[n_rows + 1]
        if blocked and _int(block) * _int(y.shape[-2]) != width:  # padded units: any bias
            d = tirx.min(d, width - 1)
        return y(*idx) + _widen(
            bias, bias[(*lead, gate * width + d if per_feature else 0)], y.dtype
        )

    return te.compute(y.shape, body, name=name)


def _addend_stage(y, addend, width: int, n_rows: int, name: str):
    """``y + addend`` with ``addend`` of shape ``(*rows[-r:], gates * width)``: axes of size 1
    broadcast, padded units of a blocked ``y`` read the last unit."""
    blocked = len(y.shape) == n_rows + 3
    block = y.shape[-1] if blocked else None
    lead = len(addend.shape) - 1

    def body(*idx):
        gate = idx[n_rows]
        d = idx[n_rows + 1] * block + idx[n_rows + 2] if blocked else idx[n_rows + 1]
        if blocked and _int(block) * _int(y.shape[-2]) != width:
            d = tirx.min(d, width - 1)
        rows = idx[n_rows - lead : n_rows]
        at = [0 if _int(e) == 1 else r for r, e in zip(rows, addend.shape[:-1], strict=True)]
        return y(*idx) + _widen(addend, addend[(*at, gate * width + d)], y.dtype)

    return te.compute(y.shape, body, name=name)


def _widen(tensor: te.Tensor, value, dtype: str):
    """``value``, read from ``tensor``, as ``dtype`` (a half-precision bias or addend read into
    the float32 tile)."""
    return value if tensor.dtype == dtype else tirx.Cast(dtype, value)


def _piece_stage(y, gate: int, width: int, n_rows: int, name: str):
    blocked = len(y.shape) == n_rows + 3
    block = y.shape[-1] if blocked else None

    def body(*idx):
        if blocked:
            return y[(*idx[:-1], gate, idx[-1] // block, idx[-1] % block)]
        return y[(*idx[:-1], gate, idx[-1])]

    return te.compute((*y.shape[:n_rows], width), body, name=name)


def _compute(group: _Group, blk: _Block, block: int, fast_math: bool, layouts: list[str]):
    """The TE function for the group: (inputs...) -> outputs."""
    n_rows = len(group.rows)
    width = group.width
    # float16 / bfloat16: the gate math runs on float32 tensors (half-precision inputs widened
    # where read), each result is rounded to its dtype once, where it is written
    wide = str(group.gemms[0].x.ty.dtype) in _HALF

    def fn(*tensors):
        pos = 0
        env: dict = {}
        for gi, g in enumerate(group.gemms):
            x, w = tensors[pos], tensors[pos + 1]
            pos += 2
            y = _gemm_stage(x, w, layouts[gi], block, width, g.gates, n_rows, f"gemm{gi}")
            if g.bias is not None:
                y = _bias_stage(y, tensors[pos], width, n_rows, f"gemm{gi}_bias")
                pos += 1
            for ai in range(len(g.addends)):
                y = _addend_stage(y, tensors[pos], width, n_rows, f"gemm{gi}_add{ai}")
                pos += 1
            for gate, piece in enumerate(g.pieces):
                env[piece] = _piece_stage(y, gate, width, n_rows, f"gate{gi}_{gate}")
            for dup, piece in g.aliases.items():
                env[dup] = env[piece]
        externals = list(tensors[pos : pos + len(group.externals)])
        if wide:
            externals = [topi.cast(t, _ACC) if t.dtype in _HALF else t for t in externals]

        def external(expr):
            for i, ext in enumerate(group.externals):
                if ext.same_as(expr):
                    return externals[i]
            raise KeyError(expr)

        for var in group.ops:
            value = blk.value[var]
            args = [
                env[a]
                if isinstance(a, relax.Var) and a in env
                else a
                if is_prim_expr(a)
                else external(a)
                for a in value.args
            ]
            env[var] = _emit_op(value, args, fast_math, wide)
        outs = [env[o] for o in group.outputs]
        if wide:
            outs = [_round_to(t, str(o.ty.dtype)) for t, o in zip(outs, group.outputs, strict=True)]
        if len(outs) == 1:
            return outs
        # Several results (the LSTM's h and c): one block writes them all, so that the
        # schedule can compute every other stage at the output tile (TIR refuses compute_at
        # of an output block, and reverse_compute_at cannot place a block that reads a gate
        # at a constant index).
        return list(te.compute(outs[0].shape, lambda *i: [o(*i) for o in outs], name="gates"))

    return fn


def _round_to(t: te.Tensor, dtype: str) -> te.Tensor:
    return t if t.dtype == dtype else topi.cast(t, dtype)


def _plan_block(group: _Group, target) -> int | None:
    """The vector block V of ``group`` on ``target`` (set on the group), None when none fits."""
    from ..schedule import gate_block
    from ..target import is_gpu

    # On CPU each GEMM of the group accumulates in registers on its own (one after the other in
    # a tile): its gates, not the group's, share the register budget (a GRU's two GEMMs of 3).
    n_gates = (sum if is_gpu(target) else max)(g.gates for g in group.gemms)
    rows = 1
    for d in group.rows:
        rows = rows * _int(d) if _int(d) is not None and rows is not None else None
    block = gate_block(target, group.width, n_gates, rows)
    if block is None:
        skip(logger, f"gates of width {group.width}", "no vector block divides the width")
    group.block = block
    return block


def _emission_order(blk: _Block, groups: list[_Group]) -> list | None:
    """The block's bindings outside the groups and the groups (each one call), in an order
    that defines every variable before its use: block order, each group at its last binding,
    and whatever is not ready yet (a binding reading a group result that the group's place
    comes after; the next layer's gate input in a Llama block) waits for it. None on a
    cycle."""
    items: list = []
    region: set = set()
    for g in groups:
        members = set(g.ops) | {v for gemm in g.gemms for v in gemm.chain}
        region |= members
        items.append((max(blk.index[v] for v in members), 1, g))
    items += [(blk.index[b.var], 0, b) for b in blk.bindings if b.var not in region]
    items.sort(key=lambda t: (t[0], t[1]))

    def needs(item) -> set:
        if isinstance(item, _Group):
            exprs = [e for g in item.gemms for e in (g.x, g.weight, g.bias) if e is not None]
            exprs += [a for g in item.gemms for a in g.addends]
            exprs += list(item.externals)
        else:
            exprs = [item.value]
        return {v for e in exprs for v in vars_in(e) if v in blk.index}

    def provides(item) -> list:
        return list(item.outputs) if isinstance(item, _Group) else [item.var]

    pending = [item for _, _, item in items]
    defined: set = set()
    order = []
    while pending:
        ready = next((i for i, item in enumerate(pending) if needs(item) <= defined), None)
        if ready is None:
            return None
        order.append(pending.pop(ready))
        defined.update(provides(order[-1]))
    return order


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, target):
        super().__init__(mod)
        self.mod = mod
        self.target = target
        self.count = 0
        self.uses: dict = {}
        self._blk: _Block | None = None

    def transform(self) -> IRModule:
        for gv, func in self.mod.functions_items():
            if not isinstance(func, relax.Function) or func.attrs.get("Primitive", False):
                continue
            self.uses = use_counts(func)
            new_func = self.visit_expr(func)
            new_func = relax.analysis.remove_all_unused(new_func)
            self.builder_.update_func(gv, new_func)
        return self.builder_.get()

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.BindingBlock:
        blk = _Block.of(block, self.uses)
        self._blk = blk
        gemms = _find_gemms(blk)
        groups = _grow(blk, gemms) if gemms else []
        groups = [g for g in groups if _plan_block(g, self.target) is not None]
        if not groups:
            return super().visit_dataflow_block_(block)
        return self._emit(block, blk, groups)

    def _emit(self, block, blk: _Block, groups: list[_Group]) -> relax.BindingBlock:
        order = _emission_order(blk, groups)
        if order is None:
            skip(logger, "gate groups of a block", "their inputs and results form a cycle")
            return super().visit_dataflow_block_(block)
        self.builder_._begin_dataflow_block()
        for item in order:
            if isinstance(item, _Group):
                self._emit_group(item)
            else:
                self.visit_binding(item)
        return self.builder_._end_block()

    def _emit_group(self, group: _Group) -> None:
        fast_math = _target.is_cpu(self.target)
        args = []
        layouts = []
        for gemm in group.gemms:
            args.append(self.visit_expr(gemm.x))
            if isinstance(gemm.weight, GenericConst):
                w = gemm.weight.value.numpy()
                args.append(
                    relax.const(
                        _blocked_weight(w, gemm.transposed, gemm.gates, gemm.width, group.block),
                        str(gemm.weight.ty.dtype),
                    )
                )
                layouts.append("blocked")
            else:
                args.append(self.visit_expr(gemm.weight))
                layouts.append("nk" if gemm.transposed else "kn")
            if gemm.bias is not None:
                args.append(self.visit_expr(gemm.bias))
            args += [self.visit_expr(a) for a in gemm.addends]
        args += [self.visit_expr(e) for e in group.externals]
        fn = _compute(group, self._blk, group.block, fast_math, layouts)
        call = self.builder_.call_te(fn, *args, primfunc_name_hint=_name(group))
        gv = call.args[0]
        func = self.builder_.get()[gv]
        hints = {
            "block": group.block,
            "gates": sum(g.gates for g in group.gemms),
            "width": group.width,
        }
        self.builder_.update_func(gv, func.with_attrs({"op_pattern": 8, GATE_ATTR: hints}))
        self.count += 1
        if len(group.outputs) == 1:
            out = group.outputs[0]
            self.builder_.emit_normalized(relax.VarBinding(out, self.builder_.normalize(call)))
            return
        fused = self.builder_.emit(call, "gates")
        for i, out in enumerate(group.outputs):
            self.builder_.emit_normalized(relax.VarBinding(out, relax.TupleGetItem(fused, i)))


def _name(group: _Group) -> str:
    return "fused_gates_" + "_".join(str(len(g.pieces)) for g in group.gemms)
