"""Shared test helpers: compile with both pipelines and compare; structural Before/Expected."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import tvm

from tvm_fusion.build import engine
from tvm_fusion.target import host_target

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")


def fused_prim_funcs(mod, target, layout_free: bool = True, containing: str | None = None) -> list:
    """The PrimFuncs of ``mod`` after Phases 0-3 of the pipeline for ``target`` (fused, not
    yet scheduled: what a schedule rule is given), constant arguments marked layout-free
    (``layout_free``); with ``containing``, only those whose script has that text (the
    ``"conv"`` kernel)."""
    from tvm import relax

    from tvm_fusion.build import pipeline

    passes = pipeline.lowering_passes(fast_math=True) + pipeline.fuse_tir_passes()
    if layout_free:
        passes.append(relax.transform.AttachAttrLayoutFreeBuffers())
    with target:
        mod = tvm.transform.Sequential(passes)(mod)
    return [
        f
        for f in mod.functions.values()
        if isinstance(f, tvm.tirx.PrimFunc) and (containing is None or containing in f.script())
    ]


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


def matches_reference(mod, cases, rtol=1e-5, atol=1e-5, pipeline="tvm_fusion", **options):
    """Compile ``mod`` once (a symbolic dim serves every case) and compare its outputs on each
    ``(inputs, reference outputs)`` of ``cases``. Returns the Compiled object."""
    compiled = engine.compile_module(mod, options.pop("target", None) or host_target(),
                                     pipeline, **options)  # fmt: skip
    for inputs, reference in cases:
        got = engine.TvmRunner(compiled, list(inputs)).outputs()
        assert len(got) == len(reference)
        for o, r in zip(got, reference, strict=True):
            np.testing.assert_allclose(o, r, rtol=rtol, atol=atol)
    return compiled


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


def accumulator_tiles(func: tvm.tirx.PrimFunc, compacted: bool = True) -> list:
    """The register tiles of a CPU rule's schedule (compacted, else as allocated): the
    allocated buffers that its accumulating blocks (a reduction iterator) write, whatever their
    scope (the GEMM rules' write cache is ``global``, ``_common.ACC_SCOPE``; a gate kernel's
    ``local``)."""
    from tvm_fusion import tir_util

    written = {
        blk.writes[0].source.name
        for blk in tir_util.blocks(func)
        if blk.writes and any(iv.iter_type == iv.CommReduce for iv in blk.iter_vars)
    }
    allocated = tir_util.compacted_allocations if compacted else tir_util.allocated_buffers
    return [b for b in allocated(func) if b.name in written]


def run_kernel(func: tvm.tirx.PrimFunc, args: list[np.ndarray]) -> list[np.ndarray]:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), "llvm")
    tensors = [tvm.runtime.tensor(a) for a in args]
    lib["main"](*tensors)
    return [t.numpy() for t in tensors]


def assert_computes_the_same(func, scheduled, rows: int, scale=1.0, tol=1e-5) -> None:
    """``scheduled`` (a schedule of ``func``), its thread loops run serially
    (:func:`sequential`), gives the numbers of the unscheduled ``func`` on llvm: float32
    arguments drawn standard normal times ``scale``, symbolic dims at ``rows``."""
    rng = np.random.default_rng(0)
    args = []
    for param in func.params:
        shape = [int(d) if isinstance(d, tvm.tirx.IntImm) else rows for d in param.shape]
        args.append((rng.standard_normal(shape) * scale).astype("float32"))
    ours = run_kernel(sequential(scheduled), args)
    plain = run_kernel(func, args)
    for a, b in zip(ours, plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def assert_gate_tile_fits(tile, gemm_gates: list[int], elem: int = 4) -> None:
    """A tile of the CUDA gate rule within its budgets: accumulators per thread, static shared
    memory (``elem``-byte elements), 32 to 256 threads."""
    from tvm_fusion.schedule.cuda.gate_fusion import ACC_BUDGET, SMEM_BUDGET, TU, _smem_bytes

    assert sum(gemm_gates) * tile.tm * TU <= ACC_BUDGET, tile
    assert _smem_bytes(tile, gemm_gates, elem) <= SMEM_BUDGET, tile
    assert 32 <= tile.threads <= 256, tile


def gate_kernel_check(compiled, scopes=("shared", "local")):
    """The ``cuda_check`` report of the one kernel GateFusion scheduled in a CUDA build,
    asserting that there is one (one kernel per gate group) and that it allocates buffers in
    ``scopes`` only (no ``(rows, gates, D)`` buffer in global memory)."""
    from tvm_fusion import tir_util
    from tvm_fusion.tools import cuda_check

    gate_funcs = {
        gv.name_hint: f
        for gv, f in compiled.lowered.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc)
        and f.attrs.get("tvm_fusion.schedule_rule") == "GateFusion"
    }
    assert len(gate_funcs) == 1, list(gate_funcs)
    (func,) = gate_funcs.values()
    for buf in tir_util.allocated_buffers(func):
        assert buf.scope() in scopes, buf
    checks = {k.name: k for k in cuda_check.check(compiled)}
    (gate,) = [k for n, k in checks.items() if n.startswith(next(iter(gate_funcs)))]
    return gate


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


def attention_module(s: int, dtype: str = "float16", causal: bool = False) -> tvm.IRModule:
    """``softmax(Q K^T / 8 [where(tril, ., -inf)]) V`` at (1, 2, s, 64), as bench/gpu's
    attention cases write it."""
    from tvm import relax
    from tvm.relax import op as R

    q, k, v = (relax.Var(n, relax.TensorType((1, 2, s, 64), dtype)) for n in "qkv")
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            kt = bb.emit(R.permute_dims(k, [0, 1, 3, 2]))
            x = bb.emit(R.multiply(bb.emit(R.matmul(q, kt)), relax.const(0.125, dtype)))
            if causal:
                keep = relax.const(np.tril(np.ones((s, s), bool)))
                x = bb.emit(R.where(keep, x, relax.const(float("-inf"), dtype)))
            out = bb.emit_output(R.matmul(bb.emit(R.nn.softmax(x, axis=-1)), v))
        bb.emit_func_output(out)
    return bb.get()


class ChildProcess:
    """Python code run in one child process kept across calls (TVM's ``PopenWorker``), so that
    a crash of compiled code (a segfault, SIGFPE) fails the test that ran it instead of ending
    pytest, without each test paying a fresh interpreter's import of TVM (~6 s). An exception
    in the child is raised here; a child that died raises ``ChildProcessError`` here and is
    started afresh at the next call."""

    def __init__(self):
        from tvm.support.popen_pool import PopenWorker

        self._worker = PopenWorker()

    def run(self, code: str, argv: list[str], timeout: float = 600):
        """Execute ``code`` with ``ARGV`` bound to ``argv`` (strings) in the child."""
        self._worker.send(exec, (code, {"__name__": "__child__", "ARGV": argv}), timeout=timeout)
        return self._worker.recv()

    def close(self) -> None:
        self._worker.kill()
