"""A 1x1 convolution in NCHW as MLAS runs it (``_conv.channels_as_rows``): the output channels
are the GEMM's rows and the merged ``(h, w)`` its vector axis, so that X is read and Y written
in whole vectors along ``hw``. The other orientation (rows ``hw``, channels as vectors)
broadcast X element by element and wrote every output tile back through a transpose:
ResNet-50's 64->256 at 56 x 56 with its residual took 1.32 ms against ONNX Runtime's 1.07,
0.64 ms this way (AVX-512, 2 threads). Only where ``hw`` is a multiple of the target's lanes
(no padded copy of X): the expectation follows the target, not the host. Numbers against numpy,
symbolic batch, residual epilogue, on the host's own build."""

import numpy as np
import pytest
import tvm
from helpers import accumulator_tiles, fused_prim_funcs, run
from tvm import relax
from tvm.relax import op as R

from tvm_fusion import target as _target
from tvm_fusion.schedule import cpu

RNG = np.random.default_rng(7)


def _module(w, bias, shape, residual: bool):
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    params = [x]
    if residual:
        out_shape = (shape[0], w.shape[0], shape[2], shape[3])
        r = relax.Var("r", relax.TensorType(out_shape, "float32"))
        params.append(r)
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            y = R.add(R.nn.conv2d(x, relax.const(w)), relax.const(bias.reshape(1, -1, 1, 1)))
            if residual:
                y = R.add(y, r)
            out = bb.emit_output(R.nn.relu(y))
        bb.emit_func_output(out)
    return bb.get()


def _conv_kernel(mod, target):
    (func,) = fused_prim_funcs(mod, target, containing="conv")
    return func


def _accumulators(func) -> list[tuple]:
    """The shapes of the register tiles of a scheduled kernel."""
    return [tuple(int(d) for d in buf.shape) for buf in accumulator_tiles(func, compacted=False)]


@pytest.mark.parametrize("hw", [8, 7])
def test_orientation_follows_the_lanes(cpu_target, hw):
    """48 channels. 8 x 8 (64 rows, a multiple of 4, 8 and 16 lanes): the accumulator is
    (.., channels, hw), hw its last (vector) axis, on every target. 7 x 7 (49, no multiple of
    any lanes): the rule keeps rows ``hw`` and the channels as vectors, (.., hw, channels)."""
    w = RNG.standard_normal((48, 32, 1, 1)).astype("float32")
    bias = RNG.standard_normal(48).astype("float32")
    func = _conv_kernel(_module(w, bias, (1, 32, hw, hw), residual=False), cpu_target)
    sch = cpu.Matmul().apply(func, cpu_target, False)
    assert sch is not None
    (acc,) = _accumulators(sch.mod["main"])
    lanes = _target.vector_lanes(cpu_target, "float32")
    if (hw * hw) % lanes == 0:
        assert acc[-1] == hw * hw and acc[-2] == 48, acc
    else:
        assert acc[-1] == 48 and acc[-2] >= hw * hw, acc  # rows padded to the tile


@pytest.mark.parametrize(
    "shape,f",
    [
        ((tvm.tirx.Var("batch", "int64"), 24, 8, 8), 48),  # symbolic batch
        ((2, 16, 4, 8), 40),  # 32 rows; 40 channels (5 rows of 8)
        ((1, 8, 6, 6), 16),  # 36 rows: swapped only at 4 lanes
        ((1, 3, 5, 5), 7),  # nothing divides: the other orientation
    ],
)
@pytest.mark.parametrize("residual", [False, True])
def test_numbers_match_numpy(target, shape, f, residual):
    c = shape[1]
    w = (RNG.standard_normal((f, c, 1, 1)) / np.sqrt(c)).astype("float32")
    bias = RNG.standard_normal(f).astype("float32")
    n = 2 if not isinstance(shape[0], int) else shape[0]
    x = RNG.standard_normal((n, c, shape[2], shape[3])).astype("float32")
    y = np.einsum("fc,nchw->nfhw", w[:, :, 0, 0], x) + bias.reshape(1, -1, 1, 1)
    inputs = [x]
    if residual:
        r = RNG.standard_normal(y.shape).astype("float32")
        inputs.append(r)
        y = y + r
    out, _ = run(_module(w, bias, shape, residual), inputs, "tvm_fusion", target=target)
    np.testing.assert_allclose(out[0], np.maximum(y, 0), rtol=1e-4, atol=1e-4)
