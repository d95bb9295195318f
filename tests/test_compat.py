"""The work-arounds of ``tvm_fusion._compat`` for apache-tvm 0.27: same answers, less time."""

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
