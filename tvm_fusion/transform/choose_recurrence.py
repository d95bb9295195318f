"""ChooseRecurrence: a static-sequence recurrence as the loop kernel on CPU, unrolled elsewhere.

The frontends (``frontend/onnx_rnn.py`` for ONNX ``LSTM`` / ``GRU`` / ``RNN``,
``frontend/torch_rnn.py`` for torch.export's ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``) write each
direction of a recurrent layer over a static sequence that ``lower/rnn_loop.py``'s kernel
covers as a call of a private Relax function marked ``rnn_loop.RECURRENCE_ATTR``: its
parameters the input projection of every step, the recurrent weight and bias, the initial
states; its body the unrolled steps (one gate kernel per step after FuseSplitGates). The
importer does not know the target; this pass does:

- CPU targets (llvm, c): the call becomes ``call_tir`` of the loop kernel (one scheduled
  PrimFunc per direction: a serial loop over time, the gate step as its body, the weights read
  from cache-resident blocks; measured faster than the unrolled steps at every size tried,
  ARCHITECTURE.md "Recurrent ops"), the weights blocked here from the call's constants;
- other targets (CUDA: the kernel is CPU code), a call whose weights are not constants, or the
  pass switched off on CPU: the function is inlined, so the unrolled steps are what they were
  before this pass (FuseSplitGates fuses each step).

Only marked functions are touched; other private Relax functions (library dispatch's
composites) are left as they are. Must run first among the graph passes: the ones after it
read the unrolled steps or the loop kernel's call, not the marked call.
"""

from __future__ import annotations

import tvm
from tvm import IRModule, relax
from tvm.ir.expr import GenericConst
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import target as _target
from ..lower import rnn_loop
from ._common import get_logger, record_rewrite, skip

logger = get_logger(__name__)
NAME = "ChooseRecurrence"
_KEEP = "__tvm_fusion_keep__"  # a temporary global symbol: InlinePrivateFunctions skips it


def _marked(mod: IRModule) -> dict:
    return {
        gv: func
        for gv, func in mod.functions_items()
        if isinstance(func, relax.Function)
        and func.attrs is not None
        and rnn_loop.RECURRENCE_ATTR in func.attrs
    }


@tvm.transform.module_pass(opt_level=0, name=NAME)
class ChooseRecurrence:
    """Marked recurrences: the loop kernel on CPU targets, inlined unrolled steps elsewhere."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        marked = _marked(mod)
        if not marked:
            return mod
        target = _target.resolve_target(self.target)
        if _target.is_cpu(target):
            mod = _to_loops(mod, marked, target)
        return _inline(mod)


def _to_loops(mod: IRModule, marked: dict, target) -> IRModule:
    count = [0]

    @mutator
    class _Loops(PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            func = marked.get(call.op) if isinstance(call.op, relax.GlobalVar) else None
            if func is None:
                return call
            spec = func.attrs[rnn_loop.RECURRENCE_ATTR]
            weights = call.args[1 : 3 if bool(spec["bias"]) else 2]
            if not all(isinstance(w, GenericConst) for w in weights):
                skip(logger, call.op.name_hint, "recurrent weight or bias not constant: inlined")
                return call
            r = weights[0].value.numpy()
            rb = weights[1].value.numpy() if len(weights) > 1 else None
            states = call.args[1 + len(weights) :]
            count[0] += 1
            add = self.builder_.add_func
            return rnn_loop.loop_call(add, spec, call.args[0], r, rb, states, target)

    loops = _Loops(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and gv not in marked:
            loops.builder_.update_func(gv, loops.visit_expr(func))
    if not count[0]:
        return mod
    record_rewrite(NAME, count[0])
    out = loops.builder_.get()
    return relax.transform.DeadCodeElimination(
        [gv.name_hint for gv, f in out.functions_items() if _public(f)]
    )(out)


def _public(func) -> bool:
    return func.attrs is not None and func.attrs.get("global_symbol") is not None


def _inline(mod: IRModule) -> IRModule:
    """The marked functions still called inlined; other private Relax functions kept (they are
    given a temporary global symbol while InlinePrivateFunctions runs)."""
    if not _marked(mod):
        return mod
    marked = _marked(mod)
    kept = {}
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and gv not in marked and not _public(func):
            kept[gv] = func.with_attr("global_symbol", _KEEP + gv.name_hint)
    if kept:
        mod = tvm.IRModule(
            {gv: kept.get(gv, f) for gv, f in mod.functions_items()},
            attrs=mod.attrs,
            global_infos=mod.global_infos,
        )
    mod = relax.transform.InlinePrivateFunctions()(mod)
    if kept:
        mod = tvm.IRModule(
            {
                gv: f.without_attr("global_symbol") if gv in kept else f
                for gv, f in mod.functions_items()
            },
            attrs=mod.attrs,
            global_infos=mod.global_infos,
        )
    return mod
