"""Operators imported through ONNX's function bodies, and ``Constant`` in every form
(``tvm_fusion/frontend/onnx_functions.py``): the rewrite itself (what is expanded, what is left
alone), and the numbers of the imported model against ONNX's reference implementation, with
static and symbolic dims."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import run
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from tvm_fusion import load_onnx
from tvm_fusion.errors import ModelError
from tvm_fusion.frontend import load, onnx_functions


def _model(nodes, inputs, outputs, opset=18, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


def _value(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _check(model, feeds_list, rtol=1e-5, atol=1e-5):
    reference = ReferenceEvaluator(model)
    mod = load_onnx(model)
    for feeds in feeds_list:
        want = reference.run(None, feeds)
        got, _ = run(mod, list(feeds.values()))
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype)
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def _constants_model():
    """``x * value_float + value_floats``, reshaped by ``value_ints``."""
    nodes = [
        helper.make_node("Constant", [], ["a"], value_float=2.5),
        helper.make_node("Constant", [], ["b"], value_floats=[1.0, -2.0, 3.0]),
        helper.make_node("Constant", [], ["s"], value_ints=[3, 2]),
        helper.make_node("Constant", [], ["k"], value_int=1),
        helper.make_node("Mul", ["x", "a"], ["xa"]),
        helper.make_node("Add", ["xa", "b"], ["y"]),
        helper.make_node("Reshape", ["y", "s"], ["z"]),
        helper.make_node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["z", "kf"], ["out"]),
    ]
    return _model(
        nodes, [_value("x", TensorProto.FLOAT, [2, 3])], [_value("out", TensorProto.FLOAT, [3, 2])]
    )


def test_constant_forms_become_value_tensors():
    model = _constants_model()
    rewritten, count = onnx_functions.normalize_constants(model)
    assert count == 4
    for node in rewritten.graph.node[:4]:
        assert [a.name for a in node.attribute] == ["value"]
    # the caller's model is not changed; one without such constants is returned as it is
    assert [a.name for a in model.graph.node[0].attribute] == ["value_float"]
    assert onnx_functions.normalize_constants(rewritten) == (rewritten, 0)


def test_constant_forms_numbers():
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.0
    _check(_constants_model(), [{"x": x}])


def _swish_model(opset=24, shape=("n", 5)):
    nodes = [helper.make_node("Swish", ["x"], ["y"], alpha=0.75)]
    return _model(
        nodes,
        [_value("x", TensorProto.FLOAT, list(shape))],
        [_value("y", TensorProto.FLOAT, list(shape))],
        opset,
    )


def test_function_body_replaces_an_unknown_op():
    model = _swish_model()
    assert load._unsupported_ops(model) == ["Swish"]
    expanded, count = onnx_functions.expand_functions(model, load._known_ops())
    assert count == 1
    ops = [n.op_type for n in expanded.graph.node]
    assert "Swish" not in ops and "Sigmoid" in ops, ops
    assert load._unsupported_ops(expanded) == []
    # the outputs keep their names; the body's values are prefixed by the node's
    assert expanded.graph.node[-1].output[0] == "y"
    assert model.graph.node[0].op_type == "Swish"


def test_known_ops_are_not_expanded():
    """Ops with a converter stay, though ONNX defines them by a function (must not fire)."""
    nodes = [
        helper.make_node("LeakyRelu", ["x"], ["a"], alpha=0.1),
        helper.make_node("Gelu", ["a"], ["y"]),
    ]
    model = _model(
        nodes, [_value("x", TensorProto.FLOAT, [4])], [_value("y", TensorProto.FLOAT, [4])], 20
    )
    assert onnx_functions.expand_functions(model, load._known_ops()) == (model, 0)


def test_op_without_a_body_is_still_refused_in_one_line():
    nodes = [helper.make_node("Det", ["x"], ["y"])]
    model = _model(
        nodes, [_value("x", TensorProto.FLOAT, [3, 3])], [_value("y", TensorProto.FLOAT, [])]
    )
    if "Det" in load._known_ops():
        pytest.skip("the importer converts Det")
    assert onnx_functions.expand_functions(model, load._known_ops())[1] == 0
    with pytest.raises(ModelError, match="cannot be imported: Det"):
        load_onnx(model)


def test_body_written_for_an_older_opset_is_converted(monkeypatch):
    """A body whose ops changed since it was written (MeanVarianceNormalization's opset-13 body,
    ReduceMean with an ``axes`` attribute, in an opset-18 model) goes through ONNX's version
    converter after the node's attributes are resolved: the axes stay the node's."""
    schema = onnx.defs.get_schema("MeanVarianceNormalization", 18, "")
    old = onnx.FunctionProto()
    old.ParseFromString(schema.get_function_with_opset_version(13))
    monkeypatch.setattr(onnx_functions, "_function", lambda node, opset, types: old)
    node = helper.make_node("MeanVarianceNormalization", ["x"], ["y"], axes=[0, 2], name="mvn")
    nodes = onnx_functions._body(node, 18, {}, "_fn0_")
    reduces = [n for n in nodes if n.op_type == "ReduceMean"]
    assert len(reduces) == 2 and all(len(n.input) == 2 and not n.attribute for n in reduces)
    outputs = [o for n in nodes for o in n.output]
    assert all(o == "y" or o.startswith("mvn_fn0_") for o in outputs), outputs
    monkeypatch.undo()
    model = _model(
        nodes,
        [_value("x", TensorProto.FLOAT, [2, 3, 4])],
        [_value("y", TensorProto.FLOAT, [2, 3, 4])],
    )
    x = np.random.default_rng(0).random((2, 3, 4), dtype=np.float32)
    mean = x.mean(axis=(0, 2), keepdims=True)
    std = np.sqrt((x * x).mean(axis=(0, 2), keepdims=True) - mean * mean)
    got = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, (x - mean) / (std + 1e-9), rtol=1e-5, atol=1e-5)
    _check(model, [{"x": x}])


def test_body_version_check():
    # ReduceMean's axes moved from an attribute (13) to an input (18): a body written for 13
    # must not be inlined into an opset-18 model
    assert not onnx_functions._same_version("ReduceMean", 13, 18)
    assert onnx_functions._same_version("Sigmoid", 13, 18)
    assert not onnx_functions._same_version("NoSuchOp", 18, 18)


@pytest.mark.parametrize("rows", [1, 7])
def test_swish_numbers_symbolic_rows(rows):
    x = np.linspace(-4, 4, rows * 5, dtype=np.float32).reshape(rows, 5)
    _check(_swish_model(), [{"x": x}])


def test_center_crop_pad_numbers():
    nodes = [helper.make_node("CenterCropPad", ["x", "shape"], ["y"], axes=[0, 1])]
    shape = onnx.numpy_helper.from_array(np.array([5, 2], np.int64), "shape")
    model = _model(
        nodes,
        [_value("x", TensorProto.FLOAT, [3, 6, 2])],
        [_value("y", TensorProto.FLOAT, [5, 2, 2])],
        18,
        [shape],
    )
    x = np.arange(36, dtype=np.float32).reshape(3, 6, 2)
    _check(model, [{"x": x}])


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_elu_selu_celu_in_other_float_types(dtype):
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [
        helper.make_node("Elu", ["x"], ["a"], alpha=0.5),
        helper.make_node("Selu", ["a"], ["b"]),
        helper.make_node("Celu", ["b"], ["y"], alpha=2.0),
    ]
    model = _model(nodes, [_value("x", elem, [9])], [_value("y", elem, [9])], 18)
    x = np.linspace(-3, 3, 9).astype(dtype)
    _check(model, [{"x": x}], rtol=2e-3 if dtype == np.float16 else 1e-6)


def _attention_model(three_d: bool, causal: bool, mask: str | None, gqa: bool):
    """ONNX's (opset 23) Attention with symbolic batch and sequence lengths."""
    hq, hkv, d = (4, 2, 8) if gqa else (2, 2, 8)
    attrs = {"is_causal": int(causal)}
    if three_d:
        attrs.update(q_num_heads=hq, kv_num_heads=hkv)
        q = _value("q", TensorProto.FLOAT, ["b", "s", hq * d])
        k = _value("k", TensorProto.FLOAT, ["b", "n", hkv * d])
        v = _value("v", TensorProto.FLOAT, ["b", "n", hkv * d])
    else:
        q = _value("q", TensorProto.FLOAT, ["b", hq, "s", d])
        k = _value("k", TensorProto.FLOAT, ["b", hkv, "n", d])
        v = _value("v", TensorProto.FLOAT, ["b", hkv, "n", d])
    inputs = [q, k, v]
    names = ["q", "k", "v"]
    if mask:
        elem = TensorProto.BOOL if mask == "bool" else TensorProto.FLOAT
        inputs.append(_value("m", elem, ["s", "n"]))
        names.append("m")
    node = helper.make_node("Attention", names, ["y"], **attrs)
    out = ["b", "s", hq * d] if three_d else ["b", hq, "s", d]
    return _model([node], inputs, [_value("y", TensorProto.FLOAT, out)], 23)


def _attention_feeds(model, b, s, n, seed):
    rng = np.random.default_rng(seed)
    feeds = {}
    for info in model.graph.input:
        dims = [
            {"b": b, "s": s, "n": n}[d.dim_param] if d.dim_param else d.dim_value
            for d in info.type.tensor_type.shape.dim
        ]
        if info.type.tensor_type.elem_type == TensorProto.BOOL:
            feeds[info.name] = rng.random(dims) > 0.3
        else:
            feeds[info.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


@pytest.mark.parametrize(
    "three_d,causal,mask,gqa",
    [
        (False, False, None, False),
        (False, True, None, True),
        (True, True, None, True),
        (True, False, "bool", False),
        (False, False, "float", True),
    ],
)
def test_attention_opset23_numbers(three_d, causal, mask, gqa):
    """Stock imported opset 23's Attention with the com.microsoft converter ("'num_heads'")."""
    model = _attention_model(three_d, causal, mask, gqa)
    # causal: self-attention; else keys of another length
    feeds = [
        _attention_feeds(model, 2, 5, 5 if causal else 3, 0),
        _attention_feeds(model, 1, 1, 1 if causal else 4, 1),
    ]
    _check(model, feeds)


def _shape_reshape_model():
    """``Reshape(x, [Shape(x)[0], 2, -1])``, x declared (1, 6); its second output the shape."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], end=1),
        helper.make_node("Concat", ["s", "tail"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
        helper.make_node("Shape", ["x"], ["whole"]),
    ]
    tail = onnx.numpy_helper.from_array(np.array([2, -1], np.int64), "tail")
    return _model(
        nodes,
        [_value("x", TensorProto.FLOAT, [1, 6])],
        [_value("y", TensorProto.FLOAT, [1, 2, 3]), _value("whole", TensorProto.INT64, [2])],
        18,
        [tail],
    )


def test_static_shape_folds_unless_the_user_makes_it_symbolic():
    """A ``Shape`` whose dims are all static folds before import (the padded-key ``Pad`` of
    ONNX's Attention body: "cannot handle ShapeExpr inputs"), but not a graph output's; with
    ``shapes=`` making the batch symbolic the model's static 1 is not folded into the reshape
    (it would reshape a batch of 3 to one row)."""
    from tvm_fusion.frontend import fold_constants

    model = _shape_reshape_model()
    folded, count = fold_constants(model)
    assert count == 2  # Shape and Concat; the graph output's Shape stays
    assert [n.op_type for n in folded.graph.node] == ["Reshape", "Shape"]
    x = np.arange(18, dtype=np.float32).reshape(3, 6)
    mod = load_onnx(model, shapes={"x": ["b", 6]})
    (y, whole), _ = run(mod, [x])
    np.testing.assert_array_equal(y, x.reshape(3, 2, 3))
    np.testing.assert_array_equal(whole, [3, 6])


def test_attention_common_form_is_converted_and_fused():
    """The common form is not expanded: our converter writes the chain FuseAttention fuses
    (scale on the scores, the causal ``where``), at symbolic batch and sequence lengths."""
    import tvm_fusion
    from tvm_fusion import analysis
    from tvm_fusion.transform import collect_rewrites

    model = _attention_model(three_d=True, causal=True, mask=None, gqa=True)
    assert onnx_functions.expand_functions(model, load._known_ops()) == (model, 0)
    with collect_rewrites() as counts:
        analysis.grouped(load_onnx(model), tvm_fusion.host_target(), True)
    assert counts.get("FuseAttention", 0) == 1, dict(counts)


def test_attention_other_forms_use_the_function_body():
    """softcap (and past key / value, qk output...) are not ours: the node is expanded, and
    the numbers are ONNX's (must-not-fire for the converter)."""
    q = _value("q", TensorProto.FLOAT, [1, 2, "s", 4])
    k = _value("k", TensorProto.FLOAT, [1, 2, "s", 4])
    v = _value("v", TensorProto.FLOAT, [1, 2, "s", 4])
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], softcap=2.0, is_causal=1)
    model = _model([node], [q, k, v], [_value("y", TensorProto.FLOAT, [1, 2, "s", 4])], 23)
    expanded, count = onnx_functions.expand_functions(model, load._known_ops())
    assert count == 1 and "Tanh" in {n.op_type for n in expanded.graph.node}
    _check(model, [_attention_feeds(model, 1, 6, 6, 2), _attention_feeds(model, 1, 1, 1, 3)])
