"""FuseLinearCrossEntropy: ``hidden @ W^T -> cross entropy`` in row chunks.

The pass reads what FuseCrossEntropy emits, so every case runs both (``_passes``). Chunks are
forced small (``rows=``) so that small shapes split.

Must not fire: logits also returned, N within one chunk (static, or a symbolic N whose
``tir_var_upper_bound`` fits one chunk), symbolic V.
"""

import numpy as np
import pytest
import tvm
import tvm.testing
from helpers import Base, run
from tvm import relax, tirx
from tvm.relax import op as R

import tvm_fusion
from tvm_fusion import analysis, models
from tvm_fusion.build import engine
from tvm_fusion.models.cross_entropy import cross_entropy_np
from tvm_fusion.transform import FuseCrossEntropy, FuseLinearCrossEntropy, collect_rewrites
from tvm_fusion.transform._common import prove_equal_shapes
from tvm_fusion.transform.fuse_cross_entropy import GRAD_NAME, cross_entropy_rows
from tvm_fusion.transform.fuse_linear_cross_entropy import (
    LOGITS_GRAD_NAME,
    ROWS_GRAD_NAME,
    chunk_rows,
    linear_logits,
    rows_to,
)

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


def _passes(rows, chunks=8):
    return tvm.transform.Sequential(
        [FuseCrossEntropy(CUDA), FuseLinearCrossEntropy(CUDA, rows=rows, chunks=chunks)]
    )


class LCEBase(Base):
    transform = _passes(4)


def _lm(n, k, v, bias=False, returned=False, transposed=True, batch=None, bound=None):
    """``nll_loss(log_softmax(h @ W^T (+ b)))``; ``batch`` makes h ``(batch, n // batch, k)``
    with the logits reshaped to ``(n, v)`` (an LM head over sequences); a symbolic ``batch``
    (``n = batch * seq``) gives h ``(batch, seq, k)``. ``bound``: ``tir_var_upper_bound``."""
    if isinstance(batch, tirx.Var):
        h_shape = (batch, n // batch if isinstance(n, int) else n.b, k)
    else:
        h_shape = (batch, n // batch, k) if batch else (n, k)
    h = relax.Var("h", relax.TensorType(h_shape, "float32"))
    w = relax.Var("w", relax.TensorType((v, k) if transposed else (k, v), "float32"))
    t = relax.Var("t", relax.TensorType((n,), "int64"))
    params = [h, w, t]
    if bias:
        b = relax.Var("b", relax.TensorType((1, v) if bias == "2d" else (v,), "float32"))
        params.append(b)
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            wt = bb.emit(R.permute_dims(w)) if transposed else w
            logits = bb.emit(R.matmul(h, wt))
            if bias:
                logits = bb.emit(R.add(logits, b))
            if batch is not None:
                logits = bb.emit(R.reshape(logits, [n, v]))
            lsm = bb.emit(R.nn.log_softmax(logits, axis=-1))
            loss = bb.emit(R.nn.nll_loss(lsm, t, reduction="sum"))
            if returned:
                out = bb.emit_output(relax.Tuple([loss, logits]))
            else:
                out = bb.emit_output(loss)
        bb.emit_func_output(out)
    mod = bb.get()
    if bound:
        mod["main"] = mod["main"].with_attr("tir_var_upper_bound", bound)
    return mod


def _expected(n, k, v, rows):
    """What the two passes make of ``_lm(n, k, v)``, written out."""
    h = relax.Var("h", relax.TensorType((n, k), "float32"))
    w = relax.Var("w", relax.TensorType((v, k), "float32"))
    t = relax.Var("t", relax.TensorType((n,), "int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [h, w, t]):
        with bb.dataflow():
            bounds = list(range(rows, n, rows))
            h_parts = bb.emit(R.split(h, bounds, axis=0))
            t_parts = bb.emit(R.split(t, bounds, axis=0))
            pieces = []
            for i in range(len(bounds) + 1):
                h_c = bb.emit(R.grad.start_checkpoint(relax.TupleGetItem(h_parts, i)))
                logits = bb.emit(
                    bb.call_te_with_grad(
                        linear_logits,
                        h_c,
                        w,
                        te_grad_name=LOGITS_GRAD_NAME,
                        primfunc_name_hint="linear_logits",
                    )
                )
                logits = bb.emit(R.grad.end_checkpoint(logits))
                pieces.append(
                    bb.emit(
                        bb.call_te_with_grad(
                            cross_entropy_rows,
                            logits,
                            relax.TupleGetItem(t_parts, i),
                            False,
                            te_grad_name=GRAD_NAME,
                            te_grad_kwargs={"fast_exp": False},
                            primfunc_name_hint="cross_entropy_rows_chunk",
                        )
                    )
                )
            packed = bb.emit(R.concat(pieces, axis=0))
            parts = bb.emit(R.split(packed, 2, axis=1))
            lse = bb.emit(R.squeeze(bb.emit(relax.TupleGetItem(parts, 0)), [1]))
            xt = bb.emit(R.squeeze(bb.emit(relax.TupleGetItem(parts, 1)), [1]))
            valid = bb.emit(R.not_equal(t, relax.const(-100, "int64")))
            validf = bb.emit(R.astype(valid, "float32"))
            rows_loss = bb.emit(R.multiply(bb.emit(R.subtract(lse, xt)), validf))
            out = bb.emit_output(bb.emit(R.sum(rows_loss)))
        bb.emit_func_output(out)
    return bb.get()


def _expected_symbolic(n, k, v, chunks):
    """What the two passes make of ``_lm(n, k, v)`` for a symbolic ``n``: ``chunks`` equal
    chunks of the rows padded to a multiple of ``chunks``, the statistics cut back to ``n``."""
    h = relax.Var("h", relax.TensorType((n, k), "float32"))
    w = relax.Var("w", relax.TensorType((v, k), "float32"))
    t = relax.Var("t", relax.TensorType((n,), "int64"))
    c = tirx.floordiv(n + (chunks - 1), chunks)
    bb = relax.BlockBuilder()

    def rows(x, count):
        return bb.emit(
            bb.call_te_with_grad(
                rows_to, x, count, te_grad_name=ROWS_GRAD_NAME, primfunc_name_hint="rows_to"
            )
        )

    with bb.function("main", [h, w, t]):
        with bb.dataflow():
            h_pad, t_pad = rows(h, chunks * c), rows(t, chunks * c)
            h_pad = bb.emit(R.reshape(h_pad, [chunks, c, k]))
            t_pad = bb.emit(R.reshape(t_pad, [chunks, c]))
            h_parts = bb.emit(R.split(h_pad, chunks, axis=0))
            t_parts = bb.emit(R.split(t_pad, chunks, axis=0))
            pieces = []
            for i in range(chunks):
                h_i = bb.emit(R.squeeze(relax.TupleGetItem(h_parts, i), [0]))
                t_i = bb.emit(R.squeeze(relax.TupleGetItem(t_parts, i), [0]))
                h_c = bb.emit(R.grad.start_checkpoint(h_i))
                logits = bb.emit(
                    bb.call_te_with_grad(
                        linear_logits,
                        h_c,
                        w,
                        te_grad_name=LOGITS_GRAD_NAME,
                        primfunc_name_hint="linear_logits",
                    )
                )
                logits = bb.emit(R.grad.end_checkpoint(logits))
                stats = bb.emit(
                    bb.call_te_with_grad(
                        cross_entropy_rows,
                        logits,
                        t_i,
                        False,
                        te_grad_name=GRAD_NAME,
                        te_grad_kwargs={"fast_exp": False},
                        primfunc_name_hint="cross_entropy_rows_chunk",
                    )
                )
                pieces.append(stats)
            stacked = bb.emit(R.concat([bb.emit(R.expand_dims(p, 0)) for p in pieces], axis=0))
            count, c, _ = stacked.ty.shape.values
            flat = bb.emit(R.reshape(stacked, [count * c, 2]))
            packed = rows(flat, n)
            parts = bb.emit(R.split(packed, 2, axis=1))
            lse = bb.emit(R.squeeze(bb.emit(relax.TupleGetItem(parts, 0)), [1]))
            xt = bb.emit(R.squeeze(bb.emit(relax.TupleGetItem(parts, 1)), [1]))
            valid = bb.emit(R.not_equal(t, relax.const(-100, "int64")))
            validf = bb.emit(R.astype(valid, "float32"))
            rows_loss = bb.emit(R.multiply(bb.emit(R.subtract(lse, xt)), validf))
            out = bb.emit_output(bb.emit(R.sum(rows_loss)))
        bb.emit_func_output(out)
    return bb.get()


class TestChunked(LCEBase):
    """N = 12 in chunks of 4: three (4, V) logits chunks, never (12, V)."""

    Before = _lm(12, 8, 10)
    Expected = _expected(12, 8, 10, 4)


class TestNoFireLogitsReturned(LCEBase):
    """The logits are an output: they must exist whole."""

    Before = _lm(12, 8, 10, returned=True)
    Expected = FuseCrossEntropy(CUDA)(_lm(12, 8, 10, returned=True))


class TestChunkedSymbolicRows(Base):
    """Symbolic N (a dynamic export's batch * seq) with no upper bound: ``chunks`` (here 3)
    equal chunks of ``ceil(N / 3)`` rows, never the (N, V) logits."""

    transform = _passes(4, chunks=3)
    n = tirx.Var("n", "int64")
    Before = _lm(n, 8, 10)
    Expected = _expected_symbolic(n, 8, 10, 3)


class TestNoFireSymbolicRowsBoundedToOneChunk(LCEBase):
    """``tir_var_upper_bound`` says N <= 4: one chunk of 4 rows holds it all."""

    n = tirx.Var("n", "int64")
    Before = _lm(n, 8, 10, bound={"n": 4})
    Expected = FuseCrossEntropy(CUDA)(_lm(n, 8, 10, bound={"n": 4}))


class TestNoFireSymbolicVocabulary(LCEBase):
    v = tirx.Var("v", "int64")
    Before = _lm(12, 8, v)
    Expected = FuseCrossEntropy(CUDA)(_lm(12, 8, v))


class TestNoFireOneChunk(LCEBase):
    Before = _lm(4, 8, 10)
    Expected = FuseCrossEntropy(CUDA)(_lm(4, 8, 10))


def test_chunk_rows_from_budget():
    assert chunk_rows(32000) == 128  # 16 MiB of float32 logits at V = 32000
    assert chunk_rows(10**7) == 16  # at least 16 rows
    assert chunk_rows(1000, 1 << 20) == 256


# ---------------------------------------------------------------------------------------------
# Numerics


def _inputs(n, k, v, seed=0, bias=False, batch=None, transposed=True):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((batch, n // batch, k) if batch else (n, k)).astype("float32")
    w = (rng.standard_normal((v, k)) / np.sqrt(k)).astype("float32")
    t = rng.integers(0, v, n).astype("int64")
    t[::5] = -100
    args = [h, w if transposed else np.ascontiguousarray(w.T), t]
    if bias:
        args.append(rng.standard_normal((1, v) if bias == "2d" else v).astype("float32"))
    return args


def _reference(h, w, t, b=None, transposed=True):
    logits = h.reshape(-1, h.shape[-1]).astype("float64") @ (w.T if transposed else w)
    if b is not None:
        logits = logits + b
    valid = t != -100
    m = logits.max(1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(1, keepdims=True)))[:, 0]
    picked = logits[np.arange(len(t)), np.where(valid, t, 0)]
    return np.array(((lse - picked) * valid).sum())


@pytest.mark.parametrize(
    ("bias", "batch", "transposed"),
    [
        (False, None, True),
        (True, None, True),
        ("2d", None, True),
        (False, 2, True),
        (True, None, False),
    ],
)
def test_chunked_matches_stock(bias, batch, transposed):
    n, k, v = 40, 16, 50
    mod = _lm(n, k, v, bias=bias, batch=batch, transposed=transposed)
    args = _inputs(n, k, v, bias=bias, batch=batch, transposed=transposed)
    target = tvm_fusion.host_target()
    with collect_rewrites() as counts:
        chunked = _passes(16)(mod)
    assert counts["FuseLinearCrossEntropy"] == 1
    ref = _reference(*args, transposed=transposed)
    ours_out, ours = run(chunked, args, "tvm_fusion", target)
    stock_out, _ = run(mod, args, "stock", target)
    np.testing.assert_allclose(ours_out[0], ref, rtol=1e-4)
    np.testing.assert_allclose(stock_out[0], ref, rtol=1e-4)
    allocs = analysis.allocations(ours.lowered)
    assert all(a.elements < n * v for a in allocs if a.elements)  # no whole logits


@pytest.mark.parametrize(("bias", "batched"), [(False, False), (True, False), (False, True)])
def test_symbolic_rows_match_reference(bias, batched):
    """Symbolic N (and a symbolic (batch, seq) LM head): equal chunks, fed at N = 1 (empty
    chunks), 7 (fewer rows than chunks is not possible: 8 chunks of 1) and 43 (a padded last
    chunk)."""
    k, v = 16, 37
    if batched:
        b, sq = tirx.Var("b", "int64"), tirx.Var("s", "int64")
        mod = _lm(b * sq, k, v, bias=bias, batch=b)
        sizes = [(1, 1), (1, 7), (1, 43), (3, 5)]
    else:
        n = tirx.Var("n", "int64")
        mod = _lm(n, k, v, bias=bias)
        sizes = [(None, 1), (None, 7), (None, 43)]
    with collect_rewrites() as counts:
        chunked = _passes(4, chunks=8)(mod)
    assert counts["FuseLinearCrossEntropy"] == 1
    compiled = engine.compile_module(chunked, tvm_fusion.host_target(), "tvm_fusion")
    for batch, rows in sizes:
        n_rows = rows * (batch or 1)
        args = _inputs(n_rows, k, v, seed=n_rows, bias=bias, batch=batch)
        got = engine.TvmRunner(compiled, args).outputs()[0]
        np.testing.assert_allclose(got, _reference(*args), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("transposed", [True, False])
def test_symbolic_rows_chunk_count_from_upper_bound(transposed):
    """``tir_var_upper_bound`` n <= 1000 at 64 rows a chunk: 16 chunks, each at most 63 rows,
    and the memory planner gives them static storage: planned peak <= 1/4 of stock's. With a
    (K, V) weight (ONNX's MatMul) the chunks are relax matmuls, whose rows the planner bounded
    by the split offsets ((i + 1) * C_max) before the chunks came from a (P, C, K) view."""
    n = tirx.Var("n", "int64")
    k, v = 32, 4096
    mod = _lm(n, k, v, bound={"n": 1000}, transposed=transposed)
    fused = _passes(64)(mod)
    script = fused["main"].script()
    assert script.count("cross_entropy_rows_chunk") == 16
    target = tvm_fusion.host_target()
    stock = engine.compile_module(mod, target, "stock")
    ours = engine.compile_module(fused, target, "tvm_fusion")
    stock_peak, ours_peak = analysis.peak_bytes(stock.lowered), analysis.peak_bytes(ours.lowered)
    assert stock_peak is not None and ours_peak is not None
    assert stock_peak >= 2 * 1000 * v * 4  # logits and log-probs at the bound
    assert ours_peak <= stock_peak / 4
    args = _inputs(999, k, v, seed=9, transposed=transposed)
    got = engine.TvmRunner(ours, args).outputs()[0]
    np.testing.assert_allclose(got, _reference(*args, transposed=transposed), rtol=1e-4)


def test_prove_equal_shapes_on_exporter_spellings():
    """torch.export spells ``s - 1`` two ways for ``logits[:, :-1]`` and ``labels[:, 1:]``."""
    s, b = tirx.Var("s", "int64"), tirx.Var("b", "int64")
    big = tirx.const(2**63 - 1, "int64")
    sliced = b * tirx.min(tirx.max(s - 1, 0), s)
    assert prove_equal_shapes(sliced, b * (tirx.min(big, s) - tirx.min(1, s)))
    assert not prove_equal_shapes(sliced, b * s)
    assert not prove_equal_shapes(tirx.max(s - 1, 1), s - 1)  # differs at s = 0 and 1


def _torch_lm_head(k, v, bias):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(k, v, bias=bias)

        def forward(self, hidden, labels):  # GPT-2's loss: predict token i + 1 from i
            logits = self.lm_head(hidden)
            shifted = logits[:, :-1, :].contiguous()
            return F.cross_entropy(shifted.view(-1, v), labels[:, 1:].contiguous().view(-1))

    torch.manual_seed(0)
    return torch, Head().eval()


@pytest.mark.parametrize("bias", [False, True])
def test_torch_export_shifted_lm_head_is_chunked(bias):
    """``torch.export`` of an LM head with GPT-2's shifted labels, dynamic (batch, seq): the
    slice and views between the matmul and the loss move to the hidden states, the chunk count
    comes from the export's ``Dim`` bounds, results match torch at odd sizes."""
    from tvm.relax.frontend.torch import from_exported_program

    k, v = 16, 37
    torch, head = _torch_lm_head(k, v, bias)
    dims = {0: torch.export.Dim("batch", max=8), 1: torch.export.Dim("seq", min=3, max=64)}
    example = (torch.randn(2, 9, k), torch.randint(0, v, (2, 9)))
    program = torch.export.export(head, example, dynamic_shapes={"hidden": dims, "labels": dims})
    mod = from_exported_program(program, keep_params_as_input=False)
    with collect_rewrites() as counts:
        fused = _passes(32)(mod)
    assert counts["FuseCrossEntropy"] == 1 and counts["FuseLinearCrossEntropy"] == 1
    script = fused["main"].script()
    assert script.count("cross_entropy_rows_chunk") == 16  # 8 * 63 rows at most, 32 a chunk
    compiled = engine.compile_module(fused, tvm_fusion.host_target(), "tvm_fusion")
    for batch, seq in [(1, 3), (3, 7), (2, 61)]:
        hidden, labels = torch.randn(batch, seq, k), torch.randint(0, v, (batch, seq))
        labels[0, 1] = -100
        expect = head(hidden, labels).detach().numpy()
        got = engine.TvmRunner(compiled, [hidden.numpy(), labels.numpy()]).outputs()[0]
        np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-5)


def test_onnx_shifted_lm_head_is_chunked(tmp_path):
    """The same head through ``torch.onnx.export`` (TorchScript exporter) and ``load_onnx``:
    a 3-D MatMul, ``NegativeLogLikelihoodLoss`` of targets whose row count the importer spells
    differently from the logits'; no upper bound, so 8 equal chunks."""
    k, v = 16, 37
    torch, head = _torch_lm_head(k, v, bias=False)
    import onnx

    path = tmp_path / "head.onnx"
    torch.onnx.export(
        head,
        (torch.randn(2, 9, k), torch.randint(0, v, (2, 9))),
        str(path),
        input_names=["hidden", "labels"],
        dynamic_axes={name: {0: "batch", 1: "seq"} for name in ("hidden", "labels")},
        dynamo=False,
    )
    mod = tvm_fusion.load_onnx(onnx.load(str(path)))
    with collect_rewrites() as counts:
        fused = _passes(32)(mod)
    assert counts["FuseCrossEntropy"] == 1 and counts["FuseLinearCrossEntropy"] == 1
    assert fused["main"].script().count("cross_entropy_rows_chunk") == 8
    compiled = engine.compile_module(fused, tvm_fusion.host_target(), "tvm_fusion")
    for batch, seq in [(1, 2), (3, 7), (2, 40)]:
        hidden, labels = torch.randn(batch, seq, k), torch.randint(0, v, (batch, seq))
        labels[0, -1] = -100
        expect = head(hidden, labels).detach().numpy()
        got = engine.TvmRunner(compiled, [hidden.numpy(), labels.numpy()]).outputs()[0]
        np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-5)


def test_workload_small_numbers_and_pass_fires():
    inst = models.build("linear_cross_entropy", "small")
    target = tvm_fusion.host_target()
    mod = _passes(32)(inst.mod)
    out, _ = run(mod, inst.input_list(), "tvm_fusion", target)
    expect = inst.reference(*inst.input_list())[0]
    np.testing.assert_allclose(out[0], expect, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        expect,
        cross_entropy_np(inst.inputs["hidden"] @ inst.inputs["weight"].T, inst.inputs["targets"]),
        rtol=1e-4,
    )


def test_peak_memory_quarter_of_unfused():
    """Planned peak bytes (VM storage plus the largest kernel scratch): chunked <= 1/4 of the
    unfused graph compiled by stock, at shapes where the logits dominate as they do at
    N 2048, V 32000."""
    n, k, v = 1024, 32, 4096
    mod = _lm(n, k, v)
    target = tvm_fusion.host_target()
    stock = engine.compile_module(mod, target, "stock")
    ours = engine.compile_module(_passes(64)(mod), target, "tvm_fusion")
    stock_peak, ours_peak = analysis.peak_bytes(stock.lowered), analysis.peak_bytes(ours.lowered)
    assert stock_peak >= 2 * n * v * 4  # logits and log-probs: the check can fail
    assert ours_peak <= stock_peak / 4


# ---------------------------------------------------------------------------------------------
# Gradient


def _adjoint(mod, args, fuse: bool, rows=16):
    target = tvm_fusion.host_target()
    if fuse:
        mod = _passes(rows)(mod)
    params = mod["main"].params
    grad_mod = relax.transform.Gradient("main", require_grads=[params[0], params[1]])(mod)
    compiled = engine.compile_module(grad_mod, target, "tvm_fusion" if fuse else "stock")
    runner = engine.TvmRunner(compiled, args, function="main_adjoint")
    return runner.outputs(), compiled, grad_mod


def test_gradient_recomputes_chunks_and_matches_stock():
    n, k, v = 48, 16, 40
    mod = _lm(n, k, v)
    args = _inputs(n, k, v, seed=3)
    ours, compiled, grad_mod = _adjoint(mod, args, fuse=True)
    stock, _, _ = _adjoint(mod, args, fuse=False)
    for got, expect in zip(ours, stock, strict=True):
        np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-5)
    script = grad_mod["main_adjoint"].script()
    assert "_cp" in script  # the checkpointed logits are recomputed in the backward
    allocs = analysis.allocations(compiled.lowered)
    assert all(a.elements < n * v for a in allocs if a.elements)


def test_gradient_with_bias_matches_finite_differences():
    n, k, v = 20, 6, 9
    mod = _lm(n, k, v, bias=True)
    args = _inputs(n, k, v, seed=4, bias=True)
    target = tvm_fusion.host_target()
    fused = _passes(8)(mod)
    params = fused["main"].params
    grad_mod = relax.transform.Gradient("main", require_grads=[params[1], params[3]])(fused)
    compiled = engine.compile_module(grad_mod, target, "tvm_fusion")
    outs = engine.TvmRunner(compiled, args, function="main_adjoint").outputs()
    dw, db = outs[1], outs[2]
    h, w, t, b = (a.astype("float64") if a.dtype != np.int64 else a for a in args)
    eps = 1e-6
    for which, grad in ((1, dw), (3, db)):
        base = [h, w, t, b]
        flat = base[which].reshape(-1)
        numeric = np.zeros_like(flat)
        for i in range(flat.size):
            plus, minus = flat.copy(), flat.copy()
            plus[i] += eps
            minus[i] -= eps
            up = list(base)
            up[which] = plus.reshape(base[which].shape)
            down = list(base)
            down[which] = minus.reshape(base[which].shape)
            numeric[i] = (_reference(*up) - _reference(*down)) / (2 * eps)
        np.testing.assert_allclose(grad.reshape(-1), numeric, rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# CUDA, flags


def test_cuda_compiles_chunked_forward():
    mod = _passes(16)(_lm(40, 16, 50))
    lowered = engine.compile_module(mod, CUDA, "tvm_fusion").lowered
    names = [gv.name_hint for gv in lowered.get_global_vars()]
    assert any(name.startswith("linear_logits") for name in names)


def test_disabled_by_flag():
    mod = _lm(40, 16, 50)
    target = tvm_fusion.host_target()
    seq = FuseLinearCrossEntropy(target, rows=16)
    with tvm.transform.PassContext(disabled_pass=["FuseLinearCrossEntropy"]):
        with collect_rewrites() as counts:
            tvm.transform.Sequential([FuseCrossEntropy(target), seq])(mod)
    assert counts["FuseLinearCrossEntropy"] == 0
    flags = tvm_fusion.build.pipeline.pass_flags()
    assert "fuse_linear_cross_entropy" in flags


if __name__ == "__main__":
    tvm.testing.main()
