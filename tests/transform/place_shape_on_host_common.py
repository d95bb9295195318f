"""What the PlaceShapeOnHost tests share: the CUDA target their builds are inspected on, and
the Before/Expected base that runs the pass on llvm."""

import tvm
from helpers import Base

from tvm_fusion.transform import PlaceShapeOnHost

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")


class ShapeBase(Base):
    transform = PlaceShapeOnHost(tvm.target.Target("llvm"))
