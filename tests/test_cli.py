"""tvm-fusion CLI: commands work; bad input is one line on stderr and exit code 2."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tvm_fusion.tools.cli import main


def _model(tmp_path, opset: int = 18):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])
    w = onnx.numpy_helper.from_array(np.eye(8, dtype="float32"), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])],
        "g",
        [x],
        [y],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    path = tmp_path / ("mlp.onnx" if opset == 18 else f"mlp_opset{opset}.onnx")
    onnx.save(model, str(path))
    return path


def _error_line(capsys):
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tvm-fusion: error: ")
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compile", "/no/such/model.onnx", "-o", "x.so"], "model file not found"),
        (["explain", "/no/such/model.onnx"], "model file not found"),
        (["explain", "not_a_workload"], "neither an ONNX file nor a workload"),
        (["bench", "--workloads", "resnet"], "unknown workload"),
        (["bench", "--engines", "tensorrt"], "unknown engine"),
        (["demo", "--workloads", "nope"], "unknown workload"),
        (["explain", "gate_2890", "--target", "vulkan9"], "unknown target"),
        (["explain", "gate_2890", "--target", "cuda:sm_xx"], "unknown CUDA architecture"),
        (["explain", "gate_2890", "--target", '{"kind": "nonsense"}'], "unknown target"),
        (["explain", "gate_2890", "--disable", "fuse_everything"], "unknown pass"),
        (["compile", "gate_2890", "-o", "x.so", "--tuning-db", "/no/db"], "tuning database"),
        (["tune", "gate_2890", "--work-dir", "/tmp/w", "--rpc-tracker", "nohost"], "HOST:PORT"),
        (["tune", "gate_2890", "--work-dir", "/tmp/w", "--rpc-tracker", "h:1"], "--rpc-key"),
        (["tune", "gate_2890", "--work-dir", "/tmp/w", "--trials", "0"], "--trials: expects"),
        (["tune", "nope", "--work-dir", "/tmp/w"], "neither an ONNX file nor a workload"),
        (["bench", "--models", "/no/such/dir"], "directory of .onnx files"),
        (["bench", "--models", "tests/corpus", "--workloads", "resnet"], "no model resnet"),
        (["bench", "--models", "tests/corpus", "--engines", "torch"], "unknown engine"),
        (["bench", "--models", "tests/corpus", "--dim", "seq=0"], "--dim expects NAME=N"),
        (["bench", "--dim", "seq=8"], "--dim needs --models"),
    ],
)
def test_bad_input_one_line_exit_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in _error_line(capsys)


def _tuning_databases(tmp_path) -> None:
    """Tuning work dirs under ``tmp_path`` that are not readable databases: ``db_garbage``
    (bytes), ``db_json`` (some JSON), ``db_swapped`` (each file holds the other's lines),
    ``db_cut`` (its record cut in half, as an interrupted write leaves it), ``db_base64`` (a
    workload whose IRModule is not base64)."""
    import tvm
    from tvm import te
    from tvm.s_tir import meta_schedule as ms

    real = tmp_path / "db_real"
    real.mkdir()
    a = te.placeholder((8,), name="a")
    b = te.compute((8,), lambda i: a[i] + 1.0, name="b")
    mod = tvm.IRModule({"main": te.create_prim_func([a, b])})
    database = ms.database.JSONDatabase(work_dir=str(real))
    database.commit_tuning_record(
        ms.database.TuningRecord(
            tvm.s_tir.Schedule(mod).trace,
            database.commit_workload(mod),
            [tvm.tirx.FloatImm("float64", 1e-6)],
            tvm.target.Target({"kind": "llvm"}),
            ms.arg_info.ArgInfo.from_prim_func(mod["main"]),
        )
    )
    workload = (real / "database_workload.json").read_text()
    record = (real / "database_tuning_record.json").read_text()
    files = {
        "db_garbage": (b"\x00\xff\x13 not json {{{", b""),
        "db_json": (b'{"hello": [1, 2, 3]}\n', b""),
        "db_swapped": (record.encode(), workload.encode()),
        "db_cut": (workload.encode(), record[: len(record) // 2].encode()),
        "db_base64": (b'["123", "!!not base64!!"]\n', b""),
    }
    for name, (workloads, records) in files.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "database_workload.json").write_bytes(workloads)
        (tmp_path / name / "database_tuning_record.json").write_bytes(records)


COMPILE = ["compile", "{tmp}/mlp.onnx", "-o", "{tmp}/out.so"]
TUNE = ["tune", "gate_2890", "--work-dir", "{tmp}/work", "--trials", "1"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["explain", "{tmp}/mlp.onnx", "--shape", "x=0,8"], "--shape: dims must be between 1"),
        (["explain", "{tmp}/mlp.onnx", "--shape", f"x={2**40},8"], "between 1 and 2**31-1"),
        (["compile", "gate_2890", "-o", "{tmp}/o.so", "--target", "cuda:sm_1"], "'sm_1'"),
        (["explain", "gate_2890", "--target", '{"kind": "rocm"}'], "'rocm' is not supported"),
        (["compile", "{tmp}/mlp.onnx", "-o", "{tmp}/file/o.so"], "{tmp}/file is not a directory"),
        (["compile", "{tmp}/mlp.onnx", "-o", "{tmp}/dir"], "-o {tmp}/dir is a directory"),
        (["compile", "{tmp}/mlp.onnx", "-o", "/sys/tvm-fusion.so"], "cannot write -o in /sys"),
        ([*COMPILE, "--dump-dir", "{tmp}/file/dump"], "cannot create --dump-dir"),
        (["explain", "gate_2890", "--dot", "{tmp}/file/g.dot"], "{tmp}/file is not a directory"),
        (["bench", "--workloads", "take_arange", "--output", "{tmp}/file/r.json"], "not a dir"),
        ([*COMPILE, "--tuning-db", "{tmp}/db_garbage"], "database_workload.json, line 1: not JSON"),
        ([*COMPILE, "--tuning-db", "{tmp}/db_json"], "line 1: not a MetaSchedule workload"),
        ([*COMPILE, "--tuning-db", "{tmp}/db_swapped"], "line 1: not a MetaSchedule workload"),
        ([*COMPILE, "--tuning-db", "{tmp}/db_cut"], "record.json, line 1: not JSON"),
        ([*COMPILE, "--tuning-db", "{tmp}/db_base64"], "cannot read the tuning database"),
        (["tune", "gate_2890", "--work-dir", "{tmp}/db_cut"], "record.json, line 1: not JSON"),
        (["tune", "gate_2890", "--work-dir", "{tmp}/file"], "work dir {tmp}/file is not a dir"),
        ([*TUNE, "--trials-per-iter", "0"], "--trials-per-iter: expects an integer >= 1"),
        ([*TUNE, "--verify", "-1"], "--verify: expects an integer >= 0, got '-1'"),
        (
            [*TUNE, "--rpc-tracker", "127.0.0.1:1", "--rpc-key", "k"],
            "cannot reach RPC tracker 127.0.0.1:1",
        ),
        (["bench", "--workloads", "take_arange", "--repeat", "0", "--output", ""], "--repeat: ex"),
        (["demo", "--workloads", "take_arange", "--repeat", "0"], "--repeat: expects"),
        # issue #40: an empty --engines ran and printed an empty table, exit 0
        (["bench", "--engines", "", "--output", "{tmp}/r.json"], "--engines names no engine"),
        (["bench", "--engines", " , ", "--output", ""], "--engines names no engine"),
        (["bench", "--models", "{tmp}", "--engines", ""], "--engines names no engine"),
        (["bench", "--output", "file/r.json"], "file is not a directory"),  # relative
    ],
)
def test_issue_27_bad_input_one_line_exit_2(argv, message, tmp_path, capsys, monkeypatch):
    """Issue #27: each of these printed a traceback and exited with 1 (or ran on: a 0 dim,
    --verify -1, --repeat 0; or hung: the RPC tracker). Nothing is compiled or tuned."""
    monkeypatch.chdir(tmp_path)  # for the relative paths
    if "/sys/" in " ".join(argv) and not os.path.isdir("/sys"):
        pytest.skip("needs Linux's /sys")
    _model(tmp_path)
    (tmp_path / "file").write_text("a file, not a directory")
    (tmp_path / "dir").mkdir()
    if any("{tmp}/db_" in arg for arg in argv):
        _tuning_databases(tmp_path)
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    before = sorted(tmp_path.rglob("*"))
    assert main(argv) == 2
    assert message.replace("{tmp}", str(tmp_path)) in _error_line(capsys)
    assert sorted(tmp_path.rglob("*")) == before  # no output, no temporary file left


def test_opset_1_model_imports(tmp_path, capsys):
    """Issue #27: an opset-1 model failed in our shape inference (ONNX Runtime's returns None
    below opset 7) with a traceback; TVM's importer takes it, so it compiles and runs."""
    import tvm
    from tvm import relax

    path = _model(tmp_path, opset=1)
    out = tmp_path / "mlp1.so"
    assert main(["compile", str(path), "-o", str(out)]) == 0
    assert capsys.readouterr().err == ""
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(out)), tvm.cpu())
    x = np.random.default_rng(0).standard_normal((3, 8)).astype("float32")
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), np.maximum(x, 0))


def _fake_compile(monkeypatch, export):
    """``compile`` without compiling: the executable's export_library is ``export``."""
    from tvm_fusion import analysis
    from tvm_fusion.build import engine

    compiled = SimpleNamespace(
        executable=SimpleNamespace(export_library=export),
        target=SimpleNamespace(kind=SimpleNamespace(name="llvm")),
        lowered=None,
        compile_s=0.0,
    )
    monkeypatch.setattr(engine, "compile_module", lambda *args, **kwargs: compiled)
    monkeypatch.setattr(analysis, "kernel_count", lambda mod: 0)


@pytest.mark.parametrize("failure", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_compile_output_is_atomic(failure, tmp_path, monkeypatch, capsys):
    """-o X: a failed or interrupted export leaves X as it was and no partial file behind; a
    successful one replaces X."""
    path = _model(tmp_path)
    out = tmp_path / "o.so"
    out.write_bytes(b"old library")

    def export_then_fail(name):
        with open(name, "wb") as f:
            f.write(b"half a libr")
        raise failure

    _fake_compile(monkeypatch, export_then_fail)
    if isinstance(failure, KeyboardInterrupt):
        assert main(["compile", str(path), "-o", str(out)]) == 130
        assert capsys.readouterr().err == "tvm-fusion: interrupted\n"
    else:
        with pytest.raises(RuntimeError, match="disk full"):
            main(["compile", str(path), "-o", str(out)])
    assert out.read_bytes() == b"old library"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.onnx", "o.so"]

    _fake_compile(monkeypatch, lambda name: Path(name).write_bytes(b"new library"))
    assert main(["compile", str(path), "-o", str(out)]) == 0
    assert out.read_bytes() == b"new library"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.onnx", "o.so"]


@pytest.mark.parametrize("where", ["cmd_explain", "build_parser", "_setup_logging"])
def test_keyboard_interrupt_one_line_exit_130(where, monkeypatch, capsys):
    """Ctrl-C while parsing, setting up or running a command: one line, status 130."""
    from tvm_fusion.tools import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, where, interrupted)
    assert main(["explain", "gate_2890"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "tvm-fusion: interrupted\n" and captured.out == ""


def _sigint_then(after):
    """A command that gets a real SIGINT, then does ``after`` with the KeyboardInterrupt, as TVM
    does when the interrupt lands in Python code that C++ called."""
    import signal
    import time

    def command(args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            return after()
        raise AssertionError("SIGINT did not interrupt")

    return command


def _as_tvm_returns_it():
    raise RuntimeError("KeyboardInterrupt")  # tvm_ffi's error for one raised below C++


@pytest.mark.parametrize(
    "after",
    [_as_tvm_returns_it, lambda: 0],  # 0: swallowed by a callee ("rule not applicable")
    ids=["converted", "swallowed"],
)
def test_ctrl_c_that_tvm_turns_into_an_error(after, monkeypatch, capsys):
    """Ctrl-C in a pass or schedule rule comes back from TVM as a RuntimeError, or not at all:
    still one line, status 130."""
    import signal

    from tvm_fusion.tools import cli

    # Python's own handler: an earlier test or library in this process may have replaced it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        monkeypatch.setattr(cli, "cmd_explain", _sigint_then(after))
        assert main(["explain", "gate_2890"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert capsys.readouterr().err == "tvm-fusion: interrupted\n"


def test_corrupt_model(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00\x01\x02 definitely not onnx" * 20)
    assert main(["compile", str(bad), "-o", str(tmp_path / "o.so")]) == 2
    assert "bad.onnx" in _error_line(capsys)


def test_bad_shape_option(tmp_path, capsys):
    path = _model(tmp_path)
    assert main(["explain", str(path), "--shape", "x=1,9"]) == 2
    assert "dim 1 is 8" in _error_line(capsys)
    assert main(["explain", str(path), "--shape", "x"]) == 2
    assert "NAME=D1,D2" in _error_line(capsys)


def test_output_dir_missing(tmp_path, capsys):
    path = _model(tmp_path)
    assert main(["compile", str(path), "-o", str(tmp_path / "nope" / "o.so")]) == 2
    assert "output directory" in _error_line(capsys)


def test_process_level_no_traceback(tmp_path):
    """As a user runs it: a separate process, exit code 2, one line, no traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tvm_fusion.tools.cli",
            "compile",
            str(tmp_path / "missing.onnx"),
            "-o",
            "x.so",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"tvm-fusion: error: model file not found: {tmp_path / 'missing.onnx'}"
    ]


def test_compile_onnx_to_so_and_run(tmp_path, capsys):
    import tvm
    from tvm import relax

    path = _model(tmp_path)
    out = tmp_path / "mlp.so"
    assert main(["compile", str(path), "-o", str(out)]) == 0
    assert out.exists() and "wrote" in capsys.readouterr().out
    ex = tvm.runtime.load_module(str(out))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    x = np.random.default_rng(0).standard_normal((3, 8)).astype("float32")
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), np.maximum(x, 0))


def test_explain_workload_and_dot(tmp_path, capsys):
    dot = tmp_path / "g.dot"
    assert main(["explain", "lstm_cell", "--dot", str(dot)]) == 0
    out = capsys.readouterr().out
    assert "fusion report: lstm_cell" in out and "kernels: stock" in out
    text = dot.read_text()
    assert text.startswith('digraph "lstm_cell"') and "->" in text


def test_explain_json(capsys):
    assert main(["explain", "take_arange", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["kernels"]) == {"stock", "tvm_fusion"}
    assert report["schedule_rules"] and None not in report["schedule_rules"].values()


def test_demo_small(capsys):
    assert (
        main(
            [
                "demo",
                "--size",
                "small",
                "--workloads",
                "gate_2890,mha_transpose",
                "--repeat",
                "3",
                "--budget",
                "0.1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| gate_2890 |" in out and "agree" in out and "DIFFER" not in out


def test_bench_small_writes_results(tmp_path, capsys):
    out_file = tmp_path / "r.json"
    argv = [
        "bench",
        "--size",
        "small",
        "--workloads",
        "take_arange",
        "--engines",
        "tvm-stock,tvm-fusion,onnxruntime",
        "--repeat",
        "3",
        "--budget",
        "0.1",
        "--output",
        str(out_file),
    ]
    assert main(argv) == 0
    data = json.loads(out_file.read_text())
    row = data["results"][0]
    assert row["workload"] == "take_arange"
    assert set(row["engines"]) == {"tvm-stock", "tvm-fusion", "onnxruntime"}
    assert all(e["ok"] for e in row["engines"].values())
    assert row["ratios"]["tvm-fusion/tvm-stock"] > 0
    assert out_file.with_suffix(".md").read_text().count("| take_arange |") == 1  # one row


def test_bench_models_against_onnxruntime(tmp_path, capsys):
    """Two corpus models at other sizes than the saved inputs: every engine runs, matches ORT;
    stock TVM's own importer is used for tvm-stock even after load_onnx installed ours."""
    out_file = tmp_path / "m.json"
    argv = ["bench", "--models", "tests/corpus", "--workloads", "gru_cell_dynamo,bert_mlm_dynamo"]
    argv += ["--dim", "batch=2", "--dim", "seq=5", "--repeat", "3", "--budget", "0.1"]
    assert main([*argv, "--output", str(out_file)]) == 0
    data = json.loads(out_file.read_text())
    rows = {row["model"]: row for row in data["results"]}
    gru, bert = rows["gru_cell_dynamo"], rows["bert_mlm_dynamo"]
    assert gru["shapes"] == {"x": [2, 32], "h": [2, 48]}
    assert bert["shapes"]["input_ids"] == [2, 5]
    for row in (gru, bert):
        ours = row["engines"]["tvm-fusion"]
        assert ours["ok"] and ours["median_ms"] > 0, row
        assert row["engines"]["stock-pipeline"]["ok"], row
    assert gru["engines"]["tvm-stock"]["ok"]
    assert gru["kernels"] == {"stock": 3, "tvm_fusion": 1}
    assert gru["rewrites"] == {"FuseSplitGates": 1}
    assert bert["rewrites"]["FuseCrossEntropy"] == 1
    # stock's importer has no SoftmaxCrossEntropyLoss: the row says so instead of failing
    assert "SoftmaxCrossEntropyLoss" in bert["engines"]["tvm-stock"]["skipped"]
    table = out_file.with_suffix(".md").read_text()
    assert "| bert_mlm_dynamo |" in table and "Failed:" in table


def test_bench_models_random_inputs(tmp_path):
    """A folder with no saved inputs: random inputs from the graph's types, dims from --dim."""
    from tvm_fusion.tools import model_bench

    _model(tmp_path)
    with pytest.raises(Exception, match="--dim n=N"):
        model_bench.load_cases(tmp_path)
    (case,) = model_bench.load_cases(tmp_path, {"n": 4})
    assert case.inputs["x"].shape == (4, 8) and case.inputs["x"].dtype == np.float32
    (res,) = model_bench.run_models(tmp_path, dims={"n": 4}, repeat=3, budget_s=0.1)
    assert all(r.ok for name, r in res.engines.items() if name != "onnxruntime"), res


def test_explain_with_a_tuning_database(tmp_path, capsys):
    """``explain --tuning-db DIR`` reported the option as an unknown pipeline flag."""
    db = tmp_path / "db"
    db.mkdir()
    assert main(["explain", str(_model(tmp_path)), "--tuning-db", str(db)]) == 0
    assert "fusion report" in capsys.readouterr().out
