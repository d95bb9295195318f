"""The differential fuzzer (tvm_fusion.testing.fuzz): a fixed-seed slice of every family runs with
no failure, and the checker does catch what it must (wrong numbers from a broken pass, a
wrong shape, a crashing or hanging worker, a refusal of what stock TVM runs)."""

import textwrap

import numpy as np
import onnx
import pytest

from tvm_fusion.errors import ModelError
from tvm_fusion.testing import fuzz
from tvm_fusion.transform.fuse_split_gates import emit as fuse_split_gates


def test_fixed_seed_slice_has_no_failure(tmp_path):
    """A minute of the fuzzer in CI: 7 graphs of each family, each run by ORT and by us on two
    feeds of different dynamic sizes, in one worker subprocess."""
    totals = fuzz.fuzz(fuzz.FAMILIES, seed=0, cases=7, out_dir=tmp_path, minimise_s=20)
    assert not totals.failures, totals.failures
    assert set(totals.counts) == set(fuzz.FAMILIES)
    ran = sum(row["ok"] + row["refused"] for row in totals.counts.values())
    assert ran == 7 * len(fuzz.FAMILIES)
    assert sum(row["ok"] for row in totals.counts.values()) >= 0.8 * ran


@pytest.mark.parametrize("seed", [20012, 20023])
def test_shape_chains_with_an_import_retry_run(seed):
    """Range, halves of an axis (``Div(Shape(x)[1], 2)`` as Slice bounds) and a Sub of the
    halves: the importer refuses a shape value, load_onnx casts it and imports again. The
    retry kept the first attempt's dims, so the second import's match_casts named another
    ``s`` (refused in PlaceShapeOnHost, "TIR variables (s,) were undefined", or VMShapeLower,
    "s // 2 is not computed"); and the halves' shapes, ``T.Div(s, 2)`` and ``s // 2``, were
    not proven equal (no shape for the Sub: code generation failed)."""
    from tvm import relax

    from tvm_fusion.frontend import load_onnx

    case = fuzz.generate("shape_chains", seed)
    mod = load_onnx(case.model)
    assert not relax.analysis.free_symbolic_vars(mod["main"])
    assert fuzz.run_case(case.model, case.feeds) == ("ok", "")


def test_generator_builds_valid_graphs_with_two_different_feeds():
    for family in fuzz.FAMILIES:
        for seed in range(5):
            case = fuzz.generate(family, seed)
            onnx.checker.check_model(case.model, full_check=True)
            first, second = case.feeds
            assert first.keys() == second.keys() == {i.name for i in case.model.graph.input}
            for feed in case.feeds:
                fuzz.ort_outputs(case.model, feed)
    # dynamic dims are fed at two sizes
    case = fuzz.generate("range_gather", 3)
    shapes = [tuple(f["x"].shape) for f in case.feeds]
    assert shapes[0] != shapes[1]
    assert fuzz.generate("views", 11).model == fuzz.generate("views", 11).model


def test_wrong_numbers_of_a_broken_pass_are_a_failure(monkeypatch):
    """FuseSplitGates made to drop the GEMM bias: the checker reports wrong numbers."""
    case = fuzz.generate("gates", 2)  # MatMul + bias (N,) -> split -> gates: fused
    assert fuzz.run_case(case.model, case.feeds) == ("ok", "")
    monkeypatch.setattr(fuse_split_gates, "_bias_stage", lambda y, *_a, **_k: y)
    outcome, reason = fuzz.run_case(case.model, case.feeds)
    assert outcome == "failure" and "wrong result" in reason and "max abs error" in reason


def test_checker_catches_wrong_values_shapes_and_dtypes():
    case = fuzz.generate("cross_entropy", 1)
    refs = [fuzz.ort_outputs(case.model, f) for f in case.feeds]
    assert fuzz.run_case(case.model, case.feeds, lambda m, f: refs) == ("ok", "")
    bumped = [[r + np.float32(1e-2) * max(1, np.abs(r).max()) for r in rs] for rs in refs]
    assert fuzz.run_case(case.model, case.feeds, lambda m, f: bumped)[0] == "failure"
    shaped = [[r[None] for r in rs] for rs in refs]
    assert "shape" in fuzz.run_case(case.model, case.feeds, lambda m, f: shaped)[1]
    ints = [np.arange(4), np.arange(4)]
    assert fuzz.compare([ints[0] + 1], [ints[1]]).startswith("output 0: 4 of 4 integers")
    assert "dtype" in fuzz.compare([ints[0].astype("int32")], [ints[1]])


def test_refusal_counts_only_where_stock_fails_too():
    case = fuzz.generate("gemms", 0)

    def refuse(_m, _f):
        raise ModelError("cannot do it")

    outcome, reason = fuzz.run_case(case.model, case.feeds, refuse)
    assert outcome == "failure" and reason.startswith("refused, but stock TVM runs it")


_PROBE = """
import os, time
from tvm_fusion.testing import fuzz

def run(model, feeds):
    op = model.graph.node[0].op_type
    if op == "Relu":
        os.abort()
    if op == "Tanh":
        time.sleep(60)
    return fuzz.run_case(model, feeds, lambda m, f: [fuzz.ort_outputs(m, x) for x in f])
"""


def _one_op(op):
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node(op, ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    feeds = [{"x": np.ones(3, "float32")}, {"x": np.ones(5, "float32")}]
    return model, feeds


def test_worker_crash_and_hang_cost_one_case(tmp_path):
    (tmp_path / "fuzz_probe.py").write_text(textwrap.dedent(_PROBE))
    worker = fuzz.Worker(timeout_s=5, runner="fuzz_probe:run", env={"PYTHONPATH": str(tmp_path)})
    try:
        outcome, reason = worker.run(*_one_op("Relu"))
        assert outcome == "crash" and "died" in reason
        assert worker.run(*_one_op("Sigmoid")) == ("ok", "")  # a new worker
        assert worker.run(*_one_op("Tanh")) == ("hang", "no result in 5 s")
    finally:
        worker.close()


def test_minimise_keeps_the_failure_drops_nodes_and_cuts_dims():
    """A failure that needs only the GEMM and 2+ rows: the activations and the epilogue go,
    the dynamic rows of both feeds come down to 2."""
    case = fuzz.generate("gates", 9)  # rows dynamic, fed at 31 and 3

    def run(model, feeds):  # fails while a MatMul is left and a feed has 2+ rows
        has = any(n.op_type == "MatMul" for n in model.graph.node)
        rows = max(f["x"].shape[0] for f in feeds)
        return ("failure", "matmul") if has and rows >= 2 else ("ok", "")

    assert min(f["x"].shape[0] for f in case.feeds) > 2
    small, feeds, reason = fuzz.minimise(case.model, case.feeds, "failure", run, budget_s=30)
    assert reason == "matmul"
    assert len(small.graph.node) < len(case.model.graph.node)
    assert any(n.op_type == "MatMul" for n in small.graph.node)
    assert feeds[0].keys() == {i.name for i in small.graph.input}
    assert sorted(f["x"].shape[0] for f in feeds) == [1, 2]


@pytest.mark.parametrize("family", ["nope"])
def test_unknown_family(family):
    with pytest.raises(ValueError, match="unknown family"):
        fuzz.generate(family, 0)


# ---------------------------------------------------------------------------------------------
# torch.export (tvm_fusion.testing.fuzz.torch_frontend)

# one seed per family, run in this process (a worker would import TVM again): each exports a
# module at size 10, imports and compiles it with our pipeline and compares two feeds with eager
_TORCH_SEEDS = [
    ("gates", 1),  # GRU cell, F.linear, gates by slices
    ("gemms", 3),  # nn.LSTMCell, dynamic rows
    ("range_gather", 0),  # x[arange(0, n - 2)], reshape, activation; not decomposed
    ("views", 1),  # reshape, matmul, transpose; not decomposed
    ("cross_entropy", 2),  # -log_softmax.gather(...).mean()
    ("shape_chains", 3),  # a (b, 2 * s) input viewed as (b, s, 2); cumsum positions
]


@pytest.mark.parametrize(("family", "seed"), _TORCH_SEEDS)
def test_torch_fixed_seeds_run(family, seed):
    pytest.importorskip("torch")
    from tvm_fusion.testing.fuzz import torch_frontend as fuzz_torch

    assert fuzz_torch.run_case(family, seed) == ("ok", "")


@pytest.mark.parametrize(
    "seed",
    [
        0,  # DeBERTa buckets, integer clamp / cumsum / power, // and %; not decomposed
        22,  # comparisons with float bounds, a bool mask made a bias (mask == 0)
    ],
)
def test_torch_dtypes_seeds_run(seed):
    """The ``dtypes`` family (torch only): integer, boolean and mixed-float arithmetic as
    models write it, which found the importer's ``x[:, -1]``, ``int < 2.5``, ``bool == 0``,
    ``h / h.shape[1]``, clamp, cumsum and integer power bugs (tests in ``test_frontend.py``)."""
    pytest.importorskip("torch")
    from tvm_fusion.testing.fuzz import torch_frontend as fuzz_torch

    assert "dtypes" in fuzz_torch.FAMILIES and "dtypes" not in fuzz.FAMILIES
    assert fuzz_torch.run_case("dtypes", seed) == ("ok", "")


def test_torch_negative_step_arange_gathers_the_right_columns():
    """``x[:, arange(n - 1, n - 3, -1)]`` (range_gather seed 3): 0.27's importer declared the
    arange 4 long (ceil-division as for a positive step) and computed 4 columns; it is
    imported as ``arange(1 - n, 3 - n, 1) * -1``. (GatherToSlice rightly leaves the take:
    for n = 1 the index n - 2 is negative, which torch wraps.)"""
    pytest.importorskip("torch")
    from tvm_fusion.frontend import import_exported_program
    from tvm_fusion.testing.fuzz import torch_frontend as fuzz_torch

    spec, program, _feeds, _refs = fuzz_torch.prepare("range_gather", 3)
    mod = import_exported_program(program, decompose=spec.decompose)
    (out,) = mod["main"].ret_ty.fields
    assert "* 2" in str(out.shape), out.shape  # (rows * 2,): two columns, reshaped
    assert fuzz_torch.run_case("range_gather", 3) == ("ok", "")
    assert fuzz_torch.run_case("range_gather", 100) == ("ok", "")  # arange(n - 2, -1, -2)


def test_torch_cross_entropy_loss_not_decomposed():
    """``cross_entropy_loss`` as exported (imported without decompositions): stock read
    ``reduction`` (passed positionally) as a mean, took log-softmax over the last axis of
    (B, C, S) and dropped label smoothing."""
    pytest.importorskip("torch")
    from tvm_fusion.testing.fuzz import torch_frontend as fuzz_torch

    assert fuzz_torch.run_case("cross_entropy", 0) == ("ok", "")  # (B, C, S), summed
    assert fuzz_torch.run_case("cross_entropy", 101) == ("ok", "")  # smoothing 0.25, none
    assert fuzz_torch.run_case("cross_entropy", 109) == ("ok", "")  # 0.1, weights, mean


def test_convnets_family_reaches_model_zoo_sizes():
    """The convnets family (ONNX only): valid CNNs, a share of them at the model zoo's sizes
    (64-512 channels: the Winograd and NHWC paths), dynamic batches among them."""
    assert "convnets" in fuzz.FAMILIES
    notes = [fuzz.generate("convnets", seed).note for seed in range(120)]
    assert any(n.startswith("zoo-sized") for n in notes)
    assert any("SAME_" in n for n in notes)
    assert any("inception" in n for n in notes) and any("residual" in n for n in notes)
    dynamic = [fuzz.generate("convnets", s) for s in range(40)]
    assert any(c.feeds[0]["x"].shape[0] != c.feeds[1]["x"].shape[0] for c in dynamic)


@pytest.mark.parametrize("seed", [2024])
def test_convnets_same_upper_after_a_conv(seed):
    """The case that found the Pad lost by reverse_compute_at (schedule/test_epilogue_pads.py):
    MaxPool, then Conv 1x3 stride 2 with auto_pad SAME_UPPER, a Conv, a head."""
    case = fuzz.generate("convnets", seed)
    assert "SAME_UPPER" in case.note
    assert fuzz.run_case(case.model, case.feeds) == ("ok", "")


def test_fuzz_target_follows_mcpu(monkeypatch):
    """scripts/fuzz.py --mcpu sets MCPU_ENV for its workers: the cases are built for that CPU;
    a CPU LLVM does not know is refused in one line."""
    from tvm_fusion.errors import TvmFusionError
    from tvm_fusion.target import host_target
    from tvm_fusion.testing.fuzz.common import MCPU_ENV, fuzz_target

    monkeypatch.delenv(MCPU_ENV, raising=False)
    assert fuzz_target().attrs["mcpu"] == host_target().attrs["mcpu"]
    monkeypatch.setenv(MCPU_ENV, "no-such-cpu")
    with pytest.raises(TvmFusionError, match="no-such-cpu"):
        fuzz_target()
