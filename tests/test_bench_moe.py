"""scripts/bench_moe.py at toy sizes (issue #38's MoE layer figures), timing stubbed: both
exports fuse both projections, every engine's output is compared with torch eager, the ratios
and decode's share of the stream bandwidth are computed from the timings, and the engines that
materialise ``W[ids]`` are skipped past ``--max-gather-gb``."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("bench_moe", ROOT / "scripts" / "bench_moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_selected_bytes():
    script = _script()
    # top 2 experts of H 16, I 12: gate-up (24, 16) and down (16, 12) float32 each
    assert script.selected_bytes(16, 12, 2) == 2 * (24 * 16 + 16 * 12) * 4
    assert script.selected_bytes(1024, 2816, 2) == 69_206_016


def test_toy_run(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    from tvm_fusion.build import engine

    script = _script()
    fake_ms = {}

    def once(runs, **_kwargs):  # each engine once; fixed "times" to check the arithmetic
        for run in runs.values():
            run()
        times = {name: 2.0 for name in runs}
        times["ours (torch.export)"] = 1.0
        fake_ms.update(times)
        return {name: {"median_ms": ms} for name, ms in times.items()}

    monkeypatch.setattr(engine, "time_interleaved", once)
    out = tmp_path / "moe.json"
    sizes = ["--hidden", "16", "--inner", "12", "--experts", "3", "--threads", "1"]
    # 1 token's copies are 4608 bytes: 3 tokens' fit under 2e-5 GB, 5 do not
    argv = [*sizes, "--tokens", "1,3,5", "--stream-mb", "4", "--max-gather-gb", "2e-5"]
    assert script.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for path in ("torch.export", "onnx"):
        assert result["rewrites"][path]["FuseGatheredGates"] == 2
    one, three, five = result["rows"]
    for row in (one, three):  # every engine against torch's batched_mm (several rows at 3)
        assert set(row["rel_err_vs_torch"]) == {
            "ours (torch.export)",
            "ours (onnx)",
            "onnxruntime",
            "torch (grouped)",
        }
    assert all(e <= 1e-4 for row in result["rows"] for e in row["rel_err_vs_torch"].values())
    assert one["ours (torch.export) / onnxruntime"] == 0.5
    assert one["ours (onnx) / torch (grouped)"] == 1.0
    # stream: 4 MiB in 2 ms; decode: 4608 bytes in 1 ms
    assert one["stream_GB/s"] == pytest.approx(4 * 2**20 / 2e-3 / 1e9)
    assert one["ours (torch.export) / stream"] == pytest.approx(4608 / 1e-3 / (4 * 2**20 / 2e-3))
    assert one["ours (decode, cycled) / stream"] == pytest.approx(4608 / 2e-3 / (4 * 2**20 / 2e-3))
    assert "onnxruntime" not in five["rel_err_vs_torch"] and "skipped" in five
    assert "ours (onnx) / onnxruntime" not in five and "stream_GB/s" not in three
