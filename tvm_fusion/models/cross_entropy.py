"""Cross-entropy workloads (nvFuser #2556).

- ``cross_entropy``: ``log_softmax(logits) -> gather(targets) -> mean over non-ignored rows``
  with ``ignore_index=-100``, written the way exporters decompose it (where / gather_elements /
  sum / divide), at logits (512, 32768).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax import op as R

from . import Instance, register
from ._build import dim, onnx_input, onnx_model, randn, rng, tensor_var

IGNORE_INDEX = -100


def _log_softmax_np(x: np.ndarray) -> np.ndarray:
    xd = x.astype("float64")
    m = xd.max(axis=-1, keepdims=True)
    return xd - m - np.log(np.exp(xd - m).sum(axis=-1, keepdims=True))


def cross_entropy_np(x, t, ignore_index: int = IGNORE_INDEX) -> np.ndarray:
    """PyTorch's ``F.cross_entropy(x, t, ignore_index=...)`` with mean reduction, in NumPy."""
    lsm = _log_softmax_np(x)
    valid = t != ignore_index
    picked = np.take_along_axis(lsm, np.where(valid, t, 0)[:, None], axis=1)[:, 0]
    count = valid.sum()
    total = np.where(valid, -picked, 0.0).sum()
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.array(total / count, dtype=x.dtype)


@register(
    "cross_entropy",
    "cross_entropy",
    "log_softmax(x) -> gather targets -> mean over non-ignored rows (ignore_index=-100)",
)
def cross_entropy(size: str = "seed", dynamic: bool = False) -> Instance:
    n_val, vocab = (512, 32768) if size == "seed" else (8, 96)
    gen = rng(2556)
    x_np = randn(gen, n_val, vocab, scale=2.0)
    t_np = gen.integers(0, vocab, size=n_val).astype("int64")
    t_np[::5] = IGNORE_INDEX  # some ignored rows, as padding makes

    n = dim("n", n_val, dynamic)
    x = tensor_var("logits", (n, vocab))
    t = tensor_var("targets", (n,), "int64")
    bb = relax.BlockBuilder()
    with bb.function("main", [x, t]):
        with bb.dataflow():
            lsm = bb.emit(R.nn.log_softmax(x, axis=-1))
            valid = bb.emit(R.not_equal(t, relax.const(IGNORE_INDEX, "int64")))
            safe = bb.emit(R.where(valid, t, relax.const(0, "int64")))
            picked = bb.emit(R.gather_elements(lsm, bb.emit(R.expand_dims(safe, 1)), axis=1))
            picked = bb.emit(R.squeeze(picked, axis=[1]))
            rows = bb.emit(R.where(valid, bb.emit(R.negative(picked)), relax.const(0.0, "float32")))
            total = bb.emit(R.sum(rows))
            count = bb.emit(R.sum(bb.emit(R.astype(valid, "float32"))))
            out = bb.emit_output(R.divide(total, count))
        bb.emit_func_output(out)

    def reference(logits, targets):
        return [cross_entropy_np(logits, targets)]

    from onnx import helper

    model = onnx_model(
        [
            helper.make_node(
                "SoftmaxCrossEntropyLoss",
                ["logits", "targets"],
                ["loss"],
                reduction="mean",
                ignore_index=IGNORE_INDEX,
            )
        ],
        [onnx_input("logits", "float32", ["n", vocab]), onnx_input("targets", "int64", ["n"])],
        [onnx_input("loss", "float32", [])],
        {},
    )

    def torch_fn(torch):
        def fn(logits, targets):
            return (torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX),)

        return fn

    return Instance(
        "cross_entropy",
        bb.get(),
        {"logits": x_np, "targets": t_np},
        reference,
        model,
        torch_fn,
        rtol=1e-4,
        atol=1e-5,
        expect="FuseCrossEntropy: one pass over the logits, no (N, V) log-probs",
    )


def nll_module(n, v, dtype="float32", weights=False, reduction="mean", ignore_index=IGNORE_INDEX):
    """``F.cross_entropy(x, t, weight=w, reduction=..., ignore_index=...)`` as PyTorch exports
    it: ``nll_loss(log_softmax(x), t, w)``; params ``x``, ``t`` and, with weights, ``w``."""
    x = relax.Var("x", relax.TensorType((n, v), dtype))
    t = relax.Var("t", relax.TensorType((n,), "int64"))
    params = [x, t]
    w = None
    if weights:
        w = relax.Var("w", relax.TensorType((v,), dtype))
        params.append(w)
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            lsm = bb.emit(R.nn.log_softmax(x, axis=-1))
            out = bb.emit_output(R.nn.nll_loss(lsm, t, w, reduction, ignore_index))
        bb.emit_func_output(out)
    return bb.get()


def cross_entropy_torch_np(
    x, t, w=None, reduction="mean", ignore_index=IGNORE_INDEX, label_smoothing=0.0
) -> np.ndarray:
    """PyTorch's ``F.cross_entropy`` with class-index targets, in float64 NumPy.

    ``(1 - eps) * nll + eps / V * smooth`` where ``smooth_i = -sum_j w_j log_softmax(x)_ij``,
    ignored rows count 0, and ``mean`` divides both terms by ``sum_i w[t_i]`` over the rows
    that are not ignored (PyTorch's ``cross_entropy_loss_label_smoothing``).
    """
    lsm = _log_softmax_np(x)
    v = x.shape[1]
    wv = np.ones(v) if w is None else w.astype("float64")
    valid = t != ignore_index
    safe = np.where(valid, t, 0)
    w_t = wv[safe] * valid
    nll = -lsm[np.arange(len(t)), safe] * w_t
    smooth = np.where(valid, -(lsm * wv[None, :]).sum(1), 0.0)
    if reduction == "none":
        nll_r, smooth_r = nll, smooth
    elif reduction == "sum":
        nll_r, smooth_r = nll.sum(), smooth.sum()
    else:
        with np.errstate(invalid="ignore", divide="ignore"):
            nll_r, smooth_r = nll.sum() / w_t.sum(), smooth.sum() / w_t.sum()
    eps = label_smoothing
    return np.asarray((1 - eps) * nll_r + eps / v * smooth_r)


def smoothed_module(
    n, v, label_smoothing=0.1, weights=False, reduction="mean", ignore_index=IGNORE_INDEX
):
    """``F.cross_entropy(x, t, weight=w, label_smoothing=eps, reduction=...)`` as
    ``torch.export(...).run_decompositions()`` writes it (torch 2.13): the log-softmax is read
    by a gather of the target column (of ``L * w`` when weighted) and by the row sum
    ``sum(L * w, 1)`` (``sum(L, 1)`` unweighted); params ``x``, ``t`` and, weighted, ``w``."""
    x = relax.Var("x", relax.TensorType((n, v), "float32"))
    t = relax.Var("t", relax.TensorType((n,), "int64"))
    params = [x, t]
    if weights:
        w = relax.Var("w", relax.TensorType((v,), "float32"))
        params.append(w)
    zero_i = relax.const(0, "int64")
    zero_f = relax.const(0.0, "float32")
    ignore = relax.const(ignore_index, "int64")
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            lsm = bb.emit(R.nn.log_softmax(x, axis=1))
            valid = bb.emit(R.not_equal(t, ignore))
            idx = bb.emit(R.expand_dims(bb.emit(R.where(valid, t, zero_i)), 1))
            source = lsm
            if weights:
                source = bb.emit(R.multiply(lsm, bb.emit(R.reshape(w, [1, v]))))
            picked = bb.emit(R.squeeze(bb.emit(R.gather_elements(source, idx, axis=1)), [1]))
            nll = bb.emit(R.where(valid, bb.emit(R.negative(picked)), zero_f))
            if weights:
                smooth_src = bb.emit(R.multiply(lsm, bb.emit(R.reshape(w, [1, v]))))
                denom = bb.emit(
                    R.where(valid, bb.emit(R.take(w, R.where(valid, t, zero_i))), zero_f)
                )
            else:
                smooth_src = lsm
                denom = bb.emit(R.astype(valid, "float32"))
            smooth = bb.emit(R.negative(bb.emit(R.sum(smooth_src, axis=[1]))))
            smooth = bb.emit(R.where(valid, smooth, zero_f))
            if reduction == "none":
                nll_r, smooth_r = nll, smooth
            elif reduction == "sum":
                nll_r, smooth_r = bb.emit(R.sum(nll)), bb.emit(R.sum(smooth))
            else:
                total = bb.emit(R.sum(denom))
                nll_r = bb.emit(R.divide(bb.emit(R.sum(nll)), total))
                smooth_r = bb.emit(R.divide(bb.emit(R.sum(smooth)), total))
            eps = label_smoothing
            out = R.add(
                bb.emit(R.multiply(nll_r, relax.const(1.0 - eps, "float32"))),
                bb.emit(R.multiply(smooth_r, relax.const(eps / v, "float32"))),
            )
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get()


def lm_head_module(n, hidden, vocab, reduction="mean") -> tvm.IRModule:
    """``nll_loss(log_softmax(hidden @ weight^T), targets)``: an LM head's loss as exported,
    params ``hidden`` (N, hidden), ``weight`` (vocab, hidden), ``targets`` (N,)."""
    h = tensor_var("hidden", (n, hidden))
    w = tensor_var("weight", (vocab, hidden))
    t = tensor_var("targets", (n,), "int64")
    bb = relax.BlockBuilder()
    with bb.function("main", [h, w, t]):
        with bb.dataflow():
            logits = bb.emit(R.matmul(h, bb.emit(R.permute_dims(w))))
            lsm = bb.emit(R.nn.log_softmax(logits, axis=-1))
            out = bb.emit_output(R.nn.nll_loss(lsm, t, reduction=reduction))
        bb.emit_func_output(out)
    return bb.get()


@register(
    "linear_cross_entropy",
    "cross_entropy",
    "LM head: hidden @ W^T -> cross entropy (mean over non-ignored rows), W a runtime input",
)
def linear_cross_entropy(size: str = "seed", dynamic: bool = False) -> Instance:
    """Issue #6's fused linear cross entropy at hidden 1024, V 32000, N 2048 (seed): the
    (N, V) logits are 262 MB. The weight is an input, as in training."""
    n_val, hidden, vocab = (2048, 1024, 32000) if size == "seed" else (96, 32, 200)
    gen = rng(6)
    h_np = randn(gen, n_val, hidden)
    w_np = randn(gen, vocab, hidden, scale=hidden**-0.5)
    t_np = gen.integers(0, vocab, size=n_val).astype("int64")
    t_np[::7] = IGNORE_INDEX

    mod = lm_head_module(dim("n", n_val, dynamic), hidden, vocab)

    def reference(hidden_states, weight, targets):
        logits = hidden_states.astype("float64") @ weight.astype("float64").T
        return [cross_entropy_np(logits, targets).astype("float32")]

    from onnx import helper

    model = onnx_model(
        [
            helper.make_node("Transpose", ["weight"], ["weight_t"], perm=[1, 0]),
            helper.make_node("MatMul", ["hidden", "weight_t"], ["logits"]),
            helper.make_node(
                "SoftmaxCrossEntropyLoss",
                ["logits", "targets"],
                ["loss"],
                reduction="mean",
                ignore_index=IGNORE_INDEX,
            ),
        ],
        [
            onnx_input("hidden", "float32", ["n", hidden]),
            onnx_input("weight", "float32", [vocab, hidden]),
            onnx_input("targets", "int64", ["n"]),
        ],
        [onnx_input("loss", "float32", [])],
        {},
    )

    def torch_fn(torch):
        def fn(hidden_states, weight, targets):
            logits = hidden_states @ weight.T
            return (torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX),)

        return fn

    skip = {}
    if size == "seed":
        skip["tvm-stock"] = (
            "stock leaves the 134 GFLOP GEMM unscheduled on CPU (~0.2 GFLOP/s measured on "
            "swiglu): about 10 minutes a call; its planned memory is compared in "
            "scripts/bench_capabilities.py --only linear_ce"
        )
    return Instance(
        "linear_cross_entropy",
        mod,
        {"hidden": h_np, "weight": w_np, "targets": t_np},
        reference,
        model,
        torch_fn,
        rtol=1e-4,
        atol=1e-4,
        expect="FuseLinearCrossEntropy: logits in row chunks, never (N, V) at once",
        skip=skip,
    )
