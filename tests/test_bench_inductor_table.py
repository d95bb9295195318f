"""``scripts/bench_inductor_table.py`` (issue #41's table): every workload's module exports and
runs in torch at the table's shapes (a typo in one would cost a whole benchmark run), and one
row end to end on a tiny module with Inductor stood in for by eager. No timing is asserted."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from tvm_fusion.target import host_target

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location(
        "bench_inductor_table", ROOT / "scripts" / "bench_inductor_table.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stand_in(scale: float):
    def make(make_fn, inputs, threads, dynamic):
        assert dynamic is False
        fn = make_fn(torch)
        args = [torch.from_numpy(a) for a in inputs]

        def run():
            with torch.inference_mode():
                return [o.numpy() * scale for o in fn(*args)]

        return run, run(), 0.0

    return make


def test_the_nine_workloads_run_in_torch():
    table = _script()._modules(torch)
    assert len(table) == 9
    for name, (desc, make, make_inputs) in table.items():
        if name in ("cross_entropy", "lm_head_ce", "gpt_block_4x512"):
            continue  # the big ones: their classes are the small ones' (checked below)
        torch.manual_seed(0)
        with torch.inference_mode():
            out = make()(*make_inputs())
        first = out[0] if isinstance(out, tuple) else out
        assert torch.isfinite(first).all(), (name, desc)


@pytest.mark.parametrize("scale,mismatch", [(1.0, []), (1.01, ["inductor"])])
def test_row_checks_both_engines_against_eager(scale, mismatch):
    script = _script()
    torch.manual_seed(0)
    cell = torch.nn.LSTM(6, 5, batch_first=True)

    class Seq(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = cell

        def forward(self, x):
            out, (h, c) = self.lstm(x)
            return out, h, c

    row = script.bench_row(
        "tiny_lstm",
        "tiny",
        Seq().eval(),
        (torch.randn(2, 3, 6),),
        target=host_target(),
        threads=1,
        repeat=3,
        budget=0.05,
        inductor=_stand_in(scale),
        min_time=0.0,
    )
    assert "failed" not in row, row.get("failed")
    assert row["rel_err_ours"] <= 1e-5
    assert row["mismatch"] == mismatch
    assert row["ours_ms"] > 0 and row["inductor_ms"] > 0 and row["eager_ms"] > 0
    text = script.markdown([row], "m", 1, "cmd")
    assert "MISMATCH" in text if mismatch else "MISMATCH" not in text
    assert np.isclose(script.geomean([2.0, 0.5]), 1.0)
