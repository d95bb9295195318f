"""Shared test helpers: compile with both pipelines and compare; structural Before/Expected."""

from __future__ import annotations

import re

import numpy as np
import tvm

from tvm_fusion import engine
from tvm_fusion.target import host_target


def run(mod: tvm.IRModule, inputs, pipeline: str = "tvm_fusion", target=None, **options):
    compiled = engine.compile_module(mod, target or host_target(), pipeline, **options)
    return engine.TvmRunner(compiled, list(inputs)).outputs(), compiled


def compare_pipelines(mod, inputs, rtol=1e-5, atol=1e-5, reference=None, **options):
    """Compile ``mod`` with stock TVM and with tvm_fusion on llvm, run both, compare outputs.

    Returns (ours, stock) Compiled objects for further checks (kernel counts...).
    """
    stock_out, stock = run(mod, inputs, "stock")
    ours_out, ours = run(mod, inputs, "tvm_fusion", **options)
    assert len(stock_out) == len(ours_out)
    for s, o in zip(stock_out, ours_out, strict=True):
        np.testing.assert_allclose(o, s, rtol=rtol, atol=atol)
    if reference is not None:
        for r, o in zip(reference, ours_out, strict=True):
            np.testing.assert_allclose(o, r, rtol=rtol, atol=atol)
    return ours, stock


def sequential(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """``func`` with its thread loops serial and its buffers global: the scheduled program's
    meaning, runnable on llvm (the software pipeline's annotations dropped: its async copies
    exist on CUDA only)."""
    text = func.script()
    text = re.sub(r'T\.thread_binding\((.+?), thread="[^"]+"\)', r"T.serial(\1)", text)
    text = re.sub(r'"software_pipeline_\w+": \[[^\]]*\](, )?', "", text)
    text = text.replace('scope="shared"', 'scope="global"').replace('scope="local"', "")
    parsed = tvm.script.from_source(text)
    return parsed if isinstance(parsed, tvm.tirx.PrimFunc) else parsed["main"]


def run_kernel(func: tvm.tirx.PrimFunc, args: list[np.ndarray]) -> list[np.ndarray]:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), "llvm")
    tensors = [tvm.runtime.tensor(a) for a in args]
    lib["main"](*tensors)
    return [t.numpy() for t in tensors]


class Base:
    """Before/Expected structural test (the idiom of TVM's test_transform_* files).

    Subclasses set ``transform`` (a pass), ``Before`` and ``Expected`` (an IRModule, or an
    exception type that the pass must raise). ``Expected = Before`` means the pass must not fire.
    """

    transform: tvm.transform.Pass
    Before: tvm.IRModule
    Expected: tvm.IRModule | type

    def test_compare(self):
        before = self.Before
        if isinstance(self.Expected, type) and issubclass(self.Expected, Exception):
            import pytest

            with pytest.raises(self.Expected):
                self.transform(before)
            return
        after = self.transform(before)
        tvm.ir.assert_structural_equal(after, self.Expected)
