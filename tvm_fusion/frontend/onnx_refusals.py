"""Converters of apache-tvm 0.27's ONNX importer fixed or refused after a run of ONNX's whole
node suite (``scripts/onnx_conformance.py``, ``bench/conformance_all.md``), where stock gave
wrong numbers or raw errors for some attribute values or dtypes:

- ``BitShift`` by a count out of range (negative, or at least the bit width): ONNX gives 0 (-1
  for a right shift of a negative value); stock shifts as C does (LLVM's ``shl`` by 32 of an
  int32 is poison: ``-8 << 32`` gave -8). The count is clamped and the result chosen here.
- ``Dropout``: its mask output was float32 (ONNX: bool, all true outside training), and
  ``training_mode`` true was ignored (no drop, no ``1 / (1 - ratio)`` scale). The mask is made
  here; training with a ratio that is not a constant 0, or a ``training_mode`` known only at
  run time, is refused (random output).
- ``ReduceMax`` / ``ReduceMin`` of floats where every reduced element is -inf / +inf (or none
  is: an empty set): TVM's reductions start from the largest finite value, so the max of
  ``[-inf, -inf]`` was -3.4e38 (an attention row masked in full then was not seen as such:
  ``Equal(ReduceMax(bias), -inf)`` in ONNX's expanded ``Attention``). Here the result is
  -inf / +inf where no element is finite or of the other sign.
- ``Softmax`` of float16 / bfloat16: TVM's kernel sums the exponentials in the input's type
  (4 float16 ulps off over 18 keys in ONNX's GQA Attention case, twice the error of ONNX's
  own float16 reference); here it runs in float32 between two casts, as ONNX Runtime does.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir.expr import GenericConst
from tvm.relax.frontend.onnx import onnx_frontend as _frontend

from ..errors import ModelError
from .onnx_fixes import _node


def _constant(expr, params):
    """The numpy value of ``expr`` when it is a constant, else None."""
    if expr is None:
        return None
    value = _frontend.get_constant(expr, params)
    return value.value.numpy() if isinstance(value, GenericConst) else None


class BitShift(_frontend.BitShift):
    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        direction = attr.get("direction", b"LEFT")
        direction = direction.decode() if isinstance(direction, bytes) else str(direction)
        x, y = inputs[0], inputs[1]
        dtype = str(getattr(getattr(x, "ty", None), "dtype", ""))
        if direction not in ("LEFT", "RIGHT") or not dtype.startswith(("int", "uint")):
            return super()._impl_v11(bb, inputs, attr, params)
        bits = tvm.DataType(dtype).bits
        zero = relax.const(0, dtype)
        out_of_range = bb.normalize(relax.op.greater_equal(y, relax.const(bits, dtype)))
        if dtype.startswith("int"):
            below = relax.op.less(y, zero)
            out_of_range = bb.normalize(relax.op.logical_or(out_of_range, below))
        count = bb.normalize(relax.op.where(out_of_range, zero, y))
        if direction == "LEFT":
            shifted = bb.normalize(relax.op.left_shift(x, count))
            return relax.op.where(out_of_range, zero, shifted)
        shifted = bb.normalize(relax.op.right_shift(x, count))
        fill = zero
        if dtype.startswith("int"):  # the sign bit fills an arithmetic shift
            fill = relax.op.where(relax.op.less(x, zero), relax.const(-1, dtype), zero)
        return relax.op.where(out_of_range, bb.normalize(fill), shifted)


class Dropout(_frontend.Dropout):
    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        ratio = inputs[1] if len(inputs) > 1 else None
        mode = inputs[2] if len(inputs) > 2 else None
        training = _constant(mode, params)
        if mode is not None and training is None:
            raise ModelError(
                f"{_node('Dropout', attr)}: a training_mode given at run time is not supported"
            )
        if training is not None and bool(training.reshape(-1)[0]):
            value = 0.5 if ratio is None else _constant(ratio, params)
            if value is None or float(value.reshape(-1)[0]) != 0.0:
                raise ModelError(
                    f"{_node('Dropout', attr)}: training_mode=1 (random output) is not supported"
                )
        return cls._identity(bb, inputs[0], attr)

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        return cls._identity(bb, inputs[0], attr)

    @classmethod
    def _identity(cls, bb, data, attr):
        """The output is the input; the mask (a second output), all true, bool."""
        if attr["tvm_custom"]["num_outputs"] < 2:
            return data
        return relax.Tuple([data, relax.op.ones_like(data, "bool")])


def _to_infinity(bb, impl, inputs, attr, params, out, sign: float):
    """``out`` (the max, ``sign`` -1, or min, ``sign`` 1, that ``impl`` made of ``inputs[0]``)
    set to ``sign * inf`` where each reduced element is ``sign * inf`` (or there is none)."""
    data = inputs[0]
    dtype = str(getattr(getattr(data, "ty", None), "dtype", ""))
    if not dtype.startswith(("float", "bfloat")) or out is data:
        return out
    inf = relax.const(sign * float("inf"), dtype)
    other = bb.normalize(relax.op.astype(relax.op.not_equal(data, inf), dtype))
    # max of the 0/1 flags: 1 where some element is not ``inf`` (the empty set: below 0)
    some = bb.normalize(impl(bb, [other, *inputs[1:]], attr, params))
    half = relax.const(0.5, dtype)
    return relax.op.where(relax.op.greater(some, half), bb.normalize(out), inf)


class ReduceMax(_frontend.ReduceMax):
    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        impl = _frontend.ReduceMax._impl_v11
        out = impl(bb, inputs, attr, params)
        return _to_infinity(bb, impl, inputs, attr, params, out, -1.0)

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        impl = _frontend.ReduceMax._impl_v18
        out = impl(bb, inputs, attr, params)
        return _to_infinity(bb, impl, inputs, attr, params, out, -1.0)


class ReduceMin(_frontend.ReduceMin):
    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        out = super()._impl_v11(bb, inputs, attr, params)
        return _to_infinity(bb, _frontend.ReduceMax._impl_v11, inputs, attr, params, out, 1.0)

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        out = super()._impl_v18(bb, inputs, attr, params)
        return _to_infinity(bb, _frontend.ReduceMax._impl_v18, inputs, attr, params, out, 1.0)


class Softmax(_frontend.Softmax):
    @classmethod
    def _half(cls, impl, bb, inputs, attr, params):
        data = inputs[0]
        dtype = str(getattr(getattr(data, "ty", None), "dtype", ""))
        if dtype not in ("float16", "bfloat16"):
            return impl(bb, inputs, attr, params)
        wide = bb.normalize(relax.op.astype(data, "float32"))
        out = bb.normalize(impl(bb, [wide, *inputs[1:]], attr, params))
        return relax.op.astype(out, dtype)

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        return cls._half(_frontend.Softmax._impl_v1, bb, inputs, attr, params)

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        return cls._half(_frontend.Softmax._impl_v13, bb, inputs, attr, params)


FIXES = {
    "Softmax": Softmax,
    "ReduceMax": ReduceMax,
    "ReduceMin": ReduceMin,
    "Dropout": Dropout,
    "BitShift": BitShift,
}
