"""TVM's thread pool: the one place that sets its environment and says how many threads it has.

TVM's runtime reads three variables when its pool first starts (the first parallel kernel):
``TVM_NUM_THREADS`` (workers), ``TVM_BIND_THREADS`` (pin each worker to a core; on unless
``0``) and ``TVM_THREAD_POOL_SPIN_COUNT`` (how long an idle worker spins before it sleeps).
``import tvm_fusion`` calls :func:`configure` before anything can start the pool; it sets only
what the user left unset (``os.environ.setdefault``), so a user's own value always wins:

- ``TVM_NUM_THREADS``: the cores this process may use (affinity-aware). Without it TVM starts
  one thread on small machines.
- ``TVM_BIND_THREADS=0``: workers are not pinned. A pinned worker that shares its core with
  another thread (ONNX Runtime's or torch's pool in the same process, another process) stalls
  every parallel kernel launch until the OS moves the other thread: issue #37 measured a small
  decoder at 100x its time in 1 of 6 processes that also ran an ONNX Runtime session, and 0 of
  8 with binding off. ONNX Runtime and torch (OpenMP) do not pin by default either.
- ``TVM_THREAD_POOL_SPIN_COUNT``: left to TVM (its workers spin about 250 ms after a run;
  benchmarks pause between engines for it, see :func:`tvm_fusion.build.engine.time_interleaved`).

Kernels with little work do not use the pool at all: the pipeline's ``SerialSmallKernels``
(:mod:`tvm_fusion.schedule.serial_small_kernels`) runs them on the calling thread, chosen at
run time where extents are symbolic. A parallel launch costs the caller a wait for each worker;
beside busy threads of another runtime that wait is an OS time slice (issue #37: a small
dynamic LSTM export at 739x its quiet time beside a busy torch thread before the pass, 1.3x
after). A larger model still launches its larger kernels; with busy neighbours on every core,
``TVM_NUM_THREADS=1`` avoids the pool (README, "Beside other runtimes").

:func:`threads` is the count that the pool has (or will have) and that the other engines of a
benchmark are given, so that every engine runs on as many threads.
"""

from __future__ import annotations

import os


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def defaults() -> dict[str, str]:
    """The variables :func:`configure` sets when they are unset, with their values."""
    return {"TVM_NUM_THREADS": str(_cpu_count()), "TVM_BIND_THREADS": "0"}


def configure() -> None:
    """Set the pool's variables that the user left unset (never overrides one that is set)."""
    for name, value in defaults().items():
        os.environ.setdefault(name, value)


def threads() -> int:
    """Threads of TVM's pool: ``TVM_NUM_THREADS`` when it is a positive integer, else the
    cores this process may use."""
    text = os.environ.get("TVM_NUM_THREADS", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else _cpu_count()
