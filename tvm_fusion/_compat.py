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
- Even with that, ``inspect.stack()`` reads the source line of every frame on the stack, and
  the parser's entries use at most the third one's (``is_defined_in_class``) and the frames
  themselves (``resolve_closure_vars``). Under pytest (stacks of 60-80 frames) collecting our
  tests spent ~10 s per process there, most of it in ``findsource``. The entries (and the
  macro lookup's ``getouterframes``) get a list of the same frames whose ``FrameInfo`` fields
  are read on first use (``_LazyFrameInfo``); same values, each computed only when asked for.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types

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
    _lazy_stacks_in_tvmscript_entries()


def _skip_module_scan_of_virtual_files() -> None:
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


class _LazyFrameInfo:
    """``inspect.FrameInfo`` of ``frame`` as it stood when taken: ``frame`` at once, the other
    fields (its source line among them) from ``inspect.getframeinfo`` when first read, at the
    line and instruction the frame was at when taken (a traceback entry holds those)."""

    __slots__ = ("frame", "_lasti", "_lineno", "_info")

    def __init__(self, frame):
        self.frame = frame
        self._lasti = frame.f_lasti
        self._lineno = frame.f_lineno
        self._info = None

    def _traceback(self):
        if self._info is None:
            taken = types.TracebackType(None, self.frame, self._lasti, self._lineno)
            self._info = inspect.getframeinfo(taken, 1)
        return self._info

    def __getattr__(self, name):
        return getattr(self._traceback(), name)

    def __getitem__(self, index):  # the tuple view: (frame, filename, lineno, ...)
        return tuple(self)[index]

    def __iter__(self):
        return iter((self.frame,) + tuple(self._traceback()))


def _frames_outwards(frame) -> list[_LazyFrameInfo]:
    """What ``inspect.getouterframes(frame)`` returns, each entry a :class:`_LazyFrameInfo`."""
    frames = []
    while frame is not None:
        frames.append(_LazyFrameInfo(frame))
        frame = frame.f_back
    return frames


class _InspectWithLazyStacks:
    """The ``inspect`` module as the TVMScript entries see it: ``stack()`` and
    ``getouterframes()`` (context 1, what they use) lazy, everything else ``inspect``'s."""

    def __getattr__(self, name):
        return getattr(inspect, name)

    @staticmethod
    def stack(context=1):
        if context != 1:
            return inspect.getouterframes(sys._getframe(1), context)
        return _frames_outwards(sys._getframe(1))

    @staticmethod
    def getouterframes(frame, context=1):
        if context != 1:
            return inspect.getouterframes(frame, context)
        return _frames_outwards(frame)


# the modules whose ``inspect.stack()`` / ``getouterframes`` are replaced: TVMScript's
# @I.ir_module, @T.prim_func, @R.function entries and T.macro's lookup
_STACK_USERS = (
    "tvm.script.parser.ir.entry",
    "tvm.tirx.script.parser.entry",
    "tvm.relax.script.parser.entry",
    "tvm.script.parser.core.parser",
)


def _lazy_stacks_in_tvmscript_entries() -> None:
    proxy = _InspectWithLazyStacks()
    for name in _STACK_USERS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "inspect", None) is inspect:
            module.inspect = proxy
