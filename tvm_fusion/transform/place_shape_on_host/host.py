"""PlaceShapeOnHost, host placement: the run-time reads of shape values, and where they live.

Shape tensors that are graph inputs (short int inputs used only where shapes are consumed) are
read once at the top of the function into fresh dims and, on GPU targets, declared host tensors
(their struct info gets the host VDevice). Values computed from data are read once, right before
the rewrite that needs them; on GPU targets the reductions, casts and reshapes of 1-D int tensors
between the data and the read run on the host VDevice after one ``to_vdevice`` copy. The
module's ``vdevice`` global info lists the device first and the host after it.
"""

from __future__ import annotations

import tvm
from tvm import IRModule, relax, tirx

from .._common import get_logger, op_name, skip
from .evaluate import _INT, _MAX_ELEMS, _is_to_shape

logger = get_logger(__package__)  # the pass's one logger, as before the split
# ops that may run on the host VDevice between a copied 1-D int tensor and a shape read
_HOST_OPS = (
    "relax.max",
    "relax.min",
    "relax.sum",
    "relax.prod",
    "relax.argmax",
    "relax.argmin",
    "relax.astype",
    "relax.reshape",
    "relax.squeeze",
    "relax.expand_dims",
)


def _is_gpu(target) -> bool:
    return target is not None and "gpu" in target.keys


def _host_vdevice(target) -> relax.VDevice | None:
    host = target.host if target is not None and target.host is not None else None
    if host is None:
        host = tvm.target.Target("llvm")
    return relax.VDevice(host, 0, "global")


def _same_vdevice(a: relax.VDevice, b: relax.VDevice) -> bool:
    return (
        str(a.target) == str(b.target)
        and int(a.vdevice_id) == int(b.vdevice_id)
        and str(a.memory_scope) == str(b.memory_scope)
    )


def _declare_vdevices(mod: IRModule, target, host: relax.VDevice) -> None:
    """List the host VDevice in the module's ``vdevice`` global info (the VM's device index of
    each allocation comes from it); the target's own device first when the list is new."""
    known = list(mod.global_infos["vdevice"]) if "vdevice" in mod.global_infos else []
    if not known:
        known = [relax.VDevice(target, 0, "global")]
    if not any(_same_vdevice(v, host) for v in known):
        known.append(host)
    mod.update_global_info("vdevice", known)


def _uses(func: relax.Function) -> dict:
    """var -> the values (call expressions) of the bindings that use it; None: returned."""
    uses: dict = {}

    def add(var, value):
        uses.setdefault(var, []).append(value)

    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value

            def visit(expr, value=value):
                if isinstance(expr, relax.Var):
                    add(expr, value)

            relax.analysis.post_order_visit(value, visit)

    def visit_ret(expr):
        if isinstance(expr, relax.Var):
            add(expr, None)

    relax.analysis.post_order_visit(func.body.body, visit_ret)
    return uses


class _HostReads:
    """The host reads of :class:`.rewrite._Rewriter` (a mixin: the rewriter provides
    ``builder_``, ``visit_expr``, ``target``, ``var2val``, ``eval``, ``unread``, ``emitted`` and
    ``host_vdevice``)."""

    def _inputs_on_host(self, func: relax.Function, params: list, name: str) -> relax.Function:
        """Declare shape inputs that are now only read by ``tensor_to_shape`` host tensors."""
        uses = _uses(func)
        host = {}
        for param in params:
            users = uses.get(param, [])
            if all(_is_to_shape(value) for value in users):
                sinfo = param.ty
                host[param] = relax.Var(
                    param.name,
                    relax.TensorType(sinfo.shape, sinfo.dtype, self._host()),
                )
            else:
                skip(logger, f"{name}: input {param.name}", "still used by a kernel")
        if not host:
            return func
        new_params = [host.get(p, p) for p in func.params]
        bound = func.bind_params(dict(host))
        return relax.Function(
            new_params, bound.body, func.ret_ty, func.is_pure, func.attrs, func.span
        )

    def _shape_inputs(self, func, name) -> dict:
        """Graph inputs that are short int tensors used only where shapes are consumed."""
        inputs: dict = {}
        uses = _uses(func)
        for param in func.params:
            sinfo = param.ty
            if not isinstance(sinfo, relax.TensorType) or sinfo.dtype not in _INT:
                continue
            if sinfo.ndim != 1 or not isinstance(sinfo.shape, relax.ShapeExpr):
                continue
            length = sinfo.shape.values[0]
            if not isinstance(length, tirx.IntImm) or int(length.value) > _MAX_ELEMS:
                continue
            if not self._only_shape_uses(param, uses, set()):
                skip(logger, f"{name}: input {param.name}", "also used as data")
                continue
            inputs[param] = [
                tirx.Var(f"{param.name}_{k}", "int64") for k in range(int(length.value))
            ]
        return inputs

    def _only_shape_uses(self, var, uses, seen) -> bool:
        """Every use of ``var`` is a shape consumer or int arithmetic that only feeds them."""
        if var in seen:
            return True
        seen.add(var)
        for value in uses.get(var, []):
            if value is None:  # returned from the function
                return False
            name = op_name(value)
            if _is_to_shape(value):
                continue
            if name == "relax.dynamic_strided_slice" and not value.args[0].same_as(var):
                continue
            user = self._bound_var(value)
            sinfo = getattr(user, "ty", None)
            if user is None or not isinstance(sinfo, relax.TensorType):
                return False
            if sinfo.dtype not in (*_INT, "bool") or not self._only_shape_uses(user, uses, seen):
                return False
        return True

    def _bound_var(self, value):
        if not hasattr(self, "_var_of"):
            self._var_of = {bound: var for var, bound in self.var2val.items()}
        return self._var_of.get(value)

    def _read_inputs(self, exprs=()) -> None:
        """Emit the one host read of every shape input (before the first rewrite uses its dims),
        and of the data-dependent values that ``exprs`` (the rewrite's elements) read."""
        inputs, self.unread = self.unread, {}
        for param, dims in inputs.items():
            self._emit_read(param, dims)
        used: set = set()
        for expr in exprs:
            used.update(tirx.analysis.undefined_vars(expr))
        for var, dims in self.eval.reads.items():
            if var in self.emitted or not any(d in used for d in dims):
                continue
            self.emitted.add(var)
            value = self._host_value(var) if _is_gpu(self.target) else self.visit_expr(var)
            if value.ty.ndim == 0:
                value = self.builder_.emit(relax.op.reshape(value, [1]))
            if value.ty.dtype != "int64":
                value = self.builder_.emit(relax.op.astype(value, "int64"))
            self._emit_read(value, dims)

    def _emit_read(self, tensor, dims: list) -> None:
        """Read a 1-D int64 tensor's values into the fresh dims ``dims``."""
        shape = self.builder_.emit(relax.op.tensor_to_shape(tensor))
        self.builder_.match_cast(shape, relax.ShapeType(dims))

    def _host_value(self, var, depth: int = 0) -> relax.Expr:
        """``var``'s value on the host VDevice (part b, GPU targets): the ops that produce it
        from 1-D int tensors (reductions, casts, reshapes: ``max(sum(mask, axis=1))``) run on
        the host after one copy of their input; a larger input (the mask) is data and stays."""
        value = self.var2val.get(var)
        name = op_name(value)
        if name in _HOST_OPS and depth < 8:
            source = value.args[0]
            sinfo = getattr(source, "ty", None)
            rest = value.args[1:]
            if (
                isinstance(source, relax.Var)
                and isinstance(sinfo, relax.TensorType)
                and sinfo.dtype in (*_INT, "bool")
                and sinfo.ndim in (0, 1)
                and not any(isinstance(getattr(a, "ty", None), relax.TensorType) for a in rest)
            ):
                host = self._host_value(source, depth + 1)
                return self.builder_.emit(
                    relax.Call(value.op, [host, *rest], value.attrs, value.ty_args)
                )
        return self.builder_.emit(relax.op.to_vdevice(self.visit_expr(var), self._host()))

    def _host(self) -> relax.VDevice:
        if self.host_vdevice is None:
            self.host_vdevice = _host_vdevice(self.target)
        return self.host_vdevice
