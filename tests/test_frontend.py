"""load_onnx: good models import; every kind of bad input is one ModelError line."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from tvm import relax

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
