"""FuseGatheredGates: a mixture-of-experts gate GEMM on gathered expert weights
(``take(W, ids) -> bmm -> split -> gate math``, transformers' ``batched_mm`` experts) becomes one
kernel reading ``W[ids[s]]`` in place: the ``(S, 2I, H)`` gathered copy is gone.

Structural: fires on a symbolic token count, the take of the weight is gone, one fused kernel
reads the per-expert blocked weight. Must not fire: a non-constant expert weight, ids of another
rank, ids the graph does not bound (a model input, topk over more logits than experts).
Numerical: a tiny Mixtral-style MoE block through torch.export and the whole ``tvm_fusion``
pipeline on llvm, 1 and 7 tokens, 3 experts top-2, against torch.
"""

import numpy as np
import pytest
import tvm
from tvm import relax, sym, tirx
from tvm.ir.expr import GenericConst

import tvm_fusion
from tvm_fusion.build import engine
from tvm_fusion.transform import FuseGatheredGates, collect_rewrites
from tvm_fusion.transform.fuse_split_gates import GATE_ATTR

H, INNER, E = 16, 12, 3  # hidden, expert inner width, experts


def _expert_module(
    *,
    const_weight=True,
    ids="topk",
    logits=E,
    transposed=False,
    symbolic=True,
    dtype="float32",
    nd=False,
    tokens=5,
) -> tvm.IRModule:
    """``silu(g) * u`` of ``squeeze(bmm(take(W, ids), x[..., None]))`` split in two; ``nd``:
    ``gather_nd(W, ids (s, 1))`` (ONNX GatherND, the dynamo export of ``W[ids]``) instead."""
    rng = np.random.default_rng(0)
    s = tirx.Var("s", "int64") if symbolic else tokens
    w_shape = (E, H, 2 * INNER) if transposed else (E, 2 * INNER, H)
    x = relax.Var("x", relax.TensorType((s, H), dtype))
    params = [x]
    if ids == "input":
        ids_in = relax.Var("ids", relax.TensorType((s,), "int64"))
        params.append(ids_in)
    else:
        scores = relax.Var("scores", relax.TensorType((s, logits), "float32"))
        params.append(scores)
    if const_weight:
        weight = relax.const(rng.standard_normal(w_shape).astype(dtype))
    else:
        weight = relax.Var("w", relax.TensorType(w_shape, dtype))
        params.append(weight)
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            if ids == "input":
                index = ids_in
            else:
                top = bb.emit(relax.op.topk(scores, 1, -1, "indices", True, "int64"))
                index = bb.emit(relax.op.reshape(top, (s,) if ids == "topk" else (s, 1)))
            if nd:
                gathered = bb.emit(relax.op.gather_nd(weight, index, batch_dims=0))
            else:
                gathered = bb.emit(relax.op.take(weight, index, axis=0))
            if transposed:
                xe = bb.emit(relax.op.expand_dims(x, [1]))
                y = bb.emit(relax.op.squeeze(relax.op.matmul(xe, gathered), [1]))
            else:
                xe = bb.emit(relax.op.expand_dims(x, [-1]))
                y = bb.emit(relax.op.squeeze(relax.op.matmul(gathered, xe), [-1]))
            pieces = bb.emit(relax.op.split(y, 2, axis=-1))
            gate = bb.emit(relax.op.nn.silu(relax.TupleGetItem(pieces, 0)))
            out = bb.emit_output(relax.op.multiply(gate, relax.TupleGetItem(pieces, 1)))
        bb.emit_func_output(out)
    return bb.get()


def _fuse(mod, target="llvm"):
    with collect_rewrites() as counts:
        out = FuseGatheredGates(target=tvm.target.Target(target))(mod)
    return counts["FuseGatheredGates"], out


def _bindings(mod):
    return [b for blk in mod["main"].body.blocks for b in blk.bindings]


def _weight_takes(mod):
    """The ``take`` / ``gather_nd`` bindings of ``main`` that read a constant (the gathered
    weight copy)."""
    ops = ("relax.take", "relax.gather_nd")
    return [
        b
        for b in _bindings(mod)
        if isinstance(b.value, relax.Call)
        and getattr(b.value.op, "name", None) in ops
        and isinstance(b.value.args[0], GenericConst)
    ]


def _gate_kernels(mod):
    return [
        f
        for _, f in mod.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and GATE_ATTR in f.attrs
    ]


@pytest.mark.parametrize("transposed, nd", [(False, False), (True, False), (False, True)])
def test_fires_symbolic_tokens_weight_read_in_place(transposed, nd):
    ids = "rank2" if nd else "topk"  # gather_nd's index is (s, 1)
    count, out = _fuse(_expert_module(transposed=transposed, ids=ids, nd=nd))
    assert count == 1
    text = out["main"].script()
    assert "R.gather_nd" not in text and not _weight_takes(out)
    assert "R.matmul" not in text and "R.split" not in text
    (kernel,) = _gate_kernels(out)
    buffers = [p.ty for p in kernel.params if hasattr(p.ty, "shape")]
    shapes = [tuple(int(d) for d in b.shape) for b in buffers if len(b.shape) == 5]
    assert len(shapes) == 1  # the per-expert blocked weight (E, D/V, K, 2, V)
    e, blocks, k, gates, v = shapes[0]
    assert (e, k, gates) == (E, H, 2) and blocks * v >= INNER
    # (rows, INNER), the rows symbolic: the sorted rows, or each expert's padded to whole tiles
    rows, width = buffers[-1].shape
    assert isinstance(rows, tirx.Var) and int(width) == INNER
    # after the weight: the expert of each tile (tiles,), of each row and the flag (rows + 1,)
    (tiles,), (flagged,) = buffers[2].shape, buffers[3].shape
    assert isinstance(tiles, tirx.Var) and not tiles.same_as(rows)
    assert sym.Analyzer().can_prove_equal(flagged, rows + 1)
    assert int(kernel.attrs[GATE_ATTR]["rows"]) > 1


@pytest.mark.parametrize(
    "case",
    [
        dict(const_weight=False),  # expert weights a runtime input
        dict(ids="rank2"),  # ids (s, 1): the gathered weight is (s, 1, N, K)
        dict(ids="input"),  # ids the graph does not bound
        dict(ids="topk", nd=True),  # gather_nd of (s,) ids: one (N, K) row per id, not W[ids]
        dict(logits=E + 1),  # topk over more scores than experts: ids may reach E
    ],
)
@pytest.mark.parametrize("target", ["llvm", "cuda"])
def test_must_not_fire(case, target):
    mod = _expert_module(**case)
    count, out = _fuse(mod, target)
    assert count == 0
    assert out.same_as(mod)


@pytest.mark.parametrize(
    "dtype, tol, nd, tokens",
    [
        ("float32", 1e-4, False, 5),
        ("float16", 2e-2, False, 5),
        ("float32", 1e-4, True, 5),
        ("float32", 1e-4, False, 80),  # past 2 * E * MR rows: one expert per tile
        ("float16", 2e-2, True, 80),
    ],
)
def test_static_tokens_match_numpy(dtype, tol, nd, tokens):
    """5 tokens, static: the CPU rule tiles several rows, each reading its own expert; 80: each
    expert's rows padded to whole tiles of one expert; float16 accumulates in float32 and
    rounds once; ``nd``: the weight gathered by gather_nd."""
    ids = "rank2" if nd else "topk"
    mod = _expert_module(symbolic=False, dtype=dtype, nd=nd, ids=ids, tokens=tokens)
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((tokens, H)) * 0.3).astype(dtype)
    scores = rng.standard_normal((tokens, E)).astype("float32")
    with collect_rewrites() as counts:
        compiled = engine.compile_module(mod, tvm_fusion.host_target(), "tvm_fusion")
    assert counts["FuseGatheredGates"] == 1
    got = engine.TvmRunner(compiled, [x, scores]).outputs()[0]
    weight = next(c for c in _constants(mod)).astype("float64")
    y = np.einsum("snk,sk->sn", weight[scores.argmax(-1)], x.astype("float64"))
    g, u = y[:, :INNER], y[:, INNER:]
    np.testing.assert_allclose(got.astype("float64"), g / (1 + np.exp(-g)) * u, rtol=tol, atol=tol)


def _constants(mod):
    found = []
    relax.analysis.post_order_visit(
        mod["main"].body,
        lambda e: (
            found.append(e.value.numpy()) if isinstance(e, tvm.ir.expr.GenericConst) else None
        ),
    )
    return found


def _down_module(scaled=True) -> tvm.IRModule:
    """The down projection: ``squeeze(bmm(take(Wd, ids), h[..., None])) * r`` (or unscaled)."""
    rng = np.random.default_rng(1)
    s = tirx.Var("s", "int64")
    h = relax.Var("h", relax.TensorType((s, INNER), "float32"))
    scores = relax.Var("scores", relax.TensorType((s, E), "float32"))
    r = relax.Var("r", relax.TensorType((s, 1), "float32"))
    weight = relax.const(rng.standard_normal((E, H, INNER)).astype("float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [h, scores, r]):
        with bb.dataflow():
            top = bb.emit(relax.op.topk(scores, 1, -1, "indices", True, "int64"))
            index = bb.emit(relax.op.reshape(top, (s,)))
            gathered = bb.emit(relax.op.take(weight, index, axis=0))
            he = bb.emit(relax.op.expand_dims(h, [-1]))
            y = bb.emit(relax.op.squeeze(relax.op.matmul(gathered, he), [-1]))
            out = bb.emit_output(relax.op.multiply(y, r) if scaled else y)
        bb.emit_func_output(out)
    return bb.get()


def test_down_projection_times_routing_weight():
    count, out = _fuse(_down_module())
    assert count == 1
    text = out["main"].script()
    assert not _weight_takes(out) and "R.matmul" not in text and "R.multiply" not in text
    (kernel,) = _gate_kernels(out)
    assert kernel.attrs[GATE_ATTR]["gates"] == 1


def test_down_projection_alone_left_alone():
    """No op of the gate table reads the result: nothing to fuse it with, left as it is."""
    mod = _down_module(scaled=False)
    count, out = _fuse(mod)
    assert count == 0 and out.same_as(mod)


class _MoE:
    """A Mixtral-style sparse MoE block in the ``batched_mm`` form (torch, built lazily)."""

    @staticmethod
    def make(torch, act="silu", transposed=False, bias=False):
        fn = torch.nn.functional

        class MoE(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.router = torch.nn.Linear(H, E, bias=False)
                shape = (E, H, 2 * INNER) if transposed else (E, 2 * INNER, H)
                self.gate_up_proj = torch.nn.Parameter(torch.randn(shape) * 0.3)
                self.gate_up_bias = torch.nn.Parameter(torch.randn(E, 2 * INNER)) if bias else None
                self.down_proj = torch.nn.Parameter(torch.randn(E, H, INNER) * 0.3)

            def forward(self, x):
                w, ids = torch.topk(fn.softmax(self.router(x), dim=-1), 2, dim=-1)
                w = w / w.sum(-1, keepdim=True)
                t = x.shape[0]
                flat = ids.reshape(-1)
                xs = x.unsqueeze(1).expand(t, 2, H).reshape(-1, H)
                if transposed:
                    gu = torch.bmm(xs.unsqueeze(1), self.gate_up_proj[flat]).squeeze(1)
                else:
                    gu = torch.bmm(self.gate_up_proj[flat], xs.unsqueeze(-1)).squeeze(-1)
                if bias:
                    gu = gu + self.gate_up_bias[flat]
                g, u = gu.chunk(2, dim=-1)
                g = fn.silu(g) if act == "silu" else fn.gelu(g, approximate="tanh")
                h = torch.bmm(self.down_proj[flat], (g * u).unsqueeze(-1)).squeeze(-1)
                return (h * w.reshape(-1, 1)).view(t, 2, H).sum(1)

        return MoE().eval()


@pytest.mark.parametrize(
    "act, transposed, bias", [("silu", False, False), ("gelu_tanh", True, True)]
)
def test_moe_block_matches_torch(act, transposed, bias):
    torch = pytest.importorskip("torch")
    from tvm_fusion.frontend.load import import_exported_program

    torch.manual_seed(0)
    model = _MoE.make(torch, act, transposed, bias)
    tokens = torch.export.Dim("tokens", min=1, max=64)
    program = torch.export.export(model, (torch.randn(7, H),), dynamic_shapes={"x": {0: tokens}})
    mod = import_exported_program(program)
    with collect_rewrites() as counts:
        compiled = engine.compile_module(mod, tvm_fusion.host_target(), "tvm_fusion")
    assert counts["FuseGatheredGates"] == 2  # gate-up and down projections
    for n in (1, 7, 61):  # the rows sorted by expert (61: tiles of several experts' rows)
        x = torch.randn(n, H)
        got = engine.TvmRunner(compiled, [x.numpy()]).outputs()[0]
        with torch.no_grad():
            want = model(x).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_moe_block_rows_sorted_by_expert():
    """Both projections run on the rows sorted by expert, each expert's segment padded to
    whole register tiles: the layout kernel (``expert_tiles``) reads the ids, ``perm =
    argsort(ids)`` and ``argsort(perm)``; the gate-up kernel runs on ``take(x, src)`` with the
    expert of each tile, the down kernel on the gate-up kernel's result in place and the
    routing weight taken in the same order; only the down result is put back in row order
    (``take(result, dst)``)."""
    torch = pytest.importorskip("torch")
    from tvm_fusion.frontend.load import import_exported_program

    torch.manual_seed(0)
    tokens = torch.export.Dim("tokens", min=1, max=64)
    program = torch.export.export(
        _MoE.make(torch), (torch.randn(7, H),), dynamic_shapes={"x": {0: tokens}}
    )
    _check_sorted(import_exported_program(program))


def _check_sorted(mod):
    """``mod``'s MoE block, fused, runs on rows sorted by expert (see the test above)."""
    count, out = _fuse(mod)
    assert count == 2
    value = {b.var: b.value for b in _bindings(out)}

    def call_of(var, name):  # the call_tir of a PrimFunc named ``name*`` bound to ``var``
        v = value.get(var)
        ok = isinstance(v, relax.Call) and getattr(v.op, "name", None) == "relax.call_tir"
        return v if ok and v.args[0].name_hint.startswith(name) else None

    def taken_by(var):  # (data, index) of ``take(data, index, axis=0)`` bound to ``var``
        v = value.get(var)
        if isinstance(v, relax.Call) and getattr(v.op, "name", None) == "relax.take":
            assert int(v.attrs.axis) == 0
            return v.args[0], v.args[1]
        return None

    def item(var):  # (tuple var, index) of ``var = tuple[index]``
        v = value.get(var)
        return (v.tuple_value, v.index) if isinstance(v, relax.TupleGetItem) else (None, None)

    kernels = [b.var for b in _bindings(out) if call_of(b.var, "fused_gates") is not None]
    assert len(kernels) == 2
    up, down = (call_of(k, "fused_gates") for k in kernels)
    x_up, _w, tiles, per_row = up.args[1].fields
    _, src = taken_by(x_up)
    layout, at = item(src)
    assert at == 0 and [item(v) for v in (tiles, per_row)] == [(layout, 1), (layout, 2)]
    ids, perm, unsort = call_of(layout, "expert_tiles").args[1].fields[:3]  # then shape vars
    assert call_of(perm, "argsort").args[1].fields[0].same_as(ids)
    assert call_of(unsort, "argsort").args[1].fields[0].same_as(perm)
    x_down, _w, tiles_down, per_row_down = down.args[1].fields[:4]
    assert x_down.same_as(kernels[0])  # the gate-up result, read in place
    assert tiles_down.same_as(tiles) and per_row_down.same_as(per_row)
    (routing,) = down.args[1].fields[4:]  # the routing weight, (rows, 1), laid out likewise
    assert taken_by(routing)[1].same_as(src)
    users = [
        b.var
        for b in _bindings(out)
        if taken_by(b.var) is not None and any(taken_by(b.var)[0].same_as(k) for k in kernels)
    ]
    (back,) = users  # only the down result goes back to row order
    data, order = taken_by(back)
    assert data.same_as(kernels[1]) and item(order) == (layout, 3)


def test_moe_block_dynamo_onnx_matches_torch():
    """The dynamo ONNX export gathers ``W[ids]`` by GatherND with an ``(S, 1)`` index (checked
    at run time by CheckGatherBounds, the topk being a library call by then): both projections
    fuse, on rows sorted by expert, and the numbers match torch and onnxruntime at a symbolic
    token count."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")

    torch.manual_seed(0)
    model = _MoE.make(torch)
    tokens = torch.export.Dim("tokens", min=1, max=64)
    program = torch.onnx.export(
        model, (torch.randn(7, H),), dynamo=True, dynamic_shapes=({0: tokens},), verbose=False
    )
    onnx_model = program.model_proto
    assert "GatherND" in [n.op_type for n in onnx_model.graph.node]
    # the ids written once per weight, wrapped by each weight's expert count: one order
    _check_sorted(tvm_fusion.load_onnx(onnx_model))
    with collect_rewrites() as counts:
        compiled = engine.compile_module(
            tvm_fusion.load_onnx(onnx_model), tvm_fusion.host_target(), "tvm_fusion"
        )
    assert counts["FuseGatheredGates"] == 2  # gate-up and down projections
    session = ort.InferenceSession(onnx_model.SerializeToString())
    name = session.get_inputs()[0].name
    for n in (1, 7, 61):
        x = torch.randn(n, H)
        got = engine.TvmRunner(compiled, [x.numpy()]).outputs()[0]
        with torch.no_grad():
            want = model(x).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got, session.run(None, {name: x.numpy()})[0], 1e-4, 1e-4)


# CUDA: the same kernels, scheduled by the CUDA gate rule's split-K GEMV per row (each row
# reads its own expert's weight: no slab that a tile of rows shares), checked without a GPU.


def _cuda_kernel(mod):
    """The fused gate kernel of ``mod`` after the CUDA pipeline's phases 0-3 (the library
    dispatch makes topk a sorting kernel: its indices are still proven in range)."""
    from tvm_fusion import target as _target
    from tvm_fusion.build import pipeline

    tgt = _target.cuda_target()
    with collect_rewrites() as counts, tgt:
        fused = tvm.transform.Sequential(pipeline.fused_passes(tgt))(mod)
    (kernel,) = _gate_kernels(fused)
    return counts["FuseGatheredGates"], kernel, tgt


def _kernel_args(func, n: int) -> list:
    """Arguments for ``func``: floats drawn normal, integer ids in ``[0, E)``, every symbolic
    dim variable (and a scalar parameter of one) at ``n``."""
    from tvm import sym

    rng = np.random.default_rng(3)
    analyzer = sym.Analyzer()
    for param in func.params:
        if not hasattr(param.ty, "shape"):
            analyzer.bind(param, n)
    for param in func.params:
        for d in getattr(param.ty, "shape", []):
            for var in tvm.tirx.analysis.undefined_vars(d):
                analyzer.bind(var, n)
    args = []
    for param in func.params:
        if not hasattr(param.ty, "shape"):
            args.append(n)
            continue
        shape = [int(analyzer.simplify(d)) for d in param.shape]
        dtype = str(param.ty.dtype)
        if "int" in dtype:
            args.append(rng.integers(0, E, size=shape).astype(dtype))
        else:
            args.append((rng.standard_normal(shape) * 0.3).astype(dtype))
    return args


def _run(func, args: list) -> np.ndarray:
    """``func``'s last argument (its result) after a run on llvm."""
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), "llvm")
    values = [tvm.runtime.tensor(a.copy()) if isinstance(a, np.ndarray) else a for a in args]
    lib["main"](*values)
    return values[-1].numpy()


def _torch_moe_bias():
    """The torch MoE block with transposed experts and a gathered bias, symbolic tokens (its
    gate kernels: gate-up with the bias of each row's expert, and the down projection)."""
    torch = pytest.importorskip("torch")
    from tvm_fusion.frontend.load import import_exported_program

    torch.manual_seed(0)
    model = _MoE.make(torch, "gelu_tanh", True, True)
    tokens = torch.export.Dim("tokens", min=1, max=64)
    program = torch.export.export(model, (torch.randn(7, H),), dynamic_shapes={"x": {0: tokens}})
    return import_exported_program(program)


@pytest.mark.parametrize(
    "build, kernels",
    [
        (lambda: _expert_module(), 1),  # symbolic tokens
        (lambda: _expert_module(transposed=True, symbolic=False), 1),  # 5 static tokens
        (lambda: _down_module(), 1),  # the down projection: one "gate"
        (lambda: _torch_moe_bias(), 2),  # torch.export: a gathered bias; tokens * top_k rows
    ],
    ids=["symbolic", "static5", "down", "torch_bias"],
)
def test_cuda_fires_and_gemv_computes_the_same(build, kernels):
    """On a CUDA target the pass fires (the old code left CUDA graphs alone: the (S, N, K)
    gathered copy stayed), the rule schedules each kernel as the split-K GEMV (partial sums in
    registers, rfactor; the expert weight in 4-unit blocks, read in place: no local copy,
    which would span every expert), and the schedule, its thread loops run serially on llvm,
    computes what the unscheduled kernel computes."""
    from helpers import sequential

    from tvm_fusion import target as _target
    from tvm_fusion import tir_util
    from tvm_fusion.build import pipeline
    from tvm_fusion.schedule import cuda

    tgt = _target.cuda_target()
    with collect_rewrites() as counts, tgt:
        fused = tvm.transform.Sequential(pipeline.fused_passes(tgt))(build())
    assert counts["FuseGatheredGates"] == kernels
    found = _gate_kernels(fused)
    assert len(found) == kernels
    for kernel in found:
        weight = next(p for p in kernel.params if len(getattr(p.ty, "shape", [])) == 5)
        assert int(weight.shape[-1]) == 4  # (E, D/4, K, gates, 4)
        sch = cuda.GateFusion().apply(kernel, tgt, False)
        assert sch is not None
        scheduled = sch.mod["main"]
        buffers = tir_util.allocated_buffers(scheduled)
        assert {b.scope() for b in buffers} == {"local"}
        assert any("rf" in b.name for b in buffers)
        assert not any(b.name.startswith(weight.name) for b in buffers), [b.name for b in buffers]
        args = _kernel_args(kernel, 7)
        want = _run(kernel, args)
        np.testing.assert_allclose(_run(sequential(scheduled), args), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_cuda_builds_without_spills(arch):
    """Symbolic tokens, built for CUDA with nvcc (skipped without it): one gate kernel, the
    gathered weight's take gone, ptxas without spills or stack within 128 registers, the
    weight read with 128-bit loads; no shared memory (one warp splits K: shuffles only)."""
    import shutil

    from helpers import gate_kernel_check

    from tvm_fusion import target as _target

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    mod = _expert_module(symbolic=True)
    with collect_rewrites() as counts:
        compiled = engine.compile_module(mod, _target.cuda_target(arch), "tvm_fusion")
    assert counts["FuseGatheredGates"] == 1
    assert "take" not in compiled.lowered["main"].script()
    gate = gate_kernel_check(compiled, scopes=("local", "shared"))
    assert gate.spill_stores == gate.spill_loads == gate.stack == 0, gate.to_text()
    assert gate.registers <= 128 and gate.vector_loads > 0, gate.to_text()


def test_dispatched_topk_kernels_tagged():
    """On CUDA the dispatch makes topk a sorting kernel: MarkDispatchedTopK tags it with the
    axis and return type (the ids' range proof); a kernel called for another op stays
    untagged."""
    from tvm_fusion import target as _target
    from tvm_fusion.build import pipeline
    from tvm_fusion.transform.mark_topk import TOPK_ATTR

    s = tirx.Var("s", "int64")
    scores = relax.Var("scores", relax.TensorType((s, E), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [scores]):
        with bb.dataflow():
            top = bb.emit(relax.op.topk(scores, 1, -1, "indices", True, "int64"))
            both = bb.emit(relax.op.topk(scores, 2, 1, "both", True, "int64"))
            order = bb.emit(relax.op.argsort(scores, -1, True, "int64"))
            out = bb.emit_output(relax.Tuple([top, both, order]))
        bb.emit_func_output(out)
    tgt = _target.cuda_target()
    with tgt:
        mod = tvm.transform.Sequential(pipeline.dispatch_passes(tgt))(bb.get())
    tags = []
    for binding in mod["main"].body.blocks[0].bindings[:3]:
        func = mod[binding.value.args[0]]
        tag = func.attrs.get(TOPK_ATTR) if func.attrs is not None else None
        tags.append(None if tag is None else (int(tag["axis"]), str(tag["ret_type"])))
    assert tags == [(-1, "indices"), (1, "both"), None], tags


def test_gathered_single_gate_block_two_vectors():
    """A gathered tile has at most 4 rows: the down projection's single gate gets a block of
    two AVX2 vectors (8 accumulators), the gate-up's two gates one vector each."""
    haswell = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})  # 8 lanes, 16 registers
    blocks = []
    for mod in (_down_module(), _expert_module()):
        with collect_rewrites():
            out = FuseGatheredGates(target=haswell)(mod)
        (kernel,) = _gate_kernels(out)
        blocks.append(int(kernel.attrs[GATE_ATTR]["block"]))
    assert blocks == [16, 8]


def test_rule_tiles_share_one_expert_weight():
    """One expert per register tile (``transform/_expert_tiles.py``): the gate-up kernel reads
    the expert of each tile, ``W[select(sorted only, per_row[r], tiles[r // MR])]``, and the
    CPU rule unswitches that select over the whole kernel: in the tiled branch every weight
    read is indexed by the tile's expert (one load a ``k`` for the tile's rows), in the other
    by the row's own."""
    from tvm_fusion.schedule.cpu.gate_fusion import GateFusion
    from tvm_fusion.tir_util import iter_stmts, loads_of

    haswell = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    with collect_rewrites():
        out = FuseGatheredGates(target=haswell)(_expert_module())
    (kernel,) = _gate_kernels(out)
    assert int(kernel.attrs[GATE_ATTR]["rows"]) > 1
    with haswell:
        func = GateFusion().apply(kernel, haswell, False).mod["main"]
    x, weight, tiles, per_row = func.params[:4]
    assert len(weight.shape) == 5 and len(tiles.shape) == 1 and len(per_row.shape) == 1
    branch = func.body.block.body
    assert isinstance(branch, tirx.IfThenElse)
    assert loads_of(branch.condition, per_row)  # the flag: per_row's last element
    for body, index_buffer in ((branch.then_case, per_row), (branch.else_case, tiles)):
        reads = [
            load
            for stmt in iter_stmts(body)
            if isinstance(stmt, tirx.BufferStore)
            for load in loads_of(stmt.value, weight)
        ]
        assert reads and all(loads_of(r.indices[0], index_buffer) for r in reads)
        other = per_row if index_buffer is tiles else tiles
        assert not any(loads_of(r.indices[0], other) for r in reads)
