"""Differential fuzzer, torch.export side: random small ``torch.nn.Module`` graphs of the
patterns our passes rewrite, exported and compiled by us, against torch eager.

Each case is a module built here from a family and a seed (weights from ``torch.manual_seed``),
its inputs' dims either static or dynamic (``torch.export.Dim.DYNAMIC``, or a named ``Dim``
where another input's dim is derived from it, ``2 * s``), and a drawn import: with torch's
decompositions (``from_exported_program``'s default, what :func:`tvm_fusion.load_model` does:
``addmm``, ``_unsafe_view``, ``_log_softmax``, ``nll_loss_forward`` ...) or without (``linear``,
``chunk``, ``unbind``, ``cross_entropy_loss`` ... as exported). The worker exports the module
at an example size that no feed uses, picks two feeds whose dynamic sizes the exported program
accepts (sizes from :data:`tvm_fusion.testing.fuzz.SIZES`: odd ones, primes and 1), imports it with
:func:`tvm_fusion.frontend.import_exported_program`, compiles it with the ``tvm_fusion``
pipeline for :func:`tvm_fusion.host_target`, and compares both feeds' outputs with the eager
module's (:func:`tvm_fusion.testing.fuzz.compare`).

Families (:data:`FAMILIES`): the ONNX fuzzer's kinds in torch's spellings (:mod:`.torch_families`)
and ``dtypes`` (:mod:`.torch_dtypes`).

Outcomes as :mod:`tvm_fusion.testing.fuzz`: ``discarded`` when torch itself cannot run or export the
module (or accepts no two feed sizes); ``refused`` when we fail with a one-line error where
stock TVM (``from_exported_program`` without our converters, and its default pipeline) fails
too. Failing cases are not
minimised: ``--seed`` reproduces one, and ``save_failure`` keeps the exported program.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from . import torch_dtypes, torch_families
from .common import FAMILIES as ONNX_FAMILIES
from .common import SIZES, _run_tvm, compare, draw, family_builders
from .torch_spec import EXAMPLE_SIZE, Input, Spec, _size

# the ONNX fuzzer's families, then those of torch only
FAMILIES = (*ONNX_FAMILIES, "dtypes")
RUNNER = "tvm_fusion.testing.fuzz.torch_frontend:run_case"
LOADER = "tvm_fusion.testing.fuzz.torch_frontend:load_case"
DIM_MAX = 64


@dataclasses.dataclass
class TorchCase:
    family: str
    seed: int
    note: str

    @property
    def name(self) -> str:
        return f"{self.family}-{self.seed}"

    @property
    def args(self) -> tuple:
        return (self.family, self.seed)


_BUILDERS = family_builders({**vars(torch_families), **vars(torch_dtypes)}, FAMILIES)


def build(family: str, seed: int) -> Spec:
    """The module of ``family`` for ``seed``: deterministic (weights included)."""
    import torch

    def reseed():
        torch.manual_seed(seed)

    return draw(_BUILDERS, family, seed, stream=100, before=reseed, what="module")


def generate(family: str, seed: int) -> TorchCase:
    spec = build(family, seed)
    note = spec.note + ("" if spec.decompose else ", not decomposed")
    return TorchCase(family, seed, note)


# ---------------------------------------------------------------------------------------------
# running one case (in the worker)


def _dims_of(inputs: list[Input]) -> list[str]:
    names: list[str] = []
    for inp in inputs:
        for d in inp.shape:
            name = d[0] if isinstance(d, tuple) else d
            if isinstance(name, str) and name not in names:
                names.append(name)
    return names


def _arrays(inputs: list[Input], sizes: dict[str, int], rng) -> list[np.ndarray]:
    out = []
    for inp in inputs:
        shape = tuple(_size(d, sizes) for d in inp.shape)
        if inp.kind == "target":
            t = rng.integers(0, inp.classes, size=shape).astype("int64")
            if inp.ignore is not None and t.size > 1:
                t.flat[rng.integers(0, t.size, size=t.size // 3)] = inp.ignore
                if (t == inp.ignore).all():
                    t.flat[0] = (inp.ignore + 1) % inp.classes if inp.ignore >= 0 else 0
            out.append(t)
        elif inp.kind == "int":
            scale = int(inp.scale)
            out.append(rng.integers(-scale, scale + 1, size=shape).astype(inp.dtype))
        elif inp.kind == "mask":
            m = rng.integers(0, 2, size=shape)
            m[..., :1] = 1
            out.append(m.astype(inp.dtype))
        else:
            out.append((rng.standard_normal(shape) * inp.scale).astype(inp.dtype))
    return out


def _dynamic_shapes(inputs: list[Input]):
    import torch

    derived = {d[0] for inp in inputs for d in inp.shape if isinstance(d, tuple)}
    named = {n: torch.export.Dim(n, min=1, max=DIM_MAX) for n in derived}
    shapes = []
    for inp in inputs:
        spec = {}
        for ax, d in enumerate(inp.shape):
            if isinstance(d, tuple):
                spec[ax] = named[d[0]] * d[1]
            elif isinstance(d, str):
                spec[ax] = named.get(d) or torch.export.Dim.DYNAMIC(min=1, max=DIM_MAX)
        shapes.append(spec or None)
    return tuple(shapes)


def _flat(out) -> list[np.ndarray]:
    if isinstance(out, tuple | list):
        return [a for o in out for a in _flat(o)]
    return [out.detach().numpy()]


def prepare(family: str, seed: int):
    """(spec, exported program, feeds, eager outputs per feed) of a case: raises
    ``_Discard`` where torch itself cannot run or export it."""
    import warnings

    import torch

    spec = build(family, seed)
    rng = np.random.default_rng([200 + FAMILIES.index(family), seed])
    dims = _dims_of(spec.inputs)
    example = _arrays(spec.inputs, dict.fromkeys(dims, EXAMPLE_SIZE), rng)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.export.export(
                spec.module,
                tuple(torch.from_numpy(a) for a in example),
                # forward(self, *xs): one argument, a tuple
                dynamic_shapes=(_dynamic_shapes(spec.inputs),) if dims else None,
            )
    except Exception as err:
        raise _Discard(f"torch.export: {_line(err)}") from None
    exported = program.module()
    # candidate sizes per dim, two feeds: the first candidates that torch runs and the
    # exported program's guards accept
    order = {d: [int(v) for v in rng.permutation(SIZES)] for d in dims}
    feeds, refs = [], []
    for j in range(len(SIZES) if dims else 2):
        sizes = {d: order[d][j] for d in dims}
        feed = _arrays(spec.inputs, sizes, rng)
        tensors = [torch.from_numpy(a) for a in feed]
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ref = _flat(spec.module(*tensors))
                exported(*tensors)
        except Exception:
            continue
        feeds.append(feed)
        refs.append(ref)
        if len(feeds) == 2:
            return spec, program, feeds, refs
    raise _Discard("fewer than two feed sizes that torch runs and the export accepts")


class _Discard(Exception):
    pass


def _line(err: BaseException) -> str:
    from ...errors import first_line

    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return lines[0] if lines else first_line(err)


def _run(mod, pipeline: str, feeds) -> list[list[np.ndarray]]:
    return _run_tvm(mod, pipeline, [dict(enumerate(f)) for f in feeds])


def _stock_runs(program, spec: Spec, feeds, refs) -> bool:
    """Whether stock TVM (its importer, without our converters, and pipeline) runs the
    program and matches torch."""
    from tvm.relax.frontend.torch import from_exported_program

    try:
        mod = from_exported_program(program, run_ep_decomposition=spec.decompose)
        outs = _run(mod, "stock", feeds)
    except Exception:
        return False
    return all(compare(o, r, "torch") is None for o, r in zip(outs, refs, strict=True))


def run_case(family: str, seed: int) -> tuple[str, str]:
    """(outcome, one-line reason) of the case ``family``, ``seed``."""
    from ...errors import TvmFusionError, first_line
    from ...frontend.load import import_exported_program

    try:
        spec, program, feeds, refs = prepare(family, seed)
    except _Discard as err:
        return "discarded", str(err)
    try:
        mod = import_exported_program(program, decompose=spec.decompose)
        outs = _run(mod, "tvm_fusion", feeds)
    except TvmFusionError as err:
        if _stock_runs(program, spec, feeds, refs):
            return "failure", f"refused, but stock TVM runs it: {err}"
        return "refused", str(err)
    except Exception as err:
        return "failure", f"{type(err).__name__}: {first_line(err)}"
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        why = compare(out, ref, "torch")
        if why:
            shapes = [a.shape for a in feeds[i]]
            stock = "stock TVM right" if _stock_runs(program, spec, feeds, refs) else "stock not"
            return "failure", f"wrong result on feed {i} {shapes}: {why} ({stock})"
    return "ok", ""


# ---------------------------------------------------------------------------------------------
# the worker's files, failures


def save_case(directory: Path, family: str, seed: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "case.json").write_text(json.dumps({"family": family, "seed": seed}))
    return directory


def load_case(directory: Path) -> tuple[str, int]:
    case = json.loads((directory / "case.json").read_text())
    return case["family"], int(case["seed"])


def save_failure(
    directory: Path, case: TorchCase, outcome: str, reason: str, _worker, _budget_s
) -> dict:
    """``case.json``, ``reason.txt`` and, where torch exports it, ``program.pt2`` and the
    feeds (``inputs.npz``: ``0/0`` is feed 0's first input)."""
    save_case(directory, case.family, case.seed)
    (directory / "reason.txt").write_text(f"{outcome}: {reason}\n{case.note}\n")
    try:
        import torch

        _spec, program, feeds, _refs = prepare(case.family, case.seed)
        torch.export.save(program, str(directory / "program.pt2"))
        np.savez(
            directory / "inputs.npz",
            **{f"{i}/{j}": a for i, feed in enumerate(feeds) for j, a in enumerate(feed)},
        )
    except Exception:  # the seed still reproduces it
        pass
    return {}
