"""The fuzzers' worker process: :class:`Worker` runs many cases in one subprocess (TVM is
imported once), each written to a directory by ``save`` and read there by the worker's
``loader``, run by its ``runner`` (both ``"module:function"``: the ONNX side's by default,
:mod:`.torch_frontend`'s for torch.export, a probe in tests). When the worker dies or hangs the
case is recorded (``crash`` / ``hang``) and the next case starts a new worker.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .onnx_run import save_case


def _function(spec: str) -> Callable:
    """The function named ``"module:function"``."""
    import importlib

    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _worker_main(
    fd: int,
    runner: str = "tvm_fusion.testing.fuzz.onnx_run:run_case",
    loader: str = "tvm_fusion.testing.fuzz.onnx_run:load_case",
) -> None:
    """Reads case directories from stdin, writes one JSON line per case to ``fd``;
    ``runner`` ("module:function") runs a case (tests swap it) on what ``loader`` reads
    from its directory."""
    import logging

    logging.disable(logging.CRITICAL)
    import tvm_fusion  # noqa: F401  (TVM: imported once, before the first case's clock)
    import tvm_fusion.schedule  # noqa: F401  (imports every target's tensor intrinsics: slow)

    run, load = _function(runner), _function(loader)
    out = os.fdopen(fd, "w", buffering=1)
    out.write('{"ready": true}\n')
    for line in sys.stdin:
        path = line.strip()
        if not path:
            continue
        try:
            outcome, reason = run(*load(Path(path)))
        except Exception as err:  # the harness itself: reported as a failure
            outcome, reason = "failure", f"harness: {type(err).__name__}: {err}"
        out.write(json.dumps({"outcome": outcome, "reason": reason.replace("\n", " ")}) + "\n")


class Worker:
    """A subprocess running many cases; ``run`` restarts it after a crash or a hang.
    ``save(directory, *case)`` writes a case where the worker's ``loader`` reads it."""

    STARTUP_S = 1200.0  # importing TVM on a loaded machine (8 minutes seen at load 9)

    def __init__(
        self,
        timeout_s: float = 120.0,
        threads: int = 1,
        runner: str = "tvm_fusion.testing.fuzz.onnx_run:run_case",
        env: dict | None = None,
        save: Callable | None = None,
        loader: str = "tvm_fusion.testing.fuzz.onnx_run:load_case",
    ):
        self.timeout_s = timeout_s
        self.runner = runner
        self.loader = loader
        self.save = save or save_case
        self.extra_env = env or {}
        self.threads = threads
        self.proc: subprocess.Popen | None = None
        self.rfd: int | None = None
        self._buf = b""
        self.tmp = Path(tempfile.mkdtemp(prefix="tvm_fusion_fuzz_"))
        self._n = 0

    def _start(self) -> None:
        rfd, wfd = os.pipe()
        env = dict(os.environ, TVM_NUM_THREADS=str(self.threads), **self.extra_env)
        code = (
            "import tvm_fusion.testing.fuzz.worker as f; "
            f"f._worker_main({wfd}, {self.runner!r}, {self.loader!r})"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(wfd,),
            env=env,
            cwd=os.getcwd(),
        )
        os.close(wfd)
        self.rfd, self._buf = rfd, b""

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        if self.rfd is not None:
            os.close(self.rfd)
            self.rfd = None

    def close(self) -> None:
        self.stop()
        import shutil

        shutil.rmtree(self.tmp, ignore_errors=True)

    def _read_line(self, timeout_s: float) -> bytes | None:
        """The worker's next line; None past ``timeout_s``, b"" when it died."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.rfd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self.rfd, 65536)
                if not chunk:
                    return b""
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def run(self, *case) -> tuple[str, str]:
        """(outcome, reason) of one case (``model, feeds`` for ONNX), in the worker."""
        self._n += 1
        case_dir = self.save(self.tmp / f"case{self._n % 4}", *case)
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self._start()
            if not self._read_line(self.STARTUP_S):  # imports done
                self.stop()
                raise RuntimeError("the fuzz worker did not start")
        try:
            self.proc.stdin.write(f"{case_dir}\n".encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.stop()
            return "crash", "worker died before reading the case"
        line = self._read_line(self.timeout_s)
        if line is None:
            self.stop()
            return "hang", f"no result in {self.timeout_s:.0f} s"
        if not line:
            code = self.proc.wait()
            self.stop()
            return "crash", f"worker died (exit status {code})"
        result = json.loads(line)
        return result["outcome"], result["reason"]
