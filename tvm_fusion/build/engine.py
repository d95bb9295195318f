"""Compile and run a Relax module with stock TVM or with tvm_fusion; the peers' runners.

Used by the CLI, the benchmark, the tests and the tutorials, so that every one of them compiles
the same way. ``compile_module`` returns the lowered IRModule too, for kernel counting.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np
import tvm
from tvm import relax
from tvm.target import Target

from .. import pool
from ..errors import ModelError, TvmFusionError, UsageError, first_line
from ..target import async_copy, is_gpu, num_cores, parse_target
from .pipeline import build_pipeline, stock_pipeline

PIPELINES = ("stock", "tvm_fusion")


@dataclasses.dataclass
class Compiled:
    executable: relax.VMExecutable
    lowered: tvm.IRModule
    target: Target
    pipeline: str
    compile_s: float

    def vm(self, device=None) -> relax.VirtualMachine:
        return relax.VirtualMachine(self.executable, device or _device(self.target))


def _device(target: Target):
    return tvm.cuda(0) if target.kind.name == "cuda" else tvm.cpu(0)


def compile_module(
    mod: tvm.IRModule,
    target=None,
    pipeline: str = "tvm_fusion",
    **options,
) -> Compiled:
    """Lower ``mod`` with ``pipeline`` ("stock" or "tvm_fusion") and build it for ``target``.

    ``options`` go to :func:`tvm_fusion.build.pipeline.build_pipeline` (flags, ``tuning_db``, ...).
    """
    tgt = parse_target(target)
    if pipeline == "stock":
        if set(options) - {"tuning_db"}:
            raise UsageError(f"the stock pipeline takes no options, got {sorted(options)}")
        passes = stock_pipeline(tgt, options.get("tuning_db"))
    elif pipeline == "tvm_fusion":
        passes = build_pipeline(tgt, **options)
    else:
        raise UsageError(f"unknown pipeline {pipeline!r}; known: {', '.join(PIPELINES)}")
    start = time.perf_counter()
    where = _LastPass()
    try:
        with tgt, _instrumented(where, async_copy=pipeline == "tvm_fusion" and async_copy(tgt)):
            lowered = passes(mod)
            where.last = "tvm.compile (code generation)"
            # inside the target scope: TVM's nvcc/NVRTC callback reads the arch from it
            executable = tvm.compile(lowered, tgt, relax_pipeline=None)
    except (TvmFusionError, KeyboardInterrupt):
        raise
    except Exception as err:  # TVM's own errors: one line naming the pass that raised
        raise ModelError(
            f"{pipeline} compilation failed in {where.last or 'the pipeline'}: {first_line(err)}"
        ) from err
    return Compiled(executable, lowered, tgt, pipeline, time.perf_counter() - start)


@tvm.instrument.pass_instrument
class _LastPass:
    """Remembers the innermost pass that started last: where a failure happened."""

    def __init__(self):
        self.last = ""

    def run_before_pass(self, _mod, info):
        if info.name not in ("sequential", "tvm_fusion_phases"):
            self.last = info.name


def _instrumented(recorder, async_copy: bool = False):
    """The current PassContext (its opt level, disabled passes, config) plus ``recorder``;
    with ``async_copy``, global-to-shared copies in software pipelines become ``cp.async``
    (``tirx.use_async_copy``, unless the context sets it)."""
    ctx = tvm.transform.PassContext.current()
    config = dict(ctx.config)
    if async_copy:
        config.setdefault("tirx.use_async_copy", True)
    return tvm.transform.PassContext(
        opt_level=ctx.opt_level,
        required_pass=list(ctx.required_pass),
        disabled_pass=list(ctx.disabled_pass),
        instruments=[*ctx.instruments, recorder],
        config=config,
    )


def as_list(out) -> list[np.ndarray]:
    """VM outputs (a tensor or a nested tuple of tensors) as a flat list of arrays."""
    if isinstance(out, tvm.runtime.Tensor):
        return [out.numpy()]
    if isinstance(out, Sequence) or hasattr(out, "__getitem__"):
        flat: list[np.ndarray] = []
        for item in out:
            flat.extend(as_list(item))
        return flat
    if isinstance(out, int | float | np.generic):
        return [np.asarray(out)]
    raise TypeError(f"unexpected VM output {type(out).__name__}")


class TvmRunner:
    """Runs ``function`` (default ``main``; ``main_adjoint`` after Gradient) of a compiled
    module on fixed inputs; ``__call__`` returns when done."""

    def __init__(self, compiled: Compiled, inputs: Sequence[np.ndarray], function: str = "main"):
        self.device = _device(compiled.target)
        self.vm = compiled.vm(self.device)
        self.args = [tvm.runtime.tensor(a, self.device) for a in inputs]
        self._main = self.vm[function]
        self._sync = is_gpu(compiled.target)

    def __call__(self):
        out = self._main(*self.args)
        if self._sync:
            self.device.sync()
        return out

    def outputs(self) -> list[np.ndarray]:
        return as_list(self())


def onnxruntime_session(model, threads: int, **options):
    """An ONNX Runtime CPU session of ``model`` on ``threads`` intra-op threads, all graph
    optimisations; ``options`` set further ``SessionOptions`` fields (``enable_profiling``)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    for name, value in options.items():
        setattr(opts, name, value)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def onnxruntime_runner(model, inputs: dict[str, np.ndarray], threads: int) -> Callable:
    session = onnxruntime_session(model, threads)
    names = [i.name for i in session.get_inputs()]
    feed = {name: inputs[name] for name in names}
    return lambda: session.run(None, feed)


def torch_runner(make_fn: Callable, inputs: Sequence[np.ndarray], threads: int) -> Callable:
    import torch

    torch.set_num_threads(threads)
    fn = make_fn(torch)
    args = [torch.from_numpy(np.ascontiguousarray(a)) for a in inputs]

    def run():
        with torch.inference_mode():
            return [o.numpy() for o in fn(*args)]

    return run


def inductor_runner(
    make_fn: Callable, inputs: Sequence[np.ndarray], threads: int, dynamic: bool
) -> tuple[Callable, list[np.ndarray], float]:
    """``torch.compile`` (Inductor) of a workload's torch function: ``dynamic=False`` for static
    shapes, ``dynamic=True`` for symbolic ones. Compiles on the first call, made here: returns
    the runner, that call's outputs and its seconds (the compile time, kept apart from the run
    time). Inductor's errors propagate (the caller reports them in one line). Dynamo's caches
    are reset first: workloads whose functions share code (SwiGLU and GeGLU) would otherwise
    count as recompiles of one function, and past its limit Dynamo runs it eagerly, unsaid."""
    import torch

    torch.set_num_threads(threads)
    torch._dynamo.reset()
    fn = torch.compile(make_fn(torch), dynamic=dynamic)
    args = [torch.from_numpy(np.ascontiguousarray(a)) for a in inputs]

    def run():
        with torch.inference_mode():
            return [o.numpy() for o in fn(*args)]

    start = time.perf_counter()
    outputs = run()
    return run, outputs, time.perf_counter() - start


def time_runs(run: Callable, repeat: int = 10, warmup: int = 1, budget_s: float = 10.0) -> dict:
    """Median and min of ``repeat`` timed calls (at least 3, fewer when over ``budget_s``)."""
    for _ in range(warmup):
        run()
    times: list[float] = []
    spent = 0.0
    while len(times) < repeat and (len(times) < 3 or spent < budget_s):
        start = time.perf_counter()
        run()
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        spent += elapsed
    return _summary(times)


def _summary(seconds: Sequence[float]) -> dict:
    ms = np.array(seconds) * 1e3
    return {"median_ms": float(np.median(ms)), "min_ms": float(ms.min()), "runs": len(ms)}


def time_interleaved(
    runs: dict[str, Callable],
    repeat: int = 10,
    budget_s: float = 10.0,
    pause_s: float = 0.3,
    block_s: float = 0.05,
    rounds: int = 5,
    min_time_s: float = 0.0,
    warm_s: float = 1.0,
) -> dict[str, dict]:
    """:func:`time_runs` for several engines at once, in alternating rounds.

    Timing the engines one after the other puts a slow phase of a shared machine (another VM's
    load, a frequency change) on whichever engine ran then: 20 % between two runs of one model
    here. In rounds, each engine gets a block of runs in turn (about ``block_s`` of them, at
    least one, at most ``repeat / rounds`` so that its runs spread over ``rounds`` rounds or
    more), and a slow phase falls on all of them. Before each block the thread pools of the
    previous engine get ``pause_s`` to go idle: after a run, TVM's workers spin for about
    250 ms (a whole core here; ``TVM_THREAD_POOL_SPIN_COUNT``) and ONNX Runtime's for about
    50 ms, and a spinning pool halves the next engine's speed on 2 cores. Then one untimed call
    warms the engine (wakes its pool, brings its clocks and caches back) when a run is shorter
    than ``warm_s``: the first call after the pause is slower, by more than the noise for some
    engines (SwiGLU's MLP here: TVM +5-9 %, ONNX Runtime +3-4 %), and the medians are of calls
    in the steady state that a model served back to back runs in. That first call's time is kept
    apart: ``first_call_ms`` in the result, the median of the first calls after the pauses (the
    first timed call of a block for an engine not warmed). An engine stops at ``repeat``
    runs, or at ``budget_s`` of timed runs once it has 3. ``min_time_s`` raises ``repeat`` for an
    engine whose runs are short, to about that many seconds of timed runs: 20 runs of a 0.3 ms
    model are 6 ms of samples, too few to outlast a slow phase of the machine. The count and the
    blocks are sized by the fastest of up to 3 warm-up calls (one when the first is over
    ``warm_s``): the first call of a model in a process is the slowest (LSTM's 0.1 ms cell:
    0.7-1.0 ms), and sized by it, an engine got a tenth of its ``min_time_s``.
    Returns ``{name: time_runs' dict + first_call_ms}``."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    first: dict[str, list[float]] = {name: [] for name in runs}
    spent = dict.fromkeys(runs, 0.0)
    estimate = {}
    for name, run in runs.items():  # warm-up, and the size of the blocks
        calls = []
        while len(calls) < 3 and (not calls or calls[0] < warm_s):
            start = time.perf_counter()
            run()
            calls.append(time.perf_counter() - start)
        estimate[name] = min(calls)
    wanted = {
        name: max(repeat, min(int(min_time_s / max(t, 1e-6)), 100_000)) if min_time_s else repeat
        for name, t in estimate.items()
    }

    def done(name: str) -> bool:
        n = len(times[name])
        return n >= wanted[name] or (n >= 3 and spent[name] >= budget_s)

    while not all(done(name) for name in runs):
        for name, run in runs.items():
            if done(name):
                continue
            time.sleep(pause_s)
            warm = estimate[name] < warm_s
            if warm:
                start = time.perf_counter()
                run()
                first[name].append(time.perf_counter() - start)
            short = estimate[name] < block_s
            block = max(1, int(block_s / max(estimate[name], 1e-6))) if short else 1
            block = min(block, -(-wanted[name] // rounds))
            for i in range(min(block, wanted[name] - len(times[name]))):
                start = time.perf_counter()
                run()
                elapsed = time.perf_counter() - start
                if i == 0 and not warm:  # the first call after the pause is a timed one
                    first[name].append(elapsed)
                times[name].append(elapsed)
                spent[name] += elapsed
    result = {}
    for name, values in times.items():
        result[name] = _summary(values)
        result[name]["first_call_ms"] = float(np.median(first[name]) * 1e3) if first[name] else None
    return result


def max_error(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    if len(outputs) != len(reference):
        return float("inf")
    worst = 0.0
    for out, ref in zip(outputs, reference, strict=True):
        out = np.asarray(out, dtype="float64")
        ref = np.asarray(ref, dtype="float64")
        if out.shape != ref.shape:
            return float("inf")
        if out.size:
            both_nan = np.isnan(out) & np.isnan(ref)
            diff = np.where(both_nan, 0.0, np.abs(out - ref))
            worst = max(worst, float(np.nanmax(np.where(np.isnan(diff), np.inf, diff))))
    return worst


def allclose(outputs, reference, rtol: float, atol: float) -> bool:
    if len(outputs) != len(reference):
        return False
    for out, ref in zip(outputs, reference, strict=True):
        out, ref = np.asarray(out), np.asarray(ref)
        if out.shape != ref.shape or not np.allclose(
            out, ref, rtol=rtol, atol=atol, equal_nan=True
        ):
            return False
    return True


def threads_for(target: Target) -> int:
    """Threads for the other engines of a benchmark (ONNX Runtime, torch): as many as TVM's pool
    runs (:func:`tvm_fusion.pool.threads`, a user's ``TVM_NUM_THREADS`` included), at most the
    target's cores."""
    return max(1, min(num_cores(target), pool.threads()))
