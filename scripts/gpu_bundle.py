"""Build a GPU bundle: every workload compiled here for CUDA (stock TVM and tvm_fusion), plus
TVM's runtime, packed so that a GPU machine without apache-tvm can run and time them.

    python scripts/gpu_bundle.py --out gpu_bundle            # compile, pack gpu_bundle.tar.gz
    # on the GPU machine (Python 3.12 there by default, numpy; torch for the peer column):
    tar xzf gpu_bundle.tar.gz && python3 gpu_bundle/run_gpu.py --out results

What is in the bundle (``--out`` directory, then ``<out>.tar.gz``):

- ``site/``: the ``tvm`` Python package without ``libtvm_compiler.so`` (imported with
  ``TVM_USE_RUNTIME_LIB=1``: libtvm_runtime, libtvm_runtime_cuda and _extra only) and
  ``tvm_ffi`` unpacked from the apache-tvm-ffi wheel for the GPU machine's Python
  (``--python-version``, downloaded with pip).
- ``modules/``: one exported library per case and pipeline. Device code is compiled here with
  nvcc (``TVM_CUDA_COMPILE_MODE=nvcc``) for ``--arch``, so nothing is compiled there.
- ``data/``: for the ``check`` cases (small sizes, weights inside the module): inputs and the
  reference outputs: NumPy's, or for the backward graphs stock TVM's on this CPU.
- ``manifest.json``: the cases. ``time`` cases use the benchmark (seed) sizes; their weights
  would make the bundle hundreds of MB, so every constant of at least ``--lift-min`` elements
  is lifted from the *compiled* ``main`` into an extra parameter after the whole pipeline ran
  (our packed gate weights stay packed, stock's stay as stock left them), and the runner feeds
  random values of the recorded shapes. Timing does not depend on the values; correctness is
  what the ``check`` cases are for.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import numpy as np

os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "gpu_run.py"
_STUB_LOADED = False  # _load_cuda_runtime ran in this process
SKIP_IN_SITE = {"lib", "3rdparty", "src", "include", "web", "__pycache__"}
RUNTIME_LIBS = ("libtvm_runtime.so", "libtvm_runtime_cuda.so", "libtvm_runtime_extra.so")

# Peer shapes for the torch column on the GPU (the runner builds the same computation with
# random weights of these shapes).
GATE_DIMS = {"swiglu": "inter", "geglu": "inter"}


def _load_cuda_runtime(work: Path) -> None:
    """Let TVM compile device code here, on a machine without a GPU driver.

    TVM's CUDA codegen hands the source to nvcc (``tvm_callback_cuda_compile``) only when
    libtvm_runtime_cuda.so is loaded; otherwise it keeps the source, which the GPU machine's
    runtime cannot load. That library needs libcudart.so.13 (the CUDA toolkit's, present with
    nvcc) and libcuda.so.1 (the driver, absent here). A stub libcuda.so.1 that defines the
    driver symbols the library links against satisfies the loader; nothing here calls them:
    compiling and exporting never touch the device. Must run before ``import tvm``: a process
    that imported TVM first would export CUDA source, which the bundle's runtime-only TVM then
    fails to compile on the GPU machine; that is refused here in one line.
    """
    import ctypes
    import glob

    global _STUB_LOADED
    if _STUB_LOADED:
        return
    if "tvm" in sys.modules:
        raise SystemExit(
            "gpu_bundle: tvm was imported before the CUDA runtime stub; the modules would carry "
            "CUDA source the GPU machine cannot compile (call main() before importing tvm)"
        )

    runtime = Path(_tvm_package_dir()) / "lib" / "libtvm_runtime_cuda.so"
    nm = subprocess.run(
        ["nm", "-D", "--undefined-only", str(runtime)], capture_output=True, text=True, check=True
    ).stdout
    symbols = sorted(
        {
            line.split()[-1].split("@")[0]
            for line in nm.splitlines()
            if line.split()
            and line.split()[-1].startswith("cu")
            and line.split()[-1][2:3].isupper()
        }
    )
    work.mkdir(parents=True, exist_ok=True)
    source = work / "cuda_stub.c"
    source.write_text("".join(f"int {name}(void) {{ return 999; }}\n" for name in symbols))
    stub = work / "libcuda.so.1"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(stub), "-Wl,-soname,libcuda.so.1", str(source)],
        check=True,
    )
    cudart = sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so.13*"))
    if not cudart:
        raise SystemExit("libcudart.so.13 not found: install the CUDA 13 toolkit (nvcc)")
    ctypes.CDLL(str(stub), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(cudart[0], mode=ctypes.RTLD_GLOBAL)
    _STUB_LOADED = True


def _tvm_package_dir() -> str:
    from importlib.util import find_spec

    spec = find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("apache-tvm is not installed")
    return list(spec.submodule_search_locations)[0]


def _lift_constants(lowered, min_elements: int, function: str = "main"):
    """``function`` of a finalised module with every large constant made a trailing parameter."""
    from tvm import relax
    from tvm.ir.expr import GenericConst

    @relax.expr_functor.mutator
    class Lift(relax.PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.params: list[relax.Var] = []
            self.seen: list[tuple[GenericConst, relax.Var]] = []

        def visit_generic_const_(self, op):
            value = op.value
            if not hasattr(value, "shape") or int(np.prod(value.shape)) < min_elements:
                return op
            for const, var in self.seen:
                if const.same_as(op):
                    return var
            var = relax.Var(f"lifted{len(self.params)}", op.ty)
            self.params.append(var)
            self.seen.append((op, var))
            return var

    main = lowered[function]
    lift = Lift(lowered)
    body = lift.visit_expr(main.body)
    specs = [
        {"shape": [int(d) for d in const.value.shape], "dtype": str(const.value.dtype)}
        for const, _ in lift.seen
    ]
    func = relax.Function(
        list(main.params) + lift.params, body, main.ret_ty, main.is_pure, main.attrs, main.span
    )
    mod = lowered.shallow_copy() if hasattr(lowered, "shallow_copy") else lowered
    mod[function] = func
    return mod, specs


def _describe(err: Exception) -> str:
    """One line: the error and the innermost Python frame that raised it."""
    import traceback

    message = (str(err).strip().splitlines() or [""])[-1]
    frames = traceback.extract_tb(err.__traceback__)
    where = ""
    if frames:
        last = frames[-1]
        where = f" in {last.name} ({'/'.join(Path(last.filename).parts[-3:])}:{last.lineno})"
    return f"{type(err).__name__}{': ' + message if message else ''}{where}"


def _input_spec(name: str, arr: np.ndarray) -> dict:
    spec = {"name": name, "shape": list(arr.shape), "dtype": str(arr.dtype)}
    if arr.dtype.kind in "iub":
        # labels, indices: small, saved exactly (their range matters)
        spec["values"] = arr.reshape(-1).tolist()
    else:
        spec["std"] = float(arr.astype("float64").std()) if arr.size else 1.0
    return spec


@contextlib.contextmanager
def _rules_removed(names):
    """tvm_fusion's schedule rules without the classes named ``names`` (a before/after of one
    rule in the same bundle: ``--without-rules``)."""
    from tvm_fusion import schedule

    if not names:
        yield
        return
    original = schedule.default_rules

    def rules(target):
        return [r for r in original(target) if type(r).__name__ not in names]

    schedule.default_rules = rules
    try:
        yield
    finally:
        schedule.default_rules = original


def _compile_case(
    mod, target, pipeline: str, lift_min: int | None, path: Path, function: str, without=()
) -> dict:
    import tvm

    from tvm_fusion import analysis
    from tvm_fusion.build import engine
    from tvm_fusion.target import async_copy

    start = time.perf_counter()
    with _rules_removed(without):
        compiled = engine.compile_module(mod, target, pipeline)
    lowered, lifted = compiled.lowered, []
    if lift_min:
        lowered, lifted = _lift_constants(compiled.lowered, lift_min, function)
    # our gate kernels' shared-memory copies as cp.async, as engine.compile_module builds them
    config = {"tirx.use_async_copy": True} if pipeline != "stock" and async_copy(target) else {}
    # nvcc's callback reads the arch from the current target
    with (
        target,
        tvm.transform.PassContext(
            opt_level=tvm.transform.PassContext.current().opt_level, config=config
        ),
    ):
        executable = tvm.compile(lowered, target, relax_pipeline=None)
    executable.export_library(str(path))
    params = compiled.lowered[function].params
    host_inputs = [
        i
        for i, param in enumerate(params)
        if getattr(param.ty, "vdevice", None) is not None
        and param.ty.vdevice.target.kind.name == "llvm"
    ]
    return {
        "file": f"modules/{path.name}",
        "kernels": analysis.kernel_count(compiled.lowered),
        "host_inputs": host_inputs,
        "lifted": lifted,
        "compile_s": round(time.perf_counter() - start, 2),
        "MB": round(path.stat().st_size / 2**20, 2),
    }


def _cases(names: list[str]):
    """(case, module, inputs, function, reference-or-None, peer) for every workload and the two
    training graphs (take and cross entropy forward+backward)."""
    from tvm import relax

    from tvm_fusion import models
    from tvm_fusion.models.cross_entropy import nll_module
    from tvm_fusion.models.take_arange import xlnet_loss
    from tvm_fusion.transform import FuseCrossEntropy

    for name in names:
        for size in ("small", "seed"):
            inst = models.build(name, size)
            ref = inst.reference(*inst.input_list()) if size == "small" else None
            peer = {"workload": name}
            if name in GATE_DIMS and size == "seed":
                peer["inter"] = 5632
            yield f"{name}.{size}", inst.mod, inst.mod, inst.inputs, "main", ref, peer, size
            if size == "small" and models.get(name).capability == "gate":
                # symbolic rows: our CUDA gate rule's tiled schedule (shared memory, cp.async),
                # which the timed 64-row cases take; the static small rows take the GEMV
                dyn = models.build(name, size, dynamic=True)
                yield f"{name}.small_dyn", dyn.mod, dyn.mod, inst.inputs, "main", ref, peer, size
            if name == "take_arange":
                bd, ac = inst.input_list()
                grad = relax.transform.Gradient("main")(xlnet_loss(bd.shape, ac.shape))
                yield (
                    f"take_fwd_bwd.{size}",
                    grad,
                    grad,
                    inst.inputs,
                    "main_adjoint",
                    None,
                    {"workload": "take_fwd_bwd"},
                    size,
                )
            if name == "cross_entropy":
                x, t = inst.input_list()
                base = nll_module(*x.shape)
                ours = FuseCrossEntropy()(base)
                grads = [
                    relax.transform.Gradient("main", require_grads=m["main"].params[0])(m)
                    for m in (base, ours)
                ]
                yield (
                    f"ce_fwd_bwd.{size}",
                    grads[0],
                    grads[1],
                    inst.inputs,
                    "main_adjoint",
                    None,
                    {"workload": "ce_fwd_bwd"},
                    size,
                )


def _llama_cases():
    """The Llama-style block of issue #8 (torch.onnx export, dynamic batch and sequence), when
    torch is installed here: small checked against ONNX Runtime, a larger one timed."""
    try:
        import onnxruntime as ort

        from tvm_fusion import load_onnx
        from tvm_fusion.models.shape_idioms import llama_block
    except ImportError:
        return
    try:
        model = llama_block()
    except ImportError:
        return
    mod = load_onnx(model)
    gen = np.random.default_rng(0)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    # LLAMA_VARIANTS=1: more sequence lengths and a static-shape build, to locate a failure
    checks = [("small", (2, 5), None)]
    if os.environ.get("LLAMA_VARIANTS") == "1":
        checks += [
            ("small_s8", (2, 8), None),
            ("small_s128", (2, 128), None),
            ("small_static", (2, 5), {"x": [2, 5, 64]}),
        ]
    for label, (batch, seq), shapes in checks:
        x = gen.standard_normal((batch, seq, 64)).astype("float32")
        ref = session.run(None, {"x": x})
        variant = load_onnx(model, shapes=shapes) if shapes else mod
        peer = {"workload": "llama_block"}
        yield f"llama_block.{label}", variant, variant, {"x": x}, "main", ref, peer, "small"
    x = gen.standard_normal((8, 256, 64)).astype("float32")
    yield "llama_block.seed", mod, mod, {"x": x}, "main", None, {"workload": "llama_block"}, "seed"


def _shape_cases():
    """Shape idioms of issue #8 whose CUDA build differs: a shape input that PlaceShapeOnHost
    declares a host tensor (passed as a CPU array there), and a head merge."""
    try:
        from tvm_fusion import load_onnx
        from tvm_fusion.models import shape_idioms
    except ImportError:
        return
    for name in ("shape_input", "merge_heads"):
        for size, (batch, seq) in (("small", (2, 5)), ("seed", (8, 256))):
            idiom = shape_idioms.build(name, batch, seq)
            mod = load_onnx(idiom.model)
            ref = None
            if size == "small":
                import onnxruntime as ort

                session = ort.InferenceSession(
                    idiom.model.SerializeToString(), providers=["CPUExecutionProvider"]
                )
                ref = session.run(None, idiom.inputs)
            peer = {"workload": name}
            yield f"{name}.{size}", mod, mod, idiom.inputs, "main", ref, peer, size


def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _glu_module(rows: int, k: int, d: int, dtype: str, act: str):
    """A gate kernel alone (no down projection): ``act="2890"``: bias, split(3), sigmoid +
    tanh * exp; ``silu``: split(2), silu(gate) * up; ``gru``: one GRU step (two GEMMs). The
    weights constants, as an exporter leaves them. Returns (module, inputs, NumPy reference)."""
    from tvm import relax
    from tvm.relax.op import nn as rnn
    from tvm.script import relax as R

    gen = np.random.default_rng(2026)
    dt = _np_dtype(dtype)

    def const(arr):
        return relax.const(arr.astype(dt), dtype)

    def rand(*shape, scale=1.0):
        return (gen.standard_normal(shape) * scale).astype(dt)

    x_np = rand(rows, k)
    inputs = {"x": x_np}
    params = [relax.Var("x", relax.TensorType((rows, k), dtype))]
    if act == "gru":
        h_np = rand(rows, d)
        inputs["h"] = h_np
        params.append(relax.Var("h", relax.TensorType((rows, d), dtype)))
    bb = relax.BlockBuilder()
    f32 = {n: a.astype("float32") for n, a in inputs.items()}
    with bb.function("main", params):
        with bb.dataflow():

            def gates(a, width, count, bias):
                w = rand(count * d, width, scale=width**-0.5)
                y = bb.emit(R.matmul(a, bb.emit(R.permute_dims(const(w)))))
                ref = f32["x" if a is params[0] else "h"] @ w.astype("float32").T
                if bias:
                    b = rand(count * d, scale=0.1)
                    y = bb.emit(R.add(y, const(b)))
                    ref = ref + b.astype("float32")
                parts = bb.emit(R.split(y, count, axis=-1))
                outs = [bb.emit(relax.TupleGetItem(parts, i)) for i in range(count)]
                return outs, np.split(ref, count, axis=-1)

            if act == "2890":
                (s, t, e), (rs, rt, re) = gates(params[0], k, 3, True)
                s, t, e = bb.emit(R.sigmoid(s)), bb.emit(R.tanh(t)), bb.emit(R.exp(e))
                out = bb.emit_output(R.add(s, bb.emit(R.multiply(t, e))))
                ref = 1 / (1 + np.exp(-rs)) + np.tanh(rt) * np.exp(re)
            elif act == "silu":
                (g, u), (rg, ru) = gates(params[0], k, 2, False)
                out = bb.emit_output(R.multiply(bb.emit(rnn.silu(g)), u))
                ref = rg / (1 + np.exp(-rg)) * ru
            else:
                (ir, iz, inn), (rir, riz, rin) = gates(params[0], k, 3, True)
                (hr, hz, hn), (rhr, rhz, rhn) = gates(params[1], d, 3, True)
                r = bb.emit(R.sigmoid(bb.emit(R.add(ir, hr))))
                z = bb.emit(R.sigmoid(bb.emit(R.add(iz, hz))))
                cand = bb.emit(R.tanh(bb.emit(R.add(inn, bb.emit(R.multiply(r, hn))))))
                keep = bb.emit(R.subtract(relax.const(1.0, dtype), z))
                new = R.add(bb.emit(R.multiply(keep, cand)), bb.emit(R.multiply(z, params[1])))
                out = bb.emit_output(new)
                sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
                rr, rz = sig(rir + rhr), sig(riz + rhz)
                ref = (1 - rz) * np.tanh(rin + rr * rhn) + rz * f32["h"]
        bb.emit_func_output(out)
    return bb.get(), inputs, [ref.astype(dt)]


def _linear_module(rows: int, k: int, n: int, dtype: str):
    """``x @ W^T`` with a constant ``W`` [n, k] (the down projection): our skinny split-K rule."""
    from tvm import relax
    from tvm.script import relax as R

    gen = np.random.default_rng(3)
    dt = _np_dtype(dtype)
    w = (gen.standard_normal((n, k)) * k**-0.5).astype(dt)
    x_np = gen.standard_normal((rows, k)).astype(dt)
    x = relax.Var("x", relax.TensorType((rows, k), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(R.matmul(x, bb.emit(R.permute_dims(relax.const(w, dtype)))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    ref = x_np.astype("float32") @ w.astype("float32").T
    return bb.get(), {"x": x_np}, [ref.astype(dt)]


# (case, kind, small dims, timed dims, dtype): the kernels of bench/gpu.md's kernel table.
# glu/gate3/gru: FuseSplitGates' gate kernels (tensor cores in float16 from 16 rows; CUDA
# cores in float32; split-K GEMV at <= 4 static rows); linear: the skinny split-K rule.
KERNEL_CASES = [
    ("tc_swiglu_f16", "silu", (37, 100, 48), (64, 2048, 5632), "float16"),
    ("tc_gate_2890_f16", "2890", (37, 100, 48), (64, 1024, 1024), "float16"),
    ("tc_gru_f16", "gru", (37, 40, 48), (64, 1024, 1024), "float16"),
    ("cc_swiglu_f32", "silu", (37, 100, 48), (64, 2048, 5632), "float32"),
    ("gemv_swiglu_f32_r1", "silu", (1, 100, 48), (1, 2048, 5632), "float32"),
    ("gemv_swiglu_f16_r1", "silu", (1, 100, 48), (1, 2048, 5632), "float16"),
    ("gemv_gate_2890_f32_r4", "2890", (4, 100, 48), (4, 1024, 1024), "float32"),
    ("gemv_gru_f32_r1", "gru", (1, 40, 48), (1, 1024, 1024), "float32"),
    ("skinny_down_f32", "linear", (13, 1300, 97), (64, 5632, 2048), "float32"),
    ("skinny_down_f16", "linear", (13, 1300, 97), (64, 5632, 2048), "float16"),
    ("skinny_down_f16_r1", "linear", (1, 1300, 97), (1, 5632, 2048), "float16"),
    # FuseAttention's CUDA kernel: (B, H, S, D); unmasked small at S = 515 (the size gate
    # leaves a static S below 512 unfused without a mask), causal: a Where(tril, ., -inf)
    ("attn_f32", "attention", (1, 2, 515, 64), (1, 8, 2048, 64), "float32"),
    ("attn_f16", "attention", (1, 2, 515, 64), (1, 8, 2048, 64), "float16"),
    ("attn_causal_f32", "causal", (1, 2, 37, 64), (1, 8, 2048, 64), "float32"),
    # float16 causal small at S = 128: the vectorized epilogue that loaded the bool mask wrongly
    ("attn_causal_f16", "causal", (1, 2, 128, 64), (1, 8, 2048, 64), "float16"),
    # FuseGatheredGates on CUDA: a Mixtral-style MoE layer (router, top-k, W[ids] bmm, SwiGLU,
    # down W[ids] bmm, weighted sum), torch.export; (tokens, hidden, inner, experts, top)
    ("moe_f32_t1", "moe", (5, 64, 48, 4, 2), (1, 1024, 2816, 8, 2), "float32"),
    ("moe_f32_t16", "moe", (5, 64, 48, 4, 2), (16, 1024, 2816, 8, 2), "float32"),
]


def _moe_module(tokens: int, hidden: int, inner: int, experts: int, top: int):
    """``tvm_fusion.testing.moe.batched_mm_moe`` through torch.export at static tokens, its
    weights bound as constants; the reference is torch's output on this CPU."""
    import torch

    from tvm_fusion.frontend.load import import_exported_program
    from tvm_fusion.testing.moe import batched_mm_moe

    torch.manual_seed(0)
    model = batched_mm_moe(hidden, inner, experts, top, scale=hidden**-0.5)
    x = torch.randn(tokens, hidden)
    mod = import_exported_program(torch.export.export(model, (x,)))
    with torch.no_grad():
        ref = model(x).numpy()
    return mod, {"x": x.numpy()}, [ref]


def _attention_module(b: int, h: int, s: int, d: int, dtype: str, causal: bool):
    """``softmax(Q K^T / sqrt(D) [where(tril, ., -inf)]) V`` as the ONNX exporters write it:
    FuseAttention's kernel."""
    from tvm import relax
    from tvm.script import relax as R

    gen = np.random.default_rng(4)
    dt = _np_dtype(dtype)
    inputs = {n: gen.standard_normal((b, h, s, d)).astype(dt) for n in "qkv"}
    q, k, v = (relax.Var(n, relax.TensorType((b, h, s, d), dtype)) for n in "qkv")
    keep = np.tril(np.ones((s, s), bool))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            kt = bb.emit(R.permute_dims(k, [0, 1, 3, 2]))
            x = bb.emit(R.multiply(bb.emit(R.matmul(q, kt)), relax.const(d**-0.5, dtype)))
            if causal:
                x = bb.emit(R.where(relax.const(keep), x, relax.const(float("-inf"), dtype)))
            out = bb.emit_output(R.matmul(bb.emit(R.nn.softmax(x, axis=-1)), v))
        bb.emit_func_output(out)
    f32 = {n: a.astype("float32") for n, a in inputs.items()}
    x = f32["q"] @ f32["k"].transpose(0, 1, 3, 2) * d**-0.5
    x = np.where(keep, x, -np.inf) if causal else x
    e = np.exp(x - x.max(-1, keepdims=True))
    return bb.get(), inputs, [(e / e.sum(-1, keepdims=True) @ f32["v"]).astype(dt)]


def _kernel_cases(picked: list[str] | None = None):
    """Single fused kernels at the sizes where each CUDA rule of ours fires, small (checked) and
    timed, with a PyTorch peer of the same computation and dtype (``picked``: these cases only)."""
    for name, kind, small, seed, dtype in KERNEL_CASES:
        if picked is not None and name not in picked:
            continue
        for size, dims in (("small", small), ("seed", seed)):
            if kind in ("attention", "causal"):
                mod, inputs, ref = _attention_module(*dims, dtype, kind == "causal")
                peer = {"workload": "kernel", "kind": kind, "dtype": dtype}
                yield (
                    f"{name}.{size}",
                    mod,
                    mod,
                    inputs,
                    "main",
                    ref if size == "small" else None,
                    peer,
                    size,
                )
                continue
            if kind == "moe":
                mod, inputs, ref = _moe_module(*dims)
                tokens, hidden, inner, experts, top = dims
                peer = {"workload": "moe", "hidden": hidden, "inner": inner}
                peer.update(experts=experts, top=top)
                yield f"{name}.{size}", mod, mod, inputs, "main", ref, peer, size
                continue
            rows, k, d = dims
            if kind == "linear":
                mod, inputs, ref = _linear_module(rows, k, d, dtype)
            else:
                mod, inputs, ref = _glu_module(rows, k, d, dtype, kind)
            peer = {"workload": "kernel", "kind": kind, "k": k, "d": d, "dtype": dtype}
            yield (
                f"{name}.{size}",
                mod,
                mod,
                inputs,
                "main",
                ref if size == "small" else None,
                (peer),
                size,
            )


def _site(out: Path, python_version: str) -> None:
    import tvm

    site = out / "site"
    tvm_dir = Path(tvm.__file__).parent
    shutil.copytree(
        tvm_dir,
        site / "tvm",
        ignore=lambda d, names: [
            n for n in names if Path(d) == tvm_dir and n in SKIP_IN_SITE or n == "__pycache__"
        ],
    )
    (site / "tvm" / "lib").mkdir()
    for lib in RUNTIME_LIBS:
        shutil.copy2(tvm_dir / "lib" / lib, site / "tvm" / "lib" / lib)
    from importlib.metadata import version

    ffi = f"apache-tvm-ffi=={version('apache-tvm-ffi')}"
    wheels = out / "_wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            python_version,
            "--implementation",
            "cp",
            "--platform",
            "manylinux_2_28_x86_64",
            "--platform",
            "manylinux_2_24_x86_64",
            "-d",
            str(wheels),
            ffi,
        ],
        check=True,
    )
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                if member.startswith("tvm_ffi/") and not member.startswith(
                    ("tvm_ffi/include", "tvm_ffi/3rdparty", "tvm_ffi/src")
                ):
                    zf.extract(member, site)
    shutil.rmtree(wheels)
    for so in site.rglob("*.so"):
        so.chmod(0o755)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_bundle")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    parser.add_argument("--only", default="", help="comma-separated workload names")
    parser.add_argument(
        "--kernels", default="", help="with --only kernels: comma-separated kernel case names"
    )
    parser.add_argument(
        "--pipelines", default="stock,tvm_fusion", help="comma-separated: stock, tvm_fusion"
    )
    parser.add_argument("--lift-min", type=int, default=1 << 16)
    parser.add_argument(
        "--without-rules",
        default="",
        help="comma-separated schedule rule classes: one more pipeline, tvm_fusion without them",
    )
    parser.add_argument(
        "--without-cases", default="", help="case prefixes that get that pipeline (default: all)"
    )
    parser.add_argument(
        "--no-runtime",
        action="store_true",
        help="skip packing TVM's runtime (site/) and the archive (for tests)",
    )
    args = parser.parse_args(argv)
    if shutil.which("nvcc") is None:
        raise SystemExit("nvcc not found: the bundle compiles device code here")
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    _load_cuda_runtime(out / "_stub")

    import tvm

    from tvm_fusion import models

    for sub in ("modules", "data"):
        (out / sub).mkdir(parents=True)
    from tvm_fusion.target import host_target

    target = tvm.target.Target({"kind": "cuda", "arch": args.arch})
    host = host_target()
    names = [n for n in args.only.split(",") if n] or models.names()
    manifest = {"arch": args.arch, "tvm": tvm.__version__, "cases": []}
    import itertools

    llama = _llama_cases() if not args.only or "llama_block" in names else iter(())
    shapes = _shape_cases() if not args.only or "shape_idioms" in names else iter(())
    picked = [n for n in args.kernels.split(",") if n] or None
    kernels = _kernel_cases(picked) if not args.only or "kernels" in names else iter(())
    pipelines = [p for p in args.pipelines.split(",") if p]
    without = tuple(n for n in args.without_rules.split(",") if n)
    variant = "tvm_fusion_without_" + "_".join(without) if without else None
    variant_cases = tuple(p for p in args.without_cases.split(",") if p)
    workloads = [n for n in names if n not in ("llama_block", "shape_idioms", "kernels")]
    for case, stock_mod, ours_mod, inputs, function, ref, peer, size in itertools.chain(
        _cases(workloads), llama, shapes, kernels
    ):
        # small: weights inside, saved inputs, checked against NumPy (or stock vs ours where
        # there is no NumPy reference); seed: lifted weights, random inputs, timed.
        check = size == "small"
        entry = {
            "case": case,
            "function": function,
            "check": check,
            "peer": peer,
            "inputs": [_input_spec(k, v) for k, v in inputs.items()],
            "pipelines": {},
            # float16 results: a relative tolerance of a few of their ulps (2^-10)
            "tol": 1e-2 if any(v.dtype == np.float16 for v in inputs.values()) else 1e-3,
        }
        if check and ref is None:
            # backward graphs: stock TVM's result on this CPU is the reference
            from tvm_fusion.build import engine

            compiled = engine.compile_module(stock_mod, host, "stock")
            ref = engine.TvmRunner(compiled, list(inputs.values()), function).outputs()
        if check:
            np.savez(
                out / "data" / f"{case}.npz",
                **{f"in{i}": v for i, v in enumerate(inputs.values())},
                **{f"ref{i}": np.asarray(r) for i, r in enumerate(ref or [])},
            )
            entry["data"] = f"data/{case}.npz"
        builds = [("stock", stock_mod, "stock"), ("tvm_fusion", ours_mod, "tvm_fusion")]
        if variant and (not variant_cases or case.startswith(variant_cases)):
            builds.append((variant, ours_mod, "tvm_fusion"))
        for name, mod, pipeline in builds:
            if name not in pipelines and name != variant:
                continue
            path = out / "modules" / f"{case}.{name}.so"
            try:
                info = _compile_case(
                    mod,
                    target,
                    pipeline,
                    None if check else args.lift_min,
                    path,
                    function,
                    without if name == variant else (),
                )
            except Exception as err:  # a compiler failure is a result too (stock's, mostly)
                entry.setdefault("errors", {})[name] = _describe(err)
                print(f"{case:28s} {name:10s} FAILED {entry['errors'][name]}", flush=True)
                continue
            entry["pipelines"][name] = info
            print(
                f"{case:28s} {name:10s} kernels {info['kernels']:3d}  "
                f"{info['MB']:6.2f} MB  {info['compile_s']:6.1f} s",
                flush=True,
            )
        manifest["cases"].append(entry)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    shutil.copy2(RUNNER, out / "run_gpu.py")
    shutil.rmtree(out / "_stub")
    if args.no_runtime:
        return 0
    _site(out, args.python_version)
    archive = out.with_suffix(".tar.gz")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(out, arcname=out.name)
    print(f"wrote {archive} ({archive.stat().st_size / 2**20:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
