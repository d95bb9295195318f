"""FuseCrossEntropy on the spellings of cross entropy that exporters produce (issue #25).

Each spelling is imported as a user imports it (``tvm_fusion.load_onnx``, or ``torch.export``
with a dynamic batch and ``from_exported_program``). It must fuse into the one row kernel (one
rewrite; no log-softmax, softmax or log left after the graph passes; no (N, V) tensor after
FuseOps and FuseTIR) and the llvm build must match ONNX Runtime / torch at two batch sizes, one
odd, from one build.

Structural: the ONNX importer's negative-index ``where(t < 0, t + V, t)`` (with ``V`` read from
``shape_of`` of the log-probs) is looked through; ``log(softmax)`` is read as ``log_softmax``.
Must not fire: log of a softmax over the rows, log of a softmax whose probabilities are also
returned. Not looked through: a ``where`` adding another value than ``V`` (the kernel reads its
result).
"""

import numpy as np
import pytest
import tvm
import tvm.testing
from helpers import Base
from tvm import relax, tirx
from tvm.relax import op as R
from tvm.script import ir as I
from tvm.script import relax as RS

import tvm_fusion
from tvm_fusion.build import engine, pipeline
from tvm_fusion.models._build import onnx_input, onnx_model
from tvm_fusion.transform import FuseCrossEntropy, collect_rewrites
from tvm_fusion.transform._common import prove_equal
from tvm_fusion.transform.fuse_cross_entropy import GRAD_NAME, cross_entropy_rows

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
V = 1003  # not a multiple of 16
BATCHES = (5, 12)


class CEBase(Base):
    transform = FuseCrossEntropy(CUDA)


def _fused_gather(n, v, index=None):
    """Expected: the kernel reading the (N, 1) targets ``t`` (or what ``index(bb, t)`` emits
    from them), the gather's value ``x_t - lse`` as (N, 1)."""
    x = relax.Var("x", relax.TensorType((n, v), "float32"))
    t = relax.Var("t", relax.TensorType((n, 1), "int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, t]):
        with bb.dataflow():
            idx = index(bb, t) if index else t
            tt = bb.emit(R.squeeze(idx, [1]))
            packed = bb.emit(
                bb.call_te_with_grad(
                    cross_entropy_rows,
                    x,
                    tt,
                    False,
                    te_grad_name=GRAD_NAME,
                    te_grad_kwargs={"fast_exp": False},
                    primfunc_name_hint="cross_entropy_rows",
                )
            )
            parts = bb.emit(R.split(packed, 2, axis=1))
            lse = bb.emit(R.squeeze(bb.emit(relax.TupleGetItem(parts, 0)), [1]))
            xt = bb.emit(R.squeeze(bb.emit(relax.TupleGetItem(parts, 1)), [1]))
            picked = bb.emit(R.subtract(xt, lse))
            out = bb.emit_output(R.expand_dims(picked, [1]))
        bb.emit_func_output(out)
    return bb.get()


_n = tirx.Var("n", "int64")


class TestLooksThroughNegativeIndexWhere(CEBase):
    """What ``load_onnx`` makes of ``LogSoftmax -> GatherElements``: the targets pass through
    ``where(t < 0, t + V, t)``, V read from ``shape_of`` of the log-probs. The kernel reads
    ``t`` itself (it picks ``t mod V``); the where and the shape ops go."""

    @I.ir_module
    class Before:
        @RS.function
        def main(x: RS.Tensor(("n", 50), "float32"), t: RS.Tensor(("n", 1), "int64")):
            with RS.dataflow():
                lsm = RS.nn.log_softmax(x, axis=1)
                shape = RS.shape_of(lsm)
                dims = RS.shape_to_tensor(shape)
                neg = RS.less(t, RS.const(0, "int64"))
                v = RS.take(dims, RS.const(1, "int64"), axis=0, mode="wrap")
                up = RS.add(t, v)
                idx = RS.where(neg, up, t)
                g = RS.gather_elements(lsm, idx, axis=1)
                RS.output(g)
            return g

    Expected = _fused_gather(_n, 50)


class TestLooksThroughConstantExtent(CEBase):
    """The same normalisation with ``V`` as a constant (a static import after folding)."""

    @I.ir_module
    class Before:
        @RS.function
        def main(x: RS.Tensor(("n", 50), "float32"), t: RS.Tensor(("n", 1), "int64")):
            with RS.dataflow():
                lsm = RS.nn.log_softmax(x, axis=-1)
                neg = RS.less(t, RS.const(0, "int64"))
                up = RS.add(t, RS.const(50, "int64"))
                idx = RS.where(neg, up, t)
                g = RS.gather_elements(lsm, idx, axis=1)
                RS.output(g)
            return g

    Expected = _fused_gather(_n, 50)


def _keep_where(constant):
    def index(bb, t):
        neg = bb.emit(R.less(t, relax.const(0, "int64")))
        up = bb.emit(R.add(t, relax.const(constant, "int64")))
        return bb.emit(R.where(neg, up, t))

    return index


class TestKeepsWhereAddingAnotherValue(CEBase):
    """``t + 7`` is not the class count: the where stays and the kernel reads its result."""

    @I.ir_module
    class Before:
        @RS.function
        def main(x: RS.Tensor(("n", 50), "float32"), t: RS.Tensor(("n", 1), "int64")):
            with RS.dataflow():
                lsm = RS.nn.log_softmax(x, axis=-1)
                neg = RS.less(t, RS.const(0, "int64"))
                up = RS.add(t, RS.const(7, "int64"))
                idx = RS.where(neg, up, t)
                g = RS.gather_elements(lsm, idx, axis=1)
                RS.output(g)
            return g

    Expected = _fused_gather(_n, 50, _keep_where(7))


class TestLogOfSoftmax(CEBase):
    """``log(softmax(x))`` (ONNX ``Softmax -> Log``) is the log-softmax; the softmax goes."""

    @I.ir_module
    class Before:
        @RS.function
        def main(x: RS.Tensor(("n", 50), "float32"), t: RS.Tensor(("n", 1), "int64")):
            with RS.dataflow():
                p = RS.nn.softmax(x, axis=-1)
                lsm = RS.log(p)
                g = RS.gather_elements(lsm, t, axis=1)
                RS.output(g)
            return g

    Expected = _fused_gather(_n, 50)


class TestNoFireLogOfSoftmaxOverRows(CEBase):
    @I.ir_module
    class Before:
        @RS.function
        def main(x: RS.Tensor((4, 50), "float32"), t: RS.Tensor((1, 50), "int64")):
            with RS.dataflow():
                p = RS.nn.softmax(x, axis=0)
                lsm = RS.log(p)
                g = RS.gather_elements(lsm, t, axis=0)
                RS.output(g)
            return g

    Expected = Before


class TestNoFireProbabilitiesReturned(CEBase):
    """The kernel computes no probabilities: a softmax read elsewhere keeps the log too."""

    @I.ir_module
    class Before:
        @RS.function
        def main(x: RS.Tensor((4, 50), "float32"), t: RS.Tensor((4, 1), "int64")):
            with RS.dataflow():
                p = RS.nn.softmax(x, axis=-1)
                lsm = RS.log(p)
                g = RS.gather_elements(lsm, t, axis=1)
                RS.output(p, g)
            return (p, g)

    Expected = Before


# ---------------------------------------------------------------------------------------------
# ONNX spellings, imported with load_onnx, against ONNX Runtime


def _hand_written(variant: str, opset: int = 18, index_dtype: str = "int64"):
    """``-mean(log_softmax(x)[i, t_i])`` as exporters write it by hand. ``variant``: which
    log-probs (``logsoftmax`` / ``softmax_log``), then ``gather_mean``, ``gather_sum``,
    ``neg_first``, ``squeeze`` or ``nll``."""
    from onnx import TensorProto, helper

    probs, _, form = variant.partition(":")
    nodes = []
    if probs == "softmax_log":
        nodes.append(helper.make_node("Softmax", ["x"], ["p"], axis=-1 if opset >= 13 else 1))
        nodes.append(helper.make_node("Log", ["p"], ["lsm"]))
    else:
        axis = -1 if form in ("gather_sum", "squeeze") else 1
        nodes.append(helper.make_node("LogSoftmax", ["x"], ["lsm"], axis=axis))
    inits = {}
    if form == "nll":
        t = onnx_input("t", index_dtype, ["n"])
        nodes.append(helper.make_node("NegativeLogLikelihoodLoss", ["lsm", "t"], ["loss"]))
    else:
        t = onnx_input("t", index_dtype, ["n", 1])
        nodes.append(helper.make_node("GatherElements", ["lsm", "t"], ["g"], axis=1))
        picked = "g"
        if form == "squeeze":
            inits["axes"] = np.array([1], "int64")
            nodes.append(helper.make_node("Squeeze", ["g", "axes"], ["gs"]))
            picked = "gs"
        reduce = "ReduceSum" if form == "gather_sum" else "ReduceMean"
        if form == "neg_first":
            nodes.append(helper.make_node("Neg", [picked], ["neg"]))
            nodes.append(helper.make_node(reduce, ["neg"], ["loss"], keepdims=0))
        else:
            nodes.append(helper.make_node(reduce, [picked], ["r"], keepdims=0))
            nodes.append(helper.make_node("Neg", ["r"], ["loss"]))
    inputs = [onnx_input("x", "float32", ["n", V]), t]
    loss = helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])
    return onnx_model(nodes, inputs, [loss], inits, opset=opset)


def _loss_op(op: str, reduction: str, weights: bool, ignore):
    from onnx import helper

    inputs = [onnx_input("x", "float32", ["n", V]), onnx_input("t", "int64", ["n"])]
    names = ["x", "t"]
    if weights:
        inputs.append(onnx_input("w", "float32", [V]))
        names.append("w")
    attrs = {"reduction": reduction}
    if ignore is not None:
        attrs["ignore_index"] = ignore
    nodes = []
    if op == "NegativeLogLikelihoodLoss":
        nodes.append(helper.make_node("LogSoftmax", ["x"], ["lsm"], axis=1))
        names[0] = "lsm"
    nodes.append(helper.make_node(op, names, ["loss"], **attrs))
    out = onnx_input("loss", "float32", ["n"] if reduction == "none" else [])
    return onnx_model(nodes, inputs, [out], {}, opset=13)


def _fuse_graph(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """The module after our graph passes, and how many kernels FuseCrossEntropy made."""
    target = tvm_fusion.host_target()
    with target, collect_rewrites() as counts:
        out = tvm.transform.Sequential(tvm_fusion.fusion_passes(target))(mod)
    return out, counts["FuseCrossEntropy"]


def _assert_fused(mod: tvm.IRModule) -> None:
    fused, count = _fuse_graph(mod)
    assert count == 1
    script = fused["main"].script()
    for op in ("R.nn.log_softmax", "R.nn.softmax", "R.log(", "R.nn.nll_loss"):
        assert op not in script, op
    assert _wide_tensors(mod, pipeline.fused_passes) == []


def _wide_tensors(mod: tvm.IRModule, fused_passes) -> list[str]:
    """Tensors of V columns and more than one row (the log-probs) that ``main`` holds after
    legalisation, FuseOps and FuseTIR: what the build allocates."""
    target = tvm_fusion.host_target()
    with target:
        grouped = tvm.transform.Sequential(fused_passes(target))(mod)
    wide = []
    for block in grouped["main"].body.blocks:
        for binding in block.bindings:
            types = [binding.var.ty]
            types += list(getattr(binding.var.ty, "fields", []))
            for ty in types:
                if not isinstance(ty, relax.TensorType) or ty.ndim < 2:
                    continue
                if not isinstance(ty.shape, relax.ShapeExpr):
                    wide.append(binding.var.name)  # unknown: may be (N, V)
                elif prove_equal(ty.shape.values[-1], V) and not prove_equal(ty.shape.values[0], 1):
                    wide.append(binding.var.name)
    return wide


def _check_against(mod, feeds, expect) -> None:
    """One llvm build of ``mod``, run on each feed, against ``expect(feed)``."""
    compiled = engine.compile_module(mod, tvm_fusion.host_target(), "tvm_fusion")
    for feed in feeds:
        out = engine.TvmRunner(compiled, feed).outputs()
        ref = expect(feed)
        assert len(out) == len(ref)
        for got, want in zip(out, ref, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _ort(model):
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return lambda feed: sess.run(None, dict(zip(names, feed, strict=True)))


def _logits(rng, n):
    return rng.standard_normal((n, V)).astype("float32") * 3


@pytest.mark.parametrize(
    ("variant", "opset", "index_dtype"),
    [
        ("logsoftmax:gather_mean", 18, "int64"),  # LogSoftmax(1) -> GatherElements -> Mean, Neg
        ("logsoftmax:gather_sum", 18, "int64"),  # LogSoftmax(-1), ReduceSum
        ("logsoftmax:neg_first", 18, "int64"),  # Neg before the reduction
        ("logsoftmax:squeeze", 18, "int64"),  # Squeeze of the (N, 1)
        ("logsoftmax:gather_mean", 18, "int32"),  # int32 targets: V cast to int32
        ("logsoftmax:gather_mean", 12, "int64"),  # opset 12: reshapes around LogSoftmax
        ("softmax_log:gather_mean", 18, "int64"),  # Softmax -> Log
        ("softmax_log:gather_mean", 12, "int64"),  # opset 12: reshapes around Softmax
        ("softmax_log:nll", 18, "int64"),  # Softmax -> Log -> NegativeLogLikelihoodLoss
    ],
)
def test_onnx_hand_written_cross_entropy(variant, opset, index_dtype):
    model = _hand_written(variant, opset, index_dtype)
    mod = tvm_fusion.load_onnx(model)
    _assert_fused(mod)
    rng = np.random.default_rng(3)
    low = 0 if variant.endswith("nll") else -V  # GatherElements takes negative indices
    shape = (lambda n: (n,)) if variant.endswith("nll") else (lambda n: (n, 1))
    feeds = [[_logits(rng, n), rng.integers(low, V, shape(n)).astype(index_dtype)] for n in BATCHES]
    if low < 0:
        assert any((f[1] < 0).any() for f in feeds)
    _check_against(mod, feeds, _ort(model))


def test_gradient_of_negative_targets():
    """The fused kernel's gradient picks the column its forward picked: ``t + V`` for a
    negative target (the where it replaced did so for the stock gather). A static batch:
    Gradient of the fused kernel with a symbolic batch fails ("key is not in Map"), already
    before these spellings (stock's Gradient of the unfused nll_loss does not)."""
    model = _hand_written("logsoftmax:gather_mean")
    mod = tvm_fusion.load_onnx(model, shapes={"x": [5, V], "t": [5, 1]})
    target = tvm_fusion.host_target()
    with collect_rewrites() as counts:
        mod = FuseCrossEntropy(target)(mod)
    assert counts["FuseCrossEntropy"] == 1
    grad_mod = relax.transform.Gradient("main", require_grads=mod["main"].params[0])(mod)
    ex = tvm.compile(grad_mod, target, relax_pipeline="tvm_fusion")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(11)
    x, t = _logits(rng, 5), np.array([[-1], [0], [-V], [V - 1], [-7]], "int64")
    _, grads = vm["main_adjoint"](tvm.runtime.tensor(x), tvm.runtime.tensor(t))
    p = np.exp(x - x.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    expect = (p - np.eye(V)[t[:, 0] % V]) / len(x)  # d/dx of -mean(log_softmax(x)[i, t_i])
    np.testing.assert_allclose(grads[0].numpy(), expect, rtol=1e-4, atol=1e-7)


def test_wide_tensor_check_sees_the_log_probs_of_stock():
    """The (N, V) check can fail: stock's grouping of the same import holds the log-probs."""
    mod = tvm_fusion.load_onnx(_hand_written("logsoftmax:gather_mean"))
    assert _wide_tensors(mod, pipeline.stock_fused_passes) != []


@pytest.mark.parametrize(
    ("op", "reduction", "weights", "ignore"),
    [
        ("SoftmaxCrossEntropyLoss", "mean", False, None),
        ("SoftmaxCrossEntropyLoss", "none", True, 2),
        ("SoftmaxCrossEntropyLoss", "sum", True, -1),
        ("NegativeLogLikelihoodLoss", "mean", True, 5),
        ("NegativeLogLikelihoodLoss", "none", False, None),
        ("NegativeLogLikelihoodLoss", "sum", False, 0),
    ],
)
def test_onnx_loss_ops_dynamic_batch(op, reduction, weights, ignore):
    model = _loss_op(op, reduction, weights, ignore)
    mod = tvm_fusion.load_onnx(model)
    _assert_fused(mod)
    rng = np.random.default_rng(7)
    feeds = []
    for n in BATCHES:
        t = rng.integers(0, V, (n,)).astype("int64")
        if ignore is not None:
            t[::3] = ignore
        feed = [_logits(rng, n), t]
        if weights:
            feed.append(rng.uniform(0.5, 1.5, V).astype("float32"))
        feeds.append(feed)
    _check_against(mod, feeds, _ort(model))


# ---------------------------------------------------------------------------------------------
# torch.export spellings, imported with from_exported_program, against torch


def _torch_loss(torch, case: str, weight):
    F = torch.nn.functional
    return {
        "cross_entropy": lambda x, t: F.cross_entropy(x, t),
        "cross_entropy_none_smoothed": lambda x, t: F.cross_entropy(
            x, t, reduction="none", label_smoothing=0.1
        ),
        "cross_entropy_all_options": lambda x, t: F.cross_entropy(
            x, t, weight=weight, ignore_index=1, label_smoothing=0.2, reduction="sum"
        ),
        "CrossEntropyLoss": torch.nn.CrossEntropyLoss(
            weight=weight, ignore_index=0, label_smoothing=0.05
        ),
        "nll_of_log_softmax": lambda x, t: F.nll_loss(F.log_softmax(x, -1), t),
        "nll_of_log_of_softmax": lambda x, t: F.nll_loss(torch.log(torch.softmax(x, -1)), t),
        "gather_of_log_of_softmax": lambda x, t: (
            -(torch.log(torch.softmax(x, 1)).gather(1, t[:, None]).mean())
        ),
    }[case]


@pytest.mark.parametrize(
    "case",
    [
        "cross_entropy",
        "cross_entropy_none_smoothed",
        "cross_entropy_all_options",
        "CrossEntropyLoss",
        "nll_of_log_softmax",
        "nll_of_log_of_softmax",
        "gather_of_log_of_softmax",
    ],
)
def test_torch_export_cross_entropy(case):
    torch = pytest.importorskip("torch")
    from tvm.relax.frontend.torch import from_exported_program

    gen = torch.Generator().manual_seed(0)
    weight = torch.rand(V, generator=gen) + 0.5
    loss = _torch_loss(torch, case, weight)

    class Loss(torch.nn.Module):
        def forward(self, x, t):
            return loss(x, t)

    batch = torch.export.Dim("batch", min=2, max=64)
    example = (torch.randn(4, V, generator=gen), torch.randint(0, V, (4,), generator=gen))
    program = torch.export.export(Loss(), example, dynamic_shapes=({0: batch}, {0: batch}))
    mod = from_exported_program(program)
    _assert_fused(mod)
    rng = np.random.default_rng(5)
    feeds = []
    for n in BATCHES:
        t = rng.integers(0, V, (n,)).astype("int64")
        t[::4] = 1  # hits the ignored classes of the cases with ignore_index
        t[1::4] = 0
        feeds.append([_logits(rng, n), t])

    def expect(feed):
        with torch.no_grad():
            return [loss(*[torch.from_numpy(a) for a in feed]).numpy()]

    _check_against(mod, feeds, expect)


if __name__ == "__main__":
    tvm.testing.main()
