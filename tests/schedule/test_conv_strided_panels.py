"""A strided 1x1 convolution that keeps its rows apart (no compact copy: ``x[.., 2h, 2w]``
read in place, where the copy buys no wider tile) and whose weights outweigh its input runs
its weight panels outside the output rows, as the window convolutions do (VGG): each panel
read from memory once and reused from L2 by every row. With the rows outside, each of the
(row, panel) tasks streamed its panel again: ResNet-50's 1024->2048 at 14 x 14 stride 2 (8 MiB
of weights) took 1.60-1.71 ms, 1.23 this way (AVX-512, 2 threads, alternating). The order
follows the target (AVX2 and SSE compact these rows instead); numbers against numpy on the
host's own build."""

import numpy as np
import pytest
import tvm
from helpers import fused_prim_funcs, run
from tvm import relax
from tvm.relax import op as R

from tvm_fusion import tir_util
from tvm_fusion.schedule import cpu

RNG = np.random.default_rng(2890)


def _module(w, shape, stride):
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = R.nn.relu(R.nn.conv2d(x, relax.const(w), strides=stride))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _scheduled(mod, target):
    (func,) = fused_prim_funcs(mod, target, containing="conv")
    sch = cpu.Matmul().apply(func, target, False)
    assert sch is not None
    names = tir_util.block_names(sch.mod["main"])
    (update,) = [n for n in names if n.endswith("_update")]
    loops = sch.get_loops(sch.get_sblock(update))
    return names, [(sch.get(lp).kind, sch.get(lp).extent) for lp in loops]


def _compacted(names) -> bool:
    return any(n.startswith("pad_temp_reindex") for n in names)


def test_weights_outside_the_rows(cpu_target):
    """256 -> 512 channels at 14 x 14, stride 2 (512 KiB of weights, a 196 KiB input): where
    the rows stay apart, the outermost (parallel) loop is the weight panels' and the 7 output
    rows run inside it."""
    w = (RNG.standard_normal((512, 256, 1, 1)) / 16).astype("float32")
    names, loops = _scheduled(_module(w, (1, 256, 14, 14), 2), cpu_target)
    if _compacted(names):  # merged rows (AVX2, SSE): one GEMM axis, nothing to order
        return
    nr = int(loops[-1][1]) * int(loops[-2][1])
    assert loops[0][0] == tvm.tirx.ForKind.PARALLEL, loops
    assert int(loops[0][1]) == 512 // nr, (nr, loops)
    assert int(loops[1][1]) == 7, loops


def test_weights_outside_the_rows_on_avx512():
    """The case above on AVX-512, where these rows are not compacted: 16 panels of 32 floats
    outermost (before: the 7 rows x 16 panels fused into one parallel loop of 112)."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    w = (RNG.standard_normal((512, 256, 1, 1)) / 16).astype("float32")
    names, loops = _scheduled(_module(w, (1, 256, 14, 14), 2), target)
    assert not _compacted(names)
    assert [int(e) for _, e in loops[:2]] == [16, 7], loops


def test_small_weights_keep_the_rows_outside():
    """32 -> 64 channels at 28 x 28, stride 2 (8 KiB of weights, a 98 KiB input): the rows
    and panels stay fused in one parallel loop (14 rows x 2 panels)."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    w = (RNG.standard_normal((64, 32, 1, 1)) / 8).astype("float32")
    names, loops = _scheduled(_module(w, (1, 32, 28, 28), 2), target)
    assert not _compacted(names)
    assert int(loops[0][1]) == 28, loops


@pytest.mark.parametrize("shape", [(2, 96, 13, 13), (1, 96, 9, 15)])
def test_strided_numbers(target, shape):
    """Odd images (13 x 13 -> 7 x 7, 9 x 15 -> 5 x 8), a batch of 2; the host's own build."""
    w = (RNG.standard_normal((160, 96, 1, 1)) / 8).astype("float32")
    x = RNG.standard_normal(shape).astype("float32")
    mod = _module(w, shape, 2)
    y = np.maximum(np.einsum("fc,nchw->nfhw", w[:, :, 0, 0], x[:, :, ::2, ::2]), 0)
    out, _ = run(mod, [x], "tvm_fusion", target=target)
    np.testing.assert_allclose(out[0], y, rtol=1e-4, atol=1e-4)
