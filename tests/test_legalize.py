"""Fast-math legalisation: accuracy of each approximation, and stock fallback elsewhere."""

import numpy as np
import pytest
import tvm
from helpers import run
from scipy.special import erf
from tvm import relax
from tvm.relax import op as R

from tvm_fusion import analysis
from tvm_fusion.lower.legalize import fast_math_legalize_map
from tvm_fusion.tools.cuda_check import cuda_source


def _gelu_tanh(x):
    """torch's ``gelu(approximate="tanh")``."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


# (op, reference, input range, bound) -- the bounds documented in tvm_fusion/lower/legalize.py:
# relative error <= 4e-7 where |f| > 1e-3; gelu, gelu_tanh: absolute error <= 1e-6 (erf's
# error times |x| / 2, the cancellation in 1 + erf(x) for x << 0 that stock float32 gelu has
# too).
CASES = [
    ("exp", R.exp, np.exp, (-80, 80), "rel"),
    ("erf", R.erf, erf, (-6, 6), "rel"),
    ("tanh", R.tanh, np.tanh, (-12, 12), "rel"),
    ("sigmoid", R.sigmoid, lambda x: 1 / (1 + np.exp(-x)), (-30, 30), "rel"),
    ("silu", R.nn.silu, lambda x: x / (1 + np.exp(-x)), (-30, 30), "rel"),
    ("gelu", R.nn.gelu, lambda x: 0.5 * x * (1 + erf(x / np.sqrt(2))), (-8, 8), "abs"),
    ("gelu_tanh", R.nn.gelu_tanh, _gelu_tanh, (-8, 8), "abs"),
]


def _unary_module(op, shape, dtype="float32"):
    x = relax.Var("x", relax.TensorType(shape, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(op(x))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("name, op, ref, bounds, kind", CASES, ids=[c[0] for c in CASES])
def test_accuracy(name, op, ref, bounds, kind):
    x = np.linspace(*bounds, 20001, dtype="float32").reshape(1, -1)
    out, compiled = run(_unary_module(op, x.shape), [x], "tvm_fusion")
    assert any("fast" in gv.name_hint for gv in compiled.lowered.get_global_vars())
    expect = ref(x.astype("float64"))
    diff = np.abs(out[0] - expect)
    if kind == "rel":
        big = np.abs(expect) > 1e-3
        assert (diff[big] / np.abs(expect[big])).max() <= 4e-7, name
    else:
        assert diff.max() <= 1e-6, name


def test_exp_below_max_accuracy(target):
    """softmax's ``exp(x - max)`` (``legalize.exp_below_max``, fewer operations than topi's
    fast_exp): relative error <= 4e-7 where exp > 1e-3 (arguments in [-87, 0]), the row
    maximum's exp exactly 1, and arguments below -87 give at most exp(-87) (not garbage from
    the exponent bits), all on the host target."""
    from tvm import te

    from tvm_fusion.lower.legalize import exp_below_max

    x = te.placeholder((1, 40001), "float32", name="x")
    m = te.placeholder((1, 1), "float32", name="m")
    built = tvm.compile(te.create_prim_func([x, m, exp_below_max(x, m, 1)]), target=target)
    shifted = np.concatenate([np.linspace(-87, 0, 40000), [-1000.0]]).astype("float32")
    peak = np.float32(3.5)
    values = (shifted + peak).reshape(1, -1)
    out = tvm.runtime.tensor(np.zeros_like(values))
    built(tvm.runtime.tensor(values), tvm.runtime.tensor(np.full((1, 1), peak)), out)
    out = out.numpy()[0]
    expect = np.exp((values[0] - peak).astype("float64"))
    big = expect > 1e-3
    assert (np.abs(out[big] - expect[big]) / expect[big]).max() <= 4e-7
    assert out[-2] == 1.0
    assert 0 <= out[-1] <= np.exp(-86.9)
    assert np.all(out[:-1] > 0)


@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("op", [R.nn.softmax, R.nn.log_softmax])
def test_softmax_family(op, axis):
    x = np.random.default_rng(0).standard_normal((6, 40)).astype("float32") * 5
    out, _ = run(_unary_module(lambda v: op(v, axis=axis), x.shape), [x], "tvm_fusion")
    xd = x.astype("float64")
    m = xd.max(axis=axis, keepdims=True)
    lse = m + np.log(np.exp(xd - m).sum(axis=axis, keepdims=True))
    expect = xd - lse if op is R.nn.log_softmax else np.exp(xd - lse)
    np.testing.assert_allclose(out[0], expect, rtol=1e-5, atol=1e-6)


def test_fast_math_off_uses_stock(target):
    mod = _unary_module(R.exp, (2, 8))
    x = np.linspace(-3, 3, 16, dtype="float32").reshape(2, 8)
    out, compiled = run(mod, [x], "tvm_fusion", fast_math=False)
    np.testing.assert_allclose(out[0], np.exp(x), rtol=1e-6)
    assert not any("fast" in gv.name_hint for gv in compiled.lowered.get_global_vars())


def test_other_dtypes_keep_stock_legalization():
    mod = _unary_module(R.exp, (2, 8), "float16")
    seq = relax.transform.LegalizeOps(fast_math_legalize_map())
    lowered = seq(mod)
    names = [gv.name_hint for gv in lowered.get_global_vars()]
    assert not any("fast" in n for n in names), names
    assert isinstance(lowered, tvm.IRModule)


@pytest.mark.parametrize("exponent", [2.0, 3.0, -2.0, 0.5])
def test_integer_power_is_multiplication(exponent):
    """power(x, n) for integral |n| <= 4 lowers to multiplications on every target (CUDA's
    --use_fast_math turns powf into exp2(n * log2(x)): NaN for negative x); 0.5 stays powf."""
    shape = (3, 8)
    mod = _unary_module(lambda v: R.power(v, relax.const(exponent, "float32")), shape)
    x = np.linspace(-2, 2, 24, dtype="float32").reshape(shape)
    out, compiled = run(mod, [x], "tvm_fusion")
    with np.errstate(invalid="ignore"):
        np.testing.assert_allclose(out[0], np.power(x, exponent), rtol=1e-6, equal_nan=True)
    names = [gv.name_hint for gv in compiled.lowered.get_global_vars()]
    assert any("integer_power" in n for n in names) == (exponent != 0.5), names
    if exponent != 0.5:
        cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
        from tvm_fusion.build import engine

        source = engine.compile_module(mod, cuda, "tvm_fusion").executable.mod
        text = cuda_source(source)
        assert text and "powf(" not in text and "__powf" not in text


def _legalized_blocks(mod):
    from tvm_fusion import tir_util

    with tvm.target.Target("llvm"):
        mod = relax.transform.LegalizeOps(fast_math_legalize_map())(mod)
    funcs = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    return [name for f in funcs for name in tir_util.block_names(f)]


@pytest.mark.parametrize("op", [R.nn.softmax, R.nn.log_softmax])
def test_symbolic_row_reductions_split_into_whole_vectors_and_a_tail(op):
    """Over a symbolic last axis, max and sum are each written as partials over the whole
    vectors, their fold and a scalar tail (what rfactor would make, which it cannot for a
    symbolic extent); a static axis of at least two vectors gets the partials too, its tail
    one masked vector (no scalar tail), and a shorter one keeps the one-block reduction
    (``llvm`` here: 4 lanes). Numbers are right for row lengths below, at and between
    multiples of the vector width."""
    seq = tvm.tirx.Var("seq", "int64")
    names = _legalized_blocks(_unary_module(lambda v: op(v, axis=-1), (3, seq)))
    for part in ("row_part", "row_fold", "row_tail"):
        assert sum(n.startswith(part) for n in names) == 2, names
    odd = _legalized_blocks(_unary_module(lambda v: op(v, axis=-1), (3, 41)))
    for part in ("row_part", "row_fold", "row_tail"):
        assert sum(n.startswith(part) for n in odd) == 2, odd
    whole = _legalized_blocks(_unary_module(lambda v: op(v, axis=-1), (3, 40)))
    assert sum(n.startswith("row_part") for n in whole) == 2, whole
    assert not any(n.startswith("row_tail") for n in whole), whole
    short = _legalized_blocks(_unary_module(lambda v: op(v, axis=-1), (3, 7)))
    assert not any(n.startswith("row_") for n in short), short

    mod = _unary_module(lambda v: op(v, axis=-1), (3, seq))
    compiled = None
    rng = np.random.default_rng(1)
    for n in (1, 3, 8, 13, 16, 40):
        x = rng.standard_normal((3, n)).astype("float32") * 5
        if compiled is None:
            out, compiled = run(mod, [x], "tvm_fusion")
        else:
            from tvm_fusion.build import engine

            out = engine.TvmRunner(compiled, [x]).outputs()
        xd = x.astype("float64")
        m = xd.max(axis=-1, keepdims=True)
        lse = m + np.log(np.exp(xd - m).sum(axis=-1, keepdims=True))
        expect = xd - lse if op is R.nn.log_softmax else np.exp(xd - lse)
        np.testing.assert_allclose(out[0], expect, rtol=1e-5, atol=1e-6, err_msg=str(n))


def _softmax_reference(x, log):
    xd = x.astype("float64")
    m = xd.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(xd - m).sum(axis=-1, keepdims=True))
    return xd - lse if log else np.exp(xd - lse)


@pytest.mark.parametrize("n", [7, 16, 33, 77, 999])
def test_static_row_reductions_at_any_length(n):
    """Static rows of every length (shorter than two vectors, whole vectors, whole vectors
    and a tail), softmax and log_softmax on the host target, one row of them made large so
    that a lane missing from the max would overflow: numbers right, scheduled by the row rule."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal((5, n)).astype("float32") * 5
    x[2, n - 1] = 80.0  # the tail's last element is the row's max
    for op, log in ((R.nn.softmax, False), (R.nn.log_softmax, True)):
        out, compiled = run(_unary_module(lambda v, op=op: op(v, axis=-1), (5, n)), [x])
        np.testing.assert_allclose(out[0], _softmax_reference(x, log), rtol=1e-5, atol=1e-6)
        rules = {i.rule for i in analysis.schedule_info(compiled.lowered)}
        assert rules == {"RowReduction"}, rules


@pytest.mark.parametrize("n", [5, 32, 771])
def test_layer_and_rms_norm_at_any_length(n):
    """Layer norm and RMS norm over the last axis take our legalisation (row sums in the split
    form): right against NumPy, scheduled by the row rule (RMS norm fell to the fallback)."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((6, n)) * 3 + 1).astype("float32")
    g = rng.standard_normal(n).astype("float32")
    b = rng.standard_normal(n).astype("float32")
    xd = x.astype("float64")
    mean = xd.mean(-1, keepdims=True)
    var = ((xd - mean) ** 2).mean(-1, keepdims=True)
    cases = [
        (
            lambda v: R.nn.layer_norm(v, relax.const(g), relax.const(b), [-1]),
            (xd - mean) / np.sqrt(var + 1e-5) * g + b,
        ),
        (
            lambda v: R.nn.rms_norm(v, relax.const(g), [-1]),
            xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-5) * g,
        ),
    ]
    for build, expect in cases:
        out, compiled = run(_unary_module(build, (6, n)), [x])
        np.testing.assert_allclose(out[0], expect, rtol=1e-4, atol=1e-5)
        rules = {i.rule for i in analysis.schedule_info(compiled.lowered)}
        assert rules == {"RowReduction"}, rules


def _reshape_module(src, dst):
    x = relax.Var("x", relax.TensorType(src, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(R.reshape(x, relax.ShapeExpr(dst)))
        bb.emit_func_output(out)
    return bb.get()


def _legalized_ops(mod):
    from tvm_fusion.lower.legalize import legalize_map

    with tvm.target.Target("llvm"):
        mod = relax.transform.LegalizeOps(legalize_map(False))(mod)
    return [b.value.op.name for b in mod["main"].body.blocks[0].bindings]


def test_symbolic_reshape_kept_as_view():
    """XLNet's rel_shift reshape ``(b, 2, 2s - 1, s) -> (b, 2, s, 2s - 1)``: TVM's reshape-pattern
    analysis does not see through it, so stock legalises it into a copy kernel that stays one;
    it is kept as ``R.reshape`` (a view in the VM). Reshapes the analysis does see, and static
    ones, keep the stock legalisation (a kernel that becomes a view or fuses)."""
    b, s = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("s", "int64")
    two = tvm.tirx.IntImm("int64", 2)
    rel_shift = _reshape_module([b, two, s * 2 - 1, s], [b, two, s, s * 2 - 1])
    assert _legalized_ops(rel_shift) == ["relax.reshape"]
    heads = _reshape_module([b, s, 256], [b, s, 4, 64])
    assert _legalized_ops(heads) == ["relax.call_tir"]
    assert _legalized_ops(_reshape_module([4, 6], [6, 4])) == ["relax.call_tir"]
    x = np.random.default_rng(5).standard_normal((3, 2, 9, 5)).astype("float32")
    out, _ = run(rel_shift, [x], "tvm_fusion")
    np.testing.assert_array_equal(out[0], x.reshape(3, 2, 5, 9))
