"""What both differential fuzzers share: the families' kinds, the outcomes of a case, the sizes
dynamic dims are fed at, drawing a family's case from a seed, the comparison of outputs with a
reference, and compiling and running a Relax module on the host.

The ONNX side (:mod:`.onnx_frontend`) and the torch.export side (:mod:`.torch_frontend`) both
import this module; it imports neither.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# the kinds of graph both fuzzers build (the ONNX fuzzer's families; torch adds its own)
FAMILIES = ("gates", "gemms", "range_gather", "views", "cross_entropy", "shape_chains")
OUTCOMES = ("ok", "refused", "discarded", "failure", "crash", "hang")
FAILING = ("failure", "crash", "hang")
RTOL = 1e-4
ATOL = 1e-4  # times the largest magnitude of the reference output (at least 1)
# sizes: odd ones, primes and 1
SIZES = (1, 2, 3, 5, 6, 7, 8, 11, 13, 16, 17, 31)
MCPU_ENV = "TVM_FUSION_FUZZ_MCPU"  # the CPU the cases are built for (default: this host's)


class InvalidCase(Exception):
    """The generator drew parameters that give no valid graph: draw again."""


def family_builders(scope: dict, families=FAMILIES) -> dict[str, Callable]:
    """The builder of each of ``families`` in a fuzzer module: ``scope["_" + family]`` (its
    globals)."""
    return {family: scope[f"_{family}"] for family in families}


def draw(
    builders: dict[str, Callable], family: str, seed: int, stream=0, before=None, what="graph"
):
    """``builders[family](rng)`` for ``seed``, deterministic: the generator is seeded by
    ``(stream + the family's index in builders, seed)`` and the builder called again (at most
    100 times) while it raises :class:`InvalidCase`; ``before()`` runs before each call."""
    if family not in builders:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(builders)}")
    rng = np.random.default_rng([stream + list(builders).index(family), seed])
    for _ in range(100):
        if before is not None:
            before()
        try:
            return builders[family](rng)
        except InvalidCase:
            continue
    raise RuntimeError(f"{family} seed {seed}: no valid {what} in 100 draws")


def compare(outputs, reference, ref_name: str = "ORT") -> str | None:
    """None when ``outputs`` match ``reference`` (from ``ref_name``), else why not (one line)."""
    if len(outputs) != len(reference):
        return f"{len(outputs)} outputs, {ref_name} has {len(reference)}"
    for i, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
        out, ref = np.asarray(out), np.asarray(ref)
        if out.shape != ref.shape:
            return f"output {i}: shape {out.shape}, {ref_name} {ref.shape}"
        if out.dtype != ref.dtype:
            return f"output {i}: dtype {out.dtype}, {ref_name} {ref.dtype}"
        if not out.size:
            continue
        if np.issubdtype(ref.dtype, np.integer) or ref.dtype == np.bool_:
            if not np.array_equal(out, ref):
                return f"output {i}: {int((out != ref).sum())} of {ref.size} integers differ"
            continue
        finite = np.isfinite(ref)
        scale = max(1.0, float(np.abs(ref[finite]).max()) if finite.any() else 1.0)
        if not np.allclose(out, ref, rtol=RTOL, atol=ATOL * scale, equal_nan=True):
            err = np.abs(out.astype("float64") - ref)
            return f"output {i}: max abs error {np.nanmax(err):.3g} (scale {scale:.3g})"
    return None


def fuzz_target():
    """The target the fuzzers build for: :func:`~tvm_fusion.target.host_target`, or that
    built for the CPU named by ``MCPU_ENV`` (``scripts/fuzz.py --mcpu znver3``: AVX2 code,
    which runs on an AVX-512 host), refused in one line where it cannot run here."""
    import os

    from ...target import check_runs_here, host_target, with_mcpu

    target = with_mcpu(host_target(), os.environ.get(MCPU_ENV) or None)
    check_runs_here(target)
    return target


def _run_tvm(mod, pipeline: str, feeds) -> list[list[np.ndarray]]:
    import tvm

    from ...build import engine

    compiled = engine.compile_module(mod, fuzz_target(), pipeline)
    vm = compiled.vm()
    results = []
    for feed in feeds:
        args = [tvm.runtime.tensor(a, tvm.cpu()) for a in feed.values()]
        results.append(engine.as_list(vm["main"](*args)))
    return results
