"""Memory of a lowered module: the tensors it allocates (:func:`allocations`) and the peak
the VM holds while a function runs (:func:`peak_bytes`), as memory planning laid them out.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax, tirx

from .kernels import host_functions


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
    for _, func in host_functions(lowered):

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
