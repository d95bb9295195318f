"""User-facing errors: each carries one line that says what is wrong and what to do."""

from __future__ import annotations

import re

_NAME = re.compile(r'name="([^"]+)"')


def _short_op_reprs(text: str) -> str:
    """``ir.Op(span=None, ty=..., name="relax.log", ...)`` in TVM's messages -> ``relax.log``."""
    while (start := text.find("ir.Op(")) >= 0:
        depth = end = 0
        for end in range(start + len("ir.Op"), len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        name = _NAME.search(text, start, end)
        if depth or name is None:
            return text
        text = text[:start] + name.group(1) + text[end + 1 :]
    return text


class TvmFusionError(Exception):
    """Base class; ``str(err)`` is a single line meant for the user."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class ModelError(TvmFusionError, ValueError):
    """The model cannot be loaded: missing file, corrupt or unsupported ONNX, bad shapes."""


class UsageError(TvmFusionError, ValueError):
    """Bad user input other than a model: unknown target, workload or option."""


def first_line(err: BaseException) -> str:
    """The most informative single line of an exception raised inside TVM or ONNX."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    if not lines:
        return type(err).__name__
    frame = ("File ", "at ", "^", "Traceback", "[bt]")
    # TVM errors put the message last, after a traceback of C++ frames.
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(frame):
            continue
        # a labelled detail ("Offending call:\nR.add(x, y)"): keep the sentence it belongs to
        start = i
        while start > 0 and start > i - 2 and lines[start - 1].endswith(":"):
            start -= 1
        if start < i and start > 0 and not lines[start - 1].startswith(frame):
            start -= 1
        return _short_op_reprs(" ".join(lines[start : i + 1]))
    return lines[-1]
