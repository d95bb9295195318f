"""Stock converters of apache-tvm 0.27's ONNX importer that give wrong numbers for some
attribute values, found by ONNX's own node tests (``onnx.backend.test.case.node``); each is
fixed here or refuses the model in one line naming the node and the value:

- ``Expand`` to a shape computed at run time of a higher rank than the input
  (``test_expand_dim_changed``): stock broadcasts to the target as given, so a target dim of 1
  where the input has 3 gave (2, 1, 6) instead of (2, 3, 6); the output dim is the input's where
  the target's is 1 (:func:`expand_to_runtime_shape`, called by ``onnx_ops.Expand``);
- ``SpaceToDepth`` with ``mode="CRD"`` (opset 28): stock ignores the mode (DCR's channel order);
- ``ConvTranspose`` with ``output_shape``: stock ignores it; the pads are derived from it as
  the spec says (a negative end pad is extra output padding);
- ``IsInf`` with ``detect_positive=0`` or ``detect_negative=0``: stock ignores both;
- ``Mod`` of floats with ``fmod=0``: stock's ``floor_mod`` is ``x - floor(x / y) * y``, NaN for
  an infinite divisor (``-3 mod inf`` is ``inf``); here from C's ``fmod`` with the sign fixed;
- ``LayerNormalization``'s Mean and InvStdDev outputs: stock returns 0-d zeros; computed here;
- ``BatchNormalization`` with ``training_mode=1``: Relax's momentum is the weight of the batch
  statistics, ONNX's that of the running ones (stock passed it unchanged);
- ``Cast`` / ``CastLike`` from or to float8 / float4 (TVM's conversions are wrong outside the
  type's range and for inf / NaN: no saturation) or int4 / int2 (no kernel takes them): refused;
- ``TopK`` at opset 10 (stock's opset-1 converter: the top 1 whatever ``K``), and of int16 /
  uint16 / uint32 (widened for the sort kernel; uint64 refused);
- ``Resize`` with ``antialias=1`` when shrinking (ignored by stock), or constant ``scales``
  whose product with an extent is not whole (stock maps by the ratio of the sizes): refused;
- ``RoiAlign`` with ``mode="max"`` (error 0.4 against ONNX's reference) and
  ``NonMaxSuppression`` (no box selected, ever) are refused.
"""

from __future__ import annotations

import numpy as np
from tvm import relax, tirx
from tvm.ir.expr import GenericConst
from tvm.relax.frontend.onnx import onnx_frontend as _frontend

from ..errors import ModelError


def _node(op: str, attr: dict) -> str:
    name = attr.get("tvm_custom", {}).get("name") or ""
    return f"{op} node {name!r}" if name else f"{op} node"


def _str(attr: dict, key: str, default: str) -> str:
    value = attr.get(key, default)
    return value.decode() if isinstance(value, bytes) else str(value)


def _i64(value) -> tirx.PrimExpr:
    return tirx.IntImm("int64", value) if isinstance(value, int) else value


def expand_to_runtime_shape(bb, data, shape) -> relax.Expr | None:
    """``Expand(data, shape)`` for a ``shape`` tensor computed at run time (its length
    known), or None. ONNX broadcasts: an output dim is the input's where the target's is 1.
    Stock declares the target itself (``(2, 1, 6)`` for a (3, 1) input expanded to
    ``[2, 1, 6]``, instead of (2, 3, 6))."""
    sinfo, target = getattr(data, "ty", None), getattr(shape, "ty", None)
    if not isinstance(sinfo, relax.TensorType) or not isinstance(sinfo.shape, relax.ShapeExpr):
        return None
    if not isinstance(target, relax.TensorType) or not isinstance(target.shape, relax.ShapeExpr):
        return None
    if target.ndim != 1 or not isinstance(target.shape.values[0], tirx.IntImm):
        return None
    length = int(target.shape.values[0].value)
    if str(target.dtype) != "int64":
        shape = bb.normalize(relax.op.astype(shape, "int64"))
    value = bb.emit(relax.op.tensor_to_shape(shape))
    want = [tirx.Var(f"expand_dim_{i}", "int64") for i in range(length)]
    bb.match_cast(value, relax.ShapeType(want))
    dims = [_i64(d) for d in sinfo.shape.values]
    rank = max(length, len(dims))
    dims = [_i64(1)] * (rank - len(dims)) + dims
    want = [_i64(1)] * (rank - length) + want
    out = []
    for d, t in zip(dims, want, strict=True):
        if isinstance(d, tirx.IntImm) and int(d.value) == 1:
            out.append(t)
        else:
            out.append(tirx.Select(t == 1, d, t))
    if rank > len(sinfo.shape.values):
        data = bb.normalize(relax.op.reshape(data, relax.ShapeExpr(dims)))
    return relax.op.broadcast_to(data, relax.ShapeExpr(out))


class SpaceToDepth(_frontend.SpaceToDepth):
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        mode = _str(attr, "mode", "DCR")
        if mode == "DCR":
            return super()._impl_v1(bb, inputs, attr, params)
        if mode != "CRD":
            raise ModelError(f"{_node('SpaceToDepth', attr)}: mode={mode!r} is not supported")
        block = int(attr["blocksize"])
        b, c, h, w = inputs[0].ty.shape
        x = relax.op.reshape(inputs[0], (b, c, h // block, block, w // block, block))
        x = relax.op.permute_dims(x, [0, 1, 3, 5, 2, 4])  # channel = (c, row, column)
        return relax.op.reshape(x, (b, c * block * block, h // block, w // block))


class ConvTranspose(_frontend.ConvTranspose):
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        if "output_shape" not in attr:
            return super()._impl_v1(bb, inputs, attr, params)
        where = _node("ConvTranspose", attr)
        data, weight = inputs[0].ty, inputs[1].ty
        spatial = data.ndim - 2
        if "pads" in attr:
            # the spec: pads given win over output_shape
            attr = {k: v for k, v in attr.items() if k != "output_shape"}
            return super()._impl_v1(bb, inputs, attr, params)
        try:
            sizes = [int(d) for d in data.shape.values[2:]]
            kernel = [int(d) for d in weight.shape.values[2:]]
        except TypeError:
            raise ModelError(f"{where}: output_shape with symbolic input dims") from None
        out_shape = list(attr["output_shape"])[-spatial:]
        strides = list(attr.get("strides", [1] * spatial))
        dilations = list(attr.get("dilations", [1] * spatial))
        extra = list(attr.get("output_padding", [0] * spatial))
        kernel = list(attr.get("kernel_shape", kernel))
        upper = _str(attr, "auto_pad", "NOTSET") == "SAME_UPPER"
        begins, ends = [], []
        for i in range(spatial):
            total = (
                strides[i] * (sizes[i] - 1)
                + extra[i]
                + (kernel[i] - 1) * dilations[i]
                + 1
                - int(out_shape[i])
            )
            begin = total // 2 if upper else total - total // 2
            end = total - begin
            if end < 0:  # output past the last input's footprint: zeros (plus bias) at the end
                extra[i] -= end
                end = 0
            if begin < 0 or extra[i] >= max(strides[i], dilations[i]):
                raise ModelError(
                    f"{where}: output_shape={list(attr['output_shape'])} is not supported"
                )
            begins.append(begin)
            ends.append(end)
        attr = {k: v for k, v in attr.items() if k not in ("output_shape", "auto_pad")}
        attr["pads"], attr["output_padding"] = begins + ends, extra
        return super()._impl_v1(bb, inputs, attr, params)


class IsInf(_frontend.IsInf):
    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        x = inputs[0]
        positive = int(attr.get("detect_positive", 1))
        negative = int(attr.get("detect_negative", 1))
        out = relax.op.isinf(x)
        if positive and negative:
            return out
        if not positive and not negative:
            return relax.op.zeros_like(out)  # bool zeros
        zero = relax.const(0, x.ty.dtype)
        sign = relax.op.greater(x, zero) if positive else relax.op.less(x, zero)
        return relax.op.logical_and(bb.normalize(out), bb.normalize(sign))


class Mod(_frontend.Mod):
    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        x, y = inputs[0], inputs[1]
        dtype = str(getattr(getattr(x, "ty", None), "dtype", ""))
        if int(attr.get("fmod", 0)) == 1 or not dtype.startswith(("float", "bfloat")):
            return super()._impl_v10(bb, inputs, attr, params)
        # Python's modulo: C's fmod (sign of x), plus y where a non-zero remainder's sign
        # differs from y's; a zero remainder takes y's sign (as numpy's mod)
        r = bb.normalize(relax.op.mod(x, y))
        zero = relax.const(0, dtype)
        y_negative = bb.normalize(relax.op.less(y, zero))
        differs = relax.op.logical_xor(relax.op.less(r, zero), y_negative)
        fix = bb.normalize(relax.op.logical_and(relax.op.not_equal(r, zero), differs))
        out = relax.op.where(fix, relax.op.add(r, y), r)
        signed_zero = relax.op.where(y_negative, relax.const(-0.0, dtype), zero)
        return relax.op.where(relax.op.equal(r, zero), signed_zero, bb.normalize(out))


class LayerNormalization(_frontend.LayerNormalization):
    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        out = super()._impl_v17(bb, inputs, attr, params)
        if attr["tvm_custom"]["num_outputs"] == 1:
            return out
        # stock's Mean and InvStdDev are 0-d zeros: computed here in float32 (stash_type 1)
        if int(attr.get("stash_type", 1)) != 1:
            where = _node("LayerNormalization", attr)
            raise ModelError(f"{where}: stash_type={attr['stash_type']} is not supported")
        data = inputs[0]
        ndim = data.ty.ndim
        axis = int(attr.get("axis", -1)) % ndim
        axes = list(range(axis, ndim))
        x = data if str(data.ty.dtype) == "float32" else relax.op.astype(data, "float32")
        x = bb.normalize(x)
        mean = bb.normalize(relax.op.mean(x, axis=axes, keepdims=True))
        centered = bb.normalize(relax.op.subtract(x, mean))
        var = relax.op.mean(relax.op.multiply(centered, centered), axis=axes, keepdims=True)
        eps = relax.const(np.float32(attr.get("epsilon", 1e-5)), "float32")
        inv = relax.op.rsqrt(relax.op.add(bb.normalize(var), eps))
        return relax.Tuple([bb.normalize(out[0]), mean, bb.normalize(inv)])


class BatchNormalization(_frontend.BatchNormalization):
    @classmethod
    def _impl_v15(cls, bb, inputs, attr, params):
        if int(attr.get("training_mode", 0)):
            # Relax: running = (1 - momentum) * running + momentum * batch; ONNX the other way
            attr = {**attr, "momentum": 1.0 - float(attr.get("momentum", 0.9))}
        return super()._impl_v15(bb, inputs, attr, params)


class RoiAlign(_frontend.RoiAlign):
    @classmethod
    def _impl(cls, bb, inputs, attr, params, default_coordinate_transformation_mode):
        mode = _str(attr, "mode", "avg")
        if mode != "avg":
            raise ModelError(f"{_node('RoiAlign', attr)}: mode={mode!r} is not supported")
        return super()._impl(bb, inputs, attr, params, default_coordinate_transformation_mode)


class NonMaxSuppression(_frontend.OnnxOpConverter):
    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        # stock's selects no box at all (all ten of ONNX's node tests)
        raise ModelError(f"{_node('NonMaxSuppression', attr)} is not supported")


# TVM's conversions to and from float8 / float4 are right in range only (1e6 to float8_e4m3fn gave
# -15 instead of ONNX's saturated 448, NaN gave 1.5, inf 1; float8 to float: inf where ONNX has
# NaN), and sub-byte integers do not reach the kernels (int4 / int2: "dtype.bits % 8 == 0")
_NARROW = ("float8", "float4", "int4", "uint4", "int2", "uint2")


def _refuse_narrow(op: str, attr: dict, *dtypes) -> None:
    for dtype in dtypes:
        if str(dtype).startswith(_NARROW):
            raise ModelError(f"{_node(op, attr)}: a cast from or to {dtype} is not supported")


def _dtype(expr) -> str:
    return str(getattr(getattr(expr, "ty", None), "dtype", ""))


class Cast(_frontend.Cast):
    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        _refuse_narrow("Cast", attr, _frontend.get_type(attr["to"]), _dtype(inputs[0]))
        return super()._impl_v13(bb, inputs, attr, params)


class CastLike(_frontend.CastLike):
    @classmethod
    def _impl_v15(cls, bb, inputs, attr, params):
        _refuse_narrow("CastLike", attr, _dtype(inputs[1]), _dtype(inputs[0]))
        return super()._impl_v15(bb, inputs, attr, params)


class Resize(_frontend.Resize):
    """Refused where stock's numbers are wrong (ONNX's node cases with constant scales / sizes,
    as real models have them): ``antialias=1`` when shrinking (stock ignores it: errors up to
    2.6), and ``scales`` whose product with an extent is not a whole number (stock resizes to
    the floor and maps coordinates by the ratio of the sizes, ONNX by the scale: 4 -> 0.6 x
    gave errors up to 1.2)."""

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        where = _node("Resize", attr)
        x = inputs[0]
        dims = list(x.ty.shape.values) if getattr(x.ty, "shape", None) is not None else []
        scales = _frontend.get_constant(inputs[2], params) if len(inputs) > 2 else None
        sizes = _frontend.get_constant(inputs[3], params) if len(inputs) > 3 else None
        shrink = False
        if isinstance(scales, GenericConst):
            values = scales.value.numpy().astype("float64").reshape(-1)
            for axis, (scale, dim) in enumerate(zip(values, dims, strict=False)):
                static = isinstance(dim, tirx.IntImm)
                whole = float(scale).is_integer() or (
                    static and float(int(dim.value) * scale).is_integer()
                )
                if not whole:
                    extent = int(dim.value) if static else dim
                    raise ModelError(
                        f"{where}: scale {scale:g} on axis {axis} (extent {extent}) does not "
                        "give a whole output extent (TVM's resize maps by the ratio of the sizes)"
                    )
                shrink |= scale < 1
        elif isinstance(sizes, GenericConst):
            values = sizes.value.numpy().reshape(-1)
            for size, dim in zip(values, dims, strict=False):
                shrink |= not isinstance(dim, tirx.IntImm) or int(size) < int(dim.value)
        else:
            shrink = True
        if int(attr.get("antialias", 0)) and shrink:
            raise ModelError(f"{where}: antialias=1 when shrinking is not supported")
        return super()._impl_v18(bb, inputs, attr, params)


# TopK's CPU kernel (the runtime's sort) takes these dtypes only ("Unsupported input dtype" at
# run time otherwise); the others are widened exactly, uint64 has no wider type and is refused
_TOPK_WIDEN = {"int16": "int32", "uint16": "int32", "uint32": "int64"}


class TopK(_frontend.TopK):
    """Opset 10 (``K`` an input, as from 11 on) used stock's opset-1 converter, which reads
    ``k`` from an attribute it does not have and returned the top 1; int16 / uint16 / uint32
    inputs are widened for the sort kernel (it raised at run time), uint64 is refused."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        return cls._impl_v11(bb, inputs, attr, params)  # no largest / sorted: stock's defaults

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        x = bb.normalize(inputs[0])
        dtype = _dtype(x)
        if dtype == "uint64":
            raise ModelError(f"{_node('TopK', attr)}: uint64 input (no sort kernel takes it)")
        wide = _TOPK_WIDEN.get(dtype)
        if wide is None:
            return super()._impl_v11(bb, [x, *inputs[1:]], attr, params)
        both = bb.normalize(
            super()._impl_v11(bb, [relax.op.astype(x, wide), *inputs[1:]], attr, params)
        )
        values = relax.op.astype(relax.TupleGetItem(both, 0), dtype)
        return relax.Tuple([values, relax.TupleGetItem(both, 1)])


FIXES = {
    "TopK": TopK,
    "Resize": Resize,
    "Cast": Cast,
    "CastLike": CastLike,
    "SpaceToDepth": SpaceToDepth,
    "ConvTranspose": ConvTranspose,
    "IsInf": IsInf,
    "Mod": Mod,
    "LayerNormalization": LayerNormalization,
    "BatchNormalization": BatchNormalization,
    "RoiAlign": RoiAlign,
    "NonMaxSuppression": NonMaxSuppression,
}
