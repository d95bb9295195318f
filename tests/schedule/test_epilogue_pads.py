"""A Pad fused after a convolution or a pool (ONNX ``auto_pad="SAME_UPPER"`` on the next Conv:
the importer pads in an op of its own, FuseOps fuses it into the producer's kernel) writes
more than its producer: TVM 0.27's ``reverse_compute_at`` derives the moved block's loops from
the producer's region and dropped the padded column or row, which the next Conv then read
uninitialised (errors up to 53 at a scale of 6; found by the fuzzer's ``convnets`` family).
The CPU rules now leave such a block at the root (``_common.covered_by``).

Every rule that schedules the producer, on every ``cpu_target``: the pad's loops cover all of
its output. On the host, the kernel alone writes every element of an output filled with NaN
first, and matches NumPy."""

import numpy as np
import pytest
import tvm
from helpers import fused_prim_funcs
from tvm import relax, s_tir
from tvm.relax import op as R

from tvm_fusion import tir_util
from tvm_fusion.schedule import cpu
from tvm_fusion.schedule._common import covered_by
from tvm_fusion.target import host_target

RNG = np.random.default_rng(58)
PAD = [0, 0, 0, 0, 0, 1, 0, 1]  # one row and one column at the end: SAME_UPPER at stride 2


def _case(kind: str, c: int = 8, hw=(13, 28)):
    """(module, reference of x, the kernel's constant arguments) for ``kind`` -> pad."""
    x = relax.Var("x", relax.TensorType((1, c, *hw), "float32"))
    w = (RNG.standard_normal((16, c, 3, 3)) / np.sqrt(9 * c)).astype("float32")
    dw = RNG.standard_normal((c, 1, 3, 3)).astype("float32")
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            if kind == "conv":
                y = R.nn.relu(R.nn.conv2d(x, relax.const(w), padding=1))
            elif kind == "pool":
                y = R.nn.max_pool2d(x, (3, 3), (1, 1), (1, 1, 1, 1))
            else:  # depthwise
                y = R.nn.conv2d(x, relax.const(dw), padding=1, groups=c)
            out = bb.emit_output(R.nn.pad(y, PAD))
        bb.emit_func_output(out)

    def reference(xv):
        import torch

        t = torch.from_numpy(xv)
        if kind == "conv":
            y = torch.relu(torch.nn.functional.conv2d(t, torch.from_numpy(w), padding=1))
        elif kind == "pool":
            y = torch.nn.functional.max_pool2d(t, 3, 1, 1)
        else:
            y = torch.nn.functional.conv2d(t, torch.from_numpy(dw), padding=1, groups=c)
        return np.pad(y.numpy(), [(0, 0), (0, 0), (0, 1), (0, 1)])

    consts = {"conv": [w], "pool": [], "depthwise": [dw]}[kind]
    return bb.get(), reference, consts


RULES = {"conv": cpu.Matmul, "pool": cpu.WindowReduction, "depthwise": cpu.WindowReduction}


def _scheduled(kind, target):
    mod, reference, consts = _case(kind)
    (func,) = fused_prim_funcs(mod, target, containing="pad")
    sch = RULES[kind]().apply(func, target, False)
    assert sch is not None, f"{RULES[kind].__name__} refused the {kind}"
    return sch.mod["main"], reference, consts


def _pad_iterations(func) -> int:
    """Iterations of the loops around the pad's block(s): every element once."""
    total = 0
    for realize in tir_util.iter_stmts(func.body):
        if not isinstance(realize, s_tir.SBlockRealize):
            continue
        if not realize.block.name_hint.startswith("PadInput"):
            continue
        inner = tir_util.iter_stmts(realize.block.body)
        if any(isinstance(s, s_tir.SBlockRealize) for s in inner):
            continue  # a loop partition's enclosing block: its parts are counted
        loops = [lp for lp in tir_util.loops(func) if _encloses(lp, realize)]
        count = 1
        for lp in loops:
            count *= int(lp.extent)
        total += count
    return total


def _encloses(loop, stmt) -> bool:
    return any(s.same_as(stmt) for s in tir_util.iter_stmts(loop.body))


@pytest.mark.parametrize("kind", list(RULES))
def test_the_pad_covers_its_output(kind, cpu_target):
    func, _, _ = _scheduled(kind, cpu_target)
    channels = 16 if kind == "conv" else 8
    assert _pad_iterations(func) == channels * 14 * 29


@pytest.mark.parametrize("kind", list(RULES))
def test_the_pad_writes_every_element(kind):
    target = host_target()
    func, reference, consts = _scheduled(kind, target)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
    x = RNG.standard_normal((1, 8, 13, 28)).astype("float32")
    ref = reference(x)
    args = [tvm.runtime.tensor(a) for a in [x, *consts]]
    out = tvm.runtime.tensor(np.full(ref.shape, np.nan, "float32"))
    lib["main"](*args, out)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-5)


def test_covered_by_compares_sizes():
    """A same-shape epilogue and a slice are covered; a pad is not."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def f(a: T.Buffer((4, 6), "float32"), b: T.Buffer((4, 7), "float32")):
        t = T.sblock_alloc_buffer((4, 6))
        s = T.sblock_alloc_buffer((4, 5))
        for i, j in T.grid(4, 6):
            with T.sblock("t"):
                vi, vj = T.axis.remap("SS", [i, j])
                t[vi, vj] = a[vi, vj] * T.float32(2)
        for i, j in T.grid(4, 5):
            with T.sblock("s"):
                vi, vj = T.axis.remap("SS", [i, j])
                s[vi, vj] = t[vi, vj + 1]
        for i, j in T.grid(4, 7):
            with T.sblock("p"):
                vi, vj = T.axis.remap("SS", [i, j])
                b[vi, vj] = T.if_then_else(vj < 6, t[vi, vj], T.float32(0))

    sch = s_tir.Schedule(f)
    t, s, p = (sch.get_sblock(n) for n in "tsp")
    assert covered_by(sch, t, s)
    assert not covered_by(sch, t, p)
