"""User-facing errors: each carries one line that says what is wrong and what to do."""

from __future__ import annotations


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
    # TVM errors put the message last, after a traceback of C++ frames.
    for line in reversed(lines):
        if not line.startswith(("File ", "at ", "  ", "^", "Traceback", "[bt]")):
            return line
    return lines[-1]
