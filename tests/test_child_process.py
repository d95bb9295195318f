"""helpers.ChildProcess: what the tests that run compiled code in a child rely on."""

import pytest
from helpers import ChildProcess


def test_failure_and_crash_in_the_child_fail_the_caller_only():
    child = ChildProcess()
    try:
        assert child.run("RESULT = int(ARGV[0]) + 1\nassert RESULT == 3", ["2"]) is None
        with pytest.raises(AssertionError, match="wrong"):
            child.run("assert ARGV[0] == 'right', 'wrong'", ["left"])
        with pytest.raises(ChildProcessError):  # a segfault, as compiled code may raise
            child.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", [])
        child.run("import sys\nassert 'tvm' in sys.modules", [])  # started afresh
    finally:
        child.close()
