"""The CPU injective rule on a static innermost extent that no power of two divides (55, as
SqueezeNet's 55 x 55 images): whole vectors plus a shorter vector tail
(``schedule_spatial`` -> ``vectorize_with_tail``), where the loop stayed scalar. SqueezeNet's
slice + bias + ReLU + concatenation (128 x 55 x 55) took 0.15 ms, 0.07 this way (AVX-512, two
threads). Compile-only checks follow the target's lanes; the numbers run on the host."""

import numpy as np
import pytest
import tvm
from helpers import fused_prim_funcs, run
from tvm import relax
from tvm.relax import op as R

from tvm_fusion import target as _target
from tvm_fusion import tir_util
from tvm_fusion.schedule import cpu

RNG = np.random.default_rng(55)


def _concat_module(width, channels=(4, 6), batch=1):
    """relu(slice(a) + bias) concatenated with b along the channels: a is one wider and taller
    (the Winograd output a 3x3 branch leaves), as in a SqueezeNet fire module."""
    a = relax.Var("a", relax.TensorType((batch, channels[0], width + 1, width + 1), "float32"))
    b = relax.Var("b", relax.TensorType((batch, channels[1], width, width), "float32"))
    bias = RNG.standard_normal((1, channels[0], 1, 1)).astype("float32")
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            s = R.strided_slice(a, axes=[2, 3], begin=[0, 0], end=[width, width])
            y = R.nn.relu(R.add(s, relax.const(bias)))
            out = bb.emit_output(R.concat([y, b], axis=1))
        bb.emit_func_output(out)
    return bb.get(), bias


def _kernel(mod, target):
    (func,) = fused_prim_funcs(mod, target, layout_free=False, containing="concat")
    return func


def _vector_loops(func) -> list[int]:
    return [
        int(lp.extent)
        for lp in tir_util.loops(func)
        if lp.kind == tvm.tirx.ForKind.VECTORIZED and isinstance(lp.extent, tvm.tirx.IntImm)
    ]


@pytest.mark.parametrize("width", [55, 40, 27, 13])
def test_odd_rows_vectorised_with_a_tail(cpu_target, width):
    """55 wide: vectors of the target's lanes and a tail of 55 % lanes, under parallel rows. 40:
    the power-of-two divisor as before (8 lanes, or 8 of 16). 13: one vector of 8 and a tail of
    5 on AVX2, 3 of 4 and a tail of one (left scalar) on SSE and NEON; under one vector of 16
    (AVX-512) the loop is left whole."""
    func = _kernel(_concat_module(width)[0], cpu_target)
    sch = cpu.Injective().apply(func, cpu_target, False)
    assert sch is not None
    lanes = _target.vector_lanes(cpu_target, "float32")
    vectors = _vector_loops(sch.mod["main"])
    kinds = [lp.kind for lp in tir_util.loops(sch.mod["main"])]
    # rows in parallel where there is enough work (10 x 13 x 13 is under MIN_PARALLEL_WORK)
    assert (tvm.tirx.ForKind.PARALLEL in kinds) == (width > 13)
    if width % 2 == 0:
        assert vectors and all(width % v == 0 for v in vectors), vectors
    elif width > lanes:
        tail = [width % lanes] if width % lanes > 1 else []  # a tail of one stays scalar
        assert sorted(vectors) == sorted([lanes, *tail]), vectors
    else:
        assert vectors == [], vectors  # under one vector: left to LLVM, as before


@pytest.mark.parametrize("width,batch", [(55, 1), (37, 2), (13, 1)])
def test_numbers_match_numpy(target, width, batch):
    mod, bias = _concat_module(width, batch=batch)
    a = RNG.standard_normal((batch, 4, width + 1, width + 1)).astype("float32")
    b = RNG.standard_normal((batch, 6, width, width)).astype("float32")
    y = np.maximum(a[:, :, :width, :width] + bias, 0)
    out, _ = run(mod, [a, b], "tvm_fusion", target=target)
    np.testing.assert_allclose(out[0], np.concatenate([y, b], axis=1), rtol=1e-6, atol=1e-6)
