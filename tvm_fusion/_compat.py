"""Work-arounds for apache-tvm 0.27 bugs that users of the pipeline would hit.

Each belongs upstream; each is applied once, on ``import tvm_fusion``, and changes nothing for
inputs that already work.

- ``tvm.compile(mod, {"kind": "llvm"}, relax_pipeline="NAME")`` raises ``TypeError: argument of
  type 'builtin_function_or_method' is not iterable``: ``relax.build`` turns a ``str`` target into
  a ``Target`` but not a ``dict``, then reads ``target.keys`` (the dict's method). Upstream fix:
  ``if isinstance(target, (str, dict)): target = Target(target)`` in ``relax/vm_build.py``.
- TVMScript's ``@T.prim_func`` / ``@I.ir_module`` call ``inspect.stack()``, which reads every
  frame's source; for a frame of a file that is not on disk (``<frozen importlib._bootstrap>``
  while importing, ``<string>``) ``inspect.getmodule`` scans every module in ``sys.modules`` on
  each call (with torch loaded, ~2000, and TVM's lazy modules answer ``hasattr`` slowly).
  Importing ``tvm.s_tir.tensor_intrin`` (which every MetaSchedule ``TuneContext`` does) took
  60-75 s of such scans; a CPU attention kernel's parse 1.7 s. Such a frame has no module the
  scan could find (``getmodule`` returns None for it after the scan), so the scan is skipped
  for objects without ``__module__`` / ``__name__`` and a ``<...>`` file name. Upstream fix:
  ``inspect.currentframe().f_back`` instead of ``inspect.stack()`` in the parser's entries.
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
    _skip_module_scan_of_virtual_files()


def _skip_module_scan_of_virtual_files() -> None:
    import inspect

    original = inspect.getmodule

    @functools.wraps(original)
    def getmodule(object, _filename=None):  # noqa: A002 - inspect's own parameter name
        if (
            _filename is not None
            and _filename.startswith("<")
            and not hasattr(object, "__module__")
            and not hasattr(object, "__name__")
        ):
            return None
        return original(object, _filename)

    inspect.getmodule = getmodule
