#!/usr/bin/env python3
"""The cost of CheckGatherBounds on the CPU: each case compiled with our pipeline twice, with the
pass and without it (``check_gather_bounds=False``), timed in alternating rounds
(``engine.time_interleaved``), outputs compared.

Cases: a single ``Gather`` of 1, 64 and 4096 ids from a (1000, 64) table, and the corpus models
with token ids (``tests/corpus``, the inputs saved there). Prints one line per case (median ms
of both builds and the difference, and of a second VM of the unchecked build: the noise
floor); nothing is written.

    TVM_NUM_THREADS=1 python scripts/bench_gather_bounds.py
    TVM_NUM_THREADS=1 python scripts/bench_gather_bounds.py --models distilbert_dynamo gpt2_dynamo

``--table``: no timing; the table of bad ids instead (``tvm_fusion.testing.bounds_table``: each
indexing op, its ids a model input, run with ids in range, out by 1, by 10**8 and below -n, in
a child process restarted after a crash), each outcome against onnxruntime's / torch's:

    TVM_NUM_THREADS=1 python scripts/bench_gather_bounds.py --table
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "corpus"
MODELS = ["distilbert_dynamo", "distilbert_torchscript", "gpt2_dynamo", "gpt2_torchscript"]


def _gather_model(count: int):
    from onnx import TensorProto, helper, numpy_helper

    table = np.random.default_rng(0).standard_normal((1000, 64)).astype("float32")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["W", "ids"], ["y"], axis=0)],
        "gather",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 64])],
        [numpy_helper.from_array(table, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    ids = np.random.default_rng(1).integers(-1000, 1000, count).astype("int64")
    return model, [ids]


def _corpus_model(key: str):
    entry = json.loads((CORPUS / "manifest.json").read_text())[key]
    data = np.load(CORPUS / f"{key}.npz")
    return CORPUS / entry["file"], [data[f"in:{name}"] for name, _ in entry["inputs"]]


def _table() -> int:
    """Prints op x case -> outcome (see ``tvm_fusion.testing.bounds_table``); exit status 1
    when a case gives other numbers than the reference, no error where it raises, or a
    crash."""
    from tvm_fusion.testing import bounds_table as bt

    todo = [(op, case) for op in bt.OPS for case in bt.cases(op)]
    rows = {(r["op"], r["case"]): r for r in bt.run_isolated(todo)}
    columns = bt.CASES + sorted({c for extra in bt.EXTRA.values() for c in extra})
    print("| op | " + " | ".join(c.replace("_", " ") for c in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for op in bt.OPS:
        cells = []
        for case in columns:
            row = rows.get((op, case))
            if row is None:
                cells.append("-")
                continue
            ref = "error" if row["reference"] else "result"
            crashed = row["outcome"] == "crash"
            cells.append(row["outcome"] if crashed else f"{row['outcome']} (ref: {ref})")
        print(f"| {op} | " + " | ".join(cells) + " |")
    print()
    for op in bt.OPS:
        details = sorted({r["detail"] for r in rows.values() if r["op"] == op and r["detail"]})
        for detail in details:
            print(f"{op}: {detail}")
    bad = [k for k, r in rows.items() if r["outcome"] in ("wrong", "crash")]
    print(f"\n{len(rows)} cases, {len(bad)} wrong or crashed: {bad}")
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, nargs="*", default=[1, 64, 4096])
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--budget", type=float, default=3.0, help="timed seconds per build")
    parser.add_argument("--table", action="store_true", help="the table of bad ids, no timing")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.table:
        return _table()
    import tvm_fusion
    from tvm_fusion.build.engine import TvmRunner, compile_module, time_interleaved
    from tvm_fusion.transform import collect_rewrites

    target = tvm_fusion.host_target()
    print(f"threads {os.environ.get('TVM_NUM_THREADS', 'all')}, target {target}")
    cases = [(f"Gather of {n} ids from (1000, 64)", *_gather_model(n)) for n in args.ids]
    cases += [(key, *_corpus_model(key)) for key in args.models]
    for name, model, inputs in cases:
        runners, outputs, checks = {}, {}, 0
        for checked in (True, False):
            with collect_rewrites() as counts:
                compiled = compile_module(
                    tvm_fusion.load_onnx(model), target, check_gather_bounds=checked
                )
            checks = max(checks, counts.get("CheckGatherBounds", 0))
            runner = TvmRunner(compiled, inputs)
            label = "checked" if checked else "unchecked"
            runners[label], outputs[label] = runner, runner.outputs()
        # the same unchecked build once more: how far two runs of one program differ here
        runners["unchecked again"] = TvmRunner(compiled, inputs)
        for a, b in zip(outputs["checked"], outputs["unchecked"], strict=True):
            np.testing.assert_array_equal(a, b)
        times = time_interleaved(runners, repeat=args.repeat, budget_s=args.budget, min_time_s=1)
        on, off, again = (times[k]["median_ms"] * 1e3 for k in runners)
        fastest = ", ".join(f"{k} {times[k]['min_ms'] * 1e3:.1f}" for k in runners)
        print(
            f"{name}: {checks} check(s); checked {on:.1f} us, unchecked {off:.1f} us, "
            f"{on - off:+.1f} us ({(on / off - 1) * 100:+.1f}%); unchecked again {again:.1f} us "
            f"({(again / off - 1) * 100:+.1f}%); fastest: {fastest} us"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
