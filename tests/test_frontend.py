"""load_onnx: good models import; every kind of bad input is one ModelError line."""

import numpy as np
import onnx
import pytest
import tvm
from helpers import run
from onnx import TensorProto, helper
from tvm import relax

import tvm_fusion
from tvm_fusion import ModelError, load_onnx, models


def _add_model(shape=("n", 4)):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))
    b = onnx.numpy_helper.from_array(np.ones(4, "float32"), "b")
    graph = helper.make_graph([helper.make_node("Add", ["x", "b"], ["y"])], "g", [x], [y], [b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


def test_loads_model_proto_and_path(tmp_path):
    model = _add_model()
    mod = load_onnx(model)
    assert isinstance(mod["main"], relax.Function)
    path = tmp_path / "add.onnx"
    onnx.save(model, str(path))
    mod2 = load_onnx(path)
    assert [p.name for p in mod2["main"].params] == ["x"]


def test_dynamic_axis_stays_symbolic():
    mod = load_onnx(_add_model())
    dim0 = mod["main"].params[0].ty.shape.values[0]
    assert not isinstance(dim0, int) and not hasattr(dim0, "value")


def test_shapes_fix_a_dim():
    mod = load_onnx(_add_model(), shapes={"x": [3, 4]})
    assert [int(d) for d in mod["main"].params[0].ty.shape.values] == [3, 4]


def test_shapes_named_dim():
    mod = load_onnx(_add_model(), shapes={"x": ["batch", 4]})
    assert str(mod["main"].params[0].ty.shape.values[0]) == "batch"


def test_missing_file():
    with pytest.raises(ModelError, match="model file not found") as err:
        load_onnx("/nonexistent/model.onnx")
    _one_line(err)


def test_directory_is_not_a_model(tmp_path):
    with pytest.raises(ModelError, match="directory") as err:
        load_onnx(tmp_path)
    _one_line(err)


def test_corrupt_file(tmp_path):
    path = tmp_path / "bad.onnx"
    path.write_bytes(b"\x08\x07garbage\xff\xfe not a protobuf" * 10)
    with pytest.raises(ModelError) as err:
        load_onnx(path)
    assert "bad.onnx" in _one_line(err)


def test_truncated_file(tmp_path):
    data = _add_model().SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError) as err:
        load_onnx(path)
    _one_line(err)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    with pytest.raises(ModelError, match="empty graph|not a valid") as err:
        load_onnx(path)
    _one_line(err)


def test_checker_failure():
    model = _add_model()
    model.graph.node[0].input[1] = "undefined_tensor"
    with pytest.raises(ModelError, match="not a valid ONNX model") as err:
        load_onnx(model)
    _one_line(err)


def test_unsupported_operator():
    model = _add_model()
    model.graph.node[0].op_type = "FancyCustomOp"
    model.graph.node[0].domain = "com.example"
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(ModelError, match="cannot be imported: com.example.FancyCustomOp") as err:
        load_onnx(model)
    _one_line(err)


def test_wrong_type():
    with pytest.raises(ModelError, match="expected an ONNX file path"):
        load_onnx(42)


@pytest.mark.parametrize(
    "shapes, message",
    [
        ({"z": [1, 4]}, "does not have"),
        ({"x": [1, 4, 1]}, "rank 2"),
        ({"x": [2, 5]}, "dim 1 is 4"),
        ({"x": [-1, 4]}, "negative"),
        ({"x": "1,4"}, "list of dims"),
        ({"x": [1.5, 4]}, "int or a name"),
    ],
)
def test_bad_shapes(shapes, message):
    with pytest.raises(ModelError, match=message) as err:
        load_onnx(_add_model(), shapes=shapes)
    _one_line(err)


@pytest.mark.parametrize("name", ["gate_2890", "take_arange", "mha_transpose"])
def test_workload_onnx_models_import(name):
    inst = models.build(name, "small")
    mod = load_onnx(inst.onnx_model)
    assert isinstance(mod["main"], relax.Function)


# ---------------------------------------------------------------------------------------------
# torch.export programs (.pt2)


def _saved_program(tmp_path):
    torch = pytest.importorskip("torch")

    class Gated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up = torch.nn.Linear(12, 2 * 7)

        def forward(self, x):
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return torch.nn.functional.silu(gate) * up

    torch.manual_seed(0)
    module = Gated().eval()
    batch = torch.export.Dim("batch", max=64)
    program = torch.export.export(module, (torch.randn(3, 12),), dynamic_shapes=({0: batch},))
    path = tmp_path / "gated.pt2"
    torch.export.save(program, str(path))
    return torch, module, path


def test_exported_program_loads_compiles_and_matches_torch(tmp_path):
    torch, module, path = _saved_program(tmp_path)
    mod = tvm_fusion.load_model(path)
    assert mod["main"].attrs["tir_var_upper_bound"]  # the Dim's bound came through
    x = torch.randn(5, 12)
    out, _ = run(mod, [x.numpy()])
    np.testing.assert_allclose(out[0], module(x).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_exported_program_errors_are_one_line(tmp_path, caplog):
    pytest.importorskip("torch")
    bad = tmp_path / "bad.pt2"
    bad.write_bytes(b"not a zip file")
    with pytest.raises(ModelError, match="cannot read .* as a torch.export program"):
        tvm_fusion.load_exported_program(bad)
    # torch.export.load logs a traceback before it raises: not shown to the user
    assert not [r for r in caplog.records if r.name.startswith("torch")], caplog.text
    with pytest.raises(ModelError, match="model file not found"):
        tvm_fusion.load_model(tmp_path / "missing.pt2")
    _, _, path = _saved_program(tmp_path)
    with pytest.raises(ModelError, match="shapes apply to ONNX models"):
        tvm_fusion.load_model(path, {"x": [4, 12]})


def test_exported_negative_indices_count_from_the_end():
    """``x[..., [-2], :]`` (Falcon's multi-query split of its fused qkv) and a runtime index
    tensor with negative entries: stock imported them as ``take(mode="fast")`` on the raw
    indices (reads out of bounds; Falcon's logits were off by 0.8). The constant ones are folded
    at import, the runtime one wrapped on its static axis; a batch ``Dim`` stays dynamic."""
    torch = pytest.importorskip("torch")
    from helpers import compare_pipelines

    class Heads(torch.nn.Module):
        def forward(self, x, i):
            query, key = x[..., :-2, :], x[..., [-2], :]
            return query * key, x[:, i] * 2.0, x[..., [0, 2], :] + 1.0

    x, i = torch.randn(2, 5, 4, 3), torch.tensor([-5, 1, -1])
    batch = torch.export.Dim("batch", max=8)
    program = torch.export.export(Heads(), (x, i), dynamic_shapes=({0: batch}, None))
    mod = tvm_fusion.frontend.import_exported_program(program)
    text = mod["main"].script()
    assert text.count("R.where") == 1, text  # the runtime index only; constants folded
    x = torch.randn(3, 5, 4, 3)
    want = [t.numpy() for t in Heads()(x, i)]
    compare_pipelines(mod, [x.numpy(), i.numpy()], reference=want)


def test_exported_integer_arithmetic_promotes_like_torch():
    """torch promotes integer / boolean operands (``int / 3`` and ``int * 0.5`` are float,
    ``log(int)`` too); stock computed in the input's dtype (integers: wrong numbers) or failed
    to import (``log``, ``**``, ``//`` by an int32 constant). DeBERTa-v2's position buckets
    are the held-out case. Dtypes and values must be torch's; a batch ``Dim`` stays dynamic."""
    torch = pytest.importorskip("torch")

    class Promoted(torch.nn.Module):
        def forward(self, x, y):
            mid = 4
            buckets = torch.ceil(
                torch.log((x.abs() + 1) / mid) / torch.log(torch.tensor(127 / mid))
            )
            return (
                x / 3,
                x * 0.5 + (x > 4),
                0.5 - x,
                torch.reciprocal(x + 13),
                (x + 13) ** 0.5,
                torch.sigmoid(x),
                x // 4,
                torch.div(x, 4, rounding_mode="trunc"),
                (x - 0.5) // 2,
                x // (y.abs() + 1),
                (x > 0) + 1,
                buckets * 3 + mid,
                y * 0.25,
            )

    batch = torch.export.Dim("batch", max=8)
    x = torch.arange(-12, 12).reshape(2, 12)
    y = torch.randn(2, 12)
    program = torch.export.export(Promoted(), (x, y), dynamic_shapes=({0: batch}, {0: batch}))
    mod = tvm_fusion.frontend.import_exported_program(program)
    x, y = torch.arange(-18, 18).reshape(3, 12), torch.randn(3, 12)
    want = [t.numpy() for t in Promoted()(x, y)]
    got, _ = run(mod, [x.numpy(), y.numpy()], "tvm_fusion")
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert g.dtype == w.dtype, (i, g.dtype, w.dtype)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"output {i}")


def test_exported_repeat_by_a_symbolic_count():
    """``e.repeat(q.size(0) // 2, 1, 1)`` (DeBERTa-v2's relative embeddings per batch): stock
    passed the symbolic count to ``tile``, which takes integers (the import failed). Integer
    counts keep stock's ``tile``."""
    torch = pytest.importorskip("torch")

    class Repeat(torch.nn.Module):
        def forward(self, q, e):
            return (
                e.repeat(q.size(0) // 2, 1, 1) * 2.0,
                q.repeat(2, 1, 3),
                e.repeat(3, q.size(1), 1, 1),
            )

    batch, seq = torch.export.Dim("batch", min=4, max=16), torch.export.Dim("seq", max=64)
    q, e = torch.randn(4, 5, 3), torch.randn(1, 7, 3)
    program = torch.export.export(Repeat(), (q, e), dynamic_shapes=({0: batch, 1: seq}, None))
    mod = tvm_fusion.frontend.import_exported_program(program)
    assert mod["main"].script().count("R.tile") == 1
    q = torch.randn(7, 9, 3)
    want = [t.numpy() for t in Repeat()(q, e)]
    got, _ = run(mod, [q.numpy(), e.numpy()], "tvm_fusion")
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g, w)


def test_exported_last_index_scalar_comparisons_and_where_of_scalars():
    """Found by the fuzzer's ``dtypes`` family (``tvm_fusion/frontend/torch_ops.py``): stock read
    ``x[:, -1]`` out of bounds (``take`` of -1 in fast mode), compared ``ids < 2.5`` as
    ``ids < 2`` and ``ids == -0.5`` as ``ids == 0``, failed to build ``bool_mask == 0`` (an
    ``fcmp`` of booleans), to import ``h / h.shape[1]`` (a float tensor and an int64 size) and,
    without decompositions, ``torch.where(c, x, 0.0)``. Values and dtypes must be torch's,
    on both imports, with a dynamic batch and sequence."""
    torch = pytest.importorskip("torch")

    class Mixed(torch.nn.Module):
        def forward(self, h, ids, mask):
            return (
                h[:, -1],  # the last token: an axis of symbolic length
                h[..., -2],  # an axis of static length
                ids < 2.5,
                ids == -0.5,
                ids >= -0.5,
                mask == 0,
                torch.zeros_like(h).masked_fill((mask == 0)[..., None], -1e4),
                torch.where(ids > -0.5, h[..., 0], 0.0),
                h / h.shape[1],
            )

    batch, seq = torch.export.Dim("batch", max=8), torch.export.Dim("seq", max=16)
    h, ids = torch.randn(2, 5, 3), torch.arange(-5, 5).reshape(2, 5)
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 0, 1, 1]]).bool()
    dims = ({0: batch, 1: seq},) * 3
    program = torch.export.export(Mixed(), (h, ids, mask), dynamic_shapes=dims)
    h, ids = torch.randn(3, 7, 3), torch.arange(-10, 11).reshape(3, 7)
    mask = ids % 3 != 0
    want = [t.numpy() for t in Mixed()(h, ids, mask)]
    for decompose in (True, False):
        mod = tvm_fusion.frontend.import_exported_program(program, decompose=decompose)
        got, _ = run(mod, [h.numpy(), ids.numpy(), mask.numpy()], "tvm_fusion")
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            assert g.dtype == w.dtype, (decompose, i, g.dtype, w.dtype)
            np.testing.assert_allclose(g, w, rtol=1e-6, err_msg=f"{decompose} output {i}")


def test_exported_integer_clamp_cumsum_and_power():
    """More of the ``dtypes`` family's finds: stock clipped an integer tensor to +-infinity for
    a missing bound (LegalizeOps failed), kept ``clamp(int, min=0.5)`` an integer, read
    ``clamp_max``'s bound from the wrong argument (no clamp), summed ``cumsum`` of int32 / bool
    in the input's dtype (torch: int64; bool failed to build) and failed on ``2 ** ids``
    (``power`` of integers) and on ``1 - ids`` (an int32 constant minus int64)."""
    torch = pytest.importorskip("torch")

    class Ints(torch.nn.Module):
        def forward(self, ids, x):
            keep = ids % 3 != 0
            return (
                ids.clamp(max=2),
                torch.clamp(ids, min=0.5),
                torch.clamp_max(x, 0.25),
                torch.clamp_min(ids, -1),
                torch.cumsum(keep, 1),
                torch.cumsum(ids.int(), -1),
                2 ** ids.clamp(0, 8),
                ids.clamp(0, 3) ** ids.clamp(0, 4),
                1 - ids,
            )

    seq = torch.export.Dim("seq", max=16)
    program = torch.export.export(
        Ints(), (torch.arange(8).reshape(2, 4), torch.randn(2, 4)), dynamic_shapes=({1: seq},) * 2
    )
    ids, x = torch.arange(-7, 7).reshape(2, 7), torch.randn(2, 7)
    want = [t.numpy() for t in Ints()(ids, x)]
    for decompose in (True, False):
        mod = tvm_fusion.frontend.import_exported_program(program, decompose=decompose)
        got, _ = run(mod, [ids.numpy(), x.numpy()], "tvm_fusion")
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            assert g.dtype == w.dtype, (decompose, i, g.dtype, w.dtype)
            np.testing.assert_array_equal(g, w, err_msg=f"{decompose} output {i}")


def test_exported_view_to_symbolic_sizes():
    """``k.view(b, s, -1, 20)`` of a ``(b, 1, s, 40)`` key (GPT-BigCode's multi-query
    attention): stock's identity check compared ``1`` with the symbolic ``s`` as a truth value
    (the import failed). An identity view with symbolic sizes is still dropped."""
    torch = pytest.importorskip("torch")

    class View(torch.nn.Module):
        def forward(self, k):
            b, _, s, _ = k.shape
            return k.view(b, s, -1, 20) * 2.0, k.reshape(b, 1, s, 40) + 1.0

    batch, seq = torch.export.Dim("batch", max=8), torch.export.Dim("seq", max=64)
    k = torch.randn(2, 1, 5, 40)
    program = torch.export.export(View(), (k,), dynamic_shapes=({0: batch, 2: seq},))
    mod = tvm_fusion.frontend.import_exported_program(program)
    assert mod["main"].script().count("R.reshape") == 1
    k = torch.randn(3, 1, 7, 40)
    want = [t.numpy() for t in View()(k)]
    got, _ = run(mod, [k.numpy()], "tvm_fusion")
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g, w)


def test_exported_float_arithmetic_imports_as_stock():
    """Operands that already have torch's result dtype take stock's converters unchanged."""
    torch = pytest.importorskip("torch")
    from tvm.relax.frontend.torch import from_exported_program

    class Plain(torch.nn.Module):
        def forward(self, x, i):
            return torch.log(x * 0.5 + 1) / 3, i * 2 + 1

    program = torch.export.export(Plain(), (torch.rand(2, 3), torch.arange(6).reshape(2, 3)))
    ours = tvm_fusion.frontend.import_exported_program(program)
    stock = from_exported_program(program)
    assert "astype" not in ours["main"].script()
    tvm.ir.assert_structural_equal(ours["main"], stock["main"])


def test_cli_explain_and_compile_a_pt2(tmp_path, capsys):
    from tvm_fusion.tools.cli import main

    _, _, path = _saved_program(tmp_path)
    assert main(["explain", str(path)]) == 0
    assert "FuseSplitGates" in capsys.readouterr().out
    out = tmp_path / "gated.so"
    assert main(["compile", str(path), "-o", str(out)]) == 0
    assert out.stat().st_size > 0


# ---------------------------------------------------------------------------------------------
# Constant folding before import, constant slice bounds


def _const(name, values):
    tensor = helper.make_tensor(name, TensorProto.INT64, [len(values)], values)
    return helper.make_node("Constant", [], [name], value=tensor)


def _padded_labels_model(fold_chain: bool):
    """``labels`` (n, s) int64 -> ``pad(labels, (0, 1), -100)[:, 1:]``: GPT-2's shifted labels
    as transformers 5 writes them. ``fold_chain``: the pads computed from constants node by
    node, as the TorchScript exporter writes F.pad (ConstantOfShape, Concat, Reshape, Slice,
    Transpose, Reshape, Cast: 7 foldable nodes)."""
    i64 = TensorProto.INT64
    inits = [
        onnx.numpy_helper.from_array(np.array(-100, "int64"), "fill"),
        onnx.numpy_helper.from_array(np.array([1], "int64"), "one"),
        onnx.numpy_helper.from_array(np.array([2**63 - 1], "int64"), "end"),
    ]
    nodes = []
    if fold_chain:
        zero = helper.make_tensor("zero", i64, [1], [0])
        nodes += [
            _const("given", [0, 1]),
            _const("two", [2]),
            helper.make_node("ConstantOfShape", ["two"], ["zeros"], value=zero),
            helper.make_node("Concat", ["given", "zeros"], ["flat"], axis=0),
            _const("pairs_shape", [-1, 2]),
            helper.make_node("Reshape", ["flat", "pairs_shape"], ["pairs"]),
            _const("minus_one", [-1]),
            _const("lowest", [-(2**63)]),
            _const("axis0", [0]),
            helper.make_node(
                "Slice", ["pairs", "minus_one", "lowest", "axis0", "minus_one"], ["r"]
            ),
            helper.make_node("Transpose", ["r"], ["cols"], perm=[1, 0]),
            helper.make_node("Reshape", ["cols", "minus_one"], ["pads_i"]),
            helper.make_node("Cast", ["pads_i"], ["pads"], to=i64),
        ]
    else:
        inits.append(onnx.numpy_helper.from_array(np.array([0, 0, 0, 1], "int64"), "pads"))
    nodes += [
        helper.make_node("Pad", ["labels", "pads", "fill"], ["padded"]),
        helper.make_node("Slice", ["padded", "one", "end", "one"], ["shifted"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("labels", i64, ["n", "s"])],
        [helper.make_tensor_value_info("shifted", i64, ["n", "s"])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("fold_chain", [True, False])
def test_constant_pads_and_shifted_labels_import_and_match(fold_chain):
    """Pads computed from constants are folded before import (stock: "Dynamic pads are not
    supported yet"); ``[:, 1:]`` with an INT64_MAX end is declared ``s`` long, not
    ``min(INT64_MAX, s + 1) - min(1, s + 1)`` (a form that sent FuseTIR into endless
    recursion in GPT-2's loss)."""
    import onnxruntime as ort

    from tvm_fusion.build import engine
    from tvm_fusion.frontend import fold_constants

    model = _padded_labels_model(fold_chain)
    assert fold_constants(model)[1] == (7 if fold_chain else 0)
    mod = load_onnx(model)
    n, s = mod["main"].params[0].ty.shape.values
    shifted = mod["main"].body.blocks[0].bindings[-1].var
    assert [str(d) for d in shifted.ty.shape.values] == [str(n), str(s)], shifted.ty
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    _, compiled = run(mod, [np.zeros((1, 1), "int64")])
    for shape in [(2, 5), (3, 1)]:
        labels = np.arange(np.prod(shape), dtype="int64").reshape(shape)
        want = session.run(None, {"labels": labels})[0]
        got = engine.TvmRunner(compiled, [labels]).outputs()[0]
        np.testing.assert_array_equal(got, want)


def test_incomplete_shape_inference_writes_no_file(tmp_path, monkeypatch):
    """ONNX Runtime's symbolic shape inference, when it cannot finish (here an op of an unknown
    domain), saves the model and its weights as external data into the working directory before
    raising (575 MB for VGG-19): the importer must leave the user's directory as it was."""
    from tvm_fusion.frontend import onnx_known_shapes

    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.ones(16, "float32"))
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"]),
        helper.make_node("Foo", ["y"], ["z"], domain="custom.x"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        [w],
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("custom.x", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    monkeypatch.chdir(tmp_path)
    assert onnx_known_shapes._infer(model) is not None
    assert list(tmp_path.iterdir()) == []


def _repeat_interleave_model():
    """TorchScript's export of ``x.repeat_interleave(k, dim=0)`` with ``k`` read from a shape
    (transformers' ``batched_mm`` experts: ``k`` is the top-k indices' last, static dim behind a
    dynamic token dim): ``Shape`` -> ``Slice`` -> ``OneHot`` repeats -> ``Tile`` -> ``Reshape``."""
    i64 = TensorProto.INT64
    nodes = [
        helper.make_node("Shape", ["ids"], ["ids_shape"]),
        _const("minus_one", [-1]),
        _const("big", [2**62]),
        _const("zero", [0]),
        helper.make_node("Slice", ["ids_shape", "minus_one", "big", "zero"], ["k1"]),
        helper.make_node("Squeeze", ["k1", "zero"], ["k"]),
        _const("one_shape", [1]),
        helper.make_node("Reshape", ["k", "one_shape"], ["k_1"]),
        _const("off", [1]),
        helper.make_node("Concat", ["off", "k_1"], ["on_off"], axis=0),
        _const("axis", [1]),
        helper.make_node(  # a scalar depth, as the export writes it
            "Constant", [], ["rank"], value=helper.make_tensor("rank", i64, [], [3])
        ),
        helper.make_node("OneHot", ["axis", "rank", "on_off"], ["reps_2d"], axis=-1),
        helper.make_node("Reshape", ["reps_2d", "minus_one"], ["reps"]),
        _const("one", [1]),
        helper.make_node("Unsqueeze", ["x", "one"], ["x3"]),
        helper.make_node("Tile", ["x3", "reps"], ["tiled"]),
        _const("rows", [-1, 4]),
        helper.make_node("Reshape", ["tiled", "rows"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["t", 4]),
            helper.make_tensor_value_info("ids", i64, ["t", 2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["r", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_static_dim_of_a_shape_folds_repeat_interleave():
    """The static dim of a dynamic tensor's ``Shape`` folds, and the ``OneHot`` repeats after
    it: ``Tile`` keeps its static dims (stock's ``dyn_tile`` to fresh ``tile_dim`` vars hid the
    rows of a gathered expert GEMM from FuseGatheredGates in the TorchScript Mixtral export),
    and the numbers match ONNX Runtime at two token counts."""
    import onnxruntime as ort

    from tvm_fusion.build import engine
    from tvm_fusion.frontend import fold_constants

    model = _repeat_interleave_model()
    folded, count = fold_constants(model)
    assert count == 6, count  # Slice, Squeeze, Reshape, Concat, OneHot, Reshape
    tile = next(n for n in folded.graph.node if n.op_type == "Tile")
    assert tile.input[1] in {i.name for i in folded.graph.initializer}
    mod = load_onnx(model)
    y = mod["main"].body.blocks[0].bindings[-1].var
    rows, cols = y.ty.shape.values
    assert isinstance(cols, tvm.tirx.IntImm) and int(cols) == 4, y.ty
    t = mod["main"].params[0].ty.shape.values[0]
    assert tvm.sym.Analyzer().can_prove_equal(rows, t * 2), y.ty
    assert "tile_dim" not in mod.script()
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    _, compiled = run(mod, [np.zeros((1, 4), "float32"), np.zeros((1, 2), "int64")])
    for t in (3, 1):
        x = np.arange(4 * t, dtype="float32").reshape(t, 4)
        ids = np.zeros((t, 2), "int64")
        want = session.run(None, {"x": x, "ids": ids})[0]
        got = engine.TvmRunner(compiled, [x, ids]).outputs()[0]
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, np.repeat(x, 2, axis=0))
