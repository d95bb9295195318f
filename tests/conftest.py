import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests/helpers.py for every subfolder

import pytest  # noqa: E402

import tvm_fusion  # noqa: E402,F401  (registers the pipeline)


@pytest.fixture(scope="session")
def target():
    return tvm_fusion.host_target()


@pytest.fixture(scope="module")
def child():
    """One :class:`helpers.ChildProcess` per test module: compiled code that may crash runs
    there, so that a crash fails its test instead of ending pytest."""
    from helpers import ChildProcess

    proc = ChildProcess()
    yield proc
    proc.close()
