"""Legalisations of our own, handed to ``LegalizeOps`` by the pipeline (Phase 2).

Fast math (CPU targets, ``fast_math=True``, the default): ``exp``, ``erf``, ``tanh`` and the ops
built on them (``sigmoid``, ``silu``, ``gelu``, ``gelu_tanh``, ``softmax``, ``log_softmax``)
lower to TVM's polynomial ``topi.fast_exp`` / ``fast_erf`` / ``fast_tanh`` instead of scalar libm
calls, which LLVM cannot vectorise. Bounds checked by tests/test_legalize.py on float32: relative
error at most 4e-7 (a few ulp; erf measures 3.2e-7) wherever |f| > 1e-3 for exp on [-80, 80],
erf on [-6, 6], tanh on [-12, 12], sigmoid and silu on [-30, 30]; gelu's and gelu_tanh's
absolute error at most 1e-6 on [-8, 8] (erf's error times |x|/2 in ``1 + erf(x)``; stock's
float32 gelu measures 4.4e-7). A GPT block's tanh-GELU MLP (8 x 63 x 256, 4x) spent more time in
its epilogue's libm tanh than in its GEMM before ``gelu_tanh`` joined this table.
Only float32 is rewritten; other dtypes keep the stock legalisation. ``softmax`` and
``log_softmax`` over a symbolic last axis (attention scores over a dynamic sequence) write their
row max and sum as ``lanes`` partials over the whole vectors, their fold and a scalar tail
(:func:`_row_reduce`), the split that ``rfactor`` cannot make for a symbolic extent; the CPU row
rule vectorises the partials. Their ``exp(x - max)`` is :func:`exp_below_max`: topi's
polynomial in fewer operations, for arguments that are never positive.

Row reductions (CPU, with fast math): ``layer_norm`` and ``rms_norm`` over the last axis, and
``sum`` / ``mean`` / ``max`` over the last axis alone, take :func:`_row_reduce` too, so that
every row length is vectorised (a static one that the vector width does not divide included:
its tail is one masked vector); stock's layer norm is a tuple reduction that stays scalar.

Integer powers (every target, :func:`legalize_map`): ``power(x, c)`` with a constant integral
exponent ``|c| <= 4`` becomes multiplications. Exact, faster, and needed on CUDA: TVM builds
device code with ``nvcc --use_fast_math``, which turns ``powf`` into ``__powf`` =
``exp2(c * log2(x))``, NaN for every negative ``x`` (a Llama block's RMSNorm ``x.pow(2)`` gave
an all-NaN output on an H100 until this).

Half-precision GEMMs (every target, :func:`legalize_map`): ``matmul`` of float16 / bfloat16
operands with a result of their dtype sums in float32 and casts each result once, as PyTorch and
cuBLAS do; stock sums in the operands' dtype (error growing with ``K``). On llvm it is also
faster: x86 has no half arithmetic, so every float16 addition of stock's sum was a conversion,
an add and a rounding (64 x 1024 @ 1024 x 1024: float16 9.9 -> 1.6 ms, bfloat16 189 -> 1.3 ms).
A ``matmul`` that names its ``out_dtype`` keeps the stock legalisation.

Stock ``FastMathTransform`` covers only ``R.exp``/``R.erf``/``R.tanh`` and rewrites them before
legalisation into opaque ``call_te``; doing it as a legalisation keeps one PrimFunc per op, so
FuseOps sees the same graph as without fast math.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from tvm import relax, te, tirx, topi
from tvm.relax.transform.legalize_ops.common import LegalizeFunc

from .pooling import strided_max_pool2d

_FLOAT = ("float32",)
_HALF = ("float16", "bfloat16")


def _unary(name: str, compute: Callable[[te.Tensor], te.Tensor]) -> LegalizeFunc:
    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
        x = call.args[0]
        if x.ty.dtype not in _FLOAT:
            return None
        return bb.call_te(compute, x, primfunc_name_hint=name)

    return legalize


def fast_sigmoid(x: te.Tensor) -> te.Tensor:
    """``1 / (1 + exp(-x))`` with the polynomial exp, as one elementwise compute."""
    neg_exp = topi.fast_exp(topi.negative(x))
    one = tirx.const(1.0, x.dtype)
    return te.compute(x.shape, lambda *i: one / (one + neg_exp(*i)), name="fast_sigmoid")


def fast_silu(x: te.Tensor) -> te.Tensor:
    return topi.multiply(x, fast_sigmoid(x))


def fast_gelu(x: te.Tensor) -> te.Tensor:
    half = tirx.const(0.5, x.dtype)
    erf = topi.fast_erf(topi.multiply(x, tirx.const(0.5**0.5, x.dtype)))
    return te.compute(x.shape, lambda *i: x(*i) * (half + erf(*i) * half), name="fast_gelu")


def gelu_tanh(x: te.Tensor, fast: bool = True) -> te.Tensor:
    """``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`` (torch's ``approximate="tanh"``,
    Relax ``nn.gelu_tanh``) as stock legalises it; ``fast``: with the polynomial tanh."""
    c = tirx.const(math.sqrt(2.0 / math.pi), x.dtype)
    cube, half, one = (tirx.const(v, x.dtype) for v in (0.044715, 0.5, 1.0))
    inner = te.compute(x.shape, lambda *i: c * x(*i) * (one + cube * x(*i) * x(*i)), name="inner")
    t = (topi.fast_tanh if fast else topi.tanh)(inner)
    return te.compute(x.shape, lambda *i: half * x(*i) * (one + t(*i)), name="gelu_tanh")


def _normalized_axis(axis: int, ndim: int) -> int:
    return axis % ndim


def _row_reduce(x: te.Tensor, axis: int, kind: str) -> te.Tensor:
    """Reduce ``x`` over ``axis`` (keepdims). The last axis, static or symbolic, at least two
    vectors long, is written as the split that ``rfactor`` would make and more: ``lanes``
    partial results over the whole vectors (``(rows..., lanes)``, the lanes a spatial axis the
    CPU row rule vectorises) and their fold; the ``n % lanes`` elements left over are one more
    masked vector of the partials when ``n`` is static, a scalar tail when it is symbolic.
    ``rfactor`` cannot split an extent that is symbolic (attention scores over a dynamic
    sequence: the one-reduction form stays scalar, 7x slower at (4, 4, 128, 128)) or not a
    multiple of the vector width (a vocabulary of 50257, a row of 999: 24x ORT at 1000 x 999);
    and where it can, its schedule ran slower than this form (log_softmax 256 x 50256: 32 ms
    against 6.0 ms at 50257 this way; a layer norm 8192 x 768: 8.0 against 1.3 ms at 771).
    Shorter rows and other axes: one reduction."""
    whole_reduce, reduce, combine = _REDUCERS[kind]
    n = x.shape[axis]
    width = _reduction_lanes(x.dtype)
    static = isinstance(n, tirx.IntImm)
    if axis != len(x.shape) - 1 or (static and int(n) < 2 * width):
        return whole_reduce(x, axis=axis, keepdims=True)
    if static and int(n) >= 8 * width * ACCUMULATORS:
        # a long row: several vectors of partials, independent accumulators, so the reduction
        # is not one chain of dependent vector adds (4 cycles each); one thread, softmax
        # 1000 x 999 0.71-0.75 -> 0.60-0.63 ms, 1767 x 1021 1.21-1.28 -> 1.13-1.16 ms
        width *= ACCUMULATORS
    lanes = tirx.const(width, n.ty.dtype)
    rows = tuple(x.shape[:-1])
    whole = tirx.floordiv(n, lanes)
    k = te.reduce_axis((0, whole), name="k")
    part = te.compute(
        rows + (lanes,),
        lambda *i: reduce(x(*i[:-1], k * lanes + i[-1]), axis=k),
        name="row_part",
    )
    j = te.reduce_axis((0, lanes), name="j")
    if static and int(n) % width:
        # the tail is one more vector: the row's last ``lanes`` elements, those that the whole
        # vectors covered masked to the reduction's identity. Every read is in the row (n >=
        # 2 * lanes) and no scalar loop evaluates the producer (softmax's exp(x - max): a
        # scalar tail took 3x the time of the whole vectors at 4096 x 77). It is a reduction
        # over one step so that the row rule keeps it a vector block of its own.
        rest, identity = int(n) % width, _IDENTITY[kind](x.dtype)
        t = te.reduce_axis((0, 1), name="t")
        tail = te.compute(
            rows + (lanes,),
            lambda *i: reduce(
                tirx.Select(i[-1] >= width - rest, x(*i[:-1], n - lanes + i[-1] + t), identity),
                axis=t,
            ),
            name="row_tail",
        )
        fold = te.compute(
            rows, lambda *i: reduce(combine(part(*i, j), tail(*i, j)), axis=j), name="row_fold"
        )
        return te.compute(rows + (1,), lambda *i: fold(*i[:-1]), name="row")
    fold = te.compute(rows, lambda *i: reduce(part(*i, j), axis=j), name="row_fold")
    if static:
        return te.compute(rows + (1,), lambda *i: fold(*i[:-1]), name="row")
    t = te.reduce_axis((0, n - whole * lanes), name="t")
    tail = te.compute(rows, lambda *i: reduce(x(*i, whole * lanes + t), axis=t), name="row_tail")
    return te.compute(rows + (1,), lambda *i: combine(fold(*i[:-1]), tail(*i[:-1])), name="row")


ACCUMULATORS = 4  # vectors of partial results of a long static row

_IDENTITY = {  # kind: the reduction's identity for a dtype
    "max": lambda dtype: tirx.min_value(dtype),
    "sum": lambda dtype: tirx.const(0, dtype),
}

_REDUCERS = {  # kind: (one topi reduction, TE reducer, how two partial results combine)
    "max": (topi.max, te.max, tirx.max),
    "sum": (topi.sum, te.sum, lambda a, b: a + b),
}


def _reduction_lanes(dtype: str) -> int:
    from tvm.target import Target

    from ..target import is_cpu, vector_lanes

    target = Target.current(allow_none=True)
    if target is None or not is_cpu(target):
        return 8
    return vector_lanes(target, dtype)


# topi.fast_exp's polynomial: exp(r) ~ 1 + r + r^2 * P(r) on r in [-ln2 / 2, ln2 / 2]
_EXP_POLY = (
    1.9875691500e-4,
    1.3981999507e-3,
    8.3334519073e-3,
    4.1665795894e-2,
    1.6666665459e-1,
    5.0000001201e-1,
)
_ROUNDING = 12582912.0  # 1.5 * 2**23: a float32 sum with it rounds to an integer in its low bits


def exp_below_max(x: te.Tensor, m: te.Tensor, axis: int) -> te.Tensor:
    """``exp(x - m)`` for ``m`` the row's maximum, so the argument is <= 0: topi.fast_exp's
    polynomial in fewer vector operations (14 per vector, topi's 19). No upper
    clamp and no ``max(result, x)`` (both for arguments above 88); the integral part ``n`` of
    ``r / ln2`` comes from adding 1.5 * 2**23 + 127 (rounding to nearest, ``n + 127`` in the
    low bits of the sum), so 2**n is those bits shifted into the exponent field, where topi
    rounds, converts to int and adds the bias. Arguments below -87 (n < -126, where the
    shifted bits would not be a float) give exp(-87) = 1.6e-38, not 0: nothing next to the
    row maximum's exp(0) = 1 in a sum or a softmax."""
    one = tirx.const(1.0, "float32")
    bias = tirx.const(_ROUNDING + 127.0, "float32")

    def value(*i):
        r = tirx.max(x(*i) - m(*_keep_axis(i, axis)), tirx.const(-87.0, "float32"))
        biased = r * tirx.const(1.4426950408889634, "float32") + bias
        # n = biased - bias, through a bit cast that TVM's simplifier does not cancel (it
        # rewrites (a + c) - c to a for floats too)
        same = tirx.reinterpret("float32", tirx.reinterpret("int32", biased))
        f = r - (same - bias) * tirx.const(0.6931471805599453, "float32")
        poly = tirx.const(_EXP_POLY[0], "float32")
        for c in _EXP_POLY[1:]:
            poly = poly * f + tirx.const(c, "float32")
        two_n = tirx.reinterpret("float32", tirx.reinterpret("int32", biased) << 23)
        return ((poly * f + one) * f + one) * two_n  # 1 + f + f^2 P(f) as two FMAs

    return te.compute(x.shape, value, name="T_exp_below_max")


def fast_softmax(x: te.Tensor, axis: int) -> te.Tensor:
    axis = _normalized_axis(axis, len(x.shape))
    m = _row_reduce(x, axis, "max")
    e = exp_below_max(x, m, axis) if x.dtype == "float32" else topi.fast_exp(topi.subtract(x, m))
    s = _row_reduce(e, axis, "sum")
    # times the row's reciprocal, not divided by the sum: the division per element (a vector
    # divide is 16x a multiply's throughput) cannot become a multiplication without fast-math
    # flags, the reciprocal is loop-invariant and LLVM hoists it out of the row
    one = tirx.const(1.0, x.dtype)
    return te.compute(x.shape, lambda *i: e(*i) * (one / s(*_keep_axis(i, axis))), name="T_softmax")


def _keep_axis(index, axis: int):
    """``index`` with ``axis`` set to 0 (a keepdims reduction's index)."""
    return tuple(tirx.const(0, "int64") if d == axis else v for d, v in enumerate(index))


def fast_log_softmax(x: te.Tensor, axis: int) -> te.Tensor:
    axis = _normalized_axis(axis, len(x.shape))
    m = _row_reduce(x, axis, "max")
    shifted = topi.subtract(x, m)
    s = _row_reduce(exp_below_max(x, m, axis), axis, "sum")
    return topi.subtract(shifted, topi.log(s))


def fast_layer_norm(x: te.Tensor, gamma: te.Tensor, beta: te.Tensor | None, eps: float):
    """Layer norm (``beta`` given) or RMS norm (``beta`` None) over the last axis, its row sums
    through :func:`_row_reduce` (vectorised at any row length). Two passes for the variance,
    ``mean((x - mean)^2)``, where topi's one pass sums ``x`` and ``x^2`` together (a tuple
    reduction that ``rfactor`` keeps scalar)."""
    n = x.shape[-1]
    inv_n = tirx.const(1.0, x.dtype) / tirx.Cast(x.dtype, n)
    eps_c = tirx.const(eps, x.dtype)
    if beta is not None:
        mean = _row_reduce(x, len(x.shape) - 1, "sum")
        centred = te.compute(x.shape, lambda *i: x(*i) - mean(*i[:-1], 0) * inv_n, name="centred")
    else:
        centred = x
    square = te.compute(x.shape, lambda *i: centred(*i) * centred(*i), name="square")
    var = _row_reduce(square, len(x.shape) - 1, "sum")

    def out(*i):
        scaled = centred(*i) * tirx.rsqrt(var(*i[:-1], 0) * inv_n + eps_c) * gamma(i[-1])
        return scaled + beta(i[-1]) if beta is not None else scaled

    return te.compute(x.shape, out, name="T_layer_norm" if beta is not None else "T_rms_norm")


def _row_norm(name: str, has_beta: bool) -> LegalizeFunc:
    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
        x, gamma = call.args[0], call.args[1]
        beta = call.args[2] if has_beta else None
        ndim = x.ty.ndim
        params = [gamma] + ([beta] if beta is not None else [])
        if (
            x.ty.dtype not in _FLOAT
            or ndim < 1
            or [int(a) % ndim for a in call.attrs.axes] != [ndim - 1]
        ):
            return None
        if any(p.ty.dtype != x.ty.dtype or p.ty.ndim != 1 for p in params):
            return None
        eps = float(call.attrs.epsilon)
        if beta is None:
            return bb.call_te(
                lambda t, g: fast_layer_norm(t, g, None, eps), x, gamma, primfunc_name_hint=name
            )
        return bb.call_te(
            lambda t, g, b: fast_layer_norm(t, g, b, eps), x, gamma, beta, primfunc_name_hint=name
        )

    return legalize


def _last_axis_reduction(kind: str, mean: bool = False) -> LegalizeFunc:
    """``sum`` / ``mean`` / ``max`` over the last axis alone (what exporters write for an RMS
    norm's ``ReduceMean``, a loss' row sums) through :func:`_row_reduce`; other axes and
    dtypes keep the stock legalisation."""

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
        x = call.args[0]
        ndim = x.ty.ndim
        axes = call.attrs.axis
        if x.ty.dtype not in _FLOAT or ndim < 2 or axes is None or len(axes) != 1:
            return None
        last = x.ty.shape.values[-1] if isinstance(x.ty.shape, relax.ShapeExpr) else None
        if int(axes[0]) % ndim != ndim - 1 or last is None:
            return None
        if isinstance(last, tirx.IntImm) and int(last) == 0:
            return None  # an empty row: stock's identity
        keepdims = bool(call.attrs.keepdims)

        def compute(t: te.Tensor) -> te.Tensor:
            row = _row_reduce(t, ndim - 1, kind)
            scale = tirx.const(1.0, t.dtype) / tirx.Cast(t.dtype, t.shape[-1]) if mean else None

            def value(*i):
                out = row(*i, 0) if not keepdims else row(*i)
                return out * scale if scale is not None else out

            shape = tuple(t.shape[:-1]) + ((1,) if keepdims else ())
            return te.compute(shape, value, name=f"row_{'mean' if mean else kind}")

        return bb.call_te(compute, x, primfunc_name_hint=f"row_{'mean' if mean else kind}")

    return legalize


def _matmul_one_column(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
    """``A (..., m, k) @ B (k, 1)`` or ``@ B (k,)``, a GEMM of one static column: a row of dot
    products, written as the row sum of ``A * B^T`` (:func:`_row_reduce`, vectorised at any K).
    As a GEMM the rule would pad the one column to a vector tile, 16 times the work; stock's
    reduction over an odd K stays scalar (95 x 2387 @ 2387 x 1: 8x ONNX Runtime's time)."""
    a, b = call.args
    if a.ty.dtype not in _FLOAT or b.ty.dtype != a.ty.dtype or call.ty.dtype != a.ty.dtype:
        return None
    if a.ty.ndim < 2 or b.ty.ndim not in (1, 2):
        return None
    if not isinstance(b.ty.shape, relax.ShapeExpr):
        return None
    b_shape = list(b.ty.shape.values)
    if b.ty.ndim == 2 and not (isinstance(b_shape[1], tirx.IntImm) and int(b_shape[1]) == 1):
        return None
    k = b_shape[0]
    if not isinstance(k, tirx.IntImm) or int(k) < 2 * _reduction_lanes(a.ty.dtype):
        return None
    column = b.ty.ndim == 2

    def compute(x: te.Tensor, w: te.Tensor) -> te.Tensor:
        w_at = (lambda j: w[j, 0]) if column else (lambda j: w[j])
        product = te.compute(x.shape, lambda *i: x(*i) * w_at(i[-1]), name="dot")
        row = _row_reduce(product, len(x.shape) - 1, "sum")
        if column:
            return row
        return te.compute(tuple(x.shape[:-1]), lambda *i: row(*i, 0), name="dots")

    return bb.call_te(compute, a, b, primfunc_name_hint="matmul_one_column")


def _matmul_half(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
    """``A @ B`` of float16 / bfloat16 operands with a result of the same dtype: the GEMM
    with ``out_dtype = float32`` (each product widened, the sum in float32), then one cast of
    each result. Stock sums in the operands' dtype: 11 bits of mantissa for float16, 8 for
    bfloat16, so every addition past ``|sum| * 2**-11`` rounds, and errors grow with ``K``.
    PyTorch, cuBLAS and the tensor cores' ``mma`` accumulate in float32 too."""
    a, b = call.args
    dtype = str(a.ty.dtype)
    if dtype not in _HALF or str(b.ty.dtype) != dtype or str(call.ty.dtype) != dtype:
        return None
    wide = bb.normalize(relax.op.matmul(a, b, out_dtype="float32"))
    product = bb.emit(_stock("relax.matmul")(bb, wide))
    return bb.call_te(topi.cast, product, dtype, primfunc_name_hint="cast")


def _matmul(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
    """Half-precision GEMMs accumulate in float32 (:func:`_matmul_half`), on every target;
    one-column float32 GEMMs are row sums with fast math (:func:`_matmul_one_column`)."""
    return _matmul_half(bb, call)


def _matmul_fast(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
    out = _matmul_half(bb, call)
    return out if out is not None else _matmul_one_column(bb, call)


def _stock(name: str) -> LegalizeFunc:
    from tvm.ir import Op

    return Op.get(name).get_attr("FLegalize")


def _softmax_like(name: str, compute) -> LegalizeFunc:
    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
        x = call.args[0]
        if x.ty.dtype not in _FLOAT or x.ty.ndim < 1:
            return None
        return bb.call_te(compute, x, int(call.attrs.axis), primfunc_name_hint=name)

    return legalize


def _with_fallback(funcs: dict[str, LegalizeFunc]) -> dict[str, LegalizeFunc]:
    """A function returning None falls back to the stock legalisation of the op."""
    from tvm.ir import Op

    stock = {name: Op.get(name).get_attr("FLegalize") for name in funcs}

    def wrap(name: str, fn: LegalizeFunc) -> LegalizeFunc:
        def legalize(bb, call):
            out = fn(bb, call)
            return out if out is not None else stock[name](bb, call)

        return legalize

    return {name: wrap(name, fn) for name, fn in funcs.items()}


def _integer_power(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
    from tvm.ir.expr import GenericConst

    x, y = call.args
    if not isinstance(y, GenericConst) or str(x.ty.dtype) not in ("float16", "float32", "float64"):
        return None
    value = y.value.numpy()
    if value.size != 1 or value.reshape(-1)[0] != round(float(value.reshape(-1)[0])):
        return None
    n = int(round(float(value.reshape(-1)[0])))
    if n == 0 or abs(n) > 4:
        return None

    def compute(t: te.Tensor) -> te.Tensor:
        def element(*idx):
            v = t(*idx)
            out = v
            for _ in range(abs(n) - 1):
                out = out * v
            return out if n > 0 else tirx.const(1.0, t.dtype) / out

        return te.compute(t.shape, element, name="T_power")

    if list(y.ty.shape.values if hasattr(y.ty.shape, "values") else []) not in ([], [1]):
        return None
    return bb.call_te(compute, x, primfunc_name_hint="integer_power")


def _reshape_as_view(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
    """A reshape between symbolic shapes that TVM's reshape-pattern analysis does not see
    through (XLNet's rel_shift, ``(b, 2, 2 * seq - 1, seq) -> (b, 2, seq, 2 * seq - 1)``) is
    kept as ``R.reshape``, which the VM lowers to a view, when the element counts are provably
    equal; stock legalises it into a copy kernel (``RewriteDataflowReshape`` only turns
    kernels with the pattern back into views): 0.8 ms of XLNet's 2 ms at (8, 64). Every other
    reshape takes the stock legalisation (and can fuse into its consumers)."""
    from tvm import sym

    x = call.args[0]
    out = call.ty
    shape = getattr(out, "shape", None)
    if not isinstance(x.ty, relax.TensorType) or not isinstance(shape, relax.ShapeExpr):
        return None
    if not isinstance(x.ty.shape, relax.ShapeExpr):
        return None
    src, dst = list(x.ty.shape.values), list(shape.values)
    if all(isinstance(d, tirx.IntImm) for d in src + dst):
        return None
    placeholder = te.placeholder(src, x.ty.dtype, name="x")
    func = te.create_prim_func([placeholder, topi.reshape(placeholder, dst)])
    if relax.analysis.has_reshape_pattern(func):
        return None  # stock's kernel becomes a view in RewriteDataflowReshape, or fuses

    def count(dims):
        total = tirx.IntImm("int64", 1)
        for d in dims:
            total = total * d
        return total

    analyzer = sym.Analyzer()
    # the analyzer does not reorder products of non-linear factors: compare the dims as a
    # multiset first (a permutation has the same count), then the products
    rest = list(dst)
    for d in src:
        match = next((i for i, e in enumerate(rest) if analyzer.can_prove_equal(d, e)), None)
        if match is None:
            break
        rest.pop(match)
    else:
        if not rest:
            return call
    return call if analyzer.can_prove_equal(count(src), count(dst)) else None


def legalize_map(fast_math: bool) -> dict[str, LegalizeFunc]:
    """``customize_legalize_map`` for ``LegalizeOps``: integer powers and symbolic reshapes
    as views everywhere, and the fast exp/erf/tanh family when ``fast_math``."""
    table = {
        "relax.power": _integer_power,
        "relax.reshape": _reshape_as_view,
        "relax.matmul": _matmul,
        "relax.nn.max_pool2d": strided_max_pool2d,
    }
    if fast_math:
        table.update(fast_math_legalize_map())
    return _with_fallback(table)


def fast_math_legalize_map() -> dict[str, LegalizeFunc]:
    """``customize_legalize_map`` for ``LegalizeOps`` with fast exp/erf/tanh."""
    return _with_fallback(
        {
            "relax.exp": _unary("fast_exp", topi.fast_exp),
            "relax.erf": _unary("fast_erf", topi.fast_erf),
            "relax.tanh": _unary("fast_tanh", topi.fast_tanh),
            "relax.sigmoid": _unary("fast_sigmoid", fast_sigmoid),
            "relax.nn.silu": _unary("fast_silu", fast_silu),
            "relax.nn.gelu": _unary("fast_gelu", fast_gelu),
            "relax.nn.gelu_tanh": _unary("fast_gelu_tanh", gelu_tanh),
            "relax.nn.softmax": _softmax_like("fast_softmax", fast_softmax),
            "relax.nn.log_softmax": _softmax_like("fast_log_softmax", fast_log_softmax),
            "relax.nn.layer_norm": _row_norm("layer_norm", has_beta=True),
            "relax.nn.rms_norm": _row_norm("rms_norm", has_beta=False),
            "relax.sum": _last_axis_reduction("sum"),
            "relax.mean": _last_axis_reduction("sum", mean=True),
            "relax.max": _last_axis_reduction("max"),
            "relax.matmul": _matmul_fast,
        }
    )
