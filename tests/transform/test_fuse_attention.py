"""FuseAttention: softmax(Q K^T * scale + mask) V as one online-softmax kernel.

Forms: the ONNX exporters' MatMul / Transpose / Div or Mul / Add or Where / Softmax / MatMul
(built with onnx.helper, imported with load_onnx), torch.export's decomposed
scaled_dot_product_attention (no mask, attn_mask, is_causal), a symbolic sequence length.
Numbers through ``tvm.compile(..., relax_pipeline="tvm_fusion")`` against numpy / torch at
sequence lengths 1, 7, 33 (the kernel's 8-row tiles and 16-key blocks both have tails there).
Must not fire: softmax over a non-last axis, Q K^T or the scaled scores also returned,
probabilities read twice, a scale that is a tensor, float16, K with one head broadcast over the
others, a GPU target other than CUDA (CUDA: test_fuse_attention_cuda.py).
"""

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
import tvm
import tvm.testing
from onnx import TensorProto, helper
from tvm import relax, tirx
from tvm.relax import op as R

from tvm_fusion.frontend import import_exported_program, load_onnx
from tvm_fusion.lower.attention import KERNEL_NAME
from tvm_fusion.schedule import serial_small_kernels
from tvm_fusion.transform import FuseAttention, collect_rewrites, fuse_attention

LLVM = tvm.target.Target({"kind": "llvm"})
B, H, D = 2, 3, 8


@pytest.fixture(autouse=True)
def _no_size_gate(monkeypatch):
    """These tests' static sequences are far below the size gate: off, except where a test
    sets it."""
    monkeypatch.setattr(fuse_attention, "MIN_STATIC_SCORES", 0)


def _softmax(x):
    with np.errstate(invalid="ignore"):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)


def _run(mod, inputs):
    ex = tvm.compile(mod, LLVM, relax_pipeline="tvm_fusion")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in inputs])
    return (out if hasattr(out, "numpy") else out[0]).numpy()


def _fused(mod) -> int:
    with collect_rewrites() as counts:
        after = FuseAttention(LLVM)(mod)
    _assert_no_scores(after, counts["FuseAttention"])
    return counts["FuseAttention"]


def _assert_no_scores(mod, fused: int):
    """Where the pass fired: a call of the kernel, and no softmax nor matmul left in main
    (these graphs hold attention only), so no (B, H, S, N) scores."""
    if not fused:
        return
    text = mod["main"].script()
    assert KERNEL_NAME in text
    assert "R.nn.softmax" not in text and "R.matmul" not in text, text


# ---------------------------------------------------------------------------------------------
# ONNX-exporter form


def _onnx_model(s="S", scale_op="Div", mask=None, causal_where=False, cast=False):
    """MatMul(Q, Transpose(K)) -> Div/Mul -> [Add(mask) | Where(causal, ., -inf)] -> Softmax ->
    [Cast] -> MatMul(V); ``s`` the sequence length (a name: symbolic)."""
    shape = [B, H, s, D]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in "qkv"]
    inits = [
        helper.make_tensor(
            "c", TensorProto.FLOAT, [], [np.sqrt(D) if scale_op == "Div" else 1 / np.sqrt(D)]
        )
    ]
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s0"]),
        helper.make_node(scale_op, ["s0", "c"], ["s1"]),
    ]
    x = "s1"
    if mask is not None:
        inputs.append(helper.make_tensor_value_info("m", TensorProto.FLOAT, list(mask)))
        nodes.append(helper.make_node("Add", ["s1", "m"], ["x"]))
        x = "x"
    if causal_where:
        n = int(s)
        tri = np.tril(np.ones((n, n), bool))
        inits.append(helper.make_tensor("tri", TensorProto.BOOL, [n, n], tri.ravel().tolist()))
        inits.append(helper.make_tensor("ninf", TensorProto.FLOAT, [], [-np.inf]))
        nodes.append(helper.make_node("Where", ["tri", x, "ninf"], ["xw"]))
        x = "xw"
    nodes.append(helper.make_node("Softmax", [x], ["p"], axis=-1))
    if cast:  # the legacy exporter's Cast after the softmax
        nodes.append(helper.make_node("Cast", ["p"], ["pc"], to=TensorProto.FLOAT))
    nodes.append(helper.make_node("MatMul", ["pc" if cast else "p", "v"], ["o"]))
    out = helper.make_tensor_value_info("o", TensorProto.FLOAT, [B, H, s, D])
    graph = helper.make_graph(nodes, "attention", inputs, [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def _qkv(s, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, H, s, D)).astype("float32") for _ in range(3)]


def _reference(q, k, v, scale, mask=None, keep=None):
    x = q @ k.transpose(0, 1, 3, 2) * scale
    if mask is not None:
        x = x + mask
    if keep is not None:
        x = np.where(keep, x, -np.inf)
    return _softmax(x) @ v


@pytest.mark.parametrize("form, s", [("div", 1), ("mul_mask", 7), ("causal_where", 33)])
def test_onnx_form_numbers(form, s):
    mask_shape = (1, 1, s, s) if form == "mul_mask" else None
    model = _onnx_model(
        s=s,
        scale_op="Mul" if form == "mul_mask" else "Div",
        mask=mask_shape,
        causal_where=form == "causal_where",
        cast=form == "mul_mask",
    )
    mod = load_onnx(model)
    assert _fused(mod) == 1
    q, k, v = _qkv(s)
    inputs = [q, k, v]
    mask = keep = None
    if mask_shape:
        mask = np.random.default_rng(1).standard_normal(mask_shape).astype("float32")
        inputs.append(mask)
    if form == "causal_where":
        keep = np.tril(np.ones((s, s), bool))
    ref = _reference(q, k, v, 1 / np.sqrt(D), mask, keep)
    np.testing.assert_allclose(_run(mod, inputs), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", ["parallel", "serial"])
def test_symbolic_sequence(path, monkeypatch):
    """S a named dim: one kernel for every length, checked at 1, 7 and 33; its parallel loops
    as scheduled, and the serial copy SerialSmallKernels adds (its threshold moved so that
    every length takes that path)."""
    below = {"parallel": 0, "serial": 1 << 40}[path]
    monkeypatch.setattr(serial_small_kernels, "SERIAL_BELOW_DENSE", below)
    mod = load_onnx(_onnx_model(s="S", mask=(B, 1, 1, "S")))
    assert _fused(mod) == 1
    ex = tvm.compile(mod, LLVM, relax_pipeline="tvm_fusion")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    for s in (1, 7, 33):
        q, k, v = _qkv(s, seed=s)
        mask = np.random.default_rng(s).standard_normal((B, 1, 1, s)).astype("float32")
        out = vm["main"](*[tvm.runtime.tensor(a) for a in (q, k, v, mask)])
        out = out if hasattr(out, "numpy") else out[0]
        ref = _reference(q, k, v, 1 / np.sqrt(D), mask)
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-4)


def test_fully_masked_row_is_nan_as_softmax():
    """A row whose every score is -inf: softmax gives NaN (0 / 0), so does the kernel."""
    s = 7
    model = _onnx_model(s=s, mask=(1, 1, s, s))
    mod = load_onnx(model)
    q, k, v = _qkv(s)
    mask = np.zeros((1, 1, s, s), "float32")
    mask[..., 2, :] = -np.inf
    out = _run(mod, [q, k, v, mask])
    assert np.isnan(out[:, :, 2]).all()
    rows = [i for i in range(s) if i != 2]
    ref = _reference(q, k, v, 1 / np.sqrt(D), mask)
    np.testing.assert_allclose(out[:, :, rows], ref[:, :, rows], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# torch.export form


class _SDPA(torch.nn.Module):
    def __init__(self, causal=False):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v, *mask):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[0] if mask else None, is_causal=self.causal
        )


@pytest.mark.parametrize("form, s", [("plain", 1), ("causal", 7), ("mask", 33), ("causal", 33)])
def test_torch_sdpa_numbers(form, s):
    q, k, v = (torch.from_numpy(a) for a in _qkv(s))
    args = (q, k, v)
    if form == "mask":
        mask = torch.randn(s, s)
        mask[0, :] = -torch.inf  # a fully masked row: torch's decomposition gives 0, as we do
        args += (mask,)
    module = _SDPA(causal=form == "causal")
    mod = import_exported_program(torch.export.export(module, args))
    assert _fused(mod) == 1
    with torch.no_grad():
        ref = module(*args).numpy()
    np.testing.assert_allclose(_run(mod, [a.numpy() for a in args]), ref, rtol=1e-4, atol=1e-4)


def test_torch_sdpa_dynamic_sequence():
    """torch.export with a dynamic sequence (causal): one build, run at 2, 7 and 33."""
    module = _SDPA(causal=True)
    example = [torch.randn(1, 2, 9, D) for _ in range(3)]  # distinct: export dedups aliases
    seq = torch.export.Dim("seq", min=2, max=256)
    ep = torch.export.export(module, tuple(example), dynamic_shapes=({2: seq},) * 3)
    mod = import_exported_program(ep)
    assert _fused(mod) == 1
    ex = tvm.compile(mod, LLVM, relax_pipeline="tvm_fusion")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    for s in (2, 7, 33, 130):  # 130: two whole key blocks, the diagonal in the third
        args = [torch.randn(1, 2, s, D) for _ in range(3)]
        out = vm["main"](*[tvm.runtime.tensor(a.numpy()) for a in args])
        out = out if hasattr(out, "numpy") else out[0]
        with torch.no_grad():
            ref = module(*args).numpy()
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# must not fire


def _decomposed(
    softmax_axis=-1,
    return_matmul=False,
    return_scores=False,
    probs_twice=False,
    dtype="float32",
    k_heads=H,
    tensor_scale=False,
):
    s = 7
    q = relax.Var("q", relax.TensorType((B, H, s, D), dtype))
    k = relax.Var("k", relax.TensorType((B, k_heads, s, D), dtype))
    v = relax.Var("v", relax.TensorType((B, H, s, D), dtype))
    c = relax.Var("c", relax.TensorType((), dtype))
    params = [q, k, v] + ([c] if tensor_scale else [])
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            kt = bb.emit(R.permute_dims(k, [0, 1, 3, 2]))
            s0 = bb.emit(R.matmul(q, kt))
            scale = c if tensor_scale else relax.const(0.35, dtype)
            s1 = bb.emit(R.multiply(s0, scale))
            p = bb.emit(R.nn.softmax(s1, axis=softmax_axis))
            o = bb.emit(R.matmul(p, v))
            outs = [o]
            if return_matmul:
                outs.append(s0)
            if return_scores:
                outs.append(s1)
            if probs_twice:
                outs.append(bb.emit(R.sum(p, axis=[-1])))
            out = bb.emit_output(relax.Tuple(outs) if len(outs) > 1 else o)
        bb.emit_func_output(out)
    return bb.get()


def test_decomposed_fires():
    """The must-not-fire cases below differ from this one in one thing each."""
    mod = _decomposed()
    assert _fused(mod) == 1
    q, k, v = _qkv(7)
    np.testing.assert_allclose(
        _run(mod, [q, k, v]), _reference(q, k, v, 0.35), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize(
    "change",
    [
        {"softmax_axis": 2},
        {"return_matmul": True},
        {"return_scores": True},
        {"probs_twice": True},
        {"dtype": "float16"},
        {"k_heads": 1},
        {"tensor_scale": True},
    ],
    ids=lambda c: next(iter(c)),
)
def test_not_fired(change):
    mod = _decomposed(**change)
    after = FuseAttention(LLVM)(mod)
    tvm.ir.assert_structural_equal(after, mod)


def test_gpus_other_than_cuda_left_alone():
    """On CUDA the pass emits the CUDA kernel (tests/transform/test_fuse_attention_cuda.py);
    on another GPU kind it does nothing."""
    mod = _decomposed()
    rocm = tvm.target.Target({"kind": "rocm"})
    tvm.ir.assert_structural_equal(FuseAttention(rocm)(mod), mod)
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with collect_rewrites() as counts:
        FuseAttention(cuda)(mod)
    assert counts["FuseAttention"] == 1


def test_kernel_symbolic_dims():
    """The kernel's B, H, S, N are variables: one PrimFunc serves any length."""
    mod = load_onnx(_onnx_model(s="S"))
    after = FuseAttention(LLVM)(mod)
    (kernel,) = [f for gv, f in after.functions_items() if gv.name_hint.startswith(KERNEL_NAME)]
    assert isinstance(kernel, tirx.PrimFunc)
    assert kernel.attrs["tirx.is_scheduled"]


@pytest.mark.parametrize("registers, lanes", [(16, 8), (32, 16), (32, 4)])
def test_kernel_register_blocks(registers, lanes):
    """The kernel's register blocking for 16 SIMD registers (AVX2: 4 query rows per pass) and
    for 32 (AVX-512, AArch64: all 8 rows), with 8, 16 and 4 lanes, run on the host: numbers at
    S = 13, N = 37 (row and key tails) with an added (B, 1, S, N) mask."""
    from tvm_fusion.lower.attention import attention_kernel

    s, n = 13, 37
    rng = np.random.default_rng(registers + lanes)
    q = rng.standard_normal((B, H, s, D)).astype("float32")
    k = rng.standard_normal((B, H, n, D)).astype("float32")
    v = rng.standard_normal((B, H, n, D)).astype("float32")
    mask = rng.standard_normal((B, 1, s, n)).astype("float32")
    kernel = attention_kernel(
        D, D, 0.5, (True, False, True, True), vector_registers=registers, lanes=lanes
    )
    lib = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), LLVM)
    args = [q, np.ascontiguousarray(k.transpose(0, 1, 3, 2)), v, mask, np.zeros_like(q)]
    args = [tvm.runtime.tensor(a) for a in args]
    lib["main"](*args)
    ref = _reference(q, k, v, 0.5, mask)
    np.testing.assert_allclose(args[-1].numpy(), ref, rtol=1e-4, atol=1e-4)


def test_size_gate(monkeypatch):
    """Static S x N below MIN_STATIC_SCORES stays unfused, at or above it fuses; a symbolic
    sequence fuses whatever the gate; the default gate leaves a static S = 7 alone."""
    monkeypatch.setattr(fuse_attention, "MIN_STATIC_SCORES", 32 * 32)
    assert _fused(load_onnx(_onnx_model(s=31))) == 0
    assert _fused(load_onnx(_onnx_model(s=32))) == 1
    assert _fused(load_onnx(_onnx_model(s="S"))) == 1
    monkeypatch.undo()  # the module's own gate
    assert fuse_attention.MIN_STATIC_SCORES > 7 * 7
    assert _fused(load_onnx(_onnx_model(s=7))) == 0
    assert _fused(load_onnx(_onnx_model(s="S"))) == 1


def test_unmasked_fuses_from_512(monkeypatch):
    """The module's own gate: without a mask, a static S = N = 512 fuses (the kernel is faster
    than the unfused matmuls there) and gives softmax's numbers; 256 stays unfused."""
    monkeypatch.undo()  # the module's own gate
    assert _fused(load_onnx(_onnx_model(s=256))) == 0
    mod = load_onnx(_onnx_model(s=512))
    assert _fused(mod) == 1
    q, k, v = _qkv(512)
    ref = _reference(q, k, v, 1 / np.sqrt(D))
    np.testing.assert_allclose(_run(mod, [q, k, v]), ref, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# causal: the key blocks that the mask makes -inf whole are skipped


def _kernel_run(kernel, args, target=LLVM):
    lib = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target)
    args = [tvm.runtime.tensor(a) for a in args]
    lib["main"](*args)
    return args[-1].numpy()


@pytest.mark.parametrize("form", ["where", "add"])
@pytest.mark.parametrize("s", [13, 70, 133])
def test_causal_numbers(form, s):
    """Causal masks (where(tril, scores, -inf) and an added 0 / -inf one) at S = N = 13 (one
    partial key block), 70 (a whole block of 64 keys, the rest in 16-key sub-blocks and a
    clamped one) and 133 (tiles whose diagonal straddles the second and third blocks)."""
    from tvm_fusion.lower.attention import attention_kernel

    rng = np.random.default_rng(s)
    q, k, v = (rng.standard_normal((1, 2, s, D)).astype("float32") for _ in range(3))
    keep = np.tril(np.ones((s, s), bool))
    if form == "where":
        mask, fill = keep.reshape(1, 1, s, s), (float("-inf"), True)
    else:
        mask, fill = np.where(keep, 0, -np.inf).astype("float32").reshape(1, 1, s, s), None
    kernel = attention_kernel(D, D, 0.5, (False, False, True, True), where_fill=fill)
    kt = np.ascontiguousarray(k.transpose(0, 1, 3, 2))
    out = _kernel_run(kernel, [q, kt, v, mask, np.zeros_like(q)])
    np.testing.assert_allclose(out, _reference(q, k, v, 0.5, keep=keep), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("form", ["where", "add"])
def test_causal_blocks_skipped(form):
    """The blocks above the diagonal are not read: V is NaN at key 128 (the first of the third
    block of 64), which rows 0..127 do not see (probability 0; 0 x NaN is NaN unfused, so the
    reference zeroes it): their outputs are finite; rows 128.. see it: NaN. Reading the block
    (1.6e-38 x NaN) made every row NaN."""
    from tvm_fusion.lower.attention import KB, QB, attention_kernel

    s = 2 * KB + 5
    assert KB % QB == 0  # no tile straddles key 128
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, s, D)).astype("float32") for _ in range(3))
    keep = np.tril(np.ones((s, s), bool))
    if form == "where":
        mask, fill = keep.reshape(1, 1, s, s), (float("-inf"), True)
    else:
        mask, fill = np.where(keep, 0, -np.inf).astype("float32").reshape(1, 1, s, s), None
    kernel = attention_kernel(D, D, 0.5, (False, False, True, True), where_fill=fill)
    kt = np.ascontiguousarray(k.transpose(0, 1, 3, 2))
    ref = _reference(q, k, v, 0.5, keep=keep)
    v[:, :, 2 * KB] = np.nan
    out = _kernel_run(kernel, [q, kt, v, mask, np.zeros_like(q)])
    np.testing.assert_allclose(out[:, :, : 2 * KB], ref[:, :, : 2 * KB], rtol=1e-4, atol=1e-4)
    assert np.isnan(out[:, :, 2 * KB :]).all()


def test_causal_fuses_below_size_gate(monkeypatch):
    """Below the size gate a mask that can skip blocks fuses (the ONNX causal Where, torch's
    is_causal at a static length); no mask, or an added mask of any values, stays unfused."""
    monkeypatch.undo()  # the module's own gate
    assert _fused(load_onnx(_onnx_model(s=33, causal_where=True))) == 1
    assert _fused(load_onnx(_onnx_model(s=33))) == 0
    assert _fused(load_onnx(_onnx_model(s=33, mask=(B, 1, 33, 33)))) == 0
    q, k, v = (torch.from_numpy(a) for a in _qkv(33))
    module = _SDPA(causal=True)
    mod = import_exported_program(torch.export.export(module, (q, k, v)))
    assert _fused(mod) == 1
    with torch.no_grad():
        ref = module(q, k, v).numpy()
    np.testing.assert_allclose(_run(mod, [q.numpy(), k.numpy(), v.numpy()]), ref, atol=1e-4)


@pytest.mark.parametrize(
    "target",
    [
        {"kind": "llvm", "mcpu": "skylake-avx512"},
        {"kind": "llvm", "mcpu": "x86-64-v3"},
        {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-v1"},
    ],
    ids=["avx512", "x86-64-v3", "neoverse-v1"],
)
def test_causal_kernel_builds(target):
    """The causal graph through the pipeline for AVX-512, AVX2 and AArch64 targets (their
    registers and lanes size the blocks): it fuses and compiles (not run: another CPU)."""
    target = tvm.target.Target(target)
    mod = load_onnx(_onnx_model(s=33, causal_where=True))
    with collect_rewrites() as counts:
        tvm.compile(mod, target, relax_pipeline="tvm_fusion")
    assert counts["FuseAttention"] == 1


if __name__ == "__main__":
    tvm.testing.main()
