"""Every extent gets its rule: awkward sizes (primes, odd, 1, tiny) of each op class that has a
CPU rule are scheduled by that rule, not by the fallback, and give ONNX Runtime's numbers.

The models are the shape sweep's (``tvm_fusion.tools.sweep``: one ONNX operator or the handful an
exporter writes for it), imported with ``load_onnx`` and compiled with our pipeline, at small
sizes drawn by hypothesis. Before the rules took any extent, a GEMM whose columns no vector
width divides fell to the row-reduction rule as a scalar loop (71x ORT for GPT-2's LM head),
and an RMS norm to the fallback.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tvm_fusion import analysis
from tvm_fusion.build import engine
from tvm_fusion.frontend import load_onnx
from tvm_fusion.tools import sweep


def _main_rule(family: str, dims: dict) -> str:
    """The rule that must schedule the family's main kernel at ``dims``: a reduction over one
    element (K = 1, a row of one) is elementwise, a GEMM of one column a row of dot products."""
    if family == "gate":
        return "GateFusion"
    if family in ("gemm", "matmul", "bmm"):
        if dims["k"] == 1:
            return "Injective"
        return "RowReduction" if dims["n"] == 1 else "Matmul"
    return "Injective" if dims["n"] == 1 else "RowReduction"


AWKWARD = st.one_of(
    st.sampled_from([1, 2, 3, 5, 7, 13, 17, 31, 33, 61, 77, 97]), st.integers(1, 130)
)


def _check(target, family: str, dims: dict, main_rule: str | None = None):
    import onnxruntime  # noqa: F401 - the test extra has it

    case = sweep.Case(family, dims)
    model, inputs = case.build(seed=1)
    reference = [np.asarray(o) for o in engine.onnxruntime_runner(model, inputs, 1)()]
    compiled = engine.compile_module(load_onnx(model), target, "tvm_fusion")
    outputs = engine.TvmRunner(compiled, [inputs[name] for name in inputs]).outputs()
    for ours, ref in zip(outputs, reference, strict=True):
        np.testing.assert_allclose(ours, ref, rtol=2e-4, atol=2e-5, err_msg=case.name)
    rules = {i.name: i.rule for i in analysis.schedule_info(compiled.lowered)}
    assert not analysis.fallback_kernels(compiled.lowered), (case.name, rules)
    assert (main_rule or _main_rule(family, dims)) in rules.values(), (case.name, rules)
    return rules


FAST = settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FAST
@given(m=AWKWARD, k=AWKWARD, n=AWKWARD)
@example(m=97, k=97, n=211)
@example(m=1, k=61, n=33)
@example(m=3, k=7, n=5)
def test_gemm_with_constant_weight(target, m, k, n):
    _check(target, "gemm", {"m": m, "k": k, "n": n})


@FAST
@given(m=AWKWARD, k=AWKWARD, n=AWKWARD)
@example(m=129, k=63, n=127)
@example(m=95, k=237, n=1)
@example(m=1, k=409, n=1)
def test_gemm_of_two_inputs(target, m, k, n):
    _check(target, "matmul", {"m": m, "k": k, "n": n})


@FAST
@given(b=st.integers(1, 5), m=AWKWARD, k=AWKWARD, n=AWKWARD)
@example(b=3, m=77, k=64, n=77)
def test_batched_matmul(target, b, m, k, n):
    _check(target, "bmm", {"batch": b, "m": m, "k": k, "n": n})


@FAST
@given(
    family=st.sampled_from(["softmax", "log_softmax", "layer_norm", "rms_norm", "cross_entropy"]),
    m=AWKWARD,
    n=st.one_of(AWKWARD, st.sampled_from([999, 1021, 4093])),
)
@example(family="softmax", m=5, n=77)
@example(family="rms_norm", m=3, n=771)
@example(family="cross_entropy", m=7, n=1021)
@example(family="log_softmax", m=2, n=1)
@example(family="softmax", m=1, n=77)
@example(family="log_softmax", m=1, n=1021)
@example(family="cross_entropy", m=1, n=999)
def test_row_reductions(target, family, m, n):
    _check(target, family, {"m": m, "n": n})


@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (7, 40, 24), (13, 33, 40)])
def test_gate_kernel_at_odd_rows_and_reductions(target, m, k, n):
    """SwiGLU's split gate at odd row counts and reduction lengths: one fused gate kernel."""
    _check(target, "gate", {"m": m, "k": k, "n": n})


@pytest.mark.parametrize("m,k,n", [(5, 17, 13), (1, 33, 7)])
def test_gate_at_odd_units_is_fused_and_scheduled(target, m, k, n):
    """Units that no vector block divides: the blocked weight is padded to whole blocks, and
    the one fused kernel is scheduled by the gate rule, numbers right."""
    _check(target, "gate", {"m": m, "k": k, "n": n}, main_rule="GateFusion")
