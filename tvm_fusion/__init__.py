"""tvm-fusion: graph-level fusion passes for Apache TVM's Relax IR.

Importing this package registers the Relax pipeline ``"tvm_fusion"``::

    import tvm, tvm_fusion
    ex = tvm.compile(mod, tvm_fusion.host_target(), relax_pipeline="tvm_fusion")
"""

from __future__ import annotations

import sys as _sys

from . import pool as _pool

# TVM's thread pool: threads and binding, before anything starts it; a user's settings win.
_pool.configure()

from . import _compat  # noqa: E402
from .build.pipeline import (  # noqa: E402
    build_pipeline,
    fusion_passes,
    post_fusion_passes,
    stock_pipeline,
)
from .build.pipeline import register as _register_pipeline  # noqa: E402
from .errors import ModelError, TvmFusionError, UsageError  # noqa: E402
from .frontend import load_exported_program, load_model, load_onnx  # noqa: E402
from .lower import gradients  # noqa: E402
from .target import host_target, parse_target  # noqa: E402
from .tools import analysis  # noqa: E402

# ``tvm_fusion.analysis`` is public (README): ``import tvm_fusion.analysis`` and
# ``from tvm_fusion.analysis import fusion_report`` find the module that lives in tools/.
_sys.modules[f"{__name__}.analysis"] = analysis

_compat.apply()
gradients.register()
_register_pipeline()

__version__ = "0.1.0"

__all__ = [
    "ModelError",
    "TvmFusionError",
    "UsageError",
    "analysis",
    "load_exported_program",
    "load_model",
    "build_pipeline",
    "fusion_passes",
    "host_target",
    "load_onnx",
    "parse_target",
    "post_fusion_passes",
    "stock_pipeline",
]
