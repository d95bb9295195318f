"""The ``tvm_fusion`` Relax pipeline and the pass lists it is made of.

``import tvm_fusion`` registers the pipeline, so both of these work::

    tvm.compile(mod, target, relax_pipeline="tvm_fusion")
    relax.get_pipeline("tvm_fusion", target=target, fuse_split_gates=False)

Phases (see shared ARCHITECTURE.md):

0. library dispatch (sampling, sort/scan), as stock does;
1. our graph rewrites on Relax ops, before LegalizeOps (:func:`fusion_passes`);
2. stock lowering and grouping: LegalizeOps, AnnotateTIROpPattern, FoldConstant, FuseOps;
3. our rewrites of the grouped program (:func:`post_fusion_passes`), then FuseTIR;
4. schedules: a MetaSchedule database when given, then our rules and dlight's defaults;
5. stock dataflow lowering and finalisation (memory planning, VM lowering).

Every pass of ours has a keyword flag of the same name in snake_case and can also be switched
off with ``PassContext(disabled_pass=["PassName"])``. The target is read when the pipeline runs:
the ``target`` argument, else ``Target.current()`` (``tvm.compile`` enters it), else the host.
The public functions (:func:`fusion_passes`, :func:`post_fusion_passes`, :func:`build_pipeline`)
parse a target given as a string or dict where it enters; the functions below them take a
``Target``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import tvm
from tvm import relax
from tvm.relax.pipeline import PIPELINE_MAP, register_pipeline
from tvm.target import Target
from tvm.tirx.buffer import BufferType

from .. import target as _target
from ..errors import UsageError
from ..transform import GRAPH_PASSES, POST_FUSION_PASSES
from ..transform.mark_topk import MarkDispatchedTopK
from .database import apply_database_pass

logger = logging.getLogger(__name__)

PIPELINE_NAME = "tvm_fusion"
_EMPTY = tvm.transform.Sequential([])


# Flags of passes after the rules (Phase 5), not in the transform stage's lists.
SCHEDULE_FLAGS = ("serial_small_kernels",)


def pass_flags() -> list[str]:
    """Keyword flags that switch one of our passes on or off."""
    return [flag for flag, _ in GRAPH_PASSES + POST_FUSION_PASSES] + list(SCHEDULE_FLAGS)


def _check_flags(flags: dict) -> None:
    known = set(pass_flags())
    unknown = sorted(set(flags) - known)
    if unknown:
        raise UsageError(
            f"unknown pipeline flag(s) {', '.join(unknown)}; known: "
            + ", ".join(sorted(known | {"schedule", "fast_math", "tuning_db", "dump_dir"}))
        )


def _build(entries: list[tuple[str, type]], target: Target, flags: dict) -> list:
    return [cls(target=target) for flag, cls in entries if flags.get(flag, True)]


def fusion_passes(
    target: Target | str | dict | None = None, **flags: bool
) -> list[tvm.transform.Pass]:
    """Our graph rewrites (Phase 1), in order. Splice them before ``LegalizeOps``.

    ``target``: a Target, or what :func:`~tvm_fusion.target.parse_target` takes; None:
    ``Target.current()``, else the host. ``flags`` switch single passes off, e.g.
    ``fusion_passes(t, gather_to_slice=False)``.
    """
    _check_flags(flags)
    return _graph_passes(_target.resolve_target(target), flags)


def _graph_passes(target: Target, flags: dict) -> list[tvm.transform.Pass]:
    passes = _build(GRAPH_PASSES, target, flags)
    return [
        _ShapesThenCanonical(p) if type(p).__name__ == "PlaceShapeOnHost" else p for p in passes
    ]


@tvm.transform.module_pass(opt_level=0, name="PlaceShapeOnHost")
class _ShapesThenCanonical:
    """PlaceShapeOnHost, then, when it changed the module, CanonicalizeBindings: what it made
    static leaves the importer's match_casts to named dims trivial, and later passes (gate
    slices) want the static/symbolic shapes. A module it leaves alone stays as it is."""

    def __init__(self, pass_):
        self.pass_ = pass_

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        new = self.pass_(mod)
        return new if new.same_as(mod) else relax.transform.CanonicalizeBindings()(new)


def post_fusion_passes(
    target: Target | str | dict | None = None, **flags: bool
) -> list[tvm.transform.Pass]:
    """Our rewrites of grouped programs (Phase 3). Splice them between ``FuseOps`` and
    ``FuseTIR``. ``target`` as for :func:`fusion_passes`."""
    _check_flags(flags)
    return _build(POST_FUSION_PASSES, _target.resolve_target(target), flags)


def lowering_passes(fast_math: bool = False) -> list[tvm.transform.Pass]:
    """Phase 2: legalisation and grouping, on every target (stock ``default`` skips grouping).

    ``fast_math`` legalises exp/erf/tanh and the ops built on them with polynomial
    approximations (see :mod:`tvm_fusion.lower.legalize`). FuseTIR is not part of this phase:
    Phase 3 works on the grouped Relax functions, then :func:`fuse_tir_passes` makes one
    PrimFunc each.
    """
    from ..lower.legalize import legalize_map

    return [
        LowerCallTIRWithGrad(),
        relax.transform.LegalizeOps(legalize_map(fast_math)),
        relax.transform.AnnotateTIROpPattern(),
        KeepHostKernelsApart(),
        KeepScalarKernelsApart(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
    ]


def _replace_functions(mod: tvm.IRModule, changed: dict) -> tvm.IRModule:
    """``mod`` with the functions of ``changed`` (GlobalVar -> function) replaced."""
    if not changed:
        return mod
    functions = {gv: changed.get(gv, func) for gv, func in mod.functions_items()}
    return tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)


@tvm.transform.module_pass(opt_level=0, name="KeepHostKernelsApart")
class KeepHostKernelsApart:
    """Kernels that LegalizeOps made for another target than the build's (host ops that
    PlaceShapeOnHost put on the llvm VDevice of a CUDA build carry ``target = llvm``) are marked
    opaque, so FuseOps leaves them alone: TVM 0.27's FuseOps fuses them with their neighbours
    into a function without that target, which the GPU scheduler then gives thread bindings."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        current = Target.current(allow_none=True)
        if current is None:
            return mod
        changed = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is None:
                continue
            own = func.attrs.get("target")
            if own is not None and own.kind.name != current.kind.name:
                changed[gv] = func.with_attr("op_pattern", 8)  # kOpaque
        return _replace_functions(mod, changed)


@tvm.transform.module_pass(opt_level=0, name="KeepScalarKernelsApart")
class KeepScalarKernelsApart:
    """Kernels that read no tensor, only scalar parameters (``shape_to_tensor`` of symbolic dims,
    legalised as ``f(b, n, out)``), are marked opaque, so FuseOps leaves them alone. TVM 0.27's
    FuseOps + FuseTIR fail on a group that holds one whose scalar (``b``) the group's other
    kernels do not use while they use another dim (``arange(n)``): "VarRemapGet(source) ==
    nullptr" in RenewDefs (``Gather(x, Range(0 - n, 0, 1))`` with ``n = Shape(x)[1]`` as an
    index vector, stock as well). Such a kernel writes a few integers; fusing it saves
    nothing."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        changed = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, tvm.tirx.PrimFunc):
                continue
            buffers = [p for p in func.params if isinstance(getattr(p, "ty", None), BufferType)]
            if len(buffers) == 1 and len(func.params) > 1:
                changed[gv] = func.with_attr("op_pattern", 8)  # kOpaque
        return _replace_functions(mod, changed)


def _pointer_params(func: tvm.tirx.PrimFunc) -> int:
    count = 0
    for param in func.params:
        ty = getattr(param, "ty", None)
        # a scalar parameter (a Var without BufferType) has no dtype attribute in 0.27
        dtype = str(getattr(param, "dtype", ""))
        if isinstance(ty, tvm.tirx.buffer.BufferType) or dtype == "handle":
            count += 1
    return count


@tvm.transform.module_pass(opt_level=0, name="RestrictSingleBufferKernels")
class RestrictSingleBufferKernels:
    """Give ``tirx.noalias`` to PrimFuncs with at most one buffer parameter that lack it
    (VMShapeLower's ``shape_func``, whose one buffer is the shape heap), so that every PrimFunc
    of the module is declared restricted.

    Works around an LLVM codegen bug in TVM 0.27 (src/target/llvm/codegen_llvm.cc, to be fixed
    there): ``is_restricted_`` is set in ``DeclareFunctionInternal``, which declares every
    function up front and returns early when ``AddFunctionInternal`` asks again. Each function is
    therefore compiled with the ``noalias`` setting of the *last declared* one. When that is
    ``shape_func``, no kernel of the module gets ``noalias`` pointers nor per-buffer TBAA, and
    LLVM stores the GEMM accumulators to memory on every step of ``k`` (measured: the symbolic
    ``(batch, seq, 256) @ (256, 2048)`` kernel 9.1 ms in the module vs 6.0 ms alone; the corpus'
    LSTM/GRU/SwiGLU builds had 0 of 2-3 kernels restricted). A function with one buffer cannot
    alias itself, so the attribute is always true for it; functions with several buffers are
    left as they are (all that TVM's legalisation makes already carry it)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        changed = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, tvm.tirx.PrimFunc):
                continue
            if func.attrs is not None and func.attrs.get("tirx.noalias") is not None:
                continue
            if _pointer_params(func) <= 1:
                changed[gv] = func.with_attr("tirx.noalias", True)
            else:
                logger.debug("%s: several buffers and no tirx.noalias; left as is", gv.name_hint)
        return _replace_functions(mod, changed)


@tvm.transform.module_pass(opt_level=0, name="LowerCallTIRWithGrad")
class LowerCallTIRWithGrad:
    """``call_tir_with_grad`` (FuseCrossEntropy's kernel, differentiable until ``Gradient``
    has run) becomes a plain ``call_tir``, which FuseOps and the VM understand. Stock does this
    inside ``Gradient`` only, so a forward-only module would not build."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        op = tvm.ir.Op.get("relax.call_tir_with_grad")
        call_tir = tvm.ir.Op.get("relax.call_tir")

        @relax.expr_functor.mutator
        class _Lower(relax.PyExprMutator):
            def visit_call_(self, call):
                call = super().visit_call_(call)
                if isinstance(call, relax.Call) and call.op.same_as(op):
                    return relax.Call(call_tir, call.args, None, call.ty_args)
                return call

        def has_op(func) -> bool:
            found = []

            def visit(expr):
                if isinstance(expr, relax.Call) and expr.op.same_as(op):
                    found.append(expr)

            relax.analysis.post_order_visit(func.body, visit)
            return bool(found)

        lower = _Lower(mod)
        changed = False
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function) and has_op(func):
                lower.builder_.update_func(gv, lower.visit_expr(func))
                changed = True
        return lower.builder_.get() if changed else mod


def fuse_tir_passes() -> list[tvm.transform.Pass]:
    """End of Phase 3: one PrimFunc per fused group."""
    return [relax.transform.FuseTIR()]


def schedule_passes(target: Target, tuning_db: str | None = None) -> list[tvm.transform.Pass]:
    """Phase 4: tuned schedules from ``tuning_db`` first, then our rules and dlight's."""
    from ..schedule import default_schedule_pass, finish_passes, prepare_passes

    passes = [*prepare_passes()]
    if tuning_db:
        passes.append(apply_database_pass(tuning_db))
    passes.append(default_schedule_pass(target))
    passes += finish_passes()
    if _target.is_gpu(target):
        from ..schedule.cuda.bool_vectors import ScalarBoolAccess

        passes.append(ScalarBoolAccess())  # TVM's CUDA codegen loads bool vectors wrongly
    return passes


def serial_passes(target: Target, serial_small_kernels: bool = True) -> list:
    """On CPU, after the stock dataflow lowering (whose RewriteDataflowReshape must still see
    the reshape kernels as scheduled, to make them views): ``PrefetchPanels`` (the Matmul
    rule's prefetches of B's next panel), then ``SerialSmallKernels``, kernels
    with little work per parallel launch run serially, chosen at run time where extents are
    symbolic."""
    if not _target.is_cpu(target):
        return []
    from ..schedule.cpu.prefetch import PrefetchPanels
    from ..schedule.serial_small_kernels import SerialSmallKernels

    # the Matmul rule's marks become prefetches (and leave the loops) in every CPU build
    return [PrefetchPanels(), *([SerialSmallKernels()] if serial_small_kernels else [])]


def _serial_flags(flags: dict) -> dict:
    return {flag: flags[flag] for flag in SCHEDULE_FLAGS if flag in flags}


def _backend(target: Target):
    """Stock TVM's per-target pass lists (``relax.pipeline``'s dispatch misses the CPU ones)."""
    if target.kind.name == "cuda":
        from tvm.relax.backend.cuda import pipeline as backend
    elif _target.is_cpu(target):
        from tvm.relax.backend.cpu_generic import pipeline as backend
    elif _target.is_gpu(target):
        from tvm.relax.backend.gpu_generic import pipeline as backend
    else:
        raise UsageError(f"target kind {target.kind.name!r} is not supported by tvm_fusion")
    return backend


_WARNED_MCPU: set[str] = set()


def _warn_generic_cpu(target: Target) -> None:
    if _target.is_cpu(target) and not _target.has_mcpu(target):
        key = str(target)
        if key not in _WARNED_MCPU:
            _WARNED_MCPU.add(key)
            logger.warning(
                "target %s names no mcpu: LLVM emits baseline code (128-bit vectors); use "
                "tvm_fusion.host_target() or add 'mcpu' for this machine's SIMD width",
                key,
            )


@tvm.transform.module_pass(opt_level=0, name="DumpIR")
class DumpIR:
    """Write the module to ``dump_dir/NN_<phase>.py`` (TVMScript) between phases."""

    def __init__(self, dump_dir: str | os.PathLike, index: int, phase: str):
        self.path = Path(dump_dir) / f"{index:02d}_{phase}.py"

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(mod.script(show_meta=False))
        return mod


def dispatch_passes(target: Target) -> list:
    """Phase 0: stock's library dispatch, the GPU topk kernels it makes tagged with what they
    compute (MarkDispatchedTopK: FuseGatheredGates reads their indices' range)."""
    return [MarkDispatchedTopK(_backend(target).library_dispatch_passes(target))]


def fused_passes(target: Target, fast_math: bool = True, dump=None, **flags: bool) -> list:
    """Phases 0-3: everything before scheduling, ending with one unscheduled PrimFunc per fused
    group (what the tune command extracts its tasks from). ``target``: a parsed Target."""
    _check_flags(flags)

    def nothing(_index, _phase):
        return _EMPTY

    dump = dump or nothing
    return [
        # Phase 0: library dispatch
        *dispatch_passes(target),
        # Phase 1: graph rewrites on Relax ops
        *_graph_passes(target, flags),
        dump(1, "graph_rewrites"),
        # Phase 2: legalisation and grouping
        *lowering_passes(fast_math and _target.is_cpu(target)),
        dump(2, "grouped"),
        # Phase 3: rewrites of the grouped program, then one PrimFunc per group
        *_build(POST_FUSION_PASSES, target, flags),
        *fuse_tir_passes(),
        dump(3, "fused"),
    ]


def build_pipeline(
    target: Target | str | dict | None = None,
    *,
    schedule: bool = True,
    fast_math: bool = True,
    tuning_db: str | None = None,
    dump_dir: str | os.PathLike | None = None,
    **flags: bool,
) -> tvm.transform.Pass:
    """The whole ``tvm_fusion`` pipeline as one pass.

    Parameters
    ----------
    target: where to compile for (a Target, or what :func:`~tvm_fusion.target.parse_target`
        takes, parsed here); default: ``Target.current()`` when the pass runs, else the host.
    schedule: apply default schedules (Phase 4). Off gives unscheduled TIR, for inspection.
    fast_math: on CPU, legalise exp/erf/tanh-based ops with polynomial approximations
        (relative error <= 4e-7 on float32; see :mod:`tvm_fusion.lower.legalize`).
    tuning_db: a MetaSchedule work dir whose database is applied before the default schedules.
    dump_dir: write the module after every phase there.
    flags: switch off single passes by their snake_case name, e.g. ``fuse_split_gates=False``.
    """
    _check_flags(flags)
    given = None if target is None else _target.resolve_target(target)

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        tgt = given if given is not None else _target.resolve_target(None)
        _warn_generic_cpu(tgt)

        def dump(index: int, phase: str):
            return DumpIR(dump_dir, index, phase) if dump_dir else _EMPTY

        with tgt:
            seq = tvm.transform.Sequential(
                [
                    dump(0, "input"),
                    *fused_passes(tgt, fast_math, dump, **flags),
                    # Phase 4: schedules
                    *(schedule_passes(tgt, tuning_db) if schedule else []),
                    dump(4, "scheduled"),
                    # Phase 5: stock finalisation
                    *_backend(tgt).dataflow_lower_passes(tgt),
                    *(serial_passes(tgt, **_serial_flags(flags)) if schedule else []),
                    *_backend(tgt).finalize_passes(tgt),
                    RestrictSingleBufferKernels(),
                    dump(5, "final"),
                ],
                name="tvm_fusion_phases",
            )
            return seq(mod)

    return _pipeline


def stock_fused_passes(target: Target) -> list:
    """Stock's passes up to one unscheduled PrimFunc per fused group (library dispatch,
    legalisation, FuseOps, FuseTIR): what ``tune --pipeline stock`` tunes and what the stock
    pipeline with a tuning database applies it to, so that both see the same PrimFuncs."""
    backend = _backend(target)
    return [*backend.library_dispatch_passes(target), *backend.legalize_passes(target)]


def stock_pipeline(target: Target, tuning_db: str | None = None) -> tvm.transform.Pass:
    """Stock TVM's fusing pipeline for ``target`` (what we compare against).

    With ``tuning_db`` (a work dir of ``tvm-fusion tune --pipeline stock``): stock's grouping,
    then the tuned schedules, the way stock's ``static_shape_tuning`` pipeline applies them.
    """
    if not tuning_db:
        return relax.get_default_pipeline(target)
    from ..schedule import finish_passes, prepare_passes

    backend = _backend(target)
    seq = tvm.transform.Sequential(
        [
            *stock_fused_passes(target),
            *prepare_passes(),
            apply_database_pass(tuning_db),
            *finish_passes(),
            *backend.dataflow_lower_passes(target),
            *backend.finalize_passes(target),
        ]
    )

    @tvm.transform.module_pass(opt_level=0, name="stock_tuned")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return seq(mod)

    return _pipeline


def register() -> None:
    """Register ``tvm_fusion`` with ``relax.get_pipeline`` (idempotent)."""
    if PIPELINE_NAME not in PIPELINE_MAP:
        register_pipeline(PIPELINE_NAME)(build_pipeline)
