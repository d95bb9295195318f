"""``scripts/bench_decoders_inductor.py`` (issue #41 item 4): its rows, table and JSON on a tiny
(input_ids, attention_mask) -> logits module, Inductor stood in for by eager (its compile
takes longer than this test may). No timing is asserted."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tvm_fusion.target import host_target

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location(
        "bench_decoders_inductor", ROOT / "scripts" / "bench_decoders_inductor.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TinyLM(torch.nn.Module):
    def __init__(self, branch: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)
        self.branch = branch

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids) * attention_mask.unsqueeze(-1).to(torch.float32)
        if self.branch and h.sum() > 0:  # data-dependent: torch.export refuses it
            h = h + 1
        return self.head(torch.tanh(h))


def _inputs():
    torch.manual_seed(1)
    ids = torch.randint(0, 16, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.int64)
    mask[-1, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _stand_in(wrong: bool):
    """engine.inductor_runner's contract (runner, first outputs, compile s), run eagerly;
    ``wrong``: its outputs off by 1 %."""

    def make(make_fn, inputs, threads, dynamic):
        assert (threads, dynamic) == (1, False)
        fn = make_fn(torch)
        args = [torch.from_numpy(a) for a in inputs]

        def run():
            with torch.inference_mode():
                return [o.numpy() * (1.01 if wrong else 1.0) for o in fn(*args)]

        return run, run(), 0.25

    return make


def test_rows_table_and_json(monkeypatch, tmp_path):
    """One row, Inductor's stand-in 1 % off: ours right, Inductor marked; the pauses between
    engines cut (the alternation itself is time_interleaved's, tested with it)."""
    from tvm_fusion.build import engine

    timed = engine.time_interleaved
    monkeypatch.setattr(engine, "time_interleaved", lambda *a, **k: timed(*a, **k, pause_s=0))
    script = _script()
    row = script.bench_shape(
        "tiny",
        TinyLM().eval(),
        _inputs(),
        target=host_target(),
        threads=1,
        repeat=3,
        budget=0.2,
        inductor=_stand_in(wrong=True),
    )
    assert (row["model"], row["batch"], row["seq"]) == ("tiny", 2, 5)
    assert "failed" not in row and "inductor_failed" not in row
    assert row["rel_err_ours"] < 1e-5
    assert row["compile_s_inductor"] == 0.25
    assert row["compile_s_ours"] == pytest.approx(row["import_s"] + row["build_s_ours"])
    assert row["ours/inductor"] == pytest.approx(row["ours_ms"] / row["inductor_ms"])
    assert row["ours/eager"] == pytest.approx(row["ours_ms"] / row["eager_ms"])
    assert min(row[f"{e}_runs"] for e in ("ours", "inductor", "eager")) >= 3
    assert len(row["load"]) == 4
    assert row["rel_err_inductor"] == pytest.approx(0.01, rel=1e-3)  # over the 1e-3 mark
    assert row["mismatch"] == ["inductor"]
    table = script.markdown([row], "a CPU; avx2: yes, avx512f: no", 1, "python x")
    line = next(ln for ln in table.splitlines() if ln.startswith("| tiny | 2 | 5 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert len(cells) == 11
    assert float(cells[3]) == pytest.approx(row["ours_ms"], abs=1e-3)
    assert cells[9].endswith("**MISMATCH (inductor)**")
    assert float(cells[9].split(" / ")[0]) == pytest.approx(row["rel_err_ours"], rel=0.06)
    out = tmp_path / "rows.json"
    out.write_text(json.dumps({"rows": [row]}))
    assert json.loads(out.read_text())["rows"][0]["mismatch"] == row["mismatch"]


def test_a_failed_export_is_one_line_and_no_timing():
    script = _script()
    row = script.bench_shape(
        "branchy",
        TinyLM(branch=True).eval(),
        _inputs(),
        target=host_target(),
        threads=1,
        repeat=3,
        budget=0.2,
        inductor=_stand_in(False),
    )
    assert row["failed"].startswith("torch.export: ") and "\n" not in row["failed"]
    assert "ours_ms" not in row
    table = script.markdown([row], "cpu", 1, "python x")
    assert "| branchy | 2 | 5 | failed |" in table
    assert f"- branchy batch 2 seq 5: {row['failed']}" in table


def test_nan_is_a_mismatch():
    script = _script()
    row = {"ours_ms": 1.0, "eager_ms": 2.0, "rel_err_ours": float("nan"), "rel_err_inductor": 0}
    assert script.finish_row(row)["mismatch"] == ["ours"]
    assert row["ours/eager"] == 0.5 and "ours/inductor" not in row
    assert script.rel_err([np.array([np.nan])], [np.array([1.0])]) == float("inf")


def test_without_transformers_one_line(monkeypatch, capsys):
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    assert _script().main(["--models", "gpt2", "--seq", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [
        "bench_decoders_inductor: error: needs torch and transformers (transformers is missing)"
    ]
