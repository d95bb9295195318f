"""Shape work of a compiled module: device kernels that compute only shape data, and the
device-to-host copies of shape tensors (each a synchronisation on a GPU). See
:func:`shape_work`.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax, tirx

from ...target import is_cpu
from .kernels import host_functions


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
    for _name, func in host_functions(lowered):
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
