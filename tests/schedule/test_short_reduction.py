"""The row rule's short reduction (``reduction._short_reduction``): a sum of a few terms read
along the rows, ONNX ``Sum`` of tensors as the importer writes it, ``sum(stack([a, b]), 0)``.
ResNet-50's four residual adds and three of ShuffleNet's were left to the fallback rule: the
stack is an injective producer, which the rule's plain-reduction path did not take, and the
reduction loop was innermost (scalar).

The schedule (compile-only, on every target of ``cpu_target``): the stack inlined, the
reduction loop outside a vector loop of the target's lanes, unrolled; the rows fused where
whole vectors of them fit (a 7 x 7 image), else vectorised on their innermost axis. Numbers on
the host's own build against NumPy, and through the pipeline from an ONNX ``Sum``: no
fallback kernel. Must not fire: a reduction over the innermost axis (its terms strided, not
along the rows), which keeps the plain path.
"""

import numpy as np
import pytest
import tvm
from tvm import te, tirx, topi

from tvm_fusion import tir_util
from tvm_fusion.schedule.cpu.reduction import RowReduction
from tvm_fusion.target import parse_target, vector_lanes

HOST = parse_target("llvm")


def _stack_sum(shape, n_terms: int = 2):
    terms = [te.placeholder(shape, name=f"x{i}") for i in range(n_terms)]
    return te.create_prim_func([*terms, topi.sum(topi.stack(terms, 0), axis=0)])


def _scheduled(func, target):
    with target:
        sch = RowReduction().apply(func, target, False)
    assert sch is not None, "the row rule declined"
    return sch.mod["main"]


def _vector_extents(func) -> list[int]:
    return [int(lp.extent) for lp in tir_util.loops(func) if lp.kind == tirx.ForKind.VECTORIZED]


def _unrolled(func) -> list[int]:
    return [int(lp.extent) for lp in tir_util.loops(func) if lp.kind == tirx.ForKind.UNROLLED]


def _run(func, args, out_shape) -> np.ndarray:
    with HOST:
        lib = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))
    dev = tvm.cpu()
    y = tvm.runtime.tensor(np.full(out_shape, np.nan, "float32"), dev)
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in args], y)
    return y.numpy()


def test_stack_sum_is_vectorised_across_rows(cpu_target):
    """(1, 16L, 7, 7): 784 L elements, whole vectors across the 7 x 7 rows, the rows in
    parallel over the target's 2 cores (ShuffleNet's 544 x 7 x 7 residual sum)."""
    lanes = vector_lanes(cpu_target, "float32")
    func = _scheduled(_stack_sum((1, 16 * lanes, 7, 7)), cpu_target)
    assert _vector_extents(func) == [lanes, lanes]  # the init's and the update's
    assert _unrolled(func) == [2]
    assert any(lp.kind == tirx.ForKind.PARALLEL for lp in tir_util.loops(func))
    assert [b.name_hint for b in tir_util.blocks(func) if "stack" in b.name_hint] == [
        "T_stack_red_init",
        "T_stack_red_update",
    ]  # the stack inlined


def test_rows_no_vector_divides_keep_the_innermost_axis(cpu_target):
    """(3, 5, 4): 60 elements, a multiple of no target's lanes: no vector across the rows;
    the innermost axis (4) vectorised as ``vectorize_innermost`` does it (by 4, the largest
    power-of-two divisor), the reduction outside it and unrolled."""
    lanes = vector_lanes(cpu_target, "float32")
    func = _scheduled(_stack_sum((3, 5, 4), 3), cpu_target)
    assert _unrolled(func) == [3]
    assert _vector_extents(func) == [min(4, lanes)] * 2


@pytest.mark.parametrize("shape,n_terms", [((1, 128, 7, 7), 2), ((2, 3, 5, 5), 3), ((3, 5, 4), 4)])
def test_numbers(shape, n_terms):
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(shape).astype("float32") for _ in range(n_terms)]
    func = _scheduled(_stack_sum(shape, n_terms), HOST)
    out = _run(func, xs, shape)
    np.testing.assert_allclose(out, np.sum(np.stack(xs), axis=0), rtol=1e-6, atol=1e-6)


def test_reduction_over_the_innermost_axis_keeps_the_plain_path(cpu_target):
    """sum(x, -1) over 4 terms: strided along the rows, no vector across them."""
    x = te.placeholder((64, 4), name="x")
    func = _scheduled(te.create_prim_func([x, topi.sum(x, axis=-1)]), cpu_target)
    assert _unrolled(func) == []
    assert _vector_extents(func) == []
    out = _run(
        _scheduled(te.create_prim_func([x, topi.sum(x, axis=-1)]), HOST),
        [np.arange(256, dtype="float32").reshape(64, 4)],
        (64,),
    )
    np.testing.assert_allclose(out, np.arange(256, dtype="float32").reshape(64, 4).sum(-1))


def test_onnx_sum_has_no_fallback_kernel(target):
    """ONNX ``Sum`` of two tensors through the pipeline: the row rule schedules it."""
    import onnx
    from onnx import TensorProto, helper

    from tvm_fusion import load_onnx
    from tvm_fusion.build import engine
    from tvm_fusion.tools import analysis

    shape = [1, 16, 7, 7]
    graph = helper.make_graph(
        [helper.make_node("Sum", ["a", "b"], ["y"])],
        "sum",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    compiled = engine.compile_module(load_onnx(model), target, "tvm_fusion")
    assert analysis.fallback_kernels(compiled.lowered) == []
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal(shape).astype("float32") for _ in range(2))
    (out,) = engine.TvmRunner(compiled, [a, b]).outputs()
    np.testing.assert_allclose(out, a + b, rtol=1e-6, atol=1e-6)


def test_symbolic_rows():
    """Rows of a symbolic extent: not fused into whole vectors (their count is unknown), the
    innermost static axis vectorised; numbers at n = 5."""
    n = te.var("n", dtype="int64")
    func = _scheduled(_stack_sum((n, 3, 8)), HOST)
    assert _unrolled(func) == [2]
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((5, 3, 8)).astype("float32") for _ in range(2)]
    np.testing.assert_allclose(_run(func, xs, (5, 3, 8)), xs[0] + xs[1], rtol=1e-6, atol=1e-6)
