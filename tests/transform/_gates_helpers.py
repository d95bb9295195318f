"""Shared by the tests/transform/test_fuse_split_gates*.py files: the CUDA target of the
structural cases and their Before/Expected base class."""

import tvm
from helpers import Base

from tvm_fusion.transform import FuseSplitGates

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


class GatesBase(Base):
    transform = FuseSplitGates(CUDA)
