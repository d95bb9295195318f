#!/usr/bin/env python3
"""Whole decoder models against Inductor (issue #41, item 4): the corpus's decoder families
(GPT-2, Llama, Qwen2, Phi-3) via torch.export, tvm_fusion vs ``torch.compile`` (Inductor) vs
torch eager; engines alternating round by round with pauses, medians, load beside each row.

The models are ``scripts/export_corpus.py``'s builders (its ``_causal_lm`` wrapper:
``(input_ids, attention_mask) -> logits``, no cache, random weights), at its ``--scale``
(``bench``: hidden 256, vocab 8192, 2 layers; ``test``: the checked-in corpus's tiny
configs). The one change: ``max_position_embeddings`` is raised to the longest ``--seq``
(GPT-2's learned positions have that many rows; the corpus's 64 / 256 are under 512).

For every model and (batch, seq): ``torch.export`` at those static shapes,
``tvm_fusion.frontend.import_exported_program``, the ``tvm_fusion`` pipeline on
``host_target()``; Inductor is ``torch.compile(dynamic=False)`` of the same module
(``engine.inductor_runner``, as ``tvm-fusion bench`` runs it). Both are compared with eager:
max |out - eager| / max |eager|, a mismatch over 1e-3. Compile seconds are apart from the run
times: ours is import + pipeline + code generation (``torch.export`` is ``export_s`` in the
JSON), Inductor's is its first call (tracing + compile). Every engine runs on ``--threads``
threads (``TVM_NUM_THREADS`` and ``torch.set_num_threads``). A model, shape or engine that
fails is one line in its row and the run goes on.

    PYTHONPATH=. python scripts/bench_decoders_inductor.py      # the whole grid, 2 threads
    PYTHONPATH=. python scripts/bench_decoders_inductor.py --models gpt2 --batch 1 --seq 8 \\
        --repeat 3 --json /tmp/dec.json

Needs torch and transformers (not project dependencies).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import export_corpus as corpus  # noqa: E402

DECODERS = ("gpt2", "llama", "qwen2", "phi3")
MISMATCH = 1e-3  # max |out - eager| / max |eager| over which a row is marked


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def isa_line() -> str:
    """The CPU's model name and whether it has AVX2 / AVX-512F (lscpu, else /proc/cpuinfo)."""
    fields = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = {
            k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in out.splitlines())
        }
    except (OSError, subprocess.SubprocessError):
        pass
    model, flags = fields.get("Model name", ""), set(fields.get("Flags", "").split())
    if not model or not flags:
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
        except OSError:
            pass
    isa = ", ".join(f"{f}: {'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f"))
    return f"{model or 'unknown CPU'} ({os.cpu_count()} logical CPUs); {isa}"


def rel_err(outputs, reference) -> float:
    """max |out - ref| / max |ref| over all outputs (inf for a count or shape mismatch)."""
    from tvm_fusion.build import engine

    scale = max((float(np.abs(np.asarray(r)).max()) for r in reference if np.size(r)), default=0)
    return engine.max_error(outputs, reference) / max(scale, 1e-30)


def _failure(stage: str, err: BaseException) -> str:
    from tvm_fusion.errors import first_line

    return f"{stage}: {type(err).__name__}: {first_line(err)[:300]}"


def bench_shape(
    name: str,
    module,
    inputs: dict,
    *,
    target,
    threads: int,
    repeat: int,
    budget: float,
    inductor: Callable | None = None,
) -> dict:
    """One row: ``module`` (``*inputs.values() -> tensor``) at the (batch, seq) of its first
    input, measured by :func:`bench_module`."""
    first = next(iter(inputs.values()))
    row: dict = {"model": name, "batch": int(first.shape[0]), "seq": int(first.shape[1])}
    where = f"{name} batch {row['batch']} seq {row['seq']}"
    return bench_module(
        row, where, module, tuple(inputs.values()), target=target, threads=threads,
        repeat=repeat, budget=budget, inductor=inductor,
    )  # fmt: skip


def _outputs(out) -> tuple:
    """A module's output as a tuple of tensors."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def bench_module(
    row: dict,
    where: str,
    module,
    args: tuple,
    *,
    target,
    threads: int,
    repeat: int,
    budget: float,
    inductor: Callable | None = None,
    min_time: float = 0.0,
) -> dict:
    """``row`` filled in for ``module(*args)`` (a tensor or a tuple of them): exported,
    compiled by tvm_fusion and Inductor, checked against eager and timed with the three
    alternating (``engine.time_interleaved``; ``min_time``: its ``min_time_s``). A failing
    export, import or compile of ours makes the row failed (``failed``: one line) and untimed;
    a failing Inductor leaves ours and eager timed (``inductor_failed``). ``inductor``: the
    runner maker, ``engine.inductor_runner`` unless given (a test's stand-in)."""
    import torch

    from tvm_fusion.build import engine
    from tvm_fusion.frontend import import_exported_program

    inductor = inductor or engine.inductor_runner
    with torch.inference_mode():
        want = [t.numpy() for t in _outputs(module(*args))]
    feeds = [a.numpy() for a in args]
    stage = "torch.export"
    try:
        start = time.perf_counter()
        program = torch.export.export(module, args)
        row["export_s"] = time.perf_counter() - start
        stage = "import"
        start = time.perf_counter()
        mod = import_exported_program(program, where=where)
        row["import_s"] = time.perf_counter() - start
        stage = "tvm_fusion compile"
        compiled = engine.compile_module(mod, target, "tvm_fusion")
        row["build_s_ours"] = compiled.compile_s
        row["compile_s_ours"] = row["import_s"] + compiled.compile_s
        stage = "tvm_fusion run"
        ours = engine.TvmRunner(compiled, feeds)
        row["rel_err_ours"] = rel_err(ours.outputs(), want)
    except Exception as err:  # noqa: BLE001 - one line in the row, and the run goes on
        row["failed"] = _failure(stage, err)
        return row
    runs = {"ours": ours}
    try:
        run, outputs, row["compile_s_inductor"] = inductor(
            lambda _torch: lambda *a: _outputs(module(*a)),
            feeds,
            threads,
            False,
        )
        row["rel_err_inductor"] = rel_err(outputs, want)
        runs["inductor"] = run
    except Exception as err:  # noqa: BLE001 - Inductor's many error types (no C++ compiler ...)
        row["inductor_failed"] = _failure("torch.compile", err)

    def eager():
        with torch.inference_mode():
            return module(*args)

    runs["eager"] = eager
    load_before = os.getloadavg()
    times = engine.time_interleaved(runs, repeat=repeat, budget_s=budget, min_time_s=min_time)
    row["load"] = [round(v, 2) for v in (*load_before, os.getloadavg()[0])]
    for key, value in times.items():
        row[f"{key}_ms"] = value["median_ms"]
        row[f"{key}_runs"] = value["runs"]
    finish_row(row)
    return row


def finish_row(row: dict) -> dict:
    """The ratios and the mismatch marks of a timed row."""
    for peer in ("inductor", "eager"):
        if row.get(f"{peer}_ms"):
            row[f"ours/{peer}"] = row["ours_ms"] / row[f"{peer}_ms"]
    row["mismatch"] = [  # "not <=": nan and inf are mismatches too
        e
        for e in ("ours", "inductor")
        if f"rel_err_{e}" in row and not row[f"rel_err_{e}"] <= MISMATCH
    ]
    return row


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(rows: list[dict], machine: str, threads: int, command: str) -> str:
    """The results table, the failures under it."""
    lines = [
        "# Decoders via torch.export: tvm_fusion vs Inductor vs torch eager",
        "",
        f"Machine: {machine}. Threads: {threads} for every engine. Command: `{command}`.",
        "Medians of warm calls, engines alternating round by round with pauses; load: the "
        "1/5/15-minute load averages before the row's timing and the 1-minute one after. "
        "Compile s: ours = import + pipeline + codegen, Inductor = its first call. rel err: "
        f"max |out - eager| / max |eager|, MISMATCH over {MISMATCH:g}.",
        "",
        "| model | batch | seq | ours ms | inductor ms | eager ms | ours/inductor | ours/eager "
        "| compile s ours / inductor | rel err ours / inductor | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for r in rows:
        head = f"| {r['model']} | {r['batch']} | {r['seq']} |"
        if "failed" in r:
            lines.append(f"{head} failed | | | | | | | |")
            notes.append(f"- {r['model']} batch {r['batch']} seq {r['seq']}: {r['failed']}")
            continue
        if "inductor_failed" in r:
            notes.append(
                f"- {r['model']} batch {r['batch']} seq {r['seq']}: {r['inductor_failed']}"
            )
        errs = " / ".join(_num(r.get(f"rel_err_{e}"), ".1e") for e in ("ours", "inductor"))
        if r.get("mismatch"):
            errs += f" **MISMATCH ({', '.join(r['mismatch'])})**"
        compile_s = " / ".join(_num(r.get(f"compile_s_{e}"), ".1f") for e in ("ours", "inductor"))
        load = " ".join(f"{v:.1f}" for v in r.get("load", []))
        lines.append(
            f"{head} {_num(r.get('ours_ms'), '.3f')} | {_num(r.get('inductor_ms'), '.3f')} | "
            f"{_num(r.get('eager_ms'), '.3f')} | {_num(r.get('ours/inductor'), '.2f')} | "
            f"{_num(r.get('ours/eager'), '.2f')} | {compile_s} | {errs} | {load} |"
        )
    if notes:
        lines += ["", "Failures:", *notes]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DECODERS))
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--seq", default="64,512")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--budget", type=float, default=5.0, help="timed seconds per engine")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scale", default="bench", choices=list(corpus.SCALES))
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    prog = "bench_decoders_inductor"
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in DECODERS]
    if unknown:
        print(f"{prog}: error: unknown model(s) {unknown}; known: {DECODERS}", file=sys.stderr)
        return 2
    batches, seqs = _ints(args.batch), _ints(args.seq)
    if not batches or not seqs or min(batches + seqs) < 1 or args.threads < 1:
        print(
            f"{prog}: error: --batch, --seq and --threads take positive integers", file=sys.stderr
        )
        return 2
    try:
        import torch
        import transformers
    except ImportError as err:
        print(
            f"{prog}: error: needs torch and transformers ({err.name} is missing)", file=sys.stderr
        )
        return 2
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # before TVM's pool starts
    import logging
    import warnings

    from tvm_fusion import pool
    from tvm_fusion.target import host_target

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    logging.getLogger("torch").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    if pool.threads() != args.threads:  # pragma: no cover - the environment is set above
        print(f"{prog}: error: TVM's pool has {pool.threads()} threads", file=sys.stderr)
        return 2
    target = host_target()
    base = corpus.SCALES[args.scale]
    corpus.S = dataclasses.replace(base, max_pos=max(base.max_pos, *seqs))
    machine = isa_line()
    command = " ".join(["python", "scripts/bench_decoders_inductor.py", *(argv or sys.argv[1:])])
    print(f"# {machine}; torch {torch.__version__}, transformers {transformers.__version__}")
    rows = []
    for name in names:
        corpus._seed()
        try:
            module, make_inputs, *_ = corpus.MODELS[name]()
        except Exception as err:  # noqa: BLE001 - this transformers lacks the family, ...
            why = _failure("build", err)
            rows += [
                {"model": name, "batch": b, "seq": s, "failed": why} for b in batches for s in seqs
            ]
            print(f"{name}: {why}", flush=True)
            continue
        for batch in batches:
            for seq in seqs:
                corpus._seed()
                row = bench_shape(
                    name,
                    module,
                    make_inputs(batch, seq),
                    target=target,
                    threads=args.threads,
                    repeat=args.repeat,
                    budget=args.budget,
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
    print()
    print(markdown(rows, machine, args.threads, command), end="")
    if args.json:
        config = {k: v for k, v in dataclasses.asdict(corpus.S).items() if k != "out"}
        result = {
            "machine": machine,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "threads": args.threads,
            "command": command,
            "scale": args.scale,
            "config": config,
            "mismatch_rel": MISMATCH,
            "rows": rows,
        }
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if any(r.get("failed") or r.get("mismatch") for r in rows) else 0  # as a check


if __name__ == "__main__":
    sys.exit(main())
