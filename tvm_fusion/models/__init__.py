"""Embedded workloads: the one source for demo, bench, tests and tutorials.

Each workload is built in code at two sizes: ``"seed"`` (the shapes of the public thread it
comes from, for benchmarks) and ``"small"`` (for tests). ``dynamic=True`` makes the batch-like
axes symbolic. A built :class:`Instance` carries the Relax module (weights bound as constants),
its inputs, a NumPy reference, and the same computation for the peers: an ONNX model for ONNX
Runtime and a PyTorch function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import tvm

from ..errors import UsageError

SIZES = ("seed", "small")


@dataclasses.dataclass
class Instance:
    """One workload at one size."""

    name: str
    mod: tvm.IRModule
    inputs: dict[str, np.ndarray]  # in the order of main's parameters
    reference: Callable[..., list[np.ndarray]]  # NumPy, same inputs, returns every output
    onnx_model: object | None = None  # onnx.ModelProto with the same input names
    torch_fn: Callable | None = None  # takes torch tensors (same order), returns a tuple
    rtol: float = 1e-4
    atol: float = 1e-4
    # Which pass this workload exercises, and what it should do (shown by demo and bench).
    expect: str = ""
    # Engines that are not run at this size, with the reason (shown instead of a time).
    skip: dict[str, str] = dataclasses.field(default_factory=dict)

    def input_list(self) -> list[np.ndarray]:
        return list(self.inputs.values())


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    capability: str  # gate | cross_entropy | gather_to_slice | views | shape
    summary: str
    build: Callable[..., Instance]  # build(size="seed", dynamic=False) -> Instance


_REGISTRY: dict[str, Workload] = {}


def register(name: str, capability: str, summary: str):
    def decorator(fn: Callable[..., Instance]) -> Callable[..., Instance]:
        _REGISTRY[name] = Workload(name, capability, summary, fn)
        return fn

    return decorator


def names() -> list[str]:
    _load()
    return list(_REGISTRY)


def get(name: str) -> Workload:
    _load()
    if name not in _REGISTRY:
        raise UsageError(f"unknown workload {name!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def build(name: str, size: str = "seed", dynamic: bool = False) -> Instance:
    if size not in SIZES:
        raise UsageError(f"unknown size {size!r}; known: {', '.join(SIZES)}")
    return get(name).build(size=size, dynamic=dynamic)


def _load() -> None:
    # Importing the modules registers their workloads, in this (display) order.
    from . import cross_entropy, dynamic_shape, gates, take_arange, views  # noqa: F401
