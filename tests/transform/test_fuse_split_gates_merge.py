"""FuseSplitGates' merges of other spellings of a gate GEMM (constant weights): two linear
layers summed before the split (torch's LSTMCell) become one GEMM over ``concat(x, h)``;
sibling linear layers of one input that meet in gate math (Llama's SwiGLU, T5's gated GELU,
``where`` / ``erf`` / casts) become one GEMM over the joined weights, split. A constant added
to a linear layer is a GEMM bias only when it broadcasts along the features alone (a per-row
bias of as many elements is not).

Left alone: summed layers with runtime weights, or with a per-row bias; sibling projections
read by other ops (attention's q/k) or whose result is also a function output; a bias that
adds leading axes to the GEMM result.
"""

import numpy as np
import pytest
import tvm
import tvm.testing
from helpers import compare_pipelines
from tvm import relax

import tvm_fusion
from tvm_fusion import analysis
from tvm_fusion.transform import FuseSplitGates, collect_rewrites


def _lstm_tail(bb, gates, c):
    """split(gates, 4) -> the LSTM cell's (h, c)."""
    parts = bb.emit(relax.op.split(gates, 4, axis=1))
    i, f, g, o = (bb.emit(relax.TupleGetItem(parts, k)) for k in range(4))
    c2 = bb.emit(
        relax.op.add(
            relax.op.multiply(relax.op.sigmoid(f), c),
            relax.op.multiply(relax.op.sigmoid(i), relax.op.tanh(g)),
        )
    )
    h2 = bb.emit(relax.op.multiply(relax.op.sigmoid(o), relax.op.tanh(c2)))
    return relax.Tuple([h2, c2])


def _summed_linears(const_weights: bool):
    """torch.nn.LSTMCell's shape after import: (x @ Wih^T + bih) + (h @ Whh^T + bhh) -> split."""
    rng = np.random.default_rng(3)
    wih = rng.standard_normal((64, 8)).astype("float32") / 4
    whh = rng.standard_normal((64, 16)).astype("float32") / 4
    bih, bhh = (rng.standard_normal(64).astype("float32") for _ in range(2))
    x = relax.Var("x", relax.TensorType((tvm.tirx.Var("n", "int64"), 8), "float32"))
    h = relax.Var("h", relax.TensorType((x.ty.shape[0], 16), "float32"))
    c = relax.Var("c", relax.TensorType((x.ty.shape[0], 16), "float32"))
    params = [x, h, c]
    if const_weights:
        w1, w2 = relax.const(wih), relax.const(whh)
    else:
        w1 = relax.Var("wih", relax.TensorType((64, 8), "float32"))
        w2 = relax.Var("whh", relax.TensorType((64, 16), "float32"))
        params += [w1, w2]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            a = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w1, [1, 0]))))
            a = bb.emit(relax.op.add(a, relax.const(bih)))
            b = bb.emit(relax.op.matmul(h, bb.emit(relax.op.permute_dims(w2, [1, 0]))))
            b = bb.emit(relax.op.add(b, relax.const(bhh)))
            out = bb.emit_output(_lstm_tail(bb, bb.emit(relax.op.add(a, b)), c))
        bb.emit_func_output(out)
    inputs = [rng.standard_normal((3, k)).astype("float32") for k in (8, 16, 16)]
    if not const_weights:
        inputs += [wih, whh]
    return bb.get(), inputs, (wih, whh, bih + bhh)


def test_two_summed_linears_become_one_gate_gemm():
    from tvm_fusion.transform.fuse_split_gates.merge import _MergeSummedGemms

    mod, _, (wih, whh, bias) = _summed_linears(const_weights=True)
    merged = _MergeSummedGemms(mod).transform()
    x, h, c = merged["main"].params
    bb = relax.BlockBuilder()
    with bb.function("main", [x, h, c]):
        with bb.dataflow():
            xc = bb.emit(relax.op.concat([x, h], axis=-1))
            wt = bb.emit(relax.op.permute_dims(relax.const(np.concatenate([wih, whh], 1)), [1, 0]))
            y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(xc, wt)), relax.const(bias)))
            out = bb.emit_output(_lstm_tail(bb, y, c))
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(merged, bb.get())


def test_two_summed_linears_numerics_and_one_gate_kernel():
    mod, inputs, _ = _summed_linears(const_weights=True)
    with collect_rewrites() as counts:
        ours, stock = compare_pipelines(mod, inputs, rtol=1e-5, atol=1e-5)
    assert counts.get("FuseSplitGates") == 1
    report = analysis.fusion_report(mod, tvm_fusion.host_target())
    assert report.ours_kernels == 2 and report.stock_kernels > 2, report.to_text()  # concat, gates


def test_two_summed_linears_with_runtime_weights_left_alone():
    from tvm_fusion.transform.fuse_split_gates.merge import _MergeSummedGemms

    mod, _, _ = _summed_linears(const_weights=False)
    assert _MergeSummedGemms(mod).transform().same_as(mod)


# ---------------------------------------------------------------------------------------------
# Sibling linear layers of one input (Llama's gate_proj / up_proj): joined into one gate GEMM


def _swiglu_mlp(layers: int = 1, width: int = 16, hidden: int = 8, up_also_output=False):
    """Llama's MLP as the ONNX importer writes it (weights (K, N) constants, rows symbolic):
    ``g = x @ Wg; (g * sigmoid(g)) * (x @ Wu)``, then the down projection; ``layers`` MLPs in a
    row, each reading the previous one's result, in one dataflow block."""
    rng = np.random.default_rng(5)
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, hidden), "float32"))
    weights = []
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            h, extra = x, []
            for _ in range(layers):
                wg, wu = (rng.standard_normal((hidden, width)).astype("float32") / 3 for _ in "gu")
                wd = rng.standard_normal((width, hidden)).astype("float32") / 3
                weights.append((wg, wu, wd))
                g = bb.emit(relax.op.matmul(h, relax.const(wg)))
                act = bb.emit(relax.op.multiply(g, bb.emit(relax.op.sigmoid(g))))
                u = bb.emit(relax.op.matmul(h, relax.const(wu)))
                if up_also_output:
                    extra.append(u)
                h = bb.emit(relax.op.matmul(bb.emit(relax.op.multiply(act, u)), relax.const(wd)))
            out = bb.emit_output(relax.Tuple([h, *extra]) if extra else h)
        bb.emit_func_output(out)
    return bb.get(), weights


def test_sibling_linears_become_one_split_gemm():
    from tvm_fusion.transform.fuse_split_gates.merge import _MergeSiblingGemms

    mod, [(wg, wu, wd)] = _swiglu_mlp()
    merger = _MergeSiblingGemms(mod)
    merged = merger.transform()
    assert len(merger.merged) == 1
    (x,) = merged["main"].params
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            wt = bb.emit(relax.op.permute_dims(relax.const(np.concatenate([wg.T, wu.T])), [1, 0]))
            y = bb.emit(relax.op.matmul(x, wt))
            parts = bb.emit(relax.op.split(y, 2, axis=-1))
            g, u = (bb.emit(relax.TupleGetItem(parts, i)) for i in range(2))
            act = bb.emit(relax.op.multiply(g, bb.emit(relax.op.sigmoid(g))))
            h = bb.emit(relax.op.matmul(bb.emit(relax.op.multiply(act, u)), relax.const(wd)))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(merged, bb.get())


def test_sibling_linears_fuse_into_one_gate_kernel_per_layer(target):
    """Two MLPs in one block: the second layer's gate input depends on the first group's
    result, so the groups are emitted in dependency order (a use before its definition
    otherwise). Numerics vs stock at 1, 3 and 5 rows."""
    mod, _ = _swiglu_mlp(layers=2)
    with target:
        fused = FuseSplitGates()(mod)
    gate_funcs = [gv.name_hint for gv in fused.get_global_vars() if "fused_gates" in gv.name_hint]
    assert len(gate_funcs) == 2, fused["main"].script()
    main = fused["main"].script()
    assert main.count("R.matmul") == 2 and "R.split" not in main, main  # down projections
    for rows in (1, 3, 5):
        inputs = [np.random.default_rng(rows).standard_normal((rows, 8)).astype("float32")]
        with collect_rewrites() as counts:
            compare_pipelines(mod, inputs, rtol=1e-4, atol=1e-4)
        assert counts.get("FuseSplitGates") == 2


def test_sibling_projections_read_by_other_ops_left_alone():
    """q/k/v-style siblings (results reshaped, not gate math) and a gate sibling whose result
    is also a function output are not joined."""
    from tvm_fusion.transform.fuse_split_gates.merge import _MergeSiblingGemms

    rng = np.random.default_rng(0)
    x = relax.Var("x", relax.TensorType((tvm.tirx.Var("n", "int64"), 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            q, k = (
                bb.emit(relax.op.matmul(x, relax.const(rng.standard_normal((8, 16), "float32"))))
                for _ in "qk"
            )
            q4, k4 = (bb.emit(relax.op.reshape(t, (x.ty.shape[0], 4, 4))) for t in (q, k))
            out = bb.emit_output(relax.op.add(q4, k4))
        bb.emit_func_output(out)
    mod = bb.get()
    assert _MergeSiblingGemms(mod).transform().same_as(mod)
    mod, _ = _swiglu_mlp(up_also_output=True)
    assert _MergeSiblingGemms(mod).transform().same_as(mod)


def test_sibling_linears_of_odd_width_join_and_fuse_padded(target):
    """Width 3: no vector block divides it; the blocked weight is padded to a whole block (zero
    columns nothing reads), so the joined GEMM and its gates are one kernel, numbers right."""
    from tvm_fusion.transform.fuse_split_gates.merge import _merge_siblings

    mod, _ = _swiglu_mlp(width=3)
    assert not _merge_siblings(mod, target).same_as(mod)
    with collect_rewrites() as counts:
        with target:
            FuseSplitGates()(_merge_siblings(mod, target))
    assert counts["FuseSplitGates"] == 1


def _t5_gated_gelu(rows, hidden: int = 8, width: int = 16, seed: int = 3):
    """T5's gated-GELU feed-forward as torch.export writes it (``wi_0`` and ``wi_1`` sibling
    Linears, ``gelu_new`` with ``pow(x, 3)``, ``tanh``), then ``wo``."""
    rng = np.random.default_rng(seed)
    x = relax.Var("x", relax.TensorType((rows, hidden), "float32"))
    w0, w1 = (rng.standard_normal((hidden, width)).astype("float32") / 3 for _ in "01")
    wo = rng.standard_normal((width, hidden)).astype("float32") / 3

    def c(v):
        return relax.const(np.array(v, "float32"))

    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            h0 = bb.emit(relax.op.matmul(x, relax.const(w0)))
            cube = bb.emit(relax.op.power(h0, c(3.0)))
            inner = bb.emit(relax.op.add(h0, bb.emit(relax.op.multiply(cube, c(0.044715)))))
            t = bb.emit(relax.op.tanh(bb.emit(relax.op.multiply(inner, c(0.7978845608)))))
            gelu = bb.emit(
                relax.op.multiply(
                    bb.emit(relax.op.multiply(h0, c(0.5))), bb.emit(relax.op.add(t, c(1.0)))
                )
            )
            h1 = bb.emit(relax.op.matmul(x, relax.const(w1)))
            y = bb.emit(relax.op.matmul(bb.emit(relax.op.multiply(gelu, h1)), relax.const(wo)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)

    def reference(xv):
        a = xv @ w0
        g = 0.5 * a * (1 + np.tanh(0.7978845608 * (a + 0.044715 * a**3)))
        return (g * (xv @ w1)) @ wo

    return bb.get(), reference


@pytest.mark.parametrize("rows", [5, "n"])
def test_t5_gated_gelu_with_power_fuses(rows, target):
    """``pow(x, 3)`` is gate math (it was not among the pass' ops, so T5's wi_0/wi_1 pair was
    dropped without a word): one gate kernel, numbers right at static and symbolic rows."""
    n = tvm.tirx.Var("n", "int64") if rows == "n" else rows
    mod, reference = _t5_gated_gelu(n)
    with target:
        fused = FuseSplitGates()(mod)
    gate_funcs = [gv.name_hint for gv in fused.get_global_vars() if "fused_gates" in gv.name_hint]
    assert len(gate_funcs) == 1, fused["main"].script()
    assert "R.power" not in fused["main"].script()
    for m in (1, 5, 7):
        if rows != "n" and m != rows:
            continue
        xv = np.random.default_rng(m).standard_normal((m, 8)).astype("float32")
        with collect_rewrites() as counts:
            ours, _ = compare_pipelines(mod, [xv], rtol=1e-4, atol=1e-4, reference=[reference(xv)])
        assert counts.get("FuseSplitGates") == 1


def test_gate_math_with_comparisons_where_and_casts_fuses(target):
    """A ReLU written as ``where(g > 0, g, 0)`` times the up projection, through a cast and
    ``erf``: every op is one LegalizeOps makes injective, so the group fuses."""
    rng = np.random.default_rng(11)
    x = relax.Var("x", relax.TensorType((6, 8), "float32"))
    wg, wu = (rng.standard_normal((8, 16)).astype("float32") / 3 for _ in "gu")
    zero = relax.const(np.array(0.0, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            g = bb.emit(relax.op.matmul(x, relax.const(wg)))
            relu = bb.emit(relax.op.where(bb.emit(relax.op.greater(g, zero)), g, zero))
            e = bb.emit(relax.op.astype(bb.emit(relax.op.erf(relu)), "float32"))
            u = bb.emit(relax.op.matmul(x, relax.const(wu)))
            out = bb.emit_output(relax.op.multiply(e, u))
        bb.emit_func_output(out)
    mod = bb.get()
    xv = rng.standard_normal((6, 8)).astype("float32")
    from scipy.special import erf

    a = xv @ wg
    expect = erf(np.where(a > 0, a, 0)) * (xv @ wu)
    with collect_rewrites() as counts:
        compare_pipelines(mod, [xv], rtol=1e-4, atol=1e-5, reference=[expect])
    assert counts.get("FuseSplitGates") == 1


# ---------------------------------------------------------------------------------------------
# Biases that are not per-feature (issue #27): a constant's size is no evidence of its shape


def _gated_with_bias(rows: int, bias_shape: tuple):
    """``tanh(x @ Wg) * (x @ Wu + b)`` with x (rows, 4), rows == features, b constant of
    ``bias_shape``: the module, its input, the NumPy result and (Wg, Wu, b)."""
    rng = np.random.default_rng(rows)
    wg, wu = (rng.standard_normal((4, rows)).astype("float32") for _ in "gu")
    b = rng.standard_normal(bias_shape).astype("float32")
    x = relax.Var("x", relax.TensorType((rows, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            g = bb.emit(relax.op.tanh(bb.emit(relax.op.matmul(x, relax.const(wg)))))
            u = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(wu))), relax.const(b)))
            out = bb.emit_output(relax.op.multiply(g, u))
        bb.emit_func_output(out)
    xv = rng.standard_normal((rows, 4)).astype("float32")
    return bb.get(), [xv], np.tanh(xv @ wg) * (xv @ wu + b), (wg, wu, b)


@pytest.mark.parametrize("rows", [8, 5])
@pytest.mark.parametrize("bias", ["per_row", "full", "per_feature"])
def test_sibling_linears_bias_shapes_numerics(rows, bias):
    """A per-row bias (rows, 1) with rows == features has as many elements as a per-feature
    one; it was flattened into the joined GEMM's bias (max error ~1 at 8 rows). Per-row and
    full (rows, N) biases stay adds in the gate math; per-feature ones join the GEMM (width 5:
    the blocked weight padded to a whole vector block)."""
    shape = {"per_row": (rows, 1), "full": (rows, rows), "per_feature": (rows,)}[bias]
    mod, inputs, expected, _ = _gated_with_bias(rows, shape)
    with collect_rewrites() as counts:
        compare_pipelines(mod, inputs, rtol=1e-5, atol=1e-5, reference=[expected])
    assert counts.get("FuseSplitGates", 0) == 1


def test_per_row_bias_stays_out_of_the_joined_gemm():
    """The siblings are joined without a bias; the per-row add stays on the up piece."""
    from tvm_fusion.transform.fuse_split_gates.merge import _MergeSiblingGemms

    mod, _, _, (wg, wu, b) = _gated_with_bias(8, (8, 1))
    merged = _MergeSiblingGemms(mod).transform()
    (x,) = merged["main"].params
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            wt = bb.emit(relax.op.permute_dims(relax.const(np.concatenate([wg.T, wu.T])), [1, 0]))
            parts = bb.emit(relax.op.split(bb.emit(relax.op.matmul(x, wt)), 2, axis=-1))
            g, u = (bb.emit(relax.TupleGetItem(parts, i)) for i in range(2))
            g = bb.emit(relax.op.tanh(g))
            u = bb.emit(relax.op.add(u, relax.const(b)))
            out = bb.emit_output(relax.op.multiply(g, u))
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(merged, bb.get())


def _summed_with_bias(bias_shape: tuple):
    """``(x @ W1 + b) + h @ W2 -> split -> sigmoid(i) * g`` over 16 rows and 16 features."""
    rng = np.random.default_rng(7)
    w1, w2 = (rng.standard_normal((4, 16)).astype("float32") for _ in "12")
    b = rng.standard_normal(bias_shape).astype("float32")
    x, h = (relax.Var(name, relax.TensorType((16, 4), "float32")) for name in "xh")
    bb = relax.BlockBuilder()
    with bb.function("main", [x, h]):
        with bb.dataflow():
            a = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(w1))), relax.const(b)))
            y = bb.emit(relax.op.add(a, bb.emit(relax.op.matmul(h, relax.const(w2)))))
            parts = bb.emit(relax.op.split(y, 2, axis=-1))
            i, g = (bb.emit(relax.TupleGetItem(parts, k)) for k in range(2))
            out = bb.emit_output(relax.op.multiply(bb.emit(relax.op.sigmoid(i)), g))
        bb.emit_func_output(out)
    xv, hv = (rng.standard_normal((16, 4)).astype("float32") for _ in "xh")
    ref = xv @ w1 + b + hv @ w2
    return bb.get(), [xv, hv], 1 / (1 + np.exp(-ref[:, :8])) * ref[:, 8:]


def test_summed_linears_with_a_per_row_bias_left_alone():
    """A (rows, 1) bias of one summand (rows == features) is not a GEMM bias: no merge, and
    the numbers match; a per-feature (N,) one still merges."""
    from tvm_fusion.transform.fuse_split_gates.merge import _MergeSummedGemms

    mod, inputs, expected = _summed_with_bias((16, 1))
    assert _MergeSummedGemms(mod).transform().same_as(mod)
    compare_pipelines(mod, inputs, rtol=1e-5, atol=1e-5, reference=[expected])
    mod, _, _ = _summed_with_bias((16,))
    assert not _MergeSummedGemms(mod).transform().same_as(mod)


def test_bias_adding_leading_axes_left_alone(target):
    """``x (1, K) @ W + b (1, 1, N)`` is a (1, 1, N) result: the split GEMM has more dims than
    its input (the matcher crashed comparing them), constant or runtime bias."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 16)).astype("float32")
    b = rng.standard_normal((1, 1, 16)).astype("float32")
    x = relax.Var("x", relax.TensorType((1, 4), "float32"))
    bv = relax.Var("b", relax.TensorType((1, 1, 16), "float32"))
    for bias, params, inputs in ((relax.const(b), [x], []), (bv, [x, bv], [b])):
        bb = relax.BlockBuilder()
        with bb.function("main", params):
            with bb.dataflow():
                y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(w))), bias))
                parts = bb.emit(relax.op.split(y, 2, axis=-1))
                i, g = (bb.emit(relax.TupleGetItem(parts, k)) for k in range(2))
                out = bb.emit_output(relax.op.multiply(bb.emit(relax.op.sigmoid(i)), g))
            bb.emit_func_output(out)
        mod = bb.get()
        with target:
            tvm.ir.assert_structural_equal(FuseSplitGates()(mod), mod)
        xv = rng.standard_normal((1, 4)).astype("float32")
        ref = xv @ w + b
        expected = 1 / (1 + np.exp(-ref[..., :8])) * ref[..., 8:]
        compare_pipelines(mod, [xv, *inputs], rtol=1e-5, atol=1e-5, reference=[expected])


def test_scalar_bias_fuses(target):
    """``x @ W + b`` with a 0-d constant ``b`` (ONNX Add of a scalar) is a GEMM bias too: the
    matcher indexed its last dim and raised IndexError (found by scripts/fuzz.py)."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((4, 16)).astype("float32")
    b = np.array(0.25, dtype="float32")
    x = relax.Var("x", relax.TensorType((3, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(w))), relax.const(b)))
            parts = bb.emit(relax.op.split(y, 2, axis=-1))
            i, g = (bb.emit(relax.TupleGetItem(parts, k)) for k in range(2))
            out = bb.emit_output(relax.op.multiply(bb.emit(relax.op.sigmoid(i)), g))
        bb.emit_func_output(out)
    mod = bb.get()
    with collect_rewrites() as counts:
        with target:
            FuseSplitGates()(mod)
    assert counts.get("FuseSplitGates", 0) == 1
    xv = rng.standard_normal((3, 4)).astype("float32")
    ref = xv @ w + b
    expected = 1 / (1 + np.exp(-ref[..., :8])) * ref[..., 8:]
    compare_pipelines(mod, [xv], rtol=1e-5, atol=1e-5, reference=[expected])


if __name__ == "__main__":
    tvm.testing.main()
