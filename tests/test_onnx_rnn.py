"""ONNX LSTM / GRU / RNN (tvm_fusion/frontend/onnx_rnn.py): imported, unrolled, and each step one
fused gate kernel; numbers against ONNX Runtime (ONNX's reference evaluator where ORT lacks the
attribute: layout 1), at two batch sizes of a dynamic batch."""

import io
import re

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper

import tvm_fusion
from tvm_fusion import ModelError
from tvm_fusion.build import engine
from tvm_fusion.build.pipeline import fusion_passes
from tvm_fusion.lower import rnn_loop
from tvm_fusion.transform import collect_rewrites

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _model(kind, seq, inp, hid, direction="forward", **opts):
    """One recurrent node with constant W, R (and B, P); X (seq, batch, inp) or, with
    ``layout=1``, (batch, seq, inp); optional initial states and sequence_lens as inputs."""
    rng = np.random.default_rng(opts.get("seed", 0))
    g, nd = GATES[kind], 2 if direction == "bidirectional" else 1
    layout = opts.get("layout", 0)

    def init(name, *shape, scale=0.5):
        array = (rng.standard_normal(shape) * scale).astype("float32")
        return onnx.numpy_helper.from_array(array, name)

    inits = [init("W", nd, g * hid, inp), init("R", nd, g * hid, hid)]
    names = ["X", "W", "R", ""]
    if opts.get("bias", True):
        inits.append(init("B", nd, 2 * g * hid, scale=1.0))
        names[3] = "B"
    x_shape = [seq, "batch", inp] if layout == 0 else ["batch", seq, inp]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)]
    names.append("")
    if opts.get("lens"):
        inputs.append(helper.make_tensor_value_info("L", TensorProto.INT32, ["batch"]))
        names[4] = "L"
    state = [nd, "batch", hid] if layout == 0 else ["batch", nd, hid]
    if opts.get("init"):
        names.append("H0")
        inputs.append(helper.make_tensor_value_info("H0", TensorProto.FLOAT, state))
        if kind == "LSTM":
            names.append("C0")
            inputs.append(helper.make_tensor_value_info("C0", TensorProto.FLOAT, state))
    if opts.get("peep"):
        names += [""] * (8 - len(names) - 1) + ["P"]
        inits.append(init("P", nd, 3 * hid, scale=1.0))
    while names[-1] == "":
        names.pop()
    outs = ["Y", "Y_h"] + (["Y_c"] if kind == "LSTM" else [])
    attrs = {"hidden_size": hid, "direction": direction}
    for key in ("layout", "clip", "activations", "activation_alpha", "activation_beta"):
        if key in opts:
            attrs[key] = opts[key]
    if kind == "GRU":
        attrs["linear_before_reset"] = opts.get("lbr", 0)
    if opts.get("input_forget"):
        attrs["input_forget"] = 1
    node = helper.make_node(kind, names, outs, **attrs)
    out_info = [
        helper.make_tensor_value_info(o, TensorProto.FLOAT, [None] * (4 if o == "Y" else 3))
        for o in outs
    ]
    graph = helper.make_graph([node], "g", inputs, out_info, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opts.get("opset", 17))])
    model.ir_version = 8
    return model


def _reference(model):
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        return lambda feeds: session.run(None, feeds)
    except Exception:  # ORT has no layout 1
        from onnx.reference import ReferenceEvaluator

        evaluator = ReferenceEvaluator(model)
        return lambda feeds: evaluator.run(None, feeds)


def _check(model, batches=(1, 3), **flags):
    """Numbers of the tvm_fusion build (``flags`` to its pipeline) against the reference; the
    rewrite counts of the graph passes on the unrolled form (ChooseRecurrence off: what a
    target without the loop kernel gets), ``ChooseRecurrence`` of the CPU build's."""
    reference = _reference(model)
    mod = tvm_fusion.load_onnx(model)
    with collect_rewrites() as counts:
        tvm.transform.Sequential(fusion_passes(tvm_fusion.host_target(), choose_recurrence=False))(
            mod
        )
    with collect_rewrites() as cpu:
        tvm.transform.Sequential(fusion_passes(tvm_fusion.host_target()))(mod)
    counts["ChooseRecurrence"] = cpu["ChooseRecurrence"]
    compiled = engine.compile_module(mod, tvm_fusion.host_target(), "tvm_fusion", **flags)
    seq = model.graph.input[0].type.tensor_type.shape.dim
    for batch in batches:
        rng = np.random.default_rng(batch)
        feeds = {}
        for info in model.graph.input:
            dims = [batch if d.dim_param else d.dim_value for d in info.type.tensor_type.shape.dim]
            if info.name == "L":
                steps = max(d.dim_value for d in seq)
                feeds["L"] = rng.integers(1, steps + 1, batch).astype("int32")
            else:
                feeds[info.name] = rng.standard_normal(dims).astype("float32")
        want = reference(feeds)
        got = engine.TvmRunner(compiled, [feeds[i.name] for i in model.graph.input]).outputs()
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6)
    return counts


@pytest.mark.parametrize(
    "kind, seq, inp, hid, direction, opts",
    [
        ("LSTM", 5, 6, 7, "forward", {}),
        ("LSTM", 4, 6, 8, "bidirectional", {"layout": 1, "init": True}),
        ("LSTM", 3, 5, 4, "reverse", {"bias": False, "clip": 0.5}),
        ("LSTM", 3, 5, 4, "forward", {"peep": True}),
        # the forget piece of the split is unused (f = 1 - i): FuseSplitGates wants every piece
        ("LSTM", 3, 5, 4, "forward", {"peep": True, "input_forget": True, "fused": False}),
        ("LSTM", 5, 4, 6, "forward", {"lens": True}),
        (
            "LSTM",
            3,
            4,
            5,
            "forward",
            {
                "activations": ["HardSigmoid", "ScaledTanh", "Softsign"],
                "activation_alpha": [0.25, 0.7, 0.0],
                "activation_beta": [0.4, 1.3, 0.0],
            },
        ),
        # linear_before_reset 0 multiplies r into h before R_h: a second GEMM on the gates'
        # result, which a gate kernel cannot hold; torch's GRU (1) fuses
        ("GRU", 5, 6, 7, "forward", {"fused": False}),
        ("GRU", 4, 6, 5, "bidirectional", {"lbr": 1, "init": True}),
        ("GRU", 3, 4, 5, "forward", {"opset": 22, "lbr": 1}),
        ("RNN", 4, 3, 5, "forward", {"activations": ["Relu"]}),
        ("RNN", 4, 3, 5, "reverse", {"activations": ["HardSigmoid"], "activation_alpha": [0.3]}),
    ],
)
def test_recurrent_op_matches_reference(kind, seq, inp, hid, direction, opts):
    counts = _check(_model(kind, seq, inp, hid, direction, **opts))
    directions = 2 if direction == "bidirectional" else 1
    steps = seq * directions
    if kind != "RNN" and opts.get("fused", True):  # RNN's one gate is no split: no fusion
        assert counts["FuseSplitGates"] == steps
    # on CPU, what the loop kernel covers is one loop kernel per direction (numbers above)
    other = {"peep", "input_forget", "lens", "activations"} & set(opts)
    covered = not other and (kind != "GRU" or opts.get("lbr"))
    assert counts["ChooseRecurrence"] == (directions if covered else 0)


def _dynamic(model):
    """``model`` with its sequence axis renamed ``seq`` (symbolic)."""
    layout = next((a.i for a in model.graph.node[0].attribute if a.name == "layout"), 0)
    model.graph.input[0].type.tensor_type.shape.dim[layout].dim_param = "seq"
    return model


def _loops(mod):
    """The loop kernels that ``main`` calls, once per call (equal kernels are one PrimFunc)."""
    return re.findall(r"call_tir\((?:cls\.)?(\w+_loop\d*)", mod["main"].script())


@pytest.mark.parametrize(
    "kind, inp, hid, direction, opts",
    [
        # 19 units: two whole 8-unit blocks and a padded one; batch 5: a 4-row tile and a tail
        # "parallel": unit blocks in parallel at any size (else serial below 2**19 MACs a row)
        ("LSTM", 6, 19, "bidirectional", {"layout": 1, "init": True, "parallel": True}),
        # clip against ORT (ONNX's reference evaluator, layout 1's reference, ignores it)
        ("LSTM", 5, 16, "reverse", {"clip": 0.5}),
        ("GRU", 5, 7, "reverse", {"lbr": 1, "init": True, "clip": 0.9}),
        ("RNN", 4, 16, "forward", {"bias": False}),
    ],
)
def test_dynamic_sequence_runs_one_loop_kernel_per_direction(
    kind, inp, hid, direction, opts, monkeypatch
):
    """A symbolic sequence length: the input projection one GEMM, the recurrence one loop
    kernel per direction (no unrolled steps, so no gate rewrites); numbers as the reference at
    sequence lengths 1, 6 and 20 and batches 1 and 5, and empty outputs at length 0."""
    if opts.get("parallel"):
        monkeypatch.setattr(rnn_loop, "PARALLEL_MIN_MACS", 0)
    model = _dynamic(_model(kind, 3, inp, hid, direction, **opts))
    reference = _reference(model)
    mod = tvm_fusion.load_onnx(model)
    directions = 2 if direction == "bidirectional" else 1
    assert len(_loops(mod)) == directions, _loops(mod)
    with collect_rewrites() as counts:
        tvm.transform.Sequential(fusion_passes(tvm_fusion.host_target()))(mod)
    assert counts["FuseSplitGates"] == 0
    compiled = engine.compile_module(mod, tvm_fusion.host_target(), "tvm_fusion")
    for seq, batch in ((1, 1), (6, 5), (20, 1), (0, 2)):
        rng = np.random.default_rng(seq)
        feeds = {}
        for info in model.graph.input:
            dims = [
                {"seq": seq, "batch": batch}.get(d.dim_param, d.dim_value)
                for d in info.type.tensor_type.shape.dim
            ]
            feeds[info.name] = rng.standard_normal(dims).astype("float32")
        got = engine.TvmRunner(compiled, list(feeds.values())).outputs()
        if seq == 0:  # Y empty; the final states are the initial ones (or zeros)
            assert got[0].size == 0
            want_h = feeds.get("H0", np.zeros_like(got[1]))
            np.testing.assert_array_equal(got[1], want_h)
            continue
        for g, w in zip(got, reference(feeds), strict=True):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    "kind, opts, why",
    [
        ("GRU", {"lbr": 0}, "linear_before_reset = 0"),
        ("LSTM", {"peep": True}, "peepholes"),
        ("LSTM", {"lens": True}, "sequence_lens"),
        ("RNN", {"activations": ["Relu"]}, "activations"),
    ],
)
def test_dynamic_sequence_outside_the_loop_kernel_is_a_clear_error(kind, opts, why):
    model = _dynamic(_model(kind, 4, 3, 5, **opts))
    with pytest.raises(ModelError, match=f"{kind} with a dynamic sequence length and {why}"):
        tvm_fusion.load_onnx(model)


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_torch_recurrent_layers_fuse_every_step(cell):
    """``nn.LSTM`` (2 layers, bidirectional, batch_first) and ``nn.GRU`` through
    ``torch.onnx.export``: ONNX LSTM/GRU ops (stock TVM: no converter), one fused gate kernel
    per step, layer and direction; numbers as ONNX Runtime's."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    if cell == "LSTM":
        module, x = (
            torch.nn.LSTM(12, 16, num_layers=2, bidirectional=True, batch_first=True),
            (torch.randn(3, 5, 12)),
        )
        axes, steps = {"x": {0: "batch"}}, 2 * 2 * 5
    else:
        module, x = torch.nn.GRU(12, 16), torch.randn(5, 3, 12)
        axes, steps = {"x": {1: "batch"}}, 5
    buffer = io.BytesIO()
    torch.onnx.export(
        module.eval(), (x,), buffer, input_names=["x"], dynamic_axes=axes, dynamo=False
    )
    model = onnx.load_from_string(buffer.getvalue())
    assert cell in {n.op_type for n in model.graph.node}
    counts = _check(model)
    assert counts["FuseSplitGates"] == steps


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_torch_recurrent_layers_dynamic_sequence(cell):
    """``nn.LSTM`` / ``nn.GRU`` (2 layers, bidirectional, batch_first, initial states) through
    the TorchScript exporter with dynamic batch and sequence axes: one loop kernel per layer
    and direction; numbers as ONNX Runtime's at sequence lengths 1, 7, 20 (the dynamo export
    is in the corpus)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module = getattr(torch.nn, cell)(12, 16, num_layers=2, bidirectional=True, batch_first=True)
    x, h0 = torch.randn(3, 5, 12), torch.randn(4, 3, 16)
    args = (x, (h0, torch.randn(4, 3, 16))) if cell == "LSTM" else (x, h0)
    names = ["x", "h0", "c0"][: 3 if cell == "LSTM" else 2]
    axes = {"x": {0: "batch", 1: "seq"}, "h0": {1: "batch"}, "c0": {1: "batch"}}
    buffer = io.BytesIO()
    torch.onnx.export(
        module.eval(),
        args,
        buffer,
        input_names=names,
        dynamic_axes={k: axes[k] for k in names},
        dynamo=False,
    )
    model = onnx.load_from_string(buffer.getvalue())
    mod = tvm_fusion.load_onnx(model)
    assert len(_loops(mod)) == 4, _loops(mod)
    reference = _reference(model)
    compiled = engine.compile_module(mod, tvm_fusion.host_target(), "tvm_fusion")
    rng = np.random.default_rng(0)
    for seq, batch in ((1, 1), (7, 3), (20, 2)):
        feeds = {"x": rng.standard_normal((batch, seq, 12)).astype("float32")}
        for name in names[1:]:
            feeds[name] = rng.standard_normal((4, batch, 16)).astype("float32")
        got = engine.TvmRunner(compiled, [feeds[n] for n in names]).outputs()
        for g, w in zip(got, reference(feeds), strict=True):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6)


def _expanded_states(model, value: float):
    """``model`` (built with ``init``) with H0 / C0 no inputs but ``value`` expanded to
    (num_dir, batch, hidden) from X's batch, as the exporters write zero initial states."""
    graph = model.graph
    states = [i.name for i in graph.input if i.name in ("H0", "C0")]
    dims = [d.dim_value for d in graph.input[1].type.tensor_type.shape.dim]
    for name in states:
        graph.input.remove(next(i for i in graph.input if i.name == name))
    graph.initializer.extend(
        [
            onnx.numpy_helper.from_array(np.array([value], "float32"), "fill"),
            onnx.numpy_helper.from_array(np.array([1], "int64"), "one"),
            onnx.numpy_helper.from_array(np.array([2], "int64"), "two"),
            onnx.numpy_helper.from_array(np.array([dims[0]], "int64"), "dirs"),
            onnx.numpy_helper.from_array(np.array([dims[2]], "int64"), "units"),
        ]
    )
    nodes = [
        helper.make_node("Shape", ["X"], ["x_shape"]),
        helper.make_node("Slice", ["x_shape", "one", "two"], ["batch_dim"]),
        helper.make_node("Concat", ["dirs", "batch_dim", "units"], ["state_shape"], axis=0),
    ]
    nodes += [helper.make_node("Expand", ["fill", "state_shape"], [name]) for name in states]
    for i, node in enumerate(nodes):
        graph.node.insert(i, node)
    return model


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("value", [0.0, 0.5])
def test_dynamic_sequence_zero_initial_states_are_set_in_the_loop_kernel(kind, value):
    """Initial states expanded from a zero constant (the TorchScript / dynamo exports' zero
    states): the loop kernel starts from zeros and takes no state arguments, so no broadcast or
    slice kernels run before it; a non-zero constant keeps them. Numbers as ORT's."""
    opts = {"init": True, "lbr": 1} if kind == "GRU" else {"init": True}
    model = _expanded_states(_dynamic(_model(kind, 3, 5, 7, "bidirectional", **opts)), value)
    reference = _reference(model)
    mod = tvm_fusion.load_onnx(model)
    calls = re.findall(r"call_tir\((?:cls\.)?\w+_loop\d*, \(([^)]*)\)", mod["main"].script())
    states = 0 if value == 0.0 else (2 if kind == "LSTM" else 1)
    assert [c.count(",") + 1 for c in calls] == [3 + states] * 2, calls
    compiled = engine.compile_module(mod, tvm_fusion.host_target(), "tvm_fusion")
    for seq, batch in ((6, 5), (1, 1)):
        x = np.random.default_rng(seq).standard_normal((seq, batch, 5)).astype("float32")
        got = engine.TvmRunner(compiled, [x]).outputs()
        for g, w in zip(got, reference({"X": x}), strict=True):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6)


def test_small_hidden_sizes_take_8_unit_blocks():
    """Blocks of 8 units where 16-unit ones would pad more (hidden 24: 24 units, not 32), below
    64 units; 16 otherwise. The blocked weight follows the kernel's block width."""
    assert [rnn_loop.lanes_for(h) for h in (7, 16, 19, 24, 32, 40, 72)] == [8, 16, 8, 8, 16, 8, 16]
    r = np.arange(4 * 24 * 24, dtype="float32").reshape(4 * 24, 24)
    w = rnn_loop.block_weight(r, 4)
    assert w.shape == (3, 24, 4, 8)
    np.testing.assert_array_equal(w[1, 5, 2, 3], r[2 * 24 + 8 + 3, 5])


def test_dynamic_sequence_batch_major_input_is_projected_untransposed():
    """X in layout 1 (torch's ``batch_first``): the input GEMM reads X as it is and the loop
    kernel reads a (batch, seq, gates * hidden) projection; a layout 0 X stays seq-major.
    (Numbers: the layout 1 case of the dynamic-sequence test above.)"""
    for layout, dims in ((1, "batch, seq"), (0, "seq, batch")):
        mod = tvm_fusion.load_onnx(_dynamic(_model("LSTM", 3, 5, 7, layout=layout)))
        script = mod["main"].script()
        assert f"R.shape([{dims}, 28])" in script, script
