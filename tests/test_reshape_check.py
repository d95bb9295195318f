"""ONNX ``Reshape`` to a target computed from the data (issue #40): the element count is
checked at run time (``check_reshape``, :mod:`tvm_fusion.frontend.onnx_reshape_check`).
Before, ``x`` of 12 elements reshaped to ``[1, 6]`` gave a (1, 6) tensor and to ``[3, 6]`` a
view reading past ``x``'s buffer, where onnxruntime refuses both. Every compiled case runs in
a child process, so that an out-of-bounds read that crashes fails its test instead of pytest."""

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import onnxruntime.capi.onnxruntime_pybind11_state as _ortc
import pytest
from onnx import TensorProto, helper

from tvm_fusion import load_onnx

CORPUS = Path(__file__).parent / "corpus"
_ORT_ERRORS = (_ortc.Fail, _ortc.InvalidArgument, _ortc.RuntimeException)

# compiles ARGV[0] with our pipeline on llvm, runs each feed of ARGV[1] (an npz of
# "<i>/<name>"), writes one JSON line per feed to ARGV[2]: the outputs, or the error's first line
_RUN = """
import json
import numpy as np
import onnx

from tvm_fusion import host_target, load_onnx
from tvm_fusion.build import engine

model = onnx.load(ARGV[0])
feeds = np.load(ARGV[1])
out = open(ARGV[2], "w")
compiled = engine.compile_module(load_onnx(model), host_target(), "tvm_fusion")
names = [v.name for v in model.graph.input]
for i in range(len(feeds.files) // len(names)):
    try:
        got = engine.TvmRunner(compiled, [feeds[f"{i}/{n}"] for n in names]).outputs()
        line = {"out": [[list(g.shape), g.reshape(-1).tolist()] for g in got]}
    except Exception as e:  # noqa: BLE001
        line = {"error": type(e).__name__ + ": " + str(e)}
    out.write(json.dumps(line) + "\\n")
    out.flush()
out.close()
"""


def _model(through_abs: bool, x_dims=(2, 6)):
    """``Reshape(x, t)`` (``Abs(t)`` with ``through_abs``), x float32 of ``x_dims``, t int64
    of 2 elements: a model input, so the target is data."""
    nodes = [helper.make_node("Abs", ["t"], ["target"])] if through_abs else []
    nodes.append(
        helper.make_node("Reshape", ["x", "target" if through_abs else "t"], ["y"], name="rs")
    )
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_dims)),
        helper.make_tensor_value_info("t", TensorProto.INT64, [2]),
    ]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])
    graph = helper.make_graph(nodes, "reshape", inputs, [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)


def _run(child, tmp_path, model, feeds: list[dict]) -> list[dict]:
    path, data, out = tmp_path / "m.onnx", tmp_path / "feeds.npz", tmp_path / "out.jsonl"
    path.write_bytes(model.SerializeToString())
    np.savez(data, **{f"{i}/{n}": a for i, feed in enumerate(feeds) for n, a in feed.items()})
    child.run(_RUN, [str(path), str(data), str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == len(feeds), lines
    return lines


def _ort(model):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return lambda feed: sess.run(None, feed)


def _x():
    return np.arange(12, dtype="float32").reshape(2, 6) - 5.5


@pytest.mark.parametrize("through_abs", [True, False])
def test_valid_and_invalid_targets(tmp_path, through_abs, child):
    """Valid targets give onnxruntime's numbers; invalid ones (too few / too many elements,
    two -1, a -1 that does not divide) raise one ValueError naming the node, as onnxruntime
    refuses them."""
    model = _model(through_abs)
    valid = [[-3, 4], [0, 6], [-4, 3]] if through_abs else [[3, 4], [0, 6], [-1, 4], [0, -1]]
    invalid = [[1, 6], [3, 6], [0, 5]]
    invalid += [] if through_abs else [[-1, -1], [5, -1], [-2, -6], [0, -5]]
    feeds = [{"x": _x(), "t": np.array(t, "int64")} for t in valid + invalid]
    got = _run(child, tmp_path, model, feeds)
    ort_run = _ort(model)
    for feed, result in zip(feeds[: len(valid)], got, strict=False):
        (want,) = ort_run(feed)
        assert "out" in result, (feed["t"], result)
        shape, values = result["out"][0]
        assert tuple(shape) == want.shape, (feed["t"], shape, want.shape)
        np.testing.assert_array_equal(np.array(values, "float32").reshape(shape), want)
    for feed, result in zip(feeds[len(valid) :], got[len(valid) :], strict=True):
        with pytest.raises(_ORT_ERRORS):
            ort_run(feed)
        assert "error" in result, (feed["t"], result)
        assert "ValueError" in result["error"] and "Reshape 'rs'" in result["error"], result


def _kernels(model) -> int:
    mod = load_onnx(model)
    return sum("check_reshape" in gv.name_hint for gv in mod.get_global_vars())


def test_no_check_for_constant_or_shape_targets():
    """A constant target, and one computed from a dynamic input's Shape (``(2 * b, 2)`` of x
    (b, 4), kept as tensor ops by the importer, proven for b >= 1 and b = 0), get no check
    kernel; a target from the data gets one."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["p", "q"])
    const = helper.make_graph(
        [helper.make_node("Reshape", ["x", "c"], ["y"])],
        "const",
        [x],
        [y],
        [helper.make_tensor("c", TensorProto.INT64, [2], [-1, 2])],
    )
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Slice", ["s", "zero", "one"], ["b1"]),
        helper.make_node("Mul", ["b1", "two"], ["b2"]),
        helper.make_node("Concat", ["b2", "two"], ["t"], axis=0),
        helper.make_node("Reshape", ["x", "t"], ["y"]),
    ]
    inits = [
        helper.make_tensor(n, TensorProto.INT64, [1], [v])
        for n, v in (("zero", 0), ("one", 1), ("two", 2))
    ]
    arith = helper.make_graph(nodes, "arith", [x], [y], inits)
    for graph in (const, arith):
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)
        assert _kernels(model) == 0, graph.name
    assert _kernels(_model(True)) == 1
    # a corpus export (its Reshapes to Shape-derived targets): no check either
    assert _kernels(onnx.load(CORPUS / "gpt2_dynamo.onnx")) == 0


def test_data_target_resolved_to_fresh_dims():
    """A target from the data reaches the reshape as fresh dims, resolved (0 and -1) by tensor
    ops: not the nested Selects that took dlight and has_reshape_pattern 4-15 s a kernel on the
    fuzzer's signed targets, and not a match_cast of those Selects, which TVM simplifies as if
    the dims were >= 0 (a -1 target then fails at run time)."""
    from tvm import relax, tirx

    main = load_onnx(_model(True))["main"]
    reshapes = []
    relax.analysis.post_order_visit(
        main.body,
        lambda e: (
            reshapes.append(e)
            if isinstance(e, relax.Call) and getattr(e.op, "name", "") == "relax.reshape"
            else None
        ),
    )
    assert len(reshapes) == 1
    (dims,) = [r.args[1].values for r in reshapes]
    assert len(dims) == 2 and all(isinstance(d, tirx.Var) for d in dims), dims


def test_input_target_selects_stay_in_the_view():
    """A target that is a model input keeps the 0/-1 rules as Selects (the VM computes them on
    the host) in one ``vm.builtin.reshape`` view whose output is matched to fresh dims: the
    Relu after it sees plain vars (with the Selects in its shape, this graph took 170 s to
    compile) and still equals ONNX Runtime for 0 and -1 targets."""
    from tvm import relax, tirx

    from tvm_fusion import host_target
    from tvm_fusion.build import engine
    from tvm_fusion.models import shape_idioms
    from tvm_fusion.tir_util import expr_children

    idiom = shape_idioms.build("shape_input", batch=2, seq=3)
    mod = load_onnx(idiom.model)
    shapes = []

    def visit(e):
        ty = getattr(e, "ty", None)
        if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
            shapes.extend(ty.shape.values)

    relax.analysis.post_order_visit(mod["main"].body, visit)

    def selects(expr):
        stack, n = [expr], 0
        while stack:
            e = stack.pop()
            n += isinstance(e, tirx.Select)
            stack.extend(expr_children(e))
        return n

    assert shapes and sum(selects(d) for d in shapes) == 0
    compiled = engine.compile_module(mod, host_target(), "tvm_fusion")
    x = idiom.inputs["x"]
    session = ort.InferenceSession(idiom.model.SerializeToString())
    for target in ([0, 0, -1], [-1, 4, 8], [6, -1, 8], [0, 3, 32]):
        feed = {"x": x, "target": np.array(target, "int64")}
        want = session.run(None, feed)[0]
        got = engine.TvmRunner(compiled, list(feed.values())).outputs()[0]
        np.testing.assert_array_equal(got, want)
