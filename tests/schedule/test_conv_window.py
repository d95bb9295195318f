"""Regular convolutions on the CPU Matmul rule (VGG's and ResNet's 3x3 and 1x1 layers).

A k x k convolution keeps its reduction loops (input channels, kh, kw): fused into one flat
``k`` its input was read at ``x[k // 9, h + k % 9 // 3, w + k % 3]``, a division per FMA step
(VGG-19's 3x3 layers 1.5-3.6x ONNX Runtime's time, 0.5-1.2x kept apart). A 1x1 convolution's
rows ``(h, w)``, contiguous in its NCHW input and output, become one axis of ``h * w`` rows that
takes the GEMM's tile (ResNet's 14 x 14 layers: 196 rows in tiles of 4, where the width alone
took tiles of 2). Where the weights outweigh the image (VGG's 512-channel layers), the loop
over weight panels encloses the output rows. The tiles are checked compile-only on AVX2,
AVX-512 and NEON targets (``cpu_target``), the numbers on the host against ONNX Runtime at
small odd shapes."""

import numpy as np
import pytest
import tvm
from helpers import accumulator_tiles, fused_prim_funcs
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.relax import op as R

from tvm_fusion import analysis, load_onnx, tir_util
from tvm_fusion import target as _target
from tvm_fusion.build import engine
from tvm_fusion.schedule import cpu

RNG = np.random.default_rng(39)


def _conv_func(target, cin, cout, size, k, stride, batch=1):
    w = RNG.standard_normal((cout, cin, k, k)).astype("float32")
    b = RNG.standard_normal((1, cout, 1, 1)).astype("float32")
    x = relax.Var("x", relax.TensorType((batch, cin, *size), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = R.nn.conv2d(x, relax.const(w), strides=[stride] * 2, padding=[k // 2] * 4)
            out = bb.emit_output(R.nn.relu(R.add(y, relax.const(b))))
        bb.emit_func_output(out)
    (conv,) = fused_prim_funcs(bb.get(), target, containing="conv")
    return conv


def _update_block(sch):
    (block,) = [b for b in tir_util.blocks(sch.mod["main"]) if b.name_hint.endswith("_update")]
    return block


def _accumulators(sch):
    (acc,) = accumulator_tiles(sch.mod["main"])
    lanes_axis = int(acc.shape[-1])
    return tir_util.num_elements(acc) // lanes_axis, lanes_axis


def _has_division(expr) -> bool:
    stack = [expr]
    while stack:
        e = stack.pop()
        if isinstance(e, tvm.tirx.FloorDiv | tvm.tirx.FloorMod):
            return True
        stack.extend(tir_util.expr_children(e))
    return False


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("batch", [1, "symbolic"])
def test_window_loops_kept(stride, batch, cpu_target):
    """3x3 conv 16 -> 32 channels on 14 x 14: the reduction is three loops, the input read has
    no division, and the tile fits the target's registers: rows dividing the output width,
    whole vectors of channels, the accumulators leaving a row's weights twice over and two
    more registers free (AVX2, 16 registers of 8 lanes: 7 rows x 1 vector)."""
    n = tvm.tirx.Var("n", "int64") if batch == "symbolic" else batch
    func = _conv_func(cpu_target, 16, 32, (14, 14), 3, stride, n)
    sch = cpu.Matmul().apply(func, cpu_target, False)
    assert sch is not None
    block = _update_block(sch)
    reduce_iters = [iv for iv in block.iter_vars if iv.iter_type == tvm.tirx.IterVar.CommReduce]
    assert len(reduce_iters) == 3, block.iter_vars  # (channels, kh, kw), not one flat k
    (a_read,) = [r for r in block.reads if r.source.name.startswith("pad")]
    assert not any(_has_division(r.min) for r in a_read.region), a_read
    lanes = _target.vector_lanes(cpu_target, "float32")
    regs = _target.vector_registers(cpu_target)
    rows, channels = _accumulators(sch)
    width = 14 // stride
    assert channels % lanes == 0 and 32 % channels == 0, channels
    vectors = channels // lanes
    assert width % rows == 0 and rows > 1, rows
    assert rows * vectors + 2 * vectors + 2 <= regs, (rows, vectors, regs)
    # the tallest such tile of its width: no divisor of the width between it and the budget
    taller = [d for d in range(rows + 1, width + 1) if width % d == 0]
    assert not taller or taller[0] * vectors + 2 * vectors + 2 > regs, (rows, taller)


def test_pointwise_rows_merged(cpu_target):
    """1x1 conv 32 -> 64 channels on 14 x 14: one row axis of 196, tiled like a GEMM's rows
    (about half the target's register file in accumulators), where 14 rows took tiles of 2.
    Where 196 is whole vectors (4 lanes: SSE, NEON) the merged axis is the GEMM's vector axis
    and the channels its rows instead (test_conv_channels_as_rows.py), tiled the same way."""
    func = _conv_func(cpu_target, 32, 64, (14, 14), 1, 1)
    sch = cpu.Matmul().apply(func, cpu_target, False)
    assert sch is not None
    block = _update_block(sch)
    extents = [int(iv.dom.extent) for iv in block.iter_vars]
    assert 196 in extents, extents
    lanes = _target.vector_lanes(cpu_target, "float32")
    regs = _target.vector_registers(cpu_target)
    rows, vector_axis = _accumulators(sch)
    assert vector_axis % lanes == 0
    assert (64 if 196 % lanes == 0 else 196) % rows == 0
    # about half the register file in accumulators (a height dividing the rows at least half
    # the budget's): 14 rows in tiles of 2 x 2 vectors on AVX2 were a quarter of it
    assert regs // 4 < rows * (vector_axis // lanes) <= regs // 2, rows


def _onnx_conv(cin, cout, size, k, stride, pad, batch):
    w = RNG.standard_normal((cout, cin, k, k)).astype("float32")
    b = RNG.standard_normal(cout).astype("float32")
    nodes = [
        helper.make_node(
            "Conv",
            ["x", "w", "b"],
            ["c"],
            strides=[stride] * 2,
            pads=[pad] * 4,
            kernel_shape=[k, k],
        ),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, cin, *size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, cout, "H", "W"])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


CASES = {
    # (channels in, out, image, kernel, stride, pad)
    "3x3_5to7_9x11": (5, 7, (9, 11), 3, 1, 1),
    "3x3_5to7_9x11_s2": (5, 7, (9, 11), 3, 2, 1),
    "3x3_16to24_7x7": (16, 24, (7, 7), 3, 1, 1),
    "1x1_5to7_9x11": (5, 7, (9, 11), 1, 1, 0),
    "1x1_16to32_7x7": (16, 32, (7, 7), 1, 1, 0),
    "1x1_16to32_9x11_s2": (16, 32, (9, 11), 1, 2, 0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_conv_numbers(name, target):
    """Against ONNX Runtime, symbolic batch run at 1 and 3, on the host's build."""
    cin, cout, size, k, stride, pad = CASES[name]
    model = _onnx_conv(cin, cout, size, k, stride, pad, "N")
    compiled = engine.compile_module(load_onnx(model), target, "tvm_fusion")
    rules = {i.name: i.rule for i in analysis.schedule_info(compiled.lowered) if "conv" in i.name}
    assert set(rules.values()) == {"Matmul"}, rules
    for batch in (1, 3):
        x = RNG.standard_normal((batch, cin, *size)).astype("float32")
        (ref,) = engine.onnxruntime_runner(model, {"x": x}, 1)()
        (out,) = engine.TvmRunner(compiled, [x]).outputs()
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def _has(expr, kind) -> bool:
    stack = [expr]
    while stack:
        e = stack.pop()
        if isinstance(e, kind):
            return True
        stack.extend(tir_util.expr_children(e))
    return False


def test_weight_panels_outside_rows(cpu_target):
    """3x3 conv 32 -> 48 channels on 7 x 7 (96 on 32 registers, whose window tile of 7 rows x
    3 vectors makes 48 channels one panel): the weights (48 x 288) outweigh the image
    (32 x 9 x 9), so the loop over channel panels encloses the output rows: each panel is read
    from memory once, not once per row (VGG's 512-channel layers). Panels and rows are fused
    into the parallel loop: the channels are its quotient, the rows its remainder."""
    n_out = 48 if _target.vector_registers(cpu_target) == 16 else 96
    func = _conv_func(cpu_target, 32, n_out, (7, 7), 3, 1)
    sch = cpu.Matmul().apply(func, cpu_target, False)
    assert sch is not None
    (realize,) = [
        s
        for s in tir_util.iter_stmts(sch.mod["main"].body)
        if isinstance(s, tvm.s_tir.SBlockRealize) and s.block.name_hint.endswith("_update")
    ]
    spatial = [
        (int(iv.dom.extent), value)
        for iv, value in zip(realize.block.iter_vars, realize.iter_values, strict=True)
        if iv.iter_type == tvm.tirx.IterVar.DataPar and int(iv.dom.extent) > 1
    ]
    channels, height = spatial[0][1], spatial[1][1]  # (channels, h, w)
    assert [e for e, _ in spatial] == [n_out, 7, 7], spatial
    assert _has(channels, tvm.tirx.FloorDiv), channels  # the panel: the outer part
    assert _has(height, tvm.tirx.FloorMod), height  # the rows: the inner part
