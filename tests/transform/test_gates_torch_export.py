"""FuseSplitGates on the forms TVM's PyTorch frontend (``torch.export`` ->
``from_exported_program``) writes: a linear layer on ``(b, s, H)`` rows is
``reshape -> matmul (+ bias) -> reshape``, which the pass folds into one GEMM on the N-D rows
before it matches (``tvm_fusion/transform/fuse_split_gates/views.py``).

torch.export's ``nn.LSTM`` unrolls the sequence: per step the hidden GEMM plus the step's
slice of the input projection (a non-constant addend, read in the gate epilogue), one kernel
per step.

Must not fire: a view of the rows whose GEMM output is also read elsewhere; a reshape that
moves the split (feature) axis; a per-row ``(n, 1)`` addend; a GEMM (before the addend) also
read elsewhere.
"""

import numpy as np
import pytest
import tvm
from helpers import Base, compare_pipelines, matches_reference
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvm_fusion
from tvm_fusion import analysis
from tvm_fusion.transform import FuseSplitGates, collect_rewrites

torch = pytest.importorskip("torch")

SIZES = [(12, 7), (32, 16), (20, 13), (24, 24)]


class _Fused(torch.nn.Module):
    """Phi-3 / Qwen MLP gate: one ``gate_up_proj``, ``chunk(2)``, ``silu(gate) * up``."""

    def __init__(self, hidden, width):
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(hidden, 2 * width)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


class _Siblings(torch.nn.Module):
    """Llama MLP gate: sibling ``gate_proj`` and ``up_proj``."""

    def __init__(self, hidden, width, bias=False):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, width, bias=bias)
        self.up_proj = torch.nn.Linear(hidden, width, bias=bias)

    def forward(self, x):
        return torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)


def _import(module, hidden, inner=()):
    from tvm.relax.frontend.torch import from_exported_program

    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("seq", min=1, max=64)
    ep = torch.export.export(
        module.eval(), (torch.randn(2, 3, *inner, hidden),), dynamic_shapes=({0: batch, 1: seq},)
    )
    return from_exported_program(ep, keep_params_as_input=False)


def _check(module, hidden, inner=()):
    mod = _import(module, hidden, inner)
    with collect_rewrites() as counts:
        ours = analysis.kernels(analysis.grouped(mod, tvm_fusion.host_target(), ours=True))
    assert counts["FuseSplitGates"] == 1
    assert [k.name.startswith("fused_gates") for k in ours] == [True]
    shapes = [(1, 5, *inner, hidden), (3, 7, *inner, hidden)]
    matches_reference(mod, [_case(module, s, i) for i, s in enumerate(shapes)], 1e-4, 1e-4)


@pytest.mark.parametrize(("hidden", "width"), SIZES)
def test_fused_gate_up_proj_3d(hidden, width):
    torch.manual_seed(hidden)
    _check(_Fused(hidden, width), hidden)


@pytest.mark.parametrize(("hidden", "width"), SIZES)
@pytest.mark.parametrize("bias", [False, True])
def test_sibling_linears_3d(hidden, width, bias):
    torch.manual_seed(hidden)
    _check(_Siblings(hidden, width, bias), hidden)


class _GeGLU(torch.nn.Module):
    """GeGLU gates as torch.export writes them: ``gelu(a, approximate="tanh")`` is Relax
    ``nn.gelu_tanh`` (Gemma), erf ``gelu`` is ``nn.gelu``; the pieces from ``chunk``, ``split``
    or ``unflatten(-1, (2, D)).unbind(-2)``."""

    def __init__(self, hidden, width, approximate, spelling):
        super().__init__()
        self.up = torch.nn.Linear(hidden, 2 * width)
        self.width, self.approximate, self.spelling = width, approximate, spelling

    def forward(self, x):
        h = self.up(x)
        if self.spelling == "chunk":
            a, b = h.chunk(2, dim=-1)
        elif self.spelling == "split":
            a, b = h.split(self.width, dim=-1)
        else:
            a, b = h.unflatten(-1, (2, self.width)).unbind(-2)
        return torch.nn.functional.gelu(a, approximate=self.approximate) * b


@pytest.mark.parametrize(("approximate", "spelling"), [("tanh", "chunk"), ("none", "unbind")])
def test_geglu_spellings(approximate, spelling):
    """Found by scripts/holdout.py: Gemma's GeGLU (``gelu_tanh``) and gates taken by
    ``unflatten(-1, (2, D)).unbind(-2)`` were left unfused."""
    torch.manual_seed(2)
    _check(_GeGLU(20, 13, approximate, spelling), 20)


def test_gates_on_4d_rows():
    """N-D inputs: ``(b, s, 4, H)`` rows flattened around the GEMM fold the same way."""
    torch.manual_seed(1)
    _check(_Fused(20, 13), 20, inner=(4,))
    _check(_Siblings(20, 13, bias=True), 20, inner=(4,))


class _RNN(torch.nn.Module):
    def __init__(self, cell, hidden, width):
        super().__init__()
        self.rnn = cell(hidden, width, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
@pytest.mark.parametrize(("hidden", "width"), [(12, 7), (32, 16)])  # odd; vector multiples
def test_rnn_unrolled_steps(hidden, width, cell):
    """``nn.LSTM`` via torch.export: the sequence unrolls; per step ``h @ W_hh^T + b`` plus
    the step's slice of the input projection (a non-constant addend), ``split(4)``, gates.
    Each step is one kernel that reads the slice in its epilogue; the next step's GEMM reads
    this step's ``h``, so the steps stay separate kernels. ``nn.GRU`` alike (its hidden GEMM
    on ``(1, b, D)`` rows split in 3, the input slice added to the gate math)."""
    from tvm.relax.frontend.torch import from_exported_program

    torch.manual_seed(hidden)
    module, steps = _RNN(getattr(torch.nn, cell), hidden, width).eval(), 3
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(module, (torch.randn(2, steps, hidden),), dynamic_shapes=({0: batch},))
    mod = from_exported_program(ep, keep_params_as_input=False)
    with collect_rewrites() as counts:
        ours = analysis.kernels(analysis.grouped(mod, tvm_fusion.host_target(), ours=True))
    assert counts["FuseSplitGates"] == steps
    assert sum(k.name.startswith("fused_gates") for k in ours) == steps
    # against torch (stock TVM's numbers add nothing here), one build for both batches
    matches_reference(mod, [_case(module, (b, steps, hidden), b) for b in (1, 3)], 1e-4, 1e-4)


class _DeepRNN(torch.nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.rnn = cell(12, 7, num_layers=2, bidirectional=True)  # sequence first

    def forward(self, x):
        return self.rnn(x)[0]


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_rnn_two_layers_bidirectional_sequence_first(cell):
    """``nn.LSTM`` / ``nn.GRU`` with 2 layers, both directions, ``batch_first=False`` via
    torch.export: one gate kernel per step of each layer and direction (2 x 2 x 3)."""
    from tvm.relax.frontend.torch import from_exported_program

    torch.manual_seed(0)
    module, steps = _DeepRNN(getattr(torch.nn, cell)).eval(), 3
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(module, (torch.randn(steps, 2, 12),), dynamic_shapes=({1: batch},))
    mod = from_exported_program(ep, keep_params_as_input=False)
    target = tvm_fusion.host_target()
    with tvm.target.Target(target), collect_rewrites() as counts:
        tvm.transform.Sequential(tvm_fusion.fusion_passes(target))(mod)
    assert counts["FuseSplitGates"] == 2 * 2 * steps
    matches_reference(mod, [_case(module, (steps, b, 12), b) for b in (1, 3)], 1e-4, 1e-4)


def _case(module, shape, seed):
    x = np.random.default_rng(seed).standard_normal(shape).astype("float32")
    with torch.no_grad():
        return [x], [module(torch.from_numpy(x)).numpy()]


class GatesBase(Base):
    transform = FuseSplitGates(tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))


class FusesAsExpected(GatesBase):
    """``Expected`` is ``Before`` in the form it must fuse as: the pass gives both the same
    module, and a fused gate group."""

    def test_compare(self):
        after = self.transform(self.Before)
        expected = self.transform(self.Expected)
        tvm.ir.assert_structural_equal(after, expected, map_free_vars=True)
        assert "fused_gates" in after.script()


class TestViewsAroundGemmFold(FusesAsExpected):
    """The frontend's 3-D Linear: the views around the GEMM fold, the gate group then fuses
    (compared with the same module written on N-D rows)."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("b", "s", 4), "float32"), w: R.Tensor((8, 4), "float32")):
            b, s = T.int64(), T.int64()
            with R.dataflow():
                xf = R.reshape(x, R.shape([b * s, 4]))
                wt = R.permute_dims(w)
                y = R.matmul(xf, wt)
                r = R.reshape(y, R.shape([b, s, 8]))
                parts = R.split(r, 2, axis=-1)
                gate = parts[0]
                up = parts[1]
                out = R.multiply(R.sigmoid(gate), up)
                R.output(out)
            return out

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor(("b", "s", 4), "float32"), w: R.Tensor((8, 4), "float32")):
            with R.dataflow():
                wt = R.permute_dims(w)
                y = R.matmul(x, wt)
                parts = R.split(y, 2, axis=-1)
                gate = parts[0]
                up = parts[1]
                out = R.multiply(R.sigmoid(gate), up)
                R.output(out)
            return out


class TestUnbindPiecesAreChunks(FusesAsExpected):
    """torch's ``y.unflatten(-1, (2, D)).unbind(-2)`` as the frontend writes it (reshape, unit
    slices of the new axis, squeezes) fuses as the ``chunk`` of ``y`` does (symbolic rows)."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("b", "s", 4), "float32"), w: R.Tensor((8, 4), "float32")):
            b, s = T.int64(), T.int64()
            with R.dataflow():
                y = R.matmul(x, R.permute_dims(w))
                v = R.reshape(y, R.shape([b, s, 2, 4]))
                p0 = R.strided_slice(v, (2,), (0,), (1,), (1,))
                p1 = R.strided_slice(v, (2,), (1,), (2,), (1,))
                gate = R.squeeze(p0, axis=[2])
                up = R.squeeze(p1, axis=[2])
                out = R.multiply(R.nn.gelu_tanh(gate), up)
                R.output(out)
            return out

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor(("b", "s", 4), "float32"), w: R.Tensor((8, 4), "float32")):
            with R.dataflow():
                y = R.matmul(x, R.permute_dims(w))
                gate = R.strided_slice(y, (2,), (0,), (4,), (1,))
                up = R.strided_slice(y, (2,), (4,), (8,), (1,))
                out = R.multiply(R.nn.gelu_tanh(gate), up)
                R.output(out)
            return out


class TestInterleavedUnbindLeftAlone(GatesBase):
    """Must not fire: ``unflatten(-1, (D, 2)).unbind(-1)`` takes every other feature, not a
    contiguous half; the pieces are not the GEMM's chunks."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("b", 4), "float32"), w: R.Tensor((8, 4), "float32")):
            b = T.int64()
            with R.dataflow():
                y = R.matmul(x, R.permute_dims(w))
                v = R.reshape(y, R.shape([b, 4, 2]))
                p0 = R.strided_slice(v, (2,), (0,), (1,), (1,))
                p1 = R.strided_slice(v, (2,), (1,), (2,), (1,))
                gate = R.squeeze(p0, axis=[2])
                up = R.squeeze(p1, axis=[2])
                out = R.multiply(R.sigmoid(gate), up)
                R.output(out)
            return out

    Expected = Before


class TestGemmAlsoReadElsewhere(GatesBase):
    """Must not fire: the 2-D GEMM output is also a result of the function, so the view of it
    stays and the split does not read a GEMM."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("b", "s", 4), "float32"), w: R.Tensor((8, 4), "float32")):
            b, s = T.int64(), T.int64()
            with R.dataflow():
                xf = R.reshape(x, R.shape([b * s, 4]))
                wt = R.permute_dims(w)
                y = R.matmul(xf, wt)
                r = R.reshape(y, R.shape([b, s, 8]))
                parts = R.split(r, 2, axis=-1)
                gate = parts[0]
                up = parts[1]
                out = R.multiply(R.sigmoid(gate), up)
                R.output(out, y)
            return (out, y)

    Expected = Before


class TestViewMovesTheSplitAxis(GatesBase):
    """Must not fire: the view regroups the features, ``(b * s, 8) -> (b, s, 2, 4)``, and the
    split cuts the new last axis: the pieces are not runs of GEMM features."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("b", "s", 4), "float32"), w: R.Tensor((8, 4), "float32")):
            b, s = T.int64(), T.int64()
            with R.dataflow():
                xf = R.reshape(x, R.shape([b * s, 4]))
                wt = R.permute_dims(w)
                y = R.matmul(xf, wt)
                r = R.reshape(y, R.shape([b, s, 2, 4]))
                parts = R.split(r, 2, axis=-1)
                gate = parts[0]
                up = parts[1]
                out = R.multiply(R.sigmoid(gate), up)
                R.output(out)
            return out

    Expected = Before


class TestSiblingViewsFold(FusesAsExpected):
    """Sibling linear layers on 3-D rows, each wrapped in views: both fold onto ``x``, then
    join into one GEMM that fuses (compared with the module written on N-D rows)."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("b", "s", 4), "float32")):
            b, s = T.int64(), T.int64()
            with R.dataflow():
                xg = R.reshape(x, R.shape([b * s, 4]))
                wg = R.permute_dims(R.const(np.arange(16, dtype="float32").reshape(4, 4) / 16))
                yg = R.matmul(xg, wg)
                g = R.reshape(yg, R.shape([b, s, 4]))
                xu = R.reshape(x, R.shape([b * s, 4]))
                wu = R.permute_dims(R.const(np.ones((4, 4), "float32")))
                yu = R.matmul(xu, wu)
                u = R.reshape(yu, R.shape([b, s, 4]))
                out = R.multiply(R.nn.silu(g), u)
                R.output(out)
            return out

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor(("b", "s", 4), "float32")):
            with R.dataflow():
                wg = R.permute_dims(R.const(np.arange(16, dtype="float32").reshape(4, 4) / 16))
                g = R.matmul(x, wg)
                wu = R.permute_dims(R.const(np.ones((4, 4), "float32")))
                u = R.matmul(x, wu)
                out = R.multiply(R.nn.silu(g), u)
                R.output(out)
            return out


def _addend_module(addend_shape, y_also_output=False):
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([n, 4], "float32"))
    w = relax.Var("w", relax.TensorType([8, 4], "float32"))
    shape = [n if d == "n" else d for d in addend_shape]
    t = relax.Var("t", relax.TensorType(shape, "float32"))
    with bb.function("main", [x, w, t]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w))))
            s = bb.emit(relax.op.add(y, t))
            parts = bb.emit(relax.op.split(s, 2, axis=-1))
            gate = bb.emit(relax.TupleGetItem(parts, 0))
            up = bb.emit(relax.TupleGetItem(parts, 1))
            out = bb.emit_output(relax.op.multiply(relax.op.sigmoid(gate), up))
            if y_also_output:
                out = bb.emit_output(relax.Tuple([out, y]))
        bb.emit_func_output(out)
    return bb.get()


def test_addend_read_in_the_epilogue():
    """``x @ W^T + t`` with ``t`` a runtime ``(n, 8)`` tensor, split, gates: one kernel that
    reads ``t`` (an input of the call) and adds it to the GEMM tile."""
    mod = _addend_module(["n", 8])
    after = GatesBase.transform(mod)
    calls = [
        b.value
        for b in after["main"].body.blocks[0].bindings
        if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"
    ]
    assert len(calls) == 1
    assert [a.name for a in calls[0].args[1].fields] == ["x", "w", "t"]
    assert "gemm0_add0" in after[calls[0].args[0]].script()
    rng = np.random.default_rng(0)
    for n in (1, 5):
        args = [rng.standard_normal(s).astype("float32") for s in ((n, 4), (8, 4), (n, 8))]
        y = args[0] @ args[1].T + args[2]
        ref = y[:, 4:] / (1 + np.exp(-y[:, :4]))
        compare_pipelines(mod, args, rtol=1e-4, atol=1e-4, reference=[ref])


@pytest.mark.parametrize(
    ("addend_shape", "y_also_output"),
    [(["n", 1], False), (["n", 8], True)],
    ids=["per_row_addend", "gemm_also_read"],
)
def test_addend_left_alone(addend_shape, y_also_output):
    """Must not fire: a per-row ``(n, 1)`` tensor (not every feature's own value) and a GEMM
    output that is also read elsewhere."""
    mod = _addend_module(addend_shape, y_also_output)
    with collect_rewrites() as counts:
        after = GatesBase.transform(mod)
    assert counts["FuseSplitGates"] == 0
    tvm.ir.assert_structural_equal(after, mod)
