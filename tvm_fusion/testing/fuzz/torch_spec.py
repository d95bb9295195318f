"""What the torch.export fuzzer's families build: a :class:`Spec` (the module, its
:class:`Input` s, how it is imported) and the helpers that draw dims and make modules and
parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .common import SIZES

# the size dynamic dims are exported at: none of SIZES, so no feed is the traced size and no
# static size of the graph equals it by chance (torch would tie the two)
EXAMPLE_SIZE = 10


@dataclasses.dataclass
class Input:
    """A graph input: dims are ints (static), names (dynamic) or (name, factor) (derived);
    ``kind`` float (standard normal times ``scale``, in ``dtype``), target (int64 classes, some
    set to ``ignore``), int (integers in [-scale, scale], in ``dtype``) or mask (0 / 1 in
    ``dtype``, each row's first 1)."""

    shape: list
    kind: str = "float"
    scale: float = 1.0
    classes: int = 0
    ignore: int | None = None
    dtype: str = "float32"


@dataclasses.dataclass
class Spec:
    """What a family builds: the module, its inputs and how the case imports."""

    module: object  # torch.nn.Module
    inputs: list[Input]
    note: str
    decompose: bool = True


def _choice(rng, items):
    return items[int(rng.integers(len(items)))]


def _dim(rng, name: str, static_p: float = 0.4, lo: int = 1):
    """A static size or the name of a dynamic dim."""
    if rng.random() < static_p:
        return int(_choice(rng, [s for s in SIZES if s >= lo]))
    return name


def _size(d, sizes: dict[str, int]) -> int:
    if isinstance(d, int):
        return d
    if isinstance(d, tuple):
        return sizes[d[0]] * d[1]
    return sizes[d]


def _act(name: str):
    import torch
    import torch.nn.functional as F

    return {
        "sigmoid": torch.sigmoid,
        "tanh": torch.tanh,
        "relu": torch.relu,
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "square": lambda t: t * t,
        "neg": torch.neg,
        "identity": lambda t: t,
    }[name]


ACTS = ("sigmoid", "tanh", "relu", "silu", "gelu", "gelu_tanh", "square", "identity")


def _module(forward: Callable, **children):
    """An ``nn.Module`` whose ``forward(self, *xs)`` is ``forward``, with ``children``
    (modules or parameters) as attributes."""
    import torch

    class Fuzz(torch.nn.Module):
        def forward(self, *xs):
            return forward(self, *xs)

    m = Fuzz()
    for name, child in children.items():
        setattr(m, name, child)
    return m.eval()


def _param(*shape, scale: float = 1.0):
    import torch

    return torch.nn.Parameter(torch.randn(*shape) * scale, requires_grad=False)
