"""Embedded workloads: the Relax module, the ONNX model and the NumPy reference agree."""

import importlib.util

import numpy as np
import pytest
from helpers import run

from tvm_fusion import models
from tvm_fusion.errors import UsageError

ALL = models.names()


def test_registry_has_the_five_families():
    caps = {models.get(n).capability for n in ALL}
    assert caps == {"gate", "cross_entropy", "gather_to_slice", "views", "shape"}
    assert {
        "gate_2890",
        "lstm_cell",
        "swiglu",
        "cross_entropy",
        "take_arange",
        "gelu_views",
        "mha_transpose",
        "dynamic_reshape",
    } <= set(ALL)


def test_unknown_workload_and_size():
    with pytest.raises(UsageError, match="unknown workload"):
        models.get("resnet")
    with pytest.raises(UsageError, match="unknown size"):
        models.build("gate_2890", "huge")


@pytest.mark.parametrize("name", ALL)
def test_stock_tvm_matches_reference(name):
    inst = models.build(name, "small")
    ref = inst.reference(*inst.input_list())
    out, _ = run(inst.mod, inst.input_list(), "stock")
    for o, r in zip(out, ref, strict=True):
        np.testing.assert_allclose(o, r, rtol=inst.rtol, atol=inst.atol)


@pytest.mark.parametrize("name", ALL)
def test_tvm_fusion_matches_reference(name):
    inst = models.build(name, "small")
    ref = inst.reference(*inst.input_list())
    out, _ = run(inst.mod, inst.input_list(), "tvm_fusion")
    for o, r in zip(out, ref, strict=True):
        np.testing.assert_allclose(o, r, rtol=inst.rtol, atol=inst.atol)


@pytest.mark.parametrize(
    "name",
    [
        "gate_2890",
        "lstm_cell",
        "gru_cell",
        "swiglu",
        "cross_entropy",
        "take_arange",
        "gelu_views",
        "mha_transpose",
    ],
)
def test_dynamic_variant(name):
    inst = models.build(name, "small", dynamic=True)
    params = inst.mod["main"].params
    assert any(
        not isinstance(d, int) and not hasattr(d, "value")
        for p in params
        for d in p.ty.shape.values
    ), "expected a symbolic dim"
    ref = inst.reference(*inst.input_list())
    out, _ = run(inst.mod, inst.input_list(), "tvm_fusion")
    for o, r in zip(out, ref, strict=True):
        np.testing.assert_allclose(o, r, rtol=inst.rtol, atol=inst.atol)


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None, reason="no onnxruntime")
@pytest.mark.parametrize("name", ALL)
def test_onnx_model_matches_reference(name):
    from tvm_fusion.engine import onnxruntime_runner

    inst = models.build(name, "small")
    ref = inst.reference(*inst.input_list())
    out = onnxruntime_runner(inst.onnx_model, inst.inputs, threads=1)()
    for o, r in zip(out, ref, strict=True):
        np.testing.assert_allclose(o, r, rtol=max(inst.rtol, 1e-5), atol=max(inst.atol, 1e-5))


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="no torch")
@pytest.mark.parametrize("name", ALL)
def test_torch_fn_matches_reference(name):
    from tvm_fusion.engine import torch_runner

    inst = models.build(name, "small")
    ref = inst.reference(*inst.input_list())
    out = torch_runner(inst.torch_fn, inst.input_list(), threads=1)()
    for o, r in zip(out, ref, strict=True):
        np.testing.assert_allclose(o, r, rtol=max(inst.rtol, 1e-5), atol=max(inst.atol, 1e-5))
