"""Embedded workloads: the Relax module, the ONNX model and the NumPy reference agree."""

import importlib.util

import numpy as np
import pytest
from helpers import run

from tvm_fusion import models
from tvm_fusion.errors import UsageError
from tvm_fusion.tools.cuda_check import cuda_source

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
    from tvm_fusion.build.engine import onnxruntime_runner

    inst = models.build(name, "small")
    ref = inst.reference(*inst.input_list())
    out = onnxruntime_runner(inst.onnx_model, inst.inputs, threads=1)()
    for o, r in zip(out, ref, strict=True):
        np.testing.assert_allclose(o, r, rtol=max(inst.rtol, 1e-5), atol=max(inst.atol, 1e-5))


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="no torch")
@pytest.mark.parametrize("name", ALL)
def test_torch_fn_matches_reference(name):
    from tvm_fusion.build.engine import torch_runner

    inst = models.build(name, "small")
    ref = inst.reference(*inst.input_list())
    out = torch_runner(inst.torch_fn, inst.input_list(), threads=1)()
    for o, r in zip(out, ref, strict=True):
        np.testing.assert_allclose(o, r, rtol=max(inst.rtol, 1e-5), atol=max(inst.atol, 1e-5))


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name", ALL)
def test_cuda_compiles(name, dynamic):
    """Every workload builds for CUDA (sm_90) with the tvm_fusion pipeline: every kernel binds
    threads, our passes fire as on llvm, and the device code compiles to PTX with nvcc (where
    nvcc is installed; tvm.compile itself leaves CUDA source for NVRTC at load time)."""
    import shutil

    import tvm
    from tvm.support import nvcc

    from tvm_fusion.build import engine
    from tvm_fusion.transform import collect_rewrites

    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    inst = models.build(name, "small", dynamic=dynamic)
    with collect_rewrites() as counts:
        compiled = engine.compile_module(inst.mod, cuda, "tvm_fusion")
    kernels = [
        f
        for f in compiled.lowered.functions.values()
        if isinstance(f, tvm.tirx.PrimFunc) and not f.attrs.get("tirx.is_host_func", False)
    ]
    assert all("threadIdx" in f.script() or "blockIdx" in f.script() for f in kernels)
    expected = {
        "gate": "FuseSplitGates",
        "cross_entropy": "FuseCrossEntropy",
        "gather_to_slice": "GatherToSlice",
        "views": "StripBookendViews",
    }.get(models.get(name).capability)
    if expected:
        assert counts[expected] >= 1, dict(counts)
    if shutil.which("nvcc"):
        source = cuda_source(compiled.executable.mod)
        with cuda:
            ptx = bytes(nvcc.compile_cuda(source, "ptx", "sm_90", compiler="nvcc")).decode()
        assert ptx.count(".entry") >= len(kernels)  # a PrimFunc may launch several kernels
