"""What a compiled (or partly compiled) module does: kernels, fused groups, rewrites, DOT.

``kernel_count(mod)`` works at every stage of the pipeline: before fusion it counts ops that will
become kernels, after FuseOps it counts fused groups, after FuseTIR and VM lowering it counts
PrimFunc and extern calls. Views (``R.reshape`` lowered to ``vm.builtin.reshape``), shape
arithmetic and allocations are not kernels.

``fusion_report(mod, target)`` lowers ``mod`` with stock TVM and with the ``tvm_fusion`` pipeline
to the grouped stage (after FuseOps and our Phase 3) and lists the groups side by side with the
rewrites each of our passes made.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable

import tvm
from tvm import relax, tirx

from ...target import is_cpu
from ...tir_util import block_names
from ...tir_util import loops as tir_loops

# Relax ops that never launch a kernel: views, shape computations, tuples, allocations.
_NON_KERNEL_OPS = {
    "relax.reshape",
    "relax.shape_of",
    "relax.tensor_to_shape",
    "relax.shape_to_tensor",
    "relax.match_cast",
    "relax.null_value",
    "relax.hint_on_device",
    "relax.to_vdevice",
    "relax.call_pure_packed",
    "relax.call_packed",
    "relax.call_builtin_with_ctx",
    "relax.builtin.alloc_tensor",
    "relax.memory.alloc_storage",
    "relax.memory.alloc_tensor",
    "relax.memory.kill_storage",
    "relax.memory.kill_tensor",
    "relax.vm.alloc_storage",
    "relax.vm.alloc_tensor",
    "relax.vm.kill_object",
    "relax.print",
    "relax.assert_op",
    "relax.grad.no_grad",
    "relax.grad.start_checkpoint",
    "relax.grad.end_checkpoint",
    "relax.ensure_zero_offset",
    "relax.memory.view",
}
_KERNEL_CALL_OPS = {"relax.call_tir", "relax.call_tir_inplace", "relax.call_dps_packed"}


@dataclasses.dataclass
class Kernel:
    """One kernel launch site in a host-side Relax function."""

    name: str
    ops: list[str]
    func: str  # the Relax function that launches it

    def label(self) -> str:
        return f"{self.name}[{', '.join(self.ops)}]" if self.ops else self.name


def _host_functions(mod: tvm.IRModule) -> Iterable[tuple[str, relax.Function]]:
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and not func.attrs.get("Primitive", False):
            yield gv.name_hint, func


def _callee_ops(mod: tvm.IRModule, callee) -> list[str]:
    """Op names inside a fused group (a Primitive Relax function) or a PrimFunc."""
    if isinstance(callee, relax.GlobalVar) and callee in mod.get_global_vars():
        func = mod[callee]
    else:
        return []
    ops: list[str] = []
    if isinstance(func, relax.Function):

        def visit(expr):
            if isinstance(expr, relax.Call):
                if isinstance(expr.op, tvm.ir.Op):
                    if expr.op.name in _KERNEL_CALL_OPS:
                        target = expr.args[0]
                        ops.append(getattr(target, "name_hint", str(target)))
                    else:
                        ops.append(expr.op.name.removeprefix("relax."))

        relax.analysis.post_order_visit(func.body, visit)
    elif isinstance(func, tirx.PrimFunc):
        ops = block_names(func)
    return ops


def kernels(mod: tvm.IRModule) -> list[Kernel]:
    """Kernel launch sites in the host-side Relax functions of ``mod``, in program order."""
    found: list[Kernel] = []
    for fname, func in _host_functions(mod):

        def visit(expr, fname=fname):
            if not isinstance(expr, relax.Call):
                return
            op = expr.op
            if isinstance(op, tvm.ir.Op):
                if op.name in _KERNEL_CALL_OPS:
                    callee = expr.args[0]
                    name = getattr(callee, "name_hint", None) or getattr(
                        callee, "global_symbol", str(callee)
                    )
                    found.append(Kernel(name, _callee_ops(mod, callee), fname))
                elif op.name not in _NON_KERNEL_OPS and not op.name.startswith(
                    ("relax.memory.", "relax.vm.", "relax.builtin.")
                ):
                    # an unlowered Relax op: one kernel once legalised
                    found.append(Kernel(op.name.removeprefix("relax."), [], fname))
            elif isinstance(op, relax.GlobalVar) and op in mod.get_global_vars():
                callee = mod[op]
                is_group = isinstance(callee, relax.Function) and callee.attrs.get(
                    "Primitive", False
                )
                is_kernel = isinstance(callee, tirx.PrimFunc) and not callee.attrs.get(
                    "tirx.is_host_func", False
                )  # VMShapeLower's shape_func runs on the host: not a kernel
                if is_kernel or is_group:
                    found.append(Kernel(op.name_hint, _callee_ops(mod, op), fname))
            elif isinstance(op, relax.ExternFunc):
                if not op.global_symbol.startswith("vm.builtin."):
                    found.append(Kernel(op.global_symbol, [], fname))

        relax.analysis.post_order_visit(func.body, visit)
    return found


def kernel_count(mod: tvm.IRModule) -> int:
    """Number of kernel launch sites in ``mod`` (see module docstring for what counts)."""
    return len(kernels(mod))


def view_count(mod: tvm.IRModule) -> int:
    """Number of zero-copy views (``R.reshape``/``vm.builtin.reshape``) in host functions."""
    count = 0
    for _, func in _host_functions(mod):

        def visit(expr):
            nonlocal count
            if isinstance(expr, relax.Call):
                op = expr.op
                if isinstance(op, tvm.ir.Op) and op.name == "relax.reshape":
                    count += 1
                elif isinstance(op, relax.ExternFunc) and op.global_symbol == "vm.builtin.reshape":
                    count += 1
                elif (
                    isinstance(op, tvm.ir.Op)
                    and op.name == "relax.call_builtin_with_ctx"
                    and isinstance(expr.args[0], relax.ExternFunc)
                    and expr.args[0].global_symbol == "vm.builtin.reshape"
                ):
                    count += 1

        relax.analysis.post_order_visit(func.body, visit)
    return count


@dataclasses.dataclass
class ScheduleInfo:
    """How one device PrimFunc of a lowered module is scheduled."""

    name: str
    scheduled: bool
    parallel: bool
    vectorized: bool
    thread_bound: bool
    loops: int
    rule: str | None = None  # the schedule rule that scheduled it (None: a tuning database)


def schedule_info(mod: tvm.IRModule) -> list[ScheduleInfo]:
    """For every kernel PrimFunc (not host shape functions): parallel / vector / thread loops."""
    infos = []
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs.get("tirx.is_host_func", False):
            continue
        kinds = [loop.kind for loop in tir_loops(func)]
        infos.append(
            ScheduleInfo(
                name=gv.name_hint,
                scheduled=bool(func.attrs.get("tirx.is_scheduled", False)),
                parallel=tirx.ForKind.PARALLEL in kinds,
                vectorized=tirx.ForKind.VECTORIZED in kinds,
                thread_bound=tirx.ForKind.THREAD_BINDING in kinds,
                loops=len(kinds),
                rule=_rule_of(func),
            )
        )
    return infos


def _rule_of(func: tirx.PrimFunc) -> str | None:
    from ...schedule import RULE_ATTR

    name = func.attrs.get(RULE_ATTR, None)
    return str(name) if name is not None else None


def fallback_kernels(mod: tvm.IRModule) -> list[str]:
    """Kernels of a lowered module that only a rule of last resort scheduled (``Fallback``), or
    that no rule scheduled at all (no rule name and not marked scheduled: e.g. a non-global
    ``adaptive_avg_pool2d``, which TVM's block analysis cannot read, so every rule declines)."""
    from ...schedule import FALLBACK_RULES

    return [
        info.name
        for info in schedule_info(mod)
        if info.rule in FALLBACK_RULES or (info.rule is None and not info.scheduled)
    ]


def peak_bytes(lowered: tvm.IRModule, function: str = "main") -> int | None:
    """Peak bytes the VM holds while ``function`` of a lowered module runs: its planned
    storages (``vm.alloc_storage``) walked in program order, each freed once it and every
    tensor placed in it are killed (``vm.kill_object``), plus the largest scratch buffer one
    kernel allocates inside itself. Inputs are not counted; None when a size is symbolic.

    This is what memory planning promises, not a measurement of the process (TVM's pooled
    allocator may keep freed blocks for reuse). A function whose ``tir_var_upper_bound``
    attribute bounds its symbolic dims (what lets StaticPlanBlockMemory plan them) is measured
    at those bounds: its storages are then static, and a kernel's symbolic scratch is taken at
    the bound of each variable of that name."""
    func = lowered[function]
    sizes: dict = {}  # storage var -> bytes
    holders: dict = {}  # storage var -> live vars (itself and its tensors)
    owner: dict = {}  # tensor var -> storage var
    live = peak = 0
    for block in func.body.blocks:
        for binding in block.bindings:
            value, var = binding.value, binding.var
            name = getattr(getattr(value, "op", None), "name", None)
            if name in ("relax.vm.alloc_storage", "relax.memory.alloc_storage"):
                size = value.args[0]
                dims = size.values if isinstance(size, relax.ShapeExpr) else None
                if dims is None or not isinstance(dims[0], tirx.IntImm):
                    return None
                sizes[var] = int(dims[0].value)
                holders[var] = {var}
                live += sizes[var]
                peak = max(peak, live)
            elif name in ("relax.vm.alloc_tensor", "relax.memory.alloc_tensor"):
                storage = value.args[0]
                if storage in holders:
                    owner[var] = storage
                    holders[storage].add(var)
            elif name == "relax.vm.kill_object" and isinstance(value.args[0], relax.Var):
                dead = value.args[0]
                storage = dead if dead in holders else owner.get(dead)
                if storage is not None and dead in holders[storage]:
                    holders[storage].discard(dead)
                    if not holders[storage]:
                        live -= sizes[storage]
    bounds = func.attrs.get("tir_var_upper_bound", None) if func.attrs else None
    bounds = {str(k): int(v) for k, v in (bounds or {}).items()}
    scratch = 0
    for alloc in allocations(lowered, exprs=True):
        if alloc.where != "relax":
            elements = alloc.elements
            if elements is None:
                elements = _bounded(alloc.shape, bounds)
            if elements is None:
                return None
            scratch = max(scratch, elements * tvm.runtime.DataType(alloc.dtype).bits // 8)
    return peak + scratch


def _bounded(shape, bounds: dict[str, int]) -> int | None:
    """Elements of a symbolic ``shape`` (PrimExprs) with each variable at most its bound, or
    None when a variable has none."""
    analyzer = tvm.sym.Analyzer()
    total = 1
    for dim in shape:
        for var in tirx.analysis.undefined_vars(dim):
            if var.name not in bounds:
                return None
            analyzer.bind(var, tvm.ir.Range(0, bounds[var.name] + 1))
        high = analyzer.const_int_bound(dim).max_value
        if high >= 1 << 62:
            return None
        total *= int(high)
    return total


@dataclasses.dataclass
class Allocation:
    """A buffer the compiled program allocates: a planned Relax tensor or a kernel's scratch."""

    where: str  # "relax" (VM tensor, after memory planning) or the kernel's name
    name: str
    shape: tuple
    dtype: str
    elements: int | None  # None when symbolic


def allocations(lowered: tvm.IRModule, exprs: bool = False) -> list[Allocation]:
    """Every tensor a lowered module (the output of the whole pipeline) allocates: the VM's
    ``alloc_tensor`` calls after StaticPlanBlockMemory and each kernel's internal buffers at
    the size TVM compacts them to. Inputs are not allocations. ``exprs``: kernel buffers'
    shapes as PrimExprs instead of strings."""
    from ...tir_util import compacted_allocations, num_elements

    found: list[Allocation] = []
    alloc_ops = {"relax.vm.alloc_tensor", "relax.memory.alloc_tensor", "relax.builtin.alloc_tensor"}
    for _, func in _host_functions(lowered):

        def visit(expr):
            if isinstance(expr, relax.Call) and getattr(expr.op, "name", None) in alloc_ops:
                sinfo = expr.ty
                if isinstance(sinfo, relax.TensorType) and isinstance(sinfo.shape, relax.ShapeExpr):
                    dims = tuple(sinfo.shape.values)
                    total = 1
                    for d in dims:
                        total = total * int(d.value) if isinstance(d, tirx.IntImm) else None
                        if total is None:
                            break
                    found.append(
                        Allocation(
                            "relax", "tensor", tuple(str(d) for d in dims), str(sinfo.dtype), total
                        )
                    )

        relax.analysis.post_order_visit(func.body, visit)
    for gv, func in lowered.functions_items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs.get("tirx.is_host_func", False):
            continue
        for buf in compacted_allocations(func):
            found.append(
                Allocation(
                    gv.name_hint,
                    buf.name,
                    tuple(buf.shape) if exprs else tuple(str(d) for d in buf.shape),
                    str(buf.dtype),
                    num_elements(buf),
                )
            )
    return found


# ---------------------------------------------------------------------------------------------
# Fusion report


@dataclasses.dataclass
class FusionReport:
    name: str
    target: str
    stock: list[Kernel]
    ours: list[Kernel]
    rewrites: dict[str, int]
    stock_views: int = 0
    ours_views: int = 0
    # our kernels once scheduled: PrimFunc name -> the rule that scheduled it
    rules: dict[str, str | None] = dataclasses.field(default_factory=dict)
    # how stock's side was lowered when not from the module as given ("" when it was)
    stock_note: str = ""

    @property
    def fallback(self) -> list[str]:
        from ...schedule import FALLBACK_RULES

        return [name for name, rule in self.rules.items() if rule in FALLBACK_RULES]

    @property
    def stock_kernels(self) -> int:
        return len(self.stock)

    @property
    def ours_kernels(self) -> int:
        return len(self.ours)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "target": self.target,
            "kernels": {"stock": self.stock_kernels, "tvm_fusion": self.ours_kernels},
            "views": {"stock": self.stock_views, "tvm_fusion": self.ours_views},
            "rewrites": dict(self.rewrites),
            "groups": {
                "stock": [k.label() for k in self.stock],
                "tvm_fusion": [k.label() for k in self.ours],
            },
            "schedule_rules": dict(self.rules),
            "stock_note": self.stock_note,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_text(self) -> str:
        lines = [
            f"fusion report: {self.name} on {self.target}",
            f"  kernels: stock {self.stock_kernels}, tvm_fusion {self.ours_kernels}"
            f"  (zero-copy views: stock {self.stock_views}, tvm_fusion {self.ours_views})",
            "  rewrites: "
            + (
                ", ".join(f"{k} x{v}" for k, v in sorted(self.rewrites.items()))
                if self.rewrites
                else "none"
            ),
            *([f"  stock: {self.stock_note}"] if self.stock_note else []),
            "  stock groups:",
            *[f"    {i}. {k.label()}" for i, k in enumerate(self.stock, 1)],
            "  tvm_fusion groups:",
            *[f"    {i}. {k.label()}" for i, k in enumerate(self.ours, 1)],
        ]
        if self.rules:
            lines.append("  tvm_fusion kernels, scheduled by:")
            lines += [
                f"    {name}: {rule or 'a tuning record'}" for name, rule in self.rules.items()
            ]
            if self.fallback:
                lines.append(
                    f"  warning: {len(self.fallback)} kernel(s) left to the fallback rule: "
                    + ", ".join(self.fallback)
                )
        return "\n".join(lines)


def grouped(mod: tvm.IRModule, target, ours: bool, **flags) -> tvm.IRModule:
    """Lower ``mod`` to the grouped stage: Phases 0-2 (and our 1 and 3 when ``ours``)."""
    from ...build import pipeline
    from ...target import parse_target

    tgt = parse_target(target)
    with tgt:
        passes = [*pipeline._backend(tgt).library_dispatch_passes(tgt)]
        if ours:
            passes += pipeline.fusion_passes(tgt, **flags)
        passes += pipeline.lowering_passes()
        if ours:
            passes += pipeline.post_fusion_passes(tgt, **flags)
        return tvm.transform.Sequential(passes)(mod)


def fusion_report(mod: tvm.IRModule, target=None, name: str = "model", **flags) -> FusionReport:
    """Groups of stock TVM and of ``tvm_fusion`` side by side, with our rewrite counts."""
    from ...build.pipeline import build_pipeline
    from ...target import parse_target
    from ...transform import collect_rewrites

    tgt = parse_target(target)
    tuning_db = flags.pop("tuning_db", None)  # schedules only: the groups do not depend on it
    stock_mod, note = _stock_grouped(mod, tgt)
    with collect_rewrites() as counts:
        ours_mod = grouped(mod, tgt, ours=True, **flags)
    with tgt:
        scheduled = build_pipeline(tgt, tuning_db=tuning_db, **flags)(mod)
    return FusionReport(
        name=name,
        target=str(tgt.kind.name),
        stock=kernels(stock_mod),
        ours=kernels(ours_mod),
        rewrites=dict(counts),
        stock_views=view_count(stock_mod),
        ours_views=view_count(ours_mod),
        rules={info.name: info.rule for info in schedule_info(scheduled)},
        stock_note=note,
    )


def _stock_grouped(mod: tvm.IRModule, tgt) -> tuple[tvm.IRModule, str]:
    """Stock's groups of ``mod``; where stock cannot lower the importer's output (a tensor
    whose shape the importer lost: "te.compute ... 'NoneType' object is not iterable" for a
    static-shape import of DistilBERT), stock's groups of it after our PlaceShapeOnHost, as
    the model benchmark's stock-pipeline engine does; an empty module when that fails too."""
    from ...build.pipeline import fusion_passes

    try:
        return grouped(mod, tgt, ours=False), ""
    except Exception as err:  # noqa: BLE001 - the report covers ours whatever stock does
        reason = str(err).strip().splitlines()[-1][:160] if str(err).strip() else repr(err)
    try:
        with tgt:
            shapes = [p for p in fusion_passes(tgt) if p.info.name == "PlaceShapeOnHost"]
            placed = tvm.transform.Sequential(shapes)(mod)
        return grouped(placed, tgt, ours=False), (
            f"stock cannot lower this import ({reason}); its groups after PlaceShapeOnHost"
        )
    except Exception:  # noqa: BLE001
        return tvm.IRModule(), f"stock cannot lower this import ({reason})"


def to_dot(mod: tvm.IRModule, title: str = "tvm_fusion") -> str:
    """The dataflow of ``main`` as Graphviz DOT: kernels as boxes, views as dashed nodes."""
    func = mod["main"]
    lines = [f'digraph "{title}" {{', "  rankdir=TB;", '  node [fontname="monospace"];']
    names: dict[relax.Var, str] = {}

    def node_id(var: relax.Var) -> str:
        if var not in names:
            names[var] = f"n{len(names)}"
        return names[var]

    for param in func.params:
        lines.append(f'  {node_id(param)} [label="{param.name}", shape=ellipse];')

    def used_vars(expr) -> list[relax.Var]:
        seen: list[relax.Var] = []

        def visit(e):
            if isinstance(e, relax.Var) and e in names and e not in seen:
                seen.append(e)

        relax.analysis.post_order_visit(expr, visit)
        return seen

    def binding_label(value) -> tuple[str, str]:
        if isinstance(value, relax.Call):
            op = value.op
            if isinstance(op, tvm.ir.Op):
                if op.name in _KERNEL_CALL_OPS:
                    callee = value.args[0]
                    name = getattr(callee, "name_hint", str(callee))
                    ops = _callee_ops(mod, callee)
                    return f"{name}\\n{' '.join(ops[:6])}", "box"
                if op.name == "relax.reshape":
                    return "reshape (view)", "box, style=dashed"
                return op.name.removeprefix("relax."), "box"
            if isinstance(op, relax.GlobalVar):
                ops = _callee_ops(mod, op)
                return f"{op.name_hint}\\n{' '.join(ops[:6])}", "box, style=bold"
        if isinstance(value, relax.TupleGetItem):
            return f"[{value.index}]", "point"
        return type(value).__name__, "plaintext"

    for block in func.body.blocks:
        for binding in block.bindings:
            label, shape = binding_label(binding.value)
            nid = node_id(binding.var)
            lines.append(f'  {nid} [label="{label}", shape={shape}];')
            for src in used_vars(binding.value):
                if src is not binding.var:
                    lines.append(f"  {names[src]} -> {nid};")
    lines.append("}")
    return "\n".join(lines) + "\n"


@dataclasses.dataclass
class ShapeWork:
    """What a compiled module spends on shape arithmetic held in tensors (see
    :func:`shape_work`)."""

    kernels: list[str]  # kernel launches whose outputs are only ever shape data
    copies: int  # device-to-host reads of shape tensors (tensor_to_shape of a device tensor)

    def as_dict(self) -> dict:
        return {"shape_kernels": len(self.kernels), "shape_copies": self.copies}


_ALLOC_OPS = {"relax.vm.alloc_tensor", "relax.builtin.alloc_tensor", "relax.memory.alloc_tensor"}
_TO_SHAPE = {"vm.builtin.tensor_to_shape"}


def _is_shape_data(sinfo) -> bool:
    return (
        isinstance(sinfo, relax.TensorType)
        and 0 <= sinfo.ndim <= 1
        and (str(sinfo.dtype).startswith(("int", "uint")) or str(sinfo.dtype) == "bool")
    )


def _on_host(sinfo) -> bool:
    vdevice = getattr(sinfo, "vdevice", None)
    return vdevice is not None and is_cpu(vdevice.target)


def shape_work(lowered: tvm.IRModule, target=None) -> ShapeWork:
    """Shape-only device kernels and device-to-host shape copies in a compiled module (the
    ``lowered`` of :func:`tvm_fusion.build.engine.compile_module`, after VM lowering).

    A kernel is shape-only when every tensor it writes is a short int/bool tensor (rank <= 1)
    read only as shape data: by ``tensor_to_shape``, by a copy to the host, as the bounds of a
    ``dynamic_strided_slice`` kernel, or by other shape-only kernels. Kernels built for the host
    (a CUDA build's ``target = llvm`` functions) are not device kernels. On a GPU target each
    ``tensor_to_shape`` of a device tensor is a copy to the host plus a synchronisation, and so
    is each copy of shape data to the host (``to_vdevice``); on a CPU target there are no
    copies (the kernels still run).
    """
    gpu = target is not None and "gpu" in tvm.target.Target(target).keys
    vdevices = lowered.global_infos["vdevice"] if "vdevice" in lowered.global_infos else []
    host_indices = {i for i, v in enumerate(vdevices) if is_cpu(v.target)}
    found: list[str] = []
    copies = 0
    for _name, func in _host_functions(lowered):
        values: dict = {}  # binding var -> value
        users: dict = {}  # var -> binding vars whose value reads it (None: returned)
        order: list = []
        for block in func.body.blocks:
            for binding in block.bindings:
                var, value = binding.var, binding.value
                values[var] = value
                order.append(var)

                def visit(expr, owner=var, users=users):
                    if isinstance(expr, relax.Var):
                        users.setdefault(expr, []).append(owner)

                relax.analysis.post_order_visit(value, visit)

        def returned(expr, users=users):
            if isinstance(expr, relax.Var):
                users.setdefault(expr, []).append(None)

        relax.analysis.post_order_visit(func.body.body, returned)
        kernels: dict = {}  # binding var of a kernel call -> (name, output vars)
        written: set = set()
        for var in order:
            value = values[var]
            if not isinstance(value, relax.Call):
                continue
            op = value.op
            if _is_to_shape(value):
                if gpu and not _host_tensor(value.args[0], values, host_indices):
                    copies += 1
                continue
            if _is_copy_to_host(value):
                if gpu and _is_shape_data(value.args[0].ty):
                    copies += 1
                continue
            if not (isinstance(op, relax.GlobalVar) and op in lowered.get_global_vars()):
                continue
            callee = lowered[op]
            if not isinstance(callee, tirx.PrimFunc) or _is_host_kernel(callee, gpu):
                continue
            # destination-passing style: an allocation's first user is the kernel writing it
            outs = []
            for arg in value.args:
                alloc = values.get(arg) if isinstance(arg, relax.Var) else None
                if (
                    isinstance(alloc, relax.Call)
                    and isinstance(alloc.op, tvm.ir.Op)
                    and alloc.op.name in _ALLOC_OPS
                    and arg not in written
                ):
                    written.add(arg)
                    outs.append(arg)
            kernels[var] = (op.name_hint, outs)
        shape_only = {
            var
            for var, (_, outs) in kernels.items()
            if outs and all(_is_shape_data(o.ty) for o in outs)
        }
        changed = True
        while changed:
            changed = False
            for var in list(shape_only):
                for out in kernels[var][1]:
                    for user in users.get(out, []):
                        if user is not None and user.same_as(var):
                            continue
                        user_value = values.get(user) if user is not None else None
                        ok = user is not None and (
                            user in shape_only
                            or _is_to_shape(user_value)
                            or _is_copy_to_host(user_value)
                            or _is_slice_bound(user_value, out)
                            or _op_name(user_value) in _SHAPE_SIDE_OPS
                        )
                        if not ok:
                            shape_only.discard(var)
                            changed = True
                            break
                    if var not in shape_only:
                        break
        found += [kernels[var][0] for var in order if var in shape_only]
    return ShapeWork(found, copies)


_SHAPE_SIDE_OPS = {
    "relax.vm.kill_object",
    "relax.memory.kill_tensor",
    "vm.builtin.check_tensor_info",
    "vm.builtin.match_shape",
}


def _is_host_kernel(func: tirx.PrimFunc, gpu: bool) -> bool:
    attrs = func.attrs
    if attrs is None:
        return False
    if attrs.get("tirx.is_host_func"):
        return True
    own = attrs.get("target")
    return gpu and own is not None and is_cpu(own)


def _is_copy_to_host(value) -> bool:
    """``to_vdevice`` to a CPU device (``vm.builtin.to_device(x, kDLCPU, ...)`` once lowered)."""
    if _op_name(value) == "relax.to_vdevice":
        return is_cpu(value.attrs.dst_vdevice.target)
    if _op_name(value) == "vm.builtin.to_device":
        kind = value.args[1]
        return isinstance(kind, tirx.IntImm) and int(kind.value) == 1
    return False


def _host_tensor(var, values: dict, host_indices: set) -> bool:
    """Whether ``var`` lives on the host: declared so, copied there, or allocated on a host
    VDevice (lowering drops the VDevice from an allocation's struct info, not its index)."""
    if _on_host(var.ty):
        return True
    value = values.get(var)
    if _is_copy_to_host(value):
        return True
    if _op_name(value) in _ALLOC_OPS and len(value.args) >= 5:
        index = value.args[4]
        return isinstance(index, tirx.IntImm) and int(index.value) in host_indices
    return False


def _is_slice_bound(value, tensor) -> bool:
    """``tensor`` is a begin/end/strides operand of a ``dynamic_strided_slice`` kernel."""
    if not isinstance(value, relax.Call) or not isinstance(value.op, relax.GlobalVar):
        return False
    if not value.op.name_hint.startswith("dynamic_strided_slice"):
        return False
    return any(arg.same_as(tensor) for arg in value.args[1:4])


def _op_name(value) -> str | None:
    if not isinstance(value, relax.Call):
        return None
    if isinstance(value.op, tvm.ir.Op):
        return value.op.name
    if isinstance(value.op, relax.ExternFunc):
        return value.op.global_symbol
    return None


def _is_to_shape(value) -> bool:
    return _op_name(value) in ("relax.tensor_to_shape", "vm.builtin.tensor_to_shape")
