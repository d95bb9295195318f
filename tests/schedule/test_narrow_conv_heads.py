"""Window convolutions with few output channels (a segmentation, depth or image head: 64 -> 1
or 3 channels at 128 x 128): the CPU Matmul rule takes their output width as the vector axis,
the weight broadcast (``_conv.narrow_channels``). With one output channel the weight had no
spatial axis left, the rule refused, and the fallback rule took 3.4x ONNX Runtime's time; 2-4
channels were vectors of 2-4 lanes. A 1x1 convolution to one channel takes the
channels-as-rows GEMM (``_conv.channels_as_rows``: one row). More channels, a stride (but for
one channel), a width no half vector divides, channels last: the schedule as it was.
Compile-only on every ``cpu_target``; the numbers on the host against torch."""

import numpy as np
import pytest
import tvm
from helpers import fused_prim_funcs, matches_reference
from tvm import relax, s_tir
from tvm.relax import op as R

from tvm_fusion import analysis, tir_util
from tvm_fusion.schedule import cpu
from tvm_fusion.schedule.cpu import _conv

RNG = np.random.default_rng(57)


def _module(n, c, o, hw, k, stride=1, dil=1, pad=None, nhwc=False):
    """sigmoid(conv(x) + bias): x (n, c, h, w) (NHWC: (n, h, w, c), weight OHWI)."""
    h, w = hw
    wt = (RNG.standard_normal((o, c, k, k)) / np.sqrt(c * k * k)).astype("float32")
    b = RNG.standard_normal(o).astype("float32")
    pad = k // 2 * dil if pad is None else pad
    shape = (n, h, w, c) if nhwc else (n, c, h, w)
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    kw = dict(strides=stride, padding=pad, dilation=dil)
    with bb.function("main", [x]):
        with bb.dataflow():
            if nhwc:
                y = R.nn.conv2d(
                    x, relax.const(wt.transpose(0, 2, 3, 1).copy()), data_layout="NHWC",
                    kernel_layout="OHWI", **kw,
                )  # fmt: skip
                y = R.add(y, relax.const(b))
            else:
                y = R.add(R.nn.conv2d(x, relax.const(wt), **kw), relax.const(b.reshape(-1, 1, 1)))
            out = bb.emit_output(R.sigmoid(y))
        bb.emit_func_output(out)
    return bb.get(), wt, b


def _reference(x, wt, b, stride, dil, pad):
    import torch

    y = torch.nn.functional.conv2d(
        torch.from_numpy(x), torch.from_numpy(wt), torch.from_numpy(b), stride, pad, dil
    )
    return torch.sigmoid(y).numpy()


def _vector_extent(mod, target) -> int | None:
    """The extent of the convolution's block axis bound to its vectorized loop (the output
    width when flipped, the channels otherwise), None when the Matmul rule refuses."""
    (conv,) = fused_prim_funcs(mod, target, containing="conv")
    sch = cpu.Matmul().apply(conv, target, False)
    if sch is None:
        return None
    func = sch.mod["main"]
    vectorized = {
        lp.loop_var.name for lp in tir_util.loops(func) if lp.kind == tvm.tirx.ForKind.VECTORIZED
    }
    (realize,) = [
        s
        for s in tir_util.iter_stmts(func.body)
        if isinstance(s, s_tir.SBlockRealize) and s.block.name_hint.endswith("_update")
    ]
    for iv, value in zip(realize.block.iter_vars, realize.iter_values, strict=True):
        if {v.name for v in tir_util.vars_in(value)} & vectorized:
            return int(iv.dom.extent)
    return None


@pytest.mark.parametrize(
    "n, c, o, hw, k, stride, dil",
    [
        (1, 64, 1, (128, 128), 3, 1, 1),  # the fallback rule's before
        (2, 64, 3, (30, 30), 3, 1, 1),  # 30 wide: 15, 6 or 3 lanes divide it
        (1, 16, 2, (40, 64), 5, 1, 2),
        (1, 32, 4, (16, 48), 3, 1, 1),
        (1, 64, 1, (64, 64), 3, 2, 1),  # one channel: any stride
    ],
)
def test_narrow_heads_take_the_width_as_vectors(n, c, o, hw, k, stride, dil, cpu_target):
    mod, _, _ = _module(n, c, o, hw, k, stride, dil)
    width = (hw[1] + 2 * (k // 2 * dil) - dil * (k - 1) - 1) // stride + 1
    assert _vector_extent(mod, cpu_target) == width


@pytest.mark.parametrize(
    "n, c, o, hw, k, stride, nhwc",
    [
        (1, 64, 8, (32, 32), 3, 1, False),  # above FLIP_MAX_CHANNELS
        (1, 32, 3, (97, 97), 5, 1, False),  # a prime width: no vector of it
        (1, 64, 3, (64, 64), 3, 2, False),  # strided loads of the width
        (1, 64, 3, (32, 32), 3, 1, True),  # channels last: the width is not contiguous
    ],
)
def test_other_convolutions_keep_the_channels_as_vectors(n, c, o, hw, k, stride, nhwc, cpu_target):
    mod, _, _ = _module(n, c, o, hw, k, stride, nhwc=nhwc)
    assert _vector_extent(mod, cpu_target) == o


def test_no_flip_without_the_rule(cpu_target, monkeypatch):
    """The flip is the only thing that schedules one output channel: without it, the refusal."""
    mod, _, _ = _module(1, 64, 1, (128, 128), 3)
    monkeypatch.setattr(_conv, "FLIP_MAX_CHANNELS", 0)
    assert _vector_extent(mod, cpu_target) is None


@pytest.mark.parametrize(
    "n, c, o, hw, k, stride, dil, pad",
    [
        (1, 64, 1, (128, 128), 3, 1, 1, None),
        (2, 8, 1, (9, 13), 3, 1, 1, None),
        (1, 32, 1, (97, 97), 5, 1, 1, None),  # one channel, a prime width
        (1, 64, 1, (33, 33), 3, 2, 1, None),
        (1, 16, 2, (40, 64), 5, 1, 2, None),
        (2, 64, 3, (30, 30), 3, 1, 1, None),
        (1, 32, 4, (16, 48), 3, 1, 1, 0),  # no padding
        (1, 3, 3, (1, 16), 3, 1, 1, None),  # one row
        (1, 64, 1, (32, 32), 1, 1, 1, 0),  # 1x1: channels as rows, one row
    ],
)
def test_narrow_heads_numbers(n, c, o, hw, k, stride, dil, pad):
    mod, wt, b = _module(n, c, o, hw, k, stride, dil, pad)
    x = RNG.standard_normal((n, c, *hw)).astype("float32")
    ref = _reference(x, wt, b, stride, dil, k // 2 * dil if pad is None else pad)
    compiled = matches_reference(mod, [([x], [ref])], rtol=1e-4, atol=1e-5)
    rules = {i.rule for i in analysis.schedule_info(compiled.lowered) if "conv" in i.name}
    assert rules == {"Matmul"}, rules


def test_symbolic_batch(cpu_target):
    """A symbolic batch is an outer column: flipped all the same."""
    mod, _, _ = _module(tvm.tirx.Var("n", "int64"), 16, 1, (24, 32), 3)
    assert _vector_extent(mod, cpu_target) == 32


def test_symbolic_batch_numbers():
    mod, wt, b = _module(tvm.tirx.Var("n", "int64"), 16, 1, (24, 32), 3)
    cases = []
    for size in (1, 3):
        x = RNG.standard_normal((size, 16, 24, 32)).astype("float32")
        cases.append(([x], [_reference(x, wt, b, 1, 1, 1)]))
    matches_reference(mod, cases, rtol=1e-4, atol=1e-5)
