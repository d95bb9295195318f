"""The gate math FuseSplitGates fuses: the elementwise op table and the data types of a gate group.

``_ELEMENTWISE`` maps each Relax op that gate math may contain to ``(arity, builder)``, the
builder taking the TE tensors (and ``fast_math``) and returning the op's TE; an op not in the
table ends a gate group (and keeps a view of a linear layer unfolded, ``views.py``).
:func:`_emit_op` builds one op of a group's gate math, the half-precision rules included.
"""

from __future__ import annotations

from tvm import relax, te, tirx, topi

from ...lower import legalize as _legalize
from .._common import op_name as _op

# Data types a gate GEMM may have (inputs, weight, bias and result alike); half-precision groups
# accumulate and run their gate math in ``_ACC`` and round once, where each result is written.
_HALF = ("float16", "bfloat16")
_DTYPES = ("float32", *_HALF)
_ACC = "float32"


def _unary(fast, stock):
    return lambda t, fm: (fast if fm else stock)(t)


# Relax op -> (arity, builder(te tensors..., fast_math) -> te tensor)
_ELEMENTWISE = {
    "relax.sigmoid": (1, _unary(_legalize.fast_sigmoid, topi.sigmoid)),
    "relax.tanh": (1, _unary(topi.fast_tanh, topi.tanh)),
    "relax.exp": (1, _unary(topi.fast_exp, topi.exp)),
    "relax.nn.silu": (1, _unary(_legalize.fast_silu, lambda t: topi.multiply(t, topi.sigmoid(t)))),
    "relax.nn.gelu": (
        1,
        _unary(
            _legalize.fast_gelu,
            lambda t: topi.multiply(
                t,
                topi.add(
                    tirx.const(0.5, t.dtype),
                    topi.multiply(
                        topi.erf(topi.multiply(t, tirx.const(0.5**0.5, t.dtype))),
                        tirx.const(0.5, t.dtype),
                    ),
                ),
            ),
        ),
    ),
    # torch's gelu(approximate="tanh") (Gemma's GeGLU): TVM's torch frontend writes gelu_tanh
    "relax.nn.gelu_tanh": (1, lambda t, fm: _legalize.gelu_tanh(t, fast=fm)),
    "relax.nn.relu": (1, lambda t, fm: topi.nn.relu(t)),
    "relax.negative": (1, lambda t, fm: topi.negative(t)),
    "relax.sqrt": (1, lambda t, fm: topi.sqrt(t)),
    "relax.add": (2, lambda a, b, fm: topi.add(a, b)),
    "relax.subtract": (2, lambda a, b, fm: topi.subtract(a, b)),
    "relax.multiply": (2, lambda a, b, fm: topi.multiply(a, b)),
    "relax.divide": (2, lambda a, b, fm: topi.divide(a, b)),
    "relax.maximum": (2, lambda a, b, fm: topi.maximum(a, b)),
    "relax.minimum": (2, lambda a, b, fm: topi.minimum(a, b)),
    # T5's gelu_new writes pow(x, 3); an integral constant exponent becomes multiplications
    # (:func:`_emit_op`), any other a power
    "relax.power": (2, lambda a, b, fm: topi.power(a, b)),
    "relax.erf": (1, _unary(topi.fast_erf, topi.erf)),
    "relax.abs": (1, lambda t, fm: topi.abs(t)),
    "relax.log": (1, lambda t, fm: topi.log(t)),
    "relax.rsqrt": (1, lambda t, fm: topi.rsqrt(t)),
    "relax.square": (1, lambda t, fm: topi.multiply(t, t)),
    "relax.where": (3, lambda c, a, b, fm: topi.where(c, a, b)),
    # bounds are PrimValue attributes, not tensors (an ONNX LSTM's clip)
    "relax.clip": (3, lambda t, lo, hi, fm: topi.clip(t, _scalar(lo), _scalar(hi))),
    "relax.greater": (2, lambda a, b, fm: topi.greater(a, b)),
    "relax.greater_equal": (2, lambda a, b, fm: topi.greater_equal(a, b)),
    "relax.less": (2, lambda a, b, fm: topi.less(a, b)),
    "relax.less_equal": (2, lambda a, b, fm: topi.less_equal(a, b)),
    "relax.equal": (2, lambda a, b, fm: topi.equal(a, b)),
    "relax.not_equal": (2, lambda a, b, fm: topi.not_equal(a, b)),
    # casts: the attribute's dtype, see _emit_op
    "relax.astype": (1, None),
}


def _emit_op(call: relax.Call, args: list, fast_math: bool, wide: bool = False):
    """The TE of one gate-math op on the tensors ``args``. ``wide``: floating-point tensors are
    held in float32 (a half-precision group), so a cast to a half type rounds to it and widens
    back, and a cast to float32 is the tensor itself."""
    name = _op(call)
    if name == "relax.astype":
        dtype = str(call.attrs.dtype)
        if not wide:
            return topi.cast(args[0], dtype)
        if dtype == _ACC and args[0].dtype == _ACC:
            return args[0]
        out = topi.cast(args[0], dtype)
        return topi.cast(out, _ACC) if dtype in _DTYPES else out
    if name == "relax.power":
        n = _integral_scalar(call.args[1])
        if n is not None and 1 <= n <= 4:
            x = args[0]

            def times(*i):
                out = x(*i)
                for _ in range(n - 1):
                    out = out * x(*i)
                return out

            return te.compute(x.shape, times, name="T_power")
    return _ELEMENTWISE[name][1](*args, fast_math)


def _scalar(value) -> float:
    """A scalar bound (``clip``'s min / max, a FloatImm / IntImm) as a Python float."""
    return float(value.value)


def _integral_scalar(expr) -> int | None:
    """The value of a constant one-element tensor holding an integral number, else None."""
    from tvm.ir.expr import GenericConst  # relax.Constant's 0.27 spelling

    if not isinstance(expr, GenericConst):
        return None
    value = expr.value.numpy().reshape(-1)
    if value.size != 1 or float(value[0]) != round(float(value[0])):
        return None
    return int(round(float(value[0])))
