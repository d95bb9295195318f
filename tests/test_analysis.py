"""Kernel counting at every stage, fusion report, DOT output."""

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_fusion import analysis, models
from tvm_fusion.build import engine


@I.ir_module
class TwoOps:
    @R.function
    def main(x: R.Tensor((4, 8), "float32")):
        with R.dataflow():
            a = R.exp(x)
            b = R.reshape(a, (8, 4))
            c = R.sum(b, axis=[1])
            R.output(c)
        return c


def test_count_before_lowering():
    # exp and sum become kernels; the reshape is a view
    assert analysis.kernel_count(TwoOps) == 2
    assert analysis.view_count(TwoOps) == 1


def test_count_after_each_pipeline(target):
    for pipeline in ("stock", "tvm_fusion"):
        lowered = engine.compile_module(TwoOps, target, pipeline).lowered
        kernels = analysis.kernels(lowered)
        assert 1 <= len(kernels) <= 2
        assert all(not k.name.startswith("shape_func") for k in kernels)


def test_kernel_launch_shapes(target):
    """Each launch lists its tensor arguments' shapes: legalised call_tir (inputs; the output
    is the call's own) and, after VM lowering, the kernel call (inputs and output)."""
    legalised = tvm.relax.transform.LegalizeOps()(TwoOps)
    # exp, the reshape (a call_tir until RewriteDataflowReshape), sum
    assert [k.shapes for k in analysis.kernels(legalised)] == [["4x8"], ["4x8"], ["8x4"]]
    lowered = engine.compile_module(TwoOps, target, "stock").lowered
    shapes = [k.shapes for k in analysis.kernels(lowered)]
    assert shapes and shapes[0][0] == "4x8" and shapes[-1][-1] == "8", shapes


def test_host_shape_funcs_are_not_kernels(target):
    inst = models.build("dynamic_reshape", "small")
    lowered = engine.compile_module(inst.mod, target, "stock").lowered
    has_shape_func = any(gv.name_hint.startswith("shape_func") for gv in lowered.get_global_vars())
    assert has_shape_func
    names = [k.name for k in analysis.kernels(lowered)]
    assert names and not any(n.startswith("shape_func") for n in names)


def test_fusion_report_lists_groups(target):
    inst = models.build("lstm_cell", "small")
    report = analysis.fusion_report(inst.mod, target, name="lstm_cell")
    assert report.stock_kernels == len(report.stock) >= 2
    text = report.to_text()
    assert "stock groups" in text and "tvm_fusion groups" in text
    assert any("matmul" in k.label() for k in report.stock)
    data = report.to_dict()
    assert data["kernels"]["stock"] == report.stock_kernels
    # our kernels once scheduled, each with its rule: the LSTM cell is one gate kernel
    assert list(report.rules.values()) == ["GateFusion"], report.rules
    assert "scheduled by:" in text and ": GateFusion" in text
    assert data["schedule_rules"] == report.rules and not report.fallback


def test_fallback_kernels_are_named(target, monkeypatch):
    """A kernel that only the fallback rule took is listed (here: the rule list without the
    row rule, so a softmax has nowhere else to go)."""
    from tvm import relax

    from tvm_fusion import schedule
    from tvm_fusion.build import engine

    x = relax.Var("x", relax.TensorType((4, 40), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.softmax(x))
        bb.emit_func_output(out)
    ours = engine.compile_module(bb.get(), target, "tvm_fusion")
    assert analysis.fallback_kernels(ours.lowered) == []
    original = schedule.default_rules

    def without_row_rule(tgt):
        return [r for r in original(tgt) if type(r).__name__ != "RowReduction"]

    monkeypatch.setattr(schedule, "default_rules", without_row_rule)
    crippled = engine.compile_module(bb.get(), target, "tvm_fusion")
    assert analysis.fallback_kernels(crippled.lowered) == ["fast_softmax1"]


def test_dot(target):
    inst = models.build("gru_cell", "small")
    grouped = analysis.grouped(inst.mod, target, ours=True)
    dot = analysis.to_dot(grouped, "g")
    assert dot.startswith('digraph "g"') and dot.rstrip().endswith("}")
    assert dot.count("->") >= 2
    assert isinstance(grouped, tvm.IRModule)


def test_adaptive_pooling_takes_the_fallback_and_unscheduled_kernels_are_listed(
    target, monkeypatch
):
    """Non-global adaptive pooling: TVM's block analysis cannot read its position-dependent
    window, so every rule but the fallback's outer-loop path declines. It runs in parallel and
    right; with the fallback rule removed it is left unscheduled, carries no rule name, and is
    still listed with the fallback kernels, not hidden."""
    import numpy as np
    import torch
    from helpers import run
    from tvm import relax

    from tvm_fusion import schedule
    from tvm_fusion.build import engine

    x = relax.Var("x", relax.TensorType((2, 8, 13, 11), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.adaptive_avg_pool2d(x, (3, 5)))
        bb.emit_func_output(out)
    data = np.random.default_rng(0).standard_normal((2, 8, 13, 11)).astype("float32")
    got, ours = run(bb.get(), [data], "tvm_fusion")
    want = torch.nn.functional.adaptive_avg_pool2d(torch.from_numpy(data), (3, 5)).numpy()
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)
    (info,) = analysis.schedule_info(ours.lowered)
    assert info.rule == "Fallback" and info.parallel, info
    assert analysis.fallback_kernels(ours.lowered) == [info.name]

    original = schedule.default_rules
    monkeypatch.setattr(
        schedule,
        "default_rules",
        lambda tgt: [r for r in original(tgt) if type(r).__name__ != "Fallback"],
    )
    bare = engine.compile_module(bb.get(), target, "tvm_fusion")
    (info,) = analysis.schedule_info(bare.lowered)
    assert info.rule is None and not info.scheduled, info
    assert analysis.fallback_kernels(bare.lowered) == [info.name]
