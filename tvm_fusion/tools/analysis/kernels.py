"""Kernels of a module at every stage of the pipeline, and the views between them.

``kernel_count(mod)`` works at every stage: before fusion it counts ops that will become
kernels, after FuseOps it counts fused groups, after FuseTIR and VM lowering it counts PrimFunc
and extern calls. Views (``R.reshape`` lowered to ``vm.builtin.reshape``), shape arithmetic and
allocations are not kernels. :func:`kernels` lists the launch sites with the ops of each group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import tvm
from tvm import relax, tirx

from ...tir_util import block_names

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


KERNEL_CALL_OPS = {"relax.call_tir", "relax.call_tir_inplace", "relax.call_dps_packed"}


@dataclasses.dataclass
class Kernel:
    """One kernel launch site in a host-side Relax function."""

    name: str
    ops: list[str]
    func: str  # the Relax function that launches it
    shapes: list[str] = dataclasses.field(default_factory=list)  # its tensor arguments' shapes

    def label(self) -> str:
        return f"{self.name}[{', '.join(self.ops)}]" if self.ops else self.name


def _arg_shapes(args) -> list[str]:
    """The static or symbolic shapes of the tensor arguments of a launch (tuples flattened)."""
    shapes = []
    for arg in args:
        for a in arg.fields if isinstance(arg, relax.Tuple) else [arg]:
            ty = getattr(a, "ty", None)
            if isinstance(ty, relax.TensorType) and ty.shape is not None:
                shapes.append("x".join(str(getattr(d, "value", d)) for d in ty.shape.values))
    return shapes


def host_functions(mod: tvm.IRModule) -> Iterable[tuple[str, relax.Function]]:
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and not func.attrs.get("Primitive", False):
            yield gv.name_hint, func


def callee_ops(mod: tvm.IRModule, callee) -> list[str]:
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
                    if expr.op.name in KERNEL_CALL_OPS:
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
    for fname, func in host_functions(mod):

        def visit(expr, fname=fname):
            if not isinstance(expr, relax.Call):
                return
            op = expr.op
            if isinstance(op, tvm.ir.Op):
                if op.name in KERNEL_CALL_OPS:
                    callee = expr.args[0]
                    name = getattr(callee, "name_hint", None) or getattr(
                        callee, "global_symbol", str(callee)
                    )
                    args = _arg_shapes(expr.args[1:])
                    found.append(Kernel(name, callee_ops(mod, callee), fname, args))
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
                    args = _arg_shapes(expr.args)
                    found.append(Kernel(op.name_hint, callee_ops(mod, op), fname, args))
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
    for _, func in host_functions(mod):

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
