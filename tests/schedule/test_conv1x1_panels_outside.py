"""NHWC 1x1 convolutions whose weights outgrow a core's L2 (``matmul.PANELS_OUTSIDE_ROWS_BYTES``):
the CPU Matmul rule puts the panel loop outside the output rows ``h``, so that every panel of
weights is read from memory once and reused from L2 by all rows, not streamed again for each
``h`` (ResNet-50's 512->2048 and 2048->512 at 7 x 7: 0.53x the time inside the model). Smaller
weights, and a symbolic batch, leave the schedule as it was. Compile-only on every
``cpu_target``; the numbers on the host against NumPy, a reduction in blocks (K = 1024) among
them."""

import numpy as np
import pytest
import tvm
from helpers import fused_prim_funcs, matches_reference
from tvm import relax, s_tir
from tvm.relax import op as R

from tvm_fusion import analysis, tir_util
from tvm_fusion.schedule import cpu
from tvm_fusion.schedule.cpu import matmul

RNG = np.random.default_rng(56)


def _module(n, hw: int, c: int, f: int):
    """x (n, hw, hw, c) NHWC -> relu(conv1x1 + bias), weight OHWI (as ChannelsLast emits)."""
    w = (RNG.standard_normal((f, 1, 1, c)) / np.sqrt(c)).astype("float32")
    b = RNG.standard_normal(f).astype("float32")
    x = relax.Var("x", relax.TensorType((n, hw, hw, c), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = R.nn.conv2d(x, relax.const(w), data_layout="NHWC", kernel_layout="OHWI")
            out = bb.emit_output(R.nn.relu(R.add(y, relax.const(b))))
        bb.emit_func_output(out)
    return bb.get(), w, b


def _h_under_panels(mod, target, hw: int, f: int) -> bool:
    """Whether the scheduled GEMM's output row ``h`` varies faster than its column panel: the
    loop binding the output channels ``f`` encloses the one binding ``h``, or, one fused loop
    binding both, ``h`` is its remainder (``fused % H``, not ``fused // panels``)."""
    (conv,) = fused_prim_funcs(mod, target, containing="conv")
    sch = cpu.Matmul().apply(conv, target, False)
    assert sch is not None
    func = sch.mod["main"]
    order = {lp.loop_var.name: i for i, lp in enumerate(tir_util.loops(func))}  # outer first
    (realize,) = [
        s
        for s in tir_util.iter_stmts(func.body)
        if isinstance(s, s_tir.SBlockRealize) and s.block.name_hint.endswith("_update")
    ]
    spatial = [
        (iv, value)
        for iv, value in zip(realize.block.iter_vars, realize.iter_values, strict=True)
        if iv.iter_type == iv.DataPar
    ]
    ext = [(iv, v, iv.dom.extent) for iv, v in spatial]
    ext = [(iv, v, int(e)) for iv, v, e in ext if isinstance(e, tvm.tirx.IntImm)]
    h_value = next(v for iv, v, e in ext if e == hw)  # h comes before w
    f_value = next(v for iv, v, e in ext if e == f)

    def outermost(value):
        return min(order[v.name] for v in tir_util.vars_in(value) if v.name in order)

    h_loop, f_loop = outermost(h_value), outermost(f_value)
    if h_loop == f_loop:
        return "%" in str(h_value)
    return f_loop < h_loop


@pytest.mark.parametrize(
    "hw, c, f, outside",
    [
        (7, 512, 1024, True),  # 2 MiB of weights, an image of 98 KiB
        (7, 1024, 512, True),
        (5, 768, 1024, True),  # 3 MiB, 5 x 5: odd rows
        (14, 256, 1024, False),  # 1 MiB: in L2, h stays outside
        (3, 16, 32, False),  # tiny
    ],
)
def test_panels_outside_rows_when_weights_outgrow_l2(hw, c, f, outside, cpu_target, monkeypatch):
    mod, _, _ = _module(1, hw, c, f)
    assert (f * c * 4 >= matmul.PANELS_OUTSIDE_ROWS_BYTES) == outside
    if outside:
        assert _h_under_panels(mod, cpu_target, hw, f)
    else:  # below the threshold the rule is as it was (h under the panels already where the
        # padded rows of AVX2's tiles take another path)
        now = _h_under_panels(mod, cpu_target, hw, f)
        monkeypatch.setattr(matmul, "PANELS_OUTSIDE_ROWS_BYTES", 1 << 60)
        assert now == _h_under_panels(mod, cpu_target, hw, f)


def test_symbolic_batch_keeps_rows_outside(cpu_target, monkeypatch):
    """A symbolic batch may make A the larger operand: nothing moves."""
    mod, _, _ = _module(tvm.tirx.Var("n", "int64"), 7, 512, 1024)
    now = _h_under_panels(mod, cpu_target, 7, 1024)
    monkeypatch.setattr(matmul, "PANELS_OUTSIDE_ROWS_BYTES", 1 << 60)
    assert now == _h_under_panels(mod, cpu_target, 7, 1024)


@pytest.mark.parametrize(
    "n, hw, c, f, threshold",
    [
        (1, 7, 512, 1024, None),
        (2, 7, 512, 1024, None),  # the batch moves under the panels too
        (1, 14, 1024, 512, None),
        (1, 3, 2048, 256, None),
        (1, 14, 1024, 256, 1 << 20),
    ],
)
def test_panels_outside_rows_numbers(n, hw, c, f, threshold, monkeypatch):
    """Against NumPy. K = 1024 runs in blocks, the tile's write-back under the row loop moved
    under the panels (14 x 14, 1024 -> 256 with the threshold at 1 MiB: with the write-back
    under the panel loop, the schedule raised and the kernel went to the fallback rule,
    176 ms inside ResNet-50)."""
    if threshold is not None:
        monkeypatch.setattr(matmul, "PANELS_OUTSIDE_ROWS_BYTES", threshold)
    mod, w, b = _module(n, hw, c, f)
    x = RNG.standard_normal((n, hw, hw, c)).astype("float32")
    y = np.maximum(np.einsum("nhwc,fc->nhwf", x, w[:, 0, 0, :]) + b, 0)
    compiled = matches_reference(mod, [([x], [y])], rtol=1e-4, atol=1e-4)
    rules = {i.name: i.rule for i in analysis.schedule_info(compiled.lowered) if "conv" in i.name}
    assert set(rules.values()) == {"Matmul"}, rules
