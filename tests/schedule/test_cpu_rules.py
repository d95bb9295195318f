"""CPU schedule rules: which rule takes which PrimFunc, numerics scheduled vs unscheduled,
every kernel scheduled, weights packed at compile time, intermediates shrunk to rows/tiles."""

import math

import numpy as np
import pytest
import tvm
from helpers import accumulator_tiles, fused_prim_funcs, run
from tvm import relax
from tvm.relax import op as R

import tvm_fusion
from tvm_fusion import analysis, models, tir_util
from tvm_fusion.build import engine
from tvm_fusion.schedule import cpu
from tvm_fusion.schedule._common import MIN_PARALLEL_WORK


def _module(build, *shapes, dtype="float32"):
    params = [relax.Var(f"x{i}", relax.TensorType(s, dtype)) for i, s in enumerate(shapes)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(build(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


def _prim_funcs(mod, target):
    """PrimFuncs after Phases 0-3 (fused, not yet scheduled) and layout-free marking."""
    return fused_prim_funcs(mod, target)


W = np.random.default_rng(0).standard_normal((256, 128)).astype("float32") / 16

CASES = {
    "elementwise": (lambda bb, x: R.nn.gelu(R.add(x, x)), [(64, 256)], cpu.Injective),
    "transpose": (
        lambda bb, x: R.permute_dims(R.reshape(x, (8, 8, 16, 16)), [0, 2, 1, 3]),
        [(64, 256)],
        cpu.Injective,
    ),
    "softmax": (lambda bb, x: R.nn.softmax(x), [(64, 256)], cpu.RowReduction),
    "log_softmax": (lambda bb, x: R.nn.log_softmax(x), [(64, 256)], cpu.RowReduction),
    "row_sum": (lambda bb, x: R.sum(x, axis=[1]), [(64, 256)], cpu.RowReduction),
    "matmul_bias_gelu": (
        lambda bb, x: R.nn.gelu(
            R.add(R.matmul(x, relax.const(W)), relax.const(np.ones(128, "float32")))
        ),
        [(64, 256)],
        cpu.Matmul,
    ),
    "matmul_runtime_weight": (lambda bb, x, w: R.matmul(x, w), [(64, 256), (256, 128)], cpu.Matmul),
    "gemv": (lambda bb, x: R.matmul(x, relax.const(W)), [(1, 256)], cpu.Matmul),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rule_choice(name, target):
    build, shapes, rule_cls = CASES[name]
    funcs = _prim_funcs(_module(build, *shapes), target)
    main = max(funcs, key=lambda f: len(tir_util.blocks(f)))
    rules = [cpu.Matmul(), cpu.RowReduction(), cpu.Injective(), cpu.Fallback()]
    taken = next(r for r in rules if r.apply(main, target, False) is not None)
    assert isinstance(taken, rule_cls)
    # rules that do not fit say so with None
    for rule in rules:
        if not isinstance(rule, rule_cls | cpu.Fallback) and rules.index(rule) < rules.index(taken):
            assert rule.apply(main, target, False) is None


def test_rules_skip_gpu_targets():
    func = _prim_funcs(_module(CASES["softmax"][0], (4, 32)), tvm_fusion.host_target())[0]
    gpu = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    rules = (
        cpu.Matmul(),
        cpu.GroupedConv(),
        cpu.RowReduction(),
        cpu.Injective(),
        cpu.WindowReduction(),
        cpu.Fallback(),
    )
    for rule in rules:
        assert rule.apply(func, gpu, False) is None


@pytest.mark.parametrize("name", list(CASES))
def test_scheduled_numbers_equal_unscheduled(name, target):
    build, shapes, _ = CASES[name]
    mod = _module(build, *shapes)
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(s).astype("float32") for s in shapes]
    ours, compiled = run(mod, inputs, "tvm_fusion")
    plain, _ = run(mod, inputs, "tvm_fusion", schedule=False)
    for a, b in zip(ours, plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    infos = analysis.schedule_info(compiled.lowered)
    assert infos and all(i.scheduled for i in infos)
    # every kernel with enough work is parallel and vectorised
    for gv, func in compiled.lowered.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc) and not func.attrs.get("tirx.is_host_func"):
            info = next(i for i in infos if i.name == gv.name_hint)
            out_elems = tir_util.num_elements(func.params[-1])
            if out_elems and out_elems * 4 >= MIN_PARALLEL_WORK and out_elems >= 64:
                assert info.parallel and info.vectorized, info


@pytest.mark.parametrize("name", models.names())
def test_every_workload_scheduled_and_equal(name, target):
    inst = models.build(name, "small")
    ours, compiled = run(inst.mod, inst.input_list(), "tvm_fusion")
    plain, _ = run(inst.mod, inst.input_list(), "tvm_fusion", schedule=False)
    for a, b in zip(ours, plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=inst.rtol, atol=inst.atol)
    assert all(i.scheduled for i in analysis.schedule_info(compiled.lowered))


def test_constant_weight_packed_at_compile_time(target):
    mod = _module(CASES["matmul_bias_gelu"][0], (64, 256))
    compiled = engine.compile_module(mod, target, "tvm_fusion")
    names = [gv.name_hint for gv in compiled.lowered.get_global_vars()]
    assert not any(n.endswith("_weight_prepack") for n in names), names
    kernel = next(
        f for gv, f in compiled.lowered.functions_items() if gv.name_hint.endswith("_prepacked")
    )
    packed = [p for p in kernel.params if len(p.shape) == 3]
    assert packed, "the weight parameter is a (panels, K, NR) array"
    assert int(packed[0].shape[1]) == 256
    assert analysis.kernel_count(compiled.lowered) == 1


def test_runtime_weight_not_prepacked_but_correct(target):
    rng = np.random.default_rng(2)
    x, w = (
        rng.standard_normal((64, 256)).astype("float32"),
        rng.standard_normal((256, 128)).astype("float32"),
    )
    mod = _module(CASES["matmul_runtime_weight"][0], (64, 256), (256, 128))
    out, compiled = run(mod, [x, w], "tvm_fusion")
    np.testing.assert_allclose(out[0], x @ w, rtol=1e-4, atol=1e-4)
    assert analysis.kernel_count(compiled.lowered) == 1


def test_runtime_weight_packed_one_panel_at_a_time(target):
    """A run-time weight with enough column panels for every core is packed panel by panel
    inside the parallel panel loop: the scratch is K x NR, not a copy of the whole weight."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((64, 128)).astype("float32")
    w = rng.standard_normal((128, 2048)).astype("float32")
    mod = _module(CASES["matmul_runtime_weight"][0], (64, 128), (128, 2048))
    out, compiled = run(mod, [x, w], "tvm_fusion")
    np.testing.assert_allclose(out[0], x @ w, rtol=1e-4, atol=1e-4)
    scratch = [a for a in analysis.allocations(compiled.lowered) if a.where != "relax"]
    assert scratch and max(a.elements for a in scratch) <= 128 * 64  # one panel, NR <= 64
    assert any(a.elements >= 128 * 8 for a in scratch)  # the packed panel is there


def test_unit_reduction_with_epilogue_regression(target):
    """K = 1: dlight reports the matmul as injective; inlining the bias into it doubled it."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((1, 4)).astype("float32")
    b = rng.standard_normal(4).astype("float32")
    mod = _module(lambda bb, x: R.add(R.matmul(x, relax.const(w)), relax.const(b)), (3, 1))
    x = rng.standard_normal((3, 1)).astype("float32")
    out, _ = run(mod, [x], "tvm_fusion")
    np.testing.assert_allclose(out[0], x @ w + b, rtol=1e-5, atol=1e-6)


def test_sliced_epilogue_regression(target):
    """A slice after a matmul is computed on the tile, not reverse-inlined (wrong in 0.27)."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((12, 8)).astype("float32")
    mod = _module(
        lambda bb, x: R.strided_slice(R.matmul(x, relax.const(w)), [1], [2], [5]), (1, 12)
    )
    x = rng.standard_normal((1, 12)).astype("float32")
    out, _ = run(mod, [x], "tvm_fusion")
    np.testing.assert_allclose(out[0], (x @ w)[:, 2:5], rtol=1e-5, atol=1e-5)


def test_row_mean_with_keepdims_regression(target):
    """mean(x, -1, keepdims=True): the row loop is the last block's innermost loop; vectorising
    it split the loop the reductions are computed at ("The loop no longer exists")."""
    x = np.random.default_rng(5).standard_normal((6, 9)).astype("float32")
    mod = _module(lambda bb, v: R.mean(v, axis=[-1], keepdims=True), (6, 9))
    out, _ = run(mod, [x], "tvm_fusion")
    np.testing.assert_allclose(out[0], x.mean(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_inlining_does_not_blow_up(target):
    """Chained fast-math ops each read their input many times: inlining all of them grew the
    IR exponentially; the rule keeps the expressions small and compiles quickly."""

    def chain(bb, x):
        y = x
        for _ in range(4):
            y = R.tanh(R.exp(R.tanh(y)))
        return y

    mod = _module(chain, (4, 8))
    x = np.random.default_rng(5).standard_normal((4, 8)).astype("float32")
    out, compiled = run(mod, [x], "tvm_fusion")
    ref = x.astype("float64")
    for _ in range(4):
        ref = np.tanh(np.exp(np.tanh(ref)))
    np.testing.assert_allclose(out[0], ref, rtol=1e-5, atol=1e-6)
    assert compiled.compile_s < 60


def test_row_reduction_keeps_rows_only(target):
    """softmax's intermediates (max, sum) shrink to one row per parallel iteration."""
    funcs = _prim_funcs(_module(CASES["log_softmax"][0], (64, 256)), target)
    sch = cpu.RowReduction().apply(funcs[0], target, False)
    for buf in tir_util.compacted_allocations(sch.mod["main"]):
        assert tir_util.num_elements(buf) <= 256, (buf.name, buf.shape)


def test_gemm_tile_epilogue_has_no_full_intermediate(target):
    funcs = _prim_funcs(_module(CASES["matmul_bias_gelu"][0], (64, 256)), target)
    sch = cpu.Matmul().apply(funcs[0], target, False)
    assert sch is not None
    acc = {b.name for b in accumulator_tiles(sch.mod["main"])}
    for buf in tir_util.compacted_allocations(sch.mod["main"]):
        if buf.name.endswith("_global") and buf.name not in acc:
            continue  # the packed weight: SplitLayoutRewritePreproc moves it out, then folded
        assert tir_util.num_elements(buf) < 64 * 128, (buf.name, buf.shape)


def test_symbolic_rows_padded_to_register_tiles(target):
    """(batch, seq) rows: the row axis is padded to a multiple of MR, so the accumulator is an
    MR x NR register tile, not one row; A is read in place with its row clamped (no padded
    copy: no buffer of symbolic size at all), and the result is right for row counts that are
    and are not multiples of MR."""
    batch, seq = tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("seq", "int64")
    mod = _module(CASES["matmul_bias_gelu"][0], (batch, seq, 256))
    funcs = _prim_funcs(mod, target)
    sch = cpu.Matmul().apply(funcs[0], target, False)
    assert sch is not None
    allocs = tir_util.compacted_allocations(sch.mod["main"])
    acc = accumulator_tiles(sch.mod["main"])
    assert len(acc) == 1 and tir_util.num_elements(acc[0]) is not None
    assert int(acc[0].shape[-2]) > 1, acc[0].shape  # more than one row per tile
    symbolic = [b.name for b in allocs if tir_util.num_elements(b) is None]
    assert symbolic == [], symbolic
    assert "T.min(" in sch.mod["main"].script()  # the clamped row
    compiled = engine.compile_module(mod, target, "tvm_fusion")
    vm = compiled.vm()
    rng = np.random.default_rng(7)
    for shape in [(1, 1, 256), (2, 5, 256), (3, 8, 256)]:
        data = rng.standard_normal(shape).astype("float32")
        h = data @ W + 1
        expected = 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
        out = vm["main"](tvm.runtime.tensor(data)).numpy()
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_symbolic_columns_padded_to_register_tiles(target):
    """Attention scores ``q @ k^T * scale + mask``: columns and rows are both ``seq``. Both are
    padded to the tile, so the scores get MR x NR register tiles (the rule used to give up on
    a symbolic vector axis and leave the kernel to the fallback rule)."""
    batch, seq = tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("seq", "int64")

    def scores(bb, q, k, mask):
        s = R.matmul(q, R.permute_dims(k, [0, 1, 3, 2]))
        return R.add(R.multiply(s, relax.const(0.125, "float32")), mask)

    mod = _module(scores, (batch, 2, seq, 16), (batch, 2, seq, 16), (batch, 1, seq, seq))
    funcs = [f for f in _prim_funcs(mod, target) if cpu.Matmul().apply(f, target, False)]
    assert len(funcs) == 1
    sch = cpu.Matmul().apply(funcs[0], target, False)
    allocs = tir_util.compacted_allocations(sch.mod["main"])
    acc = accumulator_tiles(sch.mod["main"])
    assert len(acc) == 1 and tir_util.num_elements(acc[0]) is not None, acc
    assert int(acc[0].shape[-2]) > 1 and int(acc[0].shape[-1]) > 1, acc[0].shape
    # k^T is read along seq with a stride: it is packed into contiguous panels first
    packed = [b for b in allocs if b.name.endswith("_global") and b.name != acc[0].name]
    assert packed, [b.name for b in allocs]
    vm = engine.compile_module(mod, target, "tvm_fusion").vm()
    rng = np.random.default_rng(8)
    for b, n in [(1, 1), (2, 7), (1, 19)]:
        q, k = (rng.standard_normal((b, 2, n, 16)).astype("float32") for _ in range(2))
        mask = rng.standard_normal((b, 1, n, n)).astype("float32")
        out = vm["main"](*(tvm.runtime.tensor(a) for a in (q, k, mask))).numpy()
        expected = q @ k.transpose(0, 1, 3, 2) * 0.125 + mask
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_several_reduction_axes_fused_into_one(target):
    """XLNet's output projection ``einsum('ibnd,hnd->ibh')`` reduces over heads and head size:
    the rule fuses the two reduction iterators into one and tiles it like any GEMM (it used to
    leave it to the fallback rule: 14 ms of XLNet's 65 at bench scale)."""
    seq = tvm.tirx.Var("seq", "int64")
    rng = np.random.default_rng(9)
    o = rng.standard_normal((32, 2, 16)).astype("float32")

    def project(bb, v, h):
        return R.add(R.einsum([v, relax.const(o)], "ibnd,hnd->ibh"), h)

    mod = _module(project, (seq, 2, 2, 16), (seq, 2, 32))
    funcs = [f for f in _prim_funcs(mod, target) if cpu.Matmul().apply(f, target, False)]
    assert len(funcs) == 1
    vm = engine.compile_module(mod, target, "tvm_fusion").vm()
    for n in (1, 6, 9):
        v = rng.standard_normal((n, 2, 2, 16)).astype("float32")
        h = rng.standard_normal((n, 2, 32)).astype("float32")
        out = vm["main"](tvm.runtime.tensor(v), tvm.runtime.tensor(h)).numpy()
        np.testing.assert_allclose(out, np.einsum("ibnd,hnd->ibh", v, o) + h, rtol=1e-5, atol=1e-5)


def test_heads_axis_is_not_a_gate_axis(target):
    """``einsum('ibh,hnd->ibnd')`` (XLNet's q/k/v projections): the small heads axis ``n`` is
    an outer column, not a gate axis of the tile as in FuseSplitGates' kernels, so the register
    tile holds several rows (4 x 16) instead of one row of every head (4 heads x 16)."""
    w = np.random.default_rng(10).standard_normal((32, 4, 16)).astype("float32")
    mod = _module(lambda bb, x: R.einsum([x, relax.const(w)], "ibh,hnd->ibnd"), (8, 4, 32))
    funcs = _prim_funcs(mod, target)
    sch = cpu.Matmul().apply(funcs[0], target, False)
    assert sch is not None
    acc = accumulator_tiles(sch.mod["main"])
    assert len(acc) == 1 and [int(d) for d in acc[0].shape][1:3] == [4, 1], acc[0].shape
    x = np.random.default_rng(11).standard_normal((8, 4, 32)).astype("float32")
    out = engine.compile_module(mod, target, "tvm_fusion").vm()["main"](tvm.runtime.tensor(x))
    np.testing.assert_allclose(out.numpy(), np.einsum("ibh,hnd->ibnd", x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gate_2890", "swiglu", "cross_entropy", "gelu_views"])
def test_dynamic_batch_scheduled(name, target):
    inst = models.build(name, "small", dynamic=True)
    ours, compiled = run(inst.mod, inst.input_list(), "tvm_fusion")
    for o, r in zip(ours, inst.reference(*inst.input_list()), strict=True):
        np.testing.assert_allclose(o, r, rtol=inst.rtol, atol=inst.atol)
    assert all(i.scheduled for i in analysis.schedule_info(compiled.lowered))


def test_weight_prepack_beside_blockless_primfunc(target):
    """take_backward is legalised as a root block holding loops and no block; stock
    SplitLayoutRewritePreproc aborts on it, ours sets it aside."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((256, 128)).astype("float32") / 16
    x = relax.Var("x", relax.TensorType((64, 256), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(R.matmul(x, relax.const(w)))
            t = bb.emit(R.take(h, relax.const(np.array([0, 5, 5, 9], "int64"), "int64"), axis=1))
            out = bb.emit_output(R.sum(R.multiply(t, t)))
        bb.emit_func_output(out)
    grad = relax.transform.Gradient("main")(bb.get())
    data = rng.standard_normal((64, 256)).astype("float32")
    compiled = engine.compile_module(grad, target, "tvm_fusion")
    vm = compiled.vm()
    loss, (gx,) = vm["main_adjoint"](tvm.runtime.tensor(data))
    h = data @ w
    g_h = np.zeros_like(h)
    np.add.at(g_h, (slice(None), [0, 5, 5, 9]), 2 * h[:, [0, 5, 5, 9]])
    np.testing.assert_allclose(gx.numpy(), g_h @ w.T, rtol=1e-4, atol=1e-4)
    assert any(gv.name_hint.endswith("_prepacked") for gv in compiled.lowered.get_global_vars())


def test_gate_block_fills_the_registers_for_one_row_tiles(cpu_target):
    """FuseSplitGates' vector block V on llvm (AVX2, AVX-512, NEON targets): one row gets a V
    as wide as one row's accumulators allow; many rows, static or symbolic (padded to the tile
    by the rule), get one vector per gate so that more rows fit the register tile."""
    from tvm_fusion.schedule import gate_block
    from tvm_fusion.target import vector_lanes

    target = cpu_target
    lanes = vector_lanes(target, "float32")
    assert gate_block(target, 1024, 2, 1) == 4 * lanes
    assert gate_block(target, 1024, 2, 64) == gate_block(target, 1024, 2, None) == lanes
    # units no full vector divides: padded to whole vectors, not half or quarter ones
    assert gate_block(target, 97, 2, 64) == lanes  # 7 vectors of 16 (13 of 8, 25 of 4)
    assert gate_block(target, 1365, 3, 77) == lanes
    assert gate_block(target, lanes // 2 * 3, 2, 64) == lanes  # 1.5 vectors: 2, not 3 halves


def test_gate_tile_rows_fill_the_registers_left_by_the_weight_vectors():
    """Rows per gate tile on AVX2 (16 registers, 8 lanes): the accumulators take what one
    row's weight vectors and the broadcast input leave; #2890's 3 gates of 8 units get 4 rows
    (the 4 x 24 micro-kernel; half the registers gave 2 rows and 5 loads per 6 FMAs)."""
    from tvm_fusion.schedule.cpu.gate_fusion import tile_rows

    assert tile_rows(64, 3, 8, 8, 16) == tile_rows(None, 3, 8, 8, 16) == 4
    assert tile_rows(64, 4, 8, 8, 16) == 2  # LSTM: 8 accumulators + 4 weight vectors
    assert tile_rows(64, 2, 8, 8, 16) == 4  # SwiGLU: 6 fit, 4 divides the rows
    assert tile_rows(None, 2, 8, 8, 16) == 6
    assert tile_rows(1, 4, 16, 8, 16) == 1
    assert tile_rows(64, 3, 16, 16, 32) == 8  # AVX-512: 9 fit, 8 divides
    # AVX-512, padded tiles (symbolic rows, a prime): 4 rows, each read through its own pointer
    assert tile_rows(None, 2, 16, 16, 32) == tile_rows(None, 3, 16, 16, 32) == 4
    assert tile_rows(19, 2, 16, 16, 32) == 4  # 14 fit: padded to 20 rows, not 28
    assert tile_rows(256, 2, 16, 16, 32) == 8  # a divisor: contiguous rows, no padding
    assert tile_rows(None, 6, 16, 16, 32) == 4
    assert tile_rows(19, 3, 8, 8, 16) == 4  # a prime: padded to tiles of 4, not 1 row each
    assert tile_rows(21, 3, 8, 8, 16) == 3  # 3 divides and is at least half of 4
    assert tile_rows(3, 3, 8, 8, 16) == 3
    # a gathered tile (W[ids[row]]: two pointers a row), padded: at most 4 rows on AVX2 too
    assert tile_rows(None, 1, 8, 8, 16) == 14
    assert tile_rows(None, 1, 8, 8, 16, gathered=True) == 4
    assert tile_rows(None, 2, 8, 8, 16, gathered=True) == 4
    assert tile_rows(19, 1, 8, 8, 16, gathered=True) == 4  # padded to 20 rows, not 28
    assert tile_rows(64, 2, 8, 8, 16, gathered=True) == 4  # a divisor: not padded
    assert tile_rows(2, 1, 8, 8, 16, gathered=True) == 2
    for gates in (1, 2, 3, 4, 6):
        for regs, lanes in ((16, 8), (32, 16)):
            mr = tile_rows(None, gates, lanes, lanes, regs)
            assert mr == 1 or (mr + 1) * gates + 1 <= regs


# GRU: two GEMMs of 3 gates, accumulated one after the other: 4 rows per tile (it had 1 while
# the rule counted the group's 6 gates against the registers)
@pytest.mark.parametrize("name", ["swiglu", "lstm_cell", "gru_cell"])
def test_symbolic_gate_rows_padded_to_register_tiles(name, target):
    """A gate kernel over symbolic rows: the GEMM's rows are padded to a multiple of the tile
    (``pad_einsum`` on the blocked GEMM ``Y[n, g, d // V, d % V]``), so each tile holds several
    rows of every gate in registers (it was one row per tile: SwiGLU's export at (4, 128)
    7.2 -> 4.0 ms for that kernel); no GEMM result and no padded input copy has a buffer of
    symbolic size (the inputs are read in place, rows clamped; gate math that could not be
    inlined, e.g. the LSTM's clamp, may); numbers are right for row counts that are and are not
    multiples of the tile."""
    from tvm_fusion.build import tuning
    from tvm_fusion.schedule.cpu.gate_fusion import GateFusion

    inst = models.build(name, "small", dynamic=True)
    fused = tuning.fused_module(inst.mod, target)
    funcs = [
        f
        for f in fused.functions.values()
        if isinstance(f, tvm.tirx.PrimFunc) and "tvm_fusion.gate_fusion" in f.attrs
    ]
    assert len(funcs) == 1
    sch = GateFusion().apply(funcs[0], target, False)
    assert sch is not None
    allocs = tir_util.compacted_allocations(sch.mod["main"])
    acc = [b for b in allocs if b.scope() == "local"]
    assert acc and all(tir_util.num_elements(b) is not None for b in acc), acc
    assert all(int(b.shape[0]) > 1 for b in acc), [b.shape for b in acc]  # rows per tile
    symbolic = [b.name for b in allocs if tir_util.num_elements(b) is None]
    # no (rows, gates, D) GEMM result, and the inputs are read in place (rows clamped)
    assert not any(n.startswith("gemm") or n.endswith("_pad") for n in symbolic), symbolic
    assert "T.min(" in sch.mod["main"].script()
    compiled = engine.compile_module(inst.mod, target, "tvm_fusion")
    vm = compiled.vm()
    rng = np.random.default_rng(12)
    for rows in (1, 3, 4, 5, 9):
        xs = [
            rng.standard_normal((rows, *a.shape[1:])).astype("float32") for a in inst.input_list()
        ]
        out = vm["main"](*[tvm.runtime.tensor(a) for a in xs])
        outs = list(out) if isinstance(out, tvm.ir.Array | list | tuple) else [out]
        for o, r in zip(outs, inst.reference(*xs), strict=True):
            np.testing.assert_allclose(o.numpy(), r, rtol=inst.rtol, atol=inst.atol)


def _blocks_under_vector_loops(func) -> set:
    from tvm.s_tir import SBlock

    names = set()
    for loop in tir_util.loops(func):
        if loop.kind == tvm.tirx.ForKind.VECTORIZED:
            for stmt in tir_util.iter_stmts(loop.body):
                if isinstance(stmt, SBlock):
                    names.add(stmt.name_hint)
    return names


def test_symbolic_row_reductions_vectorised(target):
    """Softmax over attention scores ``(batch, heads, seq, seq)``: the legalisation writes the
    row max and sum as partials over whole vectors + a scalar tail; the rule vectorises the
    partials' update (it was a scalar reduction: 7x slower than the static kernel), takes the
    tail's init out of its possibly empty loop, and leaves the symbolic output loop whole (no
    tail predicate, which TVM's vectoriser would scalarise; LLVM vectorises the plain loop)."""
    batch, seq = tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("seq", "int64")
    mod = _module(lambda bb, x: R.nn.softmax(x), (batch, 2, seq, seq))
    funcs = _prim_funcs(mod, target)
    sch = cpu.RowReduction().apply(funcs[0], target, False)
    assert sch is not None
    func = sch.mod["main"]
    names = tir_util.block_names(func)
    vector = _blocks_under_vector_loops(func)
    parts = [n for n in names if n.startswith("row_part") and n.endswith("_update")]
    assert len(parts) == 2 and set(parts) <= vector, (names, vector)
    tails = [n for n in names if n.startswith("row_tail")]
    assert sorted(tails) == sorted(
        ["row_tail_init", "row_tail_update", "row_tail_1_init", "row_tail_1_update"]
    ), tails
    predicated = [b.name_hint for b in tir_util.blocks(func) if not _is_true(b, sch)]
    assert predicated == [], predicated
    compiled = engine.compile_module(mod, target, "tvm_fusion")
    vm = compiled.vm()
    rng = np.random.default_rng(3)
    for shape in [(1, 2, 1, 1), (2, 2, 5, 5), (1, 2, 16, 16), (2, 2, 19, 19)]:
        x = rng.standard_normal(shape).astype("float32") * 4
        e = np.exp(x - x.max(-1, keepdims=True))
        out = vm["main"](tvm.runtime.tensor(x)).numpy()
        np.testing.assert_allclose(out, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def _is_true(block, sch) -> bool:
    """The block's realize has no predicate (split tails put one there)."""
    from tvm.s_tir import SBlockRealize

    for stmt in tir_util.iter_stmts(sch.mod["main"].body):
        if isinstance(stmt, SBlockRealize) and stmt.block.same_as(block):
            return isinstance(stmt.predicate, tvm.tirx.IntImm) and int(stmt.predicate) == 1
    return True


def test_symbolic_injective_loop_left_whole(target):
    """An elementwise kernel over a symbolic innermost axis (mask add + exp over attention
    scores) is not split by the vector width: the tail predicate would make TVM scalarise the
    vector body; the plain loop is vectorised by LLVM (0.57 -> 0.09 ms at (4, 4, 128, 128))."""
    batch, seq = tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("seq", "int64")

    def build(bb, x, m):
        return R.exp(R.add(R.multiply(x, relax.const(0.125, "float32")), m))

    mod = _module(build, (batch, 4, seq, seq), (batch, 1, seq, seq))
    funcs = _prim_funcs(mod, target)
    sch = cpu.Injective().apply(funcs[0], target, False)
    assert sch is not None
    assert all(_is_true(b, sch) for b in tir_util.blocks(sch.mod["main"]))
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 4, 11, 11)).astype("float32")
    m = rng.standard_normal((2, 1, 11, 11)).astype("float32")
    out, _ = run(mod, [x, m], "tvm_fusion")
    np.testing.assert_allclose(out[0], np.exp(x * 0.125 + m), rtol=1e-5)


def test_long_reduction_runs_in_k_blocks(target):
    """K >= 1024 with a packed weight: the reduction runs in blocks of 256 outside the row
    tiles (a panel's 256 x NR block of B is reused from L1 by every row tile), the
    accumulators stay local to a panel, and the numbers are right; K = 256 is not blocked."""
    rng = np.random.default_rng(11)
    for k, blocked in ((2048, True), (256, False)):
        w = (rng.standard_normal((k, 512)) / np.sqrt(k)).astype("float32")
        x = rng.standard_normal((64, k)).astype("float32")
        mod = _module(lambda bb, a, w=w: R.matmul(a, relax.const(w)), (64, k))
        (func,) = _prim_funcs(mod, target)
        sch = cpu.Matmul().apply(func, target, False)
        (update,) = [b for b in tir_util.block_names(sch.mod["main"]) if b.endswith("_update")]
        extents = [int(sch.get(loop).extent) for loop in sch.get_loops(sch.get_sblock(update))]
        # [panels, k blocks, row tiles, 256, rows, vectors, lanes] when blocked
        assert (extents[1:4] == [k // 256, 64 // extents[4], 256]) == blocked, extents
        acc = {b.name for b in accumulator_tiles(sch.mod["main"])}
        for buf in tir_util.compacted_allocations(sch.mod["main"]):
            if buf.name in acc or not buf.name.endswith("_global"):
                assert tir_util.num_elements(buf) <= 64 * 16 * 4, (buf.name, buf.shape)
        out, _ = run(mod, [x], "tvm_fusion")
        np.testing.assert_allclose(out[0], x @ w, rtol=1e-4, atol=1e-4)


def test_long_gemm_on_avx2_gets_tiles_of_4_rows_by_3_vectors():
    """AVX2 (16 registers), K >= 256, a constant weight: 4 x 24 tiles (12 accumulators), the
    weight's 376 columns padded to 384 in its compile-time packing (no padded copy per call, no
    (rows, padded columns) buffer), the cut back to 376 columns reading the accumulators; the
    numbers are right when run. K = 128 keeps the narrower tile (8 wide, dividing 376, no
    padding); so do AVX-512 targets (32 registers), for which 4 x 3 vectors was not measured."""
    avx2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    avx512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})
    rng = np.random.default_rng(12)
    for k, target, wide in ((2048, avx2, True), (128, avx2, False), (2048, avx512, False)):
        w = (rng.standard_normal((k, 376)) / np.sqrt(k)).astype("float32")
        x = rng.standard_normal((64, k)).astype("float32")
        mod = _module(lambda bb, a, w=w: R.matmul(a, relax.const(w)), (64, k))
        (func,) = _prim_funcs(mod, target)
        sch = cpu.Matmul().apply(func, target, False)
        main = sch.mod["main"]
        (update,) = [b for b in tir_util.block_names(main) if b.endswith("_update")]
        extents = [int(sch.get(loop).extent) for loop in sch.get_loops(sch.get_sblock(update))]
        # [panels, (k blocks,) row tiles, k, rows, vectors, lanes]
        assert (extents[0] == 16 and extents[-3:-1] == [4, 3]) == wide, extents
        if wide:
            acc = {b.name for b in accumulator_tiles(main)}
            allocs = tir_util.compacted_allocations(main)
            packed = [b for b in allocs if b.name.endswith("_global") and b.name not in acc]
            assert [tuple(int(d) for d in b.shape) for b in packed] == [(16, k, 24)]
            for buf in allocs:
                if buf.name in acc:  # the accumulators of one panel at most
                    assert tir_util.num_elements(buf) <= 64 * 24, (buf.name, buf.shape)
        if target is avx2:
            out, _ = run(mod, [x], "tvm_fusion", target=avx2)
            np.testing.assert_allclose(out[0], x @ w, rtol=1e-4, atol=1e-4)


def test_wide_tile_refused_falls_back_to_the_standard_tile(monkeypatch):
    """When a step of the wide tile fails (here ``pad_einsum`` refuses to pad the weight's 376
    columns to 384), the rule schedules the GEMM again with its standard tile (8 wide, dividing
    376: no padding needed) instead of leaving it unscheduled; the numbers are right."""
    avx2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    rng = np.random.default_rng(13)
    w = (rng.standard_normal((2048, 376)) / np.sqrt(2048)).astype("float32")
    x = rng.standard_normal((64, 2048)).astype("float32")
    mod = _module(lambda bb, a: R.matmul(a, relax.const(w)), (64, 2048))
    (func,) = _prim_funcs(mod, avx2)

    def refuse(self, *args, **kwargs):
        raise tvm.TVMError("pad_einsum refused (test)")

    with monkeypatch.context() as patch:
        patch.setattr(tvm.s_tir.Schedule, "pad_einsum", refuse)
        sch = cpu.Matmul().apply(func, avx2, False)
        assert sch is not None
        main = sch.mod["main"]
        (update,) = [b for b in tir_util.block_names(main) if b.endswith("_update")]
        extents = [int(sch.get(loop).extent) for loop in sch.get_loops(sch.get_sblock(update))]
        assert extents[-1] == 8 and extents[-3:-1] != [4, 3], extents
        out, _ = run(mod, [x], "tvm_fusion", target=avx2)
    np.testing.assert_allclose(out[0], x @ w, rtol=1e-4, atol=1e-4)


def test_nested_selects_not_inlined_past_the_cap(target):
    """DeBERTa's relative-position buckets: where / sign over ``i - j``, each step reading the
    previous several times. Inlined into one block, the Selects nest (~60 in the export) and
    TIR's simplifier, which proves each branch under its condition, took 50 s to lower it; the
    rule stops inlining at MAX_INLINED_SELECTS per block and the numbers stay the same."""
    from tvm_fusion.schedule._common import MAX_INLINED_SELECTS

    n = tvm.tirx.Var("n", "int64")

    def build(bb, x):
        y = x
        for _ in range(4):
            big = R.greater(R.multiply(y, y), relax.const(64, "int64"))
            y = R.where(big, R.add(R.sign(y), R.floor_divide(y, relax.const(4, "int64"))), y)
        return y

    mod = _module(build, (n, n), dtype="int64")
    for func in _prim_funcs(mod, target):
        sch = cpu.Injective().apply(func, target, False)
        assert sch is not None
        for block in tir_util.blocks(sch.mod["main"]):
            if isinstance(block.body, tvm.tirx.BufferStore):
                assert tir_util.count_selects(block.body.value) <= MAX_INLINED_SELECTS
    x = np.random.default_rng(6).integers(-100, 100, (5, 5)).astype("int64")
    out, _ = run(mod, [x], "tvm_fusion")
    ref = x.copy()
    for _ in range(4):
        ref = np.where(ref * ref > 64, np.sign(ref) + ref // 4, ref)
    np.testing.assert_array_equal(out[0], ref)


def _matmul_rules(compiled) -> dict:
    """Kernel name -> the rule that scheduled it, for the kernels that hold a matmul."""
    return {i.name: i.rule for i in analysis.schedule_info(compiled.lowered) if "matmul" in i.name}


def test_gemm_with_computed_epilogue_inputs_scheduled_by_matmul(target):
    """DeBERTa-v2's attention scores (TorchScript export): ``q @ k + (c2p / s + p2c / s)``, the
    divides and adds of the position terms fused into the GEMM's kernel ahead of it. They feed
    the epilogue only, so they are inlined there; the rule used to refuse any computed block
    before the GEMM, leaving the kernel to RowReduction (and T5's ``q @ k + bias + where(mask)``
    kernels to the fallback rule). Odd sizes: 7 x 19 @ 19 x 13, and symbolic ``seq``."""
    seq = tvm.tirx.Var("seq", "int64")
    s1, s2 = relax.const(np.float32(1.7)), relax.const(np.float32(3.1))

    def scores(bb, q, k, c2p, p2c):
        bias = bb.emit(R.add(R.divide(c2p, s1), R.divide(p2c, s2)))  # ahead of the GEMM
        return R.add(R.matmul(q, k), bias)

    rng = np.random.default_rng(12)
    for rows, cols in [(7, 13), (seq, seq)]:
        mod = _module(scores, (3, rows, 19), (3, 19, cols), (3, rows, cols), (3, rows, cols))
        funcs = [f for f in _prim_funcs(mod, target) if "matmul" in f.script()]
        assert len(funcs) == 1 and "T_divide" in funcs[0].script()
        assert cpu.Matmul().apply(funcs[0], target, False) is not None
        compiled = engine.compile_module(mod, target, "tvm_fusion")
        assert set(_matmul_rules(compiled).values()) == {"Matmul"}, _matmul_rules(compiled)
        vm = compiled.vm()
        for n, m in [(7, 13)] if rows == 7 else [(1, 1), (5, 5), (11, 11)]:
            q = rng.standard_normal((3, n, 19)).astype("float32")
            k = rng.standard_normal((3, 19, m)).astype("float32")
            c2p, p2c = (rng.standard_normal((3, n, m)).astype("float32") for _ in range(2))
            out = vm["main"](*(tvm.runtime.tensor(a) for a in (q, k, c2p, p2c))).numpy()
            expected = q @ k + (c2p / np.float32(1.7) + p2c / np.float32(3.1))
            np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_gemm_with_computed_prologue_on_a_scheduled_by_matmul(target):
    """``(x / s + y) @ W + b``: a computed A operand in the GEMM's PrimFunc is materialised in
    one pass before the GEMM (inlined into A's read it would be recomputed for every column
    panel), and the GEMM gets the Matmul rule's tiles, not the fallback. Odd sizes: 11 x 37 @
    37 x 29."""
    rng = np.random.default_rng(13)
    w = rng.standard_normal((37, 29)).astype("float32")
    b = rng.standard_normal(29).astype("float32")

    def build(bb, x, y):
        a = R.add(R.divide(x, relax.const(np.float32(2.5))), y)
        return R.add(R.matmul(a, relax.const(w)), relax.const(b))

    mod = _module(build, (11, 37), (11, 37))
    # the prologue in the GEMM's PrimFunc (the pipeline keeps it a kernel of its own)
    prim = tvm.te.create_prim_func(_te_prologue_gemm(11, 37, 29))
    sch = cpu.Matmul().apply(prim, target, False)
    assert sch is not None
    acc = accumulator_tiles(sch.mod["main"])
    assert len(acc) == 1 and tir_util.num_elements(acc[0]) < 11 * 29, acc
    x, y = (rng.standard_normal((11, 37)).astype("float32") for _ in range(2))
    a = x / np.float32(2.5) + y
    built = tvm.compile(sch.mod, target=target)
    out = tvm.runtime.tensor(np.zeros((11, 29), "float32"))
    built["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(y), tvm.runtime.tensor(w), out)
    np.testing.assert_allclose(out.numpy(), a @ w, rtol=1e-5, atol=1e-5)
    # and end to end through the pipeline
    vm = engine.compile_module(mod, target, "tvm_fusion").vm()
    out = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(y)).numpy()
    np.testing.assert_allclose(out, a @ w + b, rtol=1e-5, atol=1e-5)


def _te_prologue_gemm(m, k, n):
    from tvm import te

    x = te.placeholder((m, k), name="x")
    y = te.placeholder((m, k), name="y")
    w = te.placeholder((k, n), name="w")
    a = te.compute((m, k), lambda i, j: x[i, j] / 2.5 + y[i, j], name="a")
    r = te.reduce_axis((0, k), name="r")
    out = te.compute((m, n), lambda i, j: te.sum(a[i, r] * w[r, j], axis=r), name="matmul")
    return [x, y, w, out]


def test_awkward_tiles_pad_few_rows_and_columns():
    """Static extents that no tile divides get the tile that pads least: 77 columns one vector
    wide (80, not 96 in tiles of 2 vectors), 97 rows (a prime) in tiles of 14 (98, not 112),
    while 129 rows keep the full height (7 on AVX-512, 133: tiles of 5 would save too few rows
    to pay). 8 x 2 AVX-512 vectors are 1024 bytes, a workspace (_tiles.STACK_TILE_BYTES): 128
    rows take 4 x 2."""
    tile = cpu.Matmul._tile
    assert tile(77, 77, 16, 32, 1) == (16, 11)
    assert tile(97, 97, 16, 32, 1) == (16, 14)
    assert tile(129, 127, 16, 32, 1) == (32, 7)
    assert tile(128, 1024, 16, 32, 1) == (32, 4)
    assert tile(77, 77, 8, 16, 1) == (16, 6)  # AVX2: 2 vectors pad no more than 1; 6 x 2 (78)


@pytest.mark.parametrize("op,n", [("log_softmax", 4002), ("softmax", 77)])
def test_row_outputs_vectorised_at_full_width_with_a_vector_tail(cpu_target, op, n):
    """A static row that the vector width does not divide: the output is written in whole
    vectors and one short vector (4002 = 250 x 16 + 2), not in vectors of the largest power
    of two dividing the row (2 lanes for 4002: log_softmax 64 x 30522 ran at 2 lanes).
    Compile-only on AVX2, AVX-512 and NEON targets; the numbers on the host."""
    from tvm_fusion.target import vector_lanes

    target = cpu_target
    lanes = vector_lanes(target, "float32")
    mod = _module(lambda bb, x: getattr(R.nn, op)(x), (3, n))
    funcs = _prim_funcs(mod, target)
    sch = cpu.RowReduction().apply(funcs[0], target, False)
    assert sch is not None
    func = sch.mod["main"]
    out = func.params[-1]  # in 0.27 a buffer parameter is the buffer itself
    widths = set()
    for loop in tir_util.loops(func):
        if loop.kind == tvm.tirx.ForKind.VECTORIZED:
            for stmt in tir_util.iter_stmts(loop.body):
                if isinstance(stmt, tvm.s_tir.SBlock) and any(
                    w.source.same_as(out) for w in stmt.writes
                ):
                    widths.add(int(loop.extent))
    tail = n % lanes  # one lane (77 at NEON's 4) is a scalar, no vector loop
    assert widths == {lanes, tail} - {1}, widths


@pytest.mark.parametrize("op,n", [("log_softmax", 4002), ("softmax", 77)])
def test_row_outputs_with_a_vector_tail_numbers(op, n):
    mod = _module(lambda bb, x: getattr(R.nn, op)(x), (3, n))
    x = np.random.default_rng(5).standard_normal((3, n)).astype("float32") * 3
    result, _ = run(mod, [x], "tvm_fusion")
    shifted = x - x.max(-1, keepdims=True)
    e = np.exp(shifted)
    expected = (
        shifted - np.log(e.sum(-1, keepdims=True))
        if op == "log_softmax"
        else e / e.sum(-1, keepdims=True)
    )
    np.testing.assert_allclose(result[0], expected, rtol=1e-5, atol=1e-6)


def _row_loop_extents(func):
    """Extents of the parallel loops: one, the row loop (over row blocks when rows are paired)."""
    parallel = [lp for lp in tir_util.loops(func) if lp.kind == tvm.tirx.ForKind.PARALLEL]
    return [lp.extent for lp in parallel]


# (rows, row length in vectors of the target's float lanes): paired
SHORT_ROWS = [
    ((64, 5), True),  # short rows (fewer than 8 vectors): two at a time (40 at AVX2's 8 lanes)
    ((64, 16), False),  # 16 vectors: one row at a time (256 at AVX-512's 16 lanes)
    ((63, 5), False),  # an odd number of rows: one at a time
    (("n", 5), False),  # symbolic rows: one at a time
]


def _softmax_rows(shape, lanes: int):
    rows = tvm.tirx.Var("n", "int64") if shape[0] == "n" else shape[0]
    return _module(lambda bb, x: R.nn.softmax(x), (rows, shape[1] * lanes))


@pytest.mark.parametrize("shape,paired", SHORT_ROWS)
def test_short_rows_go_two_per_iteration(cpu_target, shape, paired):
    """Softmax over short rows (4096 x 77 ran at 1.14-1.33x ORT): the row loop steps two rows
    at a time, every block computed for both, so a core has two independent chains of
    max-fold-exp-sum-fold in flight. Long rows, odd and symbolic row counts keep one row.
    Compile-only on AVX2, AVX-512 and NEON targets, rows as long as the target's vectors."""
    from tvm_fusion.schedule.cpu.reduction import ROW_BLOCK
    from tvm_fusion.target import vector_lanes

    target = cpu_target
    mod = _softmax_rows(shape, vector_lanes(target, "float32"))
    funcs = _prim_funcs(mod, target)
    sch = cpu.RowReduction().apply(funcs[0], target, False)
    assert sch is not None
    func = sch.mod["main"]
    extents = _row_loop_extents(func)
    assert len(extents) == 1, extents
    expected = shape[0] // ROW_BLOCK if paired else (shape[0] if shape[0] != "n" else None)
    if expected is None:
        assert not isinstance(extents[0], tvm.tirx.IntImm)
    else:
        assert int(extents[0]) == expected


@pytest.mark.parametrize("shape,paired", SHORT_ROWS)
def test_short_rows_numbers(target, shape, paired):
    from tvm_fusion.target import vector_lanes

    lanes = vector_lanes(target, "float32")
    mod = _softmax_rows(shape, lanes)
    m = 64 if shape[0] == "n" else shape[0]
    x = np.random.default_rng(7).standard_normal((m, shape[1] * lanes)).astype("float32") * 4
    result, _ = run(mod, [x], "tvm_fusion")
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(result[0], e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
