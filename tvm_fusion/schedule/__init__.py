"""Stage 4, schedule: TIR kernels in, scheduled TIR kernels out.

Schedule rules: dlight-style, one rule per file, per target family (``cpu/``, ``cuda/``). The
lowest stage: it imports only the ground modules, and the stages above read what its kernels
want from it (``gate_block``: the weight block FuseSplitGates lays out for the gate rules).

``default_rules(target)`` is the ordered list the pipeline applies: our rules first, then
dlight's defaults. A rule's ``apply(func, target, tunable)`` returns None when it does not apply.

``default_schedule_pass(target)`` applies them in the pipeline's Phase 4 (:class:`ApplyRules`,
dlight's ``ApplyDefaultSchedule`` plus two things: each scheduled PrimFunc records the name of the
rule that scheduled it in its ``tvm_fusion.schedule_rule`` attribute, which
``tvm_fusion.analysis.schedule_info`` and ``tvm-fusion explain`` report, and a rule that raises
is treated as one that declines). Constant weights are marked layout-free first, so that the
matmul rule may pack them; the packing blocks it creates are split out and folded at compile time
afterwards.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax
from tvm.s_tir import dlight as dl
from tvm.target import Target

from .. import target as _target
from . import cpu, cuda
from .empty_reductions import init_outside_empty_loops

logger = logging.getLogger(__name__)

RULE_ATTR = "tvm_fusion.schedule_rule"
# The rules of last resort: a kernel of an op class that has a rule of its own must not land here.
FALLBACK_RULES = ("Fallback",)


def default_rules(target: Target) -> list[dl.ScheduleRule]:
    if _target.is_gpu(target):
        return [
            cuda.GateFusion(),
            cuda.SkinnyMatmul(),  # before dlight's Matmul: where that leaves SMs idle
            cuda.HalfTensorCore(),  # before dlight's Matmul: short half GEMMs on tensor cores
            dl.gpu.Matmul(),
            dl.gpu.GEMV(),
            dl.gpu.Reduction(),
            dl.gpu.GeneralReduction(),
            dl.gpu.Fallback(),
        ]
    return [
        cpu.GateFusion(),
        cpu.Matmul(),
        cpu.GroupedConv(),  # before the window rule, which would take it as dot products
        cpu.RowReduction(),
        cpu.Injective(),
        cpu.WindowReduction(),
        cpu.Fallback(),
    ]


def default_schedule_pass(target: Target) -> tvm.transform.Pass:
    """Apply :func:`default_rules` to every PrimFunc that is not yet scheduled."""
    return ApplyRules(*default_rules(target))


def rule_name(rule) -> str:
    """``Matmul`` for our rules, ``dlight.gpu.Matmul`` for dlight's."""
    cls = type(rule)
    return cls.__name__ if cls.__module__.startswith(__name__) else f"dlight.{_family(cls)}"


def _family(cls) -> str:
    parts = cls.__module__.split(".")
    family = parts[parts.index("dlight") + 1] if "dlight" in parts else parts[-1]
    return f"{family}.{cls.__name__}"


@tvm.transform.module_pass(opt_level=0, name="ApplyRules")
class ApplyRules:
    """Schedule every PrimFunc not yet scheduled with the first rule that applies, as dlight's
    ``ApplyDefaultSchedule`` does, and record that rule's name in the function's
    ``tvm_fusion.schedule_rule`` attribute (what a MetaSchedule database scheduled keeps no
    such attribute). A rule that raises counts as one that declines: the kernel goes to the
    next rule instead of failing the build (dlight's GPU Matmul raises on some fused gate
    kernels in apache-tvm 0.27); the error is logged at debug level."""

    def __init__(self, *rules):
        self.rules = list(rules)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updated = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs.get("tirx.is_scheduled", 0):
                continue
            target = func.attrs.get("target", None) or Target.current(allow_none=False)
            for rule in self.rules:
                try:
                    space = rule.apply(func, target, False)
                except Exception as err:  # noqa: BLE001 - a rule's bug must not fail the build
                    logger.debug("%s: %s raised, next rule: %s", gv.name_hint, rule_name(rule), err)
                    continue
                if space is None:
                    continue
                sch = space if not isinstance(space, list) else space[0]
                init_outside_empty_loops(sch)
                updated[gv] = (
                    sch.mod["main"]
                    .with_attr("tirx.is_scheduled", True)
                    .with_attr(RULE_ATTR, rule_name(rule))
                )
                break
        for gv, func in updated.items():
            mod[gv] = func
        return mod


def prepare_passes() -> list[tvm.transform.Pass]:
    """Before scheduling: mark PrimFunc parameters bound to constants as layout-free, then keep
    that mark on GEMM weights only (:class:`KeepLayoutFreeWeights`)."""
    return [AttachLayoutFreeBuffers(), KeepLayoutFreeWeights()]


def _call_tir_callees(func: relax.Function) -> list:
    """The PrimFuncs ``func`` calls through ``call_tir``, in post order (repeats included)."""
    call_tir = tvm.ir.Op.get("relax.call_tir")
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(call_tir):
            found.append(expr.args[0])

    relax.analysis.post_order_visit(func, visit)
    return found


@tvm.transform.module_pass(opt_level=0, name="AttachLayoutFreeBuffers")
class AttachLayoutFreeBuffers:
    """Stock ``AttachAttrLayoutFreeBuffers``, except that a PrimFunc of which it marks no
    parameter is kept as it was (with an empty mark).

    The stock pass copies every called PrimFunc through ``s_tir.renew_defs``, which gives the
    buffer shapes fresh vars but leaves those of an explicit buffer layout (the output of
    topi's scans, a ``decl_buffer``) undefined: a symbolic ``cumsum`` (OPT's positions, a
    cumsum of the attention mask) then fails ``MakePackedAPI`` with "variables (batch, seq)
    are used, but are not passed in as API arguments". Upstream fix: remap the layout's vars
    in ``RenewDefs``. Both modules' ``call_tir`` callees are walked in the same order (the
    stock pass only replaces each call's callee) to find the original of each copy.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out = relax.transform.AttachAttrLayoutFreeBuffers()(mod)
        restore = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function) or gv.name_hint not in out:
                continue
            old = _call_tir_callees(func)
            new = _call_tir_callees(out[gv.name_hint])
            if len(old) != len(new):
                logger.debug("%s: call_tir callees changed, left as the stock pass made it", gv)
                continue
            for old_gv, new_gv in zip(old, new, strict=True):
                copy = out[new_gv]
                if not list(copy.attrs.get("layout_free_buffers", None) or []):
                    restore[new_gv] = mod[old_gv].with_attr("layout_free_buffers", [])
        for new_gv, func in restore.items():
            out[new_gv] = func
        return out


def _weight_params(func) -> list[int]:
    """Indices of ``func``'s parameters read by exactly one block, a block with a reduction
    iterator (a GEMM's weight), and read there once."""
    from ..tir_util import blocks

    readers: dict[int, list] = {}
    for block in blocks(func):
        for region in block.reads:
            for i, param in enumerate(func.params):
                if param.same_as(region.source):
                    readers.setdefault(i, []).append(block)
    return [
        i
        for i, found in readers.items()
        if len(found) == 1 and any(iv.iter_type == iv.CommReduce for iv in found[0].iter_vars)
    ]


@tvm.transform.module_pass(opt_level=0, name="KeepLayoutFreeWeights")
class KeepLayoutFreeWeights:
    """``layout_free_buffers`` on the weights of reductions only.

    ``AttachAttrLayoutFreeBuffers`` marks every constant parameter, biases included.
    MetaSchedule's RewriteLayout postproc then derives a layout for each from one of its reads
    after AutoInline; a bias read three times with constant offsets (``C[v]``, ``C[16 + v]``,
    ``C[32 + v]``, a fused gate epilogue) got the non-bijective ``C[v] -> C_global[v % 16]``
    and every gate read gate 0's bias: a candidate 2x faster and wrong, which then won the
    tuning run (apache-tvm 0.27). Repacking a bias gains nothing; the weights that a GEMM
    reads once keep the mark (our Matmul rule and MetaSchedule pack those).
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        changed = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, tvm.tirx.PrimFunc) or not func.attrs:
                continue
            marked = func.attrs.get("layout_free_buffers", None)
            if marked is None:
                continue
            weights = set(_weight_params(func))
            keep = [int(i) for i in marked if int(i) in weights]
            if len(keep) == len(marked):
                continue
            if keep:
                changed[gv] = func.with_attr("layout_free_buffers", keep)
            else:
                changed[gv] = func.without_attr("layout_free_buffers")
        if not changed:
            return mod
        mod = tvm.IRModule(mod.functions, mod.attrs)
        for gv, func in changed.items():
            mod[gv] = func
        return mod


def finish_passes() -> list[tvm.transform.Pass]:
    """After scheduling: weight-packing blocks become their own PrimFuncs, folded on constants."""
    return [SplitWeightPrepack(), relax.transform.FoldConstant(), RemoveUnusedPrimFuncs()]


PREPROC = "meta_schedule.layout_rewrite_preproc"


def _has_preproc(func) -> bool:
    from ..tir_util import blocks

    return any(bool(b.annotations.get(PREPROC, False)) for b in blocks(func))


@tvm.transform.module_pass(opt_level=0, name="SplitWeightPrepack")
class SplitWeightPrepack:
    """Stock ``SplitLayoutRewritePreproc`` on the PrimFuncs that have a packing block only.

    The stock pass visits every PrimFunc and aborts on one whose root holds loops but no block
    (``take_backward`` is legalised that way): "There should be a compute block if there is
    only one subtree under the root". Upstream fix: skip functions without preproc blocks in
    ``SplitFunctionLayoutRewrite::Transform``. Here the other PrimFuncs are set aside while it
    runs and put back after.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        aside = {
            gv: func
            for gv, func in mod.functions_items()
            if isinstance(func, tvm.tirx.PrimFunc) and not _has_preproc(func)
        }
        if len(aside) == sum(isinstance(f, tvm.tirx.PrimFunc) for f in mod.functions.values()):
            return mod  # nothing to split
        sub = tvm.IRModule(
            {gv: f for gv, f in mod.functions_items() if gv not in aside}, attrs=mod.attrs
        )
        sub = relax.transform.SplitLayoutRewritePreproc()(sub)
        for gv, func in aside.items():
            sub[gv] = func
        return sub


@tvm.transform.module_pass(opt_level=0, name="RemoveUnusedPrimFuncs")
class RemoveUnusedPrimFuncs:
    """Drop PrimFuncs no Relax function calls any more (e.g. packing functions that were folded)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        used: set[str] = set()
        for _, func in mod.functions_items():
            if isinstance(func, relax.Function):
                for gv in relax.analysis.all_global_vars(func):
                    used.add(gv.name_hint)
        unused = [
            gv
            for gv, func in mod.functions_items()
            if isinstance(func, tvm.tirx.PrimFunc)
            and gv.name_hint not in used
            and not func.attrs.get("global_symbol", None)  # externally visible: keep
        ]
        if not unused:
            return mod
        mod = mod.clone() if hasattr(mod, "clone") else tvm.IRModule(mod.functions, mod.attrs)
        for gv in unused:
            del mod[gv]
        return mod


def gate_block(target: Target, width: int, gates: int, rows: int | None) -> int | None:
    """The vector block ``V`` for FuseSplitGates' blocked weights on ``target``.

    On llvm: a multiple (or half) of the SIMD lanes that divides ``width`` and keeps
    ``gates * V / lanes`` accumulators within half the vector registers; for one row (GEMV) as
    wide as that allows (more independent accumulators hide FMA latency), otherwise one vector
    per gate so that more rows fit the register tile. Of the blocks that fit, the one with the
    fewest vector instructions per row, ``ceil(width / V) * V`` units over the lanes a vector
    of ``V`` fills (FuseSplitGates pads a ``width`` that ``V`` does not divide with zero
    columns); the earlier in that order of equals.
    """
    if _target.is_gpu(target):
        from .cuda.gate_fusion import gate_block as cuda_gate_block

        return cuda_gate_block(target, width, gates, rows)
    lanes = _target.vector_lanes(target, "float32")
    budget = _target.vector_registers(target) // 2
    # Symbolic rows are padded to the tile of many rows by the CPU rule (cpu/gate_fusion.py).
    wide = [4 * lanes, 2 * lanes, lanes] if rows == 1 else [lanes, 2 * lanes]
    fits = [v for v in wide + [lanes // 2, 8, 4] if v >= 4 and gates * max(v // lanes, 1) <= budget]
    if not fits:
        return None

    def cost(item):  # vector instructions per row: padded units over the lanes a vector fills
        order, v = item
        return (-(-width // v) * v * lanes / min(v, lanes), order)

    # Units that no full vector divides (97, 1365, 1998) are padded to whole blocks of zero
    # columns rather than run on half or quarter vectors: 97 units are 7 vectors of 16, 13 of 8.
    return min(enumerate(fits), key=cost)[1]


def gate_tile_rows(
    target: Target, rows: int | None, gates: int, block: int, gathered: bool = False
) -> int:
    """Rows per register tile that the CPU gate rule gives a gate kernel of ``rows`` rows
    (None: symbolic), ``gates`` gates of the widest GEMM and vector block ``block``
    (``cpu/gate_fusion.tile_rows``, sized from the target's lanes and registers). A kernel
    that ``pad_einsum`` cannot pad (``gathered``: an expert weight read at ``W[ids[row]]``) is
    built with its GEMM rows padded to a multiple of it, named in its ``rows`` hint."""
    from .cpu.gate_fusion import tile_rows

    lanes = _target.vector_lanes(target, "float32")
    return tile_rows(rows, gates, block, lanes, _target.vector_registers(target), gathered)
