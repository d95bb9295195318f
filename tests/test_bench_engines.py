"""Benchmark engines and build options: Inductor as an engine (issue #41), ``--mcpu`` and the
thread-pool defaults (issue #37). No timing is asserted."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tvm_fusion import models
from tvm_fusion.build import engine
from tvm_fusion.errors import UsageError
from tvm_fusion.target import check_runs_here, host_target, parse_target, with_mcpu
from tvm_fusion.tools import bench
from tvm_fusion.tools.cli import main

ROOT = Path(__file__).resolve().parent.parent
X86 = platform.machine() in ("x86_64", "AMD64")


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------------------------------------
# Inductor


def test_parse_engines_knows_inductor():
    assert bench.parse_engines("tvm-fusion,onnxruntime,inductor,torch") == [
        "tvm-fusion",
        "onnxruntime",
        "inductor",
        "torch",
    ]
    assert "inductor" in bench.parse_engines(None)
    with pytest.raises(UsageError, match="unknown engine.*tensorrt.*known: .*inductor"):
        bench.parse_engines("inductor,tensorrt")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--engines", "inductor,xla"], "unknown engine(s) xla; known: "),
        (["bench", "--models", "tests/corpus", "--engines", "inductor"], "need a torch module"),
    ],
)
def test_bad_engines_one_line_exit_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in _error_line(capsys)


def test_inductor_dynamic_follows_the_workload(monkeypatch):
    """torch.compile gets dynamic=False for static shapes, dynamic=True for symbolic ones."""
    torch = pytest.importorskip("torch")
    seen = []

    def fake_compile(fn, dynamic=None):
        seen.append(dynamic)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    target = host_target()
    for dynamic in (False, True):
        inst = models.build("swiglu", "small", dynamic=dynamic)
        result, run = bench.prepare_engine("inductor", inst, target)
        assert result.ok and run is not None and result.compile_s is not None
    assert seen == [False, True]


def test_inductor_refused_in_one_line_without_a_torch_module():
    pytest.importorskip("torch")
    inst = models.build("take_arange", "small")
    inst.torch_fn = None  # an ONNX-only workload
    result, run = bench.prepare_engine("inductor", inst, host_target())
    assert run is None and result.skipped == "no torch function for this workload (ONNX only)"


def test_bench_cli_with_inductor(tmp_path, capsys):
    """The CLI's bench runs Inductor on a tiny torch workload: outputs checked against NumPy,
    compile time apart from the run time. Where Inductor cannot compile, one line says so."""
    pytest.importorskip("torch")
    out_file = tmp_path / "r.json"
    argv = ["bench", "--size", "small", "--workloads", "swiglu", "--engines", "inductor,torch"]
    argv += ["--repeat", "3", "--budget", "0.1", "--min-time", "0", "--output", str(out_file)]
    assert main(argv) == 0
    ind = json.loads(out_file.read_text())["results"][0]["engines"]["inductor"]
    table = out_file.with_suffix(".md").read_text()
    if ind["skipped"]:  # this machine's Inductor cannot compile: one line, no crash
        assert ind["skipped"].startswith("torch.compile failed: ") and "\n" not in ind["skipped"]
        assert f"swiglu, inductor: {ind['skipped']}" in table
    else:
        assert ind["ok"] and ind["median_ms"] > 0 and ind["compile_s"] > 0
        assert "Compile s (not in the run times):" in table and "inductor" in table


# ---------------------------------------------------------------------------------------------
# --mcpu


@pytest.mark.skipif(not X86, reason="x86-64 CPU names")
def test_bench_mcpu_reaches_the_built_target(tmp_path, monkeypatch):
    """``--mcpu x86-64-v2`` (SSE4.2; runs on every x86-64 host of the suite) is the mcpu of the
    target that the bench compiles for, not the host's."""
    built = []
    compile_module = engine.compile_module

    def spy(mod, target, *args, **kwargs):
        built.append(target)
        return compile_module(mod, target, *args, **kwargs)

    monkeypatch.setattr(engine, "compile_module", spy)
    out_file = tmp_path / "r.json"
    argv = ["bench", "--size", "small", "--workloads", "take_arange", "--engines", "tvm-fusion"]
    argv += ["--repeat", "3", "--budget", "0.1", "--min-time", "0", "--mcpu", "x86-64-v2"]
    assert main([*argv, "--output", str(out_file)]) == 0
    assert [str(t.attrs["mcpu"]) for t in built] == ["x86-64-v2"]
    assert json.loads(out_file.read_text())["results"][0]["engines"]["tvm-fusion"]["ok"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--mcpu", "pentium99"], "unknown --mcpu 'pentium99': LLVM knows no such CPU"),
        (["bench", "--mcpu", "znver3", "--target", "cuda"], "--mcpu applies to llvm targets"),
    ],
)
def test_bench_bad_mcpu_one_line_exit_2(argv, message, capsys):
    assert main([*argv, "--output", ""]) == 2
    assert message in _error_line(capsys)


def test_mcpu_checks():
    target = with_mcpu(parse_target('{"kind": "llvm", "mtriple": "aarch64-linux-gnu"}'), "apple-m1")
    assert str(target.attrs["mcpu"]) == "apple-m1"
    with pytest.raises(UsageError, match="LLVM knows no such CPU for aarch64-linux-gnu"):
        with_mcpu(target, "znver3")  # an x86 CPU for an AArch64 triple
    if X86:
        with pytest.raises(UsageError, match="cannot run on this machine"):
            check_runs_here(target)
    assert with_mcpu(target, None) is target


def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not X86, reason="x86-64 CPU names")
def test_bench_sweep_mcpu(monkeypatch, capsys):
    from tvm_fusion.tools import sweep

    seen = []

    def stop(case, target, **kwargs):
        seen.append(target)
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "run_case", stop)
    script = _script("bench_sweep")
    with pytest.raises(KeyboardInterrupt):
        script.main(["--mcpu", "x86-64-v2", "--family", "gemm", "--output", ""])
    assert str(seen[0].attrs["mcpu"]) == "x86-64-v2"
    assert script.main(["--mcpu", "pentium99"]) == 2
    assert "unknown --mcpu 'pentium99'" in _error_line(capsys)


def test_bench_roofline_bad_mcpu(capsys):
    pytest.importorskip("torch")
    assert _script("bench_roofline").main(["--mcpu", "pentium99", "--output", ""]) == 2
    assert "unknown --mcpu 'pentium99'" in _error_line(capsys)


def test_bench_roofline_gemms(tmp_path, capsys):
    """``--gemms``: the FMA peak and each GEMM, ours and ONNX Runtime, each with its fraction
    of the peak (no timing asserted); a shape that is not MxKxN refused in one line."""
    pytest.importorskip("torch")
    out = tmp_path / "g.json"
    script = _script("bench_roofline")
    args = ["--gemms", "16x32x24", "--repeat", "1", "--budget", "0.05", "--output", str(out)]
    assert script.main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted(r["engine"] for r in rows) == ["FMA peak", "onnxruntime", "ours"]
    assert all(r["peak_fraction"] > 0 for r in rows)
    assert rows[0]["ours_max_err"] < 1e-4
    assert script.main(["--gemms", "16x32", "--output", ""]) == 2
    assert "not MxKxN" in _error_line(capsys)


@pytest.mark.parametrize(
    "mcpu,accumulators,lanes", [("haswell", 12, 8), ("skylake-avx512", 16, 16)]
)
def test_fma_peak_fits_the_targets_registers(mcpu, accumulators, lanes):
    """The peak kernel's accumulators leave the operands room in the target's registers: 16 on
    AVX2's 16 ymm spilled every iteration (89.6 GFLOP/s measured on Zen 3, under a GEMM's 142).
    Compile-only (the flops count says how many accumulators the loop has)."""
    import tvm

    script = _script("bench_roofline")
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    _run, flops = script._fma_peak(2, target)
    assert flops == 2.0 * 2 * script.PEAK_ITERS * accumulators * lanes


# ---------------------------------------------------------------------------------------------
# thread pool


def test_pool_respects_the_users_settings(monkeypatch):
    """``import tvm_fusion`` leaves a user's TVM_NUM_THREADS and TVM_BIND_THREADS as they are;
    unset, they get the core count and 0 (workers not pinned)."""
    code = (
        "import os, tvm_fusion; "
        "print(os.environ.get('TVM_NUM_THREADS'), os.environ.get('TVM_BIND_THREADS'))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TVM_NUM_THREADS": "1", "TVM_BIND_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["1", "1"], out.stderr[-2000:]
    from tvm_fusion import pool

    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    monkeypatch.delenv("TVM_BIND_THREADS", raising=False)
    pool.configure()
    assert os.environ["TVM_NUM_THREADS"] == str(len(os.sched_getaffinity(0)))
    assert os.environ["TVM_BIND_THREADS"] == "0"


def test_other_engines_get_the_pools_threads(monkeypatch):
    target = parse_target('{"kind": "llvm", "num-cores": 4}')
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    assert engine.threads_for(target) == 1
    monkeypatch.setenv("TVM_NUM_THREADS", "64")
    assert engine.threads_for(target) == 4


def test_bench_neighbours_smoke(tmp_path):
    """scripts/bench_neighbours.py end to end on its GEMM, one process per condition, a few
    calls in blocks (no timing asserted), and a bad condition refused in one line (exit 2)."""
    script = ROOT / "scripts" / "bench_neighbours.py"
    out = tmp_path / "n.json"
    args = ["--workloads", "gemm", "--processes", "1", "--calls", "3", "--warmup", "1"]
    args += ["--block", "2", "--pause", "0", "--output", str(out)]
    run = subprocess.run(
        [sys.executable, str(script), *args, "--conditions", "alone,ort"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["workloads"]["gemm"]
    for condition in ("alone", "ort"):
        for engine_name in ("ours", "ort"):
            assert rows[condition][engine_name]["median_ms"] > 0
    assert "| gemm | ort |" in out.with_suffix(".md").read_text()
    bad = subprocess.run(
        [sys.executable, str(script), *args, "--conditions", "nearby"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1 and "nearby" in bad.stderr, bad.stderr


def _tiny_cnn(path: Path) -> Path:
    """A 1x1 and a 3x3 convolution with ReLU on an 8 x 8 image: a model for script smoke tests."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal(s).astype("float32"), name)
        for name, s in (("w1", (16, 4, 1, 1)), ("w3", (8, 16, 3, 3)))
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"]),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Conv", ["b", "w3"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_profile_kernels_smoke(tmp_path, capsys):
    """scripts/profile_kernels.py on a tiny CNN: every kernel timed inside the model (the VM's
    instrument hook), ONNX Runtime's nodes beside; an unknown model or a corrupt file refused
    in one line (exit 2). No timing asserted."""
    script = _script("profile_kernels")
    model = _tiny_cnn(tmp_path / "tiny.onnx")
    assert script.main([str(model), "--runs", "2", "--kernels", "--ort-nodes"]) == 0
    out = capsys.readouterr().out
    assert "ours: model" in out and "ONNX Runtime: model" in out, out
    kernels = [line for line in out.splitlines() if "conv2d" in line]
    assert len(kernels) >= 2, out  # the two convolutions, in call order and as a family
    assert "Conv " in out  # ORT's nodes by name
    assert script.main(["no_such_model"]) == 2
    assert "no_such_model" in _error_line(capsys)
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    assert script.main([str(tmp_path / "bad.onnx")]) == 2
    assert "bad.onnx" in _error_line(capsys)


def test_bench_onnx_attention_smoke(capsys):
    """scripts/bench_onnx_attention.py on a tiny GQA shape: the three engines agree and a row
    is printed; a bad shape is refused by argparse."""
    bench = _script("bench_onnx_attention")
    assert bench.main(["--shapes", "1,4,2,16,8", "--reps", "1"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.startswith("| 1,4,2,16,8 |"), row
    assert float(row.split("|")[-2]) < 1e-4
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "1,3,2,16,8"])
