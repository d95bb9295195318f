"""MarkDispatchedTopK: the library dispatch's ``topk`` kernels keep what they compute.

On GPU targets stock's ``DispatchSortScan`` makes each ``relax.topk`` a ``call_tir`` of a
sorting kernel (``topi.gpu.topk``) whose TIR no longer says that its indices lie in ``[0, n)``
along ``axis``; FuseGatheredGates needs that proof to read ``W[ids[s]]`` unchecked. This pass
runs the dispatch passes it wraps and tags each PrimFunc that a former ``topk`` binding now
calls with :data:`TOPK_ATTR` ``{"axis", "ret_type"}`` (the CPU dispatch's kernel names its
library call, ``tvm.contrib.sort.topk``, and needs no tag). A binding whose variable the
dispatch replaced, or a kernel that anything but such bindings calls (or they with other
attributes), is left untagged (no proof).
"""

from __future__ import annotations

import tvm
from tvm import IRModule, relax

NAME = "MarkDispatchedTopK"
TOPK_ATTR = "tvm_fusion.topk"


@tvm.transform.module_pass(opt_level=0, name=NAME)
class MarkDispatchedTopK:
    """Runs ``passes`` (the library dispatch) and tags the kernels that ``topk`` became."""

    def __init__(self, passes: list):
        self.passes = tvm.transform.Sequential(list(passes), name="library_dispatch")

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        topks = {}  # binding var -> (axis, ret_type)
        for _, func in mod.functions_items():
            if isinstance(func, relax.Function):
                for binding in _bindings(func):
                    value = binding.value
                    if isinstance(value, relax.Call) and value.op.same_as(_TOPK):
                        topks[binding.var] = (int(value.attrs.axis), str(value.attrs.ret_type))
        out = self.passes(mod)
        if not topks:
            return out
        tags: dict = {}  # kernel -> the (axis, ret_type) of each call; None: another caller
        for _, func in out.functions_items():
            if not isinstance(func, relax.Function):
                continue
            for binding in _bindings(func):
                value = binding.value
                if not isinstance(value, relax.Call) or not value.args:
                    continue
                gv = value.args[0]
                if not isinstance(gv, tvm.ir.GlobalVar):
                    continue
                if value.op.same_as(_CALL_TIR) and binding.var in topks:
                    if tags.get(gv, set()) is not None:
                        tags[gv] = tags.get(gv, set()) | {topks[binding.var]}
                else:
                    tags[gv] = None
        for gv, found in tags.items():
            func = out[gv]
            if found is not None and len(found) == 1 and isinstance(func, tvm.tirx.PrimFunc):
                ((axis, ret_type),) = found
                out[gv] = func.with_attr(TOPK_ATTR, {"axis": axis, "ret_type": ret_type})
        return out


_TOPK = tvm.ir.Op.get("relax.topk")
_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _bindings(func: relax.Function) -> list:
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return []
    return [b for block in body.blocks for b in block.bindings if isinstance(b, relax.VarBinding)]
