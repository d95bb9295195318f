"""Reductions whose loops may run zero times keep their init
(``tvm_fusion/schedule/empty_reductions.py``): the rewrite on TVMScript kernels (symbolic
extent: decomposed; static extents: left alone) and the numbers of an ONNX ``ReduceProd`` over
an empty axis, which returned uninitialized memory (3e-45 instead of 1)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import run
from onnx import helper
from onnx.reference import ReferenceEvaluator
from tvm import s_tir
from tvm.script import tirx as T

from tvm_fusion import load_onnx
from tvm_fusion.models._build import onnx_input, onnx_model
from tvm_fusion.schedule.empty_reductions import init_outside_empty_loops
from tvm_fusion.tir_util import block_names


@T.prim_func(s_tir=True)
def prod_symbolic(var_x: T.handle, var_y: T.handle):
    n, m = T.int64(), T.int64()
    x = T.match_buffer(var_x, (n, m))
    y = T.match_buffer(var_y, (n,))
    for i, k in T.grid(n, m):
        with T.sblock("prod"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                y[vi] = T.float32(1)
            y[vi] = y[vi] * x[vi, vk]


@T.prim_func(s_tir=True)
def prod_static(
    x: T.Buffer((T.int64(4), T.int64(8)), "float32"), y: T.Buffer((T.int64(4),), "float32")
):
    for i, k in T.grid(T.int64(4), T.int64(8)):
        with T.sblock("prod"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                y[vi] = T.float32(1)
            y[vi] = y[vi] * x[vi, vk]


def test_symbolic_reduction_gets_its_init_outside_the_loop():
    sch = s_tir.Schedule(prod_symbolic)
    assert init_outside_empty_loops(sch) == 1
    assert block_names(sch.mod["main"]) == ["prod_init", "prod_update"]
    # the same as the primitive applied by hand above the reduction loop
    expected = s_tir.Schedule(prod_symbolic)
    block = expected.get_sblock("prod")
    expected.decompose_reduction(block, expected.get_loops(block)[1])
    tvm.ir.assert_structural_equal(sch.mod["main"], expected.mod["main"])


def test_static_positive_extents_are_left_alone():
    sch = s_tir.Schedule(prod_static)
    assert init_outside_empty_loops(sch) == 0
    tvm.ir.assert_structural_equal(sch.mod["main"], prod_static)


@pytest.mark.parametrize("m", [0, 3])
def test_reduce_prod_over_an_empty_axis(m):
    node = helper.make_node("ReduceProd", ["x", "axes"], ["y"], keepdims=1)
    model = onnx_model(
        [node],
        [onnx_input("x", "float32", ["n", 3, "m"])],
        [onnx_input("y", "float32", ["n", 3, 1])],
        {"axes": np.array([2], np.int64)},
    )
    x = np.full((2, 3, m), 1.5, np.float32)
    (got,), _ = run(load_onnx(model), [x])
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)
