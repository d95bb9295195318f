"""The work-arounds of ``tvm_fusion._compat`` for apache-tvm 0.27: same answers, less time."""

import importlib
import inspect
import sys

import tvm_fusion  # noqa: F401 - applies the work-arounds


def test_getmodule_of_a_virtual_file_frame_is_none_without_a_scan(monkeypatch):
    """A frame of a file not on disk (``<string>``, ``<frozen ...>``): no module, as stock
    ``inspect`` answers after scanning ``sys.modules``; here without the scan (TVMScript's
    ``inspect.stack()`` made that scan 30 000 times importing ``tvm.s_tir.tensor_intrin``)."""
    frame = eval("sys._getframe()", {"sys": sys})  # a frame whose file is "<string>"
    assert frame.f_code.co_filename == "<string>"
    scanned = []

    class Modules(dict):
        def copy(self):
            scanned.append(True)
            return dict(self)

    monkeypatch.setattr(sys, "modules", Modules(sys.modules))
    assert inspect.getmodule(frame, "<string>") is None
    assert not scanned
    # objects with a module keep stock's answer
    this = test_getmodule_of_a_virtual_file_frame_is_none_without_a_scan
    assert inspect.getmodule(this) is sys.modules[__name__]
    assert inspect.getmodule(inspect.signature) is inspect


def test_tvmscript_entries_read_frames_lazily_with_stock_values(monkeypatch):
    """The TVMScript entries' ``inspect.stack()``: the same frames and fields as stock's, but
    a frame's source line is read only when its field is asked for (stock read all of them:
    ~10 s per pytest process collecting our TVMScript tests)."""
    from tvm.tirx.script.parser import entry

    assert entry.inspect is not inspect  # the entry sees the lazy stack
    stock = inspect.stack()
    lazy = entry.inspect.stack()
    assert len(lazy) == len(stock)
    assert [f.frame for f in lazy] == [f.frame for f in stock]
    # frame 0 is this function, at another line in each call; its callers are where they were
    assert lazy[0].lineno == stock[0].lineno + 1
    for mine, theirs in zip(lazy[1:4], stock[1:4], strict=True):
        assert (mine.filename, mine.lineno, mine.function) == theirs[1:4]
        assert mine.code_context == theirs.code_context and mine.index == theirs.index
        assert tuple(mine) == tuple(theirs)
    assert [f.frame for f in lazy[1:]] == [f.frame for f in stock[1:]]
    read = []
    real = inspect.getframeinfo
    monkeypatch.setattr(inspect, "getframeinfo", lambda *a: read.append(a) or real(*a))
    again, line = entry.inspect.stack(), sys._getframe().f_lineno
    assert again[0].frame is sys._getframe() and not read
    assert again[0].lineno == line and len(read) == 1  # the line when taken, read when asked
    # other functions are inspect's own
    assert entry.inspect.signature is inspect.signature


def test_tvmscript_parses_through_the_lazy_stack(tmp_path, monkeypatch):
    """A ``@T.prim_func`` inside an ``@I.ir_module`` class (``is_defined_in_class`` reads the
    third frame's line), a closure variable, and a string annotation resolved from the
    enclosing scope (PEP 563: ``resolve_closure_vars`` walks the frames)."""
    import tvm
    from tvm.script import ir as I
    from tvm.script import tirx as T

    n = 8

    @I.ir_module
    class Module:
        @T.prim_func
        def main(a: T.Buffer((n,), "float32"), b: T.Buffer((n,), "float32")):
            for i in range(n):
                b[i] = a[i] * T.float32(2)

    assert isinstance(Module["main"], tvm.tirx.PrimFunc)
    assert Module["main"].params[0].name == "a"

    # a file on disk (TVMScript reads its functions' source)
    (tmp_path / "pep563_prim_func.py").write_text(
        "from __future__ import annotations\n"
        "from tvm.script import tirx as T\n"
        "def make():\n"
        "    shape = (4,)\n"
        "    @T.prim_func\n"
        "    def f(a: T.Buffer(shape, 'float32')):\n"
        "        a[0] = T.float32(1)\n"
        "    return f\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    f = importlib.import_module("pep563_prim_func").make()
    assert 'T.Buffer((4,), "float32")' in f.script()
