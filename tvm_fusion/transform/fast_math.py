"""Fast approximations of exp/erf/tanh for CPU kernels (stock ``FastMathTransform``)."""

from __future__ import annotations

import tvm
from tvm import relax


def fast_math_passes() -> list[tvm.transform.Pass]:
    return [relax.transform.FastMathTransform()]
