"""ONNX's own operator conformance suite (``onnx.backend.test.case.node``: single-node models
with inputs and reference outputs) through three engines: tvm_fusion (``load_onnx`` + the
``tvm_fusion`` pipeline), stock TVM (its ONNX importer + the stock pipeline) and ONNX Runtime,
on the host. Each case runs in a worker process (:class:`tvm_fusion.testing.fuzz.worker.Worker`),
so that a crash costs one case. Outcomes, per case and engine: ``pass``, ``wrong`` (a number,
shape, dtype or count that differs from ONNX's reference: rtol 1e-3, atol 1e-5, two ulps for
float16 / bfloat16), ``crash`` / ``hang`` (the worker died or took longer than ``--timeout``),
``refused`` (a one-line ``TvmFusionError`` at load or compile), ``error`` (any other exception:
for tvm_fusion a raw TVM error is a bug of ours), ``skipped`` (inputs that are not tensors: the
TVM runners pass tensors).

    PYTHONPATH=$PWD python scripts/onnx_conformance.py --ops Add,MatMul --workers 2 \\
        --output bench/conformance

writes ``bench/conformance.json`` (every case) and ``bench/conformance.md`` (totals and a
summary per op, the tvm_fusion cases that are wrong, crash or raise raw errors).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import platform
import queue
import re
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import onnx_node_cases as nc  # noqa: E402

OUTCOMES = ("pass", "wrong", "crash", "hang", "refused", "error", "skipped")

# the ops of the corpus's transformer, RNN and CNN models (tests/corpus), and the CNN ops of
# the project's workloads: --ops corpus
CORPUS_OPS = (
    "Abs Add And AveragePool BatchNormalization Cast Ceil Clip Concat Constant ConstantOfShape "
    "Conv Cos CumSum Div Einsum Equal Erf Expand Flatten GRU Gather GatherElements GatherND "
    "Gemm GlobalAveragePool Greater GreaterOrEqual Identity LSTM LayerNormalization Less "
    "LessOrEqual Log MatMul Max MaxPool Min Mul Neg Not Pad Pow Range Reciprocal ReduceMean "
    "Relu Reshape Shape Sigmoid Sign Sin Slice Softmax SoftmaxCrossEntropyLoss Split Sqrt "
    "Squeeze Sub Tanh Tile Transpose Unsqueeze Where"
).split()


def _select(ops: set[str] | None) -> list[tuple[str, str, str]]:
    """(name, module, op) of the cases to run."""
    chosen = []
    for name, module in nc.all_names().items():
        op = nc.op_of(name, module)
        if ops is None or op in ops:
            chosen.append((name, module, op))
    return chosen


def _run_all(jobs, workers: int, timeout_s: float, progress: bool, log: Path | None = None):
    """Results in the order of ``jobs``; each also appended to ``log`` (JSON lines) as it ends,
    so that a long run that is stopped keeps what it did."""
    from tvm_fusion.testing.fuzz.worker import Worker

    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    pool: queue.Queue = queue.Queue()
    made = [
        Worker(
            timeout_s=timeout_s,
            runner="onnx_node_cases:run_job",
            loader="onnx_node_cases:load_job",
            save=nc.save_job,
            env=env,
        )
        for _ in range(workers)
    ]
    for w in made:
        pool.put(w)
    lock = threading.Lock()
    done = [0]
    start = time.monotonic()

    def one(job):
        name, module, op, engine = job
        worker = pool.get()
        try:
            t0 = time.monotonic()
            outcome, reason = worker.run(name, module, engine)
            seconds = time.monotonic() - t0
        finally:
            pool.put(worker)
        with lock:
            done[0] += 1
            if progress and (done[0] % 50 == 0 or outcome in ("crash", "hang")):
                print(
                    f"[{done[0]}/{len(jobs)} {time.monotonic() - start:.0f}s] "
                    f"{engine} {name}: {outcome}",
                    flush=True,
                )
        row = {
            "case": name,
            "op": op,
            "engine": engine,
            "outcome": outcome,
            "reason": reason,
            "seconds": round(seconds, 2),
        }
        if log is not None:
            with lock, log.open("a") as f:
                f.write(json.dumps(row) + "\n")
        return row

    try:
        with concurrent.futures.ThreadPoolExecutor(workers) as ex:
            return list(ex.map(one, jobs))
    finally:
        for w in made:
            w.close()


def _table(counts: dict, engines: list[str]) -> list[str]:
    head = "| engine | " + " | ".join(OUTCOMES) + " |"
    lines = [head, "|---" * (len(OUTCOMES) + 1) + "|"]
    for engine in engines:
        row = counts.get(engine, {})
        lines.append(f"| {engine} | " + " | ".join(str(row.get(o, 0)) for o in OUTCOMES) + " |")
    return lines


def _refusal_classes(results: list[dict], engine: str, top: int = 25) -> list[str]:
    """The most common refusal lines of ``engine`` (node names and numbers blanked), with
    their counts and ops."""
    counts: collections.Counter = collections.Counter()
    ops: dict = collections.defaultdict(set)
    for r in results:
        if r["engine"] != engine or r["outcome"] != "refused":
            continue
        why = re.sub(r"cannot import <ModelProto>:? ?|<ModelProto> ", "", r["reason"])
        why = re.sub(r"node '[^']*'|\bNode \S+", "node", why)
        why = re.sub(r"\d+", "N", why)[:120]
        counts[why] += 1
        ops[why].add(r["op"])
    lines = [
        "",
        f"## {engine}: refusals by reason (the {top} most common of {len(counts)})",
        "",
        "| cases | reason | ops |",
        "|---|---|---|",
    ]
    for why, n in counts.most_common(top):
        names = ", ".join(sorted(ops[why]))
        lines.append(f"| {n} | {why.replace('|', '/')} | {names[:100]} |")
    return lines


def report(
    results: list[dict], engines: list[str], command: str, seconds: float, note: str = ""
) -> str:
    totals: dict = collections.defaultdict(collections.Counter)
    per_op: dict = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    cases = sorted({r["case"] for r in results})
    for r in results:
        totals[r["engine"]][r["outcome"]] += 1
        per_op[r["op"]][r["engine"]][r["outcome"]] += 1
    by_case = {(r["case"], r["engine"]): r for r in results}
    ort_pass = {c for c in cases if by_case.get((c, "onnxruntime"), {}).get("outcome") == "pass"}
    lines = [
        "# ONNX node conformance (onnx.backend.test.case.node)",
        "",
        f"Command: `{command}`",
        "",
        f"{len(cases)} cases, {len(per_op)} ops, {seconds / 60:.1f} min. Reference: ONNX's "
        "outputs, rtol 1e-3 (two ulps for float16 / bfloat16), atol 1e-5. refused = one-line "
        "error of ours (ModelError) at load or compile; error = any other exception (stage: "
        "load / compile / run); skipped = inputs that are not tensors (sequences, optionals).",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()} "
        f"({os.cpu_count()} CPUs), engines: {', '.join(engines)}.{note}",
        "",
        *_table(totals, engines),
        "",
    ]
    if "onnxruntime" in engines:
        for engine in engines:
            if engine == "onnxruntime":
                continue
            both = sum(by_case.get((c, engine), {}).get("outcome") == "pass" for c in ort_pass)
            share = 100.0 * both / max(1, len(ort_pass))
            lines.append(
                f"- {engine} passes {both} of the {len(ort_pass)} cases ONNX Runtime passes "
                f"({share:.1f} %)."
            )
        lines.append("")
    lines += [
        "## Per op (pass / wrong / crash+hang / refused / error / skipped)",
        "",
        "| op | cases | " + " | ".join(engines) + " |",
        "|---|---|" + "---|" * len(engines),
    ]
    for op in sorted(per_op):
        n = sum(per_op[op][engines[0]].values())
        cells = []
        for engine in engines:
            c = per_op[op][engine]
            cells.append(
                f"{c['pass']}/{c['wrong']}/{c['crash'] + c['hang']}/{c['refused']}/"
                f"{c['error']}/{c['skipped']}"
            )
        lines.append(f"| {op} | {n} | " + " | ".join(cells) + " |")
    if "tvm_fusion" in engines:
        bad = [
            r
            for r in results
            if r["engine"] == "tvm_fusion" and r["outcome"] in ("wrong", "crash", "hang", "error")
        ]
        lines += ["", f"## tvm_fusion: wrong, crash, hang, raw error ({len(bad)})", ""]
        for r in sorted(bad, key=lambda r: (r["outcome"], r["op"], r["case"])):
            stock = by_case.get((r["case"], "stock"), {}).get("outcome", "-")
            ort = by_case.get((r["case"], "onnxruntime"), {}).get("outcome", "-")
            lines.append(
                f"- {r['outcome']} `{r['case']}` ({r['op']}; stock {stock}, ORT {ort}): "
                f"{r['reason'][:300]}"
            )
        lines += _refusal_classes(results, "tvm_fusion")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--ops", default="", help="comma-separated op types (Add,MatMul), or 'corpus'; all if none"
    )
    parser.add_argument("--cases", default="", help="comma-separated case names (overrides --ops)")
    parser.add_argument("--engines", default=",".join(nc.ENGINES))
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    parser.add_argument("--no-expanded", action="store_true", help="skip *_expanded cases")
    parser.add_argument("--output", default="bench/conformance", help="path stem: .json, .md")
    parser.add_argument(
        "--operands-as-initializers",
        action="store_true",
        help="each case's inputs after the first as initializers (as real models hold axes, "
        "pads, scales...); cases with one input are skipped",
    )
    parser.add_argument(
        "--merge",
        default="",
        help="a previous run's .json: its results, with this run's replacing those of the same "
        "case and engine, are written",
    )
    args = parser.parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - set(nc.ENGINES)
    if unknown or not engines:
        parser.error(f"--engines: choose from {', '.join(nc.ENGINES)}")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.operands_as_initializers:
        os.environ[nc.CONSTANTS_ENV] = "1"  # the worker processes inherit it
    ops = None
    if args.ops == "corpus":
        ops = set(CORPUS_OPS)
    elif args.ops:
        ops = {o.strip() for o in args.ops.split(",") if o.strip()}
    selected = _select(ops)
    if args.cases:
        wanted = set(args.cases.split(","))
        selected = [s for s in selected if s[0] in wanted]
    if args.no_expanded:
        selected = [s for s in selected if not nc._EXPANDED.search(s[0])]
    if not selected:
        parser.error("no case selected")
    jobs = [(name, module, op, engine) for name, module, op in selected for engine in engines]
    print(f"{len(selected)} cases x {len(engines)} engines, {args.workers} workers", flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".partial.jsonl")
    log.unlink(missing_ok=True)
    start = time.monotonic()
    results = _run_all(jobs, args.workers, args.timeout, progress=True, log=log)
    seconds = time.monotonic() - start
    log.unlink(missing_ok=True)
    command = "PYTHONPATH=$PWD python scripts/onnx_conformance.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    note = ""
    if args.merge:  # this run's cases re-run over a previous run's
        previous = json.loads(Path(args.merge).read_text())
        fresh = {(r["case"], r["engine"]) for r in results}
        kept = [r for r in previous["results"] if (r["case"], r["engine"]) not in fresh]
        note = (
            f" {len(results)} results of this command ({len(fresh)} case-engine pairs) replace "
            f"those of `{previous['command']}` ({len(previous['results'])} results, "
            f"{previous['seconds'] / 60:.1f} min)."
        )
        command = f"{previous['command']}` then `{command}"
        results, seconds = kept + results, previous["seconds"] + seconds
        engines = [e for e in nc.ENGINES if any(r["engine"] == e for r in results)]
    out.with_suffix(".json").write_text(
        json.dumps({"command": command, "seconds": seconds, "results": results}, indent=1) + "\n"
    )
    text = report(results, engines, command, seconds, note)
    out.with_suffix(".md").write_text(text)
    print(text.split("## Per op")[0])
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
