"""``tvm-fusion``: demo | compile | explain | bench | tune.

Bad input (a missing or corrupt model, an unknown target, workload or engine, a bad option
value, an output path that cannot be written, an unreadable tuning database, an unreachable
RPC tracker) prints one line ``tvm-fusion: error: ...`` on stderr and exits with status 2;
Ctrl-C prints ``tvm-fusion: interrupted`` and exits with status 130. Option values are checked
when the command line is parsed, output paths before anything is compiled.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..errors import TvmFusionError, UsageError
from .cli_args import (
    Parser,
    TargetAction,
    check_output_file,
    command_target,
    make_output_dir,
    non_negative_int,
    parse_dims,
    parse_shapes,
    positive_int,
    shape_arg,
    workload_list,
)

PROG = "tvm-fusion"


def _load_module(model: str, shapes=None, size: str = "seed"):
    """An ONNX file, a saved torch.export program (.pt2), or the name of an embedded workload."""
    from .. import models
    from ..frontend.load import load_model

    if model.endswith((".onnx", ".pt2")) or os.sep in model or os.path.exists(model):
        return load_model(model, shapes), Path(model).stem
    if model in models.names():
        return models.build(model, size).mod, model
    raise UsageError(
        f"{model!r} is neither an ONNX file nor a workload; workloads: {', '.join(models.names())}"
    )


def _pipeline_options(args) -> dict:
    options = {}
    if getattr(args, "tuning_db", None):
        from ..build.database import open_database

        open_database(args.tuning_db)  # a corrupt or foreign database fails here, in one line
        options["tuning_db"] = args.tuning_db
    if getattr(args, "dump_dir", None):
        make_output_dir(args.dump_dir, "--dump-dir")
        options["dump_dir"] = args.dump_dir
    for flag in getattr(args, "disable", None) or []:
        from ..build.pipeline import pass_flags

        if flag not in pass_flags():
            raise UsageError(
                f"unknown pass {flag!r} for --disable; known: {', '.join(pass_flags())}"
            )
        options[flag] = False
    return options


# ---------------------------------------------------------------------------------------------


def cmd_demo(args) -> int:
    from .. import models
    from . import bench

    names = workload_list(args.workloads) or models.names()
    target, spec = command_target(args), args.target_spec or "llvm"
    print(
        f"tvm-fusion demo: stock TVM's fusing pipeline vs tvm_fusion on {spec}"
        f" ({args.size} shapes)",
        flush=True,
    )
    results = bench.run_bench(
        names,
        ["tvm-stock", "tvm-fusion"],
        size=args.size,
        target=target,
        repeat=args.repeat,
        budget_s=args.budget,
        progress=lambda msg: print(f"  .. {msg}", file=sys.stderr, flush=True),
    )
    print()
    print("| workload | kernels stock | kernels ours | stock ms | ours ms | speedup | outputs |")
    print("|---|---|---|---|---|---|---|")
    all_ok = True
    for res in results:
        stock, ours = res.engines["tvm-stock"], res.engines["tvm-fusion"]
        ok = ours.ok and (stock.ok or stock.skipped)
        all_ok &= bool(ok)
        speedup = res.ratio("tvm-stock", "tvm-fusion")
        ratio = f"{speedup:.2f}x" if speedup is not None else "-"
        print(
            f"| {res.workload} | {stock.kernels or '-'} | {ours.kernels} | "
            f"{'skipped' if stock.skipped else bench._fmt_ms(stock.median_ms)} | "
            f"{bench._fmt_ms(ours.median_ms)} | {ratio} | {'agree' if ok else 'DIFFER'} |"
        )
    print()
    for res in results:
        print(f"  {res.workload}: {res.expect}")
        for ename, eres in res.engines.items():
            if eres.skipped:
                print(f"    {ename} skipped: {eres.skipped}")
    return 0 if all_ok else 1


def cmd_compile(args) -> int:
    from ..build import engine
    from .analysis import kernel_count

    target = command_target(args)
    out = check_output_file(args.output, "-o")
    mod, _ = _load_module(args.model, parse_shapes(args.shape))
    options = _pipeline_options(args)
    # export into a fresh directory beside OUT, then rename onto OUT: a failed or interrupted
    # compile or export leaves OUT as it was and no partial file behind
    try:
        staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    except OSError as err:
        raise UsageError(f"cannot write -o in {out.parent}: {err.strerror or err}") from None
    try:
        compiled = engine.compile_module(mod, target, "tvm_fusion", **options)
        compiled.executable.export_library(str(staging / out.name))
        _INTERRUPTS.check()  # a Ctrl-C that a callee swallowed: OUT stays as it was
        os.replace(staging / out.name, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(
        f"wrote {out} ({compiled.target.kind.name}, {kernel_count(compiled.lowered)} kernels, "
        f"compiled in {compiled.compile_s:.1f} s)"
    )
    return 0


def cmd_explain(args) -> int:
    from .analysis import fusion_report, to_dot

    target = command_target(args)
    if args.dot:
        check_output_file(args.dot, "--dot")
    mod, name = _load_module(args.model, parse_shapes(args.shape))
    options = {k: v for k, v in _pipeline_options(args).items() if k not in ("dump_dir",)}
    if args.ptxas and args.json:
        raise UsageError("--ptxas prints text: leave out --json")
    report = fusion_report(mod, target, name=name, **options)
    print(report.to_json() if args.json else report.to_text())
    if args.ptxas:
        _print_ptxas(mod, target, options)
    if args.dot:
        from .analysis import grouped

        flags = {k: v for k, v in options.items() if k != "tuning_db"}
        Path(args.dot).write_text(to_dot(grouped(mod, target, ours=True, **flags), name))
        print(f"wrote {args.dot}")
    return 0


def _print_ptxas(mod, tgt, options) -> None:
    """``explain --ptxas``: our pipeline's CUDA kernels as nvcc builds them (no GPU needed)."""
    from ..build import engine
    from ..target import is_gpu
    from . import cuda_check

    if not is_gpu(tgt):
        raise UsageError("--ptxas needs a CUDA --target (cuda, cuda:sm_XX, cuda:TAG)")
    if not cuda_check.have_nvcc():
        raise UsageError("--ptxas needs nvcc on PATH (the CUDA toolkit)")
    compiled = engine.compile_module(mod, tgt, "tvm_fusion", **options)
    print("CUDA kernels (nvcc -Xptxas -v, PTX):")
    for kernel in cuda_check.check(compiled, str(tgt.attrs.get("arch", "sm_90"))):
        print(f"  {kernel.to_text()}")


def cmd_tune(args) -> int:
    from ..build.tuning import tune

    target = command_target(args)
    mod, name = _load_module(args.model, parse_shapes(args.shape), size=args.size)
    options = {k: v for k, v in _pipeline_options(args).items() if k not in ("tuning_db",)}
    report = tune(
        mod,
        target,
        args.work_dir,
        args.trials,
        pipeline=args.pipeline,
        rpc=args.rpc_tracker,
        rpc_key=args.rpc_key,
        trials_per_iter=args.trials_per_iter,
        verify=args.verify,
        progress=lambda line: print(f"  .. {line}", file=sys.stderr, flush=True),
        **options,
    )
    print(report.to_text())
    if report.wrong:
        print(
            f"error: the best schedule of {', '.join(report.wrong)} computes different numbers "
            "than the unscheduled function; do not apply this database",
            file=sys.stderr,
        )
        return 1
    print(f"apply it with: tvm-fusion compile {args.model} --tuning-db {args.work_dir} -o OUT.so")
    return 0


def cmd_bench_models(args) -> int:
    from . import model_bench
    from .bench import bench_target

    if args.size != "seed" or _pipeline_options(args):
        raise UsageError("--models takes no --size, --tuning-db, --dump-dir or --disable")
    engines = model_bench.parse_model_engines(args.engines)
    if not engines:  # ``--engines ''``: an empty table, exit 0
        raise UsageError(
            f"--engines names no engine; known: {', '.join(model_bench.MODEL_ENGINES)}"
        )
    dims = parse_dims(args.dim)
    target = bench_target(command_target(args), args.mcpu)
    output = "bench/models.json" if args.output is None else args.output
    if output:
        check_output_file(output, "--output", make_parents=True)
    only = [s.strip() for s in args.workloads.split(",") if s.strip()] if args.workloads else None
    results = model_bench.run_models(
        args.models,
        engines,
        dims=dims,
        only=only,
        target=target,
        repeat=args.repeat,
        budget_s=args.budget,
        progress=lambda msg: print(f"  .. {msg}", file=sys.stderr, flush=True),
        min_time_s=args.min_time,
    )
    print(model_bench.markdown_table(results, engines))
    if output:
        path = model_bench.write_results(results, engines, target, output, args.models, dims)
        print(f"\nwrote {path} and {path.with_suffix('.md')}")
    return 0 if all(r.ok is not False for res in results for r in res.engines.values()) else 1


def cmd_bench(args) -> int:
    from . import bench

    if args.models:
        return cmd_bench_models(args)
    if args.dim:
        raise UsageError("--dim needs --models DIR")
    engines = bench.parse_engines(args.engines)
    names = workload_list(args.workloads)
    target = bench.bench_target(command_target(args), args.mcpu)
    output = "bench/results.json" if args.output is None else args.output
    if output:
        check_output_file(output, "--output", make_parents=True)
    results = bench.run_bench(
        names,
        engines,
        size=args.size,
        target=target,
        repeat=args.repeat,
        budget_s=args.budget,
        tvm_options=_pipeline_options(args),
        progress=lambda msg: print(f"  .. {msg}", file=sys.stderr, flush=True),
        min_time_s=args.min_time,
    )
    print(bench.markdown_table(results, engines))
    if output:
        path = bench.write_results(results, engines, target, output)
        print(f"\nwrote {path} and {path.with_suffix('.md')}")
    return 0 if all(r.ok is not False for res in results for r in res.engines.values()) else 1


# ---------------------------------------------------------------------------------------------


def _add_model(p: argparse.ArgumentParser) -> None:
    """The model argument and ``--shape`` of compile, explain and tune."""
    p.add_argument("model", help="MODEL.onnx, MODEL.pt2 (torch.export.save) or a workload name")
    p.add_argument(
        "--shape",
        action="append",
        type=shape_arg,
        metavar="NAME=D1,D2",
        help="input shape: dims 1..2**31-1 or names of symbolic dims",
    )


def _add_common(p: argparse.ArgumentParser, with_passes: bool = True) -> None:
    p.set_defaults(target_spec=None)
    p.add_argument(
        "--target",
        default=None,
        action=TargetAction,
        help="llvm (host CPU, default) | cuda | cuda:sm_XX | cuda:TAG | "
        "JSON target dict (kind llvm or cuda)",
    )
    if with_passes:
        p.add_argument(
            "--disable",
            action="append",
            metavar="PASS",
            help="switch one of our passes off (snake_case flag), repeatable",
        )
        p.add_argument(
            "--tuning-db",
            default=None,
            metavar="DIR",
            help="MetaSchedule work dir whose database is applied",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="-v: info, -vv: debug logs (why patterns did not fire)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="stock vs tvm_fusion on the embedded workloads")
    _add_common(p, with_passes=False)
    p.add_argument("--workloads", default=None, help="comma-separated workload names")
    p.add_argument("--size", default="seed", choices=["seed", "small"])
    p.add_argument("--repeat", type=positive_int, default=5)
    p.add_argument("--budget", type=float, default=3.0, help="seconds of timing per engine")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("compile", help="compile an ONNX model to a shared library")
    _add_model(p)
    p.add_argument("-o", "--output", required=True, help="output .so")
    p.add_argument("--dump-dir", default=None, help="write the IR after every phase here")
    _add_common(p)
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("explain", help="fusion report: groups stock vs ours, rewrites per pass")
    _add_model(p)
    p.add_argument("--dot", default=None, metavar="FILE", help="write the fused graph as DOT")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--ptxas",
        action="store_true",
        help="CUDA: build with nvcc and print per kernel its launch shape, registers, spills, "
        "shared memory, 128-bit loads, cp.async and bar.sync (no GPU needed)",
    )
    _add_common(p)
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("tune", help="MetaSchedule tuning run over the fused groups")
    _add_model(p)
    p.add_argument("--size", default="seed", choices=["seed", "small"], help="workload size")
    p.add_argument(
        "--trials", type=positive_int, default=64, help="measurements in all (resumable)"
    )
    p.add_argument("--trials-per-iter", type=positive_int, default=16)
    p.add_argument(
        "--verify",
        type=non_negative_int,
        default=8,
        metavar="K",
        help="measure the K best records of each task again, 3 times each, and keep the median"
        " (0: MetaSchedule's single measurement)",
    )
    p.add_argument("--work-dir", required=True, help="JSON database and logs (resumable)")
    p.add_argument(
        "--pipeline",
        default="tvm_fusion",
        choices=["tvm_fusion", "stock"],
        help="whose fused groups to tune (stock: for same-budget comparisons)",
    )
    p.add_argument("--rpc-tracker", default=None, metavar="HOST:PORT", help="measure over RPC")
    p.add_argument("--rpc-key", default=None, help="device key registered with the tracker")
    _add_common(p)
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("bench", help="benchmark engines side by side in one process")
    p.add_argument(
        "--workloads", default=None, help="comma-separated workload (with --models: model) names"
    )
    p.add_argument(
        "--models",
        default=None,
        metavar="DIR",
        help="benchmark the .onnx files of DIR (e.g. tests/corpus) instead of the workloads",
    )
    p.add_argument(
        "--dim",
        action="append",
        metavar="NAME=N",
        help="with --models: size of a named dynamic axis, e.g. --dim batch=8 --dim seq=64",
    )
    p.add_argument(
        "--engines",
        default=None,
        help="comma-separated: tvm-stock,tvm-fusion,onnxruntime,inductor,torch (default all); "
        "with --models: tvm-stock,stock-pipeline,tvm-fusion,onnxruntime",
    )
    p.add_argument(
        "--mcpu",
        default=None,
        help="build for this CPU (LLVM's name, e.g. znver3 for AVX2 code on an AVX-512 host)",
    )
    p.add_argument("--size", default="seed", choices=["seed", "small"])
    p.add_argument("--repeat", type=positive_int, default=20)
    p.add_argument("--budget", type=float, default=10.0, help="seconds of timing per engine")
    p.add_argument(
        "--min-time",
        type=float,
        default=0.5,
        help="seconds of timed runs per engine at least: short runs get more than --repeat",
    )
    p.add_argument(
        "--output",
        default=None,
        help="JSON results file, a markdown table beside it ('' = none; default "
        "bench/results.json, with --models bench/models.json)",
    )
    _add_common(p)
    p.set_defaults(func=cmd_bench)
    return parser


def _setup_logging(verbosity: int) -> None:
    level = os.environ.get("TVM_FUSION_LOG", "").upper() or (
        "DEBUG" if verbosity >= 2 else "INFO" if verbosity == 1 else "WARNING"
    )
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("tvm_fusion").setLevel(level)


class _Interrupts:
    """Remembers a Ctrl-C (SIGINT) while ``main`` runs. Python code that TVM calls from C++ (our
    passes, schedule rules) gets the KeyboardInterrupt, and TVM hands it back to ``main`` as a
    plain RuntimeError, or a callee that treats errors as "not applicable" swallows it and the
    command runs on; ``main`` still answers "interrupted" either way."""

    def __init__(self):
        self.seen = False
        self._previous = None

    def _handler(self, signum, frame):
        self.seen = True
        raise KeyboardInterrupt

    def __enter__(self):
        import signal
        import threading

        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        import signal

        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False

    def check(self) -> None:
        """Raise KeyboardInterrupt if Ctrl-C was pressed, even if a callee swallowed it."""
        if self.seen:
            raise KeyboardInterrupt


_INTERRUPTS = _Interrupts()


def main(argv: Sequence[str] | None = None) -> int:
    _INTERRUPTS.seen = False
    try:
        with _INTERRUPTS:
            args = build_parser().parse_args(argv)
            _setup_logging(args.verbose)
            status = args.func(args)
            _INTERRUPTS.check()
            return status
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except TvmFusionError as err:
        if _INTERRUPTS.seen:
            print(f"{PROG}: interrupted", file=sys.stderr)
            return 130
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except Exception:
        if _INTERRUPTS.seen:  # a KeyboardInterrupt that came back through TVM's C++
            print(f"{PROG}: interrupted", file=sys.stderr)
            return 130
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
