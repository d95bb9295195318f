"""ONNX operator forms apache-tvm 0.27's importer refuses, found by ONNX's own node tests
(``onnx.backend.test.case.node``, cases ONNX Runtime passes); each converter here replaces the
stock one (``onnx_ops.OVERRIDES``) and hands every other form back to it:

- ``MaxPool`` with its second output ``Indices`` (stock: "Missing outputs during conversion"):
  one TE kernel computes the maximum and its flattened index into the input together (an
  argmax reducer: the first maximum in window order, as ONNX Runtime), ``storage_order`` 0
  (row-major) or 1 (column-major: the spatial dims counted from the last), with pads,
  dilations, ``ceil_mode`` and ``auto_pad``; padding is never chosen. One output: stock.
- ``Pow`` with an exponent of another dtype than the base, or of integers (stock: "Binary
  operators must have the same datatype", LegalizeOps: "power only applies to float"). The
  output has the base's dtype, as ONNX's reference (``np.power(a, b).astype(a.dtype)``):
  a float base: the exponent cast to it (float16 / bfloat16 computed in float32); an integer
  base with a float exponent: computed in float64, truncated to the base's dtype; integer **
  integer: exact, by repeated squaring in the base's width (wrapping as numpy does). A negative
  integer exponent is an error in numpy ("Integers to negative integer powers are not
  allowed"): here a run-time ``ValueError`` naming the node.
- ``CumSum`` with its ``axis`` given at run time (stock: "CumSum with non-constant axis input
  is not supported yet"): the rank ``r`` is known, so the sum along each of the ``r`` axes
  (stock's converter, ``exclusive`` / ``reverse`` honoured) and a ``where`` on the axis picks
  one; an axis outside ``[-r, r)`` is a run-time ``ValueError`` naming the node. This costs
  ``r`` sums instead of one. ``CumProd`` (opset 26, no stock converter): the same with Relax's
  ``cumprod``.
- ``Elu`` / ``Selu`` of float16, bfloat16 or float64 (stock: "Binary operators must have the
  same datatype": its constants are float32): the same formula with constants of the input's
  dtype. ``Celu`` (no stock converter; ONNX defines it by a function from opset 28 only):
  ``alpha * Elu(x / alpha)`` in the input's dtype.
- ``EyeLike`` with a ``dtype`` other than the input's, ``LpNormalization`` (no stock
  converter), ``RMSNormalization`` over every axis (stock failed in LegalizeOps),
  ``ReverseSequence`` (no stock converter; lengths clipped to ``[0, T]``).

The integer ``Pow`` is one TIR kernel over the flattened, broadcast operands that asserts
after its loop; CumSum's axis check is a small TIR kernel called in place on the axis (which
it only reads, as ``CheckGatherBounds``'s): nothing is copied, and the sums depend on it, so no
pass drops it. Both kernels are unscheduled host loops (no thread binding): CPU targets only,
as ``CheckGatherBounds``'s kernels; not tried on CUDA.
"""

from __future__ import annotations

from tvm import relax, te, tirx
from tvm.ir.expr import GenericConst
from tvm.relax.frontend.onnx import onnx_frontend as _frontend

from ..check_kernels import Buf, flag_kernel, indices, parse_kernel, shape_vars
from ..errors import ModelError
from .onnx_fixes import _dtype, _node


def _i64(value) -> tirx.PrimExpr:
    return tirx.IntImm("int64", value) if isinstance(value, int) else value


def checked(bb, tensor: relax.Expr, condition: str, message: str) -> relax.Expr:
    """``tensor`` passed through a kernel that fails with ``ValueError: message`` unless
    ``condition`` (TVMScript over ``v``, one element as int64) holds for every element; the
    kernel runs in place and writes nothing."""
    ty = tensor.ty
    ds = shape_vars("d", ty.ndim)
    x = Buf("x", ds, str(ty.dtype))
    let = f'v = T.Cast("int64", x[{indices(len(ds))}])'
    kernel = flag_kernel(
        "check_value", [x], ds, [f"not ({condition})"], message, "ValueError", lets=(let,)
    )
    gv = bb.add_func(kernel, "check_value")
    return bb.emit(relax.call_tir_inplace(gv, (tensor,), 0, ty))


# --- MaxPool with Indices ------------------------------------------------------------------


def _pool_pads(attr, sizes, kernel, strides, dilations, where) -> list[int]:
    spatial = len(kernel)
    auto_pad = attr.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
    if auto_pad in ("NOTSET", "VALID"):
        pads = list(attr.get("pads", [0] * 2 * spatial)) if auto_pad == "NOTSET" else []
        return pads or [0] * 2 * spatial
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        raise ModelError(f"{where}: auto_pad={auto_pad!r} is not supported")
    begins, ends = [], []
    for size, k, s, d in zip(sizes, kernel, strides, dilations, strict=True):
        if not isinstance(size, int):
            raise ModelError(f"{where}: Indices with auto_pad={auto_pad} of symbolic dims")
        out = -(-size // s)
        total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
        small, large = total // 2, total - total // 2
        begins.append(small if auto_pad == "SAME_UPPER" else large)
        ends.append(large if auto_pad == "SAME_UPPER" else small)
    return begins + ends


def _argmax_reducer(dtype: str):
    def combine(a, b):
        take = tirx.Or(b[1] > a[1], tirx.And(b[1] == a[1], b[0] < a[0]))
        return tirx.Select(take, b[0], a[0]), tirx.Select(take, b[1], a[1])

    def identity(t0, t1):
        return tirx.max_value(t0), tirx.min_value(t1)

    return te.comm_reducer(combine, identity, name="maxpool_argmax")


def _maxpool_with_indices(data, out_shape, kernel, strides, dilations, pads, column_major):
    """(values, int64 indices) of a max pool, one TE kernel."""
    spatial = len(kernel)
    shape = [_i64(d) if isinstance(d, int) else d for d in data.shape]
    sizes = [tirx.Cast("int64", d) for d in shape[2:]]
    reduce_axes = [te.reduce_axis((0, k), f"k{i}") for i, k in enumerate(kernel)]
    reducer = _argmax_reducer(str(data.dtype))

    def body(*o):
        n, c = o[0], o[1]
        pos = [
            tirx.Cast("int64", o[2 + i]) * strides[i] - pads[i] + reduce_axes[i] * dilations[i]
            for i in range(spatial)
        ]
        valid = tirx.const(True)
        for p, size in zip(pos, sizes, strict=True):
            valid = tirx.And(valid, tirx.And(p >= 0, p < size))
        clamped = [tirx.max(tirx.min(p, size - 1), 0) for p, size in zip(pos, sizes, strict=True)]
        order = list(range(spatial))
        if column_major:
            order.reverse()
        flat = tirx.Cast("int64", 0)
        for i in order:
            flat = flat * sizes[i] + pos[i]
        image = 1
        for size in sizes:
            image = image * size
        flat = (tirx.Cast("int64", n) * shape[1] + tirx.Cast("int64", c)) * image + flat
        value = data[(n, c, *clamped)]
        idx = tirx.Select(valid, flat, tirx.max_value("int64"))
        val = tirx.Select(valid, value, tirx.min_value(str(data.dtype)))
        return reducer((idx, val), axis=reduce_axes)

    idx, val = te.compute(out_shape, body, name="maxpool_argmax")
    return [val, idx]


class MaxPool(_frontend.MaxPool):
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        if attr.get("tvm_custom", {}).get("num_outputs", 1) < 2:
            return super()._impl_v1(bb, inputs, attr, params)
        where = _node("MaxPool", attr)
        data = inputs[0]
        if not isinstance(data.ty.shape, relax.ShapeExpr):
            raise ModelError(f"{where}: Indices of an input of unknown shape")
        kernel = [int(k) for k in attr["kernel_shape"]]
        spatial = len(kernel)
        strides = [int(s) for s in attr.get("strides", [1] * spatial)]
        dilations = [int(d) for d in attr.get("dilations", [1] * spatial)]
        sizes = [int(d) if isinstance(d, tirx.IntImm) else d for d in data.ty.shape.values[2:]]
        pads = [int(p) for p in _pool_pads(attr, sizes, kernel, strides, dilations, where)]
        order = int(attr.get("storage_order", 0))
        if order not in (0, 1):
            raise ModelError(f"{where}: storage_order={order} is not supported")
        values = bb.normalize(super()._impl_v1(bb, inputs, attr, params))
        out_shape = list(values.ty.shape.values)
        return bb.emit_te(
            _maxpool_with_indices, data, out_shape, kernel, strides, dilations, pads, order == 1
        )


# --- Pow ----------------------------------------------------------------------------------


def _is_int(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))


def _int_pow_kernel(bdt: str, edt: str, message: str) -> tirx.PrimFunc:
    """``z = a ** b`` over flat integer buffers: repeated squaring, one step per bit of the
    exponent, in unsigned arithmetic of the base's width (exact modulo 2**bits, as numpy; no
    signed-overflow UB); a negative exponent fails with ``ValueError: message`` after the loop."""
    bits = int(bdt.removeprefix("u").removeprefix("int"))
    ebits = int(edt.removeprefix("u").removeprefix("int"))
    wide = f"uint{bits}"
    lines = [
        "@T.prim_func(private=True, s_tir=True)",
        "def int_pow(var_a: T.handle, var_b: T.handle, var_z: T.handle):",
        '    T.func_attr({"op_pattern": 8, "tirx.noalias": True, "tirx.is_scheduled": True})',
        "    n = T.int64()",
        f"    a = T.match_buffer(var_a, (n,), {bdt!r})",
        f"    b = T.match_buffer(var_b, (n,), {edt!r})",
        f"    z = T.match_buffer(var_z, (n,), {bdt!r})",
        '    with T.sblock("root"):',
        f'        acc = T.sblock_alloc_buffer((2,), {wide!r}, scope="local")',
        '        bad = T.sblock_alloc_buffer((1,), "int64", scope="local")',
        "        bad[0] = T.int64(0)",
        "        for i in range(n):",
        f"            acc[0] = T.Cast({wide!r}, 1)",
        f"            acc[1] = T.Cast({wide!r}, a[i])",
        f"            for k in range({ebits}):",
        f"                if T.bitwise_and(T.shift_right(b[i], T.Cast({edt!r}, k)),"
        f" T.Cast({edt!r}, 1)) != T.Cast({edt!r}, 0):",
        "                    acc[0] = acc[0] * acc[1]",
        "                acc[1] = acc[1] * acc[1]",
        f"            z[i] = T.Cast({bdt!r}, acc[0])",
        f'            bad[0] = T.max(bad[0], T.Cast("int64", b[i] < T.Cast({edt!r}, 0)))',
        f'        T.Assert(bad[0] == T.int64(0), {message!r}, "ValueError")',
    ]
    return parse_kernel("\n".join(lines))


def _flat(bb, tensor, shape, count) -> relax.Expr:
    tensor = bb.normalize(relax.op.broadcast_to(tensor, relax.ShapeExpr(shape)))
    return bb.normalize(relax.op.reshape(tensor, relax.ShapeExpr([count])))


class Pow(_frontend.Pow):
    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        base, exponent = inputs
        bty, ety = getattr(base, "ty", None), getattr(exponent, "ty", None)
        if not isinstance(bty, relax.TensorType) or not isinstance(ety, relax.TensorType):
            return super()._impl_v7(bb, inputs, attr, params)
        bdt, edt = str(bty.dtype), str(ety.dtype)
        if bdt == edt and not _is_int(bdt):
            return super()._impl_v7(bb, inputs, attr, params)
        if not _is_int(bdt):
            compute = "float32" if bdt in ("float16", "bfloat16") else bdt
            out = relax.op.power(relax.op.astype(base, compute), relax.op.astype(exponent, compute))
            return out if compute == bdt else relax.op.astype(out, bdt)
        if not _is_int(edt):
            out = relax.op.power(
                relax.op.astype(base, "float64"), relax.op.astype(exponent, "float64")
            )
            return relax.op.astype(out, bdt)
        message = f"{_node('Pow', attr)}: integers to negative integer powers are not allowed"
        probe = bb.normalize(relax.op.add(base, relax.op.astype(exponent, bdt)))
        if not isinstance(probe.ty.shape, relax.ShapeExpr):
            raise ModelError(f"{_node('Pow', attr)}: integer operands of unknown shape")
        shape = [_i64(d) if isinstance(d, int) else d for d in probe.ty.shape.values]
        count = _i64(1)
        for d in shape:
            count = count * d
        gv = bb.add_func(_int_pow_kernel(bdt, edt, message), "int_pow")
        flat = relax.call_tir(
            gv,
            (_flat(bb, base, shape, count), _flat(bb, exponent, shape, count)),
            relax.TensorType([count], bdt),
        )
        return relax.op.reshape(bb.normalize(flat), relax.ShapeExpr(shape))


# --- CumSum with a run-time axis ------------------------------------------------------------


class CumSum(_frontend.CumSum):
    OP = "CumSum"

    @classmethod
    def _along(cls, bb, data, axis: int, attr, params):
        """The cumulative op along a constant ``axis``."""
        return super()._impl_v14(bb, [data, relax.const(axis, "int64")], attr, params)

    @classmethod
    def _impl_v14(cls, bb, inputs, attr, params):
        data, axis = inputs[0], _frontend.get_constant(inputs[1], params)
        if isinstance(axis, GenericConst):
            value = axis.value.numpy()
            if value.size != 1 or value.ndim > 1:
                raise ModelError(f"{_node(cls.OP, attr)}: axis must hold one value")
            return cls._along(bb, data, int(value.reshape(())), attr, params)
        if not isinstance(axis, relax.Expr):
            return super()._impl_v14(bb, inputs, attr, params)
        where = _node(cls.OP, attr)
        rank = data.ty.ndim
        aty = axis.ty
        if rank < 1 or not isinstance(aty, relax.TensorType) or aty.ndim not in (0, 1):
            raise ModelError(f"{where}: a run-time axis of unknown rank or shape")
        adt = str(aty.dtype)
        axis = checked(
            bb,
            bb.normalize(axis),
            f"T.int64({-rank}) <= v and v < T.int64({rank})",
            f"{where}: axis out of range [{-rank}, {rank})",
        )
        axis = bb.normalize(relax.op.reshape(axis, ()))
        axis = bb.normalize(
            relax.op.where(
                relax.op.less(axis, relax.const(0, adt)),
                relax.op.add(axis, relax.const(rank, adt)),
                axis,
            )
        )
        out = None
        for k in reversed(range(rank)):
            along = bb.normalize(cls._along(bb, data, k, attr, params))
            if out is None:
                out = along
            else:
                pick = relax.op.equal(axis, relax.const(k, adt))
                out = bb.normalize(relax.op.where(pick, along, out))
        return out


class CumProd(CumSum):
    """ONNX's CumProd (opset 26; no stock converter): CumSum's forms with Relax's cumprod."""

    OP = "CumProd"

    @classmethod
    def _along(cls, bb, data, axis: int, attr, params):
        rank = data.ty.ndim
        if not -rank <= axis < rank:
            raise ModelError(f"{_node(cls.OP, attr)}: axis {axis} out of range for rank {rank}")
        axis %= rank
        reverse = attr.get("reverse", 0) != 0
        if reverse:
            data = bb.normalize(relax.op.flip(data, axis))
        out = bb.normalize(relax.op.cumprod(data, axis, exclusive=attr.get("exclusive", 0) != 0))
        return bb.normalize(relax.op.flip(out, axis)) if reverse else out

    @classmethod
    def _impl_v26(cls, bb, inputs, attr, params):
        return cls._impl_v14(bb, inputs, attr, params)


def _elu(x, alpha: float, dtype: str):
    """``alpha * (exp(x) - 1)`` below 0, ``x`` above, in ``dtype`` (stock's formula)."""
    return relax.const(-alpha, dtype) * relax.op.nn.relu(
        relax.const(1.0, dtype) - relax.op.exp(x)
    ) + relax.op.nn.relu(x)


class Elu(_frontend.Elu):
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x = bb.normalize(inputs[0])
        return _elu(x, float(attr.get("alpha", 1.0)), _dtype(x))


class Selu(_frontend.Selu):
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x = bb.normalize(inputs[0])
        alpha = float(attr.get("alpha", 1.67326319217681884765625))
        gamma = float(attr.get("gamma", 1.05070102214813232421875))
        return relax.const(gamma, _dtype(x)) * _elu(x, alpha, _dtype(x))


class Celu(_frontend.OnnxOpConverter):
    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        x, alpha = bb.normalize(inputs[0]), float(attr.get("alpha", 1.0))
        dtype = _dtype(x)
        return relax.const(alpha, dtype) * _elu(x / relax.const(alpha, dtype), 1.0, dtype)


class EyeLike(_frontend.EyeLike):
    """A ``dtype`` attribute other than the input's is the output's dtype (stock refused it:
    "dtype mismatch between input and attribute"; and 0.27's ``eye_like`` kernel is of the
    input's dtype whatever its attribute)."""

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        x = bb.normalize(inputs[0])
        dtype = _frontend.get_type(attr["dtype"]) if "dtype" in attr else _dtype(x)
        if x.ty.ndim != 2:
            raise ModelError(f"{_node('EyeLike', attr)}: a {x.ty.ndim}-D input (2-D only)")
        rows, cols = x.ty.shape.values
        # R.eye, not R.eye_like: 0.27's legalization of eye_like ignores its dtype
        return relax.op.eye(rows, cols, int(attr.get("k", 0)), dtype)


class LpNormalization(_frontend.OnnxOpConverter):
    """``x / ||x||_p`` along ``axis`` (p 1 or 2), 0 where the norm is 0 (ONNX's reference);
    no stock converter."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x = bb.normalize(inputs[0])
        p, axis = int(attr.get("p", 2)), int(attr.get("axis", -1))
        dtype = _dtype(x)
        if p not in (1, 2) or not dtype.startswith(("float", "bfloat")):
            raise ModelError(f"{_node('LpNormalization', attr)}: p={p} of {dtype}")
        if p == 1:
            norm = relax.op.sum(relax.op.abs(x), axis=[axis], keepdims=True)
        else:
            norm = relax.op.sqrt(relax.op.sum(relax.op.multiply(x, x), axis=[axis], keepdims=True))
        norm = bb.normalize(norm)
        zero = relax.const(0.0, dtype)
        return relax.op.where(relax.op.equal(norm, zero), zero, relax.op.divide(x, norm))


class RMSNormalization(_frontend.RMSNormalization):
    """Normalized over every axis (``axis`` 0): computed from its formula (stock's ``rms_norm``
    failed in LegalizeOps: "Tensor dimension mismatch"); other axes: stock."""

    @classmethod
    def _impl_v23(cls, bb, inputs, attr, params):
        x = bb.normalize(inputs[0])
        rank = x.ty.ndim
        if rank < 1 or int(attr.get("axis", -1)) not in (0, -rank):
            return super()._impl_v23(bb, inputs, attr, params)
        dtype, scale = _dtype(x), bb.normalize(inputs[1])
        stash = int(attr.get("stash_type", 1)) == 1 and dtype != "float32"
        if stash:
            x, scale = relax.op.astype(x, "float32"), relax.op.astype(scale, "float32")
        cdt = "float32" if stash else dtype
        mean = relax.op.mean(relax.op.multiply(x, x), axis=list(range(rank)), keepdims=True)
        eps = relax.const(float(attr.get("epsilon", 1e-5)), cdt)
        out = relax.op.multiply(relax.op.multiply(x, relax.op.rsqrt(mean + eps)), scale)
        return relax.op.astype(out, dtype) if stash else out


class ReverseSequence(_frontend.OnnxOpConverter):
    """Each batch entry's first ``sequence_lens[b]`` steps reversed along ``time_axis`` (no
    stock converter): one ``gather_elements`` with indices ``len - 1 - t`` below the length,
    ``t`` above; a length outside ``[0, T]`` is clipped to it (no index leaves the tensor)."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        x, lens = bb.normalize(inputs[0]), bb.normalize(inputs[1])
        time_axis, batch_axis = int(attr.get("time_axis", 0)), int(attr.get("batch_axis", 1))
        rank = x.ty.ndim
        if rank < 2 or {time_axis, batch_axis} != {0, 1} or lens.ty.ndim != 1:
            raise ModelError(f"{_node('ReverseSequence', attr)}: axes {time_axis}, {batch_axis}")
        steps = x.ty.shape.values[time_axis]
        norm = bb.normalize
        lens = norm(relax.op.astype(lens, "int64"))
        count = norm(relax.op.reshape(relax.op.shape_to_tensor(relax.ShapeExpr([steps])), ()))
        lens = norm(relax.op.minimum(norm(relax.op.maximum(lens, relax.const(0, "int64"))), count))
        t_shape = [1] * rank
        t_shape[time_axis] = -1
        b_shape = [1] * rank
        b_shape[batch_axis] = -1
        t = norm(relax.op.reshape(norm(relax.op.arange(0, steps, 1, "int64")), t_shape))
        n = norm(relax.op.reshape(lens, b_shape))
        back = norm(relax.op.subtract(norm(relax.op.subtract(n, relax.const(1, "int64"))), t))
        index = norm(relax.op.where(norm(relax.op.less(t, n)), back, t))
        index = norm(relax.op.broadcast_to(index, x.ty.shape))
        return relax.op.gather_elements(x, index, time_axis)


CONVERTERS = {
    "MaxPool": MaxPool,
    "Pow": Pow,
    "CumSum": CumSum,
    "CumProd": CumProd,
    "EyeLike": EyeLike,
    "LpNormalization": LpNormalization,
    "RMSNormalization": RMSNormalization,
    "ReverseSequence": ReverseSequence,
    "Elu": Elu,
    "Selu": Selu,
    "Celu": Celu,
}
