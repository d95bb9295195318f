"""FuseGroupedGates (issue #38): transformers' grouped experts (``grouped_mm_fallback``, see
``tests/test_moe_grouped.py``) with the gate epilogue fused into the grouped GEMM, against torch
eager; where it must not fire."""

from __future__ import annotations

import numpy as np
import pytest

from tvm_fusion.build import engine
from tvm_fusion.frontend import load
from tvm_fusion.target import host_target
from tvm_fusion.tools.analysis.schedules import schedule_info
from tvm_fusion.transform import collect_rewrites

torch = pytest.importorskip("torch")
moe = pytest.importorskip("tvm_fusion.testing.moe")


def _compile(model, args, dynamic=True):
    tokens = torch.export.Dim("tokens", min=1, max=128)
    shapes = ({0: tokens},) * len(args) if dynamic else None
    program = torch.export.export(model, args, dynamic_shapes=shapes)
    mod = load.import_exported_program(program)
    with collect_rewrites() as counts:
        compiled = engine.compile_module(mod, host_target(), "tvm_fusion")
    return compiled, counts


def _run(compiled, *args):
    out = engine.TvmRunner(compiled, [np.asarray(a) for a in args]).outputs()
    return np.asarray(out[0] if isinstance(out, list | tuple) else out)


def _kernels(compiled) -> list[str]:
    return [
        gv.name_hint for gv, f in compiled.lowered.functions_items() if "tirx" in type(f).__module__
    ]


@pytest.mark.parametrize(("experts", "gate"), [(3, "silu"), (5, "gelu_tanh")])
def test_grouped_experts_fused_match_torch(experts, gate):
    torch.manual_seed(experts)
    model = moe.grouped_experts(experts, hidden=8, inter=6, gate=gate).eval()
    args = (torch.randn(7, 8), torch.randint(0, experts, (7, 2)), torch.rand(7, 2))
    compiled, counts = _compile(model, args)
    assert counts["FuseGroupedGates"] == 2  # the gate_up GEMM with its gate, the down GEMM
    names = _kernels(compiled)
    assert not any(n.startswith("grouped_mm") for n in names), names
    assert sum(n.startswith("grouped_rows") for n in names) == 1, names  # shared by both
    rules = {i.name: i.rule for i in schedule_info(compiled.lowered)}
    assert {r for n, r in rules.items() if n.startswith("fused_gates")} == {"GateFusion"}, rules
    for tokens in (1, 7, 61):
        x, ids = torch.randn(tokens, 8), torch.randint(0, experts, (tokens, 2))
        weights = torch.rand(tokens, 2)
        with torch.inference_mode():
            want = model(x, ids, weights).numpy()
        got = _run(compiled, x.numpy(), ids.numpy(), weights.numpy())
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


class _GatedGrouped(torch.nn.Module):
    """The grouped GEMM and its gate, the offsets a model input; ``axis`` the chunk's axis,
    ``weight_input``: the expert weight a model input (not a constant)."""

    def __init__(self, experts: int, axis: int = -1, weight_input: bool = False):
        super().__init__()
        moe.define_grouped_mm()
        self.axis, self.weight_input = axis, weight_input
        self.weight = torch.nn.Parameter(torch.randn(experts, 12, 8) / 3)

    def forward(self, x, offs, *weight):
        w = weight[0] if self.weight_input else self.weight
        proj = torch.ops.transformers.grouped_mm_fallback(x, w.transpose(-2, -1), offs)
        gate, up = proj.chunk(2, dim=self.axis)
        return torch.nn.functional.silu(gate) * up


def _offsets_cases(rng, count: int, experts: int) -> list:
    return [
        np.sort(rng.integers(0, count + 1, experts)),  # cumulative counts, some empty
        np.sort(rng.integers(0, count // 2 + 1, experts)),  # a zero tail: rows of no expert
        rng.integers(-count, count + 3, experts),  # neither sorted nor in range
    ]


@pytest.mark.parametrize("experts", [3, 8])
def test_any_offsets_fused_match_torch(experts):
    """Rows of no expert (zero, then gated), empty experts, unsorted and negative offsets."""
    torch.manual_seed(experts)
    model = _GatedGrouped(experts).eval()
    offs = torch.tensor([2, 2, 5] + [7] * (experts - 3), dtype=torch.int32)
    rows = torch.export.Dim("rows", min=1, max=128)
    program = torch.export.export(
        model, (torch.randn(7, 8), offs), dynamic_shapes=({0: rows}, None)
    )
    with collect_rewrites() as counts:
        compiled = engine.compile_module(
            load.import_exported_program(program), host_target(), "tvm_fusion"
        )
    assert counts["FuseGroupedGates"] == 1
    rng = np.random.default_rng(experts)
    for count in (1, 7, 61):
        for offs in _offsets_cases(rng, count, experts):
            offs = torch.tensor(offs, dtype=torch.int32)
            x = torch.randn(count, 8)
            with torch.inference_mode():
                want = model(x, offs).numpy()
            got = _run(compiled, x.numpy(), offs.numpy())
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=str(offs))


@pytest.mark.parametrize("case", ["split_rows", "weight_input"])
def test_not_fused(case):
    """A chunk along the rows (not the gate halves), an expert weight that is not a constant:
    left alone, and still right."""
    torch.manual_seed(0)
    model = _GatedGrouped(
        3, axis=0 if case == "split_rows" else -1, weight_input=case != "split_rows"
    )
    offs = torch.tensor([2, 5, 8], dtype=torch.int32)
    args = (torch.randn(8, 8), offs) + ((torch.randn(3, 12, 8),) if model.weight_input else ())
    program = torch.export.export(model.eval(), args)
    with collect_rewrites() as counts:
        compiled = engine.compile_module(
            load.import_exported_program(program), host_target(), "tvm_fusion"
        )
    assert counts["FuseGroupedGates"] == 0
    assert any(n.startswith("grouped_mm") for n in _kernels(compiled))
    with torch.inference_mode():
        want = model(*args).numpy()
    np.testing.assert_allclose(_run(compiled, *args), want, rtol=1e-4, atol=1e-5)


def _unrolled_around(stmt, block: str, outer: int = 1) -> list[int]:
    """Products of the unrolled loop extents around each block named ``block``."""
    import tvm
    from tvm import s_tir

    found = []

    def walk(node, product):
        if isinstance(node, tvm.tirx.For):
            ext = node.extent
            if node.kind == tvm.tirx.ForKind.UNROLLED and isinstance(ext, tvm.tirx.IntImm):
                product *= int(ext.value)
            walk(node.body, product)
        elif isinstance(node, s_tir.SBlockRealize):
            if node.block.name_hint == block:
                found.append(product)
            walk(node.block.body, product)
        elif isinstance(node, tvm.tirx.SeqStmt):
            for s in node.seq:
                walk(s, product)
        elif isinstance(node, tvm.tirx.IfThenElse):  # SerialSmallKernels' two paths
            walk(node.then_case, product)
            walk(node.else_case, product)
        elif hasattr(node, "body"):
            walk(node.body, product)

    walk(stmt, outer)
    return found


@pytest.mark.parametrize("mcpu", ["haswell", "skylake-avx512"])
def test_register_tile_of_several_rows(mcpu):
    """The gathered GEMM over symbolic rows gets a register tile of several rows from the
    target's registers (it had one row: ``pad_einsum`` refuses the ``W[ids[row]]`` read, and
    the rule fell back to unpadded tiles of 1 row x 2 gates, 2 accumulators)."""
    import tvm

    from tvm_fusion.build.pipeline import build_pipeline

    torch.manual_seed(0)
    model = _GatedGrouped(3).eval()
    rows = torch.export.Dim("rows", min=1, max=128)
    offs = torch.tensor([2, 5, 7], dtype=torch.int32)
    program = torch.export.export(
        model, (torch.randn(7, 8), offs), dynamic_shapes=({0: rows}, None)
    )
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    with target:
        lowered = build_pipeline(target)(load.import_exported_program(program))
    (gates,) = [f for gv, f in lowered.functions_items() if gv.name_hint.startswith("fused_gates")]
    tiles = _unrolled_around(gates.body, "gemm0_update")
    assert tiles and min(tiles) >= 2 * 2, tiles  # at least 2 rows x 2 gates accumulators


@pytest.mark.parametrize("mcpu", ["haswell", "skylake-avx512"])
def test_register_tile_of_several_rows_tokens_times_top_k(mcpu):
    """transformers' rows, ``tokens * top_k`` (a product of symbols), get a register tile of
    several rows too: the kernel's rows are one variable of its own (over the product, TVM
    0.27's compute_at refused the tile over the padded GEMM, and both kernels ran tiles of one
    row: 2 and 1 accumulators). Numbers: test_grouped_experts_fused_match_torch."""
    import tvm

    from tvm_fusion.build.pipeline import build_pipeline

    torch.manual_seed(0)
    model = moe.grouped_experts(3, hidden=8, inter=6).eval()
    tokens = torch.export.Dim("tokens", min=1, max=128)
    args = (torch.randn(7, 8), torch.randint(0, 3, (7, 2)), torch.rand(7, 2))
    program = torch.export.export(model, args, dynamic_shapes=({0: tokens},) * 3)
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    with target:
        lowered = build_pipeline(target)(load.import_exported_program(program))
    kernels = {
        gv.name_hint: f for gv, f in lowered.functions_items() if "fused_gates" in gv.name_hint
    }
    assert len(kernels) == 2, list(kernels)  # gate_up with its gate, down with the weight
    for name, func in kernels.items():
        gates = int(func.attrs["tvm_fusion.gate_fusion"]["gates"])
        tiles = _unrolled_around(func.body, "gemm0_update")
        assert tiles and min(tiles) >= 2 * gates, (name, gates, tiles)
        assert max(tiles) <= 4 * gates, (name, gates, tiles)  # two pointers a row: 4 rows
