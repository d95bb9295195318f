"""Work-arounds for apache-tvm 0.27 bugs that users of the pipeline would hit.

Each belongs upstream; each is applied once, on ``import tvm_fusion``, and changes nothing for
inputs that already work.

- ``tvm.compile(mod, {"kind": "llvm"}, relax_pipeline="NAME")`` raises ``TypeError: argument of
  type 'builtin_function_or_method' is not iterable``: ``relax.build`` turns a ``str`` target into
  a ``Target`` but not a ``dict``, then reads ``target.keys`` (the dict's method). Upstream fix:
  ``if isinstance(target, (str, dict)): target = Target(target)`` in ``relax/vm_build.py``.
"""

from __future__ import annotations

import functools

import tvm
from tvm import relax

_APPLIED = False


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True
    original = relax.build

    @functools.wraps(original)
    def build(mod, target=None, *args, **kwargs):
        if isinstance(target, dict):
            target = tvm.target.Target(target)
        return original(mod, target, *args, **kwargs)

    relax.build = build
